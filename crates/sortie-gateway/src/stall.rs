//! Connections whose peer stops reading are closed (DESIGN §7.1): a write that stays blocked longer
//! than a limit fails, the server drops the connection, and the socket is reset rather than
//! closed gracefully, so the kernel does not keep its unsent bytes for a peer that takes nothing.
//!
//! This has to sit under HTTP: once a response's bytes fill the socket and hyper's write buffer,
//! hyper stops polling the body, so nothing a handler does can end the connection. Wrap the listener
//! with [`StalledWrites`] and hand it to `axum::serve`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// A TCP listener whose connections fail a write blocked for longer than `limit`.
pub struct StalledWrites {
    listener: TcpListener,
    limit: Duration,
}

impl StalledWrites {
    pub fn new(listener: TcpListener, limit: Duration) -> Self {
        Self { listener, limit }
    }
}

impl axum::serve::Listener for StalledWrites {
    type Io = StallGuard;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, address) = axum::serve::Listener::accept(&mut self.listener).await;
        (StallGuard::new(stream, self.limit), address)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// One accepted connection: reads pass through; a write (or flush) that stays pending for the
/// limit fails with `TimedOut` and arms a reset for when the connection is dropped.
pub struct StallGuard {
    stream: TcpStream,
    limit: Duration,
    /// Set while a write is blocked: when it fires, the peer has taken nothing for `limit`.
    blocked_since: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl StallGuard {
    pub fn new(stream: TcpStream, limit: Duration) -> Self {
        Self {
            stream,
            limit,
            blocked_since: None,
        }
    }

    /// Passes a ready write through (and forgets the blockage); fails one blocked for too long.
    fn watch<T>(&mut self, poll: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.blocked_since = None;
            return poll;
        }
        let limit = self.limit;
        let timer = self
            .blocked_since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // A reset on drop: a graceful close would queue the FIN behind bytes the peer never takes.
        let _ = self.stream.set_zero_linger();
        metrics::counter!("sortie_stalled_connections_closed_total").increment(1);
        tracing::info!(limit = ?limit, "closing a connection whose peer took nothing");
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the peer took nothing for too long",
        )))
    }
}

impl AsyncRead for StallGuard {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallGuard {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.watch(poll, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.watch(poll, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_flush(cx);
        this.watch(poll, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.watch(poll, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_write_blocked_past_the_limit_fails_and_the_peer_is_reset() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("rcvbuf");
        let peer = socket.connect(address).await.expect("connect");
        let (stream, _) = listener.accept().await.expect("accept");
        let mut guard = StallGuard::new(stream, Duration::from_millis(200));
        let chunk = vec![b'x'; 64 * 1024];
        let started = std::time::Instant::now();
        let error = loop {
            match tokio::time::timeout(Duration::from_secs(10), guard.write_all(&chunk)).await {
                Ok(Ok(())) => continue,
                Ok(Err(error)) => break error,
                Err(_) => panic!("a blocked write never failed"),
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        drop(guard);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match peer.take_error() {
                Ok(Some(error)) => {
                    assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
                    break;
                }
                Ok(None) => {}
                Err(error) => panic!("{error}"),
            }
            assert!(std::time::Instant::now() < deadline, "the peer was never reset");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
