//! sortie's own parts of a transcript (`data-sortie-*`, DESIGN §5.1): one enum, written only by the
//! host (DESIGN §9 invariant 9) — a sandbox's copy never passes [`crate::agent_stream`]. Each variant
//! is one part type with its fixed id (same type and id replace each other in place on clients), and
//! its data as the dashboard reads it (camelCase keys, absent optional keys left out).

use serde::Serialize;
use serde_json::Value;

use crate::chunk::UiChunk;
use crate::driver::PrimingRung;
use crate::error::FailureCode;

/// One part of sortie's own.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", content = "data")]
pub enum SortieData {
    /// `data-sortie-phase` (id `phase`): where the turn is, and its timings so far in milliseconds.
    #[serde(rename = "data-sortie-phase")]
    Phase(PhaseData),
    /// `data-sortie-priming` (id `priming`): how a fresh agent got the session's context (§6.4).
    #[serde(rename = "data-sortie-priming")]
    Priming(PrimingData),
    /// `data-sortie-delivery` (id `delivery`): what reached the branch, from the git proxy's record.
    #[serde(rename = "data-sortie-delivery")]
    Delivery(DeliveryData),
    /// `data-sortie-egress-denied`: a connection the egress proxy refused, as it happened.
    #[serde(rename = "data-sortie-egress-denied")]
    EgressDenied(EgressDeniedData),
    /// `data-sortie-usage` (id `tokens`): the turn's tokens so far, as the model proxy read them.
    #[serde(rename = "data-sortie-usage")]
    Usage(UsageData),
    /// `data-sortie-notice`: something the host did to the turn that the user should know (a part of
    /// the sandbox's stream refused, a cap reached).
    #[serde(rename = "data-sortie-notice")]
    Notice(NoticeData),
    /// `data-sortie-budget` (id `budget`): the session reached its budget: the agent's next model
    /// request is held (`paused`), goes on (`raised`), or the turn ends (`exceeded`).
    #[serde(rename = "data-sortie-budget")]
    Budget(BudgetData),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetData {
    /// `paused`, `raised` or `exceeded`.
    pub state: String,
    /// `tokens` or `compute_seconds`.
    pub kind: String,
    pub spent: u64,
    pub limit: u64,
    /// What to do, in a sentence.
    pub how: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PhaseData {
    /// `running`, `delivering` or `done`.
    pub phase: String,
    /// What the phase waits for, when it waits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Milliseconds by phase (`queued`, `clone` or `primed_clone`, `sandbox` or `warm_sandbox`, `setup`,
    /// `first_part`, `agent_turn`, `delivery`), all measured by the host.
    pub timings: std::collections::BTreeMap<String, u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PrimingData {
    pub rung: PrimingRung,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_error: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeliveryData {
    pub branch: String,
    /// The branch's head on the remote moved to `headSha` in this turn.
    pub pushed: bool,
    /// The turn produced a commit.
    pub changed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_sha: Option<String>,
    /// Where the branch was before the turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// What the branch changes, all turns so far, against the commit the session started from (the
    /// same diff as `GET /v1/sessions/{id}/diff`); zero when the turn pushed nothing.
    pub diff_stat: DiffStat,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<DeliveryError>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pr_url: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiffStat {
    pub files: u64,
    pub insertions: u64,
    pub deletions: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryError {
    /// `SECRET_DETECTED`, `PUSH_CONFLICT`, `DELIVERY_FAILED`, …
    pub code: FailureCode,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EgressDeniedData {
    pub host: String,
    pub port: u16,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UsageData {
    /// `anthropic`, `openai` or `gemini`.
    pub api: String,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NoticeData {
    /// A stable code (`STREAM_PART_REFUSED`, `TRANSCRIPT_LIMIT`, …).
    pub code: String,
    pub message: String,
}

impl SortieData {
    /// The part's type after `data-`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Phase(_) => "sortie-phase",
            Self::Priming(_) => "sortie-priming",
            Self::Delivery(_) => "sortie-delivery",
            Self::EgressDenied(_) => "sortie-egress-denied",
            Self::Usage(_) => "sortie-usage",
            Self::Notice(_) => "sortie-notice",
            Self::Budget(_) => "sortie-budget",
        }
    }

    /// The fixed id of a part that is replaced in place; `None` for parts that each stand alone.
    pub fn id(&self) -> Option<&'static str> {
        match self {
            Self::Phase(_) => Some("phase"),
            Self::Priming(_) => Some("priming"),
            Self::Delivery(_) => Some("delivery"),
            Self::Usage(_) => Some("tokens"),
            Self::Budget(_) => Some("budget"),
            Self::EgressDenied(_) | Self::Notice(_) => None,
        }
    }

    /// The part as a stream chunk.
    pub fn into_chunk(self) -> UiChunk {
        let name = self.name().to_owned();
        let id = self.id().map(str::to_owned);
        let data = match serde_json::to_value(&self) {
            Ok(Value::Object(mut tagged)) => tagged.remove("data").unwrap_or(Value::Null),
            _ => Value::Null,
        };
        UiChunk::Data {
            name,
            id,
            data,
            transient: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parts_are_written_with_their_type_id_and_data() {
        let cases = [
            (
                SortieData::Delivery(DeliveryData {
                    branch: "sortie/ses_x".into(),
                    pushed: true,
                    changed: true,
                    head_sha: Some("a".repeat(40)),
                    baseline: None,
                    diff_stat: DiffStat {
                        files: 1,
                        insertions: 2,
                        deletions: 0,
                    },
                    error: None,
                    pr_url: None,
                }),
                json!({"type": "data-sortie-delivery", "id": "delivery", "data": {
                    "branch": "sortie/ses_x", "pushed": true, "changed": true, "headSha": "a".repeat(40),
                    "diffStat": {"files": 1, "insertions": 2, "deletions": 0}}}),
            ),
            (
                SortieData::EgressDenied(EgressDeniedData {
                    host: "example.com".into(),
                    port: 443,
                    reason: "not on the allowlist".into(),
                }),
                json!({"type": "data-sortie-egress-denied", "data": {"host": "example.com", "port": 443, "reason": "not on the allowlist"}}),
            ),
            (
                SortieData::Usage(UsageData {
                    api: "anthropic".into(),
                    model: "m".into(),
                    input_tokens: 3,
                    output_tokens: 4,
                }),
                json!({"type": "data-sortie-usage", "id": "tokens", "data": {"api": "anthropic", "model": "m", "inputTokens": 3, "outputTokens": 4}}),
            ),
            (
                SortieData::Priming(PrimingData {
                    rung: PrimingRung::Transcript,
                    load_error: Some("gone".into()),
                }),
                json!({"type": "data-sortie-priming", "id": "priming", "data": {"rung": "transcript", "loadError": "gone"}}),
            ),
            (
                SortieData::Phase(PhaseData {
                    phase: "running".into(),
                    note: None,
                    timings: [("queued".to_owned(), 3)].into(),
                }),
                json!({"type": "data-sortie-phase", "id": "phase", "data": {"phase": "running", "timings": {"queued": 3}}}),
            ),
        ];
        for (part, expected) in cases {
            let chunk: Value = serde_json::from_str(&part.into_chunk().to_json()).expect("json");
            assert_eq!(chunk, expected);
        }
    }
}
