//! Attach (DESIGN §5, §7.1): `GET /v1/sessions/{id}/stream` with a single-use ticket answers the
//! active turn's UI message stream — the stored prefix first, then the live tail after the last
//! stored part from the host's own copy of the turn ([`crate::live`]; never a socket of the sandbox),
//! so there is no gap and no duplicate — and `[DONE]` when the turn ends. No active turn is 204 (useChat's "nothing to resume"); `?turn=N` replays turn N, and
//! `Last-Event-ID: K` (a part's index, its SSE id) goes on after part K. An idle stream gets a heartbeat
//! comment every 15 s. Cookies are ignored; the ticket is the only credential.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Path as UrlPath, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use serde::Deserialize;
use sortie_protocol::api::TicketAction;
use sortie_protocol::chunk::{SSE_DONE, STREAM_HEADERS, write_sse_event};
use sortie_protocol::{ApiErrorBody, ErrorCode, SessionId, TurnStatus};
use sortie_store::{GatewayStore, StoreError, TurnRow};

use crate::live::{LiveTails, TailBody};
use crate::tickets;

#[derive(Clone)]
pub struct AttachState {
    pub store: Arc<dyn GatewayStore>,
    pub ticket_secret: Arc<[u8]>,
    /// The live copies of running turns.
    pub tails: Arc<dyn LiveTails>,
    /// Origins a browser may attach from (CORS).
    pub allowed_origins: Arc<Vec<String>>,
    pub heartbeat: Duration,
    /// How long a client may leave its buffer full before it is disconnected ([`SLOW_CLIENT_LIMIT`]).
    pub slow_client_limit: Duration,
}

/// How long a client may leave its buffer full before it is disconnected.
pub const SLOW_CLIENT_LIMIT: Duration = Duration::from_secs(30);

pub fn router(state: AttachState) -> Router {
    Router::new()
        .route("/v1/sessions/{id}/stream", get(attach).post(submit).options(preflight))
        .layer(axum::middleware::from_fn_with_state(state.clone(), with_cors))
        .with_state(state)
}

/// Serves the attach routes on a bound listener until `shutdown` completes. A connection whose
/// client takes nothing for `slow_client_limit` is reset ([`crate::stall`]).
pub async fn run(
    listener: tokio::net::TcpListener,
    state: AttachState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = crate::stall::StalledWrites::new(listener, state.slow_client_limit);
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

/// Every answer on the stream path, refusals included, carries the CORS headers an allowed origin
/// needs: a page on another site reads `TICKET_EXPIRED` as well as the stream.
async fn with_cors(
    State(state): State<AttachState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let mut origin = HeaderMap::new();
    if let Some(value) = request.headers().get(header::ORIGIN) {
        origin.insert(header::ORIGIN, value.clone());
    }
    let mut response = next.run(request).await;
    cors(&state, &origin, &mut response);
    response
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
            HeaderValue::from_static("authorization, content-type, last-event-id"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
    response
}

#[derive(Debug, Deserialize)]
struct AttachQuery {
    turn: Option<u32>,
}

pub(crate) fn now_seconds() -> i64 {
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
        return if asked.is_some() {
            refuse(ErrorCode::NotFound, "no such turn")
        } else {
            StatusCode::NO_CONTENT.into_response()
        };
    };

    // A client that saw parts up to K (their SSE ids) goes on after K: nothing twice, nothing missed.
    let after = match headers.get("last-event-id") {
        None => None,
        Some(value) => match value.to_str().ok().and_then(|text| text.trim().parse::<u32>().ok()) {
            Some(index) => Some(index),
            None => return refuse(ErrorCode::InvalidRequest, "Last-Event-ID must be a part's index"),
        },
    };
    turn_stream(&state, &session, &claims.ws, &turn, after).await
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
    turn_stream(&state, &session, &claims.ws, &turn, None).await
}

/// Answers turn `turn`'s stream: its stored parts, then the driver's live tail, then `[DONE]`.
async fn turn_stream(
    state: &AttachState,
    session: &SessionId,
    workspace_id: &str,
    turn: &TurnRow,
    after: Option<u32>,
) -> Response {
    let session = session.clone();
    let ended = turn.status.is_terminal();
    // A turn that ended a moment ago is read from the copy kept in memory when it holds it all: what
    // it holds is what was stored, and a late reader is usually someone who was just watching.
    let kept = if ended {
        state.tails.open_ended(&session, turn.n, after.map(u64::from))
    } else {
        None
    };
    // Otherwise the stored prefix is read slice by slice as the client takes it: one turn, never the
    // session, and never a whole turn held at once. The first slice is read here, so a store that
    // does not answer is a 503, not a broken stream.
    let first = if kept.is_some() {
        Vec::new()
    } else {
        match state
            .store
            .turn_parts_after(&session, turn.n, after, STORED_SLICE)
            .await
        {
            Ok(parts) => parts,
            Err(_) => return refuse(ErrorCode::StoreUnavailable, "the store did not answer; try again"),
        }
    };
    let tail = live_tail(
        state.tails.clone(),
        session.clone(),
        turn.n,
        Stored {
            first,
            after,
            ended,
            kept,
        },
        Pace {
            heartbeat: state.heartbeat,
            slow_client_limit: state.slow_client_limit,
        },
        state.store.clone(),
        workspace_id.to_owned(),
    );
    let mut response = Response::new(Body::from_stream(tail));
    for (name, value) in STREAM_HEADERS {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// One slice of a turn's stored parts, as attach reads them.
const STORED_SLICE: sortie_store::PartsLimit = sortie_store::PartsLimit {
    parts: 1024,
    bytes: 4 << 20,
};

/// What the store had of the turn when the client came: its first slice, and whether the turn had ended.
struct Stored {
    first: Vec<sortie_store::StoredPart>,
    /// The part the client already has (its `Last-Event-ID`), if any.
    after: Option<u32>,
    ended: bool,
    /// The ended turn's copy kept in memory, after `after` and with its `[DONE]`: served instead of
    /// the store.
    kept: Option<TailBody>,
}

/// How a stream is paced: heartbeats while it is idle, and how long its client may take nothing.
#[derive(Clone, Copy)]
struct Pace {
    heartbeat: Duration,
    slow_client_limit: Duration,
}

/// At most this much of a client's backlog is joined into one write.
const COALESCE_BYTES: usize = 64 * 1024;

/// Hands `data` to the client's buffer, waiting at most `limit` for room; `false`: the stream ends
/// there. A client that takes nothing for that long is dropped (it can attach again).
async fn send_paced(
    sender: &tokio::sync::mpsc::Sender<Bytes>,
    data: Bytes,
    limit: Duration,
    dropped: &std::sync::atomic::AtomicBool,
    (session, n): (&SessionId, u32),
) -> bool {
    match tokio::time::timeout(limit, sender.send(data)).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) => false,
        Err(_) => {
            dropped.store(true, std::sync::atomic::Ordering::Release);
            metrics::counter!("sortie_attach_slow_clients_dropped_total").increment(1);
            tracing::info!(session = %session, turn = n, "dropped a client that took nothing");
            false
        }
    }
}

/// The rest of the stream after the stored prefix: the live copy's parts after `after`, heartbeats
/// while nothing comes, and `[DONE]`. A turn that ended and is stored whole needs no live copy.
///
/// A client that leaves its buffer (this channel) full for `slow_client_limit` is dropped: its
/// subscription is let go at once, and the body ends with an error after what is buffered, so the
/// client sees a broken stream (and can attach again), never a clean end without `[DONE]`.
#[allow(clippy::too_many_arguments)]
fn live_tail(
    tails: Arc<dyn LiveTails>,
    session: SessionId,
    n: u32,
    stored: Stored,
    pace: Pace,
    store: Arc<dyn GatewayStore>,
    workspace_id: String,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let Pace {
        heartbeat,
        slow_client_limit,
    } = pace;
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(64);
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mark_dropped = dropped.clone();
    tokio::spawn(async move {
        if let Some(mut kept) = stored.kept {
            // At the client's pace too: a client that takes nothing is dropped as from a live tail.
            while let Some(data) = kept.next().await {
                let Ok(data) = data else {
                    mark_dropped.store(true, std::sync::atomic::Ordering::Release);
                    return;
                };
                if !send_paced(&sender, data, slow_client_limit, &mark_dropped, (&session, n)).await {
                    return;
                }
            }
            return;
        }
        // The stored prefix, slice by slice, at the client's pace (the same limit as the live tail).
        let mut slice = stored.first;
        let mut last: Option<u32> = stored.after;
        while !slice.is_empty() {
            last = slice.last().map(|part| part.part_index);
            let mut bytes = Vec::with_capacity(slice.iter().map(|p| p.payload.len() + 24).sum());
            for part in &slice {
                write_sse_event(&mut bytes, u64::from(part.part_index), &part.payload);
            }
            if !send_paced(
                &sender,
                Bytes::from(bytes),
                slow_client_limit,
                &mark_dropped,
                (&session, n),
            )
            .await
            {
                return;
            }
            slice = match store.turn_parts_after(&session, n, last, STORED_SLICE).await {
                Ok(next) => next,
                Err(_) => {
                    // The store went away mid-prefix: the stream breaks (the client attaches again).
                    mark_dropped.store(true, std::sync::atomic::Ordering::Release);
                    return;
                }
            };
        }
        if stored.ended && last.is_some() {
            let _ = sender.send(Bytes::from_static(SSE_DONE)).await;
            return;
        }
        let mut relayed = Relayed::after(last.map(u64::from));
        let mut quiet_since = std::time::Instant::now();
        // Marked seen before the first look: a copy that comes up after it wakes the wait below.
        let mut appeared = tails.appeared();
        if let Some(appeared) = &mut appeared {
            appeared.borrow_and_update();
        }
        loop {
            // Asked afresh each time: the turn's live copy may come up (or go) while the client waits.
            if let Ok(Some(mut body)) =
                tokio::time::timeout(heartbeat, tails.open(&session, n, relayed.resume_after())).await
            {
                loop {
                    match tokio::time::timeout(heartbeat, body.next()).await {
                        Ok(Some(Ok(data))) => {
                            relayed.observe(&data);
                            // Only this client's own subscription ever waited for it.
                            if !send_paced(&sender, data, slow_client_limit, &mark_dropped, (&session, n)).await {
                                return;
                            }
                            if relayed.done {
                                return;
                            }
                        }
                        Ok(Some(Err(_)) | None) => break,
                        // A heartbeat only ever goes between events: inside one it would corrupt it.
                        Err(_) if relayed.at_boundary() => {
                            if sender.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                                return;
                            }
                        }
                        Err(_) => {}
                    }
                }
                // The live copy went away before `[DONE]` (its turn was lost, or its worker restarted).
                // Between two events the stream can go on from the store or a new copy; inside one it
                // cannot.
                if !relayed.at_boundary() {
                    mark_dropped.store(true, std::sync::atomic::Ordering::Release);
                    return;
                }
            }
            // No live copy (yet, or any more): wait with heartbeats; a turn that ends meanwhile ends the
            // stream. A store that does not answer is asked again, never taken for an ended turn.
            let ended = match store.turns(&workspace_id, &session).await {
                Ok(turns) => turns
                    .iter()
                    .find(|t| t.n == n)
                    .is_none_or(|t| t.status.is_terminal() && t.status != TurnStatus::Running),
                Err(_) => false,
            };
            if ended {
                // Whatever the recorder stored after what was sent while we waited, then the end.
                let mut after = relayed.resume_after().and_then(|index| u32::try_from(index).ok());
                loop {
                    let Ok(slice) = store.turn_parts_after(&session, n, after, STORED_SLICE).await else {
                        mark_dropped.store(true, std::sync::atomic::Ordering::Release);
                        return;
                    };
                    let Some(end) = slice.last().map(|part| part.part_index) else {
                        break;
                    };
                    let mut rest = Vec::new();
                    for part in &slice {
                        write_sse_event(&mut rest, u64::from(part.part_index), &part.payload);
                    }
                    if sender.send(Bytes::from(rest)).await.is_err() {
                        return;
                    }
                    after = Some(end);
                }
                let _ = sender.send(Bytes::from_static(SSE_DONE)).await;
                return;
            }
            if quiet_since.elapsed() >= heartbeat {
                if sender.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                    return;
                }
                quiet_since = std::time::Instant::now();
            }
            // Woken when this process's worker brings a live copy up (the turn started: its first part
            // is on its way); the timer finds one of another worker, or a turn that ended meanwhile.
            let look_again = tokio::time::sleep(heartbeat.min(Duration::from_millis(250)));
            match &mut appeared {
                Some(signal) => {
                    tokio::select! {
                        () = look_again => {}
                        changed = signal.changed() => if changed.is_err() {
                            // The worker is gone: nothing will say so again; the timer looks.
                            appeared = None;
                        },
                    }
                }
                None => look_again.await,
            }
        }
    });
    futures::stream::unfold(Some(receiver), move |receiver| {
        let dropped = dropped.clone();
        async move {
            let mut receiver = receiver?;
            match receiver.recv().await {
                Some(first) => {
                    // What queued up while the client was writing goes out as one write, not one each.
                    let Ok(next) = receiver.try_recv() else {
                        return Some((Ok(first), Some(receiver)));
                    };
                    let mut joined = Vec::with_capacity(first.len() + next.len() + COALESCE_BYTES / 4);
                    joined.extend_from_slice(&first);
                    joined.extend_from_slice(&next);
                    while joined.len() < COALESCE_BYTES {
                        match receiver.try_recv() {
                            Ok(more) => joined.extend_from_slice(&more),
                            Err(_) => break,
                        }
                    }
                    Some((Ok(Bytes::from(joined)), Some(receiver)))
                }
                None if dropped.load(std::sync::atomic::Ordering::Acquire) => Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client took nothing for too long",
                    )),
                    None,
                )),
                None => None,
            }
        }
    })
}

/// What of a live copy's SSE bytes went to the client: the last whole event's index and whether `[DONE]`
/// passed, so a broken driver stream can be taken up again exactly after the last whole event. Bytes
/// are relayed as they come (a write may end inside a line); only line starts are inspected.
struct Relayed {
    /// The index of the last event whose blank line was relayed.
    last_whole: Option<u64>,
    /// The index of the event being relayed, once its `id:` line passed.
    current: Option<u64>,
    /// A line not yet ended: only its first bytes (enough to tell `id:` and `[DONE]` lines apart).
    partial: Vec<u8>,
    partial_len: usize,
    inside_event: bool,
    /// The event being relayed is `data: [DONE]`.
    ending: bool,
    done: bool,
}

/// Enough of a line to read `id: <u64>` or `data: [DONE]`.
const LINE_HEAD: usize = 32;

impl Relayed {
    fn after(after: Option<u64>) -> Self {
        Self {
            last_whole: after,
            current: None,
            partial: Vec::with_capacity(LINE_HEAD),
            partial_len: 0,
            inside_event: false,
            ending: false,
            done: false,
        }
    }

    fn resume_after(&self) -> Option<u64> {
        self.last_whole
    }

    fn at_boundary(&self) -> bool {
        !self.inside_event && self.partial_len == 0
    }

    fn observe(&mut self, mut data: &[u8]) {
        while let Some(end) = memchr::memchr(b'\n', data) {
            self.push_partial(&data[..end]);
            let head = std::mem::take(&mut self.partial);
            let len = std::mem::take(&mut self.partial_len);
            self.line(&head, len);
            self.partial = head;
            self.partial.clear();
            data = &data[end + 1..];
        }
        self.push_partial(data);
    }

    fn push_partial(&mut self, bytes: &[u8]) {
        let room = LINE_HEAD.saturating_sub(self.partial.len());
        self.partial.extend_from_slice(&bytes[..room.min(bytes.len())]);
        self.partial_len += bytes.len();
    }

    fn line(&mut self, head: &[u8], len: usize) {
        if len == 0 {
            if self.inside_event {
                self.last_whole = self.current.or(self.last_whole);
                self.inside_event = false;
                self.done |= self.ending;
            }
            return;
        }
        self.inside_event = true;
        if len == head.len() {
            if let Some(id) = head.strip_prefix(b"id: ") {
                self.current = std::str::from_utf8(id).ok().and_then(|id| id.parse().ok());
            } else if head == &SSE_DONE[..SSE_DONE.len() - 2] {
                self.ending = true;
            }
        }
    }
}

/// Whether `origin` is a browser origin as the `Origin` header carries it: `http(s)://host[:port]`,
/// nothing after (what `--cors-origin` takes).
pub fn is_origin(origin: &str) -> bool {
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .unwrap_or_default();
    !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_of(indices: std::ops::Range<u64>, done: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for index in indices {
            write_sse_event(
                &mut out,
                index,
                &format!(r#"{{"type":"text-delta","id":"t","delta":"{index}"}}"#),
            );
        }
        out.extend_from_slice(b": keep-alive\n\n");
        if done {
            out.extend_from_slice(SSE_DONE);
        }
        out
    }

    #[test]
    fn knows_the_last_whole_event_wherever_the_writes_split() {
        let bytes = stream_of(7..12, true);
        for split in 0..=bytes.len() {
            let mut relayed = Relayed::after(Some(6));
            relayed.observe(&bytes[..split]);
            let whole_events = bytes[..split].windows(2).filter(|w| w == b"\n\n").count() as u64;
            let expected = match whole_events {
                0 => Some(6),
                k => Some((6 + k).min(11)),
            };
            assert_eq!(relayed.resume_after(), expected, "split at {split}");
            assert_eq!(
                relayed.at_boundary(),
                split == 0 || bytes[..split].ends_with(b"\n\n"),
                "split at {split}"
            );
            assert!(!relayed.done || split == bytes.len(), "split at {split}");
            relayed.observe(&bytes[split..]);
            assert_eq!(
                (relayed.resume_after(), relayed.done),
                (Some(11), true),
                "split at {split}"
            );
        }
    }

    #[test]
    fn a_long_data_line_and_a_done_that_is_not_alone_are_read_right() {
        let mut relayed = Relayed::after(None);
        let long = format!("id: 3\ndata: {}\n\n", "x".repeat(10_000));
        relayed.observe(long.as_bytes());
        assert_eq!(relayed.resume_after(), Some(3));
        relayed.observe(b"id: 4\ndata: [DONE] or not\n\n");
        assert_eq!((relayed.resume_after(), relayed.done), (Some(4), false));
        relayed.observe(b"data: [DONE]\n");
        assert!(!relayed.done && !relayed.at_boundary());
        relayed.observe(b"\n");
        assert!(relayed.done && relayed.at_boundary());
    }

    #[test]
    fn an_origin_is_scheme_and_host_and_nothing_after() {
        for good in [
            "https://tools.example.com",
            "http://127.0.0.1:8080",
            "http://[::1]:3000",
        ] {
            assert!(is_origin(good), "{good}");
        }
        for bad in [
            "",
            "tools.example.com",
            "https://",
            "https://a.example/",
            "ftp://a.example",
            "https://a b",
        ] {
            assert!(!is_origin(bad), "{bad}");
        }
    }
}
