//! A session's evidence read from the store (see [`sortie_protocol::evidence`]): its turns and their
//! transcripts, read a page at a time so a turn of any size is read in bounded memory, and the branch
//! diff the host stored at its last delivery.

use sortie_protocol::evidence::{FileEvidence, SessionEvidence, TurnEvidenceBuilder};

use crate::{PartsLimit, SessionRow, Store, StoreResult};

/// How many parts one read takes.
const PAGE: PartsLimit = PartsLimit {
    parts: 500,
    bytes: 4 * 1024 * 1024,
};

/// The dashboard's link to `session`, when the triggers of its forge connection name the dashboard's
/// address.
pub async fn dashboard_link(store: &dyn Store, session: &SessionRow) -> Option<String> {
    let host = sortie_protocol::api::repo_forge_host(&session.repo)?;
    let connection = store.forge_connection(&session.workspace_id, &host).await.ok()??;
    let triggers: sortie_protocol::api::ForgeTriggers = serde_json::from_str(connection.triggers.as_deref()?).ok()?;
    triggers.session_link(session.id.as_str())
}

/// The evidence of `session`, with its dashboard link when the address is known.
pub async fn session_evidence(
    store: &dyn Store,
    session: &SessionRow,
    dashboard_url: Option<String>,
) -> StoreResult<SessionEvidence> {
    let turns = store.turns(&session.workspace_id, &session.id).await?;
    let mut evidence = SessionEvidence {
        session: session.id.to_string(),
        title: session.title.clone(),
        task: turns.first().map(|turn| turn.prompt.clone()).unwrap_or_default(),
        repo: session.repo.clone(),
        branch: session.id.branch(),
        pr_url: session.pr.as_ref().map(|(url, _)| url.clone()),
        dashboard_url,
        input_tokens: session.input_tokens,
        output_tokens: session.output_tokens,
        compute_seconds: session.compute_ms / 1000,
        ..Default::default()
    };
    for turn in &turns {
        let mut builder = TurnEvidenceBuilder::default();
        let mut after = None;
        loop {
            let parts = store.turn_parts_after(&session.id, turn.n, after, PAGE).await?;
            let Some(last) = parts.last() else {
                break;
            };
            after = Some(last.part_index);
            for part in &parts {
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&part.payload) {
                    builder.read(&value);
                }
            }
        }
        let duration_ms = match (turn.started_at, turn.completed_at) {
            (Some(started), Some(completed)) => u64::try_from(completed - started).ok(),
            _ => None,
        };
        evidence.turns.push(builder.finish(
            turn.n,
            &turn.prompt,
            turn.status.as_str(),
            turn.failure.as_ref().map(|(code, reason)| {
                let code = serde_json::to_value(code)
                    .ok()
                    .and_then(|code| code.as_str().map(str::to_owned))
                    .unwrap_or_default();
                format!("{code}: {reason}")
            }),
            duration_ms,
        ));
    }
    if let Some(diff) = store.branch_diff(&session.id).await? {
        evidence.files_changed = diff.files_changed;
        evidence.insertions = diff.insertions;
        evidence.deletions = diff.deletions;
        evidence.files = diff
            .files
            .iter()
            .take(sortie_protocol::evidence::FILES_MAX)
            .map(|file| FileEvidence {
                path: file.path.clone(),
                insertions: file.insertions,
                deletions: file.deletions,
            })
            .collect();
    }
    Ok(evidence)
}
