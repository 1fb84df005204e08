//! One turn of one session, as a task: provision a sandbox when none is warm (workspace, egress and
//! git proxy, driver, setup script), prime and start the agent's turn, record its parts, honour stop
//! and cancel requests, and settle the turn and the session from what the driver reports.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_gateway::egress::proxy::{EgressProxy, SessionAllowlist, report_to_driver};
use sortie_gateway::egress::registries::PhasedAllowlist;
use sortie_gateway::git::http::{Upstream, Upstreams};
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sortie_sandbox::{SandboxSpec, SandboxStatus, SandboxStdio, inside};
use sortie_store::{SessionRow, StopRequest, TurnOutcome, TurnRow};

use crate::client::{DriverClient, DriverTurn};
use crate::meter::{TurnMeter, WorkspaceKeys};
use crate::prepare::{self, SessionDirs};
use crate::recorder::{self, Recorded};
use crate::{Context, priming, pull_request};

/// How long a new sandbox's driver has to answer.
const DRIVER_READY_DEADLINE: Duration = Duration::from_secs(30);
/// How often a running turn's stop request and driver are checked.
const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// How long the worker waits past the turn timeout (cancel, kill, delivery) before it gives up on the driver.
const DRIVER_GRACE: Duration = Duration::from_secs(180);
/// A driver that does not answer this long while its turn runs is lost.
const UNREACHABLE_LIMIT: Duration = Duration::from_secs(3);
/// Runs the repository's own setup script when the session names none.
const DEFAULT_SETUP: &str = "if [ -f .sortie/setup.sh ]; then exec sh .sortie/setup.sh; fi";

type Failure = (FailureCode, String);

/// A live sandbox of a session: its name, directories, egress allowlist and the proxy serving it.
#[derive(Clone)]
pub struct SandboxHandle(Arc<HandleInner>);

struct HandleInner {
    name: String,
    dirs: SessionDirs,
    allowlist: Arc<PhasedAllowlist>,
    meter: Arc<TurnMeter>,
    /// What the sandbox's git proxy forwards to; a forge token is read again before every turn.
    upstream: Arc<SessionUpstream>,
    proxy: tokio::task::JoinHandle<()>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.proxy.abort();
    }
}

impl SandboxHandle {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    fn driver(&self) -> DriverClient {
        DriverClient::new(self.0.dirs.driver_socket())
    }
}

/// The git proxy of one sandbox reaches its own session's repository and nothing else.
struct SessionUpstream {
    session_id: SessionId,
    upstream: std::sync::RwLock<Upstream>,
}

impl Upstreams for SessionUpstream {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.session_id).then(|| self.upstream.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

impl SessionUpstream {
    fn replace(&self, upstream: Upstream) {
        *self.upstream.write().unwrap_or_else(|p| p.into_inner()) = upstream;
    }
}

fn ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Runs `turn` (or, for a resume without a prompt, only provisions); returns the sandbox to keep warm.
pub(crate) async fn run(
    context: &Arc<Context>,
    session: SessionRow,
    turn: Option<TurnRow>,
    sandbox: Option<SandboxHandle>,
) -> Option<SandboxHandle> {
    let mut timings = BTreeMap::new();
    if let Some(turn) = &turn
        && let Some(started) = turn.started_at
    {
        timings.insert(
            "queued".to_owned(),
            u64::try_from(started - turn.created_at).unwrap_or(0),
        );
    }
    let fresh = sandbox.is_none();
    let sandbox = match sandbox {
        Some(sandbox) => sandbox,
        None => match provision(context, &session, &mut timings).await {
            Ok(sandbox) => sandbox,
            Err(failure) => {
                tracing::warn!(session = %session.id, reason = %failure.1, "provisioning failed");
                if let Some(turn) = &turn {
                    let _ = context
                        .store
                        .set_turn_details(&session.id, turn.n, None, Some(&timings))
                        .await;
                    finish(context, &session.id, turn.n, TurnStatus::Failed, None, Some(failure)).await;
                }
                let _ = context
                    .store
                    .settle_session(&session.id, SessionPhase::Provisioning, true)
                    .await;
                return None;
            }
        },
    };
    let Some(turn) = turn else {
        // A resume without a prompt: the sandbox is up and waits warm.
        return match context
            .store
            .settle_session(&session.id, SessionPhase::Provisioning, false)
            .await
        {
            Ok(Some(_)) => Some(sandbox),
            _ => {
                destroy(context, &session.id, &sandbox).await;
                None
            }
        };
    };
    if fresh
        && !matches!(
            context
                .store
                .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Running)
                .await,
            Ok(true)
        )
    {
        // Canceled while its sandbox was being made.
        destroy(context, &session.id, &sandbox).await;
        finish(context, &session.id, turn.n, TurnStatus::Canceled, None, None).await;
        return None;
    }
    run_agent_turn(context, &session, &turn, sandbox, fresh, timings).await
}

async fn run_agent_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    turn: &TurnRow,
    sandbox: SandboxHandle,
    fresh: bool,
    mut timings: BTreeMap<String, u64>,
) -> Option<SandboxHandle> {
    let driver = sandbox.driver();
    let n = turn.n;
    // A refusal the vendor sent after the last turn ended belongs to no turn.
    let _ = sandbox.0.meter.take_rejection();
    // A model key set since a warm sandbox started is checked at this turn's delivery (the driver
    // reads the file again; rewritten in place, since the sandbox sees it through a bind mount).
    // A fresh sandbox's file was written by its provisioning just now.
    if !fresh {
        let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
        if let Err(error) = write_known_secrets(context, session, &dirs.known_secrets).await {
            tracing::warn!(session = %session.id, %error, "cannot refresh the known secrets; the sandbox's list stays");
        }
        // A forge token rotated or removed since the sandbox started counts from this turn on.
        match session_upstream(context, session).await {
            Ok((upstream, _)) => sandbox.0.upstream.replace(upstream),
            Err((_, reason)) => {
                tracing::warn!(session = %session.id, %reason, "the forge connection is gone; pushes will be refused");
                if sortie_protocol::api::repo_forge_host(&session.repo).is_some() {
                    sandbox.0.upstream.replace(Upstream::Remote {
                        url: session.repo.clone(),
                        token: String::new(),
                    });
                }
            }
        }
    }
    let priming_context = if fresh && n > 1 {
        priming_context(context, session, n).await
    } else {
        Value::Null
    };
    let body = json!({
        "n": n,
        "prompt": turn.prompt,
        "baseline": session.head_sha,
        "priming_context": priming_context,
        "host_timings": timings,
    });
    if let Err(error) = driver.start_turn(&body).await {
        return lose(
            context,
            session,
            n,
            sandbox,
            format!("the driver did not take the turn: {error}"),
        )
        .await;
    }

    let deadline = Instant::now() + context.config.turn_timeout + DRIVER_GRACE;
    let mut after = None;
    let mut delivering = false;
    let mut cancel_sent: Option<Instant> = None;
    let mut rejected = None;
    let mut breaks = 0;
    loop {
        let recording = {
            let store = context.store.clone();
            let driver = driver.clone();
            let session_id = session.id.clone();
            tokio::spawn(async move { recorder::record(&store, &driver, &session_id, n, after).await })
        };
        tokio::pin!(recording);
        let mut unreachable_since: Option<Instant> = None;
        let recorded: Recorded = loop {
            tokio::select! {
                done = &mut recording => break done.unwrap_or_default(),
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            if Instant::now() >= deadline {
                recording.abort();
                return lose(
                    context,
                    session,
                    n,
                    sandbox,
                    "the driver did not end the turn within the turn timeout and its grace".into(),
                )
                .await;
            }
            if rejected.is_none()
                && let Some(rejection) = sandbox.0.meter.take_rejection()
            {
                // The vendor refused the key: the turn fails now, not when the agent gives up.
                finish(
                    context,
                    &session.id,
                    n,
                    TurnStatus::Failed,
                    None,
                    Some((FailureCode::VendorAuthRejected, rejection.reason.clone())),
                )
                .await;
                let _ = driver.cancel(n).await;
                cancel_sent = Some(Instant::now());
                rejected = Some(rejection);
            }
            if let Ok(row) = context.store.turn(&session.id, n).await
                && row.stop_requested.is_some()
                && cancel_sent.is_none_or(|sent| sent.elapsed() >= Duration::from_secs(2))
            {
                let _ = driver.cancel(n).await;
                cancel_sent = Some(Instant::now());
            }
            match driver.status().await {
                Ok(status) => {
                    unreachable_since = None;
                    if !delivering && status.turn(n).is_some_and(|t| t.state == "delivering") {
                        delivering = true;
                        let _ = context
                            .store
                            .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                            .await;
                    }
                }
                Err(_) => {
                    let gone = matches!(
                        context.runtime.status(sandbox.name()).await,
                        Ok(SandboxStatus::Exited(_)) | Err(_)
                    );
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if gone || since.elapsed() >= UNREACHABLE_LIMIT {
                        recording.abort();
                        let why = match context.runtime.status(sandbox.name()).await {
                            Ok(SandboxStatus::Exited(exit)) => format!("the sandbox's driver {}", exit.describe()),
                            _ => "the driver stopped answering".to_owned(),
                        };
                        return lose(context, session, n, sandbox, why).await;
                    }
                }
            }
        };
        if recorded.complete {
            break;
        }
        if driver.status().await.is_err() {
            let why = match context.runtime.status(sandbox.name()).await {
                Ok(SandboxStatus::Exited(exit)) => format!("the sandbox's driver {}", exit.describe()),
                _ => "the driver stopped answering".to_owned(),
            };
            return lose(context, session, n, sandbox, why).await;
        }
        // Follow again from the last stored part: the driver serves the rest from its hub or turn log.
        after = recorded.last_index;
        if recorded.store_failed {
            // The store is down, not the sandbox: wait for it (within the turn's deadline).
            tokio::time::sleep(WATCH_INTERVAL * 4).await;
            continue;
        }
        // The subscription broke while the driver lives.
        breaks += 1;
        if breaks > 20 {
            return lose(context, session, n, sandbox, "the driver's stream kept breaking".into()).await;
        }
        tokio::time::sleep(WATCH_INTERVAL).await;
    }

    let report = match driver.status().await {
        Ok(status) => status.turn(n).cloned(),
        Err(_) => None,
    };
    let Some(report) = report else {
        return lose(context, session, n, sandbox, "the driver forgot the turn".into()).await;
    };
    let stop = context
        .store
        .turn(&session.id, n)
        .await
        .ok()
        .and_then(|row| row.stop_requested);
    let (mut status, head_sha, mut failure) = outcome(&report, stop);
    if rejected.is_none()
        && let Some(late) = sandbox.0.meter.take_rejection()
    {
        status = TurnStatus::Failed;
        failure = Some((FailureCode::VendorAuthRejected, late.reason));
    }
    if let Some(driver_timings) = &report.timings {
        for (key, value) in driver_timings {
            if let Some(value) = value.as_u64() {
                timings.insert(key.clone(), value);
            }
        }
    }
    let _ = context
        .store
        .set_turn_details(&session.id, n, report.priming.as_deref(), Some(&timings))
        .await;
    let delivered = head_sha.is_some();
    // The branch is on the remote when this turn pushed it or an earlier one did (a steer that
    // changed nothing still retries a pull request that failed to open).
    let on_remote = delivered || session.head_sha.is_some();
    if rejected.is_none() && failure.is_none() && on_remote && session.pr.is_none() && status != TurnStatus::Canceled {
        // Opening the draft PR is the last step of delivering (DESIGN §4.1), bounded by the forge
        // call's deadline; the branch stands whatever the forge answers.
        if !delivering {
            delivering = matches!(
                context
                    .store
                    .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                    .await,
                Ok(true)
            );
        }
        if let pull_request::PullRequest::Failed(reason) = open_pull_request(context, session).await {
            status = TurnStatus::Failed;
            failure = Some((
                FailureCode::PrOpenFailed,
                format!(
                    "{reason}. The work is on the branch sortie/{}; steer the session to open the pull \
                     request again.",
                    session.id
                ),
            ));
        }
        // A cancel that came while the forge answered still cancels.
        if let Ok(row) = context.store.turn(&session.id, n).await
            && row.stop_requested == Some(StopRequest::Cancel)
        {
            (status, failure) = (TurnStatus::Canceled, None);
        }
    }
    let failed = failure.is_some() || rejected.is_some();
    if rejected.is_none() {
        finish(context, &session.id, n, status, head_sha, failure).await;
    }

    if status == TurnStatus::Canceled {
        destroy(context, &session.id, &sandbox).await;
        return None;
    }
    let mut from = SessionPhase::Delivering;
    if !delivering
        && !matches!(
            context
                .store
                .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                .await,
            Ok(true)
        )
    {
        from = match context.store.session_by_id(&session.id).await {
            Ok(now) => now.phase,
            Err(_) => SessionPhase::Delivering,
        };
    }
    if from == SessionPhase::Canceled {
        destroy(context, &session.id, &sandbox).await;
        return None;
    }
    if let Ok(None) = context.store.settle_session(&session.id, from, failed).await
        && matches!(
            context.store.session_by_id(&session.id).await.map(|now| now.phase),
            Ok(SessionPhase::Canceled)
        )
    {
        // Canceled while it delivered: nothing of it may stay warm.
        destroy(context, &session.id, &sandbox).await;
        return None;
    }
    Some(sandbox)
}

/// Opens the draft PR of a session on a GitHub forge after its first delivery (see [`pull_request`]).
async fn open_pull_request(context: &Arc<Context>, session: &SessionRow) -> pull_request::PullRequest {
    let config = &context.config;
    // Looked up only once a pull request is really to be opened.
    let base = async {
        match &session.base {
            Some(base) => Ok(base.clone()),
            None => {
                let mirror = prepare::mirror_path(&config.work_dir.join("mirrors"), &session.repo);
                prepare::git(
                    &config.git_binary,
                    Some(&mirror),
                    &["symbolic-ref", "--short", "HEAD"],
                    Duration::from_secs(10),
                )
                .await
                .map_err(|error| {
                    format!(
                        "the repository's default branch is unknown, so no pull request could be opened ({})",
                        error.0
                    )
                })
            }
        }
    };
    let task = context
        .store
        .turn(&session.id, 1)
        .await
        .map(|turn| turn.prompt)
        .unwrap_or_default();
    let outcome = pull_request::ensure_draft(
        context.store.as_ref(),
        config.keyring.as_deref(),
        config.forge_http.as_ref(),
        session,
        base,
        &task,
    )
    .await;
    match &outcome {
        pull_request::PullRequest::Opened { url, number } => {
            tracing::info!(session = %session.id, %url, number, "draft pull request opened");
        }
        pull_request::PullRequest::Failed(reason) => {
            tracing::warn!(session = %session.id, %reason, "no pull request");
        }
        pull_request::PullRequest::NotApplicable => {}
    }
    outcome
}

/// The turn's status, delivered head and failure from the driver's report and the stop request.
fn outcome(report: &DriverTurn, stop: Option<StopRequest>) -> (TurnStatus, Option<String>, Option<Failure>) {
    let failure_of = |code: &str, reason: &str| -> Failure {
        let code =
            serde_json::from_value::<FailureCode>(Value::String(code.to_owned())).unwrap_or(FailureCode::Internal);
        (code, reason.to_owned())
    };
    let mut failure = report
        .failure
        .as_ref()
        .filter(|f| f.code != "CANCELED")
        .map(|f| failure_of(&f.code, &f.reason));
    let delivery = report.delivery.as_ref();
    if failure.is_none()
        && let Some(error) = delivery.and_then(|d| d.error.as_ref())
    {
        failure = Some(failure_of(&error.code, &error.reason));
    }
    let head_sha = delivery.filter(|d| d.pushed).and_then(|d| d.head_sha.clone());
    let status = if failure.is_some() {
        TurnStatus::Failed
    } else {
        match (report.state.as_str(), stop) {
            (_, Some(StopRequest::Cancel)) => TurnStatus::Canceled,
            ("cancelled", _) => TurnStatus::Stopped,
            // The agent finished on its own before the stop reached it: the turn is whole.
            ("completed", _) => TurnStatus::Completed,
            (_, Some(StopRequest::Stop | StopRequest::Interrupt)) => TurnStatus::Stopped,
            _ => TurnStatus::Completed,
        }
    };
    (status, head_sha, failure)
}

async fn finish(
    context: &Arc<Context>,
    session_id: &SessionId,
    n: u32,
    status: TurnStatus,
    head_sha: Option<String>,
    failure: Option<Failure>,
) {
    let outcome = TurnOutcome {
        status,
        head_sha,
        failure,
    };
    if let Err(error) = context.store.finish_turn(session_id, n, outcome).await {
        tracing::warn!(%error, session = %session_id, turn = n, "cannot record the turn's end");
    }
}

/// The sandbox (or its driver) is gone: nothing of it may run on, the transcript is completed from
/// the driver's log, the turn is `lost` and the session `failed` with the reason.
async fn lose(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    reason: String,
) -> Option<SandboxHandle> {
    tracing::warn!(session = %session.id, turn = n, %reason, "sandbox lost");
    destroy(context, &session.id, &sandbox).await;
    recorder::harvest_log(&context.store, &sandbox.0.dirs.home, &session.id, n).await;
    let reason = format!("{reason}; the work of this turn was not delivered. Steer the session to run it again.");
    finish(
        context,
        &session.id,
        n,
        TurnStatus::Lost,
        None,
        Some((FailureCode::SandboxLost, reason)),
    )
    .await;
    let mut from = match context.store.session_by_id(&session.id).await {
        Ok(now) => now.phase,
        Err(_) => return None,
    };
    if from == SessionPhase::Running
        && matches!(
            context
                .store
                .transition_session(&session.id, from, SessionPhase::Delivering)
                .await,
            Ok(true)
        )
    {
        from = SessionPhase::Delivering;
    }
    if matches!(from, SessionPhase::Delivering | SessionPhase::Provisioning) {
        let _ = context.store.settle_session(&session.id, from, true).await;
    }
    None
}

/// Kills every process of the sandbox, stops its proxy and forgets it; the session's directories stay.
pub(crate) async fn destroy(context: &Arc<Context>, session_id: &SessionId, sandbox: &SandboxHandle) {
    context.drivers.set(session_id, None);
    sandbox.0.proxy.abort();
    match context.runtime.destroy(sandbox.name()).await {
        Ok(usage) => {
            let turn = context
                .store
                .session_by_id(session_id)
                .await
                .ok()
                .and_then(|s| s.current_turn)
                .unwrap_or(1);
            let compute_ms = (usage.cpu_seconds * 1000.0).round().max(0.0) as u64;
            let _ = context
                .store
                .record_compute(session_id, turn, sortie_store::now_ms(), compute_ms)
                .await;
        }
        Err(error) => tracing::debug!(%error, session = %session_id, "destroy"),
    }
    let _ = context.store.delete_sandbox(session_id).await;
    let _ = std::fs::remove_file(sandbox.0.dirs.egress_socket());
}

/// Takes over the sandbox of `session` that an earlier process of this worker left running (its
/// driver answers): the runtime adopts it, and its egress, git and model proxies are served again on
/// its socket. Anything short of that destroys it.
pub(crate) async fn adopt(context: &Arc<Context>, session: &SessionRow, name: &str) -> Result<SandboxHandle, String> {
    context.runtime.adopt(name).await.map_err(|e| e.to_string())?;
    let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
    let driver = DriverClient::new(dirs.driver_socket());
    let answered_by = Instant::now() + Duration::from_secs(2);
    while driver.status().await.is_err() {
        if Instant::now() >= answered_by {
            let _ = context.runtime.destroy(name).await;
            return Err("its driver does not answer".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let proxy = match session_upstream(context, session).await {
        Ok((upstream, _)) => serve_proxy(context, session, &dirs, upstream),
        Err(failure) => Err(failure),
    };
    let proxy = match proxy {
        Ok(proxy) => proxy,
        Err((_, reason)) => {
            let _ = context.runtime.destroy(name).await;
            return Err(reason);
        }
    };
    // Only a sandbox past its setup is adopted: the agent phase's allowlist.
    proxy.allowlist.end_setup();
    context.drivers.set(&session.id, Some(dirs.driver_socket()));
    Ok(SandboxHandle(Arc::new(HandleInner {
        name: name.to_owned(),
        dirs,
        allowlist: proxy.allowlist,
        meter: proxy.meter,
        upstream: proxy.upstream,
        proxy: proxy.task,
    })))
}

/// Follows a turn that was running in an adopted sandbox to its end, as if this process had started it:
/// the driver takes the same turn again as a no-op, the recorder fills in what it missed.
pub(crate) async fn resume(
    context: &Arc<Context>,
    session: SessionRow,
    turn: TurnRow,
    sandbox: SandboxHandle,
) -> Option<SandboxHandle> {
    tracing::info!(session = %session.id, turn = turn.n, "took up a turn whose sandbox outlived the last process");
    run_agent_turn(context, &session, &turn, sandbox, false, BTreeMap::new()).await
}

async fn priming_context(context: &Arc<Context>, session: &SessionRow, n: u32) -> Value {
    let turns = context
        .store
        .turns(&session.workspace_id, &session.id)
        .await
        .unwrap_or_default();
    let parts = context.store.parts(&session.id).await.unwrap_or_default();
    let preamble = priming::preamble(&turns, &parts, n, priming::PREAMBLE_LIMIT);
    let task = turns.first().map(|t| t.prompt.clone());
    json!({"preamble": preamble, "task": task})
}

/// What the session's agent profile asks the sandbox to bind read-only (its install dir outside
/// `/usr` and the agents dir): absolute paths that exist, else the turn cannot start.
fn agent_read_only_paths(manifest: Option<&Path>, agent: &str, exe_dir: &Path) -> Result<Vec<PathBuf>, Failure> {
    let agent_failed = |what: String| (FailureCode::AgentStartFailed, what);
    let profiles = sortie_driver::profile::load(manifest).map_err(|e| agent_failed(e.to_string()))?;
    let profile = sortie_driver::profile::find(&profiles, agent).map_err(|e| agent_failed(e.to_string()))?;
    let mut paths = Vec::new();
    // The driver looks for a bare command beside its own binary first: that one file is bound, not
    // the directory (which may hold anything: a build tree, other tools).
    if !profile.command.contains('/') {
        let beside = exe_dir.join(&profile.command);
        if beside.is_file() {
            paths.push(beside);
        }
    }
    for entry in &profile.read_only_paths {
        let path = PathBuf::from(entry);
        let plain = path.is_absolute() && path.components().all(|c| !matches!(c, std::path::Component::ParentDir));
        if !plain || !path.exists() {
            return Err(agent_failed(format!(
                "agent {agent:?} asks for read-only path {entry:?}, which is not an existing absolute path: fix \
                 read_only_paths in the agent manifest"
            )));
        }
        paths.push(path);
    }
    Ok(paths)
}

/// Writes the digests of the workspace's secret values to `path`, in place (truncated, same inode).
async fn write_known_secrets(context: &Arc<Context>, session: &SessionRow, path: &Path) -> Result<(), String> {
    let digests = WorkspaceKeys {
        store: context.store.clone(),
        ring: context.config.keyring.clone(),
        workspace_id: session.workspace_id.clone(),
    }
    .digests()
    .await;
    std::fs::write(path, digests).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn start_failed(what: impl std::fmt::Display) -> Failure {
    (FailureCode::SandboxStartFailed, what.to_string())
}

/// Where the session's repository lives for the git proxy, and how host-side git reaches it: a local
/// path as is; an `https://` URL through the workspace's connection to its forge, whose token only
/// the gateway and the mirror fetch ever hold.
async fn session_upstream(
    context: &Arc<Context>,
    session: &SessionRow,
) -> Result<(Upstream, Option<prepare::ForgeAuth>), Failure> {
    if session.repo.starts_with('/') {
        return Ok((Upstream::Local(PathBuf::from(&session.repo)), None));
    }
    let Some(host) = sortie_protocol::api::repo_forge_host(&session.repo) else {
        return Err((
            FailureCode::CloneFailed,
            format!(
                "{:?} is neither a local path nor an https:// repository URL",
                session.repo
            ),
        ));
    };
    let missing = || {
        (
            FailureCode::CloneFailed,
            format!(
                "the workspace has no connection to {host}: an admin adds one with `sortie forge set {host}`, then retry"
            ),
        )
    };
    let ring = context.config.keyring.as_ref().ok_or_else(missing)?;
    let opened = sortie_store::workspace_forge_token(context.store.as_ref(), ring, &session.workspace_id, &host).await;
    let (_, token) = match opened {
        Ok(Some(found)) => found,
        Ok(None) => return Err(missing()),
        Err(sortie_store::KeyError::Store(_)) => {
            return Err((FailureCode::CloneFailed, "the store did not answer; retry".into()));
        }
        Err(_) => {
            return Err((
                FailureCode::CloneFailed,
                format!(
                    "the stored token for {host} does not open with this server's master key: set it again with `sortie forge set {host}`"
                ),
            ));
        }
    };
    let token_text = String::from_utf8_lossy(token.expose()).into_owned();
    Ok((
        Upstream::Remote {
            url: session.repo.clone(),
            token: token_text,
        },
        Some(prepare::ForgeAuth {
            token,
            ca_bundle: context.config.forge_ca_bundle.clone(),
        }),
    ))
}

/// What serves a sandbox's `egress.sock`: its allowlist, model meter, git upstream and the task.
struct SandboxProxy {
    allowlist: Arc<PhasedAllowlist>,
    meter: Arc<TurnMeter>,
    upstream: Arc<SessionUpstream>,
    task: tokio::task::JoinHandle<()>,
}

/// Serves the session's egress proxy (with its git and model proxies) on its `egress.sock`.
fn serve_proxy(
    context: &Arc<Context>,
    session: &SessionRow,
    dirs: &SessionDirs,
    upstream: Upstream,
) -> Result<SandboxProxy, Failure> {
    let config = &context.config;
    let allowlist = PhasedAllowlist::new(
        Arc::new(SessionAllowlist {
            store: context.store.clone(),
            workspace_id: session.workspace_id.clone(),
            session_id: session.id.clone(),
        }),
        config.setup_hosts.clone(),
    );
    let upstream = Arc::new(SessionUpstream {
        session_id: session.id.clone(),
        upstream: std::sync::RwLock::new(upstream),
    });
    let git = crate::git_proxy::build(context, session, dirs, upstream.clone()).map_err(start_failed)?;
    // `git.pushes` is the proxy's record of every push; the turn's delivered head and pushed state
    // are to be read from it (issue 15 item 2), not yet from here.
    let git_routes = sortie_gateway::git::http::router(git.config);
    let meter = TurnMeter::new(context.store.clone(), session.id.clone(), dirs.driver_socket());
    let model_routes = sortie_gateway::model::router(
        sortie_gateway::model::ModelProxyConfig {
            session_id: session.id.clone(),
            upstreams: config.model_upstreams.clone(),
            extra_roots_pem: Vec::new(),
        },
        Arc::new(WorkspaceKeys {
            store: context.store.clone(),
            ring: config.keyring.clone(),
            workspace_id: session.workspace_id.clone(),
        }),
        meter.clone(),
    )
    .map_err(start_failed)?;
    let proxy = EgressProxy::new(
        allowlist.clone(),
        config.egress_exempt.clone(),
        config.resolver.clone(),
        Some(git_routes.merge(model_routes)),
        Some(report_to_driver(dirs.driver_socket())),
    );
    let egress_socket = dirs.egress_socket();
    let _ = std::fs::remove_file(&egress_socket);
    let listener = tokio::net::UnixListener::bind(&egress_socket)
        .map_err(|e| start_failed(format!("cannot listen on {}: {e}", egress_socket.display())))?;
    context.runtime.grant_socket(&egress_socket).map_err(start_failed)?;
    let proxy_task = tokio::spawn(proxy.serve(listener));
    Ok(SandboxProxy {
        allowlist,
        meter,
        upstream,
        task: proxy_task,
    })
}

/// Makes the session's sandbox: workspace, egress and git proxy, the driver, the setup script.
async fn provision(
    context: &Arc<Context>,
    session: &SessionRow,
    timings: &mut BTreeMap<String, u64>,
) -> Result<SandboxHandle, Failure> {
    let config = &context.config;
    let dirs = SessionDirs::new(&config.work_dir, &session.id);
    let (upstream, forge_auth) = session_upstream(context, session).await?;

    let clock = Instant::now();
    let mirrors = config.work_dir.join("mirrors");
    let mirror = {
        let lock = context
            .mirror_lock(&prepare::mirror_path(&mirrors, &session.repo))
            .await;
        let _held = lock.lock().await;
        prepare::ensure_mirror(&config.git_binary, &mirrors, &session.repo, forge_auth.as_ref())
            .await
            .map_err(|e| (FailureCode::CloneFailed, e.0))?
    };
    for dir in [&dirs.root, &dirs.home, &dirs.run, &dirs.egress] {
        std::fs::create_dir_all(dir).map_err(|e| start_failed(format!("cannot create {}: {e}", dir.display())))?;
    }
    let origin = format!(
        "http://{}/_sortie/git/{}.git",
        sortie_driver::relay::RELAY_ADDRESS,
        session.id
    );
    prepare::ensure_workspace(
        &config.git_binary,
        &mirror,
        &dirs.workspace,
        &session.id.branch(),
        session.base.as_deref(),
        &origin,
    )
    .await
    .map_err(|e| (FailureCode::CloneFailed, e.0))?;
    if let Some((uid, gid)) = context.runtime.host_owner() {
        for dir in [&dirs.workspace, &dirs.home, &dirs.run] {
            sortie_sandbox::local::chown_tree(dir, uid, gid)
                .map_err(|e| start_failed(format!("cannot hand {} to the sandbox: {e}", dir.display())))?;
        }
    }
    timings.insert("clone".into(), ms(clock));

    let clock = Instant::now();
    // A socket left by an earlier sandbox of the session must not look like a live driver.
    let _ = std::fs::remove_file(dirs.driver_socket());
    let SandboxProxy {
        allowlist,
        meter,
        upstream,
        task: proxy_task,
    } = serve_proxy(context, session, &dirs, upstream)?;

    let exe = &config.sortie_exe;
    let exe_dir = exe
        .parent()
        .ok_or_else(|| start_failed("the sortie binary has no directory"))?
        .to_owned();
    if !context.runtime.is_reachable(exe) {
        proxy_task.abort();
        return Err(start_failed(format!(
            "the sandbox uid cannot reach the sortie binary at {}: install sortie under a path every user can read \
             (e.g. /usr/local/bin)",
            exe.display()
        )));
    }
    let mut command = vec![
        exe.display().to_string(),
        "driver".into(),
        "--socket".into(),
        inside::DRIVER_SOCKET.into(),
        "--workspace".into(),
        inside::WORKSPACE.into(),
        "--home".into(),
        inside::HOME.into(),
        "--agent".into(),
        session.agent.clone(),
        "--session".into(),
        session.id.to_string(),
        "--egress-socket".into(),
        inside::EGRESS_SOCKET.into(),
        "--turn-timeout".into(),
        config.turn_timeout.as_secs().max(1).to_string(),
        "--branch".into(),
        session.id.branch(),
        "--remote".into(),
        "origin".into(),
        "--author-name".into(),
        config.author_name.clone(),
        "--author-email".into(),
        config.author_email.clone(),
    ];
    write_known_secrets(context, session, &dirs.known_secrets)
        .await
        .map_err(start_failed)?;
    command.push("--secret-digests".into());
    command.push(dirs.known_secrets.display().to_string());
    let mut read_only = vec![exe.clone(), mirror, dirs.known_secrets.clone()];
    if let Some(model) = &session.model {
        command.push("--model".into());
        command.push(model.clone());
    }
    if let Some(agents) = config.agents_dir.as_ref().filter(|dir| dir.is_dir()) {
        command.push("--agents-dir".into());
        command.push(agents.display().to_string());
        read_only.push(agents.clone());
    }
    if let Some(profiles) = &config.agent_profiles {
        command.push("--profiles".into());
        command.push(profiles.display().to_string());
        read_only.push(profiles.clone());
    }
    read_only.extend(agent_read_only_paths(
        config.agent_profiles.as_deref(),
        &session.agent,
        &exe_dir,
    )?);
    let spec = SandboxSpec {
        name: session.id.to_string(),
        workspace: dirs.workspace.clone(),
        home: dirs.home.clone(),
        run_dir: dirs.run.clone(),
        egress_dir: Some(dirs.egress.clone()),
        read_only,
        env: Vec::new(),
        command,
        limits: config.limits,
        stdio: SandboxStdio::Null,
    };
    let name = spec.name.clone();
    // A sandbox of this name left by an earlier attempt is gone for good.
    let _ = context.runtime.destroy(&name).await;
    if let Err(error) = context.runtime.create(spec).await {
        proxy_task.abort();
        return Err(start_failed(error));
    }
    let handle = SandboxHandle(Arc::new(HandleInner {
        name: name.clone(),
        dirs: dirs.clone(),
        allowlist,
        meter,
        upstream,
        proxy: proxy_task,
    }));
    let _ = context
        .store
        .put_sandbox(&session.id, "local", &name, &config.worker_id)
        .await;
    if let Err(error) = context.runtime.start(&name).await {
        destroy(context, &session.id, &handle).await;
        return Err(start_failed(error));
    }
    let driver = handle.driver();
    let ready_by = Instant::now() + DRIVER_READY_DEADLINE;
    loop {
        if driver.status().await.is_ok() {
            break;
        }
        if let Ok(SandboxStatus::Exited(exit)) = context.runtime.status(&name).await {
            destroy(context, &session.id, &handle).await;
            return Err(start_failed(format!(
                "the sandbox's driver {} before it answered",
                exit.describe()
            )));
        }
        if Instant::now() >= ready_by {
            destroy(context, &session.id, &handle).await;
            return Err(start_failed("the sandbox's driver did not answer within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    context.drivers.set(&session.id, Some(dirs.driver_socket()));
    timings.insert("sandbox".into(), ms(clock));

    let clock = Instant::now();
    let script = session.setup.as_deref().unwrap_or(DEFAULT_SETUP);
    let setup = driver.setup(script, config.setup_timeout).await;
    let failure = match setup {
        Ok(result) if result.exit_code == Some(0) && !result.timed_out => None,
        Ok(result) => {
            let what = if result.timed_out {
                format!("did not finish within {} s", config.setup_timeout.as_secs())
            } else {
                match result.exit_code {
                    Some(code) => format!("exited with code {code}"),
                    None => "was killed".to_owned(),
                }
            };
            let tail: String = {
                let lines: Vec<&str> = result.output_tail.lines().rev().take(20).collect();
                lines.into_iter().rev().collect::<Vec<_>>().join("\n")
            };
            Some(format!("the setup script {what}; its last output:\n{tail}"))
        }
        Err(error) => Some(format!("the setup script could not run: {error}")),
    };
    if let Some(reason) = failure {
        destroy(context, &session.id, &handle).await;
        return Err((FailureCode::SetupFailed, reason));
    }
    handle.0.allowlist.end_setup();
    timings.insert("setup".into(), ms(clock));
    Ok(handle)
}
