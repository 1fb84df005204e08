//! What the host accepts of a turn's stream from the sandbox (DESIGN §9 invariants 6 and 9). The
//! driver's SSE events are parsed into [`UiChunk`]s of the agent's own kinds only — text, reasoning,
//! steps, tool calls and `data-acp-*` — and written out again from the type, so no key, kind or value
//! the host did not understand reaches the store or a client. The chunks that are sortie's word
//! (`start`, `finish`, `error`, `message-metadata` and every `data-sortie-*`) are the host's alone: a
//! sandbox's copy is refused. [`AgentStream`] also keeps the stream well formed for AI SDK clients, which
//! throw on a delta of a block never opened or an output of a tool never announced: such chunks are
//! refused too, and [`AgentStream::close`] ends whatever the sandbox left open.
//!
//! Pure: bytes in, chunks out.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use crate::chunk::UiChunk;

/// The longest id of a text or reasoning block, tool call or data part.
pub const ID_MAX_BYTES: usize = 256;
/// The longest tool name (ACP's tool kind).
pub const TOOL_NAME_MAX_BYTES: usize = 128;
/// The longest tool title.
pub const TITLE_MAX_BYTES: usize = 4096;
/// The longest timestamp in `providerMetadata.sortie`.
pub const TIMESTAMP_MAX_BYTES: usize = 64;
/// The longest name of a `data-acp-*` part, `acp-` included.
pub const DATA_NAME_MAX_BYTES: usize = 64;

/// Why a chunk of the sandbox's stream was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChunkRefusal {
    #[error("not a JSON object with a string `type`")]
    NotAChunk,
    #[error("`{0}` is the host's to write, not the sandbox's")]
    HostOnly(String),
    #[error("unknown chunk type `{0}`")]
    UnknownType(String),
    #[error("`{kind}` lacks a valid `{field}`")]
    Malformed { kind: String, field: &'static str },
    #[error("`{kind}` for `{id}`, which is not open")]
    NotOpen { kind: String, id: String },
    #[error("a tool output for call `{0}`, which was never announced")]
    UnknownTool(String),
}

/// The state of one turn's agent stream: which blocks are open, which tool calls are known and done.
#[derive(Debug, Default)]
pub struct AgentStream {
    open_text: BTreeSet<String>,
    open_reasoning: BTreeSet<String>,
    /// Tool call id → whether its output came.
    tools: BTreeMap<String, ToolCall>,
    step_open: bool,
}

#[derive(Debug)]
struct ToolCall {
    finished: bool,
    at: Option<String>,
}

fn string_field(
    object: &Map<String, Value>,
    field: &'static str,
    max: usize,
    kind: &str,
) -> Result<String, ChunkRefusal> {
    match object.get(field).and_then(Value::as_str) {
        Some(text) if !text.is_empty() && text.len() <= max => Ok(text.to_owned()),
        _ => Err(ChunkRefusal::Malformed {
            kind: kind.to_owned(),
            field,
        }),
    }
}

fn optional_string(
    object: &Map<String, Value>,
    field: &'static str,
    max: usize,
    kind: &str,
) -> Result<Option<String>, ChunkRefusal> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) if text.len() <= max => Ok(Some(text.clone())),
        Some(_) => Err(ChunkRefusal::Malformed {
            kind: kind.to_owned(),
            field,
        }),
    }
}

/// `providerMetadata.sortie.{at,endedAt}`, when present and short; anything else there is dropped.
fn span(object: &Map<String, Value>) -> (Option<String>, Option<String>) {
    let sortie = object
        .get("providerMetadata")
        .and_then(|m| m.get("sortie"))
        .and_then(Value::as_object);
    let stamp = |key: &str| {
        sortie
            .and_then(|s| s.get(key))
            .and_then(Value::as_str)
            .filter(|t| t.len() <= TIMESTAMP_MAX_BYTES)
            .map(str::to_owned)
    };
    (stamp("at"), stamp("endedAt"))
}

/// Whether `name` (after `data-`) is one of the agent's data parts: `acp-` and lowercase words.
fn is_agent_data_name(name: &str) -> bool {
    name.len() <= DATA_NAME_MAX_BYTES
        && name.strip_prefix("acp-").is_some_and(|rest| {
            !rest.is_empty()
                && rest
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl AgentStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses one event's data and, if the host takes it, returns the chunk to store (written out
    /// again from its type) after updating the stream's state.
    pub fn admit(&mut self, json: &str) -> Result<UiChunk, ChunkRefusal> {
        let value: Value = serde_json::from_str(json).map_err(|_| ChunkRefusal::NotAChunk)?;
        let Value::Object(object) = value else {
            return Err(ChunkRefusal::NotAChunk);
        };
        let kind = object
            .get("type")
            .and_then(Value::as_str)
            .ok_or(ChunkRefusal::NotAChunk)?
            .to_owned();
        let chunk = self.parse(&kind, &object)?;
        self.apply(&chunk);
        Ok(chunk)
    }

    fn parse(&self, kind: &str, object: &Map<String, Value>) -> Result<UiChunk, ChunkRefusal> {
        let id = || string_field(object, "id", ID_MAX_BYTES, kind);
        let call_id = || string_field(object, "toolCallId", ID_MAX_BYTES, kind);
        let not_open = |id: String| ChunkRefusal::NotOpen {
            kind: kind.to_owned(),
            id,
        };
        let delta = || match object.get("delta") {
            Some(Value::String(delta)) => Ok(delta.clone()),
            _ => Err(ChunkRefusal::Malformed {
                kind: kind.to_owned(),
                field: "delta",
            }),
        };
        Ok(match kind {
            "start-step" => UiChunk::StartStep,
            "finish-step" => UiChunk::FinishStep,
            "text-start" => UiChunk::TextStart {
                id: id()?,
                at: span(object).0,
            },
            "reasoning-start" => UiChunk::ReasoningStart {
                id: id()?,
                at: span(object).0,
            },
            "text-delta" => {
                let id = id()?;
                if !self.open_text.contains(&id) {
                    return Err(not_open(id));
                }
                UiChunk::TextDelta { id, delta: delta()? }
            }
            "reasoning-delta" => {
                let id = id()?;
                if !self.open_reasoning.contains(&id) {
                    return Err(not_open(id));
                }
                UiChunk::ReasoningDelta { id, delta: delta()? }
            }
            "text-end" => {
                let id = id()?;
                if !self.open_text.contains(&id) {
                    return Err(not_open(id));
                }
                UiChunk::TextEnd { id }
            }
            "reasoning-end" => {
                let id = id()?;
                if !self.open_reasoning.contains(&id) {
                    return Err(not_open(id));
                }
                let (at, ended_at) = span(object);
                UiChunk::ReasoningEnd { id, at, ended_at }
            }
            "tool-input-start" => UiChunk::ToolInputStart {
                tool_call_id: call_id()?,
                tool_name: string_field(object, "toolName", TOOL_NAME_MAX_BYTES, kind)?,
                title: optional_string(object, "title", TITLE_MAX_BYTES, kind)?,
                at: span(object).0,
            },
            "tool-input-available" => UiChunk::ToolInputAvailable {
                tool_call_id: call_id()?,
                tool_name: string_field(object, "toolName", TOOL_NAME_MAX_BYTES, kind)?,
                title: optional_string(object, "title", TITLE_MAX_BYTES, kind)?,
                input: object.get("input").cloned().unwrap_or(Value::Null),
            },
            "tool-output-available" | "tool-output-error" => {
                let tool_call_id = call_id()?;
                if !self.tools.contains_key(&tool_call_id) {
                    return Err(ChunkRefusal::UnknownTool(tool_call_id));
                }
                let (at, ended_at) = span(object);
                if kind == "tool-output-available" {
                    UiChunk::ToolOutputAvailable {
                        tool_call_id,
                        output: object.get("output").cloned().unwrap_or(Value::Null),
                        at,
                        ended_at,
                    }
                } else {
                    UiChunk::ToolOutputError {
                        tool_call_id,
                        error_text: match object.get("errorText") {
                            Some(Value::String(text)) => text.clone(),
                            _ => {
                                return Err(ChunkRefusal::Malformed {
                                    kind: kind.to_owned(),
                                    field: "errorText",
                                });
                            }
                        },
                        at,
                        ended_at,
                    }
                }
            }
            "start" | "finish" | "error" | "message-metadata" | "abort" => {
                return Err(ChunkRefusal::HostOnly(kind.to_owned()));
            }
            data if data.starts_with("data-") => {
                let name = &data["data-".len()..];
                if name.starts_with("sortie-") {
                    return Err(ChunkRefusal::HostOnly(kind.to_owned()));
                }
                if !is_agent_data_name(name) {
                    return Err(ChunkRefusal::UnknownType(kind.to_owned()));
                }
                UiChunk::Data {
                    name: name.to_owned(),
                    id: optional_string(object, "id", ID_MAX_BYTES, kind)?.filter(|id| !id.is_empty()),
                    data: object.get("data").cloned().unwrap_or(Value::Null),
                    transient: object.get("transient") == Some(&Value::Bool(true)),
                }
            }
            other => return Err(ChunkRefusal::UnknownType(other.to_owned())),
        })
    }

    fn apply(&mut self, chunk: &UiChunk) {
        match chunk {
            UiChunk::StartStep => self.step_open = true,
            UiChunk::FinishStep => self.step_open = false,
            UiChunk::TextStart { id, .. } => {
                self.open_text.insert(id.clone());
            }
            UiChunk::ReasoningStart { id, .. } => {
                self.open_reasoning.insert(id.clone());
            }
            UiChunk::TextEnd { id } => {
                self.open_text.remove(id);
            }
            UiChunk::ReasoningEnd { id, .. } => {
                self.open_reasoning.remove(id);
            }
            UiChunk::ToolInputStart { tool_call_id, at, .. } => {
                self.tools.entry(tool_call_id.clone()).or_insert(ToolCall {
                    finished: false,
                    at: at.clone(),
                });
            }
            UiChunk::ToolInputAvailable { tool_call_id, .. } => {
                self.tools.entry(tool_call_id.clone()).or_insert(ToolCall {
                    finished: false,
                    at: None,
                });
            }
            UiChunk::ToolOutputAvailable { tool_call_id, .. } | UiChunk::ToolOutputError { tool_call_id, .. } => {
                if let Some(tool) = self.tools.get_mut(tool_call_id) {
                    tool.finished = true;
                }
            }
            _ => {}
        }
    }

    /// The chunks that end what the sandbox left open — blocks, tool calls without an output, an open
    /// step — so the host's `finish` closes a well-formed message. `ended_at` stamps the tools' ends.
    pub fn close(&mut self, ended_at: Option<&str>) -> Vec<UiChunk> {
        let mut out = Vec::new();
        for id in std::mem::take(&mut self.open_reasoning) {
            out.push(UiChunk::ReasoningEnd {
                id,
                at: None,
                ended_at: ended_at.map(str::to_owned),
            });
        }
        for id in std::mem::take(&mut self.open_text) {
            out.push(UiChunk::TextEnd { id });
        }
        for (tool_call_id, tool) in &mut self.tools {
            if !tool.finished {
                tool.finished = true;
                out.push(UiChunk::ToolOutputError {
                    tool_call_id: tool_call_id.clone(),
                    error_text: "the turn ended before the tool finished".into(),
                    at: tool.at.clone(),
                    ended_at: ended_at.map(str::to_owned),
                });
            }
        }
        if self.step_open {
            self.step_open = false;
            out.push(UiChunk::FinishStep);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn admit(stream: &mut AgentStream, chunk: Value) -> Result<Value, ChunkRefusal> {
        stream
            .admit(&chunk.to_string())
            .map(|chunk| serde_json::from_str(&chunk.to_json()).expect("json"))
    }

    #[test]
    fn the_agents_own_chunks_pass_as_the_schema_writes_them() {
        let mut stream = AgentStream::new();
        for (chunk, expected) in [
            (json!({"type": "start-step"}), json!({"type": "start-step"})),
            (
                json!({"type": "text-start", "id": "t", "extra": 1, "providerMetadata": {"sortie": {"at": "x", "evil": 2}, "other": 3}}),
                json!({"type": "text-start", "id": "t", "providerMetadata": {"sortie": {"at": "x"}}}),
            ),
            (
                json!({"type": "text-delta", "id": "t", "delta": "hi"}),
                json!({"type": "text-delta", "id": "t", "delta": "hi"}),
            ),
            (
                json!({"type": "text-end", "id": "t"}),
                json!({"type": "text-end", "id": "t"}),
            ),
            (
                json!({"type": "tool-input-start", "toolCallId": "c", "toolName": "edit", "dynamic": true}),
                json!({"type": "tool-input-start", "toolCallId": "c", "toolName": "edit", "dynamic": true}),
            ),
            (
                json!({"type": "tool-output-available", "toolCallId": "c", "output": {"a": 1}}),
                json!({"type": "tool-output-available", "toolCallId": "c", "output": {"a": 1}}),
            ),
            (
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": []}}),
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": []}}),
            ),
            (
                json!({"type": "data-acp-commands", "data": null, "transient": true}),
                json!({"type": "data-acp-commands", "data": null, "transient": true}),
            ),
            (json!({"type": "finish-step"}), json!({"type": "finish-step"})),
        ] {
            assert_eq!(admit(&mut stream, chunk.clone()), Ok(expected), "{chunk}");
        }
    }

    #[test]
    fn sorties_own_chunks_are_refused_from_the_sandbox() {
        let mut stream = AgentStream::new();
        for chunk in [
            json!({"type": "data-sortie-delivery", "id": "delivery", "data": {"pushed": true, "prUrl": "https://evil.example"}}),
            json!({"type": "data-sortie-usage", "data": {}}),
            json!({"type": "data-sortie-phase", "data": {}, "transient": true}),
            json!({"type": "start", "messageId": "ses_other-t1"}),
            json!({"type": "finish"}),
            json!({"type": "error", "errorText": "fake"}),
            json!({"type": "message-metadata", "messageMetadata": {}}),
        ] {
            assert!(
                matches!(admit(&mut stream, chunk.clone()), Err(ChunkRefusal::HostOnly(_))),
                "{chunk}"
            );
        }
    }

    #[test]
    fn malformed_or_unknown_chunks_are_refused() {
        let mut stream = AgentStream::new();
        let long_id = "i".repeat(ID_MAX_BYTES + 1);
        for chunk in [
            json!([1]),
            json!({"no": "type"}),
            json!({"type": "tool-input-delta", "toolCallId": "c"}),
            json!({"type": "data-other", "data": 1}),
            json!({"type": "data-acp-", "data": 1}),
            json!({"type": "data-acp-Plan", "data": 1}),
            json!({"type": "text-start"}),
            json!({"type": "text-start", "id": ""}),
            json!({"type": "text-start", "id": long_id}),
            json!({"type": "tool-input-start", "toolCallId": "c"}),
            json!({"type": "tool-input-available", "toolCallId": "c", "toolName": "x", "title": 5}),
        ] {
            assert!(admit(&mut stream, chunk.clone()).is_err(), "{chunk}");
        }
        assert_eq!(stream.admit("not json"), Err(ChunkRefusal::NotAChunk));
    }

    #[test]
    fn deltas_ends_and_outputs_need_what_they_refer_to() {
        let mut stream = AgentStream::new();
        assert!(matches!(
            admit(&mut stream, json!({"type": "text-delta", "id": "t", "delta": "x"})),
            Err(ChunkRefusal::NotOpen { .. })
        ));
        assert!(matches!(
            admit(&mut stream, json!({"type": "reasoning-end", "id": "r"})),
            Err(ChunkRefusal::NotOpen { .. })
        ));
        assert!(matches!(
            admit(
                &mut stream,
                json!({"type": "tool-output-error", "toolCallId": "c", "errorText": "e"})
            ),
            Err(ChunkRefusal::UnknownTool(_))
        ));
        // Reasoning and text ids are separate: an open text block does not open a reasoning one.
        admit(&mut stream, json!({"type": "text-start", "id": "b"})).expect("start");
        assert!(admit(&mut stream, json!({"type": "reasoning-delta", "id": "b", "delta": "x"})).is_err());
        admit(&mut stream, json!({"type": "text-end", "id": "b"})).expect("end");
        assert!(admit(&mut stream, json!({"type": "text-delta", "id": "b", "delta": "x"})).is_err());
    }

    #[test]
    fn close_ends_what_was_left_open() {
        let mut stream = AgentStream::new();
        for chunk in [
            json!({"type": "start-step"}),
            json!({"type": "reasoning-start", "id": "r"}),
            json!({"type": "text-start", "id": "t"}),
            json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "execute", "providerMetadata": {"sortie": {"at": "a"}}}),
            json!({"type": "tool-input-start", "toolCallId": "c2", "toolName": "edit"}),
            json!({"type": "tool-output-available", "toolCallId": "c2", "output": null}),
        ] {
            admit(&mut stream, chunk).expect("admit");
        }
        let closing: Vec<Value> = stream
            .close(Some("b"))
            .iter()
            .map(|c| serde_json::from_str(&c.to_json()).expect("json"))
            .collect();
        assert_eq!(
            closing,
            vec![
                json!({"type": "reasoning-end", "id": "r", "providerMetadata": {"sortie": {"endedAt": "b"}}}),
                json!({"type": "text-end", "id": "t"}),
                json!({"type": "tool-output-error", "toolCallId": "c1", "errorText": "the turn ended before the tool finished",
                    "providerMetadata": {"sortie": {"at": "a", "endedAt": "b"}}}),
                json!({"type": "finish-step"}),
            ]
        );
        assert!(stream.close(None).is_empty(), "closing twice adds nothing");
    }
}
