//! The git proxy with the real `git` client: clone, fetch and pushes of the session's own branch go
//! through; every other push is refused whole, `git push` prints why, and the upstream is unchanged.
//! Forges get the credential (over plain HTTP and over real TLS with a certificate made here), and
//! a forge whose certificate is not trusted is a 502 with nothing of the forge's in it.
//!
//! The trust boundary (issue 15): a push holding a secret is refused at the proxy however the pushing
//! repository is configured (S7); a repository owned by another user is served as that user, with
//! its hooks never run (S5); one session cannot make the proxy run more than a few git processes,
//! all in its cgroup (S6); and the proxy's ledger records what the upstream really did with a push.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sortie_gateway::git::config::{
    GitProxyConfig, KnownSecretsSource, NoKnownSecrets, PushOutcome, PushRecord, PushRecords,
};
use sortie_gateway::git::http::{ForgeTls, Upstream, Upstreams, forge_client, router};
use sortie_gateway::git::pktline;
use sortie_protocol::SessionId;
use sortie_secrets::KnownSecrets;
use sortie_testkit::forge::{make_certificates, serve_https as https_forge};

/// An AWS access key id's format (the review's S7 proof used it).
const AWS_KEY: &str = "AKIAZQ3DRSTUVWXY2345";

struct OneRepo {
    session: SessionId,
    path: PathBuf,
}

impl Upstreams for OneRepo {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.session).then(|| Upstream::Local(self.path.clone()))
    }
}

/// The workspace's secret values, as the worker hands them to the proxy.
struct Values(Vec<&'static str>);

#[async_trait]
impl KnownSecretsSource for Values {
    async fn known_secrets(&self) -> KnownSecrets {
        KnownSecrets::from_values(self.0.iter().map(|v| v.as_bytes()))
    }
}

/// A served proxy: its base URL and its ledger.
struct Proxy {
    base: String,
    ledger: Arc<PushRecords>,
}

/// A proxy config for `upstreams` keeping its state under `state` (the ledger is a [`PushRecords`]).
fn config_for(upstreams: Arc<dyn Upstreams>, state: &Path) -> (GitProxyConfig, Arc<PushRecords>) {
    let ledger = Arc::new(PushRecords::default());
    let config = GitProxyConfig::new(
        upstreams,
        PathBuf::from("git"),
        state,
        ledger.clone(),
        Arc::new(NoKnownSecrets),
    );
    (config, ledger)
}

/// Serves a git proxy over plain HTTP, as the sandbox reaches it.
async fn serve(config: GitProxyConfig, ledger: Arc<PushRecords>) -> Proxy {
    let app = router(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Proxy { base, ledger }
}

struct Setup {
    _temp: tempfile::TempDir,
    root: PathBuf,
    session: SessionId,
    upstream: PathBuf,
    url: String,
    base: String,
    ledger: Arc<PushRecords>,
}

/// The test's git as the agent runs it: `HOME` is the agent's.
fn git(dir: &Path, home: &Path, args: &[&str]) -> Output {
    sortie_testkit::git::command(dir)
        .env("HOME", home)
        .args(args)
        .output()
        .expect("git")
}

fn ok(output: Output) -> Output {
    sortie_testkit::git::assert_ok(&[], &output);
    output
}

fn rev(dir: &Path, home: &Path, spec: &str) -> Option<String> {
    let output = git(dir, home, &["rev-parse", "--verify", "--quiet", spec]);
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// A bare upstream with one commit on `main` under `root`.
fn make_upstream(root: &Path) -> PathBuf {
    sortie_testkit::git::bare_with_main(root, "upstream.git")
}

async fn setup() -> Setup {
    setup_with(|_| {}).await
}

/// A local upstream and a proxy for one session, its config adjusted by `adjust`.
async fn setup_with(adjust: impl FnOnce(&mut GitProxyConfig)) -> Setup {
    let temp = tempfile::tempdir().expect("temp");
    let root = temp.path().to_owned();
    let upstream = make_upstream(&root);
    let session = SessionId::generate();
    let upstreams = Arc::new(OneRepo {
        session: session.clone(),
        path: upstream.clone(),
    });
    let (mut config, ledger) = config_for(upstreams, &root.join("proxy-state"));
    adjust(&mut config);
    let proxy = serve(config, ledger).await;
    let url = format!("{}/_sortie/git/{session}.git", proxy.base);
    Setup {
        _temp: temp,
        root,
        session,
        upstream,
        url,
        base: proxy.base,
        ledger: proxy.ledger,
    }
}

fn clone(setup: &Setup) -> PathBuf {
    let work = setup.root.join("work");
    ok(git(
        &setup.root,
        &setup.root,
        &["clone", "-q", &setup.url, work.to_str().expect("utf-8")],
    ));
    work
}

fn commit(work: &Path, home: &Path, file: &str, content: &[u8]) {
    std::fs::write(work.join(file), content).expect("write");
    ok(git(work, home, &["add", "."]));
    ok(git(work, home, &["commit", "-q", "-m", file]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_fetch_and_the_sessions_own_pushes_go_through() {
    let setup = setup().await;
    let work = clone(&setup);
    assert_eq!(
        std::fs::read_to_string(work.join("README.md")).expect("cloned"),
        "hello\n"
    );
    let own = format!("refs/heads/sortie/{}", setup.session);
    commit(&work, &setup.root, "a.txt", b"a\n");
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("HEAD:{own}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));

    // A rewritten history, force-pushed.
    ok(git(&work, &setup.root, &["commit", "-q", "--amend", "-m", "rewritten"]));
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "--force", "origin", &format!("HEAD:{own}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));

    // Over 1 MiB: git probes with `0000`, then sends the pack chunked.
    let big: Vec<u8> = (0..3 * 1024 * 1024_u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    commit(&work, &setup.root, "big.bin", &big);
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("HEAD:{own}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
    ok(git(&work, &setup.root, &["fetch", "-q", "origin"]));
    let records = setup.ledger.records();
    assert_eq!(records.len(), 3, "{records:#?}");
    assert!(records.iter().all(|r| r.outcome == PushOutcome::Accepted));
    assert_eq!(
        setup.ledger.last_accepted().and_then(|r| r.update).map(|u| u.new),
        rev(&work, &setup.root, "HEAD")
    );
}

fn packs(repo: &Path) -> usize {
    std::fs::read_dir(repo.join("objects/pack")).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "pack"))
            .count()
    })
}

/// The repository's automatic maintenance, which receive-pack would run before its answer ends, runs
/// after the push is answered: a repository set to repack past one pack is repacked once pushes have
/// left it more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_repositorys_maintenance_still_runs_after_a_push() {
    let setup = setup().await;
    // Each push kept as a pack; maintenance's gc repacks past one.
    for (key, value) in [("receive.unpackLimit", "1"), ("gc.autoPackLimit", "1")] {
        ok(git(&setup.upstream, &setup.root, &["config", key, value]));
    }
    let work = clone(&setup);
    let own = format!("refs/heads/sortie/{}", setup.session);
    for file in ["a.txt", "b.txt"] {
        commit(&work, &setup.root, file, file.as_bytes());
        ok(git(
            &work,
            &setup.root,
            &["push", "-q", "origin", &format!("HEAD:{own}")],
        ));
    }
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while packs(&setup.upstream) > 1 {
        assert!(
            Instant::now() < deadline,
            "the upstream was never repacked: {} packs",
            packs(&setup.upstream)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
}

/// The session's WIP ref (where a pod keeps what a failed delivery could not push) may be pushed,
/// forced and deleted by that session; another session's may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_own_wip_ref_may_be_kept_rewritten_and_deleted() {
    let setup = setup().await;
    let work = clone(&setup);
    let wip = setup.session.wip_ref();
    commit(&work, &setup.root, "w.txt", b"kept\n");
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("HEAD:{wip}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &wip), rev(&work, &setup.root, "HEAD"));
    ok(git(&work, &setup.root, &["commit", "-q", "--amend", "-m", "rewritten"]));
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("+HEAD:{wip}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &wip), rev(&work, &setup.root, "HEAD"));
    // A fresh clone fetches it by name.
    let other = setup.root.join("other");
    ok(git(
        &setup.root,
        &setup.root,
        &["clone", "-q", &setup.url, other.to_str().expect("utf-8")],
    ));
    ok(git(&other, &setup.root, &["fetch", "-q", "origin", &wip]));
    assert_eq!(rev(&other, &setup.root, "FETCH_HEAD"), rev(&work, &setup.root, "HEAD"));

    let foreign = sortie_protocol::ids::wip_ref("ses_01jd8x3k4m5n6p7q8r9s0t1v2w");
    let refused = git(&work, &setup.root, &["push", "origin", &format!("HEAD:{foreign}")]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("may not be pushed"));
    assert_eq!(rev(&setup.upstream, &setup.root, &foreign), None);

    ok(git(&work, &setup.root, &["push", "-q", "origin", &format!(":{wip}")]));
    assert_eq!(rev(&setup.upstream, &setup.root, &wip), None);
    let outcomes: Vec<(String, &str)> = setup
        .ledger
        .records()
        .iter()
        .filter_map(|r| r.update.as_ref().map(|u| (u.new.clone(), r.outcome.as_str())))
        .collect();
    assert_eq!(outcomes.len(), 4, "{outcomes:?}");
    assert_eq!(outcomes[2].1, "refused");
    assert_eq!(
        outcomes[3],
        ("0".repeat(40), "accepted"),
        "the delete is recorded as taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_other_push_is_refused_whole_and_git_says_why() {
    let setup = setup().await;
    let work = clone(&setup);
    let own = format!("refs/heads/sortie/{}", setup.session);
    commit(&work, &setup.root, "b.txt", b"b\n");
    ok(git(&work, &setup.root, &["tag", "v1"]));
    let main_before = rev(&setup.upstream, &setup.root, "refs/heads/main");
    let other = "refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
    for refspecs in [
        vec!["HEAD:refs/heads/main".to_owned()],
        vec![format!("HEAD:{other}")],
        vec![format!("HEAD:{own}x")],
        vec!["refs/tags/v1".to_owned()],
        vec![format!("HEAD:{own}"), "HEAD:refs/heads/main".to_owned()],
    ] {
        let mut args = vec!["push", "origin"];
        args.extend(refspecs.iter().map(String::as_str));
        let output = git(&work, &setup.root, &args);
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{refspecs:?} went through");
        assert!(
            said.contains("sortie: push refused") && said.contains("[remote rejected]"),
            "{refspecs:?}: {said}"
        );
    }
    assert_eq!(
        rev(&setup.upstream, &setup.root, "refs/heads/main"),
        main_before,
        "main unchanged"
    );
    assert_eq!(
        rev(&setup.upstream, &setup.root, &own),
        None,
        "the own branch of a refused multi-ref push was not created"
    );
    assert_eq!(rev(&setup.upstream, &setup.root, "refs/tags/v1"), None);

    // Deleting the session's branch is refused too.
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("HEAD:{own}")],
    ));
    let delete = git(&work, &setup.root, &["push", "origin", &format!(":{own}")]);
    assert!(!delete.status.success() && String::from_utf8_lossy(&delete.stderr).contains("may not be deleted"));
    assert!(rev(&setup.upstream, &setup.root, &own).is_some());
    // Each refused push is in the ledger, every command of it refused; only the own push was taken.
    let records = setup.ledger.records();
    let refused: Vec<&PushRecord> = records
        .iter()
        .filter(|r| matches!(r.outcome, PushOutcome::Refused { .. }))
        .collect();
    assert_eq!(refused.len(), 1 + 1 + 1 + 1 + 2 + 1, "{records:#?}");
    assert_eq!(records.len(), refused.len() + 1);
    assert!(
        refused
            .iter()
            .any(|r| r.update.as_ref().is_some_and(|u| u.refname == "refs/tags/v1"))
    );
}

/// POSTs a hand-made receive-pack request to the repository at `url`; the status and the answer.
async fn post_receive_pack(url: &str, body: Vec<u8>) -> (u16, String) {
    let client = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    };
    let reply = client
        .post(format!("{url}/git-receive-pack"))
        .header("content-type", "application/x-git-receive-pack-request")
        .body(body)
        .send()
        .await
        .expect("post");
    let status = reply.status().as_u16();
    (
        status,
        String::from_utf8_lossy(&reply.bytes().await.expect("body")).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_cert_block_naming_main_is_refused_raw() {
    let setup = setup().await;
    let main_before = rev(&setup.upstream, &setup.root, "refs/heads/main").expect("main");
    let zero = "0".repeat(40);
    let cert = format!(
        "push-cert\0 report-status side-band-64k\ncertificate version 0.1\npusher x 0 +0000\npushee {}\nnonce 1\n\n{main_before} {zero} refs/heads/main\npush-cert-end\n",
        setup.url
    );
    let mut body = pktline::encode(cert.as_bytes());
    body.extend_from_slice(pktline::FLUSH);
    let (status, answer) = post_receive_pack(&setup.url, body).await;
    assert_eq!(status, 200);
    assert!(answer.contains("push-cert"), "{answer}");
    assert_eq!(
        rev(&setup.upstream, &setup.root, "refs/heads/main").as_deref(),
        Some(main_before.as_str()),
        "main unchanged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_smart_http_of_known_sessions_is_served() {
    let setup = setup().await;
    let client = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    };
    let status = |path: String| {
        let client = client.clone();
        async move { client.get(path).send().await.expect("get").status().as_u16() }
    };
    assert_eq!(
        status(format!(
            "{}/_sortie/git/{}.git/info/refs?service=git-upload-pack",
            setup.base,
            SessionId::generate()
        ))
        .await,
        404
    );
    assert_eq!(
        status(format!(
            "{}/_sortie/git/not-a-session.git/info/refs?service=git-upload-pack",
            setup.base
        ))
        .await,
        404
    );
    assert_eq!(
        status(format!("{}/info/refs", setup.url)).await,
        403,
        "no dumb ref listing"
    );
    assert_eq!(status(format!("{}/HEAD", setup.url)).await, 404, "no dumb files");
    assert_eq!(status(format!("{}/objects/info/packs", setup.url)).await, 404);
    assert_eq!(
        status(format!("{}/info/refs?service=git-receive-pack", setup.url)).await,
        200
    );
}

/// Maps one session to a forge URL with a token.
struct Forge(SessionId, String, String);

impl Upstreams for Forge {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.0).then(|| Upstream::Remote {
            url: self.1.clone(),
            token: self.2.clone(),
        })
    }
}

/// A fake forge: smart HTTP (the git router over a local repository) behind Basic auth, as GitHub
/// takes installation tokens (`x-access-token:<token>`). Answers 401 to anything else.
/// (The fake reuses sortie's own git router, so it serves the repository under the same session id
/// and confines pushes the same way a forge's branch protection would not; tests push the own branch.)
async fn fake_forge(
    upstream: PathBuf,
    token: &str,
    misbehaviour: Misbehaviour,
    session: &SessionId,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let (app, seen) = forge_app(upstream, token, misbehaviour, session);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!(
        "http://{}/_sortie/git/{session}.git",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// How the fake forge answers besides honestly.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Misbehaviour {
    None,
    /// Every request is redirected elsewhere.
    Redirect,
    /// Only the push itself (`POST …/git-receive-pack`) gets a 401, as after a token was revoked
    /// between the ref advertisement and the pack.
    RefusePushPost,
    /// Only the push itself is redirected.
    RedirectPushPost,
}

/// The fake forge's routes: every request recorded with whether it carried the credential.
fn forge_app(
    upstream: PathBuf,
    token: &str,
    misbehaviour: Misbehaviour,
    session: &SessionId,
) -> (axum::Router, Arc<std::sync::Mutex<Vec<String>>>) {
    use base64::Engine;
    let session = session.clone();
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"))
    );
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let record = seen.clone();
    let state = fresh_state(upstream.parent().expect("parent"));
    let (config, _) = config_for(
        Arc::new(OneRepo {
            session: session.clone(),
            path: upstream,
        }),
        &state,
    );
    let inner = router(config);
    let app = inner.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let expected = expected.clone();
            let record = record.clone();
            async move {
                let auth = request
                    .headers()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                record.lock().expect("lock").push(format!(
                    "{} {} auth={}",
                    request.method(),
                    request.uri(),
                    auth == expected
                ));
                let push_post =
                    request.method() == axum::http::Method::POST && request.uri().path().ends_with("/git-receive-pack");
                let redirect = misbehaviour == Misbehaviour::Redirect
                    || (push_post && misbehaviour == Misbehaviour::RedirectPushPost);
                if redirect {
                    return axum::response::Response::builder()
                        .status(302)
                        .header("location", "http://127.0.0.1:9/elsewhere")
                        .body(axum::body::Body::empty())
                        .expect("response");
                }
                if auth != expected || (push_post && misbehaviour == Misbehaviour::RefusePushPost) {
                    return axum::response::Response::builder()
                        .status(401)
                        .header("www-authenticate", "Basic realm=forge")
                        .body(axum::body::Body::empty())
                        .expect("response");
                }
                next.run(request).await
            }
        },
    ));
    (app, seen)
}

/// Clones `session`'s repository through the proxy at `base` into `work` (from and with `$HOME` at `root`).
fn clone_session(root: &Path, base: &str, session: &SessionId, work: &Path) {
    ok(git(
        root,
        root,
        &[
            "clone",
            &format!("{base}/_sortie/git/{session}.git"),
            work.to_str().expect("utf-8"),
        ],
    ));
}

/// A directory of its own under `root` for one proxy's state.
fn fresh_state(root: &Path) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    root.join(format!("proxy-state-{}", NEXT.fetch_add(1, Ordering::SeqCst)))
}

/// A proxy for forge sessions trusting `tls`'s roots (the platform's only by default), with
/// `mirror_objects` standing in for the session's mirror (where its pushes' parents are found).
async fn forge_proxy_with(upstreams: Arc<dyn Upstreams>, mirror_objects: &Path, tls: &ForgeTls) -> Proxy {
    let state = fresh_state(mirror_objects.parent().and_then(Path::parent).expect("root"));
    let (mut config, ledger) = config_for(upstreams, &state);
    config.forge_http = Some(forge_client(tls).expect("forge client"));
    config.trusted_object_dirs = vec![mirror_objects.to_owned()];
    serve(config, ledger).await
}

async fn proxy_for(upstreams: Arc<dyn Upstreams>, mirror_objects: &Path) -> String {
    forge_proxy_with(upstreams, mirror_objects, &ForgeTls::default())
        .await
        .base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forge_gets_the_credential_and_the_client_never_does() {
    let setup = setup().await;
    let token = "ghs_s3cr3t-installation-token";
    let session = SessionId::generate();
    let (forge_url, seen) = fake_forge(setup.upstream.clone(), token, Misbehaviour::None, &session).await;
    let base = proxy_for(
        Arc::new(Forge(session.clone(), forge_url, token.to_owned())),
        &setup.upstream.join("objects"),
    )
    .await;
    let url = format!("{base}/_sortie/git/{session}.git");
    let work = setup.root.join("forge-work");
    let cloned = ok(git(
        &setup.root,
        &setup.root,
        &["clone", &url, work.to_str().expect("utf-8")],
    ));
    let own = format!("refs/heads/sortie/{session}");
    commit(&work, &setup.root, "f.txt", b"f\n");
    let pushed = ok(git(&work, &setup.root, &["push", "origin", &format!("HEAD:{own}")]));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
    let refused = git(&work, &setup.root, &["push", "origin", "HEAD:refs/heads/main"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("sortie: push refused"));
    let requests = seen.lock().expect("lock").clone();
    assert!(
        !requests.is_empty() && requests.iter().all(|r| r.ends_with("auth=true")),
        "the forge saw the credential every time: {requests:?}"
    );
    let config = std::fs::read_to_string(work.join(".git/config")).expect("config");
    for text in [
        config,
        String::from_utf8_lossy(&cloned.stderr).into_owned(),
        String::from_utf8_lossy(&pushed.stderr).into_owned(),
    ] {
        assert!(!text.contains(token) && !text.contains("x-access-token"), "{text}");
    }
}

/// A forge credential that runs out (a GitHub App's installation token): whoever holds it mints another.
struct Rotating {
    session: SessionId,
    url: String,
    current: std::sync::Mutex<String>,
    fresh: String,
    refreshes: AtomicUsize,
}

impl Upstreams for Rotating {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.session).then(|| Upstream::Remote {
            url: self.url.clone(),
            token: self.current.lock().expect("lock").clone(),
        })
    }

    fn refresh<'a>(
        &'a self,
        session_id: &'a SessionId,
        _refused: &'a Upstream,
    ) -> futures::future::BoxFuture<'a, Option<Upstream>> {
        Box::pin(async move {
            self.refreshes.fetch_add(1, Ordering::SeqCst);
            *self.current.lock().expect("lock") = self.fresh.clone();
            self.upstream(session_id)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_the_forge_refuses_is_refreshed_once_and_the_fetch_and_push_go_on_with_it() {
    let setup = setup().await;
    let session = SessionId::generate();
    let (forge_url, seen) = fake_forge(setup.upstream.clone(), "ghs_minted_again", Misbehaviour::None, &session).await;
    let rotating = Arc::new(Rotating {
        session: session.clone(),
        url: forge_url,
        current: std::sync::Mutex::new("ghs_expired".into()),
        fresh: "ghs_minted_again".into(),
        refreshes: AtomicUsize::new(0),
    });
    let base = proxy_for(rotating.clone(), &setup.upstream.join("objects")).await;
    let work = setup.root.join("rotated");
    ok(git(
        &setup.root,
        &setup.root,
        &[
            "clone",
            &format!("{base}/_sortie/git/{session}.git"),
            work.to_str().expect("utf-8"),
        ],
    ));
    assert_eq!(rotating.refreshes.load(Ordering::SeqCst), 1);
    commit(&work, &setup.root, "r.txt", b"r\n");
    let own = format!("refs/heads/sortie/{session}");
    ok(git(&work, &setup.root, &["push", "origin", &format!("HEAD:{own}")]));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
    assert_eq!(rotating.refreshes.load(Ordering::SeqCst), 1, "the fresh one is kept");
    let requests = seen.lock().expect("lock").clone();
    assert_eq!(
        requests.iter().filter(|r| r.ends_with("auth=false")).count(),
        1,
        "only the first advertisement went with the old credential: {requests:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forge_that_refuses_or_redirects_is_not_relayed() {
    let setup = setup().await;
    let session = SessionId::generate();
    let (forge_url, _) = fake_forge(setup.upstream.clone(), "the-right-token", Misbehaviour::None, &session).await;
    let base = proxy_for(
        Arc::new(Forge(session.clone(), forge_url, "a-wrong-token".into())),
        &setup.upstream.join("objects"),
    )
    .await;
    let refused = git(
        &setup.root,
        &setup.root,
        &["clone", &format!("{base}/_sortie/git/{session}.git"), "nope"],
    );
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("upstream rejected the proxy's credentials"),
        "{said}"
    );
    assert!(
        !said.contains("Username"),
        "git must not be asked for a password: {said}"
    );

    let session = SessionId::generate();
    let (redirecting, _) = fake_forge(setup.upstream.clone(), "t", Misbehaviour::Redirect, &session).await;
    let base = proxy_for(
        Arc::new(Forge(session.clone(), redirecting, "t".into())),
        &setup.upstream.join("objects"),
    )
    .await;
    let redirected = git(
        &setup.root,
        &setup.root,
        &["clone", &format!("{base}/_sortie/git/{session}.git"), "nope2"],
    );
    let said = String::from_utf8_lossy(&redirected.stderr);
    assert!(
        !redirected.status.success() && said.contains("redirect; not followed"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_the_forge_refuses_or_redirects_is_not_relayed_and_changes_nothing() {
    let setup = setup().await;
    for (misbehaviour, says) in [
        (
            Misbehaviour::RefusePushPost,
            "upstream rejected the proxy's credentials",
        ),
        (Misbehaviour::RedirectPushPost, "redirect; not followed"),
    ] {
        let session = SessionId::generate();
        let (forge_url, seen) = fake_forge(setup.upstream.clone(), "t", misbehaviour, &session).await;
        let base = proxy_for(
            Arc::new(Forge(session.clone(), forge_url, "t".into())),
            &setup.upstream.join("objects"),
        )
        .await;
        let work = setup.root.join(format!("work-{session}"));
        clone_session(&setup.root, &base, &session, &work);
        commit(&work, &setup.root, "p.txt", b"p\n");
        let own = format!("refs/heads/sortie/{session}");
        let pushed = git(&work, &setup.root, &["push", "origin", &format!("HEAD:{own}")]);
        let said = String::from_utf8_lossy(&pushed.stderr);
        // A forge that answers before it has read the pack may close the connection while the proxy
        // still sends it: the proxy then sees a broken request, not the answer. Either way the push is
        // refused, said, and nothing of the forge's answer is relayed.
        let broken_off = said.contains("the repository's forge did not answer");
        assert!(
            !pushed.status.success() && (said.contains(says) || broken_off),
            "{said}"
        );
        assert!(!said.contains("Username") && !said.contains("elsewhere"), "{said}");
        assert_eq!(
            rev(&setup.upstream, &setup.root, &own),
            None,
            "the forge's branch is unchanged"
        );
        let requests = seen.lock().expect("lock").clone();
        assert!(
            requests
                .iter()
                .any(|r| r.starts_with("POST") && r.contains("git-receive-pack")),
            "the push reached the forge: {requests:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forge_over_tls_is_trusted_through_extra_roots_and_an_untrusted_one_is_a_502() {
    let setup = setup().await;
    let certificates = make_certificates(&setup.root.join("tls"));
    let token = "ghs_tls-installation-token";
    let session = SessionId::generate();
    let (app, seen) = forge_app(setup.upstream.clone(), token, Misbehaviour::None, &session);
    let (forge, failed_handshakes) = https_forge(app, &certificates).await;
    let upstreams = Arc::new(Forge(
        session.clone(),
        format!("https://{forge}/_sortie/git/{session}.git"),
        token.to_owned(),
    ));

    // Trusting the forge's CA: the real git client clones through the proxy over plain HTTP.
    let tls = ForgeTls {
        extra_roots_pem: certificates.ca_pem.clone(),
    };
    let base = forge_proxy_with(upstreams.clone(), &setup.upstream.join("objects"), &tls)
        .await
        .base;
    let work = setup.root.join("tls-work");
    clone_session(&setup.root, &base, &session, &work);
    assert_eq!(
        std::fs::read_to_string(work.join("README.md")).expect("cloned"),
        "hello\n"
    );
    let own = format!("refs/heads/sortie/{session}");
    commit(&work, &setup.root, "tls.txt", b"over tls\n");
    ok(git(
        &work,
        &setup.root,
        &["push", "-q", "origin", &format!("HEAD:{own}")],
    ));
    assert_eq!(rev(&setup.upstream, &setup.root, &own), rev(&work, &setup.root, "HEAD"));
    let requests = seen.lock().expect("lock").clone();
    for (method, route) in [
        ("GET ", "info/refs"),
        ("POST ", "git-upload-pack"),
        ("POST ", "git-receive-pack"),
    ] {
        assert!(
            requests.iter().any(|r| r.starts_with(method) && r.contains(route)),
            "{method}{route}: {requests:?}"
        );
    }
    assert!(requests.iter().all(|r| r.ends_with("auth=true")), "{requests:?}");
    assert_eq!(failed_handshakes.load(std::sync::atomic::Ordering::SeqCst), 0);

    // The platform's roots alone do not vouch for it: 502 with sortie's sentence, nothing of the forge's.
    let base = proxy_for(upstreams, &setup.upstream.join("objects")).await;
    let url = format!("{base}/_sortie/git/{session}.git");
    let refused = git(&setup.root, &setup.root, &["clone", &url, "untrusted"]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("certificate this gateway does not trust"),
        "{said}"
    );
    assert!(!setup.root.join("untrusted/README.md").exists());
    let client = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    };
    let reply = client
        .get(format!("{url}/info/refs?service=git-upload-pack"))
        .header("git-protocol", "version=2")
        .send()
        .await
        .expect("get");
    assert_eq!(reply.status().as_u16(), 502);
    assert_eq!(
        reply.headers().get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/plain")
    );
    assert_eq!(
        reply.text().await.expect("body"),
        "sortie: the repository's forge presented a certificate this gateway does not trust\n"
    );
    assert_eq!(
        seen.lock().expect("lock").len(),
        requests.len(),
        "no request reached the forge"
    );
    // The forge counts a refused handshake in its own task, after the client has already given up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while failed_handshakes.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the forge saw {} refused handshakes",
            failed_handshakes.load(std::sync::atomic::Ordering::SeqCst)
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }

    // Extra roots that are no certificate are refused when the forge client is built.
    let junk = ForgeTls {
        extra_roots_pem: b"not a certificate".to_vec(),
    };
    assert!(forge_client(&junk).is_err());
}

// ---------------------------------------------------------------------------------------------
// The trust boundary (issue 15): S7 secrets, the ledger, S5 foreign owners, S6 process bounds.
// ---------------------------------------------------------------------------------------------

/// Commits `files` (name, content) in `work`.
fn commit_files(work: &Path, home: &Path, files: &[(&str, &str)], message: &str) {
    for (name, content) in files {
        std::fs::write(work.join(name), content).expect("write");
    }
    ok(git(work, home, &["add", "-A"]));
    ok(git(work, home, &["commit", "-q", "-m", message]));
}

/// The ledger's records of `ledger` after the first `skip`.
fn records_after(ledger: &PushRecords, skip: usize) -> Vec<PushRecord> {
    ledger.records().into_iter().skip(skip).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_anywhere_in_pushed_history_is_refused_at_the_gateway_however_the_repository_is_configured() {
    let known_value = "correct-horse-battery-staple-42";
    let setup = setup_with(|config| config.known_secrets = Arc::new(Values(vec![known_value]))).await;
    let home = setup.root.as_path();
    let work = clone(&setup);
    let own = format!("refs/heads/sortie/{}", setup.session);
    let start = rev(&work, home, "HEAD").expect("head");
    let reset = || ok(git(&work, home, &["reset", "-q", "--hard", &start]));
    let refused = |says: &[&str]| {
        let before = setup.ledger.records().len();
        let head = rev(&work, home, "HEAD").expect("head");
        let output = git(&work, home, &["push", "origin", &format!("HEAD:{own}")]);
        let said = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(!output.status.success(), "the push went through: {said}");
        assert!(
            said.contains("sortie: push refused") && said.contains("[remote rejected]"),
            "{said}"
        );
        for text in says {
            assert!(said.contains(text), "{text:?} not in: {said}");
        }
        assert!(
            !said.contains(AWS_KEY) && !said.contains(known_value),
            "a refusal never shows the value: {said}"
        );
        assert_eq!(rev(&setup.upstream, home, &own), None, "nothing reached the upstream");
        let records = records_after(&setup.ledger, before);
        assert_eq!(records.len(), 1, "{records:?}");
        assert!(
            matches!(&records[0].outcome, PushOutcome::SecretDetected { reason } if !reason.contains(AWS_KEY)),
            "{records:?}"
        );
        assert_eq!(records[0].update.as_ref().map(|u| u.new.as_str()), Some(head.as_str()));
    };

    // A key in a new file.
    commit_files(
        &work,
        home,
        &[("creds.txt", &format!("aws_access_key_id = {AWS_KEY}\n"))],
        "creds",
    );
    refused(&["an AWS access key id in creds.txt"]);
    reset();

    // Hidden from a naive `git log -p` in the pushing repository by `* -diff`.
    commit_files(
        &work,
        home,
        &[(".gitattributes", "* -diff\n"), ("hidden.txt", &format!("{AWS_KEY}\n"))],
        "hidden",
    );
    let naive = ok(git(&work, home, &["log", "-p", "-1"]));
    assert!(
        !String::from_utf8_lossy(&naive.stdout).contains(AWS_KEY),
        "the attributes hide it locally"
    );
    refused(&["hidden.txt"]);
    reset();

    // Behind a textconv filter the pushing repository defines.
    ok(git(&work, home, &["config", "diff.hide.textconv", "true"]));
    commit_files(
        &work,
        home,
        &[
            (".gitattributes", "*.txt diff=hide\n"),
            ("converted.txt", &format!("{AWS_KEY}\n")),
        ],
        "converted",
    );
    let naive = ok(git(&work, home, &["log", "-p", "-1"]));
    assert!(
        !String::from_utf8_lossy(&naive.stdout).contains(AWS_KEY),
        "textconv hides it locally"
    );
    refused(&["converted.txt"]);
    reset();

    // In a file git takes for binary (a NUL byte), which a patch shows as "Binary files differ".
    commit_files(&work, home, &[("blob.bin", &format!("\0\x01{AWS_KEY}\0"))], "binary");
    refused(&["blob.bin"]);
    reset();

    // Added, then removed in a later commit of the same push: it is still in the pushed history.
    commit_files(&work, home, &[("creds.txt", &format!("{AWS_KEY}\n"))], "add a key");
    let leaking = rev(&work, home, "HEAD").expect("head");
    ok(git(&work, home, &["rm", "-q", "creds.txt"]));
    ok(git(&work, home, &["commit", "-q", "-m", "remove it again"]));
    refused(&["creds.txt", &format!("commit {}", &leaking[..12])]);
    reset();

    // A value the workspace knows (its model key), in no known format.
    commit_files(&work, home, &[("app.env", &format!("TOKEN={known_value}\n"))], "env");
    refused(&["a known secret value in app.env"]);
    reset();

    // In a commit message.
    std::fs::write(work.join("notes.md"), "notes\n").expect("write");
    ok(git(&work, home, &["add", "-A"]));
    ok(git(
        &work,
        home,
        &["commit", "-q", "-m", &format!("deploy with {AWS_KEY}")],
    ));
    refused(&["an AWS access key id in the commit object"]);
    reset();

    // A clean push goes through and is recorded as accepted.
    commit_files(&work, home, &[("clean.txt", "nothing to see\n")], "clean");
    ok(git(&work, home, &["push", "-q", "origin", &format!("HEAD:{own}")]));
    let head = rev(&work, home, "HEAD");
    assert_eq!(rev(&setup.upstream, home, &own), head);
    let accepted = setup.ledger.last_accepted().expect("an accepted push");
    assert_eq!(
        accepted.update.map(|u| (u.refname, Some(u.new))),
        Some((own.clone(), head))
    );
}

/// A local upstream whose branch is moved behind the proxy's back right before the `nth` request
/// from now reaches it (a concurrent update between `git push`'s ref advertisement and its pack).
struct Racing {
    session: SessionId,
    path: PathBuf,
    calls: AtomicUsize,
    move_at: AtomicUsize,
    moved_to: std::sync::Mutex<Option<(String, String)>>,
}

impl Racing {
    fn arm(&self, nth: usize, refname: &str, oid: &str) {
        *self.moved_to.lock().expect("lock") = Some((refname.to_owned(), oid.to_owned()));
        self.move_at
            .store(self.calls.load(Ordering::SeqCst) + nth, Ordering::SeqCst);
    }
}

impl Upstreams for Racing {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        if session_id != &self.session {
            return None;
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if call == self.move_at.load(Ordering::SeqCst)
            && let Some((refname, oid)) = self.moved_to.lock().expect("lock").take()
        {
            let status = Command::new("git")
                .arg("--git-dir")
                .arg(&self.path)
                .args(["update-ref", &refname, &oid])
                .status()
                .expect("update-ref");
            assert!(status.success());
        }
        Some(Upstream::Local(self.path.clone()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_records_what_the_upstream_did_with_each_push() {
    let temp = tempfile::tempdir().expect("temp");
    let root = temp.path().to_owned();
    let upstream = make_upstream(&root);
    let session = SessionId::generate();
    let racing = Arc::new(Racing {
        session: session.clone(),
        path: upstream.clone(),
        calls: AtomicUsize::new(0),
        move_at: AtomicUsize::new(0),
        moved_to: std::sync::Mutex::new(None),
    });
    let (config, ledger) = config_for(racing.clone(), &root.join("proxy-state"));
    let proxy = serve(config, ledger.clone()).await;
    let work = root.join("work");
    clone_session(&root, &proxy.base, &session, &work);
    let own = format!("refs/heads/sortie/{session}");
    let main = rev(&upstream, &root, "refs/heads/main").expect("main");

    // Accepted: the upstream said `ok`.
    commit_files(&work, &root, &[("a.txt", "a\n")], "a");
    let a = rev(&work, &root, "HEAD").expect("a");
    ok(git(&work, &root, &["push", "-q", "origin", &format!("HEAD:{own}")]));
    // Refused by confinement: nothing forwarded.
    let other = git(&work, &root, &["push", "origin", "HEAD:refs/heads/main"]);
    assert!(!other.status.success());
    // Refused for a secret.
    commit_files(&work, &root, &[("k.txt", &format!("{AWS_KEY}\n"))], "key");
    assert!(
        !git(&work, &root, &["push", "origin", &format!("HEAD:{own}")])
            .status
            .success()
    );
    ok(git(&work, &root, &["reset", "-q", "--hard", &a]));
    // A stale lease at the upstream: the branch moves between the advertisement (which matched the
    // lease) and the pack, so the upstream refuses the update.
    commit_files(&work, &root, &[("b.txt", "b\n")], "b");
    let b = rev(&work, &root, "HEAD").expect("b");
    racing.arm(2, &own, &main);
    let stale = git(
        &work,
        &root,
        &[
            "push",
            &format!("--force-with-lease={own}:{a}"),
            "origin",
            &format!("HEAD:{own}"),
        ],
    );
    let said = String::from_utf8_lossy(&stale.stderr);
    assert!(!stale.status.success() && said.contains("[remote rejected]"), "{said}");
    assert_eq!(
        rev(&upstream, &root, &own).as_deref(),
        Some(main.as_str()),
        "the upstream kept the other update"
    );
    // A lease the client itself finds stale never reaches the proxy's push route: nothing recorded.
    let before = ledger.records().len();
    let wrong = git(
        &work,
        &root,
        &[
            "push",
            &format!("--force-with-lease={own}:{a}"),
            "origin",
            &format!("HEAD:{own}"),
        ],
    );
    assert!(!wrong.status.success() && String::from_utf8_lossy(&wrong.stderr).contains("stale info"));
    assert_eq!(ledger.records().len(), before);

    let records = ledger.records();
    let outcomes: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        ["accepted", "refused", "secret_detected", "upstream_rejected"],
        "{records:#?}"
    );
    assert!(records.iter().all(|r| r.session_id == session));
    let update = |i: usize| records[i].update.clone().expect("an update");
    assert_eq!((update(0).refname, update(0).new), (own.clone(), a.clone()));
    assert_eq!(update(1).refname, "refs/heads/main");
    assert!(matches!(&records[1].outcome, PushOutcome::Refused { reason } if reason.contains("may not be pushed")));
    assert_eq!((update(3).old, update(3).new), (a.clone(), b));
    assert!(
        matches!(&records[3].outcome, PushOutcome::UpstreamRejected { reason } if reason.contains("the upstream refused it")),
        "{:?}",
        records[3]
    );
    assert_eq!(
        ledger.last_accepted().and_then(|r| r.update).map(|u| u.new),
        Some(a),
        "the delivered head is the last push the upstream took"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_whose_parents_no_trusted_store_holds_is_refused_and_accepted_pushes_vouch_for_later_ones() {
    let setup = setup().await;
    let token = "t";
    let session = SessionId::generate();
    let (forge_url, _) = fake_forge(setup.upstream.clone(), token, Misbehaviour::None, &session).await;
    let upstreams: Arc<dyn Upstreams> = Arc::new(Forge(session.clone(), forge_url, token.into()));
    let own = format!("refs/heads/sortie/{session}");
    let home = setup.root.as_path();

    // No mirror: the parent (the forge's main) is nowhere the gateway trusts.
    let state = fresh_state(home);
    let (mut blind, blind_ledger) = config_for(upstreams.clone(), &state);
    blind.forge_http = Some(forge_client(&ForgeTls::default()).expect("client"));
    let blind = serve(blind, blind_ledger.clone()).await;
    let work = setup.root.join("parent-work");
    clone_session(home, &blind.base, &session, &work);
    commit_files(&work, home, &[("p.txt", "p\n")], "p");
    let refused = git(&work, home, &["push", "origin", &format!("HEAD:{own}")]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("cannot be checked"),
        "{said}"
    );
    assert_eq!(rev(&setup.upstream, home, &own), None);
    assert!(matches!(blind_ledger.records()[0].outcome, PushOutcome::Refused { .. }));

    // With the mirror (the upstream's objects stand in for it), the same push goes through...
    let (mut seeing, ledger) = config_for(upstreams.clone(), &state);
    seeing.forge_http = Some(forge_client(&ForgeTls::default()).expect("client"));
    seeing.trusted_object_dirs = vec![setup.upstream.join("objects")];
    let seeing = serve(seeing, ledger.clone()).await;
    ok(git(
        &work,
        home,
        &[
            "remote",
            "set-url",
            "origin",
            &format!("{}/_sortie/git/{session}.git", seeing.base),
        ],
    ));
    ok(git(&work, home, &["push", "-q", "origin", &format!("HEAD:{own}")]));
    assert_eq!(rev(&setup.upstream, home, &own), rev(&work, home, "HEAD"));

    // ...and its objects are kept, so a later push on top of it resolves without the mirror.
    ok(git(
        &work,
        home,
        &[
            "remote",
            "set-url",
            "origin",
            &format!("{}/_sortie/git/{session}.git", blind.base),
        ],
    ));
    commit_files(&work, home, &[("q.txt", "q\n")], "q");
    ok(git(&work, home, &["push", "-q", "origin", &format!("HEAD:{own}")]));
    assert_eq!(rev(&setup.upstream, home, &own), rev(&work, home, "HEAD"));
    assert_eq!(
        blind_ledger.last_accepted().and_then(|r| r.update).map(|u| Some(u.new)),
        Some(rev(&work, home, "HEAD"))
    );
}

/// `git` in the test's PATH, resolved.
fn real_git() -> PathBuf {
    let output = Command::new("sh").args(["-c", "command -v git"]).output().expect("sh");
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// Reads a ref of a repository this process does not own (the test's own look, not the proxy's).
fn foreign_rev(repo: &Path, spec: &str) -> Option<String> {
    sortie_testkit::git::rev(repo, spec)
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Every path under `dir` (itself included) with its owner uid.
fn owners(dir: &Path) -> Vec<(PathBuf, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(path) = stack.pop() {
        let metadata = std::fs::symlink_metadata(&path).expect("metadata");
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&path).expect("read_dir") {
                stack.push(entry.expect("entry").path());
            }
        }
        out.push((path, metadata.uid()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_of_another_user_is_served_as_that_user_and_its_hooks_never_run() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: serving a repository of another user as that user needs root");
        return;
    }
    let owner = 1234;
    let temp = tempfile::tempdir().expect("temp");
    let root = temp.path().to_owned();
    chmod(&root, 0o755);
    let upstream = make_upstream(&root);
    let log = root.join("log");
    std::fs::create_dir(&log).expect("log dir");
    chmod(&log, 0o777);
    for hook in [
        "pre-receive",
        "update",
        "post-receive",
        "post-update",
        "reference-transaction",
    ] {
        let path = upstream.join("hooks").join(hook);
        std::fs::write(
            &path,
            format!("#!/bin/sh\necho \"{hook} $(id -u)\" >> {}/hook-ran\n", log.display()),
        )
        .expect("hook");
        chmod(&path, 0o755);
    }
    let status = Command::new("chown")
        .args(["-R", &format!("{owner}:{owner}")])
        .arg(&upstream)
        .status()
        .expect("chown");
    assert!(status.success());
    // Every git the proxy starts for a request reports who it runs as, then is the real git.
    let wrapper = root.join("git-wrapper");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ -n \"$GIT_PROJECT_ROOT\" ]; then echo \"$(id -u) $(id -g) [$(grep '^Groups:' /proc/$$/status | cut -f2 | tr -d ' ')] $1 $QUERY_STRING\" >> {}/backend; fi\nexec {} \"$@\"\n",
            log.display(),
            real_git().display()
        ),
    )
    .expect("wrapper");
    chmod(&wrapper, 0o755);
    // The proxy runs git's `git-http-backend` itself, without `git` in front: that one reports too.
    let session = SessionId::generate();
    let upstreams: Arc<dyn Upstreams> = Arc::new(OneRepo {
        session: session.clone(),
        path: upstream.clone(),
    });
    let (mut config, ledger) = config_for(upstreams.clone(), &root.join("proxy-state"));
    let real_backend = config
        .http_backend
        .clone()
        .expect("git's own git-http-backend is found");
    let backend_wrapper = root.join("backend-wrapper");
    std::fs::write(
        &backend_wrapper,
        format!(
            "#!/bin/sh\necho \"$(id -u) $(id -g) [$(grep '^Groups:' /proc/$$/status | cut -f2 | tr -d ' ')] http-backend $QUERY_STRING\" >> {}/backend\nexec {} \"$@\"\n",
            log.display(),
            real_backend.display()
        ),
    )
    .expect("wrapper");
    chmod(&backend_wrapper, 0o755);
    config.git = wrapper.clone();
    config.http_backend = Some(backend_wrapper);
    let proxy = serve(config, ledger.clone()).await;
    let work = root.join("work");
    clone_session(&root, &proxy.base, &session, &work);
    let own = format!("refs/heads/sortie/{session}");
    commit_files(&work, &root, &[("a.txt", "a\n")], "a");
    ok(git(&work, &root, &["push", "-q", "origin", &format!("HEAD:{own}")]));
    assert_eq!(
        foreign_rev(&upstream, &own),
        rev(&work, &root, "HEAD"),
        "the push landed"
    );
    assert_eq!(ledger.last_accepted().map(|r| r.outcome), Some(PushOutcome::Accepted));

    assert!(
        !log.join("hook-ran").exists(),
        "a hook ran: {}",
        std::fs::read_to_string(log.join("hook-ran")).unwrap_or_default()
    );
    let backend = std::fs::read_to_string(log.join("backend")).expect("the backend ran");
    let calls: Vec<&str> = backend.lines().collect();
    assert!(
        calls.iter().any(|c| c.contains("service=git-receive-pack")) && calls.len() >= 4,
        "{backend}"
    );
    for call in &calls {
        assert!(
            call.starts_with(&format!("{owner} {owner} [] http-backend")),
            "git ran as someone else than the repository's owner, or kept groups: {call}"
        );
    }
    let foreign: Vec<_> = owners(&upstream).into_iter().filter(|(_, uid)| *uid != owner).collect();
    assert!(
        foreign.is_empty(),
        "files of another owner in the repository: {foreign:?}"
    );

    // A gateway told not to serve other users' repositories refuses them outright.
    let (mut refusing, refusing_ledger) = config_for(upstreams, &root.join("refusing-state"));
    refusing.foreign_owner = sortie_gateway::git::config::ForeignOwner::Refuse;
    let refusing = serve(refusing, refusing_ledger).await;
    let output = git(
        &root,
        &root,
        &[
            "clone",
            &format!("{}/_sortie/git/{session}.git", refusing.base),
            "refused",
        ],
    );
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && said.contains("belongs to another user"),
        "{said}"
    );
}

/// A v1 cgroup (memory and pids) made for one test, emptied and removed when dropped.
struct TestCgroup {
    dirs: Vec<PathBuf>,
}

impl TestCgroup {
    fn create() -> Option<Self> {
        let root = Path::new("/sys/fs/cgroup");
        let v1 = ["memory", "pids"]
            .iter()
            .all(|c| root.join(c).join("cgroup.procs").is_file());
        if !nix::unistd::geteuid().is_root() || !v1 {
            eprintln!("cgroup part skipped: needs root and the cgroup v1 memory and pids hierarchies");
            return None;
        }
        let name = format!("sortie-test-git-{}", SessionId::generate());
        let dirs: Vec<PathBuf> = ["memory", "pids"].iter().map(|c| root.join(c).join(&name)).collect();
        for dir in &dirs {
            std::fs::create_dir(dir).expect("cgroup");
        }
        std::fs::write(dirs[0].join("memory.limit_in_bytes"), "268435456").expect("memory limit");
        std::fs::write(dirs[1].join("pids.max"), "64").expect("pids limit");
        Some(Self { dirs })
    }

    fn procs(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dirs[1].join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for dir in &self.dirs {
            while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The pids of this process's children that are `git http-backend` for a repository under `root`.
fn backend_children(root: &Path) -> Vec<u32> {
    let me = std::process::id();
    let marker = format!("GIT_PROJECT_ROOT={}", root.display());
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: the comm may hold spaces, so read after its last `)`.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(me) {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if environ.split(|b| *b == 0).any(|var| var == marker.as_bytes()) {
            found.push(pid);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sessions_git_processes_are_capped_and_kept_in_its_cgroup_while_another_session_clones() {
    let cap = 4;
    let flood = 300;
    let cgroup = TestCgroup::create();
    let procs = cgroup.as_ref().map(TestCgroup::procs).unwrap_or_default();
    let setup = setup_with(|config| {
        config.processes.max_concurrent = cap;
        config.processes.queue_wait = Duration::from_secs(1);
        config.processes.cgroup_procs = procs;
    })
    .await;
    let upstream_root = setup.upstream.parent().expect("root").to_owned();
    // Another session, with its own proxy, on a copy of the upstream (its git children are told
    // apart from the flooded session's by their project root).
    let other = SessionId::generate();
    let other_root = setup.root.join("other");
    std::fs::create_dir(&other_root).expect("dir");
    let other_upstream = other_root.join("upstream.git");
    ok(git(
        &setup.root,
        &setup.root,
        &[
            "clone",
            "-q",
            "--bare",
            setup.upstream.to_str().expect("utf-8"),
            other_upstream.to_str().expect("utf-8"),
        ],
    ));
    let (other_config, other_ledger) = config_for(
        Arc::new(OneRepo {
            session: other.clone(),
            path: other_upstream,
        }),
        &fresh_state(&setup.root),
    );
    let other_proxy = serve(other_config, other_ledger).await;

    // 300 upload-pack requests announcing 10 MB bodies, each sending 20 bytes and holding.
    let address = setup.base.trim_start_matches("http://").to_owned();
    let path = format!("/_sortie/git/{}.git/git-upload-pack", setup.session);
    let refused = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::watch::channel(false);
    let mut holders = Vec::new();
    for _ in 0..flood {
        let (address, path, refused, mut released) = (address.clone(), path.clone(), refused.clone(), released.clone());
        holders.push(tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut socket = tokio::net::TcpStream::connect(&address).await.expect("connect");
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/x-git-upload-pack-request\r\nContent-Length: 10000000\r\n\r\n0014command=ls-refs\n"
            );
            socket.write_all(head.as_bytes()).await.expect("write");
            let mut answer = [0_u8; 12];
            tokio::select! {
                read = socket.read_exact(&mut answer) => {
                    if read.is_ok() && &answer == b"HTTP/1.1 503" {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                }
                _ = released.wait_for(|r| *r) => {}
            }
            let _ = released.wait_for(|r| *r).await;
        }));
    }

    // While they hold: never more than the cap of git children, all in the session's cgroup.
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen_in_cgroup = true;
    let sample = |most: &mut usize, seen_in_cgroup: &mut bool| {
        let children = backend_children(&upstream_root);
        *most = (*most).max(children.len());
        if let Some(cgroup) = &cgroup {
            // A child still at its gate (`sh`, before the proxy placed it) runs nothing yet; one that
            // became git must be in the cgroup.
            // (Read before the members: a child that is git now was placed before it became git.)
            let became_git: Vec<&u32> = children
                .iter()
                .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "git"))
                .collect();
            let members = cgroup.pids();
            *seen_in_cgroup &= became_git.iter().all(|pid| members.contains(pid));
        }
    };
    while refused.load(Ordering::SeqCst) < flood - cap {
        assert!(
            Instant::now() < deadline,
            "only {} of the requests over the cap were refused",
            refused.load(Ordering::SeqCst)
        );
        sample(&mut most, &mut seen_in_cgroup);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The other session clones meanwhile.
    let (root, base, session) = (setup.root.clone(), other_proxy.base.clone(), other.clone());
    let clone = tokio::task::spawn_blocking(move || clone_session(&root, &base, &session, &root.join("other-work")));
    while !clone.is_finished() {
        sample(&mut most, &mut seen_in_cgroup);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clone.await.expect("the other session's clone");
    assert!(setup.root.join("other-work/README.md").is_file());
    sample(&mut most, &mut seen_in_cgroup);
    let held = backend_children(&upstream_root);
    assert_eq!(held.len(), cap, "the held requests each have their child: {held:?}");
    assert_eq!(most, cap, "never more git children than the cap");
    assert!(seen_in_cgroup, "every child was in the session's cgroup");
    if let Some(cgroup) = &cgroup {
        let members = cgroup.pids();
        assert!(held.iter().all(|pid| members.contains(pid)), "{held:?} in {members:?}");
    }
    assert_eq!(refused.load(Ordering::SeqCst), flood - cap);

    // Released: the children end, and the session can work again.
    let _ = release.send(true);
    for holder in holders {
        let _ = holder.await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !backend_children(&upstream_root).is_empty() {
        assert!(Instant::now() < deadline, "children left after the clients went away");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = setup.root.join("again");
    clone_session(&setup.root, &setup.base, &setup.session, &again);
}

/// Every process (any parent) whose environment names `root` as git's project root.
fn processes_serving(root: &Path) -> Vec<(u32, String)> {
    let marker = format!("GIT_PROJECT_ROOT={}", root.display());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if environ.split(|b| *b == 0).any(|var| var == marker.as_bytes()) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
        }
    }
    found
}

/// `git http-backend` runs `git-http-backend` as a child: a backend killed for running too long
/// takes that child with it instead of orphaning it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_for_running_too_long_leaves_no_process_behind() {
    let setup = setup_with(|config| {
        config.processes.max_lifetime = Duration::from_millis(500);
        config.processes.body_idle_timeout = Duration::from_secs(60);
    })
    .await;
    let upstream_root = setup.upstream.parent().expect("root").to_owned();
    let address = setup.base.trim_start_matches("http://").to_owned();
    let path = format!("/_sortie/git/{}.git/git-upload-pack", setup.session);
    use tokio::io::AsyncWriteExt;
    let mut socket = tokio::net::TcpStream::connect(&address).await.expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/x-git-upload-pack-request\r\nContent-Length: 10000000\r\n\r\n0014command=ls-refs\n"
    );
    socket.write_all(head.as_bytes()).await.expect("write");

    // The held request has its backend, the dashed child included...
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let serving = processes_serving(&upstream_root);
        if serving.iter().any(|(_, cmdline)| cmdline.contains("git-http-backend")) {
            break;
        }
        assert!(Instant::now() < deadline, "no backend started: {serving:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and past its lifetime nothing of it is left, while the client still holds the request open.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let serving = processes_serving(&upstream_root);
        if serving.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left behind: {serving:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(socket);
}

/// Runs the test's git with `input` on its stdin; its stdout.
fn git_with_input(dir: &Path, home: &Path, args: &[&str], input: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut child = sortie_testkit::git::command(dir)
        .env("HOME", home)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("git");
    child.stdin.take().expect("stdin").write_all(input).expect("write");
    ok(child.wait_with_output().expect("git ran")).stdout
}

/// A pushed commit is hostile down to its header: one whose `parent` line is not an object name
/// (here text that a cut `cat-file --batch-check` answer once read back as a commit, while the diff
/// that scans its changes skipped it) is refused by the gateway itself, whatever the upstream would
/// have said, and its file's key goes nowhere. The pack is made by hand: git's own push would not
/// send such a commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_parent_line_is_not_an_object_name_is_refused_at_the_gateway() {
    let setup = setup().await;
    let home = setup.root.as_path();
    let work = clone(&setup);
    let trimmed = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).trim().to_owned();
    let blob = trimmed(git_with_input(
        &work,
        home,
        &["hash-object", "-w", "--stdin"],
        format!("aws_access_key_id = {AWS_KEY}\n").as_bytes(),
    ));
    let tree = trimmed(git_with_input(
        &work,
        home,
        &["mktree"],
        format!("100644 blob {blob}\tleak.txt\n").as_bytes(),
    ));
    let commit_object = format!(
        "tree {tree}\nparent x commit{}y\nauthor A <a@example.com> 1700000000 +0000\ncommitter A <a@example.com> 1700000000 +0000\n\nleak\n",
        " ".repeat(504)
    );
    let commit = trimmed(git_with_input(
        &work,
        home,
        &["hash-object", "-t", "commit", "--literally", "-w", "--stdin"],
        commit_object.as_bytes(),
    ));
    let pack = git_with_input(
        &work,
        home,
        &["pack-objects", "--stdout", "-q"],
        format!("{commit}\n{tree}\n{blob}\n").as_bytes(),
    );
    let own = format!("refs/heads/sortie/{}", setup.session);
    let command = format!("{} {commit} {own}\0 report-status side-band-64k\n", "0".repeat(40));
    let mut body = pktline::encode(command.as_bytes());
    body.extend_from_slice(pktline::FLUSH);
    body.extend_from_slice(&pack);
    let (_, answer) = post_receive_pack(&setup.url, body).await;
    assert!(answer.contains("ng "), "{answer}");
    assert!(!answer.contains(AWS_KEY), "{answer}");
    assert_eq!(rev(&setup.upstream, home, &own), None, "nothing reached the upstream");
    let records = setup.ledger.records();
    assert_eq!(records.len(), 1, "{records:#?}");
    assert!(
        matches!(&records[0].outcome, PushOutcome::Refused { reason } if reason.contains("parent line")),
        "refused by the gateway's own check, not left to the upstream: {records:#?}"
    );
}
