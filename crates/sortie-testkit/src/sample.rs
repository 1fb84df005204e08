//! Requests shaped like the agents' (the parts the fakes read), to drive a [`crate::FakeVendor`]
//! directly or through a proxy in front of it.

use serde_json::{Value, json};

use crate::{ToolCall, VendorKind};

/// Where in a turn a sample request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnStep {
    /// The user's prompt, the tools offered: the fake calls the tool.
    Start,
    /// The tool's result: the fake answers text and ends the turn.
    ToolResult,
    /// No tools offered (a title request): the fake answers text.
    Side,
}

/// A request: path (with query, from the API's root) and JSON body.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleRequest {
    pub path: String,
    pub body: Value,
}

/// The model sample requests name.
pub fn model(kind: VendorKind) -> &'static str {
    match kind {
        VendorKind::Anthropic => "claude-sonnet-4-5",
        VendorKind::OpenAi => "gpt-5.5",
        VendorKind::Gemini => "gemini-2.5-pro",
    }
}

/// A request at `step` of a turn that writes with `tool`, streamed (SSE) or not.
pub fn request(kind: VendorKind, tool: &ToolCall, step: TurnStep, stream: bool) -> SampleRequest {
    let prompt = "create hello.txt";
    let offered = step != TurnStep::Side;
    match kind {
        VendorKind::Anthropic => {
            let mut messages = vec![json!({ "role": "user", "content": [{ "type": "text", "text": prompt }] })];
            if step == TurnStep::ToolResult {
                messages.push(json!({ "role": "assistant", "content": [
                    { "type": "tool_use", "id": "toolu_fake_1", "name": tool.name, "input": tool.arguments }] }));
                messages.push(json!({ "role": "user", "content": [
                    { "type": "tool_result", "tool_use_id": "toolu_fake_1", "content": "File created" }] }));
            }
            let tools = if offered {
                json!([{ "name": tool.name, "description": "Write a file", "input_schema": { "type": "object" } }])
            } else {
                json!([])
            };
            SampleRequest {
                path: "/v1/messages?beta=true".to_owned(),
                body: json!({ "model": model(kind), "max_tokens": 32000, "stream": stream,
                              "messages": messages, "tools": tools }),
            }
        }
        VendorKind::OpenAi => {
            let mut input = vec![json!({ "type": "message", "role": "user",
                                         "content": [{ "type": "input_text", "text": prompt }] })];
            if step == TurnStep::ToolResult {
                input.push(
                    json!({ "type": "function_call", "call_id": "call_fake_1", "name": tool.name,
                                   "arguments": tool.arguments.to_string() }),
                );
                input.push(json!({ "type": "function_call_output", "call_id": "call_fake_1", "output": "ok" }));
            }
            let tools = if offered {
                json!([{ "type": "function", "name": tool.name, "parameters": { "type": "object" } }])
            } else {
                json!([])
            };
            SampleRequest {
                path: "/v1/responses".to_owned(),
                body: json!({ "model": model(kind), "stream": stream, "input": input, "tools": tools }),
            }
        }
        VendorKind::Gemini => {
            let mut contents = vec![json!({ "role": "user", "parts": [{ "text": prompt }] })];
            if step == TurnStep::ToolResult {
                contents.push(json!({ "role": "model", "parts": [
                    { "functionCall": { "name": tool.name, "args": tool.arguments } }] }));
                contents.push(json!({ "role": "user", "parts": [
                    { "functionResponse": { "name": tool.name, "response": { "output": "ok" } } }] }));
            }
            let mut body = json!({ "contents": contents });
            if offered {
                body["tools"] = json!([{ "functionDeclarations": [{ "name": tool.name }] }]);
            }
            let method = if stream {
                "streamGenerateContent?alt=sse"
            } else {
                "generateContent"
            };
            SampleRequest {
                path: format!("/v1beta/models/{}:{method}", model(kind)),
                body,
            }
        }
    }
}
