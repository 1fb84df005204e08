//! The store's rows: what it takes and what it returns.

use sortie_protocol::api::Role;
use sortie_protocol::phase::TurnMode;
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};

/// Which local repositories a workspace may use (DESIGN §4).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepoAccess {
    /// Any local path the server can read (the embedded install's `default` workspace).
    pub any_local_path: bool,
    /// Otherwise, only paths under these absolute roots.
    pub allowed_roots: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceRow {
    pub id: String,
    pub name: String,
    pub repo_access: RepoAccess,
    pub created_at: i64,
}

/// Who a token speaks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub token_id: String,
    pub workspace_id: String,
    pub workspace_name: String,
    pub role: Role,
}

/// A session to create, already validated by the api.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewSession {
    pub id: SessionId,
    pub workspace_id: String,
    pub repo: String,
    pub base: Option<String>,
    pub agent: String,
    pub model: Option<String>,
    pub title: String,
    pub egress_allow: Vec<String>,
    pub setup: Option<String>,
    pub task: String,
    /// Its caps, the workspace's defaults already applied.
    pub budget: sortie_protocol::api::Budget,
}

/// A turn to add by a steer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewTurn {
    pub prompt: String,
    pub mode: TurnMode,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRow {
    pub id: SessionId,
    pub workspace_id: String,
    pub workspace_name: String,
    pub repo: String,
    pub base: Option<String>,
    pub agent: String,
    pub model: Option<String>,
    pub title: String,
    pub phase: SessionPhase,
    pub queued_reason: Option<String>,
    pub n_turns: u32,
    /// Turns `accepted` and not yet claimed.
    pub n_waiting: u32,
    pub current_turn: Option<u32>,
    pub head_sha: Option<String>,
    pub pr: Option<(String, u64)>,
    pub failure: Option<(FailureCode, String)>,
    pub egress_allow: Vec<String>,
    pub setup: Option<String>,
    pub archived: bool,
    pub resume_requested: bool,
    pub prompts_bytes: u64,
    pub compute_ms: u64,
    /// When retention pruned its transcript.
    pub pruned_at: Option<i64>,
    /// Its caps: model tokens, CPU milliseconds; and since when the token cap holds its agent.
    pub budget_tokens: Option<u64>,
    pub budget_compute_ms: Option<u64>,
    pub budget_paused_at: Option<i64>,
    /// The largest peak memory of any of its sandboxes.
    pub peak_memory_bytes: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub created_at: i64,
    pub updated_at: i64,
    /// A sandbox of the session is recorded (made, live or being torn down).
    pub has_sandbox: bool,
}

/// Why the worker should end a running turn early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopRequest {
    /// `POST …/stop`.
    Stop,
    /// A steer with `mode: interrupt`.
    Interrupt,
    /// `POST …/cancel`.
    Cancel,
}

impl StopRequest {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Interrupt => "interrupt",
            Self::Cancel => "cancel",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "stop" => Some(Self::Stop),
            "interrupt" => Some(Self::Interrupt),
            "cancel" => Some(Self::Cancel),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnRow {
    /// CPU its sandbox used during it, in milliseconds, and the sandbox's peak memory up to its end.
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
    pub session_id: SessionId,
    pub n: u32,
    pub prompt: String,
    pub status: TurnStatus,
    pub mode: TurnMode,
    pub stop_requested: Option<StopRequest>,
    pub priming: Option<String>,
    pub head_sha: Option<String>,
    pub failure: Option<(FailureCode, String)>,
    /// Milliseconds by phase (queued, clone, sandbox, setup, first_part, agent_turn, delivery), measured by the host.
    pub timings: Option<std::collections::BTreeMap<String, u64>>,
    /// The worker that claimed the turn to run it.
    pub claimed_by: Option<String>,
    /// The nonce the worker started the turn with at the driver.
    pub driver_nonce: Option<String>,
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub completed_at: Option<i64>,
}

/// Which sessions a list returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionFilter {
    pub phase: Option<SessionPhase>,
    pub repo: Option<String>,
    pub archived: bool,
    pub limit: u32,
    /// Only sessions older than this one (the previous page's last id).
    pub before: Option<SessionId>,
}

impl Default for SessionFilter {
    fn default() -> Self {
        Self {
            phase: None,
            repo: None,
            archived: false,
            limit: 50,
            before: None,
        }
    }
}

/// One part to store: its 0-based index within the turn and its UI message chunk, verbatim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewPart {
    pub part_index: u32,
    pub payload: String,
    /// The part's index in the sandbox's stream, for a part that came from it; `None` for the host's own.
    pub driver_index: Option<u32>,
}

/// How far a turn's stored transcript got, and the session's: where a recorder goes on, and what
/// the transcript caps count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TranscriptProgress {
    /// The highest part index stored for the turn.
    pub last_index: Option<u32>,
    /// The highest index in the sandbox's stream of a part stored for the turn.
    pub driver_cursor: Option<u32>,
    pub turn_parts: u64,
    pub turn_bytes: u64,
    pub session_parts: u64,
    pub session_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPart {
    pub turn: u32,
    pub part_index: u32,
    /// Store-allocated, increasing within a session.
    pub seq: i64,
    pub payload: String,
}

/// How much one read of a turn's parts ([`crate::Store::turn_parts_after`]) may return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartsLimit {
    /// The most parts.
    pub parts: u32,
    /// The most bytes of payload; the first part is returned whatever its size, so that a reader
    /// going slice by slice always moves on.
    pub bytes: u64,
}

impl PartsLimit {
    /// No limit: everything stored.
    pub const NONE: Self = Self {
        parts: u32::MAX,
        bytes: u64::MAX,
    };
}

/// The size of a stored transcript (a turn's or a session's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartsSize {
    pub parts: u64,
    /// Bytes of the payloads as stored (UTF-8 JSON text).
    pub bytes: u64,
}

/// Tokens one model call used, as the model proxy reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenUsage {
    pub session_id: SessionId,
    pub turn: u32,
    pub model: String,
    pub epoch_ms: i64,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// Usage rows by session, UTC day and model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageRecords {
    /// `(session, day, model, input, output)`.
    pub tokens: Vec<(SessionId, String, String, u64, u64)>,
    /// `(session, day, compute ms)`.
    pub compute: Vec<(SessionId, String, u64)>,
}

/// A live sandbox as the store knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxRow {
    pub session_id: SessionId,
    pub workspace_id: String,
    pub backend: String,
    pub handle: String,
    pub worker_id: Option<String>,
    pub created_at: i64,
}

/// A workspace's connection to a forge (see [`crate::keys`]): its token only as ciphertext and nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForgeConnectionRow {
    pub workspace_id: String,
    /// `host` or `host:port`, lowercase: what a repository URL's authority must equal.
    pub host: String,
    pub kind: sortie_protocol::api::ForgeKind,
    /// The forge's REST API (pull requests); empty for a plain git host.
    pub api_base: String,
    pub token_ciphertext: String,
    pub token_nonce: String,
    pub created_at: i64,
    /// A GitHub App's ID (or client ID): the sealed secret is then its private key.
    pub app_id: Option<String>,
    /// The App's webhook secret, sealed (ciphertext, nonce) like the key.
    pub webhook_secret: Option<(String, String)>,
    /// The JSON of the connection's `sortie_protocol::api::ForgeTriggers`.
    pub triggers: Option<String>,
}

/// A forge webhook delivery whose signature a connection's secret verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewForgeDelivery {
    /// The forge's delivery id (`X-GitHub-Delivery`), the same on a redelivery.
    pub delivery_id: String,
    /// What the signed body asks, as a key of its own (`comment:<host>/<repo>#<id>`): the same request
    /// under another delivery id is not recorded again.
    pub request_key: String,
    pub workspace_id: String,
    pub host: String,
    pub event: String,
    pub payload: String,
}

/// A recorded delivery, as a worker claims it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForgeDeliveryRow {
    pub delivery_id: String,
    pub workspace_id: String,
    pub host: String,
    pub event: String,
    pub payload: String,
    pub received_at: i64,
}

/// A token of a workspace, without its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRow {
    pub id: String,
    pub workspace_id: String,
    pub workspace_name: String,
    pub role: Role,
    pub label: Option<String>,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    pub expires_at: Option<i64>,
    /// Within a minute: uses are written at most once a minute per token.
    pub last_used_at: Option<i64>,
}

/// A repository's preset for new sessions (`repo_presets`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresetRow {
    pub repo: String,
    pub agent: Option<String>,
    pub setup: Option<String>,
    pub egress_allow: Vec<String>,
    pub updated_at: i64,
}

/// A workspace's sealed key for one model API (see [`crate::keys`]): only ciphertext and nonce, base64.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelKeyRow {
    pub workspace_id: String,
    pub api: sortie_protocol::api::ModelApi,
    pub key_ciphertext: String,
    pub key_nonce: String,
    pub label: Option<String>,
    pub created_at: i64,
}

/// What an event says changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventChange {
    /// A session's phase became this.
    Phase(SessionPhase),
    /// A turn's status became this.
    Status(TurnStatus),
}

/// One change of a session's phase or a turn's status, written with the change itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRow {
    /// Increasing in commit order, across every workspace.
    pub seq: u64,
    pub workspace_id: String,
    pub session_id: SessionId,
    /// The turn of a status change.
    pub turn: Option<u32>,
    pub change: EventChange,
    /// Why, when the change is to `failed`.
    pub failure: Option<(FailureCode, String)>,
    pub at_ms: i64,
}

impl EventRow {
    /// The event as clients and webhooks receive it.
    pub fn to_event(&self) -> sortie_protocol::api::Event {
        use sortie_protocol::api::{Event, EventKind, Failure, rfc3339_from_epoch_ms};
        let (kind, phase, status) = match self.change {
            EventChange::Phase(phase) => (EventKind::SessionPhase, Some(phase), None),
            EventChange::Status(status) => (EventKind::TurnStatus, None, Some(status)),
        };
        Event {
            seq: self.seq,
            kind,
            session: self.session_id.clone(),
            turn: self.turn,
            phase,
            status,
            failure: self.failure.clone().map(|(code, reason)| Failure { code, reason }),
            at: rfc3339_from_epoch_ms(self.at_ms),
        }
    }
}

/// The events after a reader's last one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventPage {
    pub events: Vec<EventRow>,
    /// The newest event number pruned: a reader whose last event is older has lost the ones between.
    pub pruned_through: u64,
}

/// What an `Idempotency-Key` holds when a request claims it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdempotencyClaim {
    /// The key is the request's now: answer it, then record the answer.
    Fresh,
    /// The same request was answered before: this is its answer.
    Answered { status: u16, body: String },
    /// The same request is being answered right now.
    InFlight,
    /// The key was used for a different request.
    OtherRequest,
}

/// A webhook to create, its secret already sealed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewWebhook {
    pub id: String,
    pub workspace_id: String,
    pub url: String,
    pub secret_ciphertext: String,
    pub secret_nonce: String,
    /// The event kinds it receives (`session.phase`, `turn.status`).
    pub events: Vec<String>,
    /// The newest event it does not receive (it gets what happens after it is made).
    pub cursor: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookRow {
    pub id: String,
    pub workspace_id: String,
    pub url: String,
    pub secret_ciphertext: String,
    pub secret_nonce: String,
    pub events: Vec<String>,
    /// The newest event turned into its deliveries.
    pub cursor: u64,
    pub created_at: i64,
}

/// A delivery to enqueue: one event's body for one webhook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewDelivery {
    pub id: String,
    pub event_seq: u64,
    pub kind: String,
    /// The JSON body, exactly as it will be signed and sent.
    pub payload: String,
}

/// Where a delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryState {
    /// Waiting for its next attempt.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Given up on after the retry window.
    Failed,
}

impl DeliveryState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryRow {
    pub id: String,
    pub webhook_id: String,
    pub event_seq: u64,
    pub kind: String,
    pub payload: String,
    pub state: DeliveryState,
    pub attempts: u32,
    pub next_at: i64,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub created_at: i64,
    pub delivered_at: Option<i64>,
}

/// How one attempt at a delivery went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The receiver answered 2xx with this status.
    Delivered { status: u16 },
    /// Try again at `next_at`; what went wrong this time.
    Retry {
        status: Option<u16>,
        error: String,
        next_at: i64,
    },
    /// No more attempts.
    GaveUp { status: Option<u16>, error: String },
}

/// A sandbox's usage as its cgroups count it since it was made (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SandboxReading {
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
}

/// An admin action to record: who (`tok_…`, or `cli` for the local admin commands) did what to which.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditEntry {
    pub workspace_id: String,
    pub actor: String,
    /// `token.create`, `token.revoke`, `model_key.set`, `model_key.remove`, `forge.set`, `forge.remove`,
    /// `webhook.create`, `webhook.delete`.
    pub action: String,
    /// What it was done to: a token id, a key's vendor, a forge host, a webhook id.
    pub target: String,
}

/// A recorded admin action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    pub id: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub target: String,
}

/// A session retention may prune, and what its transcript holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrunableSession {
    pub id: SessionId,
    pub repo: String,
    pub phase: SessionPhase,
    pub updated_at: i64,
    pub parts: u64,
    pub parts_bytes: u64,
}
