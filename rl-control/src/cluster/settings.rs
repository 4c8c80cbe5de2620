//! `[cluster]` and a rule's `scope`: which Redis the daemons share, under
//! what name this host joins, how often packet-rule usage travels, how long
//! a Redis call may take, and what cluster rules do while Redis is away.

use serde::Deserialize;
use toml::Spanned;

use crate::{
    config::rules::choice,
    config::units::parse_millis,
    config::{ConfigError, Located},
};

/// Where a rule's limit holds: on this host, or across every daemon that
/// shares the `[cluster]` Redis and defines the rule the same way.
///
/// Hashing writes nothing for `Local`, so a local rule's stable id (a hash
/// of its definition) is what it was before scopes existed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scope {
    #[default]
    Local,
    Cluster,
}

impl std::hash::Hash for Scope {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        if *self == Scope::Cluster {
            h.write_u8(0xc1);
        }
    }
}

/// What a cluster rule enforces while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Each host enforces the rule's own limit on its own (packet rules keep
    /// the usage already charged).
    Local,
    /// No limit.
    Open,
    /// Everything over: drop / 429.
    Closed,
}

impl OnFailure {
    pub fn name(self) -> &'static str {
        match self {
            OnFailure::Local => "local",
            OnFailure::Open => "open",
            OnFailure::Closed => "closed",
        }
    }
}

/// Most seed URLs in `redis`.
pub const MAX_SEEDS: usize = 16;
/// Longest `timeout` and `sync_interval`.
pub const MAX_TIMER_MS: u64 = 60_000;

/// A validated `[cluster]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// One URL: a standalone Redis; several: seeds of a Redis Cluster.
    pub redis: Vec<String>,
    /// This host's name among the daemons.
    pub node: String,
    pub sync_interval_ms: u64,
    pub timeout_ms: u64,
    pub on_failure: OnFailure,
}

impl ClusterConfig {
    /// Several seeds mean a Redis Cluster.
    pub fn is_redis_cluster(&self) -> bool {
        self.redis.len() > 1
    }

    /// The Redis URLs for logs, errors and `/v1/status`: passwords hidden.
    pub fn redis_shown(&self) -> Vec<String> {
        self.redis.iter().map(|u| redacted(u)).collect()
    }
}

/// `url` with the password of its user part (`redis://user:secret@host`,
/// `redis://:secret@host`) shown as `***`.
pub fn redacted(url: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let Some(at) = url[start..end].rfind('@').map(|i| start + i) else {
        return url.to_string();
    };
    match url[start..at].find(':') {
        Some(colon) => format!("{}***{}", &url[..start + colon + 1], &url[at..]),
        None => url.to_string(),
    }
}

/// `text` with every URL in it (`scheme://…` up to a quote or space)
/// [`redacted`]: for what must not reveal a password, or let anyone test
/// guesses of it.
pub fn redacted_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let start = rest[..i]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '+'))
            .map_or(0, |j| j + 1);
        let end = rest[i..]
            .find(|c: char| c == '"' || c == '\'' || c.is_whitespace())
            .map_or(rest.len(), |j| i + j);
        out.push_str(&rest[..start]);
        out.push_str(&redacted(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCluster {
    redis: Option<Spanned<Vec<Spanned<String>>>>,
    node: Option<Spanned<String>>,
    sync_interval: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    on_failure: Option<Spanned<String>>,
}

/// This machine's host name (the default `node`).
/// The host's name, as it was the first time it was asked in this process:
/// a `[cluster]` without `node` parses to the same config for the daemon's
/// whole life, so a `hostnamectl set-hostname` does not make every later
/// change look like a `[cluster]` edit (refused) until a restart.
pub fn hostname() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(read_hostname).clone()
}

fn read_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // or truncates.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    if r == 0 && valid_node(&name) {
        name
    } else {
        "rl".to_string()
    }
}

fn valid_node(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// `[cluster]`, if the file has one.
pub(crate) fn validate(
    loc: &Located,
    raw: &Option<Spanned<RawCluster>>,
) -> Result<Option<ClusterConfig>, ConfigError> {
    let Some(spanned) = raw else { return Ok(None) };
    let (r, table) = (spanned.get_ref(), spanned.span());
    let Some(urls) = &r.redis else {
        return Err(loc.at(table, "[cluster] needs redis = [\"redis://HOST:PORT\"] (one URL: a standalone Redis; several: seeds of a Redis Cluster)".into()));
    };
    if urls.get_ref().is_empty() || urls.get_ref().len() > MAX_SEEDS {
        return Err(loc.at(
            urls.span(),
            format!("cluster.redis needs 1..={MAX_SEEDS} URLs"),
        ));
    }
    let mut redis = Vec::new();
    for u in urls.get_ref() {
        let text = u.get_ref();
        let ok = (text.starts_with("redis://")
            || text.starts_with("redis+unix://")
            || text.starts_with("unix://"))
            && redis::Client::open(text.as_str()).is_ok();
        if !ok {
            return Err(loc.at(u.span(), format!("cluster.redis: \"{text}\" is not a Redis URL: write redis://HOST:PORT, such as \"redis://10.0.0.5:6379\"")));
        }
        redis.push(text.clone());
    }
    let node = match &r.node {
        Some(n) if valid_node(n.get_ref()) => n.get_ref().clone(),
        Some(n) => return Err(loc.at(n.span(), format!("cluster.node = \"{}\" is not allowed: use 1..=64 characters from A-Z, a-z, 0-9, -, _ and .", n.get_ref()))),
        None => hostname(),
    };
    let millis = |v: &Option<Spanned<String>>, what: &str, default: u64| match v {
        None => Ok(default),
        Some(s) => parse_millis(s.get_ref(), MAX_TIMER_MS)
            .map_err(|m| loc.at(s.span(), format!("cluster.{what}: {m}"))),
    };
    let on_failure = choice(
        loc,
        "cluster.on_failure",
        &r.on_failure,
        &[
            ("local", OnFailure::Local),
            ("open", OnFailure::Open),
            ("closed", OnFailure::Closed),
        ],
    )?;
    Ok(Some(ClusterConfig {
        redis,
        node,
        sync_interval_ms: millis(&r.sync_interval, "sync_interval", 100)?,
        timeout_ms: millis(&r.timeout, "timeout", 50)?,
        on_failure,
    }))
}

/// A rule's `scope`: "local" (the default) or "cluster", which needs a
/// `[cluster]` section.
pub(crate) fn scope_of(
    loc: &Located,
    who: &str,
    v: &Option<Spanned<String>>,
    has_cluster: bool,
) -> Result<Scope, ConfigError> {
    let scope = choice(
        loc,
        &format!("{who}: scope"),
        v,
        &[("local", Scope::Local), ("cluster", Scope::Cluster)],
    )?;
    if scope == Scope::Cluster && !has_cluster {
        let span = v.as_ref().map(|s| s.span()).unwrap_or_default();
        return Err(loc.at(span, format!("{who}: scope = \"cluster\" needs a [cluster] section naming the Redis the hosts share")));
    }
    Ok(scope)
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn error_of(text: &str) -> String {
        Config::from_str(&format!("{DEFAULT}{text}"), "rl.toml")
            .expect_err("must be refused")
            .to_string()
    }

    /// Two lines before every example.
    const DEFAULT: &str = "[default]\nrate = 1\n";
    const REDIS: &str = "[cluster]\nredis = [\"redis://10.0.0.5:6379\"]\n";

    #[test]
    fn cluster_settings_parse_with_defaults() {
        let c = Config::from_str(&format!("{DEFAULT}{REDIS}node = \"edge-1\"\n"), "rl.toml")
            .unwrap()
            .cluster
            .unwrap();
        assert_eq!(
            (
                c.node.as_str(),
                c.sync_interval_ms,
                c.timeout_ms,
                c.on_failure
            ),
            ("edge-1", 100, 50, super::OnFailure::Local)
        );
        assert!(!c.is_redis_cluster());
        let c = Config::from_str("[default]\nrate = 1\n[cluster]\nredis = [\"redis://a:1\", \"redis://b:2\"]\ntimeout = \"2s\"\non_failure = \"closed\"\n", "rl.toml").unwrap();
        let c = c.cluster.unwrap();
        assert!(c.is_redis_cluster());
        assert_eq!(
            (c.timeout_ms, c.on_failure),
            (2000, super::OnFailure::Closed)
        );
        assert!(!c.node.is_empty(), "the host name by default");
    }

    #[test]
    fn passwords_in_redis_urls_are_hidden() {
        assert_eq!(
            super::redacted("redis://user:s3cret@10.0.0.5:6379/0"),
            "redis://user:***@10.0.0.5:6379/0"
        );
        assert_eq!(super::redacted("redis://:s3cret@host"), "redis://:***@host");
        assert_eq!(
            super::redacted("redis://10.0.0.5:6379"),
            "redis://10.0.0.5:6379"
        );
        assert_eq!(super::redacted("redis://user@host"), "redis://user@host");
        assert_eq!(
            super::redacted("unix:///run/redis.sock"),
            "unix:///run/redis.sock"
        );
        // Every URL of a text, wherever it is quoted.
        assert_eq!(
            super::redacted_in(
                "redis = [\"redis://a:s3cret@h:1\", 'rediss://:x@h2']\n# http://u:p@w\n"
            ),
            "redis = [\"redis://a:***@h:1\", 'rediss://:***@h2']\n# http://u:***@w\n"
        );
        assert_eq!(super::redacted_in("no url: here"), "no url: here");
    }

    #[test]
    fn invalid_cluster_values_are_refused_with_line_and_column() {
        for (text, at, needle) in [
            ("[cluster]\nnode = \"a\"\n".to_string(), "rl.toml:3:1:", "needs redis = ["),
            ("[cluster]\nredis = []\n".into(), "rl.toml:4:9:", "needs 1..=16 URLs"),
            ("[cluster]\nredis = [\"http://x\"]\n".into(), "rl.toml:4:10:", "is not a Redis URL"),
            (format!("{REDIS}node = \"a b\"\n"), "rl.toml:5:8:", "is not allowed"),
            (format!("{REDIS}sync_interval = \"0ms\"\n"), "rl.toml:5:17:", "is zero"),
            (format!("{REDIS}timeout = \"5 parsecs\"\n"), "rl.toml:5:11:", "is not a duration"),
            (format!("{REDIS}timeout = \"2m\"\n"), "rl.toml:5:11:", "too long"),
            (format!("{REDIS}on_failure = \"maybe\"\n"), "rl.toml:5:14:", "use one of local, open, closed"),
            (format!("{REDIS}colour = 1\n"), "rl.toml:5:1:", "unknown field"),
            ("[[rule]]\nname = \"a\"\nrate = 1\nscope = \"cluster\"\n".into(), "rl.toml:6:9:", "needs a [cluster] section"),
            (format!("{REDIS}[[rule]]\nname = \"a\"\nrate = 1\nscope = \"everywhere\"\n"), "rl.toml:8:9:", "use one of local, cluster"),
            (format!("{REDIS}[[rule]]\nname = \"a\"\nrate = 1\nalgorithm = \"fixed_window\"\nscope = \"cluster\"\n"), "rl.toml:9:9:", "needs algorithm = \"token_bucket\""),
            (format!("{REDIS}[[rule]]\nname = \"a\"\nbytes = \"1MB\"\nscope = \"cluster\"\n"), "rl.toml:8:9:", "packet limits"),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 1\nscope = \"cluster\"\ndrain_over_limit = true\n"),
                "rl.toml:11:20:",
                "not available to scope = \"cluster\" rules yet",
            ),
            (
                format!("{REDIS}[[rule]]\nname = \"a\"\nrate = 1\nscope = \"cluster\"\nflood_wide_cells = true\n"),
                "rl.toml:9:20:",
                "flood_wide_cells = true on a cluster rule",
            ),
            (
                "[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{ key = \"k\" }]\nrate = 1\nbatch = \"10ms\"\n".into(),
                "rl.toml:8:9:",
                "batch needs scope = \"cluster\"",
            ),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 1\nalgorithm = \"sliding_log\"\nscope = \"cluster\"\nbatch = \"10ms\"\n"),
                "rl.toml:12:9:",
                "batch applies to algorithm = \"token_bucket\" only",
            ),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 1\nscope = \"cluster\"\nbatch = \"0ms\"\n"),
                "rl.toml:11:9:",
                "batch: \"0ms\" is zero",
            ),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 1\nmode = \"elastic\"\npool_rate = 5\nscope = \"cluster\"\n"),
                "rl.toml:10:8:",
                "cannot be scope = \"cluster\"",
            ),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 1\nper = \"1d\"\nburst = 105000\nscope = \"cluster\"\n"),
                "rl.toml:12:9:",
                "at most 2^53",
            ),
            (
                format!("{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nalgorithm = \"concurrency\"\nmax = 10001\nscope = \"cluster\"\n"),
                "rl.toml:11:9:",
                "at most 10000 for a cluster concurrency rule",
            ),
        ] {
            let e = error_of(&text);
            assert!(e.starts_with(at) && e.contains(needle), "{text:?}: expected {at} … {needle:?}, got: {e}");
        }
    }

    /// A cluster semaphore at the most permits, with a long lease, loads:
    /// its script never multiplies the two.
    #[test]
    fn a_cluster_semaphore_with_a_long_lease_loads() {
        let text = format!("[default]\nrate = 1\n{REDIS}[[l7.rule]]\nname = \"a\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nalgorithm = \"concurrency\"\nmax = 10000\nlease = \"120d\"\nscope = \"cluster\"\n");
        Config::from_str(&text, "rl.toml").unwrap();
    }

    #[test]
    fn a_local_rule_keeps_its_stable_id_when_scopes_exist() {
        // The scope writes nothing into the hash of a local rule, so pinned
        // buckets keep their rule ids across this upgrade.
        let text = "[default]\nrate = 1\n[[rule]]\nname = \"a\"\nrate = 5\n";
        let with = format!("{text}scope = \"local\"\n{REDIS}");
        let a = Config::from_str(text, "rl.toml").unwrap();
        let b = Config::from_str(&with, "rl.toml").unwrap();
        assert_eq!(
            crate::compile::stable_hash(&a.rules[0], 0),
            crate::compile::stable_hash(&b.rules[0], 0)
        );
        let c =
            Config::from_str(&format!("{text}scope = \"cluster\"\n{REDIS}"), "rl.toml").unwrap();
        assert_ne!(
            crate::compile::stable_hash(&a.rules[0], 0),
            crate::compile::stable_hash(&c.rules[0], 0)
        );
    }
}
