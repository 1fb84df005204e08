//! A whole `sortie serve` with every role, a bare repository and an operator's token: the world the
//! end-to-end tests drive through the API as a client would.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use super::{Server, git, http_client};

pub use sortie_testkit::git::rev;

/// Session ids of the `sortie driver` processes alive on this machine (one per live sandbox).
pub fn live_sandboxes() -> HashSet<String> {
    let mut found = HashSet::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a == "driver")
            && let Some(at) = args.iter().position(|a| a == "--session")
            && let Some(id) = args.get(at + 1)
        {
            found.insert(id.clone());
        }
    }
    found
}

/// Whether any process is left in the sandbox cgroup of `session` (v1 or v2), whatever it runs.
pub fn cgroup_has_processes(session: &str) -> bool {
    ["/sys/fs/cgroup/pids/sortie", "/sys/fs/cgroup/sortie"]
        .iter()
        .filter_map(|parent| std::fs::read_to_string(Path::new(parent).join(session).join("cgroup.procs")).ok())
        .any(|procs| procs.lines().any(|line| !line.trim().is_empty()))
}

pub fn driver_pid(session: &str) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_driver =
            args.first().is_some_and(|a| a.ends_with("sortie")) && args.get(1).is_some_and(|a| a == "driver");
        if is_driver && args.windows(2).any(|w| w[0] == "--session" && w[1] == session) {
            return entry.file_name().to_string_lossy().parse().ok();
        }
    }
    None
}

pub struct World {
    pub _temp: tempfile::TempDir,
    pub root: PathBuf,
    pub upstream: PathBuf,
    pub data_dir: PathBuf,
    pub server: Option<Server>,
    pub extra: Vec<String>,
    /// Environment of the server, besides the test's own.
    pub environment: Vec<(String, String)>,
    pub database_url: Option<String>,
    pub token: String,
    pub http: reqwest::Client,
}

impl World {
    pub fn start(extra: &[&str]) -> World {
        Self::start_on(extra, None)
    }

    pub fn start_on(extra: &[&str], database: Option<&sortie_store::testing::TestDatabase>) -> World {
        Self::start_with_env(extra, &[], database)
    }

    pub fn start_with_env(
        extra: &[&str],
        environment: &[(&str, &str)],
        database: Option<&sortie_store::testing::TestDatabase>,
    ) -> World {
        let temp = tempfile::tempdir().expect("temp");
        std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let root = temp.path().to_owned();
        let upstream = super::upstream_with_main(&root);
        let data_dir = root.join("data");
        let database_url = database.map(|d| d.url.clone());
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let args: Vec<&str> = extra.iter().map(String::as_str).collect();
        let server = Server::start_announcing(
            &root,
            &data_dir,
            database_url.as_deref(),
            &args,
            environment,
            super::LISTENING,
        );
        let token = match &database_url {
            None => std::fs::read_to_string(data_dir.join("admin-token"))
                .expect("admin token")
                .trim()
                .to_owned(),
            Some(url) => super::operator_token_on(&root, url),
        };
        World {
            _temp: temp,
            root,
            upstream,
            data_dir,
            server: Some(server),
            extra,
            environment: environment
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            database_url,
            token,
            http: http_client(),
        }
    }

    pub fn url(&self) -> String {
        self.server.as_ref().expect("server").url.clone()
    }

    pub fn kill_server(&mut self) {
        if let Some(server) = self.server.take() {
            server.kill_hard();
        }
    }

    pub fn restart_server(&mut self) {
        let args: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let environment: Vec<(&str, &str)> = self.environment.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.server = Some(Server::start_announcing(
            &self.root,
            &self.data_dir,
            self.database_url.as_deref(),
            &args,
            &environment,
            super::LISTENING,
        ));
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url()))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub async fn create(&self, task: &str, extra: Value) -> String {
        let mut body = json!({"repo": self.upstream, "task": task, "agent": "scripted"});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            for (key, value) in extra {
                body.insert(key.clone(), value.clone());
            }
        }
        let (status, created) = self.call(reqwest::Method::POST, "/v1/sessions", Some(body)).await;
        assert_eq!(status, 202, "{created}");
        created["id"].as_str().expect("id").to_owned()
    }

    pub async fn session(&self, id: &str) -> Value {
        let (status, session) = self
            .call(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
            .await;
        assert_eq!(status, 200, "{session}");
        session
    }

    pub async fn turns(&self, id: &str) -> Vec<Value> {
        let (_, turns) = self
            .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/turns"), None)
            .await;
        turns["turns"].as_array().cloned().unwrap_or_default()
    }

    pub async fn steer(&self, id: &str, prompt: &str, mode: &str) {
        let (status, body) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/steer"),
                Some(json!({"prompt": prompt, "mode": mode})),
            )
            .await;
        assert_eq!(status, 202, "{body}");
    }

    pub async fn post(&self, id: &str, action: &str) {
        let (status, body) = self
            .call(reqwest::Method::POST, &format!("/v1/sessions/{id}/{action}"), None)
            .await;
        assert_eq!(status, 202, "{action}: {body}");
    }

    /// Polls the session until `done` holds (or panics at the deadline with what it last saw).
    pub async fn wait(&self, id: &str, seconds: u64, done: impl Fn(&Value, &[Value]) -> bool) -> (Value, Vec<Value>) {
        let done = &done;
        sortie_testkit::wait::eventually(
            &format!("session {id} gets there"),
            Duration::from_secs(seconds),
            move || async move {
                let session = self.session(id).await;
                let turns = self.turns(id).await;
                if done(&session, &turns) {
                    Ok((session, turns))
                } else {
                    Err((session, turns))
                }
            },
        )
        .await
    }

    /// Waits until turn `n` ended and the session rests (`idle`, `failed`, `canceled`).
    pub async fn settled(&self, id: &str, n: usize) -> (Value, Vec<Value>) {
        self.wait(id, 60, |session, turns| {
            turns.len() >= n
                && turns[n - 1]["completed_at"].is_string()
                && ["idle", "failed", "canceled", "hibernated"].contains(&session["phase"].as_str().unwrap_or(""))
        })
        .await
    }

    /// Whether an assistant message (not a prompt) of the session says `text`.
    pub async fn assistant_said(&self, id: &str, text: &str) -> bool {
        self.messages(id)
            .await
            .iter()
            .filter(|m| m["role"] == "assistant")
            .any(|m| m["parts"].to_string().contains(text))
    }

    pub async fn wait_said(&self, id: &str, text: &str) {
        let what = format!("the agent says {text:?}");
        sortie_testkit::wait::eventually(&what, Duration::from_secs(30), move || async move {
            self.assistant_said(id, text).await.then_some(()).ok_or("not yet")
        })
        .await;
    }

    pub async fn messages(&self, id: &str) -> Vec<Value> {
        let (status, messages) = self
            .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/messages"), None)
            .await;
        assert_eq!(status, 200, "{messages}");
        messages.as_array().cloned().unwrap_or_default()
    }

    /// Attaches with a fresh ticket and reads the stream to `[DONE]`: the chunks, in order.
    pub async fn attach(&self, id: &str, turn: Option<u32>) -> Vec<Value> {
        let (status, ticket) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/attach-ticket"),
                Some(json!({"action": "attach"})),
            )
            .await;
        assert_eq!(status, 201, "{ticket}");
        let query = turn.map(|n| format!("?turn={n}")).unwrap_or_default();
        let response = self
            .http
            .get(format!("{}/v1/sessions/{id}/stream{query}", self.url()))
            .header(
                "authorization",
                format!("Ticket {}", ticket["ticket"].as_str().expect("ticket")),
            )
            .send()
            .await
            .expect("attach");
        assert_eq!(response.status(), 200);
        let body = tokio::time::timeout(Duration::from_secs(60), response.text())
            .await
            .expect("the stream ends")
            .expect("body");
        let mut chunks = Vec::new();
        let mut done = false;
        for event in body.split("\n\n") {
            for line in event.lines() {
                if let Some(data) = line.strip_prefix("data: ") {
                    if data == "[DONE]" {
                        done = true;
                    } else {
                        chunks.push(serde_json::from_str::<Value>(data).expect("chunk json"));
                    }
                }
            }
        }
        assert!(done, "the stream ends with [DONE]");
        chunks
    }

    pub fn branch(&self, id: &str) -> Option<String> {
        rev(&self.upstream, &format!("refs/heads/sortie/{id}"))
    }

    /// A working clone of the upstream under the world's root, as someone else would have one.
    pub fn clone_upstream(&self, name: &str) -> PathBuf {
        let dir = self.root.join(name);
        git(
            &self.root,
            &[
                "clone",
                "-q",
                self.upstream.to_str().expect("utf-8"),
                dir.to_str().expect("utf-8"),
            ],
        );
        dir
    }

    pub fn files_on_branch(&self, id: &str) -> Vec<String> {
        let listed = git(
            &self.upstream,
            &[
                "diff",
                "--name-only",
                "refs/heads/main",
                &format!("refs/heads/sortie/{id}"),
            ],
        );
        listed.lines().map(ToOwned::to_owned).collect()
    }

    pub fn commits_on_branch(&self, id: &str) -> usize {
        git(
            &self.upstream,
            &[
                "rev-list",
                "--count",
                &format!("refs/heads/main..refs/heads/sortie/{id}"),
            ],
        )
        .parse()
        .expect("count")
    }
}
