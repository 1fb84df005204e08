//! Claims, watched to readiness and bound to their pod's driver link.
//!
//! A session's claim is named after the session and labelled with it; the claim controller hands it a
//! sandbox (adopted warm from the pool, or made cold from the template when the pool is empty), names
//! it in the claim's status and makes the claim its controller; the sandbox's pod has its name and is
//! controlled by it. The pod's driver has dialed the gateway meanwhile ([`sortie_gateway::links`]),
//! known by the pod uid the apiserver vouched for. The session gets that link, and no other: a link is
//! bound only when the chain claim → sandbox → pod, each controlled by the one before, ends at the pod
//! the cluster says dialed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::runtime::{WatchStreamExt, watcher};
use sortie_gateway::links::{DriverLink, DriverLinks};
use sortie_protocol::{FailureCode, SessionId};

use crate::crd::{ClaimLifecycle, NameRef, SESSION_LABEL, Sandbox, SandboxClaim, SandboxClaimSpec};
use crate::status::{ClaimState, claim_state};

/// How long each step may take.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// From the claim to its Ready condition (a cold pod pulls an image: 3–30 s and more).
    pub ready: Duration,
    /// From Ready to the pod's driver link.
    pub link: Duration,
    /// The claim's `shutdownTime`, from its creation: the cluster ends a sandbox sortie forgot.
    pub lifetime: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            ready: Duration::from_secs(120),
            link: Duration::from_secs(30),
            lifetime: Duration::from_secs(24 * 60 * 60),
        }
    }
}

/// Why a session did not get its sandbox, as a turn's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {reason}")]
pub struct SandboxFailure {
    pub code: FailureCode,
    pub reason: String,
}

impl SandboxFailure {
    fn start(reason: impl Into<String>) -> Self {
        Self {
            code: FailureCode::SandboxStartFailed,
            reason: reason.into(),
        }
    }
}

/// A session's sandbox, ready and linked.
#[derive(Clone)]
pub struct Claimed {
    pub claim: String,
    pub claim_uid: String,
    pub pod_name: String,
    pub pod_uid: String,
    pub link: DriverLink,
    /// Claim → Ready, and Ready → linked.
    pub ready_after: Duration,
    pub linked_after: Duration,
}

/// Sandboxes as agent-sandbox claims in one namespace, from one warm pool.
pub struct KubeSandboxes {
    client: kube::Client,
    namespace: String,
    claims: Api<SandboxClaim>,
    sandboxes: Api<Sandbox>,
    pods: Api<Pod>,
    pool: String,
    links: Arc<DriverLinks>,
    deadlines: Deadlines,
}

/// The claim of `session`: a DNS label (a session id holds an underscore).
pub fn claim_name(session: &SessionId) -> String {
    format!(
        "sortie-{}",
        session.as_str().trim_start_matches("ses_").to_ascii_lowercase()
    )
}

impl KubeSandboxes {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        pool: &str,
        links: Arc<DriverLinks>,
        deadlines: Deadlines,
    ) -> Self {
        Self {
            claims: Api::namespaced(client.clone(), namespace),
            sandboxes: Api::namespaced(client.clone(), namespace),
            pods: Api::namespaced(client.clone(), namespace),
            client,
            namespace: namespace.to_owned(),
            pool: pool.to_owned(),
            links,
            deadlines,
        }
    }

    /// Makes the cluster hold `shape`'s template and warm pool as sortie says (server-side apply, sortie
    /// the field manager): called at start, so a changed image or pool size takes effect then.
    pub async fn reconcile(&self, shape: &crate::shape::SandboxShape) -> Result<(), kube::Error> {
        let params = kube::api::PatchParams::apply("sortie").force();
        let templates: Api<crate::crd::SandboxTemplate> = Api::namespaced(self.client.clone(), &self.namespace);
        templates
            .patch(
                &shape.name,
                &params,
                &kube::api::Patch::Apply(crate::shape::template(shape)),
            )
            .await?;
        let pools: Api<crate::crd::SandboxWarmPool> = Api::namespaced(self.client.clone(), &self.namespace);
        pools
            .patch(
                &shape.name,
                &params,
                &kube::api::Patch::Apply(crate::shape::warm_pool(shape)),
            )
            .await?;
        Ok(())
    }

    /// The claim sortie makes for `session`: from the pool, labelled, with a shutdown time; never env
    /// or volumes (the type cannot hold them), nor pod metadata (the controller allows only the label
    /// domains its operator listed, and sortie needs none on the pod).
    pub fn claim_for(&self, session: &SessionId, now: std::time::SystemTime) -> SandboxClaim {
        let labels = [(SESSION_LABEL.to_owned(), session.as_str().to_owned())];
        let shutdown = rfc3339(now + self.deadlines.lifetime);
        let mut claim = SandboxClaim::new(
            &claim_name(session),
            SandboxClaimSpec {
                warm_pool_ref: NameRef {
                    name: self.pool.clone(),
                },
                lifecycle: Some(ClaimLifecycle {
                    shutdown_time: Some(shutdown),
                    shutdown_policy: Some("DeleteForeground".into()),
                }),
                additional_pod_metadata: None,
            },
        );
        claim.metadata.labels = Some(labels.into_iter().collect());
        claim
    }

    /// Claims a sandbox for `session` (or takes the claim it already has, after a restart), waits for
    /// it to be ready and for its pod's driver to link.
    pub async fn claim(&self, session: &SessionId) -> Result<Claimed, SandboxFailure> {
        let started = Instant::now();
        let name = claim_name(session);
        let claim = match self
            .claims
            .create(
                &PostParams::default(),
                &self.claim_for(session, std::time::SystemTime::now()),
            )
            .await
        {
            Ok(claim) => claim,
            Err(kube::Error::Api(status)) if status.code == 409 => self
                .claims
                .get(&name)
                .await
                .map_err(|e| SandboxFailure::start(format!("cannot read the sandbox claim {name}: {e}")))?,
            Err(error) => return Err(SandboxFailure::start(format!("cannot claim a sandbox: {error}"))),
        };
        let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
        // The claim of another session under this name (cannot happen unless someone made it by hand).
        let owner = claim.metadata.labels.as_ref().and_then(|l| l.get(SESSION_LABEL));
        if owner.map(String::as_str) != Some(session.as_str()) {
            return Err(SandboxFailure::start(format!(
                "the sandbox claim {name} exists and is not this session's"
            )));
        }
        let sandbox = self.ready(&name).await?;
        let ready_after = started.elapsed();

        let pod = self.pod_of(&claim_uid, &sandbox).await?;
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let linked = Instant::now();
        let link = self
            .links
            .wait_for(&pod_uid, self.deadlines.link)
            .await
            .ok_or_else(|| {
                SandboxFailure::start(format!(
                    "the driver of pod {pod_name} did not link to the gateway within {:?}",
                    self.deadlines.link
                ))
            })?;
        Ok(Claimed {
            claim: name,
            claim_uid,
            pod_name,
            pod_uid,
            link,
            ready_after,
            linked_after: linked.elapsed(),
        })
    }

    /// Waits for the claim's Ready condition (the watch lists again after `410 Gone`), or a reason it
    /// will never come, or the deadline.
    async fn ready(&self, name: &str) -> Result<String, SandboxFailure> {
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut claims = std::pin::pin!(watcher(self.claims.clone(), config).default_backoff().touched_objects());
        let mut last = ClaimState::Pending {
            reason: String::new(),
            message: "no answer from the cluster".into(),
        };
        let waited = async {
            while let Some(seen) = claims.next().await {
                let claim = match seen {
                    Ok(claim) => claim,
                    Err(error) => {
                        // The watch restarts by itself (a relist after 410 Expired, backing off).
                        tracing::debug!(%error, claim = name, "the claim's watch restarts");
                        continue;
                    }
                };
                last = claim_state(claim.status.as_ref());
                match &last {
                    ClaimState::Ready { sandbox } => return Ok(sandbox.clone()),
                    ClaimState::Failed { code, reason } => {
                        return Err(SandboxFailure {
                            code: *code,
                            reason: reason.clone(),
                        });
                    }
                    ClaimState::Pending { .. } => {}
                }
            }
            Err(SandboxFailure::start("the claim's watch ended"))
        };
        match tokio::time::timeout(self.deadlines.ready, waited).await {
            Ok(result) => result,
            Err(_) => {
                let why = match &last {
                    ClaimState::Pending { reason, message } if reason.is_empty() => message.clone(),
                    ClaimState::Pending { reason, message } => format!("{reason}: {message}"),
                    _ => String::new(),
                };
                Err(SandboxFailure::start(format!(
                    "the sandbox was not ready within {:?} ({why})",
                    self.deadlines.ready
                )))
            }
        }
    }

    /// The pod of the sandbox the controller gave the claim: the sandbox named in the claim's status must
    /// be controlled by the claim, and the pod of that name by the sandbox.
    async fn pod_of(&self, claim_uid: &str, sandbox: &str) -> Result<Pod, SandboxFailure> {
        let read = |what: &str, e: kube::Error| SandboxFailure::start(format!("cannot read {what} {sandbox}: {e}"));
        let held = self.sandboxes.get(sandbox).await.map_err(|e| read("sandbox", e))?;
        if controller_uid(&held.metadata) != Some(claim_uid) {
            return Err(SandboxFailure::start(format!(
                "sandbox {sandbox} is not controlled by this session's claim"
            )));
        }
        let sandbox_uid = held.metadata.uid.clone().unwrap_or_default();
        let pod = self
            .pods
            .get(sandbox)
            .await
            .map_err(|e| read("the pod of sandbox", e))?;
        if sandbox_uid.is_empty() || controller_uid(&pod.metadata) != Some(sandbox_uid.as_str()) {
            return Err(SandboxFailure::start(format!(
                "pod {sandbox} is not controlled by the claim's sandbox"
            )));
        }
        Ok(pod)
    }

    /// Resolves when the session's claim stops being ready (expired, its pod failed or was
    /// deleted): the failure its turn ends with.
    pub async fn lost(&self, session: &SessionId) -> SandboxFailure {
        let name = claim_name(session);
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = std::pin::pin!(watcher(self.claims.clone(), config).default_backoff());
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Delete(_)) => {
                    return SandboxFailure {
                        code: FailureCode::SandboxLost,
                        reason: format!("the sandbox claim {name} was deleted"),
                    };
                }
                Ok(watcher::Event::Apply(claim) | watcher::Event::InitApply(claim)) => {
                    if let ClaimState::Failed { reason, .. } = claim_state(claim.status.as_ref()) {
                        // The claim says the pod failed; the pod says whether the kernel killed it for
                        // its memory, which a user must know to fix it.
                        let pod = claim
                            .status
                            .as_ref()
                            .and_then(|s| s.sandbox.as_ref())
                            .map(|s| s.name.clone());
                        let oom = match pod {
                            Some(pod) => self
                                .pods
                                .get_opt(&pod)
                                .await
                                .ok()
                                .flatten()
                                .is_some_and(|p| oom_killed(&p)),
                            None => false,
                        };
                        return SandboxFailure {
                            code: FailureCode::SandboxLost,
                            reason: if oom {
                                format!("{reason}; its container was OOMKilled (past its memory limit)")
                            } else {
                                reason
                            },
                        };
                    }
                }
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, claim = %name, "the claim's watch restarts"),
            }
        }
        SandboxFailure {
            code: FailureCode::SandboxLost,
            reason: format!("the watch of claim {name} ended"),
        }
    }

    /// Lets the session's sandbox go: the claim is deleted in the foreground (its sandbox and pod first).
    pub async fn release(&self, session: &SessionId) -> Result<(), kube::Error> {
        let params = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Foreground),
            ..DeleteParams::default()
        };
        match self.claims.delete(&claim_name(session), &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// The sessions that hold a claim on this worker's pool (after a restart: what to adopt or release).
    pub async fn claimed_sessions(&self) -> Result<Vec<(SessionId, String)>, kube::Error> {
        let claims = self.claims.list(&ListParams::default().labels(SESSION_LABEL)).await?;
        Ok(claims
            .items
            .into_iter()
            .filter(|claim| claim.spec.warm_pool_ref.name == self.pool)
            .filter_map(|claim| {
                let session = claim.metadata.labels.as_ref()?.get(SESSION_LABEL)?;
                Some((SessionId::parse(session).ok()?, claim.metadata.name?))
            })
            .collect())
    }
}

/// The worker's pods are claims: [`KubeSandboxes`] is where `sortie_worker::pods::Pods` gets them.
#[async_trait::async_trait]
impl sortie_worker::pods::PodSource for KubeSandboxes {
    async fn claim(
        &self,
        session: &SessionId,
    ) -> Result<sortie_worker::pods::ClaimedPod, sortie_worker::pods::PodFailure> {
        let claimed = KubeSandboxes::claim(self, session)
            .await
            .map_err(|failure| (failure.code, failure.reason))?;
        Ok(sortie_worker::pods::ClaimedPod {
            pod_name: claimed.pod_name,
            pod_uid: claimed.pod_uid,
            ready_after: claimed.ready_after,
            linked_after: claimed.linked_after,
        })
    }

    async fn lost(&self, session: &SessionId) -> sortie_worker::pods::PodFailure {
        let failure = KubeSandboxes::lost(self, session).await;
        (failure.code, failure.reason)
    }

    async fn release(&self, session: &SessionId) -> Result<(), String> {
        KubeSandboxes::release(self, session)
            .await
            .map_err(|error| error.to_string())
    }

    async fn held(&self) -> Result<Vec<SessionId>, String> {
        self.claimed_sessions()
            .await
            .map(|held| held.into_iter().map(|(session, _)| session).collect())
            .map_err(|error| error.to_string())
    }
}

/// Whether a container of `pod` was last ended by the kernel for its memory.
fn oom_killed(pod: &Pod) -> bool {
    let statuses = pod.status.iter().flat_map(|status| {
        status
            .container_statuses
            .iter()
            .flatten()
            .chain(status.init_container_statuses.iter().flatten())
    });
    statuses
        .flat_map(|container| {
            [container.state.as_ref(), container.last_state.as_ref()]
                .into_iter()
                .flatten()
                .filter_map(|state| state.terminated.as_ref())
        })
        .any(|terminated| terminated.reason.as_deref() == Some("OOMKilled"))
}

/// The uid of the object's controller (the owner reference marked `controller`), if it has one.
fn controller_uid(metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<&str> {
    metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|owner| owner.controller == Some(true))
        .map(|owner| owner.uid.as_str())
}

/// RFC 3339 in UTC, seconds precision.
fn rfc3339(at: std::time::SystemTime) -> String {
    let seconds = at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    k8s_openapi::jiff::Timestamp::from_second(i64::try_from(seconds).unwrap_or(i64::MAX))
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_oom_killed_only_by_its_containers_word() {
        let pod = |status: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "status": status})).expect("pod")
        };
        let terminated = |reason: &str| serde_json::json!({"terminated": {"exitCode": 137, "reason": reason}});
        assert!(oom_killed(&pod(serde_json::json!({
            "phase": "Failed",
            "containerStatuses": [{"name": "driver", "image": "i", "imageID": "", "ready": false,
                                   "restartCount": 0, "state": terminated("OOMKilled")}]
        }))));
        assert!(oom_killed(&pod(serde_json::json!({
            "containerStatuses": [{"name": "driver", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
                                   "state": {"running": {}}, "lastState": terminated("OOMKilled")}]
        }))));
        assert!(!oom_killed(&pod(serde_json::json!({
            "phase": "Failed",
            "containerStatuses": [{"name": "driver", "image": "i", "imageID": "", "ready": false,
                                   "restartCount": 0, "state": terminated("Error")}]
        }))));
        assert!(!oom_killed(&pod(serde_json::json!({"phase": "Failed"}))));
    }

    #[test]
    fn times_are_rfc3339_utc() {
        let at = std::time::UNIX_EPOCH + Duration::from_secs(1_796_515_200 + 3_723);
        assert_eq!(rfc3339(at), "2026-12-06T01:02:03Z");
        assert_eq!(rfc3339(std::time::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(std::time::UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }

    #[test]
    fn claim_names_are_dns_labels_and_unique_per_session() {
        let session = SessionId::parse("ses_01JD8X3K4M5N6P7Q8R9S0T1V2W")
            .or_else(|_| SessionId::parse("ses_01jd8x3k4m5n6p7q8r9s0t1v2w"))
            .expect("id");
        let name = claim_name(&session);
        assert!(name.len() <= 63, "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{name}"
        );
        assert!(name.starts_with("sortie-"));
    }
}
