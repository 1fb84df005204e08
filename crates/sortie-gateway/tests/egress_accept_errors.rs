//! S4: the egress proxy's accept loop survives running out of descriptors. The test lowers this
//! process's `RLIMIT_NOFILE` below its next free descriptor, so every accept fails with EMFILE while
//! connections wait in the backlog; once the limit is back, the same loop serves them. (The old loop
//! ended on the first failed accept, and the sandbox lost its proxy for good.)
//!
//! This file holds one test on purpose: the limit is per process, and no other test may run while
//! it is lowered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use sortie_gateway::egress::proxy::{EgressLimits, EgressProxy, FixedAllowlist, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);

/// The lowest descriptor number free now: the first a new socket would take.
fn next_free_descriptor() -> u64 {
    use std::os::fd::AsRawFd;
    let probe = std::fs::File::open("/dev/null").expect("open /dev/null");
    u64::try_from(probe.as_raw_fd()).expect("a descriptor number")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_accept_loop_backs_off_on_emfile_and_serves_again() {
    let dir = tempfile::tempdir().expect("temp");
    let proxy = EgressProxy::with_limits(
        FixedAllowlist::new(Vec::new()),
        Vec::new(),
        Arc::new(StaticResolver::default()),
        None,
        None,
        EgressLimits {
            host_connections: None,
            ..EgressLimits::default()
        },
    );
    let socket = dir.path().join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("socket");
    tokio::spawn(proxy.clone().serve(listener));

    // The clients' sockets exist before the limit drops (connecting takes no new descriptor).
    let clients: Vec<tokio::net::UnixSocket> = (0..3)
        .map(|_| tokio::net::UnixSocket::new_stream().expect("socket"))
        .collect();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, next_free_descriptor(), hard).expect("lower the limit");
    let exhausted = std::fs::File::open("/dev/null").map_err(|error| error.raw_os_error());
    let mut streams = Vec::new();
    for client in clients {
        streams.push(client.connect(&socket).await.expect("connect into the backlog"));
    }
    let before = Instant::now();
    // Several failed accepts in a row: the loop logged, paused and tried again each time.
    while proxy.accept_errors() < 3 && before.elapsed() < DEADLINE {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failed_accepts = proxy.accept_errors();
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("restore the limit");
    assert_eq!(
        exhausted.err(),
        Some(Some(24)),
        "the limit did not exhaust descriptors (EMFILE)"
    );
    assert!(failed_accepts >= 3, "only {failed_accepts} failed accepts were seen");

    // The same loop accepts the waiting connections and serves them, and new ones.
    streams.push(tokio::net::UnixStream::connect(&socket).await.expect("connect"));
    for stream in &mut streams {
        stream
            .write_all(b"GET /_sortie/nothing HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut answer = String::new();
        tokio::time::timeout(DEADLINE, stream.read_to_string(&mut answer))
            .await
            .expect("served after the limit came back")
            .expect("read");
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    }
}
