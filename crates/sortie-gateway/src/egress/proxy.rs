//! The egress proxy on a sandbox's `egress.sock` (DESIGN §7.2): HTTP `CONNECT` and absolute-URI HTTP
//! to allowlisted names only, resolved here and connected to by the vetted address (no DNS
//! rebinding), and the internal `/_sortie/…` routes (the git proxy) in origin or absolute form.
//! Every refusal is a 403 with one line the agent can read, logged, counted and reported.
//!
//! What a sandbox can make the host hold through its socket is bounded ([`EgressLimits`]): at most
//! [`MAX_CONNECTIONS_PER_SANDBOX`] connections at once (past it, new ones wait in the socket's
//! backlog, which costs the host no descriptor), a share of a process-wide budget
//! ([`HostConnections`]; past it new connections are closed at once) so that all sandboxes
//! together never take the descriptors the API and the store need, a deadline on every request
//! head ([`HEADER_READ_TIMEOUT`]) and an idle deadline on tunnels and forwarded connections
//! ([`IDLE_TIMEOUT`]). The accept loop never ends on an error: it logs (at most every
//! [`ACCEPT_ERROR_LOG_INTERVAL`]), backs off and accepts again, so a sandbox that exhausts
//! descriptors for a moment cannot cut another session's proxies for good.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use crate::egress::policy::{self, Cidr, Denial};

/// Resolves a name to addresses.
pub trait Resolver: Send + Sync + 'static {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>>;
}

/// The host's resolver.
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

/// A fixed table of names (tests use it to point public-looking names at servers on this machine).
#[derive(Default)]
pub struct StaticResolver(pub HashMap<String, Vec<IpAddr>>);

impl Resolver for StaticResolver {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>> {
        let found = self
            .0
            .get(host)
            .map(|ips| ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect::<Vec<_>>());
        Box::pin(async move { found.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such name")) })
    }
}

/// Where a proxy reads the allowlist from, at every connection.
pub trait AllowlistSource: Send + Sync + 'static {
    fn allowlist(&self) -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>>;
}

/// An allowlist held in memory (tests, and sandboxes run without a session).
#[derive(Default)]
pub struct FixedAllowlist(RwLock<Vec<String>>);

impl FixedAllowlist {
    pub fn new(allow: Vec<String>) -> Arc<Self> {
        Arc::new(Self(RwLock::new(allow)))
    }

    /// Replaces the list; the next connection sees it.
    pub fn set(&self, allow: Vec<String>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = allow;
    }
}

impl AllowlistSource for FixedAllowlist {
    fn allowlist(&self) -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>> {
        let list = self.0.read().unwrap_or_else(|p| p.into_inner()).clone();
        Box::pin(async move { list })
    }
}

/// A session's allowlist as the store has it, so `POST /v1/sessions/{id}/egress` takes effect on the
/// next connection. If the store cannot answer, nothing is allowed (fail closed).
pub struct SessionAllowlist {
    pub store: Arc<dyn sortie_store::Transcripts>,
    pub workspace_id: String,
    pub session_id: sortie_protocol::SessionId,
}

impl AllowlistSource for SessionAllowlist {
    fn allowlist(&self) -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>> {
        Box::pin(async move {
            match self.store.session(&self.workspace_id, &self.session_id).await {
                Ok(session) => session.egress_allow,
                Err(error) => {
                    tracing::warn!(%error, session = %self.session_id, "allowlist unavailable; refusing egress");
                    Vec::new()
                }
            }
        })
    }
}

/// Called for every refusal (the gateway publishes a `data-sortie-egress-denied` part from it); the
/// proxy answers the 403 only after the hook is done (or [`DENIAL_REPORT_DEADLINE`] passed), so the
/// part is in the stream before the agent can react to the refusal.
pub type DenialHook = Arc<dyn Fn(&Denial) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// How long a refusal waits for its report before the 403 goes out anyway.
pub const DENIAL_REPORT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// The same refusal (host, port, reason) is reported once per this window: an agent retrying in a
/// loop gets its 403 every time but adds one part to the transcript, not thousands.
pub const DENIAL_REPORT_WINDOW: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a connection to an allowed, vetted address may take.
const CONNECT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(15);

/// The connections one sandbox may hold open on its egress socket at once, tunnels included.
/// Agents need far fewer: a model request each (at most the model proxy's 16 in flight), a few for
/// git, and a package manager's pool (npm and pip open 10 to 50). Past the cap a new connection is
/// not accepted until one closes: it waits in the socket's backlog, where it costs the host no
/// descriptor. With [`FDS_PER_CONNECTION`] this bounds one sandbox at 512 descriptors.
pub const MAX_CONNECTIONS_PER_SANDBOX: usize = 128;
/// The descriptors one egress connection can make the host hold: the accepted socket, plus either
/// one upstream socket (a tunnel, a forwarded request, a model request) or the three pipes of a
/// `git http-backend` child. [`HostConnections`] is sized in connections of this weight.
pub const FDS_PER_CONNECTION: usize = 4;
/// How long a request head on the egress socket may take to arrive, and how long a kept-alive
/// connection may sit idle between requests. The sandbox writes over a local socket, so a head
/// takes microseconds; this only ends connections held open on purpose (slowloris) or forgotten.
/// hyper's own default when a timer is set.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a CONNECT tunnel or a forwarded request's upstream connection may carry no byte
/// either way before it is closed. Long enough for a slow registry or API to think, short enough
/// that a held-open tunnel gives its slot back.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// At most one log line per this interval while accepting keeps failing (the rest are counted).
pub const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// The first pause after a failed accept; it doubles on each failure in a row up to
/// [`ACCEPT_BACKOFF_MAX`], and is reset by an accept that succeeds.
pub const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(50);
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The egress connections every sandbox of this process may hold together, so that sandboxes can
/// never take the descriptors kept for the API and the store. `sortie serve` sizes it once at start
/// from `RLIMIT_NOFILE` (see `sortie_server::DescriptorPlan`): with a limit `L`, a reserve `R` and
/// an API cap `A` (each API connection weighs 2: its socket and, for an attach stream, the
/// driver's), the budget is `(L - R - 2A) / FDS_PER_CONNECTION` connections. One sandbox takes at
/// most [`MAX_CONNECTIONS_PER_SANDBOX`] of it. A connection accepted while the budget is spent is
/// closed at once (it held a descriptor for that moment only, out of the reserve).
#[derive(Clone, Debug)]
pub struct HostConnections(Arc<Semaphore>);

static PROCESS_WIDE: OnceLock<HostConnections> = OnceLock::new();

impl HostConnections {
    pub fn new(total: usize) -> Self {
        Self(Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))))
    }

    /// Sets the budget every proxy built afterwards with default limits shares; `false` if one was
    /// set already (it stays).
    pub fn set_process_wide(total: usize) -> bool {
        PROCESS_WIDE.set(Self::new(total)).is_ok()
    }

    /// The process-wide budget, if `sortie serve` set one.
    pub fn process_wide() -> Option<Self> {
        PROCESS_WIDE.get().cloned()
    }

    /// Connections that could still be opened now.
    pub fn available(&self) -> usize {
        self.0.available_permits()
    }
}

/// What one sandbox's proxy may hold (see the constants for each value's reason).
#[derive(Clone, Debug)]
pub struct EgressLimits {
    /// [`MAX_CONNECTIONS_PER_SANDBOX`].
    pub max_connections: usize,
    /// [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// [`IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// The budget shared with every other sandbox; by default the process-wide one, if set.
    pub host_connections: Option<HostConnections>,
}

impl Default for EgressLimits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS_PER_SANDBOX,
            header_read_timeout: HEADER_READ_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            host_connections: HostConnections::process_wide(),
        }
    }
}

/// The slots one accepted connection holds, given back when the connection and everything it
/// opened (a tunnel, a forwarded request's upstream) are gone.
struct ConnectionSlot {
    _sandbox: OwnedSemaphorePermit,
    _host: Option<OwnedSemaphorePermit>,
}

/// One sandbox's egress proxy.
pub struct EgressProxy {
    allowlist: Arc<dyn AllowlistSource>,
    exempt: Vec<Cidr>,
    resolver: Arc<dyn Resolver>,
    internal: Option<Router>,
    on_denied: Option<DenialHook>,
    /// When each refusal was last reported (see [`DENIAL_REPORT_WINDOW`]).
    reported: std::sync::Mutex<HashMap<(String, u16, String), std::time::Instant>>,
    limits: EgressLimits,
    /// One permit per open connection ([`EgressLimits::max_connections`]).
    connections: Arc<Semaphore>,
    /// Accepts that failed since the proxy started.
    accept_errors: AtomicU64,
}

impl EgressProxy {
    /// A proxy with the default limits ([`EgressLimits::default`]).
    pub fn new(
        allowlist: Arc<dyn AllowlistSource>,
        exempt: Vec<Cidr>,
        resolver: Arc<dyn Resolver>,
        internal: Option<Router>,
        on_denied: Option<DenialHook>,
    ) -> Arc<Self> {
        Self::with_limits(
            allowlist,
            exempt,
            resolver,
            internal,
            on_denied,
            EgressLimits::default(),
        )
    }

    pub fn with_limits(
        allowlist: Arc<dyn AllowlistSource>,
        exempt: Vec<Cidr>,
        resolver: Arc<dyn Resolver>,
        internal: Option<Router>,
        on_denied: Option<DenialHook>,
        limits: EgressLimits,
    ) -> Arc<Self> {
        Arc::new(Self {
            allowlist,
            exempt,
            resolver,
            internal,
            on_denied,
            reported: std::sync::Mutex::new(HashMap::new()),
            connections: Arc::new(Semaphore::new(limits.max_connections.clamp(1, Semaphore::MAX_PERMITS))),
            limits,
            accept_errors: AtomicU64::new(0),
        })
    }

    /// How many accepts failed since the proxy started (each was logged or counted, then retried).
    pub fn accept_errors(&self) -> u64 {
        self.accept_errors.load(Ordering::Relaxed)
    }

    /// Connections the sandbox could still open before new ones wait.
    pub fn connections_available(&self) -> usize {
        self.connections.available_permits()
    }

    /// Serves connections from the sandbox until the task is dropped; an accept that fails is
    /// logged and retried after a pause, never the end of the loop.
    pub async fn serve(self: Arc<Self>, listener: UnixListener) {
        let mut failures = AcceptFailures::default();
        let mut over_budget = OverBudget::default();
        loop {
            // The sandbox's slot before the accept: past its cap a connection waits in the backlog.
            let Ok(sandbox) = self.connections.clone().acquire_owned().await else {
                return;
            };
            let stream = loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        failures.succeeded();
                        break stream;
                    }
                    Err(error) => {
                        self.accept_errors.fetch_add(1, Ordering::Relaxed);
                        let pause = failures.failed(&error, tokio::time::Instant::now());
                        tokio::time::sleep(pause).await;
                    }
                }
            };
            // The host's slot after it, and never waited for: a slot held by a proxy with nothing to
            // accept would be lost to the others, and an accepted connection waiting for one would
            // hold a descriptor past the budget. Past the budget the connection is closed at once.
            let host = match &self.limits.host_connections {
                Some(host) => match host.0.clone().try_acquire_owned() {
                    Ok(permit) => Some(permit),
                    Err(_) => {
                        over_budget.refused(tokio::time::Instant::now());
                        drop(stream);
                        continue;
                    }
                },
                None => None,
            };
            let slot = Arc::new(ConnectionSlot {
                _sandbox: sandbox,
                _host: host,
            });
            tokio::spawn(self.clone().serve_connection(TokioIo::new(stream), slot));
        }
    }

    /// A connection that reached the proxy another way than its socket (a pod's, carried over an
    /// upgraded request): its slots now, or `None` at once when the sandbox holds its most
    /// connections or the host its budget — nothing waits for a slot holding a connection open.
    pub fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let sandbox = self.connections.clone().try_acquire_owned().ok()?;
        let host = match &self.limits.host_connections {
            Some(host) => Some(host.0.clone().try_acquire_owned().ok()?),
            None => None,
        };
        Some(Admitted {
            proxy: self.clone(),
            slot: Arc::new(ConnectionSlot {
                _sandbox: sandbox,
                _host: host,
            }),
        })
    }

    async fn serve_connection<I>(self: Arc<Self>, io: I, slot: Arc<ConnectionSlot>)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let header_read_timeout = self.limits.header_read_timeout;
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            let proxy = self.clone();
            // A tunnel or an upstream connection this request opens keeps the slot until it ends.
            request.extensions_mut().insert(slot.clone());
            async move { Ok::<_, Infallible>(proxy.handle(request).await) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            .serve_connection(io, service)
            .with_upgrades()
            .await;
    }

    async fn deny(&self, denial: Denial) -> Response<Body> {
        tracing::info!(host = %denial.host, port = denial.port, reason = %denial.reason, "egress denied");
        metrics::counter!("sortie_egress_decisions_total", "decision" => "denied").increment(1);
        if let Some(hook) = &self.on_denied
            && self.first_report_in_window(&denial)
        {
            let _ = tokio::time::timeout(DENIAL_REPORT_DEADLINE, hook(&denial)).await;
        }
        text(
            StatusCode::FORBIDDEN,
            &format!(
                "sortie: egress to {}:{} denied: {}",
                denial.host, denial.port, denial.reason
            ),
        )
    }

    fn first_report_in_window(&self, denial: &Denial) -> bool {
        let now = std::time::Instant::now();
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        reported.retain(|_, at| now.duration_since(*at) < DENIAL_REPORT_WINDOW);
        let key = (denial.host.clone(), denial.port, denial.reason.clone());
        if reported.contains_key(&key) {
            return false;
        }
        reported.insert(key, now);
        true
    }

    /// Checks the name, resolves it, checks every address, and connects to a vetted one.
    async fn connect(&self, host: &str, port: u16) -> Result<TcpStream, Response<Body>> {
        let allowlist = self.allowlist.allowlist().await;
        if let Err(denial) = policy::check_name(host, port, &allowlist) {
            return Err(self.deny(denial).await);
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let addresses = match self.resolver.resolve(&host, port).await {
            Ok(addresses) if !addresses.is_empty() => addresses,
            _ => {
                return Err(self
                    .deny(Denial {
                        host,
                        port,
                        reason: "the name does not resolve".into(),
                    })
                    .await);
            }
        };
        // Any forbidden address refuses the name: a record set that mixes them is a rebinding attempt.
        if let Some(reason) = addresses
            .iter()
            .find_map(|address| policy::forbidden_address(address.ip(), &self.exempt))
        {
            return Err(self
                .deny(Denial {
                    host,
                    port,
                    reason: format!("the name resolves to {reason}"),
                })
                .await);
        }
        metrics::counter!("sortie_egress_decisions_total", "decision" => "allowed").increment(1);
        tracing::debug!(%host, port, "egress allowed");
        let mut last_error = None;
        for address in addresses {
            match tokio::time::timeout(CONNECT_DEADLINE, TcpStream::connect(address)).await {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(error)) => last_error = Some(error),
                Err(_) => last_error = Some(std::io::ErrorKind::TimedOut.into()),
            }
        }
        tracing::info!(%host, port, error = ?last_error, "egress connect failed");
        Err(text(
            StatusCode::BAD_GATEWAY,
            &format!("sortie: {host}:{port} did not accept the connection"),
        ))
    }

    async fn handle(&self, request: Request<Incoming>) -> Response<Body> {
        if request.method() == Method::CONNECT {
            return self.tunnel(request).await;
        }
        let internal_path = request.uri().path().starts_with("/_sortie/");
        let to_ourselves = request
            .uri()
            .authority()
            .is_none_or(|a| matches!(a.host(), "127.0.0.1" | "localhost"));
        if internal_path && to_ourselves {
            return self.internal(request).await;
        }
        match (request.uri().scheme_str(), request.uri().authority().cloned()) {
            (Some("http"), Some(authority)) => self.forward(request, authority).await,
            (Some(_), Some(_)) => text(
                StatusCode::BAD_REQUEST,
                "sortie: only http:// URLs are proxied this way; use CONNECT for https",
            ),
            _ => text(
                StatusCode::BAD_REQUEST,
                "sortie: this is an HTTP proxy: use CONNECT or an absolute http:// URL",
            ),
        }
    }

    async fn internal(&self, request: Request<Incoming>) -> Response<Body> {
        let Some(router) = self.internal.clone() else {
            return text(StatusCode::NOT_FOUND, "sortie: no such internal route");
        };
        let (mut parts, body) = request.into_parts();
        if let Some(path_and_query) = parts.uri.path_and_query().cloned() {
            parts.uri = Uri::from(path_and_query);
        }
        match router.oneshot(Request::from_parts(parts, Body::new(body))).await {
            Ok(response) => response,
            Err(never) => match never {},
        }
    }

    async fn tunnel(&self, request: Request<Incoming>) -> Response<Body> {
        let Some(authority) = request.uri().authority().cloned() else {
            return text(StatusCode::BAD_REQUEST, "sortie: CONNECT needs host:port");
        };
        let port = authority.port_u16().unwrap_or(443);
        let upstream = match self.connect(authority.host(), port).await {
            Ok(stream) => stream,
            Err(refusal) => return refusal,
        };
        let slot = request.extensions().get::<Arc<ConnectionSlot>>().cloned();
        let idle_timeout = self.limits.idle_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            match hyper::upgrade::on(request).await {
                Ok(upgraded) => {
                    let activity = Activity::new();
                    let mut client = Watched::new(TokioIo::new(upgraded), activity.clone());
                    let mut upstream = upstream;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        () = activity.idle_for(idle_timeout) => {
                            metrics::counter!("sortie_egress_idle_closed_total", "kind" => "tunnel").increment(1);
                            tracing::debug!(?idle_timeout, "closing an idle CONNECT tunnel");
                        }
                    }
                }
                Err(error) => tracing::debug!(%error, "CONNECT upgrade failed"),
            }
        });
        Response::new(Body::empty())
    }

    async fn forward(&self, request: Request<Incoming>, authority: axum::http::uri::Authority) -> Response<Body> {
        let port = authority.port_u16().unwrap_or(80);
        let upstream = match self.connect(authority.host(), port).await {
            Ok(stream) => stream,
            Err(refusal) => return refusal,
        };
        let activity = Activity::new();
        let upstream = Watched::new(upstream, activity.clone());
        let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(_) => return text(StatusCode::BAD_GATEWAY, "sortie: the upstream did not speak HTTP"),
        };
        let slot = request.extensions().get::<Arc<ConnectionSlot>>().cloned();
        let idle_timeout = self.limits.idle_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            tokio::select! {
                _ = connection => {}
                () = activity.idle_for(idle_timeout) => {
                    metrics::counter!("sortie_egress_idle_closed_total", "kind" => "forward").increment(1);
                    tracing::debug!(?idle_timeout, "closing an idle forwarded connection");
                }
            }
        });
        let (mut parts, body) = request.into_parts();
        parts.uri = parts
            .uri
            .path_and_query()
            .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()));
        parts.headers.remove(header::PROXY_AUTHORIZATION);
        parts.headers.remove("proxy-connection");
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            parts.headers.insert(header::HOST, host);
        }
        match sender.send_request(Request::from_parts(parts, body)).await {
            Ok(response) => response.map(Body::new),
            Err(_) => text(StatusCode::BAD_GATEWAY, "sortie: the upstream closed the connection"),
        }
    }
}

/// A connection admitted by [`EgressProxy::admit`], holding its slots until it ends.
pub struct Admitted {
    proxy: Arc<EgressProxy>,
    slot: Arc<ConnectionSlot>,
}

impl Admitted {
    /// Serves the connection as one from the proxy's socket.
    pub async fn serve<I>(self, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        self.proxy.serve_connection(io, self.slot).await;
    }
}

/// When a connection last carried a byte (either way), shared by the streams that watch it.
#[derive(Clone)]
struct Activity {
    since: tokio::time::Instant,
    /// Milliseconds after `since` of the last byte.
    last: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self {
            since: tokio::time::Instant::now(),
            last: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        // Rounded up: a byte is never taken for older than it is, so a connection is never closed before
        // it was quiet for the whole limit.
        let elapsed = u64::try_from(self.since.elapsed().as_micros().div_ceil(1000)).unwrap_or(u64::MAX);
        self.last.store(elapsed, Ordering::Relaxed);
    }

    /// Completes once no byte passed for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            let last = self.since + Duration::from_millis(self.last.load(Ordering::Relaxed));
            let deadline = last + limit;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// A stream that records its traffic in an [`Activity`].
struct Watched<S> {
    stream: S,
    activity: Activity,
}

impl<S> Watched<S> {
    fn new(stream: S, activity: Activity) -> Self {
        Self { stream, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.touch();
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write(cx, data);
        if matches!(poll, Poll::Ready(Ok(written)) if written > 0) {
            this.activity.touch();
        }
        poll
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if matches!(poll, Poll::Ready(Ok(written)) if written > 0) {
            this.activity.touch();
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Connections closed because every sandbox together reached the host budget, logged at most once
/// per [`ACCEPT_ERROR_LOG_INTERVAL`].
#[derive(Debug, Default)]
struct OverBudget {
    last_logged: Option<tokio::time::Instant>,
    unlogged: u64,
}

impl OverBudget {
    fn refused(&mut self, now: tokio::time::Instant) {
        metrics::counter!("sortie_egress_connections_refused_total", "reason" => "host_budget").increment(1);
        if self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_ERROR_LOG_INTERVAL)
        {
            tracing::warn!(
                unlogged = self.unlogged,
                "the sandboxes' egress connections reached the host's budget; closing new ones"
            );
            self.last_logged = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
    }
}

/// The accept loop's memory of failures in a row: how long to pause, and whether to log.
#[derive(Debug)]
struct AcceptFailures {
    pause: Duration,
    last_logged: Option<tokio::time::Instant>,
    /// Failures not logged since the last line.
    unlogged: u64,
}

impl Default for AcceptFailures {
    fn default() -> Self {
        Self {
            pause: ACCEPT_BACKOFF_FIRST,
            last_logged: None,
            unlogged: 0,
        }
    }
}

impl AcceptFailures {
    /// Counts a failed accept, logs it unless a line went out within the interval, and returns the
    /// pause before the next attempt. A connection that died in the backlog is no reason to wait.
    fn failed(&mut self, error: &io::Error, now: tokio::time::Instant) -> Duration {
        metrics::counter!("sortie_egress_accept_errors_total").increment(1);
        if matches!(
            error.kind(),
            io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
        ) {
            return Duration::ZERO;
        }
        let pause = self.pause;
        self.pause = (self.pause * 2).min(ACCEPT_BACKOFF_MAX);
        if self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_ERROR_LOG_INTERVAL)
        {
            tracing::warn!(%error, ?pause, unlogged = self.unlogged, "the egress socket cannot accept; retrying");
            self.last_logged = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        pause
    }

    fn succeeded(&mut self) {
        self.pause = ACCEPT_BACKOFF_FIRST;
    }
}

fn text(status: StatusCode, message: &str) -> Response<Body> {
    let mut response = Response::new(Body::from(format!("{message}\n")));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_accepts_back_off_and_log_rarely() {
        let emfile = io::Error::from_raw_os_error(24);
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        let start = tokio::time::Instant::now();
        let mut failures = AcceptFailures::default();
        let pauses: Vec<u128> = (0..7)
            .map(|n| failures.failed(&emfile, start + Duration::from_millis(n)).as_millis())
            .collect();
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(failures.unlogged, 6, "one line for a burst of failures");
        assert_eq!(
            failures.failed(&aborted, start),
            Duration::ZERO,
            "a dead connection is skipped"
        );
        failures.failed(&emfile, start + ACCEPT_ERROR_LOG_INTERVAL);
        assert_eq!(failures.unlogged, 0, "a new line once the interval passed");
        failures.succeeded();
        assert_eq!(failures.failed(&emfile, start), ACCEPT_BACKOFF_FIRST);
    }

    #[tokio::test(start_paused = true)]
    async fn activity_ends_only_after_a_quiet_limit() {
        let activity = Activity::new();
        let limit = Duration::from_secs(10);
        let watcher = tokio::spawn({
            let activity = activity.clone();
            async move { activity.idle_for(limit).await }
        });
        tokio::time::sleep(Duration::from_secs(8)).await;
        activity.touch();
        tokio::time::sleep(Duration::from_secs(8)).await;
        assert!(!watcher.is_finished(), "a byte 8 s ago keeps it open");
        let closed = tokio::time::timeout(Duration::from_secs(3), watcher).await;
        assert!(closed.is_ok(), "10 s without a byte closes it");
    }
}
