//! The API listener's bounds from a client's side (S11): half-sent request heads (slowloris) are
//! dropped after the header deadline while normal requests are served; a connection that sends
//! nothing, or half an HTTP/2 preface, is dropped the same way; connections past the per-address cap
//! are closed at once while other addresses are served; past the global cap a connection waits
//! until one closes; HTTP/2 still works and shutdown still waits for open connections gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_server::{AgentCatalog, ApiState, ListenerLimits, Secret};
use sortie_store::testing::TestDatabase;
use sortie_store::{KeyRing, SqlStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection must stay unanswered to count as "not served".
const QUIET: Duration = Duration::from_millis(500);
const HALF_SENT_HEAD: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: ";
const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n";

struct Server {
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

async fn start(limits: ListenerLimits) -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(
        SqlStore::connect(&TestDatabase::sqlite(dir.path()).url)
            .await
            .expect("store"),
    );
    let state = ApiState {
        store,
        agents: Arc::new(AgentCatalog::default()),
        ticket_secret: Secret::new(b"test-ticket-secret".to_vec()),
        keyring: Arc::new(KeyRing::generate().expect("keyring")),
        signins: Arc::new(sortie_server::signin::SignIns::default()),
        webhook_exempt: Default::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(sortie_server::run_with_limits(
        listener,
        state,
        axum::Router::new(),
        None,
        limits,
        async move {
            let _ = stopped.await;
        },
    ));
    Server {
        address,
        stop: Some(stop),
        task,
        _dir: dir,
    }
}

/// A connection to `server` from `source` (any address of 127/8 works on Linux's loopback).
async fn connect_from(server: SocketAddr, source: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{source}:0").parse().expect("source address"))
        .expect("bind the source");
    socket.connect(server).await.expect("connect")
}

/// The start of the answer on `stream`, if one comes within `within`.
async fn answer_within(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut buffer = vec![0_u8; 4096];
    match tokio::time::timeout(within, stream.read(&mut buffer)).await {
        Ok(Ok(read)) if read > 0 => Some(String::from_utf8_lossy(&buffer[..read]).into_owned()),
        _ => None,
    }
}

/// Whether the server closed `stream` (end of file or reset) within `within`, without answering.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buffer = [0_u8; 1024];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buffer)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// `GET /healthz` on a fresh connection from `source`; the status line, if answered.
async fn healthz_from(server: SocketAddr, source: &str) -> Option<String> {
    let mut stream = connect_from(server, source).await;
    stream.write_all(HEALTHZ).await.ok()?;
    answer_within(&mut stream, DEADLINE)
        .await
        .map(|answer| answer.lines().next().unwrap_or_default().to_owned())
}

/// The soft descriptor limit raised so that `needed` more fit, if the hard limit allows.
fn make_room_for(needed: u64) -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft < needed && soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard.min(needed.max(soft)), hard).expect("raise the limit");
    }
    getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit").0
}

/// S11 at the size of the review's proof: 3,000 connections that each send half a request head and
/// then nothing. All are dropped once the header deadline passes; meanwhile a normal request is
/// served. (About 1 s to open them and the 2 s deadline on this machine; see the printed timings.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_half_sent_requests_are_dropped_after_the_header_timeout() {
    const HELD: usize = 3000;
    // Both ends of each connection live in this process.
    let limit = make_room_for(2 * HELD as u64 + 512);
    assert!(
        limit >= 2 * HELD as u64 + 256,
        "RLIMIT_NOFILE {limit} cannot hold {HELD} connections twice"
    );
    let header_read_timeout = Duration::from_secs(2);
    let server = start(ListenerLimits {
        header_read_timeout,
        max_connections: HELD + 100,
        max_connections_per_ip: HELD + 100,
    })
    .await;

    let started = Instant::now();
    let mut held = Vec::with_capacity(HELD);
    for _ in 0..HELD {
        let mut stream = TcpStream::connect(server.address).await.expect("connect");
        stream.write_all(HALF_SENT_HEAD).await.expect("write");
        held.push(stream);
    }
    let opened = started.elapsed();
    assert_eq!(
        healthz_from(server.address, "127.0.0.1").await.as_deref(),
        Some("HTTP/1.1 200 OK"),
        "a normal request while {HELD} half-sent ones are held"
    );

    let waits: Vec<_> = held
        .into_iter()
        .map(|mut stream| {
            tokio::spawn(async move {
                let mut buffer = [0_u8; 1024];
                loop {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return Instant::now(),
                        // hyper may answer the timeout with a 408 before it closes.
                        Ok(_) => {}
                    }
                }
            })
        })
        .collect();
    let mut last_closed = started;
    let all_closed = tokio::time::timeout(header_read_timeout + opened + Duration::from_secs(20), async {
        for wait in waits {
            last_closed = last_closed.max(wait.await.expect("join"));
        }
    })
    .await;
    assert!(all_closed.is_ok(), "some half-sent connections were still held");
    println!(
        "{HELD} half-sent requests: opened in {opened:?}, all dropped {:?} after the first was opened \
         (header deadline {header_read_timeout:?})",
        last_closed - started
    );
    assert_eq!(
        healthz_from(server.address, "127.0.0.1").await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_or_half_an_http2_preface_is_dropped_at_the_deadline() {
    let header_read_timeout = Duration::from_millis(500);
    let server = start(ListenerLimits {
        header_read_timeout,
        ..ListenerLimits::default()
    })
    .await;
    for sent in [&b""[..], b"PRI * HTTP/2.0\r\n", HALF_SENT_HEAD] {
        let started = Instant::now();
        let mut stream = TcpStream::connect(server.address).await.expect("connect");
        stream.write_all(sent).await.expect("write");
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest)).await;
        assert!(ended.is_ok(), "{sent:?}: held past the deadline");
        assert!(
            started.elapsed() >= header_read_timeout,
            "{sent:?}: dropped before the deadline"
        );
    }
    // A kept-alive connection that goes quiet after a request is dropped too.
    let mut stream = TcpStream::connect(server.address).await.expect("connect");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let answer = answer_within(&mut stream, DEADLINE).await.expect("answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        closed_within(&mut stream, DEADLINE).await,
        "an idle kept-alive connection was held"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_per_address_cap_a_connection_is_closed_and_other_addresses_are_served() {
    let server = start(ListenerLimits {
        header_read_timeout: Duration::from_secs(60),
        max_connections: 100,
        max_connections_per_ip: 3,
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut stream = connect_from(server.address, "127.0.0.1").await;
        stream.write_all(HALF_SENT_HEAD).await.expect("write");
        held.push(stream);
    }
    let mut fourth = connect_from(server.address, "127.0.0.1").await;
    let _ = fourth.write_all(HEALTHZ).await;
    assert!(
        closed_within(&mut fourth, DEADLINE).await,
        "a fourth connection from one address was kept"
    );
    assert_eq!(
        healthz_from(server.address, "127.0.0.2").await.as_deref(),
        Some("HTTP/1.1 200 OK"),
        "another address is served"
    );

    // One of the three closes: the address may connect again.
    drop(held.pop());
    let deadline = Instant::now() + DEADLINE;
    while healthz_from(server.address, "127.0.0.1").await.as_deref() != Some("HTTP/1.1 200 OK") {
        assert!(Instant::now() < deadline, "the address never got its slot back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_global_cap_a_connection_waits_until_one_closes() {
    let server = start(ListenerLimits {
        header_read_timeout: Duration::from_secs(60),
        max_connections: 2,
        max_connections_per_ip: 100,
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(server.address).await.expect("connect");
        stream.write_all(HALF_SENT_HEAD).await.expect("write");
        held.push(stream);
    }
    let mut waiting = TcpStream::connect(server.address).await.expect("connect (backlog)");
    waiting.write_all(HEALTHZ).await.expect("write");
    assert_eq!(
        answer_within(&mut waiting, QUIET).await,
        None,
        "a third connection was served"
    );
    drop(held.pop());
    let answer = answer_within(&mut waiting, DEADLINE)
        .await
        .expect("served once one closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_is_served_and_shutdown_waits_for_open_connections() {
    use http_body_util::{BodyExt, Empty};
    let mut server = start(ListenerLimits::default()).await;

    let stream = TcpStream::connect(server.address).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    let h2_connection = tokio::spawn(connection);
    let request = axum::http::Request::get(format!("http://{}/healthz", server.address))
        .body(Empty::<axum::body::Bytes>::new())
        .expect("request");
    let answer = sender.send_request(request).await.expect("h2 answer");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.version(), axum::http::Version::HTTP_2);
    let body = answer.into_body().collect().await.expect("body").to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("ok"), "{body:?}");

    // An HTTP/1.1 keep-alive connection is open too; shutdown closes both and then returns.
    let mut kept = TcpStream::connect(server.address).await.expect("connect");
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    assert!(answer_within(&mut kept, DEADLINE).await.is_some());
    if let Some(stop) = server.stop.take() {
        let _ = stop.send(());
    }
    let ended = tokio::time::timeout(DEADLINE, &mut server.task).await;
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "the server did not shut down: {ended:?}"
    );
    assert!(closed_within(&mut kept, DEADLINE).await);
    let h2_ended = tokio::time::timeout(DEADLINE, h2_connection).await;
    assert!(h2_ended.is_ok(), "the HTTP/2 connection was not closed");
    assert!(
        TcpStream::connect(server.address).await.is_err(),
        "still accepting after shutdown"
    );
}
