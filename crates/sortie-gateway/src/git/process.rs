//! How the git proxy runs host-side git (S5, S6): every child starts as a tiny `sh` gate that waits
//! for one line on its stdin; meanwhile the proxy writes the child's pid into the session's cgroup
//! (memory and pids limits), then releases the gate, so nothing the child runs is ever outside the
//! cgroup. A child for a repository owned by another uid runs as that uid and gid, without
//! supplementary groups (std's `CommandExt::uid` clears them when it drops root), and never with a
//! config that runs code: hooks are off through `GIT_CONFIG_*` and `safe.directory` is never touched.
//!
//! It must never run git as root inside a repository root does not own.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

/// Waits for the go line (the proxy has placed the pid in the cgroup by then), then becomes git.
const GATE: &str = r#"IFS= read -r _ || exit 97; exec "$@""#;

/// The only `PATH` host-side git gets.
pub(crate) const GIT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// A uid and gid a child runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// Who must run git in `repo`: `None` for this process; `Some(owner)` when this process is root and
/// the repository belongs to another uid.
pub(crate) fn identity_for(repo: &Path) -> std::io::Result<Option<Identity>> {
    let metadata = std::fs::metadata(repo)?;
    let this = nix::unistd::geteuid().as_raw();
    if this == 0 && metadata.uid() != 0 {
        return Ok(Some(Identity {
            uid: metadata.uid(),
            gid: metadata.gid(),
        }));
    }
    Ok(None)
}

/// One git child to run.
pub(crate) struct GitCommand {
    pub git: PathBuf,
    pub args: Vec<OsString>,
    /// The whole environment (nothing of this process's is inherited).
    pub env: Vec<(OsString, OsString)>,
    pub identity: Option<Identity>,
}

impl GitCommand {
    pub fn new(git: &Path) -> Self {
        Self {
            git: git.to_owned(),
            args: Vec::new(),
            env: vec![("PATH".into(), GIT_PATH.into()), ("LC_ALL".into(), "C".into())],
            identity: None,
        }
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Git configuration through `GIT_CONFIG_COUNT`/`KEY_n`/`VALUE_n` (inherited by git's own
    /// children, unlike `-c` through a local transport; never in argv).
    pub fn config(mut self, pairs: &[(&str, String)]) -> Self {
        self.env
            .push(("GIT_CONFIG_COUNT".into(), pairs.len().to_string().into()));
        for (index, (key, value)) in pairs.iter().enumerate() {
            self.env.push((format!("GIT_CONFIG_KEY_{index}").into(), (*key).into()));
            self.env
                .push((format!("GIT_CONFIG_VALUE_{index}").into(), value.into()));
        }
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum SpawnError {
    #[error("cannot start git: {0}")]
    Start(std::io::Error),
    #[error("cannot place git in the session's cgroup ({path}): {source}")]
    Cgroup { path: PathBuf, source: std::io::Error },
    #[error("git ended before it was released")]
    Gate(std::io::Error),
}

/// A started child: its stdin (past the gate), stdout and stderr are piped.
pub(crate) struct Spawned {
    pub child: tokio::process::Child,
    pub stdin: tokio::process::ChildStdin,
    pub stdout: tokio::process::ChildStdout,
    pub stderr: tokio::process::ChildStderr,
}

/// Starts `command` in the cgroup whose `cgroup.procs` files are `procs`.
pub(crate) async fn spawn(command: GitCommand, procs: &[PathBuf]) -> Result<Spawned, SpawnError> {
    let mut process = tokio::process::Command::new("/bin/sh");
    process
        .arg("-c")
        .arg(GATE)
        .arg("sh")
        .arg(&command.git)
        .args(&command.args)
        .env_clear()
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own: `git http-backend` runs `git-http-backend` as a child, which a kill of
        // the first alone would orphan.
        .process_group(0)
        .kill_on_drop(true);
    if let Some(identity) = command.identity {
        // gid first, then uid; as root, std also clears the supplementary groups (setgroups(0)).
        process.gid(identity.gid).uid(identity.uid);
    }
    let mut child = process.spawn().map_err(SpawnError::Start)?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(SpawnError::Start(std::io::Error::other("no pipes")));
    };
    if !procs.is_empty() {
        let Some(pid) = child.id() else {
            return Err(SpawnError::Gate(std::io::Error::other("the child is gone")));
        };
        for path in procs {
            // The child waits at the gate: nothing of it runs outside the cgroup.
            if let Err(source) = tokio::fs::write(path, pid.to_string()).await {
                let _ = child.start_kill();
                return Err(SpawnError::Cgroup {
                    path: path.clone(),
                    source,
                });
            }
        }
    }
    stdin.write_all(b"\n").await.map_err(SpawnError::Gate)?;
    Ok(Spawned {
        child,
        stdin,
        stdout,
        stderr,
    })
}

/// Kills a child started by [`spawn`] and every process of its group (what git started for it),
/// then reaps it.
pub(crate) async fn kill_all(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    let _ = child.kill().await;
}

/// The last lines of a child's stderr, for a reason (bounded).
pub(crate) fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(2)..].join(" / ");
    tail.chars().take(240).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_goes_through_the_environment() {
        let command = GitCommand::new(Path::new("git")).config(&[
            ("core.hooksPath", "/dev/null".into()),
            ("http.receivepack", "true".into()),
        ]);
        let env: Vec<(String, String)> = command
            .env
            .iter()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect();
        for pair in [
            ("GIT_CONFIG_COUNT", "2"),
            ("GIT_CONFIG_KEY_0", "core.hooksPath"),
            ("GIT_CONFIG_VALUE_0", "/dev/null"),
            ("GIT_CONFIG_KEY_1", "http.receivepack"),
        ] {
            assert!(env.contains(&(pair.0.to_owned(), pair.1.to_owned())), "{pair:?}");
        }
        assert!(command.args.is_empty());
    }

    #[test]
    fn stderr_tails_are_short() {
        assert_eq!(stderr_tail(b"a\n\nb\nc\n"), "b / c");
        assert_eq!(stderr_tail(&vec![b'x'; 10_000]).len(), 240);
    }
}
