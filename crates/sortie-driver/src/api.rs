//! The driver's local HTTP API on `driver.sock` (DESIGN §6.2): start a turn (idempotent on `n`),
//! stream a turn's parts as SSE from any index, cancel, status, run the setup script.

use std::future::Future;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sortie_protocol::chunk::{SSE_DONE, STREAM_HEADERS, write_sse_event};

use crate::driver::{Driver, SetupRefused, StartError, TurnRequest};
use crate::hub::{Part, Subscription, read_log};
use crate::priming::PrimingContext;

/// The largest prompt the driver takes (the api enforces 100 KiB; priming may add a preamble).
const TURN_BODY_MAX: usize = 1024 * 1024;
/// Parts encoded into one body chunk at most: large enough for throughput, small enough for latency.
const PARTS_PER_WRITE: usize = 256;
/// A setup script's deadline when the request names none, and the longest it may name.
const SETUP_TIMEOUT_DEFAULT_SECS: u64 = 600;
const SETUP_TIMEOUT_MAX_SECS: u64 = 24 * 60 * 60;

/// `POST /turns`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartTurn {
    pub n: u32,
    pub prompt: String,
    /// The branch's last delivered commit; absent or null: the branch must not exist remotely yet.
    #[serde(default)]
    pub baseline: Option<String>,
    /// The session's context, used only when a fresh agent process needs priming (DESIGN §6.4).
    #[serde(default)]
    pub priming_context: Option<PrimingContext>,
    /// The worker's timings so far in milliseconds (queued, sandbox, clone, setup), passed through.
    #[serde(default)]
    pub host_timings: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `POST /setup`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSetup {
    pub script: String,
    #[serde(default)]
    pub timeout_secs: Option<u64>,
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
        .route("/setup", post(run_setup))
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
    let baseline = request.baseline.map(|sha| sha.to_ascii_lowercase());
    if let Some(sha) = &baseline
        && !(matches!(sha.len(), 40 | 64) && sha.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return refuse(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            format!("baseline {sha:?} is not a commit id (40 or 64 hex digits)"),
        );
    }
    let host_timings = request.host_timings.unwrap_or_default();
    if let Some((name, _)) = host_timings.iter().find(|(_, value)| !value.is_number()) {
        return refuse(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            format!("host_timings.{name} is not a number of milliseconds"),
        );
    }
    let turn = TurnRequest {
        prompt: request.prompt,
        baseline,
        priming: request.priming_context.unwrap_or_default(),
        host_timings,
    };
    match driver.start_turn(request.n, turn) {
        Ok(report) => (StatusCode::ACCEPTED, Json(report)).into_response(),
        Err(error @ StartError::AnotherTurnRunning(_)) => {
            refuse(StatusCode::CONFLICT, "TURN_RUNNING", error.to_string())
        }
        Err(error @ StartError::SetupRunning) => refuse(StatusCode::CONFLICT, "SETUP_RUNNING", error.to_string()),
    }
}

/// `POST /setup`: runs the script to its end and answers its outcome.
async fn run_setup(State(driver): State<Driver>, body: Bytes) -> Response {
    let request: RunSetup = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
                format!("the body is not a setup request: {error}"),
            );
        }
    };
    let seconds = request
        .timeout_secs
        .unwrap_or(SETUP_TIMEOUT_DEFAULT_SECS)
        .clamp(1, SETUP_TIMEOUT_MAX_SECS);
    match driver.run_setup(&request.script, Duration::from_secs(seconds)).await {
        Ok(outcome) => (StatusCode::OK, Json(outcome)).into_response(),
        Err(error @ SetupRefused::TurnRunning(_)) => refuse(StatusCode::CONFLICT, "TURN_RUNNING", error.to_string()),
        Err(error @ SetupRefused::SetupRunning) => refuse(StatusCode::CONFLICT, "SETUP_RUNNING", error.to_string()),
        Err(error @ SetupRefused::Failed(_)) => {
            refuse(StatusCode::INTERNAL_SERVER_ERROR, "SETUP_FAILED", error.to_string())
        }
    }
}

/// `POST /parts`: a part of sortie's own for the running turn (`data-sortie-*`, and the model proxy's
/// token totals as `data-acp-usage`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnPart {
    /// The part's type without `data-`, e.g. `sortie-egress-denied`.
    pub name: String,
    /// A part with an id replaces the earlier one of the same type and id (AI SDK data parts).
    #[serde(default)]
    pub id: Option<String>,
    pub data: serde_json::Value,
}

/// The names `POST /parts` accepts: sortie's own parts, and the token totals the model proxy read.
fn own_part_name_allowed(name: &str) -> bool {
    (name.starts_with("sortie-") || name == "acp-usage") && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
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
    if !own_part_name_allowed(&part.name) {
        return refuse(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            "only data-sortie-* and data-acp-usage parts may be added",
        );
    }
    let id_ok = |id: &String| {
        !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if part.id.as_ref().is_some_and(|id| !id_ok(id)) {
        return refuse(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            "a part id is 1 to 64 letters, digits, '-' or '_'",
        );
    }
    let chunk = sortie_protocol::chunk::UiChunk::Data {
        name: part.name,
        id: part.id,
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
        let read = tokio::task::spawn_blocking(move || read_log(&path, after, None)).await;
        // The turn may have started since the hub was looked up: its log, created with the hub, is
        // then a live turn's (empty) beginning, not a finished turn.
        if let Some(hub) = driver.hub(n) {
            return stream_response(Body::from_stream(hub_stream(hub.subscribe(after))));
        }
        match read {
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
    stream_response(body)
}

fn stream_response(body: Body) -> Response {
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

#[cfg(test)]
mod tests {
    use super::own_part_name_allowed;

    #[test]
    fn only_sorties_own_parts_and_token_totals_may_be_added() {
        for allowed in ["sortie-egress-denied", "sortie-delivery", "acp-usage"] {
            assert!(own_part_name_allowed(allowed), "{allowed}");
        }
        for refused in [
            "acp-diff",
            "acp-usage-x",
            "text",
            "sortie-Egress",
            "sortie_x",
            "",
            "sortie-é",
        ] {
            assert!(!own_part_name_allowed(refused), "{refused}");
        }
    }
}
