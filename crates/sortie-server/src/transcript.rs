//! One page of `GET /v1/sessions/{id}/messages`: which turns it takes, each turn's stored parts read
//! slice by slice and folded as they come, and the cursors to the pages beside it.
//!
//! A page's work is bounded whatever a session stored (security review S8): at most
//! [`MESSAGES_PAGE_TURNS_MAX`] turns, no turn after the one that reaches [`MESSAGES_PAGE_MAX_BYTES`],
//! and no more of one turn than the transcript caps ([`TURN_PARTS_MAX`], [`TURN_PART_BYTES_MAX`]): a
//! turn stored past them ends with a truncation note. It must never read a session's whole
//! transcript in one go.

use serde_json::Value;
use sortie_protocol::SessionId;
use sortie_protocol::api::{UiMessage, UiRole};
use sortie_protocol::limits::{MESSAGES_PAGE_MAX_BYTES, TURN_PART_BYTES_MAX, TURN_PARTS_MAX};
use sortie_protocol::ui::{PartsAssembler, truncation_note};
use sortie_store::{PartsLimit, Store, StoreResult, TurnRow};

/// How much of a turn one store read brings: small enough that a slice of the largest parts stays a
/// few MiB, large enough that a capped turn takes about a hundred reads.
const SLICE: PartsLimit = PartsLimit {
    parts: 1024,
    bytes: 4 * 1024 * 1024,
};

/// Where a page starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageStart {
    /// The newest turns (no cursor).
    Newest,
    /// The newest of the turns numbered below this one (an older page).
    Before(u32),
    /// The oldest of the turns numbered above this one (a newer page).
    After(u32),
}

/// A page of the transcript, its turns in order, and the cursors beside it.
#[derive(Debug)]
pub struct Page {
    pub messages: Vec<UiMessage>,
    /// Pass as `before` for the page of older turns; `None` when the page starts at the first turn.
    pub older_cursor: Option<u32>,
    /// Pass as `after` for the page of newer turns; `None` when the page ends at the last turn.
    pub newer_cursor: Option<u32>,
}

/// The turns a page may take, in the order it reads them: from the start's side, at most `limit`.
fn candidates(turns: &[TurnRow], start: PageStart, limit: u32) -> Vec<&TurnRow> {
    let limit = limit as usize;
    match start {
        PageStart::Newest => turns.iter().rev().take(limit).collect(),
        PageStart::Before(before) => turns.iter().rev().filter(|t| t.n < before).take(limit).collect(),
        PageStart::After(after) => turns.iter().filter(|t| t.n > after).take(limit).collect(),
    }
}

/// Reads the page of `turns` (the session's turn ledger, in turn order) that `start` names.
pub async fn read_page(
    store: &dyn Store,
    session_id: &SessionId,
    turns: &[TurnRow],
    start: PageStart,
    limit: u32,
) -> StoreResult<Page> {
    let mut taken: Vec<(&TurnRow, Option<Vec<Value>>)> = Vec::new();
    let mut page_bytes: u64 = 0;
    for turn in candidates(turns, start, limit) {
        let answer = read_answer(store, session_id, turn.n).await?;
        page_bytes = page_bytes
            .saturating_add(turn.prompt.len() as u64)
            .saturating_add(answer.bytes);
        taken.push((turn, answer.parts));
        if page_bytes >= MESSAGES_PAGE_MAX_BYTES {
            break;
        }
    }
    taken.sort_by_key(|(turn, _)| turn.n);
    let first = taken.first().map(|(turn, _)| turn.n);
    let last = taken.last().map(|(turn, _)| turn.n);
    let older_cursor = first.filter(|&first| turns.iter().any(|t| t.n < first));
    let newer_cursor = last.filter(|&last| turns.iter().any(|t| t.n > last));
    let mut messages = Vec::with_capacity(taken.len() * 2);
    for (turn, parts) in taken {
        messages.push(UiMessage {
            id: session_id.user_message_id(turn.n),
            role: UiRole::User,
            parts: vec![sortie_protocol::ui::user_text_part(&turn.prompt)],
        });
        if let Some(parts) = parts {
            messages.push(UiMessage {
                id: session_id.assistant_message_id(turn.n),
                role: UiRole::Assistant,
                parts,
            });
        }
    }
    Ok(Page {
        messages,
        older_cursor,
        newer_cursor,
    })
}

/// A turn's answer as read: its parts (`None` when it has none yet) and the stored bytes read for it.
struct Answer {
    parts: Option<Vec<Value>>,
    bytes: u64,
}

/// Folds turn `n`'s stored parts, up to the transcript caps; a turn stored past them ends with a note.
async fn read_answer(store: &dyn Store, session_id: &SessionId, n: u32) -> StoreResult<Answer> {
    let mut assembler = PartsAssembler::default();
    let mut n_parts: u32 = 0;
    let mut bytes: u64 = 0;
    let mut after = None;
    let mut truncated = false;
    'slices: loop {
        let slice = store.turn_parts_after(session_id, n, after, SLICE).await?;
        if slice.is_empty() {
            break;
        }
        for part in slice {
            let size = part.payload.len() as u64;
            if n_parts >= TURN_PARTS_MAX || bytes.saturating_add(size) > TURN_PART_BYTES_MAX {
                truncated = true;
                break 'slices;
            }
            n_parts += 1;
            bytes += size;
            after = Some(part.part_index);
            // A payload that is not JSON is skipped, as a client skips a chunk it cannot read.
            if let Ok(chunk) = serde_json::from_str::<Value>(&part.payload) {
                assembler.push(&chunk);
            }
        }
    }
    if truncated {
        assembler.push_part(truncation_note(u64::from(n_parts), bytes));
    }
    let parts = (!assembler.is_empty()).then(|| assembler.into_parts());
    Ok(Answer { parts, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_protocol::TurnStatus;
    use sortie_protocol::phase::TurnMode;

    fn turn(n: u32) -> TurnRow {
        TurnRow {
            session_id: SessionId::generate(),
            n,
            prompt: format!("prompt {n}"),
            status: TurnStatus::Completed,
            mode: TurnMode::Queue,
            stop_requested: None,
            priming: None,
            head_sha: None,
            failure: None,
            timings: None,
            claimed_by: None,
            driver_nonce: None,
            created_at: 0,
            started_at: None,
            completed_at: None,
            cpu_ms: 0,
            peak_memory_bytes: 0,
        }
    }

    #[test]
    fn candidates_are_read_from_the_side_the_page_starts() {
        let turns: Vec<TurnRow> = (1..=7).map(turn).collect();
        let numbers = |start, limit| candidates(&turns, start, limit).iter().map(|t| t.n).collect::<Vec<_>>();
        let cases = [
            (PageStart::Newest, 3, vec![7, 6, 5]),
            (PageStart::Newest, 10, vec![7, 6, 5, 4, 3, 2, 1]),
            (PageStart::Before(5), 3, vec![4, 3, 2]),
            (PageStart::Before(3), 3, vec![2, 1]),
            (PageStart::Before(1), 3, vec![]),
            (PageStart::Before(100), 2, vec![7, 6]),
            (PageStart::After(2), 3, vec![3, 4, 5]),
            (PageStart::After(5), 3, vec![6, 7]),
            (PageStart::After(7), 3, vec![]),
            (PageStart::After(0), 1, vec![1]),
        ];
        for (start, limit, expected) in cases {
            assert_eq!(numbers(start, limit), expected, "{start:?} limit {limit}");
        }
    }
}
