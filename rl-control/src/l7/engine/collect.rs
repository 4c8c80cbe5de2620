//! Forgetting request buckets whose state is fresh again (a full token
//! bucket, a window past, an empty log or no permit out): no decision
//! changes, and the store stays within `max_keys`. The daemon sweeps the
//! shards one at a time, spread over each second.

use std::{collections::HashMap, sync::atomic::Ordering};

use super::{now_ns, Bucket, Compiled, Engine, NS, OVERFLOW, POOL, SHARDS};

impl Engine {
    /// Drops buckets whose state is fresh again (a full token bucket, a
    /// window past, an empty log or no permit out): forgetting them changes
    /// no decision. Returns how many went.
    pub fn collect(&self) -> u64 {
        self.collect_at(now_ns())
    }

    /// [`Engine::collect`] at monotonic time `now`.
    pub fn collect_at(&self, now: u64) -> u64 {
        (0..SHARDS).map(|i| self.collect_shard_at(i, now)).sum()
    }

    /// The store's shards, which [`Engine::collect_shard`] sweeps one by one.
    pub const SHARDS: usize = SHARDS;

    /// [`Engine::collect`] over shard `i` alone: the daemon sweeps the
    /// shards in turn, spread over each second, so that no sweep of a
    /// million keys takes a CPU (and a shard lock) for long at once.
    pub fn collect_shard(&self, i: usize) -> u64 {
        self.collect_shard_at(i, now_ns())
    }

    fn collect_shard_at(&self, i: usize, now: u64) -> u64 {
        let mut gone = 0;
        {
            let mut m = self.shards[i % SHARDS]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // The overrides' rules read under the shard's lock: one made
            // since is charged only once the sweep is over.
            let made = self
                .overrides
                .as_ref()
                .map(|t| t.rules())
                .unwrap_or_default();
            let by_slot: HashMap<u32, &Compiled> = self
                .rules
                .iter()
                .chain(made.iter().map(|c| &**c))
                .map(|c| (c.slot, c))
                .collect();
            m.retain(|key, b| {
                let values = key.values();
                let keep = by_slot.get(&key.slot).is_some_and(|c| match b {
                    Bucket::One(w) if values == POOL => c
                        .pool
                        .is_some_and(|p| !p.is_fresh(*w, now, self.epoch_offset_ns)),
                    Bucket::One(w) => !c.limits[0].is_fresh(*w, now, self.epoch_offset_ns),
                    Bucket::Words(w) => !c
                        .limits
                        .iter()
                        .zip(w.iter())
                        .all(|(l, w)| l.is_fresh(*w, now, self.epoch_offset_ns)),
                    Bucket::Log(logs) => !logs.iter().zip(&c.rule.limits).all(|(log, l)| {
                        log.newest().is_none_or(|t| t + l.rate.per_secs * NS <= now)
                    }),
                    Bucket::Leases(leases) => match c.rule.algorithm {
                        super::L7Algorithm::Concurrency { lease_secs, .. } => {
                            leases.newest().is_some_and(|t| t + lease_secs * NS > now)
                        }
                        _ => true,
                    },
                });
                if !keep && values != OVERFLOW && values != POOL {
                    gone += 1;
                }
                keep
            });
        }
        self.keys
            .fetch_sub(gone.min(self.keys()), Ordering::Relaxed);
        gone
    }
}
