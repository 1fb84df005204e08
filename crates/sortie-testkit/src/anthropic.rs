//! Anthropic Messages: `POST …/messages`, a `message` JSON or the SSE events `message_start`, `ping`,
//! `content_block_start`/`_delta`/`_stop`, `message_delta` (stop reason, cumulative output tokens)
//! and `message_stop` — the minimal stream Claude Code and opencode accept.

use serde_json::{Value, json};

use crate::{FakeVendorOptions, Reply, Step, halves, sse};

pub(crate) fn error(status: u16, message: &str) -> Value {
    let kind = match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    json!({ "type": "error", "error": { "type": kind, "message": message } })
}

/// Tool calls the fake makes in one conversation at most: past them it answers text whatever the
/// request looks like, so that no agent can loop on it.
const MAX_TOOL_ROUNDS: usize = 4;

/// The fake's own tool calls in the request's conversation (its earlier answers).
fn tool_rounds(options: &FakeVendorOptions, messages: &[Value]) -> usize {
    messages
        .iter()
        .filter(|message| message["role"] == "assistant")
        .flat_map(|message| message["content"].as_array().into_iter().flatten())
        .filter(|block| block["type"] == "tool_use" && block["name"] == options.tool.name.as_str())
        .count()
}

/// The id of the fake's next tool call: unique in the conversation (`toolu_fake_1` first), as a real
/// model's are — Claude Code drops a repeated `tool_use` id, and its result with it.
fn tool_use_id(options: &FakeVendorOptions, request: &Value) -> String {
    let messages = request["messages"].as_array().map_or(&[][..], Vec::as_slice);
    format!("toolu_fake_{}", tool_rounds(options, messages) + 1)
}

fn step(options: &FakeVendorOptions, request: &Value) -> Step {
    let offered = request["tools"]
        .as_array()
        .is_some_and(|tools| tools.iter().any(|tool| tool["name"] == options.tool.name.as_str()));
    let messages = request["messages"].as_array().map_or(&[][..], Vec::as_slice);
    let last = messages.last();
    let blocks = last.and_then(|message| message["content"].as_array());
    let text = match last.map(|message| &message["content"]) {
        Some(Value::String(text)) => text.clone(),
        _ => blocks
            .into_iter()
            .flatten()
            .filter_map(|block| block["text"].as_str())
            .collect(),
    };
    // The tool's result anywhere after the model's latest answer: in the last message or an earlier
    // one, before or after the agent's reminders.
    let answered = messages
        .iter()
        .rev()
        .take_while(|message| message["role"] != "assistant")
        .flat_map(|message| message["content"].as_array().into_iter().flatten())
        .any(|block| block["type"] == "tool_result");
    if answered || tool_rounds(options, messages) >= MAX_TOOL_ROUNDS {
        Step::Final
    } else if !offered || text.contains("[SUGGESTION MODE") {
        Step::Side
    } else {
        Step::Tool
    }
}

pub(crate) fn reply(options: &FakeVendorOptions, path: &str, request: &Value) -> Reply {
    if !path.ends_with("/messages") {
        return Reply::NotFound;
    }
    let step = step(options, request);
    let tool_id = tool_use_id(options, request);
    let model = options
        .model
        .clone()
        .or_else(|| request["model"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "claude-sonnet-4-5".to_owned());
    let id = format!("msg_fake_{}", step.name());
    let text = if step == Step::Final {
        &options.text
    } else {
        &options.side_text
    };
    let (block, stop_reason) = match step {
        Step::Tool => (
            json!({ "type": "tool_use", "id": tool_id, "name": options.tool.name, "input": options.tool.arguments }),
            "tool_use",
        ),
        _ => (json!({ "type": "text", "text": text }), "end_turn"),
    };
    let usage = json!({
        "input_tokens": options.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": options.output_tokens,
    });
    if request["stream"] != true {
        return Reply::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [block], "stop_reason": stop_reason, "stop_sequence": null, "usage": usage,
        }));
    }

    let event = |name: &str, data: Value| sse(Some(name), &data, "\n");
    let mut frames = vec![
        event(
            "message_start",
            json!({ "type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": options.input_tokens, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 1 },
            }}),
        ),
        event("ping", json!({ "type": "ping" })),
    ];
    let (start, deltas) = match step {
        Step::Tool => {
            let arguments = options.tool.arguments.to_string();
            let deltas = halves(&arguments)
                .into_iter()
                .map(|piece| json!({ "type": "input_json_delta", "partial_json": piece }))
                .collect::<Vec<_>>();
            (
                json!({ "type": "tool_use", "id": tool_id, "name": options.tool.name, "input": {} }),
                deltas,
            )
        }
        _ => (
            json!({ "type": "text", "text": "" }),
            halves(text)
                .into_iter()
                .map(|piece| json!({ "type": "text_delta", "text": piece }))
                .collect(),
        ),
    };
    frames.push(event(
        "content_block_start",
        json!({ "type": "content_block_start", "index": 0, "content_block": start }),
    ));
    for delta in deltas {
        frames.push(event(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0, "delta": delta }),
        ));
    }
    frames.push(event(
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": 0 }),
    ));
    frames.push(event(
        "message_delta",
        json!({ "type": "message_delta", "delta": { "stop_reason": stop_reason, "stop_sequence": null },
                "usage": { "output_tokens": options.output_tokens } }),
    ));
    frames.push(event("message_stop", json!({ "type": "message_stop" })));
    Reply::Events(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VendorKind;

    fn request(last: Value, tools: bool) -> Value {
        let tools = if tools {
            json!([{ "name": "Bash" }, { "name": "Write" }])
        } else {
            json!([])
        };
        json!({ "model": "claude-x", "messages": [{ "role": "user", "content": "hi" }, last], "tools": tools })
    }

    #[test]
    fn steps() {
        let options = FakeVendorOptions::new(VendorKind::Anthropic);
        let user = json!({ "role": "user", "content": [{ "type": "text", "text": "create hello.txt" }] });
        let result = json!({ "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "toolu_fake_1", "content": "ok" }] });
        let suggestion = json!({ "role": "user", "content": "[SUGGESTION MODE: next prompt]" });
        assert_eq!(step(&options, &request(user.clone(), true)), Step::Tool);
        assert_eq!(step(&options, &request(result, true)), Step::Final);
        assert_eq!(step(&options, &request(user, false)), Step::Side);
        assert_eq!(step(&options, &request(suggestion, true)), Step::Side);
        assert_eq!(step(&options, &Value::Null), Step::Side);
    }

    #[test]
    fn a_turn_ends_once_its_tool_answered_and_a_conversation_ends_at_last() {
        let options = FakeVendorOptions::new(VendorKind::Anthropic);
        let call = |id: &str| json!({ "role": "assistant", "content": [{ "type": "tool_use", "id": id, "name": "Write", "input": {} }] });
        let result = |id: &str| json!({ "role": "user", "content": [{ "type": "tool_result", "tool_use_id": id, "content": "ok" }] });
        let prompt = json!({ "role": "user", "content": [{ "type": "text", "text": "create hello.txt" }] });
        let reminder = json!({ "role": "user", "content": [{ "type": "text", "text": "<system-reminder>" }] });
        let done = json!({ "role": "assistant", "content": [{ "type": "text", "text": "done" }] });
        let tools = json!([{ "name": "Write" }]);
        let conversation = |messages: Vec<Value>| json!({ "messages": messages, "tools": tools });
        // The result, then a user message of its own: still the end of the turn.
        let after = conversation(vec![
            prompt.clone(),
            call("toolu_fake_1"),
            result("toolu_fake_1"),
            reminder,
        ]);
        assert_eq!(step(&options, &after), Step::Final);
        // A later prompt in the same conversation gets a tool call again, under a new id.
        let next = conversation(vec![
            prompt.clone(),
            call("toolu_fake_1"),
            result("toolu_fake_1"),
            done.clone(),
            prompt.clone(),
        ]);
        assert_eq!(step(&options, &next), Step::Tool);
        assert_eq!(tool_use_id(&options, &next), "toolu_fake_2");
        assert_eq!(
            tool_use_id(&options, &conversation(vec![prompt.clone()])),
            "toolu_fake_1"
        );
        // Past the cap: text, whatever the request.
        let mut long = Vec::new();
        for n in 1..=MAX_TOOL_ROUNDS {
            let id = format!("toolu_fake_{n}");
            long.extend([prompt.clone(), call(id.as_str()), result(id.as_str()), done.clone()]);
        }
        long.push(prompt);
        assert_eq!(step(&options, &conversation(long)), Step::Final);
    }
}
