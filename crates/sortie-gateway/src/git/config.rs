//! One session's git proxy, configured in one place ([`GitProxyConfig`]), and the two things the
//! proxy asks of whoever runs it: where each push it decides on is recorded ([`PushLedger`], the
//! host's own record of what was delivered: DESIGN §9 invariant 9) and which secret values the
//! workspace has ([`KnownSecretsSource`], for the scan of pushed packs: invariant 12).
//!
//! Nothing here is ever filled from what a sandbox says.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sortie_protocol::SessionId;
use sortie_secrets::KnownSecrets;

use crate::git::http::Upstreams;
use crate::git::receive_pack::RefUpdate;

/// What became of one ref update of a push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// The upstream's report-status said `ok <ref>` (and `unpack ok`): the ref now points at `new`.
    Accepted,
    /// The gateway's scan found a secret in the pushed content; nothing reached the upstream.
    SecretDetected { reason: String },
    /// The gateway refused the push (confinement, size, an unreadable pack, a parent it cannot
    /// resolve, a busy session); nothing reached the upstream.
    Refused { reason: String },
    /// The push was forwarded and the upstream did not take it (an `ng` such as a stale lease, a
    /// failed unpack, an HTTP failure, or an answer the proxy could not read: then the ref's state
    /// is unknown, and never counted as delivered).
    UpstreamRejected { reason: String },
}

impl PushOutcome {
    /// A stable name for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::SecretDetected { .. } => "secret_detected",
            Self::Refused { .. } => "refused",
            Self::UpstreamRejected { .. } => "upstream_rejected",
        }
    }
}

/// The git proxy's record of one push it decided on, per ref update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushRecord {
    pub session_id: SessionId,
    /// The update the push asked for; `None` when the proxy refused it before reading a command.
    pub update: Option<RefUpdate>,
    pub outcome: PushOutcome,
}

/// Where the proxy records every push it decides on, before it answers the client (so whoever reads
/// the ledger after `git push` returned sees the push). An accepted push's objects are in the proxy's
/// `delivered_objects` by the time it is recorded.
#[async_trait]
pub trait PushLedger: Send + Sync + 'static {
    async fn record(&self, record: PushRecord);
}

/// The most records [`PushRecords`] keeps.
const PUSH_RECORDS_KEPT: usize = 256;

/// A ledger in memory: the latest records of one proxy (the oldest are dropped past 256).
#[derive(Debug, Default)]
pub struct PushRecords {
    records: Mutex<VecDeque<PushRecord>>,
}

impl PushRecords {
    pub fn records(&self) -> Vec<PushRecord> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Every record since the last take, oldest first (a turn takes those of its own time).
    pub fn take(&self) -> Vec<PushRecord> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(|p| p.into_inner())).into()
    }

    /// The latest push the upstream took: its update names the delivered branch and head.
    pub fn last_accepted(&self) -> Option<PushRecord> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .rev()
            .find(|r| r.outcome == PushOutcome::Accepted)
            .cloned()
    }
}

#[async_trait]
impl PushLedger for PushRecords {
    async fn record(&self, record: PushRecord) {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        if records.len() >= PUSH_RECORDS_KEPT {
            records.pop_front();
        }
        records.push_back(record);
    }
}

/// The workspace's secret values, as digests (asked again for every push: a key set mid-session counts).
#[async_trait]
pub trait KnownSecretsSource: Send + Sync + 'static {
    async fn known_secrets(&self) -> KnownSecrets;
}

/// No known values: only the key formats are looked for.
pub struct NoKnownSecrets;

#[async_trait]
impl KnownSecretsSource for NoKnownSecrets {
    async fn known_secrets(&self) -> KnownSecrets {
        KnownSecrets::default()
    }
}

/// What the proxy does with a local upstream owned by another uid than its own, when it runs as root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForeignOwner {
    /// `git http-backend` runs as the uid and gid that own the repository directory, without
    /// supplementary groups (root's git never works inside a repository root does not own).
    RunAsOwner,
    /// Such a repository is not served at all.
    Refuse,
}

/// Bounds on the git processes one session's proxy runs (S6).
#[derive(Clone, Debug)]
pub struct GitProcessLimits {
    /// Concurrent upstream requests (each a `git http-backend` child for a local upstream).
    pub max_concurrent: usize,
    /// How long a request waits for a free slot before it is refused.
    pub queue_wait: Duration,
    /// A request body that sends nothing for this long is cut off (its child then ends).
    pub body_idle_timeout: Duration,
    /// A child still running this long is killed.
    pub max_lifetime: Duration,
    /// The `cgroup.procs` files every child is written to before it runs anything (the worker's
    /// per-session cgroup with memory and pids limits); empty: no cgroup.
    pub cgroup_procs: Vec<PathBuf>,
    /// The program that parks in the cgroup ahead of each git child (`sortie git-launch`, see
    /// `git::launch`); `None`: each child is forked into the cgroup as it is needed.
    pub launcher: Option<GitLauncher>,
}

/// A command that waits for a launch frame on stdin and becomes the git it names.
#[derive(Clone, Debug)]
pub struct GitLauncher {
    pub program: PathBuf,
    pub args: Vec<std::ffi::OsString>,
}

impl Default for GitProcessLimits {
    fn default() -> Self {
        Self {
            max_concurrent: 4,
            queue_wait: Duration::from_secs(5),
            body_idle_timeout: Duration::from_secs(60),
            max_lifetime: Duration::from_secs(30 * 60),
            cgroup_procs: Vec::new(),
            launcher: None,
        }
    }
}

/// Bounds on one push.
#[derive(Clone, Debug)]
pub struct PushLimits {
    /// A bigger request is refused (also given to receive-pack as `receive.maxInputSize`).
    pub max_push_bytes: u64,
    /// The quarantine and scan of a push must end within this.
    pub scan_deadline: Duration,
    /// How long the upstream's answer to a forwarded push is waited for.
    pub answer_deadline: Duration,
}

impl Default for PushLimits {
    fn default() -> Self {
        Self {
            max_push_bytes: 512 << 20,
            scan_deadline: Duration::from_secs(10 * 60),
            answer_deadline: Duration::from_secs(10 * 60),
        }
    }
}

/// Everything one session's git proxy works with. Every directory is the host's: none of it is
/// ever bound into a sandbox.
#[derive(Clone)]
pub struct GitProxyConfig {
    /// Where the session's repository lives (and the forge token for an `https://` one).
    pub upstreams: Arc<dyn Upstreams>,
    /// The git binary (it provides `http-backend`, `index-pack`, `diff-tree`…).
    pub git: PathBuf,
    /// `git-http-backend` in `git`'s own exec path, run without `git` in front of it (which would
    /// start it as a child of its own and wait: a process fewer per request); `None`: `git
    /// http-backend`.
    pub http_backend: Option<PathBuf>,
    /// For forge upstreams ([`crate::git::http::forge_client`]); `None`: forges answer 502.
    pub forge_http: Option<reqwest::Client>,
    pub ledger: Arc<dyn PushLedger>,
    pub known_secrets: Arc<dyn KnownSecretsSource>,
    /// Where each push is spooled and indexed before it is scanned (one temporary directory per push).
    pub quarantine_dir: PathBuf,
    /// An object directory holding the objects of every push the upstream took, so that a later
    /// push's parents resolve (an alternate of every quarantine).
    pub delivered_objects: PathBuf,
    /// Object directories the host trusts to resolve a push's parents and thin-pack bases, read
    /// only: the session's mirror's, and a local upstream's own.
    pub trusted_object_dirs: Vec<PathBuf>,
    pub foreign_owner: ForeignOwner,
    pub processes: GitProcessLimits,
    pub pushes: PushLimits,
    /// Kept as long as the proxy serves: the worker's guard of the session's git cgroup, which
    /// removes it when dropped.
    pub keep_alive: Option<Arc<dyn Send + Sync>>,
}

/// Where a proxy whose state is in `state_dir` keeps the objects of the pushes the upstream took.
pub fn delivered_objects_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("delivered-objects")
}

impl GitProxyConfig {
    /// A session's proxy with the default bounds: `state_dir` (the host's, never bound into a
    /// sandbox) holds its `quarantine/` and `delivered-objects/`.
    pub fn new(
        upstreams: Arc<dyn Upstreams>,
        git: PathBuf,
        state_dir: &Path,
        ledger: Arc<dyn PushLedger>,
        known_secrets: Arc<dyn KnownSecretsSource>,
    ) -> Self {
        Self {
            upstreams,
            http_backend: installed_http_backend(&git),
            git,
            forge_http: None,
            ledger,
            known_secrets,
            quarantine_dir: state_dir.join("quarantine"),
            delivered_objects: delivered_objects_dir(state_dir),
            trusted_object_dirs: Vec::new(),
            foreign_owner: ForeignOwner::RunAsOwner,
            processes: GitProcessLimits::default(),
            pushes: PushLimits::default(),
            keep_alive: None,
        }
    }
}

/// `git-http-backend` of `git`'s installation (`git --exec-path`, asked once per git binary for the
/// life of the process: the installation is the host's, and a sandbox writes none of it).
fn installed_http_backend(git: &Path) -> Option<PathBuf> {
    static FOUND: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<PathBuf, Option<PathBuf>>>> =
        std::sync::OnceLock::new();
    let found = FOUND.get_or_init(Default::default);
    let mut found = found.lock().unwrap_or_else(|p| p.into_inner());
    found
        .entry(git.to_owned())
        .or_insert_with(|| {
            let output = std::process::Command::new(git)
                .arg("--exec-path")
                .env_clear()
                .env("PATH", super::process::GIT_PATH)
                .output()
                .ok()?;
            let exec_path = String::from_utf8(output.stdout).ok()?;
            let backend = Path::new(exec_path.trim()).join("git-http-backend");
            (output.status.success() && backend.is_absolute() && backend.is_file()).then_some(backend)
        })
        .clone()
}
