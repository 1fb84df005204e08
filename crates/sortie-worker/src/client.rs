//! The worker's side of the driver API (DESIGN §6.2): HTTP/1.1 over the sandbox's `driver.sock`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::Value;

/// How long a plain request to the driver may take.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("the driver does not answer on {0}: {1}")]
    Unreachable(PathBuf, String),
    #[error("the driver did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the driver answered {status}: {body}")]
    Refused { status: StatusCode, body: String },
    #[error("the driver's answer is not what the worker expects: {0}")]
    Malformed(String),
}

/// A turn as the driver's `GET /status` reports it.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct DriverTurn {
    pub n: u32,
    /// `running`, `delivering`, `completed`, `cancelled` or `failed`.
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub failure: Option<DriverFailure>,
    #[serde(default)]
    pub delivery: Option<DriverDelivery>,
    #[serde(default)]
    pub priming: Option<String>,
    #[serde(default)]
    pub timings: Option<serde_json::Map<String, Value>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct DriverFailure {
    pub code: String,
    #[serde(default)]
    pub reason: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct DriverDelivery {
    #[serde(default)]
    pub head_sha: Option<String>,
    #[serde(default)]
    pub pushed: bool,
    #[serde(default)]
    pub changed: bool,
    #[serde(default)]
    pub error: Option<DriverFailure>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct DriverStatus {
    #[serde(default)]
    pub turns: Vec<DriverTurn>,
}

impl DriverStatus {
    pub fn turn(&self, n: u32) -> Option<&DriverTurn> {
        self.turns.iter().find(|t| t.n == n)
    }
}

/// What `POST /setup` reports.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SetupResult {
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    #[serde(default)]
    pub output_tail: String,
}

#[derive(Clone, Debug)]
pub struct DriverClient {
    socket: PathBuf,
}

impl DriverClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self { socket: socket.into() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Incoming, DriverError> {
        let unreachable = |e: &dyn std::fmt::Display| DriverError::Unreachable(self.socket.clone(), e.to_string());
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|e| unreachable(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(connection);
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "driver")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))
            .map_err(|e| DriverError::Malformed(e.to_string()))?;
        let response = sender.send_request(request).await.map_err(|e| unreachable(&e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response.into_body());
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        Err(DriverError::Refused { status, body })
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        deadline: Duration,
    ) -> Result<T, DriverError> {
        let exchange = async {
            let answer = self.send(method, path, body).await?;
            let bytes = answer
                .collect()
                .await
                .map_err(|e| DriverError::Unreachable(self.socket.clone(), e.to_string()))?
                .to_bytes();
            serde_json::from_slice(&bytes).map_err(|e| DriverError::Malformed(e.to_string()))
        };
        tokio::time::timeout(deadline, exchange)
            .await
            .map_err(|_| DriverError::Timeout(deadline))?
    }

    pub async fn status(&self) -> Result<DriverStatus, DriverError> {
        self.json(Method::GET, "/status", None, REQUEST_DEADLINE).await
    }

    /// `POST /turns`; idempotent on `n`.
    pub async fn start_turn(&self, body: &Value) -> Result<(), DriverError> {
        self.json::<Value>(Method::POST, "/turns", Some(body), REQUEST_DEADLINE)
            .await
            .map(|_| ())
    }

    pub async fn cancel(&self, n: u32) -> Result<(), DriverError> {
        self.json::<Value>(Method::POST, &format!("/turns/{n}/cancel"), None, REQUEST_DEADLINE)
            .await
            .map(|_| ())
    }

    /// `POST /parts`: a `data-sortie-*` part of sortie's own into the running turn's stream.
    pub async fn post_part(&self, part: &Value) -> Result<(), DriverError> {
        self.json::<Value>(Method::POST, "/parts", Some(part), REQUEST_DEADLINE)
            .await
            .map(|_| ())
    }

    /// Runs the setup script inside the sandbox; the driver enforces `timeout`, this waits a little longer.
    pub async fn setup(&self, script: &str, timeout: Duration) -> Result<SetupResult, DriverError> {
        let body = serde_json::json!({"script": script, "timeout_secs": timeout.as_secs().max(1)});
        self.json(Method::POST, "/setup", Some(&body), timeout + REQUEST_DEADLINE)
            .await
    }

    /// `GET /turns/{n}/stream?after=K`: the turn's parts as SSE, ending with `[DONE]`.
    pub async fn stream(&self, n: u32, after: Option<u64>) -> Result<Incoming, DriverError> {
        let path = match after {
            Some(k) => format!("/turns/{n}/stream?after={k}"),
            None => format!("/turns/{n}/stream"),
        };
        tokio::time::timeout(REQUEST_DEADLINE, self.send(Method::GET, &path, None))
            .await
            .map_err(|_| DriverError::Timeout(REQUEST_DEADLINE))?
    }
}
