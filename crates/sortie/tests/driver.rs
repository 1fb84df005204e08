//! `sortie driver` end to end: the real binary, the real scripted agent over ACP, the stream checked
//! by the real AI SDK (`tests/ai-sdk`), and the faults an agent can commit.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_testkit::git::git;

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
    home: PathBuf,
    client: reqwest::Client,
    /// Shared by drivers that run one after the other on the same workspace and home.
    _root: Arc<tempfile::TempDir>,
}

impl DriverProcess {
    fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, None)
    }

    fn start_with(extra: &[&str], manifest: Option<&str>) -> Self {
        Self::start_in(Arc::new(tempfile::tempdir().expect("temp")), extra, manifest)
    }

    /// A driver on `root/workspace` and `root/home`, where an earlier driver may have run.
    fn start_in(root: Arc<tempfile::TempDir>, extra: &[&str], manifest: Option<&str>) -> Self {
        ensure_scripted_agent();
        let socket = root.path().join("driver.sock");
        let workspace = root.path().join("workspace");
        let home = root.path().join("home");
        std::fs::create_dir_all(&workspace).expect("workspace");
        let mut command = support::sortie(root.path());
        command
            .arg("driver")
            .arg("--socket")
            .arg(&socket)
            .arg("--workspace")
            .arg(&workspace)
            .arg("--home")
            .arg(&home);
        command
            .args(["--agent", "scripted", "--session", "ses_test", "--kill-grace", "1"])
            .args(extra);
        if let Some(manifest) = manifest {
            let path = root.path().join("agents.toml");
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
            home,
            client,
            _root: root,
        };
        assert!(
            listening.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the driver did not start listening"
        );
        driver
    }

    /// POSTs `body` to `path`; a turn without a nonce gets the nonce the tests use for its number.
    async fn post(&self, path: &str, mut body: Value) -> (u16, Value) {
        if path == "/turns" && body.get("nonce").is_none() && body.is_object() {
            body["nonce"] = json!(format!("nonce-{}", body["n"]));
        }
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

    /// Starts turn `n` with a body of the caller's (`n` is added).
    async fn start_turn_with(&self, n: u32, mut body: Value) {
        body["n"] = json!(n);
        let (status, answer) = self.post("/turns", body).await;
        assert_eq!(status, 202, "{answer}");
    }

    /// Turn `n`'s report (`GET /turns/{n}`); `Null` when the driver has no such turn.
    async fn report(&self, n: u32) -> Value {
        let reply = self
            .client
            .get(format!("http://driver/turns/{n}"))
            .send()
            .await
            .expect("report");
        if reply.status().as_u16() == 404 {
            return Value::Null;
        }
        reply.json().await.expect("json")
    }

    /// Polls turn `n`'s report until it is neither running nor delivering; returns it.
    async fn wait_turn(&self, n: u32, within: Duration) -> Value {
        sortie_testkit::wait::eventually(&format!("turn {n} ends"), within, move || async move {
            let turn = self.report(n).await;
            if !turn.is_null() && turn["state"] != "running" && turn["state"] != "delivering" {
                Ok(turn)
            } else {
                Err(turn)
            }
        })
        .await
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
    assert_eq!(status, 202, "the same n and nonce answer the same turn: {again}");
    let (status, foreign) = driver
        .post(
            "/turns",
            json!({"n": 1, "nonce": "someone-else", "prompt": "#!scripted\nrun: echo forged >> count.txt"}),
        )
        .await;
    assert_eq!(
        (status, foreign["error"]["code"].clone()),
        (409, json!("TURN_NOT_OURS")),
        "the same n under another nonce is not the host's turn"
    );
    let (status, _) = driver.post("/turns", json!({"n": 4, "nonce": "", "prompt": "x"})).await;
    assert_eq!(status, 400, "a turn needs a nonce");
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
    let driver = DriverProcess::start_with(&["--start-timeout", "2", "--branch", BRANCH], Some(manifest));
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
    assert!(turn["delivery"].is_null(), "no agent, nothing to deliver: {turn}");
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

// Delivery (§7.3), the setup script, priming (§6.4) and timings.

/// The branch the tests deliver to.
const BRANCH: &str = "sortie/ses_test";

/// A workspace with one commit and a bare remote cloned from it, so that the base is already there.
struct Repo {
    root: Arc<tempfile::TempDir>,
    workspace: PathBuf,
    remote: PathBuf,
    base: String,
}

impl Repo {
    fn new() -> Self {
        let root = Arc::new(tempfile::tempdir().expect("temp"));
        let workspace = root.path().join("workspace");
        std::fs::create_dir_all(&workspace).expect("workspace");
        git(&workspace, &["init", "-q"]);
        std::fs::write(workspace.join("README.md"), "# project\n").expect("readme");
        git(&workspace, &["add", "README.md"]);
        git(&workspace, &["commit", "-q", "-m", "base"]);
        git(root.path(), &["clone", "-q", "--bare", "workspace", "remote.git"]);
        let base = git(&workspace, &["rev-parse", "HEAD"]);
        Self {
            remote: root.path().join("remote.git"),
            workspace,
            root,
            base,
        }
    }

    /// A driver that delivers to the bare remote.
    fn driver(&self, extra: &[&str]) -> DriverProcess {
        let remote = self.remote.to_str().expect("a UTF-8 path");
        let mut args = vec![
            "--branch",
            BRANCH,
            "--remote",
            remote,
            "--author-name",
            "Sortie Test",
            "--author-email",
            "sortie-test@localhost",
        ];
        args.extend_from_slice(extra);
        DriverProcess::start_in(self.root.clone(), &args, None)
    }

    /// The remote's commit for the session's branch, if the branch exists there.
    fn remote_head(&self) -> Option<String> {
        let reference = format!("refs/heads/{BRANCH}");
        let listed = git(&self.remote, &["for-each-ref", "--format=%(objectname)", &reference]);
        (!listed.is_empty()).then_some(listed)
    }

    /// The files a commit changed.
    fn files_of(&self, commit: &str) -> String {
        git(
            &self.remote,
            &["diff-tree", "--no-commit-id", "--name-only", "-r", commit],
        )
    }
}

/// The chunks of an SSE body, in order.
fn chunks(stream: &str) -> Vec<Value> {
    stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect()
}

/// The `data` of every chunk of one type, in order.
fn data_of(stream: &str, kind: &str) -> Vec<Value> {
    chunks(stream)
        .into_iter()
        .filter(|chunk| chunk["type"] == kind)
        .map(|chunk| chunk["data"].clone())
        .collect()
}

fn text_of(stream: &str) -> String {
    chunks(stream)
        .iter()
        .filter(|chunk| chunk["type"] == "text-delta")
        .filter_map(|chunk| chunk["delta"].as_str())
        .collect()
}

fn sha256_hex(value: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(value.as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("sha256sum");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_turn_is_delivered_as_one_commit_on_its_branch() {
    let repo = Repo::new();
    let driver = repo.driver(&[]);
    driver
        .start_turn_with(
            1,
            json!({
                "prompt": "#!scripted\nwrite: hello.txt\nhello\n>>>\nsay: wrote it",
                "baseline": null,
            }),
        )
        .await;
    let turn = driver.wait_turn(1, Duration::from_secs(30)).await;
    assert_eq!(turn["state"], "completed", "{turn}");
    let delivery = &turn["delivery"];
    let first = delivery["head_sha"].as_str().expect("head_sha").to_owned();
    assert_eq!(delivery, &json!({"head_sha": first, "pushed": true, "changed": true}),);
    assert_eq!(repo.remote_head().as_deref(), Some(first.as_str()));
    assert_eq!(
        git(&repo.remote, &["rev-parse", &format!("{first}^")]),
        repo.base,
        "one commit on the base"
    );
    assert_eq!(repo.files_of(&first), "hello.txt");
    assert_eq!(
        git(&repo.remote, &["log", "-1", "--format=%an <%ae>|%cn <%ce>", &first]),
        "Sortie Test <sortie-test@localhost>|Sortie Test <sortie-test@localhost>"
    );
    let message = git(&repo.remote, &["log", "-1", "--format=%B", &first]);
    assert!(
        message.starts_with("#!scripted\n\n#!scripted\nwrite: hello.txt\n")
            && message.ends_with("\n\nSortie-Session: ses_test"),
        "{message}"
    );

    // The driver's stream is the agent's: sortie's own parts (phase, delivery) are the host's to write.
    let stream = driver.stream(1, None).await;
    let types: Vec<Value> = chunks(&stream).iter().map(|chunk| chunk["type"].clone()).collect();
    assert!(
        !types
            .iter()
            .any(|t| t.as_str().is_some_and(|t| t.starts_with("data-sortie-"))),
        "{types:?}"
    );
    let validated = driver.node("validate.mjs", 1, &["--print"]);
    assert!(
        validated.status.success(),
        "{}",
        String::from_utf8_lossy(&validated.stderr)
    );

    // The next turn builds on the delivered commit.
    driver
        .start_turn_with(
            2,
            json!({"prompt": "#!scripted\nwrite: second.txt\ntwo\n>>>", "baseline": first}),
        )
        .await;
    let turn = driver.wait_turn(2, Duration::from_secs(30)).await;
    assert_eq!(turn["state"], "completed", "{turn}");
    let second = turn["delivery"]["head_sha"].as_str().expect("head_sha").to_owned();
    assert_eq!(repo.remote_head().as_deref(), Some(second.as_str()));
    assert_eq!(git(&repo.remote, &["rev-parse", &format!("{second}^")]), first);
    assert_eq!(repo.files_of(&second), "second.txt");

    // A turn that changes nothing delivers nothing, and that is no failure.
    driver
        .start_turn_with(
            3,
            json!({"prompt": "#!scripted\nsay: nothing to do", "baseline": second}),
        )
        .await;
    let turn = driver.wait_turn(3, Duration::from_secs(30)).await;
    assert_eq!(
        (&turn["state"], &turn["failure"]),
        (&json!("completed"), &Value::Null),
        "{turn}"
    );
    assert_eq!(
        turn["delivery"],
        json!({"head_sha": second, "pushed": false, "changed": false})
    );
    assert_eq!(repo.remote_head().as_deref(), Some(second.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_someone_else_moved_is_a_push_conflict_and_is_left_alone() {
    let repo = Repo::new();
    let driver = repo.driver(&[]);
    driver.start_turn(1, "write: a.txt\na\n>>>").await;
    let turn = driver.wait_turn(1, Duration::from_secs(30)).await;
    let first = turn["delivery"]["head_sha"].as_str().expect("head_sha").to_owned();
    assert_eq!(repo.remote_head().as_deref(), Some(first.as_str()));

    // Someone else moves the branch (back to the base) behind the session's back.
    git(
        &repo.remote,
        &["update-ref", &format!("refs/heads/{BRANCH}"), &repo.base],
    );
    let turn = failing_turn_with(
        &driver,
        2,
        json!({"prompt": "#!scripted\nwrite: b.txt\nb\n>>>", "baseline": first}),
        "PUSH_CONFLICT",
        "someone else moved the branch",
    )
    .await;
    assert_eq!(turn["delivery"]["pushed"], false, "{turn}");
    assert_eq!(turn["delivery"]["error"]["code"], "PUSH_CONFLICT", "{turn}");
    assert_eq!(
        repo.remote_head().as_deref(),
        Some(repo.base.as_str()),
        "the remote is unchanged"
    );

    // A branch that exists although the turn expects none is the same conflict.
    let turn = failing_turn_with(
        &driver,
        3,
        json!({"prompt": "#!scripted\nwrite: c.txt\nc\n>>>", "baseline": null}),
        "PUSH_CONFLICT",
        "expected it absent",
    )
    .await;
    assert_eq!(turn["delivery"]["pushed"], false);
    assert_eq!(repo.remote_head().as_deref(), Some(repo.base.as_str()));
}

/// Runs one turn that must fail with `code`, with the body given, and answers its report.
async fn failing_turn_with(driver: &DriverProcess, n: u32, body: Value, code: &str, reason_part: &str) -> Value {
    driver.start_turn_with(n, body).await;
    let turn = driver.wait_turn(n, Duration::from_secs(30)).await;
    assert_eq!(
        (&turn["state"], &turn["failure"]["code"]),
        (&json!("failed"), &json!(code)),
        "{turn}"
    );
    let reason = turn["failure"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(reason_part),
        "{reason:?} should mention {reason_part:?}"
    );
    let stream = driver.stream(n, None).await;
    // The delivery's own failure is in its report; an earlier failure of the turn is not the delivery's.
    let delivery_failed = ["SECRET_DETECTED", "PUSH_CONFLICT", "DELIVERY_FAILED"].contains(&code);
    assert_eq!(
        turn["delivery"]["error"]["code"],
        if delivery_failed { json!(code) } else { Value::Null },
        "{turn}"
    );
    assert!(
        stream.contains(r#""type":"error""#) && stream.contains(r#""finishReason":"error""#),
        "{stream}"
    );
    turn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_in_the_changes_is_never_pushed() {
    let repo = Repo::new();
    let digests = repo.root.path().join("digests");
    std::fs::write(
        &digests,
        format!("# known values\n{}\n", sha256_hex("correct-horse-battery-staple")),
    )
    .expect("digests");
    let driver = repo.driver(&["--secret-digests", digests.to_str().expect("utf-8")]);

    let turn = failing_turn_with(
        &driver,
        1,
        json!({"prompt": "#!scripted\nwrite: ok.txt\nfine\n>>>\nwrite: config/prod.env\nAWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n>>>"}),
        "SECRET_DETECTED",
        "an AWS access key id in config/prod.env",
    )
    .await;
    assert!(
        !turn.to_string().contains("AKIAIOSFODNN7EXAMPLE"),
        "the value is never shown: {turn}"
    );
    assert!(turn["delivery"]["head_sha"].is_null() && turn["delivery"]["pushed"] == false);
    assert_eq!(repo.remote_head(), None, "nothing was pushed");
    assert_eq!(
        git(&repo.workspace, &["rev-parse", "HEAD"]),
        repo.base,
        "the commit was undone"
    );
    assert!(repo.workspace.join("config/prod.env").exists(), "the files stay");

    let turn = failing_turn_with(
        &driver,
        2,
        json!({"prompt": "#!scripted\nrun: rm config/prod.env\nwrite: db.yml\npassword: correct-horse-battery-staple\n>>>"}),
        "SECRET_DETECTED",
        "a known secret value in db.yml",
    )
    .await;
    assert!(!turn.to_string().contains("correct-horse"), "{turn}");
    assert_eq!(repo.remote_head(), None);

    // Once the secret is gone, the rest is delivered.
    driver.start_turn(3, "run: rm db.yml").await;
    let turn = driver.wait_turn(3, Duration::from_secs(30)).await;
    assert_eq!(turn["state"], "completed", "{turn}");
    let head = turn["delivery"]["head_sha"].as_str().expect("head_sha");
    assert_eq!(repo.remote_head().as_deref(), Some(head));
    assert_eq!(repo.files_of(head), "ok.txt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_keeps_its_failure_and_still_delivers_its_work() {
    let repo = Repo::new();
    let driver = repo.driver(&[]);
    let turn = failing_turn_with(
        &driver,
        1,
        json!({"prompt": "#!scripted\nwrite: partial.txt\nhalf done\n>>>\nfail: the build is broken"}),
        "AGENT_ERROR",
        "the build is broken",
    )
    .await;
    assert_eq!(
        (&turn["delivery"]["pushed"], &turn["delivery"]["error"]),
        (&json!(true), &Value::Null),
        "{turn}"
    );
    let head = turn["delivery"]["head_sha"].as_str().expect("head_sha");
    assert_eq!(repo.remote_head().as_deref(), Some(head));
    assert_eq!(repo.files_of(head), "partial.txt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_setup_script_runs_in_the_workspace_and_is_killed_at_its_deadline() {
    let driver = DriverProcess::start(&[]);
    let home = std::fs::canonicalize(&driver.home).expect("home");
    let (status, ran) = driver
        .post(
            "/setup",
            json!({"script": "pwd; echo \"home=$HOME\"; echo to stderr >&2", "timeout_secs": 30}),
        )
        .await;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(
        (&ran["exit_code"], &ran["timed_out"]),
        (&json!(0), &json!(false)),
        "{ran}"
    );
    let tail = ran["output_tail"].as_str().unwrap_or_default();
    assert!(
        tail.contains(&driver.workspace.display().to_string())
            && tail.contains(&format!("home={}", home.display()))
            && tail.contains("to stderr"),
        "{tail}"
    );

    let (status, failed) = driver
        .post(
            "/setup",
            json!({"script": "seq 1 5000; echo about to fail; exit 3", "timeout_secs": 30}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!((&failed["exit_code"], &failed["timed_out"]), (&json!(3), &json!(false)));
    let tail = failed["output_tail"].as_str().unwrap_or_default();
    assert!(
        tail.len() <= 8192 && tail.ends_with("4999\n5000\nabout to fail\n"),
        "{tail}"
    );

    let started = Instant::now();
    let (status, slow) = driver
        .post(
            "/setup",
            json!({"script": "sleep 300 & echo $! > bg.pid; echo waiting; sleep 300", "timeout_secs": 1}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    assert_eq!(
        (&slow["exit_code"], &slow["timed_out"], &slow["output_tail"]),
        (&Value::Null, &json!(true), &json!("waiting\n"))
    );
    let background: i64 = std::fs::read_to_string(driver.workspace.join("bg.pid"))
        .expect("pid")
        .trim()
        .parse()
        .expect("number");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !process_is_gone(background) {
        assert!(
            Instant::now() < deadline,
            "the script's background child {background} survived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Not while a turn runs.
    driver.start_turn(1, "sleep: 600000").await;
    let (status, busy) = driver.post("/setup", json!({"script": "true"})).await;
    assert_eq!(
        (status, &busy["error"]["code"]),
        (409, &json!("TURN_RUNNING")),
        "{busy}"
    );
    let (status, _) = driver.post("/turns/1/cancel", json!({})).await;
    assert_eq!(status, 202);
    driver.wait_turn(1, Duration::from_secs(20)).await;
    let (status, bad) = driver.post("/setup", json!({"timeout_secs": 3})).await;
    assert_eq!(status, 400, "{bad}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_driver_on_the_same_home_loads_the_agents_session() {
    let root = Arc::new(tempfile::tempdir().expect("temp"));
    {
        let first = DriverProcess::start_in(root.clone(), &[], None);
        first.start_turn(1, "say: remember the number seven").await;
        let turn = first.wait_turn(1, Duration::from_secs(30)).await;
        assert_eq!(
            (&turn["state"], &turn["priming"]),
            (&json!("completed"), &Value::Null),
            "{turn}"
        );
    }
    let persisted = std::fs::read_to_string(root.path().join("home/.sortie/acp-session")).expect("persisted");
    assert!(!persisted.trim().is_empty());

    let second = DriverProcess::start_in(root.clone(), &[], None);
    second
        .start_turn_with(
            2,
            json!({
                "prompt": "#!scripted\nsay: still here",
                "priming_context": {"preamble": "user: remember the number seven", "task": "remember"},
            }),
        )
        .await;
    let turn = second.wait_turn(2, Duration::from_secs(30)).await;
    assert_eq!(
        (&turn["state"], &turn["priming"]),
        (&json!("completed"), &json!("session_load")),
        "{turn}"
    );
    let stream = second.stream(2, None).await;
    assert!(
        data_of(&stream, "data-sortie-priming").is_empty(),
        "the host writes priming parts"
    );
    assert_eq!(
        text_of(&stream),
        "still here",
        "the replay of turn 1 is not part of turn 2"
    );
    assert_eq!(
        std::fs::read_to_string(root.path().join("home/.sortie/acp-session")).expect("persisted"),
        persisted,
        "the same session"
    );

    // Every turn's agent is a fresh process (none outlives its turn): it loads its session again.
    second.start_turn(3, "say: again").await;
    let turn = second.wait_turn(3, Duration::from_secs(30)).await;
    assert_eq!(turn["priming"], json!("session_load"), "{turn}");
    assert_eq!(text_of(&second.stream(3, None).await), "again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_loadable_session_the_transcript_or_the_task_primes_the_agent() {
    // A later turn on a fresh sandbox whose agent state is gone: the preamble.
    let driver = DriverProcess::start(&[]);
    driver
        .start_turn_with(
            2,
            json!({
                "prompt": "what next?",
                "priming_context": {"preamble": "user: build a thing\nassistant: built it", "task": "build a thing"},
            }),
        )
        .await;
    let turn = driver.wait_turn(2, Duration::from_secs(30)).await;
    assert_eq!(
        (&turn["state"], &turn["priming"]),
        (&json!("completed"), &json!("transcript")),
        "{turn}"
    );
    let stream = driver.stream(2, None).await;
    let text = text_of(&stream);
    assert!(
        text.starts_with("scripted agent received: <sortie-context>\n") && text.contains("user: build a thing"),
        "{text}"
    );
    drop(driver);

    // A persisted session the agent cannot load: a new session, the task, and the failed load said.
    let root = Arc::new(tempfile::tempdir().expect("temp"));
    let persisted = root.path().join("home/.sortie/acp-session");
    std::fs::create_dir_all(persisted.parent().expect("parent")).expect("dir");
    std::fs::write(&persisted, "01JZZZZZZZZZZZZZZZZZZZZZZZ\n").expect("persist");
    let driver = DriverProcess::start_in(root.clone(), &[], None);
    driver
        .start_turn_with(
            1,
            json!({"prompt": "what next?", "priming_context": {"preamble": null, "task": "build a thing"}}),
        )
        .await;
    let turn = driver.wait_turn(1, Duration::from_secs(30)).await;
    assert_eq!(
        (&turn["state"], &turn["priming"]),
        (&json!("completed"), &json!("task")),
        "{turn}"
    );
    let stream = driver.stream(1, None).await;
    assert!(turn["load_error"].is_string(), "the failed load is said: {turn}");
    assert_eq!(
        text_of(&stream),
        "scripted agent received: Original task:\nbuild a thing\n\nNow: what next?"
    );
    let now = std::fs::read_to_string(&persisted).expect("persisted");
    assert!(
        !now.starts_with("01JZZZ") && !now.is_empty(),
        "the new session replaced it: {now}"
    );
}

/// A driver of a pod (DESIGN §15) dials the gateway, the cluster says which pod it is, and the host runs
/// turns on it over that link with the worker's own driver client. The driver runs as a plain process:
/// what is under test is the link, and a bwrap sandbox here has no network that reaches a gateway (a
/// pod's does, to the gateway only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_driver_dials_the_gateway_and_the_host_runs_turns_over_its_link() {
    use sortie_gateway::links::{DriverLinks, KubeTokenReview, LinkState, link_router};
    use sortie_protocol::driver::{LINK_AUDIENCE, StartTurn, TurnState};
    use sortie_worker::client::DriverClient;

    ensure_scripted_agent();
    let apiserver = sortie_testkit::kube::FakeApiserver::start("gateway-account-token").await;
    let links = DriverLinks::new();
    let identity = Arc::new(KubeTokenReview {
        apiserver: apiserver.url(),
        bearer: "gateway-account-token".into(),
        sandbox_account: "system:serviceaccount:sortie:sandbox".into(),
        http: support::http_client(),
    });
    let gateway = sortie_testkit::http::serve(link_router(LinkState {
        links: links.clone(),
        identity,
        egress: sortie_gateway::links::EgressBindings::new(),
    }))
    .await;

    let root = tempfile::tempdir().expect("temp");
    let spawn_driver = |name: &str, token: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir_all(dir.join("workspace")).expect("workspace");
        let token_file = dir.join("token");
        std::fs::write(&token_file, token).expect("token");
        let mut command = support::sortie(&dir);
        command
            .args(["driver", "--link", &gateway.url(), "--identity-token-file"])
            .arg(&token_file)
            .arg("--workspace")
            .arg(dir.join("workspace"))
            .arg("--home")
            .arg(dir.join("home"))
            .args(["--agent", "scripted", "--session", "ses_test", "--kill-grace", "1"])
            .env("SORTIE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        command.spawn().expect("spawn driver")
    };
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    // Drivers whose tokens the cluster does not vouch for, as ours, never link: one for another
    // audience, one of another service account, one the cluster never issued.
    let strangers = [
        apiserver.issue_token(
            "sortie",
            "sandbox",
            "pool-x",
            "uid-x",
            &["https://kubernetes.default.svc"],
        ),
        apiserver.issue_token("sortie", "gateway", "gw-0", "uid-y", &[LINK_AUDIENCE]),
        "eyJhbGciOiJSUzI1NiJ9.forged.sig".to_owned(),
    ];
    let strangers: Vec<Killed> = strangers
        .iter()
        .enumerate()
        .map(|(i, token)| Killed(spawn_driver(&format!("stranger-{i}"), token)))
        .collect();

    let token = apiserver.issue_token("sortie", "sandbox", "pool-a-1", "uid-a", &[LINK_AUDIENCE]);
    let _driver = Killed(spawn_driver("pod-a", &token));
    let link = links
        .wait_for("uid-a", Duration::from_secs(30))
        .await
        .expect("the pod's driver linked");
    assert_eq!(link.identity.pod_name, "pool-a-1");

    let client = DriverClient::over_link(link.clone());
    client.status().await.expect("the driver answers over its link");
    let started = client
        .start_turn(&StartTurn {
            n: 1,
            nonce: "nonce-link-1".into(),
            prompt: "#!scripted\nsay: over the link\nwrite: linked.txt\nhello\n>>>".into(),
            baseline: None,
            priming_context: None,
        })
        .await
        .expect("start");
    assert_eq!(started.nonce, "nonce-link-1");
    // The stream and the turn's report go over the same link at once (HTTP/2 streams).
    let body = client.stream(1, None).await.expect("stream");
    let report = sortie_testkit::wait::eventually("the turn ends", Duration::from_secs(30), || {
        let client = client.clone();
        async move {
            let report = client.report(1).await.map_err(|e| e.to_string())?;
            if report.state == TurnState::Running || report.state == TurnState::Delivering {
                Err(format!("{:?}", report.state))
            } else {
                Ok(report)
            }
        }
    })
    .await;
    assert_eq!(report.state, TurnState::Completed, "{report:?}");
    let bytes = tokio::time::timeout(Duration::from_secs(30), http_body_util::BodyExt::collect(body))
        .await
        .expect("the stream ends")
        .expect("body")
        .to_bytes();
    let stream = String::from_utf8_lossy(&bytes);
    assert_eq!(text_of(&stream), "over the link", "{stream}");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");
    assert_eq!(
        std::fs::read_to_string(root.path().join("pod-a/workspace/linked.txt")).expect("the agent wrote"),
        "hello\n"
    );

    // The link breaks (the gateway dropped it); the driver dials again and the host finds the turn it
    // ran on the new link.
    link.close();
    sortie_testkit::wait::eventually("the old link closes", Duration::from_secs(10), || {
        let open = link.is_open();
        async move { if open { Err("open") } else { Ok(()) } }
    })
    .await;
    let relinked = links
        .wait_for("uid-a", Duration::from_secs(30))
        .await
        .expect("the driver dialed again");
    let again = DriverClient::over_link(relinked).report(1).await.expect("report");
    assert_eq!(
        (again.state, again.nonce.as_str()),
        (TurnState::Completed, "nonce-link-1")
    );

    // None of the strangers linked, though each was reviewed (and each keeps dialing, backing off).
    sortie_testkit::wait::eventually("the strangers were reviewed", Duration::from_secs(30), || {
        let reviews = apiserver.reviews();
        async move { if reviews >= 5 { Ok(()) } else { Err(reviews) } }
    })
    .await;
    assert_eq!(links.len(), 1, "only the pod's own driver is linked");
    for uid in ["uid-x", "uid-y"] {
        assert!(links.get(uid).is_none(), "{uid} linked");
    }
    drop(strangers);
}
