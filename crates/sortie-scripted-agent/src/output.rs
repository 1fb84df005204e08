//! Ownership of stdout, shared by the JSON-RPC writer and the raw-line fault steps.
//!
//! The SDK serializes outgoing messages on its own task, so a message handed to `send_notification` may not be
//! on stdout yet when the turn moves on. Steps that write raw bytes (`garbage:`, `bigline:`) or leave the process
//! (`crash:`) must first know that everything sent before them was written. They send a private
//! `_scripted/barrier` notification through the SDK: it travels the same FIFO as every other message, and the
//! line sink below swallows it instead of writing it, releasing the waiting step. All writes take one lock, so
//! a raw line never lands in the middle of a JSON-RPC line.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::{Client, UntypedMessage};
use serde::Deserialize;
use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;

/// The method of the private notification used as a flush barrier; it never reaches the client.
pub(crate) const BARRIER_METHOD: &str = "_scripted/barrier";

/// How long a barrier may take before the step proceeds anyway (the connection may be closing).
const BARRIER_TIMEOUT: Duration = Duration::from_secs(5);

/// `bigline:` writes its filler in pieces of this size instead of allocating the whole line.
static FILLER_PIECE: [u8; 64 * 1024] = [b'x'; 64 * 1024];

/// A cloneable handle to the process's stdout.
#[derive(Clone)]
pub(crate) struct SharedStdout {
    inner: Arc<Inner>,
}

struct Inner {
    writer: tokio::sync::Mutex<tokio::io::Stdout>,
    waiting_barriers: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    next_barrier: AtomicU64,
}

#[derive(Deserialize)]
struct BarrierLine {
    method: String,
    params: BarrierParams,
}

#[derive(Deserialize)]
struct BarrierParams {
    token: u64,
}

impl SharedStdout {
    pub(crate) fn new() -> Self {
        SharedStdout {
            inner: Arc::new(Inner {
                writer: tokio::sync::Mutex::new(tokio::io::stdout()),
                waiting_barriers: Mutex::new(HashMap::new()),
                next_barrier: AtomicU64::new(0),
            }),
        }
    }

    /// The line sink handed to the SDK's `Lines` transport.
    pub(crate) fn json_rpc_sink(&self) -> Pin<Box<dyn futures::Sink<String, Error = io::Error> + Send>> {
        Box::pin(futures::sink::unfold(self.clone(), async |stdout, line: String| {
            stdout.accept_json_rpc_line(line).await?;
            Ok::<_, io::Error>(stdout)
        }))
    }

    async fn accept_json_rpc_line(&self, line: String) -> io::Result<()> {
        if let Some(token) = barrier_token(&line) {
            let waiter = self.waiting_barriers().remove(&token);
            if let Some(waiter) = waiter {
                // The step may have given up waiting; nothing to do then.
                let _ = waiter.send(());
            }
            return Ok(());
        }
        let mut bytes = line.into_bytes();
        bytes.push(b'\n');
        let mut writer = self.inner.writer.lock().await;
        writer.write_all(&bytes).await?;
        writer.flush().await
    }

    /// Waits until every message sent on `connection` before this call has been written to stdout.
    ///
    /// Best-effort: gives up after [`BARRIER_TIMEOUT`] or when the connection can no longer send.
    pub(crate) async fn wait_until_sent_messages_are_written(&self, connection: &ConnectionTo<Client>) {
        let token = self.inner.next_barrier.fetch_add(1, Ordering::Relaxed);
        let (released, on_release) = oneshot::channel();
        self.waiting_barriers().insert(token, released);
        let sent = UntypedMessage::new(BARRIER_METHOD, serde_json::json!({ "token": token }))
            .and_then(|barrier| connection.send_notification(barrier));
        if sent.is_ok() {
            let _ = tokio::time::timeout(BARRIER_TIMEOUT, on_release).await;
        }
        self.waiting_barriers().remove(&token);
    }

    /// Writes `text` plus a newline on stdout, after everything sent before it.
    pub(crate) async fn write_raw_line(&self, connection: &ConnectionTo<Client>, text: &str) -> io::Result<()> {
        self.wait_until_sent_messages_are_written(connection).await;
        let mut writer = self.inner.writer.lock().await;
        writer.write_all(text.as_bytes()).await?;
        writer.write_all(b"\n").await?;
        writer.flush().await
    }

    /// Writes a line of `length` bytes of `x` plus a newline on stdout, after everything sent before it.
    pub(crate) async fn write_filler_line(&self, connection: &ConnectionTo<Client>, length: usize) -> io::Result<()> {
        self.wait_until_sent_messages_are_written(connection).await;
        let mut writer = self.inner.writer.lock().await;
        let mut remaining = length;
        while remaining > 0 {
            let piece = remaining.min(FILLER_PIECE.len());
            writer.write_all(&FILLER_PIECE[..piece]).await?;
            remaining -= piece;
        }
        writer.write_all(b"\n").await?;
        writer.flush().await
    }

    fn waiting_barriers(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<()>>> {
        // The map stays consistent even if a holder panicked: entries are only inserted or removed whole.
        self.inner
            .waiting_barriers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The token of a barrier line, or `None` for any other line.
fn barrier_token(line: &str) -> Option<u64> {
    // Cheap pre-check: almost every line is a real message and needs no second parse.
    if !line.contains(BARRIER_METHOD) {
        return None;
    }
    let parsed: BarrierLine = serde_json::from_str(line).ok()?;
    (parsed.method == BARRIER_METHOD).then_some(parsed.params.token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_only_real_barrier_lines() {
        assert_eq!(
            barrier_token(r#"{"jsonrpc":"2.0","method":"_scripted/barrier","params":{"token":42}}"#),
            Some(42)
        );
        // A message whose text merely mentions the method is written normally.
        let update = serde_json::json!({
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {"text": r#"{"method":"_scripted/barrier","params":{"token":1}}"#},
        });
        assert_eq!(barrier_token(&update.to_string()), None);
        assert_eq!(barrier_token("_scripted/barrier"), None);
        assert_eq!(
            barrier_token(r#"{"jsonrpc":"2.0","method":"session/update","params":{}}"#),
            None
        );
    }
}
