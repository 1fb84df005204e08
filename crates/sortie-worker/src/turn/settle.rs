//! How a turn ends, decided from what the host established first (a vendor's refusal, its own clock,
//! the transcript's caps, the git proxy's record of pushes, the session's disk), then the driver's
//! report and the user's stop request: pure functions, table-tested, whose [`TurnOutcome`] the turn
//! ends with in one store call (`end_turn`).

use std::time::Duration;

use sortie_protocol::driver::{DriverFailureCode, TurnReport, TurnState};
use sortie_protocol::{FailureCode, SessionId, TurnStatus};
use sortie_store::{StopRequest, TurnOutcome};

use super::{DRIVER_REASON_MAX_BYTES, Failure, bounded};
use crate::pull_request::PullRequest;

/// The session's failure code for a failure the driver reports. The codes the host establishes
/// itself (a vendor's refusal, its own timeout, a transcript cap, a lost sandbox) never come from here.
pub(super) fn failure_code(code: DriverFailureCode) -> FailureCode {
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

/// What the host saw of a turn while it watched it, for its settlement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// The host's own clock ran past the turn timeout; the turn was canceled.
    pub timed_out: bool,
    /// The transcript passed a cap; the turn was stopped.
    pub limited: Option<String>,
    /// The vendor refused the workspace's key (the turn was failed at once).
    pub rejected: Option<String>,
    /// The session reached its budget and nobody raised it in time; the turn was stopped.
    pub over_budget: Option<String>,
    /// The driver said it delivers (the session was moved to `delivering` then).
    pub delivering: bool,
}

/// What the host established of a turn when its agent's turn was over.
pub(super) struct Established {
    /// What the watch saw.
    pub seen: Seen,
    /// A delivery failure the host established (a push refused for a secret, one the upstream never took).
    pub delivery_failure: Option<Failure>,
    /// The session's disk is full: why.
    pub disk_full: Option<String>,
    /// The branch's new head, when the upstream took a push of it in this turn.
    pub head: Option<String>,
    pub turn_timeout: Duration,
}

/// The turn's ending from the host's own observations first, then the driver's report and the stop request.
pub(super) fn ending(report: &TurnReport, stop: Option<StopRequest>, host: Established) -> TurnOutcome {
    let driver_failure = report
        .failure
        .as_ref()
        .filter(|f| f.code != DriverFailureCode::Canceled)
        .or_else(|| report.delivery.as_ref().and_then(|d| d.error.as_ref()))
        .map(|f| (failure_code(f.code), bounded(&f.reason, DRIVER_REASON_MAX_BYTES)));
    let mut failure = if let Some(reason) = host.seen.rejected {
        Some((FailureCode::VendorAuthRejected, reason))
    } else if host.seen.timed_out {
        Some((
            FailureCode::TurnTimeout,
            format!(
                "the turn ran past its limit of {}s; the agent was stopped",
                host.turn_timeout.as_secs()
            ),
        ))
    } else if let Some(reason) = host.seen.over_budget {
        Some((FailureCode::BudgetExceeded, reason))
    } else if let Some(reason) = host.seen.limited {
        Some((FailureCode::AgentError, reason))
    } else if host.delivery_failure.is_some() {
        host.delivery_failure
    } else {
        driver_failure
    };
    // A full disk is why the agent's writes failed, whatever it said of them.
    if let Some(full) = host.disk_full
        && failure
            .as_ref()
            .is_none_or(|(code, _)| matches!(code, FailureCode::AgentError | FailureCode::DeliveryFailed))
    {
        failure = Some((FailureCode::DiskQuotaExceeded, full));
    }
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
    TurnOutcome {
        status,
        head_sha: host.head,
        failure,
    }
}

/// Whether the turn opens the session's draft pull request: it went well, the branch is on the remote
/// (this turn pushed it or an earlier one did: a steer that changed nothing still retries a pull
/// request that failed to open), and the session has none.
pub(super) fn opens_pull_request(ending: &TurnOutcome, on_remote: bool, has_pull_request: bool) -> bool {
    ending.failure.is_none() && on_remote && !has_pull_request && ending.status != TurnStatus::Canceled
}

/// The ending once the forge answered: a pull request that could not be opened fails the turn (the
/// branch stands), and a cancel that came while the forge answered still cancels.
pub(super) fn after_pull_request(
    mut ending: TurnOutcome,
    opened: &PullRequest,
    session_id: &SessionId,
    stop_now: Option<StopRequest>,
) -> TurnOutcome {
    if let PullRequest::Failed(reason) = opened {
        ending.status = TurnStatus::Failed;
        ending.failure = Some((
            FailureCode::PrOpenFailed,
            format!(
                "{reason}. The work is on the branch sortie/{session_id}; steer the session to open the pull \
                 request again."
            ),
        ));
    }
    if stop_now == Some(StopRequest::Cancel) {
        ending.status = TurnStatus::Canceled;
        ending.failure = None;
    }
    ending
}

#[cfg(test)]
#[path = "settle_tests.rs"]
mod tests;
