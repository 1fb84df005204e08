//! Running the real `sortie` binary: a `serve` process on a free port and client commands against it.

#![allow(dead_code)]

pub mod world;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pub const BINARY: &str = env!("CARGO_BIN_EXE_sortie");

/// An HTTP client builder; the process's TLS provider (ring) is installed first, as reqwest needs.
pub fn http_builder() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}

pub fn http_client() -> reqwest::Client {
    http_builder().build().expect("http client")
}

/// A command of the binary with a clean environment: no inherited SORTIE_* settings, a private HOME.
pub fn sortie(home: &Path) -> Command {
    let mut command = Command::new(BINARY);
    for (key, _) in std::env::vars() {
        if key.starts_with("SORTIE_") || key == "XDG_DATA_HOME" {
            command.env_remove(key);
        }
    }
    command.env("HOME", home).env("SORTIE_LOG", "warn").stdin(Stdio::null());
    command
}

/// What `serve` prints once it listens for clients.
pub const LISTENING: &str = "sortie listening on ";
/// What `serve --roles worker --feed-listen …` prints once its feed listens.
pub const WORKER_FEED: &str = "sortie worker feed on ";

/// A workspace `e2e` that may use local repositories under `root`, made on the store at `database_url`
/// with the admin command, and an operator token for it (a shared database's `default` workspace may use
/// no local repository).
pub fn operator_token_on(root: &Path, database_url: &str) -> String {
    let made = sortie(root)
        .args(["workspace", "create", "e2e", "--allow-root"])
        .arg(root)
        .args(["--database-url", database_url])
        .output()
        .expect("workspace create");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let token = sortie(root)
        .args([
            "token",
            "create",
            "--workspace",
            "e2e",
            "--role",
            "operator",
            "--database-url",
            database_url,
        ])
        .output()
        .expect("token create");
    assert!(token.status.success(), "{}", String::from_utf8_lossy(&token.stderr));
    String::from_utf8_lossy(&token.stdout).trim().to_owned()
}

/// A running `sortie serve`; killed (SIGKILL) when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
    /// Everything it printed on stdout before it listened.
    pub banner: Vec<String>,
    /// Everything it logged (stderr), also passed on to this process's stderr.
    log: Arc<Mutex<String>>,
}

impl Server {
    /// The control plane and streams only: sessions wait in `queued` (no worker takes them).
    pub fn start(home: &Path, data_dir: &Path, database_url: Option<&str>) -> Server {
        Self::start_with(home, data_dir, database_url, &["--roles", "api,gateway"])
    }

    /// `sortie serve` with extra arguments (e.g. the worker's settings); every role unless they say otherwise.
    pub fn start_with(home: &Path, data_dir: &Path, database_url: Option<&str>, extra: &[&str]) -> Server {
        Self::start_announcing(home, data_dir, database_url, extra, &[], LISTENING)
    }

    /// `sortie serve` with extra arguments and environment, ready once it prints a line starting with
    /// `ready` (its `url` is the rest of that line): [`LISTENING`] for the api and gateway roles,
    /// [`WORKER_FEED`] for a worker alone.
    pub fn start_announcing(
        home: &Path,
        data_dir: &Path,
        database_url: Option<&str>,
        extra: &[&str],
        environment: &[(&str, &str)],
        ready: &str,
    ) -> Server {
        let mut command = sortie(home);
        command.envs(environment.iter().copied());
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra);
        if let Some(url) = database_url {
            command.args(["--database-url", url]);
        }
        // Egress decisions are logged at info; everything else at warn keeps test output short. A
        // sandbox that outlives a killed server waits a short orphan grace for the next one to adopt it.
        command
            .env("SORTIE_LOG", "warn,sortie_gateway::egress=info")
            .env("SORTIE_SANDBOX_ORPHAN_GRACE", "20");
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sortie serve");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(std::io::stderr(), "{line}");
                let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
                kept.push_str(&line);
                kept.push('\n');
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let (lines_tx, lines_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut banner = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = lines_rx.recv_timeout(left) else {
                let _ = child.kill();
                let _ = child.wait();
                panic!("sortie serve did not report its address in time; printed {banner:?}");
            };
            if let Some(url) = line.strip_prefix(ready) {
                return Server {
                    child,
                    url: url.to_owned(),
                    banner,
                    log,
                };
            }
            banner.push(line);
        }
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// SIGKILL, no chance to flush anything, and wait for it to be gone.
    pub fn kill_hard(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A client command against this server, with the given data dir (its admin token is the credential).
    pub fn client(&self, home: &Path, data_dir: &Path, args: &[&str]) -> Output {
        sortie(home)
            .arg("--server")
            .arg(&self.url)
            .arg("--data-dir")
            .arg(data_dir)
            .args(args)
            .output()
            .expect("run client")
    }
}

impl Drop for Server {
    /// SIGTERM first (the worker destroys its warm sandboxes), SIGKILL after 5 s.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub use sortie_testkit::git::git;

/// An empty repository `parent/<name>`.
pub fn git_repo(parent: &Path, name: &str) -> PathBuf {
    sortie_testkit::git::init(&parent.join(name))
}

/// A bare repository `root/upstream.git` whose `main` holds one commit with a README.
pub fn upstream_with_main(root: &Path) -> PathBuf {
    sortie_testkit::git::bare_with_main(root, "upstream.git")
}

/// Host pids of the processes of the sandbox of `session`: its `sortie driver` and everything under it.
pub fn sandbox_pids(session: &str) -> Vec<u32> {
    let mut driver = None;
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.get(1).is_some_and(|a| a == "driver") && args.windows(2).any(|w| w[0] == "--session" && w[1] == session)
        {
            driver = Some(pid);
        }
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        parents.push((pid, ppid));
    }
    let Some(driver) = driver else { return Vec::new() };
    let mut tree = vec![driver];
    let mut grew = true;
    while grew {
        grew = false;
        for (pid, ppid) in &parents {
            if tree.contains(ppid) && !tree.contains(pid) {
                tree.push(*pid);
                grew = true;
            }
        }
    }
    tree
}

/// What a search of a directory tree saw: every regular file read, and those holding the needle.
pub struct FileScan {
    pub read: Vec<PathBuf>,
    pub holding: Vec<PathBuf>,
}

/// Reads every regular file under `root` (not following links) and notes those holding `needle`. A
/// file or directory that exists but cannot be read fails the test: a search that skips what it
/// cannot open proves nothing.
pub fn scan_files(root: &Path, needle: &[u8]) -> FileScan {
    let mut scan = FileScan {
        read: Vec::new(),
        holding: Vec::new(),
    };
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => panic!("cannot stat {}: {error}", path.display()),
        };
        if meta.is_dir() {
            let entries = std::fs::read_dir(&path).unwrap_or_else(|e| panic!("cannot list {}: {e}", path.display()));
            pending.extend(entries.flatten().map(|e| e.path()));
        } else if meta.is_file() {
            let bytes = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => panic!("cannot read {}: {error}", path.display()),
            };
            if bytes.windows(needle.len()).any(|w| w == needle) {
                scan.holding.push(path.clone());
            }
            scan.read.push(path);
        }
    }
    scan
}

/// Every file named `name` under `root` (symlinks not followed), with its size.
pub fn scan_sizes(root: &Path, name: &str) -> Vec<(PathBuf, u64)> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                pending.extend(entries.flatten().map(|e| e.path()));
            }
        } else if meta.is_file() && path.file_name().is_some_and(|n| n == name) {
            found.push((path, meta.len()));
        }
    }
    found
}

/// Asserts that `needle` is in no process of the session's live sandbox (environment, argv) and in
/// no file under its `/workspace`, `$HOME` and `/tmp`, and that the search really looked: the
/// driver's environment was read, and the workspace's git metadata and the home were walked.
pub fn assert_not_in_sandbox(session: &str, needle: &str, what: &str) {
    let pids = sandbox_pids(session);
    assert!(!pids.is_empty(), "{what}: the session's sandbox is not running");
    let mut environments_read = 0;
    for pid in &pids {
        for file in ["environ", "cmdline"] {
            let bytes = match std::fs::read(format!("/proc/{pid}/{file}")) {
                Ok(bytes) => bytes,
                // A short-lived process of the sandbox ended meanwhile.
                Err(error) if error.raw_os_error() == Some(3) || error.kind() == std::io::ErrorKind::NotFound => {
                    continue;
                }
                Err(error) => panic!("{what}: cannot read /proc/{pid}/{file}: {error}"),
            };
            if file == "environ" && !bytes.is_empty() {
                environments_read += 1;
            }
            assert!(
                !bytes.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{what}: the secret is in /proc/{pid}/{file}"
            );
        }
    }
    assert!(environments_read > 0, "{what}: no environment of the sandbox was read");
    let inside = PathBuf::from(format!("/proc/{}/root", pids[0]));
    for dir in ["workspace", "home/agent", "tmp"] {
        let scan = scan_files(&inside.join(dir), needle.as_bytes());
        assert!(scan.holding.is_empty(), "{what}: the secret is in {:?}", scan.holding);
        if dir != "tmp" {
            assert!(!scan.read.is_empty(), "{what}: nothing was read under /{dir}");
        }
        if dir == "workspace" {
            assert!(
                scan.read.iter().any(|p| p.ends_with(".git/config")),
                "{what}: the workspace's git config was not read"
            );
        }
    }
}
