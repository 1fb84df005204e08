//! `sortie sandbox exec`: a command in a fresh local sandbox laid out like a session's, for operators
//! checking a host and for tests; and the hidden `sortie relay` that runs inside it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio, inside};

use crate::cli::{RelayArgs, SandboxCommand, SandboxExecArgs, SandboxKeepArgs};

pub async fn run(command: SandboxCommand) -> anyhow::Result<ExitCode> {
    match command {
        SandboxCommand::Exec(args) => exec(args).await,
        // `main` runs the keeper before this; blocking here would still be right, only slower to start.
        SandboxCommand::Keep(args) => keep(&args),
    }
}

/// `sortie sandbox keep`: the sandbox's parent in place of `serve` (`sortie_sandbox::local::keeper`);
/// exits the way the sandbox exits. One runs beside every sandbox, so `main` runs it before any async
/// runtime exists: it blocks, and its threads and their heaps would be each sandbox's cost.
pub fn keep(args: &SandboxKeepArgs) -> anyhow::Result<ExitCode> {
    let grace = std::time::Duration::from_secs(args.grace_secs);
    let drop_to = args.uid.zip(args.gid);
    let confinement = match &args.status_file {
        Some(status_file) => Some(
            sortie_sandbox::local::child::Confinement::prepare(&args.cgroup_procs, status_file, drop_to)
                .context("cannot prepare the sandbox's cgroups and status file")?,
        ),
        None if args.cgroup_procs.is_empty() && drop_to.is_none() => None,
        None => anyhow::bail!("--cgroup-procs and --uid need --status-file"),
    };
    let status = sortie_sandbox::local::keeper::keep(&args.lease, grace, confinement, &args.command)
        .context("cannot keep the sandbox")?;
    Ok(exit_like(status))
}

/// This process's exit, the same as the sandbox's: its code, or death by its signal.
fn exit_like(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal().and_then(|s| nix::sys::signal::Signal::try_from(s).ok()) {
        let _ = nix::sys::signal::raise(signal);
    }
    ExitCode::from(status.code().map_or(1, |code| u8::try_from(code).unwrap_or(1)))
}

/// A directory the sandbox uid can reach: mode 0755 under the system temp dir.
fn scratch_dir() -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!(
        "sortie-sandbox-{}",
        ulid::Ulid::generate().to_string().to_ascii_lowercase()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

async fn exec(args: SandboxExecArgs) -> anyhow::Result<ExitCode> {
    let scratch = scratch_dir()?;
    let outcome = exec_in(&scratch, args).await;
    let _ = std::fs::remove_dir_all(&scratch);
    outcome
}

async fn exec_in(scratch: &std::path::Path, args: SandboxExecArgs) -> anyhow::Result<ExitCode> {
    use std::os::unix::fs::MetadataExt;
    let mut config = LocalConfig::new(scratch.join("state"));
    config.sandbox_uid = args.sandbox_uid;
    config.sandbox_gid = args.sandbox_uid;
    let runtime = match LocalRuntime::new(config) {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: SANDBOX_START_FAILED: {error}");
            return Ok(ExitCode::from(125));
        }
    };
    runtime.start_soon();

    let (workspace, lent) = match &args.dir {
        Some(dir) => {
            let dir = std::fs::canonicalize(dir).with_context(|| format!("--dir {} does not exist", dir.display()))?;
            let meta = std::fs::metadata(&dir)?;
            (dir, Some((meta.uid(), meta.gid())))
        }
        None => (scratch.join("workspace"), None),
    };
    let home = scratch.join("home");
    for dir in [&workspace, &home] {
        std::fs::create_dir_all(dir)?;
    }
    let mut command = args.command.clone();
    let mut read_only = Vec::new();
    for path in &args.read_only {
        read_only.push(std::fs::canonicalize(path).with_context(|| format!("--ro {} does not exist", path.display()))?);
    }
    let egress_dir = match &args.egress_socket {
        Some(socket) => {
            let socket = std::fs::canonicalize(socket)
                .with_context(|| format!("--egress-socket {} does not exist", socket.display()))?;
            let name = socket
                .file_name()
                .context("--egress-socket has no file name")?
                .to_string_lossy()
                .into_owned();
            runtime.grant_socket(&socket)?;
            // The command runs under this very binary's relay, bound read-only inside.
            let mut exe = std::env::current_exe().context("cannot find the sortie binary")?;
            let mut exe_dir = exe.parent().context("the sortie binary has no directory")?.to_owned();
            if !runtime.is_reachable(&exe) {
                // The sandbox uid cannot reach where this binary lives (e.g. a private checkout): use a copy.
                let bin = scratch.join("bin");
                std::fs::create_dir_all(&bin)?;
                std::fs::copy(&exe, bin.join("sortie")).context("cannot copy the sortie binary for the sandbox")?;
                exe = bin.join("sortie");
                exe_dir = bin;
            }
            read_only.push(exe_dir);
            let mut wrapped = vec![
                exe.display().to_string(),
                "relay".into(),
                "--socket".into(),
                format!("{}/{name}", inside::EGRESS_DIR),
                "--".into(),
            ];
            wrapped.append(&mut command);
            command = wrapped;
            Some(socket.parent().context("--egress-socket has no directory")?.to_owned())
        }
        None => None,
    };
    let mut env = Vec::new();
    for pair in &args.env {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--env {pair:?} is not NAME=VALUE"))?;
        env.push((key.to_owned(), value.to_owned()));
    }
    let defaults = Limits::default();
    let limits = Limits {
        memory_bytes: args.memory.unwrap_or(defaults.memory_bytes),
        pids: args.pids.unwrap_or(defaults.pids),
        cpu_cores: args.cpus.or(defaults.cpu_cores),
        tmp_bytes: args.tmp_size.unwrap_or(defaults.tmp_bytes),
        disk_bytes: defaults.disk_bytes,
    };
    let name = format!("exec-{}", ulid::Ulid::generate().to_string().to_ascii_lowercase());
    let spec = SandboxSpec {
        name: name.clone(),
        workspace: workspace.clone(),
        home,
        egress_dir,
        read_only,
        read_only_at: Vec::new(),
        late_binds: false,
        env,
        command,
        limits,
        stdio: SandboxStdio::Inherit,
    };

    if let Err(error) = runtime.create(spec).await {
        eprintln!("error: SANDBOX_START_FAILED: {error}");
        return Ok(ExitCode::from(125));
    }
    let started = runtime.start(&name).await;
    let exit = match started {
        Ok(()) => Some(runtime.wait(&name).await?),
        Err(error) => {
            eprintln!("error: SANDBOX_START_FAILED: {error}");
            None
        }
    };
    let usage = runtime.destroy(&name).await;
    if let Some((uid, gid)) = lent {
        sortie_sandbox::local::chown_tree(&workspace, uid, gid)
            .with_context(|| format!("cannot give {} back to its owner", workspace.display()))?;
    }
    tracing::info!(?usage, "sandbox ended");
    let Some(exit) = exit else {
        return Ok(ExitCode::from(125));
    };
    if exit.out_of_memory {
        eprintln!(
            "sortie: the sandbox ran out of memory (limit {} bytes); the kernel killed it",
            limits.memory_bytes
        );
        return Ok(ExitCode::from(137));
    }
    let code = exit.code.or(exit.signal.map(|s| 128 + s)).unwrap_or(1);
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

pub async fn relay(args: RelayArgs) -> anyhow::Result<ExitCode> {
    sortie_driver::relay::start(sortie_driver::relay::Upstream::Socket(args.socket.clone()))
        .await
        .with_context(|| format!("cannot listen on {}", sortie_driver::relay::RELAY_ADDRESS))?;
    let (program, rest) = args.command.split_first().context("no command")?;
    let status = tokio::process::Command::new(program)
        .args(rest)
        .envs(sortie_driver::relay::proxy_env(sortie_driver::relay::RELAY_ADDRESS))
        .status()
        .await
        .with_context(|| format!("cannot run {program}"))?;
    use std::os::unix::process::ExitStatusExt;
    let code = status.code().or(status.signal().map(|s| 128 + s)).unwrap_or(1);
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}
