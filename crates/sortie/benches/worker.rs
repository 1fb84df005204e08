//! The worker's hot paths (DESIGN §10), with a baseline in the same run where one exists:
//! - create → first part on an attached client, repository already mirrored (target p50 < 500 ms);
//! - workspace preparation from the mirror of a 100 MiB repository (target < 300 ms), vs
//!   `git clone --no-local` of the same repository;
//! - sessions completed per minute with short scripted turns on this machine.
//!
//! `cargo bench -p sortie --bench worker` (as root: it runs real sandboxes)

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const SORTIE: &str = env!("CARGO_BIN_EXE_sortie");

use sortie_testkit::git::git;

fn percentile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[((samples.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(samples.len() - 1)]
}

/// A bare repository with one commit of `bytes` incompressible bytes in 1 MiB files.
fn repository(root: &Path, name: &str, bytes: usize) -> std::path::PathBuf {
    let seed = root.join(format!("{name}-seed"));
    std::fs::create_dir_all(&seed).expect("seed");
    git(&seed, &["init", "-q"]);
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..bytes.div_ceil(1 << 20) {
        let mut data = vec![0_u8; 1 << 20];
        for chunk in data.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        std::fs::write(seed.join(format!("blob-{i}.bin")), data).expect("write");
    }
    std::fs::write(seed.join("README.md"), "bench\n").expect("write");
    git(&seed, &["add", "."]);
    git(&seed, &["commit", "-q", "-m", "seed"]);
    let bare = root.join(format!("{name}.git"));
    git(
        root,
        &[
            "clone",
            "-q",
            "--bare",
            seed.to_str().expect("utf-8"),
            bare.to_str().expect("utf-8"),
        ],
    );
    bare
}

struct Serve {
    child: std::process::Child,
    url: String,
    token: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(root: &Path, extra: &[&str]) -> Serve {
    let data_dir = root.join("data");
    let mut command = Command::new(SORTIE);
    for (key, _) in std::env::vars() {
        if key.starts_with("SORTIE_") {
            command.env_remove(key);
        }
    }
    let mut child = command
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data_dir)
        .args(extra)
        .env("HOME", root)
        .env("SORTIE_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut url = String::new();
    for line in lines.by_ref().map_while(Result::ok) {
        if let Some(at) = line.strip_prefix("sortie listening on ") {
            url = at.to_owned();
            break;
        }
    }
    // Keep reading: serve prints more (the sign-in link), and a closed pipe would fail its writes.
    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    assert!(!url.is_empty(), "serve did not start");
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    Serve { child, url, token }
}

async fn create(http: &reqwest::Client, serve: &Serve, repo: &Path, task: &str) -> String {
    let created: Value = http
        .post(format!("{}/v1/sessions", serve.url))
        .bearer_auth(&serve.token)
        .json(&json!({"repo": repo, "task": task, "agent": "scripted"}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    created["id"].as_str().expect("id").to_owned()
}

async fn phase(http: &reqwest::Client, serve: &Serve, id: &str) -> String {
    let session: Value = http
        .get(format!("{}/v1/sessions/{id}", serve.url))
        .bearer_auth(&serve.token)
        .send()
        .await
        .expect("session")
        .json()
        .await
        .expect("json");
    session["phase"].as_str().unwrap_or("").to_owned()
}

async fn wait_resting(http: &reqwest::Client, serve: &Serve, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let now = phase(http, serve, id).await;
        if ["idle", "failed", "hibernated", "canceled"].contains(&now.as_str()) {
            // Hibernated: it finished, then made room for a waiting session.
            assert!(now == "idle" || now == "hibernated", "session {id} ended {now}");
            return;
        }
        assert!(Instant::now() < deadline, "session {id} stuck in {now}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn first_part_after_create(http: &reqwest::Client, serve: &Serve, repo: &Path) -> f64 {
    let began = Instant::now();
    let id = create(http, serve, repo, "#!scripted\nsay: hello").await;
    let ticket: Value = http
        .post(format!("{}/v1/sessions/{id}/attach-ticket", serve.url))
        .bearer_auth(&serve.token)
        .json(&json!({"action": "attach"}))
        .send()
        .await
        .expect("ticket")
        .json()
        .await
        .expect("json");
    let mut response = http
        .get(format!("{}/v1/sessions/{id}/stream", serve.url))
        .header(
            "authorization",
            format!("Ticket {}", ticket["ticket"].as_str().expect("ticket")),
        )
        .send()
        .await
        .expect("attach");
    let mut seen = String::new();
    while let Some(bytes) = response.chunk().await.expect("stream") {
        seen.push_str(&String::from_utf8_lossy(&bytes));
        // The agent's first words, not the driver's `start` chunk (sent before the agent runs).
        if seen.contains("hello") {
            break;
        }
    }
    let latency = began.elapsed().as_secs_f64() * 1000.0;
    drop(response);
    wait_resting(http, serve, &id).await;
    latency
}

// As the `sortie` binary, whose gateway this runs in-process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The scripted agent must sit beside this (release) sortie binary, where the driver looks.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "sortie-scripted-agent"])
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .status()
        .expect("cargo");
    assert!(built.success(), "cannot build the scripted agent");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path();
    let http = reqwest::Client::new();

    // Workspace preparation from a mirror of 100 MiB, vs a plain local clone of the same repository.
    let big = repository(root, "big", 100 << 20);
    let mirrors = root.join("mirrors");
    let (mut prepare, mut baseline) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        let git_binary = Path::new("git");
        let _made =
            sortie_worker::prepare::ensure_mirror(git_binary, &mirrors, big.to_str().expect("utf-8"), None, None)
                .await
                .expect("mirror");
        for i in 0..10 {
            let workspace = root.join(format!("ws-{i}"));
            let began = Instant::now();
            // What every provision does: fetch the mirror, clone from it, hand the tree to the sandbox uid.
            let mirror =
                sortie_worker::prepare::ensure_mirror(git_binary, &mirrors, big.to_str().expect("utf-8"), None, None)
                    .await
                    .expect("fetch");
            sortie_worker::prepare::ensure_workspace(
                git_binary,
                &mirror,
                &workspace,
                // A clone made on the path, as when no workspace was checked out ahead.
                None,
                &format!("sortie/bench-{i}"),
                None,
                "http://127.0.0.1:3128/_sortie/git/x.git",
                // Checked out as the sandbox's uid (here nobody), as the worker does when root.
                Some((65534, 65534)),
            )
            .await
            .expect("workspace");
            prepare.push(began.elapsed().as_secs_f64() * 1000.0);
            let direct = root.join(format!("direct-{i}"));
            let began = Instant::now();
            git(
                root,
                &[
                    "clone",
                    "-q",
                    "--no-local",
                    big.to_str().expect("utf-8"),
                    direct.to_str().expect("utf-8"),
                ],
            );
            baseline.push(began.elapsed().as_secs_f64() * 1000.0);
            let _ = std::fs::remove_dir_all(&workspace);
            let _ = std::fs::remove_dir_all(&direct);
        }
    });
    println!(
        "workspace from the mirror of a 100 MiB repo (fetch, clone --shared, checkout as the sandbox uid): p50 {:.1} ms, p95 {:.1} ms (target < 300 ms); \
         baseline git clone --no-local: p50 {:.1} ms",
        percentile(&mut prepare, 0.5),
        percentile(&mut prepare, 0.95),
        percentile(&mut baseline, 0.5)
    );

    let small = repository(root, "small", 1 << 16);
    let server = serve(root, &["--sandboxes-per-workspace", "4"]);
    runtime.block_on(async {
        // The first session makes the mirror; the measured ones find it.
        first_part_after_create(&http, &server, &small).await;
        let mut latencies = Vec::new();
        for _ in 0..20 {
            latencies.push(first_part_after_create(&http, &server, &small).await);
        }
        println!(
            "create → the agent's first text on an attached client (mirrored repo): p50 {:.1} ms, p95 {:.1} ms (target p50 < 500 ms)",
            percentile(&mut latencies, 0.5),
            percentile(&mut latencies, 0.95)
        );

        let sessions = 24;
        let began = Instant::now();
        let mut ids = Vec::new();
        for i in 0..sessions {
            ids.push(create(&http, &server, &small, &format!("#!scripted\nwrite: f{i}.txt\n{i}\n>>>\nsay: done")).await);
        }
        for id in &ids {
            wait_resting(&http, &server, id).await;
        }
        let seconds = began.elapsed().as_secs_f64();
        println!(
            "{sessions} sessions (write a file, deliver) created at once, 4 sandboxes per workspace: {seconds:.1} s, \
             {:.0} sessions/minute",
            sessions as f64 * 60.0 / seconds
        );
    });
}
