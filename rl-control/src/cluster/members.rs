//! Who holds which definition of a cluster rule.
//!
//! Each daemon registers `(rule, definition hash)` under its node name in
//! one Redis hash per rule, renewed while it runs. A daemon that finds a
//! live other node with a different definition does not register: that
//! request rule answers from `on_failure` and that packet rule is not
//! shared on this host (and the start is refused, see [`crate::daemon`]),
//! so two definitions never share one limit. The keys
//! of a rule's buckets carry the definition hash as well.

use std::sync::LazyLock;

use redis::Script;

use super::{Cluster, Failure};

static REGISTER: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("register.lua")));

/// The Redis key of `rule`'s registrations (`rule` is namespaced, such as
/// `l7:login` or `packet:ssh`): one hash slot per rule.
pub fn key(rule: &str) -> String {
    format!("rl:def:{{{rule}}}")
}

/// Registers every `(rule, definition)`; returns the rules another live
/// daemon defines differently, with that daemon's node name.
pub async fn register(
    cluster: &Cluster,
    definitions: &[(String, u64)],
) -> Result<Vec<(String, String)>, Failure> {
    let ttl = cluster.membership_ttl().as_millis() as u64;
    let mut clashes = Vec::new();
    for (rule, def) in definitions {
        let mut inv = REGISTER.prepare_invoke();
        inv.key(key(rule))
            .key(format!("{}:ttl", key(rule)))
            .arg(&cluster.config.node)
            .arg(format!("{def:016x}"))
            .arg(ttl);
        let other: Option<String> = cluster.call_anyway(&inv).await?;
        if let Some(node) = other {
            clashes.push((rule.clone(), node));
        }
    }
    Ok(clashes)
}
