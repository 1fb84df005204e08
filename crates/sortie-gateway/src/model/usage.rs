//! Token usage read from a vendor's answer as its frames pass (sans-IO: bytes in, counts out).
//!
//! [`UsageReader`] is fed each body chunk in order and asked for the [`Usage`] at the end. A JSON
//! answer is kept (up to [`MAX_JSON_BYTES`]) and read whole; an event stream goes through
//! `eventsource-stream` event by event, holding at most [`MAX_EVENT_BYTES`] of an unfinished event.
//! Vendors report cumulative counts, so a later report of a field replaces an earlier one:
//!
//! - Anthropic Messages: `usage` of the message (JSON) or of `message_start`'s message and then
//!   `message_delta` (SSE); input = `input_tokens` + `cache_read_input_tokens` +
//!   `cache_creation_input_tokens`.
//! - OpenAI: Responses `usage.{input,output}_tokens` (JSON, or the `response` of `response.completed`
//!   and the other final events); Chat Completions `usage.{prompt,completion}_tokens` (JSON, or the
//!   last chunk).
//! - Gemini: the last `usageMetadata` (JSON, a JSON array of chunks, or SSE); input =
//!   `promptTokenCount` + `toolUsePromptTokenCount`, output = `candidatesTokenCount` +
//!   `thoughtsTokenCount`.
//!
//! Anything malformed or oversized stops the reading (no usage), never the answer, never a panic.

use std::convert::Infallible;

use axum::body::Bytes;
use eventsource_stream::{EventStream, Eventsource};
use futures::channel::mpsc;
use futures::{FutureExt, StreamExt};
use serde_json::Value;

use super::ModelApi;

/// The most of a JSON answer kept to read its usage; a larger answer is relayed but not counted.
pub const MAX_JSON_BYTES: usize = 16 << 20;
/// The most bytes an event stream may carry without completing an event before reading stops.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// One answer's token counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    /// The model the answer names, else the one the request named, else `unknown`.
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// How an answer's body is framed, from its `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFormat {
    Json,
    EventStream,
}

impl BodyFormat {
    /// `text/event-stream` or any JSON type; `None` for anything else (not read).
    pub fn of(content_type: &str) -> Option<Self> {
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        if essence == "text/event-stream" {
            Some(Self::EventStream)
        } else if essence == "application/json" || essence.ends_with("+json") {
            Some(Self::Json)
        } else {
            None
        }
    }
}

/// The usage fields seen so far; each is replaced by a later report of the same field.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    model: Option<String>,
    input: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
    tool_prompt: Option<u64>,
    output: Option<u64>,
    thoughts: Option<u64>,
}

fn count(object: &Value, field: &str) -> Option<u64> {
    object.get(field).and_then(Value::as_u64)
}

fn replace(slot: &mut Option<u64>, value: Option<u64>) {
    if value.is_some() {
        *slot = value;
    }
}

impl Tally {
    /// Folds one JSON answer or one event's data into the tally.
    pub fn fold(&mut self, api: ModelApi, value: &Value) {
        match api {
            ModelApi::Anthropic => self.fold_anthropic(value),
            ModelApi::Openai => self.fold_openai(value),
            ModelApi::Gemini => self.fold_gemini(value),
        }
    }

    fn set_model(&mut self, model: Option<&Value>) {
        if let Some(model) = model.and_then(Value::as_str).filter(|m| !m.is_empty()) {
            self.model = Some(model.to_owned());
        }
    }

    fn fold_anthropic(&mut self, value: &Value) {
        // `message_start` wraps the message; a JSON answer and `message_delta` carry usage on top.
        let message = match value.get("type").and_then(Value::as_str) {
            Some("message_start") => value.get("message").unwrap_or(&Value::Null),
            _ => value,
        };
        self.set_model(message.get("model"));
        if let Some(usage) = message.get("usage").filter(|u| u.is_object()) {
            replace(&mut self.input, count(usage, "input_tokens"));
            replace(&mut self.cache_read, count(usage, "cache_read_input_tokens"));
            replace(&mut self.cache_creation, count(usage, "cache_creation_input_tokens"));
            replace(&mut self.output, count(usage, "output_tokens"));
        }
    }

    fn fold_openai(&mut self, value: &Value) {
        // Responses events wrap the response; Chat Completions chunks and JSON answers do not.
        let response = value.get("response").filter(|r| r.is_object()).unwrap_or(value);
        self.set_model(response.get("model"));
        if let Some(usage) = response.get("usage").filter(|u| u.is_object()) {
            replace(
                &mut self.input,
                count(usage, "input_tokens").or_else(|| count(usage, "prompt_tokens")),
            );
            replace(
                &mut self.output,
                count(usage, "output_tokens").or_else(|| count(usage, "completion_tokens")),
            );
        }
    }

    fn fold_gemini(&mut self, value: &Value) {
        if let Some(chunks) = value.as_array() {
            // `streamGenerateContent` without `alt=sse` answers one JSON array of chunks.
            for chunk in chunks {
                self.fold_gemini(chunk);
            }
            return;
        }
        self.set_model(value.get("modelVersion"));
        if let Some(usage) = value.get("usageMetadata").filter(|u| u.is_object()) {
            // The last report wins whole: earlier chunks may name fewer fields.
            self.input = count(usage, "promptTokenCount");
            self.tool_prompt = count(usage, "toolUsePromptTokenCount");
            self.output = count(usage, "candidatesTokenCount");
            self.thoughts = count(usage, "thoughtsTokenCount");
        }
    }

    /// The usage, if any count was reported; `fallback_model` names the model when the answer did not.
    pub fn usage(&self, fallback_model: Option<&str>) -> Option<Usage> {
        let inputs = [self.input, self.cache_read, self.cache_creation, self.tool_prompt];
        let outputs = [self.output, self.thoughts];
        if inputs.iter().chain(&outputs).all(Option::is_none) {
            return None;
        }
        let sum = |slots: &[Option<u64>]| slots.iter().flatten().fold(0u64, |a, b| a.saturating_add(*b));
        Some(Usage {
            model: self
                .model
                .clone()
                .or_else(|| fallback_model.map(str::to_owned))
                .unwrap_or_else(|| "unknown".to_owned()),
            input_tokens: sum(&inputs),
            output_tokens: sum(&outputs),
        })
    }
}

type Feed = futures::stream::Map<mpsc::UnboundedReceiver<Bytes>, fn(Bytes) -> Result<Bytes, Infallible>>;

enum State {
    Json(Vec<u8>),
    Events {
        feed: mpsc::UnboundedSender<Bytes>,
        events: EventStream<Feed>,
        /// Bytes fed since the last complete event: bounds what the parser holds.
        pending: usize,
    },
    /// Not read (another format, malformed, or too large).
    Off,
}

/// Reads one answer's usage from its body chunks.
pub struct UsageReader {
    api: ModelApi,
    tally: Tally,
    state: State,
}

impl UsageReader {
    /// A reader for a body of `format`; `None` reads nothing.
    pub fn new(api: ModelApi, format: Option<BodyFormat>) -> Self {
        let state = match format {
            Some(BodyFormat::Json) => State::Json(Vec::new()),
            Some(BodyFormat::EventStream) => {
                let (feed, receiver) = mpsc::unbounded();
                let ok: fn(Bytes) -> Result<Bytes, Infallible> = Ok;
                State::Events {
                    feed,
                    events: receiver.map(ok).eventsource(),
                    pending: 0,
                }
            }
            None => State::Off,
        };
        Self {
            api,
            tally: Tally::default(),
            state,
        }
    }

    /// The next chunk of the body, in order.
    pub fn feed(&mut self, chunk: &Bytes) {
        match &mut self.state {
            State::Off => {}
            State::Json(body) => {
                if body.len() + chunk.len() > MAX_JSON_BYTES {
                    self.state = State::Off;
                } else {
                    body.extend_from_slice(chunk);
                }
            }
            State::Events { feed, pending, .. } => {
                *pending += chunk.len();
                if *pending > MAX_EVENT_BYTES || feed.unbounded_send(chunk.clone()).is_err() {
                    self.state = State::Off;
                    return;
                }
                self.drain();
            }
        }
    }

    /// Folds every event the parser completed; never waits (the feed is already in the channel).
    fn drain(&mut self) {
        let State::Events { events, pending, .. } = &mut self.state else {
            return;
        };
        loop {
            match events.next().now_or_never() {
                Some(Some(Ok(event))) => {
                    *pending = 0;
                    if let Ok(value) = serde_json::from_str::<Value>(&event.data) {
                        self.tally.fold(self.api, &value);
                    }
                }
                // Not an event stream after all: stop reading, keep what was read.
                Some(Some(Err(_))) => {
                    self.state = State::Off;
                    return;
                }
                Some(None) | None => return,
            }
        }
    }

    /// The usage the whole body reported (an unfinished last event is not read, as SSE says).
    pub fn finish(mut self, fallback_model: Option<&str>) -> Option<Usage> {
        match std::mem::replace(&mut self.state, State::Off) {
            State::Json(body) => {
                if let Ok(value) = serde_json::from_slice::<Value>(&body) {
                    self.tally.fold(self.api, &value);
                }
            }
            // Every complete event was read as it arrived; an unfinished one is not an event.
            State::Events { .. } | State::Off => {}
        }
        self.tally.usage(fallback_model)
    }
}

/// The model a request names: its JSON body's `model` (Anthropic, OpenAI) or, for Gemini, the
/// `models/{model}:method` of its path.
pub fn request_model(api: ModelApi, path: &str, body: &[u8]) -> Option<String> {
    match api {
        ModelApi::Anthropic | ModelApi::Openai => {
            #[derive(serde::Deserialize)]
            struct Named {
                model: Option<String>,
            }
            serde_json::from_slice::<Named>(body)
                .ok()?
                .model
                .filter(|model| !model.is_empty())
        }
        ModelApi::Gemini => {
            let (_, after) = path.split_once("models/")?;
            let model = after.split([':', '/', '?']).next()?;
            (!model.is_empty()).then(|| model.to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(model: &str, input_tokens: u64, output_tokens: u64) -> Option<Usage> {
        Some(Usage {
            model: model.to_owned(),
            input_tokens,
            output_tokens,
        })
    }

    /// Reads `body` whole, then in every two-piece split and byte by byte.
    fn read(api: ModelApi, format: BodyFormat, body: &str, fallback: Option<&str>) -> Option<Usage> {
        let bytes = body.as_bytes();
        let mut whole = UsageReader::new(api, Some(format));
        whole.feed(&Bytes::copy_from_slice(bytes));
        let expected = whole.finish(fallback);
        for cut in 0..=bytes.len() {
            let mut reader = UsageReader::new(api, Some(format));
            reader.feed(&Bytes::copy_from_slice(&bytes[..cut]));
            reader.feed(&Bytes::copy_from_slice(&bytes[cut..]));
            assert_eq!(reader.finish(fallback), expected, "split at {cut} of {body:?}");
        }
        let mut reader = UsageReader::new(api, Some(format));
        for byte in bytes {
            reader.feed(&Bytes::copy_from_slice(&[*byte]));
        }
        assert_eq!(reader.finish(fallback), expected, "byte by byte: {body:?}");
        expected
    }

    const ANTHROPIC_SSE: &str = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"claude-sonnet-4-5\",",
        "\"usage\":{\"input_tokens\":100,\"cache_read_input_tokens\":20,\"cache_creation_input_tokens\":3,\"output_tokens\":1}}}\n\n",
        "event: ping\ndata: {\"type\": \"ping\"}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"é→ü\"}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":30}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":45}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );

    #[test]
    fn anthropic() {
        let json = r#"{"id":"msg_1","type":"message","model":"claude-opus-4-1","content":[{"type":"text","text":"hi"}],
            "usage":{"input_tokens":10,"cache_creation_input_tokens":5,"cache_read_input_tokens":null,"output_tokens":7}}"#;
        assert_eq!(
            read(ModelApi::Anthropic, BodyFormat::Json, json, None),
            usage("claude-opus-4-1", 15, 7)
        );
        assert_eq!(
            read(ModelApi::Anthropic, BodyFormat::EventStream, ANTHROPIC_SSE, None),
            usage("claude-sonnet-4-5", 123, 45)
        );
        // CRLF framing, and a newer API's cumulative input in message_delta.
        let crlf = "event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"usage\":{\"input_tokens\":1,\"output_tokens\":1}}}\r\n\r\n\
            event: message_delta\r\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":9,\"output_tokens\":4}}\r\n\r\n";
        assert_eq!(
            read(ModelApi::Anthropic, BodyFormat::EventStream, crlf, None),
            usage("m", 9, 4)
        );
        // An error answer reports nothing.
        let error = r#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}"#;
        assert_eq!(read(ModelApi::Anthropic, BodyFormat::Json, error, Some("m")), None);
    }

    #[test]
    fn openai() {
        let responses = r#"{"id":"resp_1","object":"response","model":"gpt-5.5","output":[],
            "usage":{"input_tokens":123,"input_tokens_details":{"cached_tokens":100},"output_tokens":45,"total_tokens":168}}"#;
        assert_eq!(
            read(ModelApi::Openai, BodyFormat::Json, responses, None),
            usage("gpt-5.5", 123, 45)
        );
        let events = concat!(
            "event: response.created\n",
            "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"model\":\"gpt-5.5\",\"usage\":null}}\n\n",
            "event: response.output_text.delta\n",
            "data: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n",
            "event: response.completed\n",
            "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"model\":\"gpt-5.5-2026\",",
            "\"usage\":{\"input_tokens\":123,\"output_tokens\":45}}}\n\n",
        );
        assert_eq!(
            read(ModelApi::Openai, BodyFormat::EventStream, events, None),
            usage("gpt-5.5-2026", 123, 45)
        );
        let chat = r#"{"id":"c","object":"chat.completion","model":"gpt-4o","usage":{"prompt_tokens":12,"completion_tokens":3}}"#;
        assert_eq!(
            read(ModelApi::Openai, BodyFormat::Json, chat, None),
            usage("gpt-4o", 12, 3)
        );
        let chat_events = concat!(
            "data: {\"id\":\"c\",\"model\":\"gpt-4o\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3}}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(
            read(ModelApi::Openai, BodyFormat::EventStream, chat_events, None),
            usage("gpt-4o", 12, 3)
        );
        // A stream without a usage chunk reports nothing.
        let no_usage = "data: {\"id\":\"c\",\"model\":\"gpt-4o\",\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(read(ModelApi::Openai, BodyFormat::EventStream, no_usage, None), None);
    }

    #[test]
    fn gemini() {
        let json = r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"hi"}]},"finishReason":"STOP"}],
            "usageMetadata":{"promptTokenCount":100,"toolUsePromptTokenCount":23,"candidatesTokenCount":40,"thoughtsTokenCount":5,"totalTokenCount":168},
            "modelVersion":"gemini-2.5-pro"}"#;
        assert_eq!(
            read(ModelApi::Gemini, BodyFormat::Json, json, None),
            usage("gemini-2.5-pro", 123, 45)
        );
        let array = r#"[{"candidates":[],"usageMetadata":{"promptTokenCount":123}},
            {"candidates":[],"usageMetadata":{"promptTokenCount":123,"candidatesTokenCount":45},"modelVersion":"gemini-2.5-flash"}]"#;
        assert_eq!(
            read(ModelApi::Gemini, BodyFormat::Json, array, None),
            usage("gemini-2.5-flash", 123, 45)
        );
        let events = concat!(
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"h\"}]}}],\"usageMetadata\":{\"promptTokenCount\":123,\"thoughtsTokenCount\":9},\"modelVersion\":\"gemini-2.5-pro\"}\r\n\r\n",
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"i\"}]},\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":123,\"candidatesTokenCount\":45},\"modelVersion\":\"gemini-2.5-pro\"}\r\n\r\n",
        );
        // The last usageMetadata wins whole: the first chunk's thoughts are not added.
        assert_eq!(
            read(ModelApi::Gemini, BodyFormat::EventStream, events, None),
            usage("gemini-2.5-pro", 123, 45)
        );
        // No modelVersion: the request's model.
        let bare = r#"{"usageMetadata":{"promptTokenCount":1,"candidatesTokenCount":2}}"#;
        assert_eq!(
            read(ModelApi::Gemini, BodyFormat::Json, bare, Some("gemini-x")),
            usage("gemini-x", 1, 2)
        );
        assert_eq!(
            read(ModelApi::Gemini, BodyFormat::Json, bare, None),
            usage("unknown", 1, 2)
        );
    }

    #[test]
    fn malformed_answers_report_nothing() {
        let cases: &[(ModelApi, BodyFormat, &str)] = &[
            (ModelApi::Anthropic, BodyFormat::Json, ""),
            (ModelApi::Anthropic, BodyFormat::Json, "{\"usage\":{\"input_tokens\":1"),
            (ModelApi::Anthropic, BodyFormat::Json, "not json"),
            (ModelApi::Anthropic, BodyFormat::Json, "{\"usage\":\"lots\"}"),
            (
                ModelApi::Anthropic,
                BodyFormat::Json,
                "{\"usage\":{\"input_tokens\":-1,\"output_tokens\":1.5}}",
            ),
            (ModelApi::Openai, BodyFormat::Json, "[1,2,3]"),
            (ModelApi::Openai, BodyFormat::Json, "{\"response\":{\"usage\":[]}}"),
            (ModelApi::Gemini, BodyFormat::Json, "{\"usageMetadata\":null}"),
            (ModelApi::Gemini, BodyFormat::Json, "[[[[]]]]"),
            // An unfinished last event is not an event.
            (
                ModelApi::Anthropic,
                BodyFormat::EventStream,
                "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":45}}\n",
            ),
            (
                ModelApi::Openai,
                BodyFormat::EventStream,
                "data: {broken\n\ndata: [DONE]\n\n",
            ),
            (ModelApi::Gemini, BodyFormat::EventStream, "\u{0}\u{1}garbage\n\n\n"),
        ];
        for (api, format, body) in cases {
            assert_eq!(read(*api, *format, body, Some("m")), None, "{api} {format:?} {body:?}");
        }
    }

    #[test]
    fn invalid_utf8_and_oversized_input_stop_reading() {
        let mut reader = UsageReader::new(ModelApi::Openai, Some(BodyFormat::EventStream));
        reader.feed(&Bytes::from_static(b"data: \xff\xfe\n\n"));
        reader.feed(&Bytes::from_static(
            b"data: {\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}\n\n",
        ));
        // Whatever it makes of the broken bytes, it neither panics nor grows without bound.
        let _ = reader.finish(None);

        let mut reader = UsageReader::new(ModelApi::Openai, Some(BodyFormat::EventStream));
        reader.feed(&Bytes::from_static(b"data: "));
        reader.feed(&Bytes::from(vec![b'x'; MAX_EVENT_BYTES]));
        reader.feed(&Bytes::from_static(
            b"\n\ndata: {\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}\n\n",
        ));
        assert!(matches!(reader.state, State::Off));
        assert_eq!(reader.finish(None), None);

        let mut reader = UsageReader::new(ModelApi::Openai, Some(BodyFormat::Json));
        reader.feed(&Bytes::from(vec![b' '; MAX_JSON_BYTES]));
        reader.feed(&Bytes::from_static(
            b"{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}",
        ));
        assert_eq!(reader.finish(None), None);
    }

    #[test]
    fn formats() {
        let cases = [
            ("text/event-stream", Some(BodyFormat::EventStream)),
            ("text/event-stream; charset=utf-8", Some(BodyFormat::EventStream)),
            ("application/json", Some(BodyFormat::Json)),
            ("Application/JSON; charset=UTF-8", Some(BodyFormat::Json)),
            ("application/problem+json", Some(BodyFormat::Json)),
            ("text/plain", None),
            ("", None),
        ];
        for (content_type, expected) in cases {
            assert_eq!(BodyFormat::of(content_type), expected, "{content_type}");
        }
    }

    #[test]
    fn request_models() {
        let cases: &[(ModelApi, &str, &str, Option<&str>)] = &[
            (
                ModelApi::Anthropic,
                "v1/messages",
                r#"{"model":"claude-sonnet-4-5","stream":true}"#,
                Some("claude-sonnet-4-5"),
            ),
            (
                ModelApi::Openai,
                "v1/responses",
                r#"{"input":[],"model":"gpt-5.5"}"#,
                Some("gpt-5.5"),
            ),
            (ModelApi::Openai, "v1/responses", r#"{"model":""}"#, None),
            (ModelApi::Openai, "v1/responses", "not json", None),
            (ModelApi::Anthropic, "v1/messages", r#"{"model":7}"#, None),
            (
                ModelApi::Gemini,
                "v1beta/models/gemini-2.5-pro:streamGenerateContent",
                "",
                Some("gemini-2.5-pro"),
            ),
            (
                ModelApi::Gemini,
                "v1beta/models/gemini-2.5-flash:generateContent",
                "{}",
                Some("gemini-2.5-flash"),
            ),
            (ModelApi::Gemini, "v1beta/models", "", None),
            (ModelApi::Gemini, "v1beta/models/:generateContent", "", None),
        ];
        for (api, path, body, expected) in cases {
            assert_eq!(
                request_model(*api, path, body.as_bytes()).as_deref(),
                *expected,
                "{api} {path} {body}"
            );
        }
    }
}
