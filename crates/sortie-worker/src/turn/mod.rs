//! One turn of one session, as a task: provision a sandbox when none is warm ([`provision`]), start
//! the agent's turn with a nonce of the host's, follow it into the host's own transcript, honour stop
//! and cancel requests, and settle the turn and the session from what the host established itself.
//!
//! The sandbox's side is untrusted (DESIGN §9 invariant 9): the driver's stream passes through
//! [`Transcript`]'s checks, the turn's timings are measured here, a turn the host did not start is
//! refused, and nothing a turn started inside the sandbox outlives it.

mod provision;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_gateway::egress::registries::PhasedAllowlist;
use sortie_gateway::git::config::{PushOutcome, PushRecords};
use sortie_gateway::git::http::Upstream;
use sortie_protocol::driver::{DriverErrorCode, DriverFailureCode, PrimingContext, StartTurn, TurnReport, TurnState};
use sortie_protocol::sortie_data::{DeliveryData, DeliveryError, DiffStat, PhaseData, PrimingData, SortieData};
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sortie_sandbox::SandboxStatus;
use sortie_store::{SessionRow, StopRequest, TurnOutcome, TurnRow};

use self::provision::{SessionUpstream, session_upstream, write_known_secrets};
use crate::client::DriverClient;
use crate::meter::{CurrentTurn, TurnMeter};
use crate::prepare::{self, SessionDirs};
use crate::recorder;
use crate::transcript::{Ending, Transcript};
use crate::{Context, priming, pull_request};

/// How often a running turn's stop request and driver are checked.
const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// How long past the turn timeout the host waits (cancel, kill, delivery) before it gives up on the driver.
const DRIVER_GRACE: Duration = Duration::from_secs(180);
/// A driver that does not answer this long while its turn runs is lost.
const UNREACHABLE_LIMIT: Duration = Duration::from_secs(3);
/// The longest reason of the driver's that the host keeps (its words, shown to users as its).
const DRIVER_REASON_MAX_BYTES: usize = 4096;

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
    /// The running turn's transcript, for the parts of sortie's own its proxies report.
    current: Arc<CurrentTurn>,
    /// The git proxy's record of every push it decided on: what a turn delivered comes from here.
    pushes: Arc<PushRecords>,
    /// Object stores the host trusts for the session's delivered history.
    trusted_objects: Vec<PathBuf>,
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

fn ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// At most `max` bytes of `text`, cut at a character boundary.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
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
        None => match provision::provision(context, &session, &mut timings).await {
            Ok(sandbox) => sandbox,
            Err(failure) => {
                tracing::warn!(session = %session.id, reason = %failure.1, "provisioning failed");
                if let Some(turn) = &turn {
                    record_details(context, &session.id, turn.n, None, &timings).await;
                    fail_unstarted(context, &session.id, turn.n, failure).await;
                }
                settle_or_warn(context, &session.id, SessionPhase::Provisioning, true).await;
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

/// Records a turn's priming rung and timings; a store that does not answer loses only these details.
async fn record_details(
    context: &Arc<Context>,
    session_id: &SessionId,
    n: u32,
    priming: Option<&str>,
    timings: &BTreeMap<String, u64>,
) {
    if let Err(error) = context
        .store
        .set_turn_details(session_id, n, priming, Some(timings))
        .await
    {
        tracing::warn!(%error, session = %session_id, turn = n, "cannot record the turn's timings");
    }
}

async fn settle_or_warn(context: &Arc<Context>, session_id: &SessionId, from: SessionPhase, failed: bool) {
    if let Err(error) = context.store.settle_session(session_id, from, failed).await {
        tracing::warn!(%error, session = %session_id, "cannot settle the session");
    }
}

/// A turn that failed before its agent ran: its transcript says why, then the ledger.
async fn fail_unstarted(context: &Arc<Context>, session_id: &SessionId, n: u32, failure: Failure) {
    if let Ok(transcript) = Transcript::open(context.store.clone(), context.feeds.clone(), session_id, n).await {
        transcript
            .finish(Ending {
                failure: Some(failure.clone()),
                stop_reason: None,
                parts: Vec::new(),
            })
            .await;
    }
    finish(context, session_id, n, TurnStatus::Failed, None, Some(failure)).await;
}

/// A fresh nonce for a turn: 128 random bits, hex.
fn new_nonce() -> Result<String, getrandom::Error> {
    let mut bytes = [0_u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// What the host saw of a turn while it watched it.
#[derive(Default)]
struct Watched {
    /// The host's own clock ran past the turn timeout; the turn was canceled.
    timed_out: bool,
    /// The transcript passed a cap; the turn was stopped.
    limited: Option<String>,
    /// The vendor refused the workspace's key (the turn was failed at once).
    rejected: Option<String>,
    /// The driver said it delivers (the session went `delivering`).
    delivering: bool,
    priming_written: bool,
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
    // A refusal the vendor sent, or a push decided, after the last turn ended belongs to no turn.
    let _ = sandbox.0.meter.take_rejection();
    let _ = sandbox.0.pushes.take();
    if !fresh {
        refresh_warm_sandbox(context, session, &sandbox).await;
    }
    let transcript = match Transcript::open(context.store.clone(), context.feeds.clone(), &session.id, n).await {
        Ok(transcript) => transcript,
        Err(error) => {
            return lose(
                context,
                session,
                n,
                sandbox,
                None,
                format!("the store did not answer ({error})"),
            )
            .await;
        }
    };
    sandbox.0.current.set(Some(transcript.clone()));
    transcript.host(phase_part("running", None, &timings));

    let nonce = match &turn.driver_nonce {
        // A worker that started again follows the turn it had started (`resume`).
        Some(nonce) => nonce.clone(),
        None => {
            let Ok(nonce) = new_nonce() else {
                return lose(
                    context,
                    session,
                    n,
                    sandbox,
                    Some(transcript),
                    "no randomness for the turn's nonce".into(),
                )
                .await;
            };
            if let Err(error) = context.store.set_driver_nonce(&session.id, n, &nonce).await {
                return lose(
                    context,
                    session,
                    n,
                    sandbox,
                    Some(transcript),
                    format!("the store did not answer ({error})"),
                )
                .await;
            }
            nonce
        }
    };
    // What runs in the sandbox before the turn may go on after it (the driver, a setup script's
    // service); whatever the turn starts may not (DESIGN §9, S12).
    let before = context.runtime.processes(sandbox.name()).await.unwrap_or_default();
    let started = Instant::now();
    let priming_context = if n > 1 {
        Some(priming_context(context, session, n).await)
    } else {
        None
    };
    let request = StartTurn {
        n,
        nonce: nonce.clone(),
        prompt: turn.prompt.clone(),
        baseline: session.head_sha.clone(),
        priming_context,
    };
    match driver.start_turn(&request).await {
        Ok(report) if report.nonce == nonce => {}
        Ok(_) => return foreign_turn(context, session, n, sandbox, transcript).await,
        Err(error) if error.code() == Some(DriverErrorCode::TurnNotOurs) => {
            return foreign_turn(context, session, n, sandbox, transcript).await;
        }
        Err(error) => {
            return lose(
                context,
                session,
                n,
                sandbox,
                Some(transcript),
                format!("the driver did not take the turn: {error}"),
            )
            .await;
        }
    }

    let timeout_at = started + context.config.turn_timeout;
    let give_up_at = timeout_at + DRIVER_GRACE;
    let mut watched = Watched::default();
    let mut cancel_sent: Option<Instant> = None;
    let mut breaks = 0;
    let cancel = |driver: DriverClient| async move {
        if let Err(error) = driver.cancel(n).await {
            tracing::debug!(%error, turn = n, "cancel");
        }
    };
    loop {
        let recording = {
            let driver = driver.clone();
            let transcript = transcript.clone();
            tokio::spawn(async move { recorder::follow(&driver, n, &transcript).await })
        };
        tokio::pin!(recording);
        let mut unreachable_since: Option<Instant> = None;
        let followed = loop {
            tokio::select! {
                done = &mut recording => break done.unwrap_or_default(),
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            let now = Instant::now();
            if now >= give_up_at {
                recording.abort();
                let why = "the driver did not end the turn within the turn timeout and its grace".to_owned();
                return lose(context, session, n, sandbox, Some(transcript), why).await;
            }
            let mut cancel_now = false;
            if !watched.timed_out && now >= timeout_at {
                // The host's clock, not the driver's, decides when a turn has run too long.
                watched.timed_out = true;
                cancel_now = true;
            }
            if watched.limited.is_none()
                && let Some(reason) = transcript.limit_reached()
            {
                watched.limited = Some(reason);
                cancel_now = true;
            }
            if watched.rejected.is_none()
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
                watched.rejected = Some(rejection.reason);
                cancel_now = true;
            }
            if let Ok(row) = context.store.turn(&session.id, n).await
                && row.stop_requested.is_some()
                && cancel_sent.is_none_or(|sent| sent.elapsed() >= Duration::from_secs(2))
            {
                cancel_now = true;
            }
            if cancel_now {
                cancel(driver.clone()).await;
                cancel_sent = Some(Instant::now());
            }
            match driver.report(n).await {
                Ok(report) => {
                    unreachable_since = None;
                    if report.nonce != nonce {
                        recording.abort();
                        return foreign_turn(context, session, n, sandbox, transcript).await;
                    }
                    note_progress(context, session, &report, &transcript, &timings, &mut watched).await;
                }
                Err(_) => {
                    let gone = matches!(
                        context.runtime.status(sandbox.name()).await,
                        Ok(SandboxStatus::Exited(_)) | Err(_)
                    );
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if gone || since.elapsed() >= UNREACHABLE_LIMIT {
                        recording.abort();
                        let why = sandbox_gone_reason(context, &sandbox).await;
                        return lose(context, session, n, sandbox, Some(transcript), why).await;
                    }
                }
            }
        };
        if followed.complete {
            break;
        }
        if driver.status().await.is_err() {
            let why = sandbox_gone_reason(context, &sandbox).await;
            return lose(context, session, n, sandbox, Some(transcript), why).await;
        }
        // The subscription broke while the driver lives: follow again after the last part taken.
        breaks += 1;
        if breaks > 20 {
            return lose(
                context,
                session,
                n,
                sandbox,
                Some(transcript),
                "the driver's stream kept breaking".into(),
            )
            .await;
        }
        tokio::time::sleep(WATCH_INTERVAL).await;
    }

    let report = match driver.report(n).await {
        Ok(report) if report.nonce == nonce => report,
        Ok(_) => return foreign_turn(context, session, n, sandbox, transcript).await,
        Err(_) => {
            return lose(
                context,
                session,
                n,
                sandbox,
                Some(transcript),
                "the driver forgot the turn".into(),
            )
            .await;
        }
    };
    if let Some(first) = transcript.first_agent_part() {
        timings.insert("first_part".into(), millis(first.saturating_duration_since(started)));
    }
    timings.insert("agent_turn".into(), ms(started));
    // Nothing the turn started in the sandbox outlives it: the agent, a `setsid` child of it.
    match context.runtime.kill_newer(sandbox.name(), &before).await {
        Ok(0) => {}
        Ok(killed) => tracing::info!(session = %session.id, turn = n, killed, "killed what the turn left running"),
        Err(error) => {
            let why = format!("what the turn started in the sandbox could not be stopped ({error})");
            return lose(context, session, n, sandbox, Some(transcript), why).await;
        }
    }
    note_progress(context, session, &report, &transcript, &timings, &mut watched).await;
    settle_turn(
        context, session, n, sandbox, transcript, report, watched, timings, started,
    )
    .await
}

/// The driver's account of a turn, for what the host shows as the driver's (its delivering phase,
/// the rung that primed its agent); checked to be one of the known values by its type.
async fn note_progress(
    context: &Arc<Context>,
    session: &SessionRow,
    report: &TurnReport,
    transcript: &Transcript,
    timings: &BTreeMap<String, u64>,
    watched: &mut Watched,
) {
    if !watched.priming_written
        && let Some(rung) = report.priming
    {
        watched.priming_written = true;
        transcript.host(SortieData::Priming(PrimingData {
            rung,
            load_error: report
                .load_error
                .as_deref()
                .map(|error| bounded(error, DRIVER_REASON_MAX_BYTES)),
        }));
    }
    if !watched.delivering && report.state == TurnState::Delivering {
        watched.delivering = matches!(
            context
                .store
                .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                .await,
            Ok(true)
        );
        transcript.host(phase_part("delivering", None, timings));
    }
}

fn phase_part(phase: &str, note: Option<String>, timings: &BTreeMap<String, u64>) -> SortieData {
    SortieData::Phase(PhaseData {
        phase: phase.to_owned(),
        note,
        timings: timings.clone(),
    })
}

async fn sandbox_gone_reason(context: &Arc<Context>, sandbox: &SandboxHandle) -> String {
    match context.runtime.status(sandbox.name()).await {
        Ok(SandboxStatus::Exited(exit)) => format!("the sandbox's driver {}", exit.describe()),
        _ => "the driver stopped answering".to_owned(),
    }
}

/// A warm sandbox takes a turn with what changed since it started: the workspace's model keys for
/// the delivery's scan, a rotated or removed forge token.
async fn refresh_warm_sandbox(context: &Arc<Context>, session: &SessionRow, sandbox: &SandboxHandle) {
    let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
    if let Err(error) = write_known_secrets(context, session, &dirs.known_secrets).await {
        tracing::warn!(session = %session.id, %error, "cannot refresh the known secrets; the sandbox's list stays");
    }
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

/// The session's failure code for a failure the driver reports. The codes the host establishes
/// itself (a vendor's refusal, its own timeout, a transcript cap, a lost sandbox) never come from here.
fn failure_code(code: DriverFailureCode) -> FailureCode {
    match code {
        DriverFailureCode::AgentStartFailed => FailureCode::AgentStartFailed,
        DriverFailureCode::AgentError => FailureCode::AgentError,
        DriverFailureCode::TurnTimeout => FailureCode::TurnTimeout,
        DriverFailureCode::SecretDetected => FailureCode::SecretDetected,
        DriverFailureCode::PushConflict => FailureCode::PushConflict,
        DriverFailureCode::DeliveryFailed => FailureCode::DeliveryFailed,
        DriverFailureCode::Canceled | DriverFailureCode::Internal => FailureCode::Internal,
    }
}

/// The turn's status and failure from the host's own observations first, then the driver's report
/// and the stop request.
fn outcome(
    report: &TurnReport,
    stop: Option<StopRequest>,
    watched: &Watched,
    delivery_failure: Option<Failure>,
    turn_timeout: Duration,
) -> (TurnStatus, Option<Failure>) {
    let driver_failure = report
        .failure
        .as_ref()
        .filter(|f| f.code != DriverFailureCode::Canceled)
        .or_else(|| report.delivery.as_ref().and_then(|d| d.error.as_ref()))
        .map(|f| (failure_code(f.code), bounded(&f.reason, DRIVER_REASON_MAX_BYTES)));
    let failure = if let Some(reason) = &watched.rejected {
        Some((FailureCode::VendorAuthRejected, reason.clone()))
    } else if watched.timed_out {
        Some((
            FailureCode::TurnTimeout,
            format!(
                "the turn ran past its limit of {}s; the agent was stopped",
                turn_timeout.as_secs()
            ),
        ))
    } else if let Some(reason) = &watched.limited {
        Some((FailureCode::AgentError, reason.clone()))
    } else if delivery_failure.is_some() {
        delivery_failure
    } else {
        driver_failure
    };
    let status = if failure.is_some() {
        TurnStatus::Failed
    } else {
        match (report.state, stop) {
            (_, Some(StopRequest::Cancel)) => TurnStatus::Canceled,
            (TurnState::Cancelled, _) => TurnStatus::Stopped,
            // The agent finished on its own before the stop reached it: the turn is whole.
            (TurnState::Completed, _) => TurnStatus::Completed,
            (_, Some(StopRequest::Stop | StopRequest::Interrupt)) => TurnStatus::Stopped,
            _ => TurnStatus::Completed,
        }
    };
    (status, failure)
}

/// What a turn delivered, as the host knows it.
struct Delivered {
    /// The branch's new head, when the upstream took a push of it in this turn.
    head: Option<String>,
    card: DeliveryData,
    /// A delivery failure the host established: a push the gateway refused for a secret, or a push
    /// the sandbox reports that the upstream never took.
    failure: Option<Failure>,
}

/// What the turn delivered, from the git proxy's own record of the pushes it forwarded and what the
/// upstream answered (DESIGN §9 invariant 9); the driver's report only ever adds a failure.
async fn delivered(
    context: &Arc<Context>,
    session: &SessionRow,
    sandbox: &SandboxHandle,
    report: &TurnReport,
) -> Delivered {
    let records = sandbox.0.pushes.take();
    let branch_ref = format!("refs/heads/{}", session.id.branch());
    let secret = records.iter().find_map(|record| match &record.outcome {
        PushOutcome::SecretDetected { reason } => Some(reason.clone()),
        _ => None,
    });
    let accepted = records
        .iter()
        .rev()
        .filter(|record| record.outcome == PushOutcome::Accepted)
        .filter_map(|record| record.update.as_ref())
        .find(|update| update.refname == branch_ref)
        .map(|update| update.new.clone());
    // A worker that started again after the push has it in the store, not in memory.
    let branch_head = match accepted {
        Some(head) => Some(head),
        None => context.store.pushed_head(&session.id).await.ok().flatten(),
    };
    let head = branch_head
        .clone()
        .filter(|head| session.head_sha.as_deref() != Some(head.as_str()));
    let claimed = report
        .delivery
        .as_ref()
        .filter(|delivery| delivery.pushed)
        .and_then(|delivery| delivery.head_sha.clone());
    let unseen = claimed.filter(|claimed| branch_head.as_deref() != Some(claimed.as_str()));
    let failure = match (secret, unseen) {
        (Some(reason), _) => Some((
            FailureCode::SecretDetected,
            format!(
                "the gateway refused a push: {}",
                bounded(&reason, DRIVER_REASON_MAX_BYTES)
            ),
        )),
        (None, Some(claimed)) => Some((
            FailureCode::DeliveryFailed,
            format!(
                "the sandbox reports a push of {} that the git proxy never saw the repository take; nothing of it \
                 counts as delivered",
                bounded(&claimed, 64)
            ),
        )),
        (None, None) => None,
    };
    // The branch against the commit the workspace was cloned at (what `git diff <base>...sortie/<id>`
    // shows), stored for the dashboard's Files changed; the card counts the same diff, so they agree.
    let branch = match &head {
        Some(head) => {
            let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
            let start = std::fs::read_to_string(dirs.start_commit())
                .ok()
                .map(|commit| commit.trim().to_owned());
            match sortie_gateway::git::diff::branch_diff(
                &context.config.git_binary,
                &dirs.git_state.join("stat"),
                &sandbox.0.trusted_objects,
                start.as_deref().or(session.head_sha.as_deref()),
                head,
            )
            .await
            {
                Ok(diff) => Some(diff),
                Err(error) => {
                    tracing::warn!(session = %session.id, %error, "cannot read the delivered branch's diff");
                    None
                }
            }
        }
        None => None,
    };
    if let Some(diff) = &branch
        && let Err(error) = context.store.set_branch_diff(&session.id, diff).await
    {
        // The delivery stands without it: the dashboard's Files changed says the diff is not stored.
        tracing::warn!(session = %session.id, %error, "cannot store the delivered branch's diff");
    }
    let diff_stat = branch.as_ref().map_or_else(DiffStat::default, |diff| DiffStat {
        files: diff.files_changed,
        insertions: diff.insertions,
        deletions: diff.deletions,
    });
    let card_error = failure.clone().or_else(|| {
        report
            .delivery
            .as_ref()
            .and_then(|delivery| delivery.error.as_ref())
            .map(|error| {
                (
                    failure_code(error.code),
                    bounded(&error.reason, DRIVER_REASON_MAX_BYTES),
                )
            })
    });
    let card = DeliveryData {
        branch: session.id.branch(),
        pushed: head.is_some(),
        changed: head.is_some(),
        head_sha: head.clone().or(branch_head),
        baseline: session.head_sha.clone(),
        diff_stat,
        error: card_error.map(|(code, reason)| DeliveryError { code, reason }),
        pr_url: None,
    };
    Delivered { head, card, failure }
}

#[allow(clippy::too_many_arguments)]
async fn settle_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    transcript: Transcript,
    report: TurnReport,
    watched: Watched,
    mut timings: BTreeMap<String, u64>,
    started: Instant,
) -> Option<SandboxHandle> {
    let stop = context
        .store
        .turn(&session.id, n)
        .await
        .ok()
        .and_then(|row| row.stop_requested);
    let Delivered {
        head: head_sha,
        card: mut delivery,
        failure: delivery_failure,
    } = delivered(context, session, &sandbox, &report).await;
    let (mut status, mut failure) = outcome(&report, stop, &watched, delivery_failure, context.config.turn_timeout);
    // A full disk is why the agent's writes failed, whatever it said of them.
    if let Some(full) = disk_full(&sandbox.0.dirs)
        && failure
            .as_ref()
            .is_none_or(|(code, _)| matches!(code, FailureCode::AgentError | FailureCode::DeliveryFailed))
    {
        (status, failure) = (TurnStatus::Failed, Some((FailureCode::DiskQuotaExceeded, full)));
    }
    let mut delivering = watched.delivering;
    // The branch is on the remote when this turn pushed it or an earlier one did (a steer that
    // changed nothing still retries a pull request that failed to open).
    let on_remote = head_sha.is_some() || session.head_sha.is_some();
    if failure.is_none() && on_remote && session.pr.is_none() && status != TurnStatus::Canceled {
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
        match open_pull_request(context, session).await {
            pull_request::PullRequest::Failed(reason) => {
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
            pull_request::PullRequest::Opened { url, .. } => delivery.pr_url = Some(url),
            pull_request::PullRequest::NotApplicable => {}
        }
        // A cancel that came while the forge answered still cancels.
        if let Ok(row) = context.store.turn(&session.id, n).await
            && row.stop_requested == Some(StopRequest::Cancel)
        {
            (status, failure) = (TurnStatus::Canceled, None);
        }
    }
    if delivery.pr_url.is_none() {
        delivery.pr_url = session.pr.as_ref().map(|(url, _)| url.clone());
    }
    timings.insert(
        "delivery".into(),
        ms(started).saturating_sub(timings.get("agent_turn").copied().unwrap_or(0)),
    );
    let priming = report.priming.map(|rung| rung.as_str());
    record_details(context, &session.id, n, priming, &timings).await;
    sandbox.0.current.set(None);
    transcript
        .finish(Ending {
            failure: failure.clone(),
            stop_reason: report.stop_reason.clone(),
            parts: vec![SortieData::Delivery(delivery), phase_part("done", None, &timings)],
        })
        .await;
    let failed = failure.is_some();
    if watched.rejected.is_none() {
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
    if matches!(from, SessionPhase::Canceling | SessionPhase::Canceled) {
        destroy(context, &session.id, &sandbox).await;
        return None;
    }
    if let Ok(None) = context.store.settle_session(&session.id, from, failed).await
        && matches!(
            context.store.session_by_id(&session.id).await.map(|now| now.phase),
            Ok(SessionPhase::Canceling | SessionPhase::Canceled)
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

/// The driver has turn `n` under a nonce the host did not give it: the sandbox started a turn of its
/// own. Nothing of it is believed; the sandbox goes, and the turn is lost with the reason.
async fn foreign_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    transcript: Transcript,
) -> Option<SandboxHandle> {
    tracing::warn!(session = %session.id, turn = n, "the sandbox reported a turn the host did not start");
    let reason = format!(
        "the sandbox's driver holds a turn {n} that sortie did not start (another nonce), so nothing it says \
         of this turn is taken and the sandbox was destroyed"
    );
    // Its log is not harvested either: the sandbox wrote it.
    destroy(context, &session.id, &sandbox).await;
    settle_lost(context, session, n, Some(transcript), reason, false).await
}

/// The sandbox (or its driver) is gone: nothing of it may run on, the transcript is completed from
/// the driver's log, the turn is `lost` and the session `failed` with the reason.
async fn lose(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    transcript: Option<Transcript>,
    reason: String,
) -> Option<SandboxHandle> {
    tracing::warn!(session = %session.id, turn = n, %reason, "sandbox lost");
    destroy(context, &session.id, &sandbox).await;
    settle_lost(context, session, n, transcript, reason, true).await
}

async fn settle_lost(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    transcript: Option<Transcript>,
    reason: String,
    harvest: bool,
) -> Option<SandboxHandle> {
    let reason = format!("{reason}; the work of this turn was not delivered. Steer the session to run it again.");
    if let Some(transcript) = transcript {
        if harvest {
            let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
            // The sandbox is gone and its disk with it: mounted again for the log it left, then let go.
            if provision::mount_disk(context, &dirs).await.is_ok() {
                recorder::harvest(&dirs.home, &transcript).await;
            }
            unmount_disk(&dirs).await;
        }
        transcript
            .finish(Ending {
                failure: Some((FailureCode::SandboxLost, reason.clone())),
                stop_reason: None,
                parts: Vec::new(),
            })
            .await;
    }
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
        settle_or_warn(context, &session.id, from, true).await;
    }
    None
}

/// Kills every process of the sandbox, stops its proxy and forgets it; the session's directories stay.
pub(crate) async fn destroy(context: &Arc<Context>, session_id: &SessionId, sandbox: &SandboxHandle) {
    sandbox.0.current.set(None);
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
            if let Err(error) = context
                .store
                .record_compute(session_id, turn, sortie_store::now_ms(), compute_ms)
                .await
            {
                tracing::warn!(%error, session = %session_id, "cannot record the sandbox's compute");
            }
        }
        Err(error) => tracing::debug!(%error, session = %session_id, "destroy"),
    }
    if let Err(error) = context.store.delete_sandbox(session_id).await {
        tracing::warn!(%error, session = %session_id, "cannot forget the sandbox in the store");
    }
    // Both sockets are the host's, in directories only the host writes.
    let _ = std::fs::remove_file(sandbox.0.dirs.egress_socket());
    let _ = std::fs::remove_file(sandbox.0.dirs.driver_socket());
    unmount_disk(&sandbox.0.dirs).await;
}

/// Why the session's disk is full, if it is (read by the host from the filesystem itself).
fn disk_full(dirs: &SessionDirs) -> Option<String> {
    if !dirs.has_disk() {
        return None;
    }
    let usage = sortie_sandbox::local::disk::filesystem_usage(&dirs.disk).ok()?;
    usage.is_full().then(|| usage.describe())
}

/// Unmounts the session's disk once nothing of its sandbox runs (the image stays, for the next one).
async fn unmount_disk(dirs: &SessionDirs) {
    if !dirs.has_disk() {
        return;
    }
    match sortie_sandbox::local::disk::unmount(&dirs.disk).await {
        Ok(sortie_sandbox::local::disk::Unmounted::Detached) => {
            tracing::info!(disk = %dirs.disk.display(), "the session's disk was busy; detached lazily");
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(disk = %dirs.disk.display(), %error, "cannot unmount the session's disk"),
    }
}

/// Takes over the sandbox of `session` that an earlier process of this worker left running (its
/// driver answers on the host's socket): the runtime adopts it, and its egress, git and model proxies
/// are served again on its socket. Anything short of that destroys it.
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
    let current = Arc::new(CurrentTurn::default());
    let proxy = match session_upstream(context, session).await {
        Ok((upstream, _)) => provision::serve_proxy(context, session, &dirs, upstream, &current),
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
    Ok(SandboxHandle(Arc::new(HandleInner {
        name: name.to_owned(),
        dirs,
        allowlist: proxy.allowlist,
        meter: proxy.meter,
        upstream: proxy.upstream,
        current,
        pushes: proxy.pushes,
        trusted_objects: proxy.trusted_objects,
        proxy: proxy.task,
    })))
}

/// Follows a turn that was running in an adopted sandbox to its end, as if this process had started it:
/// the driver takes the same turn (and nonce) again as a no-op, the recorder goes on after the last
/// part stored.
pub(crate) async fn resume(
    context: &Arc<Context>,
    session: SessionRow,
    turn: TurnRow,
    sandbox: SandboxHandle,
) -> Option<SandboxHandle> {
    tracing::info!(session = %session.id, turn = turn.n, "took up a turn whose sandbox outlived the last process");
    run_agent_turn(context, &session, &turn, sandbox, false, BTreeMap::new()).await
}

/// Completes the transcript of a turn whose sandbox did not survive a restart of this worker, from
/// the log its driver left (checked like a live stream), and closes it with `reason`.
pub(crate) async fn close_lost_transcript(
    context: &Arc<Context>,
    session_id: &SessionId,
    n: u32,
    home: &Path,
    reason: &str,
) {
    let Ok(transcript) = Transcript::open(context.store.clone(), context.feeds.clone(), session_id, n).await else {
        return;
    };
    let dirs = SessionDirs::new(&context.config.work_dir, session_id);
    if provision::mount_disk(context, &dirs).await.is_ok() {
        recorder::harvest(home, &transcript).await;
    }
    unmount_disk(&dirs).await;
    transcript
        .finish(Ending {
            failure: Some((FailureCode::SandboxLost, reason.to_owned())),
            stop_reason: None,
            parts: Vec::new(),
        })
        .await;
}

async fn priming_context(context: &Arc<Context>, session: &SessionRow, n: u32) -> PrimingContext {
    let turns = context
        .store
        .turns(&session.workspace_id, &session.id)
        .await
        .unwrap_or_default();
    // The assistant's text of the earlier turns, newest first, read slice by slice and only as far as
    // the preamble can hold: never the whole transcript.
    let mut answers = std::collections::BTreeMap::new();
    let mut any_parts = false;
    let mut used = 0;
    for turn in turns.iter().filter(|t| t.n < n).rev() {
        if used > priming::PREAMBLE_LIMIT {
            break;
        }
        let mut text = String::new();
        let mut after = None;
        while text.len() <= priming::PREAMBLE_LIMIT {
            let limit = sortie_store::PartsLimit {
                parts: 1024,
                bytes: 4 << 20,
            };
            let Ok(slice) = context.store.turn_parts_after(&session.id, turn.n, after, limit).await else {
                break;
            };
            let Some(last) = slice.last().map(|part| part.part_index) else {
                break;
            };
            any_parts = true;
            text.push_str(&priming::assistant_text(&slice, turn.n));
            after = Some(last);
        }
        used += text.len() + turn.prompt.len();
        answers.insert(turn.n, text);
    }
    let preamble = if any_parts {
        priming::preamble_of(&turns, &answers, n, priming::PREAMBLE_LIMIT)
    } else {
        None
    };
    let task = turns.first().map(|t| t.prompt.clone());
    PrimingContext { preamble, task }
}
