//! A turn whose sandbox is gone (it exited, its driver stopped answering, or it did not outlive the
//! last process) or whose driver holds a turn the host did not start: nothing of the sandbox runs on,
//! the transcript is completed from the driver's log where the host may believe it, and the turn ends
//! `lost` with its session, in one store call.

use std::sync::Arc;

use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sortie_store::SessionRow;

use super::{SandboxHandle, destroy, end_turn, ended, sandbox};
use crate::transcript::{Ending, Transcript};
use crate::{Context, recorder};

/// The driver has turn `n` under a nonce the host did not give it: the sandbox started a turn of its
/// own. Nothing of it is believed; the sandbox goes, and the turn is lost with the reason.
pub(super) async fn foreign_turn(
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
    settle_lost(context, &session.id, n, Some(transcript), undelivered(&reason), false).await;
    None
}

/// The sandbox (or its driver) is gone: nothing of it may run on, the transcript is completed from
/// the driver's log, the turn is `lost` and the session `failed` with the reason.
pub(super) async fn lose(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    transcript: Option<Transcript>,
    reason: String,
) -> Option<SandboxHandle> {
    tracing::warn!(session = %session.id, turn = n, %reason, "sandbox lost");
    destroy(context, &session.id, &sandbox).await;
    settle_lost(context, &session.id, n, transcript, undelivered(&reason), true).await;
    None
}

fn undelivered(reason: &str) -> String {
    format!("{reason}; the work of this turn was not delivered. Steer the session to run it again.")
}

/// Closes a lost turn's transcript with `reason` (completed from the log its driver left when
/// `harvest`), then ends the turn `lost` and settles its session in one store call. Used when a
/// sandbox dies under a running turn and, at start, for a turn whose sandbox did not outlive the
/// last process.
async fn settle_lost(
    context: &Arc<Context>,
    session_id: &SessionId,
    n: u32,
    transcript: Option<Transcript>,
    reason: String,
    harvest: bool,
) -> Option<SessionPhase> {
    if let Some(transcript) = transcript {
        if harvest {
            harvest_log(context, session_id, &transcript).await;
        }
        transcript
            .finish(Ending {
                failure: Some((FailureCode::SandboxLost, reason.clone())),
                stop_reason: None,
                parts: Vec::new(),
            })
            .await;
    }
    let lost = ended(TurnStatus::Lost, Some((FailureCode::SandboxLost, reason)));
    end_turn(context, session_id, n, lost).await
}

/// Completes `transcript` from the log the driver left in `home`, checked like a live stream: the
/// sandbox is gone and its disk with it, so the disk is mounted again for the log, then let go.
async fn harvest_log(context: &Arc<Context>, session_id: &SessionId, transcript: &Transcript) {
    let dirs = crate::prepare::SessionDirs::new(&context.config.work_dir, session_id);
    if sandbox::mount_disk(context, &dirs).await.is_ok() {
        recorder::harvest(&dirs.home, transcript).await;
    }
    sandbox::unmount_disk(&dirs).await;
}

/// Ends turn `n`, whose sandbox did not survive a restart of this worker, `lost` with `reason`: its
/// transcript completed from the log its driver left, then the turn and its session in one store call.
pub(crate) async fn end_lost_turn(
    context: &Arc<Context>,
    session_id: &SessionId,
    n: u32,
    reason: &str,
) -> Option<SessionPhase> {
    let transcript = Transcript::open(context.store.clone(), context.feeds.clone(), session_id, n)
        .await
        .ok();
    settle_lost(context, session_id, n, transcript, reason.to_owned(), true).await
}
