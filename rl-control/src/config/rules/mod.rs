//! The rule language: `[[allow]]`, `[[deny]]` and `[[rule]]` tables, from raw
//! TOML to validated rules.
//!
//! Precedence (the datapath implements exactly this): a packet whose source is
//! in an `allow` CIDR passes, uncounted by any limit; else one in a `deny`
//! CIDR drops; else the first `[[rule]]` in file order whose match fits
//! charges it; else `[default]` does. A packet is charged to exactly one rule.

use std::{collections::HashMap, ops::Range};

use serde::Deserialize;
use toml::Spanned;

pub use crate::cluster::settings::Scope;
use crate::{
    cluster::settings::scope_of,
    config::units::{parse_cidr, parse_port_range, Cidr},
    config::{ConfigError, Located},
};

/// Most `[[rule]]`s the datapath holds.
pub const MAX_RULES: usize = 1024;
/// `dst_ports` entries (ports or ranges) one rule may list.
pub const MAX_PORTS_PER_RULE: usize = 256;
/// `dst_ports` entries of all rules together: bounds the L4 classes (16-bit
/// in the datapath) and keeps compilation well under a second.
pub const MAX_PORTS_TOTAL: usize = 2048;

/// Most `allow` plus `deny` CIDRs the datapath holds.
pub const MAX_LIST_CIDRS: usize = 262_144;
/// Most `src` CIDRs over all rules: each one adds at most one source class
/// (the set of `src` CIDRs covering an address is a chain, named by its
/// longest), and with the empty class they must fit the datapath's 16 bits.
pub const MAX_SRC_CIDRS: usize = 65_535;
/// Most limits on one rule, counting packet and byte limits separately.
pub const MAX_LIMITS: usize = 4;
/// Largest `rate` in packets per `per`.
pub const MAX_RULE_RATE: u64 = 1_000_000_000;
/// Largest `bytes` per `per` (about 100 Gbit/s for a day).
pub const MAX_RULE_BYTES: u64 = 1_000_000_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    Any,
    Tcp,
    Udp,
    Icmp,
    Icmpv6,
}

/// What a rule's buckets are keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyScope {
    /// One bucket per source (aggregated to `[datapath]` prefixes).
    Source,
    /// One bucket per IPv4 /`v4` or IPv6 /`v6` network.
    Prefix { v4: u8, v6: u8 },
    /// One bucket for all traffic the rule matches.
    Global,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    TokenBucket,
    FixedWindow,
    SlidingWindow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Drop,
    /// Count what would drop, pass it.
    Shadow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Hard,
    /// Pass up to `percent` % over the limit (counted), drop beyond.
    Soft {
        percent: u32,
    },
    /// Exceed the per-key limit while the rule's shared pool has capacity.
    Elastic {
        pool: Rate,
    },
}

/// What a limit counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Packets,
    Bytes,
}

/// `amount` per `per_secs` seconds, allowing `burst` at once (token bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    pub amount: u64,
    pub per_secs: u64,
    pub burst: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuleLimit {
    pub unit: Unit,
    pub rate: Rate,
}

impl RuleLimit {
    /// The rate `mode` enforces: soft mode passes `percent` % more.
    pub fn enforced(&self, mode: Mode) -> Rate {
        match mode {
            Mode::Soft { percent } => {
                let scale = |n: u64| {
                    (n as u128 * (100 + percent as u128) / 100).min(u64::MAX as u128) as u64
                };
                Rate {
                    amount: scale(self.rate.amount),
                    per_secs: self.rate.per_secs,
                    burst: scale(self.rate.burst),
                }
            }
            _ => self.rate,
        }
    }
}

/// A validated `[[rule]]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub name: String,
    pub proto: Proto,
    /// Inclusive destination port ranges; empty matches every port (and
    /// packets without ports).
    pub dst_ports: Vec<(u16, u16)>,
    /// Only TCP segments with SYN set and ACK clear.
    pub syn_only: bool,
    /// Source CIDRs; empty matches every source.
    pub src: Vec<Cidr>,
    pub key: KeyScope,
    /// All must pass. At least one, at most [`MAX_LIMITS`].
    pub limits: Vec<RuleLimit>,
    pub algorithm: Algorithm,
    pub action: Action,
    pub mode: Mode,
    /// `scope = "cluster"`: one limit shared by every host (see [`crate::cluster`]).
    pub scope: Scope,
    /// `flood_wide_cells`: whether this rule's floods may go wide (`None`:
    /// as `[datapath]` says). Not part of the rule's state: changing it
    /// keeps the rule's buckets.
    pub wide_cells: NotState<Option<bool>>,
}

/// A rule setting that is not part of its buckets' identity: the rule's
/// id hashes the rule (`compile::rule_entry`), and this hashes to nothing,
/// so setting or changing it keeps every id (and so every bucket).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotState<T>(pub T);

impl<T> std::hash::Hash for NotState<T> {
    fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
}

// ---- Raw schema ---------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawList {
    pub(crate) cidr: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRule {
    name: Option<Spanned<String>>,
    proto: Option<Spanned<String>>,
    dst_ports: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    tcp_flags: Option<Spanned<String>>,
    src: Option<Spanned<Vec<Spanned<String>>>>,
    key: Option<Spanned<String>>,
    prefix_v4: Option<Spanned<i64>>,
    prefix_v6: Option<Spanned<i64>>,
    rate: Option<Spanned<i64>>,
    per: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    bytes: Option<Spanned<toml::Value>>,
    byte_burst: Option<Spanned<toml::Value>>,
    limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    algorithm: Option<Spanned<String>>,
    action: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    soft_percent: Option<Spanned<i64>>,
    pool_rate: Option<Spanned<i64>>,
    pool_per: Option<Spanned<String>>,
    scope: Option<Spanned<String>>,
    flood_wide_cells: Option<Spanned<bool>>,
}

#[derive(Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLimit {
    pub(crate) rate: Option<Spanned<i64>>,
    pub(crate) per: Option<Spanned<String>>,
    pub(crate) burst: Option<Spanned<i64>>,
    pub(crate) bytes: Option<Spanned<toml::Value>>,
    pub(crate) byte_burst: Option<Spanned<toml::Value>>,
}

impl RawRule {
    /// The rule's own rate/per/burst/bytes/byte_burst, as one limit group.
    fn own_limit(&self) -> RawLimit {
        RawLimit {
            rate: self.rate.clone(),
            per: self.per.clone(),
            burst: self.burst.clone(),
            bytes: self.bytes.clone(),
            byte_burst: self.byte_burst.clone(),
        }
    }
}

impl RawLimit {
    pub(crate) fn is_empty(&self) -> bool {
        self.rate.is_none()
            && self.per.is_none()
            && self.burst.is_none()
            && self.bytes.is_none()
            && self.byte_burst.is_none()
    }
}

// ---- Validation ---------------------------------------------------------

mod fields;
pub(crate) use fields::{
    checked_name, choice, duration, int_in, int_or, limits_of, mode_of, sliding_fits, ModeFields,
};

pub(crate) fn validate_list(
    loc: &Located,
    which: &str,
    raw: &[RawList],
) -> Result<Vec<Cidr>, ConfigError> {
    raw.iter()
        .enumerate()
        .map(|(i, r)| {
            parse_cidr(r.cidr.get_ref())
                .map_err(|m| loc.at(r.cidr.span(), format!("{which}[{i}].cidr: {m}")))
        })
        .collect()
}

pub(crate) fn validate_rules(
    loc: &Located,
    raw: &[Spanned<RawRule>],
    has_cluster: bool,
) -> Result<Vec<Rule>, ConfigError> {
    if raw.len() > MAX_RULES {
        return Err(loc.at(
            raw[MAX_RULES].span(),
            format!(
                "{} rules: the datapath holds at most {MAX_RULES}",
                raw.len()
            ),
        ));
    }
    /// The names of the built-in rows of the per-rule counters.
    const RESERVED_NAMES: [&str; 3] = ["default", "allow", "deny"];
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut rules = Vec::with_capacity(raw.len());
    let mut ports_total = 0usize;
    for (i, spanned) in raw.iter().enumerate() {
        let r = spanned.get_ref();
        let table = spanned.span();
        let name = r.name.as_ref().ok_or_else(|| {
            loc.at(table.clone(), format!("rule #{}: missing name: every rule needs a unique `name` ([a-z0-9_-], 1..=48 characters)", i + 1))
        })?;
        let n = checked_name(loc, "rule", name)?;
        if RESERVED_NAMES.contains(&n.as_str()) {
            return Err(loc.at(
                name.span(),
                format!("rule name \"{n}\" is reserved: stats and metrics count [default], allow CIDRs and bans under default, allow and deny; pick another name"),
            ));
        }
        if let Some(first) = seen.insert(n.clone(), name.span().start) {
            let (line, _) = loc.line_col(first);
            return Err(loc.at(
                name.span(),
                format!("rule name \"{n}\" is already used on line {line}: names must be unique"),
            ));
        }
        rules.push(rule_of(
            loc,
            r,
            table,
            n.clone(),
            has_cluster,
            &mut ports_total,
        )?);
    }
    let src_total: usize = rules.iter().map(|r| r.src.len()).sum();
    if src_total > MAX_SRC_CIDRS {
        // At the CIDR past the limit.
        let mut before = 0;
        let span = raw
            .iter()
            .filter_map(|r| r.get_ref().src.as_ref())
            .find_map(|list| {
                let here = list
                    .get_ref()
                    .get(MAX_SRC_CIDRS.checked_sub(before)?)
                    .map(|c| c.span());
                before += list.get_ref().len();
                here
            });
        return Err(loc.at(
            span.unwrap_or(0..0),
            format!(
                "{src_total} src CIDRs over all rules: the datapath holds at most {MAX_SRC_CIDRS}"
            ),
        ));
    }
    Ok(rules)
}

/// One `[[rule]]` named `name`, at `table` in the file: what it matches,
/// how it keys and limits, what it does over the limit. `ports_total`
/// counts `dst_ports` entries over the rules so far.
fn rule_of(
    loc: &Located,
    r: &RawRule,
    table: Range<usize>,
    name: String,
    has_cluster: bool,
    ports_total: &mut usize,
) -> Result<Rule, ConfigError> {
    let who = format!("rule \"{name}\"");
    let proto = choice(
        loc,
        &format!("{who}: proto"),
        &r.proto,
        &[
            ("any", Proto::Any),
            ("tcp", Proto::Tcp),
            ("udp", Proto::Udp),
            ("icmp", Proto::Icmp),
            ("icmpv6", Proto::Icmpv6),
        ],
    )?;
    let dst_ports = dst_ports_of(loc, &who, r, proto, ports_total)?;
    let syn_only = match &r.tcp_flags {
        None => false,
        Some(f) => {
            if f.get_ref() != "syn" {
                return Err(loc.at(f.span(), format!("{who}: tcp_flags = \"{}\" is not allowed: use \"syn\" (SYN set, ACK clear)", f.get_ref())));
            }
            if proto != Proto::Tcp {
                return Err(loc.at(f.span(), format!("{who}: tcp_flags needs proto = \"tcp\"")));
            }
            true
        }
    };
    let mut src = Vec::new();
    if let Some(list) = &r.src {
        if list.get_ref().is_empty() {
            return Err(loc.at(
                list.span(),
                format!("{who}: src is empty: list CIDRs, or leave it out to match every source"),
            ));
        }
        for c in list.get_ref() {
            src.push(
                parse_cidr(c.get_ref())
                    .map_err(|m| loc.at(c.span(), format!("{who}: src: {m}")))?,
            );
        }
    }
    let key = key_of(loc, &who, r)?;
    let algorithm = choice(
        loc,
        &format!("{who}: algorithm"),
        &r.algorithm,
        &[
            ("token_bucket", Algorithm::TokenBucket),
            ("fixed_window", Algorithm::FixedWindow),
            ("sliding_window", Algorithm::SlidingWindow),
        ],
    )?;
    let limits = rule_limits(
        loc,
        &who,
        r,
        algorithm != Algorithm::TokenBucket,
        table.clone(),
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
    let mode = mode_of(loc, &who, fields, table.clone(), "packets", None)?;
    if algorithm == Algorithm::SlidingWindow {
        let span = r
            .rate
            .as_ref()
            .map(|v| v.span())
            .or(r.limits.as_ref().map(|v| v.span()))
            .unwrap_or(table.clone());
        sliding_fits(loc, &who, &limits, mode, span)?;
    }
    let scope = scope_of(loc, &who, &r.scope, has_cluster)?;
    if scope == Scope::Cluster {
        let why = if algorithm != Algorithm::TokenBucket {
            Some("algorithm = \"token_bucket\"")
        } else if limits.iter().any(|l| l.unit != Unit::Packets) {
            Some("packet limits (rate), not bytes")
        } else if matches!(mode, Mode::Elastic { .. }) {
            Some("mode = \"hard\" or \"soft\"")
        } else {
            None
        };
        if let Some(why) = why {
            let span = r.scope.as_ref().map(|s| s.span()).unwrap_or(table);
            return Err(loc.at(span, format!("{who}: scope = \"cluster\" on a packet rule needs {why}: hosts exchange packet counts and charge them to token buckets")));
        }
    }
    let wide_cells = r
        .flood_wide_cells
        .as_ref()
        .map(|w| (w.span(), *w.get_ref()));
    if let (Scope::Cluster, Some((span, true))) = (scope, wide_cells.clone()) {
        return Err(loc.at(span, format!("{who}: flood_wide_cells = true on a cluster rule: its prefix cells are what hosts exchange, so it makes none (leave it out)")));
    }
    let wide_cells = NotState(wide_cells.map(|(_, on)| on));
    Ok(Rule {
        name,
        proto,
        dst_ports,
        syn_only,
        src,
        key,
        limits,
        algorithm,
        action,
        mode,
        scope,
        wide_cells,
    })
}

/// A rule's `dst_ports`, as inclusive ranges (empty: every port).
fn dst_ports_of(
    loc: &Located,
    who: &str,
    r: &RawRule,
    proto: Proto,
    ports_total: &mut usize,
) -> Result<Vec<(u16, u16)>, ConfigError> {
    let mut dst_ports = Vec::new();
    let Some(ports) = &r.dst_ports else {
        return Ok(dst_ports);
    };
    if matches!(proto, Proto::Icmp | Proto::Icmpv6) {
        return Err(loc.at(
            ports.span(),
            format!(
                "{who}: dst_ports needs proto = \"tcp\", \"udp\" or \"any\" (ICMP has no ports)"
            ),
        ));
    }
    if ports.get_ref().is_empty() {
        return Err(loc.at(ports.span(), format!("{who}: dst_ports is empty: list ports or ranges, or leave it out to match every port")));
    }
    let n = ports.get_ref().len();
    if n > MAX_PORTS_PER_RULE {
        return Err(loc.at(ports.span(), format!("{who}: dst_ports lists {n} entries, at most {MAX_PORTS_PER_RULE}: merge them into ranges (\"8000-8080\")")));
    }
    *ports_total += n;
    if *ports_total > MAX_PORTS_TOTAL {
        return Err(loc.at(ports.span(), format!("{who}: the rules list {ports_total} dst_ports entries so far, at most {MAX_PORTS_TOTAL} together: merge them into ranges")));
    }
    for p in ports.get_ref() {
        dst_ports.push(
            parse_port_range(p.get_ref())
                .map_err(|m| loc.at(p.span(), format!("{who}: dst_ports: {m}")))?,
        );
    }
    Ok(dst_ports)
}

/// What a rule's buckets are keyed by: `key`, with `prefix_v4`/`prefix_v6`
/// for `key = "prefix"` only.
fn key_of(loc: &Located, who: &str, r: &RawRule) -> Result<KeyScope, ConfigError> {
    let scope = choice(
        loc,
        &format!("{who}: key"),
        &r.key,
        &[("source", 0), ("prefix", 1), ("global", 2)],
    )?;
    Ok(match scope {
        1 => KeyScope::Prefix {
            v4: int_or(loc, &format!("{who}: prefix_v4"), &r.prefix_v4, 1, 32, 24)? as u8,
            v6: int_or(loc, &format!("{who}: prefix_v6"), &r.prefix_v6, 1, 128, 48)? as u8,
        },
        s => {
            if let Some(p) = r.prefix_v4.as_ref().or(r.prefix_v6.as_ref()) {
                return Err(loc.at(
                    p.span(),
                    format!("{who}: prefix_v4 and prefix_v6 need key = \"prefix\""),
                ));
            }
            if s == 0 {
                KeyScope::Source
            } else {
                KeyScope::Global
            }
        }
    })
}

/// A rule's limits: `limits = [...]`, or its own rate/per/burst/bytes, not
/// both; at least one, at most [`MAX_LIMITS`].
fn rule_limits(
    loc: &Located,
    who: &str,
    r: &RawRule,
    windowed: bool,
    table: Range<usize>,
) -> Result<Vec<RuleLimit>, ConfigError> {
    let own = r.own_limit();
    let limits = match &r.limits {
        Some(list) => {
            if !own.is_empty() {
                return Err(loc.at(
                    list.span(),
                    format!(
                        "{who}: give either `limits = [...]` or rate/per/burst/bytes, not both"
                    ),
                ));
            }
            if list.get_ref().is_empty() {
                return Err(loc.at(list.span(), format!("{who}: limits is empty")));
            }
            let mut all = Vec::new();
            for (j, l) in list.get_ref().iter().enumerate() {
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
    if limits.len() > MAX_LIMITS {
        let span = r.limits.as_ref().map(|l| l.span()).unwrap_or(table);
        return Err(loc.at(span, format!("{who}: {} limits: at most {MAX_LIMITS} per rule (a packet and a byte limit count as two)", limits.len())));
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const HEAD: &str = "[default]\nrate = 100\n";

    fn parse(body: &str) -> Result<Config, String> {
        Config::from_str(&format!("{HEAD}{body}"), "rules.toml").map_err(|e| e.to_string())
    }

    fn error_of(body: &str) -> String {
        parse(body).expect_err("must be rejected")
    }

    /// The error's `line:col` (the body starts on line 3) and message.
    fn assert_error(body: &str, line: usize, col: usize, needle: &str) {
        let e = error_of(body);
        let want = format!("rules.toml:{line}:{col}: ");
        assert!(
            e.starts_with(&want),
            "expected an error at {line}:{col}, got: {e}"
        );
        assert!(e.contains(needle), "expected {needle:?} in: {e}");
    }

    /// A token bucket's byte cost must fit 64 bits for a whole frame: a
    /// byte rate slower than a byte per 39 hours is refused (before, it
    /// wrapped and admitted what it liked); windows count, and take it.
    #[test]
    fn a_byte_rate_too_slow_to_charge_a_frame_is_refused_with_its_place() {
        let rule = |limit: &str| format!("[[rule]]\nname = \"slow\"\n{limit}\n");
        assert_error(
            &rule("bytes = 1\nper = \"200d\""),
            5,
            9,
            "slower than one byte per 39 hours",
        );
        assert!(parse(&rule("bytes = 1\nper = \"1d\"")).is_ok());
        assert!(parse(&rule(
            "bytes = 1\nper = \"200d\"\nalgorithm = \"fixed_window\""
        ))
        .is_ok());
    }

    #[test]
    fn the_issue_example_parses() {
        let c = parse(
            r#"
[[allow]]
cidr = "10.0.0.0/8"

[[deny]]
cidr = "198.51.100.0/24"

[[rule]]
name = "ssh-syn"
proto = "tcp"
dst_ports = [22, "8000-8080"]
tcp_flags = "syn"
src = ["0.0.0.0/0", "::/0"]
key = "prefix"
prefix_v4 = 24
prefix_v6 = 48
rate = 5
per = "1s"
burst = 10
algorithm = "token_bucket"
action = "drop"
mode = "soft"
soft_percent = 10

[[rule]]
name = "api"
limits = [{ rate = 200, per = "10s" }, { rate = 5000, per = "1h" }, { rate = 20000, per = "1d", bytes = "10MB" }]
mode = "elastic"
pool_rate = 1000

[[rule]]
name = "dns_24"
proto = "udp"
dst_ports = [53]
key = "global"
rate = 200000
algorithm = "sliding_window"
action = "shadow"
"#,
        )
        .unwrap();
        assert_eq!(c.allow[0].to_string(), "10.0.0.0/8");
        assert_eq!(c.deny[0].to_string(), "198.51.100.0/24");
        let r = &c.rules[0];
        assert_eq!(
            (r.proto, r.syn_only, r.dst_ports.clone()),
            (Proto::Tcp, true, vec![(22, 22), (8000, 8080)])
        );
        assert_eq!(r.key, KeyScope::Prefix { v4: 24, v6: 48 });
        assert_eq!(
            r.limits,
            vec![RuleLimit {
                unit: Unit::Packets,
                rate: Rate {
                    amount: 5,
                    per_secs: 1,
                    burst: 10
                }
            }]
        );
        assert_eq!(r.mode, Mode::Soft { percent: 10 });
        let api = &c.rules[1];
        assert_eq!(
            api.limits.len(),
            4,
            "three packet limits and one byte limit"
        );
        assert_eq!(
            api.limits[3],
            RuleLimit {
                unit: Unit::Bytes,
                rate: Rate {
                    amount: 10_000_000,
                    per_secs: 86_400,
                    burst: 10_000_000
                }
            }
        );
        assert_eq!(
            api.limits[1].rate,
            Rate {
                amount: 5000,
                per_secs: 3600,
                burst: 5000
            },
            "burst defaults to rate"
        );
        assert_eq!(
            api.mode,
            Mode::Elastic {
                pool: Rate {
                    amount: 1000,
                    per_secs: 1,
                    burst: 1000
                }
            }
        );
        assert_eq!(
            (api.proto, api.key, api.algorithm, api.action),
            (
                Proto::Any,
                KeyScope::Source,
                Algorithm::TokenBucket,
                Action::Drop
            )
        );
        let dns = &c.rules[2];
        assert_eq!(
            (dns.key, dns.algorithm, dns.action),
            (KeyScope::Global, Algorithm::SlidingWindow, Action::Shadow)
        );
    }

    #[test]
    fn duplicate_names_point_at_the_second_and_name_the_first() {
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"a\"\nrate = 2\n",
            7,
            8,
            "rule name \"a\" is already used on line 4",
        );
    }

    #[test]
    fn names_must_be_present_and_well_formed() {
        assert_error("[[rule]]\nrate = 1\n", 3, 1, "missing name");
        assert_error(
            "[[rule]]\nname = \"SSH\"\nrate = 1\n",
            4,
            8,
            "a-z, 0-9, _ and -",
        );
        assert_error(
            &format!("[[rule]]\nname = \"{}\"\nrate = 1\n", "a".repeat(49)),
            4,
            8,
            "1..=48",
        );
        // The per-rule counters' built-in rows: a rule of that name would
        // be summed with them.
        for n in ["default", "allow", "deny"] {
            assert_error(
                &format!("[[rule]]\nname = \"{n}\"\nrate = 1\n"),
                4,
                8,
                &format!("rule name \"{n}\" is reserved"),
            );
        }
    }

    #[test]
    fn unknown_keys_are_located() {
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nrat = 2\n",
            6,
            1,
            "unknown field `rat`",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nflood_wide_cells = 1\n",
            6,
            20,
            "expected a boolean",
        );
        assert_error(
            "[[allow]]\ncidr = \"10.0.0.0/8\"\nport = 1\n",
            5,
            1,
            "unknown field `port`",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nlimits = [{ rate = 1, pre = \"1s\" }]\n",
            5,
            23,
            "unknown field `pre`",
        );
    }

    #[test]
    fn unknown_protocol_lists_the_allowed() {
        assert_error(
            "[[rule]]\nname = \"a\"\nproto = \"sctp\"\nrate = 1\n",
            5,
            9,
            "proto = \"sctp\" is not allowed: use one of any, tcp, udp, icmp, icmpv6",
        );
    }

    #[test]
    fn bad_ports_and_ranges() {
        let rule = |ports: &str| {
            format!("[[rule]]\nname = \"a\"\nproto = \"tcp\"\ndst_ports = {ports}\nrate = 1\n")
        };
        assert_error(&rule("[0]"), 6, 14, "port 0 is out of range");
        assert_error(&rule("[22, 65536]"), 6, 18, "port 65536 is out of range");
        assert_error(&rule("[\"9000-8000\"]"), 6, 14, "reversed range");
        assert_error(&rule("[\"http\"]"), 6, 14, "not a port or range");
        assert_error(&rule("[]"), 6, 13, "dst_ports is empty");
        let ports = |n: usize| {
            (0..n)
                .map(|p| (p * 2 + 1).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        assert_error(
            &rule(&format!("[{}]", ports(MAX_PORTS_PER_RULE + 1))),
            6,
            13,
            "dst_ports lists 257 entries, at most 256",
        );
        // Eight full lists fit; a ninth crosses the total.
        let rules: String = (0..9)
            .map(|i| format!("[[rule]]\nname = \"r{i}\"\nproto = \"udp\"\ndst_ports = [{}]\nsrc = [\"10.{i}.0.0/16\"]\nrate = 1\n", ports(256)))
            .collect();
        assert_error(
            &rules,
            2 + 8 * 6 + 4,
            13,
            "the rules list 2304 dst_ports entries so far, at most 2048 together",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nproto = \"icmp\"\ndst_ports = [1]\nrate = 1\n",
            6,
            13,
            "dst_ports needs proto",
        );
    }

    #[test]
    fn bad_cidrs() {
        assert_error(
            "[[deny]]\ncidr = \"198.51.100.0/33\"\n",
            4,
            8,
            "deny[0].cidr: \"198.51.100.0/33\": the prefix length must be 0..=32",
        );
        assert_error(
            "[[allow]]\ncidr = \"10.0.0.1/8\"\n",
            4,
            8,
            "did you mean \"10.0.0.0/8\"",
        );
        assert_error("[[allow]]\ncidr = \"banana\"\n", 4, 8, "is not a CIDR");
        assert_error(
            "[[rule]]\nname = \"a\"\nsrc = [\"2001:db8::/129\"]\nrate = 1\n",
            5,
            8,
            "src: \"2001:db8::/129\": the prefix length must be 0..=128",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nsrc = []\nrate = 1\n",
            5,
            7,
            "src is empty",
        );
    }

    #[test]
    fn tcp_flags_need_tcp_and_only_syn_exists() {
        assert_error(
            "[[rule]]\nname = \"a\"\ntcp_flags = \"syn\"\nrate = 1\n",
            5,
            13,
            "tcp_flags needs proto = \"tcp\"",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nproto = \"udp\"\ntcp_flags = \"syn\"\nrate = 1\n",
            6,
            13,
            "tcp_flags needs proto = \"tcp\"",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nproto = \"tcp\"\ntcp_flags = \"fin\"\nrate = 1\n",
            6,
            13,
            "use \"syn\"",
        );
    }

    #[test]
    fn prefixes_in_range_and_only_with_prefix_keys() {
        let rule =
            |extra: &str| format!("[[rule]]\nname = \"a\"\nkey = \"prefix\"\n{extra}\nrate = 1\n");
        assert_error(
            &rule("prefix_v4 = 33"),
            6,
            13,
            "prefix_v4 = 33 is out of range: allowed 1..=32",
        );
        assert_error(
            &rule("prefix_v6 = 0"),
            6,
            13,
            "prefix_v6 = 0 is out of range: allowed 1..=128",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nprefix_v4 = 24\nrate = 1\n",
            5,
            13,
            "need key = \"prefix\"",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nkey = \"host\"\nrate = 1\n",
            5,
            7,
            "use one of source, prefix, global",
        );
    }

    #[test]
    fn zero_rates_bursts_and_missing_limits() {
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 0\n",
            5,
            8,
            "rate = 0 is out of range",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 5\nburst = 0\n",
            6,
            9,
            "burst = 0 is out of range",
        );
        assert_error("[[rule]]\nname = \"a\"\nper = \"1s\"\n", 5, 7, "no limit");
        assert_error("[[rule]]\nname = \"a\"\n", 3, 1, "no limit");
        assert_error("[[rule]]\nname = \"a\"\nbytes = \"0MB\"\n", 5, 9, "is zero");
        assert_error(
            "[[rule]]\nname = \"a\"\nbytes = -5\n",
            5,
            9,
            "not a positive number of bytes",
        );
    }

    #[test]
    fn unparsable_durations_and_sizes() {
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 5\nper = \"1 fortnight\"\n",
            6,
            7,
            "per: \"1 fortnight\" is not a duration",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 5\nper = \"1.5s\"\n",
            6,
            7,
            "is not a duration",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nbytes = \"10 parsecs\"\n",
            5,
            9,
            "is not a size",
        );
        assert_error("[[rule]]\nname = \"a\"\nmode = \"elastic\"\npool_rate = 5\npool_per = \"soon\"\nrate = 1\n", 7, 12, "pool_per: \"soon\" is not a duration");
    }

    #[test]
    fn limits_and_modes_are_consistent() {
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nlimits = [{ rate = 2 }]\n",
            6,
            10,
            "not both",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nlimits = [{ rate = 1 }, { rate = 2 }, { rate = 3 }, { rate = 4, bytes = 5 }]\n",
            5,
            10,
            "5 limits: at most 4",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nalgorithm = \"fixed_window\"\nburst = 3\n",
            7,
            9,
            "burst applies to algorithm = \"token_bucket\" only",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nalgorithm = \"leaky\"\n",
            6,
            13,
            "use one of token_bucket, fixed_window, sliding_window",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\naction = \"reject\"\n",
            6,
            10,
            "use one of drop, shadow",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"firm\"\n",
            6,
            8,
            "use one of hard, soft, elastic",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nsoft_percent = 5\n",
            6,
            16,
            "soft_percent needs mode = \"soft\"",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"soft\"\nsoft_percent = 0\n",
            7,
            16,
            "soft_percent = 0 is out of range",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"elastic\"\n",
            6,
            8,
            "needs pool_rate",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\npool_rate = 5\n",
            6,
            13,
            "need mode = \"elastic\"",
        );
        // A sliding window counts at most 2^28 - 1 a window (it passed
        // half of a larger rate), with its soft margin too; bytes and the
        // other algorithms are not capped so.
        // A bucket holds at most 2^63 ns of burst: more was silently cut.
        assert_error(
            "[[rule]]\nname = \"a\"\nrate = 1\nper = \"366d\"\nburst = 300\n",
            5,
            8,
            "a burst lasting at most 292 years",
        );
        assert_error(
            "[[rule]]\nname = \"a\"\nbytes = \"1MB\"\nper = \"1d\"\nbyte_burst = \"1TB\"\n",
            7,
            14,
            "lasts more than 292 years",
        );
        let sliding = "is more than a sliding window counts (268435455 per window)";
        assert_error("[[rule]]\nname = \"a\"\nrate = 300000000\nper = \"1h\"\nalgorithm = \"sliding_window\"\n", 5, 8, sliding);
        assert_error("[[rule]]\nname = \"a\"\nlimits = [{ rate = 5 }, { rate = 268435456, per = \"1h\" }]\nalgorithm = \"sliding_window\"\n", 5, 10, sliding);
        assert_error("[[rule]]\nname = \"a\"\nrate = 250000000\nalgorithm = \"sliding_window\"\nmode = \"soft\"\n", 5, 8, "(275000000 with its soft margin)");
        for ok in [
            "rate = 268435455\nalgorithm = \"sliding_window\"\n",
            "rate = 300000000\nper = \"1h\"\nalgorithm = \"fixed_window\"\n",
            "bytes = \"1TB\"\nalgorithm = \"sliding_window\"\n",
        ] {
            let text = format!("[default]\nrate = 5\n[[rule]]\nname = \"a\"\n{ok}");
            assert!(Config::from_str(&text, "rules.toml").is_ok(), "{ok}");
        }
    }

    #[test]
    fn more_src_cidrs_than_the_datapath_holds_are_located() {
        let list = |from: usize, n: usize| {
            (from..from + n)
                .map(|i| format!("\"{}.{}.{}.0/24\"", 10 + (i >> 16), (i >> 8) & 255, i & 255))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let body = format!(
            "[[rule]]\nname = \"a\"\nrate = 1\nsrc = [{}]\n[[rule]]\nname = \"b\"\nrate = 1\nsrc = [{}]\n",
            list(0, MAX_SRC_CIDRS - 2),
            list(MAX_SRC_CIDRS, 3)
        );
        // b's third CIDR is the one past the limit.
        let col = body.lines().nth(7).unwrap().rfind("\"11.").unwrap() + 1;
        assert_error(
            &body,
            10,
            col,
            &format!(
                "{} src CIDRs over all rules: the datapath holds at most {MAX_SRC_CIDRS}",
                MAX_SRC_CIDRS + 1
            ),
        );
    }

    #[test]
    fn more_rules_than_the_datapath_holds() {
        let body: String = (0..=MAX_RULES)
            .map(|i| format!("[[rule]]\nname = \"r{i}\"\nrate = 1\n"))
            .collect();
        let e = error_of(&body);
        assert!(
            e.contains(&format!(
                "{} rules: the datapath holds at most {MAX_RULES}",
                MAX_RULES + 1
            )),
            "{e}"
        );
        assert!(
            e.starts_with(&format!("rules.toml:{}:1:", 3 + 3 * MAX_RULES)),
            "{e}"
        );
        // Exactly the maximum is fine.
        let body: String = (0..MAX_RULES)
            .map(|i| format!("[[rule]]\nname = \"r{i}\"\nrate = 1\n"))
            .collect();
        assert_eq!(parse(&body).unwrap().rules.len(), MAX_RULES);
    }
}
