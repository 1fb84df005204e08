//! Sign-in for the dashboard: `sortie serve` issues a one-time code bound to a token; the page trades
//! it (`POST /v1/auth/signin`) for an HttpOnly, SameSite=Strict session cookie. The cookie stands for
//! that token on the control plane only, and only on requests that also carry [`CSRF_HEADER`] (a
//! cross-site form or link cannot set a custom header). The stream endpoints take tickets only.
//!
//! Codes and cookie sessions live in memory, with expiry: a restart signs every browser out. A cookie
//! resolves to its token on every request, so revoking the token ends the cookie too.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::header::SET_COOKIE;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sortie_protocol::api::SignInLink;
use sortie_protocol::{ApiErrorBody, ErrorCode};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::tokens::{hash_token, random_text};

/// The cookie that carries a dashboard session.
pub const COOKIE: &str = "sortie_session";
/// The header a cookie-authenticated request must carry (any non-empty value).
pub const CSRF_HEADER: &str = "x-sortie-csrf";
/// How long a sign-in code works, once.
pub const CODE_TTL: Duration = Duration::from_secs(15 * 60);
/// How long a cookie session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 60 * 60);

/// One-time codes and cookie sessions, each mapped to the SHA-256 of the token it stands for.
#[derive(Default)]
pub struct SignIns {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// sha256(code) → (token hash, expiry)
    codes: HashMap<String, (String, Instant)>,
    /// sha256(cookie) → (token hash, expiry)
    sessions: HashMap<String, (String, Instant)>,
}

impl SignIns {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A fresh one-time code that signs a browser in as the token whose hash is `token_hash`.
    pub fn issue_code(&self, token_hash: &str) -> Result<String, getrandom::Error> {
        self.issue_code_for(token_hash, CODE_TTL)
    }

    pub fn issue_code_for(&self, token_hash: &str, ttl: Duration) -> Result<String, getrandom::Error> {
        let code = random_text(24)?;
        let now = Instant::now();
        let mut inner = self.lock();
        inner.codes.retain(|_, (_, expiry)| *expiry > now);
        inner
            .codes
            .insert(hash_token(&code), (token_hash.to_owned(), now + ttl));
        Ok(code)
    }

    /// Uses up `code`: its token hash if it was issued, unused and unexpired.
    fn redeem(&self, code: &str) -> Option<String> {
        let (token_hash, expiry) = self.lock().codes.remove(&hash_token(code))?;
        (expiry > Instant::now()).then_some(token_hash)
    }

    fn open_session(&self, token_hash: String) -> Result<String, getrandom::Error> {
        let cookie = random_text(32)?;
        let now = Instant::now();
        let mut inner = self.lock();
        inner.sessions.retain(|_, (_, expiry)| *expiry > now);
        inner
            .sessions
            .insert(hash_token(&cookie), (token_hash, now + SESSION_TTL));
        Ok(cookie)
    }

    /// The token hash a live cookie stands for.
    pub(crate) fn session(&self, cookie: &str) -> Option<String> {
        let inner = self.lock();
        let (token_hash, expiry) = inner.sessions.get(&hash_token(cookie))?;
        (*expiry > Instant::now()).then(|| token_hash.clone())
    }

    fn close_session(&self, cookie: &str) {
        self.lock().sessions.remove(&hash_token(cookie));
    }
}

/// The value of cookie `name` in the request's Cookie headers.
pub(crate) fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

pub(crate) fn has_csrf_header(headers: &HeaderMap) -> bool {
    headers
        .get(CSRF_HEADER)
        .is_some_and(|value| !value.as_bytes().is_empty())
}

pub(crate) fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(signin))
        .routes(routes!(signout))
        .routes(routes!(signin_link))
}

/// `POST /v1/auth/signin`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignInRequest {
    /// The one-time code of the link `sortie serve` printed (after `#`).
    pub code: String,
}

fn set_cookie(value: &str, max_age: u64) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/v1; HttpOnly; SameSite=Strict; Max-Age={max_age}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("sortie_session=; Path=/v1; Max-Age=0"))
}

/// Trade a one-time sign-in code for a session cookie (HttpOnly, SameSite=Strict, accepted only
/// together with the `X-Sortie-Csrf` header). A code works once.
#[utoipa::path(
    post, path = "/v1/auth/signin", tag = "auth", request_body = SignInRequest,
    responses(
        (status = 204, description = "Signed in; the session cookie is set"),
        (status = 400, body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED: unknown, used or expired code", body = ApiErrorBody),
    )
)]
async fn signin(State(state): State<ApiState>, ApiJson(request): ApiJson<SignInRequest>) -> Result<Response, ApiError> {
    let refused = || ApiError::new(ErrorCode::Unauthorized, "this sign-in code is unknown, used or expired");
    let token_hash = state.signins.redeem(request.code.trim()).ok_or_else(refused)?;
    // The token may have been revoked since the code was issued.
    live_token(&state, &token_hash, refused).await?;
    let cookie = state.signins.open_session(token_hash).map_err(|error| {
        tracing::error!(%error, "no randomness for a session cookie");
        ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
    })?;
    let mut response = StatusCode::NO_CONTENT.into_response();
    response
        .headers_mut()
        .insert(SET_COOKIE, set_cookie(&cookie, SESSION_TTL.as_secs()));
    Ok(response)
}

/// A fresh one-time sign-in code that signs a browser in as the caller's token (what `sortie
/// signin-link` prints). Only a bearer token may ask: a browser's cookie cannot mint codes for other
/// browsers. Codes live in the memory of the server that issued them.
#[utoipa::path(
    post, path = "/v1/auth/links", tag = "auth", security(("bearer" = [])),
    responses(
        (status = 201, body = SignInLink),
        (status = 401, description = "UNAUTHORIZED: no bearer token, or one the server does not know", body = ApiErrorBody),
    )
)]
async fn signin_link(State(state): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let refused = || {
        ApiError::new(
            ErrorCode::Unauthorized,
            "a sign-in link is made for a bearer token: send `Authorization: Bearer <token>`",
        )
    };
    let token = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .ok_or_else(refused)?;
    let token_hash = hash_token(token);
    live_token(&state, &token_hash, refused).await?;
    let code = state.signins.issue_code(&token_hash).map_err(|error| {
        tracing::error!(%error, "no randomness for a sign-in code");
        ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
    })?;
    Ok((
        StatusCode::CREATED,
        Json(SignInLink {
            code,
            expires_in_seconds: CODE_TTL.as_secs(),
        }),
    )
        .into_response())
}

/// Whether the token whose hash is `token_hash` is one the store knows and has not revoked (`refused`
/// otherwise).
async fn live_token(state: &ApiState, token_hash: &str, refused: impl Fn() -> ApiError) -> Result<(), ApiError> {
    match state.store.principal_by_token_hash(token_hash).await {
        Ok(_) => Ok(()),
        Err(sortie_store::StoreError::NotFound) => Err(refused()),
        Err(other) => Err(other.into()),
    }
}

/// End the browser's session: the cookie stops working and is cleared.
#[utoipa::path(
    post, path = "/v1/auth/signout", tag = "auth",
    responses((status = 204, description = "Signed out"))
)]
async fn signout(State(state): State<ApiState>, headers: HeaderMap) -> Response {
    if let Some(value) = cookie(&headers, COOKIE) {
        state.signins.close_session(value);
    }
    let mut response = (StatusCode::NO_CONTENT, Json(())).into_response();
    *response.body_mut() = axum::body::Body::empty();
    response.headers_mut().insert(SET_COOKIE, set_cookie("", 0));
    response
}
