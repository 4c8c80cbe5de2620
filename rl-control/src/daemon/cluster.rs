//! The daemon's side of `[cluster]`: joining at start (refused when another
//! host defines a cluster rule differently), then probing Redis and
//! logging the cluster's health changes as events.

use std::sync::Arc;

use anyhow::{bail, Result};
use tracing::{info, warn};

use crate::{
    cluster::{
        packets::{Ledger, Share, Shares},
        Cluster,
    },
    compile::stable_hash,
    config::rules::Scope,
    config::Config,
    daemon::state::{lock, EventView, Shared},
    datapath::share::{scan_shared, BucketId, CollectedRecords, SharedBucket, Tables},
};

/// The definition a cluster packet rule registers and names its Redis
/// buckets by: the rule, and what makes its keys (the prefixes that key
/// its buckets and its prefix cells' lengths, from `[datapath]`). Two hosts
/// that key a rule differently must not share its buckets: one host's
/// 10.1.2.0 (a /32) would count as the other's 10.1.2.0/24.
pub fn packet_definition(r: &crate::config::rules::Rule, d: &crate::config::Datapath) -> u64 {
    let keys = crate::compile::key_prefixes(r, d.ipv4_prefix, d.ipv6_prefix);
    stable_hash(&(r, keys, (d.flood_prefix_v4, d.flood_prefix_v6)), 0)
}

/// Every cluster rule of `config` as it registers: its namespaced name and
/// the hash of its definition.
pub fn definitions(config: &Config) -> Vec<(String, u64)> {
    let packet = config
        .rules
        .iter()
        .filter(|r| r.scope == Scope::Cluster)
        .map(|r| {
            (
                format!("packet:{}", r.name),
                packet_definition(r, &config.datapath),
            )
        });
    let requests = config
        .l7
        .rules
        .iter()
        .filter(|r| r.scope == Scope::Cluster)
        .map(|r| (crate::cluster::requests::member_name(r), stable_hash(r, 0)));
    packet.chain(requests).collect()
}

/// Joins the cluster `config` names, if any. Redis unreachable: the daemon
/// starts with cluster rules in `on_failure` and says so. A rule another
/// live host defines differently: the start is refused.
pub async fn join(config: &Config) -> Result<Option<Arc<Cluster>>> {
    let Some(settings) = &config.cluster else {
        return Ok(None);
    };
    let cluster = Cluster::new(settings.clone());
    let defs = definitions(config);
    match cluster.probe(&defs).await {
        Ok(()) => {
            let st = cluster.status();
            if let Some(rule) = st.mismatched.first() {
                bail!(
                    "cluster rule \"{rule}\" is defined differently by another host sharing {}: make the rule identical on every host \
                     (or give the new definition a new name) and start again",
                    settings.redis_shown().join(", ")
                );
            }
            info!(node = %settings.node, redis = %settings.redis_shown().join(", "), "joined the cluster: {} cluster rules shared", defs.len());
        }
        Err(e) => warn!(
            node = %settings.node,
            "Redis at {} is unreachable ({e}): starting with cluster rules enforcing on_failure = \"{}\"; they are shared again as soon as Redis answers",
            settings.redis_shown().join(", "),
            settings.on_failure.name()
        ),
    }
    Ok(Some(cluster))
}

/// Watches Redis for as long as the daemon runs: a round trip every
/// `sync_interval` (so a hung or dead Redis is noticed within that and
/// `timeout`, traffic or not), the rules in force re-registered while
/// degraded and every quarter of the membership TTL; writes the cluster's
/// health changes to the event log and follows `on_failure`.
pub async fn keep_in_touch(state: Shared, cluster: Arc<Cluster>) {
    let mut every = tokio::time::interval(std::time::Duration::from_millis(
        cluster.config.sync_interval_ms,
    ));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut registered = std::time::Instant::now();
    loop {
        every.tick().await;
        // A decision that found Redis gone changed the health already.
        log_transitions(&state, &cluster);
        if cluster.is_degraded() || registered.elapsed() >= cluster.membership_ttl() / 4 {
            let defs = definitions(&lock(&state).config);
            if cluster.probe(&defs).await.is_ok() {
                registered = std::time::Instant::now();
            }
        } else {
            let _ = cluster.ping().await;
        }
        log_transitions(&state, &cluster);
        follow_failure_mode(&state, &cluster).await;
    }
}

fn log_transitions(state: &Shared, cluster: &Cluster) {
    let changes = cluster.take_transitions();
    if changes.is_empty() {
        return;
    }
    let mut s = lock(state);
    for (event, why) in changes {
        s.push_notice(EventView {
            at_unix_ms: crate::config::unix_now_ms(),
            event: event.into(),
            rule: String::new(),
            limit_index: 0,
            source: String::new(),
            detail: why,
        });
    }
}

/// The cluster packet rules' limits as the datapath numbers them
/// (`RuleEntry::id | index`), from the rules as written (never an
/// `on_failure` variant); rules another host defines differently are not
/// shared.
fn shares_of(config: &Config, cluster: &Cluster) -> Shares {
    let d = &config.datapath;
    let mut shares = Shares::new();
    // The ids the datapath holds: unique within the set (a rule's own
    // hash, unless another's collides with it).
    let ids = crate::compile::rule_ids(config);
    for (r, &id) in config.rules.iter().zip(&ids[1..]).filter(|(r, _)| {
        r.scope == Scope::Cluster && !cluster.is_mismatched(&format!("packet:{}", r.name))
    }) {
        let entry = rl_common::RuleEntry {
            id,
            ..crate::compile::rule_entry(r, d.ipv4_prefix, d.ipv6_prefix)
        };
        let definition = packet_definition(r, d);
        for which in 0..entry.n_limits.min(rl_common::MAX_LIMITS as u32) {
            let l = entry.limits[which as usize];
            shares.insert(
                entry.id | which,
                Share {
                    rule: r.name.clone(),
                    definition,
                    which,
                    ns_per_packet: l.a.max(1),
                    burst_ns: l.b,
                },
            );
        }
    }
    shares
}

/// Exchanges packet-rule usage every `sync_interval` for as long as the
/// daemon runs (see [`crate::cluster::packets`]). While the cluster is
/// degraded each host enforces with what it has; the reports travel again
/// when Redis answers, capped at what a bucket could pass meanwhile.
pub async fn sync_packets(state: Shared, cluster: Arc<Cluster>) {
    let interval = std::time::Duration::from_millis(cluster.config.sync_interval_ms);
    let interval_ns = interval.as_nanos() as u64;
    let keep_ms = (cluster.membership_ttl().as_millis() as u64 * 5).max(10_000);
    let mut ledger = Ledger::new(&cluster.config.node, keep_ms);
    if lock(&state).dp.adopted() {
        ledger = ledger.from_the_tables();
    }
    let ids = loop {
        match lock(&state).dp.table_maps() {
            Ok(ids) => break ids,
            // Reported, and tried again: a sync that gave up would leave
            // the status saying all is well.
            Err(e) => cluster.sync_went(Some(format!("the bucket tables cannot be opened: {e}"))),
        }
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    };
    // The shares of the config in force, worked out again when it changes.
    let mut shares_for: SharesCache = None;
    let collected = lock(&state).collected.clone();
    let mut every = tokio::time::interval(interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the last round reported, or ended without reporting (degraded,
    // or its scan failed: after an outage or a spell of failing scans, a
    // report is still capped at about two intervals' worth).
    let mut last_round: Option<u64> = None;
    let skipped = |last: &mut Option<u64>| *last = Some(crate::datapath::monotonic_ns());
    loop {
        every.tick().await;
        follow_failure_mode(&state, &cluster).await;
        // Degraded, or an on_failure variant still installed: each host
        // enforces alone until both are over.
        let (config, variant) = {
            let s = lock(&state);
            (s.config.clone(), s.failure_mode.is_some())
        };
        if cluster.is_degraded() || variant {
            // The collector's records are taken all the same (they are
            // bounded, and a bucket made again meanwhile counts from 0).
            if let Some((records, complete)) = under_records(&collected, take_records).await {
                ledger.collected(&records, complete, crate::datapath::monotonic_ns());
            }
            skipped(&mut last_round);
            continue;
        }
        let shares = shares_in_force(&mut shares_for, &config, &cluster);
        if shares.is_empty() {
            // Nothing to share: nothing failing either.
            cluster.sync_went(None);
            under_records(&collected, |r| r.limits.clear()).await;
            skipped(&mut last_round);
            continue;
        }
        let wanted: std::collections::HashSet<u32> = shares.keys().copied().collect();
        // The records and the scan under one lock (see `Collected`).
        let scanning = ids.clone();
        let scanned = under_records(&collected, move |records| {
            records.limits.clone_from(&wanted);
            (
                take_records(records),
                scan_shared(&scanning, |r| wanted.contains(&r)),
            )
        });
        let buckets = match scanned.await {
            Some(((records, complete), scan)) => {
                ledger.collected(&records, complete, crate::datapath::monotonic_ns());
                scan
            }
            None => {
                cluster.sync_went(Some("the table scan did not complete".into()));
                skipped(&mut last_round);
                continue;
            }
        };
        let buckets = match buckets {
            Ok(b) => b,
            Err(e) => {
                cluster.sync_went(Some(format!("reading the bucket tables failed: {e}")));
                skipped(&mut last_round);
                continue;
            }
        };
        let now = crate::datapath::monotonic_ns();
        // The round's span: the interval, or longer when rounds take
        // longer (a large table, a slow Redis), from report to report:
        // what a bucket may have passed since its last report is capped by
        // it.
        let span = round_span(interval_ns, last_round.replace(now), now);
        let reports = ledger.reports(&buckets, &shares, span, now);
        let (answers, _failure) = ledger.exchange(&cluster, &reports, keep_ms).await;
        let raises: Vec<_> = answers
            .iter()
            .filter(|(_, until)| *until > 0)
            .map(|&(i, until)| (reports[i].id, until))
            .collect();
        match raise(&collected, &ids, raises).await {
            Ok(n) => {
                ledger.stats.raised += n;
                cluster.sync_went(None);
            }
            Err(e) => cluster.sync_went(Some(e)),
        }
        for (i, _) in answers {
            ledger.acknowledge(&reports[i], now);
        }
        follow_failure_mode(&state, &cluster).await;
        ledger.stats.rounds += 1;
        *cluster.sync.lock().unwrap_or_else(|e| e.into_inner()) = ledger.stats;
    }
}

/// The shares of the config in force and the rules mismatched now, and
/// what they were worked out from.
type SharesCache = Option<(Arc<Config>, Vec<String>, Arc<Shares>)>;

/// The shares of the config in force: `cache`'s, unless the config or the
/// rules mismatched changed since (then worked out again: a rule whose
/// mismatch clears is shared again at once).
fn shares_in_force(
    cache: &mut SharesCache,
    config: &Arc<Config>,
    cluster: &Cluster,
) -> Arc<Shares> {
    let mismatched = cluster.status().mismatched;
    match cache {
        Some((c, m, sh)) if Arc::ptr_eq(c, config) && *m == mismatched => sh.clone(),
        _ => {
            let sh = Arc::new(shares_of(config, cluster));
            *cache = Some((config.clone(), mismatched, sh.clone()));
            sh
        }
    }
}

/// The span a round's reports cover: `interval_ns`, or the time since the
/// round before reported or ended without reporting (`last`) when rounds
/// run slower than the interval.
fn round_span(interval_ns: u64, last: Option<u64>, now: u64) -> u64 {
    last.map_or(interval_ns, |l| now.saturating_sub(l).max(interval_ns))
}

/// Moves each bucket of `raises` (its id, and until when the cluster's is
/// ahead, monotonic ns) up to the cluster's; returns how many moved, or
/// why none could. Under the
/// collector's lock: it decides a delete again under it, so it never
/// deletes a bucket just raised.
async fn raise(
    collected: &Arc<crate::datapath::share::Collected>,
    ids: &crate::datapath::TableMaps,
    raises: Vec<(BucketId, u64)>,
) -> Result<u64, String> {
    if raises.is_empty() {
        return Ok(0);
    }
    let ids = ids.clone();
    let raised = under_records(
        collected,
        move |_| -> Result<u64, crate::datapath::DatapathError> {
            let mut tables = Tables::open(&ids)?;
            Ok(raises
                .into_iter()
                .filter(|(id, until)| tables.raise(id, *until))
                .count() as u64)
        },
    )
    .await;
    match raised {
        Some(Ok(n)) => Ok(n),
        Some(Err(e)) => Err(format!("moving buckets up to the cluster's failed: {e}")),
        None => Err("moving buckets up to the cluster's did not complete".into()),
    }
}

/// Runs `f` on the collector's records under their lock, off the async
/// threads (taking it waits for a collector pass that holds it); `None`
/// if the blocking task failed.
async fn under_records<T: Send + 'static>(
    collected: &Arc<crate::datapath::share::Collected>,
    f: impl FnOnce(&mut CollectedRecords) -> T + Send + 'static,
) -> Option<T> {
    let handoff = collected.clone();
    tokio::task::spawn_blocking(move || f(&mut handoff.lock()))
        .await
        .ok()
}

/// The collector's records since the last round, and whether none was
/// dropped.
fn take_records(r: &mut CollectedRecords) -> (Vec<SharedBucket>, bool) {
    (
        std::mem::take(&mut r.deleted),
        std::mem::take(&mut r.dropped) == 0,
    )
}

/// Installs the packet rules' `on_failure` variant while the cluster is
/// degraded (`open` and `closed`; `local` keeps the rules), and the rules
/// as written once it is not.
async fn follow_failure_mode(state: &Shared, cluster: &Cluster) {
    let wanted = (cluster.is_degraded()
        && cluster.config.on_failure != crate::cluster::OnFailure::Local)
        .then_some(cluster.config.on_failure);
    {
        let s = lock(state);
        if s.failure_mode == wanted
            || (wanted.is_some() && !s.config.rules.iter().any(|r| r.scope == Scope::Cluster))
        {
            return;
        }
    }
    let st = state.clone();
    if let Ok(Err(e)) =
        tokio::task::spawn_blocking(move || crate::daemon::apply::set_failure_mode(&st, wanted))
            .await
    {
        warn!("{e}");
    }
}

/// Sends the hits of `batch` request rules to Redis every `batch` (the
/// shortest of the rules in force) for as long as the daemon runs, and
/// moves each key's bucket up to its cluster bucket (see
/// [`crate::cluster::batched`]).
pub async fn sync_requests(state: Shared, cluster: Arc<Cluster>) {
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let reporter = format!("{}:{boot}:l7", cluster.config.node);
    let keep_ms = (cluster.membership_ttl().as_millis() as u64 * 5).max(10_000);
    loop {
        let engine = lock(&state)
            .l7
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        tokio::time::sleep(
            engine
                .batch_interval()
                .unwrap_or(std::time::Duration::from_millis(100)),
        )
        .await;
        if cluster.is_degraded() {
            continue;
        }
        let lines = engine
            .batch
            .take(crate::datapath::monotonic_ns(), 2 * keep_ms * 1_000_000);
        if lines.is_empty() {
            continue;
        }
        let refs: Vec<&crate::cluster::packets::Line> = lines.iter().map(|(_, l)| l).collect();
        let (answers, _failure, _) =
            crate::cluster::packets::exchange(&cluster, &reporter, &refs, keep_ms).await;
        for (i, until) in answers {
            let (key, line) = &lines[i];
            engine.batch.acknowledge(key, line.cum);
            if until > 0 {
                engine.raise(*key, until);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packet rule mismatched while the config stays is shared again as
    /// soon as the mismatch clears (the shares were cached without it
    /// until the next reload, every status saying all was well).
    #[test]
    fn a_rule_is_shared_again_once_its_mismatch_clears() {
        let text =
            "[default]\nrate = 5\n[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"n\"\n\
                    [[rule]]\nname = \"r\"\nproto = \"udp\"\nrate = 5\nscope = \"cluster\"\n";
        let config = Arc::new(Config::from_str(text, "rl.toml").unwrap());
        let cluster = Cluster::new(config.cluster.clone().unwrap());
        let mut cache = None;
        assert_eq!(
            shares_in_force(&mut cache, &config, &cluster).len(),
            1,
            "shared"
        );
        cluster.set_mismatched(vec!["packet:r".into()]);
        assert!(
            shares_in_force(&mut cache, &config, &cluster).is_empty(),
            "mismatched: not shared"
        );
        cluster.set_mismatched(Vec::new());
        assert_eq!(
            shares_in_force(&mut cache, &config, &cluster).len(),
            1,
            "shared again"
        );
    }

    /// A round's span is the interval, or the time since the round before
    /// when rounds run slower: reports are capped by it, and a cap of the
    /// configured interval alone left packets of slow rounds uncharged.
    #[test]
    fn a_rounds_span_is_the_time_since_the_last_round_when_longer_than_the_interval() {
        const MS: u64 = 1_000_000;
        assert_eq!(
            round_span(20 * MS, None, 1_000 * MS),
            20 * MS,
            "the first round"
        );
        assert_eq!(
            round_span(20 * MS, Some(900 * MS), 1_000 * MS),
            100 * MS,
            "slow rounds"
        );
        assert_eq!(
            round_span(20 * MS, Some(995 * MS), 1_000 * MS),
            20 * MS,
            "a quick one"
        );
    }

    /// A sync that fails here is in the cluster's status (and so in
    /// /v1/status, /metrics and `rl-control status`) until a round works.
    #[test]
    fn a_failing_sync_is_reported_until_a_round_works() {
        let text =
            "[default]\nrate = 5\n[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"n\"\n";
        let config = Config::from_str(text, "rl.toml").unwrap();
        let cluster = Cluster::new(config.cluster.clone().unwrap());
        assert_eq!(cluster.status().sync_error, None);
        cluster.sync_went(Some("reading the bucket tables failed: EIO".into()));
        assert_eq!(
            cluster.status().sync_error.as_deref(),
            Some("reading the bucket tables failed: EIO")
        );
        cluster.sync_went(None);
        assert_eq!(cluster.status().sync_error, None);
    }

    /// Hosts that key a cluster rule differently register different
    /// definitions, so they never share its Redis buckets; hosts that
    /// differ only in what does not make its keys share them.
    #[test]
    fn a_cluster_rules_definition_holds_what_makes_its_keys() {
        let cfg = |datapath: &str, key: &str| {
            let text = format!(
                "[datapath]\n{datapath}\n[default]\nrate = 5\n[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"n\"\n\
                 [[rule]]\nname = \"r\"\nproto = \"udp\"\nrate = 5\nscope = \"cluster\"\n{key}\n"
            );
            definitions(&Config::from_str(&text, "rl.toml").unwrap())[0].1
        };
        let base = cfg("", "");
        assert_ne!(
            base,
            cfg("ipv4_prefix = 24", ""),
            "the prefix that keys its sources"
        );
        assert_ne!(base, cfg("ipv6_prefix = 56", ""));
        assert_ne!(base, cfg("flood_prefix_v4 = 16", ""), "its cells' length");
        assert_eq!(
            base,
            cfg("fragment_ttl_ms = 500", ""),
            "nothing that makes its keys"
        );
        let global = cfg("", "key = \"global\"");
        assert_eq!(
            global,
            cfg("ipv4_prefix = 24", "key = \"global\""),
            "a global key holds no prefix"
        );
    }
}
