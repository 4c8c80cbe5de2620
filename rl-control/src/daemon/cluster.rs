//! The daemon's side of `[cluster]`: joining at start (refused when another
//! host defines a cluster rule differently), then probing Redis and
//! logging the cluster's health changes as events.

use std::sync::Arc;

use anyhow::{bail, Result};
use tracing::{info, warn};

use crate::{
    cluster::Cluster,
    compile::stable_hash,
    config::Config,
    rules::Scope,
    state::{lock, EventView, Shared},
};

/// Every cluster rule of `config` as it registers: its namespaced name and
/// the hash of its definition.
pub fn definitions(config: &Config) -> Vec<(String, u64)> {
    let packet = config.rules.iter().filter(|r| r.scope == Scope::Cluster).map(|r| (format!("packet:{}", r.name), stable_hash(r, 0)));
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
    let Some(settings) = &config.cluster else { return Ok(None) };
    let cluster = Cluster::new(settings.clone());
    let defs = definitions(config);
    match cluster.probe(&defs).await {
        Ok(()) => {
            let st = cluster.status();
            if let Some(rule) = st.mismatched.first() {
                bail!(
                    "cluster rule \"{rule}\" is defined differently by another host sharing {}: make the rule identical on every host \
                     (or give the new definition a new name) and start again",
                    settings.redis.join(", ")
                );
            }
            info!(node = %settings.node, redis = %settings.redis.join(", "), "joined the cluster: {} cluster rules shared", defs.len());
        }
        Err(e) => warn!(
            node = %settings.node,
            "Redis at {} is unreachable ({e}): starting with cluster rules enforcing on_failure = \"{}\"; they are shared again as soon as Redis answers",
            settings.redis.join(", "),
            settings.on_failure.name()
        ),
    }
    Ok(Some(cluster))
}

/// Probes Redis for as long as the daemon runs (re-registering the rules
/// in force) and writes the cluster's health changes to the event log.
pub async fn keep_in_touch(state: Shared, cluster: Arc<Cluster>) {
    loop {
        tokio::time::sleep(cluster.probe_pause()).await;
        // A decision that found Redis gone changed the health already.
        log_transitions(&state, &cluster);
        let defs = definitions(&lock(&state).config);
        let _ = cluster.probe(&defs).await;
        log_transitions(&state, &cluster);
    }
}

fn log_transitions(state: &Shared, cluster: &Cluster) {
    let changes = cluster.take_transitions();
    if changes.is_empty() {
        return;
    }
    let mut s = lock(state);
    for (event, why) in changes {
        s.push_event(EventView { at_unix_ms: crate::config::unix_now() * 1000, event: event.into(), rule: why, limit_index: 0, source: String::new() });
    }
}
