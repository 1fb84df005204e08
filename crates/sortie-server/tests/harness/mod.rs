//! A server under test: the api router on SQLite or PostgreSQL, reached in-process (`oneshot`) or over
//! a real socket with a real HTTP client, with tokens of every role and a second workspace.

#![allow(dead_code)]

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use sortie_protocol::api::Role;
use sortie_server::{AgentCatalog, ApiState, Secret, tokens};
use sortie_store::testing::{TestBackend, TestDatabase};
use sortie_store::{ControlPlane, KeyRing, RepoAccess, SqlStore, WorkspaceRow};
use tower::ServiceExt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    InProcess,
    Socket,
}

pub const TICKET_SECRET: &[u8] = b"test-ticket-secret";

pub struct Harness {
    pub store: Arc<SqlStore>,
    pub workspace: WorkspaceRow,
    pub admin: String,
    pub operator: String,
    pub viewer: String,
    /// An operator of workspace `other`, which may use no local repository.
    pub other_operator: String,
    /// An admin of workspace `other`.
    pub other_admin: String,
    /// The keyring the server seals model keys with.
    pub keyring: Arc<KeyRing>,
    /// A real git repository (made by `git init`) the default workspace may use.
    pub repo: String,
    /// The server's dashboard sign-in codes and cookie sessions.
    pub signins: Arc<sortie_server::signin::SignIns>,
    pub router: Router,
    socket: Option<(String, reqwest::Client, tokio::sync::oneshot::Sender<()>)>,
    _database: TestDatabase,
    pub dir: tempfile::TempDir,
}

/// What the server answered.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub raw: Vec<u8>,
}

impl Reply {
    /// The error code of an error answer, or "" if there is none.
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

/// A request body.
pub enum Payload {
    Empty,
    Json(Value),
    Raw {
        content_type: Option<&'static str>,
        bytes: Vec<u8>,
    },
}

/// A repository with one commit on `main` (a session's `base` must name a branch it has).
pub fn git_init(path: &std::path::Path) {
    sortie_testkit::git::init(path);
    sortie_testkit::git::commit_files(path, &[], "first");
}

impl Harness {
    pub async fn start(transport: Transport, backend: TestBackend) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let database = TestDatabase::new(backend, dir.path()).await.expect("database");
        let store = Arc::new(SqlStore::connect(&database.url).await.expect("store"));
        let workspace = store
            .create_workspace(
                "default",
                RepoAccess {
                    any_local_path: true,
                    allowed_roots: vec![],
                },
            )
            .await
            .expect("workspace");
        let other = store
            .create_workspace(
                "other",
                RepoAccess {
                    any_local_path: false,
                    allowed_roots: vec!["/nonexistent-root".into()],
                },
            )
            .await
            .expect("other");
        let token = async |workspace_id: &str, role: Role| {
            let (token, hash) = tokens::generate_token().expect("token");
            store
                .create_token(workspace_id, role, &hash, None, None)
                .await
                .expect("store token");
            token
        };
        let admin = token(&workspace.id, Role::Admin).await;
        let operator = token(&workspace.id, Role::Operator).await;
        let viewer = token(&workspace.id, Role::Viewer).await;
        let other_operator = token(&other.id, Role::Operator).await;
        let other_admin = token(&other.id, Role::Admin).await;
        let keyring = Arc::new(KeyRing::generate().expect("keyring"));
        let repo_path = dir.path().join("repo");
        git_init(&repo_path);
        let repo = std::fs::canonicalize(&repo_path)
            .expect("canonical")
            .to_string_lossy()
            .into_owned();

        let signins = Arc::new(sortie_server::signin::SignIns::default());
        let state = ApiState {
            store: store.clone(),
            // One known agent this "host" lacks, as `sortie serve` reports an uninstalled one.
            agents: Arc::new(AgentCatalog {
                probe: Arc::new(std::collections::BTreeMap::from([(
                    "codex".to_owned(),
                    "sortie agents install codex".to_owned(),
                )])),
                ..AgentCatalog::default()
            }),
            ticket_secret: Secret::new(TICKET_SECRET.to_vec()),
            keyring: keyring.clone(),
            signins: signins.clone(),
            webhook_exempt: Default::default(),
        };
        let router = sortie_server::router(state.clone());
        let socket = match transport {
            Transport::InProcess => None,
            Transport::Socket => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let address = listener.local_addr().expect("address");
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                tokio::spawn(sortie_server::run(listener, state, async move {
                    let _ = stopped.await;
                }));
                Some((
                    format!("http://{address}"),
                    {
                        let _ = rustls::crypto::ring::default_provider().install_default();
                        reqwest::Client::new()
                    },
                    stop,
                ))
            }
        };
        Self {
            store,
            workspace,
            admin,
            operator,
            viewer,
            other_operator,
            other_admin,
            keyring,
            repo,
            signins,
            router,
            socket,
            _database: database,
            dir,
        }
    }

    pub async fn send(&self, method: Method, path: &str, token: Option<&str>, payload: Payload) -> Reply {
        self.send_with(method, path, token.map(|t| format!("Bearer {t}")), payload)
            .await
    }

    /// Sends with a raw `Authorization` header value (or none).
    pub async fn send_with(
        &self,
        method: Method,
        path: &str,
        authorization: Option<String>,
        payload: Payload,
    ) -> Reply {
        self.send_with_headers(method, path, authorization, &[], payload).await
    }

    /// `POST` of a JSON body with extra headers (e.g. `Idempotency-Key`).
    pub async fn post_with(&self, path: &str, token: &str, extra: &[(&str, &str)], body: Value) -> Reply {
        self.send_with_headers(
            Method::POST,
            path,
            Some(format!("Bearer {token}")),
            extra,
            Payload::Json(body),
        )
        .await
    }

    /// Sends with a raw `Authorization` header value (or none) and extra headers (small bodies only
    /// over the socket).
    pub async fn send_with_headers(
        &self,
        method: Method,
        path: &str,
        authorization: Option<String>,
        extra: &[(&str, &str)],
        payload: Payload,
    ) -> Reply {
        let (content_type, bytes) = match payload {
            Payload::Empty => (None, Vec::new()),
            Payload::Json(value) => (Some("application/json"), serde_json::to_vec(&value).expect("json")),
            Payload::Raw { content_type, bytes } => (content_type, bytes),
        };
        let (status, headers, raw) = match &self.socket {
            None => {
                let mut request = Request::builder().method(method).uri(path);
                if let Some(auth) = &authorization {
                    request = request.header("authorization", auth);
                }
                for (name, value) in extra {
                    request = request.header(*name, *value);
                }
                if let Some(content_type) = content_type {
                    request = request.header("content-type", content_type);
                }
                let response = self
                    .router
                    .clone()
                    .oneshot(request.body(Body::from(bytes)).expect("request"))
                    .await
                    .expect("infallible");
                let status = response.status();
                let headers = response.headers().clone();
                let raw = response.into_body().collect().await.expect("body").to_bytes().to_vec();
                (status, headers, raw)
            }
            Some((base, _, _)) if bytes.len() > 256 * 1024 => {
                raw_request(
                    base,
                    method.as_str(),
                    path,
                    authorization.as_deref(),
                    content_type,
                    &bytes,
                )
                .await
            }
            Some((base, client, _)) => {
                let method = reqwest::Method::from_bytes(method.as_str().as_bytes()).expect("method");
                let mut request = client.request(method, format!("{base}{path}")).body(bytes);
                if let Some(auth) = &authorization {
                    request = request.header("authorization", auth);
                }
                for (name, value) in extra {
                    request = request.header(*name, *value);
                }
                if let Some(content_type) = content_type {
                    request = request.header("content-type", content_type);
                }
                let response = request.send().await.expect("send");
                let status = StatusCode::from_u16(response.status().as_u16()).expect("status");
                let mut headers = HeaderMap::new();
                for (name, value) in response.headers() {
                    if let (Ok(name), Ok(value)) = (
                        axum::http::HeaderName::from_bytes(name.as_str().as_bytes()),
                        axum::http::HeaderValue::from_bytes(value.as_bytes()),
                    ) {
                        headers.append(name, value);
                    }
                }
                let raw = response.bytes().await.expect("body").to_vec();
                (status, headers, raw)
            }
        };
        let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
            raw,
        }
    }

    /// Opens `GET path` as a stream: the status and the body's chunks as they come (in process or over
    /// the socket), for server-sent events.
    pub async fn open_stream(
        &self,
        path: &str,
        token: &str,
        extra: &[(&str, &str)],
    ) -> (StatusCode, futures::stream::BoxStream<'static, Vec<u8>>) {
        use futures::StreamExt;
        match &self.socket {
            None => {
                let mut request = Request::builder()
                    .method(Method::GET)
                    .uri(path)
                    .header("authorization", format!("Bearer {token}"));
                for (name, value) in extra {
                    request = request.header(*name, *value);
                }
                let response = self
                    .router
                    .clone()
                    .oneshot(request.body(Body::empty()).expect("request"))
                    .await
                    .expect("infallible");
                let status = response.status();
                let body = response
                    .into_body()
                    .into_data_stream()
                    .take_while(|chunk| futures::future::ready(chunk.is_ok()))
                    .map(|chunk| chunk.map(|bytes| bytes.to_vec()).unwrap_or_default())
                    .boxed();
                (status, body)
            }
            Some((base, client, _)) => {
                let mut request = client.get(format!("{base}{path}")).bearer_auth(token);
                for (name, value) in extra {
                    request = request.header(*name, *value);
                }
                let response = request.send().await.expect("send");
                let status = StatusCode::from_u16(response.status().as_u16()).expect("status");
                let body = response
                    .bytes_stream()
                    .take_while(|chunk| futures::future::ready(chunk.is_ok()))
                    .map(|chunk| chunk.map(|bytes| bytes.to_vec()).unwrap_or_default())
                    .boxed();
                (status, body)
            }
        }
    }

    /// The base URL when the server listens on a socket.
    pub fn socket_address(&self) -> Option<&str> {
        self.socket.as_ref().map(|(base, _, _)| base.as_str())
    }

    pub async fn get(&self, path: &str, token: &str) -> Reply {
        self.send(Method::GET, path, Some(token), Payload::Empty).await
    }

    pub async fn post(&self, path: &str, token: &str, body: Value) -> Reply {
        self.send(Method::POST, path, Some(token), Payload::Json(body)).await
    }

    /// Creates a session on the test repository and returns its id.
    pub async fn create(&self, task: &str) -> String {
        let reply = self
            .post(
                "/v1/sessions",
                &self.operator,
                serde_json::json!({"repo": self.repo, "task": task, "agent": "scripted"}),
            )
            .await;
        assert_eq!(reply.status, StatusCode::ACCEPTED, "{:?}", reply.body);
        reply.body["id"].as_str().expect("id").to_owned()
    }

    /// How many sessions the default workspace has (archived or not).
    pub async fn session_count(&self) -> usize {
        let mut count = 0;
        for archived in [false, true] {
            let filter = sortie_store::SessionFilter {
                archived,
                limit: 1000,
                ..Default::default()
            };
            count += self
                .store
                .list_sessions(&self.workspace.id, &filter)
                .await
                .expect("list")
                .len();
        }
        count
    }
}

/// Sends one HTTP/1.1 request over a plain TCP stream and reads the answer, ignoring a failed write:
/// a server may answer an oversized body (413) and close before the client has written it all, which
/// an HTTP client library reports as a broken pipe instead of the answer.
async fn raw_request(
    base: &str,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> (StatusCode, HeaderMap, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {address}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if let Some(auth) = authorization {
        head.push_str(&format!("authorization: {auth}\r\n"));
    }
    if let Some(content_type) = content_type {
        head.push_str(&format!("content-type: {content_type}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP answer");
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status");
    let mut headers = HeaderMap::new();
    for line in head.lines().skip(1) {
        if let Some((name, value)) = line.split_once(':')
            && let (Ok(name), Ok(value)) = (
                axum::http::HeaderName::from_bytes(name.trim().as_bytes()),
                axum::http::HeaderValue::from_str(value.trim()),
            )
        {
            headers.append(name, value);
        }
    }
    let mut payload = answer[split + 4..].to_vec();
    if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"))
    {
        payload = dechunk(&payload);
    }
    (StatusCode::from_u16(status).expect("status"), headers, payload)
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&data[..end]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = &data[(start + size + 2).min(data.len())..];
    }
    out
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some((_, _, stop)) = self.socket.take() {
            let _ = stop.send(());
        }
    }
}
