//! The host checks: what this host has of what the worker needs (the sandbox's tools, cgroups, a
//! work dir the sandbox uid can reach, git, Node.js, free disk, the agents), each with the fix for a
//! miss. `sortie doctor` prints them; `serve` logs the misses at start.

use std::path::{Path, PathBuf};

use sortie_profile::AgentProfile;

/// Below this much free space on the data dir's disk, sessions' disks and mirrors will soon fail.
const FREE_DISK_WANTED: u64 = 2 << 30;

/// One finding (`sortie doctor --json` prints these).
#[derive(Debug, serde::Serialize)]
pub struct Check {
    #[serde(rename = "check")]
    pub name: &'static str,
    pub ok: bool,
    /// A miss of a required check means sessions cannot run; of another, some of them.
    pub required: bool,
    /// What was found, or what to do.
    pub says: String,
}

impl Check {
    pub fn ok(name: &'static str, says: impl Into<String>) -> Self {
        Self {
            name,
            ok: true,
            required: true,
            says: says.into(),
        }
    }

    pub fn miss(name: &'static str, required: bool, says: impl Into<String>) -> Self {
        Self {
            name,
            ok: false,
            required,
            says: says.into(),
        }
    }
}

/// What the host checks look at.
pub struct HostInputs<'a> {
    pub data_dir: &'a Path,
    pub work_dir: PathBuf,
    pub sandbox_uid: u32,
    pub agents_dir: &'a Path,
    pub profiles: &'a [AgentProfile],
}

/// A program on PATH, as the shell would find it.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The first line `program args…` prints, if it runs.
fn version_of(program: &Path, args: &[&str]) -> Option<String> {
    let output = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    let text = if output.stdout.is_empty() {
        output.stderr
    } else {
        output.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .next()
        .map(|l| l.trim().to_owned())
}

fn program(name: &'static str, package: &str, required: bool, version_args: &[&str], why: &str) -> Check {
    match on_path(name) {
        Some(path) => {
            let version = version_of(&path, version_args).unwrap_or_default();
            Check::ok(name, format!("{} {version}", path.display()).trim_end().to_owned())
        }
        None => Check::miss(
            name,
            required,
            format!("not on PATH ({why}): apt-get install {package}"),
        ),
    }
}

/// The checks of the host itself: the sandbox's tools, cgroups, the data dir's reach, git, Node.js,
/// free disk and the agents.
pub fn host_checks(inputs: &HostInputs<'_>) -> Vec<Check> {
    let root = nix::unistd::geteuid().is_root();
    let mut checks = vec![if root {
        Check::ok(
            "root",
            "sortie runs as root and drops each sandbox to uid ".to_owned() + &inputs.sandbox_uid.to_string(),
        )
    } else {
        Check::miss(
            "root",
            true,
            "not root: the worker needs root to run sandboxes (`sudo sortie serve`); `sortie serve --roles api,gateway` runs without it",
        )
    }];
    checks.push(program(
        "bwrap",
        "bubblewrap",
        true,
        &["--version"],
        "every sandbox is a bubblewrap",
    ));
    checks.push(program(
        "setpriv",
        "util-linux",
        true,
        &["--version"],
        "it drops each sandbox to the sandbox uid",
    ));
    checks.push(program(
        "git",
        "git",
        true,
        &["--version"],
        "mirrors, workspaces and delivery are git",
    ));
    checks.push(program(
        "mkfs.ext4",
        "e2fsprogs",
        root,
        &["-V"],
        "each session's disk is an ext4 image",
    ));
    checks.push(program(
        "losetup",
        "mount",
        root,
        &["--version"],
        "each session's disk is loop-mounted",
    ));
    checks.push(program(
        "node",
        "nodejs",
        false,
        &["--version"],
        "the npm agents (claude-code, codex, gemini, opencode) run on Node.js",
    ));
    checks.push(program(
        "npm",
        "npm",
        false,
        &["--version"],
        "`sortie agents install` uses npm",
    ));
    checks.push(cgroups());
    checks.push(reach(inputs, root));
    checks.push(free_disk(inputs.data_dir));
    checks.push(agents(inputs));
    checks
}

fn cgroups() -> Check {
    let root = Path::new("/sys/fs/cgroup");
    match sortie_sandbox::local::cgroup::detect(root) {
        Ok(sortie_sandbox::local::cgroup::CgroupVersion::V2) => {
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            let missing: Vec<&str> = ["memory", "pids", "cpu"]
                .into_iter()
                .filter(|c| !controllers.split_whitespace().any(|have| have == *c))
                .collect();
            if missing.is_empty() {
                Check::ok("cgroups", format!("v2 ({})", controllers.trim()))
            } else {
                Check::miss(
                    "cgroups",
                    true,
                    format!(
                        "v2 without the {} controller(s): enable them for sortie's group",
                        missing.join(", ")
                    ),
                )
            }
        }
        Ok(sortie_sandbox::local::cgroup::CgroupVersion::V1) => Check::ok("cgroups", "v1 (memory, pids, cpu, cpuacct)"),
        Err(error) => Check::miss("cgroups", true, error.to_string()),
    }
}

fn reach(inputs: &HostInputs<'_>, root: bool) -> Check {
    if !root {
        return Check::ok(
            "data dir",
            format!("{} (sandboxes would run as this user)", inputs.data_dir.display()),
        );
    }
    let target = inputs.work_dir.join("sessions");
    match sortie_sandbox::local::unreachable_parent(inputs.sandbox_uid, inputs.sandbox_uid, &target) {
        None => Check::ok(
            "data dir",
            format!(
                "{} (its work dir is reachable by uid {})",
                inputs.data_dir.display(),
                inputs.sandbox_uid
            ),
        ),
        Some(blocked) => Check::miss(
            "data dir",
            true,
            format!(
                "the work dir {} is not reachable by the sandbox uid {}: {} is not searchable by it; use the \
                 default data dir as root ({}), put --data-dir under a directory others may search, or `chmod o+x {}`",
                inputs.work_dir.display(),
                inputs.sandbox_uid,
                blocked.display(),
                crate::settings::SYSTEM_DATA_DIR,
                blocked.display()
            ),
        ),
    }
}

fn free_disk(data_dir: &Path) -> Check {
    let existing = data_dir.ancestors().find(|dir| dir.exists()).unwrap_or(Path::new("/"));
    match nix::sys::statvfs::statvfs(existing) {
        Ok(stats) => {
            let free = stats.blocks_available() * stats.fragment_size();
            let says = format!("{} GiB free at {}", free >> 30, existing.display());
            if free >= FREE_DISK_WANTED {
                Check::ok("disk", says)
            } else {
                Check::miss(
                    "disk",
                    false,
                    format!("only {says}: sessions' disks and mirrors need room"),
                )
            }
        }
        Err(error) => Check::miss(
            "disk",
            false,
            format!("cannot read the free space at {}: {error}", existing.display()),
        ),
    }
}

fn agents(inputs: &HostInputs<'_>) -> Check {
    let (mut installed, mut missing) = (Vec::new(), Vec::new());
    for agent in inputs.profiles {
        match sortie_profile::locate(inputs.agents_dir, agent) {
            Some(_) => installed.push(agent.id.as_str()),
            None => missing.push(format!("{} ({})", agent.id, sortie_profile::install_hint(agent))),
        }
    }
    let says = if missing.is_empty() {
        format!("installed: {}", installed.join(", "))
    } else {
        format!(
            "installed: {}; not installed: {}",
            installed.join(", "),
            missing.join(", ")
        )
    };
    if installed.is_empty() {
        Check::miss("agents", true, says)
    } else {
        Check::ok("agents", says)
    }
}
