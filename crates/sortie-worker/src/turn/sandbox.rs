//! A session's sandbox as the host holds it: the [`SandboxHandle`] a turn runs in, taken over from an
//! earlier process ([`adopt`]) or torn down ([`destroy`]), and the session's own disk under it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_protocol::SessionId;
use sortie_sandbox::local::disk::{Quota, SessionDisk};
use sortie_store::{SandboxReading, SessionRow};

use super::Failure;
use super::proxy::{self, SandboxProxy, session_upstream};
use crate::Context;
use crate::client::DriverClient;
use crate::meter::CurrentTurn;
use crate::prepare::SessionDirs;

/// A live sandbox of a session: its name, directories, egress allowlist and the proxy serving it.
#[derive(Clone)]
pub struct SandboxHandle(pub(super) Arc<HandleInner>);

pub(super) struct HandleInner {
    pub(super) name: String,
    pub(super) dirs: SessionDirs,
    /// The running turn's transcript, for the parts of sortie's own its proxies report.
    pub(super) current: Arc<CurrentTurn>,
    /// What serves its `egress.sock` (or a pod's egress): allowlist, model meter, git upstream and push
    /// record.
    pub(super) proxy: SandboxProxy,
    /// Its driver, on the socket the host made or over the pod's link.
    pub(super) driver: DriverClient,
}

impl SandboxHandle {
    /// A local sandbox, its driver on the host's socket in `dirs`.
    pub(super) fn new(name: String, dirs: SessionDirs, current: Arc<CurrentTurn>, proxy: SandboxProxy) -> Self {
        let driver = DriverClient::new(dirs.driver_socket());
        Self::with_driver(name, dirs, current, proxy, driver)
    }

    pub(super) fn with_driver(
        name: String,
        dirs: SessionDirs,
        current: Arc<CurrentTurn>,
        proxy: SandboxProxy,
        driver: DriverClient,
    ) -> Self {
        Self(Arc::new(HandleInner {
            name,
            dirs,
            current,
            proxy,
            driver,
        }))
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    pub(super) fn driver(&self) -> DriverClient {
        self.0.driver.clone()
    }
}

/// Kills every process of the sandbox, stops its proxy and forgets it; the session's directories stay.
pub(crate) async fn destroy(context: &Arc<Context>, session_id: &SessionId, sandbox: &SandboxHandle) {
    sandbox.0.current.set(None);
    if let Some(task) = &sandbox.0.proxy.task {
        task.abort();
    }
    match destroy_named(context, sandbox.name()).await {
        Ok(usage) => {
            // What it used since its last turn ended counts to that turn.
            let turn = context
                .store
                .session_by_id(session_id)
                .await
                .ok()
                .and_then(|s| s.current_turn)
                .unwrap_or(1);
            record_usage(context, session_id, turn, usage).await;
        }
        Err(error) => tracing::debug!(%error, session = %session_id, "destroy"),
    }
    if let Err(error) = context.store.delete_sandbox(session_id).await {
        tracing::warn!(%error, session = %session_id, "cannot forget the sandbox in the store");
    }
    // Both sockets are the host's, in directories only the host writes.
    let _ = std::fs::remove_file(sandbox.0.dirs.egress_socket());
    let _ = std::fs::remove_file(sandbox.0.dirs.driver_socket());
    unmount_disk(&sandbox.0.dirs).await;
}

/// Destroys sandbox `name` with the runtime and, when it was started warm, its slot: the binds into it
/// go before the session's disk is unmounted.
pub(crate) async fn destroy_named(
    context: &Arc<Context>,
    name: &str,
) -> Result<sortie_sandbox::Usage, sortie_sandbox::SandboxError> {
    let destroyed = context.runtime.destroy(name).await;
    // Only once nothing of the sandbox runs: a process that survived keeps the slot (and the session's
    // disk, bound in it) until its keeper ends it and the next start clears the slot.
    let gone = matches!(destroyed, Ok(_) | Err(sortie_sandbox::SandboxError::Unknown(_)));
    if gone && context.pods.is_none() && crate::pool::is_warm(name) {
        crate::pool::release(&crate::pool::slot_of(&context.config.work_dir, name)).await;
    }
    destroyed
}

/// Meters what the sandbox used during turn `n`, read from its cgroups as the turn ends (before it
/// could hibernate), so a session's compute is true while it is idle.
pub(super) async fn meter_turn(context: &Arc<Context>, session_id: &SessionId, n: u32, sandbox: &SandboxHandle) {
    match context.runtime.usage(sandbox.name()).await {
        Ok(usage) => record_usage(context, session_id, n, usage).await,
        Err(error) => tracing::debug!(%error, session = %session_id, "cannot read the sandbox's usage"),
    }
}

async fn record_usage(context: &Arc<Context>, session_id: &SessionId, n: u32, usage: sortie_sandbox::Usage) {
    let reading = SandboxReading {
        cpu_ms: (usage.cpu_seconds * 1000.0).round().max(0.0) as u64,
        peak_memory_bytes: usage.peak_memory_bytes,
    };
    if let Err(error) = context
        .store
        .meter_sandbox(session_id, n, sortie_store::now_ms(), reading)
        .await
    {
        tracing::warn!(%error, session = %session_id, "cannot record the sandbox's usage");
    }
}

/// Takes over the sandbox of `session` that an earlier process of this worker left running (its
/// driver answers on the host's socket): the runtime adopts it, and its egress, git and model proxies
/// are served again on its socket. Anything short of that destroys it.
pub(crate) async fn adopt(context: &Arc<Context>, session: &SessionRow, name: &str) -> Result<SandboxHandle, String> {
    if let Some(pods) = &context.pods {
        return super::pod::adopt(context, pods, session, name).await;
    }
    context.runtime.adopt(name).await.map_err(|e| e.to_string())?;
    let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
    let driver = DriverClient::new(dirs.driver_socket());
    let answered_by = Instant::now() + Duration::from_secs(2);
    while driver.status().await.is_err() {
        if Instant::now() >= answered_by {
            let _ = destroy_named(context, name).await;
            return Err("its driver does not answer".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let current = Arc::new(CurrentTurn::default());
    let proxy = match session_upstream(context, session).await {
        Ok((upstream, _)) => proxy::serve_proxy(context, session, &dirs, upstream, &current),
        Err(failure) => Err(failure),
    };
    let proxy = match proxy {
        Ok(proxy) => proxy,
        Err((_, reason)) => {
            let _ = destroy_named(context, name).await;
            return Err(reason);
        }
    };
    if crate::pool::is_warm(name)
        && let Err(reason) = crate::pool::relink_egress(&context.config.work_dir, name, &dirs)
    {
        let _ = destroy_named(context, name).await;
        return Err(reason);
    }
    // Only a sandbox past its setup is adopted: the agent phase's allowlist.
    proxy.allowlist.end_setup();
    Ok(SandboxHandle::new(name.to_owned(), dirs, current, proxy))
}

/// Mounts the session's disk (made on first use) where its workspace and home live, so a sandbox that
/// fills them runs out of its own space, never the host's. Without root there is no quota: said once
/// in the log, not a failure.
pub(super) async fn mount_disk(context: &Arc<Context>, dirs: &SessionDirs) -> Result<(), Failure> {
    if !dirs.has_disk() {
        return Ok(());
    }
    let size_bytes = context.config.limits.disk_bytes;
    let disk = match &context.spares {
        Some(spares) => {
            let disk = SessionDisk::ensure_from_spares(&dirs.image, &dirs.disk, size_bytes, &spares.dir).await;
            spares.taken();
            disk
        }
        None => SessionDisk::ensure(&dirs.image, &dirs.disk, size_bytes).await,
    };
    let disk =
        disk.map_err(|error| super::start_failed(format!("the session's disk could not be mounted: {error}")))?;
    if let Quota::Unenforced { reason } = disk.quota() {
        tracing::warn!(disk = %dirs.disk.display(), %reason, "the session has no disk quota");
    }
    Ok(())
}

/// Unmounts the session's disk once nothing of its sandbox runs (the image stays, for the next one).
pub(super) async fn unmount_disk(dirs: &SessionDirs) {
    if !dirs.has_disk() {
        return;
    }
    match sortie_sandbox::local::disk::unmount(&dirs.disk).await {
        Ok(sortie_sandbox::local::disk::Unmounted::Detached) => {
            tracing::info!(disk = %dirs.disk.display(), "the session's disk was busy; detached lazily");
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(disk = %dirs.disk.display(), %error, "cannot unmount the session's disk"),
    }
}

/// Why the session's disk is full, if it is (read by the host from the filesystem itself).
pub(super) fn disk_full(dirs: &SessionDirs) -> Option<String> {
    if !dirs.has_disk() {
        return None;
    }
    let usage = sortie_sandbox::local::disk::filesystem_usage(&dirs.disk).ok()?;
    usage.is_full().then(|| usage.describe())
}
