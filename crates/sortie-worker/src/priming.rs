//! The context ladder's middle rung (DESIGN §6.4): a bounded preamble from the durable transcript for
//! a fresh agent that cannot `session/load`. Prompts and assistant text only (tool noise elided),
//! newest kept, at most [`PREAMBLE_LIMIT`] bytes.

use serde_json::Value;
use sortie_protocol::driver::PrimingContext;
use sortie_store::{SessionRow, Store, StoredPart, TurnRow};

pub const PREAMBLE_LIMIT: usize = 64 * 1024;

/// The assistant's text of one turn, from its stored chunks.
pub fn assistant_text(parts: &[StoredPart], turn: u32) -> String {
    let mut text = String::new();
    for part in parts.iter().filter(|p| p.turn == turn) {
        let Ok(chunk) = serde_json::from_str::<Value>(&part.payload) else {
            continue;
        };
        if chunk["type"] == "text-delta"
            && let Some(delta) = chunk["delta"].as_str()
        {
            text.push_str(delta);
        }
    }
    text
}

/// The earlier turns before `n` as a preamble, newest kept whole when they do not all fit; `None` if
/// no earlier turn produced anything an agent could use.
pub fn preamble(turns: &[TurnRow], parts: &[StoredPart], n: u32, limit: usize) -> Option<String> {
    if parts.iter().all(|p| p.turn >= n) {
        return None;
    }
    let answers: std::collections::BTreeMap<u32, String> = turns
        .iter()
        .filter(|t| t.n < n)
        .map(|t| (t.n, assistant_text(parts, t.n)))
        .collect();
    preamble_of(turns, &answers, n, limit)
}

/// [`preamble`] from the assistant's text of each earlier turn (`answers`; a turn missing from it
/// said nothing); `None` when no turn fits.
pub fn preamble_of(
    turns: &[TurnRow],
    answers: &std::collections::BTreeMap<u32, String>,
    n: u32,
    limit: usize,
) -> Option<String> {
    let mut blocks = Vec::new();
    let mut used = 0;
    for turn in turns.iter().filter(|t| t.n < n).rev() {
        let answer = answers.get(&turn.n).cloned().unwrap_or_default();
        let block = if answer.trim().is_empty() {
            format!("User: {}\n", turn.prompt)
        } else {
            format!("User: {}\nAssistant: {}\n", turn.prompt, answer.trim())
        };
        if used + block.len() > limit {
            break;
        }
        used += block.len();
        blocks.push(block);
    }
    if blocks.is_empty() {
        return None;
    }
    blocks.reverse();
    Some(format!(
        "This conversation continues an earlier one in this repository; its transcript so far:\n\n{}",
        blocks.join("\n")
    ))
}

/// What primes a fresh agent for turn `n` of `session` (the preamble and the task), read from the
/// store slice by slice and never further than the preamble can hold.
pub async fn context_for(store: &dyn Store, session: &SessionRow, n: u32) -> PrimingContext {
    let turns = store
        .turns(&session.workspace_id, &session.id)
        .await
        .unwrap_or_default();
    // The assistant's text of the earlier turns, newest first, read slice by slice and only as far as
    // the preamble can hold: never the whole transcript.
    let mut answers = std::collections::BTreeMap::new();
    let mut any_parts = false;
    let mut used = 0;
    for turn in turns.iter().filter(|t| t.n < n).rev() {
        if used > PREAMBLE_LIMIT {
            break;
        }
        let mut text = String::new();
        let mut after = None;
        while text.len() <= PREAMBLE_LIMIT {
            let limit = sortie_store::PartsLimit {
                parts: 1024,
                bytes: 4 << 20,
            };
            let Ok(slice) = store.turn_parts_after(&session.id, turn.n, after, limit).await else {
                break;
            };
            let Some(last) = slice.last().map(|part| part.part_index) else {
                break;
            };
            any_parts = true;
            text.push_str(&assistant_text(&slice, turn.n));
            after = Some(last);
        }
        used += text.len() + turn.prompt.len();
        answers.insert(turn.n, text);
    }
    let preamble = if any_parts {
        preamble_of(&turns, &answers, n, PREAMBLE_LIMIT)
    } else {
        None
    };
    let task = turns.first().map(|t| t.prompt.clone());
    PrimingContext { preamble, task }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_protocol::{SessionId, TurnStatus};

    fn turn(n: u32, prompt: &str) -> TurnRow {
        TurnRow {
            session_id: SessionId::generate(),
            n,
            prompt: prompt.into(),
            status: TurnStatus::Completed,
            mode: Default::default(),
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

    fn part(turn: u32, index: u32, payload: &str) -> StoredPart {
        StoredPart {
            turn,
            part_index: index,
            seq: i64::from(index),
            payload: payload.into(),
        }
    }

    #[test]
    fn keeps_prompts_and_text_and_drops_tool_noise() {
        let parts = vec![
            part(1, 0, r#"{"type":"start","messageId":"m"}"#),
            part(1, 1, r#"{"type":"text-delta","id":"t","delta":"Hel"}"#),
            part(
                1,
                2,
                r#"{"type":"tool-input-available","toolCallId":"c","toolName":"x","input":{}}"#,
            ),
            part(1, 3, r#"{"type":"text-delta","id":"t","delta":"lo"}"#),
        ];
        let text = preamble(&[turn(1, "say hello"), turn(2, "again")], &parts, 2, PREAMBLE_LIMIT).expect("preamble");
        assert!(text.contains("User: say hello\nAssistant: Hello"), "{text}");
        assert!(!text.contains("tool") && !text.contains("again"), "{text}");
    }

    #[test]
    fn newest_turns_are_kept_within_the_limit() {
        let turns: Vec<TurnRow> = (1..=50)
            .map(|n| turn(n, &format!("prompt {n} {}", "x".repeat(100))))
            .collect();
        let parts = vec![part(1, 0, r#"{"type":"text-delta","id":"t","delta":"first"}"#)];
        let text = preamble(&turns, &parts, 50, 1000).expect("preamble");
        assert!(text.len() <= 1000 + 200);
        assert!(text.contains("prompt 49") && !text.contains("prompt 1 "), "{text}");
    }

    #[test]
    fn nothing_to_say_without_earlier_parts() {
        assert_eq!(preamble(&[turn(1, "a"), turn(2, "b")], &[], 2, PREAMBLE_LIMIT), None);
    }
}
