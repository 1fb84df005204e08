//! The workspace settings an admin keeps beside model keys and forge connections: its tokens (list,
//! create — the secret shown once — and revoke) and per-repository presets the dashboard's composer
//! fills a new session with (egress allowlist, setup script, agent). Operators and viewers may read the
//! presets; only an admin changes anything.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::Deserialize;
use sortie_protocol::api::{
    CreateTokenRequest, CreatedToken, RepoPreset, RepoPresetList, SetRepoPresetRequest, TOKEN_EXPIRY_MAX_SECONDS,
    TokenInfo, TokenList, check_model_key_label, rfc3339_from_epoch_ms,
};
use sortie_protocol::validate::{self, RepoLocation};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::{PresetRow, TokenRow, now_ms};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::extract::{Admin, ApiJson, ApiQuery, Viewer};
use crate::tokens::generate_token;
use crate::{ApiState, audit};

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(list_tokens, create_token))
        .routes(routes!(revoke_token))
        .routes(routes!(list_presets, put_preset, delete_preset))
}

fn token_view(row: &TokenRow, caller_token: &str) -> TokenInfo {
    TokenInfo {
        id: row.id.clone(),
        role: row.role,
        label: row.label.clone(),
        created_at: rfc3339_from_epoch_ms(row.created_at),
        revoked_at: row.revoked_at.map(rfc3339_from_epoch_ms),
        expires_at: row.expires_at.map(rfc3339_from_epoch_ms),
        last_used_at: row.last_used_at.map(rfc3339_from_epoch_ms),
        current: row.id == caller_token,
    }
}

/// The workspace's tokens, newest first, revoked ones too: role, label and dates, never a secret.
#[utoipa::path(
    get, path = "/v1/tokens", tag = "tokens", security(("bearer" = [])),
    responses(
        (status = 200, body = TokenList),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn list_tokens(State(state): State<ApiState>, Admin(caller): Admin) -> Result<Json<TokenList>, ApiError> {
    let rows = state.store.tokens(Some(&caller.workspace_id)).await?;
    Ok(Json(TokenList {
        tokens: rows.iter().map(|row| token_view(row, &caller.token_id)).collect(),
    }))
}

/// Create a token of the workspace. Its secret is in this answer only: the store keeps its hash.
#[utoipa::path(
    post, path = "/v1/tokens", tag = "tokens", request_body = CreateTokenRequest, security(("bearer" = [])),
    responses(
        (status = 201, body = CreatedToken),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn create_token(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiJson(request): ApiJson<CreateTokenRequest>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    let label = request.label.filter(|label| !label.trim().is_empty());
    if let Some(label) = &label {
        check_model_key_label(label)?;
    }
    let now = now_ms();
    let expires_at = match request.expires_in_seconds {
        None => None,
        Some(seconds @ 60..=TOKEN_EXPIRY_MAX_SECONDS) => Some(now + i64::try_from(seconds * 1000).unwrap_or(i64::MAX)),
        Some(_) => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "expires_in_seconds must be between 60 and ten years",
            ));
        }
    };
    let (token, hash) = generate_token().map_err(|error| {
        tracing::error!(%error, "no randomness for a token");
        ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
    })?;
    let id = state
        .store
        .create_token(&caller.workspace_id, request.role, &hash, label.as_deref(), expires_at)
        .await?;
    tracing::info!(workspace = %caller.workspace_name, token = %id, role = %request.role.as_str(), by = %caller.token_id, "token created");
    audit::record(&state, &caller, "token.create", &id).await;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            token,
            info: TokenInfo {
                id,
                role: request.role,
                label,
                created_at: rfc3339_from_epoch_ms(now),
                revoked_at: None,
                expires_at: expires_at.map(rfc3339_from_epoch_ms),
                last_used_at: None,
                current: false,
            },
        }),
    ))
}

/// Revoke a token: from now on it signs nothing in (a dashboard cookie made from it stops working too).
/// The token making the request cannot revoke itself.
#[utoipa::path(
    delete, path = "/v1/tokens/{id}", tag = "tokens",
    params(("id" = String, Path, description = "Token id")), security(("bearer" = [])),
    responses(
        (status = 204, description = "Revoked"),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "TOKEN_NOT_FOUND", body = ApiErrorBody),
        (status = 409, description = "TOKEN_IN_USE", body = ApiErrorBody),
    )
)]
async fn revoke_token(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if id == caller.token_id {
        return Err(ApiError::new(
            ErrorCode::TokenInUse,
            "this is the token making the request: revoke it with another admin token",
        ));
    }
    if state.store.revoke_token(&caller.workspace_id, &id).await? {
        tracing::info!(workspace = %caller.workspace_name, token = %id, by = %caller.token_id, "token revoked");
        audit::record(&state, &caller, "token.revoke", &id).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            ErrorCode::TokenNotFound,
            "the workspace has no live token with this id",
        ))
    }
}

fn preset_view(row: PresetRow) -> RepoPreset {
    RepoPreset {
        repo: row.repo,
        agent: row.agent,
        setup: row.setup,
        egress_allow: row.egress_allow,
        updated_at: rfc3339_from_epoch_ms(row.updated_at),
    }
}

/// The workspace's repository presets: what the composer fills in for each repository.
#[utoipa::path(
    get, path = "/v1/presets", tag = "presets", security(("bearer" = [])),
    responses((status = 200, body = RepoPresetList), (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody))
)]
async fn list_presets(State(state): State<ApiState>, Viewer(caller): Viewer) -> Result<Json<RepoPresetList>, ApiError> {
    let rows = state.store.presets(&caller.workspace_id).await?;
    Ok(Json(RepoPresetList {
        presets: rows.into_iter().map(preset_view).collect(),
    }))
}

/// Set (or replace) a repository's preset. Each field is checked as a session's would be.
#[utoipa::path(
    put, path = "/v1/presets", tag = "presets", request_body = SetRepoPresetRequest, security(("bearer" = [])),
    responses(
        (status = 200, body = RepoPreset),
        (status = 400, description = "INVALID_REQUEST, REPO_INVALID, AGENT_UNKNOWN, EGRESS_ALLOWLIST_INVALID", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 413, description = "SETUP_TOO_LARGE", body = ApiErrorBody),
    )
)]
async fn put_preset(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiJson(request): ApiJson<SetRepoPresetRequest>,
) -> Result<Json<RepoPreset>, ApiError> {
    let repo = match validate::check_repo(&request.repo)? {
        RepoLocation::Https(url) => url,
        RepoLocation::LocalPath(path) => path,
    };
    let agent = request.agent.filter(|agent| !agent.trim().is_empty());
    if let Some(agent) = &agent
        && !state.agents.known.contains(agent)
    {
        return Err(ApiError::new(
            ErrorCode::AgentUnknown,
            format!("no agent profile {agent:?}; known: {}", state.agents.known.join(", ")),
        ));
    }
    let setup = request.setup.filter(|setup| !setup.trim().is_empty());
    if let Some(setup) = &setup {
        validate::check_setup(setup)?;
    }
    crate::sessions::check_allowlist("egress_allow", &request.egress_allow)?;
    let row = PresetRow {
        repo,
        agent,
        setup,
        egress_allow: request.egress_allow,
        updated_at: now_ms(),
    };
    state.store.put_preset(&caller.workspace_id, &row).await?;
    Ok(Json(preset_view(row)))
}

/// The query of `DELETE /v1/presets`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct PresetQuery {
    /// The repository whose preset goes.
    repo: String,
}

/// Remove a repository's preset.
#[utoipa::path(
    delete, path = "/v1/presets", tag = "presets", params(PresetQuery), security(("bearer" = [])),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "PRESET_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn delete_preset(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiQuery(query): ApiQuery<PresetQuery>,
) -> Result<StatusCode, ApiError> {
    if state.store.delete_preset(&caller.workspace_id, &query.repo).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            ErrorCode::PresetNotFound,
            "the workspace has no preset for this repository",
        ))
    }
}
