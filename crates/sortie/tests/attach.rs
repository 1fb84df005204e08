//! Attach through the gateway: tickets at the door, the active turn from its `start` to `[DONE]` for
//! clients joining at any moment, many clients at once, and a stream the real AI SDK accepts. The
//! test plays the worker with its own parts: a real `sortie driver` runs the turns, and the worker's
//! recorder and transcript make the host's copy that attach serves.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_gateway::attach::AttachState;
use sortie_gateway::live::Feeds;
use sortie_protocol::api::TicketAction;
use sortie_protocol::ticket::{TICKET_VERSION, TicketClaims, mint};
use sortie_protocol::{SessionId, SessionPhase, TurnStatus};
use sortie_store::{
    ControlPlane, Ledger, NewSession, RepoAccess, SqlStore, Transcripts, TurnOutcome, testing::TestDatabase,
};
use sortie_worker::client::DriverClient;
use sortie_worker::recorder::follow;
use sortie_worker::transcript::{Ending, Transcript};

const SECRET: &[u8] = b"attach-test-secret";

fn build_scripted_agent() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let status = std::process::Command::new(cargo)
        .args(["build", "--quiet", "-p", "sortie-scripted-agent"])
        .current_dir(root)
        .status()
        .expect("cargo");
    assert!(status.success());
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

struct World {
    _temp: tempfile::TempDir,
    _database: TestDatabase,
    driver: std::process::Child,
    driver_client: reqwest::Client,
    driver_socket: PathBuf,
    feeds: Arc<Feeds>,
    /// The recorder of each turn the test started, until it ended.
    recorders: std::sync::Mutex<HashMap<u32, tokio::task::JoinHandle<()>>>,
    store: Arc<SqlStore>,
    workspace_id: String,
    /// The agent's working directory (the driver runs on the host here).
    workspace_dir: PathBuf,
    session: SessionId,
    base: String,
    client: reqwest::Client,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl World {
    async fn start() -> World {
        Self::start_with_slow_limit(sortie_gateway::attach::SLOW_CLIENT_LIMIT).await
    }

    /// With how long the gateway lets a client leave its buffer full before it is disconnected.
    async fn start_with_slow_limit(slow_client_limit: Duration) -> World {
        build_scripted_agent();
        let temp = tempfile::tempdir().expect("temp");
        let database = TestDatabase::sqlite(temp.path());
        let store = Arc::new(SqlStore::connect(&database.url).await.expect("store"));
        let workspace = store
            .create_workspace("default", RepoAccess::default())
            .await
            .expect("workspace");
        let session = SessionId::generate();
        store
            .create_session(NewSession {
                id: session.clone(),
                workspace_id: workspace.id.clone(),
                repo: "https://github.com/o/r.git".into(),
                base: None,
                agent: "scripted".into(),
                model: None,
                title: "t".into(),
                egress_allow: Vec::new(),
                setup: None,
                task: "t".into(),
                budget: Default::default(),
            })
            .await
            .expect("session");
        let socket = temp.path().join("driver.sock");
        let workspace_dir = temp.path().join("ws");
        std::fs::create_dir_all(&workspace_dir).expect("ws");
        let mut driver = support::sortie(temp.path())
            .arg("driver")
            .arg("--socket")
            .arg(&socket)
            .arg("--workspace")
            .arg(&workspace_dir)
            .arg("--home")
            .arg(temp.path().join("home"))
            .args(["--agent", "scripted", "--session", session.as_str()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("driver");
        let stdout = driver.stdout.take().expect("stdout");
        let (said, listening) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = said.send(line);
            }
        });
        assert!(
            listening.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the driver did not start"
        );

        let feeds = Feeds::new();
        let state = AttachState {
            store: store.clone(),
            ticket_secret: Arc::from(SECRET),
            tails: feeds.clone(),
            allowed_origins: Arc::new(vec!["http://dashboard.local".into()]),
            heartbeat: Duration::from_secs(15),
            slow_client_limit,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(sortie_gateway::attach::run(listener, state, std::future::pending()));
        let driver_client = support::http_builder()
            .unix_socket(socket.clone())
            .build()
            .expect("client");
        World {
            _temp: temp,
            _database: database,
            driver,
            driver_client,
            driver_socket: socket,
            feeds,
            recorders: std::sync::Mutex::new(HashMap::new()),
            store,
            workspace_id: workspace.id,
            workspace_dir,
            session,
            base,
            // A connection per attach, as the many clients of these tests would have: a pooled idle
            // connection the gateway is closing at that moment fails the next request sent on it,
            // which a browser retries and a single `send` here does not.
            client: support::http_builder()
                .pool_max_idle_per_host(0)
                .build()
                .expect("client"),
        }
    }

    fn ticket(&self, nonce: &str) -> String {
        self.ticket_for(nonce, TicketAction::Attach)
    }

    fn ticket_for(&self, nonce: &str, action: TicketAction) -> String {
        let claims = TicketClaims {
            v: TICKET_VERSION,
            sub: "tok_test".into(),
            ws: self.workspace_id.clone(),
            ses: self.session.to_string(),
            act: action,
            exp: now() + 60,
            nonce: nonce.into(),
        };
        mint(SECRET, &claims)
    }

    /// Attaches and returns only the status (a waiting stream never ends by itself).
    async fn attach_status(&self, nonce: &str) -> u16 {
        let reply = self
            .client
            .get(self.url())
            .header("authorization", format!("Ticket {}", self.ticket(nonce)))
            .send()
            .await
            .expect("get");
        reply.status().as_u16()
    }

    fn url(&self) -> String {
        format!("{}/v1/sessions/{}/stream", self.base, self.session)
    }

    async fn attach(&self, nonce: &str) -> (u16, String) {
        self.attach_after(nonce, None).await
    }

    /// Attaches as a client that already has the parts up to `last_seen` (its `Last-Event-ID`).
    async fn attach_after(&self, nonce: &str, last_seen: Option<u64>) -> (u16, String) {
        let mut request = self
            .client
            .get(self.url())
            .header("authorization", format!("Ticket {}", self.ticket(nonce)));
        if let Some(index) = last_seen {
            request = request.header("last-event-id", index.to_string());
        }
        let reply = request.send().await.expect("get");
        let status = reply.status().as_u16();
        (status, reply.text().await.unwrap_or_default())
    }

    /// Runs turn `n` in the store (claimed, as a worker would) and on the driver.
    async fn run_turn(&self, n: u32, script: &str) {
        let claimed = self
            .store
            .claim_turn(&self.session, true, "test")
            .await
            .expect("claim")
            .expect("a turn");
        assert_eq!(claimed.n, n);
        self.start_on_driver(n, &format!("#!scripted\n{script}")).await;
    }

    /// Starts turn `n` on the driver and records it into the host's transcript, as the worker does.
    async fn start_on_driver(&self, n: u32, prompt: &str) {
        let transcript = Transcript::open(self.store.clone(), self.feeds.clone(), &self.session, n)
            .await
            .expect("transcript");
        let reply = self
            .driver_client
            .post("http://driver/turns")
            .json(&json!({"n": n, "nonce": format!("nonce-{n}"), "prompt": prompt}))
            .send()
            .await
            .expect("turn");
        assert_eq!(reply.status().as_u16(), 202);
        let driver = DriverClient::new(&self.driver_socket);
        let (store, session) = (self.store.clone(), self.session.clone());
        let recorder = tokio::spawn(async move {
            while !follow(&driver, n, &transcript).await.complete {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            transcript.finish(Ending::default()).await;
            // Ended in the ledger too, as the worker does: a client that attaches once the live copy
            // is gone reads the rest from the store and ends.
            let done = TurnOutcome {
                status: TurnStatus::Completed,
                head_sha: None,
                failure: None,
            };
            assert!(store.finish_turn(&session, n, done).await.expect("finish"));
        });
        self.recorders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(n, recorder);
    }

    /// Waits for turn `n` on the driver, then completes it in the store and rests the session (as
    /// the worker will).
    async fn complete_turn(&self, n: u32) {
        self.host_parts(n).await;
        for (from, to) in [
            (SessionPhase::Running, SessionPhase::Delivering),
            (SessionPhase::Delivering, SessionPhase::Idle),
        ] {
            assert!(
                self.store
                    .transition_session(&self.session, from, to)
                    .await
                    .expect("transition")
            );
        }
    }

    /// How many parts the host's copy of turn `n` has so far (0 before it started).
    async fn parts_so_far(&self, n: u32) -> u64 {
        match self.feeds.get(&self.session, n) {
            Some(hub) => hub.len(),
            None => self.stored_parts(n).await,
        }
    }

    async fn stored_parts(&self, n: u32) -> u64 {
        let parts = self.store.parts(&self.session).await.expect("parts");
        parts.iter().filter(|p| p.turn == n).count() as u64
    }

    /// Waits until the host's transcript of turn `n` is closed; answers how many parts it has.
    async fn host_parts(&self, n: u32) -> u64 {
        let recorder = self.recorders.lock().unwrap_or_else(|p| p.into_inner()).remove(&n);
        if let Some(recorder) = recorder {
            tokio::time::timeout(Duration::from_secs(60), recorder)
                .await
                .expect("turn {n} did not end")
                .expect("recorder");
        }
        self.stored_parts(n).await
    }
}

fn ids(stream: &str) -> Vec<u64> {
    stream
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .filter_map(|id| id.parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_joining_at_any_moment_get_the_whole_turn_exactly_once() {
    let world = Arc::new(World::start().await);
    // Turn 1 waits in the store: the stream answers at once and waits for it (only the head is read).
    assert_eq!(world.attach_status("early").await, 200);

    world
        .run_turn(
            1,
            "say: begin\nsleep: 400\nflood: 5000\nsleep: 400\nflood: 5000\nsay: end",
        )
        .await;
    let mut readers = Vec::new();
    let mut seed: u64 = 0xA076_1D64_78BD_642F;
    for trial in 0..100 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_millis(seed % 1500);
        let world = world.clone();
        readers.push(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let published = world.parts_so_far(1).await;
            // Every third client comes back having seen half of what was published (a resume).
            // `then`, not `then_some`: the argument of `then_some` is computed even when the condition fails.
            let last_seen = (trial % 3 == 0 && published > 1).then(|| published / 2 - 1);
            let (status, body) = world.attach_after(&format!("trial-{trial}"), last_seen).await;
            (trial, delay, published, last_seen, status, body)
        }));
    }
    let total = world.host_parts(1).await;
    assert!(total > 10_000, "{total}");
    let mut joined_midway = 0;
    for reader in readers {
        let (trial, delay, published, last_seen, status, body) = reader.await.expect("join");
        if published > 0 && published < total {
            joined_midway += 1;
        }
        assert_eq!(status, 200, "trial {trial}");
        let first = last_seen.map_or(0, |seen| seen + 1);
        assert_eq!(
            ids(&body),
            (first..total).collect::<Vec<_>>(),
            "trial {trial} joined after {delay:?} having seen {last_seen:?}: no gap, no duplicate"
        );
        if last_seen.is_none() {
            assert!(
                body.contains(&format!(r#""messageId":"{}-t1""#, world.session)),
                "starts at `start`"
            );
        }
        assert!(body.ends_with("data: [DONE]\n\n"), "trial {trial}");
    }
    // The trials are spread over the turn: most joined while it ran (some before, some after).
    assert!(
        joined_midway >= 20,
        "only {joined_midway} of 100 trials joined a running turn"
    );

    // The ended turn is kept whole in memory, and whoever replays it now reads exactly what was stored.
    let kept = world.feeds.ended(&world.session, 1).expect("the ended turn is kept");
    assert_eq!(kept.len(), total);
    let replayed = world
        .client
        .get(format!("{}?turn=1", world.url()))
        .header("authorization", format!("Ticket {}", world.ticket("replay")))
        .send()
        .await
        .expect("replay")
        .bytes()
        .await
        .expect("the replay's body");
    let mut stored = Vec::new();
    for part in world.store.turn_parts(&world.session, 1).await.expect("parts") {
        sortie_protocol::chunk::write_sse_event(&mut stored, u64::from(part.part_index), &part.payload);
    }
    stored.extend_from_slice(sortie_protocol::chunk::SSE_DONE);
    assert!(replayed[..] == stored[..], "the replay differs from the store");

    // The real AI SDK accepts the stream.
    let kit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/ai-sdk");
    if !kit.join("node_modules/ai").exists() {
        assert!(
            std::process::Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&kit)
                .status()
                .expect("npm")
                .success()
        );
    }
    let validated = std::process::Command::new("node")
        .arg(kit.join("validate.mjs"))
        .args([
            "--url",
            &format!("{}?turn=1", world.url()),
            "--header",
            &format!("Authorization: Ticket {}", world.ticket("validate")),
        ])
        .output()
        .expect("node");
    assert!(
        validated.status.success(),
        "{}",
        String::from_utf8_lossy(&validated.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_attach_to_one_turn() {
    let world = Arc::new(World::start().await);
    // The turn waits at a gate until every client is attached (a sleep would race 1,000 attaches on a
    // loaded machine), then floods.
    world
        .run_turn(
            1,
            "run: while [ ! -e gate ]; do sleep 0.02; done\nflood: 200\nsay: done",
        )
        .await;
    let (attached_tx, mut attached) = tokio::sync::mpsc::channel(1000);
    let mut readers = Vec::new();
    for client in 0..1000 {
        let (world, attached_tx) = (world.clone(), attached_tx.clone());
        readers.push(tokio::spawn(async move {
            let reply = world
                .client
                .get(world.url())
                .header(
                    "authorization",
                    format!("Ticket {}", world.ticket(&format!("client-{client}"))),
                )
                .send()
                .await
                .expect("get");
            let status = reply.status().as_u16();
            let _ = attached_tx.send(()).await;
            (status, reply.text().await.expect("body"))
        }));
    }
    for _ in 0..1000 {
        tokio::time::timeout(Duration::from_secs(120), attached.recv())
            .await
            .expect("every client attaches")
            .expect("a reader");
    }
    std::fs::write(world.workspace_dir.join("gate"), "").expect("open the gate");
    let total = world.host_parts(1).await;
    for reader in readers {
        let (status, body) = reader.await.expect("join");
        assert_eq!(status, 200);
        assert_eq!(
            ids(&body),
            (0..total).collect::<Vec<_>>(),
            "every client got every part, once, in order"
        );
        assert!(body.ends_with("data: [DONE]\n\n"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_guard_the_stream_and_idle_sessions_answer_204() {
    let world = World::start().await;
    let unauthenticated = world.client.get(world.url()).send().await.expect("get");
    assert_eq!(unauthenticated.status().as_u16(), 401);
    let body: Value = unauthenticated.json().await.expect("json");
    assert_eq!(body["error"]["code"], "TICKET_INVALID");
    let ticket = world.ticket("once");
    let in_url = world
        .client
        .get(format!("{}?ticket={ticket}", world.url()))
        .send()
        .await
        .expect("get");
    assert_eq!(in_url.status().as_u16(), 401);
    assert_eq!(world.attach_status("replayed").await, 200);
    let replay = world
        .client
        .get(world.url())
        .header("authorization", format!("Ticket {}", world.ticket("replayed")))
        .send()
        .await
        .expect("get");
    let body: Value = replay.json().await.expect("json");
    assert_eq!(body["error"]["code"], "TICKET_REPLAYED");

    // Finish turn 1 in the store: nothing is active any more → 204; ?turn=1 replays it.
    world.run_turn(1, "say: only turn").await;
    world.complete_turn(1).await;
    let (status, body) = world.attach("idle").await;
    assert_eq!((status, body.as_str()), (204, ""));
    let replayed = world
        .client
        .get(format!("{}?turn=1", world.url()))
        .header("authorization", format!("Ticket {}", world.ticket("turn-1")))
        .header("origin", "http://dashboard.local")
        .send()
        .await
        .expect("get");
    assert_eq!(replayed.status().as_u16(), 200);
    assert_eq!(
        replayed
            .headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok()),
        Some("http://dashboard.local")
    );
    assert_eq!(
        replayed
            .headers()
            .get("x-vercel-ai-ui-message-stream")
            .and_then(|v| v.to_str().ok()),
        Some("v1")
    );
    let text = replayed.text().await.expect("body");
    assert!(
        text.contains("only turn") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_submit_becomes_a_steer_answered_with_its_stream() {
    let world = Arc::new(World::start().await);
    world.run_turn(1, "say: first").await;
    world.complete_turn(1).await;

    let body = json!({
        "id": world.session.to_string(),
        "trigger": "submit-message",
        "messages": [
            {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "the first task"}]},
            {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": "first"}]},
            {"id": "u2", "role": "user", "parts": [{"type": "text", "text": "#!scripted\nsay: steered through the chat"}]},
        ],
    });
    let attach_ticket = world.ticket("attach-not-turn");
    let wrong = world
        .client
        .post(world.url())
        .header("authorization", format!("Ticket {attach_ticket}"))
        .json(&body)
        .send()
        .await
        .expect("post");
    assert_eq!(wrong.status().as_u16(), 401, "an attach ticket cannot submit a turn");
    let submit = {
        let world = world.clone();
        let body = body.clone();
        tokio::spawn(async move {
            let reply = world
                .client
                .post(world.url())
                .header(
                    "authorization",
                    format!("Ticket {}", world.ticket_for("submit", TicketAction::Turn)),
                )
                .json(&body)
                .send()
                .await
                .expect("post");
            (reply.status().as_u16(), reply.text().await.unwrap_or_default())
        })
    };
    // Play the worker: wait for the steer to land in the store, then run it on the driver.
    let deadline = Instant::now() + Duration::from_secs(20);
    let prompt = loop {
        let turns = world
            .store
            .turns(&world.workspace_id, &world.session)
            .await
            .expect("turns");
        if let Some(turn) = turns.iter().find(|t| t.n == 2) {
            break turn.prompt.clone();
        }
        assert!(Instant::now() < deadline, "the submit never became a turn");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(prompt, "#!scripted\nsay: steered through the chat");
    world
        .store
        .claim_turn(&world.session, true, "test")
        .await
        .expect("claim")
        .expect("turn 2");
    world.start_on_driver(2, &prompt).await;
    let (status, text) = tokio::time::timeout(Duration::from_secs(30), submit)
        .await
        .expect("in time")
        .expect("join");
    assert_eq!(status, 200);
    assert!(
        text.contains(&format!(r#""messageId":"{}-t2""#, world.session)),
        "{text}"
    );
    assert!(
        text.contains("steered through the chat") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_slows_no_one() {
    // The stalled client is never cut off while the test runs: a reader that waited for it would wait
    // out the test's deadline, however slow or loaded the machine is.
    let world = Arc::new(World::start_with_slow_limit(Duration::from_secs(3600)).await);
    world.run_turn(1, "sleep: 300\nflood: 100000").await;
    // Attached, then never reads a byte of the body.
    let stalled = world
        .client
        .get(world.url())
        .header("authorization", format!("Ticket {}", world.ticket("stalled")))
        .send()
        .await
        .expect("get");
    assert_eq!(stalled.status().as_u16(), 200);
    let (status, body) = tokio::time::timeout(Duration::from_secs(180), world.attach("reader"))
        .await
        .expect("the reader was not held up");
    assert_eq!(status, 200);
    let total = world.host_parts(1).await;
    assert_eq!(ids(&body).len() as u64, total);
    drop(stalled);
}
