//! Gemini API: `POST …/models/{model}:generateContent` (one JSON answer),
//! `:streamGenerateContent?alt=sse` (SSE `data:` lines, CRLF-framed like Google's) and
//! `:streamGenerateContent` without `alt=sse` (one JSON array of the same chunks). The tool call is a
//! `functionCall` part; the last chunk carries `finishReason` and the whole `usageMetadata`, earlier
//! ones only the prompt's count.

use serde_json::{Value, json};

use crate::{FakeVendorOptions, Reply, Step, halves, sse};

pub(crate) fn error(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        _ => "INTERNAL",
    };
    json!({ "error": { "code": status, "message": message, "status": kind } })
}

fn step(options: &FakeVendorOptions, request: &Value) -> Step {
    if request["generationConfig"]["responseMimeType"] == "application/json" {
        return Step::Json;
    }
    let offered = request["tools"].as_array().is_some_and(|tools| {
        tools.iter().any(|tool| {
            tool["functionDeclarations"].as_array().is_some_and(|declarations| {
                declarations
                    .iter()
                    .any(|declaration| declaration["name"] == options.tool.name.as_str())
            })
        })
    });
    let last = request["contents"].as_array().and_then(|contents| contents.last());
    let answered = last
        .and_then(|content| content["parts"].as_array())
        .is_some_and(|parts| parts.iter().any(|part| part.get("functionResponse").is_some()));
    if answered {
        Step::Final
    } else if !offered {
        Step::Side
    } else {
        Step::Tool
    }
}

pub(crate) fn reply(options: &FakeVendorOptions, path: &str, query: &str, request: &Value) -> Reply {
    let Some((_, call)) = path.split_once("models/") else {
        return Reply::NotFound;
    };
    let Some((path_model, method)) = call.split_once(':') else {
        return Reply::NotFound;
    };
    let streaming = match method {
        "generateContent" => false,
        "streamGenerateContent" => true,
        _ => return Reply::NotFound,
    };
    let step = step(options, request);
    let model = options.model.clone().unwrap_or_else(|| path_model.to_owned());
    let text = match step {
        Step::Final => options.text.as_str(),
        Step::Json => options.json_text.as_str(),
        _ => options.side_text.as_str(),
    };
    let chunk = |parts: Value, last: bool| {
        let mut usage = json!({ "promptTokenCount": options.input_tokens });
        let mut candidate = json!({ "content": { "role": "model", "parts": parts }, "index": 0 });
        if last {
            usage["candidatesTokenCount"] = json!(options.output_tokens);
            usage["totalTokenCount"] = json!(options.input_tokens + options.output_tokens);
            candidate["finishReason"] = json!("STOP");
        }
        json!({ "candidates": [candidate], "usageMetadata": usage, "modelVersion": model,
                "responseId": format!("fake_{}", step.name()) })
    };
    let call = json!({ "functionCall": { "name": options.tool.name, "args": options.tool.arguments } });
    if !streaming {
        let parts = if step == Step::Tool {
            json!([call])
        } else {
            json!([{ "text": text }])
        };
        return Reply::Json(chunk(parts, true));
    }
    let chunks = match step {
        Step::Tool => vec![chunk(json!([call]), false), chunk(json!([{ "text": "" }]), true)],
        _ => {
            let pieces = halves(text);
            let count = pieces.len();
            pieces
                .into_iter()
                .enumerate()
                .map(|(index, piece)| chunk(json!([{ "text": piece }]), index + 1 == count))
                .collect()
        }
    };
    if query.split('&').any(|pair| pair == "alt=sse") {
        Reply::Events(chunks.iter().map(|chunk| sse(None, chunk, "\r\n")).collect())
    } else {
        Reply::Json(Value::Array(chunks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VendorKind;

    #[test]
    fn steps() {
        let options = FakeVendorOptions::new(VendorKind::Gemini);
        let tools = json!([{ "functionDeclarations": [{ "name": "read_file" }, { "name": "write_file" }] }]);
        let user = json!({ "role": "user", "parts": [{ "text": "create hello.txt" }] });
        let result =
            json!({ "role": "user", "parts": [{ "functionResponse": { "name": "write_file", "response": {} } }] });
        assert_eq!(
            step(&options, &json!({ "contents": [user], "tools": tools })),
            Step::Tool
        );
        assert_eq!(
            step(&options, &json!({ "contents": [user, result], "tools": tools })),
            Step::Final
        );
        assert_eq!(step(&options, &json!({ "contents": [user] })), Step::Side);
        let router = json!({ "contents": [user], "generationConfig": { "responseMimeType": "application/json" } });
        assert_eq!(step(&options, &router), Step::Json);
    }

    #[test]
    fn answers_by_method() {
        let options = FakeVendorOptions::new(VendorKind::Gemini);
        let request = json!({ "contents": [{ "role": "user", "parts": [{ "text": "hi" }] }] });
        assert!(matches!(
            reply(&options, "/v1beta/models/g:generateContent", "", &request),
            Reply::Json(Value::Object(_))
        ));
        assert!(matches!(
            reply(&options, "/v1beta/models/g:streamGenerateContent", "", &request),
            Reply::Json(Value::Array(_))
        ));
        assert!(matches!(
            reply(&options, "/v1beta/models/g:streamGenerateContent", "alt=sse", &request),
            Reply::Events(_)
        ));
        assert!(matches!(
            reply(&options, "/v1beta/models/g:countTokens", "", &request),
            Reply::NotFound
        ));
        assert!(matches!(
            reply(&options, "/v1beta/models", "", &request),
            Reply::NotFound
        ));
    }
}
