//! `sortie serve --runtime kubernetes` end to end (DESIGN §15): a real `serve` process reaches a fake
//! apiserver through a kubeconfig (real Kubernetes JSON; `sortie-testkit`), applies its sandbox
//! template and warm pool, claims a pod per session from the pool, identifies the pod's driver by the
//! cluster's `TokenReview`, assigns it the session over its link, and the pod clones the repository
//! through the session's git proxy and delivers its branch through it — the pod's only way out.
//!
//! This test plays agent-sandbox's controller and the kubelet: for each claim it makes the Sandbox and
//! Pod objects (controlled by the claim and the sandbox) and runs the pod as a real bubblewrap sandbox
//! (this process is root) with exactly the command of the template the worker applied. Where this is
//! easier than a cluster: a bwrap sandbox has no network to reach the worker by, so the pod's `--link`
//! names a socket bound into the sandbox, which this test splices to the worker's link listener where a
//! cluster's network would carry it; the identity token is written read-only beside it, where the kubelet would
//! project a volume.

mod support;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio, inside};
use sortie_testkit::kube::{ChangeKind, FakeApiserver, ObjectKey};
use support::world::World;

const NAMESPACE: &str = "sortie";
const POOL: &str = "pool-e2e";
const WORKER_TOKEN: &str = "worker-service-account-token";
const CLAIMS: &str = "apis/extensions.agents.x-k8s.io/v1beta1/sandboxclaims";
const TEMPLATES: &str = "apis/extensions.agents.x-k8s.io/v1beta1/sandboxtemplates";
const POOLS: &str = "apis/extensions.agents.x-k8s.io/v1beta1/sandboxwarmpools";
const SANDBOXES: &str = "apis/agents.x-k8s.io/v1beta1/sandboxes";
const PODS: &str = "api/v1/pods";
const SERVICES: &str = "api/v1/services";

static POD_SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn key(collection: &str, name: &str) -> ObjectKey {
    ObjectKey {
        collection: collection.into(),
        namespace: NAMESPACE.into(),
        name: name.into(),
    }
}

/// A kubeconfig naming the fake apiserver, with the worker's service-account token.
fn kubeconfig(dir: &Path, server: &str) -> PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\nusers:\n- name: worker\n  user:\n    token: {WORKER_TOKEN}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: worker\n    namespace: {NAMESPACE}\ncurrent-context: fake\n"
    );
    std::fs::write(&path, text).expect("kubeconfig");
    path
}

/// agent-sandbox's controller and the kubelet, as far as sortie meets them.
struct Cluster {
    apiserver: Arc<FakeApiserver>,
    runtime: LocalRuntime,
    root: PathBuf,
    /// `sortie` and the scripted agent, where the sandbox uid can read them (the pod image's binaries).
    bin_dir: PathBuf,
    /// The worker's link listener, where a pod's link and egress go.
    worker: Mutex<Option<String>>,
    /// The sandbox running each claim's pod.
    pods: Mutex<HashMap<String, String>>,
    claims_seen: Mutex<Vec<Value>>,
    /// Every pod this cluster made, in order.
    pod_names: Mutex<Vec<String>>,
    /// Warm pods left in the pool; past them a claim gets a cold pod, pending a while first.
    warm: std::sync::atomic::AtomicUsize,
    /// The identity token of every pod this cluster made, in order.
    tokens: Mutex<Vec<String>>,
    /// What is wrong with the next pods, if anything.
    fault: Mutex<Option<PodFault>>,
}

#[derive(Clone)]
enum PodFault {
    /// Its driver never starts, so it never dials the worker.
    Silent,
    /// Its driver presents this token (another pod's, leaked by that pod's agent) instead of its own.
    Presents(String),
}

impl Cluster {
    fn new(apiserver: Arc<FakeApiserver>, root: &Path) -> Arc<Cluster> {
        let dir = |name: &str| {
            let path = root.join(name);
            std::fs::create_dir_all(&path).expect("dir");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            path
        };
        let bin_dir = dir("image-bin");
        let from = Path::new(support::BINARY).parent().expect("bin dir");
        for binary in ["sortie", "sortie-scripted-agent"] {
            std::fs::copy(from.join(binary), bin_dir.join(binary)).expect("copy binary");
        }
        let runtime = LocalRuntime::new(LocalConfig::new(dir("kubelet-state"))).expect("runtime");
        Arc::new(Cluster {
            apiserver,
            runtime,
            root: root.to_owned(),
            bin_dir,
            worker: Mutex::new(None),
            pods: Mutex::new(HashMap::new()),
            claims_seen: Mutex::new(Vec::new()),
            pod_names: Mutex::new(Vec::new()),
            warm: std::sync::atomic::AtomicUsize::new(usize::MAX),
            tokens: Mutex::new(Vec::new()),
            fault: Mutex::new(None),
        })
    }

    fn set_claim_status(&self, name: &str, status: Value) {
        let Some(mut claim) = self.apiserver.get(&key(CLAIMS, name)) else {
            return;
        };
        claim["status"] = status;
        self.apiserver.put(key(CLAIMS, name), claim);
    }

    /// The command the template's driver container runs, as the kubelet would run it here: the image's
    /// `sortie`, the link through the socket bound in, the token where this test writes it.
    fn pod_command(&self) -> Vec<String> {
        let template = self
            .apiserver
            .get(&key(TEMPLATES, POOL))
            .expect("the worker applied its template");
        let command: Vec<String> = template["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
            .as_array()
            .expect("command")
            .iter()
            .map(|arg| arg.as_str().unwrap_or_default().to_owned())
            .collect();
        let mut out = Vec::new();
        let mut args = command.into_iter();
        let program = args.next().expect("program");
        assert_eq!(program, "sortie");
        out.push(self.bin_dir.join("sortie").display().to_string());
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--link" => {
                    let _cluster_url = args.next();
                    out.push(arg);
                    out.push(format!("unix:{}/link.sock", inside::EGRESS_DIR));
                }
                "--identity-token-file" => {
                    let _projected = args.next();
                    out.push(arg);
                    out.push(format!("{}/identity-token", inside::EGRESS_DIR));
                }
                _ => out.push(arg),
            }
        }
        out
    }

    /// Hands a claim a warm pod as agent-sandbox does, and starts it.
    async fn hand_out(self: &Arc<Self>, claim: &Value) {
        let name = claim["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let claim_uid = claim["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        // A warm pool's pods have generated names: a claim made again gets another pod. They also name
        // the bwrap sandboxes (and their cgroups) on this host, which the tests running beside this one
        // must not share.
        let serial = POD_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sandbox = format!("{POOL}-{}-{serial}", std::process::id());
        self.pod_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(sandbox.clone());
        let owner = |kind: &str, name: &str, uid: &str, api: &str| json!([{"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": true}]);
        let made = self.apiserver.put(
            key(SANDBOXES, &sandbox),
            json!({"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
                   "metadata": {"ownerReferences": owner("SandboxClaim", &name, &claim_uid, "extensions.agents.x-k8s.io/v1beta1")},
                   "spec": {"podTemplate": {"spec": {"containers": []}}}}),
        );
        let sandbox_uid = made["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let pod = self.apiserver.put(
            key(PODS, &sandbox),
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"ownerReferences": owner("Sandbox", &sandbox, &sandbox_uid, "agents.x-k8s.io/v1beta1")},
                   "spec": {"containers": [{"name": "driver", "image": "sortie-sandbox:test"}]},
                   "status": {"phase": "Running", "podIP": "10.0.0.9"}}),
        );
        let pod_uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let token = self.apiserver.issue_token(
            NAMESPACE,
            "sortie-sandbox",
            &sandbox,
            &pod_uid,
            &[sortie_protocol::driver::LINK_AUDIENCE],
        );
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(token.clone());
        self.start_pod(&sandbox, &token).await;
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone(), sandbox.clone());
        self.set_claim_status(
            &name,
            json!({"sandbox": {"name": sandbox, "podIPs": ["10.0.0.9"]},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "DependenciesReady", "message": "",
                                   "lastTransitionTime": "2026-12-06T00:00:00Z"}]}),
        );
    }

    /// Runs the pod: a bubblewrap sandbox with an empty workspace and home, the link socket bound in.
    async fn start_pod(self: &Arc<Self>, name: &str, token: &str) {
        let dir = |sub: &str| {
            let path = self.root.join("pods").join(name).join(sub);
            std::fs::create_dir_all(&path).expect("dir");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            path
        };
        let (workspace, home, link_dir) = (dir("workspace"), dir("home"), dir("link"));
        // Read-only inside, beside the link socket, as a projected volume would be.
        let fault = self.fault.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let token = match &fault {
            Some(PodFault::Presents(other)) => other.as_str(),
            _ => token,
        };
        let token_file = link_dir.join("identity-token");
        std::fs::write(&token_file, token).expect("token");
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let socket = link_dir.join("link.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("link socket");
        self.runtime.grant_socket(&socket).expect("grant");
        // The cluster's network between the pod and the worker: the worker's Service name, which
        // leads to whichever process serves it now.
        let cluster = self.clone();
        tokio::spawn(async move {
            while let Ok((mut pod_side, _)) = listener.accept().await {
                let worker = cluster
                    .worker
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .expect("the worker's link address");
                tokio::spawn(async move {
                    if let Ok(mut worker_side) = tokio::net::TcpStream::connect(worker.as_str()).await {
                        let _ = tokio::io::copy_bidirectional(&mut pod_side, &mut worker_side).await;
                    }
                });
            }
        });
        let spec = SandboxSpec {
            name: name.to_owned(),
            workspace,
            home,
            egress_dir: Some(link_dir),
            read_only: vec![self.bin_dir.clone()],
            read_only_at: Vec::new(),
            late_binds: false,
            env: Vec::new(),
            command: match fault {
                Some(PodFault::Silent) => vec!["/bin/sh".into(), "-c".into(), "sleep 3600".into()],
                _ => self.pod_command(),
            },
            limits: Limits::default(),
            stdio: SandboxStdio::Null,
        };
        self.runtime.create(spec).await.expect("create the pod");
        self.runtime.start(name).await.expect("start the pod");
    }

    /// The controller ends the claim's sandbox: its shutdown time passed.
    async fn expire(&self, claim: &str) {
        let pod = self.pods.lock().unwrap_or_else(|p| p.into_inner()).get(claim).cloned();
        self.set_claim_status(
            claim,
            json!({"sandbox": {"name": pod},
                   "conditions": [{"type": "Ready", "status": "False", "reason": "ClaimExpired",
                                   "message": "the claim's shutdown time passed", "lastTransitionTime": "2026-12-06T00:00:00Z"}]}),
        );
    }

    /// The kernel kills the pod's container for its memory: the pod fails with `OOMKilled`, and the
    /// controller marks the claim's sandbox failed.
    async fn oom_kill(&self, claim: &str) {
        let pod = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(claim)
            .cloned()
            .expect("the claim's pod");
        let _ = self.runtime.destroy(&pod).await;
        let mut object = self.apiserver.get(&key(PODS, &pod)).expect("pod");
        object["status"] = json!({"phase": "Failed", "containerStatuses": [{
            "name": "driver", "image": "sortie-sandbox:test", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]});
        self.apiserver.put(key(PODS, &pod), object);
        self.set_claim_status(
            claim,
            json!({"sandbox": {"name": pod},
                   "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed",
                                   "message": "the sandbox's pod failed", "lastTransitionTime": "2026-12-06T00:00:00Z"}]}),
        );
    }

    async fn delete_pod(&self, claim: &str) {
        let pod = self.pods.lock().unwrap_or_else(|p| p.into_inner()).remove(claim);
        if let Some(pod) = pod {
            let _ = self.runtime.stop(&pod, Duration::from_secs(1)).await;
            let _ = self.runtime.destroy(&pod).await;
            self.apiserver.delete(&key(PODS, &pod));
            self.apiserver.delete(&key(SANDBOXES, &pod));
        }
    }

    async fn run(self: Arc<Self>) {
        let mut changes = self.apiserver.changes();
        while let Ok(change) = changes.recv().await {
            if change.key.collection != CLAIMS {
                continue;
            }
            match change.kind {
                ChangeKind::Added => {
                    self.claims_seen
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(change.object.clone());
                    let pool = change.object["spec"]["warmPoolRef"]["name"]
                        .as_str()
                        .unwrap_or_default();
                    if self.apiserver.get(&key(POOLS, pool)).is_none() {
                        self.set_claim_status(
                            &change.key.name,
                            json!({"conditions": [{"type": "Ready", "status": "False", "reason": "WarmPoolNotFound",
                                                   "message": format!("warm pool {pool} not found"),
                                                   "lastTransitionTime": "2026-12-06T00:00:00Z"}]}),
                        );
                        continue;
                    }
                    let warm = self
                        .warm
                        .fetch_update(
                            std::sync::atomic::Ordering::Relaxed,
                            std::sync::atomic::Ordering::Relaxed,
                            |left| left.checked_sub(1),
                        )
                        .is_ok();
                    if warm {
                        self.hand_out(&change.object).await;
                        continue;
                    }
                    // An empty pool: a cold pod from the template. While it is pending, the apiserver
                    // compacts its history, so the worker's watch of the claim gets 410 and lists again.
                    self.set_claim_status(
                        &change.key.name,
                        json!({"conditions": [{"type": "Ready", "status": "False", "reason": "SandboxCreatePending",
                                               "message": "creating a sandbox from the template",
                                               "lastTransitionTime": "2026-12-06T00:00:00Z"}]}),
                    );
                    self.apiserver.compact();
                    let cluster = self.clone();
                    let claim = change.object.clone();
                    tokio::spawn(async move {
                        // What a cold pod takes to schedule and start, much shortened.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        cluster.hand_out(&claim).await;
                    });
                }
                ChangeKind::Deleted => self.delete_pod(&change.key.name).await,
                ChangeKind::Modified => {}
            }
        }
    }

    /// Stops every process of the claim's pod (SIGSTOP): its driver answers nothing, as a pod on a
    /// node that stopped scheduling it, or a driver made to hang.
    fn freeze(&self, claim: &str) {
        let pod = self.pods.lock().unwrap_or_else(|p| p.into_inner()).get(claim).cloned();
        let root = pod.and_then(|pod| self.runtime.host_pid(&pod)).expect("the pod runs");
        let mut frozen = std::collections::HashSet::from([root]);
        // Descendants first found in any order: go round until nothing new is found.
        loop {
            let before = frozen.len();
            for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                    continue;
                };
                let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
                // `pid (comm) state ppid …`: the comm may hold spaces, so read after its last ')'.
                let parent = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|ppid| ppid.parse::<u32>().ok());
                if parent.is_some_and(|parent| frozen.contains(&parent)) {
                    frozen.insert(pid);
                }
            }
            if frozen.len() == before {
                break;
            }
        }
        for pid in frozen {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGSTOP,
            );
        }
    }

    async fn stop_all(&self) {
        let pods: Vec<String> = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, pod)| pod)
            .collect();
        for pod in pods {
            let _ = self.runtime.stop(&pod, Duration::from_secs(1)).await;
            let _ = self.runtime.destroy(&pod).await;
        }
    }
}

/// A `serve --runtime kubernetes` (every role) on the fake apiserver, with this test's cluster.
struct Fixture {
    apiserver: Arc<FakeApiserver>,
    cluster: Arc<Cluster>,
    world: World,
    /// The worker's link listener, which its pods reach.
    links: String,
    scratch: tempfile::TempDir,
}

impl Fixture {
    fn server(&self) -> &support::Server {
        self.world.server.as_ref().expect("server")
    }
}

async fn start(extra: &[&str]) -> Fixture {
    start_with_links(extra, "127.0.0.1:0").await
}

/// With the worker's link listener on `link_listen`.
async fn start_with_links(extra: &[&str], link_listen: &str) -> Fixture {
    let apiserver = Arc::new(FakeApiserver::start(WORKER_TOKEN).await);
    let scratch = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let cluster = Cluster::new(apiserver.clone(), scratch.path());
    tokio::spawn(cluster.clone().run());
    let kubeconfig = kubeconfig(scratch.path(), &apiserver.url());
    let kubeconfig = kubeconfig.display().to_string();
    let mut args = vec![
        "--runtime",
        "kubernetes",
        "--kube-namespace",
        NAMESPACE,
        "--sandbox-image",
        "sortie-sandbox:test",
        "--sandbox-pool",
        POOL,
        "--warm-pool",
        "2",
        "--link-listen",
        link_listen,
    ];
    args.extend_from_slice(extra);
    let world = World::start_with_env(&args, &[("KUBECONFIG", kubeconfig.as_str())], None);
    let links = announced_links(&world);
    *cluster.worker.lock().unwrap_or_else(|p| p.into_inner()) = Some(links.clone());
    Fixture {
        apiserver,
        cluster,
        world,
        links,
        scratch,
    }
}

/// Where the running server's worker serves its pods' links.
fn announced_links(world: &World) -> String {
    world
        .server
        .as_ref()
        .expect("server")
        .banner
        .iter()
        .find_map(|line| line.strip_prefix("sortie worker links on "))
        .expect("the worker announced its link listener")
        .trim_start_matches("http://")
        .to_owned()
}

fn failure_code(value: &Value) -> &str {
    value["failure"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_in_a_claimed_pod_that_clones_and_delivers_through_the_git_proxy() {
    // A session hibernates as soon as its turn ends, so its next turn takes a new pod. The agents are
    // the sandbox image's, as an operator declares them (this host's are not the pods').
    let fixture = start(&["--idle-grace", "0", "--agents-installed", "scripted,claude-code"]).await;
    let Fixture {
        apiserver,
        cluster,
        world,
        links,
        scratch,
    } = &fixture;
    // One warm pod: the second claim gets a cold one.
    cluster.warm.store(1, std::sync::atomic::Ordering::Relaxed);
    let server = fixture.server();

    // At start the worker applied its shape: pods that dial it back, with no credential but the
    // gateway-audience token, reaching nothing but its link port — by the cluster IP of the Service it
    // applied for itself, so they have no DNS either.
    let port: u16 = links
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("link port");
    let service = apiserver
        .get(&key(SERVICES, &format!("{POOL}-link")))
        .expect("the link Service");
    assert_eq!(service["spec"]["ports"][0]["port"], port);
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    assert_eq!(
        service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"],
        hostname.trim()
    );
    let cluster_ip = service["spec"]["clusterIP"].as_str().expect("cluster IP");
    let template = apiserver.get(&key(TEMPLATES, POOL)).expect("template");
    let command = template["spec"]["podTemplate"]["spec"]["containers"][0]["command"].to_string();
    assert!(
        command.contains(&format!("http://{cluster_ip}:{port}")) && command.contains("--egress-over-link"),
        "{command}"
    );
    let egress = &template["spec"]["networkPolicy"]["egress"];
    assert_eq!(egress.as_array().map(Vec::len), Some(1), "no DNS: {egress:#}");
    assert_eq!(egress[0]["ports"][0]["port"], port);
    // The link listener serves links and egress, nothing else of the worker.
    for path in ["/metrics", "/healthz", "/v1/feed"] {
        let answer = reqwest::get(format!("http://{links}{path}"))
            .await
            .expect("the link listener answers");
        assert_eq!(answer.status(), 404, "{path}");
    }
    let pool = apiserver.get(&key(POOLS, POOL)).expect("pool");
    assert_eq!(pool["spec"]["replicas"], 2);
    let (status, agents) = world.call(reqwest::Method::GET, "/v1/agents", None).await;
    assert_eq!(status, 200, "{agents}");
    let installed: Vec<&str> = agents["agents"]
        .as_array()
        .expect("agents")
        .iter()
        .filter(|agent| agent["installed"] == true)
        .filter_map(|agent| agent["id"].as_str())
        .collect();
    assert_eq!(installed, vec!["claude-code", "scripted"], "{agents:#}");
    let (status, refused) = world
        .call(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"repo": world.upstream, "task": "t", "agent": "codex"})),
        )
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (409, Some("AGENT_NOT_INSTALLED")),
        "{refused}"
    );

    let id = world
        .create(
            "#!scripted\nsay: hello from a pod\nwrite: POD.md\nwritten in a pod\n>>>\nrun: git -C /workspace log --oneline -1",
            json!({}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert!(
        ["idle", "hibernated"].contains(&session["phase"].as_str().unwrap_or_default()),
        "{session:#}\n{turns:#?}\n{}",
        server.log()
    );
    assert_eq!(turns[0]["status"], "completed", "{turns:#?}");
    // For the record (no target here): what a warm claim, the pod's clone and its first part took.
    eprintln!("kube_serve turn 1 timings (ms): {}", turns[0]["timings"]);
    assert!(world.assistant_said(&id, "hello from a pod").await);
    // Delivered through the git proxy, from the pod's own clone, onto the session's branch only.
    assert_eq!(world.files_on_branch(&id), vec!["POD.md".to_owned()]);
    assert_eq!(world.commits_on_branch(&id), 1);

    // The claim sortie posted: from the pool, labelled with the session, with a shutdown time, and
    // nothing that would force a cold pod (env, volumes, pod metadata).
    let claims = cluster.claims_seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(claims.len(), 1, "{claims:#?}");
    let claim = &claims[0];
    assert_eq!(claim["spec"]["warmPoolRef"]["name"], POOL);
    assert_eq!(claim["metadata"]["labels"]["sortie.dev/session"], id.as_str());
    assert!(claim["spec"]["lifecycle"]["shutdownTime"].is_string(), "{claim:#}");
    for forbidden in ["env", "volumeClaimTemplates", "additionalPodMetadata"] {
        assert!(claim["spec"].get(forbidden).is_none(), "{forbidden}: {claim:#}");
    }

    // Hibernation lets the claim go, and the pod with it.
    let claim_key = key(CLAIMS, claim["metadata"]["name"].as_str().expect("name"));
    world.wait(&id, 30, |session, _| session["phase"] == "hibernated").await;
    sortie_testkit::wait::eventually("the claim is let go", Duration::from_secs(30), || {
        let gone = apiserver.get(&claim_key).is_none();
        async move { if gone { Ok(()) } else { Err("the claim is still there") } }
    })
    .await;

    // The pod gave up its agent's home before it was let go.
    // The next turn claims a new pod (a cold one: the pool had one warm pod), which starts from what the
    // session delivered and gets the agent's home back: the agent loads its own session, so the prompt
    // reaches it as the user wrote it.
    let delivered = session["head_sha"].as_str().expect("delivered head").to_owned();
    world
        .steer(
            &id,
            "#!scripted\nrun: cat /workspace/POD.md\nwrite: SECOND.md\nfrom the second pod\n>>>\nsay: second",
            "queue",
        )
        .await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(
        turns[1]["status"],
        "completed",
        "{session:#}\n{turns:#?}\n{}",
        server.log()
    );
    assert_eq!(turns[1]["priming"], "session_load", "{turns:#?}");
    eprintln!("kube_serve turn 2 (cold pod) timings (ms): {}", turns[1]["timings"]);
    assert!(world.assistant_said(&id, "second").await);
    let claims = cluster.claims_seen.lock().unwrap_or_else(|p| p.into_inner()).len();
    assert_eq!(claims, 2, "the second turn had a pod of its own");
    // As the kubelet, this test looks into the second pod's volume: it was cloned at the delivered head.
    let second_pod = cluster.pod_names.lock().unwrap_or_else(|p| p.into_inner())[1].clone();
    let second = scratch.path().join("pods").join(second_pod).join("workspace");
    let first_commit = std::process::Command::new("git")
        .args(["-c", "safe.directory=*", "-C"])
        .arg(&second)
        .args(["rev-parse", "HEAD~1"])
        .output()
        .expect("git");
    assert_eq!(String::from_utf8_lossy(&first_commit.stdout).trim(), delivered);
    let mut files = world.files_on_branch(&id);
    files.sort();
    assert_eq!(files, vec!["POD.md".to_owned(), "SECOND.md".to_owned()]);
    assert_eq!(world.commits_on_branch(&id), 2);
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_killed_for_its_memory_ends_its_turn_saying_so() {
    let fixture = start(&[]).await;
    let world = &fixture.world;
    let id = world
        .create(
            "#!scripted
say: working
sleep: 60000
say: never",
            json!({}),
        )
        .await;
    world.wait_said(&id, "working").await;
    let claim = sortie_kube::runtime::claim_name(&sortie_protocol::SessionId::parse(&id).expect("id"));
    fixture.cluster.oom_kill(&claim).await;
    let (session, turns) = world.settled(&id, 1).await;
    // Lost, as a turn whose sandbox died under it is: its transcript up to then is kept.
    assert_eq!(turns[0]["status"], "lost", "{turns:#?}");
    assert_eq!(failure_code(&turns[0]), "SANDBOX_LOST", "{turns:#?}");
    let reason = turns[0]["failure"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("ran out of memory"),
        "{reason}\n{}",
        fixture.server().log()
    );
    assert_eq!(session["phase"], "failed", "{session:#}");
    assert!(!world.assistant_said(&id, "never").await);
    fixture.cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_cluster_cannot_meet_fails_the_turn_with_the_controllers_reason() {
    let fixture = start(&[]).await;
    // An operator deleted the worker's warm pool after it started.
    fixture.apiserver.delete(&key(POOLS, POOL));
    let id = fixture
        .world
        .create(
            "#!scripted
say: never",
            json!({}),
        )
        .await;
    let (session, turns) = fixture.world.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "failed", "{turns:#?}");
    assert_eq!(failure_code(&turns[0]), "SANDBOX_START_FAILED", "{turns:#?}");
    let reason = turns[0]["failure"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("WarmPoolNotFound"), "{reason}");
    assert_eq!(session["phase"], "failed", "{session:#}");
    // Nothing of it is left to the cluster: the claim that could not be met was let go.
    sortie_testkit::wait::eventually("the claim is let go", Duration::from_secs(30), || {
        let left = fixture.apiserver.list(CLAIMS, NAMESPACE).len();
        async move { if left == 0 { Ok(()) } else { Err(left) } }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_pod_whose_claim_expired_is_given_up_and_the_next_turn_gets_another() {
    let fixture = start(&[]).await;
    let world = &fixture.world;
    let id = world.create("#!scripted\nsay: first", json!({})).await;
    let (session, _) = world.settled(&id, 1).await;
    assert_eq!(session["phase"], "idle", "{session:#}");
    let claim = sortie_kube::runtime::claim_name(&sortie_protocol::SessionId::parse(&id).expect("id"));
    fixture.cluster.expire(&claim).await;
    world.wait(&id, 30, |session, _| session["phase"] == "hibernated").await;
    world.steer(&id, "#!scripted\nsay: second", "queue").await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(turns[1]["status"], "completed", "{session:#}\n{turns:#?}");
    assert_eq!(
        fixture
            .cluster
            .claims_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len(),
        2,
        "the second turn claimed a new pod"
    );
    fixture.cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_takes_up_its_pods_and_the_turn_running_in_one_goes_on() {
    // The worker's address stays what it was across the restart, as a StatefulSet pod's DNS name does
    // (its pods dial that name again): a port that was free a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let link_listen = format!("127.0.0.1:{port}");
    let mut fixture = start_with_links(&[], &link_listen).await;
    let id = fixture
        .world
        .create(
            "#!scripted\nsay: before\nsleep: 3000\nsay: after the restart",
            json!({}),
        )
        .await;
    fixture.world.wait_said(&id, "before").await;
    // The worker dies mid-turn; the claim and its pod live on, and the pod's driver dials again. It
    // had also just claimed a pod it never recorded; another worker's pool holds a claim too.
    fixture.world.kill_server();
    let stray = |pool: &str| {
        let session = sortie_protocol::SessionId::generate();
        let name = sortie_kube::runtime::claim_name(&session);
        fixture.apiserver.put(
            key(CLAIMS, &name),
            json!({"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxClaim",
                   "metadata": {"labels": {"sortie.dev/session": session.as_str()}},
                   "spec": {"warmPoolRef": {"name": pool}}}),
        );
        key(CLAIMS, &name)
    };
    let unrecorded = stray(POOL);
    let others = stray("another-workers-pool");
    fixture.world.restart_server();
    assert_eq!(announced_links(&fixture.world), link_listen);
    assert!(
        fixture.apiserver.get(&unrecorded).is_none(),
        "a claim of this worker's pool that no session holds is let go at start"
    );
    assert!(
        fixture.apiserver.get(&others).is_some(),
        "another worker's claim is its own"
    );
    let (session, turns) = fixture.world.settled(&id, 1).await;
    assert_eq!(
        turns[0]["status"],
        "completed",
        "{session:#}\n{turns:#?}\n{}",
        fixture.server().log()
    );
    assert!(fixture.world.assistant_said(&id, "after the restart").await);
    let claims_of_the_session = fixture
        .cluster
        .claims_seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|claim| claim["metadata"]["labels"]["sortie.dev/session"] == id.as_str())
        .count();
    assert_eq!(claims_of_the_session, 1, "the same pod went on");
    fixture.cluster.stop_all().await;
}

/// A pod's processes cannot be told apart from outside it, so what a turn leaves running there is not
/// killed as in a local sandbox (S12): instead the pod has no way out between turns. A process the turn
/// started in the background reaches the egress proxy while the turn runs and nothing once it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_turn_leaves_running_in_a_pod_has_no_way_out_after_it() {
    let fixture = start(&[]).await;
    let world = &fixture.world;
    let probe = "import time, urllib.request, urllib.error\n\
                 while True:\n\
                 \x20   try:\n\
                 \x20       urllib.request.urlopen('http://127.0.0.1:3128/_sortie/nothing', timeout=2)\n\
                 \x20       said = 'out'\n\
                 \x20   except urllib.error.HTTPError:\n\
                 \x20       said = 'out'\n\
                 \x20   except Exception:\n\
                 \x20       said = 'shut'\n\
                 \x20   open('/home/agent/probe.log', 'a').write(said + '\\n')\n\
                 \x20   time.sleep(0.1)\n";
    std::fs::write(fixture.scratch.path().join("image-bin").join("probe.py"), probe).expect("probe");
    let bin = fixture.scratch.path().join("image-bin").display().to_string();
    let id = world
        .create(
            &format!(
                "#!scripted\nrun: setsid python3 {bin}/probe.py > /dev/null 2>&1 < /dev/null &\nsleep: 1500\nsay: done"
            ),
            json!({}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{session:#}\n{turns:#?}");
    let pod = fixture.cluster.pod_names.lock().unwrap_or_else(|p| p.into_inner())[0].clone();
    let log = fixture
        .scratch
        .path()
        .join("pods")
        .join(pod)
        .join("home")
        .join("probe.log");
    let lines =
        sortie_testkit::wait::eventually("the probe is shut out after the turn", Duration::from_secs(30), || {
            let lines: Vec<String> = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect();
            async move {
                let ends_shut = lines.len() >= 3 && lines[lines.len() - 3..].iter().all(|l| l == "shut");
                if ends_shut { Ok(lines) } else { Err(lines.len()) }
            }
        })
        .await;
    assert!(
        lines.iter().any(|l| l == "out"),
        "it reached the proxy while the turn ran: {lines:?}"
    );
    fixture.cluster.stop_all().await;
}

/// A pod keeps nothing once let go. Each turn here resumes the session in a warm pod. What its delivery
/// could not push (a person moved the session's branch, so the push conflicts) is kept at the session's
/// WIP ref through the git proxy, recorded as the proxy saw the upstream take it; the session's next pod
/// starts with those files, and the delivery that lands takes them to the branch and lets the ref go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_a_pod_could_not_deliver_reaches_the_sessions_next_pod() {
    let fixture = start(&["--idle-grace", "0"]).await;
    let Fixture { apiserver, world, .. } = &fixture;
    let git = |args: &[&str]| sortie_testkit::git::git(&world.upstream, args);
    let id = world
        .create("#!scripted\nwrite: POD.md\nfirst\n>>>\nsay: one", json!({}))
        .await;
    let claim = key(
        CLAIMS,
        &sortie_kube::runtime::claim_name(&sortie_protocol::SessionId::parse(&id).expect("id")),
    );
    let let_go = || async {
        sortie_testkit::wait::eventually("the pod is let go", Duration::from_secs(30), || {
            let gone = apiserver.get(&claim).is_none();
            async move { if gone { Ok(()) } else { Err("the claim is still there") } }
        })
        .await
    };
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{turns:#?}");
    let delivered = session["head_sha"].as_str().expect("delivered").to_owned();
    let_go().await;

    // Someone pushes to the session's branch: the next delivery cannot land.
    let branch = format!("refs/heads/sortie/{id}");
    let theirs = git(&[
        "commit-tree",
        &format!("{delivered}^{{tree}}"),
        "-p",
        &delivered,
        "-m",
        "theirs",
    ]);
    git(&["update-ref", &branch, &theirs]);
    world
        .steer(
            &id,
            "#!scripted\nwrite: KEPT.md\nkept across pods\n>>>\nsay: two",
            "queue",
        )
        .await;
    let (_, turns) = world.settled(&id, 2).await;
    assert_eq!(failure_code(&turns[1]), "PUSH_CONFLICT", "{turns:#?}");
    // A warm claim resumed the session, and its agent loaded its own session from the kept home.
    assert_eq!(turns[1]["priming"], "session_load", "{turns:#?}");
    let wip = format!("refs/sortie/wip/{id}");
    let kept = git(&["rev-parse", &wip]);
    assert_eq!(git(&["show", &format!("{kept}:KEPT.md")]), "kept across pods");
    let_go().await;

    // They put the branch back. The next pod (a new claim) has the kept file, and delivers it.
    git(&["update-ref", &branch, &delivered]);
    world
        .steer(&id, "#!scripted\nrun: cat /workspace/KEPT.md\nsay: three", "queue")
        .await;
    let (session, turns) = world.settled(&id, 3).await;
    assert_eq!(
        turns[2]["status"],
        "completed",
        "{session:#}\n{turns:#?}\n{}",
        fixture.server().log()
    );
    assert_eq!(
        fixture
            .cluster
            .claims_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len(),
        3
    );
    let mut files = world.files_on_branch(&id);
    files.sort();
    assert_eq!(files, vec!["KEPT.md".to_owned(), "POD.md".to_owned()]);
    assert_eq!(git(&["for-each-ref", "refs/sortie"]), "", "the kept work's ref went");
    fixture.cluster.stop_all().await;
}

/// The acceptance's driver faults, through serve: a pod whose driver never dials, and one whose driver
/// presents the identity of another session's live pod (its token, as that pod's own agent could leak
/// it). Each fails only its own session, at the link deadline and saying why; the pod it impersonated
/// keeps its link, and its session goes on in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_driver_never_links_or_passes_for_another_fails_only_its_own_session() {
    let fixture = start(&["--sandbox-link-timeout", "3"]).await;
    let Fixture { cluster, world, .. } = &fixture;
    let first = world.create("#!scripted\nsay: first turn", json!({})).await;
    let (_, turns) = world.settled(&first, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{turns:#?}");
    let first_token = cluster.tokens.lock().unwrap_or_else(|p| p.into_inner())[0].clone();

    for (fault, what) in [
        (PodFault::Silent, "a driver that never dials"),
        (PodFault::Presents(first_token), "a driver with another pod's identity"),
    ] {
        *cluster.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(fault);
        let id = world.create("#!scripted\nsay: never", json!({})).await;
        let (session, turns) = world.settled(&id, 1).await;
        assert_eq!(failure_code(&turns[0]), "SANDBOX_START_FAILED", "{what}: {turns:#?}");
        let reason = turns[0]["failure"]["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("did not link"), "{what}: {reason}");
        assert_eq!(session["phase"], "failed", "{what}: {session:#}");
        assert!(!world.assistant_said(&id, "never").await, "{what}");
    }
    *cluster.fault.lock().unwrap_or_else(|p| p.into_inner()) = None;
    assert!(
        fixture
            .server()
            .log()
            .contains("a second link for a linked pod was refused"),
        "{}",
        fixture.server().log()
    );

    // The impersonated pod still answers its own session: the next turn runs in it (no new claim).
    let claims_before = cluster.claims_seen.lock().unwrap_or_else(|p| p.into_inner()).len();
    world.steer(&first, "#!scripted\nsay: still mine", "queue").await;
    let (session, turns) = world.settled(&first, 2).await;
    assert_eq!(turns[1]["status"], "completed", "{session:#}\n{turns:#?}");
    assert!(world.assistant_said(&first, "still mine").await);
    assert_eq!(
        cluster.claims_seen.lock().unwrap_or_else(|p| p.into_inner()).len(),
        claims_before,
        "the session kept its pod"
    );
    cluster.stop_all().await;
}

/// A pod's release at hibernation waits for its agent's home (up to a deadline); a pod that does not
/// answer must not hold up the other sessions meanwhile. Here one session's pod hangs as it hibernates,
/// and another session runs a whole turn before the hung pod is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_hangs_as_it_is_let_go_holds_up_no_other_session() {
    let fixture = start(&["--idle-grace", "1"]).await;
    let Fixture {
        apiserver,
        cluster,
        world,
        ..
    } = &fixture;
    let hung = world.create("#!scripted\nsay: first", json!({})).await;
    let (_, turns) = world.settled(&hung, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{turns:#?}");
    let claim = sortie_kube::runtime::claim_name(&sortie_protocol::SessionId::parse(&hung).expect("id"));
    cluster.freeze(&claim);
    world
        .wait(&hung, 30, |session, _| session["phase"] == "hibernated")
        .await;

    let other = world.create("#!scripted\nsay: not held up", json!({})).await;
    let (_, turns) = world.settled(&other, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{turns:#?}");
    assert!(
        apiserver.get(&key(CLAIMS, &claim)).is_some(),
        "the other session's turn ran while the hung pod was still being let go"
    );
    // The hung pod goes at its deadline, and the session's next pod starts without its home.
    sortie_testkit::wait::eventually("the hung pod is let go", Duration::from_secs(60), || {
        let gone = apiserver.get(&key(CLAIMS, &claim)).is_none();
        async move { if gone { Ok(()) } else { Err("the claim is still there") } }
    })
    .await;
    world.steer(&hung, "#!scripted\nsay: again", "queue").await;
    let (session, turns) = world.settled(&hung, 2).await;
    assert_eq!(turns[1]["status"], "completed", "{session:#}\n{turns:#?}");
    assert_ne!(turns[1]["priming"], "session_load", "{turns:#?}");
    cluster.stop_all().await;
}
