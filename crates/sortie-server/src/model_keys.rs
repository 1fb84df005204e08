//! The model-key endpoints (DESIGN §4, §7.4): an admin sets, lists and removes the workspace's vendor
//! keys for the model proxy. Keys are sealed by the [`sortie_store::KeyRing`] before the store sees them.
//!
//! No answer ever carries a key, only its fingerprint; a key is never logged (it is a [`Secret`] from
//! the moment it is checked).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sortie_protocol::api::{
    ModelApi, ModelKey, ModelKeyList, SetModelKeyRequest, check_model_key, check_model_key_label,
    model_key_fingerprint, rfc3339_from_epoch_ms,
};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::ModelKeyRow;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::extract::{Admin, ApiJson, ModelApiPath};
use crate::{ApiState, Secret, audit};

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(list_model_keys))
        .routes(routes!(set_model_key, delete_model_key))
}

/// Set the workspace's key for one model API, replacing any earlier one. The answer shows its
/// fingerprint, never the key.
#[utoipa::path(
    put, path = "/v1/model-keys/{api}", tag = "model-keys",
    params(("api" = ModelApi, Path, description = "The model API: anthropic, openai or gemini")),
    request_body = SetModelKeyRequest, security(("bearer" = [])),
    responses(
        (status = 200, description = "Set (sealed at rest)", body = ModelKey),
        (status = 400, description = "MODEL_KEY_INVALID, INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "MODEL_API_UNKNOWN", body = ApiErrorBody),
        (status = 413, description = "BODY_TOO_LARGE", body = ApiErrorBody),
        (status = 415, description = "UNSUPPORTED_MEDIA_TYPE", body = ApiErrorBody),
    )
)]
async fn set_model_key(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ModelApiPath(api): ModelApiPath,
    ApiJson(request): ApiJson<SetModelKeyRequest>,
) -> Result<Json<ModelKey>, ApiError> {
    check_model_key(&request.key)?;
    let label = request.label.filter(|label| !label.trim().is_empty());
    if let Some(label) = &label {
        check_model_key_label(label)?;
    }
    let key = Secret::new(request.key.into_bytes());
    let sealed = state.keyring.seal(&caller.workspace_id, api, key.expose())?;
    let row = state
        .store
        .put_model_key(
            &caller.workspace_id,
            api,
            &sealed.ciphertext,
            &sealed.nonce,
            label.as_deref(),
        )
        .await?;
    tracing::info!(workspace = %caller.workspace_name, api = %api, token = %caller.token_id, "model key set");
    audit::record(&state, &caller, "model_key.set", api.as_str()).await;
    Ok(Json(view(&row, Some(model_key_fingerprint(key.expose())))))
}

/// The workspace's model keys, one per API that has one: label, when set and fingerprint, never the key.
#[utoipa::path(
    get, path = "/v1/model-keys", tag = "model-keys", security(("bearer" = [])),
    responses(
        (status = 200, body = ModelKeyList),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn list_model_keys(State(state): State<ApiState>, Admin(caller): Admin) -> Result<Json<ModelKeyList>, ApiError> {
    let rows = state.store.model_keys(&caller.workspace_id).await?;
    let keys = rows
        .iter()
        .map(|row| {
            let fingerprint = match state
                .keyring
                .open(&caller.workspace_id, row.api, &row.key_ciphertext, &row.key_nonce)
            {
                Ok(key) => Some(model_key_fingerprint(key.expose())),
                Err(error) => {
                    tracing::warn!(workspace = %caller.workspace_name, api = %row.api, %error, "a stored model key does not open");
                    None
                }
            };
            view(row, fingerprint)
        })
        .collect();
    Ok(Json(ModelKeyList {
        workspace: caller.workspace_name,
        keys,
    }))
}

/// Forget the workspace's key for one model API.
#[utoipa::path(
    delete, path = "/v1/model-keys/{api}", tag = "model-keys",
    params(("api" = ModelApi, Path, description = "The model API: anthropic, openai or gemini")),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Removed"),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
        (status = 404, description = "MODEL_API_UNKNOWN, MODEL_KEY_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn delete_model_key(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ModelApiPath(api): ModelApiPath,
) -> Result<StatusCode, ApiError> {
    if state.store.delete_model_key(&caller.workspace_id, api).await? {
        tracing::info!(workspace = %caller.workspace_name, api = %api, token = %caller.token_id, "model key removed");
        audit::record(&state, &caller, "model_key.remove", api.as_str()).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            ErrorCode::ModelKeyNotFound,
            format!("the workspace has no {api} key"),
        ))
    }
}

fn view(row: &ModelKeyRow, fingerprint: Option<String>) -> ModelKey {
    ModelKey {
        api: row.api,
        label: row.label.clone(),
        created_at: rfc3339_from_epoch_ms(row.created_at),
        fingerprint,
    }
}
