//! Error codes of the control plane and failure codes of sessions. Both are part of the API: a code is
//! never renamed or reused for another meaning.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($( $(#[doc = $doc:literal])* $variant:ident = $status:literal, )*) => {
        /// A refusal the control plane answers with, and its HTTP status.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "SCREAMING_SNAKE_CASE")]
        pub enum ErrorCode {
            $( $(#[doc = $doc])* $variant, )*
        }

        impl ErrorCode {
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The HTTP status this code is answered with.
            pub fn http_status(self) -> u16 {
                match self { $(ErrorCode::$variant => $status,)* }
            }
        }
    };
}

error_codes! {
    /// Malformed JSON, a missing or unknown field, a wrong type or an out-of-range query parameter.
    InvalidRequest = 400,
    /// The request body is not `application/json`.
    UnsupportedMediaType = 415,
    /// The request body is larger than the control plane reads.
    BodyTooLarge = 413,
    /// No bearer token, or one that is unknown or revoked.
    Unauthorized = 401,
    /// The token's role is too low for this action.
    Forbidden = 403,
    /// No session with this id in the token's workspace.
    SessionNotFound = 404,
    /// No such route.
    NotFound = 404,
    /// The route exists but not for this method.
    MethodNotAllowed = 405,
    /// A prompt is larger than 100 KiB.
    PromptTooLarge = 413,
    /// The session's prompts together would pass 8 MiB.
    SessionPromptsTooLarge = 413,
    /// The setup script is larger than the limit.
    SetupTooLarge = 413,
    /// The title is longer than 200 characters.
    TitleTooLong = 400,
    /// An egress allowlist entry is not an exact public DNS name; `details.entries` names each.
    EgressAllowlistInvalid = 400,
    /// No agent profile has this id.
    AgentUnknown = 400,
    /// The agent (named, or the default when none is) is not installed on this server; the message
    /// says how to install it (`sortie agents install ID`) and which agents are installed.
    AgentNotInstalled = 409,
    /// `repo` is neither an `https://` git URL nor an absolute path, or it carries credentials.
    RepoInvalid = 400,
    /// The repository is not allowed for this workspace.
    RepoNotAllowed = 403,
    /// `base` is not a valid branch name.
    BaseInvalid = 400,
    /// The local repository has no branch `base`.
    BaseNotFound = 400,
    /// The server (or the repository's owner, who serves it to sortie) cannot read the local
    /// repository; the message names the path and the permission that is missing.
    RepoNotReadable = 400,
    /// `model` is empty, too long or has characters a model name never has.
    ModelInvalid = 400,
    /// The session already has the most turns waiting that it may have.
    TurnQueueFull = 409,
    /// The session is canceled or archived: it takes no more turns.
    SessionNotSteerable = 409,
    /// Stop asked for, but no turn is running.
    NoTurnRunning = 409,
    /// The session has a turn in flight; stop or cancel it first.
    SessionActive = 409,
    /// The attach ticket is malformed, forged or for another session or action.
    TicketInvalid = 401,
    /// The attach ticket's lifetime has passed.
    TicketExpired = 401,
    /// The attach ticket was already used.
    TicketReplayed = 401,
    /// The path names no model API this server keeps keys for (`anthropic`, `openai`, `gemini`).
    ModelApiUnknown = 404,
    /// A model key is empty, longer than 4096 bytes, or has a character other than printable ASCII.
    ModelKeyInvalid = 400,
    /// The workspace keeps no key for this model API.
    ModelKeyNotFound = 404,
    /// A forge connection's host is not `host` or `host:port`, or its token or API base is malformed.
    ForgeConnectionInvalid = 400,
    /// The workspace has no connection to this forge host.
    ForgeConnectionNotFound = 404,
    /// A webhook's secret or event list is malformed, or the workspace has the most webhooks it may.
    WebhookInvalid = 400,
    /// A webhook's URL is not `http(s)://` with a host, carries credentials, or leads to a private
    /// address (webhooks reach public addresses only, unless the operator exempted the range).
    WebhookUrlRefused = 400,
    /// The workspace has no webhook with this id.
    WebhookNotFound = 404,
    /// A forge's webhook delivery is not signed by the secret of any connection of its App (or lacks
    /// the headers that name it).
    WebhookSignatureInvalid = 401,
    /// The workspace has the most forge deliveries waiting for a worker that it may have; the forge
    /// can deliver it again later.
    WebhookBacklogFull = 429,
    /// A workspace quota is used up (`details`: the quota, its limit and what is used); an admin
    /// raises it with `PUT /v1/limits`, or the day or month turns.
    QuotaExceeded = 429,
    /// The `Idempotency-Key` was used for a different request (another body or endpoint) in the last
    /// 24 h; use a new key.
    IdempotencyKeyReused = 422,
    /// A request with this `Idempotency-Key` is still being answered; retry in a moment.
    IdempotencyKeyInUse = 409,
    /// `Last-Event-ID` is older than the events the server still keeps: some were lost. Read the
    /// sessions again and reconnect without it.
    EventsPruned = 410,
    /// The workspace has no token with this id.
    TokenNotFound = 404,
    /// The token named is the one making the request: revoking it would lock the caller out. Revoke it
    /// with another admin token.
    TokenInUse = 409,
    /// The workspace has no preset for this repository.
    PresetNotFound = 404,
    /// The store did not answer; try again.
    StoreUnavailable = 503,
    /// A fault of the server; the log has the detail.
    Internal = 500,
}

impl ErrorCode {
    /// The code as it appears on the wire, e.g. `SESSION_NOT_FOUND`.
    pub fn as_str(self) -> String {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::String(text)) => text,
            _ => format!("{self:?}"),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

/// The body of every error answer: `{"error": {"code", "message", "details"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ApiErrorBody {
    pub error: ErrorDetail,
}

/// One error: a stable code, a sentence for people, and structured details (an empty object if none).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub details: serde_json::Value,
}

/// The `details` of the refusals that carry any: each a plain object on the wire. A refusal builds
/// its details from one of these, never from a JSON literal.
pub mod details {
    use serde::{Deserialize, Serialize};

    use crate::egress::AllowlistViolation;

    /// `details` of a refusal that has none: `{}`.
    pub fn none() -> serde_json::Value {
        serde_json::Value::Object(serde_json::Map::new())
    }

    /// What is known, where a name was not (`AGENT_UNKNOWN`, `MODEL_API_UNKNOWN`).
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Known {
        pub known: Vec<String>,
    }

    /// `AGENT_NOT_INSTALLED`: the agent, how to install it, and the agents this host can run.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct AgentNotInstalled {
        pub agent: String,
        pub install: String,
        pub installed: Vec<String>,
    }

    /// `BASE_NOT_FOUND`: the branch the repository does not have.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct BaseNotFound {
        pub base: String,
    }

    /// `QUOTA_EXCEEDED`: which quota (`sessions_per_day`, `tokens_per_month`), its limit, what is used.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct QuotaExceeded {
        pub quota: String,
        pub limit: u64,
        pub used: u64,
    }

    /// `REPO_NOT_READABLE`: the repository's path.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct RepoNotReadable {
        pub path: String,
    }

    /// `EGRESS_ALLOWLIST_INVALID`: each refused entry and why.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct AllowlistRefused {
        pub entries: Vec<AllowlistViolation>,
    }

    /// `EVENTS_PRUNED`: the newest event no longer kept.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct EventsPruned {
        pub pruned_through: u64,
    }
}

impl ApiErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::with_details(code, message, details::none())
    }

    pub fn with_details(code: ErrorCode, message: impl Into<String>, details: serde_json::Value) -> Self {
        Self {
            error: ErrorDetail {
                code,
                message: message.into(),
                details,
            },
        }
    }
}

/// Why a session's last turn failed (`failure.code`, DESIGN §4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FailureCode {
    /// The sandbox could not be created or started.
    SandboxStartFailed,
    /// The repository could not be cloned or the base branch checked out.
    CloneFailed,
    /// The setup script failed or timed out.
    SetupFailed,
    /// The agent did not start or did not complete the ACP handshake.
    AgentStartFailed,
    /// The vendor refused the model key the gateway injected.
    VendorAuthRejected,
    /// The turn ran past its time limit.
    TurnTimeout,
    /// The agent reported an error or exited mid-turn.
    AgentError,
    /// The delivery candidate holds something that looks like a secret; nothing was pushed.
    SecretDetected,
    /// The session's branch moved under us.
    PushConflict,
    /// Committing or pushing failed.
    DeliveryFailed,
    /// The work was pushed but the pull request could not be opened or updated.
    PrOpenFailed,
    /// The sandbox vanished.
    SandboxLost,
    /// The session's disk (its `/workspace` and `$HOME`) is full: the agent's writes past its quota
    /// failed. Free space in the workspace, or raise the disk limit, and steer the session.
    DiskQuotaExceeded,
    /// The session reached its token or compute budget and nobody raised it in time; what the agent
    /// did is delivered. Raise it (`POST /v1/sessions/{id}/budget`) and steer the session.
    BudgetExceeded,
    /// A fault of sortie itself.
    Internal,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_screaming_snake_case_on_the_wire() {
        assert_eq!(ErrorCode::SessionNotFound.as_str(), "SESSION_NOT_FOUND");
        assert_eq!(ErrorCode::EgressAllowlistInvalid.as_str(), "EGRESS_ALLOWLIST_INVALID");
        for code in ErrorCode::ALL {
            let text = code.as_str();
            assert!(text.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'), "{text}");
            let back: ErrorCode = serde_json::from_value(serde_json::json!(text)).expect("round trip");
            assert_eq!(back, *code);
        }
    }

    #[test]
    fn statuses_are_the_documented_ones() {
        use ErrorCode::*;
        let expected = [
            (InvalidRequest, 400),
            (Unauthorized, 401),
            (Forbidden, 403),
            (SessionNotFound, 404),
            (PromptTooLarge, 413),
            (SessionPromptsTooLarge, 413),
            (EgressAllowlistInvalid, 400),
            (AgentUnknown, 400),
            (AgentNotInstalled, 409),
            (BaseNotFound, 400),
            (RepoNotReadable, 400),
            (TurnQueueFull, 409),
            (SessionNotSteerable, 409),
            (NoTurnRunning, 409),
            (TicketInvalid, 401),
            (TicketExpired, 401),
            (TicketReplayed, 401),
            (ModelApiUnknown, 404),
            (ModelKeyInvalid, 400),
            (ModelKeyNotFound, 404),
            (ForgeConnectionInvalid, 400),
            (ForgeConnectionNotFound, 404),
            (EventsPruned, 410),
            (WebhookInvalid, 400),
            (WebhookUrlRefused, 400),
            (WebhookNotFound, 404),
            (WebhookSignatureInvalid, 401),
            (WebhookBacklogFull, 429),
            (QuotaExceeded, 429),
            (IdempotencyKeyReused, 422),
            (IdempotencyKeyInUse, 409),
            (Internal, 500),
        ];
        for (code, status) in expected {
            assert_eq!(code.http_status(), status, "{code}");
        }
        for code in ErrorCode::ALL {
            assert!((400..600).contains(&code.http_status()));
        }
    }
}
