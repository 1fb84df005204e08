//! `sortie serve --runtime kubernetes`: the worker's settings for sandboxes as agent-sandbox pods, and
//! [`KubeSettings::connect`], which reaches the cluster (kubeconfig or in-cluster), applies this
//! worker's sandbox shape (template and warm pool) and returns what the worker and its feed listener
//! need: the pods, their links and the identity check of their drivers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sortie_gateway::links::{CachedIdentity, DriverLinks, EgressBindings, LinkState};
use sortie_worker::pods::Pods;

use crate::identity::ClusterIdentity;
use crate::runtime::{Deadlines, KubeSandboxes};
use crate::shape::SandboxShape;

/// Where a worker's sandboxes run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeKind {
    /// bubblewrap sandboxes on this host.
    #[default]
    Local,
    /// Pods claimed from agent-sandbox warm pools on a Kubernetes cluster.
    Kubernetes,
}

/// The labels of the worker's pods in `deploy/`: the sandboxes' network policy lets their pods reach
/// these, on the worker's feed port, and nothing else but DNS.
pub fn worker_pod_labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "sortie".to_owned()),
        ("app.kubernetes.io/component".to_owned(), "worker".to_owned()),
    ])
}

/// The worker's Kubernetes settings (flags and environment).
#[derive(Clone, Debug, clap::Args)]
pub struct KubeSettings {
    /// Where sandboxes run: `local` (bubblewrap on this host, as root) or `kubernetes` (agent-sandbox
    /// claims, whose pods dial back to --link-listen).
    #[arg(long, env = "SORTIE_RUNTIME", value_enum, default_value_t = RuntimeKind::Local)]
    pub runtime: RuntimeKind,
    /// Where this worker serves its sandbox pods' links and egress (`kubernetes` only): nothing else
    /// is served there, and the pods reach nothing else of it.
    #[arg(long, env = "SORTIE_LINK_LISTEN", default_value = "0.0.0.0:7072")]
    pub link_listen: std::net::SocketAddr,
    /// The `http://host:port` the pods dial; default: the cluster IP of a Service the worker applies
    /// for itself (`<pool>-link`, selecting its StatefulSet pod), so the pods need no DNS.
    #[arg(long, env = "SORTIE_LINK_URL")]
    pub link_url: Option<String>,
    /// The namespace of the claims, templates and pools; default: the kubeconfig's or the pod's own.
    #[arg(long, env = "SORTIE_KUBE_NAMESPACE")]
    pub kube_namespace: Option<String>,
    /// The sandbox pods' image: the `sortie` binary and the agents (`deploy/sandbox/Containerfile`).
    #[arg(long, env = "SORTIE_SANDBOX_IMAGE")]
    pub sandbox_image: Option<String>,
    /// The pods' RuntimeClass (`gvisor`, `kata`, …); default the cluster's.
    #[arg(long, env = "SORTIE_SANDBOX_RUNTIME_CLASS")]
    pub sandbox_runtime_class: Option<String>,
    /// Pods this worker keeps ready to claim.
    #[arg(long, env = "SORTIE_WARM_POOL", default_value_t = 2)]
    pub warm_pool: i32,
    /// The name of this worker's template and warm pool; default `sortie-<hostname>` (a StatefulSet's
    /// pod name is stable, so a restarted worker finds its pool again).
    #[arg(long, env = "SORTIE_SANDBOX_POOL")]
    pub sandbox_pool: Option<String>,
    /// The service account the sandbox pods run as; only its tokens link.
    #[arg(long, env = "SORTIE_SANDBOX_SERVICE_ACCOUNT", default_value = "sortie-sandbox")]
    pub sandbox_service_account: String,
    #[arg(long, env = "SORTIE_SANDBOX_CPU", default_value = "2")]
    pub sandbox_cpu: String,
    #[arg(long, env = "SORTIE_SANDBOX_MEMORY", default_value = "2Gi")]
    pub sandbox_memory: String,
    #[arg(long, env = "SORTIE_SANDBOX_EPHEMERAL_STORAGE", default_value = "10Gi")]
    pub sandbox_ephemeral_storage: String,
    /// Seconds a claim may take to be ready (a cold pod pulls its image).
    #[arg(long, env = "SORTIE_SANDBOX_READY_TIMEOUT", default_value_t = 120)]
    pub sandbox_ready_timeout: u64,
    /// Seconds a ready pod's driver may take to link (its process starts and dials the worker).
    #[arg(long, env = "SORTIE_SANDBOX_LINK_TIMEOUT", default_value_t = 30)]
    pub sandbox_link_timeout: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeSettingsError {
    #[error("{0}")]
    Refused(String),
    #[error("cannot reach the cluster: {0}")]
    Cluster(String),
}

/// What `--runtime kubernetes` gives the worker and its link listener.
pub struct KubeRuntime {
    pub pods: Arc<Pods>,
    /// The link and egress routes (`sortie_gateway::links::link_router`) the link listener serves.
    pub links: LinkState,
    pub namespace: String,
    pub pool: String,
    /// Where the pods dial.
    pub link_url: String,
}

/// This host's name (a StatefulSet pod's is its pod name).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// `sortie-<hostname>`, made a DNS label.
fn default_pool_name() -> String {
    let cleaned: String = hostname()
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let name = format!("sortie-{}", cleaned.trim_matches('-'));
    name.chars()
        .take(52)
        .collect::<String>()
        .trim_end_matches('-')
        .to_owned()
}

impl KubeSettings {
    pub fn is_kubernetes(&self) -> bool {
        self.runtime == RuntimeKind::Kubernetes
    }

    /// Reaches the cluster, applies this worker's shape (its pods dial the worker's link listener, bound
    /// on `link_port`: at `--link-url`, or through the worker's own link Service), and returns the pods.
    pub async fn connect(&self, link_port: u16) -> Result<KubeRuntime, KubeSettingsError> {
        let image = self
            .sandbox_image
            .clone()
            .filter(|image| !image.is_empty())
            .ok_or_else(|| {
                KubeSettingsError::Refused(
                    "--runtime kubernetes needs --sandbox-image (SORTIE_SANDBOX_IMAGE): the sandbox pods' image".into(),
                )
            })?;
        let config = kube::Config::infer()
            .await
            .map_err(|e| KubeSettingsError::Cluster(e.to_string()))?;
        let namespace = self
            .kube_namespace
            .clone()
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(|e| KubeSettingsError::Cluster(e.to_string()))?;
        let pool = self
            .sandbox_pool
            .clone()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(default_pool_name);
        let link_url = match self.link_url.clone().filter(|url| !url.is_empty()) {
            Some(url) => url,
            None => link_service_url(&client, &namespace, &pool, link_port).await?,
        };
        let shape = SandboxShape {
            name: pool.clone(),
            image,
            runtime_class: self.sandbox_runtime_class.clone().filter(|c| !c.is_empty()),
            cpu: self.sandbox_cpu.clone(),
            memory: self.sandbox_memory.clone(),
            ephemeral_storage: self.sandbox_ephemeral_storage.clone(),
            replicas: self.warm_pool.max(0),
            service_account: self.sandbox_service_account.clone(),
            gateway_url: link_url.clone(),
            gateway_pods: worker_pod_labels(),
            gateway_port: i32::from(link_port),
        };
        let links = DriverLinks::new();
        let deadlines = Deadlines {
            ready: Duration::from_secs(self.sandbox_ready_timeout.max(1)),
            link: Duration::from_secs(self.sandbox_link_timeout.max(1)),
            ..Deadlines::default()
        };
        let sandboxes = Arc::new(KubeSandboxes::new(
            client.clone(),
            &namespace,
            &pool,
            links.clone(),
            deadlines,
        ));
        sandboxes.reconcile(&shape).await.map_err(|e| {
            KubeSettingsError::Cluster(format!(
                "cannot apply the sandbox template and warm pool {pool} in namespace {namespace} (is agent-sandbox \
                 installed, and may this worker's service account manage them?): {e}"
            ))
        })?;
        let identity = ClusterIdentity::new(client, &namespace, &self.sandbox_service_account);
        let egress = EgressBindings::new();
        let pods = Pods::new(sandboxes, links.clone(), egress.clone());
        Ok(KubeRuntime {
            pods,
            links: LinkState {
                links,
                identity: Arc::new(CachedIdentity::new(Arc::new(identity))),
                egress,
            },
            namespace,
            pool,
            link_url,
        })
    }
}

/// Applies the worker's link Service and returns the URL of its cluster IP (which the apiserver
/// assigns at creation and keeps for the Service's life).
async fn link_service_url(
    client: &kube::Client,
    namespace: &str,
    pool: &str,
    port: u16,
) -> Result<String, KubeSettingsError> {
    let pod = hostname();
    let services: kube::Api<k8s_openapi::api::core::v1::Service> = kube::Api::namespaced(client.clone(), namespace);
    let name = crate::shape::link_service_name(pool);
    // A Service of that name that is not a worker's link Service (an operator's) is not taken over.
    let existing = services
        .get_opt(&name)
        .await
        .map_err(|e| KubeSettingsError::Cluster(format!("cannot read Service {name}: {e}")))?;
    if let Some(existing) = existing {
        let labels = existing.metadata.labels.unwrap_or_default();
        if crate::shape::link_service_labels()
            .iter()
            .any(|(key, value)| labels.get(key) != Some(value))
        {
            return Err(KubeSettingsError::Refused(format!(
                "Service {name} in namespace {namespace} exists and is not a sortie worker's link Service; name the \
                 pool otherwise (--sandbox-pool) or give --link-url"
            )));
        }
    }
    let applied = services
        .patch(
            &name,
            &kube::api::PatchParams::apply("sortie").force(),
            &kube::api::Patch::Apply(crate::shape::link_service(pool, &pod, i32::from(port))),
        )
        .await
        .map_err(|e| {
            KubeSettingsError::Cluster(format!(
                "cannot apply the link Service {name} in namespace {namespace} (may this worker's service account \
                 manage services? or give --link-url): {e}"
            ))
        })?;
    let address = applied
        .spec
        .and_then(|spec| spec.cluster_ip)
        .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
        .ok_or_else(|| {
            KubeSettingsError::Cluster(format!(
                "the link Service {name} has no cluster IP; give --link-url instead"
            ))
        })?;
    Ok(format!("http://{}", std::net::SocketAddr::new(address, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pool_is_a_dns_label() {
        let name = default_pool_name();
        assert!(name.starts_with("sortie-") && name.len() <= 52, "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{name}"
        );
        assert!(!name.ends_with('-'), "{name}");
    }
}
