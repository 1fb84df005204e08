//! The webhook endpoints (DESIGN §14): an admin adds, lists and removes the workspace's webhooks and
//! reads each one's delivery log. A URL is checked like egress before it is stored (`sortie_webhooks::
//! check_url`); the secret is sealed by the [`sortie_store::KeyRing`] and never shown again. The
//! deliveries themselves are made by `sortie_webhooks::Dispatcher`, off every request path.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::Deserialize;
use sortie_protocol::api::{
    CreateWebhookRequest, EventKind, Webhook, WebhookDelivery, WebhookDeliveryList, WebhookDeliveryState, WebhookList,
    rfc3339_from_epoch_ms,
};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::{DeliveryRow, DeliveryState, NewWebhook, WebhookRow};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::extract::{Admin, ApiJson, ApiQuery};
use crate::{ApiState, audit};

/// The most webhooks a workspace may have.
pub const WEBHOOKS_MAX: usize = 20;
/// A secret's length bounds, in bytes.
pub const SECRET_BYTES: std::ops::RangeInclusive<usize> = 16..=256;

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(create_webhook, list_webhooks))
        .routes(routes!(delete_webhook))
        .routes(routes!(list_deliveries))
}

/// Add a webhook: every event of the kinds it takes is POSTed to its URL, signed with its secret.
#[utoipa::path(
    post, path = "/v1/webhooks", tag = "webhooks", request_body = CreateWebhookRequest, security(("bearer" = [])),
    responses(
        (status = 201, description = "Added; it receives what happens from now on", body = Webhook),
        (status = 400, description = "WEBHOOK_URL_REFUSED, WEBHOOK_INVALID, INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn create_webhook(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiJson(request): ApiJson<CreateWebhookRequest>,
) -> Result<(StatusCode, Json<Webhook>), ApiError> {
    if !SECRET_BYTES.contains(&request.secret.len()) || !request.secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::new(
            ErrorCode::WebhookInvalid,
            "secret must be 16 to 256 printable ASCII characters without spaces",
        ));
    }
    let mut events = request.events.unwrap_or_else(|| EventKind::ALL.to_vec());
    events.sort_by_key(|kind| kind.as_str());
    events.dedup();
    if events.is_empty() {
        return Err(ApiError::new(
            ErrorCode::WebhookInvalid,
            "events is empty: name at least one of session.phase, turn.status (or leave it out for all)",
        ));
    }
    let url = sortie_webhooks::check_url(&request.url, &state.webhook_exempt)
        .await
        .map_err(|refusal| ApiError::new(ErrorCode::WebhookUrlRefused, format!("url: {refusal}")))?;
    if state.store.webhooks(Some(&caller.workspace_id)).await?.len() >= WEBHOOKS_MAX {
        return Err(ApiError::new(
            ErrorCode::WebhookInvalid,
            format!("the workspace has {WEBHOOKS_MAX} webhooks, the most it may; remove one first"),
        ));
    }
    let id = format!("whk_{}", crate::tokens::random_text(12).map_err(internal)?);
    let sealed = state
        .keyring
        .seal_webhook_secret(&caller.workspace_id, &id, request.secret.as_bytes())?;
    let row = state
        .store
        .create_webhook(NewWebhook {
            id,
            workspace_id: caller.workspace_id.clone(),
            url: url.to_string(),
            secret_ciphertext: sealed.ciphertext,
            secret_nonce: sealed.nonce,
            events: events.iter().map(|kind| kind.as_str().to_owned()).collect(),
            cursor: state.store.latest_event().await?,
        })
        .await?;
    audit::record(&state, &caller, "webhook.create", &row.id).await;
    Ok((StatusCode::CREATED, Json(webhook(&row))))
}

/// The workspace's webhooks (never their secrets).
#[utoipa::path(
    get, path = "/v1/webhooks", tag = "webhooks", security(("bearer" = [])),
    responses(
        (status = 200, body = WebhookList),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn list_webhooks(State(state): State<ApiState>, Admin(caller): Admin) -> Result<Json<WebhookList>, ApiError> {
    let rows = state.store.webhooks(Some(&caller.workspace_id)).await?;
    Ok(Json(WebhookList {
        webhooks: rows.iter().map(webhook).collect(),
    }))
}

/// Remove a webhook and its delivery log.
#[utoipa::path(
    delete, path = "/v1/webhooks/{id}", tag = "webhooks", security(("bearer" = [])),
    params(("id" = String, Path, description = "Webhook id")),
    responses(
        (status = 204, description = "Removed"),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "WEBHOOK_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn delete_webhook(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if state.store.delete_webhook(&caller.workspace_id, &id).await? {
        audit::record(&state, &caller, "webhook.delete", &id).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_found())
    }
}

/// The query of `GET /v1/webhooks/{id}/deliveries`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct DeliveriesQuery {
    /// How many, newest first (1 to 200, default 50).
    limit: Option<u32>,
}

/// A webhook's deliveries, newest first: each event's state, attempts and the receiver's last answer.
#[utoipa::path(
    get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks", security(("bearer" = [])),
    params(("id" = String, Path, description = "Webhook id"), DeliveriesQuery),
    responses(
        (status = 200, body = WebhookDeliveryList),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "WEBHOOK_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn list_deliveries(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    Path(id): Path<String>,
    ApiQuery(query): ApiQuery<DeliveriesQuery>,
) -> Result<Json<WebhookDeliveryList>, ApiError> {
    let limit = query.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::new(ErrorCode::InvalidRequest, "limit must be 1 to 200"));
    }
    let known = state.store.webhooks(Some(&caller.workspace_id)).await?;
    if !known.iter().any(|w| w.id == id) {
        return Err(not_found());
    }
    let rows = state.store.webhook_deliveries(&caller.workspace_id, &id, limit).await?;
    Ok(Json(WebhookDeliveryList {
        deliveries: rows.iter().map(delivery).collect(),
    }))
}

fn not_found() -> ApiError {
    ApiError::new(ErrorCode::WebhookNotFound, "the workspace has no webhook with this id")
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    tracing::error!(%error, "webhooks: no randomness for an id");
    ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
}

fn webhook(row: &WebhookRow) -> Webhook {
    Webhook {
        id: row.id.clone(),
        url: row.url.clone(),
        events: row
            .events
            .iter()
            .filter_map(|kind| EventKind::ALL.into_iter().find(|k| k.as_str() == kind))
            .collect(),
        created_at: rfc3339_from_epoch_ms(row.created_at),
    }
}

fn delivery(row: &DeliveryRow) -> WebhookDelivery {
    let state = match row.state {
        DeliveryState::Pending => WebhookDeliveryState::Pending,
        DeliveryState::Delivered => WebhookDeliveryState::Delivered,
        DeliveryState::Failed => WebhookDeliveryState::Failed,
    };
    WebhookDelivery {
        id: row.id.clone(),
        event: row.event_seq,
        kind: row.kind.clone(),
        state,
        attempts: row.attempts,
        last_status: row.last_status,
        last_error: row.last_error.clone(),
        created_at: rfc3339_from_epoch_ms(row.created_at),
        delivered_at: row.delivered_at.map(rfc3339_from_epoch_ms),
        next_attempt_at: (row.state == DeliveryState::Pending).then(|| rfc3339_from_epoch_ms(row.next_at)),
    }
}
