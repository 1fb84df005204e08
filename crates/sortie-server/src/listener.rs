//! The API listener's accept loop (S11): HTTP/1.1 and HTTP/2 on one port, as `axum::serve` did, with
//! the bounds it lacks. A connection must finish each request head within
//! [`ListenerLimits::header_read_timeout`] (an idle kept-alive connection too), and an HTTP/2
//! preface within the same time; at most [`ListenerLimits::max_connections`] connections are open
//! (past it new ones wait in the kernel's backlog, costing no descriptor), and at most
//! [`ListenerLimits::max_connections_per_ip`] from one address (past it a new one is closed at once).
//! Graceful shutdown stops accepting, asks every connection to finish, and waits for them.
//!
//! [`DescriptorPlan`] sizes these caps and the sandboxes' egress budget from `RLIMIT_NOFILE`, so that
//! connections, from the network or from sandboxes, never take the last descriptors the store and
//! the process itself need. This must never hold a connection the client leaves silent, and never
//! accept past a cap.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tower::ServiceExt;

/// How long a client may take to send a request head (and how long a kept-alive connection may
/// sit idle between requests). Browsers and the CLI send a head in one packet; ten seconds is
/// generous for any real client over a slow link and short for one that holds connections open.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The API connections open at once by default ([`DescriptorPlan`] lowers it on a small descriptor
/// limit; an operator raises it with `sortie serve --max-connections`, e.g. for thousands of people
/// watching streams).
pub const MAX_CONNECTIONS: usize = 4096;
/// The API connections one IP address may hold at once. A browser opens at most 6 per origin over
/// HTTP/1.1 and a CLI a handful; 512 leaves room for many users behind one NAT. Behind a reverse
/// proxy every client has the proxy's address: raise it there (`sortie serve
/// --max-connections-per-ip`), or let the proxy limit.
pub const MAX_CONNECTIONS_PER_IP: usize = 512;
/// Descriptors kept for the store, logs, the process's own files and the worker's per-sandbox
/// handles: no cap of [`DescriptorPlan`] reaches into them.
pub const DESCRIPTOR_RESERVE: u64 = 256;
/// The descriptors one API connection holds: its socket. An attach stream whose live tail is read
/// through a connection (another worker's feed) holds a second, counted apart:
/// [`DescriptorPlan::tail_connections`].
pub const FDS_PER_API_CONNECTION: u64 = 1;

/// The bounds of the API listener (see the constants for each value's reason).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
            max_connections_per_ip: MAX_CONNECTIONS_PER_IP,
        }
    }
}

/// The API connections an operator asks for: at most `total` open at once, `per_ip` from one
/// address. [`DescriptorPlan`] grants them as far as the descriptor limit allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionCaps {
    pub total: usize,
    pub per_ip: usize,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        Self {
            total: MAX_CONNECTIONS,
            per_ip: MAX_CONNECTIONS_PER_IP,
        }
    }
}

/// How the process's descriptors are shared, from its `RLIMIT_NOFILE` (`L`) and the operator's
/// [`ConnectionCaps`] (`C`, by default [`MAX_CONNECTIONS`]):
///
/// - `R` = [`DESCRIPTOR_RESERVE`] (256) stay free for the store and the process;
/// - the API takes at most half of the rest, or three quarters when the operator raised `C` past its
///   default (thousands of people watching streams): `A = min(C, (L - R) / 2)` connections of
///   [`FDS_PER_API_CONNECTION`] (1) descriptor each;
/// - live tails read through a connection (a gateway's attach to a turn of another worker) take a
///   quarter of what is left, `T = (L - R - A) / 4`, one descriptor each; past it such an attach
///   waits for one (heartbeats go on) rather than take another's descriptor;
/// - the sandboxes' egress proxies share the rest: `E = (L - R - A - T) / W` connections, `W` the
///   descriptors one egress connection can hold (`FDS_PER_CONNECTION` of the gateway, 4).
///
/// So `A + T + W·E ≤ L - R`: API, tails and sandboxes together never take the last `R` descriptors.
/// For `L = 1024`: `A = 384`, `E = 72`; `L = 20000`: `A = 4096`, `E = 2934` (`C = 12000`:
/// `A = 12000`, `E = 1452`); `L = 1048576`: `A = 4096`, `E = 195792`. One sandbox never takes more
/// than its own cap of `E`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DescriptorPlan {
    pub open_files_limit: u64,
    pub api_connections: usize,
    pub api_connections_per_ip: usize,
    pub tail_connections: usize,
    pub egress_connections: usize,
}

impl DescriptorPlan {
    pub fn for_limit(open_files_limit: u64, fds_per_egress_connection: u64, caps: ConnectionCaps) -> Self {
        let usable = open_files_limit.saturating_sub(DESCRIPTOR_RESERVE);
        let share = if caps.total > MAX_CONNECTIONS {
            usable / 4 * 3
        } else {
            usable / 2
        };
        let wanted = u64::try_from(caps.total).unwrap_or(u64::MAX).max(1);
        let api = (share / FDS_PER_API_CONNECTION).clamp(1, wanted);
        let left = usable.saturating_sub(api * FDS_PER_API_CONNECTION);
        let tails = left / 4;
        let egress = left.saturating_sub(tails) / fds_per_egress_connection.max(1);
        let count = |n: u64| usize::try_from(n.max(1)).unwrap_or(usize::MAX);
        let api_connections = count(api);
        Self {
            open_files_limit,
            api_connections,
            api_connections_per_ip: api_connections.min(caps.per_ip.max(1)),
            tail_connections: count(tails),
            egress_connections: count(egress),
        }
    }

    /// The listener's limits under this plan.
    pub fn listener_limits(&self) -> ListenerLimits {
        self.shared_listener_limits(1)
    }

    /// The limits of each of `listeners` listeners that share the API's descriptors (a worker's feed
    /// and link listeners beside the API's): together they hold at most `A` connections.
    pub fn shared_listener_limits(&self, listeners: usize) -> ListenerLimits {
        let max_connections = (self.api_connections / listeners.max(1)).max(1);
        ListenerLimits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_connections,
            max_connections_per_ip: self.api_connections_per_ip.min(max_connections),
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes, then waits for the
/// open connections to finish.
pub(crate) async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    let connections = Arc::new(Semaphore::new(limits.max_connections.clamp(1, Semaphore::MAX_PERMITS)));
    let peers = Arc::new(PeerCounts {
        limit: limits.max_connections_per_ip.max(1),
        counts: Mutex::new(HashMap::new()),
    });
    // Dropping `stop_rx` asks every connection to finish; each holds a `done_rx` until it has.
    let (stop_tx, stop_rx) = watch::channel(());
    let (done_tx, done_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        // A slot before the accept: past the cap, a connection waits in the backlog.
        let slot = tokio::select! {
            slot = connections.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let Some(peer_slot) = PeerCounts::admit(&peers, peer.ip()) else {
            metrics::counter!("sortie_api_connections_refused_total", "reason" => "per_ip").increment(1);
            tracing::debug!(peer = %peer.ip(), limit = peers.limit, "too many connections from one address; closed");
            continue;
        };
        let connection = Connection {
            router: router.clone(),
            header_read_timeout: limits.header_read_timeout,
            _slot: slot,
            _peer_slot: peer_slot,
            stop: stop_tx.clone(),
            _done: done_rx.clone(),
        };
        tokio::spawn(connection.serve(io));
    }
    drop(listener);
    drop(stop_rx);
    drop(done_rx);
    tracing::debug!("waiting for the open connections to finish");
    done_tx.closed().await;
    Ok(())
}

/// One accepted connection and what it holds until it ends.
struct Connection {
    router: Router,
    header_read_timeout: Duration,
    _slot: OwnedSemaphorePermit,
    _peer_slot: PeerSlot,
    stop: watch::Sender<()>,
    _done: watch::Receiver<()>,
}

impl Connection {
    async fn serve<Io>(self, io: Io)
    where
        Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let io = TokioIo::new(PrefaceDeadline::new(io, self.header_read_timeout));
        let service = self
            .router
            .clone()
            .map_request(|request: Request<Incoming>| request.map(Body::new));
        let service = TowerToHyperService::new(service);
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout);
        // As `axum::serve`: the extended CONNECT protocol, for HTTP/2 websockets.
        builder.http2().timer(TokioTimer::new()).enable_connect_protocol();
        let mut connection = pin!(builder.serve_connection_with_upgrades(io, service));
        let mut stop = pin!(self.stop.closed());
        let mut stopping = false;
        loop {
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::trace!(%error, "connection ended");
                    }
                    break;
                }
                () = &mut stop, if !stopping => {
                    stopping = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Connections open per peer address.
struct PeerCounts {
    limit: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

impl PeerCounts {
    /// A slot for one more connection from `ip`, or `None` at the limit.
    fn admit(peers: &Arc<Self>, ip: IpAddr) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut counts = peers.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(ip).or_insert(0);
        if *count >= peers.limit {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: peers.clone(),
            ip,
        })
    }
}

/// One connection's place in its peer's count, given back on drop.
struct PeerSlot {
    peers: Arc<PeerCounts>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.peers.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

/// The prefix an HTTP/2 client opens with (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection that must show which protocol it speaks within a deadline. hyper-util's version
/// detection reads until the first byte that is not the HTTP/2 preface, or the whole preface, with
/// no timeout of its own; this fails that read once the deadline passes. It disarms as soon as the
/// protocol is known (HTTP/1's own header deadline takes over).
struct PrefaceDeadline<Io> {
    io: Io,
    matched: usize,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<Io> PrefaceDeadline<Io> {
    fn new(io: Io, within: Duration) -> Self {
        Self {
            io,
            matched: 0,
            deadline: Some(Box::pin(tokio::time::sleep(within))),
        }
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for PrefaceDeadline<Io> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(deadline) = &mut this.deadline else {
            return poll;
        };
        match poll {
            Poll::Ready(Ok(())) => {
                let read = &buf.filled()[before..];
                let end = (this.matched + read.len()).min(H2_PREFACE.len());
                let taken = end - this.matched;
                let decided =
                    read.is_empty() || read[..taken] != H2_PREFACE[this.matched..end] || end == H2_PREFACE.len();
                if decided {
                    this.deadline = None;
                } else {
                    this.matched = end;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    metrics::counter!("sortie_api_connections_refused_total", "reason" => "preface_timeout")
                        .increment(1);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent no request in time",
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
            error => error,
        }
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for PrefaceDeadline<Io> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_shared_with_a_reserve_kept() {
        let cases = [
            (1024, 384, 384, 72),
            (20_000, 4096, 512, 2934),
            (1_048_576, 4096, 512, 195_792),
            (256, 1, 1, 1),
            (0, 1, 1, 1),
        ];
        for (limit, api, per_ip, egress) in cases {
            let plan = DescriptorPlan::for_limit(limit, 4, ConnectionCaps::default());
            assert_eq!(
                (
                    plan.api_connections,
                    plan.api_connections_per_ip,
                    plan.egress_connections
                ),
                (api, per_ip, egress),
                "limit {limit}"
            );
            if limit > DESCRIPTOR_RESERVE + 8 {
                let used = plan.api_connections as u64 * FDS_PER_API_CONNECTION
                    + plan.tail_connections as u64
                    + plan.egress_connections as u64 * 4;
                assert!(used <= limit - DESCRIPTOR_RESERVE, "limit {limit}: {used} used");
                // An api, a feed and a link listener in one process share the API's part.
                let three: usize = (0..3).map(|_| plan.shared_listener_limits(3).max_connections).sum();
                assert!(three <= plan.api_connections, "limit {limit}: {three} listener slots");
            }
        }
        let plan = DescriptorPlan::for_limit(20_000, 4, ConnectionCaps::default());
        assert_eq!(plan.tail_connections, 3912);
        assert_eq!(plan.shared_listener_limits(2).max_connections, 2048);
        assert_eq!(plan.shared_listener_limits(1), plan.listener_limits());
        assert_eq!(
            DescriptorPlan::for_limit(0, 4, ConnectionCaps::default())
                .shared_listener_limits(3)
                .max_connections,
            1
        );
    }

    #[test]
    fn an_operators_caps_are_granted_as_far_as_the_descriptors_go() {
        let many = ConnectionCaps {
            total: 12_000,
            per_ip: 2_000,
        };
        // Room for them: granted whole, with descriptors left for tails and egress.
        for limit in [20_000, 1_048_576] {
            let plan = DescriptorPlan::for_limit(limit, 4, many);
            assert_eq!((plan.api_connections, plan.api_connections_per_ip), (12_000, 2_000));
            let used = 12_000 + plan.tail_connections as u64 + plan.egress_connections as u64 * 4;
            assert!(used <= limit - DESCRIPTOR_RESERVE, "limit {limit}: {used} used");
        }
        // Past the default the API may take three quarters of what is not reserved, never more.
        let plan = DescriptorPlan::for_limit(10_000, 4, many);
        assert_eq!(plan.api_connections, 7_308);
        assert_eq!((plan.tail_connections, plan.egress_connections), (609, 456));
        // Fewer than the default is honoured too, and a zero is read as one (a listener that serves).
        let few = DescriptorPlan::for_limit(1_048_576, 4, ConnectionCaps { total: 0, per_ip: 0 });
        assert_eq!((few.api_connections, few.api_connections_per_ip), (1, 1));
    }

    #[test]
    fn a_peer_count_gives_its_slot_back() {
        let peers = Arc::new(PeerCounts {
            limit: 2,
            counts: Mutex::new(HashMap::new()),
        });
        let one: IpAddr = "127.0.0.1".parse().expect("ip");
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().expect("ip");
        let other: IpAddr = "127.0.0.2".parse().expect("ip");
        let first = PeerCounts::admit(&peers, one).expect("first");
        let second = PeerCounts::admit(&peers, mapped).expect("second");
        assert!(
            PeerCounts::admit(&peers, one).is_none(),
            "a v4-mapped address is the same peer"
        );
        assert!(PeerCounts::admit(&peers, other).is_some());
        drop(first);
        assert!(PeerCounts::admit(&peers, one).is_some());
        drop(second);
        assert!(
            peers.counts.lock().expect("lock").is_empty(),
            "counts of gone peers are forgotten"
        );
    }
}
