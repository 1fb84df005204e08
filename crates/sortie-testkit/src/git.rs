//! Real `git` for tests: one command line (a fixed identity, `main` as the default branch, no system
//! or user config read, no prompt) and the repositories tests start from.
//!
//! Every repository a test makes here is owned by the user the test runs as. `safe.directory=*` is
//! set for the test's own git only: it lets a test read a repository the sandbox uid or another user
//! wrote to, which sortie itself never does (DESIGN §9 invariant 11).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `git` in `dir`, configured for tests: identity `sortie-test <test@sortie.invalid>`, branch `main`,
/// no hooks from outside, `HOME` at `dir` (so no user config is read; override with `.env("HOME", …)`).
pub fn command(dir: &Path) -> Command {
    let mut git = Command::new("git");
    git.current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .args([
            "-c",
            "user.name=sortie-test",
            "-c",
            "user.email=test@sortie.invalid",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "safe.directory=*",
            "-c",
            "protocol.file.allow=always",
        ]);
    git
}

/// Runs `git args…` in `dir` and returns its trimmed stdout; panics with both outputs if it fails.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = command(dir).args(args).output().expect("git runs");
    assert_ok(args, &out);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Panics unless `out` is a success, saying what ran and what it printed.
pub fn assert_ok(args: &[&str], out: &Output) {
    assert!(
        out.status.success(),
        "git {args:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The commit `spec` names in `repo` (bare or not), if any.
pub fn rev(repo: &Path, spec: &str) -> Option<String> {
    let out = command(repo)
        .args(["--git-dir"])
        .arg(git_dir(repo))
        .args(["rev-parse", "--verify", "--quiet", spec])
        .output()
        .expect("git runs");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn git_dir(repo: &Path) -> PathBuf {
    let dot_git = repo.join(".git");
    if dot_git.exists() { dot_git } else { repo.to_owned() }
}

/// A new empty repository at `path` (created), canonicalized.
pub fn init(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).expect("repository dir");
    git(path, &["init", "-q"]);
    std::fs::canonicalize(path).expect("canonical repository path")
}

/// A new empty bare repository at `path` (created), canonicalized.
pub fn init_bare(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).expect("repository dir");
    git(path, &["init", "-q", "--bare"]);
    std::fs::canonicalize(path).expect("canonical repository path")
}

/// Writes `files` into the work tree `work`, commits them all with `message`, returns the commit.
pub fn commit_files(work: &Path, files: &[(&str, &[u8])], message: &str) -> String {
    for (name, contents) in files {
        let path = work.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("file's dir");
        }
        std::fs::write(&path, contents).expect("file");
    }
    git(work, &["add", "-A"]);
    git(work, &["commit", "-q", "--allow-empty", "-m", message]);
    git(work, &["rev-parse", "HEAD"])
}

/// A bare repository `root/<name>` whose `main` has one commit (a README), as a forge would hold a
/// project; its seed work tree is `root/<name>.seed`.
pub fn bare_with_main(root: &Path, name: &str) -> PathBuf {
    let seed = init(&root.join(format!("{name}.seed")));
    commit_files(&seed, &[("README.md", b"hello\n")], "first");
    let bare = init_bare(&root.join(name));
    git(
        &seed,
        &["push", "-q", &bare.display().to_string(), "HEAD:refs/heads/main"],
    );
    bare
}
