//! The git smart-HTTP proxy (DESIGN §7.3) for local upstreams: `git http-backend` as CGI behind three
//! routes under `/_sortie/git/<session>.git/`, with every `receive-pack` request decided by
//! [`receive_pack::decide`] before a byte of it reaches git. A refusal drains the request (git
//! needs that to read the answer) and answers 200 with what `git push` prints. Only
//! `info/refs?service=…` and the two pack POSTs exist; no dumb-HTTP file is served, and no 401 or
//! redirect ever reaches the client.
//!
//! Forges are reached over TLS with the platform's roots (reqwest's rustls platform verifier) plus
//! any extra roots the operator trusts ([`ForgeTls`]); a certificate neither vouches for is a 502.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use sortie_protocol::SessionId;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::git::receive_pack::{self, Decision};

/// How much of a refused push's body is read (so git prints the reason, not a broken pipe)...
const REFUSED_PUSH_DRAIN_BYTES: usize = 64 << 20;
/// ...and for how long, before the answer goes out regardless.
const REFUSED_PUSH_DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Where a session's repository lives.
#[derive(Clone, PartialEq, Eq)]
pub enum Upstream {
    /// A repository on this machine (a bare repository or a `.git` directory), served by `git http-backend`.
    Local(PathBuf),
    /// A forge's smart-HTTP URL (`https://host/owner/repo.git`) and the token the gateway injects on
    /// every request; the sandbox never sees it.
    Remote { url: String, token: String },
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local(path) => f.debug_tuple("Local").field(path).finish(),
            Self::Remote { url, .. } => f
                .debug_struct("Remote")
                .field("url", url)
                .field("token", &"[redacted]")
                .finish(),
        }
    }
}

/// Which upstream a session pushes to and fetches from.
pub trait Upstreams: Send + Sync + 'static {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream>;
}

/// Which certificates the proxy trusts for forge upstreams, besides the platform's roots.
#[derive(Clone, Debug, Default)]
pub struct ForgeTls {
    /// PEM certificates trusted as roots in addition to the platform's (an internal forge's CA).
    pub extra_roots_pem: Vec<u8>,
}

/// Why the client for forges could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ForgeTlsError {
    #[error("the extra forge roots are not PEM certificates: {0}")]
    Pem(String),
    #[error("the extra forge roots hold no certificate")]
    NoCertificate,
    #[error("cannot build the HTTP client for forges: {0}")]
    Client(String),
}

/// The HTTP client for forge upstreams: the platform's roots and `tls`'s, and no redirect is ever
/// followed (the token would travel with it).
pub fn forge_client(tls: &ForgeTls) -> Result<reqwest::Client, ForgeTlsError> {
    // One TLS provider for the process (ring); installing it twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
    if !tls.extra_roots_pem.is_empty() {
        let roots = reqwest::Certificate::from_pem_bundle(&tls.extra_roots_pem)
            .map_err(|error| ForgeTlsError::Pem(error.to_string()))?;
        if roots.is_empty() {
            return Err(ForgeTlsError::NoCertificate);
        }
        builder = builder.tls_certs_merge(roots);
    }
    builder
        .build()
        .map_err(|error| ForgeTlsError::Client(error.to_string()))
}

#[derive(Clone)]
struct GitProxy {
    upstreams: Arc<dyn Upstreams>,
    git: PathBuf,
    /// For remote upstreams ([`forge_client`]); without one, forges answer 502.
    http: Option<reqwest::Client>,
}

/// The routes of the git proxy; `git` is the git binary that provides `http-backend`. Forges are
/// trusted by the platform's roots only.
pub fn router(upstreams: Arc<dyn Upstreams>, git: PathBuf) -> Router {
    let http = forge_client(&ForgeTls::default())
        .inspect_err(|error| tracing::error!(%error, "forge upstreams cannot be reached"))
        .ok();
    routes(upstreams, git, http)
}

/// The routes of the git proxy, trusting `tls`'s extra roots for forges too.
pub fn router_with_forge_tls(
    upstreams: Arc<dyn Upstreams>,
    git: PathBuf,
    tls: &ForgeTls,
) -> Result<Router, ForgeTlsError> {
    Ok(routes(upstreams, git, Some(forge_client(tls)?)))
}

/// The routes of the git proxy with a forge client made once by [`forge_client`] (a worker serves
/// many sessions with one).
pub fn router_with_client(upstreams: Arc<dyn Upstreams>, git: PathBuf, http: reqwest::Client) -> Router {
    routes(upstreams, git, Some(http))
}

fn routes(upstreams: Arc<dyn Upstreams>, git: PathBuf, http: Option<reqwest::Client>) -> Router {
    Router::new()
        .route("/_sortie/git/{repo}/info/refs", get(info_refs))
        .route("/_sortie/git/{repo}/git-upload-pack", post(upload_pack))
        .route("/_sortie/git/{repo}/git-receive-pack", post(receive_pack_route))
        .with_state(GitProxy { upstreams, git, http })
}

/// A refusal git shows to its user: text/plain, never 401 (git would ask for a password).
fn plain(status: StatusCode, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain")],
        format!("sortie: {message}\n"),
    )
        .into_response()
}

/// The session a repository path names and its upstream; `None` answers 404 (unknown and foreign
/// sessions look the same).
fn session_of(proxy: &GitProxy, repo: &str) -> Option<(SessionId, Upstream)> {
    let session = SessionId::parse(repo.strip_suffix(".git")?).ok()?;
    let upstream = proxy.upstreams.upstream(&session)?;
    Some((session, upstream))
}

/// Sends the request on to wherever the session's repository lives.
async fn forward(proxy: &GitProxy, upstream: &Upstream, request: Forwarded<'_>) -> Response {
    match upstream {
        Upstream::Local(path) => cgi(&proxy.git, path, request).await,
        Upstream::Remote { url, token } => match &proxy.http {
            Some(http) => remote(http, url, token, request).await,
            None => plain(StatusCode::BAD_GATEWAY, "the gateway cannot reach forges"),
        },
    }
}

/// One request on its way upstream: what the client asked for, and the body (the bytes already read
/// to decide on it, then the rest).
struct Forwarded<'a> {
    method: &'a str,
    tail: &'a str,
    query: &'a str,
    headers: &'a HeaderMap,
    prefix: Bytes,
    body: Option<Body>,
}

/// A forge upstream: the credential is injected here, the client's own `Authorization` and cookies
/// are dropped, and neither a 401 nor a redirect is relayed (git would prompt for a password, or
/// follow the redirect around the proxy).
/// The `Authorization` value a forge gets for `token`: Basic `x-access-token:<token>`, as GitHub
/// takes installation and personal tokens over smart HTTP (the worker's mirror fetch sends the same).
pub fn forge_authorization(token: &[u8]) -> String {
    use base64::Engine;
    let mut basic = b"x-access-token:".to_vec();
    basic.extend_from_slice(token);
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(basic))
}

async fn remote(http: &reqwest::Client, url: &str, token: &str, request: Forwarded<'_>) -> Response {
    let Forwarded {
        method,
        tail,
        query,
        headers,
        prefix,
        body,
    } = request;
    let mut target = format!("{}/{tail}", url.trim_end_matches('/'));
    if !query.is_empty() {
        target.push('?');
        target.push_str(query);
    }
    let method = if method == "POST" {
        reqwest::Method::POST
    } else {
        reqwest::Method::GET
    };
    let mut request = http
        .request(method, target)
        .header(header::AUTHORIZATION, forge_authorization(token.as_bytes()));
    for name in [header::CONTENT_TYPE, header::ACCEPT, header::CONTENT_ENCODING] {
        if let Some(value) = headers.get(&name) {
            request = request.header(name, value);
        }
    }
    if tail != "git-receive-pack"
        && let Some(protocol) = headers.get("git-protocol")
    {
        request = request.header("git-protocol", protocol);
    }
    if let Some(body) = body {
        let rest = body.into_data_stream();
        let stream = futures::stream::once(async move { Ok::<_, axum::Error>(prefix) }).chain(rest);
        request = request.body(reqwest::Body::wrap_stream(stream));
    }
    let answer = match request.send().await {
        Ok(answer) => answer,
        Err(error) => {
            let tls = tls_failure(&error);
            tracing::warn!(error = %error, tls = ?tls, "forge unreachable");
            return plain(
                StatusCode::BAD_GATEWAY,
                match tls {
                    Some(rustls::Error::InvalidCertificate(_)) => {
                        "the repository's forge presented a certificate this gateway does not trust"
                    }
                    Some(_) => "TLS with the repository's forge failed",
                    None => "the repository's forge did not answer",
                },
            );
        }
    };
    let status = answer.status();
    if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
        return plain(StatusCode::BAD_GATEWAY, "upstream rejected the proxy's credentials");
    }
    if status.is_redirection() {
        return plain(
            StatusCode::BAD_GATEWAY,
            "upstream answered with a redirect; not followed",
        );
    }
    // git checks the content type (`application/x-git-*-advertisement|result`); cookies stay out.
    let mut kept = HeaderMap::new();
    for name in [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::EXPIRES,
        header::PRAGMA,
    ] {
        if let Some(value) = answer
            .headers()
            .get(name.as_str())
            .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
        {
            kept.insert(name, value);
        }
    }
    let mut response = Response::new(Body::from_stream(answer.bytes_stream()));
    *response.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = kept;
    response
}

/// The TLS error behind a failed request, if that is what failed it.
fn tls_failure<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        current = match error.downcast_ref::<std::io::Error>() {
            // An io::Error hides what it wraps from `source()` (and may wrap another io::Error).
            Some(io) => io.get_ref().map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => error.source(),
        };
    }
    None
}

fn no_such_repository() -> Response {
    plain(StatusCode::NOT_FOUND, "no such repository")
}

async fn info_refs(
    State(proxy): State<GitProxy>,
    UrlPath(repo): UrlPath<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let query = query.unwrap_or_default();
    if query != "service=git-upload-pack" && query != "service=git-receive-pack" {
        return plain(StatusCode::FORBIDDEN, "only smart HTTP is served");
    }
    let Some((_, upstream)) = session_of(&proxy, &repo) else {
        return no_such_repository();
    };
    let request = Forwarded {
        method: "GET",
        tail: "info/refs",
        query: &query,
        headers: &headers,
        prefix: Bytes::new(),
        body: None,
    };
    forward(&proxy, &upstream, request).await
}

async fn upload_pack(
    State(proxy): State<GitProxy>,
    UrlPath(repo): UrlPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some((_, upstream)) = session_of(&proxy, &repo) else {
        return no_such_repository();
    };
    let request = Forwarded {
        method: "POST",
        tail: "git-upload-pack",
        query: "",
        headers: &headers,
        prefix: Bytes::new(),
        body: Some(body),
    };
    forward(&proxy, &upstream, request).await
}

async fn receive_pack_route(
    State(proxy): State<GitProxy>,
    UrlPath(repo): UrlPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some((session, upstream)) = session_of(&proxy, &repo) else {
        return no_such_repository();
    };
    if headers.get(header::CONTENT_ENCODING).is_some() {
        // git never compresses receive-pack bodies; a body this proxy cannot read is not forwarded.
        return plain(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "compressed push requests are not accepted",
        );
    }
    let mut stream = body.into_data_stream();
    let mut head = Vec::new();
    let decision = loop {
        let decision = receive_pack::decide(&head, session.as_str(), false);
        if decision != Decision::NeedMore {
            break decision;
        }
        match stream.next().await {
            Some(Ok(chunk)) => head.extend_from_slice(&chunk),
            Some(Err(_)) => return plain(StatusCode::BAD_REQUEST, "the push request broke off"),
            None => break receive_pack::decide(&head, session.as_str(), true),
        }
    };
    match decision {
        Decision::Refuse {
            reason,
            refnames,
            side_band,
        } => {
            tracing::warn!(session = %session, %reason, "push refused");
            metrics::counter!("sortie_git_pushes_total", "decision" => "refused").increment(1);
            // Read the rest before answering: git reports a broken pipe instead of the reason otherwise.
            // Bounded: a refused push may not hold the proxy with an endless body.
            let drain = async {
                let mut read = 0_usize;
                while let Some(Ok(chunk)) = stream.next().await {
                    read += chunk.len();
                    if read > REFUSED_PUSH_DRAIN_BYTES {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(REFUSED_PUSH_DRAIN_DEADLINE, drain).await;
            report_status(receive_pack::refusal(&reason, &refnames, side_band))
        }
        Decision::Probe | Decision::Allow { .. } => {
            let counted = if decision == Decision::Probe {
                "probe"
            } else {
                "forwarded"
            };
            metrics::counter!("sortie_git_pushes_total", "decision" => counted).increment(1);
            let rest = Body::from_stream(stream);
            let request = Forwarded {
                method: "POST",
                tail: "git-receive-pack",
                query: "",
                headers: &headers,
                prefix: Bytes::from(head),
                body: Some(rest),
            };
            let answer = forward(&proxy, &upstream, request).await;
            match decision {
                Decision::Allow { updates, side_band } if !answer.status().is_success() => {
                    failed_push(&session, answer, &updates, side_band).await
                }
                _ => answer,
            }
        }
        Decision::NeedMore => plain(StatusCode::BAD_REQUEST, "the push request ended early"),
    }
}

/// How long the body of an upstream's failed answer to a push is waited for.
const FAILED_PUSH_BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// A push the upstream did not take (it refused the credential, redirected, failed): git prints only
/// "HTTP 502" for a failed pack POST, so the reason goes back as report-status `ng` lines instead.
async fn failed_push(
    session: &SessionId,
    answer: Response,
    updates: &[receive_pack::RefUpdate],
    side_band: bool,
) -> Response {
    let status = answer.status();
    let ours = answer
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/plain"));
    // Bounded in size and in time: a failing upstream may also stall.
    let text = tokio::time::timeout(
        FAILED_PUSH_BODY_DEADLINE,
        axum::body::to_bytes(answer.into_body(), 4096),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let said = text.trim().trim_start_matches("sortie: ");
    let reason = if ours && !said.is_empty() {
        said.to_owned()
    } else {
        format!("the repository's upstream answered {status}")
    };
    tracing::warn!(session = %session, %reason, "push failed upstream");
    metrics::counter!("sortie_git_pushes_total", "decision" => "failed_upstream").increment(1);
    let refnames: Vec<String> = updates.iter().map(|u| u.refname.clone()).collect();
    report_status(receive_pack::refusal(&reason, &refnames, side_band))
}

/// A receive-pack answer of sortie's own (a report-status `git push` prints).
fn report_status(body: Vec<u8>) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/x-git-receive-pack-result"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// Runs `git http-backend` for one request: `prefix` then `body` go to its stdin; its CGI answer is
/// turned into the response, its body streamed.
async fn cgi(git: &Path, repo: &Path, request: Forwarded<'_>) -> Response {
    let Forwarded {
        method,
        tail,
        query,
        headers,
        prefix,
        body,
    } = request;
    let (Some(root), Some(name)) = (repo.parent(), repo.file_name()) else {
        return plain(StatusCode::BAD_GATEWAY, "the upstream repository path is not usable");
    };
    let mut command = tokio::process::Command::new(git);
    command
        .arg("http-backend")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("GIT_PROJECT_ROOT", root)
        // Built from the configured repository, never from the client's path.
        .env("PATH_INFO", format!("/{}/{tail}", name.to_string_lossy()))
        .env("REQUEST_METHOD", method)
        .env("QUERY_STRING", query)
        .env("SERVER_PROTOCOL", "HTTP/1.1")
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("GIT_CONFIG_COUNT", "3")
        .env("GIT_CONFIG_KEY_0", "http.receivepack")
        .env("GIT_CONFIG_VALUE_0", "true")
        .env("GIT_CONFIG_KEY_1", "safe.directory")
        .env("GIT_CONFIG_VALUE_1", "*")
        .env("GIT_CONFIG_KEY_2", "http.getanyfile")
        .env("GIT_CONFIG_VALUE_2", "false")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(content_type) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
        command.env("CONTENT_TYPE", content_type);
    }
    if let Some(encoding) = headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) {
        command.env("HTTP_CONTENT_ENCODING", encoding);
    }
    if tail != "git-receive-pack"
        && let Some(protocol) = headers.get("git-protocol").and_then(|v| v.to_str().ok())
    {
        command.env("GIT_PROTOCOL", protocol);
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            tracing::error!(%error, "cannot run git http-backend");
            return plain(StatusCode::BAD_GATEWAY, "the git backend could not be started");
        }
    };
    let (Some(mut stdin), Some(stdout), Some(mut stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return plain(StatusCode::BAD_GATEWAY, "the git backend has no pipes");
    };
    tokio::spawn(async move {
        if !prefix.is_empty() && stdin.write_all(&prefix).await.is_err() {
            return;
        }
        if let Some(body) = body {
            let mut stream = body.into_data_stream();
            while let Some(Ok(chunk)) = stream.next().await {
                if stdin.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        }
        let _ = stdin.shutdown().await;
    });
    tokio::spawn(async move {
        let mut said = String::new();
        let _ = stderr.read_to_string(&mut said).await;
        if !said.trim().is_empty() {
            tracing::debug!(stderr = %said.trim(), "git http-backend");
        }
    });

    let mut reader = BufReader::new(stdout);
    let mut status = StatusCode::OK;
    let mut response_headers = HeaderMap::new();
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => return plain(StatusCode::BAD_GATEWAY, "the git backend gave no answer"),
            Ok(_) => {}
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("status") {
            status = value
                .split_whitespace()
                .next()
                .and_then(|code| code.parse().ok())
                .and_then(|code| StatusCode::from_u16(code).ok())
                .unwrap_or(StatusCode::BAD_GATEWAY);
        } else if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response_headers.insert(name, value);
        }
    }
    if status == StatusCode::UNAUTHORIZED || status.is_redirection() {
        return plain(
            StatusCode::BAD_GATEWAY,
            "the git backend asked for credentials or redirected; not relayed",
        );
    }
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    let body = Body::from_stream(tokio_util::io::ReaderStream::new(reader));
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = response_headers;
    response
}
