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

use core::intrinsics::{atomic_cxchg, atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_NOEXIST},
    helpers::bpf_jiffies64,
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use rl_common::{
    cell_claim, cell_dying, cell_set, cell_way, cells_saturated, Way, Bucket, Cell, DatapathConfig, FloodState, Key4, Key6, KnownKey, RuleEntry, Unseen, CELL_WAYS,
    KEY_CELL, KEY_LAST, STAT_FALLBACK, STAT_NEW_CELLS, STAT_NEW_SOURCES, STAT_TABLE_FULL,
};

use crate::{known, stats};

/// Buckets by (limit, masked source), one map per family (see
/// rl_common::MAP_SOURCES_V6): sources' own buckets, prefix cells and last
/// resorts. Plain hash maps: nothing is ever evicted; the daemon deletes
/// buckets that are fresh again. The daemon sets the real capacity at load
/// (`max_sources + flood_prefixes` plus room for the last resorts).
#[map(name = "RL_SRC4")]
static RL_SRC4: HashMap<Key4, Bucket> = HashMap::with_max_entries(65_536, 0);
#[map(name = "RL_SRC6")]
static RL_SRC6: HashMap<Key6, Bucket> = HashMap::with_max_entries(65_536, 0);

/// Prefix cells (rl_common::cells), one array per family. Mappable: the
/// daemon frees fresh cells with compare-and-swap on their claim word. The
/// daemon sets the real size at load (`cell_slots(flood_prefixes)`).
#[map(name = "RL_CELL4")]
static RL_CELL4: Array<Cell<Key4>> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);
#[map(name = "RL_CELL6")]
static RL_CELL6: Array<Cell<Key6>> = Array::with_max_entries(CELL_WAYS, BPF_F_MMAPABLE);

/// Cells claimed per family (rl_common::MAP_CELL_COUNT).
#[map(name = "RL_CELLN")]
static RL_CELLN: Array<u64> = Array::with_max_entries(2, BPF_F_MMAPABLE);

/// Per-CPU flood detector (rl_common::MAP_FLOOD).
#[map(name = "RL_FLOOD")]
static RL_FLOOD: PerCpuArray<FloodState> = PerCpuArray::with_max_entries(1, 0);

/// The bucket that charges limit `which` of `rule` for this source, or
/// `None` if no bucket could be found or made (the caller drops: it fails
/// closed).
#[inline(always)]
pub fn bucket(cfg: &DatapathConfig, rule: &RuleEntry, which: u32, is_v6: bool, src: &[u32; 4]) -> Option<*mut Bucket> {
    if is_v6 {
        let key = rule.key6(which, src);
        if known::maybe(&key) {
            if let Some(b) = RL_SRC6.get_ptr_mut(&key) {
                return Some(b);
            }
        }
        let b = unseen6(cfg, &key);
        (!b.is_null()).then_some(b)
    } else {
        let key = rule.key4(which, src[3]);
        if known::maybe(&key) {
            if let Some(b) = RL_SRC4.get_ptr_mut(&key) {
                return Some(b);
            }
        }
        let b = unseen4(cfg, &key);
        (!b.is_null()).then_some(b)
    }
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

/// The fallback keys of a source key.
trait Fallbacks: Copy + KnownKey + PartialEq {
    fn cell(&self, cfg: &DatapathConfig) -> Self;
    fn last(&self) -> Self;
    /// Slot `i` of the family's cell array.
    fn slot(i: u32) -> Option<*mut Cell<Self>>;
}

impl Fallbacks for Key4 {
    #[inline(always)]
    fn cell(&self, cfg: &DatapathConfig) -> Self {
        Key4 { rule: self.rule | KEY_CELL, addr: self.addr & cfg.cell_mask4 }
    }
    #[inline(always)]
    fn last(&self) -> Self {
        Key4 { rule: self.rule | KEY_LAST, addr: 0 }
    }
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut Cell<Self>> {
        RL_CELL4.get_ptr_mut(i)
    }
}

impl Fallbacks for Key6 {
    #[inline(always)]
    fn cell(&self, cfg: &DatapathConfig) -> Self {
        let (m, a) = (&cfg.cell_mask6, &self.addr);
        Key6 { rule: self.rule | KEY_CELL, addr: [a[0] & m[0], a[1] & m[1], a[2] & m[2], a[3] & m[3]] }
    }
    #[inline(always)]
    fn last(&self) -> Self {
        Key6 { rule: self.rule | KEY_LAST, addr: [0; 4] }
    }
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut Cell<Self>> {
        RL_CELL6.get_ptr_mut(i)
    }
}

// Out of line, one copy per family: every limit of every rule shares them.
#[inline(never)]
fn unseen4(cfg: &DatapathConfig, key: &Key4) -> *mut Bucket {
    unseen(&RL_SRC4, key, cfg).unwrap_or(core::ptr::null_mut())
}

#[inline(never)]
fn unseen6(cfg: &DatapathConfig, key: &Key6) -> *mut Bucket {
    unseen(&RL_SRC6, key, cfg).unwrap_or(core::ptr::null_mut())
}

/// A key with no bucket of its own: create one (a copy of the bucket it
/// maps to), or, in flood mode or with the table full, charge that bucket:
/// its prefix cell (claimed now if its set has a free slot: a copy of the
/// last resort), else its rule's last resort.
/// (One key variable is reused for every probe: BPF stacks are small.)
#[inline(always)]
fn unseen<K: Fallbacks>(table: &HashMap<K, Bucket>, key: &K, cfg: &DatapathConfig) -> Option<*mut Bucket> {
    let flood = unsafe { &mut *RL_FLOOD.get_ptr_mut(0)? };
    // The tick clock: one inlined load, no helper call (each call and
    // return is dear with this CPU's return-stack mitigation), and a window
    // of ~1 s needs no finer time.
    let now = cfg.clock.at(unsafe { bpf_jiffies64() });
    // What the key maps to now: its cell, else its rule's last resort
    // (created fresh the first time a rule needs it).
    let cell_key = key.cell(cfg);
    let claim = cell_claim(&cell_key);
    let slots = 1 << (cfg.cell_slots_log2 & 31);
    let set = cell_set(&cell_key, slots);
    let claimed = RL_CELLN.get_ptr_mut(K::FAMILY);
    let look = match claimed {
        Some(n) if cells_saturated(unsafe { core::ptr::read_volatile(n) }, slots) => known::maybe(&cell_key),
        _ => true,
    };
    let dying = cell_dying(&cell_key);
    let (mut cell, mut free) = (None, None);
    for way in 0..CELL_WAYS {
        if !look {
            break;
        }
        let Some(c) = K::slot(set + way) else { break };
        let held = unsafe { core::ptr::read_volatile(&raw const (*c).claim) };
        let matches = held == claim && unsafe { core::ptr::read_volatile(&raw const (*c).key) } == cell_key;
        match cell_way(held, matches, claim, dying) {
            Way::Holds => {
                cell = Some(c);
                break;
            }
            // Its cell is being written or freed: the parent, no claim.
            Way::Busy => {
                free = None;
                break;
            }
            Way::Free if free.is_none() => free = Some(c),
            Way::Free | Way::Other => {}
        }
    }
    let parent = match cell {
        Some(c) => unsafe { &raw mut (*c).bucket },
        None => last_resort(table, key)?,
    };
    let tat = unsafe { core::ptr::read_volatile(&raw const (*parent).tat_ns) };
    if flood.see(now, cfg.flood_cap) == Unseen::Insert {
        known::mark(key);
        match table.insert(key, &copy_of(tat), BPF_NOEXIST as u64) {
            Ok(()) => stats::bump(STAT_NEW_SOURCES),
            // Another CPU created it first: charge that one.
            Err(e) if e == -(EEXIST as i32) => {}
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
    if cell.is_some() {
        return Some(parent);
    }
    // Claim a free slot of the set for this cell, a copy of the last resort
    // (`parent`): the bucket first, the key last, so a CPU that finds the
    // key finds the bucket written.
    let Some(c) = free else { return Some(parent) };
    known::mark(&cell_key);
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(&raw mut (*c).claim, 0, claim)
    };
    if !won {
        return Some(parent);
    }
    unsafe {
        core::ptr::write_volatile(&raw mut (*c).bucket, copy_of(tat));
        core::ptr::write_volatile(&raw mut (*c).key, cell_key);
    }
    stats::bump(STAT_NEW_CELLS);
    if let Some(n) = claimed {
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
    }
    Some(unsafe { &raw mut (*c).bucket })
}

/// A new bucket that starts where its parent's state word `tat` is (see
/// `rl_common::pressure`), its counters at zero. Built only where it is
/// stored, field by field: `..Bucket::default()` here compiled to a call of
/// a byte-at-a-time memset on every unseen packet (6 ns of a flood's 112
/// in the program, measured with `perf record` on the veth bench).
#[inline(always)]
fn copy_of(tat: u64) -> Bucket {
    Bucket { tat_ns: tat, passed: 0, dropped: 0, last_drop_ns: 0 }
}

/// The rule's last resort for `key`, created fresh the first time.
#[inline(always)]
fn last_resort<K: Fallbacks>(table: &HashMap<K, Bucket>, key: &K) -> Option<*mut Bucket> {
    let last = key.last();
    if let Some(l) = table.get_ptr_mut(&last) {
        return Some(l);
    }
    let _ = table.insert(&last, &Bucket::default(), BPF_NOEXIST as u64);
    table.get_ptr_mut(&last)
}

const EEXIST: u32 = 17;
