//! One sandbox's cgroups: limits, accounting, OOM detection and teardown, on cgroup v1 (separate
//! hierarchies, as on this project's machines) and v2 (unified).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Limits, SandboxError, Usage};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The v1 hierarchies a sandbox joins.
const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpuacct", "cpu"];
/// The group all sandboxes live under.
const PARENT: &str = "sortie";
/// The CPU weight sortie gives [`PARENT`], all sandboxes together, when it makes that group: a quarter
/// of the default (v1 `cpu.shares` 1024, v2 `cpu.weight` 100), so that when the CPU is contended
/// `sortie serve` answers first (on a 2-core machine starting 100 sessions, a create's p99 was 181 ms
/// and `/healthz`'s 45 ms at the default; ~70 and ~13 ms at a quarter). A weight counts only under
/// contention, but then against every busy process beside the group (v1) or every sibling group
/// (v2), not only `serve`: lower would starve sandboxes on a host busy with other work. A weight an
/// operator set on an existing group is kept.
const PARENT_CPU_SHARES_V1: &str = "256";
const PARENT_CPU_WEIGHT_V2: &str = "25";

/// Which cgroup version `root` (normally `/sys/fs/cgroup`) offers for sandboxes.
pub fn detect(root: &Path) -> Result<CgroupVersion, SandboxError> {
    if root.join("cgroup.controllers").is_file() {
        return Ok(CgroupVersion::V2);
    }
    if V1_CONTROLLERS
        .iter()
        .all(|c| root.join(c).join("cgroup.procs").is_file())
    {
        return Ok(CgroupVersion::V1);
    }
    Err(SandboxError::Cgroups(format!(
        "{} has neither cgroup v2 nor the v1 memory, pids, cpu and cpuacct hierarchies; mount them (or enable them in the kernel) to run sandboxes with limits",
        root.display()
    )))
}

/// Starts a cgroup migration now, on a thread of its own, moving this process where it already is.
/// The kernel's first migration after a quiet spell waits out an RCU grace period (6–13 ms on this
/// project's machines, the most of a sandbox start); migrations in its wake are quick. Called ahead of
/// a sandbox start, its grace period passes beside the work before it. Best effort: a failure (no
/// permission, a cgroup namespace) changes nothing.
pub fn start_migration_grace(root: &Path, version: CgroupVersion) {
    let root = root.to_owned();
    let _ = std::thread::Builder::new().name("cgroup-grace".into()).spawn(move || {
        let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
            return;
        };
        let line = own.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            match version {
                CgroupVersion::V1 => controllers
                    .split(',')
                    .any(|c| c == "pids")
                    .then(|| root.join("pids").join(path.trim_start_matches('/'))),
                CgroupVersion::V2 => controllers.is_empty().then(|| root.join(path.trim_start_matches('/'))),
            }
        });
        if let Some(dir) = line {
            let _ = std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string());
        }
    });
}

/// A cgroup for processes the host runs on a sandbox's behalf (a session's git proxy children and
/// secret scans): under the same parent as sandboxes, with memory and pids limits of its own and no
/// CPU quota; [`Cgroup::procs_files`] says where a process writes its pid to join it.
pub fn create_for_host_processes(
    root: &Path,
    name: &str,
    memory_bytes: u64,
    pids: u64,
) -> Result<Cgroup, SandboxError> {
    let limits = Limits {
        memory_bytes,
        pids,
        cpu_cores: None,
        tmp_bytes: 0,
        disk_bytes: 0,
    };
    Cgroup::create(detect(root)?, root, name, &limits)
}

/// The group, beside sandboxes' under [`PARENT`], of the processes the host runs for later sessions.
pub const WORK_AHEAD: &str = "work-ahead";
/// Its CPU weight among sandboxes where the kernel cannot mark it idle: the least there is (v1
/// `cpu.shares` 2, v2 `cpu.weight` 1).
const WORK_AHEAD_CPU_SHARES_V1: &str = "2";
const WORK_AHEAD_CPU_WEIGHT_V2: &str = "1";

/// Makes (or finds) [`WORK_AHEAD`], a CPU group only, and returns the `cgroup.procs` files a process
/// writes its pid to, to join it. What runs there (a spare disk's `mkfs`, a workspace checked out
/// ahead) takes the CPU only where neither `serve` nor a sandbox wants it. It is not removed: it holds
/// nothing between those processes, and the next start finds it.
pub fn create_for_work_ahead(root: &Path) -> Result<Vec<PathBuf>, SandboxError> {
    let version = detect(root)?;
    let parent = make_parent_with(version, root, Path::new(WORK_AHEAD)).map_err(SandboxError::io(format!(
        "cannot create {}",
        root.join(PARENT).join(WORK_AHEAD).display()
    )))?;
    let dir = parent.join(WORK_AHEAD);
    if !mark_idle(&dir) {
        match version {
            CgroupVersion::V1 => write(&dir.join("cpu.shares"), WORK_AHEAD_CPU_SHARES_V1)?,
            CgroupVersion::V2 => write(&dir.join("cpu.weight"), WORK_AHEAD_CPU_WEIGHT_V2)?,
        }
    }
    Ok(vec![dir.join("cgroup.procs")])
}

/// Makes the parent group of sandboxes if missing, weighed as [`PARENT_CPU_SHARES_V1`] /
/// [`PARENT_CPU_WEIGHT_V2`] only when this call made it (an operator's own weight is kept), with
/// `child` under it; returns the parent's directory (v1: in the cpu hierarchy).
fn make_parent_with(version: CgroupVersion, root: &Path, child: &Path) -> std::io::Result<PathBuf> {
    match version {
        CgroupVersion::V1 => {
            let parent = root.join("cpu").join(PARENT);
            let weigh_parent = !parent.exists();
            std::fs::create_dir_all(parent.join(child))?;
            if weigh_parent {
                // A priority, not a limit: where it may not be set, sandboxes run at the default.
                let _ = std::fs::write(parent.join("cpu.shares"), PARENT_CPU_SHARES_V1);
            }
            Ok(parent)
        }
        CgroupVersion::V2 => {
            let parent = root.join(PARENT);
            let weigh_parent = !parent.exists();
            std::fs::create_dir_all(&parent)?;
            // Controllers must be enabled for the children of each level.
            for level in [root, parent.as_path()] {
                let _ = std::fs::write(level.join("cgroup.subtree_control"), "+memory +pids +cpu");
            }
            if weigh_parent {
                let _ = std::fs::write(parent.join("cpu.weight"), PARENT_CPU_WEIGHT_V2);
            }
            std::fs::create_dir_all(parent.join(child))?;
            Ok(parent)
        }
    }
}

/// Sets `cpu.idle` where the kernel has it (5.15 on, v1 and v2): the group's processes are scheduled
/// as `SCHED_IDLE` against their siblings, below even the least weight (an idle group's weight cannot
/// be written). `false` where it is not set.
fn mark_idle(dir: &Path) -> bool {
    let _ = std::fs::write(dir.join("cpu.idle"), "1");
    std::fs::read_to_string(dir.join("cpu.idle")).is_ok_and(|idle| idle.trim() == "1")
}

pub struct Cgroup {
    version: CgroupVersion,
    /// v1: one directory per hierarchy (deduplicated when cpu and cpuacct are co-mounted); v2: one.
    dirs: Vec<PathBuf>,
    /// The directory whose `cgroup.procs` lists every process of the sandbox.
    pids_dir: PathBuf,
    memory_dir: PathBuf,
    cpu_dir: PathBuf,
    /// Where CPU time is counted (v1: cpuacct; v2: the one directory).
    accounting_dir: PathBuf,
}

fn write(path: &Path, value: &str) -> Result<(), SandboxError> {
    std::fs::write(path, value).map_err(SandboxError::io(format!(
        "cannot write {value:?} to {}",
        path.display()
    )))
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` lines (memory.events, memory.oom_control, cpu.stat): the value of `key`.
fn read_keyed(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

impl Cgroup {
    /// The cgroups of an existing sandbox `name` (made by an earlier process), without touching its
    /// limits; `None` if it has none.
    pub fn open(version: CgroupVersion, root: &Path, name: &str) -> Option<Self> {
        let cgroup = match version {
            CgroupVersion::V1 => {
                let mut dirs: Vec<PathBuf> = Vec::new();
                for controller in V1_CONTROLLERS {
                    let dir = root.join(controller).join(PARENT).join(name);
                    let canonical = std::fs::canonicalize(&dir).ok()?;
                    if !dirs.contains(&canonical) {
                        dirs.push(canonical);
                    }
                }
                Self {
                    version,
                    pids_dir: root.join("pids").join(PARENT).join(name),
                    memory_dir: root.join("memory").join(PARENT).join(name),
                    cpu_dir: root.join("cpu").join(PARENT).join(name),
                    accounting_dir: root.join("cpuacct").join(PARENT).join(name),
                    dirs,
                }
            }
            CgroupVersion::V2 => {
                let dir = root.join(PARENT).join(name);
                if !dir.is_dir() {
                    return None;
                }
                Self {
                    version,
                    pids_dir: dir.clone(),
                    memory_dir: dir.clone(),
                    cpu_dir: dir.clone(),
                    accounting_dir: dir.clone(),
                    dirs: vec![dir],
                }
            }
        };
        Some(cgroup)
    }

    /// Creates the sandbox's cgroups under `root` and sets its limits.
    pub fn create(version: CgroupVersion, root: &Path, name: &str, limits: &Limits) -> Result<Self, SandboxError> {
        let permission_hint = |source: std::io::Error, dir: &Path| {
            SandboxError::Cgroups(format!(
                "cannot create {}: {source} (sortie must run as root, or be given a delegated cgroup)",
                dir.display()
            ))
        };
        match version {
            CgroupVersion::V1 => {
                let mut dirs: Vec<PathBuf> = Vec::new();
                make_parent_with(version, root, Path::new(name))
                    .map_err(|e| permission_hint(e, &root.join("cpu").join(PARENT).join(name)))?;
                for controller in V1_CONTROLLERS {
                    let dir = root.join(controller).join(PARENT).join(name);
                    std::fs::create_dir_all(&dir).map_err(|e| permission_hint(e, &dir))?;
                    let canonical = std::fs::canonicalize(&dir).unwrap_or(dir);
                    if !dirs.contains(&canonical) {
                        dirs.push(canonical);
                    }
                }
                let cgroup = Self {
                    version,
                    pids_dir: root.join("pids").join(PARENT).join(name),
                    memory_dir: root.join("memory").join(PARENT).join(name),
                    cpu_dir: root.join("cpu").join(PARENT).join(name),
                    accounting_dir: root.join("cpuacct").join(PARENT).join(name),
                    dirs,
                };
                let memory = limits.memory_bytes.to_string();
                // Lowering from unlimited: the memory limit first, then memory+swap (which must stay ≥ it).
                write(&cgroup.memory_dir.join("memory.limit_in_bytes"), &memory)?;
                let memsw = cgroup.memory_dir.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    write(&memsw, &memory)?;
                }
                write(&cgroup.pids_dir.join("pids.max"), &limits.pids.to_string())?;
                if let Some(cores) = limits.cpu_cores {
                    write(&cgroup.cpu_dir.join("cpu.cfs_period_us"), "100000")?;
                    write(
                        &cgroup.cpu_dir.join("cpu.cfs_quota_us"),
                        &((cores * 100_000.0).round() as u64).max(1000).to_string(),
                    )?;
                }
                Ok(cgroup)
            }
            CgroupVersion::V2 => {
                let dir = root.join(PARENT).join(name);
                make_parent_with(version, root, Path::new(name)).map_err(|e| permission_hint(e, &dir))?;
                write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write(&swap, "0")?;
                }
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
                if let Some(cores) = limits.cpu_cores {
                    write(
                        &dir.join("cpu.max"),
                        &format!("{} 100000", ((cores * 100_000.0).round() as u64).max(1000)),
                    )?;
                }
                Ok(Self {
                    version,
                    pids_dir: dir.clone(),
                    memory_dir: dir.clone(),
                    cpu_dir: dir.clone(),
                    accounting_dir: dir.clone(),
                    dirs: vec![dir],
                })
            }
        }
    }

    /// The `cgroup.procs` files a process writes its pid to, to join the sandbox.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|dir| dir.join("cgroup.procs")).collect()
    }

    /// Every process in the sandbox now.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.pids_dir.join("cgroup.procs"))
            .map(|text| text.lines().filter_map(|line| line.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Whether the kernel killed a process of the sandbox for its memory limit.
    pub fn out_of_memory(&self) -> bool {
        let count = match self.version {
            CgroupVersion::V1 => read_keyed(&self.memory_dir.join("memory.oom_control"), "oom_kill"),
            CgroupVersion::V2 => read_keyed(&self.memory_dir.join("memory.events"), "oom_kill"),
        };
        count.is_some_and(|n| n > 0)
    }

    pub fn usage(&self) -> Usage {
        match self.version {
            CgroupVersion::V1 => Usage {
                cpu_seconds: read_u64(&self.accounting_dir.join("cpuacct.usage")).unwrap_or(0) as f64 / 1e9,
                peak_memory_bytes: read_u64(&self.memory_dir.join("memory.max_usage_in_bytes")).unwrap_or(0),
            },
            CgroupVersion::V2 => Usage {
                cpu_seconds: read_keyed(&self.accounting_dir.join("cpu.stat"), "usage_usec").unwrap_or(0) as f64 / 1e6,
                peak_memory_bytes: read_u64(&self.memory_dir.join("memory.peak")).unwrap_or(0),
            },
        }
    }

    /// SIGKILLs every process of the sandbox until none is left (or `within` passes). `true` if empty.
    pub fn kill_all(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        if self.version == CgroupVersion::V2 {
            let _ = std::fs::write(self.pids_dir.join("cgroup.kill"), "1");
        }
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return true;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Removes the cgroups (they must be empty; retried briefly while the kernel finishes exits).
    pub fn remove(&self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        for dir in &self.dirs {
            while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
