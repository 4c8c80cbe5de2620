//! The rule file: schema, defaults and validation.
//!
//! A bad file is never half-used: [`Config::from_str`] either returns a fully
//! validated configuration or one error naming `file:line:column`, what is
//! wrong and what is allowed. There is no fallback to defaults on error (a
//! typo must not silently turn limits off).
//!
//! The room's other parts: [`rules`] (the rule language), [`units`] (its
//! values) and [`document`] (the file as a document the admin API edits).

pub mod document;
pub mod rules;
pub mod units;

use std::{fmt, ops::Range, path::Path};

use serde::Deserialize;
use toml::Spanned;

use crate::{
    config::rules::{
        int_in, int_or, validate_list, validate_rules, RawList, RawRule, Rule, MAX_LIST_CIDRS,
    },
    config::units::Cidr,
};

/// The configuration used when `rl-control run` gets no `--config`.
pub const EMBEDDED_DEFAULT: &str = "\
# rl's embedded default: every source held to 1000 packets/s, burst 2000.
[datapath]
max_sources = 1048576
ipv4_prefix = 32
ipv6_prefix = 64

[default]
rate = 1000
burst = 2000
";

/// Largest LRU capacity accepted. Each entry costs roughly 100 bytes of
/// kernel memory, so this caps the map near 1.6 GiB.
pub const MAX_SOURCES_LIMIT: u64 = 16 * 1024 * 1024;
/// Highest per-source rate accepted, in packets per second.
pub const MAX_RATE: u64 = 100_000_000;
/// Largest burst accepted, in packets.
pub const MAX_BURST: u64 = 1_000_000_000;

/// A validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub datapath: Datapath,
    /// `[l7]`: request rules and their listeners.
    pub l7: crate::l7::rules::L7Config,
    pub default: DefaultLimit,
    /// Sources never limited and never dropped by rules.
    pub allow: Vec<Cidr>,
    /// Sources always dropped (unless also allowed).
    pub deny: Vec<Cidr>,
    /// `[[rule]]`s in file order: the first match charges the packet.
    pub rules: Vec<Rule>,
    /// `[api]`: where the admin API listens and how it authenticates.
    pub api: ApiConfig,
    /// `[[ban]]`: prefixes dropped until a moment (written by the admin API,
    /// so a restart keeps them). Expired bans are ignored.
    pub bans: Vec<Ban>,
    /// `[cluster]`: the Redis that `scope = "cluster"` rules share.
    pub cluster: Option<crate::cluster::settings::ClusterConfig>,
}

/// The admin API's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApiConfig {
    /// `listen = "127.0.0.1:9100"`: also serve the admin API over TCP
    /// (needs `token_file`); `--api` overrides it.
    pub listen: Option<std::net::SocketAddr>,
    /// `metrics_listen = "127.0.0.1:9101"`: serve only `/metrics` and
    /// `/healthz` here, read-only, without a token.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `token_file = "..."`: a file holding the bearer token every `/v1`
    /// request must carry.
    pub token_file: Option<std::path::PathBuf>,
}

/// A temporary deny entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ban {
    pub cidr: Cidr,
    /// Unix time (seconds) at which the ban lifts.
    pub until: u64,
    pub reason: String,
}

impl Config {
    /// Bans still in force at Unix time `now`.
    pub fn active_bans(&self, now: u64) -> impl Iterator<Item = &Ban> {
        self.bans.iter().filter(move |b| b.until > now)
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Milliseconds since the Unix epoch (0 if the clock reads before it).
pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Datapath {
    /// Capacity of each family's bucket table.
    pub max_sources: u32,
    /// IPv4 sources are aggregated to this prefix length.
    pub ipv4_prefix: u8,
    /// IPv6 sources are aggregated to this prefix length.
    pub ipv6_prefix: u8,
    /// Host-wide rate of unseen keys (per second) above which the datapath
    /// stops creating per-source buckets and charges unseen keys to their
    /// prefix cells (flood mode). Each online CPU measures its share over
    /// 67 ms windows. 0: always.
    pub flood_new_keys_per_sec: u32,
    /// The prefix cells' lengths.
    pub flood_prefix_v4: u8,
    pub flood_prefix_v6: u8,
    /// Capacity of each family's prefix-cell table.
    pub flood_prefixes: u32,
    /// Whether a flood whose rule holds cells in a quarter of the slots (half of
    /// `flood_prefixes`) is charged to wide
    /// cells (8 bits shorter, IPv6 16) instead of a cell per prefix.
    pub flood_wide_cells: bool,
    /// How long a first fragment's verdict waits for its later fragments.
    pub fragment_ttl_ms: u16,
    /// What later fragments without a (remembered) first fragment get.
    pub fragment_orphans: FragmentOrphans,
    /// Where the maps and the XDP link are pinned (`<pin_dir>/<iface>/`),
    /// on a bpffs (mounted there if absent).
    pub pin_dir: std::path::PathBuf,
    /// Interfaces to protect when `--iface` is not given.
    pub interfaces: Vec<String>,
}

/// `datapath.pin_dir` by default.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/rl";

/// `datapath.fragment_orphans`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FragmentOrphans {
    /// Dropped: a flood of bare later fragments gets nothing through.
    Drop,
    /// Limited by source under the rules for their protocol with port 0.
    Source,
}

/// Defaults sized for a table of 1M sources per family.
pub const DEFAULT_FLOOD_NEW_KEYS_PER_SEC: u32 = 100_000;
pub const DEFAULT_FLOOD_PREFIXES: u32 = 65_536;

/// The per-source limit applied to all traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultLimit {
    /// Packets per second.
    pub rate: u64,
    /// Packets a source may send at once after being quiet.
    pub burst: u64,
}

/// A config error located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file (or `<embedded default>`).
    pub origin: String,
    /// 1-based line and column, when the error has a place in the file.
    pub at: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.origin, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The text being validated, to turn byte spans into located errors.
pub(crate) struct Located<'a> {
    pub text: &'a str,
    pub origin: &'a str,
}

/// An optional `IP:PORT` setting.
pub(crate) fn socket_address(
    loc: &Located,
    v: &Option<Spanned<String>>,
    name: &str,
    example: &str,
) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    match v {
        None => Ok(None),
        Some(l) => l.get_ref().parse().map(Some).map_err(|_| {
            loc.at(
                l.span(),
                format!(
                    "{name} = \"{}\" is not an address: write IP:PORT, such as \"{example}\"",
                    l.get_ref()
                ),
            )
        }),
    }
}

impl Located<'_> {
    /// An error at `span` (an empty span at 0 names no place).
    pub fn at(&self, span: Range<usize>, message: String) -> ConfigError {
        ConfigError {
            origin: self.origin.to_string(),
            at: (span != (0..0)).then(|| self.line_col(span.start)),
            message,
        }
    }

    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        line_col(self.text, offset)
    }
}

// The file's schema. Unknown keys are errors everywhere.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    datapath: RawDatapath,
    default: Option<Spanned<RawDefault>>,
    #[serde(default)]
    allow: Vec<RawList>,
    #[serde(default)]
    deny: Vec<RawList>,
    #[serde(default)]
    rule: Vec<Spanned<RawRule>>,
    #[serde(default)]
    api: RawApi,
    #[serde(default)]
    ban: Vec<RawBan>,
    #[serde(default)]
    l7: crate::l7::rules::RawL7,
    cluster: Option<Spanned<crate::cluster::settings::RawCluster>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawApi {
    listen: Option<Spanned<String>>,
    metrics_listen: Option<Spanned<String>>,
    token_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBan {
    cidr: Spanned<String>,
    until: Spanned<i64>,
    #[serde(default)]
    reason: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDatapath {
    max_sources: Option<Spanned<i64>>,
    ipv4_prefix: Option<Spanned<i64>>,
    ipv6_prefix: Option<Spanned<i64>>,
    flood_new_keys_per_sec: Option<Spanned<i64>>,
    flood_prefix_v4: Option<Spanned<i64>>,
    flood_prefix_v6: Option<Spanned<i64>>,
    flood_prefixes: Option<Spanned<i64>>,
    flood_wide_cells: Option<bool>,
    fragment_ttl_ms: Option<Spanned<i64>>,
    fragment_orphans: Option<FragmentOrphans>,
    pin_dir: Option<Spanned<String>>,
    #[serde(default)]
    interfaces: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDefault {
    rate: Spanned<i64>,
    burst: Option<Spanned<i64>>,
}

impl Config {
    /// One line saying what the config enforces, for `check-config` and the
    /// reload log: "N rules, A allow and D deny CIDRs; by default …".
    pub fn summary(&self) -> String {
        format!(
            "{} rules, {} allow and {} deny CIDRs{}; by default every source held to {} packets/s, burst {}",
            self.rules.len(),
            self.allow.len(),
            self.deny.len(),
            match self.active_bans(unix_now()).count() {
                0 => String::new(),
                n => format!(", {n} bans"),
            },
            self.default.rate,
            self.default.burst
        )
    }

    /// Reads and validates `path`.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: origin.clone(),
            at: None,
            message: format!("cannot read the config file: {e}"),
        })?;
        Config::from_str(&text, &origin)
    }

    /// The embedded default configuration.
    pub fn embedded_default() -> Config {
        Config::from_str(EMBEDDED_DEFAULT, "<embedded default>")
            .expect("the embedded default configuration is valid")
    }

    /// Parses and validates `text`; `origin` names it in errors.
    pub fn from_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
            origin: origin.to_string(),
            at: e.span().map(|s| line_col(text, s.start)),
            // toml's parser says what it found and what it expected on two
            // lines: errors are one line (logs, 422 bodies, the CLI).
            message: e
                .message()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("; "),
        })?;
        let loc = Located { text, origin };
        let datapath = datapath_of(&loc, &raw.datapath)?;
        let default = default_of(&loc, &raw.default)?;
        let allow = validate_list(&loc, "allow", &raw.allow)?;
        let deny = validate_list(&loc, "deny", &raw.deny)?;
        // Totals over the limit are located at the entry past it.
        let past = |n: usize| {
            let cidrs = raw
                .allow
                .iter()
                .chain(&raw.deny)
                .map(|l| l.cidr.span())
                .chain(raw.ban.iter().map(|b| b.cidr.span()));
            cidrs.clone().nth(n).unwrap_or(0..0)
        };
        if allow.len() + deny.len() > MAX_LIST_CIDRS {
            return Err(loc.at(
                past(MAX_LIST_CIDRS),
                format!("{} allow and {} deny CIDRs: the datapath holds at most {MAX_LIST_CIDRS} together", allow.len(), deny.len()),
            ));
        }
        let cluster = crate::cluster::settings::validate(&loc, &raw.cluster)?;
        let rules = validate_rules(&loc, &raw.rule, cluster.is_some())?;
        let address = |v: &Option<Spanned<String>>, name: &str, example: &str| {
            socket_address(&loc, v, name, example)
        };
        let api = ApiConfig {
            listen: address(&raw.api.listen, "api.listen", "127.0.0.1:9100")?,
            metrics_listen: address(
                &raw.api.metrics_listen,
                "api.metrics_listen",
                "127.0.0.1:9101",
            )?,
            token_file: raw.api.token_file.as_ref().map(|t| t.get_ref().into()),
        };
        if let (Some(l), None) = (&raw.api.listen, &api.token_file) {
            return Err(loc.at(
                l.span(),
                "api.listen serves the admin API over TCP, which needs api.token_file (a file holding the bearer token): \
                 add it, or drop listen and use the Unix socket (root only)"
                    .into(),
            ));
        }
        let bans = bans_of(&loc, &raw.ban)?;
        if allow.len() + deny.len() + bans.len() > MAX_LIST_CIDRS {
            return Err(loc.at(
                past(MAX_LIST_CIDRS),
                format!("{} allow, {} deny and {} ban CIDRs: the datapath holds at most {MAX_LIST_CIDRS} together", allow.len(), deny.len(), bans.len()),
            ));
        }
        let l7 = crate::l7::rules::validate(&loc, &raw.l7, cluster.is_some())?;
        Ok(Config {
            datapath,
            default,
            allow,
            deny,
            rules,
            api,
            bans,
            l7,
            cluster,
        })
    }
}

/// `[datapath]`.
fn datapath_of(loc: &Located, d: &RawDatapath) -> Result<Datapath, ConfigError> {
    let flood_keys = u64::from(DEFAULT_FLOOD_NEW_KEYS_PER_SEC);
    Ok(Datapath {
        max_sources: int_or(loc, "datapath.max_sources", &d.max_sources, 1, MAX_SOURCES_LIMIT as i64, 1 << 20)? as u32,
        ipv4_prefix: int_or(loc, "datapath.ipv4_prefix", &d.ipv4_prefix, 1, 32, 32)? as u8,
        ipv6_prefix: int_or(loc, "datapath.ipv6_prefix", &d.ipv6_prefix, 1, 128, 64)? as u8,
        flood_new_keys_per_sec: int_or(loc, "datapath.flood_new_keys_per_sec", &d.flood_new_keys_per_sec, 0, 1_000_000_000, flood_keys)? as u32,
        flood_prefix_v4: int_or(loc, "datapath.flood_prefix_v4", &d.flood_prefix_v4, 0, 32, 24)? as u8,
        flood_prefix_v6: int_or(loc, "datapath.flood_prefix_v6", &d.flood_prefix_v6, 0, 128, 48)? as u8,
        flood_prefixes: int_or(loc, "datapath.flood_prefixes", &d.flood_prefixes, 1, MAX_SOURCES_LIMIT as i64, u64::from(DEFAULT_FLOOD_PREFIXES))? as u32,
        flood_wide_cells: d.flood_wide_cells.unwrap_or(true),
        fragment_ttl_ms: int_or(loc, "datapath.fragment_ttl_ms", &d.fragment_ttl_ms, 1, 60_000, 1_000)? as u16,
        fragment_orphans: d.fragment_orphans.unwrap_or(FragmentOrphans::Drop),
        pin_dir: match &d.pin_dir {
            None => DEFAULT_PIN_DIR.into(),
            Some(p) if p.get_ref().starts_with('/') && !p.get_ref().contains("..") => p.get_ref().into(),
            Some(p) => {
                return Err(loc.at(
                    p.span(),
                    format!("datapath.pin_dir = {:?} must be an absolute path without `..` (on a bpffs, e.g. {DEFAULT_PIN_DIR})", p.get_ref()),
                ))
            }
        },
        interfaces: {
            let mut v = Vec::new();
            for i in &d.interfaces {
                let name = i.get_ref();
                // IFNAMSIZ - 1; no `/`, `+` (the pin directory joins names with it) or blanks.
                if name.is_empty() || name.len() > 15 || name.contains(['/', '+', ' ', '\t']) {
                    return Err(loc.at(i.span(), format!("datapath.interfaces: {name:?} is not an interface name (1 to 15 characters, no `/`, `+` or blanks)")));
                }
                if v.contains(name) {
                    return Err(loc.at(i.span(), format!("datapath.interfaces: {name:?} is listed twice: list each interface once")));
                }
                v.push(name.clone());
            }
            v
        },
    })
}

/// `[default]`: required, so that no typo turns every limit off.
fn default_of(
    loc: &Located,
    def: &Option<Spanned<RawDefault>>,
) -> Result<DefaultLimit, ConfigError> {
    let Some(def) = def else {
        return Err(loc.at(
            0..0,
            "missing [default] table: add `[default]` with `rate = <packets per second>` and optionally `burst = <packets>`".into(),
        ));
    };
    let rate = int_in(loc, "default.rate", &def.get_ref().rate, 1, MAX_RATE as i64)?;
    let burst = int_or(
        loc,
        "default.burst",
        &def.get_ref().burst,
        1,
        MAX_BURST as i64,
        rate,
    )?;
    // The arithmetic's own limits (interval ≥ 1 ns, span fits 64 bits).
    if let Err(e) = rl_common::Limit::per_second(rate, burst) {
        let why = match e {
            rl_common::limiter::LimitError::Zero => "a zero",
            rl_common::limiter::LimitError::RateTooHigh => "more than one packet per nanosecond",
            rl_common::limiter::LimitError::BurstTooLarge => "a burst longer than 2^64 ns",
        };
        return Err(loc.at(
            def.span(),
            format!("[default] rate {rate} with burst {burst} cannot be represented ({why})"),
        ));
    }
    Ok(DefaultLimit { rate, burst })
}

/// `[[ban]]`s, as the API writes them.
fn bans_of(loc: &Located, raw: &[RawBan]) -> Result<Vec<Ban>, ConfigError> {
    let mut bans = Vec::with_capacity(raw.len());
    for (i, b) in raw.iter().enumerate() {
        let cidr = units::parse_cidr(b.cidr.get_ref())
            .map_err(|m| loc.at(b.cidr.span(), format!("ban[{i}].cidr: {m}")))?;
        let until = u64::try_from(*b.until.get_ref()).map_err(|_| {
            loc.at(
                b.until.span(),
                format!("ban[{i}].until must be a Unix time in seconds, not negative"),
            )
        })?;
        bans.push(Ban {
            cidr,
            until,
            reason: b.reason.clone(),
        });
    }
    Ok(bans)
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(text: &str) -> String {
        Config::from_str(text, "rules.toml")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn embedded_default_is_1000_pps_burst_2000() {
        let c = Config::embedded_default();
        assert_eq!(
            c.default,
            DefaultLimit {
                rate: 1000,
                burst: 2000
            }
        );
        assert_eq!(
            c.datapath,
            Datapath {
                max_sources: 1 << 20,
                ipv4_prefix: 32,
                ipv6_prefix: 64,
                flood_new_keys_per_sec: 100_000,
                flood_prefix_v4: 24,
                flood_prefix_v6: 48,
                flood_prefixes: 65_536,
                flood_wide_cells: true,
                fragment_ttl_ms: 1_000,
                fragment_orphans: FragmentOrphans::Drop,
                pin_dir: DEFAULT_PIN_DIR.into(),
                interfaces: vec![],
            }
        );
    }

    #[test]
    fn defaults_fill_missing_datapath_and_burst() {
        let c = Config::from_str("[default]\nrate = 50\n", "x").unwrap();
        assert_eq!(c.default.burst, 50, "burst defaults to rate");
        assert_eq!(c.datapath.ipv6_prefix, 64);
    }

    #[test]
    fn totals_over_the_datapath_are_located_at_the_entry_past_them() {
        let cidr = |i: usize| format!("cidr = \"10.{}.{}.{}\"\n", i >> 16, (i >> 8) & 255, i & 255);
        let mut text = String::from("[default]\nrate = 1\n");
        for i in 0..MAX_LIST_CIDRS - 1 {
            text += &format!("[[allow]]\n{}", cidr(i));
        }
        // Allow and deny fill the datapath; the first ban is one too many.
        text += &format!("[[deny]]\n{}", cidr(MAX_LIST_CIDRS - 1));
        for i in [MAX_LIST_CIDRS, MAX_LIST_CIDRS + 1] {
            text += &format!("[[ban]]\n{}until = 4102444800\n", cidr(i));
        }
        let first_ban = 2 + 2 * MAX_LIST_CIDRS + 2;
        let e = error_of(&text);
        assert!(
            e.starts_with(&format!("rules.toml:{first_ban}:8: "))
                && e.contains("262143 allow, 1 deny and 2 ban CIDRs"),
            "{e}"
        );
    }

    #[test]
    fn syntax_errors_are_one_line() {
        for (text, want) in [
            (
                "[default]\nrate = = 1\n",
                "rules.toml:2:8: invalid string; expected `\"`, `'`",
            ),
            (
                "[default]\nrate = 1\n[[rule]\n",
                "rules.toml:3:7: invalid table header; expected `.`, `]]`",
            ),
        ] {
            assert_eq!(error_of(text), want);
        }
    }

    #[test]
    fn errors_name_line_column_and_allowed_range() {
        assert_eq!(
            error_of("[default]\nrate = 0\n"),
            "rules.toml:2:8: default.rate = 0 is out of range: allowed 1..=100000000"
        );
        assert_eq!(
            error_of("[datapath]\nipv6_prefix = 129\n[default]\nrate = 5\n"),
            "rules.toml:2:15: datapath.ipv6_prefix = 129 is out of range: allowed 1..=128"
        );
        assert_eq!(
            error_of("[default]\nrate = 5\nburst = 0\n"),
            "rules.toml:3:9: default.burst = 0 is out of range: allowed 1..=1000000000"
        );
    }

    #[test]
    fn an_interface_listed_twice_is_refused_with_its_place() {
        assert_eq!(
            error_of("[datapath]\ninterfaces = [\"eth0\", \"eth1\", \"eth0\"]\n[default]\nrate = 5\n"),
            "rules.toml:2:31: datapath.interfaces: \"eth0\" is listed twice: list each interface once"
        );
    }

    #[test]
    fn flood_settings_are_validated_with_their_place() {
        let cfg = |line: &str| format!("[datapath]\n{line}\n[default]\nrate = 5\n");
        assert_eq!(
            error_of(&cfg("flood_new_keys_per_sec = -1")),
            "rules.toml:2:26: datapath.flood_new_keys_per_sec = -1 is out of range: allowed 0..=1000000000"
        );
        assert_eq!(
            error_of(&cfg("flood_prefix_v4 = 33")),
            "rules.toml:2:19: datapath.flood_prefix_v4 = 33 is out of range: allowed 0..=32"
        );
        assert_eq!(
            error_of(&cfg("flood_prefix_v6 = 129")),
            "rules.toml:2:19: datapath.flood_prefix_v6 = 129 is out of range: allowed 0..=128"
        );
        assert_eq!(
            error_of(&cfg("flood_prefixes = 0")),
            "rules.toml:2:18: datapath.flood_prefixes = 0 is out of range: allowed 1..=16777216"
        );
        assert_eq!(
            error_of(&cfg("fragment_ttl_ms = 0")),
            "rules.toml:2:19: datapath.fragment_ttl_ms = 0 is out of range: allowed 1..=60000"
        );
        let orphans = error_of(&cfg("fragment_orphans = \"pass\""));
        assert!(
            orphans.starts_with(
                "rules.toml:2:20: unknown variant `pass`, expected `drop` or `source`"
            ),
            "{orphans}"
        );
        let c = Config::from_str(&cfg("flood_new_keys_per_sec = 0"), "x").unwrap();
        assert_eq!(c.datapath.flood_new_keys_per_sec, 0);
        let e = error_of(&cfg("pin_dir = \"rl\""));
        assert!(
            e.starts_with("rules.toml:2:11: datapath.pin_dir = \"rl\" must be an absolute path"),
            "{e}"
        );
        let c = Config::from_str(&cfg("pin_dir = \"/run/rl/bpf\""), "x").unwrap();
        assert_eq!(c.datapath.pin_dir, std::path::Path::new("/run/rl/bpf"));
    }

    #[test]
    fn unknown_keys_and_bad_syntax_are_located() {
        let e = error_of("[default]\nrate = 5\nbrust = 3\n");
        assert!(
            e.starts_with("rules.toml:3:1: unknown field `brust`"),
            "{e}"
        );
        let e = error_of("[datapth]\n");
        assert!(
            e.starts_with("rules.toml:1:2: unknown field `datapth`"),
            "{e}"
        );
        let e = error_of("[default]\nrate = \"fast\"\n");
        assert!(
            e.starts_with("rules.toml:2:8: invalid type: string \"fast\""),
            "{e}"
        );
        let e = error_of("[default\n");
        assert!(e.starts_with("rules.toml:1:"), "{e}");
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let c =
            Config::from_str(include_str!("../../../dist/rules.toml"), "dist/rules.toml").unwrap();
        assert_eq!(c.rules.len(), 3);
        assert_eq!(
            c.api.metrics_listen,
            Some("127.0.0.1:9101".parse().unwrap())
        );
        assert_eq!(
            c.api.listen, None,
            "the admin API over TCP needs a token file the example cannot ship"
        );
    }

    #[test]
    fn an_api_listener_without_a_token_is_refused_where_it_is_written() {
        let e = error_of("[default]\nrate = 1\n[api]\nlisten = \"127.0.0.1:9100\"\n");
        assert!(e.starts_with("rules.toml:4:10: api.listen serves the admin API over TCP, which needs api.token_file"), "{e}");
    }

    #[test]
    fn missing_default_is_an_error_not_a_silent_no_limit() {
        let e = error_of("[datapath]\nmax_sources = 10\n");
        assert!(e.contains("missing [default] table"), "{e}");
    }
}
