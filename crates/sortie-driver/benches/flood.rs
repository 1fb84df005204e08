//! A `flood: 100000` turn of the scripted agent delivered through the driver to a subscriber over the
//! Unix socket (target ≥ 50k parts/s), beside a baseline measured in the same run: replaying the same
//! finished turn from the hub over the same socket. Also prints the hub's memory for the turn.
//!
//! `cargo bench -p sortie-driver --bench flood` (set `SORTIE_BENCH_FLOOD` to change the count).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sortie_driver::agent::AgentLaunch;

// As the `sortie` binary, whose driver this measures.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use sortie_driver::driver::{Driver, DriverConfig};

fn scripted_agent() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "sortie-scripted-agent"])
        .current_dir(&root)
        .status()
        .expect("cargo");
    assert!(status.success());
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    target.join("release/sortie-scripted-agent")
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

async fn read_stream(client: &reqwest::Client, n: u32) -> (u64, Duration) {
    let started = Instant::now();
    let mut response = client
        .get(format!("http://driver/turns/{n}/stream"))
        .send()
        .await
        .expect("stream");
    let mut body = Vec::new();
    while let Some(bytes) = response.chunk().await.expect("chunk") {
        body.extend_from_slice(&bytes);
    }
    let elapsed = started.elapsed();
    assert!(body.ends_with(b"data: [DONE]\n\n"), "the stream ended with [DONE]");
    let events = body.windows(6).filter(|w| w == b"data: ").count() as u64;
    (events.saturating_sub(1), elapsed)
}

fn main() {
    let count: u64 = std::env::var("SORTIE_BENCH_FLOOD")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let agent = scripted_agent();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let temp = tempfile::tempdir().expect("temp");
        let home = temp.path().join("home");
        std::fs::create_dir_all(&home).expect("home");
        let launch = AgentLaunch {
            command: agent,
            args: Vec::new(),
            env: vec![
                ("HOME".into(), home.to_string_lossy().into_owned()),
                ("PATH".into(), "/usr/bin:/bin".into()),
            ],
            cwd: temp.path().to_owned(),
            mode: None,
            resume_session: None,
        };
        let driver = Driver::new(DriverConfig {
            launch,
            turns_dir: temp.path().join("turns"),
            session_id: "ses_bench".into(),
            turn_timeout: Duration::from_secs(600),
            start_timeout: Duration::from_secs(30),
            kill_grace: Duration::from_secs(5),
            persist_dir: home.join(".sortie"),
            delivery: None,
        });
        let socket = temp.path().join("driver.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        tokio::spawn(sortie_driver::api::run(
            listener,
            driver.clone(),
            std::future::pending(),
        ));
        let client = {
            let _ = rustls::crypto::ring::default_provider().install_default();
            reqwest::Client::builder()
        }
        .unix_socket(socket)
        .build()
        .expect("client");

        // Warm the agent up so the measured turn does not include its start.
        client
            .post("http://driver/turns")
            .json(&serde_json::json!({"n": 1, "nonce": "warm", "prompt": "#!scripted\nsay: warm"}))
            .send()
            .await
            .expect("warm");
        read_stream(&client, 1).await;

        let rss_before = rss_kib();
        let started = Instant::now();
        let prompt = format!("#!scripted\nflood: {count}");
        client
            .post("http://driver/turns")
            .json(&serde_json::json!({"n": 2, "nonce": "flood", "prompt": prompt}))
            .send()
            .await
            .expect("turn");
        let (live_parts, _) = read_stream(&client, 2).await;
        let live = started.elapsed();
        let (replayed_parts, replay) = read_stream(&client, 2).await;
        let hub = driver.hub(2).expect("hub");
        println!("flood: {count} message chunks from the scripted agent, through the driver, over the Unix socket");
        println!("{:<34} {:>10} {:>12} {:>14}", "path", "parts", "seconds", "parts/s");
        println!(
            "{:<34} {:>10} {:>12.3} {:>14.0}",
            "live turn (agent → subscriber)",
            live_parts,
            live.as_secs_f64(),
            live_parts as f64 / live.as_secs_f64()
        );
        println!(
            "{:<34} {:>10} {:>12.3} {:>14.0}",
            "baseline: replay from the hub",
            replayed_parts,
            replay.as_secs_f64(),
            replayed_parts as f64 / replay.as_secs_f64()
        );
        println!(
            "hub memory for the turn: {} parts, {:.1} MiB of encoded chunks; process RSS grew {:.1} MiB",
            hub.len(),
            hub.memory_bytes() as f64 / 1048576.0,
            rss_kib().saturating_sub(rss_before) as f64 / 1024.0
        );
        let verdict = if live_parts as f64 / live.as_secs_f64() >= 50_000.0 {
            "met"
        } else {
            "MISSED"
        };
        println!("target: ≥ 50k parts/s delivered live: {verdict}");
        driver.shutdown().await;
    });
}
