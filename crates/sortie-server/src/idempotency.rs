//! `Idempotency-Key` on `POST /v1/sessions` and steer (DESIGN §14): a retried request (same key, same
//! endpoint, same body) gets the first answer for 24 h instead of a second session or turn; the same
//! key with another request is refused `IDEMPOTENCY_KEY_REUSED`, and one whose first request is still
//! being answered `IDEMPOTENCY_KEY_IN_USE`. Keys are per workspace and kept in the store, so every api
//! replica agrees. A request that is refused (nothing written) gives its key back, so a retry runs
//! afresh.

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sha2::{Digest, Sha256};
use sortie_protocol::ErrorCode;
use sortie_store::IdempotencyClaim;

use crate::ApiState;
use crate::error::ApiError;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// The header on an answer that is a replay of the first one.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// How long a key holds its answer.
pub const KEY_LIFETIME: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest key accepted.
pub const KEY_MAX_BYTES: usize = 255;

/// How a request under a key goes on.
pub(crate) enum Begun {
    /// Answer it (holding the key, if it has one), then [`settle`].
    Fresh(Option<Held>),
    /// The first answer, again.
    Replay(Response),
}

/// A key this request holds until it is answered.
pub(crate) struct Held {
    workspace_id: String,
    key: String,
}

/// Claims the request's key, if it has one.
pub(crate) async fn begin(
    state: &ApiState,
    workspace_id: &str,
    headers: &HeaderMap,
    scope: &str,
    request: &impl Serialize,
) -> Result<Begun, ApiError> {
    let Some(value) = headers.get(HEADER) else {
        return Ok(Begun::Fresh(None));
    };
    let key = value
        .to_str()
        .ok()
        .filter(|key| (1..=KEY_MAX_BYTES).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("Idempotency-Key must be 1 to {KEY_MAX_BYTES} visible ASCII characters"),
            )
        })?;
    let body = serde_json::to_vec(request).map_err(|error| {
        tracing::error!(%error, "cannot serialize a request to hash it");
        ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
    })?;
    let hash: String = Sha256::digest(&body).iter().map(|b| format!("{b:02x}")).collect();
    let lifetime = i64::try_from(KEY_LIFETIME.as_millis()).unwrap_or(i64::MAX);
    let expired_before = sortie_store::now_ms().saturating_sub(lifetime);
    match state
        .store
        .claim_idempotency_key(workspace_id, key, scope, &hash, expired_before)
        .await?
    {
        IdempotencyClaim::Fresh => Ok(Begun::Fresh(Some(Held {
            workspace_id: workspace_id.to_owned(),
            key: key.to_owned(),
        }))),
        IdempotencyClaim::Answered { status, body } => {
            let mut response = (
                StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
                [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                body,
            )
                .into_response();
            response
                .headers_mut()
                .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            Ok(Begun::Replay(response))
        }
        IdempotencyClaim::InFlight => Err(ApiError::new(
            ErrorCode::IdempotencyKeyInUse,
            "a request with this Idempotency-Key is still being answered; retry in a moment",
        )),
        IdempotencyClaim::OtherRequest => Err(ApiError::new(
            ErrorCode::IdempotencyKeyReused,
            "this Idempotency-Key was used for a different request in the last 24 h; use a new key",
        )),
    }
}

/// Records the answer under the held key (or gives the key back after a refusal) and answers.
pub(crate) async fn settle<T: Serialize>(
    state: &ApiState,
    held: Option<Held>,
    result: Result<(StatusCode, Json<T>), ApiError>,
) -> Response {
    let Some(held) = held else {
        return result.into_response();
    };
    match result {
        Ok((status, Json(body))) => {
            match serde_json::to_string(&body) {
                Ok(text) => {
                    if let Err(error) = state
                        .store
                        .answer_idempotency_key(&held.workspace_id, &held.key, status.as_u16(), &text)
                        .await
                    {
                        // The work is done; a retry under this key will be told it is in flight.
                        tracing::warn!(%error, "cannot record the answer under an Idempotency-Key");
                    }
                }
                Err(error) => tracing::error!(%error, "cannot serialize an answer to keep it"),
            }
            (status, Json(body)).into_response()
        }
        Err(refusal) => {
            if let Err(error) = state.store.release_idempotency_key(&held.workspace_id, &held.key).await {
                tracing::warn!(%error, "cannot give an Idempotency-Key back");
            }
            refusal.into_response()
        }
    }
}
