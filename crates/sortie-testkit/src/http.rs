//! Small HTTP servers on `127.0.0.1:0` for tests: a fixed answer, or an axum router. A [`Stub`] stops
//! its server when dropped, so keep it in a named binding for as long as the test needs it.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// A server a test started; it stops when this is dropped.
pub struct Stub {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Stub {
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Answers every connection's first request with `200 OK` and `body`, then closes it.
pub async fn respond(body: &'static str) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                // The request's content does not matter; an early close is the client's business.
                let _ = stream.read(&mut request).await;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Stub { addr, task }
}

/// Serves `app` on `127.0.0.1:0`.
pub async fn serve(app: axum::Router) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        // Ends only when the test drops the stub (abort) or the listener fails.
        let _ = axum::serve(listener, app).await;
    });
    Stub { addr, task }
}
