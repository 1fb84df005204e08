//! Sandboxes: the [`SandboxRuntime`] trait over a [`SandboxSpec`] (DESIGN §6.1) and its local backend,
//! [`local::LocalRuntime`]: Debian's `bubblewrap` with new user, mount, pid, net, ipc and uts
//! namespaces, uid 1000 inside an unprivileged host uid, limits and accounting through cgroups.
//!
//! It must never run `bwrap` as root (then the sandbox's uid is host root), never leave a process of a
//! sandbox behind after [`SandboxRuntime::destroy`], and never bind anything of the host that the spec
//! does not name.

pub mod local;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;

/// Resource limits of one sandbox.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Memory (and swap) the sandbox may use; past it the kernel kills (one real agent turn peaked at 278 MiB).
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU cores' worth of time per period; `None` is unlimited.
    pub cpu_cores: Option<f64>,
    /// The size of the sandbox's `/tmp` (a tmpfs, charged to its memory).
    pub tmp_bytes: u64,
    /// The size of the session's own filesystem that holds its `/workspace` and `$HOME`
    /// ([`local::disk::SessionDisk`]). The worker makes and mounts it (it outlives the sandbox, across
    /// hibernation); `create` does not read it. Enforced only when sortie runs as root.
    pub disk_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: 2 << 30,
            pids: 512,
            cpu_cores: None,
            tmp_bytes: 512 << 20,
            disk_bytes: local::disk::DEFAULT_DISK_BYTES,
        }
    }
}

/// Where the sandbox's standard streams go.
#[derive(Clone, Debug)]
pub enum SandboxStdio {
    /// The host process's own (for `sortie sandbox exec`).
    Inherit,
    /// Nowhere: the command speaks over a socket of its own.
    Null,
    /// Stdin is this listening socket, which the host made and keeps the name of outside the
    /// sandbox; stdout is nowhere. The driver serves its API on it (`sortie driver
    /// --listen-on-stdin`), so nothing inside the sandbox holds a name the host connects to.
    Listener(std::sync::Arc<std::os::unix::net::UnixListener>),
}

/// What a sandbox is made of. Every host path must be absolute.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// Unique among live sandboxes: names the cgroups and state files (e.g. the session id).
    pub name: String,
    /// Becomes `/workspace`, writable.
    pub workspace: PathBuf,
    /// Becomes `/home/agent`, writable, kept after the sandbox ends.
    pub home: PathBuf,
    /// Becomes `/run/sortie-egress`, read-only: holds the host's `egress.sock`.
    pub egress_dir: Option<PathBuf>,
    /// Bound read-only at the same path (the agent's install dir, the `sortie` binary's dir, a mirror).
    pub read_only: Vec<PathBuf>,
    /// Bound read-only elsewhere: `(host path, path inside)` (a warm sandbox's empty directory that
    /// receives the session's mirror where the workspace's alternates name it, [`local::slot`]).
    pub read_only_at: Vec<(PathBuf, PathBuf)>,
    /// The workspace and home are a warm slot's, which the host binds a session's over once the
    /// sandbox runs ([`local::slot`]): they stay root's (nothing inside may write under them) and the
    /// command starts in `/`, so no process keeps a way into them.
    pub late_binds: bool,
    /// The whole environment inside (besides HOME, USER, PATH, LANG, TMPDIR, which the runtime sets).
    pub env: Vec<(String, String)>,
    /// The command to run inside, e.g. `sortie driver …`.
    pub command: Vec<String>,
    pub limits: Limits,
    pub stdio: SandboxStdio,
}

/// Paths inside every sandbox.
pub mod inside {
    pub const WORKSPACE: &str = "/workspace";
    pub const HOME: &str = "/home/agent";
    pub const EGRESS_DIR: &str = "/run/sortie-egress";
    pub const EGRESS_SOCKET: &str = "/run/sortie-egress/egress.sock";
    /// The uid and gid of the agent inside.
    pub const UID: u32 = 1000;
}

/// How a sandbox ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxExit {
    /// The command's exit code, if it exited.
    pub code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// The kernel killed a process of the sandbox for exceeding its memory limit.
    pub out_of_memory: bool,
    /// The end of what the command wrote to its stderr (at most [`LAST_WORDS_BYTES`], control
    /// characters removed): the sandbox wrote it, so it is shown, never parsed.
    pub last_words: String,
}

/// How much of a sandbox's stderr an exit carries.
pub const LAST_WORDS_BYTES: usize = 2048;

impl SandboxExit {
    /// A sentence for a failure reason.
    pub fn describe(&self) -> String {
        if self.out_of_memory {
            return "the sandbox ran out of memory: the kernel killed a process that passed its memory limit".into();
        }
        let how = match (self.code, self.signal) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(signal)) => format!("killed by signal {signal}"),
            (None, None) => "ended".into(),
        };
        if self.last_words.is_empty() {
            how
        } else {
            format!("{how}; its last words: {}", self.last_words)
        }
    }
}

/// One process of a sandbox, told apart from a later process that gets the same pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcessStamp {
    pub pid: u32,
    /// When it started, in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub started: u64,
}

/// What a sandbox used, measured by its cgroups.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub peak_memory_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SandboxStatus {
    Created,
    Running,
    Exited(SandboxExit),
}

/// Why a sandbox could not be made or run. The message says what to do; the worker reports it as
/// `SANDBOX_START_FAILED`.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("bubblewrap not found at {0}: apt-get install bubblewrap")]
    BwrapMissing(PathBuf),
    #[error("{0}")]
    Unsupported(String),
    #[error("cgroups unavailable: {0}")]
    Cgroups(String),
    #[error("no sandbox named {0:?}")]
    Unknown(String),
    #[error("a sandbox named {0:?} exists")]
    Exists(String),
    #[error("invalid sandbox spec: {0}")]
    Spec(String),
    #[error("the sandbox did not start: {0}")]
    Start(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

impl SandboxError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}

/// A sandbox backend (DESIGN §6.1).
#[async_trait]
pub trait SandboxRuntime: Send + Sync {
    /// A sandbox is to start soon: the runtime may begin, in the background, what takes long and
    /// needs nothing of it (the local runtime: its cgroup migration's grace period).
    fn start_soon(&self) {}
    /// Prepares a sandbox (cgroups, limits, files) without starting it.
    async fn create(&self, spec: SandboxSpec) -> Result<(), SandboxError>;
    /// Starts its command.
    async fn start(&self, name: &str) -> Result<(), SandboxError>;
    async fn status(&self, name: &str) -> Result<SandboxStatus, SandboxError>;
    /// Waits until the sandbox's command has ended.
    async fn wait(&self, name: &str) -> Result<SandboxExit, SandboxError>;
    /// SIGTERM to the command, then every process of the sandbox is killed after `grace`.
    async fn stop(&self, name: &str, grace: Duration) -> Result<(), SandboxError>;
    /// Kills whatever is left, reports the usage and forgets the sandbox (its workspace and home stay).
    async fn destroy(&self, name: &str) -> Result<Usage, SandboxError>;
    /// Takes over a sandbox `name` that an earlier process of this runtime made and that still runs
    /// (that process died or restarted); from then on it is this runtime's, as if it had started it.
    async fn adopt(&self, name: &str) -> Result<(), SandboxError> {
        Err(SandboxError::Unsupported(format!(
            "this runtime cannot adopt sandbox {name:?}"
        )))
    }

    /// What the sandbox has used since it was made, as its cgroups count it now (cumulative: the
    /// caller meters the difference since its last reading). A runtime that cannot tell says zero.
    async fn usage(&self, _name: &str) -> Result<Usage, SandboxError> {
        Ok(Usage::default())
    }

    /// The processes of a running sandbox now (for [`SandboxRuntime::kill_newer`]).
    async fn processes(&self, _name: &str) -> Result<Vec<ProcessStamp>, SandboxError> {
        Ok(Vec::new())
    }

    /// Kills every process of the sandbox that is not one of `keep` (the processes it had when a turn
    /// began): nothing started during a turn — the agent, a `setsid` child of it — outlives the turn.
    /// Returns how many were killed.
    async fn kill_newer(&self, _name: &str, _keep: &[ProcessStamp]) -> Result<usize, SandboxError> {
        Ok(0)
    }

    /// The host uid and gid that must own a sandbox's writable directories, when the runtime maps
    /// its uid onto a dedicated host uid (the local runtime as root); `None` when no hand-over is needed.
    fn host_owner(&self) -> Option<(u32, u32)> {
        None
    }
    /// Lets the sandbox connect to a Unix socket the host created for it (its `egress.sock`).
    fn grant_socket(&self, _socket: &std::path::Path) -> Result<(), SandboxError> {
        Ok(())
    }
    /// Whether the sandbox can bind `path` (every ancestor searchable by its uid).
    fn is_reachable(&self, _path: &std::path::Path) -> bool {
        true
    }
}
