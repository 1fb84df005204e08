//! Attach against a fake live tail: a client that never reads is disconnected (its socket reset by
//! `attach::run`, no `[DONE]` ever reaching it) while a client on the same session gets every part;
//! mounted in another server, the stalled client still lets its subscription go and never sees a
//! clean end.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures::StreamExt;
use sortie_gateway::attach::AttachState;
use sortie_gateway::live::{LiveTails, TailBody};
use sortie_protocol::SessionId;
use sortie_protocol::api::TicketAction;
use sortie_protocol::chunk::{SSE_DONE, write_sse_event};
use sortie_protocol::ticket::{TICKET_VERSION, TicketClaims, mint};
use sortie_store::{ControlPlane, NewSession, RepoAccess, SqlStore, testing::TestDatabase};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SECRET: &[u8] = b"attach-slow-client-secret";
/// Parts in the turn: with ~1 KiB each, far more than socket and proxy buffers hold.
const PARTS: u64 = 24_000;
const SLOW_CLIENT_LIMIT: Duration = Duration::from_secs(1);

/// A live tail made by `open`, once `ready` (a turn whose live copy has not come up yet answers none).
struct FakeTails {
    ready: std::sync::atomic::AtomicBool,
    open: Box<dyn Fn() -> TailBody + Send + Sync>,
}

impl FakeTails {
    fn new(ready: bool, open: impl Fn() -> TailBody + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            ready: std::sync::atomic::AtomicBool::new(ready),
            open: Box::new(open),
        })
    }
}

impl LiveTails for FakeTails {
    fn open<'a>(
        &'a self,
        _session: &'a SessionId,
        _n: u32,
        _after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        let body = self.ready.load(Ordering::SeqCst).then(|| (self.open)());
        Box::pin(async move { body })
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// How many live tails the fake has opened, and how many are still open.
#[derive(Default)]
struct DriverStreams {
    opened: AtomicUsize,
    open: AtomicUsize,
}

/// Counts a tail as open until the gateway lets go of it.
struct OpenStream(Arc<DriverStreams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A live tail of turn 1 that is [`PARTS`] text deltas, as fast as the reader takes them, then `[DONE]`.
fn fake_tails() -> (Arc<FakeTails>, Arc<DriverStreams>) {
    let streams = Arc::new(DriverStreams::default());
    let counted = streams.clone();
    let tails = FakeTails::new(true, move || {
        counted.opened.fetch_add(1, Ordering::SeqCst);
        counted.open.fetch_add(1, Ordering::SeqCst);
        let open = OpenStream(counted.clone());
        let padding = "x".repeat(1000);
        let parts = futures::stream::iter(0..PARTS).map(move |index| {
            let _held_while_streaming = &open;
            let mut event = Vec::new();
            let json = format!(r#"{{"type":"text-delta","id":"t","delta":"{index} {padding}"}}"#);
            write_sse_event(&mut event, index, &json);
            Ok::<_, std::io::Error>(Bytes::from(event))
        });
        let done = futures::stream::once(async { Ok(Bytes::from_static(SSE_DONE)) });
        Box::pin(parts.chain(done)) as TailBody
    });
    (tails, streams)
}

struct World {
    _temp: tempfile::TempDir,
    state: AttachState,
    store: Arc<SqlStore>,
    driver: Arc<DriverStreams>,
    workspace_id: String,
    session: SessionId,
}

impl World {
    /// A session whose turn 1 waits in the store while the fake driver runs it.
    async fn start() -> World {
        let temp = tempfile::tempdir().expect("temp");
        let store = Arc::new(
            SqlStore::connect(&TestDatabase::sqlite(temp.path()).url)
                .await
                .expect("store"),
        );
        let workspace = store
            .create_workspace("default", RepoAccess::default())
            .await
            .expect("workspace");
        let session = SessionId::generate();
        store
            .create_session(NewSession {
                id: session.clone(),
                workspace_id: workspace.id.clone(),
                repo: "https://github.com/o/r.git".into(),
                base: None,
                agent: "scripted".into(),
                model: None,
                title: "t".into(),
                egress_allow: Vec::new(),
                setup: None,
                task: "t".into(),
                budget: Default::default(),
            })
            .await
            .expect("session");
        let (tails, driver) = fake_tails();
        let state = AttachState {
            store: store.clone(),
            ticket_secret: Arc::from(SECRET),
            tails,
            allowed_origins: Arc::new(Vec::new()),
            heartbeat: Duration::from_secs(15),
            slow_client_limit: SLOW_CLIENT_LIMIT,
        };
        World {
            _temp: temp,
            state,
            store,
            driver,
            workspace_id: workspace.id,
            session,
        }
    }

    fn ticket(&self, nonce: &str) -> String {
        let claims = TicketClaims {
            v: TICKET_VERSION,
            sub: "tok_test".into(),
            ws: self.workspace_id.clone(),
            ses: self.session.to_string(),
            act: TicketAction::Attach,
            exp: now() + 60,
            nonce: nonce.into(),
        };
        mint(SECRET, &claims)
    }

    fn path(&self) -> String {
        format!("/v1/sessions/{}/stream", self.session)
    }

    /// Attaches with a small receive buffer and never reads.
    async fn attach_and_stall(&self, address: std::net::SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("rcvbuf");
        let mut stalled = socket.connect(address).await.expect("connect");
        let request = format!(
            "GET {} HTTP/1.1\r\nhost: {address}\r\nauthorization: Ticket {}\r\n\r\n",
            self.path(),
            self.ticket("stalled")
        );
        stalled.write_all(request.as_bytes()).await.expect("request");
        stalled
    }
}

fn ids(stream: &str) -> Vec<u64> {
    stream
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .filter_map(|id| id.parse().ok())
        .collect()
}

/// Reads what a stalled client can still read, and checks it is the start of the stream and never
/// its end: no `[DONE]`, no last chunk.
async fn read_what_is_left(stalled: &mut TcpStream) {
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stalled.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "the dropped connection still delivers data");
    let text = String::from_utf8_lossy(&received);
    assert!(text.starts_with("HTTP/1.1 200"), "{}", &text[..text.len().min(200)]);
    assert!(!text.contains("[DONE]"), "a dropped client saw the end of the turn");
    assert!(!text.ends_with("\r\n0\r\n\r\n"), "a dropped client saw a clean end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_disconnected_and_the_others_get_every_part() {
    let world = World::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr");
    tokio::spawn(sortie_gateway::attach::run(
        listener,
        world.state.clone(),
        std::future::pending(),
    ));
    let mut stalled = world.attach_and_stall(address).await;
    let stalled_at = Instant::now();

    // A client that reads gets every part, in order, and the end.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let reply = reqwest::Client::new()
        .get(format!("http://{address}{}", world.path()))
        .header("authorization", format!("Ticket {}", world.ticket("reader")))
        .send()
        .await
        .expect("attach");
    assert_eq!(reply.status().as_u16(), 200);
    let body = tokio::time::timeout(Duration::from_secs(120), reply.text())
        .await
        .expect("the reader was not held up")
        .expect("the reader's body");
    assert_eq!(ids(&body), (0..PARTS).collect::<Vec<_>>(), "every part, once, in order");
    assert!(body.ends_with("data: [DONE]\n\n"));

    // The server resets the stalled connection: its socket reports the reset without a byte read.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reset = loop {
        if let Some(error) = stalled.take_error().expect("SO_ERROR") {
            break error;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled client is still connected after {:?}",
            stalled_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(reset.kind(), std::io::ErrorKind::ConnectionReset);
    assert!(
        stalled_at.elapsed() >= SLOW_CLIENT_LIMIT,
        "reset after {:?}, before the limit",
        stalled_at.elapsed()
    );
    read_what_is_left(&mut stalled).await;
    assert_eq!(world.driver.open.load(Ordering::SeqCst), 0, "no live tail left open");
}

/// `sortie serve` mounts the attach router in its own server: there the stalled client's live tail is
/// still let go, and when the client reads again its stream breaks instead of ending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_in_another_server_lets_the_driver_go_and_never_sees_a_clean_end() {
    let world = World::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr");
    let app = sortie_gateway::attach::router(world.state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut stalled = world.attach_and_stall(address).await;
    let stalled_at = Instant::now();

    let deadline = Instant::now() + Duration::from_secs(30);
    while world.driver.opened.load(Ordering::SeqCst) == 0 || world.driver.open.load(Ordering::SeqCst) > 0 {
        assert!(
            Instant::now() < deadline,
            "the live tail of the stalled client is still open after {:?}",
            stalled_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(stalled_at.elapsed() >= SLOW_CLIENT_LIMIT);
    read_what_is_left(&mut stalled).await;
}

/// A live tail of turn 1 that sends two parts, waits until `release` is notified, then sends two more
/// and `[DONE]`; it answers none until it is made ready.
fn paced_tails(release: Arc<tokio::sync::Notify>) -> Arc<FakeTails> {
    FakeTails::new(false, move || {
        let release = release.clone();
        let event = |index: u64| {
            let mut event = Vec::new();
            let json = format!(r#"{{"type":"text-delta","id":"t","delta":"part {index}"}}"#);
            write_sse_event(&mut event, index, &json);
            event
        };
        let first = futures::stream::iter([0, 1].map(|index| Ok::<_, std::io::Error>(Bytes::from(event(index)))));
        let rest = futures::stream::once(async move {
            release.notified().await;
            let mut tail = [event(2), event(3)].concat();
            tail.extend_from_slice(SSE_DONE);
            Ok(Bytes::from(tail))
        });
        Box::pin(first.chain(rest)) as TailBody
    })
}

/// Reads the body until `want` says the text so far is enough, within a deadline.
async fn read_until(
    body: &mut (impl futures::Stream<Item = reqwest::Result<Bytes>> + Unpin),
    text: &mut String,
    want: impl Fn(&str) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !want(text) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, body.next()).await {
            Ok(Some(Ok(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("the stream ended or stalled ({other:?}) with {text:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_an_idle_stream_open_and_only_ever_go_between_events() {
    const HEARTBEAT: &str = ": keep-alive\n\n";
    let mut world = World::start().await;
    let release = Arc::new(tokio::sync::Notify::new());
    let paced = paced_tails(release.clone());
    world.state.tails = paced.clone();
    world.state.heartbeat = Duration::from_millis(100);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr");
    tokio::spawn(sortie_gateway::attach::run(
        listener,
        world.state.clone(),
        std::future::pending(),
    ));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let reply = reqwest::Client::new()
        .get(format!("http://{address}{}", world.path()))
        .header("authorization", format!("Ticket {}", world.ticket("paced")))
        .send()
        .await
        .expect("attach");
    assert_eq!(reply.status().as_u16(), 200);
    let mut body = reply.bytes_stream();
    let mut text = String::new();

    // No live copy yet (the turn has not started): heartbeats, nothing else.
    read_until(&mut body, &mut text, |t| t.matches(HEARTBEAT).count() >= 2).await;
    assert_eq!(
        text,
        HEARTBEAT.repeat(text.matches(HEARTBEAT).count()),
        "only heartbeats before the turn"
    );

    // The live copy comes up, sends two parts and goes quiet: heartbeats again, after whole events only.
    paced.ready.store(true, Ordering::SeqCst);
    let before = text.len();
    read_until(&mut body, &mut text, |t| {
        t.contains("part 1") && t[t.find("part 1").unwrap_or(0)..].matches(HEARTBEAT).count() >= 2
    })
    .await;
    release.notify_one();
    read_until(&mut body, &mut text, |t| t.ends_with("data: [DONE]\n\n")).await;

    let events: Vec<&str> = text[before..].split("\n\n").filter(|e| !e.is_empty()).collect();
    for event in &events {
        assert!(
            *event == ": keep-alive"
                || (event.starts_with("id: ") && event.contains("\ndata: "))
                || *event == "data: [DONE]",
            "a heartbeat broke into an event: {event:?} in {text:?}"
        );
    }
    assert_eq!(ids(&text), vec![0, 1, 2, 3], "every part once: {text:?}");
    assert!(
        events.iter().filter(|e| **e == ": keep-alive").count() >= 2,
        "heartbeats while the turn was quiet: {text:?}"
    );
}

/// Tails read through a connection hold a descriptor each: past the budget the gateway's tails give
/// none (the attach waits with heartbeats), and a closed tail gives its descriptor back.
#[tokio::test]
async fn tails_through_a_connection_stay_within_their_descriptors() {
    let temp = tempfile::tempdir().expect("temp");
    let store = Arc::new(
        SqlStore::connect(&TestDatabase::sqlite(temp.path()).url)
            .await
            .expect("store"),
    );
    let near = FakeTails::new(true, || Box::pin(futures::stream::pending()) as TailBody);
    let tails = sortie_gateway::live::RoutedTails {
        near,
        store,
        secret: Arc::from(SECRET),
        connections: Arc::new(tokio::sync::Semaphore::new(2)),
    };
    let session = SessionId::generate();
    let first = tails.open(&session, 1, None).await.expect("a first tail");
    let second = tails.open(&session, 1, None).await.expect("a second tail");
    assert!(tails.open(&session, 1, None).await.is_none(), "past the budget");
    drop(first);
    let third = tails.open(&session, 1, None).await.expect("the first one's descriptor");
    drop((second, third));

    // The worker's own hubs cost no descriptor: never counted.
    let feeds = sortie_gateway::live::Feeds::new();
    let hub = sortie_feed::hub::TurnHub::new(1, None, 1 << 20).expect("hub");
    feeds.insert(&session, 1, hub);
    let in_memory = sortie_gateway::live::RoutedTails {
        near: feeds,
        store: Arc::new(
            SqlStore::connect(&TestDatabase::sqlite(temp.path()).url)
                .await
                .expect("store"),
        ),
        secret: Arc::from(SECRET),
        connections: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    for _ in 0..3 {
        assert!(in_memory.open(&session, 1, None).await.is_some());
    }
}

/// A worker's copies of ended turns: `kept` answers for turn 1 what the store does not hold, so a
/// reply shows which of them it came from; no live copy of any turn.
struct KeptTails {
    kept: bool,
}

impl LiveTails for KeptTails {
    fn open<'a>(
        &'a self,
        _session: &'a SessionId,
        _n: u32,
        _after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        Box::pin(async { None })
    }

    fn open_ended(&self, _session: &SessionId, n: u32, after: Option<u64>) -> Option<TailBody> {
        if !self.kept || n != 1 {
            return None;
        }
        let mut events = Vec::new();
        for index in after.map_or(0, |k| k + 1)..3 {
            write_sse_event(
                &mut events,
                index,
                &format!(r#"{{"type":"text-delta","id":"t","delta":"kept {index}"}}"#),
            );
        }
        events.extend_from_slice(SSE_DONE);
        Some(Box::pin(futures::stream::iter([Ok(Bytes::from(events))])))
    }
}

/// An ended turn is replayed from the copy its worker kept in memory when there is one (from any
/// part on), and from the store when there is none; a running turn's stored prefix still comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_turn_is_replayed_from_the_kept_copy_when_there_is_one() {
    use sortie_store::{Ledger, NewPart, Transcripts, TurnOutcome};
    let world = World::start().await;
    let store = world.store.clone();
    store
        .claim_turn(&world.session, true, "test")
        .await
        .expect("claim")
        .expect("turn 1");
    let stored: Vec<NewPart> = (0..3)
        .map(|index| NewPart {
            part_index: index,
            payload: format!(r#"{{"type":"text-delta","id":"t","delta":"stored {index}"}}"#),
            driver_index: None,
        })
        .collect();
    assert_eq!(store.append_parts(&world.session, 1, &stored).await.expect("parts"), 3);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr");
    let (use_kept, kept_tails) = (Arc::new(KeptTails { kept: true }), Arc::new(KeptTails { kept: false }));
    let mut with_kept = world.state.clone();
    with_kept.tails = use_kept;
    tokio::spawn(sortie_gateway::attach::run(listener, with_kept, std::future::pending()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let without = listener.local_addr().expect("addr");
    let mut store_only = world.state.clone();
    store_only.tails = kept_tails;
    tokio::spawn(sortie_gateway::attach::run(
        listener,
        store_only,
        std::future::pending(),
    ));

    let read = |address: std::net::SocketAddr, after: Option<u64>, nonce: &'static str| {
        let mut request = reqwest::Client::new()
            .get(format!("http://{address}{}?turn=1", world.path()))
            .header("authorization", format!("Ticket {}", world.ticket(nonce)));
        if let Some(after) = after {
            request = request.header("last-event-id", after.to_string());
        }
        async move {
            let reply = tokio::time::timeout(Duration::from_secs(30), request.send())
                .await
                .expect("answered")
                .expect("attach");
            assert_eq!(reply.status().as_u16(), 200);
            tokio::time::timeout(Duration::from_secs(30), reply.text())
                .await
                .expect("the whole body")
                .expect("body")
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();

    // Running: the stored parts, whatever the worker may keep.
    let running = tokio::time::timeout(
        Duration::from_secs(5),
        reqwest::Client::new()
            .get(format!("http://{address}{}?turn=1", world.path()))
            .header("authorization", format!("Ticket {}", world.ticket("running")))
            .send(),
    )
    .await
    .expect("answered")
    .expect("attach");
    let mut running = running.bytes_stream();
    let mut text = String::new();
    read_until(&mut running, &mut text, |text| text.contains("stored 2")).await;
    assert!(!text.contains("kept"), "{text}");
    drop(running);

    let outcome = TurnOutcome {
        status: sortie_protocol::TurnStatus::Completed,
        head_sha: None,
        failure: None,
    };
    assert!(store.finish_turn(&world.session, 1, outcome).await.expect("finish"));
    let kept = read(address, None, "kept").await;
    assert_eq!(ids(&kept), [0, 1, 2]);
    assert!(kept.contains("kept 0") && !kept.contains("stored"), "{kept}");
    assert!(kept.ends_with("data: [DONE]\n\n"));
    let after = read(address, Some(1), "kept-after").await;
    assert_eq!(ids(&after), [2]);
    assert!(after.contains("kept 2"));
    let from_store = read(without, None, "stored").await;
    assert_eq!(ids(&from_store), [0, 1, 2]);
    assert!(
        from_store.contains("stored 0") && !from_store.contains("kept"),
        "{from_store}"
    );
    assert!(from_store.ends_with("data: [DONE]\n\n"));
}
