//! The worker's side of one session's git proxy (DESIGN §7.3, §9 invariants 9–12): its settings in
//! one [`GitProxyConfig`] — the upstream, the forge client, the workspace's secret values for the
//! scan of pushed packs, the ledger every push is recorded in, the session's mirror as a trusted
//! object store, and the cgroup its git processes run in.
//!
//! It must never hand the proxy a directory a sandbox can write: the quarantine and the objects of
//! accepted pushes live under the session's `git/` directory, which is never bound into it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sortie_gateway::git::config::{
    GitProxyConfig, KnownSecretsSource, PushLedger, PushOutcome, PushRecord, PushRecords,
};
use sortie_gateway::git::http::Upstreams;
use sortie_gateway::model::{KeySource, ModelApi};
use sortie_protocol::SessionId;
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
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// One session's git proxy, ready for [`sortie_gateway::git::http::router`], and its ledger.
pub struct SessionGitProxy {
    pub config: GitProxyConfig,
    /// What the proxy did with each push: the delivered branch and head are the last accepted one's.
    pub pushes: Arc<PushRecords>,
}

/// The session's ledger: every record kept in memory for the turn to take, and what the upstream took
/// of the session's own refs also written to the store at once — the branch's head, so a worker that
/// starts again still knows what was delivered, and the WIP ref's commit, so the session's next pod
/// starts from what its last one could not deliver.
struct SessionPushes {
    records: Arc<PushRecords>,
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
                if let Err(error) = self.store.set_pushed_head(&self.session_id, &update.new).await {
                    tracing::warn!(%error, session = %self.session_id, "cannot record the pushed head; the turn keeps it in memory");
                }
                // The branch holds the workspace's work now, the kept part included: a later pod
                // starts from the branch alone.
                self.keep_wip(None).await;
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
    let ledger = Arc::new(SessionPushes {
        records: pushes.clone(),
        store: context.store.clone(),
        session_id: session.id.clone(),
        branch_ref: format!("refs/heads/{}", session.id.branch()),
        wip_ref: session.id.wip_ref(),
    });
    let mut proxy = GitProxyConfig::new(upstreams, config.git_binary.clone(), &dirs.git_state, ledger, keys);
    proxy.forge_http = config.forge_http.clone();
    // The session's workspace was cloned from the mirror: its first push's parents are there.
    let mirror = prepare::mirror_path(&config.work_dir.join("mirrors"), &session.repo);
    proxy.trusted_object_dirs = vec![mirror.join("objects")];
    if context.runtime.host_owner().is_some() {
        let name = format!("{}.git", session.id);
        let cgroup = cgroup::create_for_host_processes(Path::new(CGROUP_ROOT), &name, GIT_MEMORY_BYTES, GIT_PIDS)
            .map_err(|e| format!("cannot make the cgroup of the session's git processes: {e}"))?;
        proxy.processes.cgroup_procs = cgroup.procs_files();
        proxy.processes.launcher = config.git_launcher.clone();
        proxy.keep_alive = Some(Arc::new(GitCgroup(Some(cgroup))));
    }
    Ok(SessionGitProxy { config: proxy, pushes })
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
}
