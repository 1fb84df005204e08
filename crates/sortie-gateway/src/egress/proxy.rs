//! The egress proxy on a sandbox's `egress.sock` (DESIGN §7.2): HTTP `CONNECT` and absolute-URI HTTP
//! to allowlisted names only, resolved here and connected to by the vetted address (no DNS
//! rebinding), and the internal `/_sortie/…` routes (the git proxy) in origin or absolute form.
//! Every refusal is a 403 with one line the agent can read, logged, counted and reported.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpStream, UnixListener};
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
    pub store: Arc<dyn sortie_store::Store>,
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

/// A hook that puts every denial into the running turn's stream as a `data-sortie-egress-denied`
/// part, through the driver's `POST /parts`, so the user sees a blocked connection at once.
pub fn report_to_driver(driver_socket: std::path::PathBuf) -> DenialHook {
    Arc::new(move |denial: &Denial| {
        let socket = driver_socket.clone();
        let part = serde_json::json!({
            "name": "sortie-egress-denied",
            "data": {"host": denial.host, "port": denial.port, "reason": denial.reason},
        });
        Box::pin(async move {
            let Ok(stream) = tokio::net::UnixStream::connect(&socket).await else {
                return;
            };
            let Ok((mut sender, connection)) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await else {
                return;
            };
            tokio::spawn(connection);
            let request = Request::post("/parts")
                .header(header::HOST, "driver")
                .header(header::CONTENT_TYPE, "application/json")
                .body(http_body_util::Full::new(axum::body::Bytes::from(part.to_string())));
            if let Ok(request) = request {
                let _ = sender.send_request(request).await;
            }
        })
    })
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
}

impl EgressProxy {
    pub fn new(
        allowlist: Arc<dyn AllowlistSource>,
        exempt: Vec<Cidr>,
        resolver: Arc<dyn Resolver>,
        internal: Option<Router>,
        on_denied: Option<DenialHook>,
    ) -> Arc<Self> {
        Arc::new(Self {
            allowlist,
            exempt,
            resolver,
            internal,
            on_denied,
            reported: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Serves connections from the sandbox until the listener fails.
    pub async fn serve(self: Arc<Self>, listener: UnixListener) {
        while let Ok((stream, _)) = listener.accept().await {
            let proxy = self.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let proxy = proxy.clone();
                    async move { Ok::<_, Infallible>(proxy.handle(request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .with_upgrades()
                    .await;
            });
        }
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
        tokio::spawn(async move {
            match hyper::upgrade::on(request).await {
                Ok(upgraded) => {
                    let mut client = TokioIo::new(upgraded);
                    let mut upstream = upstream;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
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
        let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(_) => return text(StatusCode::BAD_GATEWAY, "sortie: the upstream did not speak HTTP"),
        };
        tokio::spawn(connection);
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

fn text(status: StatusCode, message: &str) -> Response<Body> {
    let mut response = Response::new(Body::from(format!("{message}\n")));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}
