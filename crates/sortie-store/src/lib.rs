//! The store: every durable fact of sortie (workspaces, tokens, sessions, turns, parts, tickets'
//! nonces, usage, keys, sandboxes) behind role-sized traits ([`ControlPlane`], [`Ledger`],
//! [`Transcripts`], [`Tickets`], [`Secrets`]) that [`Store`] unites.
//!
//! One implementation, [`SqlStore`], serves SQLite (the embedded default) and PostgreSQL (scale-out)
//! through one SQL code path on sqlx's `Any` driver: portable SQL, `$n` placeholders, TEXT ids, epoch-ms
//! integers. Every phase or status change is a compare-and-set (`UPDATE … WHERE phase = $expected`)
//! allowed by the tables in `sortie_protocol::phase`. SQL lives in this crate and nowhere else;
//! callers see [`StoreError`], never `sqlx::Error`.

mod error;
pub mod evidence;
pub mod keys;
pub mod limits;
mod model;
mod sql;
pub mod testing;

pub use error::StoreError;
pub use evidence::{dashboard_link, session_evidence};
pub use keys::{KeyError, KeyRing, Secret, workspace_forge_token, workspace_model_key};
pub use model::*;
pub use sql::{Backend, SqlStore};

use async_trait::async_trait;
use sortie_protocol::api::Role;
use sortie_protocol::{SessionId, SessionPhase, TurnStatus};

/// The result of every store call.
pub type StoreResult<T> = Result<T, StoreError>;

/// Everything sortie keeps, as one store: every role trait at once ([`SqlStore`] is all of them).
/// Methods that take a `workspace_id` never see another workspace's rows: a session of another
/// workspace is [`StoreError::NotFound`]. A role holds the narrowest view it needs; the gateway's is
/// [`GatewayStore`].
pub trait Store: ControlPlane + Ledger + GatewayStore + Secrets + ForgeEvents + Retention {}

impl<T: ControlPlane + Ledger + Transcripts + Tickets + Secrets + ForgeEvents + Retention> Store for T {}

/// What the gateway reads and claims: transcripts (and a chat's steer) and ticket nonces, nothing else.
pub trait GatewayStore: Transcripts + Tickets {}

impl<T: Transcripts + Tickets> GatewayStore for T {}

/// What the api role reads and changes: workspaces and tokens, sessions and turns as users change them,
/// presets, the event log, idempotency keys, webhooks and their deliveries, usage and stored diffs.
#[async_trait]
pub trait ControlPlane: Send + Sync + 'static {
    /// Succeeds when the database answers and migrations are applied.
    async fn ping(&self) -> StoreResult<()>;
    /// Turns accepted and waiting for a worker, in every workspace.
    async fn queued_turns(&self) -> StoreResult<u64>;
    /// Raises a session's caps by `tokens` and `compute_ms` (a cap it did not have starts at what it used).
    async fn raise_budget(
        &self,
        workspace_id: &str,
        session_id: &SessionId,
        tokens: Option<u64>,
        compute_ms: Option<u64>,
    ) -> StoreResult<SessionRow>;
    /// The workspace's default budget and quotas.
    async fn workspace_limits(&self, workspace_id: &str) -> StoreResult<sortie_protocol::api::WorkspaceLimits>;
    async fn set_workspace_limits(
        &self,
        workspace_id: &str,
        limits: &sortie_protocol::api::WorkspaceLimits,
    ) -> StoreResult<()>;

    /// Creates a workspace; [`StoreError::Conflict`] if the name is taken.
    async fn create_workspace(&self, name: &str, repo_access: RepoAccess) -> StoreResult<WorkspaceRow>;
    async fn workspace_by_name(&self, name: &str) -> StoreResult<WorkspaceRow>;
    async fn workspace(&self, workspace_id: &str) -> StoreResult<WorkspaceRow>;
    /// Stores a token's hash (never the token) with its role and its expiry (epoch ms, `None`: never);
    /// returns the token's public id.
    async fn create_token(
        &self,
        workspace_id: &str,
        role: Role,
        token_hash: &str,
        label: Option<&str>,
        expires_at: Option<i64>,
    ) -> StoreResult<String>;
    /// The workspace and role of a token neither revoked nor expired, by the hash of its secret.
    async fn principal_by_token_hash(&self, token_hash: &str) -> StoreResult<Principal>;
    /// Notes that a token was used at `at` (epoch ms).
    async fn touch_token(&self, token_id: &str, at: i64) -> StoreResult<()>;
    /// Appends an admin action to the workspace's audit log.
    async fn record_audit(&self, entry: &AuditEntry) -> StoreResult<()>;
    /// The workspace's audit log, newest first: at most `limit` entries older than entry `before`.
    async fn audit_log(&self, workspace_id: &str, before: Option<i64>, limit: u32) -> StoreResult<Vec<AuditRow>>;
    /// Writes the session (phase `queued`) and its turn 1 (`accepted`) in one transaction.
    async fn create_session(&self, new: NewSession) -> StoreResult<SessionRow>;
    /// Newest first; pages with [`SessionFilter::before`].
    async fn list_sessions(&self, workspace_id: &str, filter: &SessionFilter) -> StoreResult<Vec<SessionRow>>;
    /// Asks the worker to stop the running turn; [`StoreError::NoTurnRunning`] if none runs.
    async fn request_stop(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<TurnRow>;
    /// Ends the session: phase `canceled`, waiting turns canceled, the running turn asked to stop.
    /// Canceling a canceled session changes nothing.
    async fn cancel(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow>;
    /// Queues a hibernated session for re-provisioning; other live phases are left as they are.
    async fn resume(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow>;
    /// Hides or shows a session in the default list. Archiving refuses a session with a turn in flight.
    /// Replaces the session's egress allowlist (already validated); refused for a canceled session.
    async fn set_egress_allow(
        &self,
        workspace_id: &str,
        session_id: &SessionId,
        allow: &[String],
    ) -> StoreResult<SessionRow>;
    async fn set_archived(&self, workspace_id: &str, session_id: &SessionId, archived: bool)
    -> StoreResult<SessionRow>;
    /// The tokens of a workspace (or of every workspace), newest first, revoked and expired ones included.
    async fn tokens(&self, workspace_id: Option<&str>) -> StoreResult<Vec<TokenRow>>;
    /// Revokes a token of the workspace: `false` if it has none with this id or it was revoked already.
    async fn revoke_token(&self, workspace_id: &str, token_id: &str) -> StoreResult<bool>;
    /// The workspace's repository presets, by repository.
    async fn presets(&self, workspace_id: &str) -> StoreResult<Vec<PresetRow>>;
    /// Sets (or replaces) the preset of one repository.
    async fn put_preset(&self, workspace_id: &str, preset: &PresetRow) -> StoreResult<()>;
    /// Removes a repository's preset: `false` if it had none.
    async fn delete_preset(&self, workspace_id: &str, repo: &str) -> StoreResult<bool>;
    /// The session's stored branch diff, if it has delivered.
    async fn branch_diff(&self, session_id: &SessionId) -> StoreResult<Option<sortie_protocol::api::StoredDiff>>;
    /// Changes (to a new value) whenever this process commits an event, and, where
    /// [`Store::hears_other_processes`], whenever another process does. Otherwise events another process
    /// writes are seen only by reading, so a reader also reads on a timer.
    fn event_signal(&self) -> tokio::sync::watch::Receiver<u64>;
    /// Whether [`Store::event_signal`] also changes for other processes' commits (PostgreSQL's
    /// `LISTEN/NOTIFY`), so that a reader's timer is only a safety net.
    fn hears_other_processes(&self) -> bool {
        false
    }
    /// The newest event's number, of any workspace (0 when there is none): where a reader that wants
    /// only what happens from now on starts.
    async fn latest_event(&self) -> StoreResult<u64>;
    /// The workspace's events numbered above `after`, oldest first, at most `limit`; with `None` for
    /// the workspace, every workspace's (the webhook outbox).
    async fn events_after(&self, workspace_id: Option<&str>, after: u64, limit: u32) -> StoreResult<EventPage>;
    /// Forgets events older than `before_ms`; returns how many.
    async fn prune_events(&self, before_ms: i64) -> StoreResult<u64>;
    /// Claims `key` of the workspace for a request (its endpoint `scope` and a hash of its body); a key
    /// first claimed before `expired_before_ms` counts as unused (and such keys are forgotten).
    async fn claim_idempotency_key(
        &self,
        workspace_id: &str,
        key: &str,
        scope: &str,
        request_hash: &str,
        expired_before_ms: i64,
    ) -> StoreResult<IdempotencyClaim>;
    /// Records the answer to the request that claimed `key`.
    async fn answer_idempotency_key(&self, workspace_id: &str, key: &str, status: u16, body: &str) -> StoreResult<()>;
    /// Gives `key` up (its request failed before it changed anything), so a retry runs afresh.
    async fn release_idempotency_key(&self, workspace_id: &str, key: &str) -> StoreResult<()>;
    async fn create_webhook(&self, new: NewWebhook) -> StoreResult<WebhookRow>;
    /// The workspace's webhooks, or every workspace's with `None` (the dispatcher), oldest first.
    async fn webhooks(&self, workspace_id: Option<&str>) -> StoreResult<Vec<WebhookRow>>;
    /// Deletes a webhook of the workspace and its deliveries; `false` if it has none by that id.
    async fn delete_webhook(&self, workspace_id: &str, webhook_id: &str) -> StoreResult<bool>;
    /// Enqueues deliveries and moves the webhook's cursor from `from` to `to` in one transaction;
    /// `false` (nothing written) if the cursor was no longer `from` (another dispatcher did it).
    async fn enqueue_deliveries(
        &self,
        webhook_id: &str,
        from: u64,
        to: u64,
        deliveries: &[NewDelivery],
    ) -> StoreResult<bool>;
    /// Claims up to `limit` pending deliveries due at `now_ms` until `lease_until_ms` (another
    /// dispatcher skips them until then), oldest first.
    async fn claim_due_deliveries(&self, now_ms: i64, lease_until_ms: i64, limit: u32)
    -> StoreResult<Vec<DeliveryRow>>;
    /// Records one attempt at a delivery.
    async fn record_delivery_attempt(&self, delivery_id: &str, outcome: &AttemptOutcome) -> StoreResult<()>;
    /// A webhook's deliveries, newest first.
    async fn webhook_deliveries(
        &self,
        workspace_id: &str,
        webhook_id: &str,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryRow>>;
    /// Usage of the workspace's sessions, by session and UTC day.
    async fn usage(&self, workspace_id: &str, session_id: Option<&SessionId>) -> StoreResult<UsageRecords>;
}

/// The ledger as the worker changes it: claims, phase and status changes, a turn's end, what the host
/// established of a turn (nonce, timings, pushed head, diff, pull request), live sandboxes, metering.
#[async_trait]
pub trait Ledger: Send + Sync + 'static {
    /// Claims the oldest waiting turn of a queued session: turn `accepted → running`, session
    /// `queued → provisioning` (or `running` when the sandbox is warm). `None` if another claim won.
    async fn claim_turn(&self, session_id: &SessionId, warm: bool, worker_id: &str) -> StoreResult<Option<TurnRow>>;
    /// A compare-and-set of the session's phase; `false` if the phase was not `from` any more.
    async fn transition_session(
        &self,
        session_id: &SessionId,
        from: SessionPhase,
        to: SessionPhase,
    ) -> StoreResult<bool>;
    /// Ends a running turn; `false` if it was not running any more. The worker ends a turn with
    /// [`Ledger::end_turn`]; this alone is for a turn that fails before its settlement (a vendor's refusal).
    async fn finish_turn(&self, session_id: &SessionId, n: u32, outcome: TurnOutcome) -> StoreResult<bool>;
    /// Ends turn `n` and moves its session, in one transaction: the turn takes `ending` if it still
    /// runs (one that already ended keeps its end); a session still in the turn's phases (`provisioning`,
    /// `running`, `delivering`) is settled — `queued` when turns wait behind, else `failed` when the
    /// ending failed or was lost, else `idle` — passing through `delivering` from `running` as every
    /// turn's session does. Any other phase (`canceling`, a session settled already) is left as it is.
    /// Returns the session's phase after it.
    async fn end_turn(&self, session_id: &SessionId, n: u32, ending: TurnOutcome) -> StoreResult<SessionPhase>;
    /// Puts back in the queue a turn its worker claimed but never started at a driver (no nonce, nothing
    /// stored of its transcript), with its session, in one transaction: `false` if the turn no longer
    /// qualifies (its agent may have run: it is `lost` instead).
    async fn requeue_unstarted_turn(&self, session_id: &SessionId, n: u32) -> StoreResult<bool>;
    /// Sessions with work for a worker (queued with a waiting turn or a resume request), oldest first.
    async fn claimable_sessions(&self, limit: u32) -> StoreResult<Vec<SessionRow>>;
    /// Every session in one of `phases`, of any workspace (the worker's reconciliation at start).
    async fn sessions_in_phases(&self, phases: &[SessionPhase]) -> StoreResult<Vec<SessionRow>>;
    /// One session of any workspace (the worker and gateway act for the system, not a token).
    async fn session_by_id(&self, session_id: &SessionId) -> StoreResult<SessionRow>;
    /// One turn of a session.
    async fn turn(&self, session_id: &SessionId, n: u32) -> StoreResult<TurnRow>;
    /// Says why a queued session waits (`None` clears it); a no-op unless the session is queued.
    async fn set_queued_reason(&self, session_id: &SessionId, reason: Option<&str>) -> StoreResult<()>;
    /// Ends a turn's phase of the session from `from`: `queued` if turns wait behind, else `failed`
    /// when `failed`, else `idle`, all in one compare-and-set. `None` if the phase was not `from`.
    async fn settle_session(
        &self,
        session_id: &SessionId,
        from: SessionPhase,
        failed: bool,
    ) -> StoreResult<Option<SessionPhase>>;
    /// Claims a resume without a prompt: `queued → provisioning` when no turn waits. `false` if lost.
    async fn claim_resume(&self, session_id: &SessionId) -> StoreResult<bool>;
    /// Records how a turn's agent was primed and how long its phases took.
    async fn set_turn_details(
        &self,
        session_id: &SessionId,
        n: u32,
        priming: Option<&str>,
        timings: Option<&std::collections::BTreeMap<String, u64>>,
    ) -> StoreResult<()>;
    /// Records the head the git proxy saw the upstream take for the session's branch, and forgets the
    /// session's WIP commit: the branch holds that work now (one write, on the push's path).
    async fn set_pushed_head(&self, session_id: &SessionId, head: &str) -> StoreResult<()>;
    /// The head last recorded by [`Ledger::set_pushed_head`].
    async fn pushed_head(&self, session_id: &SessionId) -> StoreResult<Option<String>>;
    /// Records the commit the git proxy saw the upstream take at the session's WIP ref (`None`: the ref
    /// was deleted, or the branch was delivered since and holds that work).
    async fn set_wip_head(&self, session_id: &SessionId, head: Option<&str>) -> StoreResult<()>;
    /// The commit last recorded by [`Ledger::set_wip_head`].
    async fn wip_head(&self, session_id: &SessionId) -> StoreResult<Option<String>>;
    /// Records the nonce the worker starts turn `n` with at the driver.
    async fn set_driver_nonce(&self, session_id: &SessionId, n: u32, nonce: &str) -> StoreResult<()>;
    /// Replaces what the session's agent kept in its home (a tar, taken at hibernation).
    async fn set_home_snapshot(&self, session_id: &SessionId, tar: &[u8]) -> StoreResult<()>;
    /// The session's last home snapshot, if any.
    async fn home_snapshot(&self, session_id: &SessionId) -> StoreResult<Option<Vec<u8>>>;
    /// Replaces the session's stored branch diff (at each delivery).
    async fn set_branch_diff(&self, session_id: &SessionId, diff: &sortie_protocol::api::StoredDiff)
    -> StoreResult<()>;
    /// Records the session's pull request, once: `false` if it already has one (which is kept).
    async fn set_session_pr(&self, session_id: &SessionId, url: &str, number: u64) -> StoreResult<bool>;
    async fn put_sandbox(
        &self,
        session_id: &SessionId,
        backend: &str,
        handle: &str,
        worker_id: &str,
    ) -> StoreResult<()>;
    async fn delete_sandbox(&self, session_id: &SessionId) -> StoreResult<()>;
    /// Live sandboxes as `(session, workspace, handle, worker)`.
    async fn sandboxes(&self) -> StoreResult<Vec<SandboxRow>>;
    async fn record_token_usage(&self, usage: &TokenUsage) -> StoreResult<()>;
    /// Marks the session held at its token cap (`true`) or going on (`false`); `false` if it already was.
    async fn set_budget_paused(&self, session_id: &SessionId, paused: bool) -> StoreResult<bool>;
    /// Says where worker `worker_id` serves the live copies of the turns it claims (`None`: nowhere),
    /// replacing what it said before; gateways of other processes route attaches there.
    async fn register_worker(&self, worker_id: &str, feed_url: Option<&str>) -> StoreResult<()>;
    /// Meters a sandbox's cumulative `reading` for turn `turn`: what it used since the last reading
    /// of the same sandbox is added to the turn, the session and the day's usage (a reading taken
    /// twice counts once); the peak memory is the largest seen.
    async fn meter_sandbox(
        &self,
        session_id: &SessionId,
        turn: u32,
        epoch_ms: i64,
        reading: SandboxReading,
    ) -> StoreResult<()>;
}

/// A session's record as its readers and its recorder see it: the session and its turns (within a
/// workspace), a prompt added as a turn (the dashboard's chat submits it through the gateway), and the
/// turns' parts, read one turn at a time.
#[async_trait]
pub trait Transcripts: Send + Sync + 'static {
    async fn session(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow>;
    async fn turns(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<Vec<TurnRow>>;
    /// Stores parts of one turn, ignoring any `part_index` already stored; returns how many were new.
    async fn append_parts(&self, session_id: &SessionId, turn: u32, parts: &[NewPart]) -> StoreResult<u64>;
    /// Every stored part of a session, in turn and part order. Proportional to the whole session: readers
    /// of one turn use [`Transcripts::turn_parts`] or [`Transcripts::turn_parts_after`].
    async fn parts(&self, session_id: &SessionId) -> StoreResult<Vec<StoredPart>>;
    /// Where turn `turn`'s stored transcript ends (its last part, the last part from the sandbox's
    /// stream) and how big it and the session's are.
    async fn transcript_progress(&self, session_id: &SessionId, turn: u32) -> StoreResult<TranscriptProgress>;
    /// Every stored part of turn `n`, in part order. Proportional to the turn, not the session (a range
    /// of the primary key `(session_id, turn, part_index)`), and as large as the recorder let the turn
    /// grow (`limits::TURN_PARTS_MAX`); a reader that must stay bounded whatever was stored pages with
    /// [`Transcripts::turn_parts_after`].
    async fn turn_parts(&self, session_id: &SessionId, n: u32) -> StoreResult<Vec<StoredPart>>;
    /// The stored parts of turn `n` whose part index is above `after` (from the turn's first part when
    /// `None`), in part order, as many as `limit` allows: the tail after a prefix already sent, or one
    /// slice of a turn read slice by slice. Proportional to what it returns, and never holds more than
    /// `limit` (give or take one part) whatever was stored.
    async fn turn_parts_after(
        &self,
        session_id: &SessionId,
        n: u32,
        after: Option<u32>,
        limit: PartsLimit,
    ) -> StoreResult<Vec<StoredPart>>;
    /// How many parts, and how many bytes of payload, turn `n` holds, or with `None` the whole session
    /// (for the transcript caps of `sortie_protocol::limits`). Proportional to what it measures.
    async fn parts_size(&self, session_id: &SessionId, turn: Option<u32>) -> StoreResult<PartsSize>;
    /// Adds a turn. Refusals: [`StoreError::NotSteerable`], [`StoreError::TurnQueueFull`],
    /// [`StoreError::PromptsTooLarge`]; nothing is written on a refusal.
    async fn steer(&self, workspace_id: &str, session_id: &SessionId, steer: NewTurn) -> StoreResult<TurnRow>;
    /// Where the live copy of turn `n` is served, while it runs: the feed address its worker registered
    /// ([`Ledger::register_worker`]); `None` when the turn does not run or its worker serves no feed.
    async fn live_feed(&self, session_id: &SessionId, n: u32) -> StoreResult<Option<String>>;
}

/// Single-use ticket nonces and the instance-wide secrets tickets are signed with.
#[async_trait]
pub trait Tickets: Send + Sync + 'static {
    /// Claims a ticket nonce once; `false` if it was claimed before (a replay).
    async fn claim_ticket_nonce(&self, nonce: &str, expires_at_ms: i64) -> StoreResult<bool>;
    /// The instance-wide secret `name`, storing `candidate` if none exists yet (all replicas agree).
    async fn instance_secret(&self, name: &str, candidate: &str) -> StoreResult<String>;
}

/// Model keys and forge connections, sealed by a [`KeyRing`] before they get here.
#[async_trait]
pub trait Secrets: Send + Sync + 'static {
    /// Stores the workspace's sealed key for `api`, replacing any earlier one (`created_at` is now).
    async fn put_model_key(
        &self,
        workspace_id: &str,
        api: sortie_protocol::api::ModelApi,
        key_ciphertext: &str,
        key_nonce: &str,
        label: Option<&str>,
    ) -> StoreResult<ModelKeyRow>;
    /// The workspace's sealed key for `api`, if it has one.
    async fn model_key(
        &self,
        workspace_id: &str,
        api: sortie_protocol::api::ModelApi,
    ) -> StoreResult<Option<ModelKeyRow>>;
    /// Every sealed key of the workspace, by API name.
    async fn model_keys(&self, workspace_id: &str) -> StoreResult<Vec<ModelKeyRow>>;
    /// Forgets the workspace's key for `api`; `false` if it had none.
    async fn delete_model_key(&self, workspace_id: &str, api: sortie_protocol::api::ModelApi) -> StoreResult<bool>;
    /// Stores the workspace's connection to `host`, replacing any earlier one (`created_at` is now). With
    /// `app_id`, the sealed secret is that GitHub App's private key, not a token.
    #[allow(clippy::too_many_arguments)]
    async fn put_forge_connection(
        &self,
        workspace_id: &str,
        host: &str,
        kind: sortie_protocol::api::ForgeKind,
        api_base: &str,
        token_ciphertext: &str,
        token_nonce: &str,
        app_id: Option<&str>,
    ) -> StoreResult<ForgeConnectionRow>;
    /// The workspace's connection to `host`, if it has one.
    async fn forge_connection(&self, workspace_id: &str, host: &str) -> StoreResult<Option<ForgeConnectionRow>>;
    /// Every connection of the workspace, by host.
    async fn forge_connections(&self, workspace_id: &str) -> StoreResult<Vec<ForgeConnectionRow>>;
    /// Forgets the workspace's connection to `host`; `false` if it had none.
    async fn delete_forge_connection(&self, workspace_id: &str, host: &str) -> StoreResult<bool>;
}

/// What a forge asks of sortie (webhook deliveries) and where sessions were asked for from it.
#[async_trait]
/// What retention may take (DESIGN §16): the records of sessions that ended or were archived before a
/// cutoff and hold no sandbox. Never a queued, running or idle session's.
#[async_trait]
pub trait Retention: Send + Sync + 'static {
    /// Sessions retention may prune at `cutoff` (epoch ms), oldest first, with what their transcripts hold.
    async fn prunable_sessions(&self, cutoff: i64, limit: u32) -> StoreResult<Vec<PrunableSession>>;
    /// Prunes one session's transcript, diff and home snapshot if it is still prunable at `cutoff`
    /// (checked and done in one transaction); `false` if it is not (steered meanwhile, say).
    async fn prune_session(&self, session_id: &SessionId, cutoff: i64) -> StoreResult<bool>;
    /// The repositories of sessions not pruned: their mirrors are borrowed by workspaces that stay.
    async fn kept_repos(&self) -> StoreResult<Vec<String>>;
    /// Gives free space back to the filesystem when it is worth it (SQLite: `VACUUM` when a quarter
    /// of the file is free); the bytes the file shrank by.
    async fn compact(&self) -> StoreResult<u64>;
}

#[async_trait]
pub trait ForgeEvents: Send + Sync + 'static {
    /// Sets the webhook secret (sealed: ciphertext, nonce) and the triggers (JSON) of the workspace's
    /// connection to `host`, `None` clearing either; `false` if it has no such connection. One connection
    /// of the instance per App ID has a webhook secret: another is [`StoreError::Conflict`].
    async fn set_forge_triggers(
        &self,
        workspace_id: &str,
        host: &str,
        webhook_secret: Option<(&str, &str)>,
        triggers: Option<&str>,
    ) -> StoreResult<bool>;
    /// The connection, of any workspace, acting as GitHub App `app_id` with a webhook secret (at most one).
    async fn app_connections(&self, app_id: &str) -> StoreResult<Vec<ForgeConnectionRow>>;
    /// Records a delivery to be acted on; `false` (and nothing written) when its delivery id or its
    /// request key was recorded before.
    async fn record_forge_delivery(&self, delivery: &NewForgeDelivery) -> StoreResult<bool>;
    /// How many of the workspace's deliveries wait to be acted on (or are being acted on).
    async fn pending_forge_deliveries(&self, workspace_id: &str) -> StoreResult<u64>;
    /// Claims the oldest delivery not done and not claimed in the last `lease_ms`, for `worker_id`.
    async fn claim_forge_delivery(&self, worker_id: &str, lease_ms: i64) -> StoreResult<Option<ForgeDeliveryRow>>;
    /// Records what was made of a claimed delivery; it is never claimed again.
    async fn finish_forge_delivery(&self, delivery_id: &str, outcome: &str) -> StoreResult<()>;
    /// What became of a delivery: `None` while not done (or unknown), else its outcome.
    async fn forge_delivery_outcome(&self, delivery_id: &str) -> StoreResult<Option<String>>;
    /// Records where a session was asked for (JSON), replacing any earlier record.
    async fn set_session_origin(&self, session_id: &SessionId, origin: &str) -> StoreResult<()>;
    async fn session_origin(&self, session_id: &SessionId) -> StoreResult<Option<String>>;
    /// The workspace's session whose pull request is `pr_url`.
    async fn session_by_pr_url(&self, workspace_id: &str, pr_url: &str) -> StoreResult<Option<SessionId>>;
}

/// Milliseconds since the Unix epoch, from the system clock.
pub fn now_ms() -> i64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

/// A turn's terminal status and what it produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnOutcome {
    pub status: TurnStatus,
    pub head_sha: Option<String>,
    pub failure: Option<(sortie_protocol::FailureCode, String)>,
}
