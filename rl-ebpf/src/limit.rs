//! Per-source limiting: the source's bucket in an LRU hash, charged with the
//! shared GCRA arithmetic from rl-common through one compare-and-swap.

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_jiffies64, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, LruHashMap, PerCpuArray},
    programs::XdpContext,
    Global,
};
use aya_log_ebpf::debug;
use rl_common::{
    admit_shared, Admit, Bucket, DatapathConfig, Key4, Key6, SharedWord, RULE_DEFAULT,
    STAT_CONTENDED, STAT_NEW_SOURCES, STAT_NO_STATE,
};

use crate::{parse::Packet, stats::Counters};

/// Buckets by masked source, one map per family (see rl_common::MAP_SOURCES_V6).
/// The daemon sets the real capacity at load (`datapath.max_sources`); LRU
/// eviction bounds memory under floods of random sources.
#[map(name = "RL_SRC4")]
static RL_SRC4: LruHashMap<Key4, Bucket> = LruHashMap::with_max_entries(65_536, 0);
#[map(name = "RL_SRC6")]
static RL_SRC6: LruHashMap<Key6, Bucket> = LruHashMap::with_max_entries(65_536, 0);

/// Runtime configuration, written by the daemon before it attaches.
#[map(name = "RL_CONFIG")]
static RL_CONFIG: Array<DatapathConfig> = Array::with_max_entries(1, 0);

/// Per-CPU counts of rare events, used only to rate-limit their log lines.
#[map(name = "RL_LOG_SEEN")]
static RL_LOG_SEEN: PerCpuArray<u64> = PerCpuArray::with_max_entries(rl_common::STAT_COUNT, 0);

/// Benchmark only: when the loader sets this to 1, every packet is treated as
/// a new source (its address is salted with a per-CPU counter), so
/// BPF_PROG_TEST_RUN can time the LRU insert path with one repeated frame.
/// It is a load-time constant: at 0 (always, outside `cargo xtask bench`)
/// the verifier removes the branch.
#[unsafe(no_mangle)]
static RL_BENCH_NEW_SOURCES: Global<u32> = Global::new(0);

#[map(name = "RL_BENCH")]
static RL_BENCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

pub enum Verdict {
    Pass,
    Drop,
}

#[inline(always)]
pub fn limit_source(ctx: &XdpContext, pkt: &Packet, stats: &Counters) -> Verdict {
    let Some(cfg) = RL_CONFIG.get(0) else {
        return Verdict::Pass;
    };
    if cfg.enabled == 0 {
        // Not configured yet (the daemon attaches only after writing config).
        return Verdict::Pass;
    }
    let mut src = pkt.src;
    if RL_BENCH_NEW_SOURCES.load() != 0 {
        if let Some(salt) = RL_BENCH.get_ptr_mut(0) {
            unsafe {
                *salt = (*salt).wrapping_add(1);
                src[3] ^= *salt;
            }
        }
    }
    let bucket = if pkt.is_v6 {
        let m = &cfg.v6_mask;
        let key = Key6 {
            rule: RULE_DEFAULT,
            addr: [src[0] & m[0], src[1] & m[1], src[2] & m[2], src[3] & m[3]],
        };
        bucket(&RL_SRC6, &key, stats)
    } else {
        let key = Key4 {
            rule: RULE_DEFAULT,
            addr: src[3] & cfg.v4_mask,
        };
        bucket(&RL_SRC4, &key, stats)
    };
    let Some(bucket) = bucket else {
        rare_event(ctx, stats, STAT_NO_STATE);
        return Verdict::Drop;
    };
    let now = if cfg.default_coarse != 0 {
        // Inlined by the verifier into one load; see rl_common::clock.
        cfg.clock.at(unsafe { bpf_jiffies64() })
    } else {
        unsafe { bpf_ktime_get_ns() }
    };
    let cell = Tat(unsafe { &raw mut (*bucket).tat_ns });
    match admit_shared(&cell, now, &cfg.default_limit) {
        Admit::Pass => Verdict::Pass,
        Admit::Drop => Verdict::Drop,
        Admit::Contended => {
            rare_event(ctx, stats, STAT_CONTENDED);
            Verdict::Drop
        }
    }
}

/// A bucket's TAT word. It lives in map memory shared by all CPUs, so it is
/// only read whole and only changed by compare-and-swap.
struct Tat(*mut u64);

impl SharedWord for Tat {
    #[inline(always)]
    fn load(&self) -> u64 {
        unsafe { core::ptr::read_volatile(self.0) }
    }

    #[inline(always)]
    fn compare_exchange(&self, current: u64, new: u64) -> Result<u64, u64> {
        // BPF_ATOMIC | BPF_CMPXCHG (needs BPF CPU v3, set by `cargo xtask build`).
        let (seen, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                self.0, current, new,
            )
        };
        if ok {
            Ok(seen)
        } else {
            Err(seen)
        }
    }
}

/// The source's bucket, created full if it is new. When two CPUs see a new
/// source at once, `BPF_NOEXIST` lets exactly one insert win and both then
/// charge the same bucket.
#[inline(always)]
fn bucket<K>(map: &LruHashMap<K, Bucket>, key: &K, stats: &Counters) -> Option<*mut Bucket> {
    if let Some(b) = map.get_ptr_mut(key) {
        return Some(b);
    }
    if map.insert(key, &Bucket { tat_ns: 0 }, BPF_NOEXIST as u64).is_ok() {
        stats.bump(STAT_NEW_SOURCES);
    }
    map.get_ptr_mut(key)
}

/// Counts a rare event and logs it at the 1st, 2nd, 4th, 8th… occurrence on
/// this CPU, so a storm of them costs a handful of log records, not one each.
#[inline(always)]
fn rare_event(ctx: &XdpContext, stats: &Counters, stat: u32) {
    stats.bump(stat);
    if let Some(seen) = RL_LOG_SEEN.get_ptr_mut(stat) {
        let n = unsafe {
            *seen += 1;
            *seen
        };
        if n & (n - 1) == 0 {
            debug!(ctx, "rl: event {} seen {} times on this cpu", stat, n);
        }
    }
}
