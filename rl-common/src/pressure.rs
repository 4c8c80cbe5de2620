//! Holding limits when there are more sources than buckets.
//!
//! Buckets live in non-evicting hash maps: a bucket is never forgotten while
//! its state differs from a fresh one. A key that finds no bucket of its own
//! is charged to the bucket it *maps to*: its prefix cell (the key masked to
//! `flood_prefix`, marked [`KEY_CELL`], kept in the cell arrays of
//! [`crate::cells`]), or, when there is none, its rule's last resort (one
//! per rule and limit, [`KEY_LAST`], in the sources' table). Whenever a
//! finer bucket is created (a source's own, or a prefix cell), it starts as a
//! copy of the bucket the key mapped to until then, never fuller; and the
//! daemon deletes only buckets that are [`fresh`](crate::LimitEntry::is_fresh)
//! (their state is that of a new bucket, so forgetting them changes nothing).
//!
//! Together these keep one invariant for every key `k` and every limit: the
//! bucket `k` maps to never holds more than the bucket `k` would have if it
//! had been kept alone for ever. So `k` passes only packets its own bucket
//! would have passed (the README's guarantees (a) and (b)), however many
//! other keys arrive, and a flood can only ever make newcomers share, never
//! hand anybody a fresh allowance.
//!
//! Wide cells (a flood over more prefixes than cells stay cached for):
//! once a rule holds cells in a quarter of its family's cell slots
//! ([`crate::cells_wide`]), a key of that rule charged in flood mode whose
//! wide cell (its prefix 8 bits shorter, IPv6 16, marked [`KEY_WIDE`])
//! does not exist makes that wide cell instead of a cell of its own
//! prefix; and while the rule has any wide cell (its count in
//! [`crate::MAP_WIDE_COUNT`] is not 0), each of its unseen keys looks for
//! its wide cell first and, if it is there, maps to it. A wide cell starts
//! *drained* ([`crate::LimitEntry::drained`]): it holds nothing at its
//! making, so it holds no more than any key's own bucket then, whatever
//! that key was charged before (to its cell, its rule's last resort, or
//! another wide cell); from then on it takes every charge of the keys that
//! map to it, so the invariant holds for them. A key stops mapping to it
//! only when it is freed, fresh: its keys' own buckets are then full too,
//! so whatever they map to next holds no more. A key whose wide cell is
//! being made or freed (busy) maps to its cell or last resort as before.
//! So the switch to wide cells and back needs no coordination with the
//! daemon; the count only has to be 0 never while a wide cell exists (the
//! program adds one before it claims a slot, the collector counts after
//! each walk as for own buckets). A charge that races the making of a wide
//! cell on another CPU, within the same microseconds, may miss it, as one
//! may miss a new cell's copy of the last resort.
//!
//! Flood mode (Katran's `is_under_flood`): a CPU that sees more than its
//! share of `flood_new_keys_per_sec` unseen keys in a window stops creating
//! per-source buckets for the rest of that window and the next, and charges
//! unseen keys straight to their prefix cells: a lookup instead of an insert.

/// Per-CPU flood detector (`PerCpuArray<FloodState>`, one entry).
pub const MAP_FLOOD: &str = "RL_FLOOD";

/// Sources' own buckets per family, and their cap (`Array<u64>`,
/// mappable): entries [`OWNED_V4`] and [`OWNED_V6`] count the own buckets
/// (the program adds one per insert; the collector sets the count right
/// after each walk), [`OWNED_CAP`] is `datapath.max_sources`, written by
/// the daemon at load (0: no cap but the table's size). The program makes
/// no own bucket while its family's count is at the cap, so the rest of
/// the table (`LAST_RESORT_ROOM` and more) stays free for the rules' last
/// resorts, which are made the first time a rule needs one.
pub const MAP_OWNED: &str = "RL_OWNED";
/// [`MAP_OWNED`]'s entries.
pub const OWNED_V4: u32 = 0;
pub const OWNED_V6: u32 = 1;
pub const OWNED_CAP: u32 = 2;
pub const OWNED_ENTRIES: u32 = 3;

/// Whether a family holding `owned` own buckets may make another under
/// `cap` (0: no cap).
#[inline(always)]
pub const fn owned_room(owned: u64, cap: u64) -> bool {
    cap == 0 || owned < cap
}

/// Rule ids leave these bits free: bucket keys use them to mark the
/// fallbacks (last resorts share the sources' table; cells have arrays of
/// their own but keep the bit, which names them to the cluster sync). The
/// low 3 bits are the limit index.
pub const RULE_ID_MASK: u32 = 0x3fff_fff8;
/// `Key4::rule` / `Key6::rule` bit of a prefix cell: the key's address is
/// masked to `flood_prefix_v4` / `flood_prefix_v6`.
pub const KEY_CELL: u32 = 1 << 31;
/// `Key4::rule` / `Key6::rule` bit of a rule's last resort (address 0).
pub const KEY_LAST: u32 = 1 << 30;
/// `Key4::rule` / `Key6::rule` bits of a wide cell (both bits: a cell, in
/// the cell arrays): the key's address is masked to the wide prefix
/// (`crate::cells::wide_mask4`), 8 bits (IPv6: 16) shorter than a cell's.
pub const KEY_WIDE: u32 = KEY_CELL | KEY_LAST;

/// The limit a bucket key's `rule` names (`RuleEntry::id | index`): its
/// key-kind bits cleared.
#[inline(always)]
pub const fn limit_of_key(rule: u32) -> u32 {
    rule & !(KEY_CELL | KEY_LAST)
}

/// What kind of bucket a key names (a wide cell is a cell).
pub fn key_kind(rule: u32) -> KeyKind {
    if rule & KEY_CELL != 0 {
        KeyKind::Cell
    } else if rule & KEY_LAST != 0 {
        KeyKind::LastResort
    } else {
        KeyKind::Own
    }
}

/// Whether a cell key is a wide cell's.
#[inline(always)]
pub const fn is_wide(rule: u32) -> bool {
    rule & KEY_WIDE == KEY_WIDE
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Own,
    Cell,
    LastResort,
}

/// Log₂ of the flood window in ns: about 67 ms. The detector measures the
/// rate of unseen keys over windows this short so that a flood trips it
/// after a few thousand new buckets per CPU, not tens of thousands: each is
/// a junk bucket the collector must later find, and costs an insert.
pub const FLOOD_WINDOW_SHIFT: u32 = 26;

/// One CPU's count of keys it found no bucket for (each packet of such a
/// key counts: the program keeps nothing of a key it makes no bucket for).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloodState {
    /// The current window (`ns >> FLOOD_WINDOW_SHIFT`).
    pub window: u64,
    /// Unseen keys in the current window.
    pub unseen: u64,
    /// Unseen keys in the window before it (0 if it was not the previous one).
    pub prev_unseen: u64,
    /// The window in which a bucket insert (a source's own) last failed
    /// because the table was full;
    /// no more inserts are tried until the next window.
    pub full_window: u64,
    /// The clock (ns) of the last unseen key in flood mode (charged to a
    /// fallback, or offered a bucket): the daemon reports flood mode while
    /// this is recent on some CPU.
    pub last_flood_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FloodState>() == 40);

/// What to do with a key that has no bucket of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unseen {
    /// Create its bucket.
    Insert,
    /// Charge it to the bucket it maps to (flood mode, or the table is full).
    Fallback,
    /// Flood mode, but create its bucket if the table is less than half
    /// full, else charge it as [`Unseen::Fallback`] (one key a window and
    /// CPU: see [`FloodState::see`]).
    Offered,
}

impl FloodState {
    /// Counts one unseen key at `now_ns` against `cap` unseen keys per CPU
    /// and window (`u32::MAX` never floods; 0 always does).
    #[inline(always)]
    pub fn see(&mut self, now_ns: u64, cap: u32) -> Unseen {
        let w = now_ns >> FLOOD_WINDOW_SHIFT;
        if self.window != w {
            self.prev_unseen = if self.window.wrapping_add(1) == w {
                self.unseen
            } else {
                0
            };
            self.unseen = 0;
            self.window = w;
        }
        self.unseen += 1;
        let cap = cap as u64;
        if self.unseen > cap || self.prev_unseen > cap {
            self.last_flood_ns = now_ns;
            // The key just past a window's share is still offered a bucket
            // of its own (one a window): the count is of packets (a key
            // without a bucket is unseen at each), so a source first seen
            // in flood mode that keeps sending faster than the share would
            // otherwise hold its CPU in flood mode for good, the flood
            // long over. Once the flood is over, that source is the one,
            // and flood mode ends. (0 means flood mode always: none.)
            if self.unseen == cap + 1 && cap != 0 && self.may_insert(now_ns) {
                return Unseen::Offered;
            }
            return Unseen::Fallback;
        }
        if !self.may_insert(now_ns) {
            return Unseen::Fallback;
        }
        Unseen::Insert
    }

    /// Whether an insert may be tried now: the table was not found full in
    /// this window.
    #[inline(always)]
    pub fn may_insert(&self, now_ns: u64) -> bool {
        // +1 so that the zeroed state means "never full".
        self.full_window != (now_ns >> FLOOD_WINDOW_SHIFT).wrapping_add(1)
    }

    /// An insert at `now_ns` failed: the table is full for this window.
    #[inline(always)]
    pub fn table_full(&mut self, now_ns: u64) {
        self.full_window = (now_ns >> FLOOD_WINDOW_SHIFT).wrapping_add(1);
    }

    /// Whether this CPU charged a key to a fallback in flood mode within
    /// the last `within_ns` before `now_ns`.
    pub fn flooding(&self, now_ns: u64, within_ns: u64) -> bool {
        self.last_flood_ns != 0 && now_ns.saturating_sub(self.last_flood_ns) <= within_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 1 << FLOOD_WINDOW_SHIFT;

    #[test]
    fn flood_mode_starts_above_the_cap_and_lasts_one_more_window() {
        let mut s = FloodState::default();
        let t = 100 * W;
        for _ in 0..10 {
            assert_eq!(s.see(t, 10), Unseen::Insert);
        }
        assert_eq!(
            s.see(t + 1, 10),
            Unseen::Offered,
            "the 11th unseen key in a window: flood mode, offered a bucket"
        );
        assert_eq!(s.see(t + 1, 10), Unseen::Fallback, "the 12th");
        assert!(s.flooding(t + 2, W));
        // The next window still remembers the flood.
        assert_eq!(s.see(t + W, 10), Unseen::Fallback);
        // Two windows later with a quiet window in between: calm again.
        let mut quiet = s;
        assert_eq!(quiet.see(t + 3 * W, 10), Unseen::Insert);
        assert!(!quiet.flooding(t + 3 * W + W + 1, W));
    }

    /// A source first seen in flood mode that keeps sending faster than the
    /// share once the flood is over: the first packet past the share in a
    /// window is offered a bucket, and with the source out of the count
    /// flood mode ends two windows later. A spoofed flood is offered one
    /// a window, whatever the share.
    #[test]
    fn a_source_that_keeps_sending_after_a_flood_is_offered_a_bucket_and_flood_mode_ends() {
        for cap in [1u32, 10, 100, 5000] {
            let mut s = FloodState::default();
            let t = 100 * W;
            let (mut inserts, mut offers) = (0u32, 0u32);
            for i in 0..100_000 {
                match s.see(t + i, cap) {
                    Unseen::Insert => inserts += 1,
                    Unseen::Offered => offers += 1,
                    Unseen::Fallback => {}
                }
            }
            assert_eq!(
                (inserts, offers),
                (cap, 1),
                "the share, then one offered (share {cap})"
            );
            // The next window: one source, over the share.
            let first =
                (1..=u64::from(cap) + 1).find(|&i| s.see(t + W + i, cap) == Unseen::Offered);
            assert_eq!(
                first,
                Some(u64::from(cap) + 1),
                "its packet past the share is offered a bucket (share {cap})"
            );
            // It is no longer unseen: nothing is counted in the window after.
            assert_eq!(
                s.see(t + 3 * W, cap),
                Unseen::Insert,
                "two windows on, calm (share {cap})"
            );
            assert!(!s.flooding(t + 3 * W + W + 1, W));
        }
        // A full table, and flood mode always (0), offer none.
        let mut full = FloodState::default();
        full.table_full(W);
        assert!((0..1_000).all(|i| full.see(W + i, 10) == Unseen::Fallback));
        let mut always = FloodState::default();
        assert!((0..1_000).all(|i| always.see(W + i, 0) == Unseen::Fallback));
    }

    #[test]
    fn a_full_table_stops_inserts_until_the_next_window() {
        let mut s = FloodState::default();
        let t = 7 * W + 5;
        assert_eq!(s.see(t, u32::MAX), Unseen::Insert);
        s.table_full(t);
        assert_eq!(s.see(t + 1, u32::MAX), Unseen::Fallback);
        assert_eq!(s.see(8 * W, u32::MAX), Unseen::Insert);
    }

    #[test]
    fn cap_zero_always_falls_back_and_max_never_does() {
        let mut s = FloodState::default();
        assert_eq!(s.see(W, 0), Unseen::Fallback);
        let mut s = FloodState::default();
        for i in 0..10_000 {
            assert_eq!(s.see(W + i, u32::MAX), Unseen::Insert);
        }
    }
}
