//! The worker role (DESIGN §2, §4.1): claims accepted turns (a compare-and-set in the store), keeps at
//! most a configured number of live sandboxes per workspace, prepares each session's workspace from a
//! per-repository mirror, runs its sandbox with the driver and a per-sandbox egress proxy (which also
//! serves the git proxy for the session's repository only), records every part into the store,
//! settles turns and sessions, hibernates idle sandboxes and, when it starts, reconciles what an
//! earlier process left behind.
//!
//! One event loop owns the live sandboxes ([`run`]); each turn runs as a task of its own and reports
//! back with an [`Event`]. Every wait has a deadline: a session never hangs.

pub mod client;
pub(crate) mod forge;
pub mod git_proxy;
mod github;
pub mod host;
pub mod meter;
pub mod pods;
mod pool;
pub mod prepare;
pub mod priming;
pub mod pull_request;
pub mod recorder;
pub mod retention;
pub mod settings;
mod spares;
pub mod transcript;
mod turn;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_gateway::egress::policy::Cidr;
use sortie_gateway::egress::proxy::Resolver;
use sortie_gateway::live::{Feeds, LiveTails, SocketTails};
use sortie_protocol::{SessionId, SessionPhase};
use sortie_sandbox::{Limits, SandboxRuntime};
use sortie_store::Store;

pub use settings::{SettingsError, WorkerSettings};
pub use turn::SandboxHandle;

/// The `queued_reason` of a session waiting for a sandbox slot.
pub const CAPACITY_REASON: &str = "SANDBOX_CAPACITY_LIMIT";

/// How a worker runs.
#[derive(Clone)]
pub struct WorkerConfig {
    /// Names this worker's claims (`turns.claimed_by`) and sandboxes.
    pub worker_id: String,
    /// `mirrors/`, `sessions/<id>/{workspace,home,run,egress}`, the runtime's state; every ancestor must
    /// be searchable by the sandbox uid.
    pub work_dir: PathBuf,
    /// The `sortie` binary bound read-only into every sandbox (it runs `sortie driver` there), with
    /// the session's agent command when that lies beside it (those files only, not their directory).
    pub sortie_exe: PathBuf,
    /// An agent manifest (TOML) given to the driver, bound read-only.
    pub agent_profiles: Option<PathBuf>,
    /// Where `sortie agents install` put agents; bound read-only when it exists.
    pub agents_dir: Option<PathBuf>,
    pub git_binary: PathBuf,
    /// What parks in a session's git cgroup ahead of each of its git children (`sortie git-launch`);
    /// `None`: each is forked into the cgroup when it is needed.
    pub git_launcher: Option<sortie_gateway::git::config::GitLauncher>,
    /// Live sandboxes (provisioning, running or warm) per workspace; more turns wait in `queued`.
    pub sandboxes_per_workspace: usize,
    /// A turn running longer fails `TURN_TIMEOUT` (the driver enforces it; the worker gives up on a
    /// driver that has not ended the turn a grace period later: `SANDBOX_LOST`).
    pub turn_timeout: Duration,
    /// A warm sandbox idle this long is destroyed and its session `hibernated`.
    pub idle_grace: Duration,
    /// How long the model proxy holds a request at the session's token budget before the turn ends
    /// `BUDGET_EXCEEDED` (its work delivered).
    pub budget_wait: Duration,
    /// Retention's age, applied every [`RETENTION_EVERY`]; `None`: nothing is pruned but by `sortie gc`.
    pub retention: Option<Duration>,
    pub setup_timeout: Duration,
    /// Hosts allowed during the setup phase only (package registries, from config or the host's settings).
    pub setup_hosts: Vec<String>,
    /// Addresses the egress proxy may connect to although they are private (an internal registry; tests).
    pub egress_exempt: Vec<Cidr>,
    pub resolver: Arc<dyn Resolver>,
    pub limits: Limits,
    /// How often the store is asked for work.
    pub poll_interval: Duration,
    /// Opens the workspaces' model keys for the model proxy; `None`: no key is ever injected.
    pub keyring: Option<Arc<sortie_store::KeyRing>>,
    /// Where the model proxy forwards each API.
    pub model_upstreams: sortie_gateway::model::Upstreams,
    /// Reaches forges (`https://` repositories) for the git proxy, with the platform's roots and any
    /// extra the operator trusts; `None`: the platform's roots only, made when the worker starts.
    pub forge_http: Option<reqwest::Client>,
    /// The CA bundle host-side git trusts for forges (the platform's plus the operator's extra roots);
    /// `None`: git's default.
    pub forge_ca_bundle: Option<PathBuf>,
    /// Author of delivered commits.
    pub author_name: String,
    pub author_email: String,
    /// Warm sandboxes to keep started, by agent (`--warm-sandboxes AGENT=N`; local runtime, as root).
    pub warm_pool: Vec<(String, usize)>,
    /// For how many repositories a disk is kept with a workspace checked out ahead (local runtime, as
    /// root).
    pub primed_workspaces: usize,
}

/// This host and work dir: what a restarted worker finds again (its sandboxes lived there and
/// died with it), and what no other worker shares.
fn default_worker_id(work_dir: &Path) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), work_dir.display())
}

impl WorkerConfig {
    pub fn new(work_dir: PathBuf, sortie_exe: PathBuf) -> Self {
        Self {
            worker_id: default_worker_id(&work_dir),
            work_dir,
            sortie_exe,
            agent_profiles: None,
            agents_dir: None,
            git_binary: PathBuf::from("git"),
            git_launcher: None,
            sandboxes_per_workspace: 4,
            turn_timeout: Duration::from_secs(30 * 60),
            idle_grace: Duration::from_secs(10 * 60),
            retention: None,
            budget_wait: Duration::from_secs(15 * 60),
            setup_timeout: Duration::from_secs(10 * 60),
            setup_hosts: Vec::new(),
            egress_exempt: Vec::new(),
            resolver: Arc::new(sortie_gateway::egress::proxy::SystemResolver),
            limits: Limits::default(),
            poll_interval: Duration::from_millis(100),
            keyring: None,
            model_upstreams: sortie_gateway::model::Upstreams::default(),
            forge_http: None,
            forge_ca_bundle: None,
            author_name: "sortie".into(),
            author_email: "sortie@localhost".into(),
            warm_pool: Vec::new(),
            primed_workspaces: spares::PRIMED_WORKSPACES,
        }
    }
}

/// The worker's feed socket under `work_dir`: the live tails of its running turns, for a gateway in
/// another process on this host. Its directory is the host's alone (0700).
pub fn feed_socket(work_dir: &Path) -> PathBuf {
    work_dir.join("host").join("feeds.sock")
}

/// The live tails of a worker running in another process on this host, through its feed socket: a
/// gateway started alone (`--roles gateway`) beside a worker serves live tails through it.
pub fn work_dir_tails(work_dir: &Path) -> Arc<dyn LiveTails> {
    Arc::new(SocketTails(feed_socket(work_dir)))
}

/// What the worker's tasks tell its loop.
pub enum Event {
    /// A turn task ended; `keep` is the sandbox to keep warm, if any.
    TurnEnded {
        session_id: SessionId,
        keep: Option<SandboxHandle>,
    },
}

/// Sandboxes taken over at once at start.
const ADOPTIONS_AT_ONCE: usize = 8;

/// Shared by the loop and its turn tasks.
pub(crate) struct Context {
    pub config: WorkerConfig,
    pub store: Arc<dyn Store>,
    pub runtime: Arc<dyn SandboxRuntime>,
    /// The runtime again when it is pods (`--runtime kubernetes`): sandboxes are claimed, not made.
    pub pods: Option<Arc<pods::Pods>>,
    /// The host's live copy of every running turn (what attach serves).
    pub feeds: Arc<Feeds>,
    /// One mirror fetch at a time per repository.
    pub mirror_locks: tokio::sync::Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// Pods being let go at hibernation (their home kept first), by session: the session's next pod
    /// waits for its last one's home.
    pub releasing: std::sync::Mutex<HashMap<SessionId, tokio::sync::watch::Receiver<bool>>>,
    /// GitHub App connections' installation tokens.
    pub app_tokens: forge::AppTokens,
    /// Whom the worker last refused on GitHub, to answer each once in a while.
    pub(crate) github_refusals: github::Refusals,
    /// Sandboxes started ahead of their sessions (local runtime, as root), if the operator wants them.
    pub(crate) pool: Option<Arc<pool::WarmPool>>,
    /// Session disks made ahead, formatted or with a workspace checked out (local runtime, as root: only
    /// then has a session a disk).
    pub(crate) spares: Option<Arc<spares::SpareDisks>>,
}

impl Context {
    /// Waits until the session's last pod has been let go, if one is being (bounded by the release's
    /// own deadlines).
    pub async fn released(&self, session_id: &SessionId) {
        let pending = self
            .releasing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session_id)
            .cloned();
        if let Some(mut done) = pending {
            // An error: the release task ended without saying so, which is the same.
            let _ = done.wait_for(|done| *done).await;
        }
    }

    pub async fn mirror_lock(&self, path: &Path) -> Arc<tokio::sync::Mutex<()>> {
        self.mirror_locks
            .lock()
            .await
            .entry(path.to_owned())
            .or_default()
            .clone()
    }
}

/// A session the loop holds a sandbox slot for.
struct Slot {
    workspace_id: String,
    /// The sandbox, while one is up and no turn task holds it.
    warm: Option<SandboxHandle>,
    /// A turn task runs for it.
    busy: bool,
    idle_since: Instant,
}

pub struct Worker {
    context: Arc<Context>,
    /// Where gateways on other hosts reach this worker's feed ([`Worker::feed_router`]), registered in
    /// the store when the worker starts.
    feed_url: Option<String>,
    /// Sandboxes [`Worker::reconcile`] took over from an earlier process, for [`Worker::run`] to hold.
    adopted: std::sync::Mutex<Vec<Adopted>>,
}

/// A sandbox an earlier process of this worker left running, taken over at start.
struct Adopted {
    session: sortie_store::SessionRow,
    /// The turn it was running, to follow to its end; `None` for a warm sandbox.
    turn: Option<sortie_store::TurnRow>,
    sandbox: SandboxHandle,
}

impl Worker {
    pub fn new(config: WorkerConfig, store: Arc<dyn Store>, runtime: Arc<dyn SandboxRuntime>) -> Self {
        Self::with_runtime(config, store, runtime, None)
    }

    /// A worker whose sandboxes are pods claimed from a cluster.
    pub fn on_pods(config: WorkerConfig, store: Arc<dyn Store>, pods: Arc<pods::Pods>) -> Self {
        Self::with_runtime(config, store, pods.clone(), Some(pods))
    }

    fn with_runtime(
        mut config: WorkerConfig,
        store: Arc<dyn Store>,
        runtime: Arc<dyn SandboxRuntime>,
        pods: Option<Arc<pods::Pods>>,
    ) -> Self {
        if config.forge_http.is_none() {
            config.forge_http = sortie_gateway::git::http::forge_client(&Default::default())
                .inspect_err(|error| tracing::error!(%error, "forges cannot be reached"))
                .ok();
        }
        let pool = match pods {
            Some(_) => None,
            None if runtime.host_owner().is_none() => {
                if !config.warm_pool.is_empty() {
                    tracing::warn!(
                        "no warm sandboxes: they need sortie to run as root (a session's workspace is bound into one)"
                    );
                }
                None
            }
            None => pool::WarmPool::new(&config.warm_pool, config.sandboxes_per_workspace).map(Arc::new),
        };
        let spares = match (&pods, runtime.host_owner()) {
            (None, Some(owner)) => Some(Arc::new(spares::SpareDisks::new(
                &config.work_dir,
                config.limits.disk_bytes,
                config.git_binary.clone(),
                owner,
                config.primed_workspaces,
            ))),
            _ => None,
        };
        Self {
            context: Arc::new(Context {
                config,
                store,
                runtime,
                pods,
                feeds: Feeds::new(),
                mirror_locks: tokio::sync::Mutex::new(HashMap::new()),
                releasing: std::sync::Mutex::new(HashMap::new()),
                app_tokens: forge::AppTokens::default(),
                github_refusals: github::Refusals::default(),
                pool,
                spares,
            }),
            adopted: std::sync::Mutex::new(Vec::new()),
            feed_url: None,
        }
    }

    /// Says where gateways on other hosts reach this worker's feed (the address a listener serving
    /// [`Worker::feed_router`] is reached at); registered in the store by [`Worker::run`].
    pub fn advertise_feed(&mut self, url: &sortie_gateway::live::FeedUrl) {
        self.feed_url = Some(url.to_string());
    }

    /// The live copies of this worker's running turns for gateways of other processes and hosts, each
    /// request with a feed token signed with `ticket_secret`.
    pub fn feed_router(&self, ticket_secret: Arc<[u8]>) -> axum::Router {
        sortie_gateway::live::feed_router(
            self.context.feeds.clone(),
            sortie_gateway::live::FeedAccess::Token(ticket_secret),
        )
    }

    /// For the gateway's attach: the live copies of this worker's running turns.
    pub fn live_tails(&self) -> Arc<dyn LiveTails> {
        self.context.feeds.clone()
    }

    /// Settles what this worker held before it last stopped; call it once before [`Worker::run`]
    /// (`sortie serve` does before it says it listens, so a client never sees a stale session).
    pub async fn reconcile(&self) {
        let adopted = reconcile(&self.context).await;
        self.adopted.lock().unwrap_or_else(|p| p.into_inner()).extend(adopted);
    }

    /// Runs until `shutdown` completes, then destroys the sandboxes it holds.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let context = self.context;
        // Gateways find this worker's running turns through this; a worker without a feed listener
        // says so too (a stale address of an earlier run is never tried).
        if let Err(error) = context
            .store
            .register_worker(&context.config.worker_id, self.feed_url.as_deref())
            .await
        {
            tracing::warn!(%error, "cannot register this worker's feed: gateways of other hosts get no live tails from it");
        }
        let feed_server = serve_feeds(&context);
        let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel::<Event>();
        let mut slots: HashMap<SessionId, Slot> = HashMap::new();
        let adopted = std::mem::take(&mut *self.adopted.lock().unwrap_or_else(|p| p.into_inner()));
        for Adopted { session, turn, sandbox } in adopted {
            let running = turn.is_some();
            slots.insert(
                session.id.clone(),
                Slot {
                    workspace_id: session.workspace_id.clone(),
                    warm: (!running).then(|| sandbox.clone()),
                    busy: running,
                    idle_since: Instant::now(),
                },
            );
            if let Some(turn) = turn {
                let context = context.clone();
                let events = events_tx.clone();
                tokio::spawn(async move {
                    let session_id = session.id.clone();
                    let keep = turn::resume(&context, session, turn, sandbox).await;
                    if keep.is_none() {
                        end_cancel(&context, &session_id).await;
                    }
                    // The loop is gone only at shutdown, when nothing waits for this any more.
                    let _ = events.send(Event::TurnEnded { session_id, keep });
                });
            }
        }
        let (pool_stop, pool_stopped) = tokio::sync::oneshot::channel::<()>();
        let pool = context
            .pool
            .clone()
            .map(|pool| tokio::spawn(pool::keep_full(context.clone(), pool, pool_stopped)));
        let (spares_stop, spares_stopped) = tokio::sync::oneshot::channel::<()>();
        let spares = context
            .spares
            .clone()
            .map(|spares| tokio::spawn(spares::keep_spare_disks(spares, spares_stopped)));
        let (triggers_stop, triggers_stopped) = tokio::sync::oneshot::channel::<()>();
        let triggers = tokio::spawn(github::run_triggers(context.clone(), async move {
            let _ = triggers_stopped.await;
        }));
        // Registered at zero, so a dashboard or an alert finds the series before the first pause.
        metrics::counter!("sortie_budget_pauses_total").increment(0);
        let retention = context.config.retention.map(|age| {
            let store = context.store.clone();
            let work_dir = context.config.work_dir.clone();
            tokio::spawn(retain(store, work_dir, age))
        });
        // A turn accepted (a create, a steer, a resume: each commits an event) wakes the loop at once:
        // in this process always, in another where the store hears other processes (PostgreSQL). The
        // tick is then only a safety net; otherwise it is how another process's accepts are found.
        let poll = if context.store.hears_other_processes() {
            context.config.poll_interval.max(SAFETY_NET_POLL)
        } else {
            context.config.poll_interval
        };
        let mut tick = tokio::time::interval(poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut accepted = context.store.event_signal();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = tick.tick() => on_tick(&context, &mut slots, &events_tx).await,
                Ok(()) = accepted.changed() => on_tick(&context, &mut slots, &events_tx).await,
                Some(event) = events.recv() => {
                    // A turn's end commits its event before its slot is free here: the claim that
                    // event woke skipped a steer waiting behind it, so look again now.
                    on_event(&mut slots, event);
                    on_tick(&context, &mut slots, &events_tx).await;
                }
            }
            // Provisioning, running or warm: each holds (or is making) a sandbox of this worker.
            metrics::gauge!("sortie_sandboxes_live").set(slots.len() as f64);
        }
        metrics::gauge!("sortie_sandboxes_live").set(0.0);
        if let Some(server) = feed_server {
            server.abort();
        }
        if let Some(retention) = retention {
            retention.abort();
        }
        let _ = triggers_stop.send(());
        let _ = triggers.await;
        // Sandboxes started for sessions that never came go with this process.
        let _ = pool_stop.send(());
        if let Some(pool) = pool {
            let _ = pool.await;
        }
        let _ = spares_stop.send(());
        if let Some(spares) = spares {
            let _ = spares.await;
        }
        // The sandboxes of turns still running outlive this process (their keepers wait the orphan grace)
        // for the next start to adopt; warm ones are cheap to make again and go now.
        for (session_id, slot) in slots {
            if let Some(sandbox) = slot.warm {
                turn::destroy(&context, &session_id, &sandbox).await;
            }
        }
        // The warm slots' directory stays a mount only while a running sandbox still has a slot in it.
        sortie_sandbox::local::slot::unmount_if_empty(&context.config.work_dir.join("pool"));
    }
}

/// How often the worker reads the store for work when accepts in every process wake it anyway.
pub const SAFETY_NET_POLL: Duration = Duration::from_secs(1);

/// How often the worker applies retention when it is configured.
pub const RETENTION_EVERY: Duration = Duration::from_secs(60 * 60);

/// Retention on a timer: what `sortie gc --older-than age` does, every [`RETENTION_EVERY`].
async fn retain(store: Arc<dyn Store>, work_dir: PathBuf, age: Duration) {
    let mut every = tokio::time::interval(RETENTION_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        match retention::collect(store.as_ref(), &work_dir, age, false).await {
            Ok(report) if report.sessions.is_empty() && report.mirrors.is_empty() => {}
            Ok(report) => tracing::info!(
                sessions = report.sessions.len(),
                mirrors = report.mirrors.len(),
                freed_bytes = report.freed_bytes(),
                "retention freed what ended before its age"
            ),
            Err(error) => tracing::warn!(%error, "retention could not run"),
        }
    }
}

/// Serves the live copies of this worker's turns on its feed socket, for a gateway in another process;
/// `None` (logged) when the socket cannot be made: attach in this process does not need it.
fn serve_feeds(context: &Arc<Context>) -> Option<tokio::task::JoinHandle<()>> {
    use std::os::unix::fs::PermissionsExt;
    let socket = feed_socket(&context.config.work_dir);
    let made = (|| -> std::io::Result<tokio::net::UnixListener> {
        let dir = socket.parent().ok_or_else(|| std::io::Error::other("no directory"))?;
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        match std::fs::remove_file(&socket) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
        tokio::net::UnixListener::bind(&socket)
    })();
    match made {
        Ok(listener) => {
            let router =
                sortie_gateway::live::feed_router(context.feeds.clone(), sortie_gateway::live::FeedAccess::Socket);
            Some(tokio::spawn(async move {
                if let Err(error) = axum::serve(listener, router).await {
                    tracing::warn!(%error, "the feed socket stopped");
                }
            }))
        }
        Err(error) => {
            tracing::warn!(%error, socket = %socket.display(), "no feed socket: a gateway in another process gets no live tails");
            None
        }
    }
}

fn on_event(slots: &mut HashMap<SessionId, Slot>, event: Event) {
    match event {
        Event::TurnEnded { session_id, keep } => match keep {
            Some(sandbox) => {
                if let Some(slot) = slots.get_mut(&session_id) {
                    slot.busy = false;
                    slot.warm = Some(sandbox);
                    slot.idle_since = Instant::now();
                }
            }
            None => {
                slots.remove(&session_id);
            }
        },
    }
}

async fn on_tick(context: &Arc<Context>, slots: &mut HashMap<SessionId, Slot>, events: &EventSender) {
    retire_idle(context, slots).await;
    let Ok(waiting) = context.store.claimable_sessions(64).await else {
        return;
    };
    for session in waiting {
        if slots.get(&session.id).is_some_and(|slot| slot.busy) {
            continue;
        }
        let warm = slots.get_mut(&session.id).and_then(|slot| slot.warm.take());
        if let Some(sandbox) = warm {
            if session.resume_requested && session.n_waiting == 0 {
                // A resume of a session whose sandbox is still warm: nothing to provision. A claim
                // lost to a steer or a cancel leaves the session to it.
                if matches!(context.store.claim_resume(&session.id).await, Ok(true))
                    && let Err(error) = context
                        .store
                        .settle_session(&session.id, SessionPhase::Provisioning, false)
                        .await
                {
                    tracing::warn!(%error, session = %session.id, "cannot settle the resume");
                }
                if let Some(slot) = slots.get_mut(&session.id) {
                    slot.warm = Some(sandbox);
                }
                continue;
            }
            match context
                .store
                .claim_turn(&session.id, true, &context.config.worker_id)
                .await
            {
                Ok(Some(turn)) => {
                    if let Some(slot) = slots.get_mut(&session.id) {
                        slot.busy = true;
                    }
                    spawn_turn(context, events, session, Some(turn), Some(sandbox));
                }
                _ => {
                    if let Some(slot) = slots.get_mut(&session.id) {
                        slot.warm = Some(sandbox);
                    }
                }
            }
            continue;
        }
        if !make_room(context, slots, &session.workspace_id).await {
            // Only what the session shows while it waits: the next tick writes it again.
            let _ = context
                .store
                .set_queued_reason(&session.id, Some(CAPACITY_REASON))
                .await;
            continue;
        }
        let claimed = if session.resume_requested && session.n_waiting == 0 {
            match context.store.claim_resume(&session.id).await {
                Ok(true) => Some(None),
                _ => None,
            }
        } else {
            match context
                .store
                .claim_turn(&session.id, false, &context.config.worker_id)
                .await
            {
                Ok(Some(turn)) => Some(Some(turn)),
                _ => None,
            }
        };
        let Some(turn) = claimed else { continue };
        slots.insert(
            session.id.clone(),
            Slot {
                workspace_id: session.workspace_id.clone(),
                warm: None,
                busy: true,
                idle_since: Instant::now(),
            },
        );
        spawn_turn(context, events, session, turn, None);
    }
}

type EventSender = tokio::sync::mpsc::UnboundedSender<Event>;

fn spawn_turn(
    context: &Arc<Context>,
    events: &EventSender,
    session: sortie_store::SessionRow,
    turn: Option<sortie_store::TurnRow>,
    sandbox: Option<SandboxHandle>,
) {
    let context = context.clone();
    let events = events.clone();
    tokio::spawn(async move {
        let session_id = session.id.clone();
        // The forge hears of the turn off its path: a slow forge holds up no turn.
        let on_github = turn.as_ref().map(|turn| {
            let (context, before) = (context.clone(), session.clone());
            let started = tokio::spawn(async move { github::turn_started(&context, &before).await });
            (session.clone(), turn.n, started)
        });
        let keep = turn::run(&context, session, turn, sandbox).await;
        if let Some((session, n, started)) = on_github {
            let context = context.clone();
            tokio::spawn(async move {
                // Its check run is started (or not) before it is completed.
                let started = started.await.ok().flatten();
                github::turn_ended(&context, &session, n, started).await;
            });
        }
        if keep.is_none() {
            end_cancel(&context, &session_id).await;
        }
        // The loop is gone only at shutdown, when nothing waits for this any more.
        let _ = events.send(Event::TurnEnded { session_id, keep });
    });
}

/// A cancel that came while a turn was in flight: its work is delivered and its sandbox gone now, so
/// the session is `canceled` (for any other phase this compare-and-set changes nothing, which is right).
async fn end_cancel(context: &Arc<Context>, session_id: &SessionId) {
    if let Err(error) = context
        .store
        .transition_session(session_id, SessionPhase::Canceling, SessionPhase::Canceled)
        .await
    {
        tracing::warn!(%error, session = %session_id, "cannot end the cancel; the next start does");
    }
}

/// Whether a new sandbox fits the workspace's limit, hibernating its longest-idle warm sandbox if that
/// makes room.
async fn make_room(context: &Arc<Context>, slots: &mut HashMap<SessionId, Slot>, workspace_id: &str) -> bool {
    let limit = context.config.sandboxes_per_workspace.max(1);
    let held = slots.values().filter(|s| s.workspace_id == workspace_id).count();
    let elsewhere = match context.store.sandboxes().await {
        Ok(rows) => rows
            .iter()
            .filter(|row| row.workspace_id == workspace_id && !slots.contains_key(&row.session_id))
            .count(),
        Err(_) => return false,
    };
    if held + elsewhere < limit {
        return true;
    }
    let longest_idle = slots
        .iter()
        .filter(|(_, slot)| slot.workspace_id == workspace_id && !slot.busy && slot.warm.is_some())
        .min_by_key(|(_, slot)| slot.idle_since)
        .map(|(id, _)| id.clone());
    let Some(session_id) = longest_idle else {
        return false;
    };
    hibernate(context, slots, &session_id).await
}

/// Destroys the warm sandboxes that were idle past the grace, or whose session was canceled or archived.
async fn retire_idle(context: &Arc<Context>, slots: &mut HashMap<SessionId, Slot>) {
    let idle: Vec<SessionId> = slots
        .iter()
        .filter(|(_, slot)| !slot.busy && slot.warm.is_some())
        .map(|(id, _)| id.clone())
        .collect();
    for session_id in idle {
        let Ok(session) = context.store.session_by_id(&session_id).await else {
            continue;
        };
        let ended = matches!(session.phase, SessionPhase::Canceling | SessionPhase::Canceled) || session.archived;
        let mut expired = slots
            .get(&session_id)
            .is_some_and(|slot| slot.idle_since.elapsed() >= context.config.idle_grace);
        // A warm pod the cluster took back (its claim expired, its node went) is given up now, not
        // found dead by the next turn.
        if !expired
            && context.pods.is_some()
            && let Some(sandbox) = slots.get(&session_id).and_then(|slot| slot.warm.as_ref())
            && let Ok(sortie_sandbox::SandboxStatus::Exited(exit)) = context.runtime.status(sandbox.name()).await
        {
            tracing::info!(session = %session_id, reason = %exit.describe(), "a warm pod was lost; the session hibernates");
            expired = true;
        }
        if ended {
            if let Some(slot) = slots.remove(&session_id)
                && let Some(sandbox) = slot.warm
            {
                turn::destroy(context, &session_id, &sandbox).await;
            }
        } else if expired && matches!(session.phase, SessionPhase::Idle | SessionPhase::Failed) {
            hibernate(context, slots, &session_id).await;
        }
    }
}

/// Gives a resting session's sandbox back: an idle one becomes `hibernated` first; a failed one stays
/// `failed` (its sandbox's absence is shown apart from the phase). Workspace and home stay. `false` if
/// the session was not resting any more (a steer won the race).
async fn hibernate(context: &Arc<Context>, slots: &mut HashMap<SessionId, Slot>, session_id: &SessionId) -> bool {
    let from = match context.store.session_by_id(session_id).await {
        Ok(session) => session.phase,
        Err(_) => return false,
    };
    let released = match from {
        SessionPhase::Idle => matches!(
            context
                .store
                .transition_session(session_id, from, SessionPhase::Hibernated)
                .await,
            Ok(true)
        ),
        // Nothing to change: a steer that comes now finds no warm slot and provisions afresh.
        SessionPhase::Failed => true,
        _ => false,
    };
    if !released {
        return false;
    }
    if let Some(slot) = slots.remove(session_id)
        && let Some(sandbox) = slot.warm
    {
        if context.pods.is_some() {
            release_pod(context, session_id, sandbox);
        } else {
            turn::destroy(context, session_id, &sandbox).await;
        }
    }
    true
}

/// Lets a hibernating session's pod go off the loop: a pod keeps nothing once let go, so what its
/// agent keeps goes to the store first (unless the cluster took the pod already), and a pod slow to
/// give it (up to its deadline) must not hold up the other sessions. The session's next pod waits for
/// it ([`Context::released`]).
fn release_pod(context: &Arc<Context>, session_id: &SessionId, sandbox: SandboxHandle) {
    let (done, pending) = tokio::sync::watch::channel(false);
    context
        .releasing
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(session_id.clone(), pending);
    let context = context.clone();
    let session_id = session_id.clone();
    tokio::spawn(async move {
        let alive = !matches!(
            context.runtime.status(sandbox.name()).await,
            Ok(sortie_sandbox::SandboxStatus::Exited(_))
        );
        if alive {
            turn::keep_home(&context, &session_id, &sandbox).await;
        }
        turn::destroy(&context, &session_id, &sandbox).await;
        context
            .releasing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&session_id);
        let _ = done.send(true);
    });
}

/// At start, for what this worker held before it stopped (its claims and sandboxes, by
/// `worker_id`; other workers' are theirs): a sandbox that outlived the earlier process (its keeper
/// waits the orphan grace) and whose driver answers is adopted, its running turn followed to its end
/// and its warm sandbox kept warm. A turn caught provisioning (never started at a driver) is queued
/// again. Otherwise its running turn is `lost` (its log harvested into the transcript first) and its
/// session `failed` with a reason; a warm session becomes `hibernated`.
async fn reconcile(context: &Arc<Context>) -> Vec<Adopted> {
    // Warm sandboxes an earlier process started and gave no session, whether or not a pool is kept now.
    if context.pods.is_none() {
        pool::clear_leftovers(context).await;
    }
    let me = context.config.worker_id.as_str();
    let mut had_sandbox = std::collections::HashSet::new();
    let mut adopted = Vec::new();
    if let Ok(rows) = context.store.sandboxes().await {
        // Several at once: a pod whose driver has not dialed again yet waits for its link, and the
        // others need not wait behind it.
        let mine = rows.into_iter().filter(|row| row.worker_id.as_deref() == Some(me));
        use futures::StreamExt;
        let attempts: Vec<_> = futures::stream::iter(mine)
            .map(|row| async move {
                let taken = adopt(context, &row.session_id, &row.handle).await;
                (row, taken)
            })
            .buffer_unordered(ADOPTIONS_AT_ONCE)
            .collect()
            .await;
        for (row, taken) in attempts {
            if let Some(taken) = taken {
                adopted.push(taken);
                continue;
            }
            // Whatever is left of it (adopt made it this runtime's if it still ran) goes.
            // Both are best effort: a sandbox that cannot be destroyed has no session to serve any
            // more, and a row left behind is replaced by the session's next sandbox.
            let _ = turn::destroy_named(context, &row.handle).await;
            let _ = context.store.delete_sandbox(&row.session_id).await;
            had_sandbox.insert(row.session_id);
        }
    }
    let taken: std::collections::HashSet<SessionId> = adopted.iter().map(|a| a.session.id.clone()).collect();
    let held = [
        SessionPhase::Provisioning,
        SessionPhase::Running,
        SessionPhase::Delivering,
        SessionPhase::Canceling,
    ];
    if let Ok(sessions) = context.store.sessions_in_phases(&held).await {
        for session in sessions {
            let turn = match session.current_turn {
                Some(n) => context.store.turn(&session.id, n).await.ok(),
                None => None,
            };
            let mine =
                had_sandbox.contains(&session.id) || turn.as_ref().and_then(|t| t.claimed_by.as_deref()) == Some(me);
            if !mine || taken.contains(&session.id) {
                continue;
            }
            // Caught while its sandbox was being made: its agent never had the prompt, so nothing of
            // the turn happened yet and it is provisioned again (a rolling restart fails nothing).
            if session.phase == SessionPhase::Provisioning
                && let Some(turn) = &turn
                && turn.driver_nonce.is_none()
            {
                match context.store.requeue_unstarted_turn(&session.id, turn.n).await {
                    Ok(true) => {
                        tracing::info!(session = %session.id, turn = turn.n, "re-queued a turn caught provisioning when this worker stopped");
                        continue;
                    }
                    // Its transcript had begun after all: it is lost below, like a turn that ran.
                    Ok(false) => {}
                    Err(error) => {
                        tracing::warn!(%error, session = %session.id, turn = turn.n, "cannot re-queue the turn; it is lost");
                    }
                }
            }
            let phase = match session.current_turn {
                Some(n) => {
                    let reason = "sortie stopped while this turn ran and its sandbox did not outlive it (or its driver \
                                  no longer answered); the transcript up to that point is kept. Steer the session to \
                                  continue.";
                    turn::end_lost_turn(context, &session.id, n, reason).await
                }
                // A resume without a prompt caught provisioning: no turn to end, the session fails.
                None => context
                    .store
                    .settle_session(&session.id, session.phase, true)
                    .await
                    .ok()
                    .flatten(),
            };
            if phase == Some(SessionPhase::Canceling) {
                // Its sandbox is gone with the process: the cancel is done. Losing this race to another
                // change of the phase leaves that change standing.
                if let Err(error) = context
                    .store
                    .transition_session(&session.id, SessionPhase::Canceling, SessionPhase::Canceled)
                    .await
                {
                    tracing::warn!(%error, session = %session.id, "cannot end the cancel");
                }
                continue;
            }
            tracing::warn!(session = %session.id, "reconciled a session this worker held before it stopped: its turn is lost");
        }
    }
    if let Some(pods) = &context.pods {
        pods.release_unheld(&taken).await;
    }
    for session_id in &had_sandbox {
        // Only an idle session changes: any other phase is right as it is.
        let _ = context
            .store
            .transition_session(session_id, SessionPhase::Idle, SessionPhase::Hibernated)
            .await;
    }
    adopted
}

/// Takes over the sandbox of a session in a phase that can go on with it: a running turn (followed to
/// its end) or a warm sandbox. A sandbox caught while it was being made is not taken: it is made again.
async fn adopt(context: &Arc<Context>, session_id: &SessionId, name: &str) -> Option<Adopted> {
    let session = context.store.session_by_id(session_id).await.ok()?;
    let turn = match session.phase {
        SessionPhase::Running | SessionPhase::Delivering => {
            let turn = context.store.turn(session_id, session.current_turn?).await.ok()?;
            if turn.status != sortie_protocol::TurnStatus::Running {
                return None;
            }
            Some(turn)
        }
        SessionPhase::Idle | SessionPhase::Failed => None,
        _ => return None,
    };
    match turn::adopt(context, &session, name).await {
        Ok(sandbox) => {
            tracing::info!(session = %session.id, turn = ?turn.as_ref().map(|t| t.n), "adopted a sandbox that outlived the last process");
            Some(Adopted { session, turn, sandbox })
        }
        Err(reason) => {
            tracing::warn!(session = %session.id, %reason, "cannot adopt the sandbox the last process left");
            None
        }
    }
}
