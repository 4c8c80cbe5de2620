//! Envoy's per-descriptor `limit` override (`RateLimitDescriptor.limit`,
//! which a route's rate-limit action sets, often from dynamic metadata),
//! applied as Envoy's own rate-limit service applies it: in a domain that
//! has rules, the descriptor is limited at `requests_per_unit` per unit.
//! - Matched by a rule with a token bucket, a window or the sliding log:
//!   with that rule's algorithm (a sliding log's by a sliding window: a
//!   log's memory grows with its limit, which the override sets), name,
//!   action and `drain_over_limit`, in buckets of the override's own
//!   (burst: the limit; soft and elastic modes do not apply). The rule's
//!   own buckets are not charged.
//! - Matched by no rule: a fixed window per distinct descriptor (keys and
//!   values), counted under the name [`UNMATCHED`].
//! - `requests_per_unit = 0`: every request is over the limit.
//!
//! Not applied, so that the matching rule decides (counted in
//! `rl_l7_limit_overrides_ignored_total`, warned about once per reason): a
//! unit Envoy's enum does not name, a `concurrency` or `scope = "cluster"`
//! rule (whose limits are a semaphore, or shared through Redis), a limit
//! above what a rule of its algorithm may have, more than [`MAX_OVERRIDES`]
//! distinct overrides each charged within two of its periods (one idle
//! longer is forgotten to make room), or `[l7] apply_limit_overrides =
//! false`. A different limit for one descriptor is another override, with
//! buckets of its own.
//!
//! Each distinct override (rule, or descriptor keys, and limit) is compiled
//! once into a rule of its own, with a slot for its bucket keys; a reload
//! that keeps its rule (or, matched by none, its domain) keeps it and its
//! buckets.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        Arc, Mutex,
    },
};

use super::{now_ns, rule_id, Compiled, Counters, DescriptorEntry, Engine, Status, NS};
use crate::{
    config::rules::{Action, Algorithm, Mode, Rate, RuleLimit, Scope, Unit},
    l7::rules::{Entry, L7Algorithm, L7Rule},
};

/// The rule name of overrides that no rule matched (no rule can have it:
/// rule names are a-z, 0-9, `_` and `-`).
pub const UNMATCHED: &str = "(override)";
/// Distinct overrides held at once; past it, they are not applied.
pub const MAX_OVERRIDES: usize = 1024;

/// A limit Envoy sent with a descriptor: `requests` per `per_secs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LimitOverride {
    pub requests: u32,
    pub per_secs: u64,
}

impl LimitOverride {
    /// Envoy's `requests_per_unit` per `unit` (`envoy.type.v3.RateLimitUnit`;
    /// a month is 30 days and a year 365, as Envoy's service counts them).
    /// `None` for a unit the enum does not name.
    pub fn from_envoy(requests: u32, unit: i32) -> Option<LimitOverride> {
        const DAY: u64 = 86_400;
        let per_secs = match unit {
            1 => 1,
            2 => 60,
            3 => 3_600,
            4 => DAY,
            5 => 30 * DAY,
            6 => 365 * DAY,
            7 => 7 * DAY,
            _ => return None,
        };
        Some(LimitOverride { requests, per_secs })
    }
}

/// What makes two overrides one: the matching rule's id (or, matched by
/// none, the descriptor's keys) and the limit.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Id {
    domain: String,
    base: Option<u64>,
    keys: Vec<String>,
    limit: LimitOverride,
}

/// A compiled override, and when it was last charged (monotonic ns).
#[derive(Clone)]
struct Made {
    c: Arc<Compiled>,
    used: u64,
}

/// The overrides an engine has compiled.
pub(in crate::l7) struct Overrides {
    made: Mutex<HashMap<Id, Made>>,
    /// Decisions of overrides that no rule matched (kept across reloads).
    pub(super) unmatched: Arc<Counters>,
}

pub(in crate::l7) type Table = Arc<Overrides>;

impl Overrides {
    /// The rules made for overrides (for the collector, and a reload that
    /// keeps their buckets).
    pub(super) fn rules(&self) -> Vec<Arc<Compiled>> {
        self.lock().values().map(|m| m.c.clone()).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Id, Made>> {
        self.made.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The table of a new engine with `rules`: `previous`'s own, shared (the
/// engine it replaces serves until the swap, and an override it makes
/// meanwhile is kept), without the overrides whose rule is gone or changed
/// (matched by none: whose domain no longer has rules).
pub(super) fn kept(
    previous: Option<&Table>,
    rules: &[Compiled],
    by_domain: &HashMap<String, Vec<usize>>,
) -> Table {
    let Some(p) = previous else {
        return Arc::new(Overrides {
            made: Mutex::new(HashMap::new()),
            unmatched: Arc::default(),
        });
    };
    let ids: HashSet<u64> = rules.iter().map(|c| c.id).collect();
    p.lock().retain(|id, _| match id.base {
        Some(b) => ids.contains(&b),
        None => by_domain.contains_key(&id.domain),
    });
    p.clone()
}

/// Why an override was not applied, warned about once each.
#[derive(Clone, Copy)]
pub enum Ignored {
    Off,
    Unit,
    Rule,
    Full,
    Range,
}

/// Counts an override not applied, and warns the first time for `why`.
pub fn ignored(domain: &str, why: Ignored) {
    static WARNED: [AtomicBool; 5] = [const { AtomicBool::new(false) }; 5];
    crate::l7::OVERRIDES_IGNORED.fetch_add(1, Relaxed);
    let text = match why {
        Ignored::Off => return,
        Ignored::Unit => "its unit is not one of Envoy's RateLimitUnit values",
        Ignored::Rule => "the matching [[l7.rule]] is a concurrency or scope = \"cluster\" rule",
        Ignored::Full => {
            "rl holds 1024 distinct overrides already, each charged within two of its periods"
        }
        Ignored::Range => "its requests_per_unit is more than a rule of that algorithm may allow",
    };
    if !WARNED[why as usize].swap(true, Relaxed) {
        tracing::warn!(
            domain,
            "Envoy sent a descriptor limit override (RateLimitDescriptor.limit) that rl does not apply: {text}; the matching [[l7.rule]] decides (rl_l7_limit_overrides_ignored_total counts these)"
        );
    }
}

impl Engine {
    /// Charges `hits` to the bucket of one descriptor under Envoy's limit
    /// override `o` (see the module's doc). `None` when it is not applied:
    /// the descriptor's rule then decides ([`Engine::decide_scoped`]).
    pub fn decide_overridden(
        &self,
        domain: &str,
        entries: &[DescriptorEntry],
        hits: i64,
        o: LimitOverride,
    ) -> Option<Status> {
        self.decide_overridden_at(domain, entries, hits, o, now_ns())
    }

    /// [`Engine::decide_overridden`] at monotonic time `now`.
    pub fn decide_overridden_at(
        &self,
        domain: &str,
        entries: &[DescriptorEntry],
        hits: i64,
        o: LimitOverride,
        now: u64,
    ) -> Option<Status> {
        let Some(t) = &self.overrides else {
            ignored(domain, Ignored::Off);
            return None;
        };
        // An unknown domain: unmatched, as without the override.
        self.by_domain.get(domain)?;
        let base = self.matching(domain, entries);
        if base.is_some_and(|c| {
            c.cluster.is_some() || matches!(c.rule.algorithm, L7Algorithm::Concurrency { .. })
        }) {
            ignored(domain, Ignored::Rule);
            return None;
        }
        if o.requests == 0 {
            return Some(self.refused(t, base, o, hits));
        }
        if !fits(base.map(|c| c.rule.algorithm), o) {
            ignored(domain, Ignored::Range);
            return None;
        }
        let id = Id {
            domain: domain.to_string(),
            base: base.map(|c| c.id),
            keys: match base {
                Some(_) => Vec::new(),
                None => entries.iter().map(|e| e.key.clone()).collect(),
            },
            limit: o,
        };
        let c = {
            let mut made = t.lock();
            if let Some(m) = made.get_mut(&id) {
                m.used = m.used.max(now);
                m.c.clone()
            } else {
                if made.len() >= MAX_OVERRIDES && !evict_idle(&mut made, now) {
                    drop(made);
                    ignored(domain, Ignored::Full);
                    return None;
                }
                let rule = rule_of(base, domain, entries, o);
                let counters = base.map_or_else(|| t.unmatched.clone(), |c| c.counters.clone());
                let slot = self.next_slot.fetch_add(1, Relaxed);
                let c = Arc::new(Compiled::new(rule.clone(), rule_id(&rule), slot, counters));
                made.insert(
                    id,
                    Made {
                        c: c.clone(),
                        used: now,
                    },
                );
                c
            }
        };
        let st = self.charge_here(&c, entries, hits, now);
        Some(self.counted(&c, st))
    }

    /// The answer under a limit of 0: over the limit (a refund is ok),
    /// counted as the rule's (or, matched by none, as [`UNMATCHED`]'s).
    fn refused(
        &self,
        t: &Overrides,
        base: Option<&Compiled>,
        o: LimitOverride,
        hits: i64,
    ) -> Status {
        let st = Status {
            code: if hits < 0 { "ok" } else { "over_limit" },
            rule: base.map_or(UNMATCHED, |c| c.rule.name.as_str()).to_string(),
            limit: 0,
            per_secs: o.per_secs,
            remaining: 0,
            reset_ms: 0,
            retry_after_ms: o.per_secs * 1000,
            shadow: false,
            enforced: true,
        };
        match base {
            Some(c) => {
                let st = Status {
                    enforced: c.rule.action != Action::Shadow,
                    ..st
                };
                self.counted(c, st)
            }
            None => {
                let n = if st.code == "ok" {
                    &t.unmatched.ok
                } else {
                    &t.unmatched.over
                };
                n.fetch_add(1, Relaxed);
                st
            }
        }
    }
}

/// Whether `o` is a limit a rule with `algorithm` (matched by none: a
/// fixed window) may have: within what its state counts, and a token
/// bucket's span within 2^63 ns.
fn fits(algorithm: Option<L7Algorithm>, o: LimitOverride) -> bool {
    let n = u64::from(o.requests);
    match algorithm.unwrap_or(L7Algorithm::Packet(Algorithm::FixedWindow)) {
        // A sliding log's override is decided by a sliding window.
        L7Algorithm::SlidingLog | L7Algorithm::Packet(Algorithm::SlidingWindow) => {
            n <= rl_common::window::SLIDING_MAX
        }
        L7Algorithm::Packet(Algorithm::FixedWindow) => n <= rl_common::window::FIXED_MAX,
        L7Algorithm::Packet(Algorithm::TokenBucket) => {
            n <= crate::config::rules::MAX_RULE_RATE
                && crate::config::rules::representable(n, o.per_secs, n)
        }
        L7Algorithm::Concurrency { .. } => false,
    }
}

/// Forgets the override charged longest ago, if that was two of its
/// periods ago or more: its buckets are fresh then (a sliding window's
/// previous window counts for one period more), so forgetting it changes
/// no decision, and the collector frees them. Whether one went.
fn evict_idle(made: &mut HashMap<Id, Made>, now: u64) -> bool {
    let idle = made
        .iter()
        .filter(|(id, m)| m.used.saturating_add(2 * id.limit.per_secs * NS) <= now)
        .min_by_key(|(_, m)| m.used)
        .map(|(id, _)| id.clone());
    idle.is_some_and(|id| made.remove(&id).is_some())
}

/// The rule an override decides by: `base`'s with the override's limit
/// (exact, local, on buckets of its own), or a fixed window over
/// `entries`' keys.
fn rule_of(
    base: Option<&Compiled>,
    domain: &str,
    entries: &[DescriptorEntry],
    o: LimitOverride,
) -> L7Rule {
    let rate = Rate {
        amount: o.requests.into(),
        per_secs: o.per_secs,
        burst: o.requests.into(),
    };
    let limits = |unit| vec![RuleLimit { unit, rate }];
    match base {
        Some(c) => L7Rule {
            // A log holds a time per hit, and Envoy's metadata sets the
            // limit: a sliding window keeps a key in one word whatever it.
            algorithm: match c.rule.algorithm {
                L7Algorithm::SlidingLog => L7Algorithm::Packet(Algorithm::SlidingWindow),
                a => a,
            },
            limits: limits(c.rule.limits.first().map_or(Unit::Packets, |l| l.unit)),
            mode: Mode::Hard,
            scope: Scope::Local,
            batch_ms: None,
            ..c.rule.clone()
        },
        None => L7Rule {
            name: UNMATCHED.to_string(),
            domain: domain.to_string(),
            descriptor: entries
                .iter()
                .map(|e| Entry {
                    key: e.key.clone(),
                    value: None,
                })
                .collect(),
            algorithm: L7Algorithm::Packet(Algorithm::FixedWindow),
            limits: limits(Unit::Packets),
            action: Action::Drop,
            mode: Mode::Hard,
            scope: Scope::Local,
            batch_ms: None,
            drain: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{super::tests::d, *};
    use crate::config::Config;

    fn engine(extra: &str) -> Engine {
        let c = Config::from_str(
            &format!(
                "[default]\nrate = 1\n[l7]\nmax_keys = 100\n{extra}\n\
                 [[l7.rule]]\nname = \"reads\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 10\nper = \"1m\"\nalgorithm = \"sliding_log\"\n\
                 [[l7.rule]]\nname = \"uploads\"\ndomain = \"api\"\ndescriptor = [{{ key = \"op\" }}]\nalgorithm = \"concurrency\"\nmax = 2\n"
            ),
            "t",
        )
        .unwrap();
        Engine::new(&c.l7, 0, None)
    }

    const PER_MINUTE_2: LimitOverride = LimitOverride {
        requests: 2,
        per_secs: 60,
    };

    fn codes(
        e: &Engine,
        desc: &[DescriptorEntry],
        o: LimitOverride,
        n: usize,
        now: u64,
    ) -> Vec<&'static str> {
        (0..n)
            .map(|_| {
                e.decide_overridden_at("api", desc, 1, o, now)
                    .expect("applied")
                    .code
            })
            .collect()
    }

    #[test]
    fn an_override_limits_a_matched_descriptor_in_buckets_of_its_own_a_logs_by_a_sliding_window() {
        let e = engine("");
        let alice = d(&[("user", "alice")]);
        assert_eq!(
            codes(&e, &alice, PER_MINUTE_2, 3, NS),
            ["ok", "ok", "over_limit"]
        );
        let st = e
            .decide_overridden_at("api", &alice, 1, PER_MINUTE_2, 2 * NS)
            .unwrap();
        assert_eq!((st.rule.as_str(), st.limit, st.per_secs), ("reads", 2, 60));
        // The rule's own bucket was not charged: 10 per minute still.
        for _ in 0..10 {
            assert_eq!(e.decide_at("api", &alice, 1, 3 * NS).code, "ok");
        }
        assert_eq!(e.decide_at("api", &alice, 1, 3 * NS).code, "over_limit");
        // Another user, another bucket; a larger override, its own.
        assert_eq!(
            codes(&e, &d(&[("user", "bob")]), PER_MINUTE_2, 2, 4 * NS),
            ["ok", "ok"]
        );
        let big = LimitOverride {
            requests: 1000,
            per_secs: 1,
        };
        assert_eq!(codes(&e, &alice, big, 5, 5 * NS), ["ok"; 5]);
        // Decided by a sliding window, not the rule's log (whose memory
        // grows with the limit): a minute after the first two, the window
        // still weighs them; the minute after, room again.
        assert_eq!(
            codes(&e, &alice, PER_MINUTE_2, 1, 61 * NS + NS / 2),
            ["over_limit"]
        );
        assert_eq!(codes(&e, &alice, PER_MINUTE_2, 1, 121 * NS), ["ok"]);
        let (_, c) = e.counters().find(|(n, _)| *n == "reads").unwrap();
        assert!(c.over.load(Relaxed) >= 3, "counted under the rule");
    }

    #[test]
    fn an_override_in_a_known_domain_that_no_rule_matches_is_a_fixed_window_per_descriptor() {
        let e = engine("");
        let t1 = d(&[("tenant", "t1")]);
        let per_second_3 = LimitOverride {
            requests: 3,
            per_secs: 1,
        };
        assert_eq!(
            codes(&e, &t1, per_second_3, 4, 10 * NS),
            ["ok", "ok", "ok", "over_limit"]
        );
        let st = e
            .decide_overridden_at("api", &t1, 1, per_second_3, 10 * NS)
            .unwrap();
        assert_eq!((st.rule.as_str(), st.limit, st.per_secs), (UNMATCHED, 3, 1));
        // Other values and other keys are other descriptors.
        assert_eq!(
            codes(&e, &d(&[("tenant", "t2")]), per_second_3, 3, 10 * NS),
            ["ok"; 3]
        );
        assert_eq!(
            codes(&e, &d(&[("team", "t1")]), per_second_3, 3, 10 * NS),
            ["ok"; 3]
        );
        // The next window.
        assert_eq!(codes(&e, &t1, per_second_3, 1, 11 * NS), ["ok"]);
        let (_, c) = e.counters().find(|(n, _)| *n == UNMATCHED).unwrap();
        assert_eq!(
            (c.ok.load(Relaxed), c.over.load(Relaxed)),
            (3 + 3 + 3 + 1, 2)
        );
        // Unknown domains stay unmatched.
        assert!(e
            .decide_overridden_at("nowhere", &t1, 1, per_second_3, 11 * NS)
            .is_none());
    }

    #[test]
    fn a_zero_limit_refuses_everything_and_concurrency_rules_and_a_switched_off_engine_ignore_overrides(
    ) {
        let e = engine("");
        let zero = LimitOverride {
            requests: 0,
            per_secs: 60,
        };
        let st = e
            .decide_overridden_at("api", &d(&[("user", "a")]), 1, zero, NS)
            .unwrap();
        assert_eq!(
            (st.code, st.rule.as_str(), st.limit),
            ("over_limit", "reads", 0)
        );
        assert_eq!(
            e.decide_overridden_at("api", &d(&[("x", "a")]), 1, zero, NS)
                .unwrap()
                .code,
            "over_limit"
        );
        let before = crate::l7::OVERRIDES_IGNORED.load(Relaxed);
        assert!(e
            .decide_overridden_at("api", &d(&[("op", "upload")]), 1, PER_MINUTE_2, NS)
            .is_none());
        let off = engine("apply_limit_overrides = false");
        assert!(off
            .decide_overridden_at("api", &d(&[("user", "a")]), 1, PER_MINUTE_2, NS)
            .is_none());
        assert!(crate::l7::OVERRIDES_IGNORED.load(Relaxed) >= before + 2);
    }

    #[test]
    fn an_override_above_what_its_algorithm_counts_is_not_applied() {
        let e = engine("");
        let before = crate::l7::OVERRIDES_IGNORED.load(Relaxed);
        // The sliding log rule's override is a sliding window: 28 bits.
        let window_max = rl_common::window::SLIDING_MAX as u32;
        let over = LimitOverride {
            requests: window_max + 1,
            per_secs: 60,
        };
        let alice = d(&[("user", "alice")]);
        assert!(
            e.decide_overridden_at("api", &alice, 1, over, NS).is_none(),
            "a sliding window's cap"
        );
        assert!(crate::l7::OVERRIDES_IGNORED.load(Relaxed) > before);
        let at_max = LimitOverride {
            requests: window_max,
            per_secs: 60,
        };
        assert!(e
            .decide_overridden_at("api", &alice, 1, at_max, NS)
            .is_some());
        // Matched by none: a fixed window counts any u32.
        let huge = LimitOverride {
            requests: u32::MAX,
            per_secs: 365 * 86_400,
        };
        let st = e
            .decide_overridden_at("api", &d(&[("x", "1")]), 1, huge, NS)
            .unwrap();
        assert_eq!((st.code, st.limit), ("ok", u64::from(u32::MAX)));
    }

    #[test]
    fn a_reload_keeps_an_overrides_buckets_and_the_collector_frees_them_when_fresh() {
        let e = engine("");
        let alice = d(&[("user", "alice")]);
        let o = LimitOverride {
            requests: 2,
            per_secs: 1,
        };
        let t = d(&[("tenant", "t1")]);
        assert_eq!(codes(&e, &alice, o, 3, NS), ["ok", "ok", "over_limit"]);
        assert_eq!(codes(&e, &t, o, 3, NS), ["ok", "ok", "over_limit"]);
        let c = Config::from_str(
            "[default]\nrate = 1\n[l7]\nmax_keys = 100\n\
             [[l7.rule]]\nname = \"reads\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 10\nper = \"1m\"\nalgorithm = \"sliding_log\"\n",
            "t",
        )
        .unwrap();
        let e2 = Engine::new(&c.l7, 0, Some(&e));
        assert_eq!(
            codes(&e2, &alice, o, 1, NS),
            ["over_limit"],
            "kept by the reload"
        );
        assert_eq!(
            codes(&e2, &t, o, 1, NS),
            ["over_limit"],
            "kept by the reload"
        );
        assert_eq!(e2.keys(), 2);
        assert_eq!(e2.collect_at(NS + NS / 2), 0, "not fresh yet");
        assert_eq!(e2.collect_at(3 * NS), 2, "fresh: both collected");
        assert_eq!(e2.keys(), 0);
        // A reload that changes the rule drops its overrides.
        let c = Config::from_str(
            "[default]\nrate = 1\n[l7]\nmax_keys = 100\n\
             [[l7.rule]]\nname = \"reads\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 11\nper = \"1m\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(codes(&e2, &alice, o, 2, 4 * NS), ["ok", "ok"]);
        let e3 = Engine::new(&c.l7, 0, Some(&e2));
        assert_eq!(
            codes(&e3, &alice, o, 1, 4 * NS),
            ["ok"],
            "a new rule, new buckets"
        );
    }

    #[test]
    fn at_most_max_overrides_are_held_the_longest_idle_goes_after_two_periods_and_envoys_units_are_read(
    ) {
        let e = engine("");
        let t = d(&[("tenant", "t1")]);
        for n in 1..=MAX_OVERRIDES as u32 {
            let o = LimitOverride {
                requests: n,
                per_secs: 1,
            };
            assert!(e
                .decide_overridden_at("api", &t, 1, o, NS + u64::from(n) * 1000)
                .is_some());
        }
        let o = LimitOverride {
            requests: 5000,
            per_secs: 1,
        };
        assert!(
            e.decide_overridden_at("api", &t, 1, o, 2 * NS).is_none(),
            "one too many while all were charged within two periods"
        );
        // Two seconds on, the one charged first goes: its buckets are fresh.
        assert!(e
            .decide_overridden_at("api", &t, 1, o, 3 * NS + 1500)
            .is_some());
        let first = LimitOverride {
            requests: 1,
            per_secs: 1,
        };
        assert!(
            e.decide_overridden_at("api", &t, 1, first, 3 * NS + 1600)
                .is_none(),
            "the next oldest was charged less than two seconds ago"
        );
        let secs: Vec<Option<u64>> = (0..=8)
            .map(|u| LimitOverride::from_envoy(1, u).map(|o| o.per_secs))
            .collect();
        assert_eq!(
            secs,
            [
                None,
                Some(1),
                Some(60),
                Some(3600),
                Some(86_400),
                Some(2_592_000),
                Some(31_536_000),
                Some(604_800),
                None
            ]
        );
    }
}
