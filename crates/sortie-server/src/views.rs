//! Store rows as the API shows them.

use sortie_protocol::api::{self, Egress, Failure, PullRequest, Usage, rfc3339_from_epoch_ms};
use sortie_store::{SessionRow, TurnRow};

fn failure(failure: &Option<(sortie_protocol::FailureCode, String)>) -> Option<Failure> {
    failure.as_ref().map(|(code, reason)| Failure {
        code: *code,
        reason: reason.clone(),
    })
}

pub fn session(row: &SessionRow) -> api::Session {
    api::Session {
        id: row.id.clone(),
        workspace: row.workspace_name.clone(),
        repo: row.repo.clone(),
        base: row.base.clone(),
        branch: row.id.branch(),
        agent: row.agent.clone(),
        model: row.model.clone(),
        title: row.title.clone(),
        phase: row.phase,
        sandbox: if row.has_sandbox {
            api::SandboxState::Live
        } else {
            api::SandboxState::Released
        },
        queued_reason: row.queued_reason.clone(),
        turns: row.n_turns,
        current_turn: row.current_turn,
        head_sha: row.head_sha.clone(),
        pr: row.pr.as_ref().map(|(url, number)| PullRequest {
            url: url.clone(),
            number: *number,
        }),
        failure: failure(&row.failure),
        egress: Egress {
            allow: row.egress_allow.clone(),
        },
        usage: Usage {
            compute_seconds: row.compute_ms / 1000,
            peak_memory_bytes: row.peak_memory_bytes,
            input_tokens: row.input_tokens,
            output_tokens: row.output_tokens,
        },
        archived: row.archived,
        pruned_at: row.pruned_at.map(rfc3339_from_epoch_ms),
        budget: (row.budget_tokens.is_some() || row.budget_compute_ms.is_some()).then(|| api::SessionBudget {
            tokens: row.budget_tokens,
            compute_seconds: row.budget_compute_ms.map(|ms| ms / 1000),
            paused_at: row.budget_paused_at.map(rfc3339_from_epoch_ms),
        }),
        created_at: rfc3339_from_epoch_ms(row.created_at),
        updated_at: rfc3339_from_epoch_ms(row.updated_at),
    }
}

pub fn turn(row: &TurnRow) -> api::Turn {
    api::Turn {
        n: row.n,
        prompt: row.prompt.clone(),
        status: row.status,
        mode: row.mode,
        created_at: rfc3339_from_epoch_ms(row.created_at),
        started_at: row.started_at.map(rfc3339_from_epoch_ms),
        completed_at: row.completed_at.map(rfc3339_from_epoch_ms),
        head_sha: row.head_sha.clone(),
        failure: failure(&row.failure),
        priming: row.priming.clone(),
        timings: row.timings.clone(),
        usage: api::TurnUsage {
            wall_ms: row
                .started_at
                .zip(row.completed_at)
                .map(|(started, ended)| u64::try_from(ended - started).unwrap_or(0)),
            cpu_ms: row.cpu_ms,
            peak_memory_bytes: row.peak_memory_bytes,
        },
    }
}
