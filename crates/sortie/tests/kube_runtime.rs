//! The Kubernetes runtime's claims (DESIGN §15) against a fake apiserver speaking real Kubernetes JSON
//! (list and watch with resource versions, bookmarks, 410 after compaction, `Status` errors), with this
//! test as agent-sandbox's claim controller: it walks each claim through the controller's condition
//! reasons, labels the pod it hands out with the claim's uid, and starts that pod's real
//! `sortie driver --link`, which the gateway identifies through the fake's `TokenReview`.
//!
//! Where this is easier than a cluster: the "pods" are driver processes on this host (no image, no
//! scheduling), and the controller answers in milliseconds; the faults are the ones a cluster reports.

mod support;

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sortie_gateway::links::{DriverLinks, KubeTokenReview, LinkState, link_router};
use sortie_kube::runtime::{Deadlines, KubeSandboxes, claim_name};
use sortie_protocol::driver::{Assignment, DriverErrorCode, LINK_AUDIENCE, StartTurn, TurnState};
use sortie_protocol::{FailureCode, SessionId};
use sortie_testkit::kube::{ChangeKind, FakeApiserver, ObjectKey};

const NAMESPACE: &str = "sortie";
const CLAIMS: &str = "apis/extensions.agents.x-k8s.io/v1beta1/sandboxclaims";
const POOLS: &str = "apis/extensions.agents.x-k8s.io/v1beta1/sandboxwarmpools";
const SANDBOXES: &str = "apis/agents.x-k8s.io/v1beta1/sandboxes";
const PODS: &str = "api/v1/pods";

fn key(collection: &str, name: &str) -> ObjectKey {
    ObjectKey {
        collection: collection.into(),
        namespace: NAMESPACE.into(),
        name: name.into(),
    }
}

/// What the fake claim controller does with a claim's pod.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PodDriver {
    /// Its driver links with the pod's own token.
    Links,
    /// Its driver never starts.
    Silent,
    /// Its driver presents the token of another pod (one the cluster made for someone else).
    Impostor,
    /// The claim's status names a sandbox another claim controls (whose driver links).
    OthersSandbox,
}

struct Controller {
    apiserver: Arc<FakeApiserver>,
    root: tempfile::TempDir,
    /// Warm pods left per pool.
    warm: Mutex<HashMap<String, usize>>,
    pod_driver: Mutex<PodDriver>,
    drivers: Mutex<Vec<Child>>,
    gateway: String,
}

impl Drop for Controller {
    fn drop(&mut self) {
        for child in self.drivers.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn condition(status: &str, reason: &str, message: &str) -> Value {
    json!({"type": "Ready", "status": status, "reason": reason, "message": message,
           "lastTransitionTime": "2026-12-06T00:00:00Z"})
}

impl Controller {
    fn set_claim_status(&self, name: &str, status: Value) {
        let Some(mut claim) = self.apiserver.get(&key(CLAIMS, name)) else {
            return;
        };
        claim["status"] = status;
        self.apiserver.put(key(CLAIMS, name), claim);
    }

    /// Hands the claim a sandbox as agent-sandbox does: the Sandbox (a pool's generated name when warm,
    /// the claim's name when cold) controlled by the claim, its Pod of the same name controlled by the
    /// Sandbox (no claim label reaches the pod), the claim Ready naming it; then the pod's driver starts.
    fn hand_out(&self, claim: &Value, launch: &str) {
        let name = claim["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let mut claim_uid = claim["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let mode = *self.pod_driver.lock().unwrap_or_else(|p| p.into_inner());
        if mode == PodDriver::OthersSandbox {
            claim_uid = "uid-of-another-claim".into();
        }
        let sandbox = if launch == "warm" {
            let pool = claim["spec"]["warmPoolRef"]["name"].as_str().unwrap_or("pool");
            format!("{pool}-warm-{}", &name[name.len() - 5..])
        } else {
            name.clone()
        };
        let owner = |kind: &str, name: &str, uid: &str, api: &str| json!([{"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": true}]);
        let made = self.apiserver.put(
            key(SANDBOXES, &sandbox),
            json!({"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
                   "metadata": {"labels": {"agents.x-k8s.io/launch-type": launch, "agents.x-k8s.io/claim-uid": claim_uid},
                                "ownerReferences": owner("SandboxClaim", &name, &claim_uid, "extensions.agents.x-k8s.io/v1beta1")},
                   "spec": {"podTemplate": {"spec": {"containers": []}}}}),
        );
        let sandbox_uid = made["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let pod = self.apiserver.put(
            key(PODS, &sandbox),
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"labels": {"agents.x-k8s.io/sandbox-name-hash": "5f2a9c11"},
                                "ownerReferences": owner("Sandbox", &sandbox, &sandbox_uid, "agents.x-k8s.io/v1beta1")},
                   "spec": {"containers": [{"name": "driver", "image": "sortie"}]},
                   "status": {"phase": "Running", "podIP": "10.0.0.9"}}),
        );
        let pod_uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        self.set_claim_status(
            &name,
            json!({"sandbox": {"name": sandbox, "podIPs": ["10.0.0.9"]},
                   "conditions": [condition("True", "DependenciesReady", "")]}),
        );
        let token = match mode {
            PodDriver::Silent => return,
            PodDriver::Links | PodDriver::OthersSandbox => {
                self.apiserver
                    .issue_token(NAMESPACE, "sandbox", &sandbox, &pod_uid, &[LINK_AUDIENCE])
            }
            PodDriver::Impostor => self.apiserver.issue_token(
                NAMESPACE,
                "sandbox",
                "someone-else",
                "uid-of-someone-else",
                &[LINK_AUDIENCE],
            ),
        };
        self.start_driver(&sandbox, &token);
    }

    fn start_driver(&self, pod: &str, token: &str) {
        let dir = self.root.path().join(pod);
        std::fs::create_dir_all(dir.join("workspace")).expect("workspace");
        std::fs::write(dir.join("token"), token).expect("token");
        let child = support::sortie(&dir)
            .args(["driver", "--link", &self.gateway, "--identity-token-file"])
            .arg(dir.join("token"))
            .arg("--workspace")
            .arg(dir.join("workspace"))
            .arg("--home")
            .arg(dir.join("home"))
            .args(["--await-assignment", "--kill-grace", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the pod's driver");
        self.drivers.lock().unwrap_or_else(|p| p.into_inner()).push(child);
    }

    /// Plays agent-sandbox's claim controller until the test ends.
    async fn run(self: Arc<Self>) {
        let mut changes = self.apiserver.changes();
        while let Ok(change) = changes.recv().await {
            if change.key.collection != CLAIMS || change.kind != ChangeKind::Added {
                continue;
            }
            let claim = change.object;
            let name = change.key.name.clone();
            let pool = claim["spec"]["warmPoolRef"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if self.apiserver.get(&key(POOLS, &pool)).is_none() {
                self.set_claim_status(
                    &name,
                    json!({"conditions": [condition("False", "WarmPoolNotFound", &format!("warm pool {pool} not found"))]}),
                );
                continue;
            }
            let warm = {
                let mut warm = self.warm.lock().unwrap_or_else(|p| p.into_inner());
                let left = warm.entry(pool).or_insert(0);
                let had = *left > 0;
                *left = left.saturating_sub(1);
                had
            };
            if warm {
                self.hand_out(&claim, "warm");
            } else {
                // An empty pool: a cold pod from the template, pending a while first.
                self.set_claim_status(
                    &name,
                    json!({"conditions": [condition("False", "SandboxCreatePending", "creating a sandbox from the template")]}),
                );
                let controller = self.clone();
                tokio::spawn(async move {
                    // What a cold pod takes to schedule and start, much shortened.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    controller.hand_out(&claim, "cold");
                });
            }
        }
    }
}

struct World {
    apiserver: Arc<FakeApiserver>,
    controller: Arc<Controller>,
    sandboxes: KubeSandboxes,
    links: Arc<DriverLinks>,
    _gateway: sortie_testkit::http::Stub,
}

async fn world() -> World {
    let _ = support::http_client();
    let apiserver = Arc::new(FakeApiserver::start("gateway-account-token").await);
    let links = DriverLinks::new();
    let gateway = sortie_testkit::http::serve(link_router(LinkState {
        links: links.clone(),
        identity: Arc::new(KubeTokenReview {
            apiserver: apiserver.url(),
            bearer: "gateway-account-token".into(),
            sandbox_account: format!("system:serviceaccount:{NAMESPACE}:sandbox"),
            http: support::http_client(),
        }),
        egress: sortie_gateway::links::EgressBindings::new(),
    }))
    .await;
    let controller = Arc::new(Controller {
        apiserver: apiserver.clone(),
        root: tempfile::tempdir().expect("temp"),
        warm: Mutex::new(HashMap::from([("agents".to_owned(), 1)])),
        pod_driver: Mutex::new(PodDriver::Links),
        drivers: Mutex::new(Vec::new()),
        gateway: gateway.url(),
    });
    tokio::spawn(controller.clone().run());
    let config = kube::Config::new(apiserver.url().parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let sandboxes = KubeSandboxes::new(
        client,
        NAMESPACE,
        "agents",
        links.clone(),
        Deadlines {
            ready: Duration::from_secs(20),
            link: Duration::from_secs(3),
            lifetime: Duration::from_secs(3600),
        },
    );
    // The shape's template and pool, as the runtime reconciles them at start (again: nothing changes).
    let shape = shape("agents", 2);
    sandboxes.reconcile(&shape).await.expect("reconcile");
    sandboxes.reconcile(&shape).await.expect("reconcile again");
    World {
        apiserver,
        controller,
        sandboxes,
        links,
        _gateway: gateway,
    }
}

fn shape(name: &str, replicas: i32) -> sortie_kube::shape::SandboxShape {
    sortie_kube::shape::SandboxShape {
        name: name.into(),
        image: "sortie-sandbox:test".into(),
        runtime_class: None,
        cpu: "1".into(),
        memory: "1Gi".into(),
        ephemeral_storage: "4Gi".into(),
        replicas,
        service_account: "sandbox".into(),
        gateway_url: "http://sortie-gateway:7700".into(),
        gateway_pods: [("app.kubernetes.io/component".to_owned(), "gateway".to_owned())].into(),
        gateway_port: 7700,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_a_shape_applies_its_template_and_pool_once() {
    let world = world().await;
    let template = world
        .apiserver
        .get(&key(
            "apis/extensions.agents.x-k8s.io/v1beta1/sandboxtemplates",
            "agents",
        ))
        .expect("the template");
    assert_eq!(
        template["spec"]["podTemplate"]["spec"]["automountServiceAccountToken"],
        false
    );
    let pool = world.apiserver.get(&key(POOLS, "agents")).expect("the pool");
    assert_eq!(pool["spec"]["replicas"], 2);
    assert_eq!(
        pool["metadata"]["generation"], 1,
        "applying the same shape again changes nothing"
    );
    let applies = world
        .apiserver
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH ") && r.contains("fieldManager=sortie"))
        .count();
    assert_eq!(applies, 4, "{:#?}", world.apiserver.requests());
    // A restart with a bigger pool: the same objects, the new size.
    world.sandboxes.reconcile(&shape("agents", 5)).await.expect("reconcile");
    let pool = world.apiserver.get(&key(POOLS, "agents")).expect("the pool");
    assert_eq!(
        (pool["spec"]["replicas"].clone(), pool["metadata"]["generation"].clone()),
        (json!(5), json!(2))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_gets_a_warm_pod_or_a_cold_one_and_its_own_pods_driver() {
    let world = world().await;

    // Warm: the claim names the pool and the session and carries nothing that forces a cold pod.
    let session = SessionId::generate();
    let claimed = world.sandboxes.claim(&session).await.expect("a warm sandbox");
    let stored = world
        .apiserver
        .get(&key(CLAIMS, &claim_name(&session)))
        .expect("the claim");
    assert_eq!(stored["spec"]["warmPoolRef"]["name"], "agents", "{stored:#}");
    assert_eq!(stored["metadata"]["labels"]["sortie.dev/session"], session.as_str());
    assert!(stored["spec"].get("additionalPodMetadata").is_none(), "{stored:#}");
    assert_eq!(stored["spec"]["lifecycle"]["shutdownPolicy"], "DeleteForeground");
    assert!(
        stored["spec"]["lifecycle"]["shutdownTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    for never in ["env", "volumeClaimTemplates"] {
        assert!(
            stored["spec"].get(never).is_none(),
            "{never} forces a cold pod: {stored:#}"
        );
    }
    assert!(claimed.pod_name.contains("-warm-"), "{}", claimed.pod_name);
    assert_eq!(claimed.link.identity.pod_uid, claimed.pod_uid);
    // A generic pod's driver serves nothing until the host assigns it its session; then that session
    // only.
    let client = sortie_worker::client::DriverClient::over_link(claimed.link.clone());
    let unassigned = client.status().await.expect_err("no session, no status");
    assert_eq!(unassigned.code(), Some(DriverErrorCode::NotAssigned), "{unassigned}");
    let assignment = Assignment {
        session: session.as_str().to_owned(),
        agent: "scripted".into(),
        model: None,
        model_proxy: None,
        branch: None,
        remote: None,
        turn_timeout_secs: Some(60),
        checkout: None,
        secret_digests: None,
    };
    client.assign(&assignment).await.expect("assigned");
    client
        .assign(&assignment)
        .await
        .expect("the same assignment again is fine");
    let other = Assignment {
        session: SessionId::generate().as_str().to_owned(),
        ..assignment.clone()
    };
    let refused = client.assign(&other).await.expect_err("one session per pod");
    assert_eq!(refused.code(), Some(DriverErrorCode::AlreadyAssigned), "{refused}");
    client.status().await.expect("the pod's driver answers");
    let started = client
        .start_turn(&StartTurn {
            n: 1,
            nonce: "nonce-kube-1".into(),
            prompt: "#!scripted\nsay: from a claimed pod".into(),
            baseline: None,
            priming_context: None,
        })
        .await
        .expect("a turn on the claimed pod");
    assert_eq!(started.n, 1);
    sortie_testkit::wait::eventually("the pod's turn ends", Duration::from_secs(30), || {
        let client = client.clone();
        async move {
            let report = client.report(1).await.map_err(|e| e.to_string())?;
            if report.state == TurnState::Completed {
                Ok(())
            } else {
                Err(format!("{:?}", report.state))
            }
        }
    })
    .await;
    eprintln!(
        "KUBE_CLAIM warm: claim -> ready {:?}, ready -> linked {:?}",
        claimed.ready_after, claimed.linked_after
    );

    // The pool is empty now: a cold pod, pending first; the watch is compacted meanwhile and the
    // runtime lists again (410 Expired) and still sees it ready.
    let cold = SessionId::generate();
    let compactor = {
        let apiserver = world.apiserver.clone();
        let name = claim_name(&cold);
        tokio::spawn(async move {
            sortie_testkit::wait::eventually("the cold claim is pending", Duration::from_secs(10), || {
                let claim = apiserver.get(&key(CLAIMS, &name));
                async move {
                    let reason = claim.as_ref().map(|c| c["status"]["conditions"][0]["reason"].clone());
                    if reason == Some(json!("SandboxCreatePending")) {
                        Ok(())
                    } else {
                        Err(reason)
                    }
                }
            })
            .await;
            apiserver.compact();
        })
    };
    let claimed_cold = world.sandboxes.claim(&cold).await.expect("a cold sandbox");
    compactor.await.expect("compacted");
    // The watch was cut and could not resume (410): the claim was listed again.
    let lists = world
        .apiserver
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET ") && r.contains(&claim_name(&cold)) && !r.contains("watch=true"))
        .count();
    assert!(lists >= 2, "{:#?}", world.apiserver.requests());
    assert_eq!(
        claimed_cold.pod_name,
        claim_name(&cold),
        "a cold sandbox and its pod take the claim's name"
    );
    eprintln!(
        "KUBE_CLAIM cold: claim -> ready {:?}, ready -> linked {:?}",
        claimed_cold.ready_after, claimed_cold.linked_after
    );
    assert_eq!(world.links.len(), 2);

    // After a restart, the runtime finds both sessions' claims by their label; releasing one deletes it.
    let mut held = world.sandboxes.claimed_sessions().await.expect("claims");
    held.sort();
    let mut expected = vec![
        (session.clone(), claim_name(&session)),
        (cold.clone(), claim_name(&cold)),
    ];
    expected.sort();
    assert_eq!(held, expected);
    world.sandboxes.release(&cold).await.expect("release");
    world.sandboxes.release(&cold).await.expect("releasing twice is fine");
    assert!(world.apiserver.get(&key(CLAIMS, &claim_name(&cold))).is_none());

    // The claim expires under a running session: the session learns it lost its sandbox, and why.
    let lost = {
        let name = claim_name(&session);
        let controller = world.controller.clone();
        let watching = world.sandboxes.lost(&session);
        tokio::pin!(watching);
        // Let the watch start before the claim changes (a change before it is seen on its first list).
        assert!(
            tokio::time::timeout(Duration::from_millis(200), &mut watching)
                .await
                .is_err()
        );
        controller.set_claim_status(
            &name,
            json!({"sandbox": {"name": claimed.pod_name}, "conditions": [condition("False", "ClaimExpired", "shutdown time reached")]}),
        );
        tokio::time::timeout(Duration::from_secs(20), watching)
            .await
            .expect("the loss is seen")
    };
    assert_eq!(lost.code, FailureCode::SandboxLost);
    assert!(lost.reason.contains("ClaimExpired"), "{}", lost.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_cannot_be_met_or_whose_driver_does_not_link_fails_with_the_reason() {
    let world = world().await;

    // A pool the operator never made: the controller's reason, at once.
    let sandboxes = KubeSandboxes::new(
        kube::Client::try_from(kube::Config::new(world.apiserver.url().parse().expect("url"))).expect("client"),
        NAMESPACE,
        "no-such-pool",
        world.links.clone(),
        Deadlines::default(),
    );
    let failure = sandboxes
        .claim(&SessionId::generate())
        .await
        .err()
        .expect("no pool, no sandbox");
    assert_eq!(failure.code, FailureCode::SandboxStartFailed);
    assert!(failure.reason.contains("WarmPoolNotFound"), "{}", failure.reason);

    // A pod whose driver never dials: the session fails once the link deadline passes.
    *world.controller.pod_driver.lock().unwrap_or_else(|p| p.into_inner()) = PodDriver::Silent;
    let failure = world
        .sandboxes
        .claim(&SessionId::generate())
        .await
        .err()
        .expect("no driver, no sandbox");
    assert_eq!(failure.code, FailureCode::SandboxStartFailed);
    assert!(failure.reason.contains("did not link"), "{}", failure.reason);

    // A pod whose driver presents another pod's identity: it links as that other pod, and this
    // session never takes it.
    *world.controller.pod_driver.lock().unwrap_or_else(|p| p.into_inner()) = PodDriver::Impostor;
    let failure = world
        .sandboxes
        .claim(&SessionId::generate())
        .await
        .err()
        .expect("an impostor is not bound");
    assert!(failure.reason.contains("did not link"), "{}", failure.reason);
    assert!(
        world.links.get("uid-of-someone-else").is_some(),
        "the impostor did link, as the pod its token names"
    );
    assert_eq!(world.links.len(), 1);

    // A claim whose status names a sandbox another claim controls: its pod links, and this session
    // still does not take it.
    *world.controller.pod_driver.lock().unwrap_or_else(|p| p.into_inner()) = PodDriver::OthersSandbox;
    let failure = world
        .sandboxes
        .claim(&SessionId::generate())
        .await
        .err()
        .expect("another claim's sandbox is not bound");
    assert!(
        failure.reason.contains("not controlled by this session's claim"),
        "{}",
        failure.reason
    );
}
