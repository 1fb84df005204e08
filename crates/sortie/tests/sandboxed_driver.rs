//! The driver where it belongs: `sortie driver` with the scripted agent inside a real sandbox, its
//! API reached from the host through a socket the host made and handed over (its name is in a
//! directory of the host's, not in the sandbox), its agent's traffic through the egress relay.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio, Usage, inside};

// `/proc/2` is the driver: bwrap's reaper is pid 1 in the sandbox, its command pid 2.

/// A sandbox layout with copies of `sortie` and the scripted agent the sandbox uid can reach.
struct Layout {
    _temp: tempfile::TempDir,
    runtime: LocalRuntime,
    workspace: PathBuf,
    home: PathBuf,
    host_dir: PathBuf,
    egress_dir: PathBuf,
    bin_dir: PathBuf,
}

impl Layout {
    fn new() -> Layout {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let built = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "sortie-scripted-agent"])
            .current_dir(root)
            .status();
        assert!(built.expect("cargo").success());
        let temp = tempfile::tempdir().expect("temp");
        std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let dir = |name: &str| {
            let path = temp.path().join(name);
            std::fs::create_dir_all(&path).expect("dir");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            path
        };
        let (workspace, home, host_dir, egress_dir, state, bin_dir) = (
            dir("workspace"),
            dir("home"),
            dir("host"),
            dir("egress"),
            dir("state"),
            dir("bin"),
        );
        let from = Path::new(support::BINARY).parent().expect("bin dir").to_owned();
        for binary in ["sortie", "sortie-scripted-agent"] {
            std::fs::copy(from.join(binary), bin_dir.join(binary)).expect("copy binary");
        }
        // The host's own directory: no one but the host opens it.
        std::fs::set_permissions(&host_dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let runtime = LocalRuntime::new(LocalConfig::new(state)).expect("runtime");
        Layout {
            _temp: temp,
            runtime,
            workspace,
            home,
            host_dir,
            egress_dir,
            bin_dir,
        }
    }

    fn egress_socket(&self) -> PathBuf {
        self.egress_dir.join("egress.sock")
    }

    fn driver_socket(&self) -> PathBuf {
        self.host_dir.join("driver.sock")
    }

    /// Starts `sortie driver` inside a sandbox and waits until it answers; returns a client for it.
    async fn start_driver(&self, name: &str, session: &str) -> reqwest::Client {
        let sortie = self.bin_dir.join("sortie").display().to_string();
        let command = [
            sortie.as_str(),
            "driver",
            "--listen-on-stdin",
            "--workspace",
            inside::WORKSPACE,
            "--home",
            inside::HOME,
            "--agent",
            "scripted",
            "--session",
            session,
            "--egress-socket",
            inside::EGRESS_SOCKET,
        ];
        let spec = SandboxSpec {
            name: name.to_owned(),
            workspace: self.workspace.clone(),
            home: self.home.clone(),
            egress_dir: Some(self.egress_dir.clone()),
            read_only: vec![self.bin_dir.clone()],
            read_only_at: Vec::new(),
            late_binds: false,
            env: Vec::new(),
            command: command.iter().map(|s| (*s).to_owned()).collect(),
            limits: Limits::default(),
            stdio: SandboxStdio::Listener(Arc::new(
                std::os::unix::net::UnixListener::bind(self.driver_socket()).expect("bind the driver socket"),
            )),
        };
        self.runtime.create(spec).await.expect("create");
        self.runtime.start(name).await.expect("start");
        let client = support::http_builder()
            .unix_socket(self.driver_socket())
            .build()
            .expect("client");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !client
            .get("http://driver/status")
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            assert!(Instant::now() < deadline, "the driver inside never answered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        client
    }

    async fn stop(&self, name: &str) -> Usage {
        self.runtime.stop(name, Duration::from_secs(2)).await.expect("stop");
        self.runtime.destroy(name).await.expect("destroy")
    }
}

/// Runs turn 1 and returns its whole stream.
async fn turn(client: &reqwest::Client, script: &str) -> String {
    let started = client
        .post("http://driver/turns")
        .json(&json!({"n": 1, "nonce": "host-nonce", "prompt": script}))
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
    stream
}

fn chunks(stream: &str) -> Vec<Value> {
    stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|json| serde_json::from_str::<Value>(json).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_runs_inside_the_sandbox_and_reaches_out_only_through_the_relay() {
    let layout = Layout::new();
    // A stub for the gateway's side of egress.sock: it answers with the request line it received.
    let listener = tokio::net::UnixListener::bind(layout.egress_socket()).expect("egress");
    layout.runtime.grant_socket(&layout.egress_socket()).expect("grant");
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
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{said}",
                    said.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    let name = format!("driver-{}", std::process::id());
    let client = layout.start_driver(&name, "ses_sandboxed").await;
    let script = "#!scripted\nwrite: proof.txt\nwritten inside\n>>>\nrun: id -u; env | grep -c PROXY\nrun: python3 -c \"import urllib.request; print(urllib.request.urlopen('http://updates.example.org/check').read().decode())\"\nsay: done";
    let stream = turn(&client, script).await;
    assert_eq!(
        std::fs::read_to_string(layout.workspace.join("proof.txt")).expect("proof"),
        "written inside\n"
    );
    let outputs: Vec<String> = chunks(&stream)
        .into_iter()
        .filter(|c| c["type"] == "tool-output-available")
        .map(|c| c["output"].to_string())
        .collect();
    assert!(
        outputs.iter().any(|t| t.contains("1000\\n")),
        "the agent is uid 1000 inside: {outputs:?}"
    );
    // Proxied through the relay: the stub saw the request line of the absolute-URI request.
    assert!(
        outputs
            .iter()
            .any(|t| t.contains("GET http://updates.example.org/check HTTP/1.1")),
        "{outputs:?}"
    );
    // Nothing inside names the driver's socket, and the agent cannot take it from the driver: the
    // driver is not dumpable, so its descriptors, memory and environment are closed to the agent.
    let probe = "#!scripted\nrun: ls /run; ls -l /proc/2/fd; cat /proc/2/environ; head -c 4 /proc/2/mem; echo probed";
    let turn2 = client
        .post("http://driver/turns")
        .json(&json!({"n": 2, "nonce": "host-nonce-2", "prompt": probe}))
        .send()
        .await
        .expect("turn 2");
    assert_eq!(turn2.status().as_u16(), 202);
    let stream = client
        .get("http://driver/turns/2/stream")
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("body");
    let said: String = chunks(&stream)
        .into_iter()
        .filter(|c| c["type"] == "tool-output-available" || c["type"] == "tool-output-error")
        .map(|c| c.to_string())
        .collect();
    assert!(said.contains("probed"), "{said}");
    assert!(
        !said.contains("driver.sock"),
        "no name of the driver's socket inside: {said}"
    );
    assert!(
        said.contains("Permission denied"),
        "the driver's /proc entries are closed to the agent: {said}"
    );
    assert!(
        !said.contains("socket:["),
        "the agent listed the driver's descriptors: {said}"
    );
    let usage = layout.stop(&name).await;
    assert!(usage.cpu_seconds > 0.0, "{usage:?}");
}

/// A pod's driver, as the Kubernetes runtime runs it, in a real sandbox: generic (`--await-assignment`),
/// it dials the gateway with its identity token, is assigned its session over that link, and its
/// agent's only way out is the session's egress proxy at the gateway (`--egress-over-link`) — nothing
/// while the pod is bound to no session, the allowlist's hosts once it is.
///
/// A bwrap sandbox has no network to reach a gateway by, so the gateway serves its link routes on a
/// socket bound into the sandbox (`--link unix:…`) where a pod dials the cluster's network; the token
/// file is written by the test where the kubelet would project it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_driver_in_a_sandbox_links_is_assigned_and_reaches_out_only_through_its_session() {
    use sortie_gateway::egress::policy::Cidr;
    use sortie_gateway::egress::proxy::{EgressProxy, FixedAllowlist, StaticResolver};
    use sortie_gateway::links::{CachedIdentity, DriverLinks, EgressBindings, KubeTokenReview, LinkState, link_router};
    use sortie_protocol::driver::{Assignment, LINK_AUDIENCE, StartTurn, TurnState};
    use sortie_worker::client::DriverClient;

    let layout = Layout::new();
    let apiserver = sortie_testkit::kube::FakeApiserver::start("gateway-account-token").await;
    let links = DriverLinks::new();
    let bindings = EgressBindings::new();
    let review = KubeTokenReview {
        apiserver: apiserver.url(),
        bearer: "gateway-account-token".into(),
        sandbox_account: "system:serviceaccount:sortie:sandbox".into(),
        http: support::http_client(),
    };
    let router = link_router(LinkState {
        links: links.clone(),
        identity: Arc::new(CachedIdentity::new(Arc::new(review))),
        egress: bindings.clone(),
    });
    let link_socket = layout.egress_dir.join("link.sock");
    let listener = tokio::net::UnixListener::bind(&link_socket).expect("link socket");
    layout.runtime.grant_socket(&link_socket).expect("grant");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    // What the session's allowlist lets out: one name, served on the host's loopback.
    let upstream = sortie_testkit::http::serve(
        axum::Router::new().route("/check", axum::routing::get(|| async { "answered upstream" })),
    )
    .await;
    let port = upstream.url().rsplit(':').next().expect("port").to_owned();

    let token = apiserver.issue_token("sortie", "sandbox", "pool-a-1", "uid-a", &[LINK_AUDIENCE]);
    let token_file = layout.home.join("identity-token");
    std::fs::write(&token_file, &token).expect("token");
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let sortie = layout.bin_dir.join("sortie").display().to_string();
    let link = format!("unix:{}/link.sock", inside::EGRESS_DIR);
    let token_inside = format!("{}/identity-token", inside::HOME);
    let command = [
        sortie.as_str(),
        "driver",
        "--link",
        &link,
        "--identity-token-file",
        &token_inside,
        "--workspace",
        inside::WORKSPACE,
        "--home",
        inside::HOME,
        "--await-assignment",
        "--egress-over-link",
        "--kill-grace",
        "1",
    ];
    let name = format!("pod-{}", std::process::id());
    let spec = SandboxSpec {
        name: name.clone(),
        workspace: layout.workspace.clone(),
        home: layout.home.clone(),
        egress_dir: Some(layout.egress_dir.clone()),
        read_only: vec![layout.bin_dir.clone()],
        read_only_at: Vec::new(),
        late_binds: false,
        env: Vec::new(),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    };
    layout.runtime.create(spec).await.expect("create");
    layout.runtime.start(&name).await.expect("start");
    let linked = links
        .wait_for("uid-a", Duration::from_secs(30))
        .await
        .expect("the sandboxed driver linked");
    let client = DriverClient::over_link(linked);
    client
        .assign(&Assignment {
            session: "ses_pod".into(),
            agent: "scripted".into(),
            model: None,
            model_proxy: None,
            branch: None,
            remote: None,
            turn_timeout_secs: None,
            checkout: None,
            secret_digests: None,
        })
        .await
        .expect("assigned");

    let fetch = format!(
        "#!scripted\nrun: python3 -c \"import urllib.request; print(urllib.request.urlopen('http://updates.example.org:{port}/check', timeout=10).read().decode())\"\nsay: done"
    );
    let run_turn = |n: u32| {
        let client = client.clone();
        let prompt = fetch.clone();
        async move {
            client
                .start_turn(&StartTurn {
                    n,
                    nonce: format!("nonce-{n}"),
                    prompt,
                    baseline: None,
                    priming_context: None,
                })
                .await
                .expect("start");
            let body = client.stream(n, None).await.expect("stream");
            let bytes = tokio::time::timeout(Duration::from_secs(60), http_body_util::BodyExt::collect(body))
                .await
                .expect("the stream ends")
                .expect("body")
                .to_bytes();
            let report = client.report(n).await.expect("report");
            assert_eq!(report.state, TurnState::Completed, "{report:?}");
            let stream = String::from_utf8_lossy(&bytes).into_owned();
            chunks(&stream)
                .into_iter()
                .filter(|c| c["type"] == "tool-output-available" || c["type"] == "tool-output-error")
                .map(|c| c.to_string())
                .collect::<String>()
        }
    };

    // Bound to no session yet: the gateway refuses the pod's connection, and the fetch fails.
    let said = run_turn(1).await;
    assert!(
        !said.contains("answered upstream"),
        "an unbound pod reached out: {said}"
    );
    assert!(said.contains("Error") || said.contains("error"), "{said}");

    let names =
        std::collections::HashMap::from([("updates.example.org".to_owned(), vec!["127.0.0.1".parse().expect("ip")])]);
    let proxy = EgressProxy::new(
        FixedAllowlist::new(vec!["updates.example.org".into()]),
        vec![Cidr::parse("127.0.0.1/32").expect("cidr")],
        Arc::new(StaticResolver(names)),
        None,
        None,
    );
    bindings.bind("uid-a", proxy);
    let said = run_turn(2).await;
    assert!(
        said.contains("answered upstream"),
        "the session's egress carried the agent's request: {said}"
    );
    layout.runtime.stop(&name, Duration::from_secs(2)).await.expect("stop");
    layout.runtime.destroy(&name).await.expect("destroy");
}
