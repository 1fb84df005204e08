//! Ownership of stdout, shared by the JSON-RPC writer and the raw-line fault steps.
//!
//! The SDK serializes outgoing messages on its own task, so a message handed to `send_notification` may not be
//! on stdout yet when the turn moves on. Steps that write raw bytes (`garbage:`, `bigline:`) or leave the process
//! (`crash:`) must first know that everything sent before them was written. They send a private
//! `_scripted/barrier` notification through the SDK: it travels the same FIFO as every other message, and the
//! line sink below turns it into a flush marker in the stdout queue, releasing the waiting step once everything
//! before it is written. One thread writes the queue in order, so a raw line never lands inside a JSON-RPC line.

use std::collections::HashMap;
use std::io::{self, Write as _};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::Duration;

use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::{Client, UntypedMessage};
use serde::Deserialize;
use tokio::sync::oneshot;

/// The method of the private notification used as a flush barrier; it never reaches the client.
pub(crate) const BARRIER_METHOD: &str = "_scripted/barrier";

/// How long a barrier may take before the step proceeds anyway (the connection may be closing).
const BARRIER_TIMEOUT: Duration = Duration::from_secs(5);

/// `bigline:` writes its filler in pieces of this size instead of allocating the whole line.
const FILLER_PIECE: usize = 64 * 1024;

/// What the stdout thread is asked to do, in order.
enum Output {
    Bytes(Vec<u8>),
    /// Signal once everything queued before has been written and flushed.
    Flushed(oneshot::Sender<()>),
}

/// A cloneable handle to the process's stdout.
///
/// One thread owns stdout: it writes whatever is queued, in order, through a buffer, and flushes when
/// the queue runs dry. A flood of small messages thus costs a few large writes instead of one
/// blocking write and flush per message.
#[derive(Clone)]
pub(crate) struct SharedStdout {
    inner: Arc<Inner>,
}

struct Inner {
    queue: Mutex<mpsc::Sender<Output>>,
    waiting_barriers: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    next_barrier: AtomicU64,
}

#[derive(Deserialize)]
struct BarrierLine {
    method: String,
    params: BarrierParams,
}

#[derive(Deserialize, serde::Serialize)]
struct BarrierParams {
    token: u64,
}

fn write_queued(queue: mpsc::Receiver<Output>) {
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(256 * 1024, stdout.lock());
    let mut flushed = Vec::new();
    while let Ok(first) = queue.recv() {
        let mut next = Some(first);
        while let Some(item) = next {
            match item {
                Output::Bytes(bytes) => {
                    if out.write_all(&bytes).is_err() {
                        return;
                    }
                }
                Output::Flushed(signal) => flushed.push(signal),
            }
            next = queue.try_recv().ok();
        }
        if out.flush().is_err() {
            return;
        }
        for signal in flushed.drain(..) {
            let _ = signal.send(());
        }
    }
}

impl SharedStdout {
    pub(crate) fn new() -> Self {
        let (queue, queued) = mpsc::channel();
        std::thread::spawn(move || write_queued(queued));
        SharedStdout {
            inner: Arc::new(Inner {
                queue: Mutex::new(queue),
                waiting_barriers: Mutex::new(HashMap::new()),
                next_barrier: AtomicU64::new(0),
            }),
        }
    }

    fn enqueue(&self, output: Output) -> io::Result<()> {
        self.inner
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(output)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "stdout is closed"))
    }

    /// Waits until everything queued so far is on stdout.
    async fn flushed(&self) -> io::Result<()> {
        let (signal, done) = oneshot::channel();
        self.enqueue(Output::Flushed(signal))?;
        done.await
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "stdout is closed"))
    }

    /// The line sink handed to the SDK's `Lines` transport.
    pub(crate) fn json_rpc_sink(&self) -> Pin<Box<dyn futures::Sink<String, Error = io::Error> + Send>> {
        Box::pin(futures::sink::unfold(self.clone(), async |stdout, line: String| {
            stdout.accept_json_rpc_line(line)?;
            Ok::<_, io::Error>(stdout)
        }))
    }

    fn accept_json_rpc_line(&self, line: String) -> io::Result<()> {
        if let Some(token) = barrier_token(&line) {
            let waiter = self.waiting_barriers().remove(&token);
            if let Some(waiter) = waiter {
                // Released once everything before the barrier is written; the step may have given up.
                return self.enqueue(Output::Flushed(waiter));
            }
            return Ok(());
        }
        let mut bytes = line.into_bytes();
        bytes.push(b'\n');
        self.enqueue(Output::Bytes(bytes))
    }

    /// Waits until every message sent on `connection` before this call has been written to stdout.
    ///
    /// Best-effort: gives up after [`BARRIER_TIMEOUT`] or when the connection can no longer send.
    pub(crate) async fn wait_until_sent_messages_are_written(&self, connection: &ConnectionTo<Client>) {
        let token = self.inner.next_barrier.fetch_add(1, Ordering::Relaxed);
        let (released, on_release) = oneshot::channel();
        self.waiting_barriers().insert(token, released);
        let sent = UntypedMessage::new(BARRIER_METHOD, BarrierParams { token })
            .and_then(|barrier| connection.send_notification(barrier));
        if sent.is_ok() {
            let _ = tokio::time::timeout(BARRIER_TIMEOUT, on_release).await;
        }
        self.waiting_barriers().remove(&token);
    }

    /// Writes `text` plus a newline on stdout, after everything sent before it.
    pub(crate) async fn write_raw_line(&self, connection: &ConnectionTo<Client>, text: &str) -> io::Result<()> {
        self.wait_until_sent_messages_are_written(connection).await;
        let mut bytes = text.as_bytes().to_vec();
        bytes.push(b'\n');
        self.enqueue(Output::Bytes(bytes))?;
        self.flushed().await
    }

    /// Writes a line of `length` bytes of `x` plus a newline on stdout, after everything sent before it.
    pub(crate) async fn write_filler_line(&self, connection: &ConnectionTo<Client>, length: usize) -> io::Result<()> {
        self.wait_until_sent_messages_are_written(connection).await;
        let mut remaining = length;
        while remaining > 0 {
            let piece = remaining.min(FILLER_PIECE);
            self.enqueue(Output::Bytes(vec![b'x'; piece]))?;
            remaining -= piece;
        }
        self.enqueue(Output::Bytes(b"\n".to_vec()))?;
        self.flushed().await
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
