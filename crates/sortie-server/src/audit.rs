//! The audit log of admin actions (`GET /v1/audit`): who changed tokens, model keys, forge connections
//! and webhooks, and when. Handlers record after the action succeeded; a store that fails to record
//! loses the entry, never the action, and says so in the log at error level.

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use sortie_protocol::api::{AuditEntry as AuditEntryView, AuditLog, rfc3339_from_epoch_ms};
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::{AuditEntry, Principal};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::extract::{Admin, ApiQuery};

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new().routes(routes!(audit_log))
}

/// Records that `caller` did `action` to `target`.
pub(crate) async fn record(state: &ApiState, caller: &Principal, action: &str, target: &str) {
    let entry = AuditEntry {
        workspace_id: caller.workspace_id.clone(),
        actor: caller.token_id.clone(),
        action: action.to_owned(),
        target: target.to_owned(),
    };
    if let Err(error) = state.store.record_audit(&entry).await {
        tracing::error!(%error, workspace = %caller.workspace_name, action, target, by = %caller.token_id, "the audit log lost an entry");
    }
}

const PAGE_DEFAULT: u32 = 100;
const PAGE_MAX: u32 = 500;

/// The query of `GET /v1/audit`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct AuditQuery {
    /// Entries older than this cursor (a page's `next_cursor`).
    before: Option<String>,
    /// At most this many (1–500, default 100).
    limit: Option<u32>,
}

/// What the workspace's admins did, newest first.
#[utoipa::path(
    get, path = "/v1/audit", tag = "tokens", params(AuditQuery), security(("bearer" = [])),
    responses(
        (status = 200, body = AuditLog),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn audit_log(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiQuery(query): ApiQuery<AuditQuery>,
) -> Result<Json<AuditLog>, ApiError> {
    let limit = query.limit.unwrap_or(PAGE_DEFAULT);
    if !(1..=PAGE_MAX).contains(&limit) {
        return Err(ApiError::new(ErrorCode::InvalidRequest, "limit must be 1 to 500"));
    }
    let before = match query.before.as_deref() {
        None => None,
        Some(cursor) => Some(
            cursor
                .parse::<i64>()
                .ok()
                .filter(|id| *id > 0)
                .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "before is not a cursor of this log"))?,
        ),
    };
    let rows = state.store.audit_log(&caller.workspace_id, before, limit + 1).await?;
    let more = rows.len() > limit as usize;
    let entries: Vec<AuditEntryView> = rows
        .into_iter()
        .take(limit as usize)
        .map(|row| AuditEntryView {
            id: row.id.to_string(),
            at: rfc3339_from_epoch_ms(row.at),
            actor: row.actor,
            action: row.action,
            target: row.target,
        })
        .collect();
    let next_cursor = if more {
        entries.last().map(|entry| entry.id.clone())
    } else {
        None
    };
    Ok(Json(AuditLog { entries, next_cursor }))
}
