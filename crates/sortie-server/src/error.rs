//! [`ApiError`]: the one error type handlers return. Clients get a stable code and a safe sentence;
//! the log gets the detail of faults.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sortie_protocol::validate::Refusal;
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::{KeyError, StoreError};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub details: serde_json::Value,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            details: sortie_protocol::error::details::none(),
        }
    }

    /// Details from one of `sortie_protocol::error::details`' types.
    pub fn with_details(mut self, details: impl serde::Serialize) -> Self {
        // The details types are plain structs of strings and numbers: encoding cannot fail.
        self.details = serde_json::to_value(details).unwrap_or_else(|_| sortie_protocol::error::details::none());
        self
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn session_not_found() -> Self {
        Self::new(ErrorCode::SessionNotFound, "no session with this id in your workspace")
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        Self::new(refusal.code, refusal.message)
    }
}

/// A keyring fault (no randomness, a cipher refusal): logged, answered `INTERNAL`. It carries no
/// key or token; a store failure underneath keeps its own answer.
impl From<KeyError> for ApiError {
    fn from(error: KeyError) -> Self {
        match error {
            KeyError::Store(store) => store.into(),
            other => {
                tracing::error!(error = %other, "keyring fault");
                ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
            }
        }
    }
}

impl From<StoreError> for ApiError {
    /// Store errors in the context of one session: `NotFound` is that session.
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound => Self::session_not_found(),
            StoreError::NotSteerable(why) => Self::new(
                ErrorCode::SessionNotSteerable,
                format!("the session is {why}: it takes no more turns"),
            ),
            StoreError::TurnQueueFull(waiting) => Self::new(
                ErrorCode::TurnQueueFull,
                format!(
                    "the session already has {waiting} turns waiting; wait for one to start or use mode \"interrupt\""
                ),
            ),
            StoreError::PromptsTooLarge { would_be, limit } => Self::new(
                ErrorCode::SessionPromptsTooLarge,
                format!(
                    "the session's prompts would add up to {would_be} bytes, over the limit of {limit} bytes (8 MiB); start a new session"
                ),
            ),
            StoreError::NoTurnRunning => Self::new(ErrorCode::NoTurnRunning, "no turn of this session is running"),
            StoreError::QuotaExceeded(breach) => Self::new(ErrorCode::QuotaExceeded, breach.to_string()).with_details(
                sortie_protocol::error::details::QuotaExceeded {
                    quota: breach.quota.to_owned(),
                    limit: breach.limit,
                    used: breach.used,
                },
            ),
            StoreError::SessionActive(phase) => Self::new(
                ErrorCode::SessionActive,
                format!("the session is {phase} with a turn in flight; stop or cancel it first"),
            ),
            StoreError::Unavailable(detail) => {
                tracing::warn!(%detail, "store unavailable");
                Self::new(ErrorCode::StoreUnavailable, "the store did not answer; try again")
            }
            StoreError::Conflict(detail)
            | StoreError::IllegalTransition { from: detail, .. }
            | StoreError::Internal(detail) => {
                tracing::error!(%detail, "store fault");
                Self::new(ErrorCode::Internal, "the server failed; the log has the detail")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (
            status,
            Json(ApiErrorBody::with_details(self.code, self.message, self.details)),
        )
            .into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

pub(crate) async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint; see /v1/openapi.json")
}

pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "this endpoint does not take this method; see /v1/openapi.json",
    )
}
