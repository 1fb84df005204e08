//! The driver's local HTTP API on `driver.sock` (DESIGN §6.2): start a turn (idempotent on `n`),
//! stream a turn's parts as SSE from any index, cancel, status.

use std::future::Future;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sortie_protocol::chunk::{SSE_DONE, STREAM_HEADERS, write_sse_event};

use crate::driver::{Driver, StartError};
use crate::hub::{Part, Subscription, read_log};

/// The largest prompt the driver takes (the api enforces 100 KiB; priming may add a preamble).
const TURN_BODY_MAX: usize = 1024 * 1024;
/// Parts encoded into one body chunk at most: large enough for throughput, small enough for latency.
const PARTS_PER_WRITE: usize = 256;

/// `POST /turns`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartTurn {
    pub n: u32,
    pub prompt: String,
    /// The rung of the context ladder used to prime the agent (DESIGN §6.4), if any.
    #[serde(default)]
    pub priming: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    after: Option<u64>,
}

pub fn router(driver: Driver) -> Router {
    Router::new()
        .route("/turns", post(start_turn))
        .route("/turns/{n}/stream", get(stream_turn))
        .route("/turns/{n}/cancel", post(cancel_turn))
        .route("/status", get(status))
        .route("/parts", post(own_part))
        .layer(axum::extract::DefaultBodyLimit::max(TURN_BODY_MAX))
        .with_state(driver)
}

/// Serves the API on a Unix socket until `shutdown` completes.
pub async fn run(
    listener: tokio::net::UnixListener,
    driver: Driver,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(driver))
        .with_graceful_shutdown(shutdown)
        .await
}

fn refuse(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"code": code, "message": message.into(), "details": {}}})),
    )
        .into_response()
}

async fn start_turn(State(driver): State<Driver>, body: Bytes) -> Response {
    let request: StartTurn = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
                format!("the body is not a turn: {error}"),
            );
        }
    };
    if request.n == 0 {
        return refuse(StatusCode::BAD_REQUEST, "INVALID_REQUEST", "turns are numbered from 1");
    }
    let _ = request.priming;
    match driver.start_turn(request.n, request.prompt) {
        Ok(report) => (StatusCode::ACCEPTED, Json(report)).into_response(),
        Err(error @ StartError::AnotherTurnRunning(_)) => {
            refuse(StatusCode::CONFLICT, "TURN_RUNNING", error.to_string())
        }
    }
}

/// `POST /parts`: a part of sortie's own for the running turn (`data-sortie-*` only).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnPart {
    /// The part's type without `data-`, e.g. `sortie-egress-denied`.
    pub name: String,
    pub data: serde_json::Value,
}

async fn own_part(State(driver): State<Driver>, body: Bytes) -> Response {
    let part: OwnPart = match serde_json::from_slice(&body) {
        Ok(part) => part,
        Err(error) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
                format!("the body is not a part: {error}"),
            );
        }
    };
    if !part.name.starts_with("sortie-") || !part.name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
        return refuse(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            "only data-sortie-* parts may be added",
        );
    }
    let chunk = sortie_protocol::chunk::UiChunk::Data {
        name: part.name,
        id: None,
        data: part.data,
        transient: false,
    };
    if driver.push_own(chunk) {
        (StatusCode::ACCEPTED, Json(json!({"added": true}))).into_response()
    } else {
        refuse(StatusCode::CONFLICT, "NO_TURN_RUNNING", "no turn is running")
    }
}

async fn cancel_turn(State(driver): State<Driver>, Path(n): Path<u32>) -> Response {
    if driver.cancel_turn(n) {
        (StatusCode::ACCEPTED, Json(json!({"n": n, "cancel": "requested"}))).into_response()
    } else {
        refuse(
            StatusCode::CONFLICT,
            "NO_TURN_RUNNING",
            format!("turn {n} is not running"),
        )
    }
}

async fn status(State(driver): State<Driver>) -> Response {
    Json(json!({"agent": driver.agent_status(), "turns": driver.turns()})).into_response()
}

async fn stream_turn(State(driver): State<Driver>, Path(n): Path<u32>, Query(query): Query<StreamQuery>) -> Response {
    let after = query.after;
    let body = if let Some(hub) = driver.hub(n) {
        Body::from_stream(hub_stream(hub.subscribe(after)))
    } else {
        // A turn of an earlier driver process: its log is all there is.
        let path = driver.log_path(n);
        match tokio::task::spawn_blocking(move || read_log(&path, after, None)).await {
            Ok(Ok(parts)) => {
                let mut out = Vec::new();
                for (index, json) in &parts {
                    write_sse_event(&mut out, *index, json);
                }
                out.extend_from_slice(SSE_DONE);
                Body::from(out)
            }
            _ => return refuse(StatusCode::NOT_FOUND, "TURN_NOT_FOUND", format!("no turn {n} here")),
        }
    };
    let mut response = Response::new(body);
    for (name, value) in STREAM_HEADERS {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            header::HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// The SSE body of one subscriber: batches of events as they come, then `[DONE]`.
fn hub_stream(
    subscription: Subscription,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send {
    struct State {
        subscription: Subscription,
        parts: Vec<Part>,
        done: bool,
    }
    let state = State {
        subscription,
        parts: Vec::with_capacity(PARTS_PER_WRITE),
        done: false,
    };
    futures::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        state.parts.clear();
        let more = state.subscription.next_batch(PARTS_PER_WRITE, &mut state.parts).await;
        let mut out =
            Vec::with_capacity(state.parts.iter().map(|(_, json)| json.len() + 24).sum::<usize>() + SSE_DONE.len());
        for (index, json) in &state.parts {
            write_sse_event(&mut out, *index, json);
        }
        if !more {
            out.extend_from_slice(SSE_DONE);
            state.done = true;
        }
        Some((Ok(Bytes::from(out)), state))
    })
}
