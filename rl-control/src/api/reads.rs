//! The API's reads: counters, one source's quotas, the top sources and
//! cells, events. They read the collector's snapshots or the maps under the
//! state lock, never across an await.

use std::net::IpAddr;

use axum::{
    extract::{rejection::QueryRejection, Query, State as AxState},
    http::StatusCode,
    Json,
};
use rl_common::quota::ceil_ms;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Api, ApiError, ApiResult, ErrorBody, Segment};
use crate::daemon::state::{lock, State};

/// Packets and bytes under one rule (or allow, deny, default).
#[derive(Serialize, Deserialize, ToSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCounters {
    pub passed_packets: u64,
    pub passed_bytes: u64,
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    /// Would have dropped; passed because the rule's action is `shadow`.
    pub shadow_dropped_packets: u64,
    pub shadow_dropped_bytes: u64,
}

#[derive(Serialize, ToSchema)]
pub struct Stats {
    /// By rule name, plus `default`, `allow` and `deny` (bans count as deny).
    pub rules: std::collections::BTreeMap<String, RuleCounters>,
}

pub(super) fn rule_counters(
    s: &State,
) -> ApiResult<std::collections::BTreeMap<String, RuleCounters>> {
    let stats = s.dp.rule_stats()?;
    Ok(stats
        .into_iter()
        .map(|(name, r)| {
            (
                name,
                RuleCounters {
                    passed_packets: r.passed_pkts,
                    passed_bytes: r.passed_bytes,
                    dropped_packets: r.dropped_pkts,
                    dropped_bytes: r.dropped_bytes,
                    shadow_dropped_packets: r.shadow_pkts,
                    shadow_dropped_bytes: r.shadow_bytes,
                },
            )
        })
        .collect())
}

/// Per rule and for allow, deny and default: packets and bytes passed,
/// dropped and shadow-dropped, since the daemon started (and, for rules
/// that stayed in place, what the pinned datapath had counted before).
#[utoipa::path(get, path = "/v1/stats", responses((status = 200, body = Stats)))]
pub(super) async fn stats(AxState(api): AxState<Api>) -> ApiResult<Json<Stats>> {
    Ok(Json(Stats {
        rules: rule_counters(&lock(&api.state))?,
    }))
}

/// One limit's quota for a source, with the meaning of HTTP rate-limit
/// headers.
#[derive(Serialize, Deserialize, ToSchema, Debug, Clone)]
pub struct SourceLimit {
    pub rule: String,
    /// Which of the rule's limits (0-based; the elastic pool is 7).
    pub limit_index: u32,
    /// `X-RateLimit-Limit`: what a fresh source may send at once (packets,
    /// or bytes for a byte limit).
    pub limit: u64,
    /// `X-RateLimit-Remaining`: what passes now.
    pub remaining: u64,
    /// `Retry-After`: wait before one more passes (0: it may send now).
    pub retry_after_ms: u64,
    /// Wait until the source is back to its full limit.
    pub reset_ms: u64,
    /// The bucket that charges the source under this limit now: `own`, or,
    /// for a source a flood or a full table left without one, the bucket
    /// it shares: `prefix_cell`, `wide_cell` or `last_resort` (the README's
    /// "Floods"). A shared bucket's figures are its whole prefix's.
    pub charged_to: ChargedTo,
    /// That bucket's prefix: the source aggregated to its rule's key prefix
    /// (`own`) or the cell's (`10.1.2.0/24`); absent for a last resort,
    /// which holds every source of the rule left without a cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// [`SourceLimit::charged_to`].
#[derive(Serialize, Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ChargedTo {
    Own,
    PrefixCell,
    WideCell,
    LastResort,
}

impl From<crate::datapath::ChargedBy> for ChargedTo {
    fn from(by: crate::datapath::ChargedBy) -> ChargedTo {
        use crate::datapath::ChargedBy as B;
        match by {
            B::Own => ChargedTo::Own,
            B::PrefixCell => ChargedTo::PrefixCell,
            B::WideCell => ChargedTo::WideCell,
            B::LastResort => ChargedTo::LastResort,
        }
    }
}

#[derive(Serialize, Deserialize, ToSchema, Debug)]
pub struct SourceState {
    pub source: String,
    /// `allow`: an allow CIDR holds the source, which is never limited;
    /// `deny`: a deny CIDR or a ban holds it, and it is always dropped.
    /// Either way no rule charges it and `limits` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listed: Option<String>,
    /// Every limit under which the source's bucket holds a charge now: its
    /// own (kept until fresh again), or a shared fallback's (see
    /// `charged_to`). None: it has its full limit under every rule.
    pub limits: Vec<SourceLimit>,
}

/// That source's quota under each limit that holds a charge for it, from the
/// bucket that charges it now (its own, or a flood's shared fallback).
#[utoipa::path(get, path = "/v1/sources/{ip}", params(("ip" = String, Path, description = "an IPv4 or IPv6 address")),
    responses((status = 200, body = SourceState), (status = 400, body = ErrorBody)))]
pub(super) async fn source(
    AxState(api): AxState<Api>,
    Segment(ip): Segment,
) -> ApiResult<Json<SourceState>> {
    let addr: IpAddr = ip.parse().map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("\"{ip}\" is not an IP address"),
        )
    })?;
    let s = lock(&api.state);
    let host = crate::config::units::Cidr::host(addr);
    let listed = if s.config.allow.iter().any(|c| c.covers(&host)) {
        Some("allow")
    } else if s
        .config
        .deny
        .iter()
        .chain(
            s.config
                .active_bans(crate::config::unix_now())
                .map(|b| &b.cidr),
        )
        .any(|c| c.covers(&host))
    {
        Some("deny")
    } else {
        None
    };
    if let Some(list) = listed {
        return Ok(Json(SourceState {
            source: addr.to_string(),
            listed: Some(list.into()),
            limits: Vec::new(),
        }));
    }
    let quotas = s.dp.source_quotas(addr)?;
    let limits = quotas
        .into_iter()
        .filter(|sq| {
            sq.by == crate::datapath::ChargedBy::Own || may_match(&s.config, sq.rule, &host)
        })
        .map(|sq| SourceLimit {
            rule: s.dp.rule_name(sq.rule).unwrap_or("?").to_string(),
            limit_index: sq.which,
            limit: sq.quota.limit,
            remaining: sq.quota.remaining,
            retry_after_ms: ceil_ms(sq.quota.retry_after_ns),
            reset_ms: ceil_ms(sq.quota.reset_ns),
            charged_to: sq.by.into(),
            prefix: sq.prefix.map(|(a, bits)| format!("{a}/{bits}")),
        })
        .collect();
    Ok(Json(SourceState {
        source: addr.to_string(),
        listed: None,
        limits,
    }))
}

/// Whether rule `index` of the active set (0: `[default]`) may charge
/// `host`: a shared bucket of a rule whose `src` leaves the source out is
/// not the source's (its own buckets exist only where a rule matched it).
fn may_match(
    config: &crate::config::Config,
    index: u32,
    host: &crate::config::units::Cidr,
) -> bool {
    let src = index
        .checked_sub(1)
        .and_then(|i| config.rules.get(i as usize))
        .map_or(&[][..], |r| &r.src[..]);
    src.is_empty() || src.iter().any(|c| c.covers(host))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TopQuery {
    top: Option<usize>,
}

/// The N sources with the most drops over the last scan interval (5 s;
/// default N = 10, at most 1,000), with their rule, the rate the rule saw
/// from them and their drops.
#[utoipa::path(get, path = "/v1/sources", params(("top" = Option<usize>, Query, description = "how many (default 10, at most 1000)")),
    responses((status = 200, body = crate::daemon::state::Top), (status = 400, body = ErrorBody)))]
pub(super) async fn top_sources(
    AxState(api): AxState<Api>,
    q: Result<Query<TopQuery>, QueryRejection>,
) -> ApiResult<Json<crate::daemon::state::Top>> {
    let n = top_count(q, crate::daemon::state::TOP_KEPT)?;
    let s = lock(&api.state);
    let mut top = s.top.clone();
    top.sources.truncate(n);
    Ok(Json(top))
}

/// The prefix cells and wide cells holding a charge, the most limiting
/// first (no room left, then wide cells, then the least room left in
/// eighths of each limit; default 10, at most 100), with their quotas, as
/// the collector's
/// last pass read them (every second, every 5 s while the tables are under
/// 1% full), and how many have no room left per family: where a flood
/// charged to shared cells shows (its forged sources have no buckets of
/// their own for `/v1/sources?top=N` to rank).
#[utoipa::path(get, path = "/v1/cells", params(("top" = Option<usize>, Query, description = "how many (default 10, at most 100)")),
    responses((status = 200, body = crate::daemon::state::Cells), (status = 400, body = ErrorBody)))]
pub(super) async fn cells(
    AxState(api): AxState<Api>,
    q: Result<Query<TopQuery>, QueryRejection>,
) -> ApiResult<Json<crate::daemon::state::Cells>> {
    let n = top_count(q, crate::datapath::CHARGED_CELLS_KEPT)?;
    let mut cells = lock(&api.state).cells.clone();
    cells.cells.truncate(n);
    Ok(Json(cells))
}

/// A list's `?top=N` (default 10), refused outside 1..=`kept`.
fn top_count(q: Result<Query<TopQuery>, QueryRejection>, kept: usize) -> ApiResult<usize> {
    let Query(q) = q.map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("{}: use ?top=N", e.body_text()),
        )
    })?;
    let n = q.top.unwrap_or(10);
    if !(1..=kept).contains(&n) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("top must be 1..={kept}"),
        ));
    }
    Ok(n)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    limit: Option<usize>,
}

#[derive(Serialize, ToSchema)]
pub struct Events {
    /// Most recent first.
    pub events: Vec<crate::daemon::state::EventView>,
}

/// The most recent events, newest first (default 100): "source started
/// being limited under rule R" (at most 1,000 kept; the datapath raises at
/// most one per source per limiting episode and at most 100 per second in
/// all), and, kept apart so that those never push them out (the last 256),
/// the host's, its rules' and the cluster's: flood mode, full tables, wide
/// cells, Redis. `limit` is 1..=1,256 (both rings whole).
#[utoipa::path(get, path = "/v1/events", params(("limit" = Option<usize>, Query, description = "how many (default 100, at most 1,256)")),
    responses((status = 200, body = Events), (status = 400, body = ErrorBody)))]
pub(super) async fn events(
    AxState(api): AxState<Api>,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> ApiResult<Json<Events>> {
    let Query(q) = q.map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("{}: use ?limit=N", e.body_text()),
        )
    })?;
    let n = q.limit.unwrap_or(100);
    let most = crate::daemon::state::EVENTS_KEPT + crate::daemon::state::NOTICES_KEPT;
    if !(1..=most).contains(&n) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("limit must be 1..={most}"),
        ));
    }
    let s = lock(&api.state);
    Ok(Json(Events {
        events: s.events.latest(n),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{units::Cidr, Config};

    #[test]
    fn a_rules_shared_buckets_are_a_sources_only_where_its_src_holds_it() {
        let config = Config::from_str(
            "[default]\nrate = 5\n[[rule]]\nname = \"lan\"\nsrc = [\"192.168.0.0/16\"]\nrate = 1\n[[rule]]\nname = \"any\"\nrate = 1\n",
            "<test>",
        )
        .unwrap();
        let host = |a: [u8; 4]| Cidr::host(IpAddr::from(a));
        assert!(may_match(&config, 1, &host([192, 168, 3, 4])));
        assert!(
            !may_match(&config, 1, &host([10, 0, 0, 1])),
            "outside lan's src"
        );
        assert!(
            may_match(&config, 0, &host([10, 0, 0, 1]))
                && may_match(&config, 2, &host([10, 0, 0, 1])),
            "[default] and a rule without src"
        );
    }
}
