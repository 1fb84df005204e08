//! The delivery's own push (`sortie_driver::push`) against the real receive-pack: a local HTTP server
//! that runs `git http-backend` for a bare repository, as the git proxy does on the host (without the
//! proxy's checks, which `sortie/tests/worker.rs` and `attacks.rs` cover through a real sandbox).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use sortie_driver::delivery::Git;
use sortie_driver::push::{Update, push, relay_path};
use sortie_testkit::git::{git, rev};

/// `git http-backend` as a CGI under `root`, for any path.
async fn backend(State(root): State<PathBuf>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body: Bytes = axum::body::to_bytes(body, 64 << 20).await.expect("request body");
    let content_type = parts
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut child = tokio::process::Command::new("git")
        .args(["-c", "http.receivepack=true", "http-backend"])
        .env("GIT_PROJECT_ROOT", &root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("PATH_INFO", parts.uri.path())
        .env("QUERY_STRING", parts.uri.query().unwrap_or_default())
        .env("REQUEST_METHOD", parts.method.as_str())
        .env("CONTENT_TYPE", content_type)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // A refused update is said in the answer too; git's own words would only be noise here.
        .stderr(Stdio::null())
        .spawn()
        .expect("git http-backend");
    let mut stdin = child.stdin.take().expect("stdin");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, &body)
        .await
        .expect("to the backend");
    drop(stdin);
    let output = child.wait_with_output().await.expect("the backend's answer");
    let split = output
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| (at, 4))
        .or_else(|| output.stdout.windows(2).position(|w| w == b"\n\n").map(|at| (at, 2)))
        .expect("CGI headers");
    let mut status = StatusCode::OK;
    let mut headers = HeaderMap::new();
    for line in String::from_utf8_lossy(&output.stdout[..split.0]).lines() {
        if let Some((name, value)) = line.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("status") {
                status = value[..3]
                    .parse()
                    .map(StatusCode::from_u16)
                    .expect("status")
                    .expect("code");
            } else if let (Ok(name), Ok(value)) = (
                axum::http::HeaderName::try_from(name.trim()),
                HeaderValue::from_str(value),
            ) {
                headers.insert(name, value);
            }
        }
    }
    let mut response = Response::new(Body::from(output.stdout[split.0 + split.1..].to_vec()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

struct World {
    _temp: tempfile::TempDir,
    remote: PathBuf,
    work: PathBuf,
    address: SocketAddr,
    start: String,
}

impl World {
    async fn new() -> Self {
        let temp = tempfile::tempdir().expect("temp");
        let seed = temp.path().join("seed");
        std::fs::create_dir_all(&seed).expect("seed");
        git(&seed, &["init", "-q"]);
        std::fs::write(seed.join("README.md"), "start\n").expect("write");
        git(&seed, &["add", "."]);
        git(&seed, &["commit", "-q", "-m", "start"]);
        let start = git(&seed, &["rev-parse", "HEAD"]);
        git(temp.path(), &["clone", "-q", "--bare", "seed", "remote.git"]);
        git(temp.path(), &["clone", "-q", "remote.git", "work"]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().fallback(backend).with_state(temp.path().to_owned());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            remote: temp.path().join("remote.git"),
            work: temp.path().join("work"),
            _temp: temp,
            address,
            start,
        }
    }

    fn git(&self) -> Git {
        Git {
            workspace: self.work.clone(),
            env: vec![("PATH".into(), std::env::var("PATH").unwrap_or_default())],
            timeout: Duration::from_secs(60),
        }
    }

    fn commit(&self, file: &str) -> String {
        std::fs::write(self.work.join(file), format!("{file}\n")).expect("write");
        git(&self.work, &["add", "."]);
        git(&self.work, &["commit", "-q", "-m", file]);
        git(&self.work, &["rev-parse", "HEAD"])
    }

    fn remote_branch(&self) -> Option<String> {
        rev(&self.remote, BRANCH)
    }
}

const BRANCH: &str = "refs/heads/sortie/ses_1";

#[tokio::test]
async fn a_push_lands_with_its_lease_and_a_stale_lease_changes_nothing() {
    let world = World::new().await;
    let relay = world.address.to_string();
    let url = format!("http://{relay}/remote.git");
    let path = relay_path(&url, &relay).expect("a path on the relay");
    let haves = [world.start.as_str()];

    let first = world.commit("one.txt");
    let update = Update {
        refname: BRANCH,
        new: &first,
        old: None,
        haves: &haves,
    };
    push(&world.git(), &relay, path, &update, Duration::from_secs(60))
        .await
        .expect("the first push lands");
    assert_eq!(world.remote_branch().as_deref(), Some(first.as_str()));
    assert_eq!(git(&world.remote, &["show", &format!("{first}:one.txt")]), "one.txt");

    // On top of the last delivery, which the pack leaves out.
    let second = world.commit("two.txt");
    let update = Update {
        refname: BRANCH,
        new: &second,
        old: Some(&first),
        haves: &haves,
    };
    push(&world.git(), &relay, path, &update, Duration::from_secs(60))
        .await
        .expect("the second push lands");
    assert_eq!(world.remote_branch().as_deref(), Some(second.as_str()));

    // A lease the remote no longer matches: refused, and the branch stays.
    let third = world.commit("three.txt");
    for stale in [None, Some(first.as_str())] {
        let update = Update {
            refname: BRANCH,
            new: &third,
            old: stale,
            haves: &haves,
        };
        let refused = push(&world.git(), &relay, path, &update, Duration::from_secs(60)).await;
        assert!(refused.is_err(), "a stale lease {stale:?} must not land");
        assert_eq!(world.remote_branch().as_deref(), Some(second.as_str()));
    }
}

#[tokio::test]
async fn nothing_answering_or_a_missing_repository_is_an_error_not_a_delivery() {
    let world = World::new().await;
    let head = world.commit("one.txt");
    let haves = [world.start.as_str()];
    let update = Update {
        refname: BRANCH,
        new: &head,
        old: None,
        haves: &haves,
    };
    let relay = world.address.to_string();
    let missing = push(&world.git(), &relay, "/nowhere.git", &update, Duration::from_secs(60)).await;
    assert!(missing.is_err(), "{missing:?}");
    // A port nothing listens on: bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("address")
        .to_string();
    let unreachable = push(&world.git(), &closed, "/remote.git", &update, Duration::from_secs(60)).await;
    assert!(unreachable.is_err(), "{unreachable:?}");
    assert_eq!(world.remote_branch(), None);
}
