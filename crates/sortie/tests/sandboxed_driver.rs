//! The driver where it belongs: `sortie driver` with the scripted agent inside a real sandbox, its
//! API reached from the host through `driver.sock`, its agent's traffic through the egress relay.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio, inside};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_runs_inside_the_sandbox_and_reaches_out_only_through_the_relay() {
    build_scripted_agent();
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dirs = ["workspace", "home", "run", "egress", "state"].map(|d| {
        let path = temp.path().join(d);
        std::fs::create_dir_all(&path).expect("dir");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    });
    let [workspace, home, run_dir, egress_dir, state] = dirs;
    let runtime = LocalRuntime::new(LocalConfig::new(state)).expect("runtime");

    let egress_socket = egress_dir.join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&egress_socket).expect("egress");
    runtime.grant_socket(&egress_socket).expect("grant");
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0_u8; 256];
                let read = stream.read(&mut buffer).await.unwrap_or(0);
                let said = String::from_utf8_lossy(&buffer[..read])
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                let _ = stream
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{said}",
                            said.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });

    // Copies in a directory the sandbox uid can reach, wherever the checkout is.
    let bin_dir = temp.path().join("bin");
    std::fs::create_dir_all(&bin_dir).expect("bin");
    let built = Path::new(support::BINARY).parent().expect("bin dir").to_owned();
    for binary in ["sortie", "sortie-scripted-agent"] {
        std::fs::copy(built.join(binary), bin_dir.join(binary)).expect("copy binary");
    }
    let sortie = bin_dir.join("sortie").display().to_string();
    let command = [
        sortie.as_str(),
        "driver",
        "--socket",
        inside::DRIVER_SOCKET,
        "--workspace",
        inside::WORKSPACE,
        "--home",
        inside::HOME,
        "--agent",
        "scripted",
        "--session",
        "ses_sandboxed",
        "--egress-socket",
        inside::EGRESS_SOCKET,
    ];
    let spec = SandboxSpec {
        name: format!("driver-{}", std::process::id()),
        workspace: workspace.clone(),
        home,
        run_dir: run_dir.clone(),
        egress_dir: Some(egress_dir),
        read_only: vec![bin_dir],
        env: Vec::new(),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    };
    let name = spec.name.clone();
    runtime.create(spec).await.expect("create");
    runtime.start(&name).await.expect("start");

    let socket = run_dir.join("driver.sock");
    let client = reqwest::Client::builder()
        .unix_socket(socket.clone())
        .build()
        .expect("client");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(reply) = client.get("http://driver/status").send().await
            && reply.status().is_success()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the driver inside never answered on {}",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let script = "#!scripted\nwrite: proof.txt\nwritten inside\n>>>\nrun: id -u; env | grep -c PROXY\nrun: python3 -c \"import urllib.request; print(urllib.request.urlopen('http://updates.example.org/check').read().decode())\"\nsay: done";
    let started = client
        .post("http://driver/turns")
        .json(&json!({"n": 1, "prompt": script}))
        .send()
        .await
        .expect("turn");
    assert_eq!(started.status().as_u16(), 202);
    let stream = client
        .get("http://driver/turns/1/stream")
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("body");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");
    assert_eq!(
        std::fs::read_to_string(workspace.join("proof.txt")).expect("proof"),
        "written inside\n"
    );
    let outputs: Vec<Value> = stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|json| serde_json::from_str::<Value>(json).ok())
        .filter(|chunk| chunk["type"] == "tool-output-available")
        .collect();
    let texts: Vec<String> = outputs.iter().map(|o| o["output"].to_string()).collect();
    assert!(
        texts.iter().any(|t| t.contains("1000\\n")),
        "the agent is uid 1000 inside: {texts:?}"
    );
    // Proxied through the relay: the egress stub saw the request line of the absolute-URI request.
    assert!(
        texts
            .iter()
            .any(|t| t.contains("GET http://updates.example.org/check HTTP/1.1")),
        "{texts:?}"
    );

    runtime.stop(&name, Duration::from_secs(2)).await.expect("stop");
    let usage = runtime.destroy(&name).await.expect("destroy");
    assert!(usage.cpu_seconds > 0.0, "{usage:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_connection_shows_up_in_the_stream_at_once() {
    use sortie_gateway::egress::proxy::{EgressProxy, FixedAllowlist, SystemResolver, report_to_driver};
    build_scripted_agent();
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dirs = ["workspace", "home", "run", "egress", "state", "bin"].map(|d| {
        let path = temp.path().join(d);
        std::fs::create_dir_all(&path).expect("dir");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    });
    let [workspace, home, run_dir, egress_dir, state, bin_dir] = dirs;
    let runtime = LocalRuntime::new(LocalConfig::new(state)).expect("runtime");
    let built = Path::new(support::BINARY).parent().expect("bin dir").to_owned();
    for binary in ["sortie", "sortie-scripted-agent"] {
        std::fs::copy(built.join(binary), bin_dir.join(binary)).expect("copy binary");
    }

    // The real egress proxy with an empty allowlist; its denials go into the turn's stream.
    let driver_socket = run_dir.join("driver.sock");
    let proxy = EgressProxy::new(
        FixedAllowlist::new(Vec::new()),
        Vec::new(),
        Arc::new(SystemResolver),
        None,
        Some(report_to_driver(driver_socket.clone())),
    );
    let egress_socket = egress_dir.join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&egress_socket).expect("egress");
    runtime.grant_socket(&egress_socket).expect("grant");
    tokio::spawn(proxy.serve(listener));

    let sortie = bin_dir.join("sortie").display().to_string();
    let command = [
        sortie.as_str(),
        "driver",
        "--socket",
        inside::DRIVER_SOCKET,
        "--workspace",
        inside::WORKSPACE,
        "--home",
        inside::HOME,
        "--agent",
        "scripted",
        "--session",
        "ses_blocked",
        "--egress-socket",
        inside::EGRESS_SOCKET,
    ];
    let name = format!("blocked-{}", std::process::id());
    let spec = SandboxSpec {
        name: name.clone(),
        workspace,
        home,
        run_dir,
        egress_dir: Some(egress_dir),
        read_only: vec![bin_dir],
        env: Vec::new(),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    };
    runtime.create(spec).await.expect("create");
    runtime.start(&name).await.expect("start");
    let client = reqwest::Client::builder()
        .unix_socket(driver_socket.clone())
        .build()
        .expect("client");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !client
        .get("http://driver/status")
        .send()
        .await
        .map(|r| r.status().is_success())
        .unwrap_or(false)
    {
        assert!(Instant::now() < deadline, "the driver inside never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let script = "#!scripted\nrun: python3 -c \"import urllib.request; urllib.request.urlopen('http://blocked.example.org/')\"\nsleep: 300\nsay: done";
    let started = client
        .post("http://driver/turns")
        .json(&json!({"n": 1, "prompt": script}))
        .send()
        .await
        .expect("turn");
    assert_eq!(started.status().as_u16(), 202);
    let stream = client
        .get("http://driver/turns/1/stream")
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("body");
    let denied: Vec<Value> = stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|json| serde_json::from_str::<Value>(json).ok())
        .filter(|chunk| chunk["type"] == "data-sortie-egress-denied")
        .collect();
    assert_eq!(denied.len(), 1, "{stream}");
    assert_eq!(denied[0]["data"]["host"], "blocked.example.org");
    assert_eq!(denied[0]["data"]["port"], 80);
    assert!(
        denied[0]["data"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("allowlist"),
        "{stream}"
    );
    assert!(
        stream.contains("HTTP Error 403"),
        "the agent saw the refusal too: {stream}"
    );
    runtime.stop(&name, Duration::from_secs(2)).await.expect("stop");
    runtime.destroy(&name).await.expect("destroy");
}
