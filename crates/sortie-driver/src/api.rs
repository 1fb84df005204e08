//! The driver's local HTTP API (DESIGN §6.2; bodies in `sortie_protocol::driver`): start a turn
//! (idempotent on its number and the host's nonce), one turn's report, stream a turn's parts as SSE
//! from any index, cancel, status, run the setup script.
//!
//! It is served on a listening socket the host made and handed over (the driver's stdin), whose name
//! lies outside the sandbox: nothing inside can reach it, and the driver makes itself undumpable so
//! the agent cannot take it from its memory. The host still believes none of it (invariant 9).

use std::future::Future;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use sortie_feed::hub::read_log;
use sortie_protocol::chunk::{SSE_DONE, STREAM_HEADERS};
use sortie_protocol::driver::{
    DriverError, DriverErrorBody, DriverErrorCode, RunSetup, StartTurn, is_commit_id, is_nonce,
};

use crate::driver::{Driver, SetupRefused, StartError, TurnRequest};

/// The largest body the driver takes (a prompt of at most 100 KiB plus a priming preamble of 64 KiB).
const TURN_BODY_MAX: usize = 1024 * 1024;
/// A setup script's deadline when the request names none, and the longest it may name.
const SETUP_TIMEOUT_DEFAULT_SECS: u64 = 600;
const SETUP_TIMEOUT_MAX_SECS: u64 = 24 * 60 * 60;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    after: Option<u64>,
}

pub fn router(driver: Driver) -> Router {
    Router::new()
        .route("/turns", post(start_turn))
        .route("/turns/{n}", get(turn_report))
        .route("/turns/{n}/stream", get(stream_turn))
        .route("/turns/{n}/cancel", post(cancel_turn))
        .route("/status", get(status))
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

pub(crate) fn refuse(status: StatusCode, code: DriverErrorCode, message: impl Into<String>) -> Response {
    let body = DriverErrorBody {
        error: DriverError {
            code,
            message: message.into(),
        },
    };
    (status, Json(body)).into_response()
}

fn invalid(message: impl Into<String>) -> Response {
    refuse(StatusCode::BAD_REQUEST, DriverErrorCode::InvalidRequest, message)
}

async fn start_turn(State(driver): State<Driver>, body: Bytes) -> Response {
    let request: StartTurn = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => return invalid(format!("the body is not a turn: {error}")),
    };
    if request.n == 0 {
        return invalid("turns are numbered from 1");
    }
    if !is_nonce(&request.nonce) {
        return invalid("the nonce is 1 to 64 letters, digits, '-' or '_'");
    }
    let baseline = request.baseline.map(|sha| sha.to_ascii_lowercase());
    if let Some(sha) = &baseline
        && !is_commit_id(sha)
    {
        return invalid(format!("baseline {sha:?} is not a commit id (40 or 64 hex digits)"));
    }
    let turn = TurnRequest {
        nonce: request.nonce,
        prompt: request.prompt,
        baseline,
        priming: request.priming_context.unwrap_or_default(),
    };
    match driver.start_turn(request.n, turn) {
        Ok(report) => (StatusCode::ACCEPTED, Json(report)).into_response(),
        Err(error @ StartError::AnotherTurnRunning(_)) => {
            refuse(StatusCode::CONFLICT, DriverErrorCode::TurnRunning, error.to_string())
        }
        Err(error @ StartError::SetupRunning) => {
            refuse(StatusCode::CONFLICT, DriverErrorCode::SetupRunning, error.to_string())
        }
        Err(error @ StartError::NotOurs(_)) => {
            refuse(StatusCode::CONFLICT, DriverErrorCode::TurnNotOurs, error.to_string())
        }
    }
}

async fn turn_report(State(driver): State<Driver>, Path(n): Path<u32>) -> Response {
    match driver.report(n) {
        Some(report) => Json(report).into_response(),
        None => refuse(
            StatusCode::NOT_FOUND,
            DriverErrorCode::TurnNotFound,
            format!("no turn {n} in this driver"),
        ),
    }
}

/// `POST /setup`: runs the script to its end and answers its outcome.
async fn run_setup(State(driver): State<Driver>, body: Bytes) -> Response {
    let request: RunSetup = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => return invalid(format!("the body is not a setup request: {error}")),
    };
    let seconds = request
        .timeout_secs
        .unwrap_or(SETUP_TIMEOUT_DEFAULT_SECS)
        .clamp(1, SETUP_TIMEOUT_MAX_SECS);
    match driver.run_setup(&request.script, Duration::from_secs(seconds)).await {
        Ok(outcome) => (StatusCode::OK, Json(outcome)).into_response(),
        Err(error @ SetupRefused::TurnRunning(_)) => {
            refuse(StatusCode::CONFLICT, DriverErrorCode::TurnRunning, error.to_string())
        }
        Err(error @ SetupRefused::SetupRunning) => {
            refuse(StatusCode::CONFLICT, DriverErrorCode::SetupRunning, error.to_string())
        }
        Err(error @ SetupRefused::Failed(_)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            DriverErrorCode::SetupFailed,
            error.to_string(),
        ),
    }
}

async fn cancel_turn(State(driver): State<Driver>, Path(n): Path<u32>) -> Response {
    if driver.cancel_turn(n) {
        (
            StatusCode::ACCEPTED,
            Json(sortie_protocol::driver::CancelAccepted { n }),
        )
            .into_response()
    } else {
        refuse(
            StatusCode::CONFLICT,
            DriverErrorCode::NoTurnRunning,
            format!("turn {n} is not running"),
        )
    }
}

async fn status(State(driver): State<Driver>) -> Response {
    Json(driver.status()).into_response()
}

async fn stream_turn(State(driver): State<Driver>, Path(n): Path<u32>, Query(query): Query<StreamQuery>) -> Response {
    let after = query.after;
    let body = if let Some(hub) = driver.hub(n) {
        Body::from_stream(sortie_feed::sse::body(hub.subscribe(after)))
    } else {
        // A turn of an earlier driver process: its log is all there is.
        let path = driver.log_path(n);
        let read = tokio::task::spawn_blocking(move || read_log(&path, after, None)).await;
        // The turn may have started since the hub was looked up: its log, created with the hub, is
        // then a live turn's (empty) beginning, not a finished turn.
        if let Some(hub) = driver.hub(n) {
            return stream_response(Body::from_stream(sortie_feed::sse::body(hub.subscribe(after))));
        }
        match read {
            Ok(Ok(parts)) => {
                let mut out = Vec::new();
                sortie_feed::sse::encode(&mut out, &parts);
                out.extend_from_slice(SSE_DONE);
                Body::from(out)
            }
            _ => {
                return refuse(
                    StatusCode::NOT_FOUND,
                    DriverErrorCode::TurnNotFound,
                    format!("no turn {n} here"),
                );
            }
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
