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
    checked_name, choice, duration, int_in, int_or, limits_of, mode_of, representable,
    sliding_fits, ModeFields,
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
mod tests;
