//! The session's setup script (DESIGN §2 step 2): `sh -c <script>` in the workspace with the agent's
//! environment, in a process group of its own, its output's tail kept, the whole group killed at the
//! deadline.
//!
//! It must never outlive its deadline, and never wait on a background process that inherited the
//! script's output: once the script exits, the output is read for a short grace only.

use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sortie_protocol::driver::SETUP_OUTPUT_TAIL_BYTES as OUTPUT_TAIL_BYTES;
pub use sortie_protocol::driver::SetupOutcome;
use tokio::io::AsyncReadExt;
use tokio::process::Command;

/// After the script exits, how long output from its background children is still collected.
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot start the setup script: {0}")]
    Spawn(std::io::Error),
}

/// A bounded tail of bytes.
#[derive(Debug, Default)]
struct Tail {
    bytes: VecDeque<u8>,
}

impl Tail {
    fn extend(&mut self, chunk: &[u8]) {
        self.bytes.extend(chunk);
        let excess = self.bytes.len().saturating_sub(OUTPUT_TAIL_BYTES);
        self.bytes.drain(..excess);
    }

    fn text(&self) -> String {
        let bytes: Vec<u8> = self.bytes.iter().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

async fn keep_tail(mut reader: impl tokio::io::AsyncRead + Unpin, tail: Arc<Mutex<Tail>>) {
    let mut buffer = [0_u8; 8192];
    while let Ok(read) = reader.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        tail.lock().unwrap_or_else(|p| p.into_inner()).extend(&buffer[..read]);
    }
}

/// Runs `script` to the end or to `timeout`, whichever comes first.
pub async fn run(
    script: &str,
    workspace: &Path,
    env: &[(String, String)],
    timeout: Duration,
) -> Result<SetupOutcome, SetupError> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(workspace)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(SetupError::Spawn)?;
    let group = child.id().and_then(|pid| i32::try_from(pid).ok());
    let tail = Arc::new(Mutex::new(Tail::default()));
    let mut readers = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        readers.push(tokio::spawn(keep_tail(stdout, tail.clone())));
    }
    if let Some(stderr) = child.stderr.take() {
        readers.push(tokio::spawn(keep_tail(stderr, tail.clone())));
    }

    let (exit_code, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => (status.code(), false),
        Ok(Err(error)) => {
            tracing::warn!(%error, "waiting for the setup script failed");
            kill_group(group);
            let _ = child.wait().await;
            (None, false)
        }
        Err(_) => {
            kill_group(group);
            let _ = child.wait().await;
            (None, true)
        }
    };
    let drained = futures::future::join_all(readers.iter_mut());
    if tokio::time::timeout(OUTPUT_GRACE, drained).await.is_err() {
        // A background process still holds the output open; it is not waited for.
        readers.iter().for_each(tokio::task::JoinHandle::abort);
    }
    let output_tail = tail.lock().unwrap_or_else(|p| p.into_inner()).text();
    Ok(SetupOutcome {
        exit_code,
        timed_out,
        output_tail,
    })
}

fn kill_group(group: Option<i32>) {
    if let Some(group) = group {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(group), nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_keeps_the_last_bytes() {
        let mut tail = Tail::default();
        tail.extend(&[b'a'; OUTPUT_TAIL_BYTES]);
        tail.extend(b"end");
        let text = tail.text();
        assert_eq!(text.len(), OUTPUT_TAIL_BYTES);
        assert!(text.ends_with("aend"));
    }
}
