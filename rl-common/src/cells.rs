//! Prefix cells: where an unseen key is charged when it gets no bucket of
//! its own (see [`crate::pressure`]), kept in a fixed array per family
//! rather than in the sources' hash table.
//!
//! A random-source flood charges every packet to some cell, so the cell's
//! lookup is the flood's per-packet cost, and the cells' memory is what
//! such a flood keeps out of the CPU's cache. So a cell's hot part is 16
//! bytes: a claim word and the bucket's state word ([`Cell`]), the two
//! ways of a set in one half of a cache line. What only the daemon reads
//! (the cell key) and the counts that only cluster rules need live in a
//! second array, slot for slot ([`CellKey`]), touched when a cell is made
//! and, for a rule with `scope = "cluster"`, when it is charged. (64-byte
//! cells, key and counts in the line, cost 1.24× a bare `XDP_PASS` per
//! frame of a flood over 65,536 /24s on the veth bench; 32-byte ones
//! 1.18×; these 1.13–1.17×, measured side by side.)
//!
//! The array is set-associative: a cell key may sit in either of the
//! [`CELL_WAYS`] slots of its set. The claim word names the key by its
//! hash ([`cell_claim`]: 62 bits of `KnownKey::cell_hash`, keyed by the
//! datapath's secret seed, so two keys share a cell, and its state word,
//! with odds of 2⁻⁶² per pair, and no one can pick such keys) and tells
//! the slot's state:
//!
//! | claim word | meaning | a program run |
//! | --- | --- | --- |
//! | `c = cell_claim(key, seed)` | the key's cell | charges it |
//! | `cell_writing(c)` | being claimed: its state not written yet | charges the parent, claims nothing |
//! | `cell_dying(c)` | the key's cell, being freed | charges the parent, claims nothing |
//! | 0 | free | may claim it |
//! | other | another key's cell | looks at the next way |
//!
//! The program claims a free slot with a compare-and-swap to
//! [`cell_writing`], writes the bucket's state (a copy of what the key
//! mapped to until then: its rule's last resort) and the key's slot in the
//! key array, then turns the writing word into [`cell_claim`] with another
//! compare-and-swap. A key whose set is full of other
//! cells is charged to its rule's last resort, as when the cells' room is
//! spent. The daemon frees slots whose bucket is fresh again (the same rule
//! as for any bucket), through the array's mapped memory, in two steps so
//! that no charge is lost: it turns a fresh cell's claim into
//! [`cell_dying`] (no program run finds the cell from then on), waits out
//! every run in flight (one may have found the cell just before), and
//! reads the state again: still fresh, it clears the claim (the slot is
//! free); charged meanwhile, it turns the claim back and the cell lives on.
//!
//! "Claims nothing" keeps one cell per key: a second run that claimed the
//! other way while the first cell is being written (or freed, and then
//! turned back) would split the key's charges over two buckets.
//!
//! Wide cells ([`crate::KEY_WIDE`], see [`crate::pressure`]) share the
//! arrays and the claim protocol: a rule whose flood has claimed cells in a
//! quarter of the slots ([`cells_wide`]) charges its unseen keys to cells
//! 8 bits shorter (IPv6 16, [`wide_mask4`], [`wide_mask6`]), which start
//! drained; a flood over one /8 then reads 256 lines of the array instead
//! of 65,536.

use crate::{
    limit_of_key, Bucket, DatapathConfig, Key4, Key6, KnownKey, KEY_CELL, KEY_LAST, KEY_WIDE,
};

/// IPv4 cells: `Array<Cell>`, [`cell_slots`] entries, mappable.
pub const MAP_CELLS_V4: &str = "RL_CELLS4";
/// IPv6 cells: `Array<Cell>`, [`cell_slots`] entries, mappable.
pub const MAP_CELLS_V6: &str = "RL_CELLS6";
/// The IPv4 cells' keys and counts: `Array<CellKey<Key4>>`, slot for slot
/// with [`MAP_CELLS_V4`], mappable.
pub const MAP_CELL_KEYS_V4: &str = "RL_CELLK4";
/// The IPv6 cells' keys and counts: `Array<CellKey<Key6>>`, mappable.
pub const MAP_CELL_KEYS_V6: &str = "RL_CELLK6";
/// The 64-byte IPv4 cells of older builds (`Array<OldCell<Key4>>`): a
/// daemon adopting their pins moves them into [`MAP_CELLS_V4`].
pub const MAP_OLD_CELLS_V4: &str = "RL_CELL4";
/// The 64-byte IPv6 cells of older builds.
pub const MAP_OLD_CELLS_V6: &str = "RL_CELL6";
/// Per-CPU scratch of the program (`PerCpuArray<CellScratch>`, one entry).
pub const MAP_CELL_SCRATCH: &str = "RL_CSCRATCH";
/// The cell seed (`Array<u64>`, one entry): random, written by the daemon
/// that creates the arrays before any program runs, pinned with them and
/// never changed (a cell is found by it). Secret: who knows it can make
/// keys share a cell or fill a key's set.
pub const MAP_CELL_SEED: &str = "RL_CELLSEED";

/// The maps of the prefix cells (builds that kept cells in the sources'
/// tables had none of them).
pub const CELL_MAPS: [&str; 7] = [
    MAP_CELLS_V4,
    MAP_CELLS_V6,
    MAP_CELL_KEYS_V4,
    MAP_CELL_KEYS_V6,
    MAP_CELL_SEED,
    MAP_CELL_SCRATCH,
    MAP_CELL_COUNT,
];
/// The maps of [`CELL_MAPS`] that are pinned together or not at all: the
/// cells, their keys and the seed that finds them.
pub const CELL_STATE_MAPS: [&str; 5] = [
    MAP_CELLS_V4,
    MAP_CELLS_V6,
    MAP_CELL_KEYS_V4,
    MAP_CELL_KEYS_V6,
    MAP_CELL_SEED,
];

/// Cells claimed per family (`Array<u64>`, entries 0 IPv4 and 1 IPv6,
/// mappable): the program adds one per claim, the collector stores the
/// exact count after each pass. Only a hint (see [`cells_saturated`]).
pub const MAP_CELL_COUNT: &str = "RL_CELLN";

/// Whether an array of `slots` holding `claimed` cells is so full that a
/// cell key the known-keys filter does not hold skips reading its set:
/// with two ways at half load, a set is full for one new prefix in four,
/// and a flood over more prefixes than that would pay a set read (a miss
/// in memory sized for `2 × flood_prefixes` slots) only to learn that its
/// cell does not exist and cannot be made. Such keys go to their rule's
/// last resort, as when the cells' room is spent. The program sets a cell
/// key's filter bits before it claims, so the filter never hides a cell.
#[inline(always)]
pub fn cells_saturated(claimed: u64, slots: u32) -> bool {
    claimed.saturating_mul(2) >= slots as u64
}

/// Counts per rule and family (`Array<u64>`, [`WIDE_ENTRIES`] entries,
/// mappable; see [`crate::pressure`]): at [`wide_entry`], the rule's wide
/// cells, and right after it the rule's other cells, for rules whose ids
/// share the entry (a hash of the id: a few rules may). The program adds
/// one to the first once it has claimed a slot for a wide cell, and one
/// to the second once it has claimed a cell; the collector sets both after
/// each walk to the cells it kept plus those counted since it began (a
/// count always follows its cell, so the walk never counts a cell it did
/// not find, and never sets a count below the cells there are), so the
/// first is 0 while such a wide cell exists only in the instant after its
/// claim: an unseen key looks for its wide cell only when it is not. The second decides when a rule's flood goes wide
/// ([`cells_wide`]): per rule, so that a flood under one rule leaves the
/// newcomers of another with cells of their own prefix.
pub const MAP_WIDE_COUNT: &str = "RL_WIDE";
/// Rule slots of [`MAP_WIDE_COUNT`].
pub const WIDE_RULE_SLOTS: u32 = 1024;
/// Entries of [`MAP_WIDE_COUNT`]: two counts per rule slot and family.
pub const WIDE_ENTRIES: u32 = WIDE_RULE_SLOTS * 4;

/// The [`MAP_WIDE_COUNT`] entry of the wide cells of the rule a bucket
/// key's `rule` names (its limit bits and kind bits aside), in `family`
/// (0 IPv4, 1 IPv6); the rule's other cells are counted at the next one.
#[inline(always)]
pub const fn wide_entry(rule: u32, family: u32) -> u32 {
    ((rule >> 3) & (WIDE_RULE_SLOTS - 1)) * 4 + (family & 1) * 2
}

/// Whether a rule holding `cells` cells in an array of `slots` is under a
/// wide flood: a quarter of the slots, where one new prefix in eleven
/// already finds its set full and is charged to its rule's last resort
/// (so the rule's newcomers anywhere start from a drained bucket either
/// way). Its unseen keys in flood mode then make wide cells
/// ([`crate::pressure`]), whose few lines stay in the CPU's cache where a
/// cell per prefix costs a miss per packet.
#[inline(always)]
pub fn cells_wide(cells: u64, slots: u32) -> bool {
    cells.saturating_mul(4) >= slots as u64
}

/// How many bits shorter than a cell's prefix a wide cell's is.
pub const WIDE_BITS_V4: u32 = 8;
pub const WIDE_BITS_V6: u32 = 16;

/// A wide cell's IPv4 mask (network order) from a cell's, [`WIDE_BITS_V4`]
/// bits shorter: /24 ➜ /16.
#[inline(always)]
pub fn wide_mask4(cell_mask4: u32) -> u32 {
    (u32::from_be(cell_mask4) << WIDE_BITS_V4).to_be()
}

/// A wide cell's IPv6 mask (four network-order words) from a cell's,
/// [`WIDE_BITS_V6`] bits shorter: /48 ➜ /32.
#[inline(always)]
pub fn wide_mask6(m: &[u32; 4]) -> [u32; 4] {
    let h = [
        u32::from_be(m[0]),
        u32::from_be(m[1]),
        u32::from_be(m[2]),
        u32::from_be(m[3]),
    ];
    let (s, r) = (WIDE_BITS_V6, 32 - WIDE_BITS_V6);
    [
        (h[0] << s | h[1] >> r).to_be(),
        (h[1] << s | h[2] >> r).to_be(),
        (h[2] << s | h[3] >> r).to_be(),
        (h[3] << s).to_be(),
    ]
}

/// The keys a source's bucket key falls back to when it has no bucket of
/// its own (see [`crate::pressure`]): its prefix cell, its wide cell and
/// its rule's last resort. The program charges them and the daemon reads
/// them (`GET /v1/sources/{ip}`), so both derive them here.
pub trait FallbackKeys: Sized {
    /// Its prefix cell: the address masked further to the cell prefix
    /// (`cfg.cell_mask4` / `cfg.cell_mask6`).
    fn cell(&self, cfg: &DatapathConfig) -> Self;
    /// Its wide cell: the address masked to the prefix [`WIDE_BITS_V4`]
    /// ([`WIDE_BITS_V6`]) bits shorter than a cell's.
    fn wide(&self, cfg: &DatapathConfig) -> Self;
}

/// The `rule` word of the last resort of the limit that a key's `rule`
/// word names (any kind of key): its address is 0.
#[inline(always)]
pub const fn last_resort_rule(rule: u32) -> u32 {
    limit_of_key(rule) | KEY_LAST
}

impl FallbackKeys for Key4 {
    #[inline(always)]
    fn cell(&self, cfg: &DatapathConfig) -> Self {
        Key4 {
            rule: self.rule | KEY_CELL,
            addr: self.addr & cfg.cell_mask4,
        }
    }
    #[inline(always)]
    fn wide(&self, cfg: &DatapathConfig) -> Self {
        Key4 {
            rule: self.rule | KEY_WIDE,
            addr: self.addr & wide_mask4(cfg.cell_mask4),
        }
    }
}

impl FallbackKeys for Key6 {
    #[inline(always)]
    fn cell(&self, cfg: &DatapathConfig) -> Self {
        let (m, a) = (&cfg.cell_mask6, &self.addr);
        Key6 {
            rule: self.rule | KEY_CELL,
            addr: [a[0] & m[0], a[1] & m[1], a[2] & m[2], a[3] & m[3]],
        }
    }
    #[inline(always)]
    fn wide(&self, cfg: &DatapathConfig) -> Self {
        let (m, a) = (wide_mask6(&cfg.cell_mask6), &self.addr);
        Key6 {
            rule: self.rule | KEY_WIDE,
            addr: [a[0] & m[0], a[1] & m[1], a[2] & m[2], a[3] & m[3]],
        }
    }
}

/// Slots a cell key may use.
pub const CELL_WAYS: u32 = 2;

/// One slot's hot part: 16 bytes, a set's two ways in half a cache line.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cell {
    /// 0: free; else [`cell_claim`], [`cell_writing`] or [`cell_dying`] of
    /// its key.
    pub claim: u64,
    /// The bucket's state word.
    pub tat_ns: u64,
}
const _: () = assert!(core::mem::size_of::<Cell>() == 16);
/// Byte offset of [`Cell::claim`] (the daemon's atomics reach it in mapped memory).
pub const CELL_CLAIM_OFFSET: usize = 0;
/// Byte offset of the bucket's state word.
pub const CELL_TAT_OFFSET: usize = 8;

/// One slot's cold part: the key the cell was claimed for (written before
/// the claim is), and, for a rule with `scope = "cluster"` only, its
/// counts (`counts.tat_ns` is unused: the state is in [`Cell`]). Other
/// rules' cells count nowhere but in their rule's counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CellKey<K> {
    pub key: K,
    pub counts: Bucket,
}

/// A 64-byte cell of older builds ([`MAP_OLD_CELLS_V4`]): claim word
/// `known_hash | 1` when live, the key written last.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OldCell<K> {
    pub claim: u64,
    pub bucket: Bucket,
    pub key: K,
}
const _: () = assert!(core::mem::size_of::<OldCell<Key4>>() == 64);
const _: () = assert!(core::mem::size_of::<OldCell<Key6>>() == 64);

impl<K: KnownKey + PartialEq> OldCell<K> {
    /// Whether the old build held (or was freeing) this cell for its key
    /// (its claim word came from `known_hash`).
    pub fn live(&self) -> bool {
        self.claim != 0 && self.claim & !3 == self.key.known_hash() & !3
    }
}

/// The program's per-CPU scratch: the counts of cells that keep none of
/// their own (their "limited" episodes are this CPU's), and which cell the
/// last unseen key went to (the out-of-line lookup returns one pointer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CellScratch {
    pub counts: Bucket,
    /// The slot the last unseen key was charged to, or [`NO_CELL`].
    pub cell: u32,
    pub _pad: u32,
}
/// [`CellScratch::cell`] when the key went to no cell.
pub const NO_CELL: u32 = u32::MAX;

/// Cells per family that `datapath.flood_prefixes` makes room for: half
/// the slots, at least `flood_prefixes`. Once a family holds this many,
/// its array is saturated ([`cells_saturated`]): a prefix without a cell
/// is charged to its rule's last resort instead of claiming one. What
/// `/v1/status` and `/metrics` report the cells against.
pub const fn cell_room(flood_prefixes: u32) -> u32 {
    cell_slots(flood_prefixes) / 2
}

/// Slots per family for `datapath.flood_prefixes`: twice that, rounded up to
/// a power of two, so that sets rarely overflow while the cells in use stay
/// within `flood_prefixes`.
pub const fn cell_slots(flood_prefixes: u32) -> u32 {
    let want = if flood_prefixes < 1 << 24 {
        flood_prefixes
    } else {
        1 << 24
    };
    let n = (want as u64 * 2).next_power_of_two();
    if n < CELL_WAYS as u64 {
        CELL_WAYS
    } else {
        n as u32
    }
}

/// The first slot of `key`'s set in an array of `slots` (a power of two),
/// under the datapath's cell seed ([`MAP_CELL_SEED`]).
#[inline(always)]
pub fn cell_set<K: KnownKey>(key: &K, seed: u64, slots: u32) -> u32 {
    // The high half: the claim word keeps the low one.
    ((key.cell_hash(seed) >> 32) as u32 & (slots - 1)) & !(CELL_WAYS - 1)
}

/// The claim word of a slot holding `key` under the cell seed: its hash's
/// top 62 bits, then `01`. Never 0.
#[inline(always)]
pub fn cell_claim<K: KnownKey>(key: &K, seed: u64) -> u64 {
    (key.cell_hash(seed) & !3) | 1
}

/// The claim word of `key`'s slot while the program writes its state.
#[inline(always)]
pub const fn cell_writing(claim: u64) -> u64 {
    claim | 3
}

/// The claim word of `key`'s cell while the daemon frees it.
#[inline(always)]
pub const fn cell_dying(claim: u64) -> u64 {
    (claim & !3) | 2
}

/// What one way of a set is to a key (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// The key's cell: charge it.
    Holds,
    /// The key's cell is being claimed or freed: charge the parent, claim
    /// nothing.
    Busy,
    /// Free: the key may claim it.
    Free,
    /// Another key's cell.
    Other,
}

/// Classifies a way whose claim word reads `held` for a key with claim
/// word `claim`.
#[inline(always)]
pub fn cell_way(held: u64, claim: u64) -> Way {
    if held == claim {
        Way::Holds
    } else if held == 0 {
        Way::Free
    } else if held & !3 == claim & !3 {
        Way::Busy
    } else {
        Way::Other
    }
}

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Cell {}
    unsafe impl aya::Pod for super::CellKey<super::Key4> {}
    unsafe impl aya::Pod for super::CellKey<super::Key6> {}
    unsafe impl aya::Pod for super::OldCell<super::Key4> {}
    unsafe impl aya::Pod for super::OldCell<super::Key6> {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::KEY_CELL;

    /// Some cell seed.
    const SEED: u64 = 0x005e_ed0f_ce11;

    #[test]
    fn each_rule_and_family_has_two_counts_and_limits_share_their_rules() {
        let id = 0x1931_c660u32;
        assert_eq!(wide_entry(id, 0) % 4, 0);
        assert_eq!(wide_entry(id, 1), wide_entry(id, 0) + 2);
        for which in 0..8 {
            assert_eq!(
                wide_entry(id | which | KEY_CELL, 0),
                wide_entry(id, 0),
                "every limit and kind of a rule"
            );
        }
        assert!(wide_entry(u32::MAX, 1) + 1 < WIDE_ENTRIES);
        assert_ne!(wide_entry(0x2047_19f0, 0), wide_entry(id, 0));
    }

    #[test]
    fn a_wide_flood_is_a_quarter_of_the_slots() {
        assert!(!cells_wide(32_767, 131_072) && cells_wide(32_768, 131_072));
        assert!(!cells_wide(0, 2) && cells_wide(1, 2));
        assert!(cells_wide(u64::MAX, u32::MAX));
        // Before saturation: a wide flood makes wide cells while its
        // prefixes could still claim cells of their own.
        for slots in [2u32, 512, 131_072] {
            assert!(
                cells_wide(slots as u64 / 2, slots) && cells_saturated(slots as u64 / 2, slots)
            );
        }
    }

    #[test]
    fn wide_masks_are_eight_and_sixteen_bits_shorter() {
        use crate::prefix_mask_words;
        for len in 0..=32u8 {
            let want = prefix_mask_words::<1>(len.saturating_sub(8))[0];
            assert_eq!(wide_mask4(prefix_mask_words::<1>(len)[0]), want, "/{len}");
        }
        for len in 0..=128u8 {
            let want = prefix_mask_words::<4>(len.saturating_sub(16));
            assert_eq!(wide_mask6(&prefix_mask_words::<4>(len)), want, "/{len}");
        }
        let a = u32::from_ne_bytes([10, 9, 8, 7]);
        assert_eq!(
            a & wide_mask4(prefix_mask_words::<1>(24)[0]),
            u32::from_ne_bytes([10, 9, 0, 0])
        );
    }

    #[test]
    fn fallback_keys_keep_the_limit_and_mask_the_address() {
        use crate::{key_kind, limit_of_key, prefix_mask_words, KeyKind};
        let cfg = DatapathConfig {
            cell_mask4: prefix_mask_words::<1>(24)[0],
            cell_mask6: prefix_mask_words::<4>(48),
            ..Default::default()
        };
        let own = Key4 {
            rule: 0x1931_c660 | 3,
            addr: u32::from_ne_bytes([10, 9, 8, 7]),
        };
        let (cell, wide) = (own.cell(&cfg), own.wide(&cfg));
        assert_eq!(
            cell,
            Key4 {
                rule: own.rule | KEY_CELL,
                addr: u32::from_ne_bytes([10, 9, 8, 0])
            }
        );
        assert_eq!(
            wide,
            Key4 {
                rule: own.rule | KEY_WIDE,
                addr: u32::from_ne_bytes([10, 9, 0, 0])
            }
        );
        assert_eq!(
            (key_kind(cell.rule), key_kind(wide.rule)),
            (KeyKind::Cell, KeyKind::Cell)
        );
        // Every kind of key of a limit names the same last resort.
        for k in [own, cell, wide] {
            assert_eq!(last_resort_rule(k.rule), limit_of_key(own.rule) | KEY_LAST);
            assert_eq!(key_kind(last_resort_rule(k.rule)), KeyKind::LastResort);
        }
        let own6 = Key6 {
            rule: 8,
            addr: [0x2001_0db8u32.to_be(), 0x1234_5678u32.to_be(), 1, 2],
        };
        assert_eq!(
            own6.cell(&cfg).addr,
            [0x2001_0db8u32.to_be(), 0x1234_0000u32.to_be(), 0, 0]
        );
        assert_eq!(own6.wide(&cfg).addr, [0x2001_0db8u32.to_be(), 0, 0, 0]);
    }

    #[test]
    fn saturation_is_half_the_slots() {
        assert!(!cells_saturated(0, 2) && cells_saturated(1, 2));
        assert!(!cells_saturated(65_535, 131_072) && cells_saturated(65_536, 131_072));
        assert!(cells_saturated(u64::MAX, u32::MAX));
    }

    #[test]
    fn the_room_reported_is_where_the_array_saturates() {
        for n in [1, 256, 1_000, 65_536, 100_000, 16_777_216] {
            let (room, slots) = (cell_room(n), cell_slots(n));
            assert!(room >= n, "{n}: room {room}");
            assert!(
                cells_saturated(room as u64, slots) && !cells_saturated(room as u64 - 1, slots),
                "{n}"
            );
        }
    }

    #[test]
    fn slots_are_twice_the_prefixes_in_a_power_of_two() {
        assert_eq!(cell_slots(1), 2);
        assert_eq!(cell_slots(256), 512);
        assert_eq!(cell_slots(65_536), 131_072);
        assert_eq!(cell_slots(100_000), 262_144);
        assert_eq!(cell_slots(16_777_216), 33_554_432);
        assert_eq!(cell_slots(u32::MAX), 33_554_432);
    }

    #[test]
    fn a_random_flood_of_as_many_prefixes_as_configured_mostly_finds_room() {
        // 65,536 /24 cells of one rule into cell_slots(65,536): the share
        // that finds its set full (charged to the last resort instead).
        let slots = cell_slots(65_536);
        let mut used = std::vec![0u8; slots as usize / CELL_WAYS as usize];
        let mut overflow = 0;
        for i in 0..65_536u32 {
            let k = Key4 {
                rule: 8 | KEY_CELL,
                addr: (10 << 24 | i << 8).to_be(),
            };
            let set = cell_set(&k, SEED, slots);
            assert_eq!(set % CELL_WAYS, 0);
            assert!(set < slots);
            let u = &mut used[(set / CELL_WAYS) as usize];
            if u32::from(*u) < CELL_WAYS {
                *u += 1;
            } else {
                overflow += 1;
            }
        }
        // Two ways at half load: about 10% expected.
        assert!(overflow < 65_536 / 8, "{overflow} of 65,536 found no room");
    }

    #[test]
    fn a_claims_states_are_never_free_nor_another_keys_claim() {
        for i in 0..100_000u32 {
            let k = Key4 {
                rule: 8 | KEY_CELL,
                addr: i.wrapping_mul(0x9e37_79b9),
            };
            let c = cell_claim(&k, SEED);
            let (w, d) = (cell_writing(c), cell_dying(c));
            assert!(c != 0 && w != 0 && d != 0);
            assert!(c % 4 == 1 && w % 4 == 3 && d % 4 == 2);
            assert_eq!(cell_way(c, c), Way::Holds);
            assert_eq!(cell_way(w, c), Way::Busy, "being written");
            assert_eq!(cell_way(d, c), Way::Busy, "being freed");
            assert_eq!(cell_way(0, c), Way::Free);
            let other = cell_claim(
                &Key4 {
                    addr: k.addr ^ 0x100,
                    ..k
                },
                SEED,
            );
            assert_eq!(cell_way(other, c), Way::Other);
            assert_eq!(cell_way(cell_writing(other), c), Way::Other);
        }
        assert!(cell_claim(&Key6::default(), 0) != 0 && cell_claim(&Key4::default(), 0) != 0);
    }

    #[test]
    fn keys_that_collide_in_the_filters_hash_or_in_an_unseeded_chain_have_their_own_claims() {
        // `known_hash` XORs the rule into the address's second word.
        let (a, b) = (
            Key6 {
                rule: 8 | KEY_CELL,
                addr: [1, 2, 0, 0],
            },
            Key6 {
                rule: 9 | KEY_CELL,
                addr: [1, 3, 0, 0],
            },
        );
        assert_eq!(
            a.known_hash(),
            b.known_hash(),
            "the filter's hash does collide"
        );
        // A seedless chain `fmix(fmix(r ^ c) ^ w1) ^ w2)` collides for
        // `(r, w1)` and `(r', w1 ^ fmix(r ^ c) ^ fmix(r' ^ c))`, found by a
        // review: these two keys.
        let (c, d) = (
            Key6 {
                rule: 8 | KEY_CELL,
                addr: [0x2001_0db8, 0x700, 0, 0],
            },
            Key6 {
                rule: 16 | KEY_CELL,
                addr: [0x595b_0aab, 0x1c57_4c78, 0, 0],
            },
        );
        for seed in [SEED, 0, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_ne!(cell_claim(&a, seed), cell_claim(&b, seed));
            assert_ne!(cell_claim(&c, seed), cell_claim(&d, seed));
        }
        // Structured keys (limits of one rule, prefixes alike) stay apart.
        let mut claims = std::collections::HashSet::new();
        for rule in [8u32, 16, 1 << 20] {
            for which in 0..8u32 {
                for x in 0..256u32 {
                    let k = Key6 {
                        rule: (rule | which) | KEY_CELL,
                        addr: [0x2001_0db8, 0x0000_0700 ^ x ^ which, 0, 0],
                    };
                    assert!(claims.insert(cell_claim(&k, SEED)), "{k:?} shares a claim");
                }
            }
        }
    }

    #[test]
    fn the_seed_moves_every_keys_set() {
        // Who does not know the seed cannot pick keys that fill a set.
        let slots = cell_slots(65_536);
        let moved = (0..1_000u32)
            .filter(|&i| {
                let k = Key4 {
                    rule: 8 | KEY_CELL,
                    addr: (10 << 24 | i << 8).to_be(),
                };
                cell_set(&k, 1, slots) != cell_set(&k, 2, slots)
            })
            .count();
        assert!(moved > 990, "{moved} of 1,000 sets moved with the seed");
    }

    #[test]
    fn an_old_cell_is_live_only_with_its_keys_claim() {
        let key = Key4 {
            rule: 8 | KEY_CELL,
            addr: 0x0a01_0200,
        };
        let live = OldCell {
            claim: key.known_hash() | 1,
            bucket: Bucket::default(),
            key,
        };
        assert!(live.live());
        assert!(
            OldCell {
                claim: (key.known_hash() & !3) | 2,
                ..live
            }
            .live(),
            "being freed: still charged"
        );
        assert!(!OldCell { claim: 0, ..live }.live());
        assert!(
            !OldCell {
                key: Key4 {
                    addr: 0x0a01_0300,
                    ..key
                },
                ..live
            }
            .live(),
            "claimed, another key not yet overwritten"
        );
    }
}
