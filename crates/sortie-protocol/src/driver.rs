//! The driver API (DESIGN §6.2): every body, state and failure code that crosses between the host and
//! the driver, which runs inside the sandbox. The host treats everything the driver says as untrusted
//! input (DESIGN §9 invariant 9): answers are bounded ([`ANSWER_MAX_BYTES`], [`STREAM_LINE_MAX_BYTES`])
//! before they are parsed into these types, and nothing here is taken as sortie's word on delivery,
//! usage or the start of a turn — the host establishes those itself.
//!
//! Routes, all on the host-held driver socket (or a driver link, [`LINK_PATH`]): `POST /turns` ([`StartTurn`] → [`TurnReport`]),
//! `GET /turns/{n}` ([`TurnReport`]), `GET /turns/{n}/stream?after=K` (SSE of UI chunks),
//! `POST /turns/{n}/cancel`, `GET /status` ([`DriverStatus`]), `POST /setup` ([`RunSetup`] →
//! [`SetupOutcome`]); a driver that awaits its assignment serves `POST /assignment` ([`Assignment`])
//! first and refuses the rest `NOT_ASSIGNED`. Refusals carry [`DriverErrorBody`].

use serde::{Deserialize, Serialize};

/// Where the egress relay listens inside the sandbox's network namespace (the driver binds it; the host
/// names it in the workspace's git remote).
pub const RELAY_ADDRESS: &str = "127.0.0.1:3128";

/// The version of this API; `GET /status` reports it and the host refuses a driver of another one.
pub const VERSION: u32 = 2;

/// Where a driver that dials out (a pod's, DESIGN §15) offers its API to the gateway: `GET` with
/// `Connection: upgrade`, `Upgrade: `[`LINK_PROTOCOL`] and `Authorization: Bearer <its identity token>`.
pub const LINK_PATH: &str = "/v1/drivers/link";
/// The protocol a driver link upgrades to: HTTP/2 on the dialed connection, the gateway the client and
/// the driver the server of the same API as on the driver socket.
pub const LINK_PROTOCOL: &str = "sortie-driver-link.1";
/// The audience a driver's identity token is for (a projected service-account token on Kubernetes).
pub const LINK_AUDIENCE: &str = "sortie-gateway";
/// A pod's way out (DESIGN §15): each connection its driver's egress relay accepts is carried by a
/// `GET` here, with the same identity token as the link, upgraded to [`EGRESS_PROTOCOL`]; behind it
/// is the egress proxy (with the git and model proxies) of the session the pod is bound to.
pub const EGRESS_PATH: &str = "/v1/drivers/egress";
/// What an egress connection upgrades to: the bytes of one connection to the egress proxy, as a
/// sandbox's `egress.sock` carries them on the local runtime.
pub const EGRESS_PROTOCOL: &str = "sortie-egress.1";

/// `GET /home` (a tar of the agent's home, without the driver's turn logs) and `PUT /home` (the same,
/// unpacked into an unassigned pod's empty home): what a session's agent keeps (its own sessions, which
/// `session/load` reads) goes from the pod given up at hibernation to the session's next pod.
pub const HOME_PATH: &str = "/home";
/// The largest home snapshot a driver gives or the host keeps.
pub const HOME_SNAPSHOT_MAX_BYTES: usize = 16 << 20;

/// The most the host reads of any JSON answer of the driver (a report, the status, a setup outcome).
pub const ANSWER_MAX_BYTES: usize = 1024 * 1024;
/// The longest line the host reads of a turn's SSE stream: the driver's own bound on one ACP message
/// plus the chunk's JSON framing. A longer line breaks the stream.
pub const STREAM_LINE_MAX_BYTES: usize = 16 * 1024 * 1024 + 64 * 1024;
/// The longest turn nonce.
pub const NONCE_MAX_BYTES: usize = 64;
/// How much of a setup script's output the driver keeps.
pub const SETUP_OUTPUT_TAIL_BYTES: usize = 8 * 1024;
/// The exit code of a driver that cannot find its agent's program (`EX_CONFIG`): the host reports
/// `AGENT_START_FAILED` with the driver's last words instead of a failed sandbox. Only a label: the
/// words are the sandbox's and are shown as such.
pub const EXIT_AGENT_NOT_FOUND: u8 = 78;

/// `POST /turns/{n}/cancel` accepted: the turn is being canceled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelAccepted {
    pub n: u32,
}

/// `POST /turns`: the host starts turn `n`. Idempotent on `(n, nonce)`; the same `n` with another
/// nonce is refused ([`DriverErrorCode::TurnNotOurs`]): a turn the host did not start never runs
/// under a number the host will use.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartTurn {
    pub n: u32,
    /// Issued by the host for this turn; every report of the turn carries it back.
    pub nonce: String,
    pub prompt: String,
    /// The branch's last delivered commit; absent: the branch must not exist on the remote yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// The session's context, used only when the agent process is fresh (DESIGN §6.4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priming_context: Option<PrimingContext>,
}

/// What the host knows of the session's past, for priming a fresh agent process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrimingContext {
    /// A bounded preamble from the durable transcript (prompts and assistant text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preamble: Option<String>,
    /// The session's original task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
}

/// The rung of the context ladder that primed a fresh agent (DESIGN §6.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PrimingRung {
    /// The agent reloaded its own session from `$HOME` (`session/load`).
    SessionLoad,
    /// The prompt carried a preamble from the transcript.
    Transcript,
    /// The prompt carried the original task.
    Task,
    /// Context was needed and none could be given: the agent started afresh.
    None,
}

impl PrimingRung {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SessionLoad => "session_load",
            Self::Transcript => "transcript",
            Self::Task => "task",
            Self::None => "none",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [Self::SessionLoad, Self::Transcript, Self::Task, Self::None]
            .into_iter()
            .find(|rung| rung.as_str() == text)
    }
}

/// Where a turn is, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnState {
    /// The agent works.
    Running,
    /// The agent stopped; its work is being committed, scanned and pushed.
    Delivering,
    /// The agent ended its turn (and the delivery, if any, ran).
    Completed,
    /// The turn was canceled (stop, interrupt or cancel).
    Cancelled,
    /// The turn failed; its report says why.
    Failed,
}

impl TurnState {
    /// Running or delivering: no other turn (nor a setup script) may start.
    pub fn is_active(self) -> bool {
        matches!(self, Self::Running | Self::Delivering)
    }
}

/// Why a turn failed, in the driver's words. The host maps these to the session's failure codes
/// only where it cannot establish the fact itself (an agent that broke the protocol or would not
/// start); delivery outcomes come from the git proxy's record, timeouts from the host's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DriverFailureCode {
    /// The agent process could not be started or did not finish the ACP handshake.
    AgentStartFailed,
    /// The agent broke the protocol, exited mid-turn or failed the prompt.
    AgentError,
    /// The turn ran past the driver's limit.
    TurnTimeout,
    /// The driver's early scan found a secret in the candidate (the gateway's scan is the one that counts).
    SecretDetected,
    /// The branch moved on the remote since the baseline.
    PushConflict,
    /// Committing or pushing failed.
    DeliveryFailed,
    /// A cancel killed an agent that would not stop (a note, not a failure of the turn).
    Canceled,
    /// Anything else.
    Internal,
}

impl DriverFailureCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentStartFailed => "AGENT_START_FAILED",
            Self::AgentError => "AGENT_ERROR",
            Self::TurnTimeout => "TURN_TIMEOUT",
            Self::SecretDetected => "SECRET_DETECTED",
            Self::PushConflict => "PUSH_CONFLICT",
            Self::DeliveryFailed => "DELIVERY_FAILED",
            Self::Canceled => "CANCELED",
            Self::Internal => "INTERNAL",
        }
    }
}

/// A failure with the sentence that explains it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnFailure {
    pub code: DriverFailureCode,
    pub reason: String,
}

/// What the driver's delivery did (its own account; the host believes the git proxy's record).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryReport {
    /// The commit the branch should point at (the pushed one, or the candidate that was refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_sha: Option<String>,
    /// The remote branch now points at `head_sha`.
    #[serde(default)]
    pub pushed: bool,
    /// The turn changed something (a new commit was made).
    #[serde(default)]
    pub changed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TurnFailure>,
}

/// A turn as the driver reports it (`POST /turns`, `GET /turns/{n}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnReport {
    pub n: u32,
    /// The nonce the host started the turn with.
    pub nonce: String,
    pub state: TurnState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<TurnFailure>,
    /// Parts published so far.
    #[serde(default)]
    pub parts: u64,
    /// The rung that primed a fresh agent; absent on the session's first agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priming: Option<PrimingRung>,
    /// Why `session/load` failed when the rung fell past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_error: Option<String>,
    /// What the delivery did, once it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliveryReport>,
}

/// Where the agent process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentState {
    NotStarted,
    Starting,
    Ready,
    /// It was stopped (a turn ended, or a cancel or timeout killed it).
    Stopped,
    Failed,
}

/// The agent as `GET /status` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub state: AgentState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The agent's pid (its process group) inside the sandbox, while one runs; for operators and
    /// tests of the driver alone (the host acts on its own view of the sandbox's processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
}

/// `GET /status`: small and bounded whatever the driver's history (one report is `GET /turns/{n}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverStatus {
    /// [`VERSION`] of the driver that answers.
    pub version: u32,
    pub agent: AgentStatus,
    /// The turn running or delivering, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_turn: Option<u32>,
}

/// `POST /assignment`: the session a driver that awaits it (`sortie driver --await-assignment`: a generic
/// pod's, over its link, or a warm local sandbox's, on its socket) serves, given once, by the host. What a
/// cold local sandbox is given as flags.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Assignment {
    /// The sortie session id.
    pub session: String,
    /// The agent profile to run.
    pub agent: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Where the agent's model requests go (the gateway's model proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_proxy: Option<String>,
    /// The branch each turn is delivered to (`sortie/<session>`), through `remote`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_timeout_secs: Option<u64>,
    /// The workspace to make before the agent starts (a pod's is empty until it is assigned). A warm
    /// local sandbox's is bound in by the host before the assignment, so it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkout: Option<Checkout>,
    /// Where, inside the sandbox, the host keeps the digests of the session's known secret values (a
    /// warm local sandbox's; read again at each delivery, as `--secret-digests` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_digests: Option<String>,
}

/// A generic pod's workspace, cloned at its assignment through the session's git proxy, with the
/// session's branch (the assignment's `branch`) started at a commit the host resolved itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkout {
    /// The session's repository at its git proxy, e.g. `http://127.0.0.1:3128/_sortie/git/<session>.git`;
    /// it stays the workspace's `origin`.
    pub url: String,
    /// The full commit id the branch starts at.
    pub commit: String,
    /// What the session's last pod kept at its [`crate::ids::wip_ref`] because a delivery failed: the
    /// workspace is made to hold that commit's files on top of `commit`, for the next delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wip: Option<String>,
}

/// `POST /setup`: the setup script, run to its end between turns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSetup {
    pub script: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// What became of a setup script.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetupOutcome {
    /// Its exit code; absent when a signal ended it (the timeout's SIGKILL, say).
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    /// The last [`SETUP_OUTPUT_TAIL_BYTES`] of stdout and stderr, interleaved as written.
    #[serde(default)]
    pub output_tail: String,
}

/// Why the driver refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DriverErrorCode {
    /// The body is not what the route takes.
    InvalidRequest,
    /// Another turn runs.
    TurnRunning,
    /// The setup script runs.
    SetupRunning,
    /// A turn with this number exists under another nonce: the host did not start it.
    TurnNotOurs,
    /// No such turn here (never started, or its log is gone).
    TurnNotFound,
    /// Nothing is running to cancel.
    NoTurnRunning,
    /// The setup script could not be started.
    SetupFailed,
    /// A driver waiting for its assignment serves nothing else yet.
    NotAssigned,
    /// The driver serves another session already.
    AlreadyAssigned,
    /// The agent's home is larger than [`HOME_SNAPSHOT_MAX_BYTES`].
    HomeTooLarge,
    /// The assignment's checkout could not be cloned.
    CheckoutFailed,
}

/// The body of every refusal of the driver API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverErrorBody {
    pub error: DriverError,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverError {
    pub code: DriverErrorCode,
    pub message: String,
}

/// Whether `text` is a commit id (40 or 64 lowercase hex digits, not the null id git uses for "no
/// object", as in a ref's deletion).
pub fn is_commit_id(text: &str) -> bool {
    matches!(text.len(), 40 | 64)
        && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && text.bytes().any(|b| b != b'0')
}

/// Whether `nonce` can be a turn nonce: 1 to [`NONCE_MAX_BYTES`] letters, digits, `-` or `_`.
pub fn is_nonce(nonce: &str) -> bool {
    !nonce.is_empty()
        && nonce.len() <= NONCE_MAX_BYTES
        && nonce
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bodies_keep_their_wire_names() {
        let report = TurnReport {
            n: 2,
            nonce: "abc".into(),
            state: TurnState::Delivering,
            stop_reason: None,
            failure: Some(TurnFailure {
                code: DriverFailureCode::AgentStartFailed,
                reason: "no".into(),
            }),
            parts: 3,
            priming: Some(PrimingRung::SessionLoad),
            load_error: None,
            delivery: None,
        };
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(
            json,
            serde_json::json!({
                "n": 2, "nonce": "abc", "state": "delivering", "parts": 3, "priming": "session_load",
                "failure": {"code": "AGENT_START_FAILED", "reason": "no"},
            })
        );
        let back: TurnReport = serde_json::from_value(json).expect("parse");
        assert_eq!(back, report);
        for code in [
            DriverFailureCode::AgentStartFailed,
            DriverFailureCode::AgentError,
            DriverFailureCode::TurnTimeout,
            DriverFailureCode::SecretDetected,
            DriverFailureCode::PushConflict,
            DriverFailureCode::DeliveryFailed,
            DriverFailureCode::Canceled,
            DriverFailureCode::Internal,
        ] {
            assert_eq!(
                serde_json::to_value(code).expect("json"),
                serde_json::Value::from(code.as_str())
            );
        }
    }

    #[test]
    fn a_start_with_an_unknown_field_is_refused() {
        let refused = serde_json::from_str::<StartTurn>(r#"{"n":1,"nonce":"a","prompt":"p","host_timings":{}}"#);
        assert!(refused.is_err());
        let taken: StartTurn = serde_json::from_str(r#"{"n":1,"nonce":"a","prompt":"p"}"#).expect("parse");
        assert_eq!(taken.baseline, None);
    }

    #[test]
    fn nonces_and_commit_ids_are_recognised() {
        for (nonce, ok) in [("a", true), ("A-b_9", true), ("", false), ("a b", false), ("ü", false)] {
            assert_eq!(is_nonce(nonce), ok, "{nonce:?}");
        }
        assert!(!is_nonce(&"x".repeat(NONCE_MAX_BYTES + 1)));
        assert!(is_commit_id(&"a".repeat(40)));
        assert!(!is_commit_id(&"A".repeat(40)));
        assert!(!is_commit_id(&"a".repeat(41)));
        assert!(!is_commit_id(&"0".repeat(40)), "the null id names no commit");
        assert!(!is_commit_id(&"0".repeat(64)));
        for rung in ["session_load", "transcript", "task", "none"] {
            assert_eq!(PrimingRung::parse(rung).map(PrimingRung::as_str), Some(rung));
        }
        assert_eq!(PrimingRung::parse("other"), None);
    }
}
