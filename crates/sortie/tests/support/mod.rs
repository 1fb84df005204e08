//! Running the real `sortie` binary: a `serve` process on a free port and client commands against it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
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

/// A running `sortie serve`; killed (SIGKILL) when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
    /// Everything it printed on stdout before it listened.
    pub banner: Vec<String>,
}

impl Server {
    /// The control plane and streams only: sessions wait in `queued` (no worker takes them).
    pub fn start(home: &Path, data_dir: &Path, database_url: Option<&str>) -> Server {
        Self::start_with(home, data_dir, database_url, &["--roles", "api,gateway"])
    }

    /// `sortie serve` with extra arguments (e.g. the worker's settings); every role unless they say otherwise.
    pub fn start_with(home: &Path, data_dir: &Path, database_url: Option<&str>, extra: &[&str]) -> Server {
        let mut command = sortie(home);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra);
        if let Some(url) = database_url {
            command.args(["--database-url", url]);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn sortie serve");
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
            if let Some(url) = line.strip_prefix("sortie listening on ") {
                return Server {
                    child,
                    url: url.to_owned(),
                    banner,
                };
            }
            banner.push(line);
        }
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
    fn drop(&mut self) {
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

pub fn git_repo(parent: &Path, name: &str) -> PathBuf {
    let path = parent.join(name);
    let status = Command::new("git")
        .args(["init", "-q"])
        .arg(&path)
        .status()
        .expect("git");
    assert!(status.success());
    std::fs::canonicalize(path).expect("canonical")
}

/// `git` with a fixed identity and default branch and no host or user config; panics with git's
/// stderr if it fails; its stdout, trimmed.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("git")
        .args(["-c", "user.name=seed", "-c", "user.email=seed@sortie.invalid"])
        .args(["-c", "init.defaultBranch=main", "-c", "safe.directory=*"])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", dir)
        .output()
        .expect("git");
    assert!(
        output.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A bare repository `root/upstream.git` whose `main` holds one commit with a README.
pub fn upstream_with_main(root: &Path) -> PathBuf {
    let upstream = root.join("upstream.git");
    git(root, &["init", "-q", "--bare", upstream.to_str().expect("utf-8")]);
    let seed = root.join("seed");
    git(root, &["init", "-q", seed.to_str().expect("utf-8")]);
    std::fs::write(seed.join("README.md"), "hello\n").expect("write");
    git(&seed, &["add", "."]);
    git(&seed, &["commit", "-q", "-m", "first"]);
    git(
        &seed,
        &["push", "-q", upstream.to_str().expect("utf-8"), "HEAD:refs/heads/main"],
    );
    upstream
}
