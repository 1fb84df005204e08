//! Roles as replicas (DESIGN §15): `sortie serve` processes with only some roles, each with its own data
//! dir as on hosts of their own, on one PostgreSQL. Two api+gateway replicas and one worker run a real
//! session in a real sandbox; a client attached to a replica gets the live tail of a turn the worker
//! runs elsewhere, and a client whose replica dies goes on at the other one without losing or repeating a
//! part. All processes run on this machine: what they share is only the database, the master key and
//! the network, as replicas on separate hosts would.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{LISTENING, Server, WORKER_FEED, http_client, operator_token_on, sortie};

/// The master key every replica shares (from one Kubernetes Secret in a real deployment).
const SHARED_KEY: &str = "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=";
/// Another master key: a replica started with it must refuse.
const OTHER_KEY: &str = "CQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQk=";

/// One server-sent event: its id (the part's index) and data.
#[derive(Clone, Debug, PartialEq)]
struct Event {
    id: Option<u64>,
    data: String,
}

/// Reads a stream's events as they come, each within the deadline.
struct Events {
    response: reqwest::Response,
    buffer: String,
    deadline: Instant,
}

impl Events {
    fn new(response: reqwest::Response) -> Self {
        Self {
            response,
            buffer: String::new(),
            deadline: Instant::now() + Duration::from_secs(60),
        }
    }

    /// The next event with data (comments and heartbeats skipped); `None` when the stream ends.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut id = None;
                let mut data = None;
                for line in block.lines() {
                    if let Some(value) = line.strip_prefix("id: ") {
                        id = value.parse().ok();
                    } else if let Some(value) = line.strip_prefix("data: ") {
                        data = Some(value.to_owned());
                    }
                }
                if let Some(data) = data {
                    return Some(Event { id, data });
                }
                continue;
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.response.chunk()).await {
                Ok(Ok(Some(bytes))) => self.buffer.push_str(&String::from_utf8_lossy(&bytes)),
                Ok(Ok(None)) => return None,
                Ok(Err(error)) => panic!("the stream broke: {error}; unread: {}", self.buffer),
                Err(_) => panic!("the stream stalled; unread: {}", self.buffer),
            }
        }
    }

    /// Events up to and including the first whose data holds `needle`.
    async fn until(&mut self, needle: &str) -> Vec<Event> {
        let mut seen = Vec::new();
        while let Some(event) = self.next().await {
            let found = event.data.contains(needle);
            seen.push(event);
            if found {
                return seen;
            }
        }
        panic!("the stream ended before {needle:?}: {seen:#?}");
    }
}

struct Client {
    http: reqwest::Client,
    token: String,
}

impl Client {
    async fn call(&self, server: &Server, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", server.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// Attaches to the session's first turn at `server` with a ticket that replica mints, resuming
    /// after `last_event_id` when given.
    async fn attach(&self, server: &Server, id: &str, last_event_id: Option<u64>) -> Events {
        let (status, ticket) = self
            .call(
                server,
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/attach-ticket"),
                Some(json!({"action": "attach"})),
            )
            .await;
        assert_eq!(status, 201, "{ticket}");
        let mut request = self
            .http
            .get(format!("{}/v1/sessions/{id}/stream?turn=1", server.url))
            .header(
                "authorization",
                format!("Ticket {}", ticket["ticket"].as_str().expect("ticket")),
            );
        if let Some(last) = last_event_id {
            request = request.header("last-event-id", last.to_string());
        }
        let response = request.send().await.expect("attach");
        assert_eq!(response.status(), 200);
        Events::new(response)
    }
}

fn replica(root: &Path, name: &str, database_url: &str, roles: &[&str]) -> Server {
    let ready = if roles.contains(&"--feed-listen") {
        WORKER_FEED
    } else {
        LISTENING
    };
    Server::start_announcing(
        root,
        &root.join(name),
        Some(database_url),
        roles,
        &[("SORTIE_KEYRING_KEY", SHARED_KEY)],
        ready,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_replicas_and_a_worker_on_one_database_serve_the_live_tail_and_survive_a_replica() {
    if !sortie_store::testing::postgres_available("api_replicas_and_a_worker_on_one_database_serve_the_live_tail").await
    {
        return;
    }
    let database = sortie_store::testing::TestDatabase::postgres().await.expect("postgres");
    let temp = tempfile::tempdir().expect("temp");
    // The sandbox uid passes through the test's directory to the repository's mirror, as it would
    // through /srv or a home that is not 0700.
    std::fs::set_permissions(temp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let root = temp.path();
    let upstream = support::upstream_with_main(root);

    let api_a = replica(root, "api-a", &database.url, &["--roles", "api,gateway"]);
    let api_b = replica(root, "api-b", &database.url, &["--roles", "api,gateway"]);
    let worker = replica(
        root,
        "worker",
        &database.url,
        &["--roles", "worker", "--feed-listen", "127.0.0.1:0"],
    );
    let client = Client {
        http: http_client(),
        token: operator_token_on(root, &database.url),
    };

    // A replica with another master key refuses to start, naming the setting to fix, before it serves.
    let mut refused = sortie(root)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--roles",
            "api,gateway",
            "--data-dir",
        ])
        .arg(root.join("api-c"))
        .args(["--database-url", &database.url])
        .env("SORTIE_KEYRING_KEY", OTHER_KEY)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let exit = sortie_testkit::wait::eventually("the mismatched replica exits", Duration::from_secs(30), || {
        let status = refused.try_wait();
        async move {
            match status {
                Ok(Some(status)) => Ok(status),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let said = refused.wait_with_output().expect("output");
    assert!(!exit.success(), "a replica with another master key started");
    let stderr = String::from_utf8_lossy(&said.stderr);
    assert!(stderr.contains("SORTIE_KEYRING_KEY"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&said.stdout).contains(LISTENING),
        "it never listened"
    );

    // The worker's own metrics and health, on its feed listener (it serves no api).
    let health = client
        .http
        .get(format!("{}/healthz", worker.url))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);

    // The agent speaks, then waits for a file the test makes in its home, then speaks again.
    let script = "#!scripted\nsay: before the kill\nrun: i=0; while [ ! -e \"$HOME/go-on\" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; echo waited $i\nsay: after the kill\nwrite: replicas.txt\nran on a worker of its own\n>>>";
    let (status, created) = client
        .call(
            &api_a,
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"repo": upstream, "task": script, "agent": "scripted"})),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().expect("id").to_owned();

    // Attached to replica A: the part comes while the turn runs (the agent waits for the file), so it
    // came live from the worker's feed: a gateway with no route to it would wait for the turn's end.
    let mut at_a = client.attach(&api_a, &id, None).await;
    let before = at_a.until("before the kill").await;
    let (_, turns) = client
        .call(&api_b, reqwest::Method::GET, &format!("/v1/sessions/{id}/turns"), None)
        .await;
    assert_eq!(turns["turns"][0]["status"], "running", "{turns:#}");
    let last_seen = before.iter().filter_map(|e| e.id).max().expect("events have ids");

    // The worker's feed answers only a gateway's token for that turn.
    let bare = client
        .http
        .get(format!("{}/sessions/{id}/turns/1/stream", worker.url))
        .send()
        .await
        .expect("feed");
    assert_eq!(bare.status(), 401);
    let forged = client
        .http
        .get(format!("{}/sessions/{id}/turns/1/stream", worker.url))
        .header("authorization", "Feed 99999999999.AAAA")
        .send()
        .await
        .expect("feed");
    assert_eq!(forged.status(), 401);

    // Replica A dies; the client goes on at replica B after the last part it had.
    drop(at_a);
    api_a.kill_hard();
    let mut at_b = client.attach(&api_b, &id, Some(last_seen)).await;
    let go_on = root.join("worker/work/sessions").join(&id).join("disk/home/go-on");
    std::fs::write(&go_on, "").expect("let the agent go on");
    let mut after = Vec::new();
    while let Some(event) = at_b.next().await {
        after.push(event);
    }
    assert_eq!(after.last().map(|e| e.data.as_str()), Some("[DONE]"), "{after:#?}");
    let first_after = after.iter().find_map(|e| e.id).expect("parts after the kill");
    assert_eq!(first_after, last_seen + 1, "no part lost or repeated across replicas");
    assert!(after.iter().any(|e| e.data.contains("after the kill")), "{after:#?}");

    // What the two connections saw, together, is the transcript: a third client reading it whole at B
    // gets the same parts in the same order.
    sortie_testkit::wait::eventually("the session rests", Duration::from_secs(60), || async {
        let (_, session) = client
            .call(&api_b, reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
            .await;
        if session["phase"] == "idle" {
            Ok(())
        } else {
            Err(session)
        }
    })
    .await;
    let mut whole = client.attach(&api_b, &id, None).await;
    let mut stored = Vec::new();
    while let Some(event) = whole.next().await {
        stored.push(event);
    }
    let live: Vec<Event> = before.into_iter().chain(after).collect();
    assert_eq!(live, stored, "the live tail across replicas is the stored transcript");
    let branch = support::world::rev(&upstream, &format!("refs/heads/sortie/{id}"));
    assert!(branch.is_some(), "the worker delivered the branch");

    // Metrics per role: the worker's show its turns' feed routed to a gateway.
    let metrics = client
        .http
        .get(format!("{}/metrics", worker.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(metrics.contains("sortie_feed_refused_total"), "{metrics}");
    drop(api_b);
    drop(worker);
}
