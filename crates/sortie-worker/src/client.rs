//! The worker's side of the driver API (DESIGN §6.2, bodies in `sortie_protocol::driver`): HTTP/1.1
//! over the driver's socket, whose name is the host's (in a directory no sandbox can see: DESIGN §9
//! invariant 8), or HTTP/2 over the link a pod's driver dialed (`sortie_gateway::links`, §15). Every
//! answer is untrusted input: bounded ([`ANSWER_MAX_BYTES`], a deadline) before it is parsed into its
//! type, and a driver of another API version is refused.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use sortie_protocol::driver::{
    ANSWER_MAX_BYTES, DriverErrorBody, DriverErrorCode, DriverStatus, HOME_PATH, HOME_SNAPSHOT_MAX_BYTES, RunSetup,
    SetupOutcome, StartTurn, TurnReport, VERSION,
};

/// How long a plain request to the driver may take.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// How long an assignment may take: a pod clones the session's repository before it answers (the
/// driver bounds each git command to two minutes).
const ASSIGN_DEADLINE: Duration = Duration::from_secs(300);
/// How long a home snapshot may take to come or go.
const HOME_DEADLINE: Duration = Duration::from_secs(60);
/// How much of a refusal's body is read for its reason.
const REFUSAL_MAX_BYTES: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("the driver does not answer on {0}: {1}")]
    Unreachable(String, String),
    #[error("the driver did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the driver refused ({status}, {code:?}): {message}")]
    Refused {
        status: StatusCode,
        code: Option<DriverErrorCode>,
        message: String,
    },
    #[error("the driver's answer is not what the worker expects: {0}")]
    Malformed(String),
}

impl DriverError {
    /// The driver's own code for a refusal, if it gave one.
    pub fn code(&self) -> Option<DriverErrorCode> {
        match self {
            Self::Refused { code, .. } => *code,
            _ => None,
        }
    }
}

/// How the worker reaches a driver.
#[derive(Clone)]
enum Transport {
    /// The driver socket the host made for a local sandbox.
    Socket(PathBuf),
    /// The link the driver dialed to the gateway.
    Link(sortie_gateway::links::DriverLink),
    /// Whichever link the pod with this uid holds now: a driver whose link broke dials again.
    Pod(std::sync::Arc<sortie_gateway::links::DriverLinks>, String),
}

/// How long a request waits for a pod's driver to dial again after its link broke.
const RELINK_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct DriverClient {
    transport: Transport,
}

impl std::fmt::Debug for DriverClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DriverClient({})", self.place())
    }
}

impl DriverClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            transport: Transport::Socket(socket.into()),
        }
    }

    /// A client of the driver at the other end of `link`.
    pub fn over_link(link: sortie_gateway::links::DriverLink) -> Self {
        Self {
            transport: Transport::Link(link),
        }
    }

    /// A client of the driver of the pod with uid `pod_uid`, over whichever link it holds.
    pub fn of_pod(links: std::sync::Arc<sortie_gateway::links::DriverLinks>, pod_uid: String) -> Self {
        Self {
            transport: Transport::Pod(links, pod_uid),
        }
    }

    /// Where the driver is, for messages.
    fn place(&self) -> String {
        match &self.transport {
            Transport::Socket(socket) => socket.display().to_string(),
            Transport::Link(link) => format!("the link of pod {}", link.identity.pod_name),
            Transport::Pod(_, uid) => format!("the link of pod uid {uid}"),
        }
    }

    async fn send(&self, method: Method, path: &str, body: Option<Vec<u8>>) -> Result<Incoming, DriverError> {
        let unreachable = |e: &dyn std::fmt::Display| DriverError::Unreachable(self.place(), e.to_string());
        let body = Full::new(body.map(Bytes::from).unwrap_or_default());
        let response = match &self.transport {
            Transport::Socket(socket) => {
                let stream = tokio::net::UnixStream::connect(socket)
                    .await
                    .map_err(|e| unreachable(&e))?;
                let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| unreachable(&e))?;
                tokio::spawn(connection);
                let request = Self::request(method, path, body)?;
                sender.send_request(request).await.map_err(|e| unreachable(&e))?
            }
            // HTTP/2 names its target in full.
            Transport::Link(link) => {
                let request = Self::request(method, &format!("http://driver{path}"), body)?;
                link.send(request).await.map_err(|e| unreachable(&e))?
            }
            Transport::Pod(links, uid) => {
                let link = links
                    .wait_for(uid, RELINK_DEADLINE)
                    .await
                    .ok_or_else(|| unreachable(&"the pod's driver has no link"))?;
                let request = Self::request(method, &format!("http://driver{path}"), body)?;
                link.send(request).await.map_err(|e| unreachable(&e))?
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response.into_body());
        }
        let said = Limited::new(response.into_body(), REFUSAL_MAX_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let (code, message) = match serde_json::from_slice::<DriverErrorBody>(&said) {
            Ok(body) => (Some(body.error.code), body.error.message),
            Err(_) => (None, String::from_utf8_lossy(&said).chars().take(500).collect()),
        };
        Err(DriverError::Refused { status, code, message })
    }

    fn request(method: Method, uri: &str, body: Full<Bytes>) -> Result<Request<Full<Bytes>>, DriverError> {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header::HOST, "driver")
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .map_err(|e| DriverError::Malformed(e.to_string()))
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        deadline: Duration,
    ) -> Result<T, DriverError> {
        let exchange = async {
            let answer = self.send(method, path, body).await?;
            let bytes = Limited::new(answer, ANSWER_MAX_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    DriverError::Malformed(format!("the answer broke off or passed {ANSWER_MAX_BYTES} bytes: {e}"))
                })?
                .to_bytes();
            serde_json::from_slice(&bytes).map_err(|e| DriverError::Malformed(e.to_string()))
        };
        tokio::time::timeout(deadline, exchange)
            .await
            .map_err(|_| DriverError::Timeout(deadline))?
    }

    fn encode(body: &impl serde::Serialize) -> Result<Vec<u8>, DriverError> {
        serde_json::to_vec(body).map_err(|e| DriverError::Malformed(e.to_string()))
    }

    /// `GET /status`; a driver of another API version is refused.
    pub async fn status(&self) -> Result<DriverStatus, DriverError> {
        let status: DriverStatus = self.json(Method::GET, "/status", None, REQUEST_DEADLINE).await?;
        if status.version != VERSION {
            return Err(DriverError::Malformed(format!(
                "the driver speaks API version {}, this worker {VERSION}",
                status.version
            )));
        }
        Ok(status)
    }

    /// `POST /assignment`: the session a generic pod's driver serves (the same one again is a no-op).
    pub async fn assign(&self, assignment: &sortie_protocol::driver::Assignment) -> Result<(), DriverError> {
        // The driver resolves the agent's profile and files, and clones the workspace, before it answers.
        let answer = tokio::time::timeout(
            ASSIGN_DEADLINE,
            self.send(Method::POST, "/assignment", Some(Self::encode(assignment)?)),
        )
        .await
        .map_err(|_| DriverError::Timeout(ASSIGN_DEADLINE))??;
        drop(answer);
        Ok(())
    }

    /// `GET /home`: the agent's home as a tar, at most [`HOME_SNAPSHOT_MAX_BYTES`].
    pub async fn home_snapshot(&self) -> Result<Vec<u8>, DriverError> {
        let exchange = async {
            let answer = self.send(Method::GET, HOME_PATH, None).await?;
            Limited::new(answer, HOME_SNAPSHOT_MAX_BYTES)
                .collect()
                .await
                .map(|body| body.to_bytes().to_vec())
                .map_err(|e| {
                    DriverError::Malformed(format!(
                        "the home broke off or passed {HOME_SNAPSHOT_MAX_BYTES} bytes: {e}"
                    ))
                })
        };
        tokio::time::timeout(HOME_DEADLINE, exchange)
            .await
            .map_err(|_| DriverError::Timeout(HOME_DEADLINE))?
    }

    /// `PUT /home`: an unassigned pod's home, from the session's earlier pod.
    pub async fn restore_home(&self, tar: Vec<u8>) -> Result<(), DriverError> {
        let answer = tokio::time::timeout(HOME_DEADLINE, self.send(Method::PUT, HOME_PATH, Some(tar)))
            .await
            .map_err(|_| DriverError::Timeout(HOME_DEADLINE))??;
        drop(answer);
        Ok(())
    }

    /// `POST /turns`; idempotent on the turn's number and nonce.
    pub async fn start_turn(&self, turn: &StartTurn) -> Result<TurnReport, DriverError> {
        self.json(Method::POST, "/turns", Some(Self::encode(turn)?), REQUEST_DEADLINE)
            .await
    }

    /// `GET /turns/{n}`.
    pub async fn report(&self, n: u32) -> Result<TurnReport, DriverError> {
        self.json(Method::GET, &format!("/turns/{n}"), None, REQUEST_DEADLINE)
            .await
    }

    pub async fn cancel(&self, n: u32) -> Result<(), DriverError> {
        self.json::<sortie_protocol::driver::CancelAccepted>(
            Method::POST,
            &format!("/turns/{n}/cancel"),
            None,
            REQUEST_DEADLINE,
        )
        .await
        .map(|_| ())
    }

    /// Runs the setup script inside the sandbox; the driver enforces `timeout`, this waits a little longer.
    pub async fn setup(&self, script: &str, timeout: Duration) -> Result<SetupOutcome, DriverError> {
        let body = RunSetup {
            script: script.to_owned(),
            timeout_secs: Some(timeout.as_secs().max(1)),
        };
        self.json(
            Method::POST,
            "/setup",
            Some(Self::encode(&body)?),
            timeout + REQUEST_DEADLINE,
        )
        .await
    }

    /// `GET /turns/{n}/stream?after=K`: the turn's parts as SSE, ending with `[DONE]`. Unbounded in
    /// time; the reader bounds its lines ([`crate::recorder`]).
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
