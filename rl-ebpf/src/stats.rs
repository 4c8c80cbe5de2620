//! Per-CPU counters: plain increments, no atomics needed, summed by the daemon.
//! All of a CPU's counters sit in one map entry, fetched once per packet.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use rl_common::{Stats, STAT_DROPPED_BYTES, STAT_DROPPED_PKTS, STAT_PASSED_BYTES, STAT_PASSED_PKTS};

#[map(name = "RL_STATS")]
static RL_STATS: PerCpuArray<Stats> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's counters. Only this CPU writes them, and XDP runs without
/// preemption, so plain read-modify-write is exact.
pub struct Counters(*mut Stats);

impl Counters {
    #[inline(always)]
    pub fn get() -> Option<Counters> {
        RL_STATS.get_ptr_mut(0).map(Counters)
    }

    #[inline(always)]
    fn add(&self, index: u32, n: u64) {
        if let Some(c) = unsafe { (*self.0).0.get_mut(index as usize) } {
            *c += n;
        }
    }

    #[inline(always)]
    pub fn bump(&self, index: u32) {
        self.add(index, 1);
    }

    #[inline(always)]
    pub fn passed(&self, bytes: u64) {
        self.add(STAT_PASSED_PKTS, 1);
        self.add(STAT_PASSED_BYTES, bytes);
    }

    #[inline(always)]
    pub fn dropped(&self, bytes: u64) {
        self.add(STAT_DROPPED_PKTS, 1);
        self.add(STAT_DROPPED_BYTES, bytes);
    }
}
