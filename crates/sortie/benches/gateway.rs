//! The gateway's hot paths (DESIGN §10), each beside a baseline measured in the same run:
//! - first-part latency, driver publish → client read (target p99 < 50 ms), vs reading the driver directly;
//! - parts/s of a `flood: 90000` turn (under the 100,000 parts a turn may store) through the gateway to one client (target ≥ 50k/s), vs directly;
//! - extra RSS of 1,000 clients attached to one session (target < 100 MiB), gateway and driver processes;
//! - a clone of a 100 MiB repository through the git proxy vs `git clone --no-local` (target ratio ≥ 0.8).
//!
//! `cargo bench -p sortie --bench gateway`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_gateway::attach::AttachState;
use sortie_gateway::git::http::{Upstream, Upstreams};
use sortie_gateway::live::Feeds;
use sortie_protocol::SessionId;
use sortie_protocol::api::TicketAction;
use sortie_protocol::ticket::{TICKET_VERSION, TicketClaims, mint};
use sortie_store::{
    ControlPlane, Ledger, NewSession, RepoAccess, SqlStore, Transcripts, TurnOutcome, testing::TestDatabase,
};
use sortie_worker::client::DriverClient;
use sortie_worker::recorder::follow;
use sortie_worker::transcript::{Ending, Transcript};

const SORTIE: &str = env!("CARGO_BIN_EXE_sortie");
const SECRET: &[u8] = b"bench-secret";

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn percentile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[((samples.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(samples.len() - 1)]
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Milliseconds since the epoch of an RFC 3339 UTC time of today (enough for latencies).
fn epoch_ms_of(at: &str) -> Option<i64> {
    let time = at.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let (h, m, s): (i64, i64, f64) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    let day_start = now_ms() - now_ms().rem_euclid(86_400_000);
    Some(day_start + (h * 3600 + m * 60) * 1000 + (s * 1000.0).round() as i64)
}

struct World {
    store: Arc<SqlStore>,
    workspace_id: String,
    session: SessionId,
    driver: std::process::Child,
    driver_client: reqwest::Client,
    driver_socket: PathBuf,
    feeds: Arc<Feeds>,
    gateway: String,
    client: reqwest::Client,
    _temp: tempfile::TempDir,
    _database: TestDatabase,
}

impl World {
    async fn start() -> World {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        assert!(
            Command::new(cargo)
                .args(["build", "--release", "--quiet", "-p", "sortie-scripted-agent"])
                .current_dir(&root)
                .status()
                .expect("cargo")
                .success()
        );
        let temp = tempfile::tempdir().expect("temp");
        let database = TestDatabase::sqlite(temp.path());
        let store = Arc::new(SqlStore::connect(&database.url).await.expect("store"));
        let workspace = store
            .create_workspace("default", RepoAccess::default())
            .await
            .expect("ws");
        let session = SessionId::generate();
        let new = NewSession {
            id: session.clone(),
            workspace_id: workspace.id.clone(),
            repo: "https://github.com/o/r.git".into(),
            base: None,
            agent: "scripted".into(),
            model: None,
            title: "bench".into(),
            egress_allow: Vec::new(),
            setup: None,
            task: "bench".into(),
            budget: Default::default(),
        };
        store.create_session(new).await.expect("session");
        let socket = temp.path().join("driver.sock");
        std::fs::create_dir_all(temp.path().join("ws")).expect("ws");
        let driver = Command::new(SORTIE)
            .arg("driver")
            .arg("--socket")
            .arg(&socket)
            .arg("--workspace")
            .arg(temp.path().join("ws"))
            .arg("--home")
            .arg(temp.path().join("home"))
            .args(["--agent", "scripted", "--session", session.as_str()])
            .stdout(Stdio::null())
            .env("SORTIE_LOG", "warn")
            .spawn()
            .expect("driver");
        let driver_client = {
            let _ = rustls::crypto::ring::default_provider().install_default();
            reqwest::Client::builder()
        }
        .unix_socket(socket.clone())
        .build()
        .expect("client");
        let deadline = Instant::now() + Duration::from_secs(30);
        while driver_client.get("http://driver/status").send().await.is_err() {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let feeds = Feeds::new();
        let state = AttachState {
            store: store.clone(),
            ticket_secret: Arc::from(SECRET),
            tails: feeds.clone(),
            allowed_origins: Arc::new(Vec::new()),
            heartbeat: Duration::from_secs(15),
            slow_client_limit: sortie_gateway::attach::SLOW_CLIENT_LIMIT,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let gateway = format!(
            "http://{}/v1/sessions/{session}/stream",
            listener.local_addr().expect("addr")
        );
        tokio::spawn(sortie_gateway::attach::run(listener, state, std::future::pending()));
        World {
            store,
            workspace_id: workspace.id,
            session,
            driver,
            driver_client,
            driver_socket: socket,
            feeds,
            gateway,
            client: {
                let _ = rustls::crypto::ring::default_provider().install_default();
                reqwest::Client::new()
            },
            _temp: temp,
            _database: database,
        }
    }

    fn ticket(&self, nonce: &str) -> String {
        let claims = TicketClaims {
            v: TICKET_VERSION,
            sub: "bench".into(),
            ws: self.workspace_id.clone(),
            ses: self.session.to_string(),
            act: TicketAction::Attach,
            exp: now_ms() / 1000 + 60,
            nonce: nonce.into(),
        };
        mint(SECRET, &claims)
    }

    /// Runs turn 1: claimed in the store, started on the driver and recorded into the host's
    /// transcript, which attach serves (as the worker does).
    async fn turn(&self, script: &str) {
        self.store
            .claim_turn(&self.session, true, "bench")
            .await
            .expect("claim");
        let transcript = Transcript::open(self.store.clone(), self.feeds.clone(), &self.session, 1)
            .await
            .expect("transcript");
        let prompt = format!("#!scripted\n{script}");
        let reply = self
            .driver_client
            .post("http://driver/turns")
            .json(&json!({"n": 1, "nonce": "bench", "prompt": prompt}))
            .send()
            .await
            .expect("turn");
        assert_eq!(reply.status().as_u16(), 202);
        let driver = DriverClient::new(&self.driver_socket);
        let (store, session) = (self.store.clone(), self.session.clone());
        tokio::spawn(async move {
            while !follow(&driver, 1, &transcript).await.complete {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            transcript.finish(Ending::default()).await;
            // The host's word ends the turn, as the worker's does: attach ends a stream on the store's status.
            let outcome = TurnOutcome {
                status: sortie_protocol::TurnStatus::Completed,
                head_sha: None,
                failure: None,
            };
            store.finish_turn(&session, 1, outcome).await.expect("finish the turn");
        });
    }

    /// Waits until the store says turn 1 ended (the host's word, after its transcript is closed).
    async fn ended(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let turns = self
                .store
                .turns(&self.workspace_id, &self.session)
                .await
                .expect("turns");
            if turns.iter().any(|turn| turn.n == 1 && turn.status.is_terminal()) {
                return;
            }
            assert!(Instant::now() < deadline, "turn 1 did not end");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn stop(mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }

    async fn through_gateway(&self, nonce: &str) -> reqwest::Response {
        self.through_gateway_at(nonce, "").await
    }

    /// With `query` `?turn=1`: an ended turn (without one, a session with no turn in flight answers 204).
    async fn through_gateway_at(&self, nonce: &str, query: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{query}", self.gateway))
            .header("authorization", format!("Ticket {}", self.ticket(nonce)))
            .send()
            .await
            .expect("attach")
    }
}

/// Reads a stream, noting for every block start the delay between its `at` stamp and its arrival.
async fn latencies(mut response: reqwest::Response) -> (Vec<f64>, u64) {
    let mut pending = String::new();
    let mut delays = Vec::new();
    let mut parts = 0;
    while let Some(bytes) = response.chunk().await.expect("chunk") {
        let arrived = now_ms();
        pending.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            if let Some(json) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                parts += 1;
                if let Ok(chunk) = serde_json::from_str::<Value>(json)
                    && chunk["type"] == "text-start"
                    && let Some(at) = chunk["providerMetadata"]["sortie"]["at"].as_str().and_then(epoch_ms_of)
                {
                    delays.push((arrived - at) as f64);
                }
            }
        }
    }
    (delays, parts)
}

async fn count_parts(mut response: reqwest::Response) -> u64 {
    let mut parts = 0;
    let mut carry = Vec::new();
    while let Some(bytes) = response.chunk().await.expect("chunk") {
        carry.extend_from_slice(&bytes);
        parts += carry.windows(6).filter(|w| w == b"data: ").count() as u64;
        // Five bytes cannot hold a whole marker, only the start of one the next read completes.
        let keep = carry.len().saturating_sub(5);
        carry.drain(..keep);
    }
    parts
}

struct OneRepo(SessionId, PathBuf);
impl Upstreams for OneRepo {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.0).then(|| Upstream::Local(self.1.clone()))
    }
}

use sortie_testkit::git::git;

// As the `sortie` binary, whose gateway this runs in-process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // Latency: one client through the gateway and one on the driver's socket, both attached first.
        let world = World::start().await;
        let pings: String = (0..100).map(|i| format!("sleep: 20\nsay: ping {i}\nthink: pong {i}\n")).collect();
        world.turn(&pings).await;
        let (through, direct) = tokio::join!(world.through_gateway("latency"), world.driver_client.get("http://driver/turns/1/stream").send());
        let ((mut via_gateway, _), (mut via_driver, _)) = tokio::join!(latencies(through), latencies(direct.expect("direct")));
        println!("{:<48} {:>10} {:>10}", "first-part latency (publish → client read)", "p50", "p99");
        println!("{:<48} {:>7.1} ms {:>7.1} ms", "through the gateway", percentile(&mut via_gateway, 0.5), percentile(&mut via_gateway, 0.99));
        println!("{:<48} {:>7.1} ms {:>7.1} ms", "baseline: the driver's socket", percentile(&mut via_driver, 0.5), percentile(&mut via_driver, 0.99));
        world.stop();

        // Throughput: a flood through the gateway to one client, then read again on the driver's socket.
        let world = World::start().await;
        world.turn("flood: 90000").await;
        let started = Instant::now();
        let via = count_parts(world.through_gateway("flood").await).await;
        let via_rate = via as f64 / started.elapsed().as_secs_f64();
        // The same turn again once it ended, as someone opening the session just after reads it: from
        // the copy the worker kept in memory, then (that copy let go) from the store.
        world.ended().await;
        let started = Instant::now();
        let replayed = count_parts(world.through_gateway_at("flood-replay", "?turn=1").await).await;
        let replayed_rate = replayed as f64 / started.elapsed().as_secs_f64();
        // A new live copy of the turn replaces the kept one; gone, it leaves the store alone to answer.
        let placeholder = sortie_feed::hub::TurnHub::in_memory(1);
        world.feeds.insert(&world.session, 1, placeholder.clone());
        world.feeds.remove(&world.session, 1, &placeholder);
        let started = Instant::now();
        let stored = count_parts(world.through_gateway_at("flood-stored", "?turn=1").await).await;
        let stored_rate = stored as f64 / started.elapsed().as_secs_f64();
        let started = Instant::now();
        let direct = count_parts(world.driver_client.get("http://driver/turns/1/stream").send().await.expect("direct")).await;
        let direct_rate = direct as f64 / started.elapsed().as_secs_f64();
        println!("{:<48} {:>10} {:>12}", "flood: 90000 to one client", "parts", "parts/s");
        println!("{:<48} {:>10} {:>12.0}", "through the gateway, live (target ≥ 50k/s)", via, via_rate);
        println!("{:<48} {:>10} {:>12.0}", "through the gateway, the ended turn (kept copy)", replayed, replayed_rate);
        println!("{:<48} {:>10} {:>12.0}", "through the gateway, the ended turn (the store)", stored, stored_rate);
        println!("{:<48} {:>10} {:>12.0}", "baseline: replay on the driver's socket", direct, direct_rate);
        world.stop();

        // 1,000 clients on one session: extra RSS of this process (the gateway) and of the driver.
        let world = World::start().await;
        let gateway_before = rss_kib(std::process::id());
        let driver_before = rss_kib(world.driver.id());
        world.turn("sleep: 4000\nsay: done").await;
        let mut clients = Vec::new();
        for i in 0..1000 {
            clients.push(world.through_gateway(&format!("c{i}")).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let gateway_extra = rss_kib(std::process::id()).saturating_sub(gateway_before) as f64 / 1024.0;
        let driver_extra = rss_kib(world.driver.id()).saturating_sub(driver_before) as f64 / 1024.0;
        println!("1,000 attached clients: gateway process +{gateway_extra:.1} MiB, driver +{driver_extra:.1} MiB (target < 100 MiB)");
        drop(clients);
        world.stop();

        // Git: a 100 MiB repository (100 random 1 MiB blobs in 10 commits), cloned directly and through the proxy.
        let temp = tempfile::tempdir().expect("temp");
        let repo = temp.path().join("source");
        git(temp.path(), &["init", "-q", repo.to_str().expect("utf-8")]);
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        for commit in 0..10 {
            for file in 0..10 {
                let blob: Vec<u8> = (0..(1 << 20))
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state as u8
                    })
                    .collect();
                std::fs::write(repo.join(format!("blob-{commit}-{file}")), blob).expect("write");
            }
            git(&repo, &["add", "."]);
            git(&repo, &["commit", "-q", "-m", &format!("c{commit}")]);
        }
        let bare = temp.path().join("upstream.git");
        git(temp.path(), &["clone", "-q", "--bare", "--no-local", repo.to_str().expect("utf-8"), bare.to_str().expect("utf-8")]);
        let session = SessionId::generate();
        let app = sortie_gateway::git::http::router(sortie_gateway::git::config::GitProxyConfig::new(
            Arc::new(OneRepo(session.clone(), bare.clone())),
            PathBuf::from("git"),
            &temp.path().join("git-state"),
            Arc::new(sortie_gateway::git::config::PushRecords::default()),
            Arc::new(sortie_gateway::git::config::NoKnownSecrets),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/_sortie/git/{session}.git", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum_serve(listener, app).await });
        let mut direct_times = Vec::new();
        let mut proxy_times = Vec::new();
        for round in 0..3 {
            let target = temp.path().join(format!("direct-{round}"));
            let started = Instant::now();
            git(temp.path(), &["clone", "-q", "--no-local", bare.to_str().expect("utf-8"), target.to_str().expect("utf-8")]);
            direct_times.push(started.elapsed().as_secs_f64());
            let target = temp.path().join(format!("proxy-{round}"));
            let (url, dir) = (url.clone(), temp.path().to_owned());
            let started = Instant::now();
            tokio::task::spawn_blocking(move || git(&dir, &["clone", "-q", &url, target.to_str().expect("utf-8")])).await.expect("join");
            proxy_times.push(started.elapsed().as_secs_f64());
        }
        let (direct, proxied) = (percentile(&mut direct_times, 0.5), percentile(&mut proxy_times, 0.5));
        println!(
            "clone of a 100 MiB repository (median of 3): --no-local {direct:.2} s, through the git proxy {proxied:.2} s, speed ratio {:.2} (target ≥ 0.8)",
            direct / proxied
        );
    });
}

async fn axum_serve(listener: tokio::net::TcpListener, app: axum::Router) {
    let _ = axum::serve(listener, app).await;
}
