//! Fragments follow their datagram. A first fragment is limited like a
//! whole packet; its verdict is then remembered for `datapath.fragment_ttl_ms`
//! under (source, destination, protocol, id). A later fragment carries no
//! ports, so it takes that verdict and the rule that gave it:
//! - dropped first fragment ➜ dropped;
//! - passed ➜ passed, and charged to the rule's byte limits (packet limits
//!   counted the datagram once, at its first fragment); a fragment a byte
//!   limit drops breaks its datagram, so the verdict becomes "dropped" and
//!   the rest of it no longer spends the limit. A datagram's later
//!   fragments may bring at most `FRAG_DATA_MAX` bytes of data, what an IP
//!   datagram can hold; past that they are dropped;
//! - none seen (reordered, expired, or a flood of bare later fragments) ➜ an
//!   orphan: dropped, or limited by source like a packet of its own, per
//!   `datapath.fragment_orphans`. Each orphan is charged on its own.
//!
//! Only a first fragment sets its datagram's verdict and expiry: later
//! fragments never extend it, so a stream of them cannot keep a passed
//! datagram open.
//!
//! The functions are out of line, and a first fragment's key waits in a
//! per-CPU scratch slot while the packet is charged: the main path pays a
//! branch on `Frag`, and the verifier need not carry the packet's fields
//! through the charging code.

use aya_ebpf::{
    macros::map,
    maps::{LruHashMap, PerCpuArray},
};
use core::intrinsics::{atomic_cxchg, atomic_or, AtomicOrdering};

use rl_common::{
    tagged_entry, untagged_entry, DatapathConfig, FragKey, FragVerdict, RuleEntry, FRAG_DATA_MAX, FRAG_DATA_SHIFT,
    FRAG_DROPPED, FRAG_MIN_CHARGE, FRAG_ORPHANS_SOURCE, FRAG_SHADOW, FRAG_TABLE_LEN, FRAG_VERDICT_MASK, RULE_SHADOW,
    STAT_FRAG_ORPHANS,
};

use crate::{
    limit::{count, tick_now, Counted, RL_RULES},
    parse::Packet,
    stats,
};

#[map(name = "RL_FRAGS")]
static RL_FRAGS: LruHashMap<FragKey, FragVerdict> = LruHashMap::with_max_entries(FRAG_TABLE_LEN, 0);

/// The first fragment being charged on this CPU, if `pending`.
#[map(name = "RL_FRAG_NOW")]
static RL_FRAG_NOW: PerCpuArray<Pending> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
struct Pending {
    key: FragKey,
    /// 0, [`FIRST`] or [`LATER`].
    pending: u32,
}

/// A first fragment: its verdict is remembered for its datagram.
pub const FIRST: u32 = 1;
/// A later fragment charged under its datagram's verdict: if dropped (by
/// a byte limit), it breaks the datagram.
pub const LATER: u32 = 2;

/// What a later fragment gets.
pub enum Later {
    /// Decided (and counted) by its first fragment's verdict.
    Pass,
    Drop,
    /// To be charged to rule-stats `entry` with `packets` against packet
    /// limits: its datagram's rule with 0 (its bytes still count), or, for
    /// an orphan limited by source, its own classification with 1.
    Charge { entry: u32, packets: u64 },
}

#[inline(always)]
fn key(pkt: &Packet) -> FragKey {
    FragKey {
        src: pkt.src,
        dst: pkt.dst,
        id: pkt.frag_id,
        // IPv6 ids are unique per source and destination alone, and a
        // first fragment's protocol is the one after any later extension
        // headers, which its later fragments do not show.
        proto: if pkt.is_v6 { 0 } else { pkt.proto },
        family: if pkt.is_v6 { 6 } else { 4 },
        _pad: 0,
    }
}

/// Sets a fragment's key aside until it is [`settled`]: `what` is
/// [`FIRST`] or [`LATER`].
#[inline(never)]
pub fn stash(pkt: &Packet, what: u32) {
    if let Some(p) = RL_FRAG_NOW.get_ptr_mut(0) {
        unsafe { *p = Pending { key: key(pkt), pending: what } };
    }
}

/// What a passed packet adds to its bucket's count of passes: 1, or 0
/// for a later fragment charged under its datagram (counted at its first
/// fragment; a cluster rule's sync reports these counts to Redis as
/// packets). Without a branch: one more on every charge would add to the
/// verifier's walk there.
#[inline(always)]
pub fn passes() -> u64 {
    match RL_FRAG_NOW.get(0) {
        // `pending` is 0, FIRST (1) or LATER (2).
        Some(p) => 1 - ((p.pending as u64 >> 1) & 1),
        None => 1,
    }
}

/// Called with every charged packet's verdict (`rule`: the rule at
/// `entry`): if it is a [`stash`]ed fragment, remembers a first fragment's
/// verdict for the datagram's later fragments, or breaks the datagram of a
/// later one that was dropped. (A flag in a map, not one on the stack: a
/// bit carried through the charging code would double the verifier's work
/// there.)
#[inline(always)]
pub fn settled(cfg: &DatapathConfig, rule: &RuleEntry, entry: u32, counted: Counted) {
    if let Some(p) = RL_FRAG_NOW.get_ptr_mut(0) {
        if unsafe { (*p).pending } != 0 {
            remember(cfg, p, tagged_entry(entry, rule.id), counted as u32);
        }
    }
}

#[inline(never)]
fn remember(cfg: &DatapathConfig, p: *mut Pending, entry: u32, counted: u32) {
    let what = unsafe { (*p).pending };
    unsafe { (*p).pending = 0 };
    let key = unsafe { &(*p).key };
    if what == FIRST {
        let now = tick_now(cfg);
        let v = FragVerdict { expires_ns: now + cfg.frag_ttl_ms as u64 * 1_000_000, entry, counted };
        // Full: the LRU evicts the oldest datagram, whose later fragments
        // then become orphans.
        let _ = RL_FRAGS.insert(key, &v, 0);
    } else if counted == FRAG_DROPPED || counted == FRAG_SHADOW {
        // Passed until now (only a passed datagram's fragments are
        // charged): dropped (or, under a shadow rule, shadow-dropped) from
        // now on, its expiry and data count kept.
        if let Some(v) = RL_FRAGS.get_ptr_mut(key) {
            unsafe { atomic_or::<u32, u32, { AtomicOrdering::Relaxed }>(&raw mut (*v).counted, counted) };
        }
    }
}

/// Decides a later fragment by its first fragment's verdict; `entry` is
/// what it classified as on its own (port 0), for an orphan limited by source.
/// A verdict whose entry does not hold its rule now (rewritten by a later
/// rule change, or marked about to be) is not taken: the fragment is an
/// orphan (the verdict stands again if the entry gets its rule back).
#[inline(never)]
pub fn later(cfg: &DatapathConfig, pkt: &Packet, entry: u32, len: u64) -> Later {
    let now = tick_now(cfg);
    let found = RL_FRAGS
        .get_ptr_mut(&key(pkt))
        .filter(|v| unsafe { (**v).expires_ns } > now)
        .and_then(|v| {
            let tagged = unsafe { (*v).entry };
            holding(tagged).map(|shadow| (v, untagged_entry(tagged), shadow))
        });
    match found {
        Some((v, entry, shadow)) => {
            let word = unsafe { core::ptr::read_volatile(&raw const (*v).counted) };
            // Bits, not values: two CPUs that each broke the datagram, one
            // under the rule's drop and one under its shadow (the rule
            // switched between them meanwhile), leave both set; the drop
            // wins.
            let verdict = word & FRAG_VERDICT_MASK;
            // Charged while the datagram is whole and within what an IP
            // datagram can hold; past that, a shadow rule counts what it
            // would drop, and passes it.
            if verdict & (FRAG_DROPPED | FRAG_SHADOW) == 0 && brings(v, word, pkt.frag_data) {
                Later::Charge { entry, packets: 0 }
            } else if verdict & FRAG_DROPPED == 0 && (verdict & FRAG_SHADOW != 0 || shadow) {
                count(entry, len, Counted::Shadow);
                Later::Pass
            } else {
                count(entry, len, Counted::Dropped);
                Later::Drop
            }
        }
        _ if cfg.frag_orphans == FRAG_ORPHANS_SOURCE => {
            stats::bump(STAT_FRAG_ORPHANS);
            Later::Charge { entry, packets: 1 }
        }
        _ => {
            stats::dropped(len, STAT_FRAG_ORPHANS);
            Later::Drop
        }
    }
}

/// Whether a verdict's tagged entry still holds the rule it was counted
/// under, and is not about to be rewritten (`rl_common::RULE_UNNAMED`:
/// then it still holds that rule whole until this run is over, so the
/// entry read again to charge the fragment is the one checked here):
/// `Some(shadow)`, whether that rule only counts what it would drop.
#[inline(always)]
fn holding(tagged: u32) -> Option<bool> {
    RL_RULES.get(untagged_entry(tagged)).filter(|r| r.names(tagged)).map(|r| r.flags & RULE_SHADOW != 0)
}

/// Adds a later fragment's `data` bytes (at least `FRAG_MIN_CHARGE`) to
/// its datagram's count (`word`: the count as just read); false if the
/// datagram already holds, or would now hold, more than an IP datagram can
/// (`FRAG_DATA_MAX`). The count is added even then, so it stays over;
/// nothing is added once over, so it cannot wrap. A compare-and-swap, not
/// a fetch-and-add: LLVM's BPF backend emits a 32-bit fetch-and-add whose
/// result is not the old value. Lost too often to other CPUs' fragments of
/// the same datagram, the fragment is dropped: it fails closed.
#[inline(always)]
fn brings(v: *mut FragVerdict, word: u32, data: u32) -> bool {
    let data = if data < FRAG_MIN_CHARGE { FRAG_MIN_CHARGE } else { data };
    if data > FRAG_DATA_MAX {
        return false;
    }
    let mut seen = word;
    for _ in 0..4 {
        if seen >> FRAG_DATA_SHIFT > FRAG_DATA_MAX {
            return false;
        }
        let new = seen + (data << FRAG_DATA_SHIFT);
        let (now, ok) = unsafe {
            atomic_cxchg::<u32, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(&raw mut (*v).counted, seen, new)
        };
        if ok {
            return new >> FRAG_DATA_SHIFT <= FRAG_DATA_MAX;
        }
        seen = now;
    }
    false
}
