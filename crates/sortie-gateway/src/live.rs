//! Live tails (DESIGN §7.1): where attach gets the parts of a running turn that the store does not
//! have yet. The source is always the host's own copy of the turn — the worker's [`Feeds`], written by
//! the host after it checked every part — never a socket of the sandbox (DESIGN §9 invariants 8, 9).
//!
//! In one process the attach subscribes to the worker's feeds directly; a gateway started without the
//! worker role reaches them through the worker's feed socket ([`feed_router`] served by the worker,
//! [`SocketTails`] on the gateway's side), a Unix socket in a directory only the host can open; a
//! gateway on another host finds the turn's worker in the store and reads its feed listener with a feed
//! token ([`RoutedTails`]), so any replica serves any live tail.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sortie_feed::hub::TurnHub;
use sortie_protocol::SessionId;

/// The SSE bytes of a live tail: events after the asked index, then `[DONE]` when the turn ends.
pub type TailBody = Pin<Box<dyn Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// Where attach finds the live copy of a running turn.
pub trait LiveTails: Send + Sync + 'static {
    /// Turn `n`'s parts after index `after` as they come; `None` when there is no live copy of it here
    /// (not started yet, ended, or run by a worker this gateway cannot reach): the store has the rest.
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>>;

    /// Changes whenever a live copy may have come up here, so that an attach waiting for its turn's
    /// opens at once rather than at its next look; `None`: no such signal, the attach looks on its timer.
    fn appeared(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Whether each open tail holds a connection (a descriptor) of this process.
    fn opens_a_connection(&self) -> bool {
        true
    }
}

/// The worker's live turns: one hub per running turn, registered while the host writes it.
pub struct Feeds {
    hubs: RwLock<HashMap<(SessionId, u32), Arc<TurnHub>>>,
    /// Bumped by each [`Feeds::insert`].
    appeared: tokio::sync::watch::Sender<u64>,
}

impl Default for Feeds {
    fn default() -> Self {
        Self {
            hubs: RwLock::default(),
            appeared: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Feeds {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Makes `hub` the live copy of turn `n` of `session` (replacing any earlier one), and wakes the
    /// attaches waiting for one.
    pub fn insert(&self, session: &SessionId, n: u32, hub: Arc<TurnHub>) {
        self.hubs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert((session.clone(), n), hub);
        self.appeared.send_modify(|count| *count = count.wrapping_add(1));
    }

    /// Forgets turn `n`'s live copy, if it is still `hub` (a newer one stays).
    pub fn remove(&self, session: &SessionId, n: u32, hub: &Arc<TurnHub>) {
        let mut hubs = self.hubs.write().unwrap_or_else(|p| p.into_inner());
        if hubs
            .get(&(session.clone(), n))
            .is_some_and(|held| Arc::ptr_eq(held, hub))
        {
            hubs.remove(&(session.clone(), n));
        }
    }

    pub fn get(&self, session: &SessionId, n: u32) -> Option<Arc<TurnHub>> {
        self.hubs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(session.clone(), n))
            .cloned()
    }
}

impl LiveTails for Feeds {
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        let hub = self.get(session, n);
        Box::pin(async move {
            let subscription = hub?.subscribe(after);
            let body = sortie_feed::sse::body(subscription).map(|chunk| chunk.map_err(std::io::Error::other));
            Some(Box::pin(body) as TailBody)
        })
    }

    fn appeared(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.appeared.subscribe())
    }

    /// A subscription to a hub in this process's memory.
    fn opens_a_connection(&self) -> bool {
        false
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AfterQuery {
    after: Option<u64>,
}

/// Who may read a worker's feed.
#[derive(Clone)]
pub enum FeedAccess {
    /// Whoever can open the socket: the worker's feed socket is in a directory only the host opens.
    Socket,
    /// A gateway of another process or host, with a feed token for the turn it reads
    /// (`sortie_protocol::ticket::mint_feed_token`, under the ticket secret every replica shares).
    Token(Arc<[u8]>),
}

#[derive(Clone)]
struct FeedState {
    feeds: Arc<Feeds>,
    access: FeedAccess,
}

/// The authorization scheme of a feed token.
const FEED_SCHEME: &str = "Feed ";

/// The worker's feed: `GET /sessions/{id}/turns/{n}/stream?after=K`, the live copy of a running turn
/// for a gateway in another process (on this host through the feed socket, on another through the
/// worker's feed listener).
pub fn feed_router(feeds: Arc<Feeds>, access: FeedAccess) -> Router {
    Router::new()
        .route("/sessions/{id}/turns/{n}/stream", get(feed_stream))
        .with_state(FeedState { feeds, access })
}

async fn feed_stream(
    State(state): State<FeedState>,
    Path((id, n)): Path<(String, u32)>,
    Query(query): Query<AfterQuery>,
    headers: axum::http::HeaderMap,
) -> Response {
    let Ok(session) = SessionId::parse(&id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if let FeedAccess::Token(secret) = &state.access {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix(FEED_SCHEME));
        let now = crate::attach::now_seconds();
        let allowed = token.is_some_and(|token| {
            sortie_protocol::ticket::verify_feed_token(secret, token, now, session.as_str(), n).is_ok()
        });
        if !allowed {
            metrics::counter!("sortie_feed_refused_total").increment(1);
            return StatusCode::UNAUTHORIZED.into_response();
        }
    }
    let Some(hub) = state.feeds.get(&session, n) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut response = Response::new(Body::from_stream(sortie_feed::sse::body(hub.subscribe(query.after))));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    response
}

/// The feed path of turn `n` of `session`, after `after`.
fn feed_path(base: &str, session: &SessionId, n: u32, after: Option<u64>) -> String {
    match after {
        Some(k) => format!("{base}/sessions/{session}/turns/{n}/stream?after={k}"),
        None => format!("{base}/sessions/{session}/turns/{n}/stream"),
    }
}

/// One GET on a connection already open to a worker's feed: its body, or `None` when the worker has no
/// live copy of the turn (or refused).
async fn read_feed<IO>(io: IO, host: &str, path: String, authorization: Option<String>) -> Option<TailBody>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.ok()?;
    tokio::spawn(connection);
    let mut request = axum::http::Request::get(path).header(header::HOST, host);
    if let Some(authorization) = authorization {
        request = request.header(header::AUTHORIZATION, authorization);
    }
    let request = request.body(http_body_util::Empty::<Bytes>::new()).ok()?;
    let response = sender.send_request(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let body = http_body_util::BodyStream::new(response.into_body()).filter_map(|frame| async move {
        match frame {
            Ok(frame) => frame.into_data().ok().map(Ok),
            Err(error) => Some(Err(std::io::Error::other(error))),
        }
    });
    Some(Box::pin(body) as TailBody)
}

/// The live tails of a worker in another process on this host, through its feed socket.
pub struct SocketTails(pub PathBuf);

impl LiveTails for SocketTails {
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        Box::pin(async move {
            let stream = tokio::net::UnixStream::connect(&self.0).await.ok()?;
            read_feed(stream, "worker", feed_path("", session, n, after), None).await
        })
    }
}

/// Where a worker serves its feed to gateways on other hosts: `http://host:port` with an optional path
/// prefix (a proxy in front of it). Plain HTTP on the deployment's own network: every request carries
/// a feed token for one turn, and what it reads is the host's checked copy of a transcript.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedUrl {
    host: String,
    port: u16,
    base: String,
}

impl FeedUrl {
    pub fn parse(text: &str) -> Result<Self, String> {
        let uri: axum::http::Uri = text.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "{text:?} must be an http:// URL (the feed is served in plain HTTP on the deployment's network)"
            ));
        }
        let authority = uri.authority().ok_or_else(|| format!("{text:?} names no host"))?;
        let port = authority.port_u16().ok_or_else(|| format!("{text:?} names no port"))?;
        if uri.query().is_some() {
            return Err(format!("{text:?} must not have a query"));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Ok(Self {
            host,
            port,
            base: uri.path().trim_end_matches('/').to_owned(),
        })
    }
}

impl std::fmt::Display for FeedUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "http://[{}]:{}{}", self.host, self.port, self.base)
        } else {
            write!(f, "http://{}:{}{}", self.host, self.port, self.base)
        }
    }
}

/// How long a gateway waits to reach a worker's feed.
const FEED_CONNECT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// The live tails any gateway replica serves (DESIGN §15): the near copy when this process (or a worker
/// beside it on this host) has it, else the feed of the worker the store says runs the turn, reached
/// over the network with a feed token.
pub struct RoutedTails {
    pub near: Arc<dyn LiveTails>,
    pub store: Arc<dyn sortie_store::GatewayStore>,
    pub secret: Arc<[u8]>,
    /// One permit per tail read through a connection, near or routed (`DescriptorPlan`'s `T`).
    pub connections: Arc<tokio::sync::Semaphore>,
}

impl RoutedTails {
    /// A descriptor for one more tail through a connection, if the budget has one.
    fn take_connection(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let permit = self.connections.clone().try_acquire_owned().ok();
        if permit.is_none() {
            metrics::counter!("sortie_feed_routes_total", "result" => "no_descriptor").increment(1);
        }
        permit
    }
}

/// `body`, holding `permit` for as long as it is read.
fn holding(body: TailBody, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> TailBody {
    match permit {
        None => body,
        Some(permit) => Box::pin(body.map(move |item| {
            let _held = &permit;
            item
        })),
    }
}

impl LiveTails for RoutedTails {
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        Box::pin(async move {
            let near_permit = if self.near.opens_a_connection() {
                Some(self.take_connection()?)
            } else {
                None
            };
            if let Some(body) = self.near.open(session, n, after).await {
                return Some(holding(body, near_permit));
            }
            drop(near_permit);
            let url = self.store.live_feed(session, n).await.ok()??;
            let permit = self.take_connection()?;
            let Ok(feed) = FeedUrl::parse(&url) else {
                tracing::warn!(%url, "a worker registered a feed address this gateway cannot use");
                return None;
            };
            let connect = tokio::net::TcpStream::connect((feed.host.as_str(), feed.port));
            let stream = match tokio::time::timeout(FEED_CONNECT_DEADLINE, connect).await {
                Ok(Ok(stream)) => stream,
                _ => {
                    metrics::counter!("sortie_feed_routes_total", "result" => "unreachable").increment(1);
                    return None;
                }
            };
            let _ = stream.set_nodelay(true);
            let exp = crate::attach::now_seconds() + sortie_protocol::ticket::FEED_TOKEN_TTL_SECONDS;
            let token = sortie_protocol::ticket::mint_feed_token(&self.secret, session.as_str(), n, exp);
            let host = format!("{}:{}", feed.host, feed.port);
            let body = read_feed(
                stream,
                &host,
                feed_path(&feed.base, session, n, after),
                Some(format!("{FEED_SCHEME}{token}")),
            )
            .await;
            let result = if body.is_some() { "routed" } else { "refused" };
            metrics::counter!("sortie_feed_routes_total", "result" => result).increment(1);
            body.map(|body| holding(body, Some(permit)))
        })
    }

    /// Only this process's worker says when a copy comes up; another worker's is found by looking.
    fn appeared(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.near.appeared()
    }
}

#[cfg(test)]
mod tests {
    use super::{FeedUrl, Feeds, LiveTails};

    /// An attach waiting for a turn's copy is woken by its coming up, not by its next look.
    #[test]
    fn a_live_copy_coming_up_wakes_whoever_waits_for_one() {
        let feeds = Feeds::new();
        let mut appeared = feeds.appeared().expect("the worker's feeds say when a copy comes up");
        appeared.borrow_and_update();
        let session = sortie_protocol::SessionId::generate();
        assert!(!appeared.has_changed().expect("live"));
        let hub = sortie_feed::hub::TurnHub::new(1, None, 1 << 20).expect("hub");
        feeds.insert(&session, 1, hub.clone());
        assert!(appeared.has_changed().expect("live"));
        // Forgetting a copy wakes nobody: there is nothing new to open.
        appeared.borrow_and_update();
        feeds.remove(&session, 1, &hub);
        assert!(!appeared.has_changed().expect("live"));
    }

    #[test]
    fn feed_urls_are_plain_http_with_a_port() {
        let url = FeedUrl::parse("http://10.0.0.7:7450").expect("url");
        assert_eq!(url.to_string(), "http://10.0.0.7:7450");
        assert_eq!(
            FeedUrl::parse("http://worker-0.sortie:7450/feed/")
                .expect("url")
                .to_string(),
            "http://worker-0.sortie:7450/feed"
        );
        assert_eq!(
            FeedUrl::parse("http://[fd00::7]:7450").expect("url").to_string(),
            "http://[fd00::7]:7450"
        );
        for bad in [
            "https://w:7450",
            "http://w",
            "w:7450",
            "http://w:7450/?x=1",
            "",
            "ftp://w:1",
        ] {
            assert!(FeedUrl::parse(bad).is_err(), "{bad:?}");
        }
    }
}
