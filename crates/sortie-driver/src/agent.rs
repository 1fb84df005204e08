//! The agent process and its ACP connection.
//!
//! The agent runs in its own process group with a clean environment. Its stdout goes through a tee
//! before the ACP crate sees it: lines are bounded (`ACP_LINE_MAX`), anything that is not JSON is a
//! fatal protocol error, and every `session/update`, `session/request_permission` and prompt result
//! is handed to the turn as raw JSON, so that the mapping sees kinds the crate would drop and keeps
//! the agent's order. The ACP crate (`agent-client-protocol` 5.x) does the JSON-RPC: initialize,
//! session new/load, mode, prompt, cancel, and answers permission requests `allow_once` off its
//! dispatch loop (the sandbox is the boundary).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    CancelNotification, ClientCapabilities, ContentBlock, Implementation, InitializeRequest, LoadSessionRequest,
    NewSessionRequest, PermissionOptionKind, PromptRequest, RequestPermissionOutcome, RequestPermissionRequest,
    RequestPermissionResponse, SelectedPermissionOutcome, SessionId, SessionNotification, SetSessionModeRequest,
    TextContent,
};
use agent_client_protocol::{Agent, Client, Lines};
use futures::SinkExt;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot, watch};

/// The longest line the agent may write on stdout (one ACP message). Longer is a protocol error.
pub const ACP_LINE_MAX: usize = 16 * 1024 * 1024;
/// How much of the agent's stderr is kept for failure reasons.
const STDERR_TAIL_BYTES: usize = 4096;

/// How to start an agent (DESIGN §6.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentLaunch {
    pub command: PathBuf,
    pub args: Vec<String>,
    /// The whole environment of the agent (nothing is inherited but what is listed here).
    pub env: Vec<(String, String)>,
    /// The working directory: the session's workspace.
    pub cwd: PathBuf,
    /// The ACP mode to set after the session exists (e.g. `bypassPermissions`, `yolo`).
    pub mode: Option<String>,
    /// An earlier ACP session to `session/load` when the agent supports it.
    pub resume_session: Option<String>,
}

/// Something the agent said that the turn must see, in the agent's order.
#[derive(Debug)]
pub enum AgentEvent {
    /// The `update` object of a `session/update`.
    Update(Value),
    /// The params of a `session/request_permission`.
    Permission(Value),
    /// The `result` of a `session/prompt` (it has `stopReason`, maybe `usage`).
    PromptResult(Value),
    /// The agent broke the protocol (garbage, an oversized line); the turn fails.
    ProtocolError(String),
    /// The agent's stdout closed (it exited or closed it).
    Closed,
}

/// Where the agent is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentState {
    Starting,
    Ready {
        session_id: String,
        /// The agent advertises `loadSession`.
        load_session: bool,
        /// The ACP session is the earlier one (`session/load` succeeded), not a new one.
        loaded: bool,
        /// Why `session/load` of the earlier session failed (then the session is a new one).
        load_error: Option<String>,
    },
    Failed {
        reason: String,
    },
}

enum AgentCommand {
    Prompt {
        text: String,
        done: oneshot::Sender<Result<(), String>>,
    },
    Cancel,
}

/// A running agent.
pub struct AgentHandle {
    commands: mpsc::UnboundedSender<AgentCommand>,
    pub events: mpsc::Receiver<AgentEvent>,
    pub state: watch::Receiver<AgentState>,
    child: Arc<tokio::sync::Mutex<Child>>,
    pgid: Option<i32>,
    stderr_tail: Arc<Mutex<VecDeque<u8>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot start the agent {command}: {source}")]
    Spawn { command: String, source: std::io::Error },
}

impl AgentHandle {
    /// Spawns the agent and starts the ACP handshake in the background; `state` says how it went.
    pub fn spawn(launch: AgentLaunch) -> Result<Self, AgentError> {
        let mut command = Command::new(&launch.command);
        command
            .args(&launch.args)
            .env_clear()
            .envs(launch.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .current_dir(&launch.cwd)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|source| AgentError::Spawn {
            command: launch.command.display().to_string(),
            source,
        })?;
        let pgid = child.id().and_then(|pid| i32::try_from(pid).ok());
        let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(AgentError::Spawn {
                command: launch.command.display().to_string(),
                source: std::io::Error::other("the agent's stdio was not piped"),
            });
        };

        let stderr_tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_BYTES)));
        tokio::spawn(keep_stderr_tail(stderr, stderr_tail.clone()));

        let (events_tx, events) = mpsc::channel(1024);
        let (lines_tx, lines_rx) = futures::channel::mpsc::channel::<std::io::Result<String>>(64);
        let replaying = Arc::new(AtomicBool::new(false));
        tokio::spawn(tee_stdout(stdout, events_tx, lines_tx, replaying.clone()));

        let (state_tx, state) = watch::channel(AgentState::Starting);
        let (commands, commands_rx) = mpsc::unbounded_channel();
        tokio::spawn(run_connection(
            launch,
            stdin,
            lines_rx,
            commands_rx,
            state_tx,
            replaying,
        ));

        Ok(Self {
            commands,
            events,
            state,
            child: Arc::new(tokio::sync::Mutex::new(child)),
            pgid,
            stderr_tail,
        })
    }

    /// Waits until the handshake finished (or failed) and returns the state.
    pub async fn ready(&mut self, deadline: Duration) -> AgentState {
        let waited = tokio::time::timeout(deadline, self.state.wait_for(|s| *s != AgentState::Starting)).await;
        match waited {
            Ok(Ok(state)) => state.clone(),
            Ok(Err(_)) => AgentState::Failed {
                reason: "the agent's connection ended during the handshake".into(),
            },
            Err(_) => AgentState::Failed {
                reason: format!("the agent did not answer the handshake within {}s", deadline.as_secs()),
            },
        }
    }

    /// Sends a prompt; the returned receiver completes when the agent answered (or the request failed).
    pub fn prompt(&self, text: String) -> oneshot::Receiver<Result<(), String>> {
        let (done, finished) = oneshot::channel();
        if let Err(mpsc::error::SendError(AgentCommand::Prompt { done, .. })) =
            self.commands.send(AgentCommand::Prompt { text, done })
        {
            let _ = done.send(Err("the agent connection is closed".into()));
        }
        finished
    }

    /// Sends `session/cancel`.
    pub fn cancel(&self) {
        let _ = self.commands.send(AgentCommand::Cancel);
    }

    /// The agent's pid, which is also its process group id.
    pub fn pid(&self) -> Option<i32> {
        self.pgid
    }

    /// The last few KiB of the agent's stderr, for failure reasons.
    pub fn stderr_tail(&self) -> String {
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        let bytes: Vec<u8> = tail.iter().copied().collect();
        String::from_utf8_lossy(&bytes).trim().to_owned()
    }

    /// The exit status if the agent has exited.
    pub async fn try_exit_status(&self) -> Option<std::process::ExitStatus> {
        self.child.lock().await.try_wait().ok().flatten()
    }

    /// Kills the agent's whole process group: SIGTERM, then SIGKILL after `grace`, then reaps.
    pub async fn kill_group(&self, grace: Duration) {
        if let Some(pgid) = self.pgid {
            let group = nix::unistd::Pid::from_raw(pgid);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
            let exited = tokio::time::timeout(grace, async {
                // The leader's exit is awaited (and reaped, or the group would never look empty), not
                // polled: a turn's delivery waits on it.
                let _ = self.child.lock().await.wait().await;
                group_gone(group).await;
            })
            .await;
            if exited.is_err() {
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            }
        }
        let mut child = self.child.lock().await;
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// Kills the process group `pgid` of an agent this process no longer holds a handle to: SIGTERM, then
/// SIGKILL after `grace`.
pub async fn kill_group_of(pgid: i32, grace: Duration) {
    let group = nix::unistd::Pid::from_raw(pgid);
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
    let exited = tokio::time::timeout(grace, group_gone(group)).await;
    if exited.is_err() {
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    }
}

/// Returns once no process is left in `group` (signal 0 fails). What is left once its leader is gone
/// usually goes within a millisecond or two, so the first looks come quickly.
async fn group_gone(group: nix::unistd::Pid) {
    let mut pause = Duration::from_millis(1);
    while nix::sys::signal::killpg(group, None).is_ok() {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

async fn keep_stderr_tail(stderr: tokio::process::ChildStderr, tail: Arc<Mutex<VecDeque<u8>>>) {
    let mut stderr = stderr;
    let mut buffer = [0_u8; 4096];
    while let Ok(read) = stderr.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        tail.extend(&buffer[..read]);
        while tail.len() > STDERR_TAIL_BYTES {
            tail.pop_front();
        }
    }
}

/// Reads the agent's stdout line by line (bounded), hands the turn what it must see, and forwards
/// every line to the ACP connection. While `replaying` (a `session/load` in flight), updates are the
/// replay of earlier turns, already in their own logs: they are not the turn's.
async fn tee_stdout(
    stdout: tokio::process::ChildStdout,
    events: mpsc::Sender<AgentEvent>,
    mut lines: futures::channel::mpsc::Sender<std::io::Result<String>>,
    replaying: Arc<AtomicBool>,
) {
    let mut reader = BufReader::with_capacity(64 * 1024, stdout);
    let mut line = Vec::new();
    loop {
        line.clear();
        match read_bounded_line(&mut reader, &mut line, ACP_LINE_MAX).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(error) => {
                let _ = events.send(AgentEvent::ProtocolError(error)).await;
                break;
            }
        }
        while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            line.pop();
        }
        if line.is_empty() {
            continue;
        }
        let message: Value = match serde_json::from_slice(&line) {
            Ok(message) => message,
            Err(_) => {
                let shown: String = String::from_utf8_lossy(&line).chars().take(200).collect();
                let _ = events
                    .send(AgentEvent::ProtocolError(format!(
                        "the agent wrote a line that is not ACP (JSON-RPC) on stdout: {shown:?}"
                    )))
                    .await;
                break;
            }
        };
        let event = match message.get("method").and_then(Value::as_str) {
            Some("session/update") if replaying.load(Ordering::Acquire) => None,
            Some("session/update") => message
                .get("params")
                .and_then(|p| p.get("update"))
                .cloned()
                .map(AgentEvent::Update),
            Some("session/request_permission") => message.get("params").cloned().map(AgentEvent::Permission),
            Some(_) => None,
            None => message
                .get("result")
                .filter(|r| r.get("stopReason").is_some())
                .cloned()
                .map(AgentEvent::PromptResult),
        };
        if let Some(event) = event
            && events.send(event).await.is_err()
        {
            break;
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        if lines.send(Ok(text)).await.is_err() {
            break;
        }
    }
    let _ = events.send(AgentEvent::Closed).await;
}

/// Reads up to and including `\n`, refusing lines longer than `max`. Returns the bytes read (0 at EOF).
async fn read_bounded_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
    max: usize,
) -> Result<usize, String> {
    loop {
        let available = reader
            .fill_buf()
            .await
            .map_err(|e| format!("reading the agent's stdout failed: {e}"))?;
        if available.is_empty() {
            return Ok(line.len());
        }
        let (take, complete) = match available.iter().position(|b| *b == b'\n') {
            Some(end) => (end + 1, true),
            None => (available.len(), false),
        };
        if line.len() + take > max + 1 {
            return Err(format!(
                "the agent wrote a line longer than {} MiB on stdout",
                max / (1024 * 1024)
            ));
        }
        line.extend_from_slice(&available[..take]);
        reader.consume(take);
        if complete {
            return Ok(line.len());
        }
    }
}

async fn run_connection(
    launch: AgentLaunch,
    stdin: ChildStdin,
    incoming: futures::channel::mpsc::Receiver<std::io::Result<String>>,
    mut commands: mpsc::UnboundedReceiver<AgentCommand>,
    state: watch::Sender<AgentState>,
    replaying: Arc<AtomicBool>,
) {
    let outgoing = futures::sink::unfold(stdin, |mut stdin: ChildStdin, line: String| async move {
        stdin.write_all(line.as_bytes()).await?;
        stdin.write_all(b"\n").await?;
        stdin.flush().await?;
        Ok::<_, std::io::Error>(stdin)
    });
    let transport = Lines::new(Box::pin(outgoing), incoming);
    let state_for_handshake = state.clone();
    let result = Client
        .v1()
        .name("sortie-driver")
        // Updates reach the turn through the tee, raw and in order; the crate only has to drop them
        // (unhandled notifications would pile up in its parked-message queue).
        .on_receive_notification(
            async move |_update: SessionNotification, _connection: ConnectionTo<Agent>| Ok(()),
            agent_client_protocol::on_receive_notification!(),
        )
        .on_receive_request(
            async move |request: RequestPermissionRequest, responder, connection: ConnectionTo<Agent>| {
                // Answered from a task of its own: the dispatch loop never waits on it.
                connection.spawn(async move {
                    let option = [PermissionOptionKind::AllowOnce, PermissionOptionKind::AllowAlways]
                        .iter()
                        .find_map(|kind| {
                            request
                                .options
                                .iter()
                                .find(|o| o.kind == *kind)
                                .map(|o| o.option_id.clone())
                        });
                    let outcome = match option {
                        Some(id) => RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(id)),
                        None => RequestPermissionOutcome::Cancelled,
                    };
                    responder.respond(RequestPermissionResponse::new(outcome))
                })
            },
            agent_client_protocol::on_receive_request!(),
        )
        .connect_with(transport, async move |connection: ConnectionTo<Agent>| {
            let initialized = connection
                .send_request(
                    InitializeRequest::new(ProtocolVersion::V1)
                        .client_capabilities(ClientCapabilities::new())
                        .client_info(Implementation::new("sortie", env!("CARGO_PKG_VERSION"))),
                )
                .block_task()
                .await?;
            let load_session = initialized.agent_capabilities.load_session;
            let mut loaded = None;
            let mut load_error = None;
            if let (Some(previous), true) = (&launch.resume_session, load_session) {
                let id = SessionId::new(previous.as_str());
                // The tee reads the replay before the crate sees the answer, so the flag is set first
                // and cleared only once the answer is in.
                replaying.store(true, Ordering::Release);
                let answer = connection
                    .send_request(LoadSessionRequest::new(id.clone(), launch.cwd.clone()))
                    .block_task()
                    .await;
                replaying.store(false, Ordering::Release);
                match answer {
                    Ok(_) => loaded = Some(id),
                    Err(error) => {
                        // Its state did not survive (or never existed): a new session, and the turn
                        // primes it another way (DESIGN §6.4).
                        tracing::warn!(%error, session = previous.as_str(), "session/load failed; starting a new session");
                        load_error = Some(error.to_string());
                    }
                }
            }
            let session_id: SessionId = match &loaded {
                Some(id) => id.clone(),
                None => {
                    connection
                        .send_request(NewSessionRequest::new(launch.cwd.clone()))
                        .block_task()
                        .await?
                        .session_id
                }
            };
            if let Some(mode) = &launch.mode {
                let request = SetSessionModeRequest::new(session_id.clone(), mode.clone());
                if let Err(error) = connection.send_request(request).block_task().await {
                    tracing::warn!(%error, mode, "the agent refused the profile's mode");
                }
            }
            state_for_handshake.send_replace(AgentState::Ready {
                session_id: session_id.0.to_string(),
                load_session,
                loaded: loaded.is_some(),
                load_error,
            });
            while let Some(command) = commands.recv().await {
                match command {
                    AgentCommand::Prompt { text, done } => {
                        let connection = connection.clone();
                        let session_id = session_id.clone();
                        tokio::spawn(async move {
                            let request =
                                PromptRequest::new(session_id, vec![ContentBlock::Text(TextContent::new(text))]);
                            let answer = connection.send_request(request).block_task().await;
                            let _ = done.send(answer.map(|_| ()).map_err(|error| error.to_string()));
                        });
                    }
                    AgentCommand::Cancel => {
                        let _ = connection.send_notification(CancelNotification::new(session_id.clone()));
                    }
                }
            }
            Ok(())
        })
        .await;
    if let Err(error) = result {
        let reason = format!("the ACP connection failed: {error}");
        state.send_if_modified(|current| {
            if *current == AgentState::Starting {
                *current = AgentState::Failed { reason };
                true
            } else {
                false
            }
        });
    }
}
