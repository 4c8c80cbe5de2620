//! Request decisions: match a descriptor to its rule, charge its bucket.
//!
//! Token bucket and windows use rl-common's step functions on one state
//! word per limit (the datapath's arithmetic, and `quota` for what the
//! headers say); the sliding log keeps one timestamp per allowed request in
//! the window; the semaphore one lease expiry per permit out. Buckets live
//! in 64 mutex-guarded shards, so concurrent decisions on one key are
//! serialised and exact.
//!
//! Memory is bounded by `max_keys`: a collector drops buckets whose state
//! is fresh again (forgetting them changes no decision); when the store is
//! full a new key is charged to its rule's overflow bucket, shared by every
//! key that found no room. A limited key is never evicted by new ones: it
//! fails closed, as packet sources do.

use std::{
    collections::HashMap,
    hash::{Hash, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use rl_common::LimitEntry;

use super::{
    charge::charge,
    rules::{Entry, L7Algorithm, L7Config, L7Rule, MAX_VALUE_LEN},
};
use crate::config::rules::{Action, Algorithm};

mod collect;
pub mod overrides;

pub use overrides::LimitOverride;

const SHARDS: usize = 64;
const NS: u64 = 1_000_000_000;

/// One entry of a request descriptor.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, utoipa::ToSchema)]
pub struct DescriptorEntry {
    pub key: String,
    pub value: String,
}

impl DescriptorEntry {
    /// The entry with a key or value longer than descriptors allow fitted
    /// to [`MAX_VALUE_LEN`]: its start and a hash of the whole, so distinct
    /// values stay distinct. Values come from clients (a long header, a
    /// JWT, a path): refusing them would be a way out of every limit, since
    /// Envoy passes a request whose rate-limit call fails.
    pub fn fitted(self) -> DescriptorEntry {
        DescriptorEntry {
            key: fitted(self.key),
            value: fitted(self.value),
        }
    }
}

/// `v`, or for one longer than [`MAX_VALUE_LEN`] its start and a hash of
/// the whole (a hash every build computes alike: cluster rules' keys are
/// shared between daemons).
pub fn fitted(v: String) -> String {
    if v.len() <= MAX_VALUE_LEN {
        return v;
    }
    let mut cut = MAX_VALUE_LEN - 17;
    while !v.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}#{:016x}",
        &v[..cut],
        crate::compile::stable_hash(&v.as_str(), 0)
    )
}

/// What one descriptor got.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Status {
    /// `ok`, `over_limit`, or `unmatched` (no rule: not limited).
    pub code: &'static str,
    /// The rule that decided (empty when unmatched).
    pub rule: String,
    /// Requests allowed per `per_secs` (for `concurrency`: in flight).
    pub limit: u64,
    pub per_secs: u64,
    pub remaining: u64,
    /// Until the bucket is full (or a permit expires) again, in ms.
    pub reset_ms: u64,
    /// Until one more request would pass, in ms (0 when it would now).
    pub retry_after_ms: u64,
    /// Over the limit but counted only (`action = "shadow"`).
    pub shadow: bool,
    /// The rule is enforced (not `action = "shadow"`): only enforced rules
    /// speak in the rate-limit headers a client sees.
    pub enforced: bool,
}

impl Status {
    /// The status of a charge of `hits`: a check of 0 hits (Envoy's
    /// "check only", before usage charged after the fact) is over the
    /// limit when nothing is left, as a peek is.
    pub(super) fn for_hits(mut self, hits: i64) -> Status {
        if hits == 0 && self.remaining == 0 && self.code == "ok" {
            self.code = "over_limit";
        }
        self
    }

    pub(super) fn unmatched() -> Status {
        Status {
            code: "unmatched",
            rule: String::new(),
            limit: 0,
            per_secs: 0,
            remaining: 0,
            reset_ms: 0,
            retry_after_ms: 0,
            shadow: false,
            enforced: false,
        }
    }
}

/// Per-rule decision counters.
#[derive(Default)]
pub struct Counters {
    pub ok: AtomicU64,
    pub over: AtomicU64,
    pub shadow_over: AtomicU64,
    /// Charges made to the rule's overflow bucket: a key with no bucket of
    /// its own while the store held `max_keys` (such keys share one).
    pub overflow: AtomicU64,
}

pub(super) struct Compiled {
    pub(super) rule: L7Rule,
    /// `scope = "cluster"`: how to ask Redis.
    pub(super) cluster: Option<crate::cluster::requests::Prepared>,
    /// `batch`: decided here, charged to Redis this often (ns).
    pub(super) batch_ns: Option<u64>,
    /// `mode = "elastic"`: the rule's shared pool, a token bucket.
    pool: Option<LimitEntry>,
    /// The rule's identity (a hash of its definition): buckets survive a
    /// reload that leaves the rule unchanged.
    id: u64,
    /// The rule's number in bucket keys: kept with `id` by reloads.
    slot: u32,
    pub(super) limits: Vec<LimitEntry>,
    /// Shared with the previous engine's rule of the same name: the
    /// exported counters go on across reloads (and count what the old
    /// engine still decides while it is swapped out).
    counters: Arc<Counters>,
}

impl Compiled {
    /// `rule` compiled, as number `slot` in bucket keys.
    pub(super) fn new(rule: L7Rule, id: u64, slot: u32, counters: Arc<Counters>) -> Compiled {
        let r = &rule;
        Compiled {
            id,
            slot,
            limits: match r.algorithm {
                L7Algorithm::Packet(a) => r
                    .limits
                    .iter()
                    .map(|l| crate::compile::limit_entry(a, l.unit, &l.enforced(r.mode)))
                    .collect(),
                _ => Vec::new(),
            },
            pool: match r.mode {
                crate::config::rules::Mode::Elastic { pool } => Some(crate::compile::limit_entry(
                    Algorithm::TokenBucket,
                    crate::config::rules::Unit::Packets,
                    &pool,
                )),
                _ => None,
            },
            cluster: (r.scope == crate::config::rules::Scope::Cluster)
                .then(|| crate::cluster::requests::Prepared::new(r)),
            batch_ns: r.batch_ms.map(|ms| ms * 1_000_000),
            counters,
            rule,
        }
    }
}

/// A request bucket, kept small (16 bytes, its key 16): a million keys must
/// fit in about 100 MB with the map's own overhead. A one-limit token
/// bucket or window, the common case, needs no allocation.
// Boxed collections keep the enum at 16 bytes (asserted below): a bare
// `Vec` would make every bucket 32.
#[allow(clippy::box_collection)]
pub(super) enum Bucket {
    /// The state word of a packet-algorithm rule with one limit (no heap).
    One(u64),
    /// The state words of a packet-algorithm rule's limits, one per limit.
    Words(Box<Vec<u64>>),
    /// One log of hit times per limit.
    Log(Box<Vec<super::runs::Runs>>),
    /// When the permits out were taken.
    Leases(Box<super::runs::Runs>),
}

const _: () = assert!(std::mem::size_of::<Bucket>() == 16);
const _: () = assert!(std::mem::size_of::<Key>() == 16);

/// A bucket's key, 16 bytes whatever the values' length: its rule's slot
/// (a number the engine gives each rule, kept by reloads that leave the
/// rule unchanged) and a 96-bit hash of the descriptor's values (`hi`,
/// `lo`: two independent hashes; that two of a million keys collide is
/// about as likely as 2^-57). 24 bytes with the rule's 64-bit id in it cost
/// 8 bytes more per key, spread by the map's load to about 17.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Key {
    slot: u32,
    hi: u32,
    lo: u64,
}

impl Key {
    pub(crate) fn new(slot: u32, (hi, lo): (u32, u64)) -> Key {
        Key { slot, hi, lo }
    }

    fn values(&self) -> (u32, u64) {
        (self.hi, self.lo)
    }
}

/// The values part of the overflow bucket's key.
const OVERFLOW: (u32, u64) = (u32::MAX, u64::MAX);
/// The values part of an elastic rule's pool bucket's key.
const POOL: (u32, u64) = (u32::MAX, u64::MAX - 1);

fn values_hash(entries: &[DescriptorEntry]) -> (u32, u64) {
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut h);
        for e in entries {
            e.value.hash(&mut h);
        }
        h.finish()
    };
    let v = (
        (half(0x9e37_79b9_7f4a_7c15) >> 32) as u32,
        half(0xc2b2_ae3d_27d4_eb4f),
    );
    if v == OVERFLOW || v == POOL {
        (u32::MAX, 0)
    } else {
        v
    }
}

/// The request limiter: compiled rules and their buckets.
pub struct Engine {
    rules: Vec<Compiled>,
    by_domain: HashMap<String, Vec<usize>>,
    /// Shared with the engine this one replaced (a reload keeps buckets).
    shards: Arc<Vec<Mutex<HashMap<Key, Bucket>>>>,
    keys: Arc<AtomicU64>,
    /// The next rule slot (shared with the engine this one replaced).
    next_slot: Arc<std::sync::atomic::AtomicU32>,
    max_keys: u64,
    epoch_offset_ns: u64,
    pub unmatched: Arc<AtomicU64>,
    /// The shared Redis, for `scope = "cluster"` rules.
    pub(super) cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Hits of `batch` rules on their way to Redis (kept across reloads).
    pub batch: Arc<crate::cluster::batched::Batch>,
    /// Envoy's limit overrides, as rules made when first sent (see
    /// `overrides`); `None` when `[l7] apply_limit_overrides = false`.
    overrides: Option<overrides::Table>,
}

fn rule_id(rule: &L7Rule) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rule.hash(&mut h);
    h.finish()
}

/// The monotonic clock rl-common's arithmetic runs on.
pub(super) fn now_ns() -> u64 {
    crate::datapath::monotonic_ns()
}

impl Engine {
    /// An engine for `config`, keeping the buckets of `previous`'s rules
    /// that are unchanged.
    pub fn new(config: &L7Config, epoch_offset_ns: u64, previous: Option<&Engine>) -> Engine {
        // An unchanged rule keeps its slot, and so its buckets; a new or
        // changed one gets a slot never used before.
        let next_slot = previous.map(|p| p.next_slot.clone()).unwrap_or_default();
        let slot = |id: u64| match previous.and_then(|p| p.rules.iter().find(|q| q.id == id)) {
            Some(q) => q.slot,
            None => next_slot.fetch_add(1, Ordering::Relaxed),
        };
        let rules: Vec<Compiled> = config
            .rules
            .iter()
            .map(|r| {
                let id = rule_id(r);
                let counters = previous
                    .and_then(|p| p.rules.iter().find(|q| q.rule.name == r.name))
                    .map_or_else(Arc::default, |q| q.counters.clone());
                Compiled::new(r.clone(), id, slot(id), counters)
            })
            .collect();
        let mut by_domain: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, c) in rules.iter().enumerate() {
            by_domain.entry(c.rule.domain.clone()).or_default().push(i);
        }
        let overrides = config.apply_limit_overrides.then(|| {
            overrides::kept(
                previous.and_then(|p| p.overrides.as_ref()),
                &rules,
                &by_domain,
            )
        });
        let (shards, keys) = match previous {
            Some(p) => {
                // The buckets of rules that are gone go now (a walk of
                // every key: only when a rule went or changed).
                let mut live: std::collections::HashSet<u32> =
                    rules.iter().map(|c| c.slot).collect();
                live.extend(overrides.iter().flat_map(|t| t.rules()).map(|c| c.slot));
                // Slots handed out from here on (an override the old
                // engine makes during this walk) are live too.
                let first_new = next_slot.load(Ordering::Relaxed);
                let any_gone = p.rules.iter().any(|q| !live.contains(&q.slot));
                for s in p.shards.iter().filter(|_| any_gone) {
                    let mut m = s.lock().unwrap_or_else(|e| e.into_inner());
                    let mut gone = 0u64;
                    m.retain(|key, _| {
                        let keep = live.contains(&key.slot) || key.slot >= first_new;
                        gone +=
                            u64::from(!keep && key.values() != OVERFLOW && key.values() != POOL);
                        keep
                    });
                    p.keys
                        .fetch_sub(gone.min(p.keys.load(Ordering::Relaxed)), Ordering::Relaxed);
                }
                (p.shards.clone(), p.keys.clone())
            }
            None => (
                Arc::new((0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect()),
                Arc::new(AtomicU64::new(0)),
            ),
        };
        let batch = previous.map(|p| p.batch.clone()).unwrap_or_default();
        let unmatched = previous.map(|p| p.unmatched.clone()).unwrap_or_default();
        Engine {
            rules,
            by_domain,
            shards,
            keys,
            next_slot,
            max_keys: config.max_keys,
            epoch_offset_ns,
            unmatched,
            cluster: None,
            batch,
            overrides,
        }
    }

    /// This engine deciding `scope = "cluster"` rules through `cluster`
    /// (without one, they are decided here).
    pub fn with_cluster(mut self, cluster: Option<Arc<crate::cluster::Cluster>>) -> Engine {
        self.cluster = cluster;
        self
    }

    /// The shard holding `key`, locked. The key's values part is already a
    /// hash; mixed with the rule id it spreads one rule's keys, and the
    /// rules' pool and overflow buckets, over the shards.
    fn shard(&self, key: &Key) -> std::sync::MutexGuard<'_, HashMap<Key, Bucket>> {
        let i = ((u64::from(key.slot) << 32 | u64::from(key.hi)) ^ key.lo)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            >> 58;
        self.shards[i as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The engine's key of `entries`' bucket under rule `c`.
    pub(super) fn key_of(c: &Compiled, entries: &[DescriptorEntry]) -> Key {
        Key::new(c.slot, values_hash(entries))
    }

    /// The shortest `batch` of the rules, if any rule batches.
    pub fn batch_interval(&self) -> Option<std::time::Duration> {
        self.rules
            .iter()
            .filter_map(|c| c.batch_ns)
            .min()
            .map(std::time::Duration::from_nanos)
    }

    /// Whether the store holds a bucket under `key`.
    pub(super) fn holds(&self, key: &Key) -> bool {
        self.shard(key).contains_key(key)
    }

    /// Moves a token bucket's state up to `tat` (a batched key charged by
    /// other daemons); never down.
    pub fn raise(&self, key: Key, tat: u64) {
        if let Some(Bucket::One(word)) = self.shard(&key).get_mut(&key) {
            *word = (*word).max(tat);
        }
    }

    /// Request buckets held now.
    pub fn keys(&self) -> u64 {
        self.keys.load(Ordering::Relaxed)
    }

    /// Per-rule counters, in file order, then those of limit overrides no
    /// rule matched ([`overrides::UNMATCHED`]).
    pub fn counters(&self) -> impl Iterator<Item = (&str, &Counters)> {
        self.rules
            .iter()
            .map(|c| (c.rule.name.as_str(), &*c.counters))
            .chain(
                self.overrides
                    .as_ref()
                    .map(|t| (overrides::UNMATCHED, &*t.unmatched)),
            )
    }

    /// The name of the `concurrency` rule that `entries` match, if they
    /// match one (a caller that sends no release must not take permits).
    pub fn concurrency_rule(&self, domain: &str, entries: &[DescriptorEntry]) -> Option<&str> {
        self.matching(domain, entries)
            .filter(|c| matches!(c.rule.algorithm, L7Algorithm::Concurrency { .. }))
            .map(|c| c.rule.name.as_str())
    }

    /// The first rule of `domain` whose descriptor matches `entries`.
    pub(super) fn matching(&self, domain: &str, entries: &[DescriptorEntry]) -> Option<&Compiled> {
        let matches = |d: &[Entry]| {
            d.len() == entries.len()
                && d.iter()
                    .zip(entries)
                    .all(|(r, e)| r.key == e.key && r.value.as_ref().is_none_or(|v| *v == e.value))
        };
        self.by_domain
            .get(domain)?
            .iter()
            .map(|&i| &self.rules[i])
            .find(|c| matches(&c.rule.descriptor))
    }

    /// Charges `hits` (negative: a refund) to the bucket of one descriptor.
    pub fn decide(&self, domain: &str, entries: &[DescriptorEntry], hits: i64) -> Status {
        self.decide_at(domain, entries, hits, now_ns())
    }

    /// [`Engine::decide`] at monotonic time `now` (tests drive the clock).
    pub fn decide_at(
        &self,
        domain: &str,
        entries: &[DescriptorEntry],
        hits: i64,
        now: u64,
    ) -> Status {
        let Some(c) = self.matching(domain, entries) else {
            self.unmatched.fetch_add(1, Ordering::Relaxed);
            return Status::unmatched();
        };
        let st = self.charge_here(c, entries, hits, now);
        self.counted(c, st)
    }

    /// Charges this host's bucket of `entries` under rule `c`.
    pub(super) fn charge_here(
        &self,
        c: &Compiled,
        entries: &[DescriptorEntry],
        hits: i64,
        now: u64,
    ) -> Status {
        let mut key = Key::new(c.slot, values_hash(entries));
        let mut shard = self.shard(&key);
        let (mut hits, refund) = (hits, hits < 0);
        if !shard.contains_key(&key) {
            let full = self.keys.load(Ordering::Relaxed) >= self.max_keys;
            if refund && full {
                // Nothing to give back (below), and the key's next charge
                // goes to the overflow bucket: what that holds is the
                // answer (read with 0 hits), not a fresh bucket's limit.
                hits = 0;
            }
            if hits < 0 || (hits == 0 && !full) {
                // A refund for a key without a bucket: what it gives back
                // has expired, or went to the rule's overflow bucket, which
                // cannot tell its hits from other keys': nothing is given
                // back (a permit left there expires), and no bucket made.
                // A check of 0 hits reads a fresh bucket and keeps none.
                drop(shard);
                return charge(c, &mut new_bucket(c), now, hits, self.epoch_offset_ns);
            }
            // A place taken in one step: threads deciding on other shards
            // cannot all take the last one and overshoot max_keys.
            let placed = !full
                && self
                    .keys
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| {
                        (k < self.max_keys).then_some(k + 1)
                    })
                    .is_ok();
            if !placed {
                // Full: the rule's overflow bucket (fails closed, coarser).
                key = Key::new(c.slot, OVERFLOW);
                drop(shard);
                shard = self.shard(&key);
                if hits > 0 {
                    c.counters.overflow.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let bucket = shard.entry(key).or_insert_with(|| new_bucket(c));
        let mut st = charge(c, bucket, now, hits, self.epoch_offset_ns);
        drop(shard);
        if refund {
            // A refund always passes, whatever is left.
            st.code = "ok";
            return st;
        }
        if st.code == "over_limit" && hits >= 0 {
            if let Some(pool) = &c.pool {
                // Elastic: over its own limit, the key may use the rule's
                // shared pool while it has room; what is left is then the
                // pool's (a check of 0 hits reads it).
                let key = Key::new(c.slot, POOL);
                let mut shard = self.shard(&key);
                if let Bucket::One(word) = shard.entry(key).or_insert(Bucket::One(0)) {
                    if let Some(next) = pool.gcra_step_checked(*word, now, hits as u64) {
                        let q = rl_common::quota::quota(pool, next, now, self.epoch_offset_ns);
                        if hits > 0 || q.remaining > 0 {
                            *word = next;
                            st.code = "ok";
                            st.remaining = q.remaining;
                            st.reset_ms = rl_common::quota::ceil_ms(q.reset_ns);
                            st.retry_after_ms = rl_common::quota::ceil_ms(q.retry_after_ns);
                        }
                    }
                }
            }
        }
        st
    }

    /// `st` after the rule's action (shadow rules pass what is over),
    /// counted.
    pub(super) fn counted(&self, c: &Compiled, mut st: Status) -> Status {
        let counters = &c.counters;
        if st.code == "over_limit" {
            if c.rule.action == Action::Shadow {
                counters.shadow_over.fetch_add(1, Ordering::Relaxed);
                st.code = "ok";
                st.shadow = true;
            } else {
                counters.over.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            counters.ok.fetch_add(1, Ordering::Relaxed);
        }
        st
    }

    /// What the next request with this descriptor would meet, without
    /// charging or creating anything: `ok` if it would pass now.
    pub fn peek(&self, domain: &str, entries: &[DescriptorEntry]) -> Status {
        let Some(c) = self.matching(domain, entries) else {
            return Status::unmatched();
        };
        let now = now_ns();
        // A key without a bucket while the store is full would be charged
        // to the rule's overflow bucket: that is its state.
        let own = Key::new(c.slot, values_hash(entries));
        let key = if !self.shard(&own).contains_key(&own)
            && self.keys.load(Ordering::Relaxed) >= self.max_keys
        {
            Key::new(c.slot, OVERFLOW)
        } else {
            own
        };
        let mut shard = self.shard(&key);
        let mut st = match shard.get_mut(&key) {
            Some(b) => charge(c, b, now, 0, self.epoch_offset_ns),
            None => charge(c, &mut new_bucket(c), now, 0, self.epoch_offset_ns),
        };
        st.code = if st.remaining > 0 { "ok" } else { "over_limit" };
        st
    }
}

/// A fresh bucket for `c`'s algorithm.
fn new_bucket(c: &Compiled) -> Bucket {
    match c.rule.algorithm {
        L7Algorithm::Packet(_) if c.limits.len() == 1 => Bucket::One(0),
        L7Algorithm::Packet(_) => Bucket::Words(Box::new(vec![0; c.limits.len()])),
        L7Algorithm::SlidingLog => {
            Bucket::Log(Box::new(vec![Default::default(); c.rule.limits.len()]))
        }
        L7Algorithm::Concurrency { .. } => Bucket::Leases(Box::default()),
    }
}

#[cfg(test)]
mod tests;
