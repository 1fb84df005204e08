//! Sandboxes as pods (DESIGN §15): what the worker needs of a cluster, whatever client speaks to it
//! ([`PodSource`]; `sortie-kube` implements it on agent-sandbox claims), and [`Pods`], the runtime the
//! worker's loop drives for them. A pod is claimed rather than created: provisioning binds the claimed
//! pod's uid to the session's egress proxy and reaches its driver by the link it dialed; from then on
//! the loop asks the runtime about it as about a local sandbox, and `destroy` lets the claim go.
//!
//! The pod is as untrusted as a local sandbox: it is known only by the uid the apiserver vouched for
//! (its link and its egress say nothing else), and what happened to it (lost, out of memory) comes from
//! the cluster's record of its claim, never from the pod.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sortie_gateway::links::{DriverLinks, EgressBindings};
use sortie_protocol::{FailureCode, SessionId};
use sortie_sandbox::{SandboxError, SandboxExit, SandboxRuntime, SandboxSpec, SandboxStatus, Usage};

/// A session's pod, claimed, ready, and its driver linked.
#[derive(Clone, Debug)]
pub struct ClaimedPod {
    pub pod_name: String,
    /// What the pod is known by: its driver's link and its egress carry this uid, vouched for by the
    /// apiserver.
    pub pod_uid: String,
    /// Claim → ready, and ready → linked.
    pub ready_after: Duration,
    pub linked_after: Duration,
}

/// Why a session has no pod: the turn's failure.
pub type PodFailure = (FailureCode, String);

/// Where pods come from.
#[async_trait]
pub trait PodSource: Send + Sync + 'static {
    /// Claims a pod for `session` (or takes the claim it holds), ready and its driver linked.
    async fn claim(&self, session: &SessionId) -> Result<ClaimedPod, PodFailure>;
    /// Resolves when the session's pod is lost (deleted, failed, its claim expired): why.
    async fn lost(&self, session: &SessionId) -> PodFailure;
    /// Lets the session's pod go.
    async fn release(&self, session: &SessionId) -> Result<(), String>;
    /// The sessions holding a pod of this worker's (after a restart: what it did not record).
    async fn held(&self) -> Result<Vec<SessionId>, String>;
}

/// One pod the worker holds, by the sandbox name (the session id).
struct Held {
    session: SessionId,
    pod_uid: String,
    /// Why the cluster says it was lost, once it did.
    lost: Arc<Mutex<Option<PodFailure>>>,
    watch: tokio::task::JoinHandle<()>,
}

/// The worker's pods: claimed through a [`PodSource`], reached by their drivers' links, each pod's
/// way out bound to its session's egress proxy.
pub struct Pods {
    source: Arc<dyn PodSource>,
    pub links: Arc<DriverLinks>,
    pub egress: Arc<EgressBindings>,
    held: Mutex<HashMap<String, Held>>,
}

impl Pods {
    pub fn new(source: Arc<dyn PodSource>, links: Arc<DriverLinks>, egress: Arc<EgressBindings>) -> Arc<Self> {
        Arc::new(Self {
            source,
            links,
            egress,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Claims the pod of `session`, known from then on as sandbox `name`; the cluster's word that it
    /// was lost is watched for from now on.
    pub(crate) async fn claim(&self, name: &str, session: &SessionId) -> Result<ClaimedPod, PodFailure> {
        let claimed = match self.source.claim(session).await {
            Ok(claimed) => claimed,
            Err(failure) => {
                // A claim the cluster could not meet (or whose pod never linked) is not left to it.
                if let Err(error) = self.source.release(session).await {
                    tracing::warn!(%error, session = %session, "cannot let the failed claim go; its shutdown time will");
                }
                return Err(failure);
            }
        };
        let lost = Arc::new(Mutex::new(None));
        let watch = {
            let source = self.source.clone();
            let session = session.clone();
            let lost = lost.clone();
            tokio::spawn(async move {
                let why = source.lost(&session).await;
                *lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
            })
        };
        let held = Held {
            session: session.clone(),
            pod_uid: claimed.pod_uid.clone(),
            lost,
            watch,
        };
        if let Some(older) = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_owned(), held)
        {
            older.watch.abort();
            if older.pod_uid != claimed.pod_uid {
                self.egress.unbind(&older.pod_uid);
            }
        }
        Ok(claimed)
    }

    /// Lets go every pod of this worker's that no session of `kept` holds: a claim made just before
    /// an earlier process died, before it was recorded, is not left to its shutdown time.
    pub(crate) async fn release_unheld(&self, kept: &std::collections::HashSet<SessionId>) {
        let held = match self.source.held().await {
            Ok(held) => held,
            Err(error) => {
                tracing::warn!(%error, "cannot list this worker's pods; unrecorded ones wait for their shutdown time");
                return;
            }
        };
        for session in held.into_iter().filter(|session| !kept.contains(session)) {
            match self.source.release(&session).await {
                Ok(()) => tracing::info!(session = %session, "let go a pod no session of this worker holds"),
                Err(error) => tracing::warn!(%error, session = %session, "cannot let an unrecorded pod go"),
            }
        }
    }

    /// Opens or closes the way out of the pod held as sandbox `name` ([`EgressBindings::set_open`]).
    pub(crate) fn set_egress(&self, name: &str, open: bool) {
        let uid = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .map(|held| held.pod_uid.clone());
        if let Some(uid) = uid {
            self.egress.set_open(&uid, open);
        }
    }

    fn take(&self, name: &str) -> Option<Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).remove(name)
    }
}

fn pods_are_claimed(name: &str) -> SandboxError {
    SandboxError::Unsupported(format!(
        "sandbox {name:?} is a pod: it is claimed from the cluster, not made here"
    ))
}

#[async_trait]
impl SandboxRuntime for Pods {
    async fn create(&self, spec: SandboxSpec) -> Result<(), SandboxError> {
        Err(pods_are_claimed(&spec.name))
    }

    async fn start(&self, name: &str) -> Result<(), SandboxError> {
        Err(pods_are_claimed(name))
    }

    /// Running until the cluster says the pod was lost; then ended, with the cluster's reason.
    async fn status(&self, name: &str) -> Result<SandboxStatus, SandboxError> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let held = held.get(name).ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
        let lost = held.lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(match lost {
            None => SandboxStatus::Running,
            Some((_, reason)) => SandboxStatus::Exited(SandboxExit {
                code: None,
                signal: None,
                out_of_memory: reason.contains("OOMKilled"),
                last_words: reason,
            }),
        })
    }

    async fn wait(&self, name: &str) -> Result<SandboxExit, SandboxError> {
        loop {
            if let SandboxStatus::Exited(exit) = self.status(name).await? {
                return Ok(exit);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn stop(&self, name: &str, _grace: Duration) -> Result<(), SandboxError> {
        self.destroy(name).await.map(|_| ())
    }

    /// Unbinds the pod's egress and lets its claim go. A sandbox row left by an earlier process (no
    /// pod held in this one) is the session's claim all the same, and is let go too.
    async fn destroy(&self, name: &str) -> Result<Usage, SandboxError> {
        let session = match self.take(name) {
            Some(held) => {
                held.watch.abort();
                self.egress.unbind(&held.pod_uid);
                held.session
            }
            None => SessionId::parse(name).map_err(|_| SandboxError::Unknown(name.to_owned()))?,
        };
        self.source.release(&session).await.map_err(|reason| SandboxError::Io {
            what: format!("cannot let the pod of {session} go"),
            source: std::io::Error::other(reason),
        })?;
        // The cluster meters pods; nothing of it reaches sortie's usage yet.
        Ok(Usage::default())
    }
}
