//! The warm pool (local runtime, as root; DESIGN §10): per agent profile, a few sandboxes started
//! ahead of any session, their driver up and awaiting an assignment, so a session's first turn does
//! not wait for a sandbox to start. A session takes one ([`WarmPool::take`]: each is handed out once,
//! under a lock), the host binds its workspace, home and mirror in ([`sortie_sandbox::local::slot`]),
//! links its egress socket and secret digests, and assigns it; from then on it is the session's
//! sandbox like any other, recorded under its own name. The pool refills in the background.
//!
//! Bounds: the pool holds at most the workspace's sandbox limit (a session takes one only once its
//! workspace has room), and starts none while the host has less memory available than one sandbox
//! may use. A warm sandbox nobody took is destroyed when `serve` stops, and one left by a process that
//! died is destroyed at the next start's reconciliation ([`clear_leftovers`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sortie_protocol::driver::DriverErrorCode;
use sortie_sandbox::local::slot::WarmSlot;
use sortie_sandbox::{SandboxSpec, SandboxStdio};
use sortie_store::SessionRow;

use crate::Context;
use crate::client::DriverClient;
use crate::prepare::SessionDirs;

/// Every warm sandbox's name starts with this (its cgroup and state are named by it, and the store
/// records it once a session has it).
pub const NAME_PREFIX: &str = "warm_";
/// Where a warm sandbox's driver finds the session's secret digests, in its read-only egress dir.
const SECRET_DIGESTS_INSIDE: &str = "/run/sortie-egress/known-secrets";
/// How long the pool waits before it tries again after a warm sandbox would not start.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How often a full pool looks at the host's memory and its own count again.
const LOOK_AGAIN_EVERY: Duration = Duration::from_secs(30);

/// Whether the sandbox `name` was started warm (its slot is released when it goes).
pub fn is_warm(name: &str) -> bool {
    name.starts_with(NAME_PREFIX)
}

/// The slot of warm sandbox `name` under the worker's work dir: its mounts in `pool/`, the host's names
/// for it in `warm/`.
pub fn slot_of(work_dir: &Path, name: &str) -> WarmSlot {
    WarmSlot::new(work_dir.join("pool").join(name), work_dir.join("warm").join(name))
}

/// One started sandbox awaiting its session.
pub(crate) struct Warm {
    pub name: String,
    pub slot: WarmSlot,
}

/// The warm sandboxes ready, by agent.
pub(crate) struct WarmPool {
    wanted: Vec<(String, usize)>,
    ready: std::sync::Mutex<HashMap<String, Vec<Warm>>>,
    taken: tokio::sync::Notify,
}

impl WarmPool {
    /// The pool the operator asked for (`agent → size`), each size at most `limit` (the workspace's
    /// sandbox limit) and all of them together too; `None` when it holds nothing.
    pub fn new(wanted: &[(String, usize)], limit: usize) -> Option<Self> {
        let mut left = limit;
        let mut sizes = Vec::new();
        for (agent, size) in wanted {
            let size = (*size).min(left);
            left -= size;
            if size > 0 {
                sizes.push((agent.clone(), size));
            }
        }
        (!sizes.is_empty()).then(|| Self {
            wanted: sizes,
            ready: std::sync::Mutex::new(HashMap::new()),
            taken: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Warm>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A warm sandbox for `agent`, if one is ready: it leaves the pool here, so no other caller can
    /// have it.
    pub fn take(&self, agent: &str) -> Option<Warm> {
        let warm = self.lock().get_mut(agent).and_then(Vec::pop);
        if warm.is_some() {
            self.taken.notify_one();
            self.gauge(agent);
        }
        warm
    }

    fn count(&self, agent: &str) -> usize {
        self.lock().get(agent).map_or(0, Vec::len)
    }

    fn put(&self, agent: &str, warm: Warm) {
        self.lock().entry(agent.to_owned()).or_default().push(warm);
        self.gauge(agent);
    }

    fn gauge(&self, agent: &str) {
        metrics::gauge!("sortie_warm_sandboxes", "agent" => agent.to_owned()).set(self.count(agent) as f64);
    }
}

/// Keeps the pool full until `shutdown`, then destroys the sandboxes still in it.
pub(crate) async fn keep_full(
    context: Arc<Context>,
    pool: Arc<WarmPool>,
    mut shutdown: tokio::sync::oneshot::Receiver<()>,
) {
    for (agent, _) in &pool.wanted {
        pool.gauge(agent);
    }
    'keep: loop {
        let mut pause = LOOK_AGAIN_EVERY;
        'fill: for (agent, size) in &pool.wanted {
            while pool.count(agent) < *size {
                // A start is never cut short (it would leave a sandbox no one holds); a stop is
                // looked for between starts, each bounded by the driver's deadline.
                if !matches!(
                    shutdown.try_recv(),
                    Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                ) {
                    break 'keep;
                }
                if !memory_allows(&context) {
                    break 'fill;
                }
                match start(&context, agent).await {
                    Ok(warm) => pool.put(agent, warm),
                    Err(reason) => {
                        tracing::warn!(%agent, %reason, "a warm sandbox did not start; trying again in 5 s");
                        pause = RETRY_AFTER;
                        break 'fill;
                    }
                }
            }
        }
        tokio::select! {
            _ = &mut shutdown => break,
            () = pool.taken.notified() => {}
            () = tokio::time::sleep(pause) => {}
        }
    }
    let left: Vec<Warm> = pool.lock().drain().flat_map(|(_, warm)| warm).collect();
    for warm in left {
        discard(&context, &warm.name).await;
    }
    for (agent, _) in &pool.wanted {
        pool.gauge(agent);
    }
}

/// Whether the host has the memory one more sandbox may use (`MemAvailable`), so a pool never
/// takes what running sessions need.
fn memory_allows(context: &Context) -> bool {
    let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else {
        return true;
    };
    let available_kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    available_kib.is_none_or(|kib| kib.saturating_mul(1024) >= context.config.limits.memory_bytes)
}

/// A name no other sandbox of this host has had.
pub(crate) fn fresh_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!(
        "{NAME_PREFIX}{:x}_{}_{}",
        now.as_millis(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Starts one warm sandbox for `agent`: its slot, its driver awaiting an assignment on the host's
/// socket, answered before it joins the pool.
async fn start(context: &Arc<Context>, agent: &str) -> Result<Warm, String> {
    if context.runtime.host_owner().is_none() {
        return Err("a warm sandbox needs sortie to run as root (its workspace is bound in later)".into());
    }
    let name = fresh_name();
    let slot = slot_of(&context.config.work_dir, &name);
    let prepared = {
        let slot = slot.clone();
        tokio::task::spawn_blocking(move || slot.prepare())
            .await
            .map_err(|e| e.to_string())
    };
    if let Err(reason) = prepared.and_then(|made| made.map_err(|e| e.to_string())) {
        release(&slot).await;
        return Err(reason);
    }
    match start_in(context, agent, &name, &slot).await {
        Ok(()) => Ok(Warm { name, slot }),
        Err(reason) => {
            discard(context, &name).await;
            Err(reason)
        }
    }
}

async fn start_in(context: &Arc<Context>, agent: &str, name: &str, slot: &WarmSlot) -> Result<(), String> {
    let config = &context.config;
    let socket = slot.host().join("driver.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    let crate::turn::DriverCommand { mut command, read_only } =
        crate::turn::driver_command(context, agent).map_err(|(_, reason)| reason)?;
    command.push("--await-assignment".into());
    let spec = SandboxSpec {
        name: name.to_owned(),
        workspace: slot.workspace(),
        home: slot.home(),
        egress_dir: Some(slot.egress()),
        read_only,
        // The session's mirror is bound in under this at the assignment, at the path the workspace's
        // alternates name.
        read_only_at: vec![(slot.mirrors(), config.work_dir.join("mirrors"))],
        late_binds: true,
        env: Vec::new(),
        command,
        limits: config.limits,
        stdio: SandboxStdio::Listener(Arc::new(listener)),
    };
    context.runtime.create(spec).await.map_err(|e| e.to_string())?;
    context.runtime.start(name).await.map_err(|e| e.to_string())?;
    let driver = DriverClient::new(&socket);
    crate::turn::await_driver(
        context,
        name,
        &driver,
        |answer| matches!(answer, Err(error) if error.code() == Some(DriverErrorCode::NotAssigned)),
    )
    .await
    .map_err(|(_, reason)| reason)
}

/// Gives the warm sandbox to `session`, whose workspace and home are made and whose egress proxy
/// serves `dirs`' socket: binds them in, links the sockets and digests, and assigns its driver.
pub(crate) async fn assign(
    context: &Arc<Context>,
    session: &SessionRow,
    dirs: &SessionDirs,
    mirror: &Path,
    warm: &Warm,
) -> Result<(), String> {
    let config = &context.config;
    let relative = mirror
        .strip_prefix(config.work_dir.join("mirrors"))
        .map_err(|_| format!("the mirror {} is not under the work dir's mirrors", mirror.display()))?
        .to_owned();
    let binds = [
        (dirs.workspace.clone(), warm.slot.workspace(), false),
        (dirs.home.clone(), warm.slot.home(), false),
        (mirror.to_owned(), warm.slot.mirrors().join(relative), true),
    ];
    let slot = warm.slot.clone();
    tokio::task::spawn_blocking(move || {
        binds
            .iter()
            .try_for_each(|(source, target, read_only)| slot.bind(source, target, *read_only))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    // The host's names, in directories the sandbox cannot write: the same inodes under the slot.
    link(&dirs.egress_socket(), &warm.slot.egress().join("egress.sock"))?;
    link(&dirs.known_secrets, &warm.slot.egress().join("known-secrets"))?;
    crate::turn::make_host_dir(dirs)?;
    link(&warm.slot.host().join("driver.sock"), &dirs.driver_socket())?;
    let assignment = crate::turn::assignment(config, session, None, Some(SECRET_DIGESTS_INSIDE.into()));
    DriverClient::new(dirs.driver_socket())
        .assign(&assignment)
        .await
        .map_err(|e| format!("the warm sandbox's driver refused its assignment: {e}"))
}

/// Links the egress socket of a warm sandbox again, after the proxy of an adopted one was served
/// anew (a new socket at the session's name).
pub(crate) fn relink_egress(work_dir: &Path, name: &str, dirs: &SessionDirs) -> Result<(), String> {
    link(
        &dirs.egress_socket(),
        &slot_of(work_dir, name).egress().join("egress.sock"),
    )
}

/// Hard-links `to` to `from`'s inode, replacing what `to` was (both names are the host's).
fn link(from: &Path, to: &Path) -> Result<(), String> {
    match std::fs::remove_file(to) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(format!("cannot replace {}: {error}", to.display())),
    }
    std::fs::hard_link(from, to).map_err(|e| format!("cannot link {} at {}: {e}", from.display(), to.display()))
}

/// Destroys warm sandbox `name` and its slot (said in the log if it would not go: its keeper ends it
/// after the orphan grace, and the next start clears the slot).
pub(crate) async fn discard(context: &Arc<Context>, name: &str) {
    if let Err(error) = crate::turn::destroy_named(context, name).await {
        tracing::warn!(%error, sandbox = %name, "cannot destroy a warm sandbox");
    }
}

/// Unmounts and removes a warm sandbox's slot once the sandbox is gone.
pub(crate) async fn release(slot: &WarmSlot) {
    let slot = slot.clone();
    let root = slot.root().to_owned();
    match tokio::task::spawn_blocking(move || slot.release()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, slot = %root.display(), "cannot release a warm sandbox's slot"),
        Err(error) => tracing::warn!(%error, slot = %root.display(), "cannot release a warm sandbox's slot"),
    }
}

/// Destroys the warm sandboxes an earlier process left unassigned (the store names every assigned
/// one, which that process's sessions keep).
pub(crate) async fn clear_leftovers(context: &Arc<Context>) {
    let work_dir = &context.config.work_dir;
    let mut names = std::collections::BTreeSet::new();
    for dir in [work_dir.join("pool"), work_dir.join("warm")] {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            names.extend(
                entries
                    .filter_map(Result::ok)
                    .filter_map(|entry| entry.file_name().to_str().map(str::to_owned))
                    .filter(|name| is_warm(name)),
            );
        }
    }
    if names.is_empty() {
        return;
    }
    let assigned: std::collections::HashSet<String> = match context.store.sandboxes().await {
        Ok(rows) => rows.into_iter().map(|row| row.handle).collect(),
        // Without the store's word nothing is known to be unassigned.
        Err(_) => return,
    };
    for name in names.iter().filter(|name| !assigned.contains(*name)) {
        discard(context, name).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(sizes: &[(&str, usize)]) -> Vec<(String, usize)> {
        sizes.iter().map(|(agent, size)| ((*agent).to_owned(), *size)).collect()
    }

    #[test]
    fn the_pool_holds_at_most_the_workspaces_sandbox_limit_in_all() {
        let pool = WarmPool::new(&wanted(&[("claude-code", 3), ("codex", 2), ("gemini", 1)]), 4).expect("a pool");
        assert_eq!(pool.wanted, wanted(&[("claude-code", 3), ("codex", 1)]));
        assert!(WarmPool::new(&wanted(&[("claude-code", 0)]), 4).is_none());
        assert!(WarmPool::new(&[], 4).is_none());
    }

    #[test]
    fn each_warm_sandbox_is_taken_once_by_concurrent_takers() {
        let pool = Arc::new(WarmPool::new(&wanted(&[("scripted", 2)]), 4).expect("a pool"));
        for name in ["warm_a", "warm_b"] {
            pool.put(
                "scripted",
                Warm {
                    name: name.into(),
                    slot: slot_of(Path::new("/srv/work"), name),
                },
            );
        }
        let takers: Vec<_> = (0..8)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || pool.take("scripted").map(|warm| warm.name))
            })
            .collect();
        let mut taken: Vec<String> = takers
            .into_iter()
            .filter_map(|taker| taker.join().expect("taker"))
            .collect();
        taken.sort();
        assert_eq!(taken, ["warm_a", "warm_b"]);
        assert!(pool.take("scripted").is_none());
        assert!(pool.take("codex").is_none());
    }

    #[test]
    fn warm_names_are_told_apart_from_session_sandboxes() {
        let name = fresh_name();
        assert!(is_warm(&name), "{name}");
        assert_ne!(name, fresh_name());
        assert!(name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
        assert!(!is_warm("ses_01jxyz"));
    }
}
