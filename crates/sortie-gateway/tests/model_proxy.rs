//! The model proxy on a real listener in front of the fake vendors of `sortie-testkit`: the
//! workspace's key replaces whatever the agent sent, answers stream through unbuffered and
//! byte for byte, usage is read from JSON and SSE and reported once per answer, a vendor 401/403 is
//! reported before the agent sees it, 429/5xx pass untouched, a missing key never reaches the
//! vendor, redirects are never relayed, and bodies over the limit are refused. Routes off the
//! allowlist never get the key (S9), the agent's tenancy headers never reach the vendor, and one
//! session's requests in flight, buffered body bytes and body read time are bounded (S6).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::Value;
use sortie_gateway::model::{
    self, KeySource, MAX_REQUEST_BYTES, ModelApi, ModelProxyConfig, ModelProxyLimits, PinnedHeader, Upstreams, Usage,
    UsageSink,
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

struct Keys(HashMap<ModelApi, String>, Arc<std::sync::atomic::AtomicUsize>);

impl Keys {
    fn all() -> Self {
        Self(
            ModelApi::ALL.into_iter().map(|api| (api, workspace_key(api))).collect(),
            Arc::default(),
        )
    }
}

#[async_trait::async_trait]
impl KeySource for Keys {
    async fn key(&self, api: ModelApi) -> Option<String> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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
    address: std::net::SocketAddr,
    sink: Arc<Sink>,
    /// How many times the proxy asked for a key.
    key_lookups: Arc<std::sync::atomic::AtomicUsize>,
    client: reqwest::Client,
    _server: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstreams: Upstreams, keys: Keys) -> Self {
        Self::start_with(upstreams, keys, Vec::new(), ModelProxyLimits::default()).await
    }

    async fn start_with(
        upstreams: Upstreams,
        keys: Keys,
        pinned_headers: Vec<PinnedHeader>,
        limits: ModelProxyLimits,
    ) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let sink = Arc::new(Sink(watch::Sender::new(Vec::new())));
        let config = ModelProxyConfig {
            session_id: SessionId::generate(),
            upstreams,
            extra_roots_pem: Vec::new(),
            pinned_headers,
            limits,
        };
        let key_lookups = keys.1.clone();
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
            address,
            sink,
            key_lookups,
            client,
            _server: server,
        }
    }

    /// A proxy whose every API goes to `fake`.
    async fn before(fake: &FakeVendor) -> Self {
        Self::start(all_to(fake), Keys::all()).await
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

/// Every API to `fake`.
fn all_to(fake: &FakeVendor) -> Upstreams {
    Upstreams {
        anthropic: fake.url.clone(),
        openai: fake.url.clone(),
        gemini: fake.url.clone(),
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
        pinned_headers: Vec::new(),
        limits: Default::default(),
    };
    let error = model::router(config, Arc::new(Keys::all()), sink).expect_err("refused");
    assert!(error.to_string().contains("openai"), "{error}");
}

/// S9: the workspace's key is lent to inference only. Files, fine-tuning, batches, admin endpoints
/// and other methods are refused here with a 403 naming the route: no key looked up or injected, no
/// vendor contacted, nothing reported.
#[tokio::test]
async fn routes_off_the_allowlist_never_get_the_key() {
    let fake = FakeVendor::start(VendorKind::OpenAi).await.expect("fake");
    let proxy = Proxy::before(&fake).await;
    let refused = [
        (reqwest::Method::GET, "openai", "/v1/files"),
        (reqwest::Method::DELETE, "openai", "/v1/files/file-OTHER-USERS-UPLOAD"),
        (reqwest::Method::POST, "openai", "/v1/fine_tuning/jobs"),
        (reqwest::Method::GET, "openai", "/v1/organization/admin_api_keys"),
        (reqwest::Method::POST, "openai", "/v1/batches"),
        (reqwest::Method::GET, "openai", "/v1/responses/resp_1"),
        (reqwest::Method::POST, "openai", "/v1/responses/../files"),
        (reqwest::Method::POST, "openai", "/v1/%66iles"),
        (reqwest::Method::POST, "anthropic", "/v1/messages/batches"),
        (reqwest::Method::POST, "anthropic", "/v1/files"),
        (reqwest::Method::GET, "anthropic", "/v1/organizations/api_keys"),
        (reqwest::Method::PUT, "anthropic", "/v1/messages"),
        (reqwest::Method::GET, "gemini", "/v1beta/files"),
        (reqwest::Method::POST, "gemini", "/v1beta/cachedContents"),
        (reqwest::Method::POST, "gemini", "/v1beta/tunedModels/x:generateContent"),
    ];
    for (method, api, path) in refused {
        let answer = proxy
            .client
            .request(method.clone(), format!("{}/{api}{path}", proxy.base))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 403, "{method} {api}{path}");
        let body: Value = answer.json().await.expect("JSON");
        assert_eq!(
            body["error"]["code"], "MODEL_ROUTE_REFUSED",
            "{method} {api}{path}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("{method} /")) && message.contains(api) && !message.contains('\n'),
            "{message}"
        );
    }
    assert!(
        fake.requests().is_empty(),
        "a refused route reached the vendor: {:?}",
        fake.requests()
    );
    assert_eq!(
        proxy.key_lookups.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a key was looked up"
    );
    assert!(proxy.sink.seen().is_empty(), "{:?}", proxy.sink.seen());

    // The model lists are allowed: they reach the vendor (the fake has none and says 404).
    for (api, path) in [
        ("openai", "/v1/models"),
        ("openai", "/v1/models/gpt-5.5"),
        ("anthropic", "/v1/models"),
        ("gemini", "/v1beta/models"),
    ] {
        let answer = proxy
            .client
            .get(format!("{}/{api}{path}", proxy.base))
            .send()
            .await
            .expect("answer");
        assert_eq!(
            answer.status(),
            404,
            "{api}{path}: forwarded, and the fake has no such endpoint"
        );
    }
    let paths: Vec<String> = fake.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        ["/v1/models", "/v1/models/gpt-5.5", "/v1/models", "/v1beta/models"]
    );
}

/// S9: `OpenAI-Organization`, `OpenAI-Project` and `x-goog-user-project` pick whom the key bills;
/// the agent's never reach the vendor, and an operator's pinned value replaces them.
#[tokio::test]
async fn tenancy_headers_are_dropped_and_pinned_ones_set() {
    for kind in [VendorKind::OpenAi, VendorKind::Gemini] {
        let fake = FakeVendor::start(kind).await.expect("fake");
        let pinned = vec![PinnedHeader {
            api: ModelApi::Openai,
            name: "OpenAI-Organization".to_owned(),
            value: "org-pinned".to_owned(),
        }];
        let proxy = Proxy::start_with(all_to(&fake), Keys::all(), pinned, ModelProxyLimits::default()).await;
        let answer = proxy
            .agent_request(kind, &turn_start(kind, false))
            .header("openai-organization", "org-victim")
            .header("openai-project", "proj-x")
            .header("x-goog-user-project", "victim-project")
            .header("openai-beta", "responses=v1")
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 200);
        let requests = fake.requests();
        let seen = &requests[0];
        let expected_organization = (kind == VendorKind::OpenAi).then_some("org-pinned");
        assert_eq!(seen.header("openai-organization"), expected_organization, "{kind:?}");
        assert_eq!(seen.header("openai-project"), None, "{kind:?}");
        assert_eq!(seen.header("x-goog-user-project"), None, "{kind:?}");
        assert_eq!(
            seen.header("openai-beta"),
            Some("responses=v1"),
            "other vendor headers pass"
        );
    }

    let _ = rustls::crypto::ring::default_provider().install_default();
    for name in [
        "authorization",
        "x-api-key",
        "X-Goog-Api-Key",
        "content-length",
        "host",
        "connection",
        "bad name",
    ] {
        let config = ModelProxyConfig {
            session_id: SessionId::generate(),
            upstreams: Upstreams::default(),
            extra_roots_pem: Vec::new(),
            pinned_headers: vec![PinnedHeader {
                api: ModelApi::Anthropic,
                name: name.to_owned(),
                value: "v".to_owned(),
            }],
            limits: ModelProxyLimits::default(),
        };
        let sink = Arc::new(Sink(watch::Sender::new(Vec::new())));
        let error = model::router(config, Arc::new(Keys::all()), sink).expect_err("refused");
        assert!(error.to_string().contains(name), "{name}: {error}");
    }
}

/// S6: one session has at most `max_in_flight` requests in flight (until their answers end). One
/// more waits for a slot; past the wait it is answered 429 with `retry-after`, and the vendor never
/// sees it. A slot freed while it waits serves it.
#[tokio::test]
async fn requests_over_the_in_flight_cap_wait_then_are_refused() {
    let kind = VendorKind::Anthropic;
    for queue_wait in [Duration::from_millis(300), DEADLINE] {
        let fake = start_fake(kind, |options| options.hold_after_first_event = true).await;
        let limits = ModelProxyLimits {
            max_in_flight: 2,
            queue_wait,
            ..ModelProxyLimits::default()
        };
        let proxy = Proxy::start_with(all_to(&fake), Keys::all(), Vec::new(), limits).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let answer = proxy
                .agent_request(kind, &turn_start(kind, true))
                .send()
                .await
                .expect("answer");
            assert_eq!(answer.status(), 200);
            let mut events = answer.bytes_stream().eventsource();
            let first = tokio::time::timeout(DEADLINE, events.next())
                .await
                .expect("first event");
            assert!(matches!(first, Some(Ok(_))));
            held.push(events);
        }
        let started = std::time::Instant::now();
        let extra = tokio::spawn(proxy.agent_request(kind, &turn_start(kind, false)).send());
        if queue_wait < DEADLINE {
            let answer = tokio::time::timeout(DEADLINE, extra)
                .await
                .expect("an answer within the deadline")
                .expect("join")
                .expect("answer");
            assert!(started.elapsed() >= queue_wait, "refused before the wait was over");
            assert_eq!(answer.status(), 429);
            assert_eq!(
                answer.headers().get("retry-after").and_then(|v| v.to_str().ok()),
                Some("1")
            );
            let body: Value = answer.json().await.expect("JSON");
            assert_eq!(body["error"]["code"], "MODEL_REQUESTS_IN_FLIGHT");
            assert_eq!(fake.requests().len(), 2, "the refused request reached the vendor");
            fake.release();
        } else {
            // Waiting for a slot, not refused: the vendor has not seen it.
            let mut extra = extra;
            let waited = tokio::time::timeout(Duration::from_millis(300), &mut extra).await;
            assert!(
                waited.is_err(),
                "the third request was answered while two were in flight"
            );
            assert_eq!(fake.requests().len(), 2);
            // One answer ends; its slot goes to the waiting request.
            fake.release();
            drop(held.remove(0));
            let answer = tokio::time::timeout(DEADLINE, extra)
                .await
                .expect("served once a slot was free")
                .expect("join")
                .expect("answer");
            assert_eq!(answer.status(), 200);
        }
        for events in held {
            let rest: Vec<_> = tokio::time::timeout(DEADLINE, events.collect::<Vec<_>>())
                .await
                .expect("the held answers end after release");
            assert!(rest.iter().all(Result::is_ok));
        }
        // Every slot is back.
        for _ in 0..3 {
            let answer = proxy
                .agent_request(kind, &turn_start(kind, false))
                .send()
                .await
                .expect("answer");
            assert_eq!(answer.status(), 200);
        }
    }
}

/// Sends a request head with `content-length` and the first `sent` bytes of its body to the
/// proxy's socket, and leaves the connection open.
async fn partial_body(proxy: &Proxy, declared: usize, sent: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(proxy.address).await.expect("connect");
    let head = format!(
        "POST /_sortie/model/openai/v1/responses HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         content-length: {declared}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(&vec![b' '; sent]).await.expect("body");
    stream
}

/// Reads a whole HTTP/1.1 answer until the server closes the connection.
async fn read_until_closed(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer))
        .await
        .expect("the connection was closed within the deadline")
        .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}

/// S6: a body that stalls, or trickles in, is cut once the read deadline passes: 408, connection
/// closed, nothing forwarded, and its slot back.
#[tokio::test]
async fn a_stalled_or_trickling_body_is_cut_at_the_deadline() {
    use tokio::io::AsyncWriteExt;
    let fake = FakeVendor::start(VendorKind::OpenAi).await.expect("fake");
    let timeout = Duration::from_millis(500);
    let limits = ModelProxyLimits {
        max_in_flight: 1,
        body_read_timeout: timeout,
        ..ModelProxyLimits::default()
    };
    let proxy = Proxy::start_with(all_to(&fake), Keys::all(), Vec::new(), limits).await;
    for trickle in [false, true] {
        let started = std::time::Instant::now();
        let mut stream = partial_body(&proxy, 1000, 10).await;
        let (mut reader, mut writer) = stream.split();
        let answer = async {
            let mut answer = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut reader, &mut answer)
                .await
                .expect("read");
            String::from_utf8_lossy(&answer).into_owned()
        };
        let feed = async {
            // One byte every 50 ms: always something arriving, never the whole body in time.
            while trickle && writer.write_all(b" ").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            std::future::pending::<()>().await;
        };
        let answer = tokio::time::timeout(DEADLINE, async {
            tokio::select! {
                answer = answer => answer,
                () = feed => unreachable!(),
            }
        })
        .await
        .expect("the body was cut within the deadline");
        let elapsed = started.elapsed();
        assert!(answer.starts_with("HTTP/1.1 408"), "trickle={trickle}: {answer}");
        assert!(answer.contains("MODEL_BODY_TIMEOUT"), "{answer}");
        assert!(
            elapsed >= timeout && elapsed < timeout + Duration::from_secs(5),
            "trickle={trickle}: cut after {elapsed:?}"
        );
    }
    assert!(fake.requests().is_empty(), "a cut body was forwarded");
    // The slot (the only one) is free again.
    let answer = proxy
        .agent_request(VendorKind::OpenAi, &turn_start(VendorKind::OpenAi, false))
        .send()
        .await
        .expect("answer");
    assert_eq!(answer.status(), 200);
}

/// S6: the bytes of request bodies one session holds at once are bounded, however many connections
/// it opens: past the budget a request is answered 429, and the budget comes back when the bodies
/// holding it are gone. A body declared larger than the budget is refused before it is read.
#[tokio::test]
async fn a_sessions_buffered_body_bytes_are_bounded() {
    let fake = FakeVendor::start(VendorKind::OpenAi).await.expect("fake");
    let budget = 1 << 20;
    let limits = ModelProxyLimits {
        max_in_flight: 8,
        max_buffered_bytes: budget,
        body_read_timeout: DEADLINE * 3,
        ..ModelProxyLimits::default()
    };
    let proxy = Proxy::start_with(all_to(&fake), Keys::all(), Vec::new(), limits).await;

    let mut declared_too_large = partial_body(&proxy, budget + 1, 0).await;
    let answer = read_until_closed(&mut declared_too_large).await;
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("limited to 1 MiB"),
        "{answer}"
    );

    // Four bodies of 384 KiB, each one byte short: three would need 1.1 MiB. At most two fit; the
    // others are answered 429 as soon as their bytes pass the budget.
    let piece = 384 << 10;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(partial_body(&proxy, piece + 1, piece).await);
    }
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut answered = vec![false; streams.len()];
    while answered.iter().filter(|done| **done).count() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the budget never ran out: {answered:?}"
        );
        for (stream, done) in streams.iter().zip(answered.iter_mut()) {
            let mut byte = [0_u8; 1];
            *done |= tokio::time::timeout(Duration::from_millis(10), stream.peek(&mut byte))
                .await
                .is_ok();
        }
    }
    let mut held = Vec::new();
    for (mut stream, done) in streams.into_iter().zip(answered) {
        if done {
            let refused = read_until_closed(&mut stream).await;
            assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
            assert!(refused.contains("MODEL_BODIES_BUFFERED"), "{refused}");
        } else {
            held.push(stream);
        }
    }
    assert!(
        held.len() <= 2,
        "{} bodies of 384 KiB held within a 1 MiB budget",
        held.len()
    );
    assert!(fake.requests().is_empty());

    // The held bodies go away; their bytes are no longer counted.
    drop(held);
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let answer = proxy
            .client
            .post(proxy.url(VendorKind::OpenAi, "/v1/responses"))
            .header("content-type", "application/json")
            .body(vec![b' '; 900 << 10])
            .send()
            .await
            .expect("answer");
        if answer.status() == 200 {
            break;
        }
        assert_eq!(answer.status(), 429);
        assert!(std::time::Instant::now() < deadline, "the budget never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fake.requests().len(), 1);
}

/// A sink that admits or refuses as told, and records how each admitted answer ended.
#[derive(Default)]
struct Gate {
    refuse: std::sync::atomic::AtomicBool,
    admitted: std::sync::atomic::AtomicUsize,
    ended: std::sync::Mutex<Vec<bool>>,
}

#[async_trait::async_trait]
impl UsageSink for Gate {
    async fn admit(&self, _api: ModelApi) -> Result<(), String> {
        if self.refuse.load(std::sync::atomic::Ordering::Acquire) {
            return Err("the session is at its budget".into());
        }
        self.admitted.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }
    fn answer_ended(&self, _api: ModelApi, metered: bool) {
        self.ended.lock().expect("ended").push(metered);
    }
    fn usage(&self, _api: ModelApi, _usage: &Usage) {}
    fn auth_rejected(&self, _api: ModelApi, _status: u16) {}
    fn key_missing(&self, _api: ModelApi) {}
}

#[tokio::test]
async fn every_request_is_admitted_first_and_each_answer_says_whether_it_was_metered() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let metered = start_fake(VendorKind::Anthropic, |_| {}).await;
    // A 200 whose body the usage reader finds nothing in: a generation that cost unknown tokens.
    let unmetered = start_fake(VendorKind::OpenAi, |options| options.status = Some(200)).await;
    let gate = Arc::new(Gate::default());
    let config = ModelProxyConfig {
        session_id: SessionId::generate(),
        upstreams: Upstreams {
            anthropic: metered.url.clone(),
            openai: unmetered.url.clone(),
            gemini: metered.url.clone(),
        },
        extra_roots_pem: Vec::new(),
        pinned_headers: Vec::new(),
        limits: ModelProxyLimits::default(),
    };
    let router = model::router(config, Arc::new(Keys::all()), gate.clone()).expect("router");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}/_sortie/model", listener.local_addr().expect("address"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let client = reqwest::Client::new();
    let send = |kind: VendorKind| {
        let request = turn_start(kind, false);
        client
            .post(format!("{base}/{}{}", api_of(kind), request.path))
            .header("anthropic-version", "2023-06-01")
            .json(&request.body)
            .send()
    };
    let answer = send(VendorKind::Anthropic).await.expect("answer");
    assert_eq!(answer.status(), 200);
    answer.bytes().await.expect("body");
    let answer = send(VendorKind::OpenAi).await.expect("answer");
    assert_eq!(answer.status(), 200);
    answer.bytes().await.expect("body");
    let ended = sortie_testkit::wait::eventually("both answers ended", DEADLINE, || async {
        let ended = gate.ended.lock().expect("ended").clone();
        if ended.len() == 2 { Ok(ended) } else { Err(ended) }
    })
    .await;
    assert_eq!(ended, [true, false], "the second reported no usage");
    // Refused at admission: the vendor is never asked.
    gate.refuse.store(true, std::sync::atomic::Ordering::Release);
    let before = metered.requests().len();
    let refused = send(VendorKind::Anthropic).await.expect("answer");
    assert_eq!(refused.status(), 429);
    let body: serde_json::Value = refused.json().await.expect("json");
    assert!(body.to_string().contains("BUDGET_EXCEEDED"), "{body}");
    assert_eq!(metered.requests().len(), before);
    assert_eq!(gate.admitted.load(std::sync::atomic::Ordering::Acquire), 2);
    assert_eq!(
        gate.ended.lock().expect("ended").len(),
        2,
        "a refused request was never admitted"
    );
}
