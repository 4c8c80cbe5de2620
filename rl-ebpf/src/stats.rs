//! Per-CPU counters: plain increments, no atomics needed, summed by the daemon.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use rl_common::{
    STAT_COUNT, STAT_DROPPED_BYTES, STAT_DROPPED_PKTS, STAT_PASSED_BYTES, STAT_PASSED_PKTS,
};

#[map(name = "RL_STATS")]
static RL_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);

#[inline(always)]
fn add(index: u32, n: u64) {
    if let Some(p) = RL_STATS.get_ptr_mut(index) {
        // Per-CPU slot: only this CPU writes it, and XDP runs without preemption.
        unsafe { *p += n };
    }
}

#[inline(always)]
pub fn bump(index: u32) {
    add(index, 1);
}

#[inline(always)]
pub fn passed(bytes: u64) {
    add(STAT_PASSED_PKTS, 1);
    add(STAT_PASSED_BYTES, bytes);
}

#[inline(always)]
pub fn dropped(bytes: u64) {
    add(STAT_DROPPED_PKTS, 1);
    add(STAT_DROPPED_BYTES, bytes);
}
