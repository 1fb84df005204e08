//! Each fake plays a whole turn (tool call, then text after the tool's result, and a side call) in
//! JSON and in SSE with the usage it was given; holds a stream until released; answers a scripted
//! status; and checks the key it requires.

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::Value;
use sortie_testkit::sample::{self, TurnStep};
use sortie_testkit::{FakeVendor, FakeVendorOptions, ToolCall, VendorKind};

const KINDS: [VendorKind; 3] = [VendorKind::Anthropic, VendorKind::OpenAi, VendorKind::Gemini];
const DEADLINE: Duration = Duration::from_secs(10);

fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn send(client: &reqwest::Client, fake: &FakeVendor, step: TurnStep, stream: bool) -> reqwest::Response {
    let request = sample::request(fake.kind, &ToolCall::write_hello(fake.kind), step, stream);
    client
        .post(format!("{}{}", fake.url, request.path))
        .json(&request.body)
        .send()
        .await
        .expect("the fake answers")
}

/// The data of every event of an SSE answer, parsed.
async fn events(answer: reqwest::Response) -> Vec<Value> {
    assert_eq!(
        answer.headers().get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    answer
        .bytes_stream()
        .eventsource()
        .map(|event| serde_json::from_str(&event.expect("an SSE event").data).expect("JSON data"))
        .collect()
        .await
}

/// Whether `value` holds `needle` anywhere as a string (or inside a string).
fn mentions(value: &Value, needle: &str) -> bool {
    match value {
        Value::String(text) => text.contains(needle),
        Value::Array(items) => items.iter().any(|item| mentions(item, needle)),
        Value::Object(map) => map.iter().any(|(key, item)| key == needle || mentions(item, needle)),
        _ => false,
    }
}

/// The input and output tokens an answer (JSON or the events of an SSE one) reports last.
fn usage(kind: VendorKind, values: &[Value]) -> (u64, u64) {
    let mut found = (0, 0);
    for value in values {
        let pair = match kind {
            VendorKind::Anthropic => {
                let usage = value.get("message").unwrap_or(value).get("usage");
                usage.map(|u| (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()))
            }
            VendorKind::OpenAi => {
                let usage = value
                    .get("response")
                    .unwrap_or(value)
                    .get("usage")
                    .filter(|u| u.is_object());
                usage.map(|u| (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()))
            }
            VendorKind::Gemini => value
                .get("usageMetadata")
                .map(|u| (u["promptTokenCount"].as_u64(), u["candidatesTokenCount"].as_u64())),
        };
        if let Some((input, output)) = pair {
            found = (input.unwrap_or(found.0), output.unwrap_or(found.1));
        }
    }
    found
}

#[tokio::test]
async fn each_fake_plays_a_turn_in_json_and_sse() {
    let client = client();
    for kind in KINDS {
        let fake = FakeVendor::start(kind).await.expect("fake");
        let tool = ToolCall::write_hello(kind);
        for stream in [false, true] {
            for (step, expected) in [
                (TurnStep::Start, tool.name.as_str()),
                (TurnStep::ToolResult, "I created hello.txt."),
                (TurnStep::Side, "Create hello.txt"),
            ] {
                let answer = send(&client, &fake, step, stream).await;
                assert_eq!(answer.status(), 200, "{kind:?} {step:?}");
                let values = if stream {
                    events(answer).await
                } else {
                    vec![answer.json::<Value>().await.expect("JSON")]
                };
                let whole = Value::Array(values.clone());
                // Streamed text comes in deltas: its start is in the first.
                let needle = if stream { &expected[..5] } else { expected };
                assert!(mentions(&whole, needle), "{kind:?} {step:?} {stream}: {whole}");
                if step != TurnStep::Start {
                    assert!(
                        !mentions(&whole, &tool.name),
                        "{kind:?} {step:?} calls no tool: {whole}"
                    );
                }
                assert_eq!(usage(kind, &values), (123, 45), "{kind:?} {step:?} {stream}");
            }
        }
        let requests = fake.requests();
        assert_eq!(requests.len(), 6);
        assert!(
            requests
                .iter()
                .all(|r| r.method == "POST" && r.key.is_none() && r.key_matched.is_none())
        );
    }
}

#[tokio::test]
async fn tool_calls_carry_the_configured_arguments() {
    let client = client();
    let tool = ToolCall {
        name: "write".to_owned(),
        arguments: serde_json::json!({ "filePath": "/workspace/a.txt", "content": "a" }),
    };
    let mut options = FakeVendorOptions::new(VendorKind::Anthropic);
    options.tool = tool.clone();
    options.model = Some("claude-haiku-4-5".to_owned());
    let fake = FakeVendor::start_with(VendorKind::Anthropic, options)
        .await
        .expect("fake");
    let request = sample::request(VendorKind::Anthropic, &tool, TurnStep::Start, false);
    let answer: Value = client
        .post(format!("{}{}", fake.url, request.path))
        .json(&request.body)
        .send()
        .await
        .expect("answer")
        .json()
        .await
        .expect("JSON");
    assert_eq!(answer["model"], "claude-haiku-4-5");
    assert_eq!(answer["stop_reason"], "tool_use");
    assert_eq!(answer["content"][0]["name"], "write");
    assert_eq!(answer["content"][0]["input"], tool.arguments);

    // Streamed, the arguments arrive as JSON text in pieces that join up.
    let request = sample::request(VendorKind::Anthropic, &tool, TurnStep::Start, true);
    let answer = client
        .post(format!("{}{}", fake.url, request.path))
        .json(&request.body)
        .send()
        .await
        .expect("answer");
    let joined: String = events(answer)
        .await
        .iter()
        .filter_map(|event| event["delta"]["partial_json"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&joined).expect("arguments"),
        tool.arguments
    );
}

#[tokio::test]
async fn a_held_stream_sends_its_first_event_then_waits_for_release() {
    let client = client();
    for kind in KINDS {
        let mut options = FakeVendorOptions::new(kind);
        options.hold_after_first_event = true;
        let fake = FakeVendor::start_with(kind, options).await.expect("fake");
        let answer = send(&client, &fake, TurnStep::ToolResult, true).await;
        let mut events = answer.bytes_stream().eventsource();
        let first = tokio::time::timeout(DEADLINE, events.next())
            .await
            .expect("the first event before release")
            .expect("an event")
            .expect("a good event");
        assert!(!first.data.is_empty());
        let early = tokio::time::timeout(Duration::from_millis(100), events.next()).await;
        assert!(early.is_err(), "{kind:?}: nothing more before release");
        fake.release();
        let rest: Vec<_> = tokio::time::timeout(DEADLINE, events.collect::<Vec<_>>())
            .await
            .expect("the rest after release");
        assert!(!rest.is_empty());
    }
}

#[tokio::test]
async fn scripted_statuses_and_required_keys() {
    let client = client();
    for (kind, status) in [
        (VendorKind::Anthropic, 401),
        (VendorKind::OpenAi, 429),
        (VendorKind::Gemini, 503),
    ] {
        let mut options = FakeVendorOptions::new(kind);
        options.status = Some(status);
        let fake = FakeVendor::start_with(kind, options).await.expect("fake");
        let answer = send(&client, &fake, TurnStep::Start, true).await;
        assert_eq!(answer.status().as_u16(), status);
        let body: Value = answer.json().await.expect("an error body");
        assert!(body["error"].is_object(), "{kind:?}: {body}");
    }

    let mut options = FakeVendorOptions::new(VendorKind::Gemini);
    options.status = Some(307);
    let fake = FakeVendor::start_with(VendorKind::Gemini, options).await.expect("fake");
    let client_without_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let answer = send(&client_without_redirects, &fake, TurnStep::Start, false).await;
    assert_eq!(answer.status(), 307);
    assert!(answer.headers().contains_key("location"));

    for kind in KINDS {
        let mut options = FakeVendorOptions::new(kind);
        options.require_key = Some("right-key".to_owned());
        let fake = FakeVendor::start_with(kind, options).await.expect("fake");
        let request = sample::request(kind, &ToolCall::write_hello(kind), TurnStep::Start, false);
        let url = format!("{}{}", fake.url, request.path);
        for (key, expected) in [("wrong-key", 401), ("right-key", 200)] {
            let builder = client.post(&url).json(&request.body);
            let builder = match kind {
                VendorKind::Anthropic => builder.header("x-api-key", key),
                VendorKind::OpenAi => builder.bearer_auth(key),
                VendorKind::Gemini => builder.header("x-goog-api-key", key),
            };
            let answer = builder.send().await.expect("answer");
            assert_eq!(answer.status().as_u16(), expected, "{kind:?} {key}");
        }
        let matched: Vec<_> = fake.requests().iter().map(|r| (r.key.clone(), r.key_matched)).collect();
        assert_eq!(
            matched,
            [
                (Some("wrong-key".to_owned()), Some(false)),
                (Some("right-key".to_owned()), Some(true))
            ]
        );
    }
}
