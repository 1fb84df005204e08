//! The local backend: `bwrap` as a subprocess, never as root.
//!
//! As root, bwrap's process joins the sandbox's cgroups, takes the status file as fd 3 and drops to
//! the dedicated unprivileged sandbox uid between fork and exec ([`child::Confinement`]): inside, the
//! agent is uid 1000; on the host, every process of the sandbox is that uid and owns nothing of the
//! host's. Run without root, bwrap runs as the invoking user. The process is spawned from a thread that
//! lives as long as the sandbox (the parent-death signal follows the spawning thread), and teardown
//! kills every pid in the sandbox's cgroup whatever bwrap did.
//!
//! With a [`Keeper`] (what `sortie serve` uses), bwrap's parent is instead a small keeper process of
//! its own, which confines bwrap the same way, so a sandbox outlives a restart of the process that
//! made it and the next one can [`adopt`](SandboxRuntime::adopt) it; the keeper kills its sandbox once
//! no runtime has renewed its lease for the orphan grace, so nothing runs unowned for long.

pub mod bwrap;
pub mod cgroup;
pub mod child;
pub mod disk;
pub mod keeper;
pub mod priority;
pub mod slot;

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::watch;

use crate::{ProcessStamp, SandboxError, SandboxExit, SandboxRuntime, SandboxSpec, SandboxStatus, SandboxStdio, Usage};
use cgroup::{Cgroup, CgroupVersion};

/// The host uid (and gid) sandboxes run as when sortie runs as root. It needs no passwd entry.
pub const DEFAULT_SANDBOX_UID: u32 = 61_000;
/// How long `start` waits for bwrap to report the sandbox's pid.
const START_DEADLINE: Duration = Duration::from_secs(10);

/// The process that holds a sandbox's bwrap in place of the runtime's own process: `program args…
/// --lease FILE --grace-secs N -- COMMAND…` runs COMMAND, exits as it exits, and SIGKILLs it once FILE
/// has not been touched for N seconds (`sortie sandbox keep`).
#[derive(Clone, Debug)]
pub struct Keeper {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// How long a sandbox runs on after its runtime's process is gone, waiting to be adopted.
    pub orphan_grace: Duration,
}

#[derive(Clone, Debug)]
pub struct LocalConfig {
    pub bwrap: PathBuf,
    pub cgroup_root: PathBuf,
    /// Per-sandbox state (the `/etc` files, bwrap's status); must be reachable by the sandbox uid.
    pub state_dir: PathBuf,
    pub sandbox_uid: u32,
    pub sandbox_gid: u32,
    /// `None`: sandboxes die with this process (bwrap's parent-death signal).
    pub keeper: Option<Keeper>,
}

impl LocalConfig {
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            bwrap: PathBuf::from("/usr/bin/bwrap"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            state_dir,
            sandbox_uid: DEFAULT_SANDBOX_UID,
            sandbox_gid: DEFAULT_SANDBOX_UID,
            keeper: None,
        }
    }
}

struct Entry {
    /// `None` for a sandbox adopted from an earlier process (it runs; it is never started again).
    spec: Option<SandboxSpec>,
    cgroup: Arc<Cgroup>,
    state_dir: PathBuf,
    pid: Option<u32>,
    exit: Option<watch::Receiver<Option<SandboxExit>>>,
}

type Entries = Arc<Mutex<HashMap<String, Entry>>>;

pub struct LocalRuntime {
    config: LocalConfig,
    cgroups: CgroupVersion,
    as_root: bool,
    sandboxes: Entries,
}

/// The file whose age tells a sandbox's keeper that its runtime is gone.
fn lease_file(state_dir: &Path) -> PathBuf {
    state_dir.join("lease")
}

fn renew_lease(path: &Path) -> std::io::Result<()> {
    std::fs::File::options()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?
        .set_modified(std::time::SystemTime::now())
}

/// Renews the lease of every sandbox the runtime holds, until the runtime is dropped.
fn spawn_lease_renewal(entries: &Entries, grace: Duration) {
    let entries = Arc::downgrade(entries);
    let every = (grace / 4).clamp(Duration::from_millis(250), Duration::from_secs(15));
    let _ = std::thread::Builder::new()
        .name("sandbox-leases".into())
        .spawn(move || {
            while let Some(entries) = entries.upgrade() {
                let dirs: Vec<PathBuf> = entries
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .map(|entry| entry.state_dir.clone())
                    .collect();
                drop(entries);
                for dir in dirs {
                    let _ = renew_lease(&lease_file(&dir));
                }
                std::thread::sleep(every);
            }
        });
}

impl LocalRuntime {
    /// Checks the host (bwrap, cgroups) and returns a runtime, or says what is missing.
    pub fn new(config: LocalConfig) -> Result<Self, SandboxError> {
        if !config.bwrap.is_file() {
            return Err(SandboxError::BwrapMissing(config.bwrap.clone()));
        }
        let as_root = nix::unistd::geteuid().is_root();
        if as_root && config.sandbox_uid == 0 {
            return Err(SandboxError::Unsupported("the sandbox uid must not be 0".into()));
        }
        let cgroups = cgroup::detect(&config.cgroup_root)?;
        std::fs::create_dir_all(&config.state_dir).map_err(SandboxError::io(format!(
            "cannot create {}",
            config.state_dir.display()
        )))?;
        let sandboxes: Entries = Arc::default();
        if let Some(keeper) = &config.keeper {
            spawn_lease_renewal(&sandboxes, keeper.orphan_grace);
        }
        Ok(Self {
            config,
            cgroups,
            as_root,
            sandboxes,
        })
    }

    /// The host uid processes of a sandbox run as.
    pub fn host_uid(&self) -> u32 {
        if self.as_root {
            self.config.sandbox_uid
        } else {
            nix::unistd::geteuid().as_raw()
        }
    }

    /// The host pid of a started sandbox's outer bwrap (tests use it to kill bwrap mid-setup).
    pub fn host_pid(&self, name: &str) -> Option<u32> {
        self.lock().get(name).and_then(|entry| entry.pid)
    }

    /// Makes a host-side Unix socket (e.g. `egress.sock`) connectable from inside the sandbox.
    pub fn grant_socket(&self, socket: &Path) -> Result<(), SandboxError> {
        if self.as_root {
            std::os::unix::fs::chown(socket, Some(self.config.sandbox_uid), Some(self.config.sandbox_gid)).map_err(
                SandboxError::io(format!("cannot hand {} to the sandbox uid", socket.display())),
            )?;
        }
        Ok(())
    }

    fn cgroup_of(&self, name: &str) -> Result<Arc<Cgroup>, SandboxError> {
        self.lock()
            .get(name)
            .map(|entry| entry.cgroup.clone())
            .ok_or_else(|| SandboxError::Unknown(name.to_owned()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.sandboxes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the sandbox uid can reach `path` (bwrap opens every bind source as that uid): every
    /// ancestor directory must be searchable by it.
    pub fn is_reachable(&self, path: &Path) -> bool {
        self.unreachable_parent(path).is_none()
    }

    /// The first directory above `path` the sandbox uid may not search: what keeps it from `path`.
    /// `None` when it can reach it, or when sandboxes run as this user.
    pub fn unreachable_parent(&self, path: &Path) -> Option<PathBuf> {
        if !self.as_root {
            return None;
        }
        unreachable_parent(self.config.sandbox_uid, self.config.sandbox_gid, path)
    }

    fn validate(&self, spec: &SandboxSpec) -> Result<(), SandboxError> {
        let name_ok = !spec.name.is_empty()
            && spec.name.len() <= 64
            && spec
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(SandboxError::Spec(format!(
                "sandbox name {:?}: 1 to 64 letters, digits, '-' or '_'",
                spec.name
            )));
        }
        if spec.command.is_empty() {
            return Err(SandboxError::Spec("no command to run".into()));
        }
        let mut paths: Vec<&Path> = vec![&spec.workspace, &spec.home];
        paths.extend(spec.egress_dir.as_deref());
        paths.extend(spec.read_only.iter().map(PathBuf::as_path));
        paths.extend(spec.read_only_at.iter().map(|(from, _)| from.as_path()));
        if let Some((_, to)) = spec.read_only_at.iter().find(|(_, to)| !to.is_absolute()) {
            return Err(SandboxError::Spec(format!("{} must be an absolute path", to.display())));
        }
        for path in paths {
            if !path.is_absolute() || !path.exists() {
                return Err(SandboxError::Spec(format!(
                    "{} must be an existing absolute path",
                    path.display()
                )));
            }
            if !self.is_reachable(path) {
                return Err(SandboxError::Spec(format!(
                    "{} is not reachable by the sandbox uid {}: a parent directory is not searchable by it (mode o+x); keep sandbox directories under such a directory",
                    path.display(),
                    self.config.sandbox_uid
                )));
            }
        }
        Ok(())
    }

    /// Hands the writable directories to the sandbox uid (as root).
    fn hand_over(&self, spec: &SandboxSpec) -> Result<(), SandboxError> {
        if !self.as_root || spec.late_binds {
            return Ok(());
        }
        for dir in [&spec.workspace, &spec.home] {
            chown_tree(dir, self.config.sandbox_uid, self.config.sandbox_gid).map_err(SandboxError::io(format!(
                "cannot hand {} to the sandbox uid",
                dir.display()
            )))?;
        }
        Ok(())
    }
}

/// The first directory above `path` that `uid`/`gid` (without supplementary groups) may not search,
/// or `None`. A directory that does not exist yet is passed over: whoever makes it chooses its mode.
pub fn unreachable_parent(uid: u32, gid: u32, path: &Path) -> Option<PathBuf> {
    path.ancestors()
        .skip(1)
        .filter(|dir| !dir.as_os_str().is_empty())
        .find(|dir| match std::fs::metadata(dir) {
            Ok(meta) => {
                let mode = meta.permissions().mode();
                !((meta.uid() == uid && mode & 0o100 != 0)
                    || (meta.gid() == gid && mode & 0o010 != 0)
                    || mode & 0o001 != 0)
            }
            Err(error) => error.kind() != std::io::ErrorKind::NotFound,
        })
        .map(Path::to_path_buf)
}

/// When each of `pids` started; a pid that is gone is left out.
fn stamps(pids: &[i32]) -> Vec<ProcessStamp> {
    pids.iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some(ProcessStamp {
                pid: u32::try_from(*pid).ok()?,
                started: start_time(&stat)?,
            })
        })
        .collect()
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line; the command name (field 2) may hold spaces
/// and parentheses, so fields are counted from the last `)`.
fn start_time(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// `chown -R` without following symlinks (a link inside must not make us chown a host file).
pub fn chown_tree(root: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.uid() != uid || meta.gid() != gid {
            std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(())
}

fn exit_of(status: std::process::ExitStatus, out_of_memory: bool, stderr_file: &Path) -> SandboxExit {
    use std::os::unix::process::ExitStatusExt;
    SandboxExit {
        code: status.code(),
        signal: status.signal(),
        out_of_memory,
        last_words: last_words(stderr_file),
    }
}

/// The last [`LAST_WORDS_BYTES`] of a stderr log the sandbox wrote, as one line of text: it may be
/// gigabytes long and hold anything, so only its end is read and everything but printable text
/// is dropped.
fn last_words(stderr_file: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(stderr_file) else {
        return String::new();
    };
    let length = file.metadata().map(|meta| meta.len()).unwrap_or(0);
    let start = length.saturating_sub(crate::LAST_WORDS_BYTES as u64);
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut tail = Vec::with_capacity(crate::LAST_WORDS_BYTES);
    if file
        .take(crate::LAST_WORDS_BYTES as u64)
        .read_to_end(&mut tail)
        .is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&tail);
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|line| !line.is_empty()).collect();
    // A cut first line is only a fragment; the next ones say more.
    let lines = if start > 0 && lines.len() > 1 {
        &lines[1..]
    } else {
        &lines[..]
    };
    lines.join(" | ").chars().filter(|c| !c.is_control()).collect()
}

/// The sandbox's pid 1 as bwrap reported it on its status fd, once the namespaces exist.
fn child_pid(status_file: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(status_file).ok()?;
    text.lines().find_map(|line| {
        let after_key = &line[line.find("\"child-pid\"")? + "\"child-pid\"".len()..];
        let value = after_key.trim_start().strip_prefix(':')?.trim_start();
        let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    })
}

#[async_trait]
impl SandboxRuntime for LocalRuntime {
    fn host_owner(&self) -> Option<(u32, u32)> {
        self.as_root
            .then_some((self.config.sandbox_uid, self.config.sandbox_gid))
    }

    fn grant_socket(&self, socket: &Path) -> Result<(), SandboxError> {
        LocalRuntime::grant_socket(self, socket)
    }

    fn is_reachable(&self, path: &Path) -> bool {
        LocalRuntime::is_reachable(self, path)
    }

    async fn create(&self, spec: SandboxSpec) -> Result<(), SandboxError> {
        self.validate(&spec)?;
        if self.lock().contains_key(&spec.name) {
            return Err(SandboxError::Exists(spec.name));
        }
        self.hand_over(&spec)?;
        let state_dir = self.config.state_dir.join(&spec.name);
        let etc = state_dir.join("etc");
        std::fs::create_dir_all(&etc).map_err(SandboxError::io(format!("cannot create {}", etc.display())))?;
        for dir in [&state_dir, &etc] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(SandboxError::io("cannot open the state dir"))?;
        }
        for (name, content) in bwrap::ETC_FILES {
            let path = etc.join(name);
            std::fs::write(&path, content).map_err(SandboxError::io(format!("cannot write {}", path.display())))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
                .map_err(SandboxError::io("cannot chmod"))?;
        }
        let cgroup = Arc::new(Cgroup::create(
            self.cgroups,
            &self.config.cgroup_root,
            &spec.name,
            &spec.limits,
        )?);
        let name = spec.name.clone();
        self.lock().insert(
            name,
            Entry {
                spec: Some(spec),
                cgroup,
                state_dir,
                pid: None,
                exit: None,
            },
        );
        Ok(())
    }

    fn start_soon(&self) {
        if self.as_root {
            cgroup::start_migration_grace(&self.config.cgroup_root, self.cgroups);
        }
    }

    async fn start(&self, name: &str) -> Result<(), SandboxError> {
        let (spec, cgroup, state_dir) = {
            let sandboxes = self.lock();
            let entry = sandboxes
                .get(name)
                .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
            let Some(spec) = entry.spec.clone().filter(|_| entry.exit.is_none()) else {
                return Err(SandboxError::Start(format!("sandbox {name:?} was already started")));
            };
            (spec, entry.cgroup.clone(), entry.state_dir.clone())
        };
        let status_file = state_dir.join("status.json");
        let stderr_file = state_dir.join("stderr.log");
        let args = bwrap::arguments(&spec, &state_dir.join("etc"), child::STATUS_FD, |path| path.exists());
        let procs = cgroup.procs_files();
        let drop_to = self
            .as_root
            .then_some((self.config.sandbox_uid, self.config.sandbox_gid));

        let mut command = match &self.config.keeper {
            Some(keeper) => {
                let lease = lease_file(&state_dir);
                renew_lease(&lease).map_err(SandboxError::io("cannot write the sandbox's lease"))?;
                let mut command = Command::new(&keeper.program);
                command
                    .args(&keeper.args)
                    .arg("--lease")
                    .arg(&lease)
                    .arg("--grace-secs")
                    .arg(keeper.orphan_grace.as_secs().max(1).to_string());
                // The keeper confines bwrap as this process would.
                for path in &procs {
                    command.arg("--cgroup-procs").arg(path);
                }
                command.arg("--status-file").arg(&status_file);
                if let Some((uid, gid)) = drop_to {
                    command
                        .arg("--uid")
                        .arg(uid.to_string())
                        .arg("--gid")
                        .arg(gid.to_string());
                }
                command.arg("--").arg(&self.config.bwrap);
                // Its own process group: a signal to this process's group (a terminal's Ctrl-C) is not
                // the sandbox's end.
                std::os::unix::process::CommandExt::process_group(&mut command, 0);
                command
            }
            None => {
                let mut command = Command::new(&self.config.bwrap);
                child::Confinement::prepare(&procs, &status_file, drop_to)
                    .map_err(SandboxError::io("cannot prepare the sandbox's cgroups and status file"))?
                    .apply(&mut command);
                command
            }
        };
        command.args(&args);
        // Nothing of the host process's environment or working directory reaches bwrap.
        command
            .current_dir("/")
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
        match &spec.stdio {
            SandboxStdio::Inherit => {
                command
                    .stdin(Stdio::inherit())
                    .stdout(Stdio::inherit())
                    .stderr(Stdio::inherit());
            }
            SandboxStdio::Null => {
                let log = std::fs::File::create(&stderr_file)
                    .map_err(SandboxError::io("cannot create the sandbox's stderr log"))?;
                command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
            }
            SandboxStdio::Listener(listener) => {
                let log = std::fs::File::create(&stderr_file)
                    .map_err(SandboxError::io("cannot create the sandbox's stderr log"))?;
                // The keeper and bwrap each pass stdin on to the command.
                let listener = std::os::fd::OwnedFd::from(
                    listener
                        .try_clone()
                        .map_err(SandboxError::io("cannot hand the driver socket to the sandbox"))?,
                );
                command.stdin(Stdio::from(listener)).stdout(Stdio::null()).stderr(log);
            }
        }

        // Spawned and waited on from a thread of its own that lives as long as the sandbox: bwrap's
        // parent-death signal fires when the spawning thread ends, not the process.
        let (spawned_tx, spawned) = std::sync::mpsc::channel();
        let (exit_tx, exit_rx) = watch::channel(None);
        let waiter_cgroup = cgroup.clone();
        let waiter_stderr = stderr_file.clone();
        std::thread::Builder::new()
            .name(format!("sandbox-{name}"))
            .spawn(move || {
                let spawned = command.spawn();
                // The command holds what its child was confined with (cgroup files opened as root,
                // the status file): none of it is this thread's to keep while the sandbox runs.
                drop(command);
                match spawned {
                    Ok(mut child) => {
                        let _ = spawned_tx.send(Ok(child.id()));
                        let exit = match child.wait() {
                            Ok(status) => exit_of(status, waiter_cgroup.out_of_memory(), &waiter_stderr),
                            Err(_) => SandboxExit {
                                code: None,
                                signal: None,
                                out_of_memory: waiter_cgroup.out_of_memory(),
                                last_words: last_words(&waiter_stderr),
                            },
                        };
                        exit_tx.send_replace(Some(exit));
                    }
                    Err(error) => {
                        let _ = spawned_tx.send(Err(error));
                    }
                }
            })
            .map_err(SandboxError::io("cannot start the sandbox's thread"))?;
        let pid = match spawned.recv() {
            Ok(Ok(pid)) => pid,
            Ok(Err(error)) => {
                return Err(SandboxError::Start(format!(
                    "cannot run {}: {error}",
                    self.config
                        .keeper
                        .as_ref()
                        .map_or(&self.config.bwrap, |keeper| &keeper.program)
                        .display()
                )));
            }
            Err(_) => return Err(SandboxError::Start("the sandbox's thread ended early".into())),
        };
        {
            let mut sandboxes = self.lock();
            if let Some(entry) = sandboxes.get_mut(name) {
                entry.pid = Some(pid);
                entry.exit = Some(exit_rx.clone());
            }
        }
        // Started means bwrap built the namespaces and reported the sandbox's pid, or the command already ended.
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if child_pid(&status_file).is_some() {
                return Ok(());
            }
            if let Some(exit) = exit_rx.borrow().clone() {
                return Err(SandboxError::Start(format!("bwrap {}", exit.describe())));
            }
            if Instant::now() >= deadline {
                return Err(SandboxError::Start(format!(
                    "bwrap did not set the sandbox up within {}s",
                    START_DEADLINE.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn adopt(&self, name: &str) -> Result<(), SandboxError> {
        if self.config.keeper.is_none() {
            return Err(SandboxError::Unsupported(
                "sandboxes of this runtime die with the process that made them".into(),
            ));
        }
        if self.lock().contains_key(name) {
            return Err(SandboxError::Exists(name.to_owned()));
        }
        let cgroup = Cgroup::open(self.cgroups, &self.config.cgroup_root, name)
            .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
        if cgroup.pids().is_empty() {
            return Err(SandboxError::Start(format!("sandbox {name:?} is no longer running")));
        }
        let state_dir = self.config.state_dir.join(name);
        renew_lease(&lease_file(&state_dir)).map_err(SandboxError::io("cannot renew the sandbox's lease"))?;
        let cgroup = Arc::new(cgroup);
        // Not this process's child: it has ended when its cgroup is empty.
        let (exit_tx, exit_rx) = watch::channel(None);
        let watched = cgroup.clone();
        let watched_stderr = state_dir.join("stderr.log");
        std::thread::Builder::new()
            .name(format!("sandbox-{name}"))
            .spawn(move || {
                while !watched.pids().is_empty() && !exit_tx.is_closed() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                exit_tx.send_replace(Some(SandboxExit {
                    code: None,
                    signal: None,
                    out_of_memory: watched.out_of_memory(),
                    last_words: last_words(&watched_stderr),
                }));
            })
            .map_err(SandboxError::io("cannot watch the adopted sandbox"))?;
        self.lock().insert(
            name.to_owned(),
            Entry {
                spec: None,
                cgroup,
                state_dir,
                pid: None,
                exit: Some(exit_rx),
            },
        );
        Ok(())
    }

    async fn usage(&self, name: &str) -> Result<Usage, SandboxError> {
        let cgroup = self.cgroup_of(name)?;
        Ok(cgroup.usage())
    }

    async fn processes(&self, name: &str) -> Result<Vec<ProcessStamp>, SandboxError> {
        let cgroup = self.cgroup_of(name)?;
        Ok(tokio::task::spawn_blocking(move || stamps(&cgroup.pids()))
            .await
            .unwrap_or_default())
    }

    async fn kill_newer(&self, name: &str, keep: &[ProcessStamp]) -> Result<usize, SandboxError> {
        let cgroup = self.cgroup_of(name)?;
        let keep: std::collections::HashSet<ProcessStamp> = keep.iter().copied().collect();
        Ok(tokio::task::spawn_blocking(move || {
            use nix::sys::signal::{Signal, kill};
            use nix::unistd::Pid;
            let newer = || -> Vec<ProcessStamp> {
                stamps(&cgroup.pids())
                    .into_iter()
                    .filter(|stamp| !keep.contains(stamp))
                    .collect()
            };
            let signal = |stamp: &ProcessStamp, signal: Signal| {
                i32::try_from(stamp.pid).is_ok_and(|pid| kill(Pid::from_raw(pid), signal).is_ok())
            };
            // First stop them: a stopped process forks no more, so what is new in a later round was
            // forked before its parent stopped (or by a process that ran before, whose children of
            // this moment go too). Then kill them all at once.
            let mut stopped = std::collections::HashSet::new();
            for _ in 0..20 {
                let fresh: Vec<ProcessStamp> = newer().into_iter().filter(|s| !stopped.contains(s)).collect();
                if fresh.is_empty() {
                    break;
                }
                for stamp in fresh {
                    signal(&stamp, Signal::SIGSTOP);
                    stopped.insert(stamp);
                }
            }
            let mut killed = std::collections::HashSet::new();
            for stamp in stopped.iter().chain(newer().iter()) {
                if signal(stamp, Signal::SIGKILL) {
                    killed.insert(*stamp);
                }
            }
            // Gone once reaped (the sandbox's init reaps them): wait for it, within a bound.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && stamps(&cgroup.pids()).iter().any(|stamp| killed.contains(stamp)) {
                std::thread::sleep(Duration::from_millis(5));
            }
            killed.len()
        })
        .await
        .map_err(|_| SandboxError::Start("the sweep of the sandbox's processes failed".into()))?)
    }

    async fn status(&self, name: &str) -> Result<SandboxStatus, SandboxError> {
        let sandboxes = self.lock();
        let entry = sandboxes
            .get(name)
            .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
        Ok(match &entry.exit {
            None => SandboxStatus::Created,
            Some(exit) => match exit.borrow().clone() {
                Some(exit) => SandboxStatus::Exited(exit),
                None => SandboxStatus::Running,
            },
        })
    }

    async fn wait(&self, name: &str) -> Result<SandboxExit, SandboxError> {
        let exit = {
            let sandboxes = self.lock();
            let entry = sandboxes
                .get(name)
                .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
            entry
                .exit
                .clone()
                .ok_or_else(|| SandboxError::Start(format!("sandbox {name:?} was not started")))?
        };
        let mut exit = exit;
        let ended = exit
            .wait_for(Option::is_some)
            .await
            .map_err(|_| SandboxError::Start("the sandbox's thread vanished".into()))?;
        Ok(ended.clone().unwrap_or(SandboxExit {
            code: None,
            signal: None,
            out_of_memory: false,
            last_words: String::new(),
        }))
    }

    async fn stop(&self, name: &str, grace: Duration) -> Result<(), SandboxError> {
        let (cgroup, exit) = {
            let sandboxes = self.lock();
            let entry = sandboxes
                .get(name)
                .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
            (entry.cgroup.clone(), entry.exit.clone())
        };
        for pid in cgroup.pids() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        if let Some(mut exit) = exit {
            let _ = tokio::time::timeout(grace, exit.wait_for(Option::is_some)).await;
        }
        tokio::task::spawn_blocking(move || cgroup.kill_all(Duration::from_secs(5)))
            .await
            .map_err(|_| SandboxError::Start("teardown failed".into()))?;
        Ok(())
    }

    async fn destroy(&self, name: &str) -> Result<Usage, SandboxError> {
        let Some(entry) = self.lock().remove(name) else {
            // Left by an earlier process and never adopted: its cgroup still says what to kill.
            let cgroup = Cgroup::open(self.cgroups, &self.config.cgroup_root, name)
                .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
            let state_dir = self.config.state_dir.join(name);
            return tokio::task::spawn_blocking(move || {
                let emptied = cgroup.kill_all(Duration::from_secs(5));
                let usage = cgroup.usage();
                cgroup.remove();
                let _ = std::fs::remove_dir_all(&state_dir);
                if emptied {
                    Ok(usage)
                } else {
                    Err(SandboxError::Start("processes survived SIGKILL for 5 s".into()))
                }
            })
            .await
            .map_err(|_| SandboxError::Start("teardown failed".into()))?;
        };
        let cgroup = entry.cgroup.clone();
        let emptied = tokio::task::spawn_blocking(move || cgroup.kill_all(Duration::from_secs(5)))
            .await
            .unwrap_or(false);
        if let Some(mut exit) = entry.exit.clone() {
            let _ = tokio::time::timeout(Duration::from_secs(5), exit.wait_for(Option::is_some)).await;
        }
        let usage = entry.cgroup.usage();
        let cgroup = entry.cgroup.clone();
        let _ = tokio::task::spawn_blocking(move || cgroup.remove()).await;
        let _ = std::fs::remove_dir_all(&entry.state_dir);
        if !emptied {
            return Err(SandboxError::Start(format!(
                "sandbox {name:?}: processes survived SIGKILL for 5 s"
            )));
        }
        Ok(usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_words_are_the_end_of_the_log_as_one_printable_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("stderr.log");
        assert_eq!(last_words(&log), "", "no log, no words");
        std::fs::write(&log, "starting\nError: agent \"x\" is \u{1b}[31mmissing\u{7}\n\n").expect("write");
        assert_eq!(last_words(&log), "starting | Error: agent \"x\" is [31mmissing");
        // A log of megabytes is read from its end, and its cut first line is left out.
        let mut long = "noise ".repeat(1 << 18);
        long.push_str("\nthe reason\n");
        std::fs::write(&log, long).expect("write");
        let words = last_words(&log);
        assert_eq!(words, "the reason");
    }

    #[test]
    fn the_start_time_is_read_after_the_command_name() {
        let stat = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 150 0 0 0 1 2 0 0 20 0 1 0 987654 123 0";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("4242 (x"), None);
        assert_eq!(start_time("4242 (x) S 1"), None);
    }

    #[test]
    fn the_child_pid_is_read_from_bwraps_status() {
        let dir = std::env::temp_dir().join(format!("sortie-status-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("status.json");
        std::fs::write(&file, "{ \"child-pid\": 13396, \"ipc-namespace\": 4026532329 }\n").expect("write");
        assert_eq!(child_pid(&file), Some(13396));
        std::fs::write(&file, "{ \"child-pid\": 13").expect("write");
        assert_eq!(child_pid(&file), Some(13), "a partial line yields what is there");
        std::fs::write(&file, "").expect("write");
        assert_eq!(child_pid(&file), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
