//! The git smart-HTTP proxy (DESIGN §7.3): three routes under `/_sortie/git/<session>.git/` in
//! front of the session's upstream — `git http-backend` as CGI for a repository on this machine, or
//! a forge over HTTPS with the token injected here. Only `info/refs?service=…` and the two pack
//! POSTs exist; no dumb-HTTP file is served, and no 401 or redirect ever reaches the client.
//!
//! Every `receive-pack` request is decided by [`receive_pack::decide`] before a byte of it reaches
//! the upstream; an allowed push is then spooled into a quarantine and scanned for secrets
//! ([`scan`]), forwarded only if clean, and the upstream's report-status is read
//! ([`report_status`]) to record the push in the session's [`PushLedger`]: the host's own record of
//! what was delivered. A refusal drains the request (git needs that to read the answer) and answers
//! 200 with what `git push` prints.
//!
//! Host git (S5, S6): `http-backend` runs as the repository's owner when that is not root, with hooks
//! off and no `safe.directory` override, at most a few at a time per session, each in the session's
//! cgroup ([`process`]).
//!
//! Forges are reached over TLS with the platform's roots (reqwest's rustls platform verifier) plus
//! any extra roots the operator trusts ([`ForgeTls`]); a certificate neither vouches for is a 502.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use sortie_protocol::SessionId;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::git::config::{ForeignOwner, GitProxyConfig, PushOutcome, PushRecord};
pub use crate::git::process::GitChildren;
use crate::git::process::{self, GitCommand, Spawner};
use crate::git::receive_pack::{self, Decision, RefUpdate};
use crate::git::report_status;
use crate::git::scan::{self, ObjectFormat, Quarantine, ScanContext, SpoolError, Verdict};

/// How much of a refused push's body is read (so git prints the reason, not a broken pipe)...
const REFUSED_PUSH_DRAIN_BYTES: usize = 64 << 20;
/// ...and for how long, before the answer goes out regardless.
const REFUSED_PUSH_DRAIN_DEADLINE: Duration = Duration::from_secs(30);
/// The most of an upstream's answer to a push that is read (a report-status is a few lines, plus
/// progress); a longer one leaves the push unconfirmed.
const MAX_PUSH_ANSWER: usize = 4 << 20;
/// The most CGI header bytes `http-backend` may print.
const MAX_CGI_HEADERS: usize = 64 << 10;

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

    /// The forge refused `refused`'s credential (a 401 to a ref advertisement, the first request of
    /// every fetch and push): a fresh upstream if whoever holds the credential can get one (a GitHub
    /// App's installation token, minted again); `None` leaves the refusal as it is.
    fn refresh<'a>(
        &'a self,
        _session_id: &'a SessionId,
        _refused: &'a Upstream,
    ) -> futures::future::BoxFuture<'a, Option<Upstream>> {
        Box::pin(async { None })
    }
}

/// Marks a forge's 401 on the answer the client gets (a 502), so a ref advertisement can be asked
/// again with a fresh credential.
#[derive(Clone, Copy)]
struct CredentialsRefused;

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
///
/// One client per distinct `tls` for the process, shared by every caller (the worker and each
/// session's model proxy): building one loads and parses the platform's whole CA bundle, which cost
/// each session start ~3 ms of CPU and ~0.2 MiB. Sharing the client shares its connection pool; every
/// request carries its own credential, as through any proxy.
pub fn forge_client(tls: &ForgeTls) -> Result<reqwest::Client, ForgeTlsError> {
    // Keyed by the operator's configured roots: a handful of distinct values in one process.
    static BUILT: std::sync::Mutex<Vec<(Vec<u8>, reqwest::Client)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, client)) = built.iter().find(|(roots, _)| *roots == tls.extra_roots_pem) {
        return Ok(client.clone());
    }
    let client = build_forge_client(tls)?;
    built.push((tls.extra_roots_pem.clone(), client.clone()));
    Ok(client)
}

fn build_forge_client(tls: &ForgeTls) -> Result<reqwest::Client, ForgeTlsError> {
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

/// One session's proxy: its configuration and its slots.
#[derive(Clone)]
struct GitProxy(Arc<Inner>);

struct Inner {
    config: GitProxyConfig,
    /// Upstream requests in flight (each a `git http-backend` child for a local upstream).
    slots: Arc<Semaphore>,
    /// One push at a time (each spools up to `max_push_bytes` to disk).
    pushes: Arc<Semaphore>,
    /// Where this session's git children start.
    spawner: Arc<Spawner>,
}

/// The routes of one session's git proxy.
pub fn router(config: GitProxyConfig) -> Router {
    router_and_children(config).0
}

/// The routes of one session's git proxy, and the handle that parks its git children ahead.
pub fn router_and_children(config: GitProxyConfig) -> (Router, GitChildren) {
    let slots = Arc::new(Semaphore::new(config.processes.max_concurrent.max(1)));
    let spawner = Spawner::new(config.processes.cgroup_procs.clone(), config.processes.launcher.clone());
    let routes = Router::new()
        .route("/_sortie/git/{repo}/info/refs", get(info_refs))
        .route("/_sortie/git/{repo}/git-upload-pack", post(upload_pack))
        .route("/_sortie/git/{repo}/git-receive-pack", post(receive_pack_route))
        .with_state(GitProxy(Arc::new(Inner {
            slots,
            pushes: Arc::new(Semaphore::new(1)),
            spawner: spawner.clone(),
            config,
        })));
    (routes, GitChildren(spawner))
}

impl GitProxy {
    fn config(&self) -> &GitProxyConfig {
        &self.0.config
    }

    /// A slot for one upstream request, waited for briefly.
    async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        let wait = self.config().processes.queue_wait;
        match tokio::time::timeout(wait, self.0.slots.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Some(permit),
            _ => {
                metrics::counter!("sortie_git_requests_refused_total", "reason" => "busy").increment(1);
                None
            }
        }
    }

    async fn record(&self, session: &SessionId, updates: &[RefUpdate], outcome: PushOutcome) {
        metrics::counter!("sortie_git_push_outcomes_total", "outcome" => outcome.as_str()).increment(1);
        let ledger = &self.config().ledger;
        if updates.is_empty() {
            ledger
                .record(PushRecord {
                    session_id: session.clone(),
                    update: None,
                    outcome,
                })
                .await;
            return;
        }
        for update in updates {
            ledger
                .record(PushRecord {
                    session_id: session.clone(),
                    update: Some(update.clone()),
                    outcome: outcome.clone(),
                })
                .await;
        }
    }
}

fn busy() -> Response {
    plain(
        StatusCode::SERVICE_UNAVAILABLE,
        "too many git requests of this session at once; try again",
    )
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
    let upstream = proxy.config().upstreams.upstream(&session)?;
    Some((session, upstream))
}

/// Sends the request on to wherever the session's repository lives; `slot` is held as long as
/// the upstream works on it.
async fn forward(
    proxy: &GitProxy,
    upstream: &Upstream,
    request: Forwarded<'_>,
    slot: OwnedSemaphorePermit,
) -> Response {
    match upstream {
        Upstream::Local(path) => cgi(proxy.config(), &proxy.0.spawner, path, request, slot).await,
        Upstream::Remote { url, token } => match &proxy.config().forge_http {
            Some(http) => remote(http, url, token, request, slot).await,
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

/// The `Authorization` value a forge gets for `token`: Basic `x-access-token:<token>`, as GitHub
/// takes installation and personal tokens over smart HTTP (the worker's mirror fetch sends the same).
pub fn forge_authorization(token: &[u8]) -> String {
    use base64::Engine;
    let mut basic = b"x-access-token:".to_vec();
    basic.extend_from_slice(token);
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(basic))
}

/// A forge upstream: the credential is injected here, the client's own `Authorization` and cookies
/// are dropped, and neither a 401 nor a redirect is relayed (git would prompt for a password, or
/// follow the redirect around the proxy). `slot` is held until the answer's body is done.
async fn remote(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    request: Forwarded<'_>,
    slot: OwnedSemaphorePermit,
) -> Response {
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
        let mut refused = plain(StatusCode::BAD_GATEWAY, "upstream rejected the proxy's credentials");
        if status == reqwest::StatusCode::UNAUTHORIZED {
            refused.extensions_mut().insert(CredentialsRefused);
        }
        return refused;
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
    let body = answer.bytes_stream().map(move |chunk| {
        let _held = &slot;
        chunk
    });
    let mut response = Response::new(Body::from_stream(body));
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
    let Some((session, upstream)) = session_of(&proxy, &repo) else {
        return no_such_repository();
    };
    let advertisement = |upstream: Upstream| {
        let proxy = proxy.clone();
        let (query, headers) = (&query, &headers);
        async move {
            let Some(slot) = proxy.slot().await else {
                return busy();
            };
            let request = Forwarded {
                method: "GET",
                tail: "info/refs",
                query,
                headers,
                prefix: Bytes::new(),
                body: None,
            };
            forward(&proxy, &upstream, request, slot).await
        }
    };
    let answer = advertisement(upstream.clone()).await;
    if answer.extensions().get::<CredentialsRefused>().is_none() {
        return answer;
    }
    // A refused credential may have run out (an installation token lives an hour): once, with a
    // fresh one, if there is one. The rest of the fetch or push then goes with it.
    match proxy.config().upstreams.refresh(&session, &upstream).await {
        Some(fresh) => {
            tracing::info!(session = %session, "the forge refused the credential; asked again with a fresh one");
            advertisement(fresh).await
        }
        None => answer,
    }
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
    let Some(slot) = proxy.slot().await else {
        return busy();
    };
    let request = Forwarded {
        method: "POST",
        tail: "git-upload-pack",
        query: "",
        headers: &headers,
        prefix: Bytes::new(),
        body: Some(body),
    };
    forward(&proxy, &upstream, request, slot).await
}

/// Reads the rest of a refused push before the answer (git prints a broken pipe instead of the
/// reason otherwise), bounded: a refused push may not hold the proxy with an endless body.
async fn drain(stream: &mut (impl futures::Stream<Item = Result<Bytes, axum::Error>> + Unpin)) {
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
        let reason = "compressed push requests are not accepted";
        proxy
            .record(&session, &[], PushOutcome::Refused { reason: reason.into() })
            .await;
        return plain(StatusCode::UNSUPPORTED_MEDIA_TYPE, reason);
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
            updates,
            side_band,
        } => {
            tracing::warn!(session = %session, %reason, "push refused");
            metrics::counter!("sortie_git_pushes_total", "decision" => "refused").increment(1);
            drain(&mut stream).await;
            proxy
                .record(&session, &updates, PushOutcome::Refused { reason: reason.clone() })
                .await;
            report_status(receive_pack::refusal(&reason, &Decision::refnames(&updates), side_band))
        }
        Decision::Probe => {
            metrics::counter!("sortie_git_pushes_total", "decision" => "probe").increment(1);
            let Some(slot) = proxy.slot().await else {
                return busy();
            };
            let request = Forwarded {
                method: "POST",
                tail: "git-receive-pack",
                query: "",
                headers: &headers,
                prefix: Bytes::from(head),
                body: Some(Body::from_stream(stream)),
            };
            forward(&proxy, &upstream, request, slot).await
        }
        Decision::Allow {
            updates,
            side_band,
            pack_offset,
        } => {
            let push = Push {
                session: &session,
                upstream: &upstream,
                headers: &headers,
                updates: &updates,
                side_band,
                pack_offset,
            };
            let (outcome, answer) = push.run(&proxy, &head, &mut stream).await;
            if let PushOutcome::Refused { reason } | PushOutcome::SecretDetected { reason } = &outcome {
                tracing::warn!(session = %session, %reason, outcome = outcome.as_str(), "push refused");
                let decision = if matches!(outcome, PushOutcome::SecretDetected { .. }) {
                    "secret_detected"
                } else {
                    "refused"
                };
                metrics::counter!("sortie_git_pushes_total", "decision" => decision).increment(1);
            }
            answer
        }
        Decision::NeedMore => plain(StatusCode::BAD_REQUEST, "the push request ended early"),
    }
}

/// One allowed push, from the spool to the ledger.
struct Push<'a> {
    session: &'a SessionId,
    upstream: &'a Upstream,
    headers: &'a HeaderMap,
    updates: &'a [RefUpdate],
    side_band: bool,
    pack_offset: usize,
}

impl Push<'_> {
    /// Quarantines, scans and (if clean) forwards the push; records every ref's outcome in the
    /// ledger and returns the first outcome with the answer for the client.
    async fn run(
        &self,
        proxy: &GitProxy,
        head: &[u8],
        stream: &mut (impl futures::Stream<Item = Result<Bytes, axum::Error>> + Unpin),
    ) -> (PushOutcome, Response) {
        let verdict = self.check(proxy, head, stream).await;
        // The push's own turn is held until its answer is read: one push at a time, start to end.
        let (quarantine, slot, _one_push) = match verdict {
            Ok(ready) => ready,
            Err(outcome) => {
                let reason = match &outcome {
                    PushOutcome::Refused { reason }
                    | PushOutcome::SecretDetected { reason }
                    | PushOutcome::UpstreamRejected { reason } => reason.clone(),
                    PushOutcome::Accepted => String::new(),
                };
                proxy.record(self.session, self.updates, outcome.clone()).await;
                let answer = receive_pack::refusal(&reason, &Decision::refnames(self.updates), self.side_band);
                return (outcome, report_status(answer));
            }
        };
        metrics::counter!("sortie_git_pushes_total", "decision" => "forwarded").increment(1);
        let body = match tokio::fs::File::open(quarantine.request_path()).await {
            Ok(file) => Body::from_stream(tokio_util::io::ReaderStream::new(file)),
            Err(error) => {
                let outcome = PushOutcome::Refused {
                    reason: format!("the gateway cannot read the spooled push: {error}"),
                };
                return self.refuse_after_spool(proxy, outcome).await;
            }
        };
        let request = Forwarded {
            method: "POST",
            tail: "git-receive-pack",
            query: "",
            headers: self.headers,
            prefix: Bytes::new(),
            body: Some(body),
        };
        let answer = forward(proxy, self.upstream, request, slot).await;
        if !answer.status().is_success() {
            let (reason, answer) = failed_push(self.session, answer, self.updates, self.side_band).await;
            let outcome = PushOutcome::UpstreamRejected { reason };
            proxy.record(self.session, self.updates, outcome.clone()).await;
            return (outcome, answer);
        }
        let (parts, body) = answer.into_parts();
        let deadline = proxy.config().pushes.answer_deadline;
        let read = tokio::time::timeout(deadline, axum::body::to_bytes(body, MAX_PUSH_ANSWER)).await;
        let Ok(Ok(bytes)) = read else {
            let reason = "the upstream's answer to the push could not be read, so whether it landed is unknown";
            let outcome = PushOutcome::UpstreamRejected { reason: reason.into() };
            proxy.record(self.session, self.updates, outcome.clone()).await;
            let answer = receive_pack::refusal(reason, &Decision::refnames(self.updates), self.side_band);
            return (outcome, report_status(answer));
        };
        let report = report_status::parse(&bytes, self.side_band);
        let outcomes: Vec<PushOutcome> = self
            .updates
            .iter()
            .map(|update| match &report {
                Ok(report) => match report.rejection(&update.refname) {
                    None => PushOutcome::Accepted,
                    Some(reason) => PushOutcome::UpstreamRejected { reason },
                },
                Err(error) => PushOutcome::UpstreamRejected {
                    reason: error.to_string(),
                },
            })
            .collect();
        if outcomes.contains(&PushOutcome::Accepted) {
            // Before the ledger hears of it: later pushes build on this one (its objects must resolve
            // in their quarantines), and a ledger may read the delivered history at once.
            let delivered = proxy.config().delivered_objects.clone();
            if let Err(error) = quarantine.keep_objects(&delivered) {
                tracing::warn!(session = %self.session, %error, "cannot keep the objects of an accepted push");
            }
        }
        for (update, outcome) in self.updates.iter().zip(&outcomes) {
            tracing::info!(session = %self.session, refname = %update.refname, new = %update.new, outcome = outcome.as_str(), "push forwarded");
            proxy
                .record(self.session, std::slice::from_ref(update), outcome.clone())
                .await;
        }
        let outcome = outcomes.into_iter().next().unwrap_or(PushOutcome::UpstreamRejected {
            reason: "the push named no ref".into(),
        });
        (outcome, Response::from_parts(parts, Body::from(bytes)))
    }

    async fn refuse_after_spool(&self, proxy: &GitProxy, outcome: PushOutcome) -> (PushOutcome, Response) {
        let reason = match &outcome {
            PushOutcome::Refused { reason } => reason.clone(),
            _ => String::new(),
        };
        proxy.record(self.session, self.updates, outcome.clone()).await;
        let answer = receive_pack::refusal(&reason, &Decision::refnames(self.updates), self.side_band);
        (outcome, report_status(answer))
    }

    /// Spools the request into a fresh quarantine and scans it; `Ok` with the quarantine, an
    /// upstream slot and the session's push turn when the push may be forwarded, else the outcome
    /// to record.
    async fn check(
        &self,
        proxy: &GitProxy,
        head: &[u8],
        stream: &mut (impl futures::Stream<Item = Result<Bytes, axum::Error>> + Unpin),
    ) -> Result<(Quarantine, OwnedSemaphorePermit, OwnedSemaphorePermit), PushOutcome> {
        let config = proxy.config();
        let refused = |reason: String| PushOutcome::Refused { reason };
        let wait = config.processes.queue_wait;
        let Ok(Ok(one_push)) = tokio::time::timeout(wait, proxy.0.pushes.clone().acquire_owned()).await else {
            drain(stream).await;
            return Err(refused(
                "another push of this session is still being checked; push again".into(),
            ));
        };
        let format = self
            .updates
            .first()
            .map_or(ObjectFormat::Sha1, |u| ObjectFormat::of(&u.new));
        let mut trusted = vec![config.delivered_objects.clone()];
        trusted.extend(config.trusted_object_dirs.iter().cloned());
        if let Upstream::Local(path) = self.upstream {
            // The upstream's own objects, read only (nothing runs in it): parents the agent fetched
            // after the session's mirror was made resolve too.
            trusted.push(local_objects(path));
        }
        let quarantine = scan::create_private_dir(&config.delivered_objects)
            .and_then(|()| Quarantine::create(&config.quarantine_dir, format, &trusted));
        let quarantine = match quarantine {
            Ok(quarantine) => quarantine,
            Err(error) => {
                tracing::error!(session = %self.session, %error, "cannot make a quarantine for a push");
                drain(stream).await;
                return Err(refused("the gateway cannot check the push right now".into()));
            }
        };
        let spooled = scan::spool(
            &quarantine.request_path(),
            head,
            stream,
            config.pushes.max_push_bytes,
            config.processes.body_idle_timeout,
        )
        .await;
        match spooled {
            Ok(_) => {}
            Err(error @ SpoolError::TooLarge(_)) => {
                drain(stream).await;
                return Err(refused(error.to_string()));
            }
            Err(error) => return Err(refused(error.to_string())),
        }
        let Some(slot) = proxy.slot().await else {
            return Err(refused(
                "too many git requests of this session at once; push again".into(),
            ));
        };
        let known = config.known_secrets.known_secrets().await;
        let context = ScanContext {
            git: &config.git,
            spawner: &proxy.0.spawner,
            known: &known,
        };
        let deadline = config.pushes.scan_deadline;
        let verdict = tokio::time::timeout(
            deadline,
            scan::scan(&context, &quarantine, self.pack_offset as u64, self.updates),
        )
        .await
        .unwrap_or_else(|_| {
            Verdict::Unverifiable(format!(
                "the secret scan did not finish within {} s",
                deadline.as_secs()
            ))
        });
        match verdict {
            Verdict::Clean => Ok((quarantine, slot, one_push)),
            Verdict::Secret(reason) => Err(PushOutcome::SecretDetected { reason }),
            Verdict::Unverifiable(reason) => Err(refused(reason)),
        }
    }
}

/// The object directory of a local repository (bare, or a work tree's `.git`).
fn local_objects(repo: &Path) -> PathBuf {
    let bare = repo.join("objects");
    if bare.is_dir() { bare } else { repo.join(".git/objects") }
}

/// How long the body of an upstream's failed answer to a push is waited for.
const FAILED_PUSH_BODY_DEADLINE: Duration = Duration::from_secs(5);

/// A push the upstream did not take (it refused the credential, redirected, failed): git prints only
/// "HTTP 502" for a failed pack POST, so the reason goes back as report-status `ng` lines instead.
async fn failed_push(
    session: &SessionId,
    answer: Response,
    updates: &[RefUpdate],
    side_band: bool,
) -> (String, Response) {
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
    let answer = report_status(receive_pack::refusal(&reason, &Decision::refnames(updates), side_band));
    (reason, answer)
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

/// Runs the repository's automatic maintenance (`git maintenance run --auto`: packs loose objects once
/// there are enough, as receive-pack would have) after a push was answered, as receive-pack's own
/// child would have run: in the session's cgroup, as the repository's owner, hooks off; bounded like
/// any git child.
async fn maintain_after(spawner: &Arc<Spawner>, command: GitCommand, lifetime: Duration) {
    let Ok(process::Spawned { mut child, stdin, .. }) = spawner.spawn(command).await else {
        tracing::warn!("cannot start the repository's maintenance after a push");
        return;
    };
    drop(stdin);
    if tokio::time::timeout(lifetime, child.wait()).await.is_err() {
        tracing::warn!("the repository's maintenance after a push ran too long; killed");
        process::kill_all(&mut child).await;
    }
}

/// Runs `git http-backend` for one request: `prefix` then `body` go to its stdin; its CGI answer is
/// turned into the response, its body streamed. The child runs as the repository's owner (when this
/// process is root and the owner is not), in the session's cgroup, with hooks off; `slot` is held
/// until it has ended (after a push, with the repository's maintenance).
async fn cgi(
    config: &GitProxyConfig,
    spawner: &Arc<Spawner>,
    repo: &Path,
    request: Forwarded<'_>,
    slot: OwnedSemaphorePermit,
) -> Response {
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
    let identity = match process::identity_for(repo) {
        Ok(identity) => identity,
        Err(error) => {
            tracing::error!(%error, repo = %repo.display(), "cannot read the upstream repository");
            return plain(StatusCode::BAD_GATEWAY, "the upstream repository cannot be read");
        }
    };
    if identity.is_some() && config.foreign_owner == ForeignOwner::Refuse {
        return plain(
            StatusCode::FORBIDDEN,
            "the upstream repository belongs to another user; this gateway does not serve it",
        );
    }
    let backend = match &config.http_backend {
        Some(backend) => GitCommand::new(backend),
        None => GitCommand::new(&config.git).arg("http-backend"),
    };
    let mut command = backend
        .env("GIT_PROJECT_ROOT", root)
        // Built from the configured repository, never from the client's path.
        .env("PATH_INFO", format!("/{}/{tail}", name.to_string_lossy()))
        .env("REQUEST_METHOD", method)
        .env("QUERY_STRING", query)
        .env("SERVER_PROTOCOL", "HTTP/1.1")
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .config(&[
            ("http.receivepack", "true".into()),
            ("http.getanyfile", "false".into()),
            // Never a hook: whoever owns the repository, nothing of theirs runs for a sandbox's push.
            ("core.hooksPath", "/dev/null".into()),
            ("receive.maxInputSize", config.pushes.max_push_bytes.to_string()),
            // Its automatic maintenance runs after the push's answer instead (`maintain_after`): git
            // would run it before receive-pack ends, and the pushing client waits for that end.
            ("receive.autogc", "false".into()),
            // receive-pack's connectivity check runs in its own quarantine, whose one alternate is the
            // repository itself: the alternate's refs it would list (a `git for-each-ref` on the
            // push's path) are the repository's own, which the check already counts (`--all`).
            ("core.alternateRefsCommand", "true".into()),
        ]);
    command.identity = identity;
    if let Some(content_type) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
        command = command.env("CONTENT_TYPE", content_type);
    }
    if let Some(encoding) = headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) {
        command = command.env("HTTP_CONTENT_ENCODING", encoding);
    }
    if tail != "git-receive-pack"
        && let Some(protocol) = headers.get("git-protocol").and_then(|v| v.to_str().ok())
    {
        command = command.env("GIT_PROTOCOL", protocol);
    }
    let spawned = match spawner.spawn(command).await {
        Ok(spawned) => spawned,
        Err(error) => {
            tracing::error!(%error, "cannot run git http-backend");
            return plain(StatusCode::BAD_GATEWAY, "the git backend could not be started");
        }
    };
    let process::Spawned {
        mut child,
        mut stdin,
        stdout,
        mut stderr,
    } = spawned;
    let idle = config.processes.body_idle_timeout;
    tokio::spawn(async move {
        if !prefix.is_empty() && stdin.write_all(&prefix).await.is_err() {
            return;
        }
        if let Some(body) = body {
            let mut stream = body.into_data_stream();
            // A body that stalls is cut off: its child then ends and frees its slot.
            while let Ok(Some(Ok(chunk))) = tokio::time::timeout(idle, stream.next()).await {
                if stdin.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        }
        let _ = stdin.shutdown().await;
    });
    tokio::spawn(async move {
        let mut said = Vec::new();
        let _ = (&mut stderr).take(64 << 10).read_to_end(&mut said).await;
        let said = String::from_utf8_lossy(&said);
        if !said.trim().is_empty() {
            tracing::debug!(stderr = %said.trim(), "git http-backend");
        }
    });
    let lifetime = config.processes.max_lifetime;
    let maintenance = (tail == "git-receive-pack").then(|| {
        let mut command = GitCommand::new(&config.git)
            .arg("maintenance")
            .arg("run")
            .arg("--auto")
            .arg("--quiet")
            .env("GIT_DIR", repo)
            .config(&[("core.hooksPath", "/dev/null".into())]);
        command.identity = identity;
        (spawner.clone(), command)
    });
    tokio::spawn(async move {
        let ended = tokio::time::timeout(lifetime, child.wait()).await;
        if ended.is_err() {
            tracing::warn!("git http-backend ran too long; killed");
            process::kill_all(&mut child).await;
        }
        if let (Ok(Ok(status)), Some((spawner, command))) = (ended, maintenance)
            && status.success()
        {
            // Within the push's slot, as receive-pack's own child was: a session's git stays capped.
            maintain_after(&spawner, command, lifetime).await;
        }
        drop(slot);
    });

    let mut reader = BufReader::new(stdout);
    let mut status = StatusCode::OK;
    let mut response_headers = HeaderMap::new();
    let mut header_bytes = 0;
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(MAX_CGI_HEADERS as u64)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return plain(StatusCode::BAD_GATEWAY, "the git backend gave no answer"),
            Ok(read) => header_bytes += read,
        }
        if header_bytes > MAX_CGI_HEADERS {
            return plain(StatusCode::BAD_GATEWAY, "the git backend's answer is not CGI");
        }
        let line = String::from_utf8_lossy(&line);
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
    let body = Body::from_stream(tokio_util::io::ReaderStream::new(reader));
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = response_headers;
    response
}
