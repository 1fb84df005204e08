//! Fakes for tests and benchmarks only; nothing in production depends on this crate.
//!
//! [`FakeVendor`] is a model API on `127.0.0.1:0` that speaks a vendor's real wire format
//! (Anthropic Messages, OpenAI Responses, Gemini `generateContent`), streaming SSE when the request
//! asks for it and plain JSON otherwise. It is scripted like the fakes the real agents were verified
//! against (`docs/design/ref/acp.md` §3, §5): the first answer of a turn calls the agent's file-writing tool
//! ([`ToolCall`]), the answer to a request that carries the tool's result is text and the end of the
//! turn, and side calls (titles, suggestions, Gemini's JSON-mode router) get plain text. Every answer
//! reports the same usage ([`FakeVendorOptions::input_tokens`], [`FakeVendorOptions::output_tokens`])
//! and every request is recorded ([`RecordedRequest`]). Answers are deterministic: the same request
//! gets the same bytes. [`sample`] builds requests like the agents' to drive a fake.
//!
//! [`forge`] is a git forge over real TLS: smart HTTP behind a token, as GitHub serves it, with a
//! GitHub App ([`github_app`]) that mints the installation tokens it takes.
//!
//! The shared fixtures: [`git`] (real git with a test identity, and the repositories tests start
//! from), [`wait`] (poll with a deadline; one patience knob) and [`http`] (small servers on
//! `127.0.0.1:0`).

mod anthropic;
pub mod forge;
mod gemini;
pub mod git;
pub mod github_app;
pub mod http;
pub mod kube;
mod openai;
pub mod sample;
pub mod wait;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::watch;

/// Which vendor a [`FakeVendor`] plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VendorKind {
    /// `POST …/messages` (Claude Code, opencode).
    Anthropic,
    /// `POST …/responses` (Codex).
    OpenAi,
    /// `POST …/models/{model}:generateContent` and `:streamGenerateContent[?alt=sse]` (Gemini CLI).
    Gemini,
}

/// The tool call the first answer of a turn makes.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The tool's input as JSON (an OpenAI `arguments` string is this, serialized).
    pub arguments: Value,
}

impl ToolCall {
    /// Codex's `apply_patch` adding `/workspace/hello.txt` (a custom tool: its input is the patch
    /// text); Codex reports it as an edit with a diff.
    pub fn apply_patch_hello() -> Self {
        Self {
            name: "apply_patch".to_owned(),
            arguments: Value::String(
                "*** Begin Patch\n*** Add File: /workspace/hello.txt\n+hello\n*** End Patch\n".to_owned(),
            ),
        }
    }

    /// Each agent's file-writing tool creating `/workspace/hello.txt` (Claude Code's `Write`, Codex's
    /// `exec_command`, Gemini CLI's `write_file`).
    pub fn write_hello(kind: VendorKind) -> Self {
        let (name, arguments) = match kind {
            VendorKind::Anthropic => (
                "Write",
                serde_json::json!({ "file_path": "/workspace/hello.txt", "content": "hello\n" }),
            ),
            VendorKind::OpenAi => (
                "exec_command",
                serde_json::json!({ "cmd": "printf 'hello\\n' > /workspace/hello.txt" }),
            ),
            VendorKind::Gemini => (
                "write_file",
                serde_json::json!({ "file_path": "/workspace/hello.txt", "content": "hello\n" }),
            ),
        };
        Self {
            name: name.to_owned(),
            arguments,
        }
    }
}

/// How a [`FakeVendor`] answers.
#[derive(Clone, Debug)]
pub struct FakeVendorOptions {
    /// The tool the first answer of a turn calls (when the request offers it; else the request is a
    /// side call).
    pub tool: ToolCall,
    /// The text that ends a turn, after the tool's result.
    pub text: String,
    /// The text of side calls (titles, suggestions).
    pub side_text: String,
    /// The text of Gemini's JSON-mode calls (the model router).
    pub json_text: String,
    /// The usage every answer reports (for Anthropic all of it as `input_tokens`).
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The model answers name; `None` names the request's.
    pub model: Option<String>,
    /// Answer every request with this status and the vendor's error body (a 3xx with a `Location`)
    /// instead of the script: 401 for a rejected key, 429, 500, 307…
    pub status: Option<u16>,
    /// The key requests must carry (the vendor's header, or a Gemini `key=`); any other is answered
    /// 401 and recorded as not matching.
    pub require_key: Option<String>,
    /// Streamed answers send their first event, then wait for [`FakeVendor::release`].
    pub hold_after_first_event: bool,
}

impl FakeVendorOptions {
    pub fn new(kind: VendorKind) -> Self {
        Self {
            tool: ToolCall::write_hello(kind),
            text: "I created hello.txt.".to_owned(),
            side_text: "Create hello.txt".to_owned(),
            json_text: r#"{"reasoning":"a simple task","model_choice":"flash"}"#.to_owned(),
            input_tokens: 123,
            output_tokens: 45,
            model: None,
            status: None,
            require_key: None,
            hold_after_first_event: false,
        }
    }
}

/// One request as the fake received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    /// Path and query.
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The credential it carried the vendor's way, if any.
    pub key: Option<String>,
    /// Whether `key` was [`FakeVendorOptions::require_key`]; `None` when no key is required.
    pub key_matched: Option<bool>,
}

impl RecordedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    pub fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// What a vendor module makes of a request.
enum Reply {
    Json(Value),
    /// Whole SSE frames (`event: …\ndata: …\n\n`), sent one by one.
    Events(Vec<String>),
    NotFound,
}

/// Where a turn is, read from the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// The turn's first call: call the tool.
    Tool,
    /// The request carries the tool's result: text, end of turn.
    Final,
    /// Not the turn's conversation (no tool offered, a suggestion): text.
    Side,
    /// Gemini's JSON-mode router call: JSON text.
    Json,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Self::Tool => "tool",
            Self::Final => "final",
            Self::Side => "side",
            Self::Json => "json",
        }
    }
}

/// `text` in two pieces on a character boundary (streams send text in deltas); empty pieces left out.
fn halves(text: &str) -> Vec<&str> {
    let middle = text
        .char_indices()
        .map(|(index, _)| index)
        .nth(text.chars().count() / 2)
        .unwrap_or(text.len());
    let (first, second) = text.split_at(middle);
    [first, second].into_iter().filter(|piece| !piece.is_empty()).collect()
}

fn sse(event: Option<&str>, data: &Value, line_end: &str) -> String {
    match event {
        Some(event) => format!("event: {event}{line_end}data: {data}{line_end}{line_end}"),
        None => format!("data: {data}{line_end}{line_end}"),
    }
}

struct Shared {
    kind: VendorKind,
    options: FakeVendorOptions,
    requests: Mutex<Vec<RecordedRequest>>,
    /// Answers sent with a usage report (every JSON or event-stream answer carries one).
    usage_answers: std::sync::atomic::AtomicUsize,
    release: watch::Sender<bool>,
}

/// A fake model API on `127.0.0.1`, served until dropped.
pub struct FakeVendor {
    /// `http://127.0.0.1:PORT`, no path: the base URL an agent or a proxy is pointed at.
    pub url: String,
    pub kind: VendorKind,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeVendor {
    /// A fake with the default script ([`FakeVendorOptions::new`]).
    pub async fn start(kind: VendorKind) -> std::io::Result<Self> {
        Self::start_with(kind, FakeVendorOptions::new(kind)).await
    }

    pub async fn start_with(kind: VendorKind, options: FakeVendorOptions) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let shared = Arc::new(Shared {
            kind,
            options,
            requests: Mutex::new(Vec::new()),
            usage_answers: std::sync::atomic::AtomicUsize::new(0),
            release: watch::Sender::new(false),
        });
        let router = Router::new().fallback(answer).with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok(Self {
            url,
            kind,
            shared,
            task,
        })
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared
            .requests
            .lock()
            .map(|requests| requests.clone())
            .unwrap_or_default()
    }

    /// How many answers reported usage: the tokens a ledger should hold are this many times
    /// [`FakeVendorOptions::input_tokens`] and [`FakeVendorOptions::output_tokens`].
    pub fn usage_answers(&self) -> usize {
        self.shared.usage_answers.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets held streams ([`FakeVendorOptions::hold_after_first_event`]) go on, now and from now on.
    pub fn release(&self) {
        self.shared.release.send_replace(true);
    }
}

impl Drop for FakeVendor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The credential a request carries the vendor's way.
fn key_of(kind: VendorKind, headers: &HeaderMap, query: &str) -> Option<String> {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let bearer = || header("authorization").and_then(|value| value.strip_prefix("Bearer "));
    let key = match kind {
        VendorKind::Anthropic => header("x-api-key").or_else(bearer),
        VendorKind::OpenAi => bearer(),
        VendorKind::Gemini => {
            header("x-goog-api-key").or_else(|| query.split('&').find_map(|pair| pair.strip_prefix("key=")))
        }
    };
    key.map(str::to_owned)
}

/// The vendor's error body for `status`.
fn error_body(kind: VendorKind, status: u16, message: &str) -> Value {
    match kind {
        VendorKind::Anthropic => anthropic::error(status, message),
        VendorKind::OpenAi => openai::error(status, message),
        VendorKind::Gemini => gemini::error(status, message),
    }
}

fn json_response(status: StatusCode, value: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}

async fn answer(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20).await.unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let query = parts.uri.query().unwrap_or_default().to_owned();
    let key = key_of(shared.kind, &parts.headers, &query);
    let options = &shared.options;
    let key_matched = options
        .require_key
        .as_ref()
        .map(|required| key.as_deref() == Some(required.as_str()));
    if let Ok(mut requests) = shared.requests.lock() {
        requests.push(RecordedRequest {
            method: parts.method.to_string(),
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| path.clone(), ToString::to_string),
            headers: parts.headers.clone(),
            body: body.clone(),
            key,
            key_matched,
        });
    }

    if let Some(code) = options.status {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = json_response(status, &error_body(shared.kind, code, "scripted failure"));
        if status.is_redirection() {
            response.headers_mut().insert(
                header::LOCATION,
                HeaderValue::from_static("http://127.0.0.1:9/elsewhere"),
            );
        }
        return response;
    }
    if key_matched == Some(false) {
        return json_response(
            StatusCode::UNAUTHORIZED,
            &error_body(shared.kind, 401, "invalid API key"),
        );
    }
    let request_body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = match shared.kind {
        VendorKind::Anthropic => anthropic::reply(options, &path, &request_body),
        VendorKind::OpenAi => openai::reply(options, &path, &request_body),
        VendorKind::Gemini => gemini::reply(options, &path, &query, &request_body),
    };
    if !matches!(reply, Reply::NotFound) {
        shared.usage_answers.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    match reply {
        Reply::Json(value) => json_response(StatusCode::OK, &value),
        Reply::NotFound => json_response(
            StatusCode::NOT_FOUND,
            &error_body(shared.kind, 404, &format!("no such endpoint: {path}")),
        ),
        Reply::Events(frames) => {
            let hold = options.hold_after_first_event;
            let release = shared.release.subscribe();
            let stream = futures::stream::unfold(
                (0usize, frames, release),
                move |(index, frames, mut release)| async move {
                    let frame = frames.get(index)?.clone();
                    if hold && index == 1 {
                        // Dropped sender (the fake is gone): go on, the connection is ending anyway.
                        let _ = release.wait_for(|go| *go).await;
                    }
                    Some((Ok::<_, Infallible>(Bytes::from(frame)), (index + 1, frames, release)))
                },
            );
            (
                [
                    (header::CONTENT_TYPE, "text/event-stream"),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                Body::from_stream(stream),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_split_on_characters() {
        assert_eq!(halves("abcd"), ["ab", "cd"]);
        assert_eq!(halves("é→ü"), ["é", "→ü"]);
        assert_eq!(halves("a"), ["a"]);
        assert!(halves("").is_empty());
    }

    #[test]
    fn keys_are_read_the_vendors_way() {
        let mut headers = HeaderMap::new();
        headers.insert("x-api-key", HeaderValue::from_static("anthropic-key"));
        headers.insert("authorization", HeaderValue::from_static("Bearer openai-key"));
        headers.insert("x-goog-api-key", HeaderValue::from_static("gemini-key"));
        assert_eq!(
            key_of(VendorKind::Anthropic, &headers, "").as_deref(),
            Some("anthropic-key")
        );
        assert_eq!(key_of(VendorKind::OpenAi, &headers, "").as_deref(), Some("openai-key"));
        assert_eq!(key_of(VendorKind::Gemini, &headers, "").as_deref(), Some("gemini-key"));
        let empty = HeaderMap::new();
        assert_eq!(
            key_of(VendorKind::Gemini, &empty, "alt=sse&key=q").as_deref(),
            Some("q")
        );
        assert_eq!(key_of(VendorKind::OpenAi, &empty, "key=q"), None);
    }
}
