//! `POST /v1/check` on `[l7] http_listen`: one decision per request for any
//! gateway or application, with the conventional and IETF rate-limit
//! headers; and `/v1/forward-auth/{domain}?entries`, the same decision for
//! forward-auth gateways, which send no body (see [`super::forward`]). It
//! only charges buckets: it cannot change rules, and needs no
//! token (like Envoy's gRPC port it belongs on loopback or a private
//! network).

use std::sync::{Arc, RwLock};

use axum::{
    body::Bytes,
    extract::{Path, RawQuery, State},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{any, get, post},
    Json, Router,
};
use serde::Deserialize;

use super::{
    engine::{DescriptorEntry, Engine, Status},
    rules::{MAX_ENTRIES, MAX_VALUE_LEN},
};

/// The engine in force; a reload swaps in a new one (keeping buckets).
pub type Shared = Arc<RwLock<Arc<Engine>>>;

/// Most descriptors in one check.
pub const MAX_DESCRIPTORS: usize = 16;
/// Largest check body: the largest valid check (16 descriptors of 16
/// entries of 256-byte keys and values) with every byte JSON-escaped
/// (`\u0001`: six bytes) fits, as in the gRPC port's 1 MiB.
pub const MAX_BODY: usize = 1 << 20;
/// How long a check's body has to arrive once its head has (the head has
/// 30 s: hyper's `header_read_timeout`).
const BODY_READ: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Check {
    domain: String,
    descriptors: Vec<Vec<DescriptorEntry>>,
    #[serde(default)]
    hits: Option<i64>,
}

fn bad(msg: String) -> Response {
    super::refused("http", 0, &msg);
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({ "error": msg })),
    )
        .into_response()
}

/// What is wrong with `c`, if anything.
fn invalid(c: &Check) -> Option<String> {
    if c.domain.is_empty() || c.domain.len() > MAX_VALUE_LEN {
        return Some(format!("domain must be 1..={MAX_VALUE_LEN} bytes"));
    }
    if c.descriptors.is_empty() || c.descriptors.len() > MAX_DESCRIPTORS {
        return Some(format!(
            "descriptors must hold 1..={MAX_DESCRIPTORS} descriptors"
        ));
    }
    for d in &c.descriptors {
        if d.is_empty() || d.len() > MAX_ENTRIES {
            return Some(format!("a descriptor must hold 1..={MAX_ENTRIES} entries"));
        }
        if d.iter().any(|e| e.key.is_empty()) {
            return Some("descriptor keys must not be empty".into());
        }
    }
    None
}

/// The status the headers speak for: the first over the limit, else the
/// enforced one with the least left (unmatched descriptors and shadow rules
/// do not limit, so they do not speak).
pub fn deciding(statuses: &[Status]) -> Option<&Status> {
    let enforced = statuses.iter().filter(|s| s.enforced);
    statuses
        .iter()
        .find(|s| s.code == "over_limit")
        .or_else(|| enforced.min_by_key(|s| s.remaining))
}

/// `X-RateLimit-*`, IETF `RateLimit-Policy` / `RateLimit` of `s`, and
/// `Retry-After` when over (`retry_after_ms`: when the request passes
/// under every descriptor's limits, which may be later than `s`'s).
pub fn headers(s: &Status, retry_after_ms: Option<u64>) -> HeaderMap {
    // Names made once (an `&str` name is parsed on every insert).
    const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
    const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
    const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
    const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
    const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
    let mut h = HeaderMap::with_capacity(8);
    let secs = |ms: u64| ms.div_ceil(1000);
    let mut put = |name: HeaderName, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(name, v);
        }
    };
    put(LIMIT, s.limit.to_string());
    put(REMAINING, s.remaining.to_string());
    put(RESET, secs(s.reset_ms).to_string());
    put(
        POLICY,
        format!("\"{}\";q={};w={}", s.rule, s.limit, s.per_secs),
    );
    put(
        RATELIMIT,
        format!("\"{}\";r={};t={}", s.rule, s.remaining, secs(s.reset_ms)),
    );
    if let Some(ms) = retry_after_ms {
        put(axum::http::header::RETRY_AFTER, secs(ms).max(1).to_string());
    }
    h
}

async fn check(State(l7): State<Shared>, req: axum::extract::Request) -> Response {
    use axum::extract::FromRequest;
    // A body trickling in holds a connection: it has BODY_READ to arrive.
    let body = match tokio::time::timeout(BODY_READ, Bytes::from_request(req, &())).await {
        Ok(Ok(b)) => b,
        // Past MAX_BODY (or unreadable): JSON like every other error.
        Ok(Err(e)) => return (e.status(), Json(serde_json::json!({ "error": format!("the request body: {e} (at most {MAX_BODY} bytes)") }))).into_response(),
        Err(_) => {
            let error = format!("the request body did not arrive within {BODY_READ:?}");
            return (StatusCode::REQUEST_TIMEOUT, Json(serde_json::json!({ "error": error }))).into_response();
        }
    };
    let t = std::time::Instant::now();
    let r = answer(l7, body).await;
    super::HTTP_LATENCY.record(t.elapsed());
    r
}

/// A forward-auth gateway's call: the descriptor from the query and the
/// forwarded request, one hit (400 on a `concurrency` rule: nothing would
/// release its permit). Over the limit it answers 429, or the status
/// in the gateway's `RL-Over-Status` header (401 or 403: nginx's
/// `auth_request` takes any other as an error).
async fn forward_auth(
    State(l7): State<Shared>,
    Path(domain): Path<String>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
) -> Response {
    let t = std::time::Instant::now();
    let r = forward_answer(l7, domain, q.as_deref().unwrap_or(""), &headers).await;
    super::HTTP_LATENCY.record(t.elapsed());
    r
}

async fn forward_answer(l7: Shared, domain: String, q: &str, headers: &HeaderMap) -> Response {
    let over_status = match headers
        .get(OVER_STATUS)
        .map(|v| v.to_str().unwrap_or("").trim())
    {
        None | Some("429") => StatusCode::TOO_MANY_REQUESTS,
        Some("403") => StatusCode::FORBIDDEN,
        Some("401") => StatusCode::UNAUTHORIZED,
        Some(v) => return bad(format!("RL-Over-Status must be 401, 403 or 429, not {v:?}")),
    };
    let mut r = match super::forward::descriptor(q, headers) {
        Err(m) => return bad(m),
        // A header it names is absent: the descriptor does not apply.
        Ok(None) => answered(&[]),
        Ok(Some(d)) => {
            let engine = l7.read().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(rule) = engine.concurrency_rule(&domain, &d) {
                return bad(format!(
                    "rule {rule:?} is a concurrency rule, and forward auth sends no release: each call would hold a permit for its whole lease. Give this descriptor a rate rule, or release with POST /v1/check and negative hits"
                ));
            }
            decided(
                l7,
                Check {
                    domain,
                    descriptors: vec![d],
                    hits: None,
                },
            )
            .await
        }
    };
    if r.status() == StatusCode::TOO_MANY_REQUESTS {
        *r.status_mut() = over_status;
    }
    r
}

/// The header in which a gateway asks for another status than 429 over the
/// limit.
const OVER_STATUS: HeaderName = HeaderName::from_static("rl-over-status");

async fn answer(l7: Shared, body: Bytes) -> Response {
    let c: Check = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => {
            return bad(format!(
                "expected {{\"domain\": \"...\", \"descriptors\": [[{{\"key\": \"...\", \"value\": \"...\"}}]], \"hits\": 1}}: {e}"
            ))
        }
    };
    decided(l7, c).await
}

/// The check's decision: each descriptor charged, or 400 when the check is
/// invalid.
async fn decided(l7: Shared, c: Check) -> Response {
    if let Some(m) = invalid(&c) {
        return bad(m);
    }
    // Absent: 1. JSON, unlike Envoy's request-level field, can tell 0 from
    // absent: 0 is a check, as a descriptor's `hits_addend` 0 is.
    let hits = c.hits.unwrap_or(1);
    let engine = l7.read().unwrap_or_else(|e| e.into_inner()).clone();
    let mut statuses: Vec<Status> = Vec::with_capacity(c.descriptors.len());
    for d in c.descriptors {
        // Long values fitted, never refused (see `DescriptorEntry::fitted`).
        let d: Vec<DescriptorEntry> = d.into_iter().map(DescriptorEntry::fitted).collect();
        statuses.push(engine.decide_scoped(&c.domain, &d, hits).await);
    }
    answered(&statuses)
}

/// 200 or 429 with the headers of the deciding status and the statuses as
/// JSON.
fn answered(statuses: &[Status]) -> Response {
    let over = statuses.iter().any(|s| s.code == "over_limit");
    let code = if over {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    // Retrying sooner than the latest over-limit descriptor allows only
    // meets another 429.
    let retry = over.then(|| {
        statuses
            .iter()
            .filter(|s| s.code == "over_limit")
            .map(|s| s.retry_after_ms)
            .max()
            .unwrap_or(0)
    });
    let hdrs = deciding(statuses)
        .map(|s| headers(s, retry))
        .unwrap_or_default();
    // Serialized straight from the statuses (a `json!` value built a map
    // per status first: a tenth of the daemon's CPU per check).
    let body = serde_json::to_vec(&Answer {
        overall: if over { "over_limit" } else { "ok" },
        statuses,
    })
    .unwrap_or_default();
    let mut r = (code, hdrs, body).into_response();
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The check's answer body.
#[derive(serde::Serialize)]
struct Answer<'a> {
    overall: &'static str,
    statuses: &'a [Status],
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// Serves the check on the l7 serving threads: each HTTP/1.1 connection
/// stays on the thread it was dealt to.
pub fn serve(
    listener: tokio::net::TcpListener,
    threads: &super::threads::Threads,
    l7: Shared,
    max_connections: u32,
) {
    let app = router(l7);
    let limits = super::threads::Limits::new("http", max_connections);
    threads.serve(listener, "HTTP check", limits, move |s, thread| {
        let app = app.clone();
        async move {
            if let Err(e) = crate::http1::serve(s, app).await {
                tracing::debug!("an HTTP check connection on thread {thread} ended: {e}");
            }
        }
    });
}

/// `POST /v1/check`, `/v1/forward-auth/{domain}` (any method) and
/// `GET /healthz`.
pub fn router(l7: Shared) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/forward-auth/{domain}", any(forward_auth))
        .route("/healthz", get(healthz))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(l7)
}
