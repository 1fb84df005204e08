//! The forge-connection endpoints (DESIGN §4): an admin sets, lists and removes the token (or the GitHub
//! App, by its private key) the workspace reaches a forge with (`repo` URLs on that host). Secrets are
//! sealed by the
//! [`sortie_store::KeyRing`] before the store sees them; the gateway and the worker's mirror fetch
//! are the only users of the plaintext, and no answer or log line ever carries it.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sortie_protocol::api::{
    ForgeConnection, ForgeConnectionList, ForgeKind, ForgeTriggers, GITHUB_APP_KEY_MAX_BYTES,
    GITHUB_WEBHOOK_SECRET_BYTES, SetForgeConnectionRequest, check_forge_token, check_github_app_id,
    model_key_fingerprint, rfc3339_from_epoch_ms,
};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::ForgeConnectionRow;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::extract::{Admin, ApiJson, ForgeHostPath};
use crate::{ApiState, Secret, audit};

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(list_forge_connections))
        .routes(routes!(set_forge_connection, delete_forge_connection))
}

/// The longest API base URL taken, in bytes.
const API_BASE_MAX_BYTES: usize = 2048;

/// The REST API base a GitHub host has unless told otherwise.
fn default_api_base(kind: ForgeKind, host: &str) -> String {
    match kind {
        ForgeKind::Github if host == "github.com" => "https://api.github.com".to_owned(),
        ForgeKind::Github => format!("https://{host}/api/v3"),
        ForgeKind::Git => String::new(),
    }
}

/// Set the workspace's token for the forge at `host` (the authority of its repository URLs),
/// replacing any earlier one. The answer shows its fingerprint, never the token.
#[utoipa::path(
    put, path = "/v1/forge-connections/{host}", tag = "forge-connections",
    params(("host" = String, Path, description = "host or host:port, e.g. github.com")),
    request_body = SetForgeConnectionRequest, security(("bearer" = [])),
    responses(
        (status = 200, description = "Set (the token sealed at rest)", body = ForgeConnection),
        (status = 400, description = "FORGE_CONNECTION_INVALID, INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 413, description = "BODY_TOO_LARGE", body = ApiErrorBody),
        (status = 415, description = "UNSUPPORTED_MEDIA_TYPE", body = ApiErrorBody),
    )
)]
async fn set_forge_connection(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ForgeHostPath(host): ForgeHostPath,
    ApiJson(request): ApiJson<SetForgeConnectionRequest>,
) -> Result<Json<ForgeConnection>, ApiError> {
    let kind = request.kind.unwrap_or_default();
    let webhook_secret = request.github_app.as_ref().and_then(|app| app.webhook_secret.clone());
    if let Some(secret) = &webhook_secret
        && (!GITHUB_WEBHOOK_SECRET_BYTES.contains(&secret.len()) || secret.bytes().any(|b| !(0x20..0x7f).contains(&b)))
    {
        return Err(ApiError::new(
            ErrorCode::ForgeConnectionInvalid,
            format!(
                "github_app.webhook_secret must be {} to {} printable ASCII characters",
                GITHUB_WEBHOOK_SECRET_BYTES.start(),
                GITHUB_WEBHOOK_SECRET_BYTES.end()
            ),
        ));
    }
    if webhook_secret.is_some() {
        let app_id = request
            .github_app
            .as_ref()
            .map(|app| app.app_id.as_str())
            .unwrap_or_default();
        if !app_id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ApiError::new(
                ErrorCode::ForgeConnectionInvalid,
                "a webhook secret needs the App's numeric App ID as github_app.app_id (GitHub names the App \
                 by it in each delivery), not its client ID",
            ));
        }
        // One GitHub App has one webhook: one connection of the instance takes its deliveries.
        let taken = state
            .store
            .app_connections(app_id)
            .await?
            .into_iter()
            .any(|other| other.workspace_id != caller.workspace_id || other.host != host);
        if taken {
            return Err(ApiError::new(
                ErrorCode::ForgeConnectionInvalid,
                format!(
                    "GitHub App {app_id} already delivers its webhooks to another connection of this server; \
                     remove its webhook secret there first"
                ),
            ));
        }
    }
    if let Some(triggers) = &request.triggers {
        if request.github_app.is_none() {
            return Err(ApiError::new(
                ErrorCode::ForgeConnectionInvalid,
                "triggers need a github_app connection (comments reach sortie through the App's webhook)",
            ));
        }
        check_triggers(&state, triggers)?;
    }
    // A token, or a GitHub App's key: the secret sealed either way.
    let (secret, app_id) = match &request.github_app {
        Some(app) => {
            if !request.token.is_empty() || kind != ForgeKind::Github {
                return Err(ApiError::new(
                    ErrorCode::ForgeConnectionInvalid,
                    "give either token or github_app, and github_app only for kind github",
                ));
            }
            check_github_app_id(&app.app_id)?;
            if app.private_key.len() > GITHUB_APP_KEY_MAX_BYTES {
                return Err(ApiError::new(
                    ErrorCode::ForgeConnectionInvalid,
                    format!("github_app.private_key is larger than {GITHUB_APP_KEY_MAX_BYTES} bytes"),
                ));
            }
            // Refused now, not at the first session: a key that cannot sign.
            if let Err(error) = sortie_github::app::AppKey::from_pem(app.private_key.as_bytes()) {
                return Err(ApiError::new(
                    ErrorCode::ForgeConnectionInvalid,
                    format!("github_app.private_key: {error}"),
                ));
            }
            (
                Secret::new(app.private_key.clone().into_bytes()),
                Some(app.app_id.clone()),
            )
        }
        None => {
            check_forge_token(&request.token)?;
            (Secret::new(request.token.into_bytes()), None)
        }
    };
    let api_base = match request.api_base.filter(|base| !base.trim().is_empty()) {
        Some(base) => {
            if base.len() > API_BASE_MAX_BYTES
                || !base.starts_with("https://")
                || base.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(ApiError::new(
                    ErrorCode::ForgeConnectionInvalid,
                    "api_base must be an https:// URL without spaces",
                ));
            }
            base.trim_end_matches('/').to_owned()
        }
        None => default_api_base(kind, &host),
    };
    let sealed = state
        .keyring
        .seal_forge_token(&caller.workspace_id, &host, secret.expose())?;
    let sealed_webhook = match &webhook_secret {
        Some(webhook) => Some(state.keyring.seal_webhook_secret(
            &caller.workspace_id,
            &webhook_secret_binding(&host),
            webhook.as_bytes(),
        )?),
        None => None,
    };
    // Kept with the agent named: the default is this server's at the time it was set.
    let triggers = request.triggers.clone().map(|mut triggers| {
        triggers.agent.get_or_insert_with(|| state.agents.default.clone());
        serde_json::to_string(&triggers).unwrap_or_default()
    });
    let row = state
        .store
        .put_forge_connection(
            &caller.workspace_id,
            &host,
            kind,
            &api_base,
            &sealed.ciphertext,
            &sealed.nonce,
            app_id.as_deref(),
        )
        .await?;
    state
        .store
        .set_forge_triggers(
            &caller.workspace_id,
            &host,
            sealed_webhook
                .as_ref()
                .map(|s| (s.ciphertext.as_str(), s.nonce.as_str())),
            triggers.as_deref(),
        )
        .await?;
    let row = sortie_store::ForgeConnectionRow {
        webhook_secret: sealed_webhook.map(|s| (s.ciphertext, s.nonce)),
        triggers,
        ..row
    };
    tracing::info!(workspace = %caller.workspace_name, host = %host, token = %caller.token_id, app = app_id.is_some(), "forge connection set");
    audit::record(&state, &caller, "forge.set", &host).await;
    Ok(Json(view(&row, Some(fingerprint(&row, secret.expose())))))
}

/// The workspace's forge connections: host, kind, API base, when set and fingerprint, never the token.
#[utoipa::path(
    get, path = "/v1/forge-connections", tag = "forge-connections", security(("bearer" = [])),
    responses(
        (status = 200, body = ForgeConnectionList),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn list_forge_connections(
    State(state): State<ApiState>,
    Admin(caller): Admin,
) -> Result<Json<ForgeConnectionList>, ApiError> {
    let rows = state.store.forge_connections(&caller.workspace_id).await?;
    let connections = rows
        .iter()
        .map(|row| {
            let fingerprint = match state.keyring.open_forge_token(
                &caller.workspace_id,
                &row.host,
                &row.token_ciphertext,
                &row.token_nonce,
            ) {
                Ok(token) => Some(fingerprint(row, token.expose())),
                Err(error) => {
                    tracing::warn!(workspace = %caller.workspace_name, host = %row.host, %error, "a stored forge token does not open");
                    None
                }
            };
            view(row, fingerprint)
        })
        .collect();
    Ok(Json(ForgeConnectionList {
        workspace: caller.workspace_name,
        connections,
    }))
}

/// Forget the workspace's connection to the forge at `host`.
#[utoipa::path(
    delete, path = "/v1/forge-connections/{host}", tag = "forge-connections",
    params(("host" = String, Path, description = "host or host:port")),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "FORGE_CONNECTION_INVALID", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "FORGE_CONNECTION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn delete_forge_connection(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ForgeHostPath(host): ForgeHostPath,
) -> Result<StatusCode, ApiError> {
    if state.store.delete_forge_connection(&caller.workspace_id, &host).await? {
        tracing::info!(workspace = %caller.workspace_name, host = %host, token = %caller.token_id, "forge connection removed");
        audit::record(&state, &caller, "forge.remove", &host).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            ErrorCode::ForgeConnectionNotFound,
            format!("the workspace has no connection to {host}"),
        ))
    }
}

fn view(row: &ForgeConnectionRow, fingerprint: Option<String>) -> ForgeConnection {
    ForgeConnection {
        host: row.host.clone(),
        kind: row.kind,
        api_base: row.api_base.clone(),
        created_at: rfc3339_from_epoch_ms(row.created_at),
        fingerprint,
        app_id: row.app_id.clone(),
        webhook: row.webhook_secret.is_some(),
        triggers: row.triggers.as_deref().and_then(|json| serde_json::from_str(json).ok()),
    }
}

/// What a connection's webhook secret is sealed to (beside its workspace): its host, so a secret
/// copied to another connection's row does not open.
pub(crate) fn webhook_secret_binding(host: &str) -> String {
    format!("forge:{host}")
}

/// The triggers' sessions are checked as a session's would be when it is asked for.
fn check_triggers(state: &ApiState, triggers: &ForgeTriggers) -> Result<(), ApiError> {
    triggers.check()?;
    if let Some(agent) = &triggers.agent
        && !state.agents.known.contains(agent)
    {
        return Err(ApiError::new(
            ErrorCode::AgentUnknown,
            format!(
                "triggers.agent: no agent profile {agent:?}; known: {}",
                state.agents.known.join(", ")
            ),
        ));
    }
    if let Some(model) = &triggers.model {
        sortie_protocol::validate::check_model(model)?;
    }
    if let Some(setup) = &triggers.setup {
        sortie_protocol::validate::check_setup(setup)?;
    }
    crate::sessions::check_allowlist("triggers.egress_allow", &triggers.egress_allow)
}

/// A token's last characters; for an App's PEM key, those of its key material (not the armour).
fn fingerprint(row: &ForgeConnectionRow, secret: &[u8]) -> String {
    if row.app_id.is_none() {
        return model_key_fingerprint(secret);
    }
    let material: Vec<u8> = String::from_utf8_lossy(secret)
        .lines()
        .filter(|line| !line.starts_with("-----"))
        .flat_map(|line| line.trim().bytes())
        .collect();
    model_key_fingerprint(&material)
}
