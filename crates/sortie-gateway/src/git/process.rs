//! How the git proxy runs host-side git (S5, S6): every child joins the session's cgroup (memory and
//! pids limits) between fork and exec, by writing `0` to `cgroup.procs` files the proxy opened as
//! root, so nothing the child runs is ever outside the cgroup and no gate process or round trip stands
//! before git. A child for a repository owned by another uid then drops to that uid and gid, without
//! supplementary groups, and never runs with a config that runs code: hooks are off through
//! `GIT_CONFIG_*` and `safe.directory` is never touched.
//!
//! It must never run git as root inside a repository root does not own.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::AsyncWriteExt;

use super::config::GitLauncher;

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
    #[error("cannot open the session's cgroup ({path}): {source}")]
    Cgroup { path: PathBuf, source: std::io::Error },
}

/// A started child: its stdin, stdout and stderr are piped.
pub(crate) struct Spawned {
    pub child: tokio::process::Child,
    pub stdin: tokio::process::ChildStdin,
    pub stdout: tokio::process::ChildStdout,
    pub stderr: tokio::process::ChildStderr,
}

/// Launchers kept parked while a turn runs: a push takes four children in a row (`index-pack`,
/// `cat-file`, `diff-tree`, `http-backend`), each a few ms apart, faster than one launcher starts; a
/// child that finds none parked is forked into the cgroup and may wait out the grace period there.
pub(crate) const PARKED_LAUNCHERS: usize = 3;

/// Where a session's git children start: in its cgroup (when it has one), each from a launcher
/// parked there ahead while one is wanted and a launcher is configured (see [`super::launch`]), else
/// forked into it.
pub(crate) struct Spawner {
    procs: Vec<PathBuf>,
    launcher: Option<GitLauncher>,
    parked: std::sync::Mutex<Vec<Spawned>>,
    wanted: AtomicBool,
    refilling: AtomicBool,
}

impl Spawner {
    pub fn new(procs: Vec<PathBuf>, launcher: Option<GitLauncher>) -> Arc<Self> {
        Arc::new(Self {
            launcher: launcher.filter(|_| !procs.is_empty()),
            procs,
            parked: std::sync::Mutex::new(Vec::new()),
            wanted: AtomicBool::new(false),
            refilling: AtomicBool::new(false),
        })
    }

    /// Keeps [`PARKED_LAUNCHERS`] parked from now on (another started after each is taken).
    pub fn park(self: &Arc<Self>) {
        self.wanted.store(true, Ordering::SeqCst);
        self.refill();
    }

    /// Parks none any more, and ends those parked: processes of ~2 MiB each an idle session need not hold.
    pub fn unpark(&self) {
        self.wanted.store(false, Ordering::SeqCst);
        self.lock().clear();
    }

    /// Starts `command`: its stdin (past the launch frame), stdout and stderr are piped.
    pub async fn spawn(self: &Arc<Self>, command: GitCommand) -> Result<Spawned, SpawnError> {
        if self.launcher.is_none() {
            return start(command, &self.procs).await;
        }
        let parked = {
            let mut parked = self.lock();
            std::iter::from_fn(|| parked.pop()).find_map(|mut launcher| {
                let running = matches!(launcher.child.try_wait(), Ok(None));
                running.then_some(launcher)
            })
        };
        self.refill();
        if let Some(mut parked) = parked {
            match parked.stdin.write_all(&super::launch::encode(&command)).await {
                Ok(()) => {
                    metrics::counter!("sortie_git_children_total", "start" => "parked").increment(1);
                    return Ok(parked);
                }
                // It died since it was looked at: forked, as if none had been parked.
                Err(error) => tracing::warn!(%error, "a parked git launcher was gone; git is forked into the cgroup"),
            }
        }
        // None parked (not wanted, not yet there, or it died): forked into the cgroup now, the grace
        // period paid here.
        metrics::counter!("sortie_git_children_total", "start" => "forked").increment(1);
        start(command, &self.procs).await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Spawned>> {
        self.parked.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Parks the next launcher, in the background, while they are wanted, fewer than
    /// [`PARKED_LAUNCHERS`] are parked and none is on its way (then the next, until they are all there).
    fn refill(self: &Arc<Self>) {
        let Some(launcher) = &self.launcher else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.wanted.load(Ordering::SeqCst)
            || self.lock().len() >= PARKED_LAUNCHERS
            || self.refilling.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let command = GitCommand {
            git: launcher.program.clone(),
            args: launcher.args.clone(),
            env: Vec::new(),
            identity: None,
        };
        let procs = self.procs.clone();
        let spawner = Arc::downgrade(self);
        runtime.spawn(async move {
            let parked = start(command, &procs).await;
            // A proxy gone meanwhile takes its launcher with it (killed on drop).
            let Some(spawner) = spawner.upgrade() else {
                return;
            };
            let started = parked.is_ok();
            match parked {
                Ok(parked) if spawner.wanted.load(Ordering::SeqCst) => spawner.lock().push(parked),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "cannot park a git launcher; git is forked into the cgroup"),
            }
            spawner.refilling.store(false, Ordering::SeqCst);
            // A failure is not tried again at once: the next child taken tries.
            if started {
                spawner.refill();
            }
        });
    }
}

/// A session's git children, for whoever knows when they will be needed: parked ahead while its
/// turn runs (a fetch, the delivery's push), none while it rests.
#[derive(Clone)]
pub struct GitChildren(pub(crate) Arc<Spawner>);

impl GitChildren {
    pub fn park(&self) {
        self.0.park();
    }

    pub fn unpark(&self) {
        self.0.unpark();
    }
}

/// Starts `command` in the cgroup whose `cgroup.procs` files are `procs`.
async fn start(command: GitCommand, procs: &[PathBuf]) -> Result<Spawned, SpawnError> {
    // Opened here, as this process: the kernel judges a migration by the credentials the file was
    // opened with, so the child may write to it after it dropped to the repository's owner. Every file
    // is opened close-on-exec: git never holds one.
    let cgroups = procs
        .iter()
        .map(|path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|source| SpawnError::Cgroup {
                    path: path.clone(),
                    source,
                })
        })
        .collect::<Result<Vec<std::fs::File>, SpawnError>>()?;
    let identity = command.identity;
    let mut process = tokio::process::Command::new(&command.git);
    process
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
    super::child::confine(&mut process, cgroups, identity);
    // The spawn returns once the child has exec'd (after its cgroup migration, which may wait out a
    // grace period): never on a runtime thread, which would serve nothing else meanwhile (milliseconds a
    // spawn, under load).
    let mut child = tokio::task::spawn_blocking(move || process.spawn())
        .await
        .unwrap_or_else(|joined| Err(std::io::Error::other(joined)))
        .map_err(SpawnError::Start)?;
    let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(SpawnError::Start(std::io::Error::other("no pipes")));
    };
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
