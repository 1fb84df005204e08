//! Provisioning a session's sandbox (DESIGN §2 step 2): the workspace from the repository's mirror,
//! the per-sandbox egress proxy (with the git and model proxies of this session only), the driver's
//! socket made and held by the host, the sandbox, and the setup script.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_protocol::FailureCode;
use sortie_protocol::driver::SETUP_OUTPUT_TAIL_BYTES;
use sortie_sandbox::{SandboxSpec, SandboxStatus, SandboxStdio, inside};
use sortie_store::SessionRow;

use super::proxy::{serve_proxy, session_upstream, write_known_secrets};
use super::sandbox::{destroy, mount_disk};
use super::{Failure, SandboxHandle, ms, start_failed};
use crate::Context;
use crate::meter::CurrentTurn;
use crate::prepare::{self, SessionDirs};

/// How long a new sandbox's driver has to answer.
const DRIVER_READY_DEADLINE: Duration = Duration::from_secs(30);
/// Runs the repository's own setup script when the session names none.
const DEFAULT_SETUP: &str = "if [ -f .sortie/setup.sh ]; then exec sh .sortie/setup.sh; fi";

/// What the session's agent profile asks the sandbox to bind read-only (its install dir outside
/// `/usr` and the agents dir): absolute paths that exist, else the turn cannot start.
fn agent_read_only_paths(manifest: Option<&Path>, agent: &str, exe_dir: &Path) -> Result<Vec<PathBuf>, Failure> {
    let agent_failed = |what: String| (FailureCode::AgentStartFailed, what);
    let profiles = sortie_profile::load(manifest).map_err(|e| agent_failed(e.to_string()))?;
    let profile = sortie_profile::find(&profiles, agent).map_err(|e| agent_failed(e.to_string()))?;
    let mut paths = Vec::new();
    // The driver looks for a bare command beside its own binary first: that one file is bound, not
    // the directory (which may hold anything: a build tree, other tools).
    if !profile.command.contains('/') {
        let beside = exe_dir.join(&profile.command);
        if beside.is_file() {
            paths.push(beside);
        }
    }
    for entry in &profile.read_only_paths {
        let path = PathBuf::from(entry);
        let plain = path.is_absolute() && path.components().all(|c| !matches!(c, std::path::Component::ParentDir));
        if !plain || !path.exists() {
            return Err(agent_failed(format!(
                "agent {agent:?} asks for read-only path {entry:?}, which is not an existing absolute path: fix \
                 read_only_paths in the agent manifest"
            )));
        }
        paths.push(path);
    }
    Ok(paths)
}

/// The spare disks and the session's mirror, when the session has no disk yet (it may take one primed
/// for its repository).
fn primable<'a>(
    context: &'a Arc<Context>,
    session: &SessionRow,
    dirs: &SessionDirs,
) -> Option<(&'a Arc<crate::spares::SpareDisks>, PathBuf)> {
    let spares = context.spares.as_ref()?;
    let new_disk = dirs.has_disk() && sortie_sandbox::local::disk::takes_a_spare(&dirs.image, &dirs.disk);
    let mirror = prepare::mirror_path(&context.config.work_dir.join("mirrors"), &session.repo);
    new_disk.then_some((spares, mirror))
}

/// Makes the session's sandbox: workspace, egress and git proxy, the driver, the setup script.
pub(super) async fn provision(
    context: &Arc<Context>,
    session: &SessionRow,
    timings: &mut BTreeMap<String, u64>,
) -> Result<SandboxHandle, Failure> {
    let config = &context.config;
    let dirs = SessionDirs::new(&config.work_dir, &session.id);
    let (upstream, forge_auth) = session_upstream(context, session).await?;

    let clock = Instant::now();
    // The sandbox starts after the clone; what its start waits on in the kernel begins now.
    context.runtime.start_soon();
    // Apart until the clone: the mirror's fetch waits on the repository, the disk on the kernel. A disk
    // with the repository checked out ahead is taken if there is one (its adoption, after the fetch,
    // brings it to the mirror's refs).
    let disk = async {
        std::fs::create_dir_all(&dirs.root)
            .map_err(|e| start_failed(format!("cannot create {}: {e}", dirs.root.display())))?;
        if let Some((spares, mirror)) = primable(context, session, &dirs) {
            spares.take_primed(&mirror, &dirs.image);
        }
        let mounted = mount_disk(context, &dirs).await;
        tracing::debug!(session = %session.id, ms = ms(clock), "the session's disk is mounted");
        mounted
    };
    let mirror = async {
        let mirrored = session_mirror(context, session, forge_auth.as_ref()).await;
        tracing::debug!(session = %session.id, ms = ms(clock), "the session's mirror is fetched");
        mirrored
    };
    let (mirrored, disk) = tokio::join!(mirror, disk);
    let (mirror, mirror_hold) = match (mirrored, disk) {
        (Ok(mirrored), Ok(())) => mirrored,
        (Err(failure), disk) => {
            if disk.is_ok() {
                super::sandbox::unmount_disk(&dirs).await;
            }
            return Err(failure);
        }
        (Ok(_), Err(failure)) => return Err(failure),
    };
    for dir in [&dirs.home, &dirs.egress] {
        std::fs::create_dir_all(dir).map_err(|e| start_failed(format!("cannot create {}: {e}", dir.display())))?;
    }
    let origin = format!(
        "http://{}/_sortie/git/{}.git",
        sortie_protocol::driver::RELAY_ADDRESS,
        session.id
    );
    let workspace_clock = Instant::now();
    let made = prepare::ensure_workspace(
        &config.git_binary,
        &mirror,
        &dirs.workspace,
        dirs.has_disk().then(|| dirs.disk.join(prepare::PRIMED_DIR)).as_deref(),
        &session.id.branch(),
        session.base.as_deref(),
        &origin,
        context.runtime.host_owner(),
    )
    .await
    .map_err(|e| (FailureCode::CloneFailed, e.0))?;
    // The workspace borrows the mirror's objects now; a session kept by the store keeps it from retention.
    drop(mirror_hold);
    if let Some(made) = &made {
        std::fs::write(dirs.start_commit(), &made.start_commit)
            .map_err(|e| start_failed(format!("cannot record the workspace's start: {e}")))?;
        if made.primed {
            tracing::debug!(session = %session.id, ms = ms(workspace_clock), "adopted a workspace checked out ahead");
        }
    }
    if let Some(spares) = context.spares.as_ref().filter(|_| dirs.has_disk()) {
        // The next session of this repository finds its checkout made.
        spares.want_primed(&mirror);
    }
    // The workspace was made as the sandbox uid; its home may hold what the host restored.
    if let Some((uid, gid)) = context.runtime.host_owner() {
        sortie_sandbox::local::chown_tree(&dirs.home, uid, gid)
            .map_err(|e| start_failed(format!("cannot hand {} to the sandbox: {e}", dirs.home.display())))?;
    }
    let primed = made.as_ref().is_some_and(|made| made.primed);
    timings.insert(if primed { "primed_clone" } else { "clone" }.into(), ms(clock));

    write_known_secrets(context, session, &dirs.known_secrets)
        .await
        .map_err(start_failed)?;
    let current = Arc::new(CurrentTurn::default());
    let proxy = serve_proxy(context, session, &dirs, upstream, &current)?;

    if let Some(warm) = context.pool.as_ref().and_then(|pool| pool.take(&session.agent)) {
        let clock = Instant::now();
        match crate::pool::assign(context, session, &dirs, &mirror, &warm).await {
            Ok(()) => {
                timings.insert("warm_sandbox".into(), ms(clock));
                let handle = SandboxHandle::new(warm.name.clone(), dirs.clone(), current, proxy);
                if let Err(error) = context
                    .store
                    .put_sandbox(&session.id, "local", &warm.name, &config.worker_id)
                    .await
                {
                    tracing::warn!(%error, session = %session.id, "cannot record the sandbox; it cannot be adopted");
                }
                let clock = Instant::now();
                run_setup(context, session, &handle).await?;
                timings.insert("setup".into(), ms(clock));
                return Ok(handle);
            }
            Err(reason) => {
                // Nothing of the session is lost: it gets a sandbox of its own, as without a pool.
                tracing::warn!(session = %session.id, sandbox = %warm.name, %reason, "the warm sandbox could not be assigned; starting a new one");
                crate::pool::discard(context, &warm.name).await;
            }
        }
    }

    let clock = Instant::now();
    // The driver's socket: made here, in a directory only the host can open, and handed to the driver
    // as its stdin; nothing in the sandbox has a name for it (DESIGN §9 invariant 8).
    let driver_listener = bind_driver_socket(&dirs).map_err(start_failed)?;
    let DriverCommand {
        mut command,
        mut read_only,
    } = driver_command(context, &session.agent)?;
    command.extend([
        "--agent".into(),
        session.agent.clone(),
        "--session".into(),
        session.id.to_string(),
        "--branch".into(),
        session.id.branch(),
        "--remote".into(),
        "origin".into(),
        "--secret-digests".into(),
        dirs.known_secrets.display().to_string(),
    ]);
    read_only.extend([mirror, dirs.known_secrets.clone()]);
    if let Some(model) = &session.model {
        command.push("--model".into());
        command.push(model.clone());
    }
    let spec = SandboxSpec {
        name: session.id.to_string(),
        workspace: dirs.workspace.clone(),
        home: dirs.home.clone(),
        egress_dir: Some(dirs.egress.clone()),
        read_only,
        read_only_at: Vec::new(),
        late_binds: false,
        env: Vec::new(),
        command,
        limits: config.limits,
        stdio: SandboxStdio::Listener(Arc::new(driver_listener)),
    };
    let name = spec.name.clone();
    // A sandbox of this name left by an earlier attempt is gone for good.
    let _ = context.runtime.destroy(&name).await;
    if let Err(error) = context.runtime.create(spec).await {
        return Err(start_failed(error));
    }
    let handle = SandboxHandle::new(name.clone(), dirs.clone(), current, proxy);
    // The row lets the next start adopt the sandbox; without it the sandbox only cannot be adopted
    // (the keeper ends it after the orphan grace), which loses nothing of the turn.
    if let Err(error) = context
        .store
        .put_sandbox(&session.id, "local", &name, &config.worker_id)
        .await
    {
        tracing::warn!(%error, session = %session.id, "cannot record the sandbox; it cannot be adopted");
    }
    if let Err(error) = context.runtime.start(&name).await {
        destroy(context, &session.id, &handle).await;
        return Err(start_failed(error));
    }
    if let Err(failure) = await_driver(context, &name, &handle.driver(), Result::is_ok).await {
        destroy(context, &session.id, &handle).await;
        return Err(failure);
    }
    timings.insert("sandbox".into(), ms(clock));

    let clock = Instant::now();
    run_setup(context, session, &handle).await?;
    timings.insert("setup".into(), ms(clock));
    Ok(handle)
}

/// The driver's command line and what its sandbox binds read-only, as every sandbox of `agent` has
/// them: a cold sandbox's adds its session, a warm one's awaits its assignment.
pub(crate) struct DriverCommand {
    pub command: Vec<String>,
    pub read_only: Vec<PathBuf>,
}

pub(crate) fn driver_command(context: &Arc<Context>, agent: &str) -> Result<DriverCommand, Failure> {
    let config = &context.config;
    let exe = &config.sortie_exe;
    let exe_dir = exe
        .parent()
        .ok_or_else(|| start_failed("the sortie binary has no directory"))?
        .to_owned();
    if !context.runtime.is_reachable(exe) {
        return Err(start_failed(format!(
            "the sandbox uid cannot reach the sortie binary at {}: install sortie under a path every user can read \
             (e.g. /usr/local/bin)",
            exe.display()
        )));
    }
    let mut command = vec![
        exe.display().to_string(),
        "driver".into(),
        "--listen-on-stdin".into(),
        "--workspace".into(),
        inside::WORKSPACE.into(),
        "--home".into(),
        inside::HOME.into(),
        "--egress-socket".into(),
        inside::EGRESS_SOCKET.into(),
        "--turn-timeout".into(),
        config.turn_timeout.as_secs().max(1).to_string(),
        "--author-name".into(),
        config.author_name.clone(),
        "--author-email".into(),
        config.author_email.clone(),
    ];
    let mut read_only = vec![exe.clone()];
    if let Some(agents) = config.agents_dir.as_ref().filter(|dir| dir.is_dir()) {
        command.push("--agents-dir".into());
        command.push(agents.display().to_string());
        read_only.push(agents.clone());
    }
    if let Some(profiles) = &config.agent_profiles {
        command.push("--profiles".into());
        command.push(profiles.display().to_string());
        read_only.push(profiles.clone());
    }
    read_only.extend(agent_read_only_paths(
        config.agent_profiles.as_deref(),
        agent,
        &exe_dir,
    )?);
    Ok(DriverCommand { command, read_only })
}

/// Waits for the driver of sandbox `name` to answer on `driver` (`ready` says whether an answer is
/// the one wanted); the sandbox is destroyed if it ends or stays silent first.
pub(crate) async fn await_driver(
    context: &Arc<Context>,
    name: &str,
    driver: &crate::client::DriverClient,
    ready: impl Fn(&Result<sortie_protocol::driver::DriverStatus, crate::client::DriverError>) -> bool,
) -> Result<(), Failure> {
    let ready_by = Instant::now() + DRIVER_READY_DEADLINE;
    loop {
        if ready(&driver.status().await) {
            return Ok(());
        }
        if let Ok(SandboxStatus::Exited(exit)) = context.runtime.status(name).await {
            let what = format!("the sandbox's driver {} before it answered", exit.describe());
            if exit.code == Some(i32::from(sortie_protocol::driver::EXIT_AGENT_NOT_FOUND)) {
                return Err((FailureCode::AgentStartFailed, what));
            }
            return Err(start_failed(what));
        }
        if Instant::now() >= ready_by {
            return Err(start_failed("the sandbox's driver did not answer within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The host's mirror of the session's repository, fetched now (one fetch at a time per repository),
/// and the hold that keeps retention off it while the caller clones from it.
pub(super) async fn session_mirror(
    context: &Arc<Context>,
    session: &SessionRow,
    forge_auth: Option<&prepare::ForgeAuth>,
) -> Result<(PathBuf, prepare::MirrorHold), Failure> {
    let config = &context.config;
    let mirrors = config.work_dir.join("mirrors");
    let path = prepare::mirror_path(&mirrors, &session.repo);
    let hold = prepare::hold_mirror(&path)
        .await
        .map_err(|e| (FailureCode::CloneFailed, e.0))?;
    let lock = context.mirror_lock(&path).await;
    let _held = lock.lock().await;
    let mirror = prepare::ensure_mirror(
        &config.git_binary,
        &mirrors,
        &session.repo,
        session.base.as_deref(),
        forge_auth,
    )
    .await
    .map_err(|e| (FailureCode::CloneFailed, e.0))?;
    Ok((mirror, hold))
}

/// Runs the session's setup script in its new sandbox, then closes the setup phase's allowlist; a
/// setup that fails destroys the sandbox.
pub(super) async fn run_setup(
    context: &Arc<Context>,
    session: &SessionRow,
    handle: &SandboxHandle,
) -> Result<(), Failure> {
    let config = &context.config;
    let driver = handle.driver();
    let script = session.setup.as_deref().unwrap_or(DEFAULT_SETUP);
    let setup = driver.setup(script, config.setup_timeout).await;
    let setup = setup.map(|mut outcome| {
        // The sandbox's words: at most the tail the driver promises, whatever it sent.
        outcome.output_tail = tail_chars(&outcome.output_tail, SETUP_OUTPUT_TAIL_BYTES);
        outcome
    });
    let failure = match setup {
        Ok(result) if result.exit_code == Some(0) && !result.timed_out => None,
        Ok(result) => {
            let what = if result.timed_out {
                format!("did not finish within {} s", config.setup_timeout.as_secs())
            } else {
                match result.exit_code {
                    Some(code) => format!("exited with code {code}"),
                    None => "was killed".to_owned(),
                }
            };
            let tail: String = {
                let lines: Vec<&str> = result.output_tail.lines().rev().take(20).collect();
                lines.into_iter().rev().collect::<Vec<_>>().join("\n")
            };
            Some(format!("the setup script {what}; its last output:\n{tail}"))
        }
        Err(error) => Some(format!("the setup script could not run: {error}")),
    };
    if let Some(reason) = failure {
        destroy(context, &session.id, handle).await;
        return Err((FailureCode::SetupFailed, reason));
    }
    handle.0.proxy.allowlist.end_setup();
    Ok(())
}

/// Makes the session's directory only the host opens (0700), where its driver socket is.
pub(crate) fn make_host_dir(dirs: &SessionDirs) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(&dirs.host).map_err(|e| format!("cannot create {}: {e}", dirs.host.display()))?;
    std::fs::set_permissions(&dirs.host, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot close {} to others: {e}", dirs.host.display()))
}

/// Binds the driver's listening socket at its host path (a stale one of an earlier sandbox is
/// replaced: the directory is the host's, so nothing else can have put it there).
fn bind_driver_socket(dirs: &SessionDirs) -> Result<std::os::unix::net::UnixListener, String> {
    make_host_dir(dirs)?;
    let socket = dirs.driver_socket();
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(format!("cannot replace {}: {error}", socket.display())),
    }
    std::os::unix::net::UnixListener::bind(&socket).map_err(|e| format!("cannot listen on {}: {e}", socket.display()))
}

/// The last `max` bytes of `text`, cut at a character boundary.
fn tail_chars(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}
