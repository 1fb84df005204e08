//! Folding a turn's stored UI message chunks into the parts of one AI SDK `UIMessage`, the way the
//! AI SDK client does it (`process-ui-message-stream`): text and reasoning blocks are concatenated,
//! tool chunks are merged into one `dynamic-tool` part per call, `data-*` chunks with the same type and
//! id replace each other in place, transient ones are dropped, `start-step` becomes `step-start`.

use serde_json::{Map, Value, json};

/// The parts of the assistant message that `chunks` (in part order) build.
pub fn assemble_parts<'a>(chunks: impl IntoIterator<Item = &'a Value>) -> Vec<Value> {
    let mut parts: Vec<Value> = Vec::new();
    let mut open_text: Map<String, Value> = Map::new();
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
                let Some(index) = open_text
                    .get(&key)
                    .and_then(Value::as_u64)
                    .and_then(|i| usize::try_from(i).ok())
                else {
                    continue;
                };
                let Some(part) = parts.get_mut(index) else {
                    continue;
                };
                if let Some(delta) = chunk["delta"].as_str() {
                    let text = format!("{}{delta}", part["text"].as_str().unwrap_or_default());
                    part["text"] = json!(text);
                }
                if kind.ends_with("-end") {
                    part["state"] = json!("done");
                    // An end's metadata (its start again, and its end) replaces the start's, as clients do.
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
            // start, finish, finish-step, message-metadata, error and abort carry no part.
            _ => {}
        }
    }
    parts
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
}
