//! Liveness, readiness, Prometheus metrics and the OpenAPI document. None needs a token.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde::Serialize;
use sortie_protocol::ApiErrorBody;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(api_metrics_text))
}

/// `/healthz` and `/metrics` for a process that serves no api (a worker on its feed listener): metrics
/// per role, from whichever process records them.
pub fn operations_router() -> axum::Router {
    axum::Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .route("/metrics", axum::routing::get(metrics_text))
}

#[derive(Serialize, utoipa::ToSchema)]
struct Health {
    status: &'static str,
}

/// The process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Health)))]
async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// The store answers and its migrations are applied.
#[utoipa::path(get, path = "/readyz", tag = "operations", responses((status = 200, body = Health), (status = 503, description = "STORE_UNAVAILABLE", body = ApiErrorBody)))]
async fn readyz(State(state): State<ApiState>) -> Result<Json<Health>, ApiError> {
    state.store.ping().await?;
    Ok(Json(Health { status: "ready" }))
}

/// Prometheus text exposition; the store's queue depth (`sortie_turns_queued`) is read at each scrape,
/// so every api replica reports the same, true figure.
#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
async fn api_metrics_text(State(state): State<ApiState>) -> impl IntoResponse {
    match state.store.queued_turns().await {
        Ok(queued) => metrics::gauge!("sortie_turns_queued").set(queued as f64),
        Err(error) => tracing::debug!(%error, "cannot count the queued turns"),
    }
    metrics_text().await
}

/// What this process recorded (a worker's, on its feed listener).
async fn metrics_text() -> impl IntoResponse {
    let body = crate::metrics_layer::render();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        body,
    )
}

/// The OpenAPI document as served, serialized once at start: its JSON is 82 KiB, where the
/// document as a tree held 5 MiB of an idle serve's 6.7 MiB heap (heaptrack) and was cloned for each
/// request.
#[derive(Clone)]
pub(crate) struct OpenApiJson(Option<axum::body::Bytes>);

impl OpenApiJson {
    pub(crate) fn new(openapi: &utoipa::openapi::OpenApi) -> Self {
        match serde_json::to_vec(openapi) {
            Ok(json) => Self(Some(json.into())),
            Err(error) => {
                tracing::error!(%error, "the OpenAPI document does not serialize");
                Self(None)
            }
        }
    }
}

pub(crate) async fn openapi_document(openapi: OpenApiJson) -> axum::response::Response {
    match openapi.0 {
        Some(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        None => ApiError::new(
            sortie_protocol::ErrorCode::Internal,
            "the OpenAPI document could not be serialized; the log has the detail",
        )
        .into_response(),
    }
}
