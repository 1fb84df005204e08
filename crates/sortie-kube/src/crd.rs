//! The agent-sandbox v1beta1 kinds sortie reads and writes (kubernetes-sigs/agent-sandbox; facts in
//! `docs/design/ref/agent-sandbox.md`), as much of each as sortie uses. Fields sortie must never set are
//! not here at all: a claim that carries `env` or volume claim templates forces a cold pod, so
//! [`SandboxClaimSpec`] cannot express them. Unknown fields of what the cluster answers are ignored.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::api::networking::v1::{NetworkPolicyEgressRule, NetworkPolicyIngressRule};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The label that names a claim's session. On the claim only: the claim controller refuses pod labels
/// outside the domains its operator allowlisted, and sortie needs none on the pod.
pub const SESSION_LABEL: &str = "sortie.dev/session";

/// A condition as agent-sandbox reports it (`metav1.Condition`), lenient about what is missing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct NameRef {
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimLifecycle {
    /// RFC 3339: the claim (and its sandbox) ends then, whatever sortie does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_time: Option<String>,
    /// `Delete`, `DeleteForeground` or `Retain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_policy: Option<String>,
}

/// A session's sandbox: a pod adopted from a warm pool (or made cold from its template).
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize)]
#[kube(
    group = "extensions.agents.x-k8s.io",
    version = "v1beta1",
    kind = "SandboxClaim",
    namespaced,
    status = "SandboxClaimStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaimSpec {
    pub warm_pool_ref: NameRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<ClaimLifecycle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_pod_metadata: Option<PodMetadata>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedSandboxRef {
    #[serde(default)]
    pub name: String,
    #[serde(default, rename = "podIPs", skip_serializing_if = "Vec::is_empty")]
    pub pod_ips: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaimStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<ClaimedSandboxRef>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// A sandbox: what a claim is handed (its pod has the sandbox's name and is controlled by it). Only its
/// metadata matters to sortie: who controls it.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize)]
#[kube(
    group = "agents.x-k8s.io",
    version = "v1beta1",
    kind = "Sandbox",
    namespaced,
    schema = "disabled"
)]
pub struct SandboxSpec {
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// The blueprint of a sandbox shape's pods.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize)]
#[kube(
    group = "extensions.agents.x-k8s.io",
    version = "v1beta1",
    kind = "SandboxTemplate",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateSpec {
    pub pod_template: PodTemplateSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<TemplateNetworkPolicy>,
    /// `Managed` (the controller makes the NetworkPolicy) or `Unmanaged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy_management: Option<String>,
    /// `Disallowed`, `Allowed` or `Overrides`: sortie says `Disallowed` (it never injects env).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_vars_injection_policy: Option<String>,
}

/// The template's network policy: an empty list denies; sortie always says what is allowed.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct TemplateNetworkPolicy {
    #[serde(default)]
    pub ingress: Vec<NetworkPolicyIngressRule>,
    #[serde(default)]
    pub egress: Vec<NetworkPolicyEgressRule>,
}

/// Ready pods of a template, waiting to be claimed.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize)]
#[kube(
    group = "extensions.agents.x-k8s.io",
    version = "v1beta1",
    kind = "SandboxWarmPool",
    namespaced,
    status = "SandboxWarmPoolStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxWarmPoolSpec {
    pub replicas: i32,
    pub sandbox_template_ref: NameRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_strategy: Option<WarmPoolUpdateStrategy>,
}

/// How a pool's ready pods follow a change of their template: `Recreate` (replaced at once) or
/// `OnReplenish` (the controller's default: only pods made later follow it).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct WarmPoolUpdateStrategy {
    #[serde(rename = "type")]
    pub type_: String,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxWarmPoolStatus {
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
}
