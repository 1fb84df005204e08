//! What a turn delivered, as the host knows it: the git proxy's own record of the pushes it forwarded
//! and what the upstream answered (DESIGN §9 invariant 9), the branch's diff read from trusted objects,
//! the draft pull request opened after the first delivery, and the settlement that ends the turn.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_gateway::git::config::PushOutcome;
use sortie_protocol::api::StoredDiff;
use sortie_protocol::driver::TurnReport;
use sortie_protocol::sortie_data::{DeliveryData, DeliveryError, DiffStat, SortieData};
use sortie_protocol::{FailureCode, SessionPhase, TurnStatus};
use sortie_store::{SessionRow, StopRequest};

use super::sandbox::{destroy, disk_full, meter_turn};
use super::settle::Seen;
use super::settle::{self, Established, failure_code};
use super::{DRIVER_REASON_MAX_BYTES, Failure, SandboxHandle, bounded, end_turn, ms, phase_part, record_details};
use crate::Context;
use crate::prepare::{self, SessionDirs};
use crate::pull_request::{self, PullRequest};
use crate::transcript::{Ending, Transcript};

/// Settles a turn whose agent's turn is over: what it delivered, its ending (see [`settle`]), the
/// draft pull request, the transcript's closing parts, then the turn and its session in one store call.
/// Returns the sandbox to keep warm.
#[allow(clippy::too_many_arguments)]
pub(super) async fn settle_turn(
    context: &Arc<Context>,
    session: &SessionRow,
    n: u32,
    sandbox: SandboxHandle,
    transcript: Transcript,
    report: TurnReport,
    seen: Seen,
    mut timings: BTreeMap<String, u64>,
    started: Instant,
) -> Option<SandboxHandle> {
    let Delivered {
        head,
        card: mut delivery,
        failure: delivery_failure,
        diff,
    } = delivered(context, session, &sandbox, &report).await;
    // Stored before the card is shown: the dashboard reads the Files changed once it sees the card.
    let store_diff = async {
        if let Some(diff) = &diff
            && let Err(error) = context.store.set_branch_diff(&session.id, diff).await
        {
            // The delivery stands without it: the dashboard's Files changed says the diff is not stored.
            tracing::warn!(session = %session.id, %error, "cannot store the delivered branch's diff");
        }
    };
    let ((), stop) = tokio::join!(store_diff, stop_request(context, session, n));
    let on_remote = head.is_some() || session.head_sha.is_some();
    let delivering = seen.delivering;
    let established = Established {
        seen,
        delivery_failure,
        disk_full: disk_full(&sandbox.0.dirs),
        head,
        turn_timeout: context.config.turn_timeout,
    };
    let mut ending = settle::ending(&report, stop, established);
    if settle::opens_pull_request(&ending, on_remote, session.pr.is_some()) {
        // Opening the draft PR is the last step of delivering (DESIGN §4.1), bounded by the forge
        // call's deadline; the branch stands whatever the forge answers. A session no longer running
        // (a cancel came) keeps its phase: `end_turn` settles from either.
        if !delivering
            && let Err(error) = context
                .store
                .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                .await
        {
            tracing::warn!(%error, session = %session.id, "cannot mark the session delivering");
        }
        let opened = open_pull_request(context, session).await;
        if !matches!(opened, PullRequest::NotApplicable) {
            if let PullRequest::Opened { url, .. } = &opened {
                delivery.pr_url = Some(url.clone());
            }
            // A cancel that came while the forge answered still cancels.
            let stop_now = stop_request(context, session, n).await;
            ending = settle::after_pull_request(ending, &opened, &session.id, stop_now);
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
    sandbox.0.current.set(None);
    // The card goes out while the turn's records are written: none of them is what it shows.
    tokio::join!(
        record_details(context, &session.id, n, priming, &timings),
        meter_turn(context, &session.id, n, &sandbox),
        transcript.finish(Ending {
            failure: ending.failure.clone(),
            stop_reason: report.stop_reason.clone(),
            parts: vec![SortieData::Delivery(delivery), phase_part("done", None, &timings)],
        }),
    );
    let canceled = ending.status == TurnStatus::Canceled;
    let phase = end_turn(context, &session.id, n, ending).await;
    if canceled || matches!(phase, Some(SessionPhase::Canceling | SessionPhase::Canceled)) {
        // Canceled while it ran or delivered: nothing of it may stay warm.
        destroy(context, &session.id, &sandbox).await;
        return None;
    }
    Some(sandbox)
}

/// The user's stop request on turn `n`; a store that does not answer reads as none (the turn ends as
/// the agent ended it).
async fn stop_request(context: &Arc<Context>, session: &SessionRow, n: u32) -> Option<StopRequest> {
    context
        .store
        .turn(&session.id, n)
        .await
        .ok()
        .and_then(|row| row.stop_requested)
}

/// What a turn delivered, as the host knows it.
struct Delivered {
    /// The branch's new head, when the upstream took a push of it in this turn.
    head: Option<String>,
    card: DeliveryData,
    /// A delivery failure the host established: a push the gateway refused for a secret, or a push
    /// the sandbox reports that the upstream never took.
    failure: Option<Failure>,
    /// The branch's diff, to store, when a push moved it.
    diff: Option<StoredDiff>,
}

/// What the turn delivered, from the git proxy's own record of the pushes it forwarded and what the
/// upstream answered (DESIGN §9 invariant 9); the driver's report only ever adds a failure.
async fn delivered(
    context: &Arc<Context>,
    session: &SessionRow,
    sandbox: &SandboxHandle,
    report: &TurnReport,
) -> Delivered {
    let records = sandbox.0.proxy.pushes.take();
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
            match sandbox
                .0
                .proxy
                .diffs
                .read(start.as_deref().or(session.head_sha.as_deref()), head)
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
    Delivered {
        head,
        card,
        failure,
        diff: branch,
    }
}

/// Opens the draft PR of a session on a GitHub forge after its first delivery (see [`pull_request`]).
async fn open_pull_request(context: &Arc<Context>, session: &SessionRow) -> PullRequest {
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
    let credential = match sortie_protocol::api::repo_forge_host(&session.repo) {
        Some(host) => crate::forge::credential(context, &session.workspace_id, &host, &session.repo)
            .await
            .inspect_err(
                |error| tracing::warn!(session = %session.id, %error, "no forge credential for the pull request"),
            )
            .ok(),
        None => None,
    };
    let outcome = pull_request::ensure_draft(
        context.store.as_ref(),
        credential,
        config.forge_http.as_ref(),
        session,
        base,
        &task,
    )
    .await;
    match &outcome {
        PullRequest::Opened { url, number } => {
            tracing::info!(session = %session.id, %url, number, "draft pull request opened");
        }
        PullRequest::Failed(reason) => {
            tracing::warn!(session = %session.id, %reason, "no pull request");
        }
        PullRequest::NotApplicable => {}
    }
    outcome
}
