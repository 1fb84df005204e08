//! Attach (DESIGN §5, §7.1): `GET /v1/sessions/{id}/stream` with a single-use ticket answers the
//! active turn's UI message stream — the stored prefix first, then the driver's live tail after the
//! last stored part (`?after=K`), so there is no gap and no duplicate — and `[DONE]` when the turn
//! ends. No active turn is 204 (useChat's "nothing to resume"); `?turn=N` replays turn N. An idle
//! stream gets a heartbeat comment every 15 s. Cookies are ignored; the ticket is the only credential.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Path as UrlPath, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sortie_protocol::api::TicketAction;
use sortie_protocol::chunk::{SSE_DONE, STREAM_HEADERS, write_sse_event};
use sortie_protocol::{ApiErrorBody, ErrorCode, SessionId, TurnStatus};
use sortie_store::{Store, StoreError, TurnRow};

use crate::tickets;

/// Where the driver of a session listens, while it has one.
pub trait DriverLocator: Send + Sync + 'static {
    fn driver_socket(&self, session_id: &SessionId) -> Option<PathBuf>;
}

#[derive(Clone)]
pub struct AttachState {
    pub store: Arc<dyn Store>,
    pub ticket_secret: Arc<[u8]>,
    pub drivers: Arc<dyn DriverLocator>,
    /// Origins a browser may attach from (CORS).
    pub allowed_origins: Arc<Vec<String>>,
    pub heartbeat: Duration,
}

/// How long a client may leave its buffer full before it is disconnected.
pub const SLOW_CLIENT_LIMIT: Duration = Duration::from_secs(30);

pub fn router(state: AttachState) -> Router {
    Router::new()
        .route("/v1/sessions/{id}/stream", get(attach).post(submit).options(preflight))
        .with_state(state)
}

/// Serves the attach routes on a bound listener until `shutdown` completes.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: AttachState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

fn refuse(code: ErrorCode, message: &str) -> Response {
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, axum::Json(ApiErrorBody::new(code, message))).into_response()
}

fn cors(state: &AttachState, headers: &HeaderMap, response: &mut Response) {
    let origin = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok());
    if let Some(origin) = origin.filter(|o| state.allowed_origins.iter().any(|allowed| allowed == o))
        && let Ok(value) = HeaderValue::from_str(origin)
    {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-vercel-ai-ui-message-stream"),
        );
        h.insert(header::VARY, HeaderValue::from_static("origin"));
    }
}

async fn preflight(State(state): State<AttachState>, headers: HeaderMap) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    cors(&state, &headers, &mut response);
    if response.headers().contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN) {
        let h = response.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
    response
}

#[derive(Debug, Deserialize)]
struct AttachQuery {
    turn: Option<u32>,
}

fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The turn a stream is about: the one asked for, else the oldest one not yet ended.
fn active_turn(turns: &[TurnRow], asked: Option<u32>) -> Option<&TurnRow> {
    match asked {
        Some(n) => turns.iter().find(|t| t.n == n),
        None => turns.iter().find(|t| !t.status.is_terminal()),
    }
}

/// The session a stream request names, and the claims of its ticket for `action`.
async fn admit(
    state: &AttachState,
    id: &str,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    action: TicketAction,
) -> Result<(SessionId, sortie_protocol::ticket::TicketClaims), tickets::TicketRefusal> {
    let session = SessionId::parse(id).map_err(|_| tickets::TicketRefusal {
        code: ErrorCode::SessionNotFound,
        message: "no session with this id".into(),
    })?;
    let claims = tickets::check(
        state.store.as_ref(),
        &state.ticket_secret,
        headers,
        uri,
        &session,
        action,
        now_seconds(),
    )
    .await?;
    Ok((session, claims))
}

async fn attach(
    State(state): State<AttachState>,
    UrlPath(id): UrlPath<String>,
    OriginalUri(uri): OriginalUri,
    Query(query): Query<AttachQuery>,
    headers: HeaderMap,
) -> Response {
    let (session, claims) = match admit(&state, &id, &uri, &headers, TicketAction::Attach).await {
        Ok(admitted) => admitted,
        Err(refusal) => return refuse(refusal.code, &refusal.message),
    };
    let turns = match state.store.turns(&claims.ws, &session).await {
        Ok(turns) => turns,
        Err(StoreError::NotFound) => {
            return refuse(ErrorCode::SessionNotFound, "no session with this id in your workspace");
        }
        Err(_) => return refuse(ErrorCode::StoreUnavailable, "the store did not answer; try again"),
    };
    let asked = query.turn;
    let Some(turn) = active_turn(&turns, asked).cloned() else {
        let mut response = if asked.is_some() {
            refuse(ErrorCode::NotFound, "no such turn")
        } else {
            StatusCode::NO_CONTENT.into_response()
        };
        cors(&state, &headers, &mut response);
        return response;
    };

    turn_stream(&state, &session, &claims.ws, &turn, &headers).await
}

/// The body useChat's `DefaultChatTransport` posts.
#[derive(Debug, Deserialize)]
struct ChatSubmit {
    #[serde(default)]
    messages: Vec<serde_json::Value>,
}

/// The text of the last user message of a useChat submit.
fn last_user_text(messages: &[serde_json::Value]) -> Option<String> {
    let message = messages.iter().rev().find(|m| m["role"] == "user")?;
    let text: Vec<&str> = message["parts"]
        .as_array()?
        .iter()
        .filter(|p| p["type"] == "text")
        .filter_map(|p| p["text"].as_str())
        .collect();
    Some(text.join("\n")).filter(|t| !t.trim().is_empty())
}

/// `POST …/stream` (useChat submit): the last user message becomes a steer, answered with its stream.
async fn submit(
    State(state): State<AttachState>,
    UrlPath(id): UrlPath<String>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (session, claims) = match admit(&state, &id, &uri, &headers, TicketAction::Turn).await {
        Ok(admitted) => admitted,
        Err(refusal) => return refuse(refusal.code, &refusal.message),
    };
    if body.len() > 4 * 1024 * 1024 {
        return refuse(ErrorCode::BodyTooLarge, "the request body is too large");
    }
    let Ok(request) = serde_json::from_slice::<ChatSubmit>(&body) else {
        return refuse(
            ErrorCode::InvalidRequest,
            "the body is not a useChat request ({id, messages, trigger})",
        );
    };
    let Some(prompt) = last_user_text(&request.messages) else {
        return refuse(ErrorCode::InvalidRequest, "no user message with text to send");
    };
    if let Err(refusal) = sortie_protocol::validate::check_prompt("prompt", &prompt) {
        return refuse(refusal.code, &refusal.message);
    }
    let turn = match state
        .store
        .steer(
            &claims.ws,
            &session,
            sortie_store::NewTurn {
                prompt,
                mode: Default::default(),
            },
        )
        .await
    {
        Ok(turn) => turn,
        Err(StoreError::NotFound) => {
            return refuse(ErrorCode::SessionNotFound, "no session with this id in your workspace");
        }
        Err(StoreError::NotSteerable(why)) => {
            return refuse(ErrorCode::SessionNotSteerable, &format!("the session is {why}"));
        }
        Err(StoreError::TurnQueueFull(_)) => {
            return refuse(
                ErrorCode::TurnQueueFull,
                "the session has the most turns waiting it may have",
            );
        }
        Err(StoreError::PromptsTooLarge { .. }) => {
            return refuse(
                ErrorCode::SessionPromptsTooLarge,
                "the session's prompts would pass 8 MiB",
            );
        }
        Err(_) => return refuse(ErrorCode::StoreUnavailable, "the store did not answer; try again"),
    };
    turn_stream(&state, &session, &claims.ws, &turn, &headers).await
}

/// Answers turn `turn`'s stream: its stored parts, then the driver's live tail, then `[DONE]`.
async fn turn_stream(
    state: &AttachState,
    session: &SessionId,
    workspace_id: &str,
    turn: &TurnRow,
    headers: &HeaderMap,
) -> Response {
    let session = session.clone();
    let stored: Vec<(u64, String)> = match state.store.parts(&session).await {
        Ok(parts) => parts
            .into_iter()
            .filter(|p| p.turn == turn.n)
            .map(|p| (u64::from(p.part_index), p.payload))
            .collect(),
        Err(_) => return refuse(ErrorCode::StoreUnavailable, "the store did not answer; try again"),
    };
    let last_stored = stored.last().map(|(index, _)| *index);
    let mut prefix = Vec::new();
    for (index, json) in &stored {
        write_sse_event(&mut prefix, *index, json);
    }
    let driver = state.drivers.driver_socket(&session);
    let ended = turn.status.is_terminal();
    let tail = live_tail(
        driver,
        session.clone(),
        turn.n,
        last_stored,
        ended && last_stored.is_some(),
        state.heartbeat,
        state.store.clone(),
        workspace_id.to_owned(),
    );
    let body = futures::stream::once(async move { Ok::<_, std::convert::Infallible>(Bytes::from(prefix)) }).chain(tail);
    let mut response = Response::new(Body::from_stream(body));
    for (name, value) in STREAM_HEADERS {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    cors(state, headers, &mut response);
    response
}

/// The rest of the stream after the stored prefix: the driver's parts after `after`, heartbeats
/// while nothing comes, and `[DONE]`. A turn that ended and is stored whole needs no driver.
#[allow(clippy::too_many_arguments)]
fn live_tail(
    driver: Option<PathBuf>,
    session: SessionId,
    n: u32,
    after: Option<u64>,
    stored_whole: bool,
    heartbeat: Duration,
    store: Arc<dyn Store>,
    workspace_id: String,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send {
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        if stored_whole {
            let _ = sender.send(Bytes::from_static(SSE_DONE)).await;
            return;
        }
        let mut quiet_since = std::time::Instant::now();
        loop {
            if let Some(socket) = &driver
                && let Some(mut body) = open_driver_stream(socket, n, after).await
            {
                loop {
                    match tokio::time::timeout(heartbeat, body.frame()).await {
                        Ok(Some(Ok(frame))) => {
                            // A client that takes nothing for this long is dropped (it can attach again);
                            // only its own connection to the driver ever waited for it.
                            if let Ok(data) = frame.into_data()
                                && !matches!(
                                    tokio::time::timeout(SLOW_CLIENT_LIMIT, sender.send(data)).await,
                                    Ok(Ok(()))
                                )
                            {
                                return;
                            }
                        }
                        Ok(Some(Err(_)) | None) => return,
                        Err(_) => {
                            if sender.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
            // No driver (yet): wait with heartbeats; a turn that ends meanwhile ends the stream.
            let ended = match store.turns(&workspace_id, &session).await {
                Ok(turns) => turns
                    .iter()
                    .find(|t| t.n == n)
                    .is_none_or(|t| t.status.is_terminal() && t.status != TurnStatus::Running),
                Err(_) => true,
            };
            if ended {
                let _ = sender.send(Bytes::from_static(SSE_DONE)).await;
                return;
            }
            if quiet_since.elapsed() >= heartbeat {
                if sender.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                    return;
                }
                quiet_since = std::time::Instant::now();
            }
            tokio::time::sleep(heartbeat.min(Duration::from_millis(250))).await;
        }
    });
    futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|bytes| (Ok(bytes), receiver))
    })
}

/// `GET /turns/{n}/stream?after=K` on the driver's socket; `None` if it has no such turn (yet).
async fn open_driver_stream(socket: &std::path::Path, n: u32, after: Option<u64>) -> Option<hyper::body::Incoming> {
    let stream = tokio::net::UnixStream::connect(socket).await.ok()?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(connection);
    let path = match after {
        Some(k) => format!("/turns/{n}/stream?after={k}"),
        None => format!("/turns/{n}/stream"),
    };
    let request = axum::http::Request::get(path)
        .header(header::HOST, "driver")
        .body(http_body_util::Empty::<Bytes>::new())
        .ok()?;
    let response = sender.send_request(request).await.ok()?;
    response.status().is_success().then(|| response.into_body())
}
