//! Request rules with `batch = "10ms"`: decided at once from this daemon's
//! own token bucket (no Redis round trip per decision), and every `batch`
//! the hits each key took here travel to Redis with the packet rules'
//! script (`sync.lua`): Redis charges them to the key's cluster bucket and
//! answers how far ahead it is; the daemon moves its own bucket up to it.
//!
//! The bound is the packet rules' with `T = batch` and nothing unreported:
//! over any span τ, N daemons allow at most `R·τ + N·B + (N−1)·R·(T+δ)`
//! requests of one key.

use std::{collections::HashMap, sync::Mutex};

use super::packets::Line;

/// A batched key's account.
#[derive(Clone, Debug)]
struct Account {
    key: String,
    slot: String,
    ns_per_unit: u64,
    interval_ns: u64,
    burst_ns: u64,
    /// Hits taken here and not yet sent.
    unsent: u64,
    /// Hits sent but not acknowledged (they travel again, charged once).
    unacked: u64,
    /// Hits this daemon run sent in total.
    cum: u64,
    last_ns: u64,
}

/// The engine's key of a request bucket (rule slot, values hash).
pub type LocalKey = crate::l7::engine::Key;

/// Hits of batched keys on their way to Redis. Shared by the engines a
/// reload swaps in, like the buckets.
#[derive(Default)]
pub struct Batch {
    accounts: Mutex<Accounts>,
}

#[derive(Default)]
struct Accounts {
    by_key: HashMap<LocalKey, Account>,
    /// Every hit this daemon run sent, summed: a new account (a key never
    /// sent, or forgotten while Redis kept its ledger) counts on from here,
    /// so its count is above any this run sent for that key before, and
    /// Redis charges its hits in full (a count below its ledger is a stale
    /// report, charged nothing).
    base: u64,
}

impl Batch {
    /// Records `hits` taken here by `local` (a limit of `ns_per_unit` per
    /// hit holding `burst_ns`); `names` gives its Redis key and hash tag
    /// the first time.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        local: LocalKey,
        hits: u64,
        ns_per_unit: u64,
        burst_ns: u64,
        interval_ns: u64,
        now: u64,
        names: impl FnOnce() -> (String, String),
    ) {
        let mut a = self.accounts.lock().unwrap_or_else(|e| e.into_inner());
        let base = a.base;
        let acc = a.by_key.entry(local).or_insert_with(|| {
            let (key, slot) = names();
            Account {
                key,
                slot,
                ns_per_unit,
                interval_ns,
                burst_ns,
                unsent: 0,
                unacked: 0,
                cum: base,
                last_ns: now,
            }
        });
        acc.unsent += hits;
        acc.last_ns = now;
    }

    /// The lines to send now (keys with hits not yet acknowledged), and the
    /// keys they belong to. What a key took beyond two batches and its
    /// burst since its last line (an outage) is not sent. Keys idle for
    /// `forget_ns` are forgotten: a later line of theirs counts on from the
    /// run's base, above the old count, so Redis charges it in full.
    pub fn take(&self, now: u64, forget_ns: u64) -> Vec<(LocalKey, Line)> {
        let mut a = self.accounts.lock().unwrap_or_else(|e| e.into_inner());
        let Accounts { by_key, base } = &mut *a;
        by_key.retain(|_, acc| {
            acc.unsent + acc.unacked > 0 || now.saturating_sub(acc.last_ns) < forget_ns
        });
        by_key
            .iter_mut()
            .filter(|(_, acc)| acc.unsent + acc.unacked > 0)
            .map(|(k, acc)| {
                let cap = (2 * acc.interval_ns + acc.burst_ns) / acc.ns_per_unit.max(1) + 1;
                acc.unsent = acc.unsent.min(cap);
                acc.cum += acc.unsent;
                *base += acc.unsent;
                acc.unacked += acc.unsent;
                acc.unsent = 0;
                let line = Line {
                    key: acc.key.clone(),
                    slot: acc.slot.clone(),
                    cum: acc.cum,
                    delta: acc.unacked,
                    ns_per_unit: acc.ns_per_unit,
                    interval_ns: acc.interval_ns,
                };
                (*k, line)
            })
            .collect()
    }

    /// Redis holds what `local` sent up to `cum`.
    pub fn acknowledge(&self, local: &LocalKey, cum: u64) {
        if let Some(acc) = self
            .accounts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_key
            .get_mut(local)
        {
            if acc.cum == cum {
                acc.unacked = 0;
            }
        }
    }

    /// Keys with an account.
    pub fn len(&self) -> usize {
        self.accounts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_key
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key forgotten while Redis kept its ledger counts on above its old
    /// count: Redis charges its new hits in full.
    #[test]
    fn a_forgotten_key_counts_on_above_its_old_count() {
        let b = Batch::default();
        let k = LocalKey::new(1, (7, 7));
        let names = || ("rl:k".to_string(), "s".to_string());
        b.record(k, 500, 1_000, 0, 10_000_000, 0, names);
        let lines = b.take(0, 1_000);
        let old = lines[0].1.cum;
        b.acknowledge(&k, old);
        assert!(
            b.take(5_000, 1_000).is_empty() && b.is_empty(),
            "idle past forget_ns: forgotten"
        );
        b.record(k, 3, 1_000, 0, 10_000_000, 6_000, names);
        let line = &b.take(6_000, 1_000)[0].1;
        assert_eq!(line.delta, 3);
        assert!(line.cum >= old + 3, "{} after {old}", line.cum);
    }
}
