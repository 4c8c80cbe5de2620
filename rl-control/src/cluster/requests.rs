//! Request rules with `scope = "cluster"`: one script call per decision,
//! atomic in Redis and timed by Redis' clock, so every daemon that shares
//! the Redis charges one bucket exactly (token bucket, fixed and sliding
//! window with rl-common's weighting, the sliding log as a sorted set, the
//! semaphore with leases).

use std::sync::LazyLock;

use redis::Script;

use super::{Cluster, Failure};
use crate::{
    config::rules::Algorithm,
    l7::rules::{L7Algorithm, L7Rule},
};

/// The decision script (`decide.lua`), for tools that call it directly.
pub const DECIDE_LUA: &str = include_str!("decide.lua");
static DECIDE: LazyLock<Script> = LazyLock::new(|| Script::new(DECIDE_LUA));

/// Largest `amount × period` (and `burst × period`) in µs a cluster rule may
/// have: Redis' Lua computes in doubles, exact below 2⁵³.
pub const MAX_EXACT: u128 = 1 << 53;

/// The most hits (or refunded hits) sent to `decide.lua`: beyond every
/// limit a cluster rule may have, below the 10^14 where Lua's numbers turn
/// to exponent form.
pub const MAX_LUA_HITS: i64 = 1_000_000_000_000;

/// What Redis answered for one descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub ok: bool,
    /// The limit that speaks for the headers (0-based).
    pub index: usize,
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
}

/// A cluster request rule, ready to call: its script arguments and the
/// prefix of its bucket keys.
#[derive(Clone, Debug)]
pub struct Prepared {
    algorithm: &'static str,
    /// `amount, period µs, burst` per limit.
    limits: Vec<[u64; 3]>,
    /// `rl:l7:{<rule>:<definition>:` — the values' hash and `}` complete it.
    prefix: String,
    logs: usize,
}

/// The namespaced name a request rule registers under.
pub fn member_name(rule: &L7Rule) -> String {
    format!("l7:{}", rule.name)
}

impl Prepared {
    pub fn new(rule: &L7Rule) -> Prepared {
        let us = |secs: u64| secs * 1_000_000;
        let (algorithm, limits, logs) = match rule.algorithm {
            L7Algorithm::Concurrency { max, lease_secs } => {
                ("sem", vec![[max, us(lease_secs), 0]], 1)
            }
            a => {
                let limits: Vec<[u64; 3]> = rule
                    .limits
                    .iter()
                    .map(|l| {
                        let r = l.enforced(rule.mode);
                        [r.amount, us(r.per_secs), r.burst.max(1)]
                    })
                    .collect();
                let name = match a {
                    L7Algorithm::Packet(Algorithm::TokenBucket) => "gcra",
                    L7Algorithm::Packet(Algorithm::FixedWindow) => "fixed",
                    L7Algorithm::Packet(Algorithm::SlidingWindow) => "sliding",
                    _ => "log",
                };
                let logs = if name == "log" { limits.len() } else { 0 };
                (name, limits, logs)
            }
        };
        let definition = crate::compile::stable_hash(rule, 0);
        Prepared {
            algorithm,
            limits,
            prefix: format!("rl:l7:{{{}:{definition:016x}:", rule.name),
            logs,
        }
    }

    /// The Redis key and hash tag of a batched bucket (see
    /// [`super::batched`]): 16 slots per rule.
    pub fn batch_names(&self, values: [u64; 2]) -> (String, String) {
        let slot = format!(
            "{}b{}",
            self.prefix.trim_start_matches("rl:l7:{"),
            values[0] % 16
        );
        (
            format!("rl:b:{{{slot}}}:{:016x}{:016x}", values[0], values[1]),
            slot,
        )
    }

    /// The key of the bucket for descriptor values hashed to `values`.
    pub fn bucket_key(&self, values: [u64; 2]) -> String {
        format!("{}{:016x}{:016x}}}", self.prefix, values[0], values[1])
    }

    /// Charges `hits` (negative: a refund) to the bucket of `values`.
    pub async fn decide(
        &self,
        cluster: &Cluster,
        values: [u64; 2],
        hits: i64,
    ) -> Result<Answer, Failure> {
        // Redis' Lua prints numbers of 10^14 and more in exponent form, which
        // ZPOPMIN refuses as a count (a script error degrades the cluster):
        // more hits than any limit holds are over it all the same, and a
        // refund of them empties the bucket all the same.
        let hits = hits.clamp(-MAX_LUA_HITS, MAX_LUA_HITS);
        let key = self.bucket_key(values);
        let mut inv = DECIDE.prepare_invoke();
        inv.key(&key);
        for i in 0..self.logs {
            inv.key(format!("{key}:z{i}"));
        }
        inv.arg(self.algorithm)
            .arg(hits)
            .arg(self.limits.len())
            .arg(cluster.deadline_us());
        for l in &self.limits {
            inv.arg(l[0]).arg(l[1]).arg(l[2]);
        }
        let (ok, index, remaining, reset_ms, retry_after_ms): (i64, u64, i64, i64, i64) =
            cluster.call(&inv).await?;
        Ok(Answer {
            ok: ok == 1,
            index: index as usize,
            remaining: remaining.max(0) as u64,
            reset_ms: reset_ms.max(0) as u64,
            retry_after_ms: retry_after_ms.max(0) as u64,
        })
    }
}

/// Largest `max` of a `scope = "cluster"` concurrency rule (a local one
/// keeps its permits as runs, whatever their number).
pub const MAX_CLUSTER_PERMITS: u64 = 10_000;

/// Why `rule` cannot be decided exactly in Redis, if it cannot.
pub fn too_large(rule: &L7Rule) -> Option<String> {
    // Redis keeps a sorted-set member per permit held: one acquire of a
    // million hits would write a million members in one script, stalling
    // Redis for every host.
    if let crate::l7::rules::L7Algorithm::Concurrency { max, .. } = rule.algorithm {
        // (Its script only adds the lease to now: no product to bound.)
        return (max > MAX_CLUSTER_PERMITS).then(|| format!("max = {max}: at most {MAX_CLUSTER_PERMITS} for a cluster concurrency rule (Redis keeps a member per permit held)"));
    }
    let p = Prepared::new(rule);
    p.limits.iter().find_map(|[amount, per, burst]| {
        let worst = u128::from(*amount.max(burst)) * u128::from(*per);
        (worst >= MAX_EXACT).then(|| format!("rate or burst × period is {worst} µs-requests: at most 2^53 for a cluster rule (Redis' Lua numbers)"))
    })
}
