//! The admin HTTP API (axum): status, rules, stats, per-source quotas, bans,
//! reload, Prometheus metrics and its own OpenAPI document.
//!
//! Every error is JSON `{"error": "..."}` with a 4xx/5xx status; bodies are
//! size-limited; handlers never hold the state lock across an await, and
//! changes run on the blocking pool (an install waits for the old rule slot
//! to drain), so a slow change never stalls reads.

use std::sync::Arc;

use axum::{
    extract::{DefaultBodyLimit, MatchedPath, Request, State as AxState},
    http::{header, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{delete, get},
    Json, Router,
};
use serde::Serialize;
use utoipa::{OpenApi, ToSchema};

use crate::{
    config::document::EditError,
    config::unix_now,
    daemon::state::{lock, ApplyError, ReloadRecord, Shared, State},
};

mod edit;
mod l7;
pub mod listen;
mod metrics;
mod reads;

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

/// One path parameter, refused (not UTF-8 once decoded, say) as JSON like
/// every other error, not axum's plain text.
pub(super) struct Segment(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Segment {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Segment, ApiError> {
        axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(s)| Segment(s))
            .map_err(|e| ApiError(e.status(), format!("the path: {}", e.body_text())))
    }
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
            ApplyError::Failed(m) | ApplyError::Unwritable(m) => {
                ApiError(StatusCode::INTERNAL_SERVER_ERROR, m)
            }
            ApplyError::Conflict(m) => ApiError(StatusCode::CONFLICT, m),
            ApplyError::Stopping(m) => ApiError(StatusCode::SERVICE_UNAVAILABLE, m),
        }
    }
}

impl From<crate::datapath::DatapathError> for ApiError {
    fn from(e: crate::datapath::DatapathError) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

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
        _ => not_attached_problem(&s.dp.not_attached()),
    };
    match problem {
        None => (
            StatusCode::OK,
            Json(Health {
                status: "ok".into(),
                error: None,
            }),
        )
            .into_response(),
        Some(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "unavailable".into(),
                error: Some(e),
            }),
        )
            .into_response(),
    }
}

/// Interfaces that no longer run rl's program, as one line with what to do.
fn not_attached_problem(gone: &[(String, String)]) -> Option<String> {
    let (first, _) = gone.first()?;
    Some(format!(
        "rl's XDP program is no longer attached to {}: nothing limits that traffic; restart the daemon to attach it again \
         (`rl-control detach --iface {first}` takes rl off for good)",
        crate::datapath::Datapath::listed(gone)
    ))
}

/// One interface the limiter is attached to.
#[derive(Serialize, ToSchema)]
pub struct InterfaceView {
    pub iface: String,
    /// `native` or `skb`.
    pub xdp_mode: String,
    /// Whether the interface runs rl's program now, as the kernel says
    /// (false: detached by hand, or the interface gone; `/healthz` then
    /// answers 503).
    pub attached: bool,
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
    /// Per-source buckets held, both families together (each family's
    /// table holds up to `source_capacity`; by family in `pressure`).
    pub tracked_sources: u64,
    /// Capacity of each family's source map.
    pub source_capacity: u32,
    /// Table occupancy, unseen keys, refusals, fallbacks and flood mode.
    pub pressure: crate::daemon::state::Pressure,
    pub config_file: Option<String>,
    /// The config file as the daemon last read it was refused (it does not
    /// load, or is gone): the rules in force are older than the file.
    /// `last_reload` of that reload says why, unless a change came since.
    pub config_file_refused: bool,
    pub last_reload: Option<ReloadRecord>,
    /// `[cluster]`: `state` is `degraded` while Redis does not answer.
    pub cluster: Option<crate::cluster::ClusterStatus>,
}

/// Interface, XDP mode, program, uptime, rule count, sources, last reload.
#[utoipa::path(get, path = "/v1/status", responses((status = 200, body = Status)))]
async fn status(AxState(api): AxState<Api>) -> Json<Status> {
    let s = lock(&api.state);
    Json(Status {
        iface: s
            .attachments
            .first()
            .map(|a| a.iface.clone())
            .unwrap_or_default(),
        xdp_mode: s
            .attachments
            .first()
            .map(|a| a.mode.to_string())
            .unwrap_or_default(),
        interfaces: {
            let gone = s.dp.not_attached();
            s.attachments
                .iter()
                .map(|a| InterfaceView {
                    iface: a.iface.clone(),
                    xdp_mode: a.mode.to_string(),
                    attached: !gone.iter().any(|(i, _)| *i == a.iface),
                })
                .collect()
        },
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
        config_file_refused: s.path.is_some() && s.seen != s.stamp,
        last_reload: s.last_reload.clone(),
        cluster: s.cluster.as_ref().map(|c| c.status()),
    })
}

#[derive(OpenApi)]
#[openapi(
    info(title = "rl admin API", description = "rl-control's admin API: rules, stats, per-source quotas, bans, metrics."),
    paths(healthz, status, edit::get_rules, edit::put_rules, edit::post_rule, edit::delete_rule, reads::stats, reads::top_sources, reads::source, reads::cells, reads::events, edit::post_ban, edit::get_bans, edit::delete_ban, edit::reload, metrics::metrics, l7::l7_state),
    components(schemas(ErrorBody, Health, Status, crate::daemon::state::Pressure, crate::daemon::state::CollectorHealth, crate::daemon::state::ReaderHealth, crate::daemon::state::WideCellRule, edit::Applied, reads::Stats, reads::RuleCounters, reads::SourceState, reads::SourceLimit, reads::ChargedTo, edit::NewBan, edit::BanView, ReloadRecord, crate::daemon::state::Top, crate::daemon::state::TopSource, crate::daemon::state::Cells, crate::daemon::state::CellView, reads::Events, crate::daemon::state::EventView, crate::l7::engine::Status, crate::cluster::ClusterStatus)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// Declares the bearer token scheme (used when `[api] token_file` is set)
/// and requires it of every `/v1` operation (401 without it), and the
/// answers every change can give: 409 (the file holds an edit not applied,
/// or a conflicting rule), 413 (a body over the limit), 422 (the result
/// does not validate), 500 (the install or the write failed, nothing
/// changed), 503 (the daemon is stopping); a read's 500 (the datapath
/// could not be read); a path parameter's 400.
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{
            security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme},
            ContentBuilder, Ref, ResponseBuilder,
        };
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
        let error = |what: &str| {
            ResponseBuilder::new()
                .description(what)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build()
        };
        for (path, item) in doc
            .paths
            .paths
            .iter_mut()
            .filter(|(p, _)| p.starts_with("/v1/"))
        {
            let param = path.contains('{');
            let ops = [
                (&mut item.get, false),
                (&mut item.put, true),
                (&mut item.post, true),
                (&mut item.delete, true),
            ];
            for (op, changes) in ops {
                let Some(op) = op.as_mut() else { continue };
                op.security = Some(vec![SecurityRequirement::new(
                    "bearer",
                    Vec::<String>::new(),
                )]);
                let mut add = |code: &str, what: &str| {
                    op.responses
                        .responses
                        .entry(code.into())
                        .or_insert_with(|| error(what).into());
                };
                add(
                    "401",
                    "missing or wrong bearer token ([api] token_file is set)",
                );
                if param {
                    add("400", "the path parameter is not valid");
                }
                // A reload reads the file: no body, nothing written back.
                let reload = path == "/v1/reload";
                if changes {
                    if !reload {
                        add("409", "the config file holds an edit not applied yet, or the change conflicts with the rules");
                    }
                    if !param && !reload {
                        add("413", "the body is over the limit");
                    }
                    add(
                        "422",
                        "the resulting rule set does not validate (line and column given)",
                    );
                    add(
                        "500",
                        "installing the rules or writing the file failed: nothing changed",
                    );
                    add("503", "the daemon is stopping: the change was not applied");
                } else if ["/v1/stats", "/v1/sources/{ip}"].contains(&path.as_str()) {
                    add("500", "reading the datapath failed");
                }
            }
        }
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
            // The scheme's name is case-insensitive (RFC 9110).
            .and_then(|v| {
                v.split_once(' ')
                    .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                    .map(|(_, t)| t)
            });
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes()));
        if !ok {
            let mut r = ApiError(StatusCode::UNAUTHORIZED, "missing or wrong bearer token: send `Authorization: Bearer <token>` (see [api] token_file)".into()).into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
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
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |m| m.as_str().to_string());
    let r = next.run(req).await;
    tally(&api, route, r.status().as_u16());
    r
}

fn tally(api: &Api, route: String, status: u16) {
    *lock(&api.state)
        .api_requests
        .entry((route, status))
        .or_default() += 1;
}

/// The admin router's fallback: no route layer runs for it, so it counts
/// itself (probes of paths that do not exist show in `/metrics`).
async fn not_found_counted(AxState(api): AxState<Api>) -> ApiError {
    tally(&api, "unmatched".to_string(), 404);
    not_found().await
}

async fn not_found() -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        "no such route: GET /openapi.json lists them".into(),
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed on this route: GET /openapi.json lists them".into(),
    )
}

async fn metrics_only() -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "this listener serves GET /metrics and GET /healthz only: the admin API is on the daemon's socket".into())
}

/// The scrapers' router (`[api] metrics_listen`): `/metrics` and
/// `/healthz`, nothing else.
pub fn metrics_router(api: Api) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics::metrics))
        .fallback(metrics_only)
        .method_not_allowed_fallback(metrics_only)
        .with_state(api)
}

/// The router: `/healthz`, `/metrics` and `/openapi.json` are open (for
/// probes and scrapers), `/v1` needs the token when one is configured.
pub fn router(api: Api) -> Router {
    let v1 = Router::new()
        .route("/v1/status", get(status))
        .route(
            "/v1/rules",
            get(edit::get_rules)
                .put(edit::put_rules)
                .post(edit::post_rule),
        )
        .route("/v1/rules/{name}", delete(edit::delete_rule))
        .route("/v1/stats", get(reads::stats))
        .route("/v1/sources", get(reads::top_sources))
        .route("/v1/cells", get(reads::cells))
        .route("/v1/sources/{ip}", get(reads::source))
        .route("/v1/events", get(reads::events))
        .route("/v1/bans", get(edit::get_bans).post(edit::post_ban))
        .route("/v1/bans/{cidr}", delete(edit::delete_ban))
        .route("/v1/reload", axum::routing::post(edit::reload))
        .route("/v1/l7/state", get(l7::l7_state))
        .route_layer(middleware::from_fn_with_state(api.clone(), auth));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(openapi))
        .merge(v1)
        .fallback(not_found_counted)
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(middleware::from_fn_with_state(api.clone(), count))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(api)
}
