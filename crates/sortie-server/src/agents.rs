//! `GET /v1/agents`: the agents this server accepts in `POST /v1/sessions` and the one it uses when a
//! request names none, and whether this host can run each (the dashboard's composer offers the
//! installed ones).

use axum::Json;
use axum::extract::State;
use sortie_protocol::ApiErrorBody;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::extract::Viewer;

pub(crate) fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new().routes(routes!(list_agents))
}

/// One agent a session may name.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AgentInfo {
    /// The profile id, e.g. `claude-code`.
    pub id: String,
    /// Whether this host can run the agent (its program is installed or on PATH).
    pub installed: bool,
    /// What the host lacks to run it, e.g. `sortie agents install codex`; null when installed.
    pub needs: Option<String>,
}

/// The agents of `GET /v1/agents`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AgentList {
    pub agents: Vec<AgentInfo>,
    /// The agent a session without `agent` gets.
    pub default: String,
}

/// List the agents sessions may use, and the default.
#[utoipa::path(
    get, path = "/v1/agents", tag = "agents", security(("bearer" = [])),
    responses((status = 200, body = AgentList), (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody))
)]
async fn list_agents(State(state): State<ApiState>, Viewer(_caller): Viewer) -> Result<Json<AgentList>, ApiError> {
    Ok(Json(AgentList {
        agents: state
            .agents
            .known
            .iter()
            .map(|id| {
                let needs = state.agents.needs(id);
                AgentInfo {
                    id: id.clone(),
                    installed: needs.is_none(),
                    needs,
                }
            })
            .collect(),
        default: state.agents.default.clone(),
    }))
}
