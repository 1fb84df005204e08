//! What a claim's conditions mean for a session (pure): still coming, ready, or failed with which of
//! sortie's failure codes. agent-sandbox's condition reasons are stable API; the reason text goes into
//! the failure as the cluster wrote it.

use sortie_protocol::FailureCode;

use crate::crd::{Condition, SandboxClaimStatus};

/// Where a claim is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimState {
    /// Not ready yet; the reason says why (an empty pool makes a cold pod: `SandboxCreatePending`).
    Pending { reason: String, message: String },
    /// Its sandbox is up.
    Ready { sandbox: String },
    /// It will not become ready, or its sandbox ended.
    Failed { code: FailureCode, reason: String },
}

/// Reasons after which the claim will never be ready: the operator's configuration is wrong.
const MISCONFIGURED: &[&str] = &[
    "TemplateNotFound",
    "WarmPoolNotFound",
    "InvalidMetadata",
    "EnvVarsInjectionRejected",
    "VolumeClaimTemplatesError",
];

/// Reasons for a sandbox that existed and is gone or going.
const ENDED: &[&str] = &[
    "ClaimExpired",
    "SandboxExpired",
    "SandboxMissing",
    "SandboxSuspended",
    "PodFailed",
    "PodSucceeded",
];

fn ready(status: &SandboxClaimStatus) -> Option<&Condition> {
    status.conditions.iter().find(|c| c.type_ == "Ready")
}

fn described(condition: &Condition) -> String {
    if condition.message.is_empty() {
        condition.reason.clone()
    } else {
        format!("{}: {}", condition.reason, condition.message)
    }
}

/// The state of a claim with `status` (`None`: the controller has not looked at it yet).
pub fn claim_state(status: Option<&SandboxClaimStatus>) -> ClaimState {
    let pending = |reason: &str, message: &str| ClaimState::Pending {
        reason: reason.to_owned(),
        message: message.to_owned(),
    };
    let Some(status) = status else {
        return pending("", "the claim controller has not seen the claim yet");
    };
    let Some(condition) = ready(status) else {
        return pending("", "the claim has no Ready condition yet");
    };
    match condition.status.as_str() {
        "True" => match status.sandbox.as_ref().filter(|s| !s.name.is_empty()) {
            Some(sandbox) => ClaimState::Ready {
                sandbox: sandbox.name.clone(),
            },
            // Ready without a sandbox to go to is not ready for sortie.
            None => pending(&condition.reason, "ready, but names no sandbox yet"),
        },
        "False" if MISCONFIGURED.contains(&condition.reason.as_str()) => ClaimState::Failed {
            code: FailureCode::SandboxStartFailed,
            reason: format!("the sandbox claim cannot be met ({})", described(condition)),
        },
        "False" if ENDED.contains(&condition.reason.as_str()) => ClaimState::Failed {
            code: FailureCode::SandboxLost,
            reason: format!("the sandbox ended ({})", described(condition)),
        },
        // AdoptionConflict, SandboxCreatePending, SandboxNotReady, DependenciesNotReady,
        // ReconcilerError, and reasons of a newer controller: still coming.
        _ => pending(&condition.reason, &condition.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ClaimedSandboxRef;

    fn status(ready: &str, reason: &str, sandbox: Option<&str>) -> SandboxClaimStatus {
        SandboxClaimStatus {
            sandbox: sandbox.map(|name| ClaimedSandboxRef {
                name: name.into(),
                pod_ips: vec!["10.0.0.9".into()],
            }),
            conditions: vec![
                Condition {
                    type_: "Finished".into(),
                    status: "False".into(),
                    ..Condition::default()
                },
                Condition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    reason: reason.into(),
                    message: "the controller's words".into(),
                    last_transition_time: None,
                },
            ],
        }
    }

    #[test]
    fn every_documented_reason_maps_to_a_state() {
        use FailureCode::{SandboxLost, SandboxStartFailed};
        // (Ready's status, its reason, the claim's sandbox, what it means)
        type Row = (
            &'static str,
            &'static str,
            Option<&'static str>,
            Result<&'static str, FailureCode>,
        );
        let table: &[Row] = &[
            ("True", "DependenciesReady", Some("pool-abc"), Ok("ready")),
            ("True", "DependenciesReady", None, Ok("pending")),
            ("False", "SandboxCreatePending", None, Ok("pending")),
            ("False", "AdoptionConflict", None, Ok("pending")),
            ("False", "SandboxNotReady", Some("pool-abc"), Ok("pending")),
            ("False", "DependenciesNotReady", Some("pool-abc"), Ok("pending")),
            ("False", "ReconcilerError", None, Ok("pending")),
            ("Unknown", "", None, Ok("pending")),
            ("False", "SomethingNewer", None, Ok("pending")),
            ("False", "TemplateNotFound", None, Err(SandboxStartFailed)),
            ("False", "WarmPoolNotFound", None, Err(SandboxStartFailed)),
            ("False", "InvalidMetadata", None, Err(SandboxStartFailed)),
            ("False", "EnvVarsInjectionRejected", None, Err(SandboxStartFailed)),
            ("False", "VolumeClaimTemplatesError", None, Err(SandboxStartFailed)),
            ("False", "ClaimExpired", Some("pool-abc"), Err(SandboxLost)),
            ("False", "SandboxExpired", Some("pool-abc"), Err(SandboxLost)),
            ("False", "SandboxMissing", Some("pool-abc"), Err(SandboxLost)),
            ("False", "SandboxSuspended", Some("pool-abc"), Err(SandboxLost)),
            ("False", "PodFailed", Some("pool-abc"), Err(SandboxLost)),
            ("False", "PodSucceeded", Some("pool-abc"), Err(SandboxLost)),
        ];
        for (ready, reason, sandbox, expected) in table {
            let state = claim_state(Some(&status(ready, reason, *sandbox)));
            match (expected, &state) {
                (Ok("ready"), ClaimState::Ready { sandbox }) => assert_eq!(sandbox, "pool-abc"),
                (Ok("pending"), ClaimState::Pending { .. }) => {}
                (Err(code), ClaimState::Failed { code: got, reason: why }) => {
                    assert_eq!(code, got, "{reason}");
                    assert!(why.contains(reason) && why.contains("the controller's words"), "{why}");
                }
                _ => panic!("{ready} {reason} {sandbox:?}: {state:?}, expected {expected:?}"),
            }
        }
        assert!(matches!(claim_state(None), ClaimState::Pending { .. }));
        assert!(matches!(
            claim_state(Some(&SandboxClaimStatus::default())),
            ClaimState::Pending { .. }
        ));
    }
}
