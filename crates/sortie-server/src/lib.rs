//! The api role of sortie: the control-plane REST API of DESIGN §4, its OpenAPI document, and the
//! health, readiness and metrics endpoints.
//!
//! It validates, authorizes and writes to the store; it never runs anything slow on the request path
//! (no clone, no sandbox, no agent). Every refusal is an [`error::ApiError`] with a stable code, and no
//! input makes it answer 500: faults of its own are logged with detail and answered with `INTERNAL`.

mod agents;
mod audit;
pub mod bootstrap;
pub mod error;
pub mod events;
mod extract;
mod forges;
mod github_webhook;
mod health;
mod idempotency;
mod listener;
mod local_repo;
mod metrics_layer;
mod model_keys;
mod sessions;
mod settings;
pub mod signin;
pub mod tokens;
mod transcript;
mod views;
pub mod webhooks;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use sortie_protocol::agents::{BUILT_IN_AGENTS, DEFAULT_AGENT};
use sortie_protocol::limits::REQUEST_BODY_MAX_BYTES;
use sortie_store::{KeyRing, Store};
use tokio::net::TcpListener;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

pub use health::operations_router;
pub use listener::{
    ConnectionCaps, DESCRIPTOR_RESERVE, DescriptorPlan, FDS_PER_API_CONNECTION, HEADER_READ_TIMEOUT, ListenerLimits,
    MAX_CONNECTIONS, MAX_CONNECTIONS_PER_IP,
};
pub use metrics_layer::{install_recorder as install_metrics_recorder, render as render_metrics};
pub use tokens::Secret;

/// Whether this host can run an agent, asked at every create (an install while the server runs counts).
pub trait AgentProbe: Send + Sync {
    /// What the host lacks to run agent `id` (how to install it, e.g. `sortie agents install codex`),
    /// or `None` when it can run it.
    fn needs(&self, id: &str) -> Option<String>;
}

/// A fixed answer: the agents named are missing, with what each needs; every other is installed.
impl AgentProbe for std::collections::BTreeMap<String, String> {
    fn needs(&self, id: &str) -> Option<String> {
        self.get(id).cloned()
    }
}

/// The agents a server accepts and the one it uses when a request names none.
#[derive(Clone)]
pub struct AgentCatalog {
    pub known: Vec<String>,
    /// The agent of a request that names none, used only when it is installed (else the request must
    /// name one).
    pub default: String,
    /// Which known agents this host can run; a session naming one it cannot is refused
    /// `AGENT_NOT_INSTALLED` with what it needs.
    pub probe: Arc<dyn AgentProbe>,
}

impl AgentCatalog {
    /// What the host lacks to run `id`, or `None` when it can run it.
    pub fn needs(&self, id: &str) -> Option<String> {
        self.probe.needs(id)
    }

    /// The known agents this host can run.
    pub fn installed(&self) -> Vec<String> {
        self.known
            .iter()
            .filter(|id| self.needs(id).is_none())
            .cloned()
            .collect()
    }
}

impl std::fmt::Debug for AgentCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentCatalog")
            .field("known", &self.known)
            .field("default", &self.default)
            .finish_non_exhaustive()
    }
}

impl Default for AgentCatalog {
    fn default() -> Self {
        Self {
            known: BUILT_IN_AGENTS.iter().map(|id| (*id).to_owned()).collect(),
            default: DEFAULT_AGENT.to_owned(),
            probe: Arc::new(std::collections::BTreeMap::new()),
        }
    }
}

impl AgentCatalog {
    /// The agents of `profiles` (the built-in ones and an operator's manifest's, all as good), probed
    /// on this host at each question so an install while `serve` runs counts. `default_agent`, when
    /// given, must be one of them.
    pub fn for_host(
        profiles: Vec<sortie_profile::AgentProfile>,
        agents_dir: std::path::PathBuf,
        default_agent: Option<String>,
    ) -> Result<Self, String> {
        let mut catalog = Self::default();
        for profile in &profiles {
            if !catalog.known.contains(&profile.id) {
                catalog.known.push(profile.id.clone());
            }
        }
        if let Some(default_agent) = default_agent {
            if !catalog.known.contains(&default_agent) {
                return Err(format!(
                    "--default-agent {default_agent:?} is not a known agent ({})",
                    catalog.known.join(", ")
                ));
            }
            catalog.default = default_agent;
        }
        catalog.probe = Arc::new(HostAgents { profiles, agents_dir });
        Ok(catalog)
    }

    /// The catalog whose installed agents are `installed`, as the operator declared them for sandboxes
    /// that run elsewhere (pods of an image that holds them), instead of this host's.
    pub fn declared(mut self, installed: &[String]) -> Result<Self, String> {
        let installed: Vec<&String> = installed.iter().filter(|id| !id.is_empty()).collect();
        if let Some(unknown) = installed.iter().find(|id| !self.known.contains(id)) {
            return Err(format!(
                "--agents-installed names {unknown:?}, which is not a known agent ({})",
                self.known.join(", ")
            ));
        }
        let listed = installed.iter().map(|id| id.as_str()).collect::<Vec<_>>().join(",");
        let missing: std::collections::BTreeMap<String, String> = self
            .known
            .iter()
            .filter(|id| !installed.contains(id))
            .map(|id| {
                (
                    id.clone(),
                    format!("this deployment's sandboxes do not hold it (SORTIE_AGENTS_INSTALLED={listed})"),
                )
            })
            .collect();
        self.probe = Arc::new(missing);
        Ok(self)
    }
}

/// The agents this host can run: installed under the agents dir, next to sortie or on PATH.
struct HostAgents {
    profiles: Vec<sortie_profile::AgentProfile>,
    agents_dir: std::path::PathBuf,
}

impl AgentProbe for HostAgents {
    fn needs(&self, id: &str) -> Option<String> {
        let profile = self.profiles.iter().find(|p| p.id == id)?;
        sortie_profile::locate(&self.agents_dir, profile)
            .is_none()
            .then(|| sortie_profile::install_hint(profile))
    }
}

/// What the api role needs, shared by every request.
#[derive(Clone)]
pub struct ApiState {
    pub store: Arc<dyn Store>,
    pub agents: Arc<AgentCatalog>,
    /// Signs attach tickets; the gateway verifies with the same secret.
    pub ticket_secret: Secret,
    /// Seals model keys before the store sees them (and opens them for their fingerprints).
    pub keyring: Arc<KeyRing>,
    /// The dashboard's one-time sign-in codes and cookie sessions (in memory).
    pub signins: Arc<signin::SignIns>,
    /// Address ranges a webhook may reach although private (an internal receiver; tests).
    pub webhook_exempt: Arc<Vec<sortie_protocol::egress::Cidr>>,
}

#[derive(OpenApi)]
#[openapi(
    info(title = "sortie", description = "Control plane of sortie: sessions of coding agents in sandboxes, delivered as branches."),
    modifiers(&BearerAuth),
    components(schemas(
        sortie_protocol::ErrorCode,
        sortie_protocol::FailureCode,
        sortie_protocol::api::Role,
        sortie_protocol::api::Event,
        sortie_protocol::sortie_data::SortieData
    ))
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

fn api_routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(sessions::routes())
        .merge(events::routes())
        .merge(webhooks::routes())
        .merge(model_keys::routes())
        .merge(settings::routes())
        .merge(audit::routes())
        .merge(forges::routes())
        .merge(github_webhook::routes())
        .merge(signin::routes())
        .merge(agents::routes())
        .merge(health::routes())
}

/// The OpenAPI document `/v1/openapi.json` serves (the dashboard's types are generated from a
/// checked-in copy that a test keeps equal to this).
pub fn openapi() -> utoipa::openapi::OpenApi {
    api_routes().split_for_parts().1
}

/// The api role's router, serving its OpenAPI document, built from the same handler list.
pub fn router(state: ApiState) -> Router {
    let (api_routes, openapi) = api_routes().split_for_parts();
    let openapi_json = health::OpenApiJson::new(&openapi);
    api_routes
        .route(
            "/v1/openapi.json",
            axum::routing::get(move || health::openapi_document(openapi_json.clone())),
        )
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(DefaultBodyLimit::max(REQUEST_BODY_MAX_BYTES))
        .layer(axum::middleware::from_fn(metrics_layer::track))
        .with_state(state)
}

/// Lets a request through only with a valid bearer token of any role (no cookie): for routes that
/// serve the workspace's callers but are not the api's own, such as `/mcp`, whose handlers then act
/// with that token.
pub async fn require_bearer(
    axum::extract::State(state): axum::extract::State<ApiState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::extract::FromRequestParts;
    use axum::response::IntoResponse;
    let (mut parts, body) = request.into_parts();
    if !parts.headers.contains_key(axum::http::header::AUTHORIZATION) {
        return error::ApiError::new(
            sortie_protocol::ErrorCode::Unauthorized,
            "missing Authorization: Bearer <token>",
        )
        .into_response();
    }
    match extract::Viewer::from_request_parts(&mut parts, &state).await {
        Ok(_) => next.run(axum::extract::Request::from_parts(parts, body)).await,
        Err(refusal) => refusal.into_response(),
    }
}

/// Serves the api role on a bound listener until `shutdown` completes, within the default
/// [`ListenerLimits`].
pub async fn run(
    listener: TcpListener,
    state: ApiState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_with(listener, state, Router::new(), None, shutdown).await
}

/// Serves the api role together with routes of other roles in the same process (the gateway's
/// `/v1/sessions/{id}/stream` in `sortie serve`), and an app (the dashboard) for every other path,
/// within the default [`ListenerLimits`].
pub async fn run_with<L>(
    listener: L,
    state: ApiState,
    others: Router,
    app: Option<Router>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    run_with_limits(listener, state, others, app, ListenerLimits::default(), shutdown).await
}

/// [`run_with`] within `limits` (a header-read deadline and connection caps; `sortie serve` sizes
/// the caps from its descriptor limit, [`DescriptorPlan`]).
pub async fn run_with_limits<L>(
    listener: L,
    state: ApiState,
    others: Router,
    app: Option<Router>,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    metrics_layer::install_recorder();
    let mut routes = others.merge(router(state));
    if let Some(app) = app {
        routes = with_app(routes, app);
    }
    listener::serve(listener, routes, limits, shutdown).await
}

/// Serves any `router` (a worker's feed, which its pods reach too) within `limits`: the same bounds
/// as the api listener, a head deadline and connection caps, and upgrades.
pub async fn serve_bounded<L>(
    listener: L,
    router: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    listener::serve(listener, router, limits, shutdown).await
}

/// `router` with an app behind it: every path the API does not route goes to `app` (the dashboard),
/// except under `/v1/`, which stays the API's own JSON 404.
pub fn with_app<S>(router: Router, app: S) -> Router
where
    S: tower::Service<axum::extract::Request, Error = std::convert::Infallible> + Clone + Send + Sync + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
{
    use axum::response::IntoResponse;
    use tower::ServiceExt;
    router.fallback(move |request: axum::extract::Request| {
        let app = app.clone();
        async move {
            let path = request.uri().path();
            if path == "/v1" || path.starts_with("/v1/") {
                return error::not_found().await.into_response();
            }
            match app.oneshot(request).await {
                Ok(response) => response.into_response(),
                Err(never) => match never {},
            }
        }
    })
}
