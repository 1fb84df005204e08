//! Real coding agents from npm, end to end: a real `sortie serve`, the agent's pinned package installed by
//! `sortie agents install`, a real sandbox, and a fake vendor (`sortie-testkit`) reached only through the
//! gateway's model proxy. The agent writes a file with its own tool; the branch holds it; the transcript
//! validates with the `ai` package; the usage ledger holds the fake's tokens; the workspace's key reaches
//! the vendor and appears nowhere inside the sandbox.
//!
//! Agents are installed into `SORTIE_TEST_AGENTS_DIR` (default `/var/cache/sortie-test-agents`; npm keeps
//! its own cache too), so only the first run downloads them. `SORTIE_TEST_AGENTS` picks which run
//! (comma-separated; default all four).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_testkit::{FakeVendor, FakeVendorOptions, ToolCall, VendorKind};
use support::{Server, git, http_client, sortie};

const CANARY_KEY: &str = "sk-canary-4f1d9e0b7c2a5e8f3b6d1a9c0e7f2b4d";

const AGENTS: [&str; 4] = ["claude-code", "codex", "gemini", "opencode"];

fn selected(agent: &str) -> bool {
    match std::env::var("SORTIE_TEST_AGENTS") {
        Ok(list) => {
            let names: Vec<&str> = list.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
            // A misspelt name must not quietly turn every agent test into a pass.
            for name in &names {
                assert!(
                    AGENTS.contains(name),
                    "SORTIE_TEST_AGENTS names {name:?}; known: {AGENTS:?}"
                );
            }
            names.contains(&agent)
        }
        Err(_) => true,
    }
}

/// Installs run one at a time: two `npm install --prefix` into one directory would race.
static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn agents_dir() -> PathBuf {
    std::env::var_os("SORTIE_TEST_AGENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sortie-test-agents"))
}

fn install(agent: &str, root: &Path) {
    let _one_at_a_time = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
    let dir = agents_dir();
    let listed = sortie(root)
        .args(["--json", "agents", "list", "--agents-dir"])
        .arg(&dir)
        .output()
        .expect("agents list");
    let rows: Value = serde_json::from_slice(&listed.stdout).expect("agents list json");
    let installed = rows.as_array().expect("rows").iter().any(|r| {
        r["id"] == agent
            && r["installed"] == true
            && r["outdated"] == false
            && r["command"]
                .as_str()
                .is_some_and(|c| c.starts_with(dir.to_str().unwrap_or("-")))
    });
    if installed {
        return;
    }
    std::fs::create_dir_all(&dir).expect("agents dir");
    let out = sortie(root)
        .args(["agents", "install", agent, "--agents-dir"])
        .arg(&dir)
        .env("HOME", std::env::var_os("HOME").unwrap_or_default())
        .output()
        .expect("agents install");
    assert!(
        out.status.success(),
        "sortie agents install {agent}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One finished turn of a real agent whose model (a fake vendor behind the model proxy) calls `tool`.
struct AgentTurn {
    _temp: tempfile::TempDir,
    upstream: PathBuf,
    fake: FakeVendor,
    server: Server,
    token: String,
    http: reqwest::Client,
    id: String,
    /// The turn's stream as the `ai` package assembled it.
    message: Value,
}

/// Runs `task` as one turn of `agent` to its end, or `None` when the agent is not selected.
async fn run_agent_turn(agent: &str, vendor: VendorKind, tool: ToolCall, task: &str) -> Option<AgentTurn> {
    if !selected(agent) {
        eprintln!("skipped {agent}: not in SORTIE_TEST_AGENTS");
        return None;
    }
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path().to_owned();
    install(agent, &root);

    let upstream = support::upstream_with_main(&root);

    let mut options = FakeVendorOptions::new(vendor);
    options.tool = tool;
    options.require_key = Some(CANARY_KEY.to_owned());
    let fake = FakeVendor::start_with(vendor, options).await.expect("fake vendor");
    let api = match vendor {
        VendorKind::Anthropic => "anthropic",
        VendorKind::OpenAi => "openai",
        VendorKind::Gemini => "gemini",
    };
    let data_dir = root.join("data");
    let agents = agents_dir();
    let server = Server::start_with(
        &root,
        &data_dir,
        None,
        &[
            &format!("--upstream-{api}"),
            &fake.url,
            "--agents-dir",
            agents.to_str().expect("utf-8"),
        ],
    );
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    let http = http_client();
    let put = http
        .put(format!("{}/v1/model-keys/{api}", server.url))
        .bearer_auth(&token)
        .json(&json!({"key": CANARY_KEY}))
        .send()
        .await
        .expect("put key");
    assert!(put.status().is_success(), "{}", put.text().await.unwrap_or_default());

    let created: Value = http
        .post(format!("{}/v1/sessions", server.url))
        .bearer_auth(&token)
        .json(&json!({"repo": upstream, "task": task, "agent": agent}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(180);
    let session = loop {
        let session: Value = http
            .get(format!("{}/v1/sessions/{id}", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("session")
            .json()
            .await
            .expect("json");
        if ["idle", "failed"].contains(&session["phase"].as_str().unwrap_or("")) {
            break session;
        }
        assert!(
            Instant::now() < deadline,
            "{agent}: the session did not finish: {session:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(session["phase"], "idle", "{agent}: {session:#}");

    // The stream of the turn validates with the `ai` package and shows the tool call.
    let ticket: Value = http
        .post(format!("{}/v1/sessions/{id}/attach-ticket", server.url))
        .bearer_auth(&token)
        .json(&json!({"action": "attach"}))
        .send()
        .await
        .expect("ticket")
        .json()
        .await
        .expect("json");
    let validated = Command::new("node")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/ai-sdk/validate.mjs"))
        .args(["--url", &format!("{}/v1/sessions/{id}/stream?turn=1", server.url)])
        .args([
            "--header",
            &format!("Authorization: Ticket {}", ticket["ticket"].as_str().expect("ticket")),
        ])
        .arg("--print")
        .output()
        .expect("node");
    assert!(
        validated.status.success(),
        "{agent}: {}",
        String::from_utf8_lossy(&validated.stderr)
    );
    let message: Value = serde_json::from_slice(&validated.stdout).expect("message");
    Some(AgentTurn {
        _temp: temp,
        upstream,
        fake,
        server,
        token,
        http,
        id,
        message,
    })
}

async fn agent_writes_a_file_through_the_model_proxy(agent: &str, vendor: VendorKind, tool: ToolCall) {
    let Some(AgentTurn {
        _temp,
        upstream,
        fake,
        server,
        token,
        http,
        id,
        message,
    }) = run_agent_turn(agent, vendor, tool, "Create hello.txt saying hello.").await
    else {
        return;
    };
    // The branch holds the file the agent's own tool wrote.
    let branch = format!("refs/heads/sortie/{id}");
    let files = git(&upstream, &["diff", "--name-only", "refs/heads/main", &branch]);
    assert!(files.lines().any(|f| f == "hello.txt"), "{agent}: {files}");
    assert_eq!(git(&upstream, &["show", &format!("{branch}:hello.txt")]), "hello");

    let parts = message["parts"].as_array().expect("parts");
    assert!(
        parts.iter().any(|p| p["type"] == "dynamic-tool"),
        "{agent}: no tool call in {message:#}"
    );
    // Claude Code, Gemini and Codex (its `apply_patch`) report the edit's diff; opencode's `write` sends
    // none, and the driver makes it from the call (a new file: its whole content).
    let mentions = |p: &&Value| p.to_string().contains("hello.txt");
    let diff = parts
        .iter()
        .filter(mentions)
        .find(|p| p["type"] == "data-acp-diff")
        .unwrap_or_else(|| panic!("{agent}: no diff in {message:#}"));
    assert!(
        diff["data"]["newText"].as_str().is_some_and(|t| t.contains("hello")),
        "{agent}: {diff:#}"
    );
    // The model proxy's reading of each answer is in the turn too, written by the host.
    assert!(
        parts.iter().any(|p| p["type"] == "data-sortie-usage"
            && p["id"] == "tokens"
            && p["data"]["inputTokens"]
                .as_u64()
                .is_some_and(|n| n >= 123 && n % 123 == 0)),
        "{agent}: no usage part in {message:#}"
    );

    // The ledger holds exactly what the fake reported, once every answer has been read to its end.
    let answers = fake.usage_answers() as u64;
    assert!(answers >= 1, "{agent}: the fake answered nothing");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let usage: Value = http
            .get(format!("{}/v1/usage", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("usage")
            .json()
            .await
            .expect("json");
        let models: Vec<&Value> = usage["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|row| row["session_id"] == id.as_str())
            .flat_map(|row| row["models"].as_array().into_iter().flatten())
            .collect();
        let input: u64 = models.iter().filter_map(|m| m["input_tokens"].as_u64()).sum();
        let output: u64 = models.iter().filter_map(|m| m["output_tokens"].as_u64()).sum();
        // Every answer of the fake reports 123 in and 45 out.
        if (input, output) == (answers * 123, answers * 45) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{agent}: {answers} answers, but the ledger holds {input} in and {output} out: {usage:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The vendor saw the real key and only it; the sandbox holds it nowhere.
    let requests = fake.requests();
    assert!(!requests.is_empty());
    assert!(
        requests.iter().all(|r| r.key_matched == Some(true)),
        "{agent}: a request reached the vendor without the key"
    );
    let placeholder = sortie_driver::profile::API_KEY_PLACEHOLDER;
    for request in &requests {
        let headers = format!("{:?}", request.headers);
        assert!(
            !headers.contains(placeholder)
                && !request.path.contains(placeholder)
                && !request
                    .body
                    .windows(placeholder.len())
                    .any(|w| w == placeholder.as_bytes()),
            "{agent}: the agent's placeholder reached the vendor in {} {}",
            request.method,
            request.path
        );
    }
    support::assert_not_in_sandbox(&id, CANARY_KEY, agent);
    assert!(
        !server.log().contains(CANARY_KEY),
        "{agent}: the key is in the server's log"
    );
    let (_, transcript) = {
        let messages = http
            .get(format!("{}/v1/sessions/{id}/messages", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("messages")
            .text()
            .await
            .expect("text");
        ((), messages)
    };
    assert!(
        !transcript.contains(CANARY_KEY),
        "{agent}: the key is in the transcript"
    );
}

/// What the shell tools print: the command itself does not hold it (`printf 'sortie-%s' …`), so finding it
/// in a part means the tool's output reached the transcript.
const SHELL_OUTPUT: &str = "sortie-shell-ok";

/// Each agent's own shell tool running a two-line command: Claude Code's `Bash`, Codex's `exec_command`,
/// Gemini CLI's `run_shell_command`, opencode's `bash`.
fn shell_tool(agent: &str) -> ToolCall {
    let command = "printf 'sortie-%s\\n' shell-ok; printf 'second line\\n'";
    let description = "Print two lines";
    let (name, arguments) = match agent {
        "claude-code" => ("Bash", json!({"command": command, "description": description})),
        "codex" => ("exec_command", json!({"cmd": command})),
        "gemini" => (
            "run_shell_command",
            json!({"command": command, "description": description}),
        ),
        _ => ("bash", json!({"command": command, "description": description})),
    };
    ToolCall {
        name: name.to_owned(),
        arguments,
    }
}

/// A real agent runs a command with its own shell tool, and the command's output is in the transcript.
/// The tool call's parts are the dashboard's recorded fixtures (`web/test/fixtures/agents/`): with
/// `SORTIE_RECORD_FIXTURES=1` this test writes them.
async fn agent_runs_a_command_with_its_shell_tool(agent: &str, vendor: VendorKind) {
    let Some(turn) = run_agent_turn(agent, vendor, shell_tool(agent), "Print the two greeting lines.").await else {
        return;
    };
    let parts = turn.message["parts"].as_array().expect("parts");
    let toolish: Vec<&Value> = parts
        .iter()
        .filter(|p| {
            ["dynamic-tool", "data-acp-terminal", "data-acp-permission"].contains(&p["type"].as_str().unwrap_or(""))
        })
        .collect();
    assert!(
        toolish.iter().any(|p| p["type"] == "dynamic-tool"
            && (p["input"].to_string().contains("shell-ok") || p["title"].to_string().contains("shell-ok"))),
        "{agent}: no shell call in {:#}",
        turn.message
    );
    // Gemini CLI's ACP reports a shell command's completion with empty content and no raw output (seen
    // with 0.61): there is nothing of its output to show, and the dashboard says the agent reported none.
    if agent != "gemini" {
        assert!(
            toolish.iter().any(|p| p.to_string().contains(SHELL_OUTPUT)),
            "{agent}: the command's output is not in the transcript: {:#}",
            turn.message
        );
    }
    if std::env::var_os("SORTIE_RECORD_FIXTURES").is_some() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web/test/fixtures/agents");
        std::fs::create_dir_all(&dir).expect("fixtures dir");
        let recorded = json!({ "agent": agent, "recorded_by": "crates/sortie/tests/agents.rs", "parts": toolish });
        std::fs::write(
            dir.join(format!("{agent}-shell.json")),
            serde_json::to_string_pretty(&recorded).expect("json") + "\n",
        )
        .expect("write the fixture");
    }
    drop(turn.fake);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_runs_a_command() {
    agent_runs_a_command_with_its_shell_tool("claude-code", VendorKind::Anthropic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_runs_a_command() {
    agent_runs_a_command_with_its_shell_tool("codex", VendorKind::OpenAi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_runs_a_command() {
    agent_runs_a_command_with_its_shell_tool("gemini", VendorKind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_runs_a_command() {
    agent_runs_a_command_with_its_shell_tool("opencode", VendorKind::Anthropic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_writes_a_file() {
    agent_writes_a_file_through_the_model_proxy(
        "claude-code",
        VendorKind::Anthropic,
        ToolCall::write_hello(VendorKind::Anthropic),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_writes_a_file() {
    agent_writes_a_file_through_the_model_proxy("codex", VendorKind::OpenAi, ToolCall::apply_patch_hello()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_writes_a_file() {
    agent_writes_a_file_through_the_model_proxy(
        "gemini",
        VendorKind::Gemini,
        ToolCall::write_hello(VendorKind::Gemini),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_writes_a_file() {
    agent_writes_a_file_through_the_model_proxy(
        "opencode",
        VendorKind::Anthropic,
        ToolCall {
            name: "write".to_owned(),
            arguments: json!({"filePath": "/workspace/hello.txt", "content": "hello\n"}),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_key_fails_the_turn_at_once_and_the_session_goes_on_once_it_is_fixed() {
    let agent = "claude-code";
    if !selected(agent) {
        eprintln!("skipped the rejected-key story: {agent} is not in SORTIE_TEST_AGENTS");
        return;
    }
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path().to_owned();
    install(agent, &root);
    let upstream = support::upstream_with_main(&root);

    let mut options = FakeVendorOptions::new(VendorKind::Anthropic);
    options.require_key = Some(CANARY_KEY.to_owned());
    let fake = FakeVendor::start_with(VendorKind::Anthropic, options)
        .await
        .expect("fake");
    let data_dir = root.join("data");
    let agents = agents_dir();
    let server = Server::start_with(
        &root,
        &data_dir,
        None,
        &[
            "--upstream-anthropic",
            &fake.url,
            "--agents-dir",
            agents.to_str().expect("utf-8"),
        ],
    );
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    let http = http_client();
    let set_key = |key: &'static str| {
        let http = http.clone();
        let url = format!("{}/v1/model-keys/anthropic", server.url);
        let token = token.clone();
        async move {
            let put = http
                .put(url)
                .bearer_auth(token)
                .json(&json!({"key": key}))
                .send()
                .await
                .expect("put");
            assert!(put.status().is_success());
        }
    };
    set_key("sk-wrong-key-0000000000000000000000").await;
    let created: Value = http
        .post(format!("{}/v1/sessions", server.url))
        .bearer_auth(&token)
        .json(&json!({"repo": upstream, "task": "Create hello.txt saying hello.", "agent": agent}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id").to_owned();

    // From the vendor's first refusal to a failed turn.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !fake.requests().iter().any(|r| r.key_matched == Some(false)) {
        assert!(Instant::now() < deadline, "the agent never called the vendor");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let refused = Instant::now();
    let turn = loop {
        let turns: Value = http
            .get(format!("{}/v1/sessions/{id}/turns", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("turns")
            .json()
            .await
            .expect("json");
        let turn = turns["turns"][0].clone();
        if turn["status"] == "failed" {
            break turn;
        }
        assert!(
            refused.elapsed() < Duration::from_secs(10),
            "the turn did not fail: {turn:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let took = refused.elapsed();
    eprintln!("VENDOR_AUTH_REJECTED {} ms after the vendor's 401", took.as_millis());
    assert_eq!(turn["failure"]["code"], "VENDOR_AUTH_REJECTED", "{turn:#}");
    assert!(
        turn["failure"]["reason"].as_str().unwrap_or("").contains("anthropic"),
        "{turn:#}"
    );
    assert!(
        took < Duration::from_secs(2),
        "the turn failed {took:?} after the vendor's answer"
    );
    assert!(
        !turn.to_string().contains("sk-wrong-key"),
        "the reason never quotes a key"
    );

    // Once the session has failed (turn 1's agent is gone: a key fixed while it still ran could serve
    // it, and the next turn loads its history), fix the key; the session takes the next turn and delivers.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let session: Value = http
            .get(format!("{}/v1/sessions/{id}", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("session")
            .json()
            .await
            .expect("json");
        if session["phase"] == "failed" {
            break;
        }
        assert!(Instant::now() < deadline, "{session:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        fake.requests().iter().all(|r| r.key_matched == Some(false)),
        "turn 1's agent reached the vendor with a good key"
    );
    set_key(CANARY_KEY).await;
    let steered = http
        .post(format!("{}/v1/sessions/{id}/steer", server.url))
        .bearer_auth(&token)
        .json(&json!({"prompt": "Create hello.txt saying hello."}))
        .send()
        .await
        .expect("steer");
    assert_eq!(steered.status(), 202);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let session: Value = http
            .get(format!("{}/v1/sessions/{id}", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("session")
            .json()
            .await
            .expect("json");
        if session["phase"] == "idle" && session["turns"] == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{session:#}\nthe vendor saw {} requests; the last ones ended with:\n{}",
            fake.requests().len(),
            last_messages(&fake, 3)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let branch = format!("refs/heads/sortie/{id}");
    assert_eq!(git(&upstream, &["show", &format!("{branch}:hello.txt")]), "hello");
}

/// The last message of each of the vendor's `n` latest requests, for a failure's message.
fn last_messages(fake: &FakeVendor, n: usize) -> String {
    let requests = fake.requests();
    requests
        .iter()
        .rev()
        .take(n)
        .map(|request| {
            let body: Value = serde_json::from_slice(&request.body).unwrap_or_default();
            let last = body["messages"]
                .as_array()
                .and_then(|m| m.last())
                .cloned()
                .unwrap_or_default();
            let tools = body["tools"].as_array().map_or(0, Vec::len);
            format!(
                "{} ({} tools): {}",
                request.path,
                tools,
                last.to_string().chars().take(600).collect::<String>()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
