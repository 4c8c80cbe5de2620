//! Map names and the `#[repr(C)]` keys and values the XDP program and the
//! daemon share. Every layout is pinned by a size assertion: a silent change
//! would make lookups miss.

use core::mem::size_of;

use crate::{clock::TickClock, limiter::Limit, LimitEntry};

/// IPv4 buckets (`BPF_MAP_TYPE_HASH`, [`Key4`] ➜ [`Bucket`]: nothing is
/// evicted; the daemon's collector deletes buckets that are fresh again).
/// Its capacity is set at load time from `datapath.max_sources`.
pub const MAP_SOURCES_V4: &str = "RL_SRC4";
/// IPv6 buckets ([`Key6`] ➜ [`Bucket`]), sized like [`MAP_SOURCES_V4`].
///
/// Why two maps: an 8-byte IPv4 key hashes and compares in about half the
/// time of a 20-byte one, on the lookup every packet makes; and a flood of
/// one family cannot fill the other family's table.
pub const MAP_SOURCES_V6: &str = "RL_SRC6";
/// The single-entry [`DatapathConfig`] array written by the daemon.
pub const MAP_CONFIG: &str = "RL_CONFIG";
/// Per-CPU [`Stats`], one entry: one lookup per packet covers every counter.
pub const MAP_STATS: &str = "RL_STATS";

/// A two-entry `u32` array the program never reads, pinned with the rest:
/// [`LAYOUT_VERSION`] at index 0 (index 1 is reserved). A daemon adopts
/// pinned maps only when the version, and every map's type, key and value
/// size and capacity, match its own.
pub const MAP_LAYOUT: &str = "RL_LAYOUT";
/// Bump whenever a map's meaning changes while its sizes stay the same.
/// 2: `DatapathConfig` reads its slot and flags as one word.
pub const LAYOUT_VERSION: u32 = 2;

/// The limiter program's name in the object file.
pub const PROG_LIMITER: &str = "rl";
/// A program that only returns `XDP_DROP`: the floor for benchmarks.
pub const PROG_FLOOR: &str = "rl_floor";
/// A program that only returns `XDP_PASS`: the baseline the veth benchmark
/// attaches in rl's place.
pub const PROG_PASS: &str = "rl_pass";
/// A program that writes `[jiffies64, ktime_ns]` (native-endian `u64`s) into
/// the first 16 bytes of the packet: the daemon's [`TickClock`] calibration.
pub const PROG_CLOCK: &str = "rl_clock";

/// Rule id of the `[default]` limit.
pub const RULE_DEFAULT: u32 = 0;

/// The key of an IPv4 bucket: which limit, and the source masked to its
/// aggregation prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Key4 {
    /// Which limit this bucket belongs to ([`RULE_DEFAULT`] for `[default]`).
    pub rule: u32,
    /// The masked address in network byte order, as read from the packet.
    pub addr: u32,
}
const _: () = assert!(size_of::<Key4>() == 8);

/// The key of an IPv6 bucket: which limit, and the source masked to its
/// aggregation prefix as four network-order words read from the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Key6 {
    pub rule: u32,
    pub addr: [u32; 4],
}
const _: () = assert!(size_of::<Key6>() == 20);

impl Key4 {
    /// The address's four bytes, in order.
    pub fn addr_bytes(&self) -> [u8; 4] {
        self.addr.to_ne_bytes()
    }
}

impl Key6 {
    /// The address's 16 bytes, in order.
    pub fn addr_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, w) in self.addr.iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        out
    }
}

/// A bucket: one state word of one limit (a GCRA theoretical arrival time
/// in ktime nanoseconds, or a window counter, see [`crate::window`]),
/// updated only with compare-and-swap (see [`crate::admit_with`]); then
/// what the daemon reports about the source (`GET /v1/sources?top=N`,
/// events). Those counters are plain increments in the bucket's cache line
/// (which the compare-and-swap already owns): two CPUs racing on one
/// source may lose a count, never a token.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub tat_ns: u64,
    /// Packets this bucket passed.
    pub passed: u64,
    /// Packets this bucket dropped.
    pub dropped: u64,
    /// The datapath clock at the last drop: a drop more than
    /// [`LIMITED_GAP_NS`] after the previous one starts a new "limited"
    /// episode and may raise an [`Event`].
    pub last_drop_ns: u64,
}
const _: () = assert!(size_of::<Bucket>() == 32);

/// A source whose last drop is older than this is "not being limited".
pub const LIMITED_GAP_NS: u64 = 1_000_000_000;

/// Events for the daemon (`BPF_MAP_TYPE_RINGBUF` of [`Event`]s).
pub const MAP_EVENTS: &str = "RL_EVENTS";
/// The kernel-side budget of events (`Array<u64>`, one GCRA word shared by
/// all CPUs): at most [`EVENTS_PER_SEC`] per second, [`EVENTS_BURST`] at
/// once, so a spoofed flood of new sources cannot swamp userspace.
pub const MAP_EVENT_BUDGET: &str = "RL_EVBUDGET";
pub const EVENTS_PER_SEC: u64 = 100;
pub const EVENTS_BURST: u64 = 100;
/// That budget as a token bucket, for [`crate::gcra`].
pub const EVENT_BUDGET: Limit = match Limit::per_second(EVENTS_PER_SEC, EVENTS_BURST) {
    Ok(l) => l,
    Err(_) => panic!("the events budget must be a valid limit"),
};

/// "This source started being limited under this rule."
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// The datapath clock (ktime ns) of the drop.
    pub at_ns: u64,
    /// `RuleEntry::id | limit index` of the bucket that dropped.
    pub rule: u32,
    /// 4 or 6.
    pub family: u32,
    /// The source's key address (masked to the rule's scope): IPv4 in the
    /// first 4 bytes.
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<Event>() == 32);

impl Event {
    /// An event as the ring buffer hands it over (`None` if cut short).
    pub fn read(record: &[u8]) -> Option<Event> {
        if record.len() < size_of::<Event>() {
            return None;
        }
        // SAFETY: long enough, and every bit pattern is a valid Event.
        Some(unsafe { core::ptr::read_unaligned(record.as_ptr() as *const Event) })
    }
}

/// What the daemon tells the datapath; entry 0 of [`MAP_CONFIG`].
/// Until the daemon writes it, `enabled` is 0 and every packet passes.
///
/// Rule sets are double-buffered: every rule table has two slots, and a
/// packet reads `slot` once and then looks only at that slot. A reload fills
/// the other slot and flips `slot` (see [`DatapathConfig::flip_words`]), so
/// each packet sees the old rule set or the new one, never a mix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// The tick clock, measured by the daemon at load.
    pub clock: TickClock,
    /// Unix-epoch nanoseconds minus ktime, for epoch-aligned windows.
    pub epoch_offset_ns: u64,
    /// 1 once the daemon has written a configuration.
    pub enabled: u8,
    /// `DP_*` bits. (Carved from a former `enabled: u16`: a configuration
    /// pinned by an older build reads 0, the defaults.)
    pub flags: u8,
    /// Log₂ of the slots of each prefix-cell array ([`crate::cell_slots`]).
    /// (Carved from a former `enabled: u32`: a configuration pinned by an
    /// older build reads as one slot, which holds one cell, until the
    /// daemon rewrites it.)
    pub cell_slots_log2: u16,
    /// Unseen keys one CPU may see per flood window (~67 ms) before it
    /// enters flood mode (see [`crate::pressure`]); `u32::MAX`: never.
    pub flood_cap: u32,
    /// The active slot (bit 0), each slot's `CFG_*` bits (bits 8-15 for
    /// slot 0, 16-23 for slot 1) and the active slot's again (high half,
    /// what programs built before the per-slot bytes read), in one word the
    /// program reads with one load. See [`DatapathConfig::slot_flags`].
    pub slot_flags: u64,
    /// Prefix-cell masks (network order): a key's cell is its bucket key
    /// masked further to `flood_prefix_v4` / `flood_prefix_v6`.
    pub cell_mask4: u32,
    /// How long a first fragment's verdict waits for its later fragments.
    pub frag_ttl_ms: u16,
    /// What a later fragment whose first fragment was not seen gets:
    /// [`FRAG_ORPHANS_DROP`] or [`FRAG_ORPHANS_SOURCE`].
    pub frag_orphans: u16,
    pub cell_mask6: [u32; 4],
}
const _: () = assert!(size_of::<DatapathConfig>() == 64);
const _: () = assert!(core::mem::offset_of!(DatapathConfig, slot_flags) % 8 == 0);

/// [`DatapathConfig::flags`]: make no wide cells (see [`crate::cells`]).
/// Set when no rule may go wide (`flood_wide_cells = false` for every
/// rule). Programs since per-rule settings read [`RULE_NO_WIDE`] instead;
/// an older program adopted by a newer daemon reads this.
pub const DP_NO_WIDE_CELLS: u8 = 1;

impl DatapathConfig {
    /// `word` with `slot` active and `flags` as its rule set's `CFG_*`
    /// bits; the other slot's byte is kept.
    pub const fn pack_slot_flags(word: u64, slot: u32, flags: u32) -> u64 {
        let shift = SLOT_FLAGS_SHIFT + 8 * (slot & 1);
        let kept = word & !(0xff << shift) & 0xff_ff00;
        (slot & 1) as u64 | kept | ((flags & 0xff) as u64) << shift | (flags as u64) << 32
    }

    /// The two writes that flip `word` to `slot` with `flags`, each a
    /// `memcpy` that a packet may read half done. The first sets only the
    /// new slot's byte, which no packet reads while that slot is inactive;
    /// the second changes bit 0 and the high half, and leaves the per-slot
    /// bytes alone. Each byte a packet reads is old or new, so it sees the
    /// old slot with its flags or the new one with its own: never one slot
    /// with the other's flags, as one write of both could show.
    pub const fn flip_words(word: u64, slot: u32, flags: u32) -> [u64; 2] {
        let after = Self::pack_slot_flags(word, slot, flags);
        let first = (word & !0xff_ff00) | (after & 0xff_ff00);
        [first, after]
    }

    /// A word written by a daemon that predates the per-slot bytes, with
    /// its active slot's byte set from the high half (an older daemon's
    /// pinned entry, before this build's program reads it).
    pub const fn upgrade_slot_flags(word: u64) -> u64 {
        Self::pack_slot_flags(word, (word & 1) as u32, (word >> 32) as u32)
    }

    /// `(slot, flags)` from one read of the word (volatile: one load).
    #[inline(always)]
    pub fn slot_flags(&self) -> (u32, u32) {
        let w = unsafe { core::ptr::read_volatile(&raw const self.slot_flags) };
        Self::decode_slot_flags(w)
    }

    /// `(slot, flags)` of a word: bit 0 and that slot's byte.
    #[inline(always)]
    pub const fn decode_slot_flags(w: u64) -> (u32, u32) {
        let slot = (w & 1) as u32;
        (slot, (w >> (SLOT_FLAGS_SHIFT + 8 * slot)) as u32 & 0xff)
    }
}

/// Where slot 0's byte of `CFG_*` bits starts in
/// [`DatapathConfig::slot_flags`]; slot 1's follows.
const SLOT_FLAGS_SHIFT: u32 = 8;
const _: () = assert!(CFG_LPM_V4 < 0x100 && CFG_LPM_V6 < 0x100 && CFG_RULES < 0x100);

/// The active rule set has IPv4 allow/deny/src CIDRs: look sources up in
/// [`MAP_LPM_V4`].
pub const CFG_LPM_V4: u32 = 1;
/// Likewise for IPv6 and [`MAP_LPM_V6`].
pub const CFG_LPM_V6: u32 = 2;
/// The active rule set has `[[rule]]`s: classify by [`MAP_L4`].
pub const CFG_RULES: u32 = 4;

/// Rules of both slots (`Array<RuleEntry>`): entry `slot × RULE_SLOTS + i`,
/// `i = 0` being `[default]` and `i ≥ 1` the rules in file order.
pub const MAP_RULES: &str = "RL_RULES";
/// Most `[[rule]]`s plus `[default]`.
pub const RULE_SLOTS: u32 = 1025;

/// Protocol, port and SYN ➜ [`L4Entry`] (`Array<u32>`), per slot
/// [`L4_SLOT_LEN`] entries: TCP without SYN-only match by port at
/// [`L4_TCP`], TCP SYN (SYN set, ACK clear) at [`L4_TCP_SYN`], UDP at
/// [`L4_UDP`], then ICMP, ICMPv6 and every other protocol.
pub const MAP_L4: &str = "RL_L4";
pub const L4_TCP: u32 = 0;
pub const L4_TCP_SYN: u32 = 65_536;
pub const L4_UDP: u32 = 131_072;
pub const L4_ICMP: u32 = 196_608;
pub const L4_ICMPV6: u32 = 196_609;
pub const L4_OTHER: u32 = 196_610;
pub const L4_SLOT_LEN: u32 = 196_611;

/// What the L4 table says about a packet: `first` is the index of the first
/// rule (file order) that matches its protocol, port and flags and has no
/// `src` restriction (0: none, `[default]` applies unless a `src` rule does).
/// `class` is nonzero when some rule with a `src` list comes before `first`:
/// then [`MAP_DECIDE`] settles it with the source's class.
pub struct L4Entry;
impl L4Entry {
    pub const fn pack(class: u16, first: u16) -> u32 {
        (class as u32) << 16 | first as u32
    }
    pub const fn class(v: u32) -> u16 {
        (v >> 16) as u16
    }
    pub const fn first(v: u32) -> u16 {
        v as u16
    }
}

/// Source CIDRs (`LpmTrie`): allow, deny and every rule's `src`, per slot.
/// The key's data is `[slot, address bytes…]`, its prefix length
/// `8 + CIDR length`. The value is a [`CidrEntry`].
pub const MAP_LPM_V4: &str = "RL_LPM4";
pub const MAP_LPM_V6: &str = "RL_LPM6";

/// IPv4 first level, in front of the trie (`Array<u32>`, [`DIR16_LEN`]
/// entries per slot, indexed by the source's top 16 bits): the
/// [`CidrEntry`] of every address in that /16 when no CIDR longer than /16
/// lies inside it (0 when none covers it either), else [`DIR16_LOOKUP`]: ask
/// `RL_LPM4`. An array lookup is inlined by the verifier, so most sources
/// never pay for a trie walk, however many CIDRs the lists hold.
pub const MAP_DIR16: &str = "RL_DIR16";
pub const DIR16_LEN: u32 = 65_536;
/// Set in a [`MAP_DIR16`] value (outside [`CidrEntry`]'s bits): this /16
/// holds longer CIDRs, so the trie decides.
pub const DIR16_LOOKUP: u32 = 1 << 8;

/// Set in a [`CidrEntry`] denied by bans alone (no `[[deny]]` covers it,
/// nor an `[[allow]]`): the source is denied only while a ban covering it
/// holds, which [`MAP_BANS_V4`] / [`MAP_BANS_V6`] say. (Outside the list
/// byte: a program built before it reads the entry as denied.)
pub const DENY_BY_BANS: u32 = 1 << 9;

/// When bans end (`LpmTrie`, keyed as [`MAP_LPM_V4`] / [`MAP_LPM_V6`]):
/// for each ban's CIDR, the latest end (ktime ns) of the bans covering it,
/// so the longest ban matching a source gives the end of every ban that
/// covers it. The kernel ends a ban at its time whether or not a daemon
/// runs then.
pub const MAP_BANS_V4: &str = "RL_BANS4";
pub const MAP_BANS_V6: &str = "RL_BANS6";

/// The longest CIDR matching a source: whether the source is allowed or
/// denied (allow wins over deny whatever the lengths), and its source class:
/// which rules' `src` lists contain it.
pub struct CidrEntry;
pub const LIST_NONE: u32 = 0;
pub const LIST_ALLOW: u32 = 1;
pub const LIST_DENY: u32 = 2;
impl CidrEntry {
    pub const fn pack(list: u32, src_class: u16) -> u32 {
        (src_class as u32) << 16 | list
    }
    pub const fn list(v: u32) -> u32 {
        v & 0xff
    }
    pub const fn src_class(v: u32) -> u16 {
        (v >> 16) as u16
    }
}

/// (slot, L4 class, source class) ➜ rule index (`HashMap<u64, u32>`); a
/// missing entry means `first` of the L4 entry.
pub const MAP_DECIDE: &str = "RL_DECIDE";
/// [`MAP_DECIDE`] entries each slot may hold (the map holds both slots).
pub const DECIDE_SLOT_LEN: u32 = 1 << 20;
/// Trie entries each slot may hold, per family (the tries hold both slots).
pub const LPM_SLOT_LEN: u32 = 327_680;
pub const fn decide_key(slot: u32, l4_class: u16, src_class: u16) -> u64 {
    (slot as u64) << 48 | (l4_class as u64) << 16 | src_class as u64
}

/// Per-CPU [`RuleStats`] (`PerCpuArray`): entry `slot × RULE_SLOTS + i` for
/// rule `i`, then [`RSTAT_ALLOW`] and [`RSTAT_DENY`].
pub const MAP_RULE_STATS: &str = "RL_RSTATS";
pub const RSTAT_ALLOW: u32 = 2 * RULE_SLOTS;
pub const RSTAT_DENY: u32 = 2 * RULE_SLOTS + 1;
pub const RSTAT_LEN: u32 = 2 * RULE_SLOTS + 2;

/// One rule's counters on one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    pub passed_pkts: u64,
    pub passed_bytes: u64,
    pub dropped_pkts: u64,
    pub dropped_bytes: u64,
    /// Would have dropped, passed because the rule's action is `shadow`.
    pub shadow_pkts: u64,
    pub shadow_bytes: u64,
}

/// Most limits on one rule (packet and byte limits counted separately).
pub const MAX_LIMITS: usize = 4;

/// `RuleEntry::flags`.
pub const RULE_SHADOW: u32 = 1;
pub const RULE_ELASTIC: u32 = 2;
/// `scope = "cluster"`: its prefix cells keep counts (`rl_common::CellKey`)
/// for the cluster sync to report.
pub const RULE_CLUSTER: u32 = 4;
/// `flood_wide_cells = false` in effect for the rule (its own setting, else
/// `[datapath]`'s): its floods make no wide cells; its keys still look for
/// those it made before (see [`crate::cells`]).
pub const RULE_NO_WIDE: u32 = 8;
/// `key = "global"`: one bucket per limit for all the traffic the rule
/// matches, IPv4 and IPv6 alike, kept in the IPv4 table (address 0)
/// ([`RuleEntry::keys_v6`]). Before it, each family had a bucket of its
/// own, and dual-stack traffic passed twice the limit.
pub const RULE_GLOBAL: u32 = 16;
/// Set by the daemon on an entry of the inactive slot that it is about to
/// rewrite with another rule, or with its rule changed: the entry still
/// holds its rule whole (id, limits), so a program run already charging a
/// fragment under it charges the rule it checked, but no fragment verdict
/// takes it any more ([`RuleEntry::names`]). The daemon then writes the new
/// rule with the flag still on, and lifts it with a last write (one flag
/// changes), so that no run reads the entry half-written; an entry past
/// the end of the new rules is emptied ([`NO_RULE_ID`]) instead.
pub const RULE_UNNAMED: u32 = 1 << 31;
/// Flag bits 16–30: how many steps of 8 the daemon moved the rule's id
/// from the one its definition hashes to (its *natural* id), so that its
/// wide-cell count shares no other rule's entry ([`crate::wide_entry`];
/// rl-control's `compile::part_wide_counts`). The program never reads
/// them; the daemon reads them back to give each rule the id it holds, and
/// only its own. 0 in entries of builds before it.
pub const RULE_STEPS_SHIFT: u32 = 16;
pub const RULE_STEPS_MASK: u32 = 0x7fff << RULE_STEPS_SHIFT;

/// The natural id of an entry with `id` and `flags` ([`RULE_STEPS_MASK`]).
#[inline(always)]
pub const fn natural_id(id: u32, flags: u32) -> u32 {
    id.wrapping_sub(8 * ((flags & RULE_STEPS_MASK) >> RULE_STEPS_SHIFT)) & crate::RULE_ID_MASK
}

/// The steps ([`RULE_STEPS_MASK`]) from `natural` to `id`: both rule ids
/// along one probe sequence (`natural` plus 8 a step, in the id bits).
#[inline(always)]
pub const fn steps_between(natural: u32, id: u32) -> u32 {
    ((id.wrapping_sub(natural) & crate::RULE_ID_MASK) >> 3) & (RULE_STEPS_MASK >> RULE_STEPS_SHIFT)
}

/// One rule (or `[default]`) as the datapath applies it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleEntry {
    /// Bucket keys use `id | limit index` (the low 3 bits of `id` are 0).
    /// The daemon derives it from the rule's definition, so a rule that did
    /// not change keeps its buckets across reloads and a changed one starts
    /// fresh.
    pub id: u32,
    pub flags: u32,
    pub n_limits: u32,
    /// Mask for IPv4 keys (network order): the `[datapath]` prefix for
    /// `key = "source"`, the rule's for `"prefix"`, 0 for `"global"`.
    pub v4_mask: u32,
    pub v6_mask: [u32; 4],
    pub limits: [LimitEntry; MAX_LIMITS],
    /// The shared pool of an elastic rule (bucket index [`POOL_INDEX`], address 0).
    pub pool: LimitEntry,
}
const _: () = assert!(size_of::<RuleEntry>() == 152);

impl RuleEntry {
    /// Whether a fragment verdict's tagged entry ([`tagged_entry`]) may be
    /// taken through this entry: it holds the rule the verdict names.
    #[inline(always)]
    pub const fn names(&self, tagged: u32) -> bool {
        self.flags & RULE_UNNAMED == 0 && tag_names(tagged, self.id)
    }

    /// Whether a packet of this family (`is_v6`) is charged in the IPv6
    /// tables: not under a global rule, whose buckets, and an elastic
    /// rule's pool, hold both families' traffic in the IPv4 table.
    #[inline(always)]
    pub const fn keys_v6(&self, is_v6: bool) -> bool {
        is_v6 && self.flags & RULE_GLOBAL == 0
    }

    /// The IPv4 bucket key of limit `which` for a source (network-order
    /// word as read from the packet): masked to the rule's key scope.
    #[inline(always)]
    pub fn key4(&self, which: u32, addr: u32) -> Key4 {
        Key4 {
            rule: self.id | which,
            addr: addr & self.v4_mask,
        }
    }

    /// The IPv6 bucket key of limit `which` for a source (four
    /// network-order words as read from the packet).
    #[inline(always)]
    pub fn key6(&self, which: u32, addr: &[u32; 4]) -> Key6 {
        let m = &self.v6_mask;
        Key6 {
            rule: self.id | which,
            addr: [
                addr[0] & m[0],
                addr[1] & m[1],
                addr[2] & m[2],
                addr[3] & m[3],
            ],
        }
    }
}

/// Bucket-key index of an elastic rule's pool.
pub const POOL_INDEX: u32 = 7;

/// The `N` network-order words (as read from packet memory) of a mask that
/// keeps the first `prefix` bits of a `32 × N`-bit address.
pub fn prefix_mask_words<const N: usize>(prefix: u8) -> [u32; N] {
    let mut out = [0u32; N];
    let mut left = prefix as u32;
    for w in out.iter_mut() {
        let bits = if left >= 32 { 32 } else { left };
        left -= bits;
        let host = if bits == 0 {
            0
        } else {
            u32::MAX << (32 - bits)
        };
        *w = u32::from_ne_bytes(host.to_be_bytes());
    }
    out
}

/// First fragments' verdicts ([`FragKey`] ➜ [`FragVerdict`], an LRU hash
/// of [`FRAG_TABLE_LEN`] entries): later fragments of a datagram take the
/// rule and verdict of its first fragment.
pub const MAP_FRAGS: &str = "RL_FRAGS";
pub const FRAG_TABLE_LEN: u32 = 65_536;

/// A datagram: source, destination, protocol and fragment id. The IPv6
/// destination is folded to 32 bits (xor of its words): a clash needs the
/// same source, protocol and 32-bit id, and could only lend one of that
/// source's own datagrams the verdict of another.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// As in the packet (network order); IPv4 uses only `src[3]`.
    pub src: [u32; 4],
    pub dst: u32,
    /// IPv4: the 16-bit identification; IPv6: the 32-bit one.
    pub id: u32,
    /// IPv4 only (0 for IPv6, whose ids are unique per source and destination).
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    pub _pad: u16,
}
const _: () = assert!(size_of::<FragKey>() == 28);

/// What a first fragment got: its rule-stats entry and how it was counted.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragVerdict {
    /// Coarse ktime after which the verdict no longer applies: the first
    /// fragment's time plus `fragment_ttl_ms`, which later fragments never
    /// extend.
    pub expires_ns: u64,
    /// The entry it was counted under (`slot × RULE_SLOTS + i`, below
    /// [`FRAG_TAG_SHIFT`]), and above it the [`rule_tag`] of the rule that
    /// entry held: a later fragment takes the verdict only while the entry
    /// still holds that rule. (Builds before the tag wrote 0 there: their
    /// verdicts read as another rule's, and their datagrams' later
    /// fragments as orphans.)
    pub entry: u32,
    /// Low byte ([`FRAG_VERDICT_MASK`]): [`FRAG_PASSED`], [`FRAG_DROPPED`]
    /// or [`FRAG_SHADOW`]. Above it ([`FRAG_DATA_SHIFT`]): the bytes of
    /// data the datagram's later fragments brought so far (added
    /// atomically), see [`FRAG_DATA_MAX`]. (Builds before the count wrote
    /// the verdict alone: their entries read as no data yet.)
    pub counted: u32,
}
const _: () = assert!(size_of::<FragVerdict>() == 16);

/// [`FragVerdict::entry`]: where the rule's tag starts (entries are under
/// `2 × RULE_SLOTS`).
pub const FRAG_TAG_SHIFT: u32 = 16;
const _: () = assert!(2 * RULE_SLOTS <= 1 << FRAG_TAG_SHIFT);

/// 16 bits of a rule's id (`RuleEntry::id`, a hash of its definition whose
/// low 3 bits are 0): a verdict names its rule by its entry in one of the
/// two rule slots, which the next but one change rewrites (a failed change
/// may rewrite part of one), and by this, so that it is never read through
/// another rule. One rule's tag is another's by chance for 1 pair in 65,536.
#[inline(always)]
pub const fn rule_tag(id: u32) -> u32 {
    (id >> 3) & 0xffff
}

/// A verdict's [`FragVerdict::entry`]: rule-table `entry` tagged with
/// the [`rule_tag`] of `rule_id`, the rule it holds.
#[inline(always)]
pub const fn tagged_entry(entry: u32, rule_id: u32) -> u32 {
    entry | rule_tag(rule_id) << FRAG_TAG_SHIFT
}

/// The rule-table entry of a tagged [`FragVerdict::entry`].
#[inline(always)]
pub const fn untagged_entry(tagged: u32) -> u32 {
    tagged & ((1 << FRAG_TAG_SHIFT) - 1)
}

/// Whether the tagged [`FragVerdict::entry`] names the rule with `id`.
#[inline(always)]
pub const fn tag_names(tagged: u32, id: u32) -> bool {
    is_rule_id(id) && rule_tag(id) == tagged >> FRAG_TAG_SHIFT
}

/// `RuleEntry::id` of an entry that holds no rule (the rest zeroed, but
/// for [`RULE_UNNAMED`]). The daemon writes it over the entries past the
/// end of a shorter rule set, once no program run reads them. Builds
/// before [`RULE_UNNAMED`] wrote it over every entry whose rule changed.
pub const NO_RULE_ID: u32 = u32::MAX;

/// Whether `id` is a rule's (not [`NO_RULE_ID`], nor the 0 of an entry never
/// written).
#[inline(always)]
pub const fn is_rule_id(id: u32) -> bool {
    id != 0 && id & !crate::RULE_ID_MASK == 0
}

/// [`FragVerdict::counted`]: the verdict's bits.
pub const FRAG_VERDICT_MASK: u32 = 0xff;
/// [`FragVerdict::counted`]: where the later fragments' data count starts.
pub const FRAG_DATA_SHIFT: u32 = 8;
/// The data a passed datagram's later fragments may bring: an IP datagram
/// holds at most 65,535 bytes, so a real one's later fragments hold less.
/// Past it, its later fragments are dropped: without the bound, one
/// passed first fragment would open its datagram to an endless stream of
/// later fragments (same id, repeated offsets), which packet limits count
/// as the one datagram.
pub const FRAG_DATA_MAX: u32 = 65_535;
/// What a later fragment counts against [`FRAG_DATA_MAX`] at the least,
/// whatever data its header claims: so a datagram gets at most 127 later
/// fragments, and fragments that claim no data cannot stream past the
/// bound. A real datagram's fragments (all but its last carry at least
/// 552 bytes at IPv4's smallest common MTU of 576, 1,232 at IPv6's 1,280)
/// stay within it.
pub const FRAG_MIN_CHARGE: u32 = 512;

pub const FRAG_PASSED: u32 = 0;
pub const FRAG_DROPPED: u32 = 1;
/// Dropped by a shadow rule: passed, and counted as a shadow drop.
pub const FRAG_SHADOW: u32 = 2;

/// `datapath.fragment_orphans = "drop"`: a later fragment without a known
/// first fragment is dropped (counted in [`STAT_FRAG_ORPHANS`]).
pub const FRAG_ORPHANS_DROP: u16 = 0;
/// `"source"`: it is limited by source under the rules for its protocol
/// with port 0, like a packet of its own.
pub const FRAG_ORPHANS_SOURCE: u16 = 1;

/// Every counter of one CPU, indexed by the `STAT_*` constants.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats(pub [u64; STAT_COUNT as usize]);

// Counters: indices into [`Stats`].
/// Packets passed (all of them, including non-IP).
pub const STAT_PASSED_PKTS: u32 = 0;
pub const STAT_PASSED_BYTES: u32 = 1;
/// Packets dropped (all of them, including malformed).
pub const STAT_DROPPED_PKTS: u32 = 2;
pub const STAT_DROPPED_BYTES: u32 = 3;
/// Of the passed: frames that are not IPv4/IPv6 (never limited).
pub const STAT_NON_IP: u32 = 4;
/// Of the dropped: IP packets with truncated or malformed headers.
pub const STAT_MALFORMED: u32 = 5;
/// Buckets created for sources seen for the first time (or after eviction).
pub const STAT_NEW_SOURCES: u32 = 6;
/// Of the dropped: the source's bucket could not be created or found.
pub const STAT_NO_STATE: u32 = 7;
/// Of the dropped: other CPUs won the bucket's compare-and-swap every retry.
pub const STAT_CONTENDED: u32 = 8;
/// "Limited" events raised and sent to the daemon.
pub const STAT_EVENTS: u32 = 9;
/// "Limited" events not sent: over the kernel-side budget, or the ring
/// buffer was full.
pub const STAT_EVENTS_SUPPRESSED: u32 = 10;
/// Packets of keys that had no bucket of their own, charged to their
/// prefix cell or their rule's last resort (flood mode or a full table).
pub const STAT_FALLBACK: u32 = 11;
/// Bucket inserts refused because the table was full.
pub const STAT_TABLE_FULL: u32 = 12;
/// Prefix cells created.
pub const STAT_NEW_CELLS: u32 = 13;
/// Later fragments whose first fragment was not seen (or whose verdict had
/// expired): dropped, or limited by source, per `datapath.fragment_orphans`.
pub const STAT_FRAG_ORPHANS: u32 = 14;
/// Number of counters.
pub const STAT_COUNT: u32 = 15;

/// Counter names for logs and metrics, indexed like the `STAT_*` constants.
pub const STAT_NAMES: [&str; STAT_COUNT as usize] = [
    "passed_packets",
    "passed_bytes",
    "dropped_packets",
    "dropped_bytes",
    "non_ip_packets",
    "malformed_packets",
    "new_sources",
    "no_state_drops",
    "contended_drops",
    "events",
    "events_suppressed",
    "fallback_packets",
    "table_full_refusals",
    "new_cells",
    "fragment_orphans",
];

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Key4 {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::FragVerdict {}
    unsafe impl aya::Pod for super::Key6 {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::DatapathConfig {}
    unsafe impl aya::Pod for super::Stats {}
    unsafe impl aya::Pod for super::RuleStats {}
    unsafe impl aya::Pod for super::RuleEntry {}
    unsafe impl aya::Pod for crate::pressure::FloodState {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every word a packet could read while `from` is overwritten by `to`,
    /// one byte old or new at a time (a `memcpy` tears at bytes at worst).
    fn torn(from: u64, to: u64) -> impl Iterator<Item = u64> {
        (0u32..256).map(move |mix| {
            (0..8).fold(0, |w, b| {
                let src = if mix >> b & 1 == 1 { to } else { from };
                w | src & 0xff << (8 * b)
            })
        })
    }

    /// Through a flip's two writes, a packet reading the word half written
    /// sees the old slot with its own flags or the new slot with its own,
    /// never a slot with the other's flags. One write of the final word
    /// fails this (the new slot with the old flags).
    #[test]
    fn a_flip_never_shows_a_slot_with_the_other_slots_flags() {
        let fresh = DatapathConfig::pack_slot_flags(0, 0, 0);
        let mut word = fresh;
        let mut slot = 0;
        for flags in [
            CFG_RULES,
            CFG_LPM_V4 | CFG_RULES,
            0,
            CFG_LPM_V6,
            7,
            CFG_LPM_V4,
        ] {
            slot ^= 1;
            let before = DatapathConfig::decode_slot_flags(word);
            let steps = DatapathConfig::flip_words(word, slot, flags);
            let mut prev = word;
            for step in steps {
                for w in torn(prev, step) {
                    let seen = DatapathConfig::decode_slot_flags(w);
                    assert!(
                        seen == before || seen == (slot, flags),
                        "flip to ({slot}, {flags:#x}) from {before:?}: a packet read {seen:?}"
                    );
                }
                prev = step;
            }
            word = steps[1];
            assert_eq!(DatapathConfig::decode_slot_flags(word), (slot, flags));
            // A program built before the per-slot bytes reads the high half.
            assert_eq!(((word & 1) as u32, (word >> 32) as u32), (slot, flags));
        }
        // The single write this replaced tears into a mix.
        let one = DatapathConfig::pack_slot_flags(word, slot ^ 1, 3);
        let before = DatapathConfig::decode_slot_flags(word);
        assert!(torn(word, one)
            .map(DatapathConfig::decode_slot_flags)
            .any(|s| s != before && s != (slot ^ 1, 3)));
    }

    /// An older daemon's word (no per-slot bytes) gets its active slot's
    /// byte from the high half.
    #[test]
    fn an_older_daemons_word_is_upgraded_for_this_program() {
        for (slot, flags) in [(0, CFG_RULES), (1, CFG_LPM_V4 | CFG_RULES), (1, 0)] {
            let old = slot as u64 | (flags as u64) << 32;
            let up = DatapathConfig::upgrade_slot_flags(old);
            assert_eq!(DatapathConfig::decode_slot_flags(up), (slot, flags));
            assert_eq!(up >> 32, old >> 32);
            assert_eq!(DatapathConfig::upgrade_slot_flags(up), up);
        }
    }

    /// A moved id gives its natural one back from the steps in its flags,
    /// across the id bits' wrap, and the other flags stay out of it.
    #[test]
    fn a_moved_id_gives_its_natural_id_back() {
        let top = crate::RULE_ID_MASK;
        for (natural, k) in [
            (0x0100_0000, 0),
            (0x0100_0000, 1),
            (top, 3),
            (top - 8, 32_767),
        ] {
            let id = natural.wrapping_add(8 * k) & crate::RULE_ID_MASK;
            assert_eq!(steps_between(natural, id), k);
            let flags = RULE_UNNAMED | RULE_NO_WIDE | RULE_CLUSTER | k << RULE_STEPS_SHIFT;
            assert_eq!(natural_id(id, flags), natural, "{natural:#x} + {k} steps");
            assert_eq!(
                flags & RULE_STEPS_MASK,
                k << RULE_STEPS_SHIFT,
                "the steps overlap no flag"
            );
        }
        assert_eq!(
            RULE_STEPS_MASK
                & (RULE_UNNAMED
                    | RULE_GLOBAL
                    | RULE_NO_WIDE
                    | RULE_CLUSTER
                    | RULE_ELASTIC
                    | RULE_SHADOW),
            0
        );
    }

    #[test]
    fn masks_keep_prefix_bits_in_network_order() {
        let m: [u32; 1] = prefix_mask_words(24);
        assert_eq!(m[0].to_ne_bytes(), [255, 255, 255, 0]);
        let m: [u32; 4] = prefix_mask_words(64);
        assert_eq!(m[1].to_ne_bytes(), [255; 4]);
        assert_eq!(m[2], 0);
        let m: [u32; 4] = prefix_mask_words(52);
        assert_eq!(m[1].to_ne_bytes(), [255, 255, 240, 0]);
        let m: [u32; 4] = prefix_mask_words(128);
        assert_eq!(m, [u32::MAX; 4]);
        let m: [u32; 1] = prefix_mask_words(0);
        assert_eq!(m, [0]);
    }

    #[test]
    fn key_bytes_are_network_order() {
        let k = Key4 {
            rule: 0,
            addr: u32::from_ne_bytes([192, 0, 2, 7]),
        };
        assert_eq!(k.addr_bytes(), [192, 0, 2, 7]);
        let k = Key6 {
            rule: 0,
            addr: [
                u32::from_ne_bytes([0xfd, 0, 0, 1]),
                0,
                0,
                u32::from_ne_bytes([0, 0, 0, 9]),
            ],
        };
        assert_eq!(k.addr_bytes()[0], 0xfd);
        assert_eq!(k.addr_bytes()[15], 9);
    }
}
