//! A sandbox shape's `SandboxTemplate` and `SandboxWarmPool` (pure builders). The pods are generic — no
//! session, key or repository in them — so every claim can take a warm one: the driver dials the
//! gateway with a projected service-account token for audience `sortie-gateway` (no other credential is
//! mounted), runs as an unprivileged user with nothing to escalate to, and the template's network policy
//! lets it reach the worker's link port, nothing else: the driver dials an address, not a name, so the
//! pod has no DNS to tunnel through (a name in `--link-url` brings the cluster's DNS back for it). The
//! address is the cluster IP of the worker's own link Service ([`link_service`]), which outlives the
//! worker's pod, so pods claimed before a restart find the worker again.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, SecurityContext, Service, ServiceAccountTokenProjection, ServicePort,
    ServiceSpec, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::api::networking::v1::{NetworkPolicyEgressRule, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sortie_protocol::driver::LINK_AUDIENCE;

use crate::crd::{
    NameRef, SandboxTemplate, SandboxTemplateSpec, SandboxWarmPool, SandboxWarmPoolSpec, TemplateNetworkPolicy,
    WarmPoolUpdateStrategy,
};

/// Where the pod's identity token is mounted.
pub const TOKEN_DIR: &str = "/var/run/secrets/sortie";
/// How long a projected identity token lives before the kubelet rotates it.
const TOKEN_SECONDS: i64 = 3600;
/// The uid of the agent and the driver in the pod (as in the local sandbox).
const SANDBOX_UID: i64 = 1000;

/// One kind of sandbox pod: its image, isolation and limits, and the pool kept warm.
#[derive(Clone, Debug)]
pub struct SandboxShape {
    /// Names the template and the pool.
    pub name: String,
    /// An image holding the `sortie` binary and the agents (`deploy/sandbox/Containerfile`).
    pub image: String,
    /// `gvisor`, `kata`, …; `None`: the cluster's default (runc).
    pub runtime_class: Option<String>,
    pub cpu: String,
    pub memory: String,
    pub ephemeral_storage: String,
    /// Pods kept ready to claim (an autoscaler may change it through `/scale`).
    pub replicas: i32,
    /// The service account the pods run as; its tokens are what the gateway accepts.
    pub service_account: String,
    /// Where the driver dials, `http://<address>:<port>` (or a name the cluster's DNS resolves).
    pub gateway_url: String,
    /// The labels of the gateway's pods and the port they serve links on, for the network policy.
    pub gateway_pods: BTreeMap<String, String>,
    pub gateway_port: i32,
}

/// Whether `url` (`http://host:port/…`) names its host by address, so the pod needs no DNS.
pub fn dials_an_address(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        // User info: whatever follows is no plain address, so the pods keep their DNS.
        return false;
    }
    let host = match authority.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(host, _)| host),
    };
    host.parse::<std::net::IpAddr>().is_ok()
}

/// The labels that mark a Service as a worker's link Service (a worker patches no other).
pub fn link_service_labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "sortie".to_owned()),
        ("app.kubernetes.io/component".to_owned(), "worker-link".to_owned()),
    ])
}

/// The name of the link Service of the worker whose pool is `pool`.
pub fn link_service_name(pool: &str) -> String {
    format!("{pool}-link")
}

/// The Service a worker's pods dial it through: a cluster IP in front of the worker's own pod (a
/// worker's, by the pod-name label a StatefulSet sets), on its link port, ready or not (the worker's
/// readiness is its feed's, and a pod's link must not wait on it).
pub fn link_service(pool: &str, worker_pod: &str, port: i32) -> Service {
    let mut selector = crate::settings::worker_pod_labels();
    selector.insert("statefulset.kubernetes.io/pod-name".to_owned(), worker_pod.to_owned());
    Service {
        metadata: ObjectMeta {
            name: Some(link_service_name(pool)),
            labels: Some(link_service_labels()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("link".into()),
                port,
                target_port: Some(IntOrString::Int(port)),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn labels(shape: &SandboxShape) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "sortie-sandbox".to_owned()),
        ("sortie.dev/shape".to_owned(), shape.name.clone()),
    ])
}

fn quantity(text: &str) -> Quantity {
    Quantity(text.to_owned())
}

fn pod_spec(shape: &SandboxShape) -> PodSpec {
    let limits = BTreeMap::from([
        ("cpu".to_owned(), quantity(&shape.cpu)),
        ("memory".to_owned(), quantity(&shape.memory)),
        ("ephemeral-storage".to_owned(), quantity(&shape.ephemeral_storage)),
    ]);
    let driver = Container {
        name: "driver".into(),
        image: Some(shape.image.clone()),
        command: Some(
            [
                "sortie",
                "driver",
                "--link",
                &shape.gateway_url,
                "--identity-token-file",
                &format!("{TOKEN_DIR}/token"),
                "--workspace",
                "/workspace",
                "--home",
                "/home/agent",
                // The session, its agent and its branch come over the link once the pod is claimed.
                "--await-assignment",
                // The pod's only way out: its session's egress proxy, at the gateway it links to.
                "--egress-over-link",
            ]
            .map(str::to_owned)
            .to_vec(),
        ),
        resources: Some(ResourceRequirements {
            limits: Some(limits.clone()),
            requests: Some(limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(SANDBOX_UID),
            run_as_group: Some(SANDBOX_UID),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![
            mount("identity", TOKEN_DIR, true),
            mount("workspace", "/workspace", false),
            mount("home", "/home/agent", false),
            mount("tmp", "/tmp", false),
        ]),
        ..Container::default()
    };
    PodSpec {
        containers: vec![driver],
        service_account_name: Some(shape.service_account.clone()),
        // The API credential of the service account stays out: only the gateway-audience token is in.
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        runtime_class_name: shape.runtime_class.clone(),
        restart_policy: Some("Never".into()),
        security_context: Some(PodSecurityContext {
            fs_group: Some(SANDBOX_UID),
            ..PodSecurityContext::default()
        }),
        volumes: Some(vec![
            Volume {
                name: "identity".into(),
                projected: Some(ProjectedVolumeSource {
                    sources: Some(vec![VolumeProjection {
                        service_account_token: Some(ServiceAccountTokenProjection {
                            audience: Some(LINK_AUDIENCE.into()),
                            expiration_seconds: Some(TOKEN_SECONDS),
                            path: "token".into(),
                        }),
                        ..VolumeProjection::default()
                    }]),
                    ..ProjectedVolumeSource::default()
                }),
                ..Volume::default()
            },
            empty_dir("workspace"),
            empty_dir("home"),
            empty_dir("tmp"),
        ]),
        ..PodSpec::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

fn empty_dir(name: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// Egress to the gateway's pods on its link port (and to the cluster's DNS only when the pods dial a
/// name); no ingress at all.
fn network_policy(shape: &SandboxShape) -> TemplateNetworkPolicy {
    let port = |number: i32, protocol: &str| NetworkPolicyPort {
        port: Some(IntOrString::Int(number)),
        protocol: Some(protocol.into()),
        ..NetworkPolicyPort::default()
    };
    let gateway = NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            pod_selector: Some(LabelSelector {
                match_labels: Some(shape.gateway_pods.clone()),
                ..LabelSelector::default()
            }),
            ..NetworkPolicyPeer::default()
        }]),
        ports: Some(vec![port(shape.gateway_port, "TCP")]),
    };
    let dns = NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            namespace_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    "kubernetes.io/metadata.name".to_owned(),
                    "kube-system".to_owned(),
                )])),
                ..LabelSelector::default()
            }),
            pod_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([("k8s-app".to_owned(), "kube-dns".to_owned())])),
                ..LabelSelector::default()
            }),
            ..NetworkPolicyPeer::default()
        }]),
        ports: Some(vec![port(53, "UDP"), port(53, "TCP")]),
    };
    let mut egress = vec![gateway];
    if !dials_an_address(&shape.gateway_url) {
        egress.push(dns);
    }
    TemplateNetworkPolicy {
        ingress: Vec::new(),
        egress,
    }
}

/// The shape's template.
pub fn template(shape: &SandboxShape) -> SandboxTemplate {
    let mut template = SandboxTemplate::new(
        &shape.name,
        SandboxTemplateSpec {
            pod_template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(shape)),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod_spec(shape)),
            },
            network_policy: Some(network_policy(shape)),
            network_policy_management: Some("Managed".into()),
            env_vars_injection_policy: Some("Disallowed".into()),
        },
    );
    template.metadata.labels = Some(labels(shape));
    template
}

/// The shape's warm pool.
pub fn warm_pool(shape: &SandboxShape) -> SandboxWarmPool {
    let mut pool = SandboxWarmPool::new(
        &shape.name,
        SandboxWarmPoolSpec {
            replicas: shape.replicas,
            sandbox_template_ref: NameRef {
                name: shape.name.clone(),
            },
            // A new image (a fixed agent, a security patch) reaches the next session, not after the
            // pods made with the old one were all claimed first.
            update_strategy: Some(WarmPoolUpdateStrategy {
                type_: "Recreate".into(),
            }),
        },
    );
    pool.metadata.labels = Some(labels(shape));
    pool
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn shape() -> SandboxShape {
        SandboxShape {
            name: "claude-small".into(),
            image: "registry.example.org/sortie/sandbox:1".into(),
            runtime_class: Some("gvisor".into()),
            cpu: "2".into(),
            memory: "2Gi".into(),
            ephemeral_storage: "10Gi".into(),
            replicas: 3,
            service_account: "sandbox".into(),
            gateway_url: "http://sortie-gateway.sortie.svc:7700".into(),
            gateway_pods: BTreeMap::from([("app.kubernetes.io/component".into(), "gateway".into())]),
            gateway_port: 7700,
        }
    }

    #[test]
    fn a_template_holds_no_credential_and_reaches_only_the_gateway() {
        let json = serde_json::to_value(template(&shape())).expect("json");
        let spec = &json["spec"]["podTemplate"]["spec"];
        assert_eq!(json["apiVersion"], "extensions.agents.x-k8s.io/v1beta1");
        assert_eq!(json["kind"], "SandboxTemplate");
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["runtimeClassName"], "gvisor");
        let container = &spec["containers"][0];
        assert!(
            container.get("env").is_none() && container.get("envFrom").is_none(),
            "{container:#}"
        );
        assert_eq!(container["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(container["securityContext"]["capabilities"]["drop"][0], "ALL");
        let token = &spec["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"];
        assert_eq!(token["audience"], LINK_AUDIENCE);
        let command = container["command"].to_string();
        assert!(
            command.contains("--identity-token-file")
                && command.contains("--await-assignment")
                && command.contains("--egress-over-link"),
            "{container:#}"
        );
        assert!(
            !command.contains("--agent"),
            "a generic pod runs no agent before its assignment"
        );
        let policy = &json["spec"]["networkPolicy"];
        assert_eq!(policy["ingress"], serde_json::json!([]));
        assert_eq!(policy["egress"].as_array().map(Vec::len), Some(2), "a name needs DNS");
        assert_eq!(policy["egress"][0]["ports"][0]["port"], 7700);
        assert_eq!(json["spec"]["envVarsInjectionPolicy"], "Disallowed");
        let pool = serde_json::to_value(warm_pool(&shape())).expect("json");
        assert_eq!(pool["spec"]["replicas"], 3);
        assert_eq!(pool["spec"]["sandboxTemplateRef"]["name"], "claude-small");
        assert_eq!(pool["spec"]["updateStrategy"]["type"], "Recreate");
    }

    #[test]
    fn pods_that_dial_an_address_get_no_dns() {
        let mut by_address = shape();
        by_address.gateway_url = "http://10.96.3.7:7072".into();
        let json = serde_json::to_value(template(&by_address)).expect("json");
        let egress = &json["spec"]["networkPolicy"]["egress"];
        assert_eq!(egress.as_array().map(Vec::len), Some(1), "{egress:#}");
        assert_eq!(
            egress[0]["ports"],
            serde_json::json!([{"port": 7700, "protocol": "TCP"}])
        );
        for (url, address) in [
            ("http://10.96.3.7:7072", true),
            ("http://[fd00::7]:7072", true),
            ("http://10.96.3.7", true),
            ("http://sortie-worker-0.sortie-worker.sortie.svc:7071", false),
            ("http://localhost:7072", false),
            ("http://1.2.3.4:80@name:7072", false),
            ("http://u@10.0.0.1:7072", false),
        ] {
            assert_eq!(dials_an_address(url), address, "{url}");
        }
        let service = serde_json::to_value(link_service("sortie-w0", "sortie-worker-0", 7072)).expect("json");
        assert_eq!(service["metadata"]["name"], "sortie-w0-link");
        assert_eq!(service["spec"]["selector"]["app.kubernetes.io/component"], "worker");
        assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
        assert_eq!(
            service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"],
            "sortie-worker-0"
        );
        assert_eq!(service["spec"]["ports"][0]["targetPort"], 7072);
        assert_eq!(service["spec"]["type"], "ClusterIP");
    }
}
