//! Folding a turn's stored UI message chunks into the parts of one AI SDK `UIMessage`, the way the
//! AI SDK client does it (`process-ui-message-stream`): text and reasoning blocks are concatenated,
//! tool chunks are merged into one `dynamic-tool` part per call, `data-*` chunks with the same type and
//! id replace each other in place, transient ones are dropped, `start-step` becomes `step-start`.
//!
//! The fold is linear in the chunks: a delta is appended to its part's text in place, and open text,
//! reasoning, tool and data parts are found through maps by id, never by a scan of the parts so far
//! (security review S8: the quadratic fold made one `GET /messages` of a flooded turn take minutes).

use std::collections::HashMap;

use serde_json::{Value, json};

/// The part type of the note that says a turn's transcript is longer than what was read of it.
pub const TRUNCATED_PART_TYPE: &str = "data-sortie-truncated";

/// The note that ends a turn's answer when only its first `shown_parts` parts (`shown_bytes` bytes of
/// stored payloads) were read, because the stored turn goes past the transcript caps.
pub fn truncation_note(shown_parts: u64, shown_bytes: u64) -> Value {
    /// `data-sortie-truncated`: the part's envelope.
    #[derive(serde::Serialize)]
    #[serde(tag = "type", rename = "data-sortie-truncated")]
    struct Note {
        data: Shown,
    }
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Shown {
        shown_parts: u64,
        shown_bytes: u64,
        reason: &'static str,
    }
    let note = Note {
        data: Shown {
            shown_parts,
            shown_bytes,
            reason: "the turn's transcript is longer than sortie keeps; the rest is not shown",
        },
    };
    // Numbers and strings only: encoding cannot fail.
    serde_json::to_value(note).unwrap_or_default()
}

/// The one part of a user message: its prompt as a `text` part.
pub fn user_text_part(text: &str) -> Value {
    #[derive(serde::Serialize)]
    #[serde(tag = "type", rename = "text")]
    struct Text<'a> {
        text: &'a str,
    }
    serde_json::to_value(Text { text }).unwrap_or_default()
}

/// The parts of the assistant message that `chunks` (in part order) build.
pub fn assemble_parts<'a>(chunks: impl IntoIterator<Item = &'a Value>) -> Vec<Value> {
    let mut assembler = PartsAssembler::default();
    for chunk in chunks {
        assembler.push(chunk);
    }
    assembler.into_parts()
}

/// Folds chunks one at a time, so that a caller can parse each stored part, fold it and drop it.
///
/// Parts are JSON values, not a type of ours: a `UIMessage` part is the AI SDK's shape, and a stored
/// chunk's keys (its data, a tool's input and output) pass through to the client as they were.
#[derive(Debug, Default)]
pub struct PartsAssembler {
    parts: Vec<Value>,
    /// The index in `parts` of each open text block, by its id.
    open_text: HashMap<String, usize>,
    /// The index in `parts` of each open reasoning block, by its id.
    open_reasoning: HashMap<String, usize>,
    /// The index in `parts` of each tool call's `dynamic-tool` part, by `toolCallId`.
    tool_calls: HashMap<String, usize>,
    /// The index in `parts` of each `data-*` part that has an id, by type and then id.
    data_by_id: HashMap<String, HashMap<String, usize>>,
}

impl PartsAssembler {
    /// Folds the next chunk; one that is malformed or out of order is skipped, as clients do.
    pub fn push(&mut self, chunk: &Value) {
        let Some(kind) = chunk["type"].as_str() else {
            return;
        };
        match kind {
            "start-step" => self.parts.push(json!({"type": "step-start"})),
            "text-start" | "reasoning-start" => {
                let Some(id) = chunk["id"].as_str() else {
                    return;
                };
                let (part_kind, open) = if kind == "text-start" {
                    ("text", &mut self.open_text)
                } else {
                    ("reasoning", &mut self.open_reasoning)
                };
                let mut part = json!({"type": part_kind, "text": "", "state": "streaming"});
                copy_optional(chunk, &mut part, "providerMetadata");
                open.insert(id.to_owned(), self.parts.len());
                self.parts.push(part);
            }
            "text-delta" | "reasoning-delta" | "text-end" | "reasoning-end" => {
                let Some(id) = chunk["id"].as_str() else {
                    return;
                };
                let open = if kind.starts_with("text") {
                    &mut self.open_text
                } else {
                    &mut self.open_reasoning
                };
                let Some(part) = open.get(id).and_then(|&index| self.parts.get_mut(index)) else {
                    return;
                };
                if let Some(delta) = chunk["delta"].as_str()
                    && let Some(Value::String(text)) = part.get_mut("text")
                {
                    text.push_str(delta);
                }
                if kind.ends_with("-end") {
                    part["state"] = json!("done");
                    // An end's metadata (its start again, and its end) replaces the start's, as clients do.
                    copy_optional(chunk, part, "providerMetadata");
                    open.remove(id);
                }
            }
            "tool-input-start" | "tool-input-available" | "tool-input-error" => {
                let Some(call_id) = chunk["toolCallId"].as_str() else {
                    return;
                };
                let index = match self.tool_calls.get(call_id) {
                    Some(&index) => index,
                    None => {
                        let index = self.parts.len();
                        self.parts.push(json!({"type": "dynamic-tool", "toolCallId": call_id, "toolName": chunk["toolName"], "state": "input-streaming", "input": null}));
                        self.tool_calls.insert(call_id.to_owned(), index);
                        index
                    }
                };
                let part = &mut self.parts[index];
                part["toolName"] = chunk["toolName"].clone();
                copy_optional(chunk, part, "title");
                copy_optional(chunk, part, "providerMetadata");
                match kind {
                    "tool-input-available" => {
                        part["input"] = chunk["input"].clone();
                        part["state"] = json!("input-available");
                    }
                    "tool-input-error" => {
                        part["input"] = chunk["input"].clone();
                        part["errorText"] = chunk["errorText"].clone();
                        part["state"] = json!("output-error");
                    }
                    _ => {}
                }
            }
            "tool-output-available" | "tool-output-error" => {
                let Some(call_id) = chunk["toolCallId"].as_str() else {
                    return;
                };
                let Some(part) = self
                    .tool_calls
                    .get(call_id)
                    .and_then(|&index| self.parts.get_mut(index))
                else {
                    return;
                };
                copy_optional(chunk, part, "providerMetadata");
                if kind == "tool-output-available" {
                    part["output"] = chunk["output"].clone();
                    part["state"] = json!("output-available");
                } else {
                    part["errorText"] = chunk["errorText"].clone();
                    part["state"] = json!("output-error");
                }
            }
            data if data.starts_with("data-") => {
                if chunk["transient"] == json!(true) {
                    return;
                }
                let id = chunk["id"].as_str();
                let existing = id.and_then(|id| self.data_by_id.get(data)?.get(id).copied());
                if let Some(index) = existing {
                    self.parts[index]["data"] = chunk["data"].clone();
                    return;
                }
                let mut part = json!({"type": data, "data": chunk["data"]});
                copy_optional(chunk, &mut part, "id");
                if let Some(id) = id {
                    self.data_by_id
                        .entry(data.to_owned())
                        .or_default()
                        .insert(id.to_owned(), self.parts.len());
                }
                self.parts.push(part);
            }
            // start, finish, finish-step, message-metadata, error and abort carry no part.
            _ => {}
        }
    }

    /// Adds a part as it is (a note of sortie's own, such as [`truncation_note`]).
    pub fn push_part(&mut self, part: Value) {
        self.parts.push(part);
    }

    /// Whether no chunk so far made a part.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The parts folded so far.
    pub fn into_parts(self) -> Vec<Value> {
        self.parts
    }
}

fn copy_optional(from: &Value, to: &mut Value, key: &str) {
    if let Some(value) = from.get(key).filter(|v| !v.is_null()) {
        to[key] = value.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assemble(chunks: &[Value]) -> Vec<Value> {
        assemble_parts(chunks.iter())
    }

    #[test]
    fn text_and_reasoning_blocks_are_concatenated() {
        let parts = assemble(&[
            json!({"type": "start", "messageId": "m"}),
            json!({"type": "start-step"}),
            json!({"type": "reasoning-start", "id": "r1"}),
            json!({"type": "reasoning-delta", "id": "r1", "delta": "think"}),
            json!({"type": "reasoning-end", "id": "r1"}),
            json!({"type": "text-start", "id": "t1", "providerMetadata": {"sortie": {"at": "x"}}}),
            json!({"type": "text-delta", "id": "t1", "delta": "Hel"}),
            json!({"type": "text-delta", "id": "t1", "delta": "lo"}),
            json!({"type": "text-end", "id": "t1"}),
            json!({"type": "finish-step"}),
            json!({"type": "finish"}),
        ]);
        assert_eq!(
            parts,
            vec![
                json!({"type": "step-start"}),
                json!({"type": "reasoning", "text": "think", "state": "done"}),
                json!({"type": "text", "text": "Hello", "state": "done", "providerMetadata": {"sortie": {"at": "x"}}}),
            ]
        );
    }

    #[test]
    fn an_end_keeps_when_its_block_or_call_began_and_ended() {
        let span = json!({"sortie": {"at": "a", "endedAt": "b"}});
        let parts = assemble(&[
            json!({"type": "reasoning-start", "id": "r1", "providerMetadata": {"sortie": {"at": "a"}}}),
            json!({"type": "reasoning-end", "id": "r1", "providerMetadata": span}),
            json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "execute", "dynamic": true, "providerMetadata": {"sortie": {"at": "a"}}}),
            json!({"type": "tool-output-available", "toolCallId": "c1", "output": "ok", "providerMetadata": span}),
        ]);
        assert_eq!(parts[0]["providerMetadata"], span);
        assert_eq!(parts[1]["providerMetadata"], span);
    }

    #[test]
    fn tool_chunks_merge_into_one_dynamic_tool_part() {
        let parts = assemble(&[
            json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "edit", "dynamic": true}),
            json!({"type": "tool-input-available", "toolCallId": "c1", "toolName": "edit", "dynamic": true, "title": "Write a.txt", "input": {"path": "a.txt"}}),
            json!({"type": "tool-output-available", "toolCallId": "c1", "output": "ok"}),
            json!({"type": "tool-input-available", "toolCallId": "c2", "toolName": "execute", "dynamic": true, "input": null}),
            json!({"type": "tool-output-error", "toolCallId": "c2", "errorText": "exit 1"}),
            json!({"type": "tool-output-available", "toolCallId": "unknown", "output": 1}),
        ]);
        assert_eq!(
            parts,
            vec![
                json!({"type": "dynamic-tool", "toolCallId": "c1", "toolName": "edit", "title": "Write a.txt", "state": "output-available", "input": {"path": "a.txt"}, "output": "ok"}),
                json!({"type": "dynamic-tool", "toolCallId": "c2", "toolName": "execute", "state": "output-error", "input": null, "errorText": "exit 1"}),
            ]
        );
    }

    #[test]
    fn data_parts_replace_in_place_and_transient_ones_are_dropped() {
        let parts = assemble(&[
            json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": ["a"]}}),
            json!({"type": "data-sortie-phase", "data": "running", "transient": true}),
            json!({"type": "data-acp-diff", "data": {"path": "x"}}),
            json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": ["a", "b"]}}),
        ]);
        assert_eq!(
            parts,
            vec![
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": ["a", "b"]}}),
                json!({"type": "data-acp-diff", "data": {"path": "x"}}),
            ]
        );
    }

    #[test]
    fn chunks_out_of_order_or_malformed_are_skipped_not_fatal() {
        let parts = assemble(&[
            json!({"type": "text-delta", "id": "never-started", "delta": "x"}),
            json!({"no": "type"}),
            json!({"type": "text-start"}),
            json!({"type": "text-start", "id": "t"}),
            json!({"type": "text-delta", "id": "t", "delta": "partial"}),
        ]);
        assert_eq!(
            parts,
            vec![json!({"type": "text", "text": "partial", "state": "streaming"})]
        );
    }

    #[test]
    fn a_stored_truncation_note_is_kept_as_a_part() {
        let mut assembler = PartsAssembler::default();
        assert!(assembler.is_empty());
        assembler.push(&json!({"type": "text-start", "id": "t"}));
        assembler.push(&json!({"type": "text-delta", "id": "t", "delta": "so far"}));
        assembler.push_part(truncation_note(2, 80));
        let parts = assembler.into_parts();
        assert_eq!(parts[0]["text"], "so far");
        assert_eq!(parts[1]["type"], TRUNCATED_PART_TYPE);
        assert_eq!(parts[1]["data"]["shownParts"], 2);
        assert_eq!(parts[1]["data"]["shownBytes"], 80);
    }

    /// The fold as it was before it was made linear (a copy per delta, a scan per tool or data chunk):
    /// the reference the linear fold must agree with.
    fn quadratic_reference(chunks: &[Value]) -> Vec<Value> {
        let mut parts: Vec<Value> = Vec::new();
        let mut open_text: serde_json::Map<String, Value> = serde_json::Map::new();
        let find = |parts: &[Value], kind: &str, key: &str, id: &str| {
            parts.iter().rposition(|p| p["type"] == kind && p[key] == id)
        };
        for chunk in chunks {
            let Some(kind) = chunk["type"].as_str() else {
                continue;
            };
            match kind {
                "start-step" => parts.push(json!({"type": "step-start"})),
                "text-start" | "reasoning-start" => {
                    let part_kind = if kind == "text-start" { "text" } else { "reasoning" };
                    let Some(id) = chunk["id"].as_str() else {
                        continue;
                    };
                    let mut part = json!({"type": part_kind, "text": "", "state": "streaming"});
                    copy_optional(chunk, &mut part, "providerMetadata");
                    open_text.insert(format!("{part_kind}:{id}"), json!(parts.len()));
                    parts.push(part);
                }
                "text-delta" | "reasoning-delta" | "text-end" | "reasoning-end" => {
                    let part_kind = if kind.starts_with("text") { "text" } else { "reasoning" };
                    let Some(id) = chunk["id"].as_str() else {
                        continue;
                    };
                    let key = format!("{part_kind}:{id}");
                    let Some(index) = open_text.get(&key).and_then(Value::as_u64) else {
                        continue;
                    };
                    let part = &mut parts[index as usize];
                    if let Some(delta) = chunk["delta"].as_str() {
                        let text = format!("{}{delta}", part["text"].as_str().unwrap_or_default());
                        part["text"] = json!(text);
                    }
                    if kind.ends_with("-end") {
                        part["state"] = json!("done");
                        copy_optional(chunk, part, "providerMetadata");
                        open_text.remove(&key);
                    }
                }
                "tool-input-start" | "tool-input-available" | "tool-input-error" => {
                    let Some(call_id) = chunk["toolCallId"].as_str() else {
                        continue;
                    };
                    let index = match find(&parts, "dynamic-tool", "toolCallId", call_id) {
                        Some(index) => index,
                        None => {
                            parts.push(json!({"type": "dynamic-tool", "toolCallId": call_id, "toolName": chunk["toolName"], "state": "input-streaming", "input": null}));
                            parts.len() - 1
                        }
                    };
                    let part = &mut parts[index];
                    part["toolName"] = chunk["toolName"].clone();
                    copy_optional(chunk, part, "title");
                    copy_optional(chunk, part, "providerMetadata");
                    match kind {
                        "tool-input-available" => {
                            part["input"] = chunk["input"].clone();
                            part["state"] = json!("input-available");
                        }
                        "tool-input-error" => {
                            part["input"] = chunk["input"].clone();
                            part["errorText"] = chunk["errorText"].clone();
                            part["state"] = json!("output-error");
                        }
                        _ => {}
                    }
                }
                "tool-output-available" | "tool-output-error" => {
                    let Some(call_id) = chunk["toolCallId"].as_str() else {
                        continue;
                    };
                    let Some(index) = find(&parts, "dynamic-tool", "toolCallId", call_id) else {
                        continue;
                    };
                    let part = &mut parts[index];
                    copy_optional(chunk, part, "providerMetadata");
                    if kind == "tool-output-available" {
                        part["output"] = chunk["output"].clone();
                        part["state"] = json!("output-available");
                    } else {
                        part["errorText"] = chunk["errorText"].clone();
                        part["state"] = json!("output-error");
                    }
                }
                data if data.starts_with("data-") => {
                    if chunk["transient"] == json!(true) {
                        continue;
                    }
                    let mut part = json!({"type": data, "data": chunk["data"]});
                    copy_optional(chunk, &mut part, "id");
                    let existing = chunk["id"].as_str().and_then(|id| find(&parts, data, "id", id));
                    match existing {
                        Some(index) => parts[index]["data"] = chunk["data"].clone(),
                        None => parts.push(part),
                    }
                }
                _ => {}
            }
        }
        parts
    }

    /// A deterministic stream of every kind of chunk, well-formed or not, with few ids so that starts,
    /// ends, re-starts, unknown ids and repeated data ids all happen.
    fn mixed_chunks(seed: u64, count: usize) -> Vec<Value> {
        let mut state = seed;
        let mut next = move |below: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % below
        };
        (0..count)
            .map(|i| {
                let id = format!("i{}", next(4));
                let meta = json!({"sortie": {"at": i}});
                match next(17) {
                    0 => json!({"type": "start-step"}),
                    1 => json!({"type": "text-start", "id": id, "providerMetadata": meta}),
                    2 | 3 => json!({"type": "text-delta", "id": id, "delta": format!("d{i} ")}),
                    4 => json!({"type": "text-end", "id": id, "providerMetadata": meta}),
                    5 => json!({"type": "reasoning-start", "id": id}),
                    6 => json!({"type": "reasoning-delta", "id": id, "delta": format!("r{i}")}),
                    7 => json!({"type": "reasoning-end", "id": id}),
                    8 => json!({"type": "tool-input-start", "toolCallId": id, "toolName": "execute", "dynamic": true}),
                    9 => json!({"type": "tool-input-available", "toolCallId": id, "toolName": "edit", "title": format!("t{i}"), "input": {"n": i}}),
                    10 => json!({"type": "tool-input-error", "toolCallId": id, "toolName": "edit", "input": null, "errorText": "bad"}),
                    11 => json!({"type": "tool-output-available", "toolCallId": id, "output": i, "providerMetadata": meta}),
                    12 => json!({"type": "tool-output-error", "toolCallId": id, "errorText": format!("e{i}")}),
                    13 => json!({"type": "data-acp-plan", "id": id, "data": {"n": i}}),
                    14 => json!({"type": "data-acp-diff", "data": {"n": i}}),
                    15 => json!({"type": "data-sortie-phase", "data": i, "transient": next(2) == 0}),
                    _ => match next(4) {
                        0 => json!({"type": "text-delta", "delta": "no id"}),
                        1 => json!({"no": "type"}),
                        2 => json!({"type": "tool-output-available", "output": "no call"}),
                        _ => json!({"type": "finish"}),
                    },
                }
            })
            .collect()
    }

    #[test]
    fn the_linear_fold_agrees_with_the_quadratic_one_it_replaced() {
        for seed in 0..50 {
            let chunks = mixed_chunks(seed, 400);
            assert_eq!(assemble(&chunks), quadratic_reference(&chunks), "seed {seed}");
        }
    }

    /// Security review S8: a flood turn made one `GET /messages` take 250 s. 200,000 deltas and 20,000
    /// tool calls take minutes with a copy per delta and a scan per tool chunk; linear, well under a
    /// second in release. The bound below only catches a return to quadratic work on a loaded machine.
    #[test]
    fn a_flood_of_deltas_and_tool_calls_folds_in_linear_time() {
        const DELTAS: usize = 200_000;
        const TOOL_CALLS: usize = 20_000;
        let mut chunks = vec![json!({"type": "start-step"}), json!({"type": "text-start", "id": "t"})];
        for i in 0..DELTAS {
            chunks.push(json!({"type": "text-delta", "id": "t", "delta": format!("flood {i}\n")}));
            if i % (DELTAS / TOOL_CALLS) == 0 {
                let call = format!("call-{i}");
                chunks.push(
                    json!({"type": "tool-input-start", "toolCallId": call, "toolName": "execute", "dynamic": true}),
                );
                chunks.push(json!({"type": "tool-input-available", "toolCallId": call, "toolName": "execute", "dynamic": true, "input": {"i": i}}));
                chunks.push(json!({"type": "tool-output-available", "toolCallId": call, "output": i}));
                chunks.push(json!({"type": "data-acp-plan", "id": format!("plan-{}", i % 7), "data": {"i": i}}));
            }
        }
        chunks.push(json!({"type": "text-end", "id": "t"}));
        let started = std::time::Instant::now();
        let parts = assemble(&chunks);
        let took = started.elapsed();
        println!("folded {} chunks into {} parts in {took:?}", chunks.len(), parts.len());

        assert_eq!(parts.len(), 2 + TOOL_CALLS + 7);
        let text = parts[1]["text"].as_str().expect("text");
        let expected_len: usize = (0..DELTAS).map(|i| format!("flood {i}\n").len()).sum();
        assert_eq!((text.len(), parts[1]["state"].clone()), (expected_len, json!("done")));
        assert!(text.starts_with("flood 0\nflood 1\n") && text.ends_with("flood 199999\n"));
        let tools: Vec<&Value> = parts.iter().filter(|p| p["type"] == "dynamic-tool").collect();
        assert_eq!(tools.len(), TOOL_CALLS);
        assert!(
            tools
                .iter()
                .all(|t| t["state"] == "output-available" && t["output"] == t["input"]["i"])
        );
        let plan_0 = parts.iter().find(|p| p["id"] == "plan-0").expect("plan-0");
        assert_eq!(
            plan_0["data"]["i"], 199_990,
            "a data part with an id keeps its last data"
        );
        assert!(
            took < std::time::Duration::from_secs(20),
            "the fold took {took:?}: is it quadratic again?"
        );
    }
}
