//! The driver's side of a driver link (DESIGN §15): a driver in a generic pod has no socket the host
//! made for it, so it dials the gateway, proves who it is with the identity token its pod was given
//! (read afresh at every dial: the kubelet rotates projected tokens), upgrades the connection to
//! [`LINK_PROTOCOL`] and serves its API as the HTTP/2 server of that connection. A link that breaks is
//! dialed again, backing off, until the driver is told to stop.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use sortie_protocol::driver::{EGRESS_PATH, EGRESS_PROTOCOL, LINK_PATH, LINK_PROTOCOL};

/// The longest identity token the driver sends.
const TOKEN_MAX_BYTES: u64 = 16 * 1024;
/// How long a dial may take before it is tried again.
const DIAL_DEADLINE: Duration = Duration::from_secs(5);
/// How often a quiet link is pinged, and how long a ping may go unanswered.
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The first and the longest wait between dials.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How much of a refusal's body is shown.
const REFUSAL_MAX_BYTES: usize = 1024;

/// Where to dial and with what.
#[derive(Clone, Debug)]
pub struct LinkTarget {
    dial: Dial,
    authority: String,
    token_file: PathBuf,
}

#[derive(Clone, Debug)]
enum Dial {
    Tcp {
        host: String,
        port: u16,
    },
    /// A socket bound into a sandbox that no network reaches the gateway from (a bwrap sandbox
    /// standing in for a pod).
    Unix(PathBuf),
}

/// A dialed connection, whichever kind.
trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("--link {0:?}: {1}")]
    BadUrl(String, String),
    #[error("cannot read the identity token {}: {source}", path.display())]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach the gateway at {0}: {1}")]
    Unreachable(String, String),
    #[error("the gateway refused the link ({0}): {1}")]
    Refused(StatusCode, String),
    #[error("the link broke: {0}")]
    Broken(String),
}

impl LinkTarget {
    /// `url` is the gateway's `http://host:port`, or `unix:/path` for a socket bound into the sandbox.
    pub fn new(url: &str, token_file: &Path) -> Result<Self, LinkError> {
        let bad = |why: &str| LinkError::BadUrl(url.to_owned(), why.to_owned());
        if let Some(path) = url.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(bad("a socket's path must be absolute"));
            }
            return Ok(Self {
                dial: Dial::Unix(PathBuf::from(path)),
                authority: "localhost".into(),
                token_file: token_file.to_owned(),
            });
        }
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("must be http://host:port (the cluster's network carries the link)"));
        }
        let authority = uri.authority().ok_or_else(|| bad("names no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        Ok(Self {
            dial: Dial::Tcp {
                host: authority
                    .host()
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
                port,
            },
            authority: authority.as_str().to_owned(),
            token_file: token_file.to_owned(),
        })
    }

    async fn connect(&self) -> std::io::Result<Box<dyn Stream>> {
        Ok(match &self.dial {
            Dial::Tcp { host, port } => {
                let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                let _ = stream.set_nodelay(true);
                Box::new(stream)
            }
            Dial::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        })
    }

    fn token(&self) -> Result<String, LinkError> {
        use std::io::Read;
        let error = |source| LinkError::Token {
            path: self.token_file.clone(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(&self.token_file)
            .map_err(error)?
            .take(TOKEN_MAX_BYTES)
            .read_to_string(&mut text)
            .map_err(error)?;
        Ok(text.trim().to_owned())
    }
}

/// Dials and serves `api` on each link until `shutdown` completes.
pub async fn serve(target: LinkTarget, api: Router, shutdown: impl Future<Output = ()> + Send) {
    tokio::pin!(shutdown);
    let mut backoff = BACKOFF_FIRST;
    loop {
        let linked = tokio::select! {
            () = &mut shutdown => return,
            linked = serve_one(&target, api.clone()) => linked,
        };
        match linked {
            // The link was up and ended: dial again at once.
            Ok(()) => backoff = BACKOFF_FIRST,
            Err(error) => {
                tracing::warn!(%error, "no link to the gateway; dialing again in {backoff:?}");
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Dials the gateway and upgrades a `GET path` to `protocol`, with the identity token as bearer.
async fn upgrade(target: &LinkTarget, path: &str, protocol: &'static str) -> Result<Upgraded, LinkError> {
    let token = target.token()?;
    let unreachable = |e: &dyn std::fmt::Display| LinkError::Unreachable(target.authority.clone(), e.to_string());
    let stream = tokio::time::timeout(DIAL_DEADLINE, target.connect())
        .await
        .map_err(|_| unreachable(&"no answer"))?
        .map_err(|e| unreachable(&e))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(&e))?;
    tokio::spawn(connection.with_upgrades());
    let bearer = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
        LinkError::Refused(
            StatusCode::BAD_REQUEST,
            "the identity token is not a header value".into(),
        )
    })?;
    let request = Request::get(path)
        .header(header::HOST, &target.authority)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, protocol)
        .header(header::AUTHORIZATION, bearer)
        .body(Body::empty())
        .map_err(|e| unreachable(&e))?;
    let response = tokio::time::timeout(DIAL_DEADLINE, sender.send_request(request))
        .await
        .map_err(|_| unreachable(&"no answer to the upgrade"))?
        .map_err(|e| unreachable(&e))?;
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        let status = response.status();
        let said = http_body_util::Limited::new(response.into_body(), REFUSAL_MAX_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(LinkError::Refused(status, String::from_utf8_lossy(&said).into_owned()));
    }
    hyper::upgrade::on(response)
        .await
        .map_err(|e| LinkError::Broken(e.to_string()))
}

/// One connection out of the pod, to the egress proxy of the session the pod is bound to.
pub async fn dial_egress(target: &LinkTarget) -> Result<TokioIo<Upgraded>, LinkError> {
    upgrade(target, EGRESS_PATH, EGRESS_PROTOCOL).await.map(TokioIo::new)
}

/// One link: dial, upgrade, serve until it ends.
async fn serve_one(target: &LinkTarget, api: Router) -> Result<(), LinkError> {
    let upgraded = upgrade(target, LINK_PATH, LINK_PROTOCOL).await?;
    tracing::info!(gateway = %target.authority, "linked to the gateway");
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEP_ALIVE)
        .keep_alive_timeout(KEEP_ALIVE)
        .serve_connection(upgraded, TowerToHyperService::new(api))
        .await
        .map_err(|e| LinkError::Broken(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_dials_plain_http_or_a_socket_bound_in() {
        let target = LinkTarget::new("http://sortie-gateway.sortie:7700", Path::new("/t")).expect("url");
        assert!(
            matches!(&target.dial, Dial::Tcp { host, port: 7700 } if host == "sortie-gateway.sortie"),
            "{target:?}"
        );
        let target = LinkTarget::new("http://10.0.0.1", Path::new("/t")).expect("url");
        assert!(matches!(&target.dial, Dial::Tcp { port: 80, .. }), "{target:?}");
        let target = LinkTarget::new("unix:/run/sortie-link/link.sock", Path::new("/t")).expect("url");
        assert!(matches!(&target.dial, Dial::Unix(path) if path == Path::new("/run/sortie-link/link.sock")));
        for bad in ["https://g:7700", "g:7700", "", "http://", "unix:link.sock"] {
            assert!(LinkTarget::new(bad, Path::new("/t")).is_err(), "{bad:?}");
        }
    }
}
