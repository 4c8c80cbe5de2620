//! `[l7]` and `[[l7.rule]]`: request rules, validated with line:col like
//! packet rules, sharing their limit syntax (`rate`/`per`/`burst` or
//! `limits = [...]`, `action`, `mode = "hard" | "soft"`).

use std::{net::SocketAddr, ops::Range};

use serde::Deserialize;
use toml::Spanned;

use crate::{
    cluster::settings::scope_of,
    config::rules::{
        checked_name, choice, duration, int_in, int_or, limits_of, mode_of, Action, Algorithm,
        Mode, ModeFields, RawLimit, RuleLimit, Scope, MAX_LIMITS,
    },
    config::{socket_address, ConfigError, Located},
};

/// Most `[[l7.rule]]`s.
pub const MAX_L7_RULES: usize = 1024;
/// Most entries in a rule's (and a request's) descriptor.
pub const MAX_ENTRIES: usize = 16;
/// Longest descriptor key or value, in bytes.
pub const MAX_VALUE_LEN: usize = 256;
/// Largest `rate` of a `sliding_log` rule: its memory is one timestamp
/// per allowed request in the window.
pub const MAX_LOG_RATE: u64 = 10_000;
/// Largest `max` of a `concurrency` rule.
pub const MAX_CONCURRENCY: u64 = 1_000_000;
/// `[l7] max_connections` unless set: far more than gateways hold (Envoy
/// holds one per worker), far fewer than the daemon's open files.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
/// Most `[l7] max_connections`.
pub const MAX_CONNECTIONS: u32 = 65_536;
/// Most `[l7] grpc_threads`.
pub const MAX_GRPC_THREADS: usize = 64;
/// Largest `[l7] max_keys`.
pub const MAX_KEYS_LIMIT: u64 = 16_777_216;

/// How a request rule counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum L7Algorithm {
    /// The packet algorithms (token bucket, fixed and sliding window).
    Packet(Algorithm),
    /// At most `rate` in any span of `per`, exactly (a log of timestamps).
    SlidingLog,
    /// At most `max` in flight; a refund releases one.
    Concurrency { max: u64, lease_secs: u64 },
}

/// One descriptor entry of a rule: a key, and the value it must have
/// (`None`: every value gets its own bucket).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub key: String,
    pub value: Option<String>,
}

/// A validated `[[l7.rule]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L7Rule {
    pub name: String,
    pub domain: String,
    pub descriptor: Vec<Entry>,
    pub algorithm: L7Algorithm,
    /// All must pass (empty for `concurrency`).
    pub limits: Vec<RuleLimit>,
    pub action: Action,
    pub mode: Mode,
    /// `scope = "cluster"`: decided in Redis, shared by every daemon.
    pub scope: Scope,
    /// `batch = "10ms"` (cluster token buckets): decided here, charged to
    /// Redis in batches this often.
    pub batch_ms: Option<u64>,
    /// `drain_over_limit = true`: a charge over the limit empties the
    /// key's bucket instead of changing nothing (usage known only after the
    /// fact, checked beforehand with 0 hits).
    pub drain: bool,
}

/// A rule's hash is its id (buckets kept across reloads) and, for a
/// cluster rule, its definition in Redis: fields are hashed as a derived
/// `Hash` did before `drain_over_limit` existed, and that one only when
/// set, so that a rule without it keeps its id and definition across an
/// upgrade (hosts of both builds agree during a rolling upgrade).
impl std::hash::Hash for L7Rule {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let L7Rule {
            name,
            domain,
            descriptor,
            algorithm,
            limits,
            action,
            mode,
            scope,
            batch_ms,
            drain,
        } = self;
        (
            name, domain, descriptor, algorithm, limits, action, mode, scope, batch_ms,
        )
            .hash(state);
        if *drain {
            drain.hash(state);
        }
    }
}

/// `[l7]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L7Config {
    /// Envoy's `RateLimitService` (gRPC).
    pub grpc_listen: Option<SocketAddr>,
    /// `POST /v1/check` and `/v1/forward-auth/{domain}`.
    pub http_listen: Option<SocketAddr>,
    /// Request buckets held at most.
    pub max_keys: u64,
    /// Add the IETF `RateLimit-Policy` / `RateLimit` headers to gRPC answers.
    pub draft_headers: bool,
    /// Threads serving gRPC and HTTP check connections (`None`: one per CPU
    /// the daemon may run on). Read at start, like the listen addresses.
    pub grpc_threads: Option<u32>,
    /// Open connections per listener at most: more are closed at once.
    pub max_connections: u32,
    /// Apply Envoy's per-descriptor `limit` override (`true`, as Envoy's
    /// own service does) or ignore it (the matching rule decides).
    pub apply_limit_overrides: bool,
    pub rules: Vec<L7Rule>,
}

impl Default for L7Config {
    fn default() -> Self {
        L7Config {
            grpc_listen: None,
            http_listen: None,
            max_keys: 1_000_000,
            draft_headers: false,
            grpc_threads: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            apply_limit_overrides: true,
            rules: Vec::new(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawL7 {
    grpc_listen: Option<Spanned<String>>,
    http_listen: Option<Spanned<String>>,
    max_keys: Option<Spanned<i64>>,
    draft_headers: Option<bool>,
    grpc_threads: Option<Spanned<i64>>,
    max_connections: Option<Spanned<i64>>,
    apply_limit_overrides: Option<bool>,
    #[serde(default)]
    rule: Vec<Spanned<RawL7Rule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawL7Rule {
    name: Option<Spanned<String>>,
    domain: Option<Spanned<String>>,
    descriptor: Option<Spanned<Vec<Spanned<RawEntry>>>>,
    rate: Option<Spanned<i64>>,
    per: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    algorithm: Option<Spanned<String>>,
    action: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    soft_percent: Option<Spanned<i64>>,
    pool_rate: Option<Spanned<i64>>,
    pool_per: Option<Spanned<String>>,
    max: Option<Spanned<i64>>,
    lease: Option<Spanned<String>>,
    scope: Option<Spanned<String>>,
    batch: Option<Spanned<String>>,
    drain_over_limit: Option<Spanned<bool>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    key: Spanned<String>,
    value: Option<Spanned<String>>,
}

fn text(loc: &Located, what: &str, v: &Spanned<String>) -> Result<String, ConfigError> {
    let t = v.get_ref();
    if t.is_empty() || t.len() > MAX_VALUE_LEN {
        return Err(loc.at(
            v.span(),
            format!("{what} must be 1..={MAX_VALUE_LEN} bytes long"),
        ));
    }
    Ok(t.clone())
}

pub(crate) fn validate(
    loc: &Located,
    raw: &RawL7,
    has_cluster: bool,
) -> Result<L7Config, ConfigError> {
    let mut out = L7Config {
        grpc_listen: socket_address(loc, &raw.grpc_listen, "l7.grpc_listen", "127.0.0.1:8081")?,
        http_listen: socket_address(loc, &raw.http_listen, "l7.http_listen", "127.0.0.1:8082")?,
        max_keys: int_or(
            loc,
            "l7.max_keys",
            &raw.max_keys,
            1,
            MAX_KEYS_LIMIT as i64,
            1_000_000,
        )?,
        draft_headers: raw.draft_headers.unwrap_or(false),
        grpc_threads: match &raw.grpc_threads {
            Some(v) => Some(int_in(loc, "l7.grpc_threads", v, 1, MAX_GRPC_THREADS as i64)? as u32),
            None => None,
        },
        max_connections: int_or(
            loc,
            "l7.max_connections",
            &raw.max_connections,
            1,
            MAX_CONNECTIONS.into(),
            DEFAULT_MAX_CONNECTIONS.into(),
        )? as u32,
        apply_limit_overrides: raw.apply_limit_overrides.unwrap_or(true),
        rules: Vec::new(),
    };
    if raw.rule.len() > MAX_L7_RULES {
        return Err(loc.at(
            raw.rule[MAX_L7_RULES].span(),
            format!("{} l7 rules: at most {MAX_L7_RULES}", raw.rule.len()),
        ));
    }
    for (i, spanned) in raw.rule.iter().enumerate() {
        let rule = validate_rule(loc, i, spanned, has_cluster)?;
        if let Some(first) = out.rules.iter().find(|r| r.name == rule.name) {
            let span = spanned
                .get_ref()
                .name
                .as_ref()
                .map(|n| n.span())
                .unwrap_or(spanned.span());
            return Err(loc.at(
                span,
                format!(
                    "l7 rule name \"{}\" is already used: names must be unique",
                    first.name
                ),
            ));
        }
        out.rules.push(rule);
    }
    Ok(out)
}

fn validate_rule(
    loc: &Located,
    i: usize,
    spanned: &Spanned<RawL7Rule>,
    has_cluster: bool,
) -> Result<L7Rule, ConfigError> {
    let (r, table) = (spanned.get_ref(), spanned.span());
    let name = r
        .name
        .as_ref()
        .ok_or_else(|| loc.at(table.clone(), format!("l7 rule #{}: missing name", i + 1)))?;
    let n = checked_name(loc, "l7 rule", name)?;
    let who = format!("l7 rule \"{n}\"");
    let (domain, descriptor) = descriptor_of(loc, &who, r, table.clone())?;
    let kind = choice(
        loc,
        &format!("{who}: algorithm"),
        &r.algorithm,
        &[
            ("token_bucket", 0),
            ("fixed_window", 1),
            ("sliding_window", 2),
            ("sliding_log", 3),
            ("concurrency", 4),
        ],
    )?;
    let action = choice(
        loc,
        &format!("{who}: action"),
        &r.action,
        &[("drop", Action::Drop), ("shadow", Action::Shadow)],
    )?;
    let fields = ModeFields {
        mode: &r.mode,
        soft_percent: &r.soft_percent,
        pool_rate: &r.pool_rate,
        pool_per: &r.pool_per,
    };
    let no_elastic =
        (kind >= 3).then_some("applies to token_bucket, fixed_window and sliding_window");
    let mode = mode_of(loc, &who, fields, table.clone(), "requests", no_elastic)?;
    if kind >= 3 && matches!(mode, Mode::Soft { .. }) {
        // The log and the semaphore count against their rate or max as
        // written: a soft margin would be taken and silently ignored.
        let span = r.mode.as_ref().map(|m| m.span()).unwrap_or(table.clone());
        return Err(loc.at(span, format!("{who}: mode = \"soft\" applies to token_bucket, fixed_window and sliding_window; raise rate (or max) instead")));
    }
    let scope = scope_of(loc, &who, &r.scope, has_cluster)?;
    if scope == Scope::Cluster && matches!(mode, Mode::Elastic { .. }) {
        let span = r.mode.as_ref().map(|m| m.span()).unwrap_or(table.clone());
        return Err(loc.at(span, format!("{who}: mode = \"elastic\" cannot be scope = \"cluster\": the pool is this host's; use hard or soft")));
    }
    let drain = drain_of(loc, &who, r, kind, scope, mode)?;
    if kind == 4 {
        let algorithm = concurrency_of(loc, &who, r, table.clone())?;
        let rule = L7Rule {
            name: n.clone(),
            domain,
            descriptor,
            algorithm,
            limits: Vec::new(),
            action,
            mode,
            scope,
            batch_ms: None,
            drain,
        };
        return cluster_fits(loc, &who, r, table, rule);
    }
    for (field, v) in [
        ("max", r.max.as_ref().map(|v| v.span())),
        ("lease", r.lease.as_ref().map(|v| v.span())),
    ] {
        if let Some(span) = v {
            return Err(loc.at(
                span,
                format!("{who}: {field} applies to algorithm = \"concurrency\" only"),
            ));
        }
    }
    let algorithm = match kind {
        0 => L7Algorithm::Packet(Algorithm::TokenBucket),
        1 => L7Algorithm::Packet(Algorithm::FixedWindow),
        2 => L7Algorithm::Packet(Algorithm::SlidingWindow),
        _ => L7Algorithm::SlidingLog,
    };
    let limits = request_limits(loc, &who, r, algorithm, table.clone())?;
    if algorithm == L7Algorithm::Packet(Algorithm::SlidingWindow) {
        let span = r
            .rate
            .as_ref()
            .map(|v| v.span())
            .or(r.limits.as_ref().map(|v| v.span()))
            .unwrap_or(table.clone());
        crate::config::rules::sliding_fits(loc, &who, &limits, mode, span)?;
    }
    let batch_ms = batch_of(loc, &who, r, scope, algorithm, limits.len())?;
    let rule = L7Rule {
        name: n.clone(),
        domain,
        descriptor,
        algorithm,
        limits,
        action,
        mode,
        scope,
        batch_ms,
        drain,
    };
    cluster_fits(loc, &who, r, table, rule)
}

/// `rule`, unless it is a cluster rule Redis cannot decide exactly.
fn cluster_fits(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    table: std::ops::Range<usize>,
    rule: L7Rule,
) -> Result<L7Rule, ConfigError> {
    if rule.scope == Scope::Cluster {
        if let Some(why) = crate::cluster::requests::too_large(&rule) {
            return Err(loc.at(
                r.scope.as_ref().map(|s| s.span()).unwrap_or(table),
                format!("{who}: {why}"),
            ));
        }
    }
    Ok(rule)
}

/// What a rule matches: Envoy's `domain` and the descriptor's entries.
fn descriptor_of(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    table: Range<usize>,
) -> Result<(String, Vec<Entry>), ConfigError> {
    let domain = match &r.domain {
        Some(d) => text(loc, &format!("{who}: domain"), d)?,
        None => {
            return Err(loc.at(
                table,
                format!("{who}: missing domain (Envoy's rate-limit domain, e.g. \"auth\")"),
            ))
        }
    };
    let Some(desc) = &r.descriptor else {
        return Err(loc.at(
            table,
            format!("{who}: missing descriptor, e.g. [{{ key = \"remote_address\" }}]"),
        ));
    };
    if desc.get_ref().is_empty() || desc.get_ref().len() > MAX_ENTRIES {
        return Err(loc.at(
            desc.span(),
            format!("{who}: descriptor needs 1..={MAX_ENTRIES} entries"),
        ));
    }
    let mut descriptor = Vec::new();
    for e in desc.get_ref() {
        let e = e.get_ref();
        let key = text(loc, &format!("{who}: descriptor key"), &e.key)?;
        let value = e
            .value
            .as_ref()
            .map(|v| text(loc, &format!("{who}: descriptor value"), v))
            .transpose()?;
        descriptor.push(Entry { key, value });
    }
    Ok((domain, descriptor))
}

/// `algorithm = "concurrency"`: `max` in flight and the `lease`, no rates.
fn concurrency_of(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    table: Range<usize>,
) -> Result<L7Algorithm, ConfigError> {
    for (field, span) in [
        ("rate", r.rate.as_ref().map(|v| v.span())),
        ("per", r.per.as_ref().map(|v| v.span())),
        ("burst", r.burst.as_ref().map(|v| v.span())),
        ("limits", r.limits.as_ref().map(|v| v.span())),
    ] {
        if let Some(span) = span {
            return Err(loc.at(span, format!("{who}: {field} does not apply to algorithm = \"concurrency\": give `max` (and `lease`)")));
        }
    }
    let Some(max) = &r.max else {
        return Err(loc.at(
            table,
            format!(
                "{who}: algorithm = \"concurrency\" needs `max`, the requests allowed in flight"
            ),
        ));
    };
    let max = int_in(loc, &format!("{who}: max"), max, 1, MAX_CONCURRENCY as i64)?;
    let lease_secs = match &r.lease {
        None => 60,
        Some(_) => duration(loc, &format!("{who}: lease"), &r.lease)?,
    };
    Ok(L7Algorithm::Concurrency { max, lease_secs })
}

/// `drain_over_limit`: for the token bucket, the windows and the log, of a
/// rule decided on this host (Redis' script charges all or nothing) with
/// limits of its own (an elastic rule's pool would take the overdraw).
fn drain_of(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    kind: i32,
    scope: Scope,
    mode: Mode,
) -> Result<bool, ConfigError> {
    let Some(d) = &r.drain_over_limit else {
        return Ok(false);
    };
    let why = if kind == 4 {
        "a concurrency rule's permits are taken or not: there is nothing to drain"
    } else if scope == Scope::Cluster {
        "it is not available to scope = \"cluster\" rules yet: their charges are all or nothing in Redis"
    } else if matches!(mode, Mode::Elastic { .. }) {
        "mode = \"elastic\" would charge the overdraw to the shared pool: use hard or soft"
    } else {
        return Ok(*d.get_ref());
    };
    Err(loc.at(d.span(), format!("{who}: drain_over_limit: {why}")))
}

/// A rate rule's limits: `limits = [...]` or its own rate/per/burst, in
/// requests (never bytes).
fn request_limits(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    algorithm: L7Algorithm,
    table: Range<usize>,
) -> Result<Vec<RuleLimit>, ConfigError> {
    let windowed = algorithm != L7Algorithm::Packet(Algorithm::TokenBucket);
    let own = RawLimit {
        rate: r.rate.clone(),
        per: r.per.clone(),
        burst: r.burst.clone(),
        bytes: None,
        byte_burst: None,
    };
    let limits: Vec<RuleLimit> = match &r.limits {
        Some(list) => {
            if !own.is_empty() {
                return Err(loc.at(
                    list.span(),
                    format!("{who}: give either `limits = [...]` or rate/per/burst, not both"),
                ));
            }
            if list.get_ref().is_empty() || list.get_ref().len() > MAX_LIMITS {
                return Err(loc.at(
                    list.span(),
                    format!("{who}: limits needs 1..={MAX_LIMITS} entries"),
                ));
            }
            let mut all = Vec::new();
            for (j, l) in list.get_ref().iter().enumerate() {
                if let Some(b) = &l.get_ref().bytes {
                    return Err(loc.at(b.span(), format!("{who}: limits[{j}]: request rules count requests: give rate, not bytes")));
                }
                all.extend(limits_of(
                    loc,
                    &format!("{who}: limits[{j}]"),
                    l.get_ref(),
                    windowed,
                    l.span(),
                )?);
            }
            all
        }
        None => limits_of(loc, who, &own, windowed, table.clone())?,
    };
    if algorithm == L7Algorithm::SlidingLog {
        for l in &limits {
            if l.rate.amount > MAX_LOG_RATE {
                let span = r.rate.as_ref().map(|v| v.span()).unwrap_or(table.clone());
                return Err(loc.at(span, format!("{who}: rate {} is too large for algorithm = \"sliding_log\" (one timestamp per request in the window): at most {MAX_LOG_RATE}", l.rate.amount)));
            }
        }
    }
    Ok(limits)
}

/// `batch`: a cluster token-bucket rule with one limit may settle with
/// Redis in batches.
fn batch_of(
    loc: &Located,
    who: &str,
    r: &RawL7Rule,
    scope: Scope,
    algorithm: L7Algorithm,
    n_limits: usize,
) -> Result<Option<u64>, ConfigError> {
    let Some(b) = &r.batch else { return Ok(None) };
    let why = if scope != Scope::Cluster {
        Some("needs scope = \"cluster\"")
    } else if algorithm != L7Algorithm::Packet(Algorithm::TokenBucket) {
        Some("applies to algorithm = \"token_bucket\" only")
    } else if n_limits != 1 {
        Some("needs exactly one limit")
    } else {
        None
    };
    if let Some(why) = why {
        return Err(loc.at(b.span(), format!("{who}: batch {why}")));
    }
    Ok(Some(
        crate::config::units::parse_millis(b.get_ref(), 60_000)
            .map_err(|m| loc.at(b.span(), format!("{who}: batch: {m}")))?,
    ))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn error_of(l7: &str) -> String {
        Config::from_str(&format!("[default]\nrate = 1\n{l7}"), "rules.toml")
            .unwrap_err()
            .to_string()
    }

    fn rule(extra: &str) -> String {
        format!(
            "[[l7.rule]]\nname = \"r\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\n{extra}"
        )
    }

    #[test]
    fn the_issue_example_parses() {
        let c = Config::from_str(
            "[default]\nrate = 1\n[l7]\nhttp_listen = \"127.0.0.1:8082\"\nmax_keys = 1000000\n\
             [[l7.rule]]\nname = \"login-per-ip\"\ndomain = \"auth\"\n\
             descriptor = [{ key = \"auth_type\", value = \"login\" }, { key = \"remote_address\" }]\n\
             rate = 5\nper = \"1m\"\nalgorithm = \"sliding_log\"\naction = \"drop\"\nmode = \"hard\"\n",
            "x",
        )
        .unwrap();
        let r = &c.l7.rules[0];
        assert_eq!(
            (r.name.as_str(), r.domain.as_str(), r.descriptor.len()),
            ("login-per-ip", "auth", 2)
        );
        assert_eq!(r.descriptor[0].value.as_deref(), Some("login"));
        assert_eq!(r.descriptor[1].value, None);
        assert_eq!(r.algorithm, super::L7Algorithm::SlidingLog);
        assert_eq!(
            (r.limits[0].rate.amount, r.limits[0].rate.per_secs),
            (5, 60)
        );
    }

    /// A rule without `drain_over_limit` hashes as it did before the field
    /// existed (its fields in order, as the derived `Hash` did): its id and
    /// its cluster definition survive the upgrade. With it, they differ.
    #[test]
    fn a_rule_without_drain_over_limit_keeps_its_hash() {
        let text = |extra: &str| {
            format!(
                "[default]\nrate = 1\n{}",
                rule(&format!("rate = 5\n{extra}"))
            )
        };
        let r = Config::from_str(&text(""), "t").unwrap().l7.rules.remove(0);
        let old = (
            &r.name,
            &r.domain,
            &r.descriptor,
            &r.algorithm,
            &r.limits,
            &r.action,
            &r.mode,
            &r.scope,
            &r.batch_ms,
        );
        assert_eq!(
            crate::compile::stable_hash(&r, 0),
            crate::compile::stable_hash(&old, 0)
        );
        let drained = Config::from_str(&text("drain_over_limit = true\n"), "t")
            .unwrap()
            .l7
            .rules
            .remove(0);
        assert_ne!(
            crate::compile::stable_hash(&r, 0),
            crate::compile::stable_hash(&drained, 0)
        );
        let explicit = Config::from_str(&text("drain_over_limit = false\n"), "t")
            .unwrap()
            .l7
            .rules
            .remove(0);
        assert_eq!(
            crate::compile::stable_hash(&r, 0),
            crate::compile::stable_hash(&explicit, 0)
        );
    }

    #[test]
    fn bad_l7_rules_are_located() {
        let cases = [
            (rule("rate = 5\nalgorithm = \"leaky\"\n"), "rules.toml:8:13:", "algorithm = \"leaky\" is not allowed"),
            (rule("rate = 20000\nalgorithm = \"sliding_log\"\n"), "rules.toml:7:8:", "at most 10000"),
            (rule("algorithm = \"concurrency\"\n"), "rules.toml:3:1:", "needs `max`"),
            (rule("algorithm = \"concurrency\"\nmax = 3\nrate = 1\n"), "rules.toml:9:8:", "rate does not apply"),
            (rule("rate = 1\nmax = 3\n"), "rules.toml:8:7:", "max applies to algorithm = \"concurrency\" only"),
            (rule("rate = 1\nburst = 2\nalgorithm = \"fixed_window\"\n"), "rules.toml:8:9:", "burst applies to algorithm = \"token_bucket\" only"),
            (rule("limits = [{ bytes = \"1MB\" }]\n"), "rules.toml:7:21:", "give rate, not bytes"),
            ("[[l7.rule]]\nname = \"r\"\ndescriptor = [{ key = \"k\" }]\nrate = 1\n".into(), "rules.toml:3:1:", "missing domain"),
            ("[[l7.rule]]\nname = \"R!\"\n".into(), "rules.toml:4:8:", "is not allowed"),
            (format!("{}{}", rule("rate = 1\n"), rule("rate = 2\n")), "rules.toml:9:8:", "already used"),
            ("[l7]\nmax_keys = 0\n".into(), "rules.toml:4:12:", "l7.max_keys = 0 is out of range"),
            ("[l7]\ngrpc_threads = 0\n".into(), "rules.toml:4:16:", "l7.grpc_threads = 0 is out of range"),
            ("[l7]\ngrpc_threads = 65\n".into(), "rules.toml:4:16:", "l7.grpc_threads = 65 is out of range"),
            ("[l7]\nmax_connections = 0\n".into(), "rules.toml:4:19:", "l7.max_connections = 0 is out of range"),
            ("[l7]\nhttp_listen = \"localhost\"\n".into(), "rules.toml:4:15:", "is not an address"),
            ("[l7]\ngrpc_listen = \"8081\"\n".into(), "rules.toml:4:15:", "is not an address"),
            ("[l7]\nbogus = 1\n".into(), "rules.toml:4:1:", "unknown field `bogus`"),
            (rule("rate = 1\nmode = \"elastic\"\n"), "rules.toml:8:8:", "needs pool_rate"),
            (rule("rate = 1\nalgorithm = \"sliding_log\"\nmode = \"elastic\"\npool_rate = 5\n"), "rules.toml:9:8:", "applies to token_bucket, fixed_window and sliding_window"),
            (rule("rate = 1\npool_rate = 5\n"), "rules.toml:8:13:", "pool_rate and pool_per need mode = \"elastic\""),
            (rule("rate = 1\nalgorithm = \"sliding_log\"\nmode = \"soft\"\n"), "rules.toml:9:8:", "mode = \"soft\" applies to token_bucket"),
            (rule("algorithm = \"concurrency\"\nmax = 3\nmode = \"soft\"\n"), "rules.toml:9:8:", "mode = \"soft\" applies to token_bucket"),
            (rule("rate = 300000000\nper = \"1h\"\nalgorithm = \"sliding_window\"\n"), "rules.toml:7:8:", "more than a sliding window counts"),
            (rule("limits = [{ rate = 300000000, per = \"1h\" }]\nalgorithm = \"sliding_window\"\n"), "rules.toml:7:10:", "more than a sliding window counts"),
            (rule("algorithm = \"concurrency\"\nmax = 3\ndrain_over_limit = true\n"), "rules.toml:9:20:", "nothing to drain"),
            (rule("rate = 1\nmode = \"elastic\"\npool_rate = 5\ndrain_over_limit = true\n"), "rules.toml:10:20:", "would charge the overdraw to the shared pool"),
            (rule("rate = 1\ndrain_over_limit = 1\n"), "rules.toml:8:20:", "invalid type"),
        ];
        for (text, at, needle) in cases {
            let e = error_of(&text);
            assert!(
                e.starts_with(at) && e.contains(needle),
                "{text}\nexpected {at} … {needle}, got: {e}"
            );
        }
    }
}
