//! The driver's turn engine: one turn at a time on one agent process, each turn mapped into its hub
//! and log, with a timeout and a cancel that end in a killed process group if the agent will not stop.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sortie_protocol::api::rfc3339_from_epoch_ms;
use sortie_protocol::chunk::UiChunk;
use tokio::sync::Notify;

use crate::agent::{AgentEvent, AgentHandle, AgentLaunch, AgentState};
use crate::hub::{HUB_MEMORY_LIMIT, TurnHub, log_path};
use crate::mapping::{Mapped, Mapper, TurnEnd};

/// How often a cancel is repeated until the agent ends its turn or the grace runs out.
const CANCEL_RESEND: Duration = Duration::from_millis(250);

/// How a driver runs its agent.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub launch: AgentLaunch,
    /// Where the turn logs go (`turns/{n}.jsonl`).
    pub turns_dir: PathBuf,
    /// The sortie session id: assistant messages are `<session>-t<n>`.
    pub session_id: String,
    /// A turn running longer is canceled, then killed, and fails `TURN_TIMEOUT`.
    pub turn_timeout: Duration,
    /// The agent must finish the ACP handshake within this.
    pub start_timeout: Duration,
    /// After a cancel (or SIGTERM), how long the agent has before the next step (SIGTERM, SIGKILL).
    pub kill_grace: Duration,
}

/// A turn's status as `/status` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnState {
    Running,
    Completed,
    Cancelled,
    Failed,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TurnFailure {
    pub code: String,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct TurnReport {
    pub n: u32,
    pub state: TurnState,
    pub stop_reason: Option<String>,
    pub failure: Option<TurnFailure>,
    pub parts: u64,
}

struct TurnRecord {
    hub: Arc<TurnHub>,
    report: TurnReport,
    cancel: Arc<Notify>,
    /// Parts of sortie's own (an egress denial) to put into the turn's stream, in order.
    own: tokio::sync::mpsc::UnboundedSender<UiChunk>,
}

struct Shared {
    config: DriverConfig,
    turns: Mutex<BTreeMap<u32, TurnRecord>>,
    agent: tokio::sync::Mutex<Option<AgentHandle>>,
    agent_state: Mutex<AgentStatus>,
    /// The agent's ACP session, to `session/load` into a fresh process.
    acp_session: Mutex<Option<String>>,
}

/// The agent as `/status` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct AgentStatus {
    pub state: &'static str,
    pub reason: Option<String>,
    /// The agent's pid (= its process group), while one runs.
    pub pid: Option<i32>,
}

/// Why a turn was not started.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    #[error("turn {0} is running; wait for it or cancel it")]
    AnotherTurnRunning(u32),
}

#[derive(Clone)]
pub struct Driver {
    shared: Arc<Shared>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now() -> String {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339_from_epoch_ms(i64::try_from(since_epoch.as_millis()).unwrap_or(0))
}

impl Driver {
    pub fn new(config: DriverConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                config,
                turns: Mutex::new(BTreeMap::new()),
                agent: tokio::sync::Mutex::new(None),
                agent_state: Mutex::new(AgentStatus {
                    state: "not_started",
                    reason: None,
                    pid: None,
                }),
                acp_session: Mutex::new(None),
            }),
        }
    }

    /// Starts turn `n`, or answers with the turn already known under `n` (idempotent).
    pub fn start_turn(&self, n: u32, prompt: String) -> Result<TurnReport, StartError> {
        let mut turns = lock(&self.shared.turns);
        if let Some(existing) = turns.get(&n) {
            return Ok(existing.report.clone());
        }
        if let Some((running, _)) = turns.iter().find(|(_, t)| t.report.state == TurnState::Running) {
            return Err(StartError::AnotherTurnRunning(*running));
        }
        let hub = match TurnHub::new(n, Some(log_path(&self.shared.config.turns_dir, n)), HUB_MEMORY_LIMIT) {
            Ok(hub) => hub,
            Err(error) => {
                tracing::warn!(%error, "turn log unavailable; the turn is kept in memory only");
                TurnHub::in_memory(n)
            }
        };
        let report = TurnReport {
            n,
            state: TurnState::Running,
            stop_reason: None,
            failure: None,
            parts: 0,
        };
        let cancel = Arc::new(Notify::new());
        let (own, own_parts) = tokio::sync::mpsc::unbounded_channel();
        turns.insert(
            n,
            TurnRecord {
                hub: hub.clone(),
                report: report.clone(),
                cancel: cancel.clone(),
                own,
            },
        );
        drop(turns);
        let shared = self.shared.clone();
        tokio::spawn(async move { run_turn(shared, n, prompt, hub, cancel, own_parts).await });
        Ok(report)
    }

    /// Asks turn `n` to stop; `false` if there is no such running turn.
    pub fn cancel_turn(&self, n: u32) -> bool {
        let turns = lock(&self.shared.turns);
        match turns.get(&n) {
            Some(turn) if turn.report.state == TurnState::Running => {
                turn.cancel.notify_one();
                true
            }
            _ => false,
        }
    }

    /// Adds a part of sortie's own (`data-sortie-*`) to the running turn; `false` if none runs.
    pub fn push_own(&self, chunk: UiChunk) -> bool {
        let turns = lock(&self.shared.turns);
        turns
            .values()
            .find(|t| t.report.state == TurnState::Running)
            .is_some_and(|t| t.own.send(chunk).is_ok())
    }

    /// The hub of turn `n`, if this driver ran it.
    pub fn hub(&self, n: u32) -> Option<Arc<TurnHub>> {
        lock(&self.shared.turns).get(&n).map(|t| t.hub.clone())
    }

    /// Where turn `n`'s log is (it may exist from an earlier driver process).
    pub fn log_path(&self, n: u32) -> PathBuf {
        log_path(&self.shared.config.turns_dir, n)
    }

    pub fn turns(&self) -> Vec<TurnReport> {
        lock(&self.shared.turns)
            .values()
            .map(|t| TurnReport {
                parts: t.hub.len(),
                ..t.report.clone()
            })
            .collect()
    }

    pub fn agent_status(&self) -> AgentStatus {
        lock(&self.shared.agent_state).clone()
    }

    /// Kills the agent (shutdown).
    pub async fn shutdown(&self) {
        let mut agent = self.shared.agent.lock().await;
        if let Some(handle) = agent.take() {
            handle.kill_group(self.shared.config.kill_grace).await;
        }
    }
}

fn set_agent_status(shared: &Shared, state: &'static str, reason: Option<String>, pid: Option<i32>) {
    *lock(&shared.agent_state) = AgentStatus { state, reason, pid };
}

fn with_stderr(reason: String, agent: &AgentHandle) -> String {
    let tail = agent.stderr_tail();
    if tail.is_empty() {
        reason
    } else {
        format!("{reason}; the agent's last words: {tail}")
    }
}

async fn run_turn(
    shared: Arc<Shared>,
    n: u32,
    prompt: String,
    hub: Arc<TurnHub>,
    cancel: Arc<Notify>,
    mut own_parts: tokio::sync::mpsc::UnboundedReceiver<UiChunk>,
) {
    let config = shared.config.clone();
    let mut mapper = Mapper::new(format!("{}-t{n}", config.session_id));
    let mut chunks = Vec::new();
    mapper.start(&mut chunks);
    hub.publish(&chunks);
    chunks.clear();

    let mut agent_slot = shared.agent.lock().await;
    if let Some(agent) = agent_slot.as_ref()
        && agent.try_exit_status().await.is_some()
    {
        *agent_slot = None;
    }
    if agent_slot.is_none() {
        let launch = AgentLaunch {
            resume_session: lock(&shared.acp_session).clone(),
            ..config.launch.clone()
        };
        set_agent_status(&shared, "starting", None, None);
        match AgentHandle::spawn(launch) {
            Ok(agent) => {
                set_agent_status(&shared, "starting", None, agent.pid());
                *agent_slot = Some(agent);
            }
            Err(error) => {
                set_agent_status(&shared, "failed", Some(error.to_string()), None);
                end(
                    &shared,
                    &hub,
                    &mut mapper,
                    n,
                    Outcome::failed("AGENT_START_FAILED", error.to_string()),
                );
                return;
            }
        }
    }
    let Some(agent) = agent_slot.as_mut() else { return };
    match agent.ready(config.start_timeout).await {
        AgentState::Ready { session_id, .. } => {
            *lock(&shared.acp_session) = Some(session_id);
            set_agent_status(&shared, "ready", None, agent.pid());
        }
        AgentState::Failed { reason } => {
            let reason = with_stderr(format!("the agent did not start: {reason}"), agent);
            agent.kill_group(config.kill_grace).await;
            *agent_slot = None;
            set_agent_status(&shared, "failed", Some(reason.clone()), None);
            end(
                &shared,
                &hub,
                &mut mapper,
                n,
                Outcome::failed("AGENT_START_FAILED", reason),
            );
            return;
        }
        AgentState::Starting => {}
    }

    let mut prompt_done = agent.prompt(prompt);
    let timeout = tokio::time::sleep(config.turn_timeout);
    tokio::pin!(timeout);
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut canceled = false;
    let outcome = loop {
        let kill_timer = async {
            match kill_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            event = agent.events.recv() => {
                match handle_event(event, &mut mapper, &hub, &mut chunks) {
                    Step::Continue => {}
                    Step::Finished(stop_reason) => break Outcome::stopped(stop_reason, canceled),
                    Step::Broken(reason) => {
                        let reason = with_stderr(reason, agent);
                        agent.kill_group(config.kill_grace).await;
                        *agent_slot = None;
                        break Outcome::failed("AGENT_ERROR", reason);
                    }
                }
            }
            answer = &mut prompt_done => {
                // The answer's line followed every update, so whatever is still queued came first.
                let mut finished = None;
                while let Ok(event) = agent.events.try_recv() {
                    if let Step::Finished(stop_reason) = handle_event(Some(event), &mut mapper, &hub, &mut chunks) {
                        finished = Some(stop_reason);
                    }
                }
                match (answer, finished) {
                    (_, Some(stop_reason)) => break Outcome::stopped(stop_reason, canceled),
                    (Ok(Ok(())), None) => break Outcome::stopped("end_turn".into(), canceled),
                    (Ok(Err(error)), None) => {
                        let exited = agent.try_exit_status().await;
                        let reason = match exited {
                            Some(status) => format!("the agent exited mid-turn ({status})"),
                            None => format!("the agent failed the turn: {error}"),
                        };
                        let reason = with_stderr(reason, agent);
                        if exited.is_some() {
                            agent.kill_group(config.kill_grace).await;
                            *agent_slot = None;
                        }
                        break Outcome::failed("AGENT_ERROR", reason);
                    }
                    (Err(_), None) => {
                        let reason = with_stderr("the agent connection closed mid-turn".into(), agent);
                        agent.kill_group(config.kill_grace).await;
                        *agent_slot = None;
                        break Outcome::failed("AGENT_ERROR", reason);
                    }
                }
            }
            () = &mut timeout => {
                agent.cancel();
                agent.kill_group(config.kill_grace).await;
                *agent_slot = None;
                break Outcome::failed("TURN_TIMEOUT", format!("the turn ran past its limit of {}s; the agent was stopped", config.turn_timeout.as_secs()));
            }
            Some(chunk) = own_parts.recv() => {
                mapper.push_own(chunk, &mut chunks);
                hub.publish(&chunks);
                chunks.clear();
            }
            () = cancel.notified(), if kill_at.is_none() => {
                canceled = true;
                agent.cancel();
                kill_at = Some(tokio::time::Instant::now() + config.kill_grace);
            }
            () = tokio::time::sleep(CANCEL_RESEND), if kill_at.is_some() => {
                // A cancel that overtook the prompt finds no turn to stop in the agent: say it again.
                agent.cancel();
            }
            () = kill_timer => {
                // Canceled, and the agent did not end its turn in time.
                agent.kill_group(config.kill_grace).await;
                *agent_slot = None;
                break Outcome::Canceled { reason: Some(format!("the agent did not stop within {}s of the cancel; it was killed", config.kill_grace.as_secs())) };
            }
        }
    };
    if agent_slot.is_none() {
        set_agent_status(&shared, "stopped", None, None);
    }
    drop(agent_slot);
    end(&shared, &hub, &mut mapper, n, outcome);
}

enum Step {
    Continue,
    Finished(String),
    Broken(String),
}

fn handle_event(event: Option<AgentEvent>, mapper: &mut Mapper, hub: &TurnHub, chunks: &mut Vec<UiChunk>) -> Step {
    let at = now();
    let step = match event {
        Some(AgentEvent::Update(update)) => {
            if mapper.on_update(&update, &at, chunks) == Mapped::Unknown {
                hub.log_raw(&update);
            }
            Step::Continue
        }
        Some(AgentEvent::Permission(params)) => {
            mapper.on_permission_request(&params, &at, chunks);
            Step::Continue
        }
        Some(AgentEvent::PromptResult(result)) => {
            if let Some(usage) = result.get("usage") {
                mapper.on_prompt_usage(usage, chunks);
            }
            let stop_reason = result
                .get("stopReason")
                .and_then(Value::as_str)
                .unwrap_or("end_turn")
                .to_owned();
            Step::Finished(stop_reason)
        }
        Some(AgentEvent::ProtocolError(reason)) => Step::Broken(reason),
        Some(AgentEvent::Closed) | None => Step::Broken("the agent exited mid-turn".into()),
    };
    hub.publish(chunks);
    chunks.clear();
    step
}

enum Outcome {
    Stopped { stop_reason: String },
    Canceled { reason: Option<String> },
    Failed { code: &'static str, reason: String },
}

impl Outcome {
    fn failed(code: &'static str, reason: String) -> Self {
        Self::Failed { code, reason }
    }

    fn stopped(stop_reason: String, canceled: bool) -> Self {
        if canceled || stop_reason == "cancelled" {
            Self::Canceled { reason: None }
        } else {
            Self::Stopped { stop_reason }
        }
    }
}

fn end(shared: &Shared, hub: &TurnHub, mapper: &mut Mapper, n: u32, outcome: Outcome) {
    let mut chunks = Vec::new();
    let (state, stop_reason, failure, end) = match outcome {
        Outcome::Stopped { stop_reason } => (
            TurnState::Completed,
            Some(stop_reason.clone()),
            None,
            TurnEnd::Stopped { stop_reason },
        ),
        Outcome::Canceled { reason } => (
            TurnState::Cancelled,
            Some("cancelled".to_owned()),
            reason.map(|reason| TurnFailure {
                code: "CANCELED".into(),
                reason,
            }),
            TurnEnd::Stopped {
                stop_reason: "cancelled".into(),
            },
        ),
        Outcome::Failed { code, reason } => (
            TurnState::Failed,
            None,
            Some(TurnFailure {
                code: code.into(),
                reason: reason.clone(),
            }),
            TurnEnd::Failed {
                code: code.into(),
                reason,
            },
        ),
    };
    mapper.finish(&end, &mut chunks);
    hub.publish(&chunks);
    hub.finish();
    if let Some(record) = lock(&shared.turns).get_mut(&n) {
        record.report.state = state;
        record.report.stop_reason = stop_reason;
        record.report.failure = failure;
    }
}
