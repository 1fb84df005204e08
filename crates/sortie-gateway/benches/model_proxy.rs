//! The model proxy's streaming latency (DESIGN §10, issue "real agents"): the time to the first SSE
//! event of a vendor answer through the proxy, beside the same request sent straight to the fake
//! vendor in the same run; their difference is what the proxy adds (target: the first byte reaches
//! the agent within 10 ms of leaving the vendor).
//!
//! `cargo bench -p sortie-gateway --bench model_proxy`

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use sortie_gateway::model::{self, KeySource, ModelApi, ModelProxyConfig, Upstreams, Usage, UsageSink};
use sortie_protocol::SessionId;
use sortie_testkit::{FakeVendor, FakeVendorOptions, ToolCall, VendorKind, sample};

struct Key;

#[async_trait]
impl KeySource for Key {
    async fn key(&self, _api: ModelApi) -> Option<String> {
        Some("sk-bench".into())
    }
}

struct Ignore;

impl UsageSink for Ignore {
    fn usage(&self, _api: ModelApi, _usage: &Usage) {}
    fn auth_rejected(&self, _api: ModelApi, _status: u16) {}
    fn key_missing(&self, _api: ModelApi) {}
}

fn percentile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[((samples.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(samples.len() - 1)]
}

/// Milliseconds from sending the request to holding the first SSE event's bytes.
async fn first_event_ms(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> f64 {
    let began = Instant::now();
    let mut answer = client
        .post(url)
        .header("x-api-key", "placeholder")
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("answer");
    let mut seen = Vec::new();
    while let Some(bytes) = answer.chunk().await.expect("chunk") {
        seen.extend_from_slice(&bytes);
        if seen.windows(2).any(|w| w == b"\n\n") {
            break;
        }
    }
    began.elapsed().as_secs_f64() * 1000.0
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let kind = VendorKind::Anthropic;
        let fake = FakeVendor::start_with(kind, FakeVendorOptions::new(kind))
            .await
            .expect("fake");
        let config = ModelProxyConfig {
            session_id: SessionId::generate(),
            upstreams: Upstreams {
                anthropic: fake.url.clone(),
                ..Upstreams::default()
            },
            extra_roots_pem: Vec::new(),
            pinned_headers: Vec::new(),
            limits: Default::default(),
        };
        let router = model::router(config, Arc::new(Key), Arc::new(Ignore)).expect("router");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let client = reqwest::Client::new();
        let request = sample::request(kind, &ToolCall::write_hello(kind), sample::TurnStep::Start, true);
        let through = format!("http://{address}/_sortie/model/anthropic{}", request.path);
        let direct = format!("{}{}", fake.url, request.path);
        for _ in 0..50 {
            first_event_ms(&client, &through, &request.body).await;
            first_event_ms(&client, &direct, &request.body).await;
        }
        let (mut proxied, mut straight, mut added) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..500 {
            let p = first_event_ms(&client, &through, &request.body).await;
            let d = first_event_ms(&client, &direct, &request.body).await;
            proxied.push(p);
            straight.push(d);
            added.push(p - d);
        }
        println!(
            "first SSE event of a vendor answer: through the model proxy p50 {:.2} ms p99 {:.2} ms; straight to \
             the vendor p50 {:.2} ms p99 {:.2} ms; added by the proxy p50 {:.2} ms p99 {:.2} ms (target < 10 ms)",
            percentile(&mut proxied, 0.5),
            percentile(&mut proxied, 0.99),
            percentile(&mut straight, 0.5),
            percentile(&mut straight, 0.99),
            percentile(&mut added, 0.5),
            percentile(&mut added, 0.99),
        );
    });
}
