//! sortie's MCP server driven by the official MCP TypeScript SDK (`tests/mcp`, pinned) against a real
//! `sortie serve` (every role, real sandboxes, the scripted agent): over streamable HTTP at `/mcp`
//! with an operator's and a viewer's token, and over stdio through `sortie mcp`.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::{BINARY, Server, http_client, sortie, stderr, stdout, upstream_with_main};

fn kit() -> PathBuf {
    let kit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/mcp");
    if !kit.join("node_modules/@modelcontextprotocol/sdk").exists() {
        let installed = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&kit)
            .status()
            .expect("npm");
        assert!(installed.success(), "npm ci in tests/mcp");
    }
    kit
}

/// Runs the kit's story and returns what it printed.
fn story(home: &Path, args: &[&str]) -> Value {
    let output = Command::new("node")
        .arg(kit().join("session.mjs"))
        .args(args)
        .env("HOME", home)
        .env_remove("SORTIE_TOKEN")
        .env_remove("SORTIE_SERVER")
        .output()
        .expect("node");
    assert!(
        output.status.success(),
        "the MCP story failed:\n{}\n{}",
        stdout(&output),
        stderr(&output)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|_| panic!("not JSON: {}", stdout(&output)))
}

/// The checks one story must pass, whichever transport carried it.
fn assert_story(out: &Value) {
    let names: Vec<&str> = out["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    for tool in [
        "create_session",
        "list_sessions",
        "get_session",
        "steer_session",
        "stop_session",
        "cancel_session",
        "await_session",
        "get_transcript",
        "allow_egress",
        "raise_budget",
    ] {
        assert!(names.contains(&tool), "{tool} in {names:?}");
    }
    for tool in out["tools"].as_array().expect("tools") {
        assert!(tool["description"].as_str().is_some_and(|d| d.len() > 20), "{tool}");
        assert_eq!(tool["schema"]["type"], "object", "{tool}");
    }
    let create = out["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["name"] == "create_session")
        .expect("create_session");
    assert_eq!(
        create["schema"]["required"],
        serde_json::json!(["repo", "task"]),
        "{create}"
    );
    assert_eq!(out["server"]["name"], "sortie");

    assert_eq!(out["created"]["isError"], false, "{}", out["created"]);
    let id = out["created"]["json"]["id"].as_str().expect("id");
    let awaited = &out["awaited"]["json"];
    assert_eq!(
        (awaited["phase"].as_str(), awaited["finished"].as_bool()),
        (Some("idle"), Some(true)),
        "{awaited}"
    );
    assert_eq!(awaited["branch"], format!("sortie/{id}"));
    assert!(
        awaited["last_turn_summary"]
            .as_str()
            .is_some_and(|s| s.contains("Hello from the first turn.")),
        "{awaited}"
    );
    let transcript = out["transcript"]["text"].as_str().expect("text");
    assert!(
        transcript.contains("[assistant]\nHello from the first turn."),
        "{transcript}"
    );
    assert_eq!(out["steered"]["json"]["n"], 2, "{}", out["steered"]);
    assert_eq!(out["awaitedAgain"]["json"]["phase"], "idle");
    let again = out["transcriptAgain"]["text"].as_str().expect("text");
    assert!(
        again.contains("And the second.") && !again.contains("Hello from the first turn."),
        "{again}"
    );
    assert!(
        out["listed"]["json"]["sessions"]
            .as_array()
            .expect("sessions")
            .iter()
            .any(|s| s["id"] == id)
    );
    assert_eq!(out["allowed"]["json"]["allow"], serde_json::json!(["example.com"]));
    assert_eq!(out["refusedAllow"]["isError"], true);
    assert!(
        out["refusedAllow"]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("EGRESS_ALLOWLIST_INVALID: "))
    );
    assert_eq!(out["missing"]["isError"], true);
    assert!(
        out["missing"]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("SESSION_NOT_FOUND: "))
    );
    assert_eq!(out["canceled"]["json"]["phase"], "canceled");
}

#[test]
fn an_mcp_client_creates_awaits_reads_and_steers_sessions_over_http_and_stdio() {
    let temp = tempfile::tempdir().expect("temp");
    // The data dir under this scratch dir must be searchable by the sandbox uid, as /var/lib/sortie is.
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let home = temp.path().to_path_buf();
    let data_dir = temp.path().join("data");
    let repo = upstream_with_main(temp.path()).to_string_lossy().into_owned();
    let server = Server::start_with(&home, &data_dir, None, &["--default-agent", "scripted"]);
    let admin = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    let viewer = sortie(&home)
        .args([
            "token",
            "create",
            "--workspace",
            "default",
            "--role",
            "viewer",
            "--data-dir",
        ])
        .arg(&data_dir)
        .output()
        .expect("token create");
    assert!(viewer.status.success(), "{}", stderr(&viewer));
    let viewer = stdout(&viewer).trim().to_owned();

    // /mcp takes no request without a token.
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let anonymous = runtime.block_on(async {
        http_client()
            .post(format!("{}/mcp", server.url))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#)
            .send()
            .await
            .expect("post")
    });
    assert_eq!(anonymous.status().as_u16(), 401);

    let url = format!("{}/mcp", server.url);
    let http = story(
        &home,
        &["--http", &url, "--token", &admin, "--viewer", &viewer, "--repo", &repo],
    );
    assert_story(&http);
    // The token's role applies: a viewer reads but cannot create.
    assert_eq!(http["viewerCreate"]["isError"], true, "{}", http["viewerCreate"]);
    assert!(
        http["viewerCreate"]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("FORBIDDEN: "))
    );
    assert_eq!(http["viewerGet"]["isError"], false, "{}", http["viewerGet"]);

    // `sortie mcp` on stdio, with the CLI's credentials (here the data dir's admin token).
    let data = data_dir.to_str().expect("utf-8");
    let stdio = story(
        &home,
        &[
            "--stdio",
            BINARY,
            "--server",
            &server.url,
            "--data-dir",
            data,
            "mcp",
            "--",
            "--repo",
            &repo,
        ],
    );
    assert_story(&stdio);
}
