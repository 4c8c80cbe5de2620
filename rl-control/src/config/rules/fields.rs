//! Field checks every rule shares (packet `[[rule]]`s and request
//! `[[l7.rule]]`s): names, choices, ranges, durations, sizes, limit groups
//! and modes, each failing with line and column.

use std::ops::Range;

use toml::Spanned;

use super::{Mode, Rate, RawLimit, RuleLimit, Unit, MAX_RULE_BYTES, MAX_RULE_RATE};
use crate::{
    config::units::{parse_duration, parse_size},
    config::{ConfigError, Located},
};

/// A rule's name: 1..=48 characters from a-z, 0-9, `_` and `-`.
pub(crate) fn checked_name<'a>(
    loc: &Located,
    what: &str,
    name: &'a Spanned<String>,
) -> Result<&'a String, ConfigError> {
    let n = name.get_ref();
    if n.is_empty()
        || n.len() > 48
        || !n
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return Err(loc.at(
            name.span(),
            format!(
                "{what} name \"{n}\" is not allowed: use 1..=48 characters from a-z, 0-9, _ and -"
            ),
        ));
    }
    Ok(n)
}

/// A rule's `mode`, `soft_percent`, `pool_rate` and `pool_per` (packet and
/// request rules share them).
#[derive(Clone, Copy)]
pub(crate) struct ModeFields<'a> {
    pub mode: &'a Option<Spanned<String>>,
    pub soft_percent: &'a Option<Spanned<i64>>,
    pub pool_rate: &'a Option<Spanned<i64>>,
    pub pool_per: &'a Option<Spanned<String>>,
}

/// The mode a rule's fields give: hard, soft (10% by default) or elastic
/// (a pool of `pool_rate` `counts` per `pool_per`). `no_elastic`: why this
/// rule cannot be elastic, if it cannot.
pub(crate) fn mode_of(
    loc: &Located,
    who: &str,
    f: ModeFields,
    table: Range<usize>,
    counts: &str,
    no_elastic: Option<&str>,
) -> Result<Mode, ConfigError> {
    let kind = choice(
        loc,
        &format!("{who}: mode"),
        f.mode,
        &[("hard", 0), ("soft", 1), ("elastic", 2)],
    )?;
    if kind != 1 {
        if let Some(p) = f.soft_percent {
            return Err(loc.at(
                p.span(),
                format!("{who}: soft_percent needs mode = \"soft\""),
            ));
        }
    }
    if kind != 2 {
        if let Some(span) = f
            .pool_rate
            .as_ref()
            .map(|p| p.span())
            .or(f.pool_per.as_ref().map(|p| p.span()))
        {
            return Err(loc.at(
                span,
                format!("{who}: pool_rate and pool_per need mode = \"elastic\""),
            ));
        }
    }
    let mode_span = || f.mode.as_ref().map(|m| m.span()).unwrap_or(table.clone());
    Ok(match kind {
        0 => Mode::Hard,
        1 => Mode::Soft {
            percent: int_or(
                loc,
                &format!("{who}: soft_percent"),
                f.soft_percent,
                1,
                1000,
                10,
            )? as u32,
        },
        _ => {
            if let Some(why) = no_elastic {
                return Err(loc.at(mode_span(), format!("{who}: mode = \"elastic\" {why}")));
            }
            let Some(pool_rate) = f.pool_rate else {
                return Err(loc.at(mode_span(), format!("{who}: mode = \"elastic\" needs pool_rate ({counts} per pool_per shared by all keys of the rule)")));
            };
            let amount = int_in(
                loc,
                &format!("{who}: pool_rate"),
                pool_rate,
                1,
                MAX_RULE_RATE as i64,
            )?;
            let per_secs = duration(loc, &format!("{who}: pool_per"), f.pool_per)?;
            Mode::Elastic {
                pool: Rate {
                    amount,
                    per_secs,
                    burst: amount,
                },
            }
        }
    })
}

/// One of `allowed` (the first is the default when `value` is absent).
pub(crate) fn choice<T: Copy>(
    loc: &Located,
    what: &str,
    value: &Option<Spanned<String>>,
    allowed: &[(&str, T)],
) -> Result<T, ConfigError> {
    let Some(v) = value else {
        return Ok(allowed[0].1);
    };
    allowed
        .iter()
        .find(|(name, _)| name == v.get_ref())
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let names: Vec<_> = allowed.iter().map(|(n, _)| *n).collect();
            loc.at(
                v.span(),
                format!(
                    "{what} = \"{}\" is not allowed: use one of {}",
                    v.get_ref(),
                    names.join(", ")
                ),
            )
        })
}

pub(crate) fn int_in(
    loc: &Located,
    what: &str,
    v: &Spanned<i64>,
    lo: i64,
    hi: i64,
) -> Result<u64, ConfigError> {
    if (lo..=hi).contains(v.get_ref()) {
        Ok(*v.get_ref() as u64)
    } else {
        Err(loc.at(
            v.span(),
            format!(
                "{what} = {} is out of range: allowed {lo}..={hi}",
                v.get_ref()
            ),
        ))
    }
}

/// An optional integer: [`int_in`] when given, `default` when not.
pub(crate) fn int_or(
    loc: &Located,
    what: &str,
    v: &Option<Spanned<i64>>,
    lo: i64,
    hi: i64,
    default: u64,
) -> Result<u64, ConfigError> {
    v.as_ref()
        .map_or(Ok(default), |v| int_in(loc, what, v, lo, hi))
}

fn size_in(loc: &Located, what: &str, v: &Spanned<toml::Value>) -> Result<u64, ConfigError> {
    let bytes = match v.get_ref() {
        toml::Value::Integer(n) if *n > 0 => Ok(*n as u64),
        toml::Value::Integer(n) => Err(format!("{n} is not a positive number of bytes")),
        toml::Value::String(s) => parse_size(s),
        other => Err(format!(
            "{other} is not a size: write bytes as an integer or a string such as \"10MB\""
        )),
    }
    .map_err(|m| loc.at(v.span(), format!("{what}: {m}")))?;
    if bytes > MAX_RULE_BYTES {
        return Err(loc.at(
            v.span(),
            format!("{what} = {bytes} bytes is too large: at most {MAX_RULE_BYTES}"),
        ));
    }
    Ok(bytes)
}

pub(crate) fn duration(
    loc: &Located,
    what: &str,
    v: &Option<Spanned<String>>,
) -> Result<u64, ConfigError> {
    match v {
        None => Ok(1),
        Some(s) => {
            parse_duration(s.get_ref()).map_err(|m| loc.at(s.span(), format!("{what}: {m}")))
        }
    }
}

/// Whether `amount` packets per `per_secs` with `burst` fit a token
/// bucket: at most one packet a nanosecond, and the bucket's span (burst ×
/// interval) within 2^63 ns.
pub(crate) fn representable(amount: u64, per_secs: u64, burst: u64) -> bool {
    rl_common::Limit::new(amount, per_secs * 1_000_000_000, burst)
        .is_ok_and(|l| l.burst_span_ns <= u64::MAX / 2)
}

/// The packet and byte limits of one `rate`/`bytes` group.
pub(crate) fn limits_of(
    loc: &Located,
    who: &str,
    raw: &RawLimit,
    windowed: bool,
    table: Range<usize>,
) -> Result<Vec<RuleLimit>, ConfigError> {
    let per_secs = duration(loc, &format!("{who}: per"), &raw.per)?;
    let mut out = Vec::new();
    if windowed {
        for (field, name) in [
            (raw.burst.as_ref().map(|b| b.span()), "burst"),
            (raw.byte_burst.as_ref().map(|b| b.span()), "byte_burst"),
        ] {
            if let Some(span) = field {
                return Err(loc.at(
                    span,
                    format!("{who}: {name} applies to algorithm = \"token_bucket\" only; a window passes at most `rate` per window"),
                ));
            }
        }
    }
    if let Some(rate) = &raw.rate {
        let amount = int_in(loc, &format!("{who}: rate"), rate, 1, MAX_RULE_RATE as i64)?;
        let burst = int_or(
            loc,
            &format!("{who}: burst"),
            &raw.burst,
            1,
            MAX_RULE_RATE as i64,
            amount,
        )?;
        if !representable(amount, per_secs, burst) {
            return Err(loc.at(rate.span(), format!("{who}: rate {amount} per {per_secs}s with burst {burst} cannot be represented (at most one packet per nanosecond, and a burst lasting at most 292 years)")));
        }
        out.push(RuleLimit {
            unit: Unit::Packets,
            rate: Rate {
                amount,
                per_secs,
                burst,
            },
        });
    } else if let Some(b) = &raw.burst {
        return Err(loc.at(b.span(), format!("{who}: burst needs a rate")));
    }
    if let Some(bytes) = &raw.bytes {
        let amount = size_in(loc, &format!("{who}: bytes"), bytes)?;
        let burst = match &raw.byte_burst {
            Some(b) => size_in(loc, &format!("{who}: byte_burst"), b)?,
            None => amount,
        };
        // A token bucket charges a frame's bytes × the ns a byte costs in
        // 64 bits: past 2^47 ns a byte, a 64 KiB frame would wrap.
        if !windowed && u128::from(per_secs) * 1_000_000_000 >= u128::from(amount) << 47 {
            return Err(loc.at(
                bytes.span(),
                format!("{who}: bytes {amount} per {per_secs}s is slower than one byte per 39 hours, which a token bucket cannot charge a whole frame against: raise bytes or shorten per"),
            ));
        }
        if u128::from(per_secs) * 1_000_000_000 * u128::from(burst) / u128::from(amount)
            > u128::from(u64::MAX / 2)
        {
            let span = raw.byte_burst.as_ref().map_or(bytes.span(), |b| b.span());
            return Err(loc.at(span, format!("{who}: a burst of {burst} bytes at {amount} per {per_secs}s lasts more than 292 years, which a bucket cannot hold: lower byte_burst")));
        }
        out.push(RuleLimit {
            unit: Unit::Bytes,
            rate: Rate {
                amount,
                per_secs,
                burst,
            },
        });
    } else if let Some(b) = &raw.byte_burst {
        return Err(loc.at(b.span(), format!("{who}: byte_burst needs bytes")));
    }
    if out.is_empty() {
        let span = raw.per.as_ref().map(|p| p.span()).unwrap_or(table);
        return Err(loc.at(span, format!("{who}: no limit: give `rate` (packets per `per`), `bytes` (bytes per `per`), or both")));
    }
    Ok(out)
}

/// A sliding window keeps each window's count in 28 bits of one word: a
/// packet or request limit (as its mode enforces it) above
/// [`rl_common::window::SLIDING_MAX`] per window would count in units of
/// several and pass fewer than written. (Byte limits count in units of
/// 2^k bytes by design.)
pub(crate) fn sliding_fits(
    loc: &Located,
    who: &str,
    limits: &[RuleLimit],
    mode: Mode,
    span: Range<usize>,
) -> Result<(), ConfigError> {
    let max = rl_common::window::SLIDING_MAX;
    match limits.iter().find(|l| l.unit == Unit::Packets && l.enforced(mode).amount > max) {
        Some(l) => Err(loc.at(
            span,
            format!(
                "{who}: rate {} per {}s{} is more than a sliding window counts ({max} per window): shorten per, or use algorithm = \"fixed_window\" or \"token_bucket\"",
                l.rate.amount,
                l.rate.per_secs,
                if l.enforced(mode).amount != l.rate.amount { format!(" ({} with its soft margin)", l.enforced(mode).amount) } else { String::new() }
            ),
        )),
        None => Ok(()),
    }
}
