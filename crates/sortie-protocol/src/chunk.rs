//! AI SDK UI message stream chunks (DESIGN §5.1, `ref/ui-message-stream.md`): only the core set every
//! AI SDK 5/6/7 client accepts, serialized exactly as the SDK's schema wants them: camelCase keys, an
//! absent optional key left out (never `null`), `input`/`output`/`data` always present, provider
//! metadata two levels deep.

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};
use serde_json::Value;

/// One chunk of an assistant message's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum UiChunk {
    /// Opens the message; `message_id` is stable per turn (`<session>-t<n>`).
    Start {
        message_id: String,
        metadata: Option<Value>,
    },
    /// Opens a step (the client adds a `step-start` part).
    StartStep,
    /// Closes a step.
    FinishStep,
    TextStart {
        id: String,
        at: Option<String>,
    },
    TextDelta {
        id: String,
        delta: String,
    },
    TextEnd {
        id: String,
    },
    ReasoningStart {
        id: String,
        at: Option<String>,
    },
    ReasoningDelta {
        id: String,
        delta: String,
    },
    /// `at` repeats the block's start (clients replace a reasoning part's metadata with the end's);
    /// `ended_at` is when it ended: together, how long the agent thought.
    ReasoningEnd {
        id: String,
        at: Option<String>,
        ended_at: Option<String>,
    },
    /// An agent tool call begins (always `dynamic`: agents bring their own tools).
    ToolInputStart {
        tool_call_id: String,
        tool_name: String,
        title: Option<String>,
        at: Option<String>,
    },
    /// The tool call's input is known (sent again when it changes).
    ToolInputAvailable {
        tool_call_id: String,
        tool_name: String,
        title: Option<String>,
        input: Value,
    },
    /// `at` (the call's start) and `ended_at` time the call.
    ToolOutputAvailable {
        tool_call_id: String,
        output: Value,
        at: Option<String>,
        ended_at: Option<String>,
    },
    ToolOutputError {
        tool_call_id: String,
        error_text: String,
        at: Option<String>,
        ended_at: Option<String>,
    },
    /// `data-<name>`: everything of ours. Same `name` and `id` replace each other in place.
    Data {
        name: String,
        id: Option<String>,
        data: Value,
        transient: bool,
    },
    MessageMetadata {
        metadata: Value,
    },
    /// Ends the message; `finish_reason` is one of stop, length, content-filter, tool-calls, error, other.
    Finish {
        finish_reason: &'static str,
        metadata: Option<Value>,
    },
    /// A fatal turn failure (it stops useChat; a `finish` follows for other clients).
    Error {
        error_text: String,
    },
}

impl UiChunk {
    /// The chunk's `type` on the wire.
    pub fn kind(&self) -> std::borrow::Cow<'static, str> {
        use std::borrow::Cow::{Borrowed, Owned};
        match self {
            Self::Start { .. } => Borrowed("start"),
            Self::StartStep => Borrowed("start-step"),
            Self::FinishStep => Borrowed("finish-step"),
            Self::TextStart { .. } => Borrowed("text-start"),
            Self::TextDelta { .. } => Borrowed("text-delta"),
            Self::TextEnd { .. } => Borrowed("text-end"),
            Self::ReasoningStart { .. } => Borrowed("reasoning-start"),
            Self::ReasoningDelta { .. } => Borrowed("reasoning-delta"),
            Self::ReasoningEnd { .. } => Borrowed("reasoning-end"),
            Self::ToolInputStart { .. } => Borrowed("tool-input-start"),
            Self::ToolInputAvailable { .. } => Borrowed("tool-input-available"),
            Self::ToolOutputAvailable { .. } => Borrowed("tool-output-available"),
            Self::ToolOutputError { .. } => Borrowed("tool-output-error"),
            Self::Data { name, .. } => Owned(format!("data-{name}")),
            Self::MessageMetadata { .. } => Borrowed("message-metadata"),
            Self::Finish { .. } => Borrowed("finish"),
            Self::Error { .. } => Borrowed("error"),
        }
    }

    /// The chunk as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| r#"{"type":"error","errorText":"unencodable chunk"}"#.to_owned())
    }
}

/// `providerMetadata` of a chunk: `{"sortie": {"at"?, "endedAt"?}}`.
#[derive(Serialize)]
struct ProviderMetadata<'a> {
    sortie: Span<'a>,
}

/// When a block started and, for a chunk that ends it, when it ended.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Span<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    at: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ended_at: Option<&'a str>,
}

fn provider_metadata(at: &str) -> ProviderMetadata<'_> {
    ProviderMetadata {
        sortie: Span {
            at: Some(at),
            ended_at: None,
        },
    }
}

/// `providerMetadata` of a chunk that ends something: its start again and its end, when known.
fn span_metadata<'a>(at: Option<&'a String>, ended_at: Option<&'a String>) -> Option<ProviderMetadata<'a>> {
    (at.is_some() || ended_at.is_some()).then(|| ProviderMetadata {
        sortie: Span {
            at: at.map(String::as_str),
            ended_at: ended_at.map(String::as_str),
        },
    })
}

/// A turn's `finish.messageMetadata`: `{"sortie": {"stopReason"}}` or `{"sortie": {"failure"}}`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FinishMetadata<F> {
    pub sortie: FinishNote<F>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FinishNote<F> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<F>,
}

impl<F: Serialize> FinishMetadata<F> {
    /// The agent ended the turn with `stop_reason` (ACP's, e.g. `end_turn`).
    pub fn stopped(stop_reason: impl Into<String>) -> Self {
        Self {
            sortie: FinishNote {
                stop_reason: Some(stop_reason.into()),
                failure: None,
            },
        }
    }

    /// The turn failed with `code`.
    pub fn failed(code: F) -> Self {
        Self {
            sortie: FinishNote {
                stop_reason: None,
                failure: Some(code),
            },
        }
    }

    /// As the chunk carries it. A code and a string: encoding cannot fail.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

impl Serialize for UiChunk {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("type", &self.kind())?;
        match self {
            Self::Start { message_id, metadata } => {
                map.serialize_entry("messageId", message_id)?;
                if let Some(metadata) = metadata {
                    map.serialize_entry("messageMetadata", metadata)?;
                }
            }
            Self::StartStep | Self::FinishStep => {}
            Self::TextStart { id, at } | Self::ReasoningStart { id, at } => {
                map.serialize_entry("id", id)?;
                if let Some(at) = at {
                    map.serialize_entry("providerMetadata", &provider_metadata(at))?;
                }
            }
            Self::TextDelta { id, delta } | Self::ReasoningDelta { id, delta } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("delta", delta)?;
            }
            Self::TextEnd { id } => map.serialize_entry("id", id)?,
            Self::ReasoningEnd { id, at, ended_at } => {
                map.serialize_entry("id", id)?;
                if let Some(metadata) = span_metadata(at.as_ref(), ended_at.as_ref()) {
                    map.serialize_entry("providerMetadata", &metadata)?;
                }
            }
            Self::ToolInputStart {
                tool_call_id,
                tool_name,
                title,
                at,
            } => {
                map.serialize_entry("toolCallId", tool_call_id)?;
                map.serialize_entry("toolName", tool_name)?;
                map.serialize_entry("dynamic", &true)?;
                if let Some(title) = title {
                    map.serialize_entry("title", title)?;
                }
                if let Some(at) = at {
                    map.serialize_entry("providerMetadata", &provider_metadata(at))?;
                }
            }
            Self::ToolInputAvailable {
                tool_call_id,
                tool_name,
                title,
                input,
            } => {
                map.serialize_entry("toolCallId", tool_call_id)?;
                map.serialize_entry("toolName", tool_name)?;
                map.serialize_entry("dynamic", &true)?;
                if let Some(title) = title {
                    map.serialize_entry("title", title)?;
                }
                map.serialize_entry("input", input)?;
            }
            Self::ToolOutputAvailable {
                tool_call_id,
                output,
                at,
                ended_at,
            } => {
                map.serialize_entry("toolCallId", tool_call_id)?;
                map.serialize_entry("output", output)?;
                if let Some(metadata) = span_metadata(at.as_ref(), ended_at.as_ref()) {
                    map.serialize_entry("providerMetadata", &metadata)?;
                }
            }
            Self::ToolOutputError {
                tool_call_id,
                error_text,
                at,
                ended_at,
            } => {
                map.serialize_entry("toolCallId", tool_call_id)?;
                map.serialize_entry("errorText", error_text)?;
                if let Some(metadata) = span_metadata(at.as_ref(), ended_at.as_ref()) {
                    map.serialize_entry("providerMetadata", &metadata)?;
                }
            }
            Self::Data {
                id, data, transient, ..
            } => {
                if let Some(id) = id {
                    map.serialize_entry("id", id)?;
                }
                map.serialize_entry("data", data)?;
                if *transient {
                    map.serialize_entry("transient", &true)?;
                }
            }
            Self::MessageMetadata { metadata } => map.serialize_entry("messageMetadata", metadata)?,
            Self::Finish {
                finish_reason,
                metadata,
            } => {
                map.serialize_entry("finishReason", finish_reason)?;
                if let Some(metadata) = metadata {
                    map.serialize_entry("messageMetadata", metadata)?;
                }
            }
            Self::Error { error_text } => map.serialize_entry("errorText", error_text)?,
        }
        map.end()
    }
}

/// Appends one SSE event carrying `json` with event id `index` (the part's index in its turn).
pub fn write_sse_event(out: &mut Vec<u8>, index: u64, json: &str) {
    out.extend_from_slice(b"id: ");
    out.extend_from_slice(index.to_string().as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The SSE line that ends every stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// The response headers of every UI message stream.
pub const STREAM_HEADERS: [(&str, &str); 4] = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-vercel-ai-ui-message-stream", "v1"),
    ("x-accel-buffering", "no"),
];

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn chunks_serialize_exactly_as_the_sdk_schema_wants() {
        let cases = [
            (
                UiChunk::Start {
                    message_id: "ses_x-t1".into(),
                    metadata: None,
                },
                json!({"type": "start", "messageId": "ses_x-t1"}),
            ),
            (UiChunk::StartStep, json!({"type": "start-step"})),
            (
                UiChunk::TextStart {
                    id: "t0".into(),
                    at: Some("2026-12-02T00:00:00.000Z".into()),
                },
                json!({"type": "text-start", "id": "t0", "providerMetadata": {"sortie": {"at": "2026-12-02T00:00:00.000Z"}}}),
            ),
            (
                UiChunk::TextStart {
                    id: "t0".into(),
                    at: None,
                },
                json!({"type": "text-start", "id": "t0"}),
            ),
            (
                UiChunk::ReasoningDelta {
                    id: "r0".into(),
                    delta: "hm".into(),
                },
                json!({"type": "reasoning-delta", "id": "r0", "delta": "hm"}),
            ),
            (
                UiChunk::ToolInputStart {
                    tool_call_id: "c".into(),
                    tool_name: "edit".into(),
                    title: None,
                    at: None,
                },
                json!({"type": "tool-input-start", "toolCallId": "c", "toolName": "edit", "dynamic": true}),
            ),
            (
                UiChunk::ToolInputAvailable {
                    tool_call_id: "c".into(),
                    tool_name: "edit".into(),
                    title: Some("Write".into()),
                    input: Value::Null,
                },
                json!({"type": "tool-input-available", "toolCallId": "c", "toolName": "edit", "dynamic": true, "title": "Write", "input": null}),
            ),
            (
                UiChunk::ToolOutputAvailable {
                    tool_call_id: "c".into(),
                    output: Value::Null,
                    at: None,
                    ended_at: None,
                },
                json!({"type": "tool-output-available", "toolCallId": "c", "output": null}),
            ),
            (
                UiChunk::ToolOutputError {
                    tool_call_id: "c".into(),
                    error_text: "exit 1".into(),
                    at: Some("2026-01-01T00:00:00.000Z".into()),
                    ended_at: Some("2026-01-01T00:00:02.500Z".into()),
                },
                json!({"type": "tool-output-error", "toolCallId": "c", "errorText": "exit 1",
                    "providerMetadata": {"sortie": {"at": "2026-01-01T00:00:00.000Z", "endedAt": "2026-01-01T00:00:02.500Z"}}}),
            ),
            (
                UiChunk::ReasoningEnd {
                    id: "r0".into(),
                    at: Some("2026-01-01T00:00:00.000Z".into()),
                    ended_at: None,
                },
                json!({"type": "reasoning-end", "id": "r0", "providerMetadata": {"sortie": {"at": "2026-01-01T00:00:00.000Z"}}}),
            ),
            (
                UiChunk::Data {
                    name: "acp-plan".into(),
                    id: Some("plan".into()),
                    data: json!({"entries": []}),
                    transient: false,
                },
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": []}}),
            ),
            (
                UiChunk::Data {
                    name: "acp-commands".into(),
                    id: None,
                    data: Value::Null,
                    transient: true,
                },
                json!({"type": "data-acp-commands", "data": null, "transient": true}),
            ),
            (
                UiChunk::Finish {
                    finish_reason: "stop",
                    metadata: None,
                },
                json!({"type": "finish", "finishReason": "stop"}),
            ),
            (
                UiChunk::Error {
                    error_text: "boom".into(),
                },
                json!({"type": "error", "errorText": "boom"}),
            ),
        ];
        for (chunk, expected) in cases {
            let encoded: Value = serde_json::from_str(&chunk.to_json()).expect("json");
            assert_eq!(encoded, expected);
        }
    }

    #[test]
    fn sse_events_carry_the_part_index() {
        let mut out = Vec::new();
        write_sse_event(&mut out, 7, r#"{"type":"start-step"}"#);
        out.extend_from_slice(SSE_DONE);
        assert_eq!(
            String::from_utf8_lossy(&out),
            "id: 7\ndata: {\"type\":\"start-step\"}\n\ndata: [DONE]\n\n"
        );
    }
}
