//! Where a request decision is made: in this daemon's buckets, or for a
//! `scope = "cluster"` rule in Redis, shared by every daemon; while Redis
//! cannot answer (within `timeout`), by `[cluster] on_failure`.

use std::sync::atomic::Ordering::Relaxed;

use super::{
    engine::{now_ns, Compiled, DescriptorEntry, Engine, Status},
    rules::L7Algorithm,
};
use crate::cluster::{requests::Answer, OnFailure};

impl Engine {
    /// Charges `hits` to the bucket of one descriptor, wherever the rule's
    /// scope keeps it. Front ends call this; [`Engine::decide`] is the
    /// local part.
    pub async fn decide_scoped(
        &self,
        domain: &str,
        entries: &[DescriptorEntry],
        hits: i64,
    ) -> Status {
        let Some(c) = self.matching(domain, entries) else {
            self.unmatched.fetch_add(1, Relaxed);
            return Status::unmatched();
        };
        let (Some(prepared), Some(cluster)) = (&c.cluster, &self.cluster) else {
            let st = self.charge_here(c, entries, hits, now_ns());
            return self.counted(c, st);
        };
        let mismatched = cluster.is_mismatched(&crate::cluster::requests::member_name(&c.rule));
        if let Some(interval) = c.batch_ns {
            // Batched: decided here; the hits travel to Redis every batch.
            // Degraded, or defined differently by another host: as
            // `on_failure` says, as an unbatched rule answers.
            // Counted as a fallback either way (`local` too: it is
            // decided here alone, its hits not shared).
            if cluster.is_degraded() || mismatched {
                cluster.health.fallbacks.fetch_add(1, Relaxed);
                if cluster.config.on_failure != OnFailure::Local {
                    return self.counted(
                        c,
                        fixed(c, cluster.config.on_failure == OnFailure::Open || hits < 0),
                    );
                }
            }
            let now = now_ns();
            let st = self.charge_here(c, entries, hits, now);
            let key = Engine::key_of(c, entries);
            // Only keys with a bucket of their own (not the overflow bucket
            // of a full store): accounts stay bounded by max_keys.
            if st.code == "ok" && hits > 0 && !mismatched && self.holds(&key) {
                let (cost, burst) = c.limits.first().map_or((1, 0), |l| (l.a, l.b));
                self.batch
                    .record(key, hits as u64, cost, burst, interval, now, || {
                        prepared.batch_names(values_key(entries))
                    });
            }
            return self.counted(c, st);
        }
        let answer = if mismatched {
            None
        } else {
            // Boxed: the Redis call's state is large (over a kilobyte), and
            // unboxed it would be part of every decision's future, moved
            // and copied with it, local ones included.
            Box::pin(prepared.decide(cluster, values_key(entries), hits))
                .await
                .ok()
        };
        let st = match answer {
            Some(a) => from_answer(c, a).for_hits(hits),
            None => {
                cluster.health.fallbacks.fetch_add(1, Relaxed);
                match cluster.config.on_failure {
                    OnFailure::Local => self.charge_here(c, entries, hits, now_ns()),
                    OnFailure::Open => fixed(c, true),
                    OnFailure::Closed => fixed(c, hits < 0),
                }
            }
        };
        self.counted(c, st)
    }

    /// What the next request with this descriptor would meet, without
    /// charging anything, wherever its rule keeps the state: an unbatched
    /// `scope = "cluster"` rule's is in Redis (asked with 0 hits, which
    /// changes nothing; while Redis does not answer, `on_failure`'s), the
    /// rest here.
    pub async fn peek_scoped(&self, domain: &str, entries: &[DescriptorEntry]) -> Status {
        let Some(c) = self.matching(domain, entries) else {
            return Status::unmatched();
        };
        let (Some(prepared), Some(cluster), None) = (&c.cluster, &self.cluster, c.batch_ns) else {
            return self.peek(domain, entries);
        };
        let answer = match cluster.is_mismatched(&crate::cluster::requests::member_name(&c.rule)) {
            true => None,
            false => Box::pin(prepared.decide(cluster, values_key(entries), 0))
                .await
                .ok(),
        };
        let mut st = match (answer, cluster.config.on_failure) {
            (Some(a), _) => from_answer(c, a),
            (None, OnFailure::Local) => return self.peek(domain, entries),
            (None, OnFailure::Open) => fixed(c, true),
            (None, OnFailure::Closed) => fixed(c, false),
        };
        st.code = if st.remaining > 0 { "ok" } else { "over_limit" };
        st
    }
}

/// The descriptor's values as every daemon hashes them (128 bits).
fn values_key(entries: &[DescriptorEntry]) -> [u64; 2] {
    let values: Vec<&str> = entries.iter().map(|e| e.value.as_str()).collect();
    let h = |seed| crate::compile::stable_hash(&values, seed);
    [h(0x5bd1_e995), h(0x27d4_eb2f_1656_67c5)]
}

/// The limit a status reports: the rule's `index`th (for `concurrency`, its
/// max per lease).
fn limit_of(c: &Compiled, index: usize) -> (u64, u64) {
    match c.rule.algorithm {
        L7Algorithm::Concurrency { max, lease_secs } => (max, lease_secs),
        _ => c
            .rule
            .limits
            .get(index)
            .map_or((0, 0), |l| (l.rate.amount, l.rate.per_secs)),
    }
}

fn status(c: &Compiled, ok: bool, index: usize) -> Status {
    let (limit, per_secs) = limit_of(c, index);
    Status {
        code: if ok { "ok" } else { "over_limit" },
        rule: c.rule.name.clone(),
        limit,
        per_secs,
        remaining: 0,
        reset_ms: 0,
        retry_after_ms: 0,
        shadow: false,
        enforced: c.rule.action != crate::config::rules::Action::Shadow,
    }
}

fn from_answer(c: &Compiled, a: Answer) -> Status {
    Status {
        remaining: a.remaining,
        reset_ms: a.reset_ms,
        retry_after_ms: a.retry_after_ms,
        ..status(c, a.ok, a.index)
    }
}

/// `on_failure = "open"` (everything passes) or `"closed"` (nothing does,
/// but refunds): no bucket is charged, and the headers say so.
fn fixed(c: &Compiled, ok: bool) -> Status {
    let mut s = status(c, ok, 0);
    if ok {
        s.remaining = s.limit;
    } else {
        s.retry_after_ms = 1000;
    }
    s
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{cluster::Cluster, config::Config};

    /// An engine with one batched cluster rule `b` (domain `api`, keyed by
    /// `user`) under `on_failure`, its cluster (degraded until told), and
    /// a decision of one hit for user `u`.
    fn batched(on_failure: &str) -> (Engine, Arc<Cluster>) {
        let text = format!(
            "[default]\nrate = 1\n[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"n\"\non_failure = \"{on_failure}\"\n\
             [[l7.rule]]\nname = \"b\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 100\nscope = \"cluster\"\nbatch = \"10ms\"\n"
        );
        let config = Config::from_str(&text, "rl.toml").unwrap();
        let cluster = Cluster::new(config.cluster.clone().unwrap());
        (
            Engine::new(&config.l7, 0, None).with_cluster(Some(cluster.clone())),
            cluster,
        )
    }

    fn decide(engine: &Engine) -> Status {
        let user = [DescriptorEntry {
            key: "user".into(),
            value: "u".into(),
        }];
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(engine.decide_scoped("api", &user, 1))
    }

    /// A batched cluster rule that another host defines differently
    /// answers from `on_failure`, as an unbatched one does (it decided
    /// here and sent its hits to its own keys, as if shared).
    #[test]
    fn a_mismatched_batched_rule_answers_from_on_failure() {
        let (engine, cluster) = batched("closed");
        cluster.set_mismatched(Vec::new());
        assert_eq!(decide(&engine).code, "ok", "shared: decided here, batched");
        cluster.set_mismatched(vec!["l7:b".into()]);
        assert_eq!(
            decide(&engine).code,
            "over_limit",
            "defined differently elsewhere: on_failure = closed"
        );
    }

    /// A batched rule decided here alone while the cluster is degraded
    /// (`on_failure = "local"`) counts as a fallback, as an unbatched one
    /// does; a shared decision does not.
    #[test]
    fn a_batched_rule_decided_alone_counts_as_a_fallback() {
        let (engine, cluster) = batched("local");
        // A new handle is degraded until its first probe answers.
        assert_eq!(decide(&engine).code, "ok");
        assert_eq!(
            cluster.health.fallbacks.load(Relaxed),
            1,
            "decided here alone while degraded"
        );
        cluster.set_mismatched(Vec::new());
        assert_eq!(decide(&engine).code, "ok");
        assert_eq!(
            cluster.health.fallbacks.load(Relaxed),
            1,
            "shared: no fallback"
        );
    }
}
