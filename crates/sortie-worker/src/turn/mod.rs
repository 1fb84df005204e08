//! One turn of one session, as a task: provision a sandbox when none is warm ([`provision`]), start
//! the agent's turn with a nonce of the host's, watch it into the host's own transcript ([`watch`]),
//! and settle it ([`settle`], [`deliver`]) with one store call that ends the turn and moves its
//! session (`end_turn`), from what the host established itself.
//!
//! The sandbox's side is untrusted (DESIGN §9 invariant 9): the driver's stream passes through
//! [`Transcript`]'s checks, the turn's timings are measured here, a turn the host did not start is
//! refused, and nothing a turn started inside the sandbox outlives it.

mod deliver;
mod lost;
mod pod;
mod provision;
mod proxy;
mod sandbox;
mod settle;
mod watch;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_protocol::driver::{DriverErrorCode, StartTurn};
use sortie_protocol::sortie_data::{PhaseData, SortieData};
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sortie_sandbox::SandboxStatus;
use sortie_store::{SessionRow, TurnOutcome, TurnRow};

pub(crate) use self::lost::end_lost_turn;
use self::lost::{foreign_turn, lose};
pub(crate) use self::pod::keep_home;
pub(crate) use self::provision::{DriverCommand, await_driver, driver_command, make_host_dir};
pub use self::sandbox::SandboxHandle;
pub(crate) use self::sandbox::{adopt, destroy, destroy_named};
use self::watch::{TurnWatch, Watched, Watching};
use crate::transcript::{Ending, Transcript};
use crate::{Context, priming};

/// The longest reason of the driver's that the host keeps (its words, shown to users as its).
const DRIVER_REASON_MAX_BYTES: usize = 4096;

type Failure = (FailureCode, String);

fn ms(since: Instant) -> u64 {
    millis(since.elapsed())
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

fn start_failed(what: impl std::fmt::Display) -> Failure {
    (FailureCode::SandboxStartFailed, what.to_string())
}

fn phase_part(phase: &str, note: Option<String>, timings: &BTreeMap<String, u64>) -> SortieData {
    SortieData::Phase(PhaseData {
        phase: phase.to_owned(),
        note,
        timings: timings.clone(),
    })
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
        None => match provisioned(context, &session, &mut timings).await {
            Ok(sandbox) => sandbox,
            Err(failure) => {
                tracing::warn!(session = %session.id, reason = %failure.1, "provisioning failed");
                match &turn {
                    Some(turn) => {
                        record_details(context, &session.id, turn.n, None, &timings).await;
                        fail_unstarted(context, &session.id, turn.n, failure).await;
                    }
                    None => fail_resume(context, &session.id).await,
                }
                return None;
            }
        },
    };
    let Some(turn) = turn else {
        // A resume without a prompt: the sandbox is up and waits warm, unless the session was
        // canceled meanwhile.
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
        end_turn(context, &session.id, turn.n, ended(TurnStatus::Canceled, None)).await;
        return None;
    }
    run_agent_turn(context, &session, &turn, sandbox, fresh, timings).await
}

/// A new sandbox for the session: a claimed pod, or a local one.
async fn provisioned(
    context: &Arc<Context>,
    session: &SessionRow,
    timings: &mut BTreeMap<String, u64>,
) -> Result<SandboxHandle, Failure> {
    let clock = Instant::now();
    let provisioned = match &context.pods {
        Some(pods) => pod::provision(context, pods, session, timings).await,
        None => provision::provision(context, session, timings).await,
    };
    if provisioned.is_ok() {
        for phase in PROVISION_PHASES {
            if let Some(ms) = timings.get(phase) {
                metrics::histogram!("sortie_provision_seconds", "phase" => phase).record(*ms as f64 / 1000.0);
            }
        }
        metrics::histogram!("sortie_provision_seconds", "phase" => "total").record(clock.elapsed().as_secs_f64());
    }
    provisioned
}

/// The phases of making a session's sandbox, as its turn's timings name them (and the wait before).
const PROVISION_PHASES: [&str; 6] = ["queued", "clone", "primed_clone", "sandbox", "warm_sandbox", "setup"];

/// What a driver awaiting its session is told of `session` (a pod's, with its checkout; a warm
/// sandbox's, with where its secret digests are): the same session, agent, branch and deadline.
pub(crate) fn assignment(
    config: &crate::WorkerConfig,
    session: &SessionRow,
    checkout: Option<sortie_protocol::driver::Checkout>,
    secret_digests: Option<String>,
) -> sortie_protocol::driver::Assignment {
    sortie_protocol::driver::Assignment {
        session: session.id.to_string(),
        agent: session.agent.clone(),
        model: session.model.clone(),
        model_proxy: None,
        branch: Some(session.id.branch()),
        remote: Some("origin".into()),
        turn_timeout_secs: Some(config.turn_timeout.as_secs().max(1)),
        checkout,
        secret_digests,
    }
}

/// Ends a resume without a prompt whose sandbox could not be made (no turn to end): the session fails.
async fn fail_resume(context: &Arc<Context>, session_id: &SessionId) {
    if let Err(error) = context
        .store
        .settle_session(session_id, SessionPhase::Provisioning, true)
        .await
    {
        tracing::warn!(%error, session = %session_id, "cannot settle the session");
    }
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

fn ended(status: TurnStatus, failure: Option<Failure>) -> TurnOutcome {
    TurnOutcome {
        status,
        head_sha: None,
        failure,
    }
}

/// Ends turn `n` and moves its session, in one store call; the session's phase after it, `None` when
/// the store did not answer (the turn then stays running for the next start's reconciliation).
async fn end_turn(context: &Arc<Context>, session_id: &SessionId, n: u32, ending: TurnOutcome) -> Option<SessionPhase> {
    let outcome = ending.status.as_str();
    match context.store.end_turn(session_id, n, ending).await {
        Ok(phase) => {
            metrics::counter!("sortie_turns_total", "outcome" => outcome).increment(1);
            // The store's clock, the one that stamped its start.
            if let Ok(turn) = context.store.turn(session_id, n).await
                && let (Some(started), Some(ended)) = (turn.started_at, turn.completed_at)
            {
                let seconds = (ended - started).max(0) as f64 / 1000.0;
                metrics::histogram!("sortie_turn_duration_seconds", "outcome" => outcome).record(seconds);
            }
            Some(phase)
        }
        Err(error) => {
            tracing::warn!(%error, session = %session_id, turn = n, "cannot record the turn's end");
            None
        }
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
    end_turn(context, session_id, n, ended(TurnStatus::Failed, Some(failure))).await;
}

/// A fresh nonce for a turn: 128 random bits, hex.
fn new_nonce() -> Result<String, getrandom::Error> {
    let mut bytes = [0_u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A turn's git (a fetch, its delivery's push) starts from a launcher parked in the session's cgroup
/// ahead; a resting session holds none.
async fn run_agent_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    turn: &TurnRow,
    sandbox: SandboxHandle,
    fresh: bool,
    timings: BTreeMap<String, u64>,
) -> Option<SandboxHandle> {
    sandbox.0.proxy.git_children.park();
    let kept = agent_turn(context, session, turn, sandbox, fresh, timings).await;
    if let Some(sandbox) = &kept {
        sandbox.0.proxy.git_children.unpark();
    }
    kept
}

async fn agent_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    turn: &TurnRow,
    sandbox: SandboxHandle,
    fresh: bool,
    mut timings: BTreeMap<String, u64>,
) -> Option<SandboxHandle> {
    let driver = sandbox.driver();
    let n = turn.n;
    // A refusal the vendor sent, or a push decided, after the last turn ended belongs to no turn:
    // both are taken and dropped.
    let _ = sandbox.0.proxy.meter.take_rejection();
    sandbox.0.proxy.meter.new_turn();
    let _ = sandbox.0.proxy.pushes.take();
    if !fresh {
        proxy::refresh_warm_sandbox(context, session, &sandbox).await;
    }
    let transcript = match Transcript::open(context.store.clone(), context.feeds.clone(), &session.id, n).await {
        Ok(transcript) => transcript,
        Err(error) => {
            let why = format!("the store did not answer ({error})");
            return lose(context, session, n, sandbox, None, why).await;
        }
    };
    sandbox.0.current.set(Some(transcript.clone()));
    transcript.host(phase_part("running", None, &timings));

    let nonce = match &turn.driver_nonce {
        // A worker that started again follows the turn it had started (`resume`).
        Some(nonce) => nonce.clone(),
        None => {
            let Ok(nonce) = new_nonce() else {
                let why = "no randomness for the turn's nonce".to_owned();
                return lose(context, session, n, sandbox, Some(transcript), why).await;
            };
            if let Err(error) = context.store.set_driver_nonce(&session.id, n, &nonce).await {
                let why = format!("the store did not answer ({error})");
                return lose(context, session, n, sandbox, Some(transcript), why).await;
            }
            nonce
        }
    };
    // What runs in the sandbox before the turn may go on after it (the driver, a setup script's
    // service); whatever the turn starts may not (DESIGN §9, S12).
    let before = context.runtime.processes(sandbox.name()).await.unwrap_or_default();
    // A pod's processes cannot be told apart from outside it: its way out is open only while a turn runs.
    if let Some(pods) = &context.pods {
        pods.set_egress(sandbox.name(), true);
    }
    // A cap needs a reading to count from; a sandbox whose cgroup cannot be read is not capped
    // (what it uses is metered when it can be).
    let compute_cap = match session.budget_compute_ms {
        Some(limit_ms) => match context.runtime.usage(sandbox.name()).await {
            Ok(reading) => Some(watch::ComputeCap {
                limit_ms,
                used_before_ms: session.compute_ms,
                reading_at_start_ms: (reading.cpu_seconds * 1000.0) as u64,
                noted: Default::default(),
            }),
            Err(error) => {
                tracing::warn!(%error, session = %session.id, "cannot read the sandbox's usage: its compute cap is not watched");
                None
            }
        },
        None => None,
    };
    let started = Instant::now();
    let priming_context = if n > 1 {
        Some(priming::context_for(context.store.as_ref(), session, n).await)
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
            let why = format!("the driver did not take the turn: {error}");
            return lose(context, session, n, sandbox, Some(transcript), why).await;
        }
    }

    let mut watching = TurnWatch::new(started, context.config.turn_timeout);
    let mut on = Watching {
        context,
        session,
        n,
        nonce: &nonce,
        sandbox: &sandbox,
        transcript: &transcript,
        timings: timings.clone(),
        compute_cap,
    };
    match watch::watch(&on, &mut watching).await {
        Watched::Over => {}
        Watched::Foreign => return foreign_turn(context, session, n, sandbox, transcript).await,
        Watched::Lost(why) => return lose(context, session, n, sandbox, Some(transcript), why).await,
    }

    let report = match driver.report(n).await {
        Ok(report) if report.nonce == nonce => report,
        Ok(_) => return foreign_turn(context, session, n, sandbox, transcript).await,
        Err(_) => {
            let why = "the driver forgot the turn".to_owned();
            return lose(context, session, n, sandbox, Some(transcript), why).await;
        }
    };
    if let Some(first) = transcript.first_agent_part() {
        timings.insert("first_part".into(), millis(first.saturating_duration_since(started)));
    }
    timings.insert("agent_turn".into(), ms(started));
    // Nothing the turn started in the sandbox outlives it: the agent, a `setsid` child of it (in a
    // pod: nothing it left running has a way out).
    if let Some(pods) = &context.pods {
        pods.set_egress(sandbox.name(), false);
    }
    match context.runtime.kill_newer(sandbox.name(), &before).await {
        Ok(0) => {}
        Ok(killed) => tracing::info!(session = %session.id, turn = n, killed, "killed what the turn left running"),
        Err(error) => {
            let why = format!("what the turn started in the sandbox could not be stopped ({error})");
            return lose(context, session, n, sandbox, Some(transcript), why).await;
        }
    }
    // The last report may say what the watch did not see yet (its priming, that it delivered).
    on.timings = timings.clone();
    watch::note_final(&on, &mut watching, &report).await;
    let seen = watching.seen;
    deliver::settle_turn(context, session, n, sandbox, transcript, report, seen, timings, started).await
}

/// How long a lost turn in a pod waits for the cluster to say why (its link breaks a moment before the
/// controller marks the claim).
const POD_VERDICT_WAIT: Duration = Duration::from_secs(5);

async fn sandbox_gone_reason(context: &Arc<Context>, sandbox: &SandboxHandle) -> String {
    let wait = if context.pods.is_some() {
        POD_VERDICT_WAIT
    } else {
        Duration::ZERO
    };
    let deadline = Instant::now() + wait;
    loop {
        if let Ok(SandboxStatus::Exited(exit)) = context.runtime.status(sandbox.name()).await {
            return if exit.out_of_memory {
                exit.describe()
            } else {
                format!("the sandbox's driver {}", exit.describe())
            };
        }
        if Instant::now() >= deadline {
            return "the driver stopped answering".to_owned();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
