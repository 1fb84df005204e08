//! The worker's side of one session's git proxy (DESIGN §7.3, §9 invariants 9–12): its settings in
//! one [`GitProxyConfig`] — the upstream, the forge client, the workspace's secret values for the
//! scan of pushed packs, the ledger every push is recorded in, the session's mirror as a trusted
//! object store, and the cgroup its git processes run in — and the delivered branch's diff, read from
//! those trusted stores as soon as the upstream took a push.
//!
//! It must never hand the proxy a directory a sandbox can write: the quarantine and the objects of
//! accepted pushes live under the session's `git/` directory, which is never bound into it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sortie_gateway::git::config::{
    GitProxyConfig, KnownSecretsSource, PushLedger, PushOutcome, PushRecord, PushRecords,
};
use sortie_gateway::git::http::Upstreams;
use sortie_gateway::model::{KeySource, ModelApi};
use sortie_protocol::SessionId;
use sortie_protocol::api::StoredDiff;
use sortie_sandbox::local::cgroup::{self, Cgroup};
use sortie_secrets::KnownSecrets;
use sortie_store::{SessionRow, Store};

use crate::Context;
use crate::meter::WorkspaceKeys;
use crate::prepare::{self, SessionDirs};

/// Memory of a session's host-side git processes together (`http-backend`, `index-pack`, the scan).
pub const GIT_MEMORY_BYTES: u64 = 1 << 30;
/// Processes and threads of them together (index-pack and pack-objects run a thread per core).
pub const GIT_PIDS: u64 = 256;
/// Where the cgroup hierarchies are mounted (the local runtime's default).
pub(crate) const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// One session's git proxy, ready for [`sortie_gateway::git::http::router`], and its ledger.
pub struct SessionGitProxy {
    pub config: GitProxyConfig,
    /// What the proxy did with each push: the delivered branch and head are the last accepted one's.
    pub pushes: Arc<PushRecords>,
    /// The delivered branch's diff, begun when the upstream takes a push of it.
    pub diffs: Arc<BranchDiffs>,
}

/// The session's branch against the commit its workspace was cloned at, read by the host from the
/// object stores it trusts (the accepted pushes' objects, the mirror), never from the sandbox.
///
/// The read begins the moment the upstream takes a push of the branch: the proxy answers the
/// sandbox, the driver ends its turn and the worker settles it meanwhile, and the settlement takes the
/// diff already read instead of starting it then.
pub struct BranchDiffs {
    git: PathBuf,
    scratch: PathBuf,
    trusted: Vec<PathBuf>,
    /// The file that names the commit the workspace was cloned at.
    start_commit: PathBuf,
    ahead: Mutex<Option<DiffAhead>>,
}

/// A read begun ahead: the diff between two commits.
struct DiffAhead {
    from: String,
    to: String,
    read: tokio::task::JoinHandle<Result<StoredDiff, String>>,
}

impl BranchDiffs {
    /// Reads with `git` in a scratch repository under `scratch` whose alternates are `trusted`;
    /// `start_commit` is the file that names the workspace's start.
    pub fn new(git: PathBuf, scratch: PathBuf, trusted: Vec<PathBuf>, start_commit: PathBuf) -> Self {
        Self {
            git,
            scratch,
            trusted,
            start_commit,
            ahead: Mutex::new(None),
        }
    }

    /// What `to` changes since `from` (the empty tree when `None`): the read begun ahead when it was
    /// of the same two commits, else a read now.
    pub async fn read(&self, from: Option<&str>, to: &str) -> Result<StoredDiff, String> {
        let ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(ahead) = ahead
            && from == Some(ahead.from.as_str())
            && to == ahead.to
            && let Ok(read) = ahead.read.await
        {
            return read;
        }
        self.read_now(from, to).await
    }

    async fn read_now(&self, from: Option<&str>, to: &str) -> Result<StoredDiff, String> {
        sortie_gateway::git::diff::branch_diff(&self.git, &self.scratch, &self.trusted, from, to).await
    }

    /// Begins the read of the branch at `to` against the workspace's start, when that is known (a
    /// session without it is read at settlement, against its last delivery). A read begun before is
    /// stopped (its git killed): a sandbox pushing in a loop holds at most one read on the host.
    fn begin(self: &Arc<Self>, to: &str) {
        let Some(from) = std::fs::read_to_string(&self.start_commit)
            .ok()
            .map(|commit| commit.trim().to_owned())
        else {
            return;
        };
        let diffs = self.clone();
        let (from_now, to_now) = (from.clone(), to.to_owned());
        let read = tokio::spawn(async move { diffs.read_now(Some(&from_now), &to_now).await });
        let before = self.ahead.lock().unwrap_or_else(|p| p.into_inner()).replace(DiffAhead {
            from,
            to: to.to_owned(),
            read,
        });
        if let Some(before) = before {
            before.read.abort();
        }
    }
}

/// The session's ledger: every record kept in memory for the turn to take, and what the upstream took
/// of the session's own refs also written to the store at once — the branch's head, so a worker that
/// starts again still knows what was delivered, and the WIP ref's commit, so the session's next pod
/// starts from what its last one could not deliver.
struct SessionPushes {
    records: Arc<PushRecords>,
    diffs: Arc<BranchDiffs>,
    store: Arc<dyn Store>,
    session_id: SessionId,
    branch_ref: String,
    wip_ref: String,
}

#[async_trait]
impl PushLedger for SessionPushes {
    async fn record(&self, record: PushRecord) {
        if record.outcome == PushOutcome::Accepted
            && let Some(update) = &record.update
        {
            // A delete names the null id, which is no commit.
            let is_commit = sortie_protocol::driver::is_commit_id(&update.new);
            if update.refname == self.branch_ref && is_commit {
                self.diffs.begin(&update.new);
                // The branch holds the workspace's work now, the kept part included: the store forgets
                // the WIP commit with it, and a later pod starts from the branch alone.
                if let Err(error) = self.store.set_pushed_head(&self.session_id, &update.new).await {
                    tracing::warn!(%error, session = %self.session_id, "cannot record the pushed head; the turn keeps it in memory");
                }
            } else if update.refname == self.wip_ref {
                self.keep_wip(is_commit.then_some(update.new.as_str())).await;
            }
        }
        self.records.record(record).await;
    }
}

impl SessionPushes {
    async fn keep_wip(&self, head: Option<&str>) {
        if let Err(error) = self.store.set_wip_head(&self.session_id, head).await {
            tracing::warn!(%error, session = %self.session_id, "cannot record the session's kept work");
        }
    }
}

/// The proxy of `session` (whose repository `upstreams` names). As root (the local runtime hands
/// sandbox directories to another uid), its git processes get a cgroup of their own, removed when
/// the proxy is dropped.
pub(crate) fn build(
    context: &Context,
    session: &SessionRow,
    dirs: &SessionDirs,
    upstreams: Arc<dyn Upstreams>,
) -> Result<SessionGitProxy, String> {
    create_private_dir(&dirs.git_state)?;
    let config = &context.config;
    let pushes = Arc::new(PushRecords::default());
    let keys = Arc::new(WorkspaceKeys {
        store: context.store.clone(),
        ring: config.keyring.clone(),
        workspace_id: session.workspace_id.clone(),
    });
    // The session's workspace was cloned from the mirror: its first push's parents are there.
    let mirror = prepare::mirror_path(&config.work_dir.join("mirrors"), &session.repo);
    let delivered_objects = sortie_gateway::git::config::delivered_objects_dir(&dirs.git_state);
    let diffs = Arc::new(BranchDiffs::new(
        config.git_binary.clone(),
        dirs.git_state.join("stat"),
        vec![delivered_objects, mirror.join("objects")],
        dirs.start_commit(),
    ));
    let ledger = Arc::new(SessionPushes {
        records: pushes.clone(),
        diffs: diffs.clone(),
        store: context.store.clone(),
        session_id: session.id.clone(),
        branch_ref: format!("refs/heads/{}", session.id.branch()),
        wip_ref: session.id.wip_ref(),
    });
    let mut proxy = GitProxyConfig::new(upstreams, config.git_binary.clone(), &dirs.git_state, ledger, keys);
    proxy.forge_http = config.forge_http.clone();
    proxy.trusted_object_dirs = vec![mirror.join("objects")];
    if context.runtime.host_owner().is_some() {
        let name = format!("{}.git", session.id);
        let cgroup = cgroup::create_for_host_processes(Path::new(CGROUP_ROOT), &name, GIT_MEMORY_BYTES, GIT_PIDS)
            .map_err(|e| format!("cannot make the cgroup of the session's git processes: {e}"))?;
        proxy.processes.cgroup_procs = cgroup.procs_files();
        proxy.processes.launcher = config.git_launcher.clone();
        proxy.keep_alive = Some(Arc::new(GitCgroup(Some(cgroup))));
    }
    Ok(SessionGitProxy {
        config: proxy,
        pushes,
        diffs,
    })
}

fn create_private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// The cgroup of a session's git processes: whatever is left in it is killed, and it is removed,
/// once the proxy is gone.
struct GitCgroup(Option<Cgroup>);

impl Drop for GitCgroup {
    fn drop(&mut self) {
        if let Some(cgroup) = self.0.take() {
            // Off the async runtime: emptying a cgroup waits for the kernel.
            let _ = std::thread::Builder::new()
                .name("git-cgroup-teardown".into())
                .spawn(move || {
                    cgroup.kill_all(Duration::from_secs(5));
                    cgroup.remove();
                });
        }
    }
}

/// The workspace's model keys are its known secrets: a push holding one is refused at the gateway.
#[async_trait]
impl KnownSecretsSource for WorkspaceKeys {
    async fn known_secrets(&self) -> KnownSecrets {
        let mut known = KnownSecrets::default();
        for api in ModelApi::ALL {
            if let Some(key) = self.key(api).await {
                known.insert_value(key.as_bytes());
            }
        }
        known
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_gateway::git::receive_pack::RefUpdate;
    use sortie_store::{NewSession, RepoAccess, SqlStore};
    use sortie_testkit::git::git;

    #[tokio::test]
    async fn the_ledger_records_the_kept_work_and_forgets_it_once_deleted_or_delivered() {
        let temp = tempfile::tempdir().expect("temp");
        let database = sortie_store::testing::TestDatabase::sqlite(temp.path());
        let store: Arc<dyn Store> = Arc::new(SqlStore::connect(&database.url).await.expect("store"));
        let workspace = store
            .create_workspace("default", RepoAccess::default())
            .await
            .expect("workspace");
        let id = SessionId::generate();
        store
            .create_session(NewSession {
                id: id.clone(),
                workspace_id: workspace.id,
                repo: "/srv/repo.git".into(),
                base: None,
                agent: "scripted".into(),
                model: None,
                title: "t".into(),
                egress_allow: Vec::new(),
                setup: None,
                task: "t".into(),
                budget: Default::default(),
            })
            .await
            .expect("session");
        let ledger = SessionPushes {
            records: Arc::default(),
            diffs: Arc::new(BranchDiffs::new(
                "git".into(),
                temp.path().join("stat"),
                Vec::new(),
                temp.path().join("no-start-commit"),
            )),
            store: store.clone(),
            session_id: id.clone(),
            branch_ref: format!("refs/heads/{}", id.branch()),
            wip_ref: id.wip_ref(),
        };
        let accepted = |refname: String, new: &str| PushRecord {
            session_id: id.clone(),
            update: Some(RefUpdate {
                old: "0".repeat(40),
                new: new.to_owned(),
                refname,
            }),
            outcome: PushOutcome::Accepted,
        };
        let kept = "a".repeat(40);
        ledger.record(accepted(id.wip_ref(), &kept)).await;
        assert_eq!(store.wip_head(&id).await, Ok(Some(kept.clone())));
        ledger.record(accepted(id.wip_ref(), &"0".repeat(40))).await;
        assert_eq!(store.wip_head(&id).await, Ok(None), "a delete is no commit");
        ledger.record(accepted(id.wip_ref(), &kept)).await;
        ledger
            .record(accepted(format!("refs/heads/{}", id.branch()), &"b".repeat(40)))
            .await;
        assert_eq!(store.wip_head(&id).await, Ok(None), "the branch holds it now");
        assert_eq!(store.pushed_head(&id).await, Ok(Some("b".repeat(40))));
    }

    #[tokio::test]
    async fn the_diff_begun_at_the_push_answers_the_settlement_of_the_same_commits() {
        let temp = tempfile::tempdir().expect("temp");
        let repo = temp.path().join("repo");
        std::fs::create_dir_all(&repo).expect("repo dir");
        git(&repo, &["init", "-q"]);
        std::fs::write(repo.join("a.txt"), "one\n").expect("write");
        git(&repo, &["add", "."]);
        git(&repo, &["commit", "-q", "-m", "start"]);
        let start = git(&repo, &["rev-parse", "HEAD"]);
        std::fs::write(repo.join("b.txt"), "two\n").expect("write");
        git(&repo, &["add", "."]);
        git(&repo, &["commit", "-q", "-m", "work"]);
        let head = git(&repo, &["rev-parse", "HEAD"]);
        let start_file = temp.path().join("start-commit");
        std::fs::write(&start_file, format!("{start}\n")).expect("start commit");
        let objects = repo.join(".git/objects");
        let diffs = Arc::new(BranchDiffs::new(
            "git".into(),
            temp.path().join("stat"),
            vec![objects.clone()],
            start_file,
        ));

        diffs.begin(&head);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !diffs
            .ahead
            .lock()
            .expect("lock")
            .as_ref()
            .is_some_and(|ahead| ahead.read.is_finished())
        {
            assert!(std::time::Instant::now() < deadline, "the read begun ahead never ended");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Gone from where they were read: only what was read ahead can answer now.
        std::fs::rename(&objects, temp.path().join("objects-moved")).expect("move the objects");
        let read = diffs.read(Some(&start), &head).await.expect("the diff read ahead");
        assert_eq!((read.files_changed, read.files[0].path.as_str()), (1, "b.txt"));
        assert!(
            diffs.read(Some(&start), &head).await.is_err(),
            "a read ahead answers once; the next reads the stores again"
        );
        std::fs::rename(temp.path().join("objects-moved"), &objects).expect("objects back");
        diffs.begin(&head);
        let other = diffs.read(None, &head).await.expect("a read of other commits");
        assert_eq!(
            other.files_changed, 2,
            "from the empty tree, not the start the read ahead used"
        );
    }
}
