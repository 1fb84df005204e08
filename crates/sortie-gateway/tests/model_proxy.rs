//! The model proxy on a real listener in front of the fake vendors of `sortie-testkit`: the
//! workspace's key replaces whatever the agent sent, answers stream through unbuffered and
//! byte for byte, usage is read from JSON and SSE and reported once per answer, a vendor 401/403 is
//! reported before the agent sees it, 429/5xx pass untouched, a missing key never reaches the
//! vendor, redirects are never relayed, and bodies over the limit are refused.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::Value;
use sortie_gateway::model::{
    self, KeySource, MAX_REQUEST_BYTES, ModelApi, ModelProxyConfig, Upstreams, Usage, UsageSink,
};
use sortie_protocol::SessionId;
use sortie_testkit::sample::{self, SampleRequest, TurnStep};
use sortie_testkit::{FakeVendor, FakeVendorOptions, ToolCall, VendorKind};
use tokio::sync::watch;

const DEADLINE: Duration = Duration::from_secs(10);
const KINDS: [VendorKind; 3] = [VendorKind::Anthropic, VendorKind::OpenAi, VendorKind::Gemini];

fn api_of(kind: VendorKind) -> ModelApi {
    match kind {
        VendorKind::Anthropic => ModelApi::Anthropic,
        VendorKind::OpenAi => ModelApi::Openai,
        VendorKind::Gemini => ModelApi::Gemini,
    }
}

fn workspace_key(api: ModelApi) -> String {
    format!("sk-workspace-{api}")
}

struct Keys(HashMap<ModelApi, String>);

impl Keys {
    fn all() -> Self {
        Self(ModelApi::ALL.into_iter().map(|api| (api, workspace_key(api))).collect())
    }
}

#[async_trait::async_trait]
impl KeySource for Keys {
    async fn key(&self, api: ModelApi) -> Option<String> {
        self.0.get(&api).cloned()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Usage(ModelApi, Usage),
    AuthRejected(ModelApi, u16),
    KeyMissing(ModelApi),
}

/// Everything the proxy reported, in order, watched.
struct Sink(watch::Sender<Vec<Seen>>);

impl Sink {
    fn seen(&self) -> Vec<Seen> {
        self.0.borrow().clone()
    }

    /// Waits (up to the deadline) until `count` reports were made, and returns them all.
    async fn wait_for(&self, count: usize) -> Vec<Seen> {
        let mut receiver = self.0.subscribe();
        let waited = tokio::time::timeout(DEADLINE, receiver.wait_for(|seen| seen.len() >= count)).await;
        let seen = self.seen();
        assert!(waited.is_ok(), "expected {count} reports, got {seen:?}");
        seen
    }
}

impl UsageSink for Sink {
    fn usage(&self, api: ModelApi, usage: &Usage) {
        self.0.send_modify(|seen| seen.push(Seen::Usage(api, usage.clone())));
    }
    fn auth_rejected(&self, api: ModelApi, status: u16) {
        self.0.send_modify(|seen| seen.push(Seen::AuthRejected(api, status)));
    }
    fn key_missing(&self, api: ModelApi) {
        self.0.send_modify(|seen| seen.push(Seen::KeyMissing(api)));
    }
}

struct Proxy {
    /// `http://127.0.0.1:PORT/_sortie/model`
    base: String,
    sink: Arc<Sink>,
    client: reqwest::Client,
    _server: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstreams: Upstreams, keys: Keys) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let sink = Arc::new(Sink(watch::Sender::new(Vec::new())));
        let config = ModelProxyConfig {
            session_id: SessionId::generate(),
            upstreams,
            extra_roots_pem: Vec::new(),
        };
        let router = model::router(config, Arc::new(keys), sink.clone()).expect("router");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("client");
        Self {
            base: format!("http://{address}/_sortie/model"),
            sink,
            client,
            _server: server,
        }
    }

    /// A proxy whose every API goes to `fake`.
    async fn before(fake: &FakeVendor) -> Self {
        let upstreams = Upstreams {
            anthropic: fake.url.clone(),
            openai: fake.url.clone(),
            gemini: fake.url.clone(),
        };
        Self::start(upstreams, Keys::all()).await
    }

    fn url(&self, kind: VendorKind, path: &str) -> String {
        format!("{}/{}{path}", self.base, api_of(kind))
    }

    /// The request as an agent sends it: with its own placeholder credential, the vendor's way.
    fn agent_request(&self, kind: VendorKind, request: &SampleRequest) -> reqwest::RequestBuilder {
        let builder = self
            .client
            .post(self.url(kind, &request.path))
            .header("accept-encoding", "gzip, br")
            .json(&request.body);
        match kind {
            VendorKind::Anthropic => builder
                .header("x-api-key", "placeholder")
                .header("anthropic-version", "2023-06-01")
                .header("anthropic-beta", "fine-grained-tool-streaming-2025-05-14"),
            VendorKind::OpenAi => builder.bearer_auth("placeholder"),
            VendorKind::Gemini => builder.header("x-goog-api-key", "placeholder"),
        }
    }
}

fn turn_start(kind: VendorKind, stream: bool) -> SampleRequest {
    sample::request(kind, &ToolCall::write_hello(kind), TurnStep::Start, stream)
}

async fn start_fake(kind: VendorKind, configure: impl FnOnce(&mut FakeVendorOptions)) -> FakeVendor {
    let mut options = FakeVendorOptions::new(kind);
    configure(&mut options);
    FakeVendor::start_with(kind, options).await.expect("fake vendor")
}

#[tokio::test]
async fn the_workspace_key_replaces_the_agents_credentials() {
    for kind in KINDS {
        let api = api_of(kind);
        let fake = start_fake(kind, |options| options.require_key = Some(workspace_key(api))).await;
        let proxy = Proxy::before(&fake).await;
        let mut request = turn_start(kind, false);
        if kind == VendorKind::Gemini {
            request.path.push_str("?key=placeholder&%6Bey=placeholder");
        }
        let answer = proxy
            .agent_request(kind, &request)
            // Every vendor's credential header at once: none of them may reach any vendor.
            .header("authorization", "Bearer placeholder")
            .header("x-api-key", "placeholder")
            .header("x-goog-api-key", "placeholder")
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 200, "{kind:?}: {:?}", answer.text().await);

        let requests = fake.requests();
        assert_eq!(requests.len(), 1);
        let seen = &requests[0];
        assert_eq!(seen.key_matched, Some(true), "{kind:?}: {:?}", seen.key);
        let credentials: Vec<_> = ["authorization", "x-api-key", "x-goog-api-key"]
            .into_iter()
            .filter_map(|name| seen.header(name).map(|value| (name, value.to_owned())))
            .collect();
        let expected = match kind {
            VendorKind::Anthropic => ("x-api-key", workspace_key(api)),
            VendorKind::OpenAi => ("authorization", format!("Bearer {}", workspace_key(api))),
            VendorKind::Gemini => ("x-goog-api-key", workspace_key(api)),
        };
        assert_eq!(
            credentials,
            [expected],
            "{kind:?}: only the workspace's key, the vendor's way"
        );
        assert!(!seen.path.contains("placeholder"), "{kind:?}: {}", seen.path);
        assert_eq!(seen.header("accept-encoding"), Some("identity"));
        assert_eq!(seen.json(), Some(request.body.clone()), "{kind:?}: the body as sent");
        match kind {
            VendorKind::Anthropic => {
                assert_eq!(seen.path, "/v1/messages?beta=true");
                assert_eq!(seen.header("anthropic-version"), Some("2023-06-01"));
                assert!(seen.header("anthropic-beta").is_some());
            }
            VendorKind::OpenAi => assert_eq!(seen.path, "/v1/responses"),
            VendorKind::Gemini => assert_eq!(seen.path, "/v1beta/models/gemini-2.5-pro:generateContent"),
        }
    }
}

#[tokio::test]
async fn answers_stream_through_unbuffered() {
    for kind in KINDS {
        let fake = start_fake(kind, |options| options.hold_after_first_event = true).await;
        let proxy = Proxy::before(&fake).await;
        let answer = proxy
            .agent_request(kind, &turn_start(kind, true))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 200);
        assert_eq!(
            answer.headers().get("content-type").and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        let mut events = answer.bytes_stream().eventsource();
        // The fake sends nothing more until released: the first event can only come through if
        // the proxy relays frames as they arrive.
        let first = tokio::time::timeout(DEADLINE, events.next())
            .await
            .unwrap_or_else(|_| panic!("{kind:?}: the first event did not come through before release"))
            .expect("an event")
            .expect("a well-formed event");
        assert!(!first.data.is_empty());
        assert!(proxy.sink.seen().is_empty(), "no usage before the answer ends");
        fake.release();
        let rest: Vec<_> = tokio::time::timeout(DEADLINE, events.collect::<Vec<_>>())
            .await
            .expect("the rest after release");
        assert!(rest.iter().all(Result::is_ok) && !rest.is_empty());
        let seen = proxy.sink.wait_for(1).await;
        assert!(
            matches!(&seen[..], [Seen::Usage(_, usage)] if usage.output_tokens == 45),
            "{seen:?}"
        );
    }
}

#[tokio::test]
async fn usage_is_read_from_json_and_sse_and_reported_once_per_answer() {
    let mut expected = Vec::new();
    let mut upstreams = Upstreams::default();
    let mut fakes = Vec::new();
    for kind in KINDS {
        let answer_model = format!("{}-from-the-answer", sample::model(kind));
        let fake = start_fake(kind, |options| options.model = Some(answer_model.clone())).await;
        match kind {
            VendorKind::Anthropic => upstreams.anthropic = fake.url.clone(),
            VendorKind::OpenAi => upstreams.openai = fake.url.clone(),
            VendorKind::Gemini => upstreams.gemini = fake.url.clone(),
        }
        fakes.push((kind, fake, answer_model));
    }
    let proxy = Proxy::start(upstreams, Keys::all()).await;
    let direct = reqwest::Client::new();
    for (kind, fake, answer_model) in &fakes {
        for stream in [false, true] {
            for step in [TurnStep::Start, TurnStep::ToolResult] {
                let request = sample::request(*kind, &ToolCall::write_hello(*kind), step, stream);
                let through = proxy.agent_request(*kind, &request).send().await.expect("answer");
                assert_eq!(through.status(), 200);
                let content_type = through.headers().get("content-type").cloned();
                let through = through.bytes().await.expect("body");
                let straight = direct
                    .post(format!("{}{}", fake.url, request.path))
                    .json(&request.body)
                    .send()
                    .await
                    .expect("direct answer");
                assert_eq!(content_type, straight.headers().get("content-type").cloned());
                let straight = straight.bytes().await.expect("body");
                assert_eq!(
                    through, straight,
                    "{kind:?} stream={stream} {step:?}: the answer unchanged"
                );

                expected.push(Seen::Usage(
                    api_of(*kind),
                    Usage {
                        model: answer_model.clone(),
                        input_tokens: 123,
                        output_tokens: 45,
                    },
                ));
                // One report per answer, in order: each is waited for before the next request.
                assert_eq!(proxy.sink.wait_for(expected.len()).await, expected);
            }
        }
    }
}

#[tokio::test]
async fn a_gemini_array_stream_and_the_requests_model() {
    let fake = FakeVendor::start(VendorKind::Gemini).await.expect("fake");
    let proxy = Proxy::before(&fake).await;
    let request = SampleRequest {
        path: "/v1beta/models/gemini-2.5-flash:streamGenerateContent".to_owned(),
        body: turn_start(VendorKind::Gemini, false).body,
    };
    let answer = proxy
        .agent_request(VendorKind::Gemini, &request)
        .send()
        .await
        .expect("answer");
    let body: Value = answer.json().await.expect("a JSON array");
    assert!(body.is_array());
    let seen = proxy.sink.wait_for(1).await;
    assert_eq!(
        seen,
        [Seen::Usage(
            ModelApi::Gemini,
            Usage {
                model: "gemini-2.5-flash".to_owned(),
                input_tokens: 123,
                output_tokens: 45
            }
        )]
    );
}

#[tokio::test]
async fn an_answer_cut_short_reports_what_it_read() {
    let fake = start_fake(VendorKind::Anthropic, |options| options.hold_after_first_event = true).await;
    let proxy = Proxy::before(&fake).await;
    let answer = proxy
        .agent_request(VendorKind::Anthropic, &turn_start(VendorKind::Anthropic, true))
        .send()
        .await
        .expect("answer");
    let mut events = answer.bytes_stream().eventsource();
    let first = tokio::time::timeout(DEADLINE, events.next())
        .await
        .expect("first event");
    assert!(matches!(first, Some(Ok(event)) if event.event == "message_start"));
    drop(events);
    let seen = proxy.sink.wait_for(1).await;
    assert_eq!(
        seen,
        [Seen::Usage(
            ModelApi::Anthropic,
            Usage {
                model: "claude-sonnet-4-5".to_owned(),
                input_tokens: 123,
                output_tokens: 1
            }
        )]
    );
}

#[tokio::test]
async fn a_rejected_key_is_reported_before_the_agent_sees_the_answer() {
    for (kind, status) in [
        (VendorKind::Anthropic, 401),
        (VendorKind::OpenAi, 401),
        (VendorKind::Gemini, 403),
    ] {
        let fake = start_fake(kind, |options| options.status = Some(status)).await;
        let proxy = Proxy::before(&fake).await;
        let answer = proxy
            .agent_request(kind, &turn_start(kind, true))
            .send()
            .await
            .expect("answer");
        // Reported by the time the status line arrives, not when the body ends.
        assert_eq!(proxy.sink.seen(), [Seen::AuthRejected(api_of(kind), status)]);
        assert_eq!(answer.status().as_u16(), status, "the vendor's answer is relayed");
        let body: Value = answer.json().await.expect("the vendor's error");
        assert_eq!(body["error"]["message"], "scripted failure", "{kind:?}: {body}");
    }
}

#[tokio::test]
async fn rate_limits_and_server_errors_pass_through_without_a_report() {
    let healthy_anthropic = FakeVendor::start(VendorKind::Anthropic).await.expect("fake");
    let healthy_openai = FakeVendor::start(VendorKind::OpenAi).await.expect("fake");
    for (kind, status) in [
        (VendorKind::Anthropic, 429),
        (VendorKind::OpenAi, 500),
        (VendorKind::Gemini, 503),
        (VendorKind::Anthropic, 529),
    ] {
        let failing = start_fake(kind, |options| options.status = Some(status)).await;
        // Another API on the same proxy, healthy: its report comes after anything the failure made.
        let (sentinel, healthy) = if kind == VendorKind::Anthropic {
            (VendorKind::OpenAi, &healthy_openai)
        } else {
            (VendorKind::Anthropic, &healthy_anthropic)
        };
        let mut upstreams = Upstreams {
            anthropic: healthy.url.clone(),
            openai: healthy.url.clone(),
            gemini: healthy.url.clone(),
        };
        match kind {
            VendorKind::Anthropic => upstreams.anthropic = failing.url.clone(),
            VendorKind::OpenAi => upstreams.openai = failing.url.clone(),
            VendorKind::Gemini => upstreams.gemini = failing.url.clone(),
        }
        let proxy = Proxy::start(upstreams, Keys::all()).await;
        for stream in [false, true] {
            let answer = proxy
                .agent_request(kind, &turn_start(kind, stream))
                .send()
                .await
                .expect("answer");
            assert_eq!(answer.status().as_u16(), status);
            let body: Value = answer.json().await.expect("the vendor's error");
            assert_eq!(body["error"]["message"], "scripted failure", "{kind:?}: {body}");
        }
        let answer = proxy
            .agent_request(sentinel, &turn_start(sentinel, false))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 200);
        let seen = proxy.sink.wait_for(1).await;
        assert!(
            matches!(&seen[..], [Seen::Usage(api, _)] if *api == api_of(sentinel)),
            "{kind:?} {status}: {seen:?}"
        );
    }
}

#[tokio::test]
async fn no_key_is_answered_here_without_contacting_the_vendor() {
    let fake = FakeVendor::start(VendorKind::Gemini).await.expect("fake");
    let upstreams = Upstreams {
        anthropic: fake.url.clone(),
        openai: fake.url.clone(),
        gemini: fake.url.clone(),
    };
    let mut keys = Keys::all();
    keys.0.remove(&ModelApi::Gemini);
    keys.0.insert(ModelApi::Openai, "  ".to_owned());
    let proxy = Proxy::start(upstreams, keys).await;
    for kind in [VendorKind::Gemini, VendorKind::OpenAi] {
        let answer = proxy
            .agent_request(kind, &turn_start(kind, true))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 401);
        let body: Value = answer.json().await.expect("JSON");
        let api = api_of(kind);
        assert_eq!(body["error"]["code"], "MODEL_KEY_MISSING");
        assert_eq!(
            body["error"]["message"],
            format!("no {api} key is set for this workspace: sortie keys set {api}")
        );
    }
    assert_eq!(
        proxy.sink.seen(),
        [Seen::KeyMissing(ModelApi::Gemini), Seen::KeyMissing(ModelApi::Openai)]
    );
    assert!(fake.requests().is_empty(), "the vendor was contacted");
}

#[tokio::test]
async fn redirects_are_never_relayed() {
    for status in [301, 307, 308] {
        let fake = start_fake(VendorKind::Anthropic, |options| options.status = Some(status)).await;
        let proxy = Proxy::before(&fake).await;
        let answer = proxy
            .agent_request(VendorKind::Anthropic, &turn_start(VendorKind::Anthropic, false))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 502);
        assert!(answer.headers().get("location").is_none());
        let body = answer.text().await.expect("body");
        assert!(!body.contains("elsewhere"), "{body}");
        assert!(body.contains("MODEL_UPSTREAM_REDIRECT"), "{body}");
        assert_eq!(fake.requests().len(), 1, "the redirect was followed");
        assert!(proxy.sink.seen().is_empty());
    }
}

#[tokio::test]
async fn bodies_over_the_limit_are_refused_413() {
    let fake = FakeVendor::start(VendorKind::OpenAi).await.expect("fake");
    let proxy = Proxy::before(&fake).await;
    let url = proxy.url(VendorKind::OpenAi, "/v1/responses");

    // Declared too long: refused before a byte of it is read.
    let declared = proxy
        .client
        .post(&url)
        .header("content-type", "application/json")
        .body(vec![b' '; MAX_REQUEST_BYTES + 1])
        .send()
        .await
        .expect("an answer to a declared length");
    assert_eq!(declared.status(), 413);
    let body: Value = declared.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "BODY_TOO_LARGE");

    // Chunked, no length: refused once the limit is passed.
    let pieces = (0..=MAX_REQUEST_BYTES / (1 << 20)).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1 << 20]));
    let chunked = proxy
        .client
        .post(&url)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(pieces)))
        .send()
        .await
        .expect("an answer to a chunked body");
    assert_eq!(chunked.status(), 413);
    assert!(fake.requests().is_empty(), "an oversized body was forwarded");

    // At the limit it goes through.
    let at_limit = proxy
        .client
        .post(&url)
        .bearer_auth("placeholder")
        .body(vec![b' '; MAX_REQUEST_BYTES])
        .send()
        .await
        .expect("an answer");
    assert_eq!(at_limit.status(), 200);
    assert_eq!(fake.requests().len(), 1);
    assert_eq!(fake.requests()[0].body.len(), MAX_REQUEST_BYTES);
}

#[tokio::test]
async fn unknown_apis_and_unreachable_upstreams() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = closed.local_addr().expect("address");
    drop(closed);
    let upstreams = Upstreams {
        anthropic: format!("http://{address}"),
        ..Upstreams::default()
    };
    let proxy = Proxy::start(upstreams, Keys::all()).await;
    let unknown = proxy
        .client
        .post(format!("{}/mistral/v1/chat/completions", proxy.base))
        .body("{}")
        .send()
        .await
        .expect("answer");
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "MODEL_API_UNKNOWN");

    let unreachable = proxy
        .agent_request(VendorKind::Anthropic, &turn_start(VendorKind::Anthropic, true))
        .send()
        .await
        .expect("answer");
    assert_eq!(unreachable.status(), 502);
    let body: Value = unreachable.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "MODEL_UPSTREAM_UNREACHABLE");
    assert!(proxy.sink.seen().is_empty());
}

#[test]
fn upstreams_must_be_http_urls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let sink = Arc::new(Sink(watch::Sender::new(Vec::new())));
    let config = ModelProxyConfig {
        session_id: SessionId::generate(),
        upstreams: Upstreams {
            openai: "file:///etc".to_owned(),
            ..Upstreams::default()
        },
        extra_roots_pem: Vec::new(),
    };
    let error = model::router(config, Arc::new(Keys::all()), sink).expect_err("refused");
    assert!(error.to_string().contains("openai"), "{error}");
}
