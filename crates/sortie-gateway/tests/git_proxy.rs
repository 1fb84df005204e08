//! The git proxy with the real `git` client: clone, fetch and pushes of the session's own branch go
//! through; every other push is refused whole, `git push` prints why, and the upstream is unchanged.
//! Forges get the credential (over plain HTTP and over real TLS with a certificate made here), and
//! a forge whose certificate is not trusted is a 502 with nothing of the forge's in it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use sortie_gateway::git::http::{ForgeTls, Upstream, Upstreams, router, router_with_forge_tls};
use sortie_gateway::git::pktline;
use sortie_protocol::SessionId;
use sortie_testkit::forge::{make_certificates, serve_https as https_forge};

struct OneRepo {
    session: SessionId,
    path: PathBuf,
}

impl Upstreams for OneRepo {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.session).then(|| Upstream::Local(self.path.clone()))
    }
}

struct Setup {
    _temp: tempfile::TempDir,
    root: PathBuf,
    session: SessionId,
    upstream: PathBuf,
    url: String,
    base: String,
}

fn git(dir: &Path, home: &Path, args: &[&str]) -> Output {
    Command::new("git")
        .args([
            "-c",
            "user.name=agent",
            "-c",
            "user.email=agent@sortie.invalid",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "protocol.file.allow=always",
        ])
        .args(args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .expect("git")
}

fn ok(output: Output) -> Output {
    assert!(
        output.status.success(),
        "git failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn rev(dir: &Path, home: &Path, spec: &str) -> Option<String> {
    let output = git(dir, home, &["rev-parse", "--verify", "--quiet", spec]);
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

async fn setup() -> Setup {
    let temp = tempfile::tempdir().expect("temp");
    let root = temp.path().to_owned();
    let upstream = root.join("upstream.git");
    ok(git(
        &root,
        &root,
        &["init", "-q", "--bare", upstream.to_str().expect("utf-8")],
    ));
    let seed = root.join("seed");
    ok(git(&root, &root, &["init", "-q", seed.to_str().expect("utf-8")]));
    std::fs::write(seed.join("README.md"), "hello\n").expect("write");
    ok(git(&seed, &root, &["add", "."]));
    ok(git(&seed, &root, &["commit", "-q", "-m", "first"]));
    ok(git(
        &seed,
        &root,
        &["push", "-q", upstream.to_str().expect("utf-8"), "HEAD:refs/heads/main"],
    ));

    let session = SessionId::generate();
    let upstreams = Arc::new(OneRepo {
        session: session.clone(),
        path: upstream.clone(),
    });
    let app = router(upstreams, PathBuf::from("git"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("{base}/_sortie/git/{session}.git");
    Setup {
        _temp: temp,
        root,
        session,
        upstream,
        url,
        base,
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
    let client = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    };
    let reply = client
        .post(format!("{}/git-receive-pack", setup.url))
        .header("content-type", "application/x-git-receive-pack-request")
        .body(body)
        .send()
        .await
        .expect("post");
    assert_eq!(reply.status().as_u16(), 200);
    let answer = reply.bytes().await.expect("body");
    assert!(
        String::from_utf8_lossy(&answer).contains("push-cert"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
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
    let inner = router(
        Arc::new(OneRepo {
            session: session.clone(),
            path: upstream,
        }),
        PathBuf::from("git"),
    );
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

async fn proxy_for(upstreams: Arc<dyn Upstreams>) -> String {
    serve_proxy(router(upstreams, PathBuf::from("git"))).await
}

/// Serves a git proxy over plain HTTP, as the sandbox reaches it; returns its base URL.
async fn serve_proxy(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forge_gets_the_credential_and_the_client_never_does() {
    let setup = setup().await;
    let token = "ghs_s3cr3t-installation-token";
    let session = SessionId::generate();
    let (forge_url, seen) = fake_forge(setup.upstream.clone(), token, Misbehaviour::None, &session).await;
    let base = proxy_for(Arc::new(Forge(session.clone(), forge_url, token.to_owned()))).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forge_that_refuses_or_redirects_is_not_relayed() {
    let setup = setup().await;
    let session = SessionId::generate();
    let (forge_url, _) = fake_forge(setup.upstream.clone(), "the-right-token", Misbehaviour::None, &session).await;
    let base = proxy_for(Arc::new(Forge(session.clone(), forge_url, "a-wrong-token".into()))).await;
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
    let base = proxy_for(Arc::new(Forge(session.clone(), redirecting, "t".into()))).await;
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
        let base = proxy_for(Arc::new(Forge(session.clone(), forge_url, "t".into()))).await;
        let work = setup.root.join(format!("work-{session}"));
        clone_session(&setup.root, &base, &session, &work);
        commit(&work, &setup.root, "p.txt", b"p\n");
        let own = format!("refs/heads/sortie/{session}");
        let pushed = git(&work, &setup.root, &["push", "origin", &format!("HEAD:{own}")]);
        let said = String::from_utf8_lossy(&pushed.stderr);
        assert!(!pushed.status.success() && said.contains(says), "{said}");
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
    let trusting = router_with_forge_tls(upstreams.clone(), PathBuf::from("git"), &tls).expect("router");
    let base = serve_proxy(trusting).await;
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
    let base = proxy_for(upstreams).await;
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

    // Extra roots that are no certificate are refused when the router is built.
    let junk = ForgeTls {
        extra_roots_pem: b"not a certificate".to_vec(),
    };
    assert!(
        router_with_forge_tls(
            Arc::new(Forge(session, String::new(), String::new())),
            PathBuf::from("git"),
            &junk
        )
        .is_err()
    );
}
