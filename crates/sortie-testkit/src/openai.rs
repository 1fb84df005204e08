//! OpenAI Responses: `POST …/responses`, a `response` JSON or the SSE events `response.created`,
//! `response.output_item.added`, the text or arguments deltas, `response.output_item.done` and
//! `response.completed` (with the usage) — what Codex reads. The tool call is a `function_call`
//! output item whose `arguments` is a JSON string.

use serde_json::{Value, json};

use crate::{FakeVendorOptions, Reply, Step, halves, sse};

pub(crate) fn error(status: u16, message: &str) -> Value {
    let (kind, code) = match status {
        401 => ("invalid_request_error", "invalid_api_key"),
        403 => ("invalid_request_error", "unsupported_country_region_territory"),
        404 => ("invalid_request_error", "not_found"),
        429 => ("requests", "rate_limit_exceeded"),
        400..=499 => ("invalid_request_error", "invalid_request"),
        _ => ("server_error", "server_error"),
    };
    json!({ "error": { "message": message, "type": kind, "param": null, "code": code } })
}

fn step(options: &FakeVendorOptions, request: &Value) -> Step {
    let offered = request["tools"].as_array().is_some_and(|tools| {
        tools.iter().any(|tool| {
            tool["name"] == options.tool.name.as_str() || tool["function"]["name"] == options.tool.name.as_str()
        })
    });
    let last = request["input"].as_array().and_then(|items| items.last());
    let kind = last.and_then(|item| item["type"].as_str()).unwrap_or_default();
    if matches!(kind, "function_call_output" | "custom_tool_call_output") {
        Step::Final
    } else if !offered {
        Step::Side
    } else {
        Step::Tool
    }
}

pub(crate) fn reply(options: &FakeVendorOptions, path: &str, request: &Value) -> Reply {
    if !path.ends_with("/responses") {
        return Reply::NotFound;
    }
    let step = step(options, request);
    let model = options
        .model
        .clone()
        .or_else(|| request["model"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "gpt-5.5".to_owned());
    let text = if step == Step::Final {
        &options.text
    } else {
        &options.side_text
    };
    let arguments = options.tool.arguments.to_string();
    let item_id = format!("{}_fake_{}", if step == Step::Tool { "fc" } else { "msg" }, step.name());
    // A tool whose input is free text (Codex's `apply_patch`) is a custom tool call, with no deltas.
    let custom_input = options.tool.arguments.as_str();
    let (item, pending_item, pieces) = match step {
        Step::Tool if custom_input.is_some() => (
            json!({ "type": "custom_tool_call", "id": item_id, "call_id": "call_fake_1",
                    "name": options.tool.name, "input": custom_input, "status": "completed" }),
            json!({ "type": "custom_tool_call", "id": item_id, "call_id": "call_fake_1",
                    "name": options.tool.name, "input": "", "status": "in_progress" }),
            Vec::new(),
        ),
        Step::Tool => (
            json!({ "type": "function_call", "id": item_id, "call_id": "call_fake_1",
                    "name": options.tool.name, "arguments": arguments, "status": "completed" }),
            json!({ "type": "function_call", "id": item_id, "call_id": "call_fake_1",
                    "name": options.tool.name, "arguments": "", "status": "in_progress" }),
            halves(&arguments),
        ),
        _ => (
            json!({ "type": "message", "id": item_id, "role": "assistant", "status": "completed",
                    "content": [{ "type": "output_text", "text": text, "annotations": [] }] }),
            json!({ "type": "message", "id": item_id, "role": "assistant", "status": "in_progress",
                    "content": [] }),
            halves(text),
        ),
    };
    let response = |status: &str, output: Value, usage: Value| {
        json!({ "id": format!("resp_fake_{}", step.name()), "object": "response", "created_at": 1_767_225_600,
                "status": status, "model": model, "output": output, "usage": usage })
    };
    let usage = json!({
        "input_tokens": options.input_tokens,
        "input_tokens_details": { "cached_tokens": 0 },
        "output_tokens": options.output_tokens,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": options.input_tokens + options.output_tokens,
    });
    if request["stream"] != true {
        return Reply::Json(response("completed", json!([item]), usage));
    }

    let mut sequence = 0u64;
    let mut event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(sequence);
        sequence += 1;
        sse(Some(name), &data, "\n")
    };
    let mut frames = vec![
        event(
            "response.created",
            json!({ "response": response("in_progress", json!([]), Value::Null) }),
        ),
        event(
            "response.output_item.added",
            json!({ "output_index": 0, "item": pending_item }),
        ),
    ];
    for piece in pieces {
        frames.push(match step {
            Step::Tool => event(
                "response.function_call_arguments.delta",
                json!({ "item_id": item_id, "output_index": 0, "delta": piece }),
            ),
            _ => event(
                "response.output_text.delta",
                json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece }),
            ),
        });
    }
    frames.push(event(
        "response.output_item.done",
        json!({ "output_index": 0, "item": item.clone() }),
    ));
    frames.push(event(
        "response.completed",
        json!({ "response": response("completed", json!([item]), usage) }),
    ));
    Reply::Events(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VendorKind;

    #[test]
    fn steps() {
        let options = FakeVendorOptions::new(VendorKind::OpenAi);
        let tools = json!([{ "type": "function", "name": "exec_command" }]);
        let user = json!({ "type": "message", "role": "user", "content": [{ "type": "input_text", "text": "hi" }] });
        let output = json!({ "type": "function_call_output", "call_id": "call_fake_1", "output": "ok" });
        assert_eq!(step(&options, &json!({ "input": [user], "tools": tools })), Step::Tool);
        assert_eq!(
            step(&options, &json!({ "input": [user, output], "tools": tools })),
            Step::Final
        );
        assert_eq!(step(&options, &json!({ "input": [user] })), Step::Side);
        assert_eq!(step(&options, &json!({ "input": "hi", "tools": tools })), Step::Tool);
        let chat_tools = json!([{ "type": "function", "function": { "name": "exec_command" } }]);
        assert_eq!(
            step(&options, &json!({ "input": [user], "tools": chat_tools })),
            Step::Tool
        );
    }
}
