//! Where a key's bucket is: its own, else its prefix cell, else its rule's
//! last resort. The invariant that makes this safe under any flood, and why
//! a new bucket starts as a copy of the one its key mapped to, are in
//! `rl_common::pressure`.
//!
//! All three kinds live in one table per family (told apart by key bits):
//! every bucket pointer the charging code holds is then of one kind, which
//! keeps the verifier's work linear in the number of limits.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::bpf_ktime_get_coarse_ns,
    macros::map,
    maps::{HashMap, PerCpuArray},
};
use rl_common::{
    Bucket, DatapathConfig, FloodState, Key4, Key6, KnownKey, RuleEntry, Unseen, KEY_CELL, KEY_LAST, STAT_FALLBACK,
    STAT_NEW_CELLS, STAT_NEW_SOURCES, STAT_TABLE_FULL,
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
trait Fallbacks: Copy + KnownKey {
    fn cell(&self, cfg: &DatapathConfig) -> Self;
    fn last(&self) -> Self;
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
/// maps to), or, in flood mode or with the table full, charge that bucket.
/// (One key variable is reused for every probe: BPF stacks are small.)
#[inline(always)]
fn unseen<K: Fallbacks>(table: &HashMap<K, Bucket>, key: &K, cfg: &DatapathConfig) -> Option<*mut Bucket> {
    let flood = unsafe { &mut *RL_FLOOD.get_ptr_mut(0)? };
    // The coarse clock: one load, and a window of ~1 s needs no more.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // What the key maps to now: its cell, else its rule's last resort
    // (created fresh the first time a rule needs it).
    let mut probe = key.cell(cfg);
    let cell = if known::maybe(&probe) { table.get_ptr_mut(&probe) } else { None };
    let (parent, is_cell) = match cell {
        Some(c) => (c, true),
        None => {
            probe = key.last();
            let l = match table.get_ptr_mut(&probe) {
                Some(l) => l,
                None => {
                    let _ = table.insert(&probe, &Bucket::default(), BPF_NOEXIST as u64);
                    table.get_ptr_mut(&probe)?
                }
            };
            (l, false)
        }
    };
    let mut init = Bucket { tat_ns: unsafe { core::ptr::read_volatile(&raw const (*parent).tat_ns) }, ..Bucket::default() };
    if flood.see(now, cfg.flood_cap) == Unseen::Insert {
        known::mark(key);
        match table.insert(key, &init, BPF_NOEXIST as u64) {
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
    // Charge the cell: the one found above, else a new one (a copy of the
    // last resort) while the table has room, else the last resort.
    if is_cell || !flood.may_insert(now) {
        return Some(parent);
    }
    probe = key.cell(cfg);
    init.tat_ns = unsafe { core::ptr::read_volatile(&raw const (*parent).tat_ns) };
    known::mark(&probe);
    match table.insert(&probe, &init, BPF_NOEXIST as u64) {
        Ok(()) => stats::bump(STAT_NEW_CELLS),
        Err(e) if e == -(EEXIST as i32) => {}
        Err(_) => flood.table_full(now),
    }
    Some(table.get_ptr_mut(&probe).unwrap_or(parent))
}

const EEXIST: u32 = 17;
