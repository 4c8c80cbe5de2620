//! Fragments follow their datagram. A first fragment is limited like a
//! whole packet; its verdict is then remembered for `datapath.fragment_ttl_ms`
//! under (source, destination, protocol, id). A later fragment carries no
//! ports, so it takes that verdict and the rule that gave it:
//! - dropped first fragment ➜ dropped;
//! - passed ➜ passed, and charged to the rule's byte limits (packet limits
//!   counted the datagram once, at its first fragment); a fragment a byte
//!   limit drops breaks its datagram, so the verdict becomes "dropped" and
//!   the rest of it no longer spends the limit;
//! - none seen (reordered, expired, or a flood of bare later fragments) ➜ an
//!   orphan: dropped, or limited by source like a packet of its own, per
//!   `datapath.fragment_orphans`.
//!
//! The functions are out of line, and a first fragment's key waits in a
//! per-CPU scratch slot while the packet is charged: the main path pays a
//! branch on `Frag`, and the verifier need not carry the packet's fields
//! through the charging code.

use aya_ebpf::{
    helpers::bpf_ktime_get_coarse_ns,
    macros::map,
    maps::{LruHashMap, PerCpuArray},
};
use rl_common::{
    DatapathConfig, FragKey, FragVerdict, FRAG_DROPPED, FRAG_ORPHANS_SOURCE, FRAG_SHADOW, FRAG_TABLE_LEN,
    STAT_FRAG_ORPHANS,
};

use crate::{
    limit::{count, Counted},
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
    pending: u32,
}

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

/// Sets a fragment's key aside until it is [`settled`].
#[inline(never)]
pub fn stash(pkt: &Packet) {
    if let Some(p) = RL_FRAG_NOW.get_ptr_mut(0) {
        unsafe { *p = Pending { key: key(pkt), pending: 1 } };
    }
}

/// Called with every charged packet's verdict: if it is a [`stash`]ed
/// fragment, remembers the verdict for the datagram's later fragments. (A flag
/// in a map, not one on the stack: a bit carried through the charging code
/// would double the verifier's work there.)
#[inline(always)]
pub fn settled(cfg: &DatapathConfig, entry: u32, counted: Counted) {
    if let Some(p) = RL_FRAG_NOW.get_ptr_mut(0) {
        if unsafe { (*p).pending } != 0 {
            remember(cfg, p, entry, counted as u32);
        }
    }
}

#[inline(never)]
fn remember(cfg: &DatapathConfig, p: *mut Pending, entry: u32, counted: u32) {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let v = FragVerdict { expires_ns: now + cfg.frag_ttl_ms as u64 * 1_000_000, entry, counted };
    unsafe {
        (*p).pending = 0;
        // Full: the LRU evicts the oldest datagram, whose later fragments
        // then become orphans.
        let _ = RL_FRAGS.insert(&(*p).key, &v, 0);
    }
}

/// Decides a later fragment by its first fragment's verdict; `entry` is
/// what it classified as on its own (port 0), for an orphan limited by source.
#[inline(never)]
pub fn later(cfg: &DatapathConfig, pkt: &Packet, entry: u32, len: u64) -> Later {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    match unsafe { RL_FRAGS.get(&key(pkt)) } {
        Some(v) if v.expires_ns > now => match v.counted {
            FRAG_DROPPED => {
                count(v.entry, len, Counted::Dropped);
                Later::Drop
            }
            FRAG_SHADOW => {
                count(v.entry, len, Counted::Shadow);
                Later::Pass
            }
            _ => Later::Charge { entry: v.entry, packets: 0 },
        },
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
