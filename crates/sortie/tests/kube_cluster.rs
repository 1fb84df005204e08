//! Opt-in: sessions through a real cluster running `deploy/` (DESIGN §15), with agent-sandbox's own
//! controller, a real kubelet and the cluster's network in place of `kube_serve.rs`'s stand-ins. It is
//! ignored unless asked for (`--ignored`), and then needs `SORTIE_K8S_E2E_KUBECONFIG` to name the
//! kubeconfig of a disposable cluster; CI has no cluster, so CI only compiles it. `docs/kubernetes.md` ("End to end on a real cluster") says how to run it.
//!
//! - `SORTIE_K8S_E2E_KUBECONFIG`: the cluster (the test reads the session's SandboxClaim there).
//! - `SORTIE_K8S_E2E_URL`: sortie's API as this machine reaches it (e.g. a `kubectl port-forward`).
//! - `SORTIE_K8S_E2E_TOKEN`: a token of that sortie.
//! - `SORTIE_K8S_E2E_REPO`: a repository the workers can reach (a forge URL with a connection set).
//! - `SORTIE_K8S_E2E_NAMESPACE`: where sortie runs (default `sortie`).
//!
//! It prints each turn's timings: `sandbox` is claim → pod Ready → its driver linked, `clone` the pod's
//! clone through the git proxy; the first part's latency follows.

use std::time::Duration;

use kube::api::Api;
use serde_json::{Value, json};
use sortie_kube::crd::SandboxClaim;

struct Cluster {
    http: reqwest::Client,
    url: String,
    token: String,
    repo: String,
    claims: Api<SandboxClaim>,
}

fn setting(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is needed with SORTIE_K8S_E2E_KUBECONFIG"))
}

impl Cluster {
    async fn from_env() -> Option<Cluster> {
        let kubeconfig = std::env::var_os("SORTIE_K8S_E2E_KUBECONFIG")?;
        let config = kube::config::Kubeconfig::read_from(&kubeconfig).expect("the kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(config, &kube::config::KubeConfigOptions::default())
            .await
            .expect("a usable kubeconfig");
        let client = kube::Client::try_from(config).expect("a kube client");
        let namespace = std::env::var("SORTIE_K8S_E2E_NAMESPACE").unwrap_or_else(|_| "sortie".into());
        Some(Cluster {
            http: reqwest::Client::new(),
            url: setting("SORTIE_K8S_E2E_URL").trim_end_matches('/').to_owned(),
            token: setting("SORTIE_K8S_E2E_TOKEN"),
            repo: setting("SORTIE_K8S_E2E_REPO"),
            claims: Api::namespaced(client, &namespace),
        })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("sortie's API answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// Waits (a real cluster's cold pod may take minutes) until turn `n` ended and the session rests.
    async fn settled(&self, id: &str, n: usize) -> (Value, Vec<Value>) {
        sortie_testkit::wait::eventually(
            &format!("turn {n} of {id} ends"),
            Duration::from_secs(600),
            || async move {
                let (_, session) = self
                    .call(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
                    .await;
                let (_, turns) = self
                    .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/turns"), None)
                    .await;
                let turns = turns["turns"].as_array().cloned().unwrap_or_default();
                let rests =
                    ["idle", "failed", "canceled", "hibernated"].contains(&session["phase"].as_str().unwrap_or(""));
                if rests && turns.len() >= n && turns[n - 1]["completed_at"].is_string() {
                    Ok((session, turns))
                } else {
                    Err((session, turns))
                }
            },
        )
        .await
    }

    /// The session's claim as the cluster has it, while it exists.
    async fn claim(&self, id: &str) -> SandboxClaim {
        let name = sortie_kube::runtime::claim_name(&sortie_protocol::SessionId::parse(id).expect("id"));
        sortie_testkit::wait::eventually("the session's claim", Duration::from_secs(300), || {
            let name = name.clone();
            async move {
                match self.claims.get_opt(&name).await {
                    Ok(Some(claim)) => Ok(claim),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: set SORTIE_K8S_E2E_* and run with --ignored (docs/kubernetes.md)"]
async fn a_session_runs_hibernates_and_resumes_on_a_real_cluster() {
    let Some(cluster) = Cluster::from_env().await else {
        panic!("SORTIE_K8S_E2E_KUBECONFIG is not set (see docs/kubernetes.md)");
    };
    let task = "#!scripted\nsay: hello from the cluster\nwrite: E2E.md\nwritten in a pod\n>>>\nsay: done";
    let (status, created) = cluster
        .call(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"repo": cluster.repo, "task": task, "agent": "scripted"})),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().expect("id").to_owned();

    // The claim sortie posted: from the warm pool, labelled, with nothing that forces a cold pod.
    let claim = cluster.claim(&id).await;
    assert!(!claim.spec.warm_pool_ref.name.is_empty(), "{claim:?}");
    assert_eq!(
        claim
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(sortie_kube::crd::SESSION_LABEL)),
        Some(&id)
    );
    assert!(claim.spec.additional_pod_metadata.is_none(), "{claim:?}");

    let (session, turns) = cluster.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{session:#}\n{turns:#?}");
    println!("real cluster, turn 1 timings (ms): {}", turns[0]["timings"]);
    assert!(session["head_sha"].is_string(), "delivered: {session:#}");

    // Once hibernated (after the deployment's idle grace), the next turn takes a new pod and the agent
    // loads its own session from the home the first pod gave up.
    sortie_testkit::wait::eventually("the session hibernates", Duration::from_secs(900), || async {
        let (_, session) = cluster
            .call(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
            .await;
        if session["phase"] == "hibernated" {
            Ok(())
        } else {
            Err(session)
        }
    })
    .await;
    let (status, steered) = cluster
        .call(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/steer"),
            Some(json!({"prompt": "#!scripted\nsay: resumed", "mode": "queue"})),
        )
        .await;
    assert_eq!(status, 202, "{steered}");
    let (session, turns) = cluster.settled(&id, 2).await;
    assert_eq!(turns[1]["status"], "completed", "{session:#}\n{turns:#?}");
    println!(
        "real cluster, turn 2 (resumed) timings (ms): {}, priming {}",
        turns[1]["timings"], turns[1]["priming"]
    );
}
