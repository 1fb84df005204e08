//! The driver's turn engine: one turn at a time, each on a fresh agent process that is killed when
//! the turn ends (nothing the agent started outlives its turn), each turn mapped into its hub and log,
//! with a timeout and a cancel that end in a killed process group if the agent will not stop; a fresh
//! agent primed with the session's context (§6.4); the work delivered when the agent stops (§7.3).
//!
//! Every turn carries the nonce the host started it with: the same number under another nonce is
//! refused, so nothing but the host decides what a turn is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sortie_feed::hub::{HUB_MEMORY_LIMIT, TurnHub, log_path};
use sortie_protocol::api::rfc3339_from_epoch_ms;
use sortie_protocol::chunk::UiChunk;
use sortie_protocol::driver::{
    AgentState as ReportedAgentState, AgentStatus, DriverFailureCode, DriverStatus, PrimingRung, TurnFailure,
    TurnReport, TurnState, VERSION, is_commit_id,
};
use tokio::sync::Notify;

use crate::agent::{AgentEvent, AgentHandle, AgentLaunch, AgentState};
use crate::delivery::{DeliveryConfig, DeliveryInput, DeliveryReport, Git};
use crate::mapping::{Mapped, Mapper, TurnEnd};
use crate::priming::{AgentOrigin, PrimingContext, prime};
use crate::refresh::EarlyRefresh;
use crate::setup::{SetupError, SetupOutcome};

/// How often a cancel is repeated until the agent ends its turn or the grace runs out.
const CANCEL_RESEND: Duration = Duration::from_millis(250);
/// The most of a file the agent could have written that the driver reads (its persisted session id).
const PERSISTED_MAX_BYTES: u64 = 4096;

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
    /// What must outlive the driver and its sandbox (`$HOME/.sortie`, kept across hibernation): the
    /// agent's ACP session id, and the workspace's HEAD when the first turn started.
    pub persist_dir: PathBuf,
    /// Commit and push at the end of each turn; `None`: the work stays in the workspace.
    pub delivery: Option<DeliveryConfig>,
}

/// The file under `persist_dir` that holds the agent's ACP session id.
const ACP_SESSION_FILE: &str = "acp-session";
/// The file under `persist_dir` that holds HEAD at the first turn (empty: an unborn branch).
const START_HEAD_FILE: &str = "start-head";

/// What a turn is asked to do.
#[derive(Clone, Debug, Default)]
pub struct TurnRequest {
    /// The host's nonce for this turn.
    pub nonce: String,
    pub prompt: String,
    /// The branch's last delivered commit; `None`: the branch must not exist on the remote yet.
    pub baseline: Option<String>,
    pub priming: PrimingContext,
}

struct TurnRecord {
    hub: Arc<TurnHub>,
    report: TurnReport,
    cancel: Arc<Notify>,
}

#[derive(Default)]
struct Activity {
    turns: BTreeMap<u32, TurnRecord>,
    /// A setup script runs: no turn may start (and no second script).
    setup_running: bool,
}

struct Shared {
    config: DriverConfig,
    activity: Mutex<Activity>,
    /// The process group of the running turn's agent (none between turns: each turn's agent dies
    /// with it), for a shutdown that comes mid-turn.
    agent_group: Mutex<Option<i32>>,
    agent_state: Mutex<AgentStatus>,
    /// The agent's ACP session, to `session/load` into the next fresh process (read from
    /// `persist_dir` at start).
    acp_session: Mutex<Option<String>>,
    /// HEAD when the first turn started (`Some(None)`: unborn): where a never-delivered branch's
    /// changes begin. Unset when it could not be read.
    start_head: tokio::sync::OnceCell<Option<String>>,
    /// The first turn refreshes the index beside the agent ([`EarlyRefresh`]): the workspace was just
    /// checked out for this sandbox. After it, each delivery left the index refreshed.
    refreshed_early: std::sync::atomic::AtomicBool,
}

/// Why a turn was not started.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    #[error("turn {0} is running; wait for it or cancel it")]
    AnotherTurnRunning(u32),
    #[error("the setup script is running; start the turn when it is done")]
    SetupRunning,
    #[error("turn {0} exists under another nonce: it was not started by the host")]
    NotOurs(u32),
}

/// Why a setup script did not run to an outcome.
#[derive(Debug, thiserror::Error)]
pub enum SetupRefused {
    #[error("turn {0} is running; a setup script runs only between turns")]
    TurnRunning(u32),
    #[error("another setup script is running")]
    SetupRunning,
    #[error(transparent)]
    Failed(#[from] SetupError),
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
    /// A driver; the agent's ACP session persisted by an earlier driver on this home is resumed.
    pub fn new(config: DriverConfig) -> Self {
        let acp_session = read_persisted_session(&config.persist_dir.join(ACP_SESSION_FILE));
        Self {
            shared: Arc::new(Shared {
                config,
                activity: Mutex::new(Activity::default()),
                agent_group: Mutex::new(None),
                agent_state: Mutex::new(AgentStatus {
                    state: ReportedAgentState::NotStarted,
                    reason: None,
                    pid: None,
                }),
                acp_session: Mutex::new(acp_session),
                start_head: tokio::sync::OnceCell::new(),
                refreshed_early: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Starts turn `n`, or answers with the turn already known under `n` and the same nonce
    /// (idempotent); the same `n` under another nonce is refused.
    pub fn start_turn(&self, n: u32, request: TurnRequest) -> Result<TurnReport, StartError> {
        let mut activity = lock(&self.shared.activity);
        if let Some(existing) = activity.turns.get(&n) {
            if existing.report.nonce != request.nonce {
                return Err(StartError::NotOurs(n));
            }
            return Ok(existing.report.clone());
        }
        if let Some((running, _)) = activity.turns.iter().find(|(_, t)| t.report.state.is_active()) {
            return Err(StartError::AnotherTurnRunning(*running));
        }
        if activity.setup_running {
            return Err(StartError::SetupRunning);
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
            nonce: request.nonce.clone(),
            state: TurnState::Running,
            stop_reason: None,
            failure: None,
            parts: 0,
            priming: None,
            load_error: None,
            delivery: None,
        };
        let cancel = Arc::new(Notify::new());
        activity.turns.insert(
            n,
            TurnRecord {
                hub: hub.clone(),
                report: report.clone(),
                cancel: cancel.clone(),
            },
        );
        drop(activity);
        let turn = Turn {
            shared: self.shared.clone(),
            n,
            mapper: Mapper::new(format!("{}-t{n}", self.shared.config.session_id)),
            hub,
        };
        tokio::spawn(run_turn(turn, request, cancel));
        Ok(report)
    }

    /// Asks turn `n` to stop; `false` if there is no such running turn. A turn already delivering
    /// answers `true` and goes on: a stopped turn's work is delivered anyway.
    pub fn cancel_turn(&self, n: u32) -> bool {
        let activity = lock(&self.shared.activity);
        match activity.turns.get(&n) {
            Some(turn) if turn.report.state == TurnState::Running => {
                turn.cancel.notify_one();
                true
            }
            Some(turn) => turn.report.state == TurnState::Delivering,
            None => false,
        }
    }

    /// Runs the setup script between turns (§2 step 2) and answers its outcome.
    pub async fn run_setup(&self, script: &str, timeout: Duration) -> Result<SetupOutcome, SetupRefused> {
        {
            let mut activity = lock(&self.shared.activity);
            if let Some((running, _)) = activity.turns.iter().find(|(_, t)| t.report.state.is_active()) {
                return Err(SetupRefused::TurnRunning(*running));
            }
            if activity.setup_running {
                return Err(SetupRefused::SetupRunning);
            }
            activity.setup_running = true;
        }
        // Cleared however this future ends (an HTTP client that goes away drops it).
        struct Running<'a>(&'a Shared);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                lock(&self.0.activity).setup_running = false;
            }
        }
        let _running = Running(&self.shared);
        let launch = &self.shared.config.launch;
        Ok(crate::setup::run(script, &launch.cwd, &launch.env, timeout).await?)
    }

    /// The hub of turn `n`, if this driver ran it.
    pub fn hub(&self, n: u32) -> Option<Arc<TurnHub>> {
        lock(&self.shared.activity).turns.get(&n).map(|t| t.hub.clone())
    }

    /// Where turn `n`'s log is (it may exist from an earlier driver process).
    pub fn log_path(&self, n: u32) -> PathBuf {
        log_path(&self.shared.config.turns_dir, n)
    }

    /// Turn `n`'s report, if this driver ran it.
    pub fn report(&self, n: u32) -> Option<TurnReport> {
        lock(&self.shared.activity).turns.get(&n).map(|t| TurnReport {
            parts: t.hub.len(),
            ..t.report.clone()
        })
    }

    /// Every turn this driver ran, in order.
    pub fn turns(&self) -> Vec<TurnReport> {
        lock(&self.shared.activity)
            .turns
            .values()
            .map(|t| TurnReport {
                parts: t.hub.len(),
                ..t.report.clone()
            })
            .collect()
    }

    pub fn status(&self) -> DriverStatus {
        let active_turn = lock(&self.shared.activity)
            .turns
            .iter()
            .find(|(_, t)| t.report.state.is_active())
            .map(|(n, _)| *n);
        DriverStatus {
            version: VERSION,
            agent: lock(&self.shared.agent_state).clone(),
            active_turn,
        }
    }

    /// Kills the running turn's agent, if any (shutdown).
    pub async fn shutdown(&self) {
        let group = lock(&self.shared.agent_group).take();
        if let Some(group) = group {
            crate::agent::kill_group_of(group, self.shared.config.kill_grace).await;
        }
    }
}

/// The ACP session id an earlier driver persisted, if it looks like one.
fn read_persisted_session(path: &Path) -> Option<String> {
    use std::io::Read;
    // $HOME is the agent's too: read a bounded prefix and take only what can be an id.
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(PERSISTED_MAX_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    let id = text.trim();
    (!id.is_empty() && id.len() <= 256 && !id.chars().any(char::is_control)).then(|| id.to_owned())
}

/// Writes `contents` to `path` through a temporary file and a rename: a reader never sees half.
async fn write_atomically(path: &Path, contents: &str) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent).await?;
    }
    let temporary = path.with_extension("tmp");
    tokio::fs::write(&temporary, contents).await?;
    tokio::fs::rename(&temporary, path).await
}

/// Keeps the agent's ACP session for the next fresh process, in this driver and the next one.
async fn remember_session(shared: &Shared, session_id: String) {
    {
        let mut current = lock(&shared.acp_session);
        if current.as_deref() == Some(session_id.as_str()) {
            return;
        }
        *current = Some(session_id.clone());
    }
    let path = shared.config.persist_dir.join(ACP_SESSION_FILE);
    if let Err(error) = write_atomically(&path, &session_id).await {
        tracing::warn!(%error, path = %path.display(), "cannot persist the agent's session; a fresh sandbox will prime it another way");
    }
}

/// Records HEAD at the first turn of this workspace (persisted, so that a later driver on the same
/// home starts from the same point); a failure leaves it unset.
async fn record_start_head(shared: &Shared, git: &Git) {
    let path = shared.config.persist_dir.join(START_HEAD_FILE);
    let recorded = shared
        .start_head
        .get_or_try_init(|| async {
            if let Ok(text) = read_bounded(&path).await {
                let head = text.trim();
                if head.is_empty() {
                    return Ok(None);
                }
                if is_commit_id(head) {
                    return Ok(Some(head.to_owned()));
                }
            }
            let head = git.head().await?;
            if let Err(error) = write_atomically(&path, head.as_deref().unwrap_or("")).await {
                tracing::warn!(%error, path = %path.display(), "cannot persist the workspace's starting point");
            }
            Ok::<_, crate::delivery::GitError>(head)
        })
        .await;
    if let Err(error) = recorded {
        tracing::warn!(%error, "cannot read the workspace's HEAD at the first turn");
    }
}

async fn read_bounded(path: &Path) -> std::io::Result<String> {
    use tokio::io::AsyncReadExt;
    let mut text = String::new();
    tokio::fs::File::open(path)
        .await?
        .take(PERSISTED_MAX_BYTES)
        .read_to_string(&mut text)
        .await?;
    Ok(text)
}

fn set_agent_status(shared: &Shared, state: ReportedAgentState, reason: Option<String>) {
    let pid = match state {
        ReportedAgentState::Starting | ReportedAgentState::Ready => *lock(&shared.agent_group),
        _ => None,
    };
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

/// One turn on its way: the stream it writes.
struct Turn {
    shared: Arc<Shared>,
    n: u32,
    mapper: Mapper,
    hub: Arc<TurnHub>,
}

impl Turn {
    fn update(&self, change: impl FnOnce(&mut TurnReport)) {
        if let Some(record) = lock(&self.shared.activity).turns.get_mut(&self.n) {
            change(&mut record.report);
        }
    }
}

async fn run_turn(mut turn: Turn, request: TurnRequest, cancel: Arc<Notify>) {
    let mut chunks = Vec::new();
    turn.mapper.start(&mut chunks);
    turn.hub.publish(&chunks);
    let shared = turn.shared.clone();
    let delivery = shared.config.delivery.as_ref().map(|config| {
        let git = Git {
            workspace: shared.config.launch.cwd.clone(),
            env: shared.config.launch.env.clone(),
            timeout: config.git_timeout,
        };
        (config, git)
    });
    if let Some((_, git)) = &delivery {
        record_start_head(&shared, git).await;
    }
    let early_refresh = delivery
        .as_ref()
        .filter(|_| !shared.refreshed_early.swap(true, std::sync::atomic::Ordering::SeqCst))
        .and_then(|(_, git)| EarlyRefresh::start(git));

    let ran = run_agent(&mut turn, &request, &cancel).await;
    let mut ending = Ending::from(ran.outcome);
    if ran.agent_started
        && let Some((config, git)) = &delivery
    {
        let mut index_refreshed = false;
        if let Some(early_refresh) = early_refresh {
            index_refreshed = early_refresh.hand_over().await;
            tracing::debug!(index_refreshed, "the index refreshed while the agent worked");
        }
        let report = deliver(&mut turn, config, git, &request, index_refreshed).await;
        // A turn that failed already keeps its failure; one that went well fails with the delivery.
        if let Some(failure) = report.error
            && ending.state != TurnState::Failed
        {
            ending.state = TurnState::Failed;
            ending.failure = Some(failure);
        }
    }
    end(turn, ending);
}

/// How the agent part of a turn went.
struct AgentRun {
    outcome: Outcome,
    /// The agent was ready and got the prompt: there may be work to deliver.
    agent_started: bool,
}

impl AgentRun {
    fn not_started(code: DriverFailureCode, reason: String) -> Self {
        Self {
            outcome: Outcome::failed(code, reason),
            agent_started: false,
        }
    }
}

/// Runs the agent part of the turn on a fresh agent process, which is killed (its whole process
/// group) before this returns: nothing of it runs on into the delivery or the next turn.
async fn run_agent(turn: &mut Turn, request: &TurnRequest, cancel: &Notify) -> AgentRun {
    let shared = turn.shared.clone();
    let config = &shared.config;
    let resume_session = lock(&shared.acp_session).clone();
    let launch = AgentLaunch {
        resume_session: resume_session.clone(),
        ..config.launch.clone()
    };
    let mut agent = match AgentHandle::spawn(launch) {
        Ok(agent) => {
            *lock(&shared.agent_group) = agent.pid();
            set_agent_status(&shared, ReportedAgentState::Starting, None);
            agent
        }
        Err(error) => {
            set_agent_status(&shared, ReportedAgentState::Failed, Some(error.to_string()));
            return AgentRun::not_started(DriverFailureCode::AgentStartFailed, error.to_string());
        }
    };
    let (loaded, load_error) = match agent.ready(config.start_timeout).await {
        AgentState::Ready {
            session_id,
            loaded,
            load_error,
            ..
        } => {
            remember_session(&shared, session_id).await;
            set_agent_status(&shared, ReportedAgentState::Ready, None);
            (loaded, load_error)
        }
        AgentState::Failed { reason } => {
            let reason = with_stderr(format!("the agent did not start: {reason}"), &agent);
            agent.kill_group(config.kill_grace).await;
            lock(&shared.agent_group).take();
            set_agent_status(&shared, ReportedAgentState::Failed, Some(reason.clone()));
            return AgentRun::not_started(DriverFailureCode::AgentStartFailed, reason);
        }
        AgentState::Starting => (false, None),
    };

    let origin = AgentOrigin {
        fresh: true,
        had_session: resume_session.is_some(),
        loaded,
    };
    let (rung, prompt) = prime(turn.n, origin, &request.priming, &request.prompt);
    if let Some(rung) = rung {
        let load_error = load_error.filter(|_| rung != PrimingRung::SessionLoad);
        turn.update(|report| {
            report.priming = Some(rung);
            report.load_error = load_error;
        });
    }

    let mut chunks = Vec::new();
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
                match handle_event(event, &mut turn.mapper, &turn.hub, &mut chunks) {
                    Step::Continue => {}
                    Step::Finished(stop_reason) => break Outcome::stopped(stop_reason, canceled),
                    Step::Broken(reason) => break Outcome::failed(DriverFailureCode::AgentError, with_stderr(reason, &agent)),
                }
            }
            answer = &mut prompt_done => {
                // The answer's line followed every update, so whatever is still queued came first.
                let mut finished = None;
                while let Ok(event) = agent.events.try_recv() {
                    if let Step::Finished(stop_reason) = handle_event(Some(event), &mut turn.mapper, &turn.hub, &mut chunks) {
                        finished = Some(stop_reason);
                    }
                }
                match (answer, finished) {
                    (_, Some(stop_reason)) => break Outcome::stopped(stop_reason, canceled),
                    (Ok(Ok(())), None) => break Outcome::stopped("end_turn".into(), canceled),
                    (Ok(Err(error)), None) => {
                        let reason = match agent.try_exit_status().await {
                            Some(status) => format!("the agent exited mid-turn ({status})"),
                            None => format!("the agent failed the turn: {error}"),
                        };
                        break Outcome::failed(DriverFailureCode::AgentError, with_stderr(reason, &agent));
                    }
                    (Err(_), None) => {
                        let reason = with_stderr("the agent connection closed mid-turn".into(), &agent);
                        break Outcome::failed(DriverFailureCode::AgentError, reason);
                    }
                }
            }
            () = &mut timeout => {
                agent.cancel();
                break Outcome::failed(DriverFailureCode::TurnTimeout, format!("the turn ran past its limit of {}s; the agent was stopped", config.turn_timeout.as_secs()));
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
                break Outcome::Canceled { reason: Some(format!("the agent did not stop within {}s of the cancel; it was killed", config.kill_grace.as_secs())) };
            }
        }
    };
    // The turn is over for the agent: its whole process group goes, before the delivery reads the tree.
    agent.kill_group(config.kill_grace).await;
    lock(&shared.agent_group).take();
    set_agent_status(&shared, ReportedAgentState::Stopped, None);
    AgentRun {
        outcome,
        agent_started: true,
    }
}

/// Commits, scans and pushes the turn's work; reports what happened.
async fn deliver(
    turn: &mut Turn,
    config: &DeliveryConfig,
    git: &Git,
    request: &TurnRequest,
    index_refreshed: bool,
) -> DeliveryReport {
    turn.update(|report| report.state = TurnState::Delivering);
    let shared = turn.shared.clone();
    let start_head = shared.start_head.get();
    let report = if request.baseline.is_none() && start_head.is_none() {
        DeliveryReport {
            error: Some(TurnFailure {
                code: DriverFailureCode::DeliveryFailed,
                reason: "the workspace's commit could not be read when the first turn began (is it a git \
                         repository?), so the changes to scan are unknown; nothing was pushed"
                    .into(),
            }),
            ..DeliveryReport::default()
        }
    } else {
        let input = DeliveryInput {
            prompt: &request.prompt,
            session_id: &shared.config.session_id,
            baseline: request.baseline.as_deref(),
            start_head: start_head.and_then(Option::as_deref),
            waiting: None,
            index_refreshed,
        };
        crate::delivery::deliver(config, git, &input).await
    };
    let reported = report.clone();
    turn.update(|record| record.delivery = Some(reported));
    report
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
    Failed { code: DriverFailureCode, reason: String },
}

impl Outcome {
    fn failed(code: DriverFailureCode, reason: String) -> Self {
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

/// How a turn ends, as its report says.
struct Ending {
    state: TurnState,
    stop_reason: Option<String>,
    failure: Option<TurnFailure>,
}

impl From<Outcome> for Ending {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Stopped { stop_reason } => Self {
                state: TurnState::Completed,
                stop_reason: Some(stop_reason),
                failure: None,
            },
            Outcome::Canceled { reason } => Self {
                state: TurnState::Cancelled,
                stop_reason: Some("cancelled".to_owned()),
                failure: reason.map(|reason| TurnFailure {
                    code: DriverFailureCode::Canceled,
                    reason,
                }),
            },
            Outcome::Failed { code, reason } => Self {
                state: TurnState::Failed,
                stop_reason: None,
                failure: Some(TurnFailure { code, reason }),
            },
        }
    }
}

impl Ending {
    /// How the stream ends.
    fn turn_end(&self) -> TurnEnd {
        match (&self.state, &self.failure) {
            (TurnState::Failed, Some(failure)) => TurnEnd::Failed {
                code: failure.code.as_str().to_owned(),
                reason: failure.reason.clone(),
            },
            _ => TurnEnd::Stopped {
                stop_reason: self.stop_reason.clone().unwrap_or_else(|| "end_turn".to_owned()),
            },
        }
    }
}

fn end(mut turn: Turn, ending: Ending) {
    let mut chunks = Vec::new();
    turn.mapper.finish(&ending.turn_end(), &mut chunks);
    turn.hub.publish(&chunks);
    // The report first: whoever saw the stream end and asks for the report finds the turn ended too.
    turn.update(|report| {
        report.state = ending.state;
        report.stop_reason = ending.stop_reason;
        report.failure = ending.failure;
    });
    turn.hub.finish();
}
