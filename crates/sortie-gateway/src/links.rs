//! Driver links (DESIGN §15): a driver that dials out — a generic pod's, assigned its session only after
//! it is claimed — offers its API to the gateway over the connection it opened. The driver proves who it
//! is with an identity token the cluster issued (a projected service-account token for audience
//! [`LINK_AUDIENCE`], checked by the apiserver's `TokenReview`), the connection upgrades to
//! [`LINK_PROTOCOL`], and from then on the gateway is the HTTP/2 client of the same driver API the local
//! runtime reaches on the host-held driver socket ([`DriverLink::send`]).
//!
//! The driver is as untrusted here as on a socket (DESIGN §9 invariant 9): a link only says which pod
//! is at the other end, never which session it serves (the worker binds a claimed pod's uid to its
//! session), and every answer is bounded by the client that reads it.
//!
//! A pod's only way out is the same kind of connection: each connection its driver's egress relay
//! accepts is carried by an upgraded `GET `[`EGRESS_PATH`] with the same identity token, and reaches
//! the egress proxy of the session the worker bound that pod to ([`EgressBindings`]) — a pod bound to
//! no session reaches nothing. Reviews are cached and bounded ([`CachedIdentity`]): a pod opens many
//! connections, and a flood of tokens must not become a flood of requests to the apiserver.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sortie_protocol::driver::{EGRESS_PATH, EGRESS_PROTOCOL, LINK_AUDIENCE, LINK_PATH, LINK_PROTOCOL};
use tokio::sync::{Notify, Semaphore};

use crate::egress::proxy::EgressProxy;

/// The longest identity token the gateway passes on to the apiserver.
const TOKEN_MAX_BYTES: usize = 16 * 1024;
/// How often a quiet link is pinged, and how long a ping may go unanswered before the link is dropped.
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// How long the apiserver may take to review a token.
const REVIEW_DEADLINE: Duration = Duration::from_secs(5);
/// The most of a review's answer the gateway reads.
const REVIEW_MAX_BYTES: usize = 64 * 1024;
/// How long an accepted token is taken without asking the apiserver again. A pod deleted meanwhile
/// gains nothing by it: its binding goes with its claim, and a link or egress needs one.
const REVIEW_CACHE_TTL: Duration = Duration::from_secs(60);
/// How long a refused token is refused again without asking the apiserver.
const REFUSAL_CACHE_TTL: Duration = Duration::from_secs(10);
/// The most accepted (or refused) tokens remembered; past it the oldest are forgotten.
const REVIEW_CACHE_MAX: usize = 1024;
/// The most reviews in flight at once; more wait (up to [`REVIEW_DEADLINE`]) for a turn.
const REVIEWS_AT_ONCE: usize = 4;

/// Who dialed, as the cluster's apiserver says: the pod the identity token is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverIdentity {
    /// `system:serviceaccount:<namespace>:<name>`.
    pub username: String,
    pub pod_name: String,
    /// What a link is known by: a pod's uid is never reused, unlike its name or its IP.
    pub pod_uid: String,
}

/// Why a driver's identity was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum IdentityRefused {
    #[error("the identity token was not accepted: {0}")]
    NotAuthenticated(String),
    #[error("the identity token is not for audience {LINK_AUDIENCE}")]
    WrongAudience,
    #[error("the identity token is not bound to a pod")]
    NotBoundToPod,
    #[error("the identity token belongs to {0}, not to the sandboxes' service account")]
    WrongServiceAccount(String),
    #[error("the apiserver did not review the token: {0}")]
    Unavailable(String),
}

/// Says who an identity token belongs to.
#[async_trait]
pub trait IdentityCheck: Send + Sync + 'static {
    async fn identify(&self, token: &str) -> Result<DriverIdentity, IdentityRefused>;
}

/// `authentication.k8s.io/v1` `TokenReview`, as much of it as the review needs.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenReview {
    pub api_version: String,
    pub kind: String,
    pub spec: TokenReviewSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<TokenReviewStatus>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct TokenReviewSpec {
    pub token: String,
    #[serde(default)]
    pub audiences: Vec<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct TokenReviewStatus {
    #[serde(default)]
    pub authenticated: bool,
    #[serde(default)]
    pub user: ReviewedUser,
    #[serde(default)]
    pub audiences: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ReviewedUser {
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub extra: HashMap<String, Vec<String>>,
}

/// The extra fields a bound service-account token's review carries for its pod.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// Identity by the apiserver's `TokenReview` (`POST /apis/authentication.k8s.io/v1/tokenreviews`),
/// asked under the gateway's own credential, for audience [`LINK_AUDIENCE`], accepting only tokens of
/// the sandboxes' service account that are bound to a pod.
pub struct KubeTokenReview {
    /// The apiserver, e.g. `https://kubernetes.default.svc`.
    pub apiserver: String,
    /// The gateway's own bearer token (its service account's), which may create token reviews.
    pub bearer: String,
    /// `system:serviceaccount:<namespace>:<name>` of the sandbox pods.
    pub sandbox_account: String,
    pub http: reqwest::Client,
}

#[async_trait]
impl IdentityCheck for KubeTokenReview {
    async fn identify(&self, token: &str) -> Result<DriverIdentity, IdentityRefused> {
        let review = TokenReview {
            api_version: "authentication.k8s.io/v1".into(),
            kind: "TokenReview".into(),
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: vec![LINK_AUDIENCE.to_owned()],
            },
            status: None,
        };
        let url = format!(
            "{}/apis/authentication.k8s.io/v1/tokenreviews",
            self.apiserver.trim_end_matches('/')
        );
        let exchange = async {
            let response = self
                .http
                .post(url)
                .bearer_auth(&self.bearer)
                .json(&review)
                .send()
                .await
                .map_err(|e| IdentityRefused::Unavailable(e.to_string()))?;
            let status = response.status();
            let mut body = Vec::new();
            let mut response = response;
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| IdentityRefused::Unavailable(e.to_string()))?
            {
                if body.len() + chunk.len() > REVIEW_MAX_BYTES {
                    return Err(IdentityRefused::Unavailable("the review's answer is too large".into()));
                }
                body.extend_from_slice(&chunk);
            }
            if !status.is_success() {
                return Err(IdentityRefused::Unavailable(format!(
                    "{status}: {}",
                    String::from_utf8_lossy(&body).chars().take(300).collect::<String>()
                )));
            }
            serde_json::from_slice::<TokenReview>(&body).map_err(|e| IdentityRefused::Unavailable(e.to_string()))
        };
        let reviewed = tokio::time::timeout(REVIEW_DEADLINE, exchange)
            .await
            .map_err(|_| IdentityRefused::Unavailable(format!("no answer within {REVIEW_DEADLINE:?}")))??;
        identity_of(reviewed.status.unwrap_or_default(), &self.sandbox_account)
    }
}

/// What a review says, checked: authenticated, for our audience, the sandboxes' account, bound to a pod.
pub fn identity_of(status: TokenReviewStatus, sandbox_account: &str) -> Result<DriverIdentity, IdentityRefused> {
    if !status.authenticated {
        return Err(IdentityRefused::NotAuthenticated(
            status.error.unwrap_or_else(|| "not authenticated".into()),
        ));
    }
    if !status.audiences.iter().any(|a| a == LINK_AUDIENCE) {
        return Err(IdentityRefused::WrongAudience);
    }
    if status.user.username != sandbox_account {
        return Err(IdentityRefused::WrongServiceAccount(status.user.username));
    }
    let one = |key: &str| match status.user.extra.get(key).map(Vec::as_slice) {
        Some([value]) if !value.is_empty() => Some(value.clone()),
        _ => None,
    };
    let (Some(pod_name), Some(pod_uid)) = (one(POD_NAME_EXTRA), one(POD_UID_EXTRA)) else {
        return Err(IdentityRefused::NotBoundToPod);
    };
    Ok(DriverIdentity {
        username: status.user.username,
        pod_name,
        pod_uid,
    })
}

/// [`IdentityCheck`] in front of another that asks it about a token once per [`REVIEW_CACHE_TTL`] at
/// most (a refused one once per [`REFUSAL_CACHE_TTL`]), and at most [`REVIEWS_AT_ONCE`] at a time.
/// Tokens are remembered by their SHA-256, never themselves.
pub struct CachedIdentity {
    inner: Arc<dyn IdentityCheck>,
    accepted: std::sync::Mutex<HashMap<[u8; 32], (DriverIdentity, tokio::time::Instant)>>,
    /// Tokens the apiserver refused, for [`REFUSAL_CACHE_TTL`]: the same garbage again costs no review.
    refused: std::sync::Mutex<HashMap<[u8; 32], tokio::time::Instant>>,
    reviews: Semaphore,
}

impl CachedIdentity {
    pub fn new(inner: Arc<dyn IdentityCheck>) -> Self {
        Self {
            inner,
            accepted: std::sync::Mutex::new(HashMap::new()),
            refused: std::sync::Mutex::new(HashMap::new()),
            reviews: Semaphore::new(REVIEWS_AT_ONCE),
        }
    }

    fn remembered(&self, key: &[u8; 32]) -> Option<DriverIdentity> {
        let accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        accepted
            .get(key)
            .filter(|(_, at)| at.elapsed() < REVIEW_CACHE_TTL)
            .map(|(identity, _)| identity.clone())
    }

    fn refused_lately(&self, key: &[u8; 32]) -> bool {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|at| at.elapsed() < REFUSAL_CACHE_TTL)
    }

    fn remember_refusal(&self, key: [u8; 32]) {
        let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        if refused.len() >= REVIEW_CACHE_MAX {
            refused.retain(|_, at| at.elapsed() < REFUSAL_CACHE_TTL);
        }
        if refused.len() >= REVIEW_CACHE_MAX {
            refused.clear();
        }
        refused.insert(key, tokio::time::Instant::now());
    }

    fn remember(&self, key: [u8; 32], identity: DriverIdentity) {
        let mut accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        if accepted.len() >= REVIEW_CACHE_MAX {
            accepted.retain(|_, (_, at)| at.elapsed() < REVIEW_CACHE_TTL);
        }
        if accepted.len() >= REVIEW_CACHE_MAX
            && let Some(oldest) = accepted.iter().min_by_key(|(_, (_, at))| *at).map(|(key, _)| *key)
        {
            accepted.remove(&oldest);
        }
        accepted.insert(key, (identity, tokio::time::Instant::now()));
    }
}

#[async_trait]
impl IdentityCheck for CachedIdentity {
    async fn identify(&self, token: &str) -> Result<DriverIdentity, IdentityRefused> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(identity) = self.remembered(&key) {
            return Ok(identity);
        }
        if self.refused_lately(&key) {
            return Err(IdentityRefused::NotAuthenticated("refused moments ago".into()));
        }
        let _turn = tokio::time::timeout(REVIEW_DEADLINE, self.reviews.acquire())
            .await
            .map_err(|_| IdentityRefused::Unavailable("too many identity reviews at once".into()))?
            .map_err(|_| IdentityRefused::Unavailable("the gateway is stopping".into()))?;
        // Another connection with the same token may have had it reviewed while this one waited.
        if let Some(identity) = self.remembered(&key) {
            return Ok(identity);
        }
        if self.refused_lately(&key) {
            return Err(IdentityRefused::NotAuthenticated("refused moments ago".into()));
        }
        match self.inner.identify(token).await {
            Ok(identity) => {
                self.remember(key, identity.clone());
                Ok(identity)
            }
            Err(error @ IdentityRefused::Unavailable(_)) => Err(error),
            Err(error) => {
                self.remember_refusal(key);
                Err(error)
            }
        }
    }
}

/// Which session's egress proxy each pod reaches, by pod uid: the worker binds a pod when it has
/// claimed it for a session and unbinds it when it lets the claim go — which also ends every connection
/// the pod still holds through it (a pod let go keeps no way out while it terminates).
#[derive(Default)]
pub struct EgressBindings {
    proxies: std::sync::Mutex<HashMap<String, Binding>>,
}

struct Binding {
    proxy: Arc<EgressProxy>,
    /// Cancelled when the binding ends or closes: every connection through it ends.
    ended: tokio_util::sync::CancellationToken,
    /// Between turns a pod has no way out: nothing a turn left running may act for the session.
    open: bool,
}

impl EgressBindings {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn bind(&self, pod_uid: &str, proxy: Arc<EgressProxy>) {
        let binding = Binding {
            proxy,
            ended: tokio_util::sync::CancellationToken::new(),
            open: true,
        };
        let older = self
            .proxies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pod_uid.to_owned(), binding);
        if let Some(older) = older {
            older.ended.cancel();
        }
    }

    pub fn unbind(&self, pod_uid: &str) {
        let bound = self.proxies.lock().unwrap_or_else(|p| p.into_inner()).remove(pod_uid);
        if let Some(bound) = bound {
            bound.ended.cancel();
        }
    }

    /// Opens the pod's way out (a turn starts), or closes it (a turn ended): closing ends every
    /// connection it holds and refuses new ones until it opens again.
    pub fn set_open(&self, pod_uid: &str, open: bool) {
        let mut proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        let Some(binding) = proxies.get_mut(pod_uid) else {
            return;
        };
        if binding.open == open {
            return;
        }
        binding.open = open;
        if open {
            binding.ended = tokio_util::sync::CancellationToken::new();
        } else {
            binding.ended.cancel();
        }
    }

    fn get(&self, pod_uid: &str) -> Result<(Arc<EgressProxy>, tokio_util::sync::CancellationToken), &'static str> {
        let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        match proxies.get(pod_uid) {
            None => Err("serves no session"),
            Some(binding) if !binding.open => Err("runs no turn"),
            Some(binding) => Ok((binding.proxy.clone(), binding.ended.clone())),
        }
    }
}

/// A driver's live link: send it requests of the driver API.
#[derive(Clone)]
pub struct DriverLink {
    pub identity: DriverIdentity,
    serial: u64,
    sender: SendRequest<Full<Bytes>>,
    closed: Arc<Notify>,
}

impl DriverLink {
    /// One request of the driver API (an absolute URI, `http://driver/…`).
    pub async fn send(&self, request: hyper::Request<Full<Bytes>>) -> Result<hyper::Response<Incoming>, hyper::Error> {
        let mut sender = self.sender.clone();
        sender.ready().await?;
        sender.send_request(request).await
    }

    pub fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }

    /// Ends the link (the driver dials again if it still runs).
    pub fn close(&self) {
        self.closed.notify_one();
    }
}

/// The gateway's live driver links, by pod uid.
#[derive(Default)]
pub struct DriverLinks {
    links: std::sync::Mutex<HashMap<String, DriverLink>>,
    changed: Notify,
    serials: AtomicU64,
}

impl DriverLinks {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The open link of the pod with uid `pod_uid`, if it has dialed.
    pub fn get(&self, pod_uid: &str) -> Option<DriverLink> {
        self.links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(pod_uid)
            .filter(|link| link.is_open())
            .cloned()
    }

    /// Waits up to `within` for the pod with uid `pod_uid` to dial.
    pub async fn wait_for(&self, pod_uid: &str, within: Duration) -> Option<DriverLink> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let changed = self.changed.notified();
            if let Some(link) = self.get(pod_uid) {
                return Some(link);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.get(pod_uid);
            }
        }
    }

    /// How many links are open.
    pub fn len(&self) -> usize {
        self.links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|link| link.is_open())
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A pod's link, unless the pod has one that is still open: whoever presents a pod's identity
    /// (its token, leaked by its own agent) cannot take the link of a driver that answers. A driver
    /// whose link broke dials again and is taken once the old one is closed (at the latest when its
    /// pings go unanswered, [`KEEP_ALIVE`] twice).
    fn insert(&self, identity: DriverIdentity, sender: SendRequest<Full<Bytes>>) -> Option<DriverLink> {
        let link = DriverLink {
            identity,
            serial: self.serials.fetch_add(1, Ordering::Relaxed),
            sender,
            closed: Arc::new(Notify::new()),
        };
        {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            if links.get(&link.identity.pod_uid).is_some_and(DriverLink::is_open) {
                metrics::counter!("sortie_driver_links_total", "result" => "held").increment(1);
                return None;
            }
            links.insert(link.identity.pod_uid.clone(), link.clone());
        }
        self.changed.notify_waiters();
        Some(link)
    }

    fn remove(&self, link: &DriverLink) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        if links
            .get(&link.identity.pod_uid)
            .is_some_and(|held| held.serial == link.serial)
        {
            links.remove(&link.identity.pod_uid);
        }
        drop(links);
        self.changed.notify_waiters();
    }
}

/// What the link and egress routes need.
#[derive(Clone)]
pub struct LinkState {
    pub links: Arc<DriverLinks>,
    /// Wrap a reviewer in [`CachedIdentity`]: every egress connection is identified.
    pub identity: Arc<dyn IdentityCheck>,
    pub egress: Arc<EgressBindings>,
}

/// `GET /v1/drivers/link` and `GET /v1/drivers/egress` (outside bearer auth: the identity token is the
/// credential).
pub fn link_router(state: LinkState) -> Router {
    Router::new()
        .route(LINK_PATH, get(accept_link))
        .route(EGRESS_PATH, get(accept_egress))
        .with_state(state)
}

fn refuse(status: StatusCode, why: String) -> Response {
    metrics::counter!("sortie_driver_links_total", "result" => "refused").increment(1);
    (status, why).into_response()
}

/// Who sent a request with `headers`, which must upgrade to `protocol`: the pod its identity token is bound to, or
/// the refusal to answer.
async fn identify(
    state: &LinkState,
    headers: &axum::http::HeaderMap,
    protocol: &str,
) -> Result<DriverIdentity, Response> {
    let upgrade = headers.get(header::UPGRADE).and_then(|v| v.to_str().ok());
    if upgrade != Some(protocol) {
        return Err(refuse(
            StatusCode::UPGRADE_REQUIRED,
            format!("this route upgrades to {protocol}"),
        ));
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|token| !token.is_empty() && token.len() <= TOKEN_MAX_BYTES);
    let Some(token) = token else {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "a driver's connection needs its identity token".into(),
        ));
    };
    match state.identity.identify(token).await {
        Ok(identity) => Ok(identity),
        Err(error @ IdentityRefused::Unavailable(_)) => {
            tracing::warn!(%error, "a driver's identity could not be reviewed");
            Err(refuse(StatusCode::SERVICE_UNAVAILABLE, error.to_string()))
        }
        Err(error) => {
            tracing::info!(%error, "a driver's connection was refused");
            Err(refuse(StatusCode::UNAUTHORIZED, error.to_string()))
        }
    }
}

/// A second link for a pod whose link is open: refused, whoever asks.
fn link_held(identity: &DriverIdentity) -> Response {
    metrics::counter!("sortie_driver_links_total", "result" => "held").increment(1);
    tracing::warn!(pod = %identity.pod_name, uid = %identity.pod_uid, "a second link for a linked pod was refused");
    (
        StatusCode::CONFLICT,
        format!(
            "pod {} is linked already; another link for it is taken once that one ends",
            identity.pod_name
        ),
    )
        .into_response()
}

fn switching(protocol: &'static str) -> Response {
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    response
        .headers_mut()
        .insert(header::UPGRADE, HeaderValue::from_static(protocol));
    response
}

/// One connection of a pod to its session's egress proxy.
async fn accept_egress(State(state): State<LinkState>, mut request: Request) -> Response {
    let identity = match identify(&state, request.headers(), EGRESS_PROTOCOL).await {
        Ok(identity) => identity,
        Err(refusal) => return refusal,
    };
    let (proxy, unbound) = match state.egress.get(&identity.pod_uid) {
        Ok(bound) => bound,
        Err(why) => {
            metrics::counter!("sortie_egress_decisions_total", "decision" => "unbound").increment(1);
            return (
                StatusCode::FORBIDDEN,
                format!("pod {} {why}: it has no way out", identity.pod_name),
            )
                .into_response();
        }
    };
    let Some(admitted) = proxy.admit() else {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            "the sandbox holds its most egress connections",
        )
            .into_response();
    };
    let on_upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            tokio::select! {
                () = admitted.serve(upgraded) => {}
                () = unbound.cancelled() => {}
            }
        }
    });
    switching(EGRESS_PROTOCOL)
}

async fn accept_link(State(state): State<LinkState>, mut request: Request) -> Response {
    let identity = match identify(&state, request.headers(), LINK_PROTOCOL).await {
        Ok(identity) => identity,
        Err(refusal) => return refusal,
    };
    if state.links.get(&identity.pod_uid).is_some() {
        return link_held(&identity);
    }
    let on_upgrade = hyper::upgrade::on(&mut request);
    let links = state.links.clone();
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let handshake = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE)
            .keep_alive_timeout(KEEP_ALIVE)
            .keep_alive_while_idle(true)
            .handshake::<_, Full<Bytes>>(upgraded)
            .await;
        let Ok((sender, connection)) = handshake else {
            return;
        };
        let Some(link) = links.insert(identity, sender) else {
            // Another link of the same pod won the race; this one's connection ends here.
            return;
        };
        tracing::info!(pod = %link.identity.pod_name, uid = %link.identity.pod_uid, "a driver linked");
        metrics::counter!("sortie_driver_links_total", "result" => "linked").increment(1);
        tokio::select! {
            _ = connection => {}
            () = link.closed.notified() => {}
        }
        links.remove(&link);
        tracing::info!(pod = %link.identity.pod_name, "a driver link ended");
    });
    switching(LINK_PROTOCOL)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACCOUNT: &str = "system:serviceaccount:sortie:sandbox";

    fn reviewed(
        authenticated: bool,
        audiences: &[&str],
        username: &str,
        extra: &[(&str, &[&str])],
    ) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated,
            user: ReviewedUser {
                username: username.into(),
                uid: "sa-uid".into(),
                extra: extra
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.iter().map(|s| (*s).to_owned()).collect()))
                    .collect(),
            },
            audiences: audiences.iter().map(|s| (*s).to_owned()).collect(),
            error: None,
        }
    }

    #[test]
    fn only_a_pod_bound_token_of_the_sandbox_account_for_our_audience_is_an_identity() {
        let pod = [(POD_NAME_EXTRA, &["pool-abc"][..]), (POD_UID_EXTRA, &["uid-1"][..])];
        let identity = identity_of(reviewed(true, &[LINK_AUDIENCE], ACCOUNT, &pod), ACCOUNT).expect("identity");
        assert_eq!(identity.pod_uid, "uid-1");
        assert_eq!(identity.pod_name, "pool-abc");
        assert!(matches!(
            identity_of(reviewed(false, &[LINK_AUDIENCE], ACCOUNT, &pod), ACCOUNT),
            Err(IdentityRefused::NotAuthenticated(_))
        ));
        assert!(matches!(
            identity_of(reviewed(true, &["kubernetes"], ACCOUNT, &pod), ACCOUNT),
            Err(IdentityRefused::WrongAudience)
        ));
        assert!(matches!(
            identity_of(
                reviewed(true, &[LINK_AUDIENCE], "system:serviceaccount:sortie:gateway", &pod),
                ACCOUNT
            ),
            Err(IdentityRefused::WrongServiceAccount(_))
        ));
        for extra in [
            &[(POD_NAME_EXTRA, &["pool-abc"][..])][..],
            &[(POD_NAME_EXTRA, &["pool-abc"][..]), (POD_UID_EXTRA, &[][..])][..],
            &[(POD_NAME_EXTRA, &["pool-abc"][..]), (POD_UID_EXTRA, &["a", "b"][..])][..],
            &[(POD_NAME_EXTRA, &["pool-abc"][..]), (POD_UID_EXTRA, &[""][..])][..],
        ] {
            assert!(
                matches!(
                    identity_of(reviewed(true, &[LINK_AUDIENCE], ACCOUNT, extra), ACCOUNT),
                    Err(IdentityRefused::NotBoundToPod)
                ),
                "{extra:?}"
            );
        }
    }
}
