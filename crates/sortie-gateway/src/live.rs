//! Live tails (DESIGN §7.1): where attach gets the parts of a running turn that the store does not
//! have yet. The source is always the host's own copy of the turn — the worker's [`Feeds`], written by
//! the host after it checked every part — never a socket of the sandbox (DESIGN §9 invariants 8, 9).
//!
//! In one process the attach subscribes to the worker's feeds directly; a gateway started without the
//! worker role reaches them through the worker's feed socket ([`feed_router`] served by the worker,
//! [`SocketTails`] on the gateway's side), a Unix socket in a directory only the host can open; a
//! gateway on another host finds the turn's worker in the store and reads its feed listener with a feed
//! token ([`RoutedTails`]), so any replica serves any live tail.
//!
//! A turn that ended stays in its worker's [`Feeds`] a while (bounded in bytes and age) when it holds
//! what the store holds: someone opening a session just after its turn ended reads it from memory, at
//! the rate the driver serves it, instead of row by row from the store.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

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

    /// Ended turn `n`'s parts after index `after`, then `[DONE]`, from a copy this process kept in
    /// memory when the turn ended; `None` when there is none that holds them all (the store has them).
    fn open_ended(&self, _session: &SessionId, _n: u32, _after: Option<u64>) -> Option<TailBody> {
        None
    }

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

/// The worker's live turns: one hub per running turn, registered while the host writes it; and the
/// copies of the turns that ended lately, kept (within [`ENDED_COPIES_BYTES`] and [`ENDED_COPY_TTL`])
/// so that whoever opens a session just after its turn ends reads it from memory, not from the store.
pub struct Feeds {
    hubs: RwLock<HashMap<(SessionId, u32), Arc<TurnHub>>>,
    ended: Mutex<EndedCopies>,
    /// Bumped by each [`Feeds::insert`].
    appeared: tokio::sync::watch::Sender<u64>,
}

/// The most memory the copies of ended turns hold together; the oldest leave first.
pub const ENDED_COPIES_BYTES: usize = 32 << 20;
/// How long the copy of an ended turn is kept at most: a late reader after that reads the store.
pub const ENDED_COPY_TTL: Duration = Duration::from_secs(600);
/// What one part costs a hub besides its JSON: its shared string's header and its slot.
const PART_OVERHEAD_BYTES: usize = 40;

/// Ended turns' hubs, oldest first, and what they hold.
#[derive(Default)]
struct EndedCopies {
    copies: VecDeque<EndedCopy>,
    bytes: usize,
}

struct EndedCopy {
    key: (SessionId, u32),
    hub: Arc<TurnHub>,
    bytes: usize,
    ended: Instant,
}

impl EndedCopies {
    fn forget(&mut self, key: &(SessionId, u32)) {
        if let Some(at) = self.copies.iter().position(|copy| &copy.key == key)
            && let Some(copy) = self.copies.remove(at)
        {
            self.bytes -= copy.bytes;
        }
    }

    /// Lets the oldest copies go until what is kept fits `budget` and none is older than the TTL.
    fn trim(&mut self, budget: usize, now: Instant) {
        while let Some(oldest) = self.copies.front() {
            if self.bytes <= budget && now.duration_since(oldest.ended) < ENDED_COPY_TTL {
                break;
            }
            if let Some(copy) = self.copies.pop_front() {
                self.bytes -= copy.bytes;
            }
        }
    }
}

impl Default for Feeds {
    fn default() -> Self {
        Self {
            hubs: RwLock::default(),
            ended: Mutex::default(),
            appeared: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Feeds {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn ended_copies(&self) -> std::sync::MutexGuard<'_, EndedCopies> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `hub` the live copy of turn `n` of `session` (replacing any earlier one), and wakes the
    /// attaches waiting for one.
    pub fn insert(&self, session: &SessionId, n: u32, hub: Arc<TurnHub>) {
        let key = (session.clone(), n);
        self.ended_copies().forget(&key);
        self.hubs.write().unwrap_or_else(|p| p.into_inner()).insert(key, hub);
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

    /// Turn `n` ended and `hub` holds it whole as stored: it stops being a live copy and is kept as
    /// the turn's ended copy (if it is still the turn's hub, and while the budget allows).
    pub fn retire(&self, session: &SessionId, n: u32, hub: &Arc<TurnHub>) {
        self.retire_within(session, n, hub, ENDED_COPIES_BYTES);
    }

    /// [`Feeds::retire`] within a budget of its own.
    pub fn retire_within(&self, session: &SessionId, n: u32, hub: &Arc<TurnHub>, budget: usize) {
        let key = (session.clone(), n);
        let mut hubs = self.hubs.write().unwrap_or_else(|p| p.into_inner());
        if !hubs.get(&key).is_some_and(|held| Arc::ptr_eq(held, hub)) {
            return;
        }
        hubs.remove(&key);
        let bytes = hub.memory_bytes() + hub.len() as usize * PART_OVERHEAD_BYTES;
        let mut ended = self.ended_copies();
        ended.forget(&key);
        if hub.is_done() && bytes <= budget {
            ended.bytes += bytes;
            ended.copies.push_back(EndedCopy {
                key,
                hub: hub.clone(),
                bytes,
                ended: Instant::now(),
            });
        }
        ended.trim(budget, Instant::now());
    }

    pub fn get(&self, session: &SessionId, n: u32) -> Option<Arc<TurnHub>> {
        self.hubs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(session.clone(), n))
            .cloned()
    }

    /// The kept copy of ended turn `n`, if it is still kept.
    pub fn ended(&self, session: &SessionId, n: u32) -> Option<Arc<TurnHub>> {
        let mut ended = self.ended_copies();
        ended.trim(usize::MAX, Instant::now());
        let key = (session.clone(), n);
        ended
            .copies
            .iter()
            .find(|copy| copy.key == key)
            .map(|copy| copy.hub.clone())
    }

    /// Bytes the ended turns' copies hold.
    pub fn ended_bytes(&self) -> usize {
        self.ended_copies().bytes
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

    fn open_ended(&self, session: &SessionId, n: u32, after: Option<u64>) -> Option<TailBody> {
        let hub = self.ended(session, n)?;
        if !hub.is_done() || hub.serves_from() > after.map_or(0, |k| k.saturating_add(1)) {
            return None;
        }
        let body = sortie_feed::sse::body(hub.subscribe(after)).map(|chunk| chunk.map_err(std::io::Error::other));
        Some(Box::pin(body))
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

    /// Only this process's worker keeps ended turns for its gateway (one of another process reads the
    /// store, as fast as a feed would serve them).
    fn open_ended(&self, session: &SessionId, n: u32, after: Option<u64>) -> Option<TailBody> {
        if self.near.opens_a_connection() {
            return None;
        }
        self.near.open_ended(session, n, after)
    }

    /// Only this process's worker says when a copy comes up; another worker's is found by looking.
    fn appeared(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.near.appeared()
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

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

    /// A hub of turn `n` holding `parts` parts of about 100 bytes each, from index `first` on, ended.
    fn ended_hub(n: u32, first: u64, parts: u64) -> std::sync::Arc<sortie_feed::hub::TurnHub> {
        let hub = sortie_feed::hub::TurnHub::in_memory_from(n, first);
        let delta = "x".repeat(64);
        hub.publish_encoded((first..first + parts).map(|index| {
            std::sync::Arc::<str>::from(format!(r#"{{"type":"text-delta","id":"{index}","delta":"{delta}"}}"#))
        }));
        hub.finish();
        hub
    }

    async fn read_all(body: super::TailBody) -> String {
        let chunks: Vec<_> = body.collect().await;
        chunks
            .into_iter()
            .map(|chunk| String::from_utf8(chunk.expect("a chunk").to_vec()).expect("text"))
            .collect()
    }

    /// An ended turn's hub is kept for readers just after its end, whole or not at all, and no
    /// longer a live copy; the budget lets the oldest go first.
    #[tokio::test]
    async fn an_ended_turn_is_kept_whole_within_the_budget_and_the_oldest_goes_first() {
        let feeds = Feeds::new();
        let (first, second) = (
            sortie_protocol::SessionId::generate(),
            sortie_protocol::SessionId::generate(),
        );
        let older = ended_hub(1, 0, 10);
        feeds.insert(&first, 1, older.clone());
        assert!(
            feeds.open_ended(&first, 1, None).is_none(),
            "a live copy is not an ended one"
        );
        feeds.retire(&first, 1, &older);
        let one_turn = feeds.ended_bytes();
        assert!(one_turn > 10 * 64, "{one_turn} bytes counted");
        assert!(feeds.get(&first, 1).is_none(), "no longer a live copy");
        let text = read_all(feeds.open_ended(&first, 1, Some(6)).expect("kept")).await;
        let ids: Vec<&str> = text.lines().filter_map(|line| line.strip_prefix("id: ")).collect();
        assert_eq!(ids, ["7", "8", "9"]);
        assert!(text.ends_with("data: [DONE]\n\n"));

        // A hub that starts past what the reader has (a recorder that started again) is not whole.
        let resumed = ended_hub(2, 5, 5);
        feeds.insert(&first, 2, resumed.clone());
        feeds.retire(&first, 2, &resumed);
        assert!(feeds.open_ended(&first, 2, None).is_none());
        assert!(feeds.open_ended(&first, 2, Some(3)).is_none());
        assert!(feeds.open_ended(&first, 2, Some(4)).is_some());

        // Within a budget that holds one turn like it, the newest stays.
        let newer = ended_hub(1, 0, 10);
        feeds.insert(&second, 1, newer.clone());
        feeds.retire_within(&second, 1, &newer, one_turn);
        assert_eq!(feeds.ended_bytes(), one_turn);
        assert!(feeds.open_ended(&second, 1, None).is_some());
        assert!(feeds.open_ended(&first, 1, None).is_none(), "the oldest went first");

        // A turn that starts again is a live copy once more, not an ended one.
        let again = sortie_feed::hub::TurnHub::in_memory(1);
        feeds.insert(&second, 1, again.clone());
        assert!(feeds.open_ended(&second, 1, None).is_none());
        // A hub that is not the turn's any more is not kept.
        feeds.retire(&second, 1, &newer);
        assert!(
            feeds
                .get(&second, 1)
                .is_some_and(|held| std::sync::Arc::ptr_eq(&held, &again))
        );
        assert!(feeds.open_ended(&second, 1, None).is_none());
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
