//! The Kubernetes sandbox runtime (DESIGN §15) on kubernetes-sigs/agent-sandbox: per sandbox shape one
//! `SandboxTemplate` and one `SandboxWarmPool` ([`shape`]), a session's sandbox a `SandboxClaim` from that
//! pool ([`runtime`]), what its conditions mean ([`status`], pure), and the pod's driver bound to the
//! session only through what the cluster says: the sandbox the claim controls, the pod that sandbox
//! controls, and the driver link whose identity token the apiserver says belongs to that pod.
//!
//! It must never put `env` or volumes in a claim (either forces a cold pod), never bind a link to a
//! session on the driver's word, and never wait on the cluster without a deadline.

pub mod crd;
pub mod identity;
pub mod runtime;
pub mod settings;
pub mod shape;
pub mod status;
