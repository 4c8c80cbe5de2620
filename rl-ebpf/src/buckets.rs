//! Where a key's bucket is: its own, else its prefix cell, else its rule's
//! last resort. The invariant that makes this safe under any flood, and why
//! a new bucket starts as a copy of the one its key mapped to, are in
//! `rl_common::pressure`.
//!
//! Own buckets and last resorts live in one hash table per family (told
//! apart by key bits); prefix cells in an array per family
//! (`rl_common::cells`), where finding a random source's cell is one load
//! of one line instead of a hash-table walk: the cost a random-source flood
//! pays on every packet.

use core::{
    intrinsics::{atomic_cxchg, atomic_xadd, AtomicOrdering},
    mem::MaybeUninit,
    ptr::write_volatile,
};

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_NOEXIST},
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use rl_common::{
    cell_claim, cell_set, cell_way, cell_writing, cells_saturated, cells_wide, last_resort_rule, owned_room, wide_entry, Bucket, Cell, CellKey,
    CellScratch, DatapathConfig, FallbackKeys, FloodState, Key4, Key6, KnownKey, LimitEntry, RuleEntry, Unseen, Way, CELL_WAYS,
    NO_CELL, OWNED_CAP, OWNED_ENTRIES, POOL_INDEX, RULE_CLUSTER, RULE_NO_WIDE, STAT_FALLBACK, STAT_NEW_CELLS, STAT_NEW_SOURCES,
    STAT_TABLE_FULL, WIDE_ENTRIES,
};

use crate::{known, limit::tick_now, stats};

/// Buckets by (limit, masked source), one map per family (see
/// rl_common::MAP_SOURCES_V6): sources' own buckets, prefix cells and last
/// resorts. Plain hash maps: nothing is ever evicted; the daemon deletes
/// buckets that are fresh again. The daemon sets the real capacity at load
/// (`max_sources + flood_prefixes` plus room for the last resorts).
#[map(name = "RL_SRC4")]
static RL_SRC4: HashMap<Key4, Bucket> = HashMap::with_max_entries(65_536, 0);
#[map(name = "RL_SRC6")]
static RL_SRC6: HashMap<Key6, Bucket> = HashMap::with_max_entries(65_536, 0);

/// Prefix cells (rl_common::cells), one array per family, and their keys
/// and counts, slot for slot. Mappable: the daemon frees fresh cells with
/// compare-and-swap on their claim word. The daemon sets the real size at
/// load (`cell_slots(flood_prefixes)`).
#[map(name = "RL_CELLS4")]
static RL_CELLS4: Array<Cell> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);
#[map(name = "RL_CELLS6")]
static RL_CELLS6: Array<Cell> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);
#[map(name = "RL_CELLK4")]
static RL_CELLK4: Array<CellKey<Key4>> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);
#[map(name = "RL_CELLK6")]
static RL_CELLK6: Array<CellKey<Key6>> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);

/// The cell seed (rl_common::MAP_CELL_SEED), written by the daemon before
/// the program is attached.
#[map(name = "RL_CELLSEED")]
static RL_CELLSEED: Array<u64> = Array::with_max_entries(1, 0);

/// rl_common::MAP_CELL_SCRATCH.
#[map(name = "RL_CSCRATCH")]
static RL_CSCRATCH: PerCpuArray<CellScratch> = PerCpuArray::with_max_entries(1, 0);

/// Wide cells and cells per rule and family (rl_common::MAP_WIDE_COUNT).
#[map(name = "RL_WIDE")]
static RL_WIDE: Array<u64> = Array::with_max_entries(WIDE_ENTRIES, BPF_F_MMAPABLE);

/// Cells claimed per family (rl_common::MAP_CELL_COUNT).
#[map(name = "RL_CELLN")]
static RL_CELLN: Array<u64> = Array::with_max_entries(2, BPF_F_MMAPABLE);

/// Own buckets per family and their cap (rl_common::MAP_OWNED).
#[map(name = "RL_OWNED")]
static RL_OWNED: Array<u64> = Array::with_max_entries(OWNED_ENTRIES, BPF_F_MMAPABLE);

/// Per-CPU flood detector (rl_common::MAP_FLOOD).
#[map(name = "RL_FLOOD")]
static RL_FLOOD: PerCpuArray<FloodState> = PerCpuArray::with_max_entries(1, 0);

/// Where a limit's state word is, and where its packets are counted: a
/// bucket's own fields, or, for a prefix cell, the state in the cell and
/// the counts in this CPU's scratch (and, for a cluster rule, in the cell's
/// key slot too: [`count_in_cell`]).
pub struct Held {
    pub tat: *mut u64,
    pub counts: *mut Bucket,
    /// The cell's slot, or [`NO_CELL`].
    pub cell: u32,
}

#[inline(always)]
fn whole(b: *mut Bucket) -> Held {
    Held { tat: unsafe { &raw mut (*b).tat_ns }, counts: b, cell: NO_CELL }
}

/// Counts a cluster rule's packet in the key slot of the cell that decided
/// it (the cluster sync reports cells' passes). Kept apart from the
/// bucket's counts: one kind of counts pointer for every cell keeps the
/// verifier's walk ~75,000 instructions shorter.
#[inline(always)]
pub fn count_in_cell(rule: &RuleEntry, is_v6: bool, cell: u32, passed: bool) {
    if cell == NO_CELL || rule.flags & RULE_CLUSTER == 0 {
        return;
    }
    let counts = if is_v6 {
        RL_CELLK6.get_ptr_mut(cell).map(|k| unsafe { &raw mut (*k).counts })
    } else {
        RL_CELLK4.get_ptr_mut(cell).map(|k| unsafe { &raw mut (*k).counts })
    };
    if let Some(c) = counts {
        // A passed later fragment adds 0: counted with its datagram.
        let (n, by) = if passed { (unsafe { &raw mut (*c).passed }, crate::frag::passes()) } else { (unsafe { &raw mut (*c).dropped }, 1) };
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, by) };
    }
}

/// The bucket that charges limit `which` of `rule` for this source, or
/// `None` if no bucket could be found or made (the caller drops: it fails
/// closed).
#[inline(always)]
pub fn bucket(cfg: &DatapathConfig, rule: &RuleEntry, which: u32, is_v6: bool, src: &[u32; 4]) -> Option<Held> {
    // Wide cells: not for a cluster rule (its sync names cells by their
    // prefix) nor for an elastic rule's pool (one bucket, address 0), so
    // their keys never look for one (`wide` 0); the others' keys look for
    // theirs (bit 0) even while the rule's `flood_wide_cells = false`
    // forbids making more (bit 1 clear).
    let limit = if which == POOL_INDEX { &rule.pool } else { rule.limits.get(which as usize)? };
    let look = (rule.flags & RULE_CLUSTER == 0 && which != POOL_INDEX) as u32;
    let wide = look | (look & (rule.flags & RULE_NO_WIDE == 0) as u32) << 1;
    if is_v6 {
        let key = rule.key6(which, src);
        if known::maybe(&key) {
            if let Some(b) = RL_SRC6.get_ptr_mut(&key) {
                return Some(whole(b));
            }
        }
        found::<Key6>(unseen6(cfg, &key, limit, wide))
    } else {
        let key = rule.key4(which, src[3]);
        if known::maybe(&key) {
            if let Some(b) = RL_SRC4.get_ptr_mut(&key) {
                return Some(whole(b));
            }
        }
        found::<Key4>(unseen4(cfg, &key, limit, wide))
    }
}

/// What [`unseen`] found: the bucket it returned, else the cell it left in
/// the scratch, else nothing.
#[inline(always)]
fn found<K: Fallbacks>(b: *mut Bucket) -> Option<Held> {
    if !b.is_null() {
        return Some(whole(b));
    }
    let scratch = RL_CSCRATCH.get_ptr_mut(0)?;
    let i = unsafe { (*scratch).cell };
    let c = K::slot(i)?;
    Some(Held { tat: unsafe { &raw mut (*c).tat_ns }, counts: unsafe { &raw mut (*scratch).counts }, cell: i })
}

/// The bucket of limit `which` of `rule` for this source if it already
/// exists (no creation, no fallback): for reads that may skip a key.
#[inline(always)]
pub fn existing(rule: &RuleEntry, which: u32, is_v6: bool, src: &[u32; 4]) -> Option<*mut Bucket> {
    if is_v6 {
        RL_SRC6.get_ptr_mut(&rule.key6(which, src))
    } else {
        RL_SRC4.get_ptr_mut(&rule.key4(which, src[3]))
    }
}

/// A source key's fallbacks: the keys (`rl_common::FallbackKeys`, the
/// rule's last resort) and the family's cell arrays.
trait Fallbacks: Copy + KnownKey + PartialEq + FallbackKeys {
    /// The key's `rule` word.
    fn rule(&self) -> u32;
    fn last(&self) -> Self;
    /// Slot `i` of the family's cell array.
    fn slot(i: u32) -> Option<*mut Cell>;
    /// Slot `i` of the family's cell-key array.
    fn key_slot(i: u32) -> Option<*mut CellKey<Self>>;
}

impl Fallbacks for Key4 {
    #[inline(always)]
    fn rule(&self) -> u32 {
        self.rule
    }
    #[inline(always)]
    fn last(&self) -> Self {
        Key4 { rule: last_resort_rule(self.rule), addr: 0 }
    }
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut Cell> {
        RL_CELLS4.get_ptr_mut(i)
    }
    #[inline(always)]
    fn key_slot(i: u32) -> Option<*mut CellKey<Self>> {
        RL_CELLK4.get_ptr_mut(i)
    }
}

impl Fallbacks for Key6 {
    #[inline(always)]
    fn rule(&self) -> u32 {
        self.rule
    }
    #[inline(always)]
    fn last(&self) -> Self {
        zero_addr6(last_resort_rule(self.rule))
    }
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut Cell> {
        RL_CELLS6.get_ptr_mut(i)
    }
    #[inline(always)]
    fn key_slot(i: u32) -> Option<*mut CellKey<Self>> {
        RL_CELLK6.get_ptr_mut(i)
    }
}

// Out of line, one copy per family: every limit of every rule shares them.
// A null bucket: the key went to the cell in the scratch (`found`).
#[inline(never)]
fn unseen4(cfg: &DatapathConfig, key: &Key4, limit: &LimitEntry, wide: u32) -> *mut Bucket {
    unseen(&RL_SRC4, key, cfg, limit, wide).unwrap_or(core::ptr::null_mut())
}

#[inline(never)]
fn unseen6(cfg: &DatapathConfig, key: &Key6, limit: &LimitEntry, wide: u32) -> *mut Bucket {
    unseen(&RL_SRC6, key, cfg, limit, wide).unwrap_or(core::ptr::null_mut())
}

/// What a cell key with claim word `claim` finds in the set at `set`: the
/// slot of its cell, else [`NO_CELL`] and a free way it may claim ([`NO_CELL`]
/// if none, or while its cell is being made or freed: the key then goes
/// to the parent and claims nothing). Slots, not pointers: a BPF stack is
/// small.
#[inline(always)]
fn look<K: Fallbacks>(set: u32, claim: u64) -> (u32, u32) {
    let (mut cell, mut free) = (NO_CELL, NO_CELL);
    for way in 0..CELL_WAYS {
        let Some(c) = K::slot(set + way) else { break };
        match cell_way(unsafe { core::ptr::read_volatile(&raw const (*c).claim) }, claim) {
            Way::Holds => {
                cell = set + way;
                break;
            }
            Way::Busy => {
                free = NO_CELL;
                break;
            }
            Way::Free if free == NO_CELL => free = set + way,
            Way::Free | Way::Other => {}
        }
    }
    (cell, free)
}

/// A key with no bucket of its own: create one (a copy of the bucket it
/// maps to), or, in flood mode or with the table full, charge that bucket:
/// its wide cell if it has one (`rl_common::pressure`), else its prefix
/// cell (claimed now if its set has a free slot: a copy of the last
/// resort; or, once its rule's cells hold a wide flood, its wide cell,
/// claimed drained), else its rule's last resort. A cell is returned as
/// `None` with its slot in the scratch (one pointer comes back from a
/// call); `None` with [`NO_CELL`] there: nothing could be found or made.
/// (One key variable is reused for every probe: BPF stacks are small. The
/// verifier walks this function once per call site and path, and every
/// value live across its branches multiplies the walk.)
#[inline(always)]
fn unseen<K: Fallbacks>(table: &HashMap<K, Bucket>, key: &K, cfg: &DatapathConfig, limit: &LimitEntry, wide: u32) -> Option<*mut Bucket> {
    let scratch = unsafe { &mut *RL_CSCRATCH.get_ptr_mut(0)? };
    scratch.cell = NO_CELL;
    let flood = unsafe { &mut *RL_FLOOD.get_ptr_mut(0)? };
    // A window of 67 ms is 6.7 ticks at the coarsest kernel tick (HZ =
    // 100), so its edges are seen at most a tick late.
    let now = tick_now(cfg);
    let seen = flood.see(now, cfg.flood_cap);
    let insert = seen != Unseen::Fallback;
    let seed = unsafe { core::ptr::read_volatile(RL_CELLSEED.get_ptr(0)?) };
    let slots = 1 << (cfg.cell_slots_log2 & 31);
    // What the key maps to now: its wide cell (if `wide`: it may have
    // one), else its cell, else its rule's last resort (created fresh the
    // first time a rule needs one). One slot variable holds the wide cell
    // or the cell: a second one live across the rest doubles the
    // verifier's walk.
    let found = if wide != 0 { wide_cell::<K>(key, cfg, limit, seed, slots, !insert && wide & 2 != 0) } else { None };
    let mut cell = found.unwrap_or(NO_CELL);
    if cell != NO_CELL && !insert {
        stats::bump(STAT_FALLBACK);
        scratch.cell = cell;
        return None;
    }
    let cell_key = key.cell(cfg);
    let claim = cell_claim(&cell_key, seed);
    let mut free = NO_CELL;
    if cell == NO_CELL {
        let look_set = match RL_CELLN.get_ptr_mut(K::FAMILY) {
            Some(n) if cells_saturated(unsafe { core::ptr::read_volatile(n) }, slots) => known::maybe(&cell_key),
            _ => true,
        };
        if look_set {
            (cell, free) = look::<K>(cell_set(&cell_key, seed, slots), claim);
        }
    }
    // (A source's own bucket starts where its wide cell is, if it has one.)
    let (tat, last) = match K::slot(cell) {
        Some(c) => (unsafe { core::ptr::read_volatile(&raw const (*c).tat_ns) }, None),
        None => {
            let l = last_resort(table, key)?;
            (unsafe { core::ptr::read_volatile(&raw const (*l).tat_ns) }, Some(l))
        }
    };
    if insert {
        // At `max_sources` own buckets the table is full for them (the rest
        // is the last resorts' room): as if the insert had failed. Two CPUs
        // may both pass the check at once: one bucket over, per CPU. A key
        // offered a bucket in flood mode takes one only while the table is
        // under half full (its count doubled), so that a long spoofed flood's
        // offers never fill it; refused so, it is not a full table.
        // (Flood mode stamped this window's state at `now`: read again
        // here, not kept from above, which would double the verifier's walk.)
        let flooding = unsafe { core::ptr::read_volatile(&raw const flood.last_flood_ns) } == now;
        let owned = RL_OWNED.get_ptr_mut(K::FAMILY);
        let room = match (owned, RL_OWNED.get_ptr(OWNED_CAP)) {
            (Some(n), Some(cap)) => unsafe { owned_room(core::ptr::read_volatile(n) << (flooding as u32), core::ptr::read_volatile(cap)) },
            _ => true,
        };
        let inserted = if room {
            known::mark(key);
            table.insert(key, copy_of(&mut MaybeUninit::uninit(), tat), BPF_NOEXIST as u64)
        } else {
            Err(-1)
        };
        match inserted {
            Ok(()) => {
                stats::bump(STAT_NEW_SOURCES);
                if let Some(n) = owned {
                    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
                }
            }
            // Another CPU created it first: charge that one.
            Err(e) if e == -(EEXIST as i32) => {}
            // An offer refused for want of half the table.
            Err(-1) if flooding => {}
            Err(_) => {
                flood.table_full(now);
                stats::bump(STAT_TABLE_FULL);
            }
        }
        if let Some(b) = table.get_ptr_mut(key) {
            return Some(b);
        }
    }
    stats::bump(STAT_FALLBACK);
    if cell != NO_CELL {
        scratch.cell = cell;
        return None;
    }
    // Claim a free slot of the set for this cell, a copy of the last resort:
    // the state and the key first, the claim last, so a CPU that finds the
    // claim finds the state written.
    let Some(c) = K::slot(free) else { return last };
    known::mark(&cell_key);
    if !claim_slot::<K>(c, free, &cell_key, claim, tat) {
        return last;
    }
    // The rule's cells: what decides when its flood goes wide.
    if let Some(n) = RL_WIDE.get_ptr_mut(wide_entry(key.rule(), K::FAMILY) + 1) {
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
    }
    scratch.cell = free;
    None
}

/// The key's wide cell (`rl_common::pressure`): its slot if it exists
/// (looked for only while its rule has wide cells), else, if `may_make`
/// (flood mode, and the rule's `flood_wide_cells` on) and its rule's cells hold a wide
/// flood, a new one claimed drained.
/// `None`: the key goes to its cell or last resort.
#[inline(always)]
fn wide_cell<K: Fallbacks>(key: &K, cfg: &DatapathConfig, limit: &LimitEntry, seed: u64, slots: u32, may_make: bool) -> Option<u32> {
    let at = wide_entry(key.rule(), K::FAMILY);
    // The rule's wide cells and its cells, in one line.
    let wides = RL_WIDE.get_ptr_mut(at)?;
    let make = may_make
        && RL_WIDE.get_ptr(at + 1).is_some_and(|n| cells_wide(unsafe { core::ptr::read_volatile(n) }, slots));
    if !make && unsafe { core::ptr::read_volatile(wides) } == 0 {
        return None;
    }
    let wide_key = key.wide(cfg);
    let claim = cell_claim(&wide_key, seed);
    let (cell, free) = look::<K>(cell_set(&wide_key, seed, slots), claim);
    if cell != NO_CELL || !make {
        return (cell != NO_CELL).then_some(cell);
    }
    let c = K::slot(free)?;
    let drained = limit.drained(crate::limit::now(cfg, limit), cfg.epoch_offset_ns);
    if !claim_slot::<K>(c, free, &wide_key, claim, drained) {
        return None;
    }
    // Counted once claimed, so that the collector's walk, which sets the
    // count to the cells it finds plus those counted since it began, never
    // counts one it cannot find (that could read 0 for a second while the
    // rule has a wide cell). For the few ns before, an unseen key not
    // making cells may skip it, as it did a moment before: it was born
    // drained.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(wides, 1) };
    Some(free)
}

/// Claims free slot `i` (`c`) for cell `key` (claim word `claim`) holding
/// state `tat`: the state and the key first, the claim last, so a CPU that
/// finds the claim finds the state written; then counts it (`RL_CELLN`).
/// `false`: another run took the slot first (or, for a run stalled past
/// the daemon's grace, freed it).
#[inline(always)]
fn claim_slot<K: Fallbacks>(c: *mut Cell, i: u32, key: &K, claim: u64, tat: u64) -> bool {
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(&raw mut (*c).claim, 0, cell_writing(claim))
    };
    if !won {
        return false;
    }
    unsafe {
        core::ptr::write_volatile(&raw mut (*c).tat_ns, tat);
        if let Some(k) = K::key_slot(i) {
            // Field by field: a whole `CellKey` would be built on the stack.
            core::ptr::write_volatile(&raw mut (*k).key, *key);
            core::ptr::write_volatile(&raw mut (*k).counts.passed, 0);
            core::ptr::write_volatile(&raw mut (*k).counts.dropped, 0);
            core::ptr::write_volatile(&raw mut (*k).counts.last_drop_ns, 0);
        }
    }
    // A compare-and-swap, not a store: were this run stalled past the
    // daemon's grace, which frees a slot left writing, the slot is not
    // taken back from whoever has it now (this packet goes to the parent).
    let (_, written) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(&raw mut (*c).claim, cell_writing(claim), claim)
    };
    if written {
        stats::bump(STAT_NEW_CELLS);
        if let Some(n) = RL_CELLN.get_ptr_mut(K::FAMILY) {
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
        }
    }
    written
}

/// A new bucket that starts where its parent's state word `tat` is (see
/// `rl_common::pressure`), its counters at zero. Each field is stored on
/// its own (volatile): LLVM's BPF backend turns a run of zero stores into
/// a call of a byte-at-a-time memset, which `..Bucket::default()` here cost
/// on every unseen packet (6 ns of a flood's 112 in the program, measured
/// with `perf record` on the veth bench), and plain field stores still
/// cost on every insert.
///
/// The bucket is built in `b`, which the caller keeps, and lent out: a
/// bucket returned by value is copied, and the copy's zeros are a memset.
#[inline(always)]
fn copy_of(b: &mut MaybeUninit<Bucket>, tat: u64) -> &Bucket {
    let p = b.as_mut_ptr();
    unsafe {
        write_volatile(&raw mut (*p).tat_ns, tat);
        write_volatile(&raw mut (*p).passed, 0);
        write_volatile(&raw mut (*p).dropped, 0);
        write_volatile(&raw mut (*p).last_drop_ns, 0);
        b.assume_init_ref()
    }
}

/// The rule's last resort for `key`, created fresh the first time.
#[inline(always)]
fn last_resort<K: Fallbacks>(table: &HashMap<K, Bucket>, key: &K) -> Option<*mut Bucket> {
    let last = key.last();
    if let Some(l) = table.get_ptr_mut(&last) {
        return Some(l);
    }
    let _ = table.insert(&last, copy_of(&mut MaybeUninit::uninit(), 0), BPF_NOEXIST as u64);
    table.get_ptr_mut(&last)
}

const EEXIST: u32 = 17;

/// The IPv6 key of `rule` with the address `::` (last resorts, elastic
/// pools). Its zeros are read back through a volatile load, so the
/// compiler does not know them: known zero stores become a call of a
/// byte-at-a-time memset (see [`copy_of`]), even where the key is copied.
#[inline(always)]
fn zero_addr6(rule: u32) -> Key6 {
    let z = opaque_zero();
    Key6 { rule, addr: [z; 4] }
}

/// 0, which the compiler cannot see through.
#[inline(always)]
pub fn opaque_zero() -> u32 {
    let z = 0u32;
    unsafe { core::ptr::read_volatile(&z) }
}
