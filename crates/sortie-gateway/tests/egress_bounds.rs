//! What one sandbox can make its egress proxy hold is bounded (S4): past its connection cap a new
//! connection gets no service until one closes (it waits in the socket's backlog, costing the host
//! no descriptor); a request head that never completes is dropped at the header deadline; a CONNECT
//! tunnel or a forwarded request that goes quiet is closed at the idle deadline and gives its slot
//! back; and a budget shared by all sandboxes caps them together (past it a new connection is
//! closed at once).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_gateway::egress::policy::Cidr;
use sortie_gateway::egress::proxy::{EgressLimits, EgressProxy, FixedAllowlist, HostConnections, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection must stay unanswered to count as "not served".
const QUIET: Duration = Duration::from_millis(500);
const ALLOWED: &str = "pkg.sortie-test.dev";

struct Sandbox {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    proxy: Arc<EgressProxy>,
}

/// A proxy on a socket of its own that lets `ALLOWED` reach 127.0.0.1, with `limits`.
fn start(limits: EgressLimits) -> Sandbox {
    let dir = tempfile::tempdir().expect("temp");
    let names: HashMap<String, Vec<IpAddr>> = [(ALLOWED.to_owned(), vec!["127.0.0.1".parse().expect("ip")])].into();
    let proxy = EgressProxy::with_limits(
        FixedAllowlist::new(vec![ALLOWED.to_owned()]),
        vec![Cidr::parse("127.0.0.1/32").expect("cidr")],
        Arc::new(StaticResolver(names)),
        None,
        None,
        limits,
    );
    let socket = dir.path().join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("socket");
    tokio::spawn(proxy.clone().serve(listener));
    Sandbox {
        _dir: dir,
        socket,
        proxy,
    }
}

fn limits(max_connections: usize) -> EgressLimits {
    EgressLimits {
        max_connections,
        header_read_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        host_connections: None,
    }
}

/// A request the proxy answers itself (no internal router: 404), on `stream`. A connection the
/// proxy already closed fails the write; the answer (none) says so.
async fn ask(stream: &mut UnixStream) {
    let _ = stream
        .write_all(b"GET /_sortie/nothing HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        .await;
}

/// The start of the answer on `stream`, if one comes within `within`.
async fn answer_within(stream: &mut UnixStream, within: Duration) -> Option<String> {
    let mut buffer = vec![0_u8; 4096];
    match tokio::time::timeout(within, stream.read(&mut buffer)).await {
        Ok(Ok(read)) if read > 0 => Some(String::from_utf8_lossy(&buffer[..read]).into_owned()),
        _ => None,
    }
}

/// Whether the proxy closed `stream` (end of file or reset) within `within`.
async fn closed_within(stream: &mut UnixStream, within: Duration) -> bool {
    let mut buffer = vec![0_u8; 4096];
    let ended = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    ended.is_ok()
}

async fn connect(socket: &Path) -> UnixStream {
    UnixStream::connect(socket).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_a_new_connection_waits_until_one_closes() {
    let sandbox = start(limits(4));
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = connect(&sandbox.socket).await;
        ask(&mut stream).await;
        let answer = answer_within(&mut stream, DEADLINE).await.expect("served");
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
        held.push(stream);
    }
    assert_eq!(sandbox.proxy.connections_available(), 0);

    // Connected (the backlog takes it) but not accepted: no answer while four are held.
    let mut extra = connect(&sandbox.socket).await;
    ask(&mut extra).await;
    assert_eq!(
        answer_within(&mut extra, QUIET).await,
        None,
        "a fifth connection was served"
    );

    // One closes: the waiting connection is accepted and answered.
    drop(held.pop());
    let answer = answer_within(&mut extra, DEADLINE)
        .await
        .expect("served once a slot was free");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_that_never_ends_is_dropped_at_the_header_deadline() {
    let timeout = Duration::from_millis(300);
    let sandbox = start(EgressLimits {
        header_read_timeout: timeout,
        ..limits(1)
    });
    let started = Instant::now();
    let mut slow = connect(&sandbox.socket).await;
    slow.write_all(b"GET /_sortie/nothing HTTP/1.1\r\nHost: x\r\nX-a: ")
        .await
        .expect("write");
    assert!(closed_within(&mut slow, DEADLINE).await, "a half-sent head was held");
    assert!(started.elapsed() >= timeout);

    // A kept-alive connection that sends nothing more is dropped the same way.
    let mut idle = connect(&sandbox.socket).await;
    ask(&mut idle).await;
    assert!(answer_within(&mut idle, DEADLINE).await.is_some());
    assert!(
        closed_within(&mut idle, DEADLINE).await,
        "an idle kept-alive connection was held"
    );

    // The only slot is back.
    let mut next = connect(&sandbox.socket).await;
    ask(&mut next).await;
    assert!(answer_within(&mut next, DEADLINE).await.is_some());
}

/// An upstream that echoes what it reads, on 127.0.0.1.
async fn echo_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut reader, mut writer) = stream.split();
                let _ = tokio::io::copy(&mut reader, &mut writer).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tunnel_is_closed_and_gives_its_slot_back() {
    let idle = Duration::from_millis(400);
    let sandbox = start(EgressLimits {
        idle_timeout: idle,
        ..limits(1)
    });
    let port = echo_server().await;
    let mut tunnel = connect(&sandbox.socket).await;
    tunnel
        .write_all(format!("CONNECT {ALLOWED}:{port} HTTP/1.1\r\nhost: {ALLOWED}:{port}\r\n\r\n").as_bytes())
        .await
        .expect("connect request");
    let answer = answer_within(&mut tunnel, DEADLINE).await.expect("CONNECT answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Traffic keeps it open past the idle limit.
    let started = Instant::now();
    let mut last_traffic = started;
    while started.elapsed() < idle * 2 {
        // Stamped before the write: the proxy sees this traffic (and its echo) after the stamp, never
        // before, however the threads are scheduled.
        last_traffic = Instant::now();
        tunnel.write_all(b"ping").await.expect("write");
        let echoed = answer_within(&mut tunnel, DEADLINE).await.expect("echo");
        assert_eq!(echoed, "ping");
        tokio::time::sleep(idle / 4).await;
    }
    // The tunnel holds the sandbox's only slot: another connection waits.
    let mut waiting = connect(&sandbox.socket).await;
    ask(&mut waiting).await;
    assert_eq!(answer_within(&mut waiting, QUIET.min(idle / 2)).await, None);

    // Quiet: closed, and the slot goes to the waiting connection.
    assert!(closed_within(&mut tunnel, DEADLINE).await, "a quiet tunnel was held");
    assert!(
        last_traffic.elapsed() >= idle,
        "closed before it was quiet for the limit"
    );
    let answer = answer_within(&mut waiting, DEADLINE)
        .await
        .expect("served after the tunnel closed");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_whose_upstream_goes_quiet_is_ended() {
    // An upstream that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let idle = Duration::from_millis(400);
    let sandbox = start(EgressLimits {
        idle_timeout: idle,
        ..limits(1)
    });
    let started = Instant::now();
    let mut stream = connect(&sandbox.socket).await;
    stream
        .write_all(format!("GET http://{ALLOWED}:{port}/ HTTP/1.1\r\nhost: {ALLOWED}:{port}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let answer = answer_within(&mut stream, DEADLINE).await.expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(started.elapsed() >= idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_budget_caps_all_sandboxes_together() {
    let host = HostConnections::new(3);
    let first = start(EgressLimits {
        host_connections: Some(host.clone()),
        ..limits(8)
    });
    let second = start(EgressLimits {
        host_connections: Some(host.clone()),
        ..limits(8)
    });
    let mut held = Vec::new();
    for socket in [&first.socket, &first.socket, &second.socket] {
        let mut stream = connect(socket).await;
        ask(&mut stream).await;
        assert!(answer_within(&mut stream, DEADLINE).await.is_some());
        held.push(stream);
    }
    assert_eq!(host.available(), 0);
    // Past the budget: closed at once, in any sandbox.
    let mut refused = connect(&second.socket).await;
    ask(&mut refused).await;
    assert!(
        closed_within(&mut refused, DEADLINE).await,
        "a connection past the host budget was kept"
    );
    // A slot freed in one sandbox serves another.
    drop(held.remove(0));
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut stream = connect(&second.socket).await;
        ask(&mut stream).await;
        if answer_within(&mut stream, DEADLINE).await.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the freed slot never served the other sandbox"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
