//! Create-accept latency over a real socket (DESIGN §10: p99 < 10 ms on SQLite), on SQLite and on
//! PostgreSQL, beside a baseline measured in the same run: `GET /healthz` on the same connection, the
//! floor of one HTTP round trip through the same stack.
//!
//! `cargo bench -p sortie-server --bench create_accept` (set `SORTIE_BENCH_REQUESTS` to change the count).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sortie_protocol::api::Role;
use sortie_server::{AgentCatalog, ApiState, Secret, tokens};
use sortie_store::testing::{TestBackend, TestDatabase};
use sortie_store::{ControlPlane, RepoAccess, SqlStore};

struct Figures {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn figures(mut samples: Vec<Duration>) -> Figures {
    samples.sort_unstable();
    let at = |q: f64| {
        samples[((samples.len() as f64 * q).ceil() as usize)
            .saturating_sub(1)
            .min(samples.len() - 1)]
    };
    Figures {
        p50: at(0.50),
        p99: at(0.99),
        max: samples[samples.len() - 1],
    }
}

fn ms(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}

async fn measure(backend: TestBackend, requests: usize) -> (Figures, Figures) {
    let dir = tempfile::tempdir().expect("temp dir");
    let database = TestDatabase::new(backend, dir.path()).await.expect("database");
    let store = Arc::new(SqlStore::connect(&database.url).await.expect("store"));
    let workspace = store
        .create_workspace(
            "default",
            RepoAccess {
                any_local_path: true,
                allowed_roots: vec![],
            },
        )
        .await
        .expect("workspace");
    let (token, hash) = tokens::generate_token().expect("token");
    store
        .create_token(&workspace.id, Role::Operator, &hash, None, None)
        .await
        .expect("token");
    let repo = dir.path().join("repo");
    assert!(
        std::process::Command::new("git")
            .args(["init", "-q"])
            .arg(&repo)
            .status()
            .expect("git")
            .success()
    );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let state = ApiState {
        store: store.clone(),
        agents: Arc::new(AgentCatalog::default()),
        ticket_secret: Secret::new(b"bench".to_vec()),
        keyring: Arc::new(sortie_store::KeyRing::generate().expect("keyring")),
        signins: Default::default(),
        webhook_exempt: Default::default(),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(sortie_server::run(listener, state, async move {
        let _ = stopped.await;
    }));

    let client = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    };
    let body = json!({"repo": repo, "task": "Fix the flaky test in the parser and add a regression test.", "egress": {"allow": ["github.com"]}});
    let create = || async {
        let reply = client
            .post(format!("{base}/v1/sessions"))
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
            .expect("create");
        assert_eq!(reply.status().as_u16(), 202);
        reply.bytes().await.expect("body");
    };
    let health = || async {
        let reply = client.get(format!("{base}/healthz")).send().await.expect("health");
        reply.bytes().await.expect("body");
    };
    for _ in 0..100 {
        create().await;
        health().await;
    }
    let mut creates = Vec::with_capacity(requests);
    let mut baseline = Vec::with_capacity(requests);
    for _ in 0..requests {
        let started = Instant::now();
        create().await;
        creates.push(started.elapsed());
        let started = Instant::now();
        health().await;
        baseline.push(started.elapsed());
    }
    let _ = stop.send(());
    let _ = server.await;
    store.close().await;
    (figures(creates), figures(baseline))
}

fn main() {
    let requests: usize = std::env::var("SORTIE_BENCH_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!("create-accept over a real socket, {requests} sequential requests after 100 warm-up");
    println!(
        "{:<12} {:<22} {:>10} {:>10} {:>10}",
        "store", "request", "p50", "p99", "max"
    );
    for (name, backend) in [("sqlite", TestBackend::Sqlite), ("postgres", TestBackend::Postgres)] {
        let (create, baseline) = runtime.block_on(measure(backend, requests));
        println!(
            "{:<12} {:<22} {:>10} {:>10} {:>10}",
            name,
            "POST /v1/sessions",
            ms(create.p50),
            ms(create.p99),
            ms(create.max)
        );
        println!(
            "{:<12} {:<22} {:>10} {:>10} {:>10}",
            name,
            "GET /healthz (base)",
            ms(baseline.p50),
            ms(baseline.p99),
            ms(baseline.max)
        );
        if backend == TestBackend::Sqlite {
            let verdict = if create.p99 < Duration::from_millis(10) {
                "met"
            } else {
                "MISSED"
            };
            println!("target: create-accept p99 < 10 ms on SQLite: {verdict}");
        }
    }
}
