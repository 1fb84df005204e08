//! Extractors that turn every malformed input into an [`ApiError`] with a stable code: the caller's
//! token and role, the session id in the path, JSON bodies and query strings.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use sortie_protocol::api::{ModelApi, Role};
use sortie_protocol::{ErrorCode, SessionId};
use sortie_store::{Principal, StoreError, now_ms};

use crate::ApiState;
use crate::error::ApiError;
use crate::tokens::hash_token;

/// The token hash a request authenticates with: its bearer token, or else the dashboard's session
/// cookie, which counts only together with the CSRF header.
fn token_hash(parts: &Parts, state: &ApiState) -> Result<String, ApiError> {
    let Some(header) = parts.headers.get(AUTHORIZATION) else {
        let Some(cookie) = crate::signin::cookie(&parts.headers, crate::signin::COOKIE) else {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "missing Authorization: Bearer <token>",
            ));
        };
        if !crate::signin::has_csrf_header(&parts.headers) {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "the session cookie counts only with the X-Sortie-Csrf header",
            ));
        }
        return state
            .signins
            .session(cookie)
            .ok_or_else(|| ApiError::new(ErrorCode::Unauthorized, "the session has expired; sign in again"));
    };
    let token = header
        .to_str()
        .ok()
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::Unauthorized,
                "the Authorization header is not `Bearer <token>`",
            )
        })?;
    Ok(hash_token(token))
}

/// When each token's use was last written, so a busy token costs the store one write a minute, not one
/// a request. Holds only tokens that signed in.
static USES_WRITTEN: LazyLock<Mutex<HashMap<String, i64>>> = LazyLock::new(Default::default);
const USE_WRITTEN_EVERY_MS: i64 = 60_000;

/// Notes a token's use in the store, off the request path.
fn note_use(state: &ApiState, token_id: &str) {
    let now = now_ms();
    {
        let mut written = USES_WRITTEN.lock().unwrap_or_else(PoisonError::into_inner);
        if written.get(token_id).is_some_and(|at| now - at < USE_WRITTEN_EVERY_MS) {
            return;
        }
        written.insert(token_id.to_owned(), now);
    }
    let store = state.store.clone();
    let token_id = token_id.to_owned();
    tokio::spawn(async move {
        if let Err(error) = store.touch_token(&token_id, now).await {
            tracing::debug!(%error, token = %token_id, "cannot note the token's use");
        }
    });
}

/// Authenticates the caller (bearer token or session cookie) and checks that its role is at least `needed`.
async fn authenticate(parts: &Parts, state: &ApiState, needed: Role) -> Result<Principal, ApiError> {
    let hash = token_hash(parts, state)?;
    let principal = match state.store.principal_by_token_hash(&hash).await {
        Ok(principal) => principal,
        Err(StoreError::NotFound) => {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "unknown, revoked or expired token",
            ));
        }
        Err(other) => return Err(other.into()),
    };
    note_use(state, &principal.token_id);
    if principal.role < needed {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "this needs the {} role; the token is {}",
                needed.as_str(),
                principal.role.as_str()
            ),
        ));
    }
    Ok(principal)
}

macro_rules! role_extractor {
    ($(#[$doc:meta])* $name:ident, $role:expr) => {
        $(#[$doc])*
        pub struct $name(pub Principal);

        impl FromRequestParts<ApiState> for $name {
            type Rejection = ApiError;
            async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Self::Rejection> {
                authenticate(parts, state, $role).await.map($name)
            }
        }
    };
}

role_extractor!(
    /// A caller with any role: reads.
    Viewer,
    Role::Viewer
);
role_extractor!(
    /// A caller that may change sessions.
    Operator,
    Role::Operator
);
role_extractor!(
    /// A caller that manages the workspace: tokens, forge connections, model keys.
    Admin,
    Role::Admin
);

/// The `{api}` of a model-key path: a known model API, else `MODEL_API_UNKNOWN`.
pub struct ModelApiPath(pub ModelApi);

impl FromRequestParts<ApiState> for ModelApiPath {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Self::Rejection> {
        let unknown = |named: &str| {
            let known: Vec<&str> = ModelApi::ALL.iter().map(|api| api.as_str()).collect();
            ApiError::new(
                ErrorCode::ModelApiUnknown,
                format!("no model API {named:?}; known: {}", known.join(", ")),
            )
            .with_details(sortie_protocol::error::details::Known {
                known: known.iter().map(|api| (*api).to_owned()).collect(),
            })
        };
        let Path(api) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| unknown(""))?;
        api.parse()
            .map(ModelApiPath)
            .map_err(|_| unknown(&api.chars().take(64).collect::<String>()))
    }
}

/// The `{host}` of a forge-connection path, lowercased; anything but `host[:port]` is
/// `FORGE_CONNECTION_INVALID`.
pub struct ForgeHostPath(pub String);

impl FromRequestParts<ApiState> for ForgeHostPath {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Self::Rejection> {
        let Path(host) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::new(ErrorCode::ForgeConnectionInvalid, "the path names no forge host"))?;
        Ok(ForgeHostPath(sortie_protocol::api::check_forge_host(&host)?))
    }
}

/// The `{id}` of a session path. A malformed id cannot name a session, so it is `SESSION_NOT_FOUND`.
pub struct SessionPath(pub SessionId);

impl FromRequestParts<ApiState> for SessionPath {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::session_not_found())?;
        SessionId::parse(&id)
            .map(SessionPath)
            .map_err(|_| ApiError::session_not_found())
    }
}

/// A query string parsed into `T`; anything unknown or malformed is `INVALID_REQUEST`.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<ApiState> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, _state: &ApiState) -> Result<Self, Self::Rejection> {
        Query::<T>::try_from_uri(&parts.uri)
            .map(|Query(value)| ApiQuery(value))
            .map_err(|rejection| ApiError::invalid(rejection.body_text()))
    }
}

/// A JSON body: `application/json`, within the size cap, valid UTF-8, no unknown fields.
pub struct ApiJson<T>(pub T);

/// A JSON body that may also be left out entirely (then `T::default()`), for actions without input.
pub struct OptionalJson<T>(pub T);

async fn read_body(request: Request, state: &ApiState) -> Result<Bytes, ApiError> {
    Bytes::from_request(request, state).await.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorCode::BodyTooLarge,
                format!(
                    "the request body is over {} bytes",
                    sortie_protocol::limits::REQUEST_BODY_MAX_BYTES
                ),
            )
        } else {
            ApiError::invalid(format!("the request body could not be read: {}", rejection.body_text()))
        }
    })
}

fn require_json_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let is_json = headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"));
    if is_json {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            "send the body as Content-Type: application/json",
        ))
    }
}

fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // serde would also build a struct from a JSON array; every body of this API is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|error| ApiError::invalid(format!("the request body is not valid: {error}")))
}

impl<T: DeserializeOwned> FromRequest<ApiState> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(request: Request, state: &ApiState) -> Result<Self, Self::Rejection> {
        require_json_content_type(request.headers())?;
        let bytes = read_body(request, state).await?;
        parse_json(&bytes).map(ApiJson)
    }
}

impl<T: DeserializeOwned + Default> FromRequest<ApiState> for OptionalJson<T> {
    type Rejection = ApiError;
    async fn from_request(request: Request, state: &ApiState) -> Result<Self, Self::Rejection> {
        let headers = request.headers().clone();
        let bytes = read_body(request, state).await?;
        if bytes.is_empty() {
            return Ok(OptionalJson(T::default()));
        }
        require_json_content_type(&headers)?;
        parse_json(&bytes).map(OptionalJson)
    }
}

/// The body of actions that take no input: `{}` or nothing.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoInput {}
