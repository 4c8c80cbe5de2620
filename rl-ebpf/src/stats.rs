//! Global per-CPU counters: plain increments, no atomics needed, summed by
//! the daemon. Only rare paths touch them (non-IP and malformed frames, new
//! sources, contention); IP packets are counted in their rule's counters, so
//! the hot path does not look this map up at all.

use aya_ebpf::{macros::map, maps::{Array, PerCpuArray}};
use rl_common::{Stats, STAT_DROPPED_BYTES, STAT_DROPPED_PKTS, STAT_PASSED_BYTES, STAT_PASSED_PKTS};

/// rl_common::MAP_LAYOUT: written and read by the daemon only.
#[map(name = "RL_LAYOUT")]
static RL_LAYOUT: Array<u32> = Array::with_max_entries(2, 0);

#[map(name = "RL_STATS")]
static RL_STATS: PerCpuArray<Stats> = PerCpuArray::with_max_entries(1, 0);

/// Adds to counters of this CPU. Only this CPU writes them, and XDP runs
/// without preemption, so plain read-modify-write is exact.
#[inline(always)]
fn add(pairs: &[(u32, u64)]) {
    if let Some(s) = RL_STATS.get_ptr_mut(0) {
        for &(index, n) in pairs {
            if let Some(c) = unsafe { (*s).0.get_mut(index as usize) } {
                *c += n;
            }
        }
    }
}

#[inline(always)]
pub fn bump(index: u32) {
    add(&[(index, 1)]);
}

/// A frame passed with `also` counted as its kind (e.g. `STAT_NON_IP`).
#[inline(always)]
pub fn passed(bytes: u64, also: Option<u32>) {
    match also {
        Some(kind) => add(&[(STAT_PASSED_PKTS, 1), (STAT_PASSED_BYTES, bytes), (kind, 1)]),
        None => add(&[(STAT_PASSED_PKTS, 1), (STAT_PASSED_BYTES, bytes)]),
    }
}

#[inline(always)]
pub fn dropped(bytes: u64, kind: u32) {
    add(&[(STAT_DROPPED_PKTS, 1), (STAT_DROPPED_BYTES, bytes), (kind, 1)]);
}
