//! Request and response bodies of the control plane (DESIGN §4). Requests reject unknown fields;
//! responses omit nothing: an absent value is `null`, so clients see one fixed shape.

use serde::{Deserialize, Serialize};

use crate::error::FailureCode;
use crate::ids::SessionId;
use crate::phase::{SessionPhase, TurnMode, TurnStatus};

/// `POST /v1/sessions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// An `https://` git URL, or an absolute path to a local git repository the workspace may use.
    pub repo: String,
    /// The task: the first turn's prompt (at most 100 KiB).
    pub task: String,
    /// The agent profile id; the server's default when absent.
    #[serde(default)]
    pub agent: Option<String>,
    /// The branch to start from; the repository's default branch when absent.
    #[serde(default)]
    pub base: Option<String>,
    /// The model the agent should use; the agent's default when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// Hosts the agent may reach through the egress proxy.
    #[serde(default)]
    pub egress: Option<EgressRequest>,
    /// A shell script run in the sandbox before the agent starts (setup-phase egress applies).
    #[serde(default)]
    pub setup: Option<String>,
    /// A title for people; the first line of the task when absent.
    #[serde(default)]
    pub title: Option<String>,
    /// Caps on what the session may spend; each absent field takes the workspace's default
    /// (`GET /v1/limits`).
    #[serde(default)]
    pub budget: Option<Budget>,
}

/// What a session may spend (DESIGN §12, §16). At the token cap the model proxy holds the agent's
/// next request and the session needs input; at the compute cap the turn stops. Raise either with
/// `POST /v1/sessions/{id}/budget`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Model tokens (input and output) in all of the session's turns.
    #[serde(default)]
    pub tokens: Option<u64>,
    /// CPU seconds of the session's sandboxes.
    #[serde(default)]
    pub compute_seconds: Option<u64>,
}

impl Budget {
    /// Each field of `self`, else of `default`.
    pub fn or(self, default: Budget) -> Budget {
        Budget {
            tokens: self.tokens.or(default.tokens),
            compute_seconds: self.compute_seconds.or(default.compute_seconds),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_none() && self.compute_seconds.is_none()
    }
}

/// A session's budget as it stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionBudget {
    pub tokens: Option<u64>,
    pub compute_seconds: Option<u64>,
    /// Set while the model proxy holds the agent's request at the token cap: the session needs input.
    pub paused_at: Option<String>,
}

/// `POST /v1/sessions/{id}/budget`: how much to add (a held request goes on at once if the new cap
/// allows it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RaiseBudgetRequest {
    /// Tokens to add to the token cap (a session without one gets this much more than it used).
    #[serde(default)]
    pub tokens: Option<u64>,
    /// CPU seconds to add to the compute cap (likewise).
    #[serde(default)]
    pub compute_seconds: Option<u64>,
}

/// `GET`/`PUT /v1/limits`: a workspace's default budget for new sessions and its quotas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WorkspaceLimits {
    /// The budget of a session created without one (field by field).
    #[serde(default)]
    pub budget: Budget,
    #[serde(default)]
    pub quotas: Quotas,
}

/// A workspace's quotas: past one, creating a session (and, for tokens, steering one) is refused
/// `QUOTA_EXCEEDED`. Live sandboxes are capped per workspace by `serve --sandboxes-per-workspace`
/// (past it, turns queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Sessions created per UTC day.
    #[serde(default)]
    pub sessions_per_day: Option<u64>,
    /// Model tokens per UTC calendar month, all sessions together.
    #[serde(default)]
    pub tokens_per_month: Option<u64>,
}

/// The largest budget or quota figure accepted (far past any real need; keeps sums in range).
pub const LIMIT_MAX: u64 = 1 << 50;

/// The egress part of a create request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EgressRequest {
    /// Exact public DNS names, at most 32.
    #[serde(default)]
    pub allow: Vec<String>,
}

/// `POST /v1/sessions/{id}/egress`: the session's new allowlist, replacing the old one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EgressAmendment {
    /// Exact public DNS names, at most 32.
    pub allow: Vec<String>,
}

/// `POST /v1/sessions/{id}/steer`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SteerRequest {
    /// The new turn's prompt (at most 100 KiB).
    pub prompt: String,
    /// `queue` (default) waits for the running turn; `interrupt` stops it first.
    #[serde(default)]
    pub mode: Option<TurnMode>,
}

/// `POST /v1/sessions/{id}/attach-ticket`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AttachTicketRequest {
    /// `attach` (default) to read the stream, `turn` to submit a turn through it.
    #[serde(default)]
    pub action: Option<TicketAction>,
}

/// What a ticket lets its holder do on the conversation plane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TicketAction {
    /// Read the session's stream (`GET …/stream`).
    #[default]
    Attach,
    /// Submit a turn and read its stream (`POST …/stream`).
    Turn,
}

impl TicketAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Attach => "attach",
            Self::Turn => "turn",
        }
    }
}

/// The answer to `POST …/attach-ticket`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AttachTicket {
    /// Send as `Authorization: Ticket <ticket>`; valid once.
    pub ticket: String,
    /// RFC 3339 UTC.
    pub expires_at: String,
    /// The stream path the ticket is for.
    pub stream_url: String,
}

/// Whether a session holds a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Live,
    Released,
}

/// A session as the control plane shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Session {
    pub id: SessionId,
    /// The workspace's name.
    pub workspace: String,
    pub repo: String,
    pub base: Option<String>,
    /// `sortie/<id>`.
    pub branch: String,
    pub agent: String,
    pub model: Option<String>,
    pub title: String,
    pub phase: SessionPhase,
    /// Whether the session holds a sandbox now (`live`) or not (`released`: never made yet, or given
    /// back after the idle grace or for capacity; its workspace and agent state stay on disk). Apart
    /// from `phase`, so a failed session stays `failed` when its sandbox goes.
    pub sandbox: SandboxState,
    /// Why a queued session waits, e.g. `SANDBOX_CAPACITY_LIMIT`; null otherwise.
    pub queued_reason: Option<String>,
    /// How many turns the session has.
    pub turns: u32,
    /// The turn in flight or last run; null before any turn started.
    pub current_turn: Option<u32>,
    pub head_sha: Option<String>,
    pub pr: Option<PullRequest>,
    pub failure: Option<Failure>,
    pub egress: Egress,
    pub usage: Usage,
    pub archived: bool,
    /// Its caps, when it has any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<SessionBudget>,
    /// When retention pruned its transcript and directories (`sortie gc`); the session and its turns stay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pruned_at: Option<String>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// RFC 3339 UTC.
    pub updated_at: String,
}

/// What a control-plane event announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum EventKind {
    /// A session's phase changed (`phase`).
    #[serde(rename = "session.phase")]
    SessionPhase,
    /// A turn's status changed (`turn`, `status`).
    #[serde(rename = "turn.status")]
    TurnStatus,
}

impl EventKind {
    pub const ALL: [Self; 2] = [Self::SessionPhase, Self::TurnStatus];

    /// The kind as it appears on the wire, e.g. `session.phase`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SessionPhase => "session.phase",
            Self::TurnStatus => "turn.status",
        }
    }
}

/// One change of the control plane (`GET /v1/events`, DESIGN §14; the body of a webhook delivery).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Increasing in the order the changes were made; the SSE `id`, and what `Last-Event-ID` names.
    pub seq: u64,
    #[serde(rename = "type")]
    pub kind: EventKind,
    pub session: SessionId,
    /// The turn, for `turn.status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// The session's new phase, for `session.phase`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<SessionPhase>,
    /// The turn's new status, for `turn.status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<TurnStatus>,
    /// Why, when the new phase or status is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// When the change was made, RFC 3339 UTC.
    pub at: String,
}

/// `POST /v1/auth/links`: a fresh one-time sign-in code for the caller's own token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SignInLink {
    /// Open `<server>/signin#<code>` in a browser; it works once.
    pub code: String,
    pub expires_in_seconds: u64,
}

/// `POST /v1/webhooks`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateWebhookRequest {
    /// Where deliveries are POSTed: `http(s)://`, a public address.
    pub url: String,
    /// Signs each delivery (`X-Sortie-Signature: sha256=<hex HMAC-SHA256 of the body>`); 16 to 256
    /// printable characters; never shown again.
    pub secret: String,
    /// The event kinds it receives; default all.
    #[serde(default)]
    pub events: Option<Vec<EventKind>>,
}

/// A webhook (never its secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Webhook {
    /// `whk_…`.
    pub id: String,
    pub url: String,
    pub events: Vec<EventKind>,
    /// RFC 3339 UTC.
    pub created_at: String,
}

/// `GET /v1/webhooks`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WebhookList {
    pub webhooks: Vec<Webhook>,
}

/// Where a webhook delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WebhookDeliveryState {
    /// Waiting for its next attempt.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Given up on, 24 h after its event.
    Failed,
}

/// One event's delivery to a webhook, with how its attempts went.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WebhookDelivery {
    /// `dlv_…`: the `X-Sortie-Delivery` header.
    pub id: String,
    /// The event's `seq`.
    pub event: u64,
    #[serde(rename = "type")]
    pub kind: String,
    pub state: WebhookDeliveryState,
    pub attempts: u32,
    /// The receiver's last status, if it answered.
    pub last_status: Option<u16>,
    /// What went wrong last, if anything did.
    pub last_error: Option<String>,
    /// RFC 3339 UTC.
    pub created_at: String,
    pub delivered_at: Option<String>,
    /// When a pending delivery is tried next.
    pub next_attempt_at: Option<String>,
}

/// `GET /v1/webhooks/{id}/deliveries`, newest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WebhookDeliveryList {
    pub deliveries: Vec<WebhookDelivery>,
}

/// The draft pull request of a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PullRequest {
    pub url: String,
    pub number: u64,
}

/// Why a session or turn failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Failure {
    pub code: FailureCode,
    /// A sentence a user can act on.
    pub reason: String,
}

/// The session's egress allowlist.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Egress {
    pub allow: Vec<String>,
}

/// What a session has used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    /// CPU seconds its sandboxes used, metered at the end of every turn.
    pub compute_seconds: u64,
    /// The largest peak memory of its sandboxes, in bytes.
    #[serde(default)]
    pub peak_memory_bytes: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// What one turn used, measured by the host: wall time from its start to its end, and its sandbox's
/// CPU and peak memory read from the sandbox's cgroups when it ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TurnUsage {
    /// Null until the turn has started and ended.
    pub wall_ms: Option<u64>,
    pub cpu_ms: u64,
    /// The sandbox's peak memory up to the turn's end, in bytes.
    pub peak_memory_bytes: u64,
}

/// One turn of a session's ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Turn {
    /// 1-based.
    pub n: u32,
    pub prompt: String,
    pub status: TurnStatus,
    pub mode: TurnMode,
    /// RFC 3339 UTC.
    pub created_at: String,
    pub started_at: Option<String>,
    pub completed_at: Option<String>,
    pub head_sha: Option<String>,
    pub failure: Option<Failure>,
    /// Which rung of the context ladder primed the agent for this turn (DESIGN §6.4).
    pub priming: Option<String>,
    /// Milliseconds by phase: queued, sandbox (or warm_sandbox: a started one taken from the warm pool,
    /// bound and assigned), clone (or primed_clone: a workspace checked out ahead, adopted), setup,
    /// agent_ready, first_part, agent_turn, delivery.
    #[serde(default)]
    pub timings: Option<std::collections::BTreeMap<String, u64>>,
    #[serde(default)]
    pub usage: TurnUsage,
}

/// `GET /v1/sessions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionList {
    pub sessions: Vec<Session>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// A token of the workspace as its admin sees it: never the secret (the store keeps only its hash).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenInfo {
    pub id: String,
    pub role: Role,
    pub label: Option<String>,
    pub created_at: String,
    /// Set once revoked: the token no longer signs anything in.
    pub revoked_at: Option<String>,
    /// When it stops signing anything in; null: never.
    #[serde(default)]
    pub expires_at: Option<String>,
    /// When it was last used, within a minute; null: never.
    #[serde(default)]
    pub last_used_at: Option<String>,
    /// The token this request was made with.
    pub current: bool,
}

/// `GET /v1/audit`: what admins did, newest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditLog {
    pub entries: Vec<AuditEntry>,
    /// Pass as `before` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// One admin action.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    pub id: String,
    /// RFC 3339 UTC.
    pub at: String,
    /// The token that did it (`tok_…`), or `cli` for the admin commands run on the server's host.
    pub actor: String,
    /// `token.create`, `token.revoke`, `model_key.set`, `model_key.remove`, `forge.set`, `forge.remove`,
    /// `webhook.create`, `webhook.delete`.
    pub action: String,
    /// What it was done to: a token id, a model API, a forge host, a webhook id.
    pub target: String,
}

/// The longest a token may live: ten years, in seconds.
pub const TOKEN_EXPIRY_MAX_SECONDS: u64 = 10 * 366 * 86_400;

/// `GET /v1/tokens`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenList {
    pub tokens: Vec<TokenInfo>,
}

/// `POST /v1/tokens`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTokenRequest {
    pub role: Role,
    /// Who or what the token is for (≤ 100 characters).
    #[serde(default)]
    pub label: Option<String>,
    /// Seconds until it expires (60 to ten years); absent: it never does.
    #[serde(default)]
    pub expires_in_seconds: Option<u64>,
}

/// A new token: the secret is in this answer and nowhere else, ever.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CreatedToken {
    pub token: String,
    pub info: TokenInfo,
}

/// What the composer fills in for a repository: its egress allowlist, setup script and agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RepoPreset {
    /// The repository as sessions name it (`https://…` or a local path).
    pub repo: String,
    pub agent: Option<String>,
    pub setup: Option<String>,
    pub egress_allow: Vec<String>,
    pub updated_at: String,
}

/// `GET /v1/presets`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RepoPresetList {
    pub presets: Vec<RepoPreset>,
}

/// `PUT /v1/presets`: sets (or replaces) the preset of one repository.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetRepoPresetRequest {
    pub repo: String,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub setup: Option<String>,
    #[serde(default)]
    pub egress_allow: Vec<String>,
}

/// How a file changed on a session's branch (`git diff --name-status`, renames off).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileStatus {
    Added,
    Modified,
    Deleted,
    /// A file that became a symlink or a submodule, or the other way round.
    TypeChanged,
}

/// One file of a branch diff.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileDiff {
    pub path: String,
    pub status: FileStatus,
    pub insertions: u64,
    pub deletions: u64,
    /// Git sees a binary file: no line counts and no patch.
    pub binary: bool,
    /// The file's unified diff (from its `diff --git` line), absent for a binary file and for files past
    /// the branch's patch cap (2 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// The patch stops early: it was longer than 64 KiB.
    #[serde(default)]
    pub patch_truncated: bool,
}

/// A session's branch against the commit it started from, as stored at its last delivery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StoredDiff {
    /// The commit the session's workspace was cloned at (the merge base of the branch and its base).
    pub base_sha: String,
    /// The branch's delivered head.
    pub head_sha: String,
    /// Every file the branch changes, as `git diff --shortstat` counts them (binary files count no lines).
    pub files_changed: u64,
    pub insertions: u64,
    pub deletions: u64,
    /// The files, by path, up to 3,000.
    pub files: Vec<FileDiff>,
    /// More files changed than are listed (3,000).
    pub truncated: bool,
}

/// `GET /v1/sessions/{id}/diff`: one page of the files a session's branch changes against the commit the
/// session started from (what `git diff --name-status <base>...sortie/<id>` lists), with each file's
/// counts and unified diff.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BranchDiff {
    /// `sortie/<session-id>`.
    pub branch: String,
    /// The base branch the session was asked for (null: the repository's default branch).
    pub base: Option<String>,
    /// Null until the session has delivered.
    pub base_sha: Option<String>,
    /// Null until the session has delivered.
    pub head_sha: Option<String>,
    /// Every file the branch changes (the page holds some of them), as `git diff --shortstat` counts.
    pub files_changed: u64,
    pub insertions: u64,
    pub deletions: u64,
    /// The files of this page, by path.
    pub files: Vec<FileDiff>,
    /// Pass as `offset` for the next page; null on the last.
    pub next_offset: Option<u32>,
    /// More files changed than sortie keeps (3,000): the branch itself has them all.
    pub truncated: bool,
}

/// `GET /v1/sessions/{id}/turns`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TurnList {
    pub turns: Vec<Turn>,
}

/// An AI SDK `UIMessage`, as `GET /v1/sessions/{id}/messages` returns them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UiMessage {
    pub id: String,
    pub role: UiRole,
    /// AI SDK message parts (`text`, `reasoning`, `dynamic-tool`, `data-*`, …).
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub parts: Vec<serde_json::Value>,
}

/// Who a message is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum UiRole {
    /// A prompt.
    User,
    /// The agent's answer to it.
    Assistant,
}

/// `GET /v1/usage`: one row per session and UTC day.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageReport {
    pub rows: Vec<UsageRow>,
}

/// Usage of one session on one UTC day.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageRow {
    pub session_id: SessionId,
    /// `YYYY-MM-DD`.
    pub day: String,
    pub compute_seconds: u64,
    pub models: Vec<ModelUsage>,
}

/// Tokens of one model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelUsage {
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A token's role (DESIGN §4). Ordered: each role may do what the roles below it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Reads sessions, turns, transcripts and usage.
    Viewer,
    /// Also creates, steers, stops, cancels and archives sessions.
    Operator,
    /// Also manages tokens, forge connections and model keys.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
            Self::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = crate::phase::UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|role| role.as_str() == s)
            .ok_or_else(|| crate::phase::UnknownName {
                kind: "role",
                value: s.to_owned(),
            })
    }
}

/// A vendor model API whose key a workspace keeps for the model proxy (DESIGN §7.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ModelApi {
    /// Anthropic's Messages API.
    Anthropic,
    /// OpenAI's API.
    Openai,
    /// Google's Gemini API.
    Gemini,
}

impl ModelApi {
    pub const ALL: [ModelApi; 3] = [ModelApi::Anthropic, ModelApi::Openai, ModelApi::Gemini];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Anthropic => "anthropic",
            Self::Openai => "openai",
            Self::Gemini => "gemini",
        }
    }
}

impl std::fmt::Display for ModelApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ModelApi {
    type Err = crate::phase::UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|api| api.as_str() == s)
            .ok_or_else(|| crate::phase::UnknownName {
                kind: "model api",
                value: s.to_owned(),
            })
    }
}

/// The longest model key the control plane takes, in bytes.
pub const MODEL_KEY_MAX_BYTES: usize = 4096;
/// The longest label of a model key, in characters.
pub const MODEL_KEY_LABEL_MAX_CHARS: usize = 200;

/// `PUT /v1/model-keys/{api}`: the workspace's key for one model API, replacing any earlier one.
/// Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetModelKeyRequest {
    /// The vendor key: 1 to 4096 bytes of printable ASCII, no whitespace. Never answered back.
    pub key: String,
    /// A note for people (at most 200 characters), e.g. which account the key belongs to.
    #[serde(default)]
    pub label: Option<String>,
}

impl std::fmt::Debug for SetModelKeyRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetModelKeyRequest")
            .field("key", &"[redacted]")
            .field("label", &self.label)
            .finish()
    }
}

/// A model key as the control plane shows it: which API, its label, when it was set and its
/// fingerprint. Never the key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelKey {
    pub api: ModelApi,
    pub label: Option<String>,
    /// RFC 3339 UTC: when this key was set.
    pub created_at: String,
    /// The key's last characters (at most 4, never more than a quarter of it), to tell keys apart;
    /// null when the server's master key cannot decrypt the stored key (set it again).
    pub fingerprint: Option<String>,
}

/// `GET /v1/model-keys`: the keys the token's workspace keeps, one per model API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelKeyList {
    /// The workspace's name.
    pub workspace: String,
    pub keys: Vec<ModelKey>,
}

/// What a forge is, which says what sortie does there besides pushing the session's branch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ForgeKind {
    /// GitHub or GitHub Enterprise: smart HTTP with the token as `x-access-token`, pull requests by its REST API.
    #[default]
    Github,
    /// Any other smart-HTTP git host: branches only, no pull requests.
    Git,
}

impl ForgeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Github => "github",
            Self::Git => "git",
        }
    }
}

impl std::str::FromStr for ForgeKind {
    type Err = crate::phase::UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::Github, Self::Git]
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| crate::phase::UnknownName {
                kind: "forge kind",
                value: s.to_owned(),
            })
    }
}

/// `PUT /v1/forge-connections/{host}`: the workspace's token for the forge at `host` (the authority of
/// its repository URLs: `github.com`, `git.example.com:8443`), replacing any earlier one. Its
/// `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetForgeConnectionRequest {
    /// The token (1 to 4096 bytes of printable ASCII, no whitespace) the gateway sends as Basic
    /// `x-access-token:<token>`. Never answered back, never inside a sandbox. Empty with `github_app`.
    #[serde(default)]
    pub token: String,
    /// Instead of a token: a GitHub App, whose installation tokens are minted per repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub github_app: Option<GitHubAppCredentials>,
    /// Default `github`.
    #[serde(default)]
    pub kind: Option<ForgeKind>,
    /// The forge's REST API base (`https://…`); for GitHub it defaults to `https://api.<host>` for
    /// github.com and `https://<host>/api/v3` for an Enterprise host.
    #[serde(default)]
    pub api_base: Option<String>,
    /// Which repositories' `@sortie` comments this workspace takes, and the sessions they start (a
    /// GitHub App connection with a webhook secret only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggers: Option<ForgeTriggers>,
}

/// What `@sortie` comments on a GitHub App's repositories do in this workspace (DESIGN §4, issue
/// triggers): the repositories taken, and the agent, egress and setup of the sessions they start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForgeTriggers {
    /// `owner/name`, or `owner/*` for every repository of an owner. A comment on any other repository
    /// is answered that it is not connected.
    pub repositories: Vec<String>,
    /// The agent of a session a comment starts; the server's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The model of such a session; the agent's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The egress allowlist of such a session.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_allow: Vec<String>,
    /// The setup script of such a session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// Whether a comment on a pull request sortie did not open starts a session on that pull
    /// request's head branch (delivered to `sortie/<id>` with a pull request into that branch).
    #[serde(default)]
    pub others_pull_requests: bool,
    /// The dashboard's address (`https://sortie.example.com`), for the links sortie answers with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard_url: Option<String>,
    /// A login (the App's bot user, `<app-slug>[bot]`) whose assignment to an issue starts a session on
    /// it, as `@sortie` in a comment would.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignee: Option<String>,
}

/// What `POST /v1/forges/github/webhook` made of a delivery: `pong`, `accepted`, `duplicate` or
/// `ignored`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForgeWebhookAnswer {
    pub status: String,
}

/// The most repository patterns one connection's triggers take.
pub const FORGE_TRIGGER_REPOSITORIES_MAX: usize = 100;

impl ForgeTriggers {
    /// Whether `owner/name` is one of the repositories taken (names compare as GitHub does, any case).
    pub fn takes(&self, owner: &str, name: &str) -> bool {
        self.repositories.iter().any(|pattern| match pattern.split_once('/') {
            Some((o, "*")) => o.eq_ignore_ascii_case(owner),
            Some((o, n)) => o.eq_ignore_ascii_case(owner) && n.eq_ignore_ascii_case(name),
            None => false,
        })
    }

    /// The link to a session on the dashboard, when its address is known.
    pub fn session_link(&self, id: &str) -> Option<String> {
        self.dashboard_url
            .as_ref()
            .map(|base| format!("{}/sessions/{id}", base.trim_end_matches('/')))
    }

    /// The repositories and dashboard address are well formed (the agent, egress and setup are the
    /// api's to check, as for a session).
    pub fn check(&self) -> Result<(), crate::validate::Refusal> {
        let refuse = |message: String| crate::validate::Refusal {
            code: crate::error::ErrorCode::ForgeConnectionInvalid,
            message,
        };
        if self.repositories.len() > FORGE_TRIGGER_REPOSITORIES_MAX {
            return Err(refuse(format!(
                "triggers.repositories has more than {FORGE_TRIGGER_REPOSITORIES_MAX} entries"
            )));
        }
        let part = |p: &str| {
            !p.is_empty()
                && p.len() <= 100
                && p != "."
                && p != ".."
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        for pattern in &self.repositories {
            let fine = pattern
                .split_once('/')
                .is_some_and(|(owner, name)| part(owner) && (name == "*" || part(name)));
            if !fine {
                return Err(refuse(format!(
                    "triggers.repositories: {:?} is not owner/name or owner/*",
                    pattern.chars().take(200).collect::<String>()
                )));
            }
        }
        if let Some(login) = &self.assignee {
            let fine = !login.is_empty()
                && login.len() <= 100
                && login.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_[]".contains(&b));
            if !fine {
                return Err(refuse(
                    "triggers.assignee must be a GitHub login (e.g. sortie-app[bot])".into(),
                ));
            }
        }
        if let Some(url) = &self.dashboard_url {
            let fine = (url.starts_with("https://") || url.starts_with("http://"))
                && url.len() <= 2048
                && !url.chars().any(|c| c.is_whitespace() || c.is_control());
            if !fine {
                return Err(refuse(
                    "triggers.dashboard_url must be an http(s):// URL without spaces".into(),
                ));
            }
        }
        Ok(())
    }
}

/// A GitHub App a forge connection acts as. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GitHubAppCredentials {
    /// The App ID or its client ID (`Iv23…`): what the App's JWT names as its issuer.
    pub app_id: String,
    /// The App's private key, PEM: GitHub's download (`BEGIN RSA PRIVATE KEY`) or PKCS#8. Sealed at
    /// rest, never answered back, never inside a sandbox.
    pub private_key: String,
    /// The App's webhook secret, with which `POST /v1/forges/github/webhook` checks each delivery's
    /// `X-Hub-Signature-256` (8 to 256 printable characters). Sealed at rest; without it the App's
    /// deliveries are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook_secret: Option<String>,
}

/// The shortest and longest webhook secret taken.
pub const GITHUB_WEBHOOK_SECRET_BYTES: std::ops::RangeInclusive<usize> = 8..=256;

impl std::fmt::Debug for GitHubAppCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitHubAppCredentials")
            .field("app_id", &self.app_id)
            .field("private_key", &"[redacted]")
            .field("webhook_secret", &self.webhook_secret.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

/// The longest App private key taken (a 4096-bit RSA PEM is about 3.3 KB).
pub const GITHUB_APP_KEY_MAX_BYTES: usize = 16 * 1024;

/// An App ID (digits) or client ID (`Iv…`): 1 to 64 ASCII letters and digits.
pub fn check_github_app_id(app_id: &str) -> Result<(), crate::validate::Refusal> {
    if app_id.is_empty() || app_id.len() > 64 || !app_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(crate::validate::Refusal {
            code: crate::error::ErrorCode::ForgeConnectionInvalid,
            message: "github_app.app_id must be the App ID or its client ID (letters and digits)".into(),
        });
    }
    Ok(())
}

impl std::fmt::Debug for SetForgeConnectionRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetForgeConnectionRequest")
            .field("token", &"[redacted]")
            .field("github_app", &self.github_app)
            .field("kind", &self.kind)
            .field("api_base", &self.api_base)
            .field("triggers", &self.triggers)
            .finish()
    }
}

/// A forge connection as the control plane shows it. Never the token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForgeConnection {
    pub host: String,
    pub kind: ForgeKind,
    /// Empty for a plain git host.
    pub api_base: String,
    /// RFC 3339 UTC: when this connection was set.
    pub created_at: String,
    /// The token's last characters, as for model keys; null when it cannot be decrypted (set it again).
    pub fingerprint: Option<String>,
    /// Set when the connection is a GitHub App (its ID or client ID) rather than a token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    /// The App's webhook secret is set: its deliveries are taken.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub webhook: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggers: Option<ForgeTriggers>,
}

/// `GET /v1/forge-connections`: the forges the token's workspace reaches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForgeConnectionList {
    /// The workspace's name.
    pub workspace: String,
    pub connections: Vec<ForgeConnection>,
}

/// A forge host as connections and repository URLs name it: `host` or `host:port`, lowercased; a
/// DNS name or an IP address, no user, path or scheme.
pub fn check_forge_host(host: &str) -> Result<String, crate::validate::Refusal> {
    let refuse = |why: &str| crate::validate::Refusal {
        code: crate::error::ErrorCode::ForgeConnectionInvalid,
        message: format!("forge host {host:?} {why}"),
    };
    let lower = host.to_ascii_lowercase();
    let (name, port) = match lower.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => (name, Some(port)),
        _ => (lower.as_str(), None),
    };
    if name.is_empty() || name.len() > 253 {
        return Err(refuse("is not a host name (e.g. github.com or git.example.com:8443)"));
    }
    if port.is_some_and(|p| p.parse::<u16>().map_or(true, |p| p == 0)) {
        return Err(refuse("has a port that is not 1 to 65535"));
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if !name.split('.').all(label_ok) {
        return Err(refuse("is not a host name (e.g. github.com or git.example.com:8443)"));
    }
    Ok(lower)
}

/// The forge host of an `https://` repository URL (its authority, lowercased), the key of the
/// workspace's forge connection for it; `None` for anything else.
pub fn repo_forge_host(repo: &str) -> Option<String> {
    let rest = repo.strip_prefix("https://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    if authority.contains('@') {
        return None;
    }
    check_forge_host(authority).ok()
}

/// A forge token: the rules of a model key, refused as `FORGE_CONNECTION_INVALID` and never quoted.
pub fn check_forge_token(token: &str) -> Result<(), crate::validate::Refusal> {
    check_model_key(token).map_err(|refusal| crate::validate::Refusal {
        code: crate::error::ErrorCode::ForgeConnectionInvalid,
        message: refusal.message.replacen("key", "token", 1),
    })
}

/// A model key: 1 to 4096 bytes, each printable ASCII other than space. The refusal never quotes it.
pub fn check_model_key(key: &str) -> Result<(), crate::validate::Refusal> {
    let refuse = |message: String| crate::validate::Refusal {
        code: crate::error::ErrorCode::ModelKeyInvalid,
        message,
    };
    if key.is_empty() {
        return Err(refuse("key is empty".to_owned()));
    }
    if key.len() > MODEL_KEY_MAX_BYTES {
        return Err(refuse(format!(
            "key is {} bytes; the limit is {MODEL_KEY_MAX_BYTES} bytes",
            key.len()
        )));
    }
    if let Some(position) = key.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(refuse(format!(
            "key has a character that is whitespace or not printable ASCII at byte {position}; \
             a model key is printable ASCII without spaces or newlines"
        )));
    }
    Ok(())
}

/// A model key's label: at most 200 characters, no control characters.
pub fn check_model_key_label(label: &str) -> Result<(), crate::validate::Refusal> {
    let chars = label.chars().count();
    let refuse = |message: String| crate::validate::Refusal {
        code: crate::error::ErrorCode::InvalidRequest,
        message,
    };
    if chars > MODEL_KEY_LABEL_MAX_CHARS {
        return Err(refuse(format!(
            "label is {chars} characters; the limit is {MODEL_KEY_LABEL_MAX_CHARS}"
        )));
    }
    if label.chars().any(char::is_control) {
        return Err(refuse("label has control characters".to_owned()));
    }
    Ok(())
}

/// The fingerprint of a model key: its last characters, 4 for a key of 16 bytes or more and never
/// more than a quarter of it (a key shorter than 4 bytes has an empty fingerprint).
pub fn model_key_fingerprint(key: &[u8]) -> String {
    let shown = (key.len() / 4).min(4);
    String::from_utf8_lossy(&key[key.len() - shown..]).into_owned()
}

/// Formats epoch milliseconds as RFC 3339 UTC with millisecond precision, e.g. `2026-12-02T13:50:31.123Z`.
pub fn rfc3339_from_epoch_ms(epoch_ms: i64) -> String {
    let seconds = epoch_ms.div_euclid(1000);
    let millis = epoch_ms.rem_euclid(1000);
    let days = seconds.div_euclid(86_400);
    let second_of_day = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        second_of_day / 3600,
        (second_of_day % 3600) / 60,
        second_of_day % 60
    )
}

/// The UTC day (`YYYY-MM-DD`) of an epoch-millisecond time.
pub fn utc_day_from_epoch_ms(epoch_ms: i64) -> String {
    let (year, month, day) = civil_from_days(epoch_ms.div_euclid(86_400_000));
    format!("{year:04}-{month:02}-{day:02}")
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_request_rejects_unknown_fields() {
        let ok: Result<CreateSessionRequest, _> = serde_json::from_str(r#"{"repo":"/r","task":"t"}"#);
        assert!(ok.is_ok());
        let unknown: Result<CreateSessionRequest, _> = serde_json::from_str(r#"{"repo":"/r","task":"t","x":1}"#);
        assert!(unknown.is_err());
        let nested: Result<CreateSessionRequest, _> =
            serde_json::from_str(r#"{"repo":"/r","task":"t","egress":{"allow":[],"deny":[]}}"#);
        assert!(nested.is_err());
    }

    #[test]
    fn times_format_as_rfc3339_utc() {
        assert_eq!(rfc3339_from_epoch_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_from_epoch_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_from_epoch_ms(1_796_219_431_123), "2026-12-02T13:50:31.123Z");
        assert_eq!(rfc3339_from_epoch_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(utc_day_from_epoch_ms(1_796_219_431_123), "2026-12-02");
    }

    #[test]
    fn model_apis_round_trip_and_unknown_ones_are_refused() {
        for kind in [ForgeKind::Github, ForgeKind::Git] {
            assert_eq!(kind.as_str().parse::<ForgeKind>(), Ok(kind));
        }
        for api in ModelApi::ALL {
            assert_eq!(api.as_str().parse::<ModelApi>(), Ok(api));
            assert_eq!(
                serde_json::to_value(api).expect("json"),
                serde_json::json!(api.as_str())
            );
        }
        for unknown in ["Anthropic", "open-ai", "", "azure", "anthropic "] {
            assert!(unknown.parse::<ModelApi>().is_err(), "{unknown:?}");
        }
    }

    #[test]
    fn model_keys_are_printable_ascii_without_whitespace() {
        let too_long = "k".repeat(MODEL_KEY_MAX_BYTES + 1);
        let longest = "k".repeat(MODEL_KEY_MAX_BYTES);
        for (key, ok) in [
            ("sk-ant-api03-abcdEFGH_1234", true),
            ("x", true),
            (longest.as_str(), true),
            ("", false),
            (too_long.as_str(), false),
            ("sk-ant abc", false),
            ("sk-ant\nabc", false),
            ("sk-ant\tabc", false),
            ("sk-\u{7f}abc", false),
            ("sk-é", false),
        ] {
            let checked = check_model_key(key);
            assert_eq!(checked.is_ok(), ok, "{key:?}");
            if let Err(refusal) = checked {
                assert_eq!(refusal.code, crate::ErrorCode::ModelKeyInvalid);
                if key.len() > 3 {
                    assert!(!refusal.message.contains(key), "the refusal never quotes the key");
                }
            }
        }
        assert!(check_model_key_label("team account").is_ok());
        assert!(check_model_key_label(&"l".repeat(MODEL_KEY_LABEL_MAX_CHARS + 1)).is_err());
        assert!(check_model_key_label("a\nb").is_err());
    }

    #[test]
    fn fingerprints_show_at_most_a_quarter_of_the_key() {
        assert_eq!(model_key_fingerprint(b"sk-ant-api03-0123456789abcd"), "abcd");
        assert_eq!(model_key_fingerprint(b"0123456789abcdef"), "cdef");
        assert_eq!(model_key_fingerprint(b"01234567"), "67");
        assert_eq!(model_key_fingerprint(b"abc"), "");
        assert_eq!(model_key_fingerprint(b""), "");
    }

    #[test]
    fn a_set_key_request_never_prints_its_key() {
        let request: SetModelKeyRequest =
            serde_json::from_str(r#"{"key":"sk-secret-value","label":"ops"}"#).expect("parse");
        let printed = format!("{request:?}");
        assert!(
            !printed.contains("sk-secret-value") && printed.contains("ops"),
            "{printed}"
        );
        assert!(serde_json::from_str::<SetModelKeyRequest>(r#"{"key":"k","extra":1}"#).is_err());
    }

    #[test]
    fn roles_are_ordered_by_power() {
        assert!(Role::Viewer < Role::Operator && Role::Operator < Role::Admin);
        assert_eq!("operator".parse::<Role>(), Ok(Role::Operator));
        assert!("root".parse::<Role>().is_err());
    }

    #[test]
    fn forge_hosts_are_authorities_and_repo_urls_name_theirs() {
        assert_eq!(check_forge_host("GitHub.com"), Ok("github.com".to_owned()));
        assert_eq!(
            check_forge_host("git.example.com:8443"),
            Ok("git.example.com:8443".to_owned())
        );
        assert_eq!(check_forge_host("127.0.0.1:41234"), Ok("127.0.0.1:41234".to_owned()));
        for bad in [
            "",
            "https://github.com",
            "github.com/o",
            "a..b",
            "-a.com",
            "x:0",
            "x:70000",
            "u@h",
            "h :1",
        ] {
            assert_eq!(
                check_forge_host(bad).map_err(|r| r.code),
                Err(crate::ErrorCode::ForgeConnectionInvalid),
                "{bad:?}"
            );
        }
        assert_eq!(
            repo_forge_host("https://GitHub.com/o/r.git"),
            Some("github.com".to_owned())
        );
        assert_eq!(
            repo_forge_host("https://127.0.0.1:8443/o/r"),
            Some("127.0.0.1:8443".to_owned())
        );
        assert_eq!(repo_forge_host("https://user:pw@github.com/o/r"), None);
        assert_eq!(repo_forge_host("/srv/git/r"), None);
        assert!(check_forge_token("ghp_abc").is_ok());
        let refusal = check_forge_token("has space").expect_err("space");
        assert_eq!(refusal.code, crate::ErrorCode::ForgeConnectionInvalid);
        assert!(!refusal.message.contains("has space"), "{}", refusal.message);
    }
}
