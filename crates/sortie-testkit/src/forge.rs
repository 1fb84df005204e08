//! A fake forge for tests: smart HTTP over the bare repositories under a directory (served by the
//! real `git http-backend`, with no branch rules, as a forge's would be), behind Basic auth as
//! GitHub takes installation tokens (`x-access-token:<token>`), over real TLS with a certificate
//! made here by the `openssl` CLI. Every request is recorded with whether it carried the token.
//! It also answers GitHub's pull-request calls (`POST`/`GET /repos/{owner}/{repo}/pulls`, with the
//! token as a bearer), in GitHub's shapes, including the 422 for a head that has a PR already.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use base64::Engine;
use tokio::io::AsyncWriteExt;

use crate::github_app::FakeApp;

/// A CA and a certificate for 127.0.0.1 it signed.
pub struct Certificates {
    /// Where the CA's PEM is, for clients to trust.
    pub ca_file: PathBuf,
    pub ca_pem: Vec<u8>,
    pub forge_pem: Vec<u8>,
    pub forge_key_pem: Vec<u8>,
}

/// Runs the `openssl` CLI in `dir`; a failure fails the test with openssl's words.
pub(crate) fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl CLI");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Makes a CA and a server certificate for `IP:127.0.0.1` under `dir` with the `openssl` CLI.
pub fn make_certificates(dir: &Path) -> Certificates {
    std::fs::create_dir_all(dir).expect("tls dir");
    let openssl = |args: &[&str]| openssl(dir, args);
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let ca = [
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=sortie test forge CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ];
    openssl(&[&["req", "-x509"][..], &ec, &ca].concat());
    let csr = ["-keyout", "forge.key", "-out", "forge.csr", "-subj", "/CN=127.0.0.1"];
    openssl(&[&["req"][..], &ec, &csr].concat());
    std::fs::write(
        dir.join("forge.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .expect("extensions");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "forge.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "forge.pem",
        "-days",
        "2",
        "-extfile",
        "forge.ext",
    ]);
    let read = |name: &str| std::fs::read(dir.join(name)).expect(name);
    Certificates {
        ca_file: dir.join("ca.pem"),
        ca_pem: read("ca.pem"),
        forge_pem: read("forge.pem"),
        forge_key_pem: read("forge.key"),
    }
}

/// Serves `app` over TLS on 127.0.0.1 with the forge certificate; its address and a count of the
/// TLS handshakes that failed.
pub async fn serve_https(app: Router, certificates: &Certificates) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tower::ServiceExt;

    let _ = rustls::crypto::ring::default_provider().install_default();
    let chain = CertificateDer::pem_slice_iter(&certificates.forge_pem)
        .collect::<Result<Vec<_>, _>>()
        .expect("certificate");
    let key = PrivateKeyDer::from_pem_slice(&certificates.forge_key_pem).expect("key");
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr");
    let failed_handshakes = Arc::new(AtomicUsize::new(0));
    let failures = failed_handshakes.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app, failures) = (acceptor.clone(), app.clone(), failures.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    failures.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    app.clone().oneshot(request.map(Body::new))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (address, failed_handshakes)
}

/// One request the forge saw: `METHOD /path?query` and whether it carried the token.
#[derive(Clone, Debug)]
pub struct ForgeRequest {
    pub line: String,
    pub authorized: bool,
}

/// A pull request the forge keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakePull {
    pub number: u64,
    pub repo: String,
    pub head: String,
    pub base: String,
    pub title: String,
    pub body: String,
    pub draft: bool,
}

/// The bare repositories under `root` as a forge serves them (`/<name>.git/…`), for `token` only.
pub struct GitForge {
    root: PathBuf,
    /// The Basic credential git requests must carry, and the bearer of API calls.
    credentials: Mutex<(String, String)>,
    seen: Mutex<Vec<ForgeRequest>>,
    pulls: Mutex<Vec<FakePull>>,
    /// The token may push but not open pull requests (GitHub's 403 for a token without the permission).
    pulls_forbidden: AtomicBool,
    /// Milliseconds a pull-request call waits before it is answered (a slow forge).
    pulls_delay_ms: std::sync::atomic::AtomicU64,
    /// A GitHub App installed here, whose installation tokens are taken too.
    app: Mutex<Option<FakeApp>>,
    /// What the issue and pull request conversations hold.
    talk: Mutex<Conversation>,
}

/// A comment made through the API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeComment {
    pub id: u64,
    pub repo: String,
    /// The issue or pull request it is in.
    pub number: u64,
    pub body: String,
}

/// A reaction to a comment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeReaction {
    pub repo: String,
    /// `issues` or `pulls` (a review comment).
    pub on: String,
    pub comment_id: u64,
    pub content: String,
}

/// A check run, as last set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeCheckRun {
    pub id: u64,
    pub repo: String,
    pub name: String,
    pub head_sha: String,
    pub status: String,
    pub conclusion: Option<String>,
    pub title: Option<String>,
}

#[derive(Default)]
struct Conversation {
    /// `login` → `admin|write|read|none` (not listed: 404, as for someone who is no collaborator).
    permissions: std::collections::BTreeMap<String, String>,
    comments: Vec<FakeComment>,
    reactions: Vec<FakeReaction>,
    check_runs: Vec<FakeCheckRun>,
    /// Every time a pull request's body was replaced: (number, body).
    body_updates: Vec<(u64, String)>,
}

impl GitForge {
    pub fn new(root: &Path, token: &str) -> Arc<Self> {
        Arc::new(Self {
            root: root.to_owned(),
            credentials: Mutex::new(credentials_for(token)),
            seen: Mutex::new(Vec::new()),
            pulls: Mutex::new(Vec::new()),
            pulls_forbidden: AtomicBool::new(false),
            pulls_delay_ms: std::sync::atomic::AtomicU64::new(0),
            app: Mutex::new(None),
            talk: Mutex::new(Conversation::default()),
        })
    }

    /// From now on `login` has `permission` (`admin`, `write`, `read`, `none`) on every repository.
    pub fn set_permission(&self, login: &str, permission: &str) {
        self.conversation()
            .permissions
            .insert(login.to_owned(), permission.to_owned());
    }

    fn conversation(&self) -> std::sync::MutexGuard<'_, Conversation> {
        self.talk.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn comments(&self) -> Vec<FakeComment> {
        self.conversation().comments.clone()
    }

    pub fn reactions(&self) -> Vec<FakeReaction> {
        self.conversation().reactions.clone()
    }

    pub fn check_runs(&self) -> Vec<FakeCheckRun> {
        self.conversation().check_runs.clone()
    }

    /// Each replacement of a pull request's description, in order.
    pub fn body_updates(&self) -> Vec<(u64, String)> {
        self.conversation().body_updates.clone()
    }

    /// Whether the request's token may use `permission` at `level` on `repository`: the personal token
    /// may do anything, an installation token what it was minted for.
    fn allows(&self, headers: &HeaderMap, repository: &str, permission: &str, level: &str) -> bool {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if self.credentials.lock().is_ok_and(|c| given == Some(c.1.as_str())) {
            return true;
        }
        let Some(token) = given.and_then(|g| g.strip_prefix("Bearer ")) else {
            return false;
        };
        self.with_app(|app| app.grants(token, repository, permission, level, std::time::SystemTime::now()))
            .unwrap_or(false)
    }

    /// From now on a call that opens a pull request is answered only after `delay`.
    pub fn delay_pulls(&self, delay: std::time::Duration) {
        self.pulls_delay_ms
            .store(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// From now on opening a pull request is refused as GitHub refuses a token lacking the permission.
    pub fn forbid_pulls(&self, forbidden: bool) {
        self.pulls_forbidden.store(forbidden, Ordering::SeqCst);
    }

    /// From now on only `token` is accepted (a rotated token).
    pub fn set_token(&self, token: &str) {
        if let Ok(mut credentials) = self.credentials.lock() {
            *credentials = credentials_for(token);
        }
    }

    fn basic_ok(&self, headers: &HeaderMap) -> bool {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        self.credentials.lock().is_ok_and(|c| given == Some(c.0.as_str()))
    }

    /// Installs a GitHub App (its token routes answer from now on).
    pub fn install_app(&self, app: FakeApp) {
        *self.app.lock().unwrap_or_else(|p| p.into_inner()) = Some(app);
    }

    /// The installed App, to look at or change (`expire_all`, `stateless`, installations).
    pub fn with_app<T>(&self, f: impl FnOnce(&mut FakeApp) -> T) -> Option<T> {
        self.app.lock().unwrap_or_else(|p| p.into_inner()).as_mut().map(f)
    }

    /// Whether `given` (a whole `Authorization` value) is a live installation token for `repository`.
    fn app_token_ok(&self, given: Option<&str>, repository: &str) -> bool {
        let token = given.and_then(|value| {
            value.strip_prefix("Bearer ").map(str::to_owned).or_else(|| {
                let basic = value.strip_prefix("Basic ")?;
                let decoded = base64::engine::general_purpose::STANDARD.decode(basic).ok()?;
                String::from_utf8(decoded)
                    .ok()?
                    .strip_prefix("x-access-token:")
                    .map(str::to_owned)
            })
        });
        let Some(token) = token else {
            return false;
        };
        self.with_app(|app| app.accepts(&token, repository, std::time::SystemTime::now()))
            .unwrap_or(false)
    }

    pub fn pulls(&self) -> Vec<FakePull> {
        self.pulls.lock().map(|pulls| pulls.clone()).unwrap_or_default()
    }

    pub fn requests(&self) -> Vec<ForgeRequest> {
        self.seen.lock().map(|seen| seen.clone()).unwrap_or_default()
    }

    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route(
                "/repos/{owner}/{name}/pulls",
                axum::routing::get(list_pulls).post(open_pull),
            )
            .route(
                "/repos/{owner}/{name}/installation",
                axum::routing::get(repo_installation),
            )
            .route(
                "/app/installations/{id}/access_tokens",
                axum::routing::post(installation_token),
            )
            .route(
                "/repos/{owner}/{name}/collaborators/{login}/permission",
                axum::routing::get(collaborator_permission),
            )
            .route(
                "/repos/{owner}/{name}/issues/{number}/comments",
                axum::routing::post(add_comment),
            )
            .route(
                "/repos/{owner}/{name}/{on}/comments/{id}/reactions",
                axum::routing::post(add_reaction),
            )
            .route(
                "/repos/{owner}/{name}/pulls/{number}",
                axum::routing::get(get_pull).patch(patch_pull),
            )
            .route("/repos/{owner}/{name}/check-runs", axum::routing::post(start_check_run))
            .route(
                "/repos/{owner}/{name}/check-runs/{id}",
                axum::routing::patch(update_check_run),
            )
            .fallback(serve)
            .with_state(self.clone())
    }

    fn record(&self, request_line: String, authorized: bool) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(ForgeRequest {
                line: request_line,
                authorized,
            });
        }
    }

    fn bearer_ok(&self, headers: &HeaderMap, repository: &str) -> bool {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        self.credentials.lock().is_ok_and(|c| given == Some(c.1.as_str())) || self.app_token_ok(given, repository)
    }
}

fn credentials_for(token: &str) -> (String, String) {
    (
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"))
        ),
        format!("Bearer {token}"),
    )
}

fn json_answer(code: StatusCode, value: &serde_json::Value) -> Response {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json; charset=utf-8")
        .body(Body::from(value.to_string()))
        .unwrap_or_default()
}

fn pull_json(pull: &FakePull) -> serde_json::Value {
    serde_json::json!({
        "number": pull.number,
        "html_url": format!("https://forge.test/{}/pull/{}", pull.repo, pull.number),
        "state": "open",
        "draft": pull.draft,
        "title": pull.title,
        "head": {"ref": pull.head, "repo": {"full_name": pull.repo}},
        "base": {"ref": pull.base},
    })
}

async fn open_pull(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name)): axum::extract::Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let authorized = forge.bearer_ok(&headers, &format!("{owner}/{name}"));
    forge.record(format!("POST /repos/{owner}/{name}/pulls"), authorized);
    let delay = forge.pulls_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    }
    if !authorized {
        return json_answer(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"message": "Bad credentials"}),
        );
    }
    if forge.pulls_forbidden.load(Ordering::SeqCst) {
        return json_answer(
            StatusCode::FORBIDDEN,
            &serde_json::json!({
                "message": "Resource not accessible by integration",
                "documentation_url": "https://docs.github.com/rest/pulls/pulls#create-a-pull-request",
                "status": "403",
            }),
        );
    }
    let Ok(asked) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return json_answer(
            StatusCode::BAD_REQUEST,
            &serde_json::json!({"message": "Problems parsing JSON"}),
        );
    };
    let text = |key: &str| asked[key].as_str().unwrap_or_default().to_owned();
    let repo = format!("{owner}/{name}");
    let Ok(mut pulls) = forge.pulls.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, None);
    };
    if pulls.iter().any(|p| p.repo == repo && p.head == text("head")) {
        return json_answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            &serde_json::json!({
                "message": "Validation Failed",
                "errors": [{"resource": "PullRequest", "code": "custom",
                            "message": format!("A pull request already exists for {owner}:{}.", text("head"))}],
            }),
        );
    }
    let pull = FakePull {
        number: pulls.len() as u64 + 1,
        repo,
        head: text("head"),
        base: text("base"),
        title: text("title"),
        body: text("body"),
        draft: asked["draft"].as_bool().unwrap_or(false),
    };
    pulls.push(pull.clone());
    json_answer(StatusCode::CREATED, &pull_json(&pull))
}

async fn list_pulls(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name)): axum::extract::Path<(String, String)>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    let authorized = forge.bearer_ok(&headers, &format!("{owner}/{name}"));
    forge.record(format!("GET {uri}"), authorized);
    if !authorized {
        return json_answer(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"message": "Bad credentials"}),
        );
    }
    let head = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("head="))
        .and_then(|head| head.split_once(':'))
        .map(|(_, branch)| branch.to_owned());
    let repo = format!("{owner}/{name}");
    let listed: Vec<serde_json::Value> = forge
        .pulls()
        .iter()
        .filter(|p| p.repo == repo && head.as_ref().is_none_or(|h| &p.head == h))
        .map(pull_json)
        .collect();
    json_answer(StatusCode::OK, &serde_json::Value::Array(listed))
}

impl GitForge {
    /// Adds a pull request as if someone opened it on the forge.
    pub fn add_pull(&self, pull: FakePull) {
        if let Ok(mut pulls) = self.pulls.lock() {
            pulls.push(pull);
        }
    }
}

async fn serve(State(forge): State<Arc<GitForge>>, request: Request) -> Response {
    // `/<name>.git/…`: an installation token must be scoped to a repository of that name.
    let name = request
        .uri()
        .path()
        .trim_start_matches('/')
        .split_once(".git/")
        .map(|(name, _)| name.to_owned())
        .unwrap_or_default();
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let authorized = forge.basic_ok(request.headers()) || forge.app_token_ok(given, &name);
    forge.record(format!("{} {}", request.method(), request.uri()), authorized);
    if !authorized {
        return status(StatusCode::UNAUTHORIZED, Some("Basic realm=forge"));
    }
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 256 << 20).await else {
        return status(StatusCode::PAYLOAD_TOO_LARGE, None);
    };
    http_backend(&forge.root, &parts.method, &parts.uri, &parts.headers, body).await
}

fn status(code: StatusCode, challenge: Option<&str>) -> Response {
    let mut response = Response::builder().status(code);
    if let Some(challenge) = challenge {
        response = response.header(header::WWW_AUTHENTICATE, challenge);
    }
    response.body(Body::empty()).unwrap_or_default()
}

/// One CGI round of `git http-backend` (buffered: a test forge).
async fn http_backend(
    root: &Path,
    method: &axum::http::Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let mut command = tokio::process::Command::new("git");
    command
        .arg("http-backend")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("GIT_PROJECT_ROOT", root)
        .env("PATH_INFO", uri.path())
        .env("REQUEST_METHOD", method.as_str())
        .env("QUERY_STRING", uri.query().unwrap_or_default())
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REMOTE_USER", "x-access-token")
        .env("GIT_CONFIG_COUNT", "2")
        .env("GIT_CONFIG_KEY_0", "http.receivepack")
        .env("GIT_CONFIG_VALUE_0", "true")
        .env("GIT_CONFIG_KEY_1", "safe.directory")
        .env("GIT_CONFIG_VALUE_1", "*")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (name, variable) in [
        (header::CONTENT_TYPE, "CONTENT_TYPE"),
        (header::CONTENT_ENCODING, "HTTP_CONTENT_ENCODING"),
    ] {
        if let Some(value) = headers.get(name).and_then(|v| v.to_str().ok()) {
            command.env(variable, value);
        }
    }
    if let Some(protocol) = headers.get("git-protocol").and_then(|v| v.to_str().ok()) {
        command.env("GIT_PROTOCOL", protocol);
    }
    let Ok(mut child) = command.spawn() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, None);
    };
    if let Some(mut stdin) = child.stdin.take() {
        tokio::spawn(async move {
            let _ = stdin.write_all(&body).await;
        });
    }
    let Ok(output) = child.wait_with_output().await else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, None);
    };
    let out = output.stdout;
    let Some(split) = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| out.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2)))
    else {
        return status(StatusCode::BAD_GATEWAY, None);
    };
    let (head, rest) = (&out[..split.0], &out[split.0 + split.1..]);
    let mut response = Response::builder();
    for line in String::from_utf8_lossy(head).lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("status") {
            let code = value
                .split(' ')
                .next()
                .and_then(|c| c.parse::<u16>().ok())
                .unwrap_or(500);
            response = response.status(code);
        } else {
            response = response.header(name.trim(), value);
        }
    }
    response.body(Body::from(rest.to_vec())).unwrap_or_default()
}

type RepoPath = axum::extract::Path<(String, String)>;

impl GitForge {
    /// GitHub's refusal of a call the token may not make: 401 for a token it does not know (or one that
    /// expired), 403 for one that lacks the permission.
    fn refusal(&self, headers: &HeaderMap, repository: &str) -> Response {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if self.bearer_ok(headers, repository) || given.is_some_and(|g| g.starts_with("Basic ")) {
            json_answer(
                StatusCode::FORBIDDEN,
                &serde_json::json!({"message": "Resource not accessible by integration", "status": "403"}),
            )
        } else {
            json_answer(
                StatusCode::UNAUTHORIZED,
                &serde_json::json!({"message": "Bad credentials", "status": "401"}),
            )
        }
    }
}

/// `GET /repos/{o}/{r}/collaborators/{login}/permission`.
async fn collaborator_permission(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, login)): axum::extract::Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repository = format!("{owner}/{name}");
    let allowed = forge.allows(&headers, &repository, "metadata", "read");
    forge.record(
        format!("GET /repos/{repository}/collaborators/{login}/permission"),
        allowed,
    );
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    match forge.conversation().permissions.get(&login) {
        Some(permission) => json_answer(
            StatusCode::OK,
            &serde_json::json!({"permission": permission, "role_name": permission, "user": {"login": login}}),
        ),
        None => json_answer(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"message": format!("{login} is not a user"), "status": "404"}),
        ),
    }
}

/// `POST /repos/{o}/{r}/issues/{number}/comments` (issues and pull requests alike).
async fn add_comment(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, number)): axum::extract::Path<(String, String, u64)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let repository = format!("{owner}/{name}");
    let allowed = forge.allows(&headers, &repository, "issues", "write");
    forge.record(format!("POST /repos/{repository}/issues/{number}/comments"), allowed);
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut talk = forge.conversation();
    let id = 9_000 + talk.comments.len() as u64;
    talk.comments.push(FakeComment {
        id,
        repo: repository,
        number,
        body: asked["body"].as_str().unwrap_or_default().to_owned(),
    });
    json_answer(StatusCode::CREATED, &serde_json::json!({"id": id}))
}

/// `POST /repos/{o}/{r}/issues/comments/{id}/reactions` and `…/pulls/comments/{id}/reactions`.
async fn add_reaction(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, on, id)): axum::extract::Path<(String, String, String, u64)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let repository = format!("{owner}/{name}");
    let permission = if on == "pulls" { "pull_requests" } else { "issues" };
    let allowed = (on == "issues" || on == "pulls") && forge.allows(&headers, &repository, permission, "write");
    forge.record(
        format!("POST /repos/{repository}/{on}/comments/{id}/reactions"),
        allowed,
    );
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    forge.conversation().reactions.push(FakeReaction {
        repo: repository,
        on,
        comment_id: id,
        content: asked["content"].as_str().unwrap_or_default().to_owned(),
    });
    json_answer(
        StatusCode::CREATED,
        &serde_json::json!({"id": 1, "content": asked["content"]}),
    )
}

/// `GET /repos/{o}/{r}/pulls/{number}`.
async fn get_pull(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, number)): axum::extract::Path<(String, String, u64)>,
    headers: HeaderMap,
) -> Response {
    let repository = format!("{owner}/{name}");
    let allowed = forge.allows(&headers, &repository, "pull_requests", "read");
    forge.record(format!("GET /repos/{repository}/pulls/{number}"), allowed);
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    match forge
        .pulls()
        .iter()
        .find(|p| p.repo == repository && p.number == number)
    {
        Some(pull) => json_answer(StatusCode::OK, &pull_json(pull)),
        None => json_answer(StatusCode::NOT_FOUND, &serde_json::json!({"message": "Not Found"})),
    }
}

/// `PATCH /repos/{o}/{r}/pulls/{number}`: the body (and title) are replaced; `draft` is ignored, as
/// GitHub ignores it.
async fn patch_pull(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, number)): axum::extract::Path<(String, String, u64)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let repository = format!("{owner}/{name}");
    let allowed = forge.allows(&headers, &repository, "pull_requests", "write");
    forge.record(format!("PATCH /repos/{repository}/pulls/{number}"), allowed);
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let Ok(mut pulls) = forge.pulls.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, None);
    };
    let Some(pull) = pulls.iter_mut().find(|p| p.repo == repository && p.number == number) else {
        return json_answer(StatusCode::NOT_FOUND, &serde_json::json!({"message": "Not Found"}));
    };
    if let Some(text) = asked["body"].as_str() {
        pull.body = text.to_owned();
        forge.conversation().body_updates.push((number, text.to_owned()));
    }
    if let Some(title) = asked["title"].as_str() {
        pull.title = title.to_owned();
    }
    json_answer(StatusCode::OK, &pull_json(pull))
}

/// `POST /repos/{o}/{r}/check-runs` (GitHub Apps only).
async fn start_check_run(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name)): RepoPath,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let repository = format!("{owner}/{name}");
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let is_app = given.and_then(|g| g.strip_prefix("Bearer ")).is_some_and(|token| {
        forge
            .with_app(|app| app.grants(token, &repository, "checks", "write", std::time::SystemTime::now()))
            .unwrap_or(false)
    });
    forge.record(format!("POST /repos/{repository}/check-runs"), is_app);
    if !is_app && !forge.bearer_ok(&headers, &repository) {
        return forge.refusal(&headers, &repository);
    }
    if !is_app {
        return json_answer(
            StatusCode::FORBIDDEN,
            &serde_json::json!({"message": "You must authenticate via a GitHub App.", "status": "403"}),
        );
    }
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut talk = forge.conversation();
    let id = 500 + talk.check_runs.len() as u64;
    talk.check_runs.push(FakeCheckRun {
        id,
        repo: repository,
        name: asked["name"].as_str().unwrap_or_default().to_owned(),
        head_sha: asked["head_sha"].as_str().unwrap_or_default().to_owned(),
        status: asked["status"].as_str().unwrap_or("queued").to_owned(),
        conclusion: asked["conclusion"].as_str().map(str::to_owned),
        title: None,
    });
    json_answer(StatusCode::CREATED, &serde_json::json!({"id": id}))
}

/// `PATCH /repos/{o}/{r}/check-runs/{id}`.
async fn update_check_run(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name, id)): axum::extract::Path<(String, String, u64)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let repository = format!("{owner}/{name}");
    let allowed = forge.allows(&headers, &repository, "checks", "write");
    forge.record(format!("PATCH /repos/{repository}/check-runs/{id}"), allowed);
    if !allowed {
        return forge.refusal(&headers, &repository);
    }
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut talk = forge.conversation();
    let Some(run) = talk
        .check_runs
        .iter_mut()
        .find(|run| run.id == id && run.repo == repository)
    else {
        return json_answer(StatusCode::NOT_FOUND, &serde_json::json!({"message": "Not Found"}));
    };
    if let Some(status) = asked["status"].as_str() {
        run.status = status.to_owned();
    }
    if let Some(conclusion) = asked["conclusion"].as_str() {
        run.conclusion = Some(conclusion.to_owned());
    }
    if let Some(title) = asked["output"]["title"].as_str() {
        run.title = Some(title.to_owned());
    }
    json_answer(StatusCode::OK, &serde_json::json!({"id": id}))
}

/// `GET /repos/{owner}/{repo}/installation`, with the App's JWT.
async fn repo_installation(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path((owner, name)): axum::extract::Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let now = std::time::SystemTime::now();
    let repository = format!("{owner}/{name}");
    let answer = forge.with_app(|app| match app.verify_jwt(given, now) {
        Err(message) => Err(message),
        Ok(()) => Ok((app.installation(&repository), app.app_id.clone(), app.client_id.clone())),
    });
    forge.record(
        format!("GET /repos/{repository}/installation"),
        matches!(answer, Some(Ok(_))),
    );
    match answer {
        None => json_answer(StatusCode::NOT_FOUND, &serde_json::json!({"message": "Not Found"})),
        Some(Err(message)) => json_answer(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"message": message, "documentation_url": "https://docs.github.com/rest"}),
        ),
        Some(Ok((None, _, _))) => json_answer(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"message": "Not Found", "documentation_url": "https://docs.github.com/rest/apps/apps#get-a-repository-installation-for-the-authenticated-app"}),
        ),
        Some(Ok((Some(id), app_id, client_id))) => json_answer(
            StatusCode::OK,
            &serde_json::json!({
                "id": id, "app_id": app_id.parse::<u64>().unwrap_or_default(), "client_id": client_id,
                "account": {"login": owner}, "repository_selection": "selected",
                "access_tokens_url": format!("/app/installations/{id}/access_tokens"),
                "permissions": {"contents": "write", "pull_requests": "write", "metadata": "read"},
                "suspended_at": null,
            }),
        ),
    }
}

/// `POST /app/installations/{id}/access_tokens`, with the App's JWT.
async fn installation_token(
    State(forge): State<Arc<GitForge>>,
    axum::extract::Path(id): axum::extract::Path<u64>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let now = std::time::SystemTime::now();
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let stateless_header = headers
        .get("x-github-stateless-s2s-token")
        .and_then(|v| v.to_str().ok())
        .map(|v| v == "enabled");
    let answer = forge.with_app(|app| {
        app.verify_jwt(given, now)?;
        let asked_names: Vec<String> = asked["repositories"]
            .as_array()
            .map(|names| names.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        // Names without the owner, as GitHub takes them: the installation's repositories of that name.
        let mut repositories = Vec::new();
        for name in &asked_names {
            let full = app.repositories_of(id).into_iter().find(|repo| repo.rsplit('/').next() == Some(name.as_str()));
            match full {
                Some(full) => repositories.push(full),
                None => return Err(format!("There is at least one repository that does not exist or is not accessible to the parent installation.: {name}")),
            }
        }
        let permissions: std::collections::BTreeMap<String, String> = asked["permissions"]
            .as_object()
            .map(|map| map.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned())).collect())
            .unwrap_or_default();
        let stateless = stateless_header.unwrap_or(app.stateless);
        Ok(app.mint(id, &repositories, permissions, stateless, now))
    });
    forge.record(
        format!("POST /app/installations/{id}/access_tokens"),
        matches!(answer, Some(Ok(_))),
    );
    match answer {
        None => json_answer(StatusCode::NOT_FOUND, &serde_json::json!({"message": "Not Found"})),
        Some(Err(message)) if message.starts_with("There is") => json_answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            &serde_json::json!({"message": message, "documentation_url": "https://docs.github.com/rest"}),
        ),
        Some(Err(message)) => json_answer(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"message": message, "documentation_url": "https://docs.github.com/rest"}),
        ),
        Some(Ok(minted)) => {
            let expires_at = humantime::format_rfc3339_seconds(minted.expires_at).to_string();
            json_answer(
                StatusCode::CREATED,
                &serde_json::json!({
                    "token": minted.token, "expires_at": expires_at,
                    "permissions": minted.permissions, "repository_selection": "selected",
                    "repositories": minted.repositories.iter().map(|r| serde_json::json!({"full_name": r})).collect::<Vec<_>>(),
                }),
            )
        }
    }
}
