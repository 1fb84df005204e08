//! `sortie driver` end to end: the real binary, the real scripted agent over ACP, the stream checked
//! by the real AI SDK (`tests/ai-sdk`), and the faults an agent can commit.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds the scripted agent next to the `sortie` binary, where the driver finds it.
fn ensure_scripted_agent() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "sortie-scripted-agent"])
            .current_dir(workspace_root())
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the scripted agent failed");
    });
}

/// Installs the AI SDK conformance kit once (`npm ci`).
fn ai_sdk_dir() -> PathBuf {
    static READY: OnceLock<PathBuf> = OnceLock::new();
    READY
        .get_or_init(|| {
            let dir = workspace_root().join("tests/ai-sdk");
            if !dir.join("node_modules/ai").exists() {
                let status = Command::new("npm")
                    .args(["ci", "--no-audit", "--no-fund"])
                    .current_dir(&dir)
                    .status()
                    .expect("npm");
                assert!(status.success(), "npm ci in tests/ai-sdk failed");
            }
            dir
        })
        .clone()
}

struct DriverProcess {
    child: Child,
    socket: PathBuf,
    workspace: PathBuf,
    client: reqwest::Client,
    _temp: tempfile::TempDir,
}

impl DriverProcess {
    fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, None)
    }

    fn start_with(extra: &[&str], manifest: Option<&str>) -> Self {
        ensure_scripted_agent();
        let temp = tempfile::tempdir().expect("temp");
        let socket = temp.path().join("driver.sock");
        let workspace = temp.path().join("workspace");
        std::fs::create_dir_all(&workspace).expect("workspace");
        let mut command = support::sortie(temp.path());
        command
            .arg("driver")
            .arg("--socket")
            .arg(&socket)
            .arg("--workspace")
            .arg(&workspace)
            .arg("--home")
            .arg(temp.path().join("home"));
        command
            .args(["--agent", "scripted", "--session", "ses_test", "--kill-grace", "1"])
            .args(extra);
        if let Some(manifest) = manifest {
            let path = temp.path().join("agents.toml");
            std::fs::write(&path, manifest).expect("manifest");
            command.arg("--profiles").arg(path);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn driver");
        // The socket file appears at bind(), a moment before listen(): wait for the driver to say it listens.
        let stdout = child.stdout.take().expect("stdout");
        let (said, listening) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("sortie driver listening on") {
                    let _ = said.send(());
                }
            }
        });
        let client = support::http_builder()
            .unix_socket(socket.clone())
            .build()
            .expect("client");
        let workspace = std::fs::canonicalize(&workspace).expect("canonical");
        let driver = Self {
            child,
            socket,
            workspace,
            client,
            _temp: temp,
        };
        assert!(
            listening.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the driver did not start listening"
        );
        driver
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let reply = self
            .client
            .post(format!("http://driver{path}"))
            .json(&body)
            .send()
            .await
            .expect("post");
        let status = reply.status().as_u16();
        (status, reply.json().await.unwrap_or(Value::Null))
    }

    async fn status(&self) -> Value {
        let reply = self.client.get("http://driver/status").send().await.expect("status");
        assert_eq!(reply.status().as_u16(), 200, "the driver keeps answering /status");
        reply.json().await.expect("json")
    }

    async fn start_turn(&self, n: u32, script: &str) {
        let (status, body) = self
            .post("/turns", json!({"n": n, "prompt": format!("#!scripted\n{script}")}))
            .await;
        assert_eq!(status, 202, "{body}");
    }

    /// Polls `/status` until turn `n` is no longer running; returns its report.
    async fn wait_turn(&self, n: u32, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let status = self.status().await;
            if let Some(turn) = status["turns"].as_array().and_then(|t| t.iter().find(|t| t["n"] == n))
                && turn["state"] != "running"
            {
                return turn.clone();
            }
            assert!(Instant::now() < deadline, "turn {n} still running: {status}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn stream(&self, n: u32, after: Option<u64>) -> String {
        let path = match after {
            Some(k) => format!("http://driver/turns/{n}/stream?after={k}"),
            None => format!("http://driver/turns/{n}/stream"),
        };
        let reply = self.client.get(path).send().await.expect("stream");
        assert_eq!(
            reply
                .headers()
                .get("x-vercel-ai-ui-message-stream")
                .and_then(|v| v.to_str().ok()),
            Some("v1")
        );
        reply.text().await.expect("body")
    }

    /// Runs a tool of the AI SDK kit against turn `n`'s stream.
    fn node(&self, script: &str, n: u32, extra: &[&str]) -> std::process::Output {
        let dir = ai_sdk_dir();
        Command::new("node")
            .arg(dir.join(script))
            .args(["--url", &format!("http://driver/turns/{n}/stream"), "--socket"])
            .arg(&self.socket)
            .args(extra)
            .output()
            .expect("node")
    }
}

impl Drop for DriverProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn event_ids(stream: &str) -> Vec<u64> {
    stream
        .lines()
        .filter_map(|line| line.strip_prefix("id: "))
        .filter_map(|id| id.parse().ok())
        .collect()
}

fn process_is_gone(pid: i64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // A zombie is dead; it only waits for its parent to read its status.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

const EVERY_STEP: &str = "think: Let me look at the repository first.
say: I will write a file and run a command. This sentence is long enough to be split into several chunks by the agent.
plan: write the file | run the tests | report
write: notes/hello.txt
hello from the scripted agent
>>>
done: 1
run: cat notes/hello.txt
run: echo failing >&2; exit 3
done: 2
ask: May I continue?
sleep: 10
flood: 20
say: Done.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_kind_streams_chunks_the_ai_sdk_accepts() {
    let driver = DriverProcess::start(&[]);
    driver.start_turn(1, EVERY_STEP).await;
    // Validated live, while the turn runs, and again once it is done (replayed from the hub).
    let live = driver.node("validate.mjs", 1, &["--print"]);
    assert!(
        live.status.success(),
        "live stream invalid: {}",
        String::from_utf8_lossy(&live.stderr)
    );
    let turn = driver.wait_turn(1, Duration::from_secs(30)).await;
    assert_eq!(
        (turn["state"].clone(), turn["stop_reason"].clone()),
        (json!("completed"), json!("end_turn")),
        "{turn}"
    );
    let replayed = driver.node("validate.mjs", 1, &["--print"]);
    assert!(
        replayed.status.success(),
        "replayed stream invalid: {}",
        String::from_utf8_lossy(&replayed.stderr)
    );
    let message: Value = serde_json::from_slice(&replayed.stdout).expect("final message");
    assert_eq!(message["id"], "ses_test-t1");
    let parts = message["parts"].as_array().expect("parts");
    let kinds: Vec<&str> = parts.iter().filter_map(|p| p["type"].as_str()).collect();
    for kind in [
        "step-start",
        "reasoning",
        "text",
        "data-acp-plan",
        "dynamic-tool",
        "data-acp-diff",
    ] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let tools: Vec<(&str, &str)> = parts
        .iter()
        .filter(|p| p["type"] == "dynamic-tool")
        .map(|p| (p["toolName"].as_str().unwrap_or(""), p["state"].as_str().unwrap_or("")))
        .collect();
    // The permission request announced a tool of its own, which the agent never completed.
    assert_eq!(
        tools,
        vec![
            ("edit", "output-available"),
            ("execute", "output-available"),
            ("execute", "output-error"),
            ("other", "input-available")
        ]
    );
    let plan = parts.iter().find(|p| p["type"] == "data-acp-plan").expect("plan");
    let statuses: Vec<&str> = plan["data"]["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["status"].as_str())
        .collect();
    assert_eq!(
        statuses,
        vec!["completed", "completed", "pending"],
        "the plan was replaced in place"
    );
    let text: String = parts
        .iter()
        .filter(|p| p["type"] == "text")
        .filter_map(|p| p["text"].as_str())
        .collect();
    assert!(
        text.contains("permission: allow_once") && text.contains("flood 19") && text.ends_with("Done."),
        "{text}"
    );
    assert_eq!(
        std::fs::read_to_string(driver.workspace.join("notes/hello.txt")).expect("written"),
        "hello from the scripted agent\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_resumes_a_running_turn_into_exactly_one_message() {
    let driver = DriverProcess::start(&[]);
    driver
        .start_turn(
            1,
            "say: before the pause\nsleep: 1500\nthink: after the pause\nsay: after",
        )
        .await;
    let resumed = driver.node("chat-resume.mjs", 1, &["--resumes", "2", "--chat-id", "ses_test"]);
    assert!(
        resumed.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&resumed.stdout),
        String::from_utf8_lossy(&resumed.stderr)
    );
    let outcome: Value = serde_json::from_slice(&resumed.stdout).expect("json");
    let messages = outcome["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 1);
    let texts: Vec<&str> = messages[0]["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .filter_map(|p| p["text"].as_str())
        .collect();
    assert_eq!(texts, vec!["before the pause", "after the pause", "after"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_are_idempotent_and_resume_exactly_after_k() {
    let driver = DriverProcess::start(&[]);
    driver
        .start_turn(1, "run: echo once >> count.txt\nsleep: 300\nflood: 30")
        .await;
    let (status, again) = driver
        .post(
            "/turns",
            json!({"n": 1, "prompt": "#!scripted\nrun: echo twice >> count.txt"}),
        )
        .await;
    assert_eq!(status, 202, "the same n answers the same turn: {again}");
    let (status, busy) = driver.post("/turns", json!({"n": 2, "prompt": "hello"})).await;
    assert_eq!((status, busy["error"]["code"].clone()), (409, json!("TURN_RUNNING")));
    driver.wait_turn(1, Duration::from_secs(20)).await;
    assert_eq!(
        std::fs::read_to_string(driver.workspace.join("count.txt")).expect("count"),
        "once\n",
        "one turn ran"
    );

    let all = event_ids(&driver.stream(1, None).await);
    let total = all.len() as u64;
    assert_eq!(all, (0..total).collect::<Vec<_>>());
    for k in [0, 5, total - 2, total - 1, total + 10] {
        let stream = driver.stream(1, Some(k)).await;
        assert_eq!(event_ids(&stream), ((k + 1)..total).collect::<Vec<_>>(), "after {k}");
        assert!(stream.ends_with("data: [DONE]\n\n"));
    }
    let (status, _) = driver.post("/turns", json!({"n": 0, "prompt": "x"})).await;
    assert_eq!(status, 400);
    let (status, _) = driver
        .post("/turns", json!({"n": 3, "prompt": "x", "extra": true}))
        .await;
    assert_eq!(status, 400);
    let missing = driver
        .client
        .get("http://driver/turns/9/stream")
        .send()
        .await
        .expect("get");
    assert_eq!(missing.status().as_u16(), 404);
    // A plain prompt gets the agent's plain reply.
    driver.start_turn(2, "").await;
    let (status, _) = driver.post("/turns", json!({"n": 3, "prompt": "just text"})).await;
    assert!(status == 202 || status == 409);
}

/// Runs one turn that must fail, and checks the failure and that the driver still answers.
async fn failing_turn(
    driver: &DriverProcess,
    n: u32,
    script: &str,
    code: &str,
    reason_part: &str,
    within: Duration,
) -> Value {
    driver.start_turn(n, script).await;
    let turn = driver.wait_turn(n, within).await;
    assert_eq!(turn["state"], "failed", "{turn}");
    assert_eq!(turn["failure"]["code"], code, "{turn}");
    let reason = turn["failure"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(reason_part),
        "reason {reason:?} should mention {reason_part:?}"
    );
    let stream = driver.stream(n, None).await;
    assert!(
        stream.contains(r#""type":"error""#)
            && stream.contains(r#""finishReason":"error""#)
            && stream.ends_with("data: [DONE]\n\n"),
        "{stream}"
    );
    // Exit 2: every chunk valid, and the stream carries the fatal `error` chunk.
    let validated = driver.node("validate.mjs", n, &[]);
    assert_eq!(
        validated.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&validated.stderr)
    );
    turn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_stdout_fails_the_turn() {
    let driver = DriverProcess::start(&[]);
    failing_turn(
        &driver,
        1,
        "say: fine so far\ngarbage: this is not json",
        "AGENT_ERROR",
        "not ACP",
        Duration::from_secs(20),
    )
    .await;
    // The next turn gets a fresh agent.
    driver.start_turn(2, "say: back again").await;
    assert_eq!(driver.wait_turn(2, Duration::from_secs(20)).await["state"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_line_fails_the_turn() {
    let driver = DriverProcess::start(&[]);
    failing_turn(
        &driver,
        1,
        &format!("bigline: {}", 64 * 1024 * 1024),
        "AGENT_ERROR",
        "longer than 16 MiB",
        Duration::from_secs(60),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_exiting_mid_turn_fails_it_with_its_last_words() {
    let driver = DriverProcess::start(&[]);
    failing_turn(
        &driver,
        1,
        "say: working\nstderr: fatal: out of coffee\ncrash: 7",
        "AGENT_ERROR",
        "out of coffee",
        Duration::from_secs(20),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_answers_initialize_fails_to_start() {
    let manifest = "[[agent]]\nid = \"scripted\"\ncommand = \"/bin/sleep\"\nargs = [\"1000\"]\n";
    let driver = DriverProcess::start_with(&["--start-timeout", "2"], Some(manifest));
    driver.start_turn(1, "say: hi").await;
    let turn = driver.wait_turn(1, Duration::from_secs(20)).await;
    assert_eq!(
        (turn["state"].clone(), turn["failure"]["code"].clone()),
        (json!("failed"), json!("AGENT_START_FAILED")),
        "{turn}"
    );
    assert!(
        turn["failure"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("handshake"),
        "{turn}"
    );
    assert_eq!(driver.status().await["agent"]["state"], "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_ignores_cancel_is_killed_with_its_whole_group_at_the_timeout() {
    let driver = DriverProcess::start(&["--turn-timeout", "3"]);
    driver
        .start_turn(1, "run: sleep 300 > /dev/null 2>&1 & echo $! > bg.pid\nhang: 600000")
        .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let agent_pid = loop {
        if let Some(pid) = driver.status().await["agent"]["pid"].as_i64() {
            break pid;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let turn = driver.wait_turn(1, Duration::from_secs(30)).await;
    assert_eq!(turn["failure"]["code"], "TURN_TIMEOUT", "{turn}");
    let background: i64 = std::fs::read_to_string(driver.workspace.join("bg.pid"))
        .expect("pid")
        .trim()
        .parse()
        .expect("number");
    assert!(process_is_gone(agent_pid), "the agent {agent_pid} survived");
    assert!(
        process_is_gone(background),
        "its background child {background} survived"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_turn_gracefully_or_by_force() {
    let driver = DriverProcess::start(&[]);
    driver.start_turn(1, "say: sleeping\nsleep: 600000").await;
    let (status, _) = driver.post("/turns/1/cancel", json!({})).await;
    assert!(status == 202 || status == 409);
    let (status, _) = driver.post("/turns/1/cancel", json!({})).await;
    let turn = driver.wait_turn(1, Duration::from_secs(10)).await;
    assert_eq!(
        (turn["state"].clone(), turn["stop_reason"].clone()),
        (json!("cancelled"), json!("cancelled")),
        "{turn} {status}"
    );
    assert!(turn["failure"].is_null(), "the agent stopped by itself: {turn}");

    driver.start_turn(2, "hang: 600000").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _) = driver.post("/turns/2/cancel", json!({})).await;
    assert_eq!(status, 202);
    let turn = driver.wait_turn(2, Duration::from_secs(20)).await;
    assert_eq!(turn["state"], "cancelled", "{turn}");
    assert!(
        turn["failure"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("killed"),
        "{turn}"
    );
    let stream = driver.stream(2, None).await;
    assert!(
        stream.contains(r#""finishReason":"other""#) && stream.ends_with("data: [DONE]\n\n"),
        "{stream}"
    );
    let (status, body) = driver.post("/turns/2/cancel", json!({})).await;
    assert_eq!((status, body["error"]["code"].clone()), (409, json!("NO_TURN_RUNNING")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_leaves_the_agent_ready_for_the_next() {
    let driver = DriverProcess::start(&[]);
    failing_turn(
        &driver,
        1,
        "say: trying\nfail: the build is broken",
        "AGENT_ERROR",
        "the build is broken",
        Duration::from_secs(20),
    )
    .await;
    driver.start_turn(2, "say: fixed").await;
    assert_eq!(driver.wait_turn(2, Duration::from_secs(20)).await["state"], "completed");
}
