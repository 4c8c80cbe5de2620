//! The admin HTTP API (axum): status, rules, stats, per-source quotas, bans,
//! reload, Prometheus metrics and its own OpenAPI document.
//!
//! Every error is JSON `{"error": "..."}` with a 4xx/5xx status; bodies are
//! size-limited; handlers never hold the state lock across an await, and
//! changes run on the blocking pool (an install waits for the old rule slot
//! to drain), so a slow change never stalls reads.

use std::{net::IpAddr, sync::Arc};

use axum::{
    body::Bytes,
    extract::{
        rejection::{BytesRejection, QueryRejection},
        DefaultBodyLimit, MatchedPath, Path, Query, Request, State as AxState,
    },
    http::{header, HeaderMap, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{delete, get},
    Json, Router,
};
use serde::{Deserialize, Serialize};
use rl_common::quota::ceil_ms;
use utoipa::{OpenApi, ToSchema};

use crate::{
    config::document::{self, EditError},
    config::units::parse_cidr,
    config::unix_now,
    daemon::apply::{self, Change},
    daemon::state::{lock, ApplyError, ReloadRecord, Shared, State},
};

mod l7;
mod metrics;
pub mod listen;

/// Largest request body accepted (a full rule set with 262,144 CIDRs fits).
pub const MAX_BODY: usize = 16 << 20;

/// What the handlers share.
#[derive(Clone)]
pub struct Api {
    pub state: Shared,
    /// The bearer token `/v1` requests must carry, if any.
    pub token: Option<Arc<str>>,
}

/// An error response: `{"error": "..."}` with its status.
pub struct ApiError(StatusCode, String);

#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<EditError> for ApiError {
    fn from(e: EditError) -> Self {
        match e {
            EditError::Invalid(m) => ApiError(StatusCode::BAD_REQUEST, m),
            EditError::Conflict(m) => ApiError(StatusCode::CONFLICT, m),
            EditError::NotFound(m) => ApiError(StatusCode::NOT_FOUND, m),
        }
    }
}

impl From<ApplyError> for ApiError {
    fn from(e: ApplyError) -> Self {
        match e {
            ApplyError::Invalid(m) => ApiError(StatusCode::UNPROCESSABLE_ENTITY, m),
            ApplyError::Failed(m) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, m),
            ApplyError::Conflict(m) => ApiError(StatusCode::CONFLICT, m),
        }
    }
}

impl From<crate::datapath::DatapathError> for ApiError {
    fn from(e: crate::datapath::DatapathError) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

fn body_error(e: BytesRejection) -> ApiError {
    ApiError(e.status(), format!("cannot read the request body: {}", e.body_text()))
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs a change on the blocking pool (see [`crate::daemon::apply`]: it holds the
/// state lock only briefly).
async fn change<T: Send + 'static>(api: &Api, f: impl FnOnce(&Shared) -> ApiResult<T> + Send + 'static) -> ApiResult<T> {
    let state = api.state.clone();
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("the change did not complete: {e}")))?
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or `unavailable`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// 200 while the program is attached and its maps answer, 503 otherwise.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health), (status = 503, body = Health)))]
async fn healthz(AxState(api): AxState<Api>) -> Response {
    let s = lock(&api.state);
    let problem = match (s.dp.attachments().first(), s.dp.config()) {
        (None, _) => Some("the XDP program is not attached".to_string()),
        (_, Err(e)) => Some(format!("the datapath maps do not answer: {e}")),
        (Some(_), Ok(cfg)) if cfg.enabled == 0 => Some("no rule set is installed".to_string()),
        _ => None,
    };
    match problem {
        None => (StatusCode::OK, Json(Health { status: "ok".into(), error: None })).into_response(),
        Some(e) => (StatusCode::SERVICE_UNAVAILABLE, Json(Health { status: "unavailable".into(), error: Some(e) })).into_response(),
    }
}

/// One interface the limiter is attached to.
#[derive(Serialize, ToSchema)]
pub struct InterfaceView {
    pub iface: String,
    /// `native` or `skb`.
    pub xdp_mode: String,
}

#[derive(Serialize, ToSchema)]
pub struct Status {
    /// The first interface (all of them in `interfaces`).
    pub iface: String,
    /// The first interface's mode: `native` or `skb`.
    pub xdp_mode: String,
    /// Every interface, with its mode: one rule set and one set of buckets
    /// for all of them.
    pub interfaces: Vec<InterfaceView>,
    pub program_id: Option<u32>,
    pub uptime_secs: u64,
    /// `[[rule]]`s in force (the default not counted).
    pub rules: usize,
    pub allow_cidrs: usize,
    pub deny_cidrs: usize,
    pub active_bans: usize,
    pub tracked_sources: u64,
    /// Capacity of each family's source map.
    pub source_capacity: u32,
    /// Table occupancy, unseen keys, refusals, fallbacks and flood mode.
    pub pressure: crate::daemon::state::Pressure,
    pub config_file: Option<String>,
    pub last_reload: Option<ReloadRecord>,
    /// `[cluster]`: `state` is `degraded` while Redis does not answer.
    pub cluster: Option<crate::cluster::ClusterStatus>,
}

/// Interface, XDP mode, program, uptime, rule count, sources, last reload.
#[utoipa::path(get, path = "/v1/status", responses((status = 200, body = Status)))]
async fn status(AxState(api): AxState<Api>) -> Json<Status> {
    let s = lock(&api.state);
    Json(Status {
        iface: s.attachments.first().map(|a| a.iface.clone()).unwrap_or_default(),
        xdp_mode: s.attachments.first().map(|a| a.mode.to_string()).unwrap_or_default(),
        interfaces: s.attachments.iter().map(|a| InterfaceView { iface: a.iface.clone(), xdp_mode: a.mode.to_string() }).collect(),
        program_id: s.program_id,
        uptime_secs: s.started.elapsed().as_secs(),
        rules: s.config.rules.len(),
        allow_cidrs: s.config.allow.len(),
        deny_cidrs: s.config.deny.len(),
        active_bans: s.config.active_bans(unix_now()).count(),
        tracked_sources: s.pressure.buckets_ipv4 + s.pressure.buckets_ipv6,
        source_capacity: s.config.datapath.max_sources,
        pressure: crate::daemon::state::Pressure {
            bucket_capacity: s.config.datapath.max_sources,
            cell_capacity: rl_common::cell_room(s.config.datapath.flood_prefixes),
            ..s.pressure.clone()
        },
        config_file: s.path.as_ref().map(|p| p.display().to_string()),
        last_reload: s.last_reload.clone(),
        cluster: s.cluster.as_ref().map(|c| c.status()),
    })
}

/// The active rule set as JSON: the rule file's tables, with `rules` for
/// `[[rule]]` and `bans` for `[[ban]]`.
#[utoipa::path(get, path = "/v1/rules", responses((status = 200, body = Object)))]
async fn get_rules(AxState(api): AxState<Api>) -> Json<serde_json::Value> {
    Json(document::to_json(&lock(&api.state).text))
}

#[derive(Serialize, ToSchema)]
pub struct Applied {
    /// What is enforced now.
    pub summary: String,
}

fn is_toml(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/toml"))
}

fn json_body(body: &[u8]) -> ApiResult<serde_json::Value> {
    serde_json::from_slice(body).map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}")))
}

/// Replaces the whole rule set: JSON like `GET /v1/rules` returns, or the
/// rule file itself with `Content-Type: application/toml`. Validated first,
/// applied atomically, written back to the config file.
#[utoipa::path(put, path = "/v1/rules", request_body(content = Object, description = "the rule set (JSON or TOML)"),
    responses((status = 200, body = Applied), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn put_rules(AxState(api): AxState<Api>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> ApiResult<Json<Applied>> {
    let body = body.map_err(body_error)?;
    let text = if is_toml(&headers) {
        String::from_utf8(body.to_vec()).map_err(|_| ApiError(StatusCode::BAD_REQUEST, "the TOML body is not UTF-8".into()))?
    } else {
        document::from_json(&json_body(&body)?)?
    };
    let summary = change(&api, move |sh| {
        apply::apply(sh, "api: PUT /v1/rules", |_| Ok::<_, ApiError>(Change { text, origin: "<PUT /v1/rules>".into(), persist: true }))
    })
    .await?;
    Ok(Json(Applied { summary }))
}

/// Adds one rule (a `[[rule]]` table as JSON) after the existing ones.
#[utoipa::path(post, path = "/v1/rules", request_body(content = Object, description = "one rule, e.g. {\"name\": \"dns\", \"proto\": \"udp\", \"dst_ports\": [53], \"rate\": 100}"),
    responses((status = 201, body = Applied), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn post_rule(AxState(api): AxState<Api>, body: Result<Bytes, BytesRejection>) -> ApiResult<(StatusCode, Json<Applied>)> {
    let rule = json_body(&body.map_err(body_error)?)?;
    let summary = change(&api, move |sh| {
        apply::apply(sh, "api: POST /v1/rules", |s| {
            let text = document::add_rule(&s.text, &rule)?;
            Ok::<_, ApiError>(Change { text, origin: "<POST /v1/rules> (the rule file with the new rule last)".into(), persist: true })
        })
    })
    .await?;
    Ok((StatusCode::CREATED, Json(Applied { summary })))
}

/// Removes the rule `name`.
#[utoipa::path(delete, path = "/v1/rules/{name}", params(("name" = String, Path, description = "the rule's name")),
    responses((status = 200, body = Applied), (status = 404, body = ErrorBody)))]
async fn delete_rule(AxState(api): AxState<Api>, Path(name): Path<String>) -> ApiResult<Json<Applied>> {
    let summary = change(&api, move |sh| {
        apply::apply_edit(sh, &format!("api: DELETE /v1/rules/{name}"), |s| Ok::<_, ApiError>(document::remove_rule(&s.text, &name)?))
    })
    .await?;
    Ok(Json(Applied { summary }))
}

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

fn rule_counters(s: &State) -> ApiResult<std::collections::BTreeMap<String, RuleCounters>> {
    let stats = s.dp.rule_stats()?;
    Ok(stats
        .into_iter()
        .map(|(name, r)| {
            (name, RuleCounters {
                passed_packets: r.passed_pkts,
                passed_bytes: r.passed_bytes,
                dropped_packets: r.dropped_pkts,
                dropped_bytes: r.dropped_bytes,
                shadow_dropped_packets: r.shadow_pkts,
                shadow_dropped_bytes: r.shadow_bytes,
            })
        })
        .collect())
}

/// Per rule and for allow, deny and default: packets and bytes passed,
/// dropped and shadow-dropped, since the daemon started (and, for rules
/// that stayed in place, what the pinned datapath had counted before).
#[utoipa::path(get, path = "/v1/stats", responses((status = 200, body = Stats)))]
async fn stats(AxState(api): AxState<Api>) -> ApiResult<Json<Stats>> {
    Ok(Json(Stats { rules: rule_counters(&lock(&api.state))? }))
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
async fn source(AxState(api): AxState<Api>, Path(ip): Path<String>) -> ApiResult<Json<SourceState>> {
    let addr: IpAddr = ip
        .parse()
        .map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("\"{ip}\" is not an IP address")))?;
    let s = lock(&api.state);
    let host = crate::config::units::Cidr::host(addr);
    let listed = if s.config.allow.iter().any(|c| c.covers(&host)) {
        Some("allow")
    } else if s.config.deny.iter().chain(s.config.active_bans(crate::config::unix_now()).map(|b| &b.cidr)).any(|c| c.covers(&host)) {
        Some("deny")
    } else {
        None
    };
    if let Some(list) = listed {
        return Ok(Json(SourceState { source: addr.to_string(), listed: Some(list.into()), limits: Vec::new() }));
    }
    let quotas = s.dp.source_quotas(addr)?;
    let limits = quotas
        .into_iter()
        .filter(|sq| sq.by == crate::datapath::ChargedBy::Own || may_match(&s.config, sq.rule, &host))
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
    Ok(Json(SourceState { source: addr.to_string(), listed: None, limits }))
}

/// Whether rule `index` of the active set (0: `[default]`) may charge
/// `host`: a shared bucket of a rule whose `src` leaves the source out is
/// not the source's (its own buckets exist only where a rule matched it).
fn may_match(config: &crate::config::Config, index: u32, host: &crate::config::units::Cidr) -> bool {
    let src = index.checked_sub(1).and_then(|i| config.rules.get(i as usize)).map_or(&[][..], |r| &r.src[..]);
    src.is_empty() || src.iter().any(|c| c.covers(host))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TopQuery {
    top: Option<usize>,
}

/// The N sources with the most drops over the last scan interval (5 s;
/// default N = 10, at most 1,000), with their rule, the rate the rule saw
/// from them and their drops.
#[utoipa::path(get, path = "/v1/sources", params(("top" = Option<usize>, Query, description = "how many (default 10, at most 1000)")),
    responses((status = 200, body = crate::daemon::state::Top), (status = 400, body = ErrorBody)))]
async fn top_sources(AxState(api): AxState<Api>, q: Result<Query<TopQuery>, QueryRejection>) -> ApiResult<Json<crate::daemon::state::Top>> {
    let n = top_count(q, crate::daemon::state::TOP_KEPT)?;
    let s = lock(&api.state);
    let mut top = s.top.clone();
    top.sources.truncate(n);
    Ok(Json(top))
}

/// The prefix cells and wide cells holding a charge, the most limiting
/// first (no room left, then wide cells, then the state furthest ahead;
/// default 10, at most 100), with their quotas, as the collector's
/// last pass read them (every second, every 5 s while the tables are under
/// 1% full), and how many have no room left per family: where a flood
/// charged to shared cells shows (its forged sources have no buckets of
/// their own for `/v1/sources?top=N` to rank).
#[utoipa::path(get, path = "/v1/cells", params(("top" = Option<usize>, Query, description = "how many (default 10, at most 100)")),
    responses((status = 200, body = crate::daemon::state::Cells), (status = 400, body = ErrorBody)))]
async fn cells(AxState(api): AxState<Api>, q: Result<Query<TopQuery>, QueryRejection>) -> ApiResult<Json<crate::daemon::state::Cells>> {
    let n = top_count(q, crate::datapath::CHARGED_CELLS_KEPT)?;
    let mut cells = lock(&api.state).cells.clone();
    cells.cells.truncate(n);
    Ok(Json(cells))
}

/// A list's `?top=N` (default 10), refused outside 1..=`kept`.
fn top_count(q: Result<Query<TopQuery>, QueryRejection>, kept: usize) -> ApiResult<usize> {
    let Query(q) = q.map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("{}: use ?top=N", e.body_text())))?;
    let n = q.top.unwrap_or(10);
    if !(1..=kept).contains(&n) {
        return Err(ApiError(StatusCode::BAD_REQUEST, format!("top must be 1..={kept}")));
    }
    Ok(n)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
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
async fn events(AxState(api): AxState<Api>, q: Result<Query<EventsQuery>, QueryRejection>) -> ApiResult<Json<Events>> {
    let Query(q) = q.map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("{}: use ?limit=N", e.body_text())))?;
    let n = q.limit.unwrap_or(100);
    let most = crate::daemon::state::EVENTS_KEPT + crate::daemon::state::NOTICES_KEPT;
    if !(1..=most).contains(&n) {
        return Err(ApiError(StatusCode::BAD_REQUEST, format!("limit must be 1..={most}")));
    }
    let s = lock(&api.state);
    Ok(Json(Events { events: s.events.latest(n) }))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewBan {
    /// An IPv4 or IPv6 prefix, e.g. `198.51.100.0/24`.
    pub cidr: String,
    /// Seconds until the ban lifts by itself (1 ..= 31,536,000).
    pub ttl_secs: u64,
    #[serde(default)]
    pub reason: String,
}

#[derive(Serialize, Deserialize, ToSchema, Debug)]
pub struct BanView {
    pub cidr: String,
    /// Unix time (seconds) when the ban lifts.
    pub until: u64,
    pub ttl_secs: u64,
    pub reason: String,
}

/// The longest ban accepted: one year.
const MAX_BAN_SECS: u64 = 365 * 86_400;

/// Drops everything from a prefix until its TTL runs out (allowed CIDRs
/// excepted: `allow` wins over bans as over `deny`).
#[utoipa::path(post, path = "/v1/bans", request_body = NewBan,
    responses((status = 201, body = BanView), (status = 400, body = ErrorBody)))]
async fn post_ban(AxState(api): AxState<Api>, body: Result<Bytes, BytesRejection>) -> ApiResult<(StatusCode, Json<BanView>)> {
    let body = body.map_err(body_error)?;
    let ban: NewBan = serde_json::from_slice(&body).map_err(|e| {
        ApiError(StatusCode::BAD_REQUEST, format!("expected {{\"cidr\": \"...\", \"ttl_secs\": N, \"reason\": \"...\"}}: {e}"))
    })?;
    let cidr = parse_cidr(&ban.cidr).map_err(|m| ApiError(StatusCode::BAD_REQUEST, format!("cidr: {m}")))?;
    if !(1..=MAX_BAN_SECS).contains(&ban.ttl_secs) {
        return Err(ApiError(StatusCode::BAD_REQUEST, format!("ttl_secs must be 1..={MAX_BAN_SECS}")));
    }
    let until = unix_now() + ban.ttl_secs;
    let view = BanView { cidr: cidr.to_string(), until, ttl_secs: ban.ttl_secs, reason: ban.reason.clone() };
    let (key, reason) = (cidr.to_string(), ban.reason);
    change(&api, move |sh| {
        apply::apply_edit(sh, &format!("api: ban {key} for {}s", ban.ttl_secs), |s| {
            Ok::<_, ApiError>(document::set_ban(&s.text, &key, until, &reason)?)
        })
    })
    .await?;
    Ok((StatusCode::CREATED, Json(view)))
}

/// Bans in force.
#[utoipa::path(get, path = "/v1/bans", responses((status = 200, body = [BanView])))]
async fn get_bans(AxState(api): AxState<Api>) -> Json<Vec<BanView>> {
    let s = lock(&api.state);
    let now = unix_now();
    Json(
        s.config
            .active_bans(now)
            .map(|b| BanView { cidr: b.cidr.to_string(), until: b.until, ttl_secs: b.until - now, reason: b.reason.clone() })
            .collect(),
    )
}

/// Lifts a ban now (URL-encode the `/`: `198.51.100.0%2F24`).
#[utoipa::path(delete, path = "/v1/bans/{cidr}", params(("cidr" = String, Path, description = "the banned prefix, URL-encoded")),
    responses((status = 200, body = Applied), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn delete_ban(AxState(api): AxState<Api>, Path(cidr): Path<String>) -> ApiResult<Json<Applied>> {
    let c = parse_cidr(&cidr).map_err(|m| ApiError(StatusCode::BAD_REQUEST, format!("cidr: {m}")))?;
    let summary = change(&api, move |sh| {
        apply::apply_edit(sh, &format!("api: lift the ban on {c}"), |s| {
            if !s.config.active_bans(unix_now()).any(|b| b.cidr == c) {
                return Err(ApiError(StatusCode::NOT_FOUND, format!("{c} is not banned")));
            }
            Ok(document::remove_bans(&s.text, |t, _| parse_cidr(t).is_ok_and(|x| x == c))?.0)
        })
    })
    .await?;
    Ok(Json(Applied { summary }))
}

/// Re-reads the config file (as SIGHUP does). An invalid file changes
/// nothing and answers 422 with the error's line and column.
#[utoipa::path(post, path = "/v1/reload", responses((status = 200, body = Applied), (status = 422, body = ErrorBody)))]
async fn reload(AxState(api): AxState<Api>) -> ApiResult<Json<Applied>> {
    let summary = change(&api, |sh| Ok(apply::reload_file(sh, "api: POST /v1/reload")?)).await?;
    Ok(Json(Applied { summary }))
}

#[derive(OpenApi)]
#[openapi(
    info(title = "rl admin API", description = "rl-control's admin API: rules, stats, per-source quotas, bans, metrics."),
    paths(healthz, status, get_rules, put_rules, post_rule, delete_rule, stats, top_sources, source, cells, events, post_ban, get_bans, delete_ban, reload, metrics::metrics, l7::l7_state),
    components(schemas(ErrorBody, Health, Status, crate::daemon::state::Pressure, crate::daemon::state::WideCellRule, Applied, Stats, RuleCounters, SourceState, SourceLimit, ChargedTo, NewBan, BanView, ReloadRecord, crate::daemon::state::Top, crate::daemon::state::TopSource, crate::daemon::state::Cells, crate::daemon::state::CellView, Events, crate::daemon::state::EventView, crate::l7::engine::Status, crate::cluster::ClusterStatus)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// Declares the bearer token scheme (used when `[api] token_file` is set).
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// `/v1` needs `Authorization: Bearer <token>` when a token is configured.
async fn auth(AxState(api): AxState<Api>, req: Request, next: Next) -> Response {
    if let Some(token) = &api.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes()));
        if !ok {
            let mut r = ApiError(StatusCode::UNAUTHORIZED, "missing or wrong bearer token: send `Authorization: Bearer <token>` (see [api] token_file)".into()).into_response();
            r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts requests by matched route and status, for `/metrics`.
async fn count(AxState(api): AxState<Api>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched".to_string(), |m| m.as_str().to_string());
    let r = next.run(req).await;
    *lock(&api.state).api_requests.entry((route, r.status().as_u16())).or_default() += 1;
    r
}

async fn not_found() -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "no such route: GET /openapi.json lists them".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this route: GET /openapi.json lists them".into())
}

/// The scrapers' router (`[api] metrics_listen`): `/metrics` and
/// `/healthz`, nothing else.
pub fn metrics_router(api: Api) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(api)
}

/// The router: `/healthz`, `/metrics` and `/openapi.json` are open (for
/// probes and scrapers), `/v1` needs the token when one is configured.
pub fn router(api: Api) -> Router {
    let v1 = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/rules", get(get_rules).put(put_rules).post(post_rule))
        .route("/v1/rules/{name}", delete(delete_rule))
        .route("/v1/stats", get(stats))
        .route("/v1/sources", get(top_sources))
        .route("/v1/cells", get(cells))
        .route("/v1/sources/{ip}", get(source))
        .route("/v1/events", get(events))
        .route("/v1/bans", get(get_bans).post(post_ban))
        .route("/v1/bans/{cidr}", delete(delete_ban))
        .route("/v1/reload", axum::routing::post(reload))
        .route("/v1/l7/state", get(l7::l7_state))
        .route_layer(middleware::from_fn_with_state(api.clone(), auth));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(openapi))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(middleware::from_fn_with_state(api.clone(), count))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(api)
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
        assert!(!may_match(&config, 1, &host([10, 0, 0, 1])), "outside lan's src");
        assert!(may_match(&config, 0, &host([10, 0, 0, 1])) && may_match(&config, 2, &host([10, 0, 0, 1])), "[default] and a rule without src");
    }
}
