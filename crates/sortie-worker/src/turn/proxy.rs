//! What serves one sandbox's `egress.sock` (DESIGN §6): the egress proxy with its allowlist, and behind
//! it the git proxy of the session's own repository and the model proxy with the workspace's keys.
//! Everything the sandbox reaches goes through here; none of it holds a name the sandbox can write.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sortie_gateway::egress::policy::Denial;
use sortie_gateway::egress::proxy::{DenialHook, EgressProxy, SessionAllowlist};
use sortie_gateway::egress::registries::PhasedAllowlist;
use sortie_gateway::git::config::PushRecords;
use sortie_gateway::git::http::{GitChildren, Upstream, Upstreams};
use sortie_protocol::sortie_data::{EgressDeniedData, SortieData};
use sortie_protocol::{FailureCode, SessionId};
use sortie_store::SessionRow;

use super::{Failure, SandboxHandle, start_failed};
use crate::Context;
use crate::git_proxy::BranchDiffs;
use crate::meter::{CurrentTurn, TurnMeter, WorkspaceKeys};
use crate::prepare::{self, SessionDirs};

/// The git proxy of one sandbox reaches its own session's repository and nothing else.
pub(super) struct SessionUpstream {
    session_id: SessionId,
    upstream: std::sync::RwLock<Upstream>,
    /// Where a refused forge credential is renewed (a GitHub App's installation token).
    context: Arc<Context>,
    workspace_id: String,
    repo: String,
}

impl Upstreams for SessionUpstream {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.session_id).then(|| self.upstream.read().unwrap_or_else(|p| p.into_inner()).clone())
    }

    fn refresh<'a>(
        &'a self,
        session_id: &'a SessionId,
        refused: &'a Upstream,
    ) -> futures::future::BoxFuture<'a, Option<Upstream>> {
        Box::pin(async move {
            let Upstream::Remote { url, token } = refused else {
                return None;
            };
            if session_id != &self.session_id {
                return None;
            }
            let host = sortie_protocol::api::repo_forge_host(&self.repo)?;
            let credential = crate::forge::credential(&self.context, &self.workspace_id, &host, &self.repo)
                .await
                .ok()?;
            // A personal token is what it is: only an App's can be had afresh.
            let fresh = credential.renewal?.renew(token).await?;
            let fresh = Upstream::Remote {
                url: url.clone(),
                token: String::from_utf8_lossy(fresh.expose()).into_owned(),
            };
            self.replace(fresh.clone());
            Some(fresh)
        })
    }
}

impl SessionUpstream {
    pub(super) fn replace(&self, upstream: Upstream) {
        *self.upstream.write().unwrap_or_else(|p| p.into_inner()) = upstream;
    }
}

/// Writes the digests of the workspace's secret values to `path`, in place (truncated, same inode).
pub(super) async fn write_known_secrets(
    context: &Arc<Context>,
    session: &SessionRow,
    path: &Path,
) -> Result<(), String> {
    let digests = WorkspaceKeys {
        store: context.store.clone(),
        ring: context.config.keyring.clone(),
        workspace_id: session.workspace_id.clone(),
    }
    .digests()
    .await;
    std::fs::write(path, digests).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Where the session's repository lives for the git proxy, and how host-side git reaches it: a local
/// path as is; an `https://` URL through the workspace's connection to its forge, whose token only
/// the gateway and the mirror fetch ever hold.
pub(super) async fn session_upstream(
    context: &Arc<Context>,
    session: &SessionRow,
) -> Result<(Upstream, Option<prepare::ForgeAuth>), Failure> {
    if session.repo.starts_with('/') {
        return Ok((Upstream::Local(PathBuf::from(&session.repo)), None));
    }
    let Some(host) = sortie_protocol::api::repo_forge_host(&session.repo) else {
        return Err((
            FailureCode::CloneFailed,
            format!(
                "{:?} is neither a local path nor an https:// repository URL",
                session.repo
            ),
        ));
    };
    let token = crate::forge::credential(context, &session.workspace_id, &host, &session.repo)
        .await
        .map_err(|error| (FailureCode::CloneFailed, error.to_string()))?
        .token;
    let token_text = String::from_utf8_lossy(token.expose()).into_owned();
    Ok((
        Upstream::Remote {
            url: session.repo.clone(),
            token: token_text,
        },
        Some(prepare::ForgeAuth {
            token,
            ca_bundle: context.config.forge_ca_bundle.clone(),
        }),
    ))
}

/// What serves a sandbox's `egress.sock`: its allowlist, model meter, git upstream and the task.
pub(super) struct SandboxProxy {
    pub allowlist: Arc<PhasedAllowlist>,
    pub meter: Arc<TurnMeter>,
    pub upstream: Arc<SessionUpstream>,
    /// The git proxy's record of every push it decided on.
    pub pushes: Arc<PushRecords>,
    /// The git proxy's children, parked in the session's cgroup ahead while a turn runs.
    pub git_children: GitChildren,
    /// The delivered branch's diff, read from object stores the host trusts.
    pub diffs: Arc<BranchDiffs>,
    /// The proxy itself: served on `egress.sock`, or bound to a pod's uid.
    pub egress: Arc<EgressProxy>,
    /// What serves `egress.sock` (a local sandbox's).
    pub task: Option<tokio::task::JoinHandle<()>>,
}

/// The proxy stops with the last holder of its sandbox (or with a provisioning that gave up on it).
impl Drop for SandboxProxy {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Serves the session's egress proxy (with its git and model proxies) on its `egress.sock`.
pub(super) fn serve_proxy(
    context: &Arc<Context>,
    session: &SessionRow,
    dirs: &SessionDirs,
    upstream: Upstream,
    current: &Arc<CurrentTurn>,
) -> Result<SandboxProxy, Failure> {
    let mut proxy = build_proxy(context, session, dirs, upstream, current)?;
    let egress_socket = dirs.egress_socket();
    let _ = std::fs::remove_file(&egress_socket);
    let listener = tokio::net::UnixListener::bind(&egress_socket)
        .map_err(|e| start_failed(format!("cannot listen on {}: {e}", egress_socket.display())))?;
    context.runtime.grant_socket(&egress_socket).map_err(start_failed)?;
    proxy.task = Some(tokio::spawn(proxy.egress.clone().serve(listener)));
    Ok(proxy)
}

/// The session's egress proxy with its git and model proxies, not yet served anywhere.
pub(super) fn build_proxy(
    context: &Arc<Context>,
    session: &SessionRow,
    dirs: &SessionDirs,
    upstream: Upstream,
    current: &Arc<CurrentTurn>,
) -> Result<SandboxProxy, Failure> {
    let config = &context.config;
    let allowlist = PhasedAllowlist::new(
        Arc::new(SessionAllowlist {
            store: context.store.clone(),
            workspace_id: session.workspace_id.clone(),
            session_id: session.id.clone(),
        }),
        config.setup_hosts.clone(),
    );
    let upstream = Arc::new(SessionUpstream {
        session_id: session.id.clone(),
        upstream: std::sync::RwLock::new(upstream),
        context: context.clone(),
        workspace_id: session.workspace_id.clone(),
        repo: session.repo.clone(),
    });
    let git = crate::git_proxy::build(context, session, dirs, upstream.clone()).map_err(start_failed)?;
    let diffs = git.diffs.clone();
    let pushes = git.pushes.clone();
    let (git_routes, git_children) = sortie_gateway::git::http::router_and_children(git.config);
    let meter = TurnMeter::new(
        context.store.clone(),
        session.id.clone(),
        current.clone(),
        context.config.budget_wait,
    );
    let model_routes = sortie_gateway::model::router(
        sortie_gateway::model::ModelProxyConfig {
            session_id: session.id.clone(),
            upstreams: config.model_upstreams.clone(),
            extra_roots_pem: Vec::new(),
            pinned_headers: Vec::new(),
            limits: Default::default(),
        },
        Arc::new(WorkspaceKeys {
            store: context.store.clone(),
            ring: config.keyring.clone(),
            workspace_id: session.workspace_id.clone(),
        }),
        meter.clone(),
    )
    .map_err(start_failed)?;
    let proxy = EgressProxy::new(
        allowlist.clone(),
        config.egress_exempt.clone(),
        config.resolver.clone(),
        Some(git_routes.merge(model_routes)),
        Some(report_denials(current.clone())),
    );
    Ok(SandboxProxy {
        allowlist,
        meter,
        upstream,
        pushes,
        git_children,
        diffs,
        egress: proxy,
        task: None,
    })
}

/// Every egress refusal becomes a `data-sortie-egress-denied` part of the running turn, written by
/// the host into its own transcript (nothing of it passes through the sandbox).
fn report_denials(current: Arc<CurrentTurn>) -> DenialHook {
    Arc::new(move |denial: &Denial| {
        if let Some(transcript) = current.get() {
            transcript.host(SortieData::EgressDenied(EgressDeniedData {
                host: denial.host.clone(),
                port: denial.port,
                reason: denial.reason.clone(),
            }));
        }
        Box::pin(std::future::ready(()))
    })
}

/// A warm sandbox takes a turn with what changed since it started: the workspace's model keys for
/// the delivery's scan, a rotated or removed forge token.
pub(super) async fn refresh_warm_sandbox(context: &Arc<Context>, session: &SessionRow, sandbox: &SandboxHandle) {
    let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
    if let Err(error) = write_known_secrets(context, session, &dirs.known_secrets).await {
        tracing::warn!(session = %session.id, %error, "cannot refresh the known secrets; the sandbox's list stays");
    }
    match session_upstream(context, session).await {
        Ok((upstream, _)) => sandbox.0.proxy.upstream.replace(upstream),
        Err((_, reason)) => {
            tracing::warn!(session = %session.id, %reason, "the forge connection is gone; pushes will be refused");
            if sortie_protocol::api::repo_forge_host(&session.repo).is_some() {
                sandbox.0.proxy.upstream.replace(Upstream::Remote {
                    url: session.repo.clone(),
                    token: String::new(),
                });
            }
        }
    }
}
