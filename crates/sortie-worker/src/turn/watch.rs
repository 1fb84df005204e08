//! Watching a running turn: a pure state machine ([`TurnWatch::step`]) that takes what the host
//! observes ([`TurnEvent`]) and says what to do ([`TurnAction`]), driven by a thin loop ([`watch`])
//! that makes the observations and carries the actions out.
//!
//! The host's clock decides when a turn has run too long, the host's transcript when it has grown
//! too large, the model proxy when the vendor refused the key; the driver's answers only say how far
//! the agent is, and a driver that stops answering loses the turn (DESIGN §9 invariant 9).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_protocol::driver::{TurnReport, TurnState};
use sortie_protocol::sortie_data::{BudgetData, PrimingData, SortieData};
use sortie_protocol::{FailureCode, SessionPhase, TurnStatus};
use sortie_sandbox::SandboxStatus;
use sortie_store::{SessionRow, TurnOutcome};

use super::settle::Seen;
use super::{DRIVER_REASON_MAX_BYTES, Failure, SandboxHandle, bounded, phase_part};
use crate::client::DriverClient;
use crate::transcript::Transcript;
use crate::{Context, recorder};

/// How often a running turn's stop request and driver are checked.
pub(super) const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// How long past the turn timeout the host waits (cancel, kill, delivery) before it gives up on the driver.
pub(super) const DRIVER_GRACE: Duration = Duration::from_secs(180);
/// A driver that does not answer this long while its turn runs is lost.
pub(super) const UNREACHABLE_LIMIT: Duration = Duration::from_secs(3);
/// A stop request is passed on to the driver again after this long without the turn ending.
pub(super) const CANCEL_REPEAT: Duration = Duration::from_secs(2);
/// A recorder whose subscription breaks more often while the driver lives loses the turn.
pub(super) const BREAKS_MAX: u32 = 20;

/// What the host observed of a running turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum TurnEvent {
    /// The watch interval passed; the host's clock reads `now`.
    Tick { now: Instant },
    /// The transcript passed a cap, for this reason.
    TranscriptLimit(String),
    /// The vendor refused the workspace's key, for this reason.
    VendorRejected(String),
    /// The session reached its budget for good (tokens: nobody raised it in time; compute: at the cap).
    BudgetExceeded(String),
    /// A user asked the turn to stop (stop, interrupt or cancel).
    StopRequested,
    /// The driver answered for the turn: whether under the host's nonce, and how far it is.
    DriverReport { ours: bool, state: TurnState, primed: bool },
    /// The driver did not answer; whether the sandbox has exited.
    DriverSilent { sandbox_exited: bool },
    /// The recorder took the turn's whole stream: the agent's turn is over.
    RecorderFinished,
    /// The recorder's subscription broke; whether the driver still answers.
    RecorderBroke { driver_alive: bool },
}

/// What the loop does about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum TurnAction {
    /// Ask the driver to cancel the turn.
    Cancel,
    /// End the turn failed now, before its settlement (the user waits on no agent).
    FailNow(Failure),
    /// Write the driver's priming rung into the transcript (once).
    NotePriming,
    /// The driver delivers: say so in the transcript and the session's phase (once).
    MarkDelivering,
    /// Subscribe to the driver's stream again after the last part taken.
    FollowAgain,
    /// The turn is over: settle it.
    Settle,
    /// The driver holds the turn under another nonce: nothing of it is believed.
    Foreign,
    /// The sandbox or its driver is gone.
    Lose(Loss),
}

/// Why a watched turn is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Loss {
    /// The driver did not end the turn within the timeout and its grace.
    GaveUp,
    /// The sandbox exited or its driver stopped answering.
    SandboxGone,
    /// The driver's stream kept breaking while the driver lived.
    StreamKeptBreaking,
}

/// The state of one watched turn.
#[derive(Debug)]
pub(super) struct TurnWatch {
    now: Instant,
    timeout_at: Instant,
    give_up_at: Instant,
    cancel_sent: Option<Instant>,
    unreachable_since: Option<Instant>,
    breaks: u32,
    primed: bool,
    pub seen: Seen,
}

impl TurnWatch {
    /// A turn started at `started` that may run `timeout` by the host's clock.
    pub fn new(started: Instant, timeout: Duration) -> Self {
        let timeout_at = started + timeout;
        Self {
            now: started,
            timeout_at,
            give_up_at: timeout_at + DRIVER_GRACE,
            cancel_sent: None,
            unreachable_since: None,
            breaks: 0,
            primed: false,
            seen: Seen::default(),
        }
    }

    fn cancel(&mut self) -> TurnAction {
        self.cancel_sent = Some(self.now);
        TurnAction::Cancel
    }

    /// What to do about `event`; pure but for the watch's own state.
    pub fn step(&mut self, event: TurnEvent) -> Vec<TurnAction> {
        match event {
            TurnEvent::Tick { now } => {
                self.now = now;
                if now >= self.give_up_at {
                    return vec![TurnAction::Lose(Loss::GaveUp)];
                }
                if !self.seen.timed_out && now >= self.timeout_at {
                    self.seen.timed_out = true;
                    return vec![self.cancel()];
                }
                Vec::new()
            }
            TurnEvent::TranscriptLimit(reason) if self.seen.limited.is_none() => {
                self.seen.limited = Some(reason);
                vec![self.cancel()]
            }
            TurnEvent::VendorRejected(reason) if self.seen.rejected.is_none() => {
                self.seen.rejected = Some(reason.clone());
                vec![
                    TurnAction::FailNow((FailureCode::VendorAuthRejected, reason)),
                    self.cancel(),
                ]
            }
            TurnEvent::BudgetExceeded(reason) if self.seen.over_budget.is_none() => {
                self.seen.over_budget = Some(reason);
                vec![self.cancel()]
            }
            TurnEvent::TranscriptLimit(_) | TurnEvent::VendorRejected(_) | TurnEvent::BudgetExceeded(_) => Vec::new(),
            TurnEvent::StopRequested => {
                let due = self
                    .cancel_sent
                    .is_none_or(|sent| self.now.saturating_duration_since(sent) >= CANCEL_REPEAT);
                if due { vec![self.cancel()] } else { Vec::new() }
            }
            TurnEvent::DriverReport { ours: false, .. } => vec![TurnAction::Foreign],
            TurnEvent::DriverReport { state, primed, .. } => {
                self.unreachable_since = None;
                let mut actions = Vec::new();
                if primed && !self.primed {
                    self.primed = true;
                    actions.push(TurnAction::NotePriming);
                }
                if state == TurnState::Delivering && !self.seen.delivering {
                    self.seen.delivering = true;
                    actions.push(TurnAction::MarkDelivering);
                }
                actions
            }
            TurnEvent::DriverSilent { sandbox_exited } => {
                let since = *self.unreachable_since.get_or_insert(self.now);
                if sandbox_exited || self.now.saturating_duration_since(since) >= UNREACHABLE_LIMIT {
                    vec![TurnAction::Lose(Loss::SandboxGone)]
                } else {
                    Vec::new()
                }
            }
            TurnEvent::RecorderFinished => vec![TurnAction::Settle],
            TurnEvent::RecorderBroke { driver_alive: false } => vec![TurnAction::Lose(Loss::SandboxGone)],
            TurnEvent::RecorderBroke { driver_alive: true } => {
                self.breaks += 1;
                self.unreachable_since = None;
                if self.breaks > BREAKS_MAX {
                    vec![TurnAction::Lose(Loss::StreamKeptBreaking)]
                } else {
                    vec![TurnAction::FollowAgain]
                }
            }
        }
    }
}

/// How a watched turn ended.
pub(super) enum Watched {
    /// The agent's turn is over and its stream recorded: settle it.
    Over,
    /// The driver holds the turn under another nonce.
    Foreign,
    /// The sandbox or its driver is gone, for this reason.
    Lost(String),
}

/// What the loop needs of the turn it watches.
pub(super) struct Watching<'a> {
    pub context: &'a Arc<Context>,
    pub session: &'a SessionRow,
    pub n: u32,
    pub nonce: &'a str,
    pub sandbox: &'a SandboxHandle,
    pub transcript: &'a Transcript,
    /// The turn's timings so far, for the phase parts written meanwhile.
    pub timings: BTreeMap<String, u64>,
    /// The session's compute cap, when it has one.
    pub compute_cap: Option<ComputeCap>,
}

/// A session's compute cap as a turn watches it: the CPU its sandboxes used before the turn, and the
/// sandbox's cgroup reading when the turn began.
pub(super) struct ComputeCap {
    pub limit_ms: u64,
    pub used_before_ms: u64,
    pub reading_at_start_ms: u64,
    pub noted: std::sync::atomic::AtomicBool,
}

/// Follows the turn's stream into its transcript until the turn is over, observing it every
/// [`WATCH_INTERVAL`] for `watch` and carrying out what it says.
pub(super) async fn watch(on: &Watching<'_>, watch: &mut TurnWatch) -> Watched {
    let driver = on.sandbox.driver();
    let mut report: Option<TurnReport> = None;
    loop {
        let recording = {
            let (driver, transcript, n) = (driver.clone(), on.transcript.clone(), on.n);
            tokio::spawn(async move { recorder::follow(&driver, n, &transcript).await })
        };
        tokio::pin!(recording);
        let ended = 'round: loop {
            let first = tokio::select! {
                done = &mut recording => if done.unwrap_or_default().complete {
                    TurnEvent::RecorderFinished
                } else {
                    TurnEvent::RecorderBroke { driver_alive: driver.status().await.is_ok() }
                },
                () = tokio::time::sleep(WATCH_INTERVAL) => TurnEvent::Tick { now: Instant::now() },
            };
            // A round's tick is followed by the host's own observations, then (after any cancel they
            // caused reached it) the driver's answer.
            let mut ask_driver = matches!(first, TurnEvent::Tick { .. });
            let mut events = vec![first];
            if ask_driver {
                events.extend(observe(on).await);
            }
            events.reverse();
            let mut canceled = false;
            loop {
                let event = match events.pop() {
                    Some(event) => event,
                    None if ask_driver => {
                        ask_driver = false;
                        ask(on, &driver, &mut report).await
                    }
                    None => continue 'round,
                };
                for action in watch.step(event) {
                    if let Some(ended) = act(on, &driver, action, report.as_ref(), &mut canceled).await {
                        break 'round ended;
                    }
                }
            }
        };
        match ended {
            Some(watched) => {
                recording.abort();
                return watched;
            }
            None => tokio::time::sleep(WATCH_INTERVAL).await,
        }
    }
}

/// Takes the driver's last report of a finished turn the way the watch took the others (what it says
/// of its priming and its delivery, once each).
pub(super) async fn note_final(on: &Watching<'_>, watch: &mut TurnWatch, report: &TurnReport) {
    let driver = on.sandbox.driver();
    let event = TurnEvent::DriverReport {
        ours: true,
        state: report.state,
        primed: report.priming.is_some(),
    };
    // No cancel is sent for a turn that is over.
    let mut canceled = true;
    for action in watch.step(event) {
        act(on, &driver, action, Some(report), &mut canceled).await;
    }
}

/// The driver's answer for the turn, kept in `report` when it gives one.
async fn ask(on: &Watching<'_>, driver: &DriverClient, report: &mut Option<TurnReport>) -> TurnEvent {
    match driver.report(on.n).await {
        Ok(answer) => {
            let event = TurnEvent::DriverReport {
                ours: answer.nonce == on.nonce,
                state: answer.state,
                primed: answer.priming.is_some(),
            };
            *report = Some(answer);
            event
        }
        Err(_) => TurnEvent::DriverSilent {
            sandbox_exited: matches!(
                on.context.runtime.status(on.sandbox.name()).await,
                Ok(SandboxStatus::Exited(_)) | Err(_)
            ),
        },
    }
}

/// What the host reads of its own each round: the transcript's caps, the model proxy's record of a
/// vendor's refusal, the stop request in the store.
async fn observe(on: &Watching<'_>) -> Vec<TurnEvent> {
    let mut events = Vec::new();
    if let Some(reason) = on.transcript.limit_reached() {
        events.push(TurnEvent::TranscriptLimit(reason));
    }
    if let Some(rejection) = on.sandbox.0.proxy.meter.take_rejection() {
        events.push(TurnEvent::VendorRejected(rejection.reason));
    }
    if let Some(reason) = on.sandbox.0.proxy.meter.take_over_budget() {
        events.push(TurnEvent::BudgetExceeded(reason));
    }
    if let Some(cap) = &on.compute_cap
        && let Ok(usage) = on.context.runtime.usage(on.sandbox.name()).await
    {
        let reading = (usage.cpu_seconds * 1000.0) as u64;
        let used = cap.used_before_ms + reading.saturating_sub(cap.reading_at_start_ms);
        if used >= cap.limit_ms {
            let (spent, limit) = (used / 1000, cap.limit_ms / 1000);
            let reason = format!(
                "the session used {spent} of its {limit} CPU seconds: the turn was stopped; raise the budget \
                 (sortie budget {} --compute-seconds N) and steer the session to go on",
                on.session.id
            );
            if !cap.noted.swap(true, std::sync::atomic::Ordering::AcqRel) {
                metrics::counter!("sortie_budget_pauses_total").increment(1);
                on.transcript.host(SortieData::Budget(BudgetData {
                    state: "exceeded".to_owned(),
                    kind: "compute_seconds".to_owned(),
                    spent,
                    limit,
                    how: "The session reached its compute budget: the turn stops and its work is delivered. Raise \
                          the budget and steer the session to go on."
                        .to_owned(),
                }));
            }
            events.push(TurnEvent::BudgetExceeded(reason));
        }
    }
    if let Ok(row) = on.context.store.turn(&on.session.id, on.n).await
        && row.stop_requested.is_some()
    {
        events.push(TurnEvent::StopRequested);
    }
    events
}

/// Carries out one action: `Some(Some(end))` ends the watch, `Some(None)` follows the stream again.
async fn act(
    on: &Watching<'_>,
    driver: &DriverClient,
    action: TurnAction,
    report: Option<&TurnReport>,
    canceled: &mut bool,
) -> Option<Option<Watched>> {
    match action {
        TurnAction::Cancel if !*canceled => {
            *canceled = true;
            if let Err(error) = driver.cancel(on.n).await {
                tracing::debug!(%error, turn = on.n, "cancel");
            }
        }
        TurnAction::Cancel => {}
        TurnAction::FailNow(failure) => {
            let outcome = TurnOutcome {
                status: TurnStatus::Failed,
                head_sha: None,
                failure: Some(failure),
            };
            // The settlement's `end_turn` ends the turn again with the same failure and settles the
            // session; if this write is lost, that one is the turn's end.
            if let Err(error) = on.context.store.finish_turn(&on.session.id, on.n, outcome).await {
                tracing::warn!(%error, session = %on.session.id, turn = on.n, "cannot fail the turn early");
            }
        }
        TurnAction::NotePriming => {
            if let Some(rung) = report.and_then(|report| report.priming) {
                on.transcript.host(SortieData::Priming(PrimingData {
                    rung,
                    load_error: report
                        .and_then(|report| report.load_error.as_deref())
                        .map(|error| bounded(error, DRIVER_REASON_MAX_BYTES)),
                }));
            }
        }
        TurnAction::MarkDelivering => {
            // A session that is no longer running (a cancel came) keeps its phase: `end_turn` settles
            // from either.
            if let Err(error) = on
                .context
                .store
                .transition_session(&on.session.id, SessionPhase::Running, SessionPhase::Delivering)
                .await
            {
                tracing::warn!(%error, session = %on.session.id, "cannot mark the session delivering");
            }
            on.transcript.host(phase_part("delivering", None, &on.timings));
        }
        TurnAction::FollowAgain => return Some(None),
        TurnAction::Settle => return Some(Some(Watched::Over)),
        TurnAction::Foreign => return Some(Some(Watched::Foreign)),
        TurnAction::Lose(loss) => {
            let reason = match loss {
                Loss::GaveUp => "the driver did not end the turn within the turn timeout and its grace".to_owned(),
                Loss::StreamKeptBreaking => "the driver's stream kept breaking".to_owned(),
                Loss::SandboxGone => super::sandbox_gone_reason(on.context, on.sandbox).await,
            };
            return Some(Some(Watched::Lost(reason)));
        }
    }
    None
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
