//! Webhooks with the real binaries: `sortie webhook add` against a real `sortie serve` (every role,
//! real sandboxes, the scripted agent), a receiver on this machine that fails its first two answers,
//! and signatures checked with the `openssl` CLI, not with sortie's own code.

mod support;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;
use support::{Server, sortie, stderr, stdout, upstream_with_main};

/// One request the receiver got.
#[derive(Clone, Debug)]
struct Received {
    event: String,
    delivery: String,
    signature: String,
    body: Vec<u8>,
    answered: u16,
}

/// A receiver that answers 500 twice to the first delivery it gets, and 200 to everything else.
async fn receiver() -> (String, Arc<Mutex<Vec<Received>>>) {
    let seen: Arc<Mutex<Vec<Received>>> = Arc::default();
    let kept = seen.clone();
    let app = axum::Router::new().route(
        "/hooks/sortie",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let kept = kept.clone();
            async move {
                let mut seen = kept.lock().expect("seen");
                let header = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned()
                };
                // The first delivery that arrives is refused twice; every other is taken at once.
                let delivery = header("x-sortie-delivery");
                let first = seen
                    .first()
                    .map_or(delivery.as_str(), |r| r.delivery.as_str())
                    .to_owned();
                let tries = seen.iter().filter(|r| r.delivery == delivery).count();
                let status = if delivery == first && tries < 2 { 500 } else { 200 };
                seen.push(Received {
                    event: header("x-sortie-event"),
                    delivery: header("x-sortie-delivery"),
                    signature: header("x-sortie-signature"),
                    body: body.to_vec(),
                    answered: status,
                });
                StatusCode::from_u16(status).expect("status")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hooks/sortie", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// `sha256=<hex>` of the body under the secret, as `openssl dgst` computes it.
fn openssl_signature(secret: &str, body: &[u8]) -> String {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-hmac", secret, "-r"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("openssl");
    child.stdin.take().expect("stdin").write_all(body).expect("write");
    let out = child.wait_with_output().expect("openssl");
    let text = String::from_utf8_lossy(&out.stdout);
    format!("sha256={}", text.split_whitespace().next().expect("digest"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_gets_signed_phase_events_and_a_failed_answer_is_retried() {
    let temp = tempfile::tempdir().expect("temp");
    // The data dir under this scratch dir must be searchable by the sandbox uid, as /var/lib/sortie is.
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let home = temp.path().to_path_buf();
    let data_dir = temp.path().join("data");
    let repo = upstream_with_main(temp.path()).to_string_lossy().into_owned();
    let (url, seen) = receiver().await;
    // The receiver is on this machine: its loopback range is exempted, as an operator would exempt an
    // internal receiver. Without it the URL is refused (below).
    let server = Server::start_with(
        &home,
        &data_dir,
        None,
        &["--default-agent", "scripted", "--webhook-exempt", "127.0.0.1/32"],
    );
    let client = |args: &[&str], stdin: Option<&str>| {
        let mut command = sortie(&home);
        command
            .args(["--server", &server.url, "--data-dir"])
            .arg(&data_dir)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("client");
        let mut input = child.stdin.take().expect("stdin");
        input.write_all(stdin.unwrap_or_default().as_bytes()).expect("stdin");
        drop(input);
        child.wait_with_output().expect("client")
    };

    let secret = "whsec-0123456789abcdef0123456789";
    let refused = client(&["webhook", "add", "http://10.9.8.7/hooks"], Some(secret));
    assert!(
        !refused.status.success() && stderr(&refused).contains("WEBHOOK_URL_REFUSED"),
        "{}",
        stderr(&refused)
    );
    let added = client(
        &["webhook", "add", &url, "--events", "session.phase"],
        Some(&format!("{secret}\n")),
    );
    assert!(added.status.success(), "{}", stderr(&added));
    let webhook = stdout(&added).split_whitespace().next().expect("id").to_owned();

    let done = client(&["--json", "run", "--repo", &repo, "#!scripted\nsay: fine"], None);
    let done: Value = serde_json::from_slice(&done.stdout).expect("json");
    let failing = client(&["--json", "run", "--repo", &repo, "#!scripted\nfail: it broke"], None);
    let failing: Value = serde_json::from_slice(&failing.stdout).expect("json");

    // Each session's resting phase arrives, signed; the first two answers were 500s, so the first event
    // was delivered three times under one delivery id.
    let deadline = Instant::now() + Duration::from_secs(90);
    let phase_of = |received: &[Received], session: &Value, phase: &str| {
        received.iter().any(|r| {
            let event: Value = serde_json::from_slice(&r.body).unwrap_or_default();
            r.answered == 200 && event["session"] == session["id"] && event["phase"] == phase
        })
    };
    loop {
        let received = seen.lock().expect("seen").clone();
        let first_delivered = received.first().is_some_and(|first| {
            received
                .iter()
                .any(|r| r.delivery == first.delivery && r.answered == 200)
        });
        if phase_of(&received, &done, "idle") && phase_of(&received, &failing, "failed") && first_delivered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no idle and failed events in time: {received:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received = seen.lock().expect("seen").clone();
    for request in &received {
        assert_eq!(request.event, "session.phase", "only the kinds asked for");
        assert_eq!(
            request.signature,
            openssl_signature(secret, &request.body),
            "the signature verifies"
        );
        let event: Value = serde_json::from_slice(&request.body).expect("a JSON event");
        assert_eq!(event["type"], "session.phase");
        assert!(
            event["seq"].as_u64().is_some() && event["at"].as_str().is_some(),
            "{event}"
        );
    }
    let failed = received
        .iter()
        .map(|r| serde_json::from_slice::<Value>(&r.body).expect("json"))
        .find(|e| e["session"] == failing["id"] && e["phase"] == "failed")
        .expect("the failed event");
    assert_eq!(failed["failure"]["code"], "AGENT_ERROR", "{failed}");
    let first = &received[0].delivery;
    let tries: Vec<u16> = received
        .iter()
        .filter(|r| &r.delivery == first)
        .map(|r| r.answered)
        .collect();
    assert_eq!(
        tries,
        [500, 500, 200],
        "the first delivery: two failures, then the third try"
    );
    // Every delivery id is answered 200 once: no event is delivered twice after it succeeded.
    let mut delivered: Vec<&str> = received
        .iter()
        .filter(|r| r.answered == 200)
        .map(|r| r.delivery.as_str())
        .collect();
    let count = delivered.len();
    delivered.sort_unstable();
    delivered.dedup();
    assert_eq!(delivered.len(), count);

    // The delivery log says the same.
    let log = client(&["--json", "webhook", "deliveries", &webhook], None);
    let log: Value = serde_json::from_slice(&log.stdout).expect("json");
    let entry = log["deliveries"]
        .as_array()
        .expect("deliveries")
        .iter()
        .find(|d| &d["id"] == first)
        .expect("the first delivery in the log");
    assert_eq!(
        (entry["state"].clone(), entry["attempts"].clone()),
        (Value::from("delivered"), Value::from(3))
    );
    assert_eq!(entry["last_status"], 200);
    let listed = client(&["webhook", "list"], None);
    assert!(stdout(&listed).contains(&webhook) && !stdout(&listed).contains(secret));
    let removed = client(&["webhook", "rm", &webhook], None);
    assert!(removed.status.success(), "{}", stderr(&removed));
}
