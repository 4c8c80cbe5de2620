//! The API's changes: the rule set (replace, add, remove), bans and
//! reload. Each runs on the blocking pool through `apply`, validated first
//! and applied all-or-nothing.

use axum::{
    body::Bytes,
    extract::{rejection::BytesRejection, State as AxState},
    http::{header, HeaderMap, StatusCode},
    Json,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Api, ApiError, ApiResult, ErrorBody, Segment};
use crate::{
    config::{document, units::parse_cidr, unix_now},
    daemon::{
        apply::{self, Change},
        state::{lock, Shared},
    },
};

fn body_error(e: BytesRejection) -> ApiError {
    ApiError(
        e.status(),
        format!("cannot read the request body: {}", e.body_text()),
    )
}

/// Runs a change on the blocking pool (see [`crate::daemon::apply`]: it holds the
/// state lock only briefly).
pub(super) async fn change<T: Send + 'static>(
    api: &Api,
    f: impl FnOnce(&Shared) -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    let state = api.state.clone();
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .map_err(|e| {
            ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the change did not complete: {e}"),
            )
        })?
}

/// The longest ban `reason`.
const MAX_REASON: usize = 1024;

/// The rule file's entity tag: changes whenever its text does, but for a
/// Redis password (the crate's stable hash of it, the same across daemon
/// runs and builds).
pub(super) fn etag(text: &str) -> String {
    // Over the text with its Redis passwords starred: a tag that hashed
    // one would let whoever reads it test guesses of it offline.
    let shown = crate::cluster::settings::redacted_in(text);
    format!("\"{:016x}\"", crate::compile::stable_hash(&shown, 0))
}

/// `If-Match` against the rule file's `text`: absent or `*` passes, else
/// one of its tags (in one header or several) must be the file's, compared
/// strongly (a weak `W/"…"` tag never matches), or the edit is refused with
/// 412: someone changed the rules since the client read them.
fn if_match(headers: &HeaderMap, text: &str) -> ApiResult<()> {
    if headers.get(header::IF_MATCH).is_none() {
        return Ok(());
    }
    // Present but holding no tag (empty, a bare comma, not text) matches
    // nothing: the edit was meant to be conditional.
    let tags: Vec<&str> = headers
        .get_all(header::IF_MATCH)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    let now = etag(text);
    if tags.iter().any(|t| *t == "*" || *t == now) {
        return Ok(());
    }
    let given = tags.join(", ");
    Err(ApiError(
        StatusCode::PRECONDITION_FAILED,
        format!("the rules changed since they were read (If-Match {given}, now {now}): GET /v1/rules again, redo the edit on what it returns, and send it with the new ETag"),
    ))
}

/// The active rule set as JSON: the rule file's tables, with `rules` for
/// `[[rule]]` and `bans` for `[[ban]]`. Its `ETag` goes in `If-Match` of
/// an edit that must not overwrite a change made since.
#[utoipa::path(get, path = "/v1/rules", responses((status = 200, body = Object,
    headers(("ETag" = String, description = "the rule file's tag, for If-Match on PUT, POST and DELETE")))))]
pub(super) async fn get_rules(
    AxState(api): AxState<Api>,
) -> ApiResult<([(header::HeaderName, String); 1], Json<serde_json::Value>)> {
    // Copied out, then parsed without the state lock and off the async
    // workers: a large file takes a while, and /healthz, /metrics and the
    // collector must not wait.
    let text = lock(&api.state).text.clone();
    let (tag, json) = tokio::task::spawn_blocking(move || (etag(&text), document::to_json(&text)))
        .await
        .map_err(|e| {
            ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the rules failed: {e}"),
            )
        })?;
    Ok(([(header::ETAG, tag)], Json(json)))
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
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/toml")
        })
}

fn json_body(body: &[u8]) -> ApiResult<serde_json::Value> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("the body is not valid JSON: {e}"),
        )
    })
}

/// Replaces the whole rule set: JSON like `GET /v1/rules` returns, or the
/// rule file itself with `Content-Type: application/toml`. Validated first,
/// applied atomically, written back to the config file. With `If-Match`
/// (the `ETag` of `GET /v1/rules`), only if the rules are still those.
#[utoipa::path(put, path = "/v1/rules", request_body(content((Object = "application/json"), (String = "application/toml")), description = "the rule set: JSON as GET /v1/rules answers, or the rule file's TOML"),
    params(("If-Match" = Option<String>, Header, description = "the ETag of GET /v1/rules: refused with 412 if the rules changed since")),
    responses((status = 200, body = Applied, headers(("ETag" = String, description = "the rule file's tag now"))), (status = 400, body = ErrorBody), (status = 412, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub(super) async fn put_rules(
    AxState(api): AxState<Api>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<([(header::HeaderName, String); 1], Json<Applied>)> {
    let body = body.map_err(body_error)?;
    let toml = is_toml(&headers);
    let (summary, tag) = change(&api, move |sh| {
        // Parsed here, off the async workers (a body may be megabytes).
        let text = if toml {
            String::from_utf8(body.to_vec()).map_err(|_| {
                ApiError(StatusCode::BAD_REQUEST, "the TOML body is not UTF-8".into())
            })?
        } else {
            document::from_json(&json_body(&body)?)?
        };
        let mut tag = String::new();
        let summary = apply::apply(sh, "api: PUT /v1/rules", |s| {
            if_match(&headers, &s.text)?;
            let text = document::for_put(text, &s.text)?;
            tag = etag(&text);
            Ok::<_, ApiError>(Change {
                text,
                origin: "<PUT /v1/rules>".into(),
                persist: true,
                read_as: None,
            })
        })?;
        Ok((summary, tag))
    })
    .await?;
    Ok(([(header::ETAG, tag)], Json(Applied { summary })))
}

/// Adds one rule (a `[[rule]]` table as JSON) after the existing ones
/// (with `If-Match`, only if the rules are still those read).
#[utoipa::path(post, path = "/v1/rules", request_body(content = Object, description = "one rule, e.g. {\"name\": \"dns\", \"proto\": \"udp\", \"dst_ports\": [53], \"rate\": 100}"),
    params(("If-Match" = Option<String>, Header, description = "the ETag of GET /v1/rules: refused with 412 if the rules changed since")),
    responses((status = 201, body = Applied, headers(("ETag" = String, description = "the rule file's tag now"))), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 412, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub(super) async fn post_rule(
    AxState(api): AxState<Api>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, [(header::HeaderName, String); 1], Json<Applied>)> {
    let rule = json_body(&body.map_err(body_error)?)?;
    let (summary, tag) = change(&api, move |sh| {
        let mut tag = String::new();
        let summary = apply::apply(sh, "api: POST /v1/rules", |s| {
            if_match(&headers, &s.text)?;
            let text = document::add_rule(&s.text, &rule)?;
            tag = etag(&text);
            Ok::<_, ApiError>(Change {
                text,
                origin: "<POST /v1/rules> (the rule file with the new rule last)".into(),
                persist: true,
                read_as: None,
            })
        })?;
        Ok((summary, tag))
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        [(header::ETAG, tag)],
        Json(Applied { summary }),
    ))
}

/// Removes the rule `name` (with `If-Match`, only if the rules are still
/// those read).
#[utoipa::path(delete, path = "/v1/rules/{name}", params(("name" = String, Path, description = "the rule's name"),
        ("If-Match" = Option<String>, Header, description = "the ETag of GET /v1/rules: refused with 412 if the rules changed since")),
    responses((status = 200, body = Applied, headers(("ETag" = String, description = "the rule file's tag now"))), (status = 404, body = ErrorBody), (status = 412, body = ErrorBody)))]
pub(super) async fn delete_rule(
    AxState(api): AxState<Api>,
    Segment(name): Segment,
    headers: HeaderMap,
) -> ApiResult<([(header::HeaderName, String); 1], Json<Applied>)> {
    let (summary, tag) = change(&api, move |sh| {
        let mut tag = String::new();
        let summary = apply::apply_edit(sh, &format!("api: DELETE /v1/rules/{name:?}"), |s| {
            if_match(&headers, &s.text)?;
            let text = document::remove_rule(&s.text, &name)?;
            tag = etag(&text);
            Ok::<_, ApiError>(text)
        })?;
        Ok((summary, tag))
    })
    .await?;
    Ok(([(header::ETAG, tag)], Json(Applied { summary })))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewBan {
    /// An IPv4 or IPv6 prefix, e.g. `198.51.100.0/24`.
    pub cidr: String,
    /// Seconds until the ban lifts by itself (1 ..= 31,622,400: 366 days).
    pub ttl_secs: u64,
    #[serde(default)]
    pub reason: String,
    /// Needed for a prefix broader than /8 (IPv4) or /16 (IPv6): such a
    /// ban drops most of the Internet, this host's own management traffic
    /// included unless an `[[allow]]` covers it.
    #[serde(default)]
    pub force: bool,
}

/// The broadest prefixes a ban takes without `force` (IPv4, IPv6).
pub const BROADEST_BAN: (u8, u8) = (8, 16);

#[derive(Serialize, Deserialize, ToSchema, Debug)]
pub struct BanView {
    pub cidr: String,
    /// Unix time (seconds) when the ban lifts.
    pub until: u64,
    pub ttl_secs: u64,
    pub reason: String,
}

/// The longest ban accepted: one year.
const MAX_BAN_SECS: u64 = 366 * 86_400; // as long as any period (`--ttl 366d` passes the CLI)

/// Drops everything from a prefix until its TTL runs out (allowed CIDRs
/// excepted: `allow` wins over bans as over `deny`).
#[utoipa::path(post, path = "/v1/bans", request_body = NewBan,
    responses((status = 201, body = BanView), (status = 400, body = ErrorBody)))]
pub(super) async fn post_ban(
    AxState(api): AxState<Api>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, Json<BanView>)> {
    let body = body.map_err(body_error)?;
    let ban: NewBan = serde_json::from_slice(&body).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("expected {{\"cidr\": \"...\", \"ttl_secs\": N, \"reason\": \"...\"}}: {e}"),
        )
    })?;
    let cidr = parse_cidr(&ban.cidr)
        .map_err(|m| ApiError(StatusCode::BAD_REQUEST, format!("cidr: {m}")))?;
    let broadest = if cidr.addr.is_ipv4() {
        BROADEST_BAN.0
    } else {
        BROADEST_BAN.1
    };
    if cidr.len < broadest && !ban.force {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("{cidr} is broader than /{broadest}: it would drop most of the Internet, this host's own management traffic included unless an [[allow]] covers it; ban narrower prefixes, or send \"force\": true (rl-control ban --force) if you mean it"),
        ));
    }
    if !(1..=MAX_BAN_SECS).contains(&ban.ttl_secs) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("ttl_secs must be 1..={MAX_BAN_SECS}"),
        ));
    }
    if ban.reason.len() > MAX_REASON {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("reason: at most {MAX_REASON} bytes (it is written into the rule file)"),
        ));
    }
    let now = unix_now();
    let until = now + ban.ttl_secs;
    let (key, reason) = (cidr.to_string(), ban.reason.clone());
    // A ban already longer keeps its end and reason (see `document::set_ban`).
    let kept = std::sync::Arc::new(std::sync::Mutex::new((until, ban.reason)));
    let keep = kept.clone();
    change(&api, move |sh| {
        apply::apply_edit(sh, &format!("api: ban {key} for {}s", ban.ttl_secs), |s| {
            let (text, until, reason) = document::set_ban(&s.text, &key, until, &reason)?;
            *keep.lock().unwrap_or_else(|e| e.into_inner()) = (until, reason);
            Ok::<_, ApiError>(text)
        })
    })
    .await?;
    let (until, reason) = kept.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let view = BanView {
        cidr: cidr.to_string(),
        until,
        ttl_secs: until.saturating_sub(now),
        reason,
    };
    Ok((StatusCode::CREATED, Json(view)))
}

/// Bans in force.
#[utoipa::path(get, path = "/v1/bans", responses((status = 200, body = [BanView])))]
pub(super) async fn get_bans(AxState(api): AxState<Api>) -> Json<Vec<BanView>> {
    let s = lock(&api.state);
    let now = unix_now();
    Json(
        s.config
            .active_bans(now)
            .map(|b| BanView {
                cidr: b.cidr.to_string(),
                until: b.until,
                ttl_secs: b.until - now,
                reason: b.reason.clone(),
            })
            .collect(),
    )
}

/// Lifts a ban now (URL-encode the `/`: `198.51.100.0%2F24`).
#[utoipa::path(delete, path = "/v1/bans/{cidr}", params(("cidr" = String, Path, description = "the banned prefix, URL-encoded")),
    responses((status = 200, body = Applied), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn delete_ban(
    AxState(api): AxState<Api>,
    Segment(cidr): Segment,
) -> ApiResult<Json<Applied>> {
    let c =
        parse_cidr(&cidr).map_err(|m| ApiError(StatusCode::BAD_REQUEST, format!("cidr: {m}")))?;
    let summary = change(&api, move |sh| {
        apply::apply_edit(sh, &format!("api: lift the ban on {c}"), |s| {
            if !s.config.active_bans(unix_now()).any(|b| b.cidr == c) {
                return Err(ApiError(
                    StatusCode::NOT_FOUND,
                    format!("{c} is not banned"),
                ));
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
pub(super) async fn reload(AxState(api): AxState<Api>) -> ApiResult<Json<Applied>> {
    let summary = change(&api, |sh| {
        Ok(apply::reload_file(sh, "api: POST /v1/reload")?)
    })
    .await?;
    Ok(Json(Applied { summary }))
}
