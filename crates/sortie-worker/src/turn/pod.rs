//! Provisioning a session's pod (DESIGN §15): the host's mirror resolves the commit the session starts
//! at, a pod is claimed and its driver linked, the session's egress proxy (with its git and model
//! proxies) is bound to that pod's uid, and the driver is assigned the session: it clones the
//! repository through the git proxy at that commit, then the setup script runs as on a local sandbox.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use sortie_protocol::FailureCode;
use sortie_protocol::driver::{Checkout, RELAY_ADDRESS};
use sortie_store::SessionRow;

use super::provision::{run_setup, session_mirror};
use super::proxy::{build_proxy, session_upstream};
use super::sandbox::destroy;
use super::{Failure, SandboxHandle, ms, start_failed};
use crate::Context;
use crate::client::DriverClient;
use crate::meter::CurrentTurn;
use crate::pods::Pods;
use crate::prepare::{self, SessionDirs};

/// How long a hibernating pod has to give up its agent's home.
const KEEP_HOME_DEADLINE: std::time::Duration = std::time::Duration::from_secs(15);

pub(super) async fn provision(
    context: &Arc<Context>,
    pods: &Arc<Pods>,
    session: &SessionRow,
    timings: &mut BTreeMap<String, u64>,
) -> Result<SandboxHandle, Failure> {
    let config = &context.config;
    let dirs = SessionDirs::new(&config.work_dir, &session.id);
    // The session's last pod gives up its agent's home before this one is given it.
    context.released(&session.id).await;
    let (upstream, forge_auth) = session_upstream(context, session).await?;

    let clock = Instant::now();
    let (mirror, _mirror_hold) = session_mirror(context, session, forge_auth.as_ref()).await?;
    let base = prepare::start_commit(&config.git_binary, &mirror, session.base.as_deref())
        .await
        .map_err(|e| (FailureCode::CloneFailed, e.0))?;
    std::fs::create_dir_all(&dirs.root)
        .map_err(|e| start_failed(format!("cannot create {}: {e}", dirs.root.display())))?;
    // What the branch is diffed against stays the first pod's start.
    if !dirs.start_commit().exists() {
        std::fs::write(dirs.start_commit(), &base)
            .map_err(|e| start_failed(format!("cannot record the workspace's start: {e}")))?;
    }
    // A session that delivered before (its pod was let go at hibernation) goes on from what the git
    // proxy saw the repository take, not from its base: a pod keeps nothing between claims.
    let commit = session
        .head_sha
        .clone()
        .filter(|head| sortie_protocol::driver::is_commit_id(head))
        .unwrap_or(base);
    let mirrored = clock.elapsed();

    let clock = Instant::now();
    let name = session.id.to_string();
    let claimed = pods.claim(&name, &session.id).await?;
    let current = Arc::new(CurrentTurn::default());
    let proxy = match build_proxy(context, session, &dirs, upstream, &current) {
        Ok(proxy) => proxy,
        Err(failure) => {
            let _ = sortie_sandbox::SandboxRuntime::destroy(pods.as_ref(), &name).await;
            return Err(failure);
        }
    };
    pods.egress.bind(&claimed.pod_uid, proxy.egress.clone());
    let driver = DriverClient::of_pod(pods.links.clone(), claimed.pod_uid.clone());
    let handle = SandboxHandle::with_driver(name.clone(), dirs, current, proxy, driver);
    if let Err(error) = context
        .store
        .put_sandbox(&session.id, "kubernetes", &name, &config.worker_id)
        .await
    {
        tracing::warn!(%error, session = %session.id, "cannot record the pod; a restart will not let its claim go");
    }
    timings.insert("sandbox".into(), ms(clock));
    tracing::info!(
        session = %session.id,
        pod = %claimed.pod_name,
        ready_ms = claimed.ready_after.as_millis() as u64,
        linked_ms = claimed.linked_after.as_millis() as u64,
        "claimed a pod"
    );

    let clock = Instant::now();
    // What the session's agent kept, from its last pod: its own sessions, which `session/load` reads.
    match context.store.home_snapshot(&session.id).await {
        Ok(Some(tar)) => {
            if let Err(error) = handle.driver().restore_home(tar).await {
                tracing::warn!(%error, session = %session.id, "the agent's home was not restored; it is primed from the transcript");
            }
        }
        Ok(None) => {}
        Err(error) => {
            tracing::warn!(%error, session = %session.id, "cannot read the agent's home; it is primed from the transcript");
        }
    }
    // What the session's last pod could not deliver, as the git proxy saw the upstream take it.
    let wip = match context.store.wip_head(&session.id).await {
        Ok(wip) => wip.filter(|wip| sortie_protocol::driver::is_commit_id(wip)),
        Err(error) => {
            tracing::warn!(%error, session = %session.id, "cannot read the session's kept work; the pod starts from its branch");
            None
        }
    };
    let checkout = Checkout {
        url: format!("http://{RELAY_ADDRESS}/_sortie/git/{}.git", session.id),
        commit,
        wip,
    };
    let assignment = super::assignment(config, session, Some(checkout), None);
    if let Err(error) = handle.driver().assign(&assignment).await {
        destroy(context, &session.id, &handle).await;
        let code = if error.code() == Some(sortie_protocol::driver::DriverErrorCode::CheckoutFailed) {
            FailureCode::CloneFailed
        } else {
            FailureCode::SandboxStartFailed
        };
        return Err((code, format!("the pod's driver did not take the session: {error}")));
    }
    timings.insert("clone".into(), ms(clock) + mirrored.as_millis() as u64);

    let clock = Instant::now();
    run_setup(context, session, &handle).await?;
    timings.insert("setup".into(), ms(clock));
    Ok(handle)
}

/// Keeps what the pod's agent has in its home for the session's next pod, before the pod is let go at
/// hibernation. A home too large or a driver that does not answer loses only that: the next pod's agent
/// is primed from the transcript.
pub(crate) async fn keep_home(
    context: &Arc<Context>,
    session_id: &sortie_protocol::SessionId,
    sandbox: &SandboxHandle,
) {
    // The worker's loop waits for this: a pod that sends its home slowly costs at most this long.
    let given = tokio::time::timeout(KEEP_HOME_DEADLINE, sandbox.driver().home_snapshot())
        .await
        .unwrap_or(Err(crate::client::DriverError::Timeout(KEEP_HOME_DEADLINE)));
    match given {
        Ok(tar) => {
            if let Err(error) = context.store.set_home_snapshot(session_id, &tar).await {
                tracing::warn!(%error, session = %session_id, "cannot keep the agent's home");
            }
        }
        Err(error) => tracing::warn!(%error, session = %session_id, "the pod did not give up its agent's home"),
    }
}

/// Takes over the pod an earlier process of this worker held for `session` (a restart: the claim and
/// its pod outlive the worker, and the pod's driver dials again): the claim is taken up as it is, the
/// session's egress is bound to the pod again and its driver must answer over the link. Anything short
/// of that lets the claim go.
pub(super) async fn adopt(
    context: &Arc<Context>,
    pods: &Arc<Pods>,
    session: &SessionRow,
    name: &str,
) -> Result<SandboxHandle, String> {
    let claimed = pods.claim(name, &session.id).await.map_err(|(_, reason)| reason)?;
    let gone = |reason: String| async move {
        let _ = sortie_sandbox::SandboxRuntime::destroy(pods.as_ref(), name).await;
        reason
    };
    let upstream = match session_upstream(context, session).await {
        Ok((upstream, _)) => upstream,
        Err((_, reason)) => return Err(gone(reason).await),
    };
    let dirs = SessionDirs::new(&context.config.work_dir, &session.id);
    let current = Arc::new(CurrentTurn::default());
    let proxy = match build_proxy(context, session, &dirs, upstream, &current) {
        Ok(proxy) => proxy,
        Err((_, reason)) => return Err(gone(reason).await),
    };
    // Only a pod past its setup is adopted: the agent phase's allowlist.
    proxy.allowlist.end_setup();
    pods.egress.bind(&claimed.pod_uid, proxy.egress.clone());
    let driver = DriverClient::of_pod(pods.links.clone(), claimed.pod_uid.clone());
    if let Err(error) = driver.status().await {
        return Err(gone(format!("its driver does not answer: {error}")).await);
    }
    Ok(SandboxHandle::with_driver(
        name.to_owned(),
        dirs,
        current,
        proxy,
        driver,
    ))
}
