//! `POST /v1/forges/github/webhook` (outside bearer auth): GitHub's deliveries for a workspace's GitHub
//! App. A delivery counts only when the webhook secret of a connection of the App it names
//! (`X-GitHub-Hook-Installation-Target-ID`) signs its body (`X-Hub-Signature-256`, compared in constant
//! time); then a comment event is recorded once per `X-GitHub-Delivery` and answered 202 at once. A
//! worker acts on it from the store (`sortie_worker::triggers`): nothing slow, and no call to GitHub,
//! runs on this request.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use sortie_github::webhook;
use sortie_protocol::api::{ForgeTriggers, ForgeWebhookAnswer};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::NewForgeDelivery;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::forges::webhook_secret_binding;

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new().routes(routes!(github_webhook))
}

/// The events a delivery of which is recorded for a worker to act on.
const ACTED_ON: [&str; 3] = ["issue_comment", "pull_request_review_comment", "issues"];
/// The most deliveries of one workspace that wait for a worker.
const PENDING_MAX: u64 = 100;
/// The longest delivery id taken (GitHub's are GUIDs).
const DELIVERY_ID_MAX: usize = 100;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok()).map(str::trim)
}

fn counted(result: &'static str) {
    metrics::counter!("sortie_webhook_deliveries_total", "result" => result).increment(1);
}

/// A delivery from a GitHub App: `ping` is answered; `issue_comment`, `pull_request_review_comment` and
/// an `issues` assignment are recorded for a worker (once per delivery id); every other event is ignored.
#[utoipa::path(
    post, path = "/v1/forges/github/webhook", tag = "forge-connections",
    request_body(content = String, description = "GitHub's JSON payload, signed", content_type = "application/json"),
    params(
        ("X-GitHub-Event" = String, Header, description = "The event"),
        ("X-GitHub-Delivery" = String, Header, description = "The delivery's id, the same on a redelivery"),
        ("X-Hub-Signature-256" = String, Header, description = "sha256=<hex HMAC-SHA256 of the body>"),
        ("X-GitHub-Hook-Installation-Target-ID" = String, Header, description = "The App's ID"),
    ),
    responses(
        (status = 200, description = "A ping, an event sortie does not act on, or a delivery already recorded", body = ForgeWebhookAnswer),
        (status = 202, description = "Recorded; a worker acts on it", body = ForgeWebhookAnswer),
        (status = 400, description = "INVALID_REQUEST: no event or delivery id", body = ApiErrorBody),
        (status = 401, description = "WEBHOOK_SIGNATURE_INVALID", body = ApiErrorBody),
        (status = 429, description = "WEBHOOK_BACKLOG_FULL", body = ApiErrorBody),
        (status = 413, description = "BODY_TOO_LARGE", body = ApiErrorBody),
    )
)]
async fn github_webhook(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<ForgeWebhookAnswer>), ApiError> {
    let answer = |code: StatusCode, status: &str| Ok((code, Json(ForgeWebhookAnswer { status: status.into() })));
    let (Some(event), Some(delivery_id)) = (
        header(&headers, "x-github-event"),
        header(&headers, "x-github-delivery"),
    ) else {
        counted("invalid");
        return Err(ApiError::invalid(
            "a GitHub delivery has X-GitHub-Event and X-GitHub-Delivery",
        ));
    };
    let plain = |text: &str| {
        !text.is_empty()
            && text.len() <= DELIVERY_ID_MAX
            && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if !plain(event) || !plain(delivery_id) {
        counted("invalid");
        return Err(ApiError::invalid(
            "X-GitHub-Event or X-GitHub-Delivery is not one GitHub sends",
        ));
    }
    let refused = || {
        counted("bad_signature");
        ApiError::new(
            ErrorCode::WebhookSignatureInvalid,
            "the delivery is not signed with the webhook secret of a GitHub App connected to sortie",
        )
    };
    let signature = header(&headers, "x-hub-signature-256").ok_or_else(refused)?;
    // The App it is for, by its numeric ID: one connection of the instance takes its deliveries, so one
    // secret is opened and one digest computed, whoever sends what.
    let app_id = header(&headers, "x-github-hook-installation-target-id")
        .filter(|id| !id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(refused)?;
    let connection = state
        .store
        .app_connections(app_id)
        .await?
        .into_iter()
        .next()
        .ok_or_else(refused)?;
    let Some((ciphertext, nonce)) = &connection.webhook_secret else {
        return Err(refused());
    };
    let signed = state
        .keyring
        .open_webhook_secret(
            &connection.workspace_id,
            &webhook_secret_binding(&connection.host),
            ciphertext,
            nonce,
        )
        .is_ok_and(|secret| webhook::signature_matches(secret.expose(), &body, signature));
    if !signed {
        return Err(refused());
    }
    if event == "ping" {
        counted("ping");
        return answer(StatusCode::OK, "pong");
    }
    // Only a request is kept: a comment or an assignment that passes the loop guards, on the
    // connection's host. Everything else is answered and forgotten.
    let triggers: Option<ForgeTriggers> = connection
        .triggers
        .as_deref()
        .and_then(|json| serde_json::from_str(json).ok());
    let assignee = triggers.as_ref().and_then(|t| t.assignee.as_deref());
    let request = ACTED_ON
        .contains(&event)
        .then(|| webhook::comment(event, &body).ok().flatten())
        .flatten()
        .filter(|comment| comment.ignored(app_id, assignee).is_none())
        .filter(|comment| comment.host().as_deref() == Some(connection.host.as_str()));
    let Some(request) = request else {
        counted("ignored");
        return answer(StatusCode::OK, "ignored");
    };
    // One workspace's flood waits in its own backlog, not in front of everyone's.
    if state.store.pending_forge_deliveries(&connection.workspace_id).await? >= PENDING_MAX {
        counted("backlog_full");
        return Err(ApiError::new(
            ErrorCode::WebhookBacklogFull,
            format!("{PENDING_MAX} deliveries of this App already wait for a worker; redeliver it later"),
        ));
    }
    let recorded = state
        .store
        .record_forge_delivery(&NewForgeDelivery {
            delivery_id: delivery_id.to_owned(),
            request_key: request.request_key(&connection.host),
            workspace_id: connection.workspace_id.clone(),
            host: connection.host.clone(),
            event: event.to_owned(),
            payload: String::from_utf8_lossy(&body).into_owned(),
        })
        .await?;
    if recorded {
        counted("accepted");
        answer(StatusCode::ACCEPTED, "accepted")
    } else {
        counted("duplicate");
        answer(StatusCode::OK, "duplicate")
    }
}
