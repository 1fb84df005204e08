//! The api role of sortie: the control-plane REST API of DESIGN §4, its OpenAPI document, and the
//! health, readiness and metrics endpoints.
//!
//! It validates, authorizes and writes to the store; it never runs anything slow on the request path
//! (no clone, no sandbox, no agent). Every refusal is an [`error::ApiError`] with a stable code, and no
//! input makes it answer 500: faults of its own are logged with detail and answered with `INTERNAL`.

pub mod error;
mod extract;
mod health;
mod metrics_layer;
mod sessions;
pub mod tokens;
mod views;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use sortie_protocol::agents::{BUILT_IN_AGENTS, DEFAULT_AGENT};
use sortie_protocol::limits::REQUEST_BODY_MAX_BYTES;
use sortie_store::Store;
use tokio::net::TcpListener;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

pub use tokens::Secret;

/// The agents a server accepts and the one it uses when a request names none.
#[derive(Clone, Debug)]
pub struct AgentCatalog {
    pub known: Vec<String>,
    pub default: String,
}

impl Default for AgentCatalog {
    fn default() -> Self {
        Self {
            known: BUILT_IN_AGENTS.iter().map(|id| (*id).to_owned()).collect(),
            default: DEFAULT_AGENT.to_owned(),
        }
    }
}

/// What the api role needs, shared by every request.
#[derive(Clone)]
pub struct ApiState {
    pub store: Arc<dyn Store>,
    pub agents: Arc<AgentCatalog>,
    /// Signs attach tickets; the gateway verifies with the same secret.
    pub ticket_secret: Secret,
}

#[derive(OpenApi)]
#[openapi(
    info(title = "sortie", description = "Control plane of sortie: sessions of coding agents in sandboxes, delivered as branches."),
    modifiers(&BearerAuth),
    components(schemas(sortie_protocol::ErrorCode, sortie_protocol::FailureCode, sortie_protocol::api::Role))
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The api role's router and its OpenAPI document, built from the same handler list.
pub fn router_and_openapi(state: ApiState) -> (Router, utoipa::openapi::OpenApi) {
    let (api_routes, openapi) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(sessions::routes())
        .merge(health::routes())
        .split_for_parts();
    let openapi_json = Arc::new(openapi.clone());
    let router = api_routes
        .route(
            "/v1/openapi.json",
            axum::routing::get(move || health::openapi_document(openapi_json.clone())),
        )
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(DefaultBodyLimit::max(REQUEST_BODY_MAX_BYTES))
        .layer(axum::middleware::from_fn(metrics_layer::track))
        .with_state(state);
    (router, openapi)
}

/// The api role's router.
pub fn router(state: ApiState) -> Router {
    router_and_openapi(state).0
}

/// Serves the api role on a bound listener until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    state: ApiState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_with(listener, state, Router::new(), shutdown).await
}

/// Serves the api role together with routes of other roles in the same process (the gateway's
/// `/v1/sessions/{id}/stream` in `sortie serve`).
pub async fn run_with(
    listener: TcpListener,
    state: ApiState,
    others: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    metrics_layer::install_recorder();
    axum::serve(listener, others.merge(router(state)))
        .with_graceful_shutdown(shutdown)
        .await
}
