//! `GET /v1/l7/state`: a request key's state, as `rl-control source` gives
//! a packet source's: what the next request with that descriptor would
//! meet, without charging anything.

use axum::{
    extract::{RawQuery, State as AxState},
    http::StatusCode,
    Json,
};

use super::{Api, ApiError, ApiResult};
use crate::l7::engine::{DescriptorEntry, Status};

/// `domain=D` then the descriptor's entries in order, `key=value` each
/// (URL-encoded).
#[utoipa::path(get, path = "/v1/l7/state",
    params(("domain" = String, Query, description = "the rate-limit domain; the other parameters, in order, are the descriptor's entries (key=value)")),
    responses((status = 200, body = Status), (status = 400, body = super::ErrorBody)))]
pub async fn l7_state(
    AxState(api): AxState<Api>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Status>> {
    let bad = |m: &str| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("{m}: use ?domain=D&key=value&… (the descriptor's entries in order)"),
        )
    };
    let pairs: Vec<(String, String)> = crate::l7::forward::query_pairs(q.as_deref().unwrap_or(""))
        .into_iter()
        .map(|(k, v)| (k, v.unwrap_or_default()))
        .collect();
    let Some(((first, domain), entries)) = pairs.split_first() else {
        return Err(bad("no domain"));
    };
    if first != "domain" || domain.is_empty() {
        return Err(bad("the first parameter must be domain"));
    }
    if entries.is_empty() || entries.len() > crate::l7::rules::MAX_ENTRIES {
        return Err(bad("give 1 to 16 descriptor entries"));
    }
    let entries: Vec<DescriptorEntry> = entries
        .iter()
        .map(|(k, v)| {
            // Fitted as the front ends fit them: the same bucket.
            DescriptorEntry {
                key: k.clone(),
                value: v.clone(),
            }
            .fitted()
        })
        .collect();
    let engine = crate::daemon::state::lock(&api.state)
        .l7
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Ok(Json(engine.peek_scoped(domain, &entries).await))
}
