//! [`SqlStore`]: the [`Store`] on SQLite or PostgreSQL through sqlx's `Any` driver.
//!
//! Portability rules (ref/deps.md §4): `$n` placeholders, only TEXT and 64-bit integers, `ON CONFLICT`,
//! `RETURNING`. Writes that read first do so outside the transaction and then compare-and-set, so that a
//! SQLite transaction always starts with its write (`BEGIN IMMEDIATE`) and never has to upgrade a read
//! lock, and a PostgreSQL one re-checks its condition on the latest row version.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use sortie_protocol::api::{ForgeKind, ModelApi, Role};
use sortie_protocol::limits::{SESSION_PROMPTS_MAX_BYTES, TURN_QUEUE_MAX};
use sortie_protocol::phase::TurnMode;
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, Executor, Row, Transaction};

use crate::model::*;
use crate::{
    ControlPlane, Ledger, Retention, Secrets, StoreError, StoreResult, Tickets, Transcripts, TurnOutcome, now_ms,
};

/// The database behind a [`SqlStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// The backend a database URL names.
    pub fn from_url(url: &str) -> StoreResult<Self> {
        if url.starts_with("sqlite:") {
            Ok(Self::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Self::Postgres)
        } else {
            Err(StoreError::Internal(
                "the database URL must start with sqlite: or postgres://".into(),
            ))
        }
    }
}

/// How often a compare-and-set loop re-reads before it gives up with a conflict.
const CAS_ATTEMPTS: usize = 200;

pub struct SqlStore {
    pool: AnyPool,
    /// What writes. On SQLite a pool of one connection: writers queue here, in order and woken at once,
    /// each holding nothing while it waits. With several connections they queued on SQLite's own lock,
    /// whose busy handler sleeps 1, 2, 5 … 100 ms between looks, every waiter holding a connection of
    /// the pool, so the reads of an accept waited behind the worker's writes (p99 of a create under
    /// load: 344 ms). On PostgreSQL the one pool.
    writer: AnyPool,
    /// The worker's frequent writes (transcript parts, phase changes, metering, claims and ends of
    /// turns) take this one permit before they queue for the writer, so at most one of them is ever
    /// ahead of a request's write. Without it an accept on SQLite queued behind every write of a burst
    /// (waits up to 0.5 s with 100 sessions starting; the longest single write held 0.16 s).
    background_writes: Arc<tokio::sync::Semaphore>,
    backend: Backend,
    /// Bumped after every commit that wrote an event ([`Store::event_signal`]), and on PostgreSQL when
    /// another process's commit notifies [`EVENTS_CHANNEL`].
    events: tokio::sync::watch::Sender<u64>,
    /// This store's name in its notifications, so its listener skips what it sent itself.
    notifier: String,
    /// The PostgreSQL listener's task, stopped with the store.
    listener: Option<tokio::task::AbortHandle>,
}

/// A background writer's place at the head of its queue ([`SqlStore::begin_background_write`]).
struct BackgroundTurn {
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The PostgreSQL channel every commit that wrote events notifies (DESIGN §17: wake, don't poll).
pub const EVENTS_CHANNEL: &str = "sortie_events";

/// How long the listener waits before it connects again after losing its connection.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);

impl Drop for SqlStore {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

/// Bumps `events` for each notification on [`EVENTS_CHANNEL`] another store sent, for as long as the
/// store lives. A lost connection bumps it too: what was notified meanwhile is gone, so readers read.
async fn listen_for_events(url: String, notifier: String, events: tokio::sync::watch::Sender<u64>) {
    loop {
        let Err(error) = listen_once(&url, &notifier, &events).await;
        tracing::warn!(%error, "cannot listen for other processes' events; reading on the slow timer meanwhile");
        tokio::time::sleep(RELISTEN_AFTER).await;
    }
}

async fn listen_once(
    url: &str,
    notifier: &str,
    events: &tokio::sync::watch::Sender<u64>,
) -> Result<std::convert::Infallible, sqlx::Error> {
    let bump = || events.send_modify(|n| *n = n.wrapping_add(1));
    let mut listener = sqlx::postgres::PgListener::connect(url).await?;
    listener.listen(EVENTS_CHANNEL).await?;
    // Commits made before LISTEN took effect were not heard: a reader reads once now.
    bump();
    loop {
        match listener.try_recv().await? {
            Some(notification) if notification.payload() == notifier => {}
            // `None`: the connection was lost and is made again; what was notified meanwhile is gone.
            Some(_) | None => bump(),
        }
    }
}

/// A SQLite pool on `url` whose connections write ahead (WAL) and wait on a lock rather than fail;
/// `read_only`: its connections refuse to write (a write sent to the readers fails, in tests first,
/// instead of queueing on SQLite's lock).
async fn sqlite_pool(options: AnyPoolOptions, url: &str, read_only: bool) -> Result<AnyPool, sqlx::Error> {
    options
        .after_connect(move |connection, _| {
            Box::pin(async move {
                // WAL lets readers run beside the writer; NORMAL syncs at checkpoints, which survives a
                // killed process (only power loss can drop the newest commits). The busy timeout covers
                // another process's writer (`sortie gc`, a client command on the store).
                connection.execute("PRAGMA journal_mode = WAL").await?;
                connection.execute("PRAGMA synchronous = NORMAL").await?;
                connection.execute("PRAGMA busy_timeout = 10000").await?;
                connection.execute("PRAGMA foreign_keys = ON").await?;
                if read_only {
                    connection.execute("PRAGMA query_only = ON").await?;
                }
                Ok(())
            })
        })
        .connect(url)
        .await
}

impl SqlStore {
    /// Connects, applies pending migrations and returns the store. A SQLite file is created if missing.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        sqlx::any::install_default_drivers();
        let backend = Backend::from_url(url)?;
        let options = || AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        let (pool, writer) = match backend {
            Backend::Sqlite => {
                let url = if url.contains('?') {
                    url.to_owned()
                } else {
                    format!("{url}?mode=rwc")
                };
                // The writer first: it makes the file and sets WAL before the readers open it.
                let writer = sqlite_pool(options().max_connections(1), &url, false).await?;
                (sqlite_pool(options().max_connections(8), &url, true).await?, writer)
            }
            Backend::Postgres => {
                let pool = options().max_connections(16).connect(url).await?;
                (pool.clone(), pool)
            }
        };
        let events = tokio::sync::watch::channel(0).0;
        let notifier = ulid::Ulid::generate().to_string();
        let listener = (backend == Backend::Postgres)
            .then(|| tokio::spawn(listen_for_events(url.to_owned(), notifier.clone(), events.clone())).abort_handle());
        let store = Self {
            pool,
            writer,
            background_writes: Arc::new(tokio::sync::Semaphore::new(1)),
            backend,
            events,
            notifier,
            listener,
        };
        store.migrate().await?;
        Ok(store)
    }

    async fn migrate(&self) -> StoreResult<()> {
        match self.backend {
            Backend::Sqlite => sqlx::migrate!("./migrations/sqlite").run(&self.writer).await?,
            Backend::Postgres => sqlx::migrate!("./migrations/postgres").run(&self.writer).await?,
        }
        Ok(())
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Closes the pool; pending work finishes first.
    pub async fn close(&self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
        self.pool.close().await;
        self.writer.close().await;
    }

    /// A transaction that writes, on the writer. On SQLite it takes the write lock up front, so another
    /// process's writer is waited for on `busy_timeout` instead of failing a lock upgrade (this process's
    /// writers queue for the writer's one connection before that).
    async fn begin_write(&self) -> StoreResult<Transaction<'static, Any>> {
        Ok(match self.backend {
            Backend::Sqlite => self.writer.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.writer.begin().await?,
        })
    }

    /// [`Self::begin_write`] for the worker's frequent writes: behind [`Self::background_writes`] on
    /// SQLite. Keep the permit until the transaction ends.
    async fn begin_background_write(&self) -> StoreResult<(BackgroundTurn, Transaction<'static, Any>)> {
        let turn = match self.backend {
            Backend::Sqlite => Some(
                self.background_writes
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| StoreError::Unavailable("the store is closing".into()))?,
            ),
            Backend::Postgres => None,
        };
        Ok((BackgroundTurn { _permit: turn }, self.begin_write().await?))
    }

    /// The workspace's quota a new session (`creating`) or turn would pass, read in `tx`. On PostgreSQL
    /// the workspace's row is locked first, so concurrent creates count one after another (SQLite's
    /// writers are serialised already).
    async fn quota_breach(
        &self,
        tx: &mut Transaction<'static, Any>,
        workspace_id: &str,
        creating: bool,
    ) -> StoreResult<Option<crate::limits::QuotaBreach>> {
        let lock = match self.backend {
            Backend::Postgres => "SELECT limits FROM workspaces WHERE id = $1 FOR UPDATE",
            Backend::Sqlite => "SELECT limits FROM workspaces WHERE id = $1",
        };
        let Some(row) = sqlx::query(lock).bind(workspace_id).fetch_optional(&mut **tx).await? else {
            return Ok(None);
        };
        let text: String = row.try_get("limits")?;
        let quotas = serde_json::from_str::<sortie_protocol::api::WorkspaceLimits>(&text)
            .map_err(internal)?
            .quotas;
        let now = now_ms();
        if creating && let Some(limit) = quotas.sessions_per_day {
            let midnight = now - now.rem_euclid(86_400_000);
            let row = sqlx::query("SELECT COUNT(*) AS n FROM sessions WHERE workspace_id = $1 AND created_at >= $2")
                .bind(workspace_id)
                .bind(midnight)
                .fetch_one(&mut **tx)
                .await?;
            let used = get_u64(&row, "n")?;
            if used >= limit {
                return Ok(Some(crate::limits::QuotaBreach {
                    quota: "sessions_per_day",
                    limit,
                    used,
                }));
            }
        }
        if let Some(limit) = quotas.tokens_per_month {
            let today = sortie_protocol::api::utc_day_from_epoch_ms(now);
            let first_of_month = format!("{}-01", &today[..7]);
            let row = sqlx::query(
                "SELECT CAST(COALESCE(SUM(u.input_tokens + u.output_tokens), 0) AS BIGINT) AS n FROM usage_tokens u \
                 JOIN sessions s ON s.id = u.session_id WHERE s.workspace_id = $1 AND u.day >= $2",
            )
            .bind(workspace_id)
            .bind(first_of_month)
            .fetch_one(&mut **tx)
            .await?;
            let used = get_u64(&row, "n")?;
            if used >= limit {
                return Ok(Some(crate::limits::QuotaBreach {
                    quota: "tokens_per_month",
                    limit,
                    used,
                }));
            }
        }
        Ok(None)
    }

    /// Writes an event about `session_id` in `tx`. Call it after the transaction's other writes: on
    /// PostgreSQL it takes the events lock (held to the commit), so numbers commit in order and a reader
    /// that saw number n never sees a smaller one appear later.
    async fn record_event(
        &self,
        tx: &mut Transaction<'static, Any>,
        session_id: &SessionId,
        turn: Option<u32>,
        change: EventChange,
        failure: Option<(&str, &str)>,
        at: i64,
    ) -> StoreResult<()> {
        if self.backend == Backend::Postgres {
            sqlx::query("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE")
                .execute(&mut **tx)
                .await?;
        }
        let (kind, state) = match change {
            EventChange::Phase(phase) => (EVENT_SESSION_PHASE, phase.as_str()),
            EventChange::Status(status) => (EVENT_TURN_STATUS, status.as_str()),
        };
        // A session that failed says why from its own row; a failed turn's reason comes with it.
        sqlx::query(
            "INSERT INTO events (workspace_id, session_id, turn, kind, state, failure_code, failure_reason, at) \
             SELECT workspace_id, id, $2, $3, $4, CASE WHEN $4 = 'failed' THEN COALESCE($5, failure_code) END, \
             CASE WHEN $4 = 'failed' THEN COALESCE($6, failure_reason) END, $7 FROM sessions WHERE id = $1",
        )
        .bind(session_id.as_str())
        .bind(turn.map(i64::from))
        .bind(kind)
        .bind(state)
        .bind(failure.map(|(code, _)| code))
        .bind(failure.map(|(_, reason)| reason))
        .bind(at)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Ends turn `n` in `tx` if it still runs: its status, head and failure, the session's head and
    /// failure, and the turn's event. `false` (nothing written) if it was not running.
    async fn write_turn_end(
        &self,
        tx: &mut Transaction<'static, Any>,
        session_id: &SessionId,
        n: u32,
        ending: &TurnOutcome,
        now: i64,
    ) -> StoreResult<bool> {
        let (failure_code, failure_reason) = match &ending.failure {
            Some((code, reason)) => (Some(failure_code_text(*code)), Some(reason.as_str())),
            None => (None, None),
        };
        let changed = sqlx::query(
            "UPDATE turns SET status = $3, head_sha = $4, failure_code = $5, failure_reason = $6, completed_at = $7 \
             WHERE session_id = $1 AND n = $2 AND status = 'running'",
        )
        .bind(session_id.as_str())
        .bind(i64::from(n))
        .bind(ending.status.as_str())
        .bind(ending.head_sha.as_deref())
        .bind(failure_code.as_deref())
        .bind(failure_reason)
        .bind(now)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if changed != 1 {
            return Ok(false);
        }
        sqlx::query(
            "UPDATE sessions SET head_sha = COALESCE($2, head_sha), failure_code = $3, failure_reason = $4, \
             updated_at = $5 WHERE id = $1",
        )
        .bind(session_id.as_str())
        .bind(ending.head_sha.as_deref())
        .bind(failure_code.as_deref())
        .bind(failure_reason)
        .bind(now)
        .execute(&mut **tx)
        .await?;
        let failure = failure_code.as_deref().zip(failure_reason);
        self.record_event(
            tx,
            session_id,
            Some(n),
            EventChange::Status(ending.status),
            failure,
            now,
        )
        .await?;
        Ok(true)
    }

    /// Commits a transaction that wrote events and wakes this process's readers, and on PostgreSQL
    /// every other process's (a notification is delivered only if the transaction commits).
    async fn commit_events(&self, mut tx: Transaction<'static, Any>) -> StoreResult<()> {
        if self.backend == Backend::Postgres {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(EVENTS_CHANNEL)
                .bind(self.notifier.as_str())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        self.events.send_modify(|n| *n = n.wrapping_add(1));
        Ok(())
    }

    async fn fetch_session(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow> {
        let row = sqlx::query(session_select!("WHERE s.id = $1 AND s.workspace_id = $2"))
            .bind(session_id.as_str())
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        session_from_row(&row)
    }

    async fn fetch_session_any_workspace(&self, session_id: &SessionId) -> StoreResult<SessionRow> {
        let row = sqlx::query(session_select!("WHERE s.id = $1"))
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        session_from_row(&row)
    }

    async fn fetch_turn(&self, session_id: &SessionId, n: u32) -> StoreResult<TurnRow> {
        let row = sqlx::query(turn_select!("WHERE session_id = $1 AND n = $2"))
            .bind(session_id.as_str())
            .bind(i64::from(n))
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        turn_from_row(&row)
    }
}

macro_rules! session_select {
    ($tail:literal) => {
        concat!(
            "SELECT s.id, s.workspace_id, w.name AS workspace_name, s.repo, s.base, s.agent, s.model, s.title, ",
            "s.phase, s.queued_reason, s.n_turns, s.n_waiting, s.current_turn, s.head_sha, s.pr_url, s.pr_number, ",
            "s.failure_code, s.failure_reason, s.egress_allow, s.setup, s.archived, s.resume_requested, ",
            "s.prompts_bytes, s.compute_ms, s.peak_memory_bytes, s.pruned_at, s.budget_tokens, s.budget_compute_ms, ",
            "s.budget_paused_at, s.input_tokens, s.output_tokens, s.created_at, s.updated_at, ",
            "(SELECT COUNT(*) FROM sandboxes x WHERE x.session_id = s.id) AS sandboxes ",
            "FROM sessions s JOIN workspaces w ON w.id = s.workspace_id ",
            $tail
        )
    };
}
use session_select;

macro_rules! turn_select {
    ($tail:literal) => {
        concat!(
            "SELECT session_id, n, prompt, status, mode, stop_requested, priming, head_sha, failure_code, ",
            "failure_reason, timings, claimed_by, driver_nonce, created_at, started_at, completed_at, cpu_ms, ",
            "peak_memory_bytes FROM turns ",
            $tail
        )
    };
}
use turn_select;

const EVENT_SESSION_PHASE: &str = "session.phase";
const EVENT_TURN_STATUS: &str = "turn.status";

fn event_from_row(row: &AnyRow) -> StoreResult<EventRow> {
    let kind: String = row.try_get("kind")?;
    let state: String = row.try_get("state")?;
    let change = match kind.as_str() {
        EVENT_SESSION_PHASE => EventChange::Phase(SessionPhase::from_str(&state).map_err(internal)?),
        EVENT_TURN_STATUS => EventChange::Status(TurnStatus::from_str(&state).map_err(internal)?),
        other => return Err(internal(format!("an event of unknown kind {other:?}"))),
    };
    let id: String = row.try_get("session_id")?;
    Ok(EventRow {
        seq: get_u64(row, "seq")?,
        workspace_id: row.try_get("workspace_id")?,
        session_id: SessionId::parse(&id).map_err(internal)?,
        turn: get_opt_u32(row, "turn")?,
        change,
        failure: parse_failure(row.try_get("failure_code")?, row.try_get("failure_reason")?)?,
        at_ms: row.try_get("at")?,
    })
}

macro_rules! webhook_select {
    ($tail:literal) => {
        concat!(
            "SELECT id, workspace_id, url, secret_ciphertext, secret_nonce, events, event_cursor, created_at ",
            "FROM webhooks ",
            $tail
        )
    };
}

/// A delivery's columns between `$head` and `$tail` (a SELECT, or an UPDATE … RETURNING).
macro_rules! delivery_select {
    ($head:literal) => {
        concat!(
            $head,
            "id, webhook_id, event_seq, kind, payload, state, attempts, next_at, last_status, last_error, ",
            "created_at, delivered_at"
        )
    };
    ($head:literal, $tail:literal) => {
        concat!(
            $head,
            "id, webhook_id, event_seq, kind, payload, state, attempts, next_at, last_status, last_error, ",
            "created_at, delivered_at",
            $tail
        )
    };
}

fn webhook_from_row(row: &AnyRow) -> StoreResult<WebhookRow> {
    let events: String = row.try_get("events")?;
    Ok(WebhookRow {
        id: row.try_get("id")?,
        workspace_id: row.try_get("workspace_id")?,
        url: row.try_get("url")?,
        secret_ciphertext: row.try_get("secret_ciphertext")?,
        secret_nonce: row.try_get("secret_nonce")?,
        events: serde_json::from_str(&events).map_err(internal)?,
        cursor: get_u64(row, "event_cursor")?,
        created_at: row.try_get("created_at")?,
    })
}

fn delivery_from_row(row: &AnyRow) -> StoreResult<DeliveryRow> {
    let state: String = row.try_get("state")?;
    let state = match state.as_str() {
        "pending" => DeliveryState::Pending,
        "delivered" => DeliveryState::Delivered,
        "failed" => DeliveryState::Failed,
        other => return Err(internal(format!("a delivery in state {other:?}"))),
    };
    let last_status: Option<i64> = row.try_get("last_status")?;
    Ok(DeliveryRow {
        id: row.try_get("id")?,
        webhook_id: row.try_get("webhook_id")?,
        event_seq: get_u64(row, "event_seq")?,
        kind: row.try_get("kind")?,
        payload: row.try_get("payload")?,
        state,
        attempts: get_u32(row, "attempts")?,
        next_at: row.try_get("next_at")?,
        last_status: last_status.and_then(|s| u16::try_from(s).ok()),
        last_error: row.try_get("last_error")?,
        created_at: row.try_get("created_at")?,
        delivered_at: row.try_get("delivered_at")?,
    })
}

fn internal(what: impl std::fmt::Display) -> StoreError {
    StoreError::Internal(what.to_string())
}

fn get_u32(row: &AnyRow, column: &str) -> StoreResult<u32> {
    let value: i64 = row.try_get(column)?;
    u32::try_from(value).map_err(|_| internal(format!("{column} out of range: {value}")))
}

/// Rows per `INSERT` of parts: 3 bound values each (plus 3 shared), far below SQLite's 32,766 and
/// PostgreSQL's 65,535 bound values per statement.
const INSERT_PARTS_PER_STATEMENT: usize = 1000;

/// `INSERT` of `rows` parts: on PostgreSQL `$1` session, `$2` turn, `$3` time, then index, seq, payload
/// and driver index per row; on SQLite the same seven values per row, each an anonymous `?`: SQLite
/// looks every `$N` up by name in a list as it parses and binds, which made a statement of many rows
/// cost the square of its parameters (most of a flood's time went there). A part index already
/// stored is left as it is.
fn insert_parts_sql(backend: Backend, rows: usize) -> String {
    let mut sql = String::from(
        "INSERT INTO parts (session_id, turn, created_at, part_index, seq, payload, driver_index) VALUES ",
    );
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        match backend {
            Backend::Sqlite => sql.push_str("(?, ?, ?, ?, ?, ?, ?)"),
            Backend::Postgres => {
                let first = 4 + 4 * row;
                sql.push_str(&format!(
                    "($1, $2, $3, ${first}, ${}, ${}, ${})",
                    first + 1,
                    first + 2,
                    first + 3
                ));
            }
        }
    }
    sql.push_str(" ON CONFLICT (session_id, turn, part_index) DO NOTHING RETURNING part_index");
    sql
}

fn part_from_row(row: &AnyRow) -> StoreResult<StoredPart> {
    Ok(StoredPart {
        turn: get_u32(row, "turn")?,
        part_index: get_u32(row, "part_index")?,
        seq: row.try_get("seq")?,
        payload: row.try_get("payload")?,
    })
}

fn get_opt_u64(row: &AnyRow, column: &str) -> StoreResult<Option<u64>> {
    let value: Option<i64> = row.try_get(column)?;
    value
        .map(|value| u64::try_from(value).map_err(|_| internal(format!("{column} out of range: {value}"))))
        .transpose()
}

fn get_u64(row: &AnyRow, column: &str) -> StoreResult<u64> {
    let value: i64 = row.try_get(column)?;
    u64::try_from(value).map_err(|_| internal(format!("{column} out of range: {value}")))
}

fn get_opt_u32(row: &AnyRow, column: &str) -> StoreResult<Option<u32>> {
    let value: Option<i64> = row.try_get(column)?;
    value
        .map(|v| u32::try_from(v).map_err(|_| internal(format!("{column} out of range: {v}"))))
        .transpose()
}

fn parse_failure(code: Option<String>, reason: Option<String>) -> StoreResult<Option<(FailureCode, String)>> {
    match code {
        None => Ok(None),
        Some(code) => {
            let parsed: FailureCode = serde_json::from_value(serde_json::Value::String(code.clone()))
                .map_err(|_| internal(format!("unknown failure code {code}")))?;
            Ok(Some((parsed, reason.unwrap_or_default())))
        }
    }
}

/// A turn ends only in one of the statuses a running turn can end in.
fn check_turn_end(status: TurnStatus) -> StoreResult<()> {
    if status == TurnStatus::Accepted || !TurnStatus::Running.can_become(status) {
        return Err(StoreError::IllegalTransition {
            from: "running".into(),
            to: status.to_string(),
        });
    }
    Ok(())
}

fn failure_code_text(code: FailureCode) -> String {
    match serde_json::to_value(code) {
        Ok(serde_json::Value::String(text)) => text,
        _ => "INTERNAL".to_owned(),
    }
}

fn session_from_row(row: &AnyRow) -> StoreResult<SessionRow> {
    let id: String = row.try_get("id")?;
    let phase: String = row.try_get("phase")?;
    let egress_allow: String = row.try_get("egress_allow")?;
    let pr_url: Option<String> = row.try_get("pr_url")?;
    let pr_number: Option<i64> = row.try_get("pr_number")?;
    Ok(SessionRow {
        id: SessionId::parse(&id).map_err(internal)?,
        workspace_id: row.try_get("workspace_id")?,
        workspace_name: row.try_get("workspace_name")?,
        repo: row.try_get("repo")?,
        base: row.try_get("base")?,
        agent: row.try_get("agent")?,
        model: row.try_get("model")?,
        title: row.try_get("title")?,
        phase: SessionPhase::from_str(&phase).map_err(internal)?,
        queued_reason: row.try_get("queued_reason")?,
        n_turns: get_u32(row, "n_turns")?,
        n_waiting: get_u32(row, "n_waiting")?,
        current_turn: get_opt_u32(row, "current_turn")?,
        head_sha: row.try_get("head_sha")?,
        pr: match (pr_url, pr_number) {
            (Some(url), Some(number)) => Some((url, u64::try_from(number).map_err(internal)?)),
            _ => None,
        },
        failure: parse_failure(row.try_get("failure_code")?, row.try_get("failure_reason")?)?,
        egress_allow: serde_json::from_str(&egress_allow).map_err(internal)?,
        setup: row.try_get("setup")?,
        archived: row.try_get::<i64, _>("archived")? != 0,
        resume_requested: row.try_get::<i64, _>("resume_requested")? != 0,
        prompts_bytes: get_u64(row, "prompts_bytes")?,
        compute_ms: get_u64(row, "compute_ms")?,
        peak_memory_bytes: get_u64(row, "peak_memory_bytes")?,
        pruned_at: row.try_get("pruned_at")?,
        budget_tokens: get_opt_u64(row, "budget_tokens")?,
        budget_compute_ms: get_opt_u64(row, "budget_compute_ms")?,
        budget_paused_at: row.try_get("budget_paused_at")?,
        input_tokens: get_u64(row, "input_tokens")?,
        output_tokens: get_u64(row, "output_tokens")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        has_sandbox: row.try_get::<i64, _>("sandboxes")? > 0,
    })
}

fn turn_from_row(row: &AnyRow) -> StoreResult<TurnRow> {
    let session_id: String = row.try_get("session_id")?;
    let status: String = row.try_get("status")?;
    let mode: String = row.try_get("mode")?;
    let stop_requested: Option<String> = row.try_get("stop_requested")?;
    Ok(TurnRow {
        session_id: SessionId::parse(&session_id).map_err(internal)?,
        n: get_u32(row, "n")?,
        prompt: row.try_get("prompt")?,
        status: TurnStatus::from_str(&status).map_err(internal)?,
        mode: TurnMode::from_str(&mode).map_err(internal)?,
        stop_requested: stop_requested.as_deref().and_then(StopRequest::parse),
        priming: row.try_get("priming")?,
        head_sha: row.try_get("head_sha")?,
        failure: parse_failure(row.try_get("failure_code")?, row.try_get("failure_reason")?)?,
        timings: match row.try_get::<Option<String>, _>("timings")? {
            Some(text) => Some(serde_json::from_str(&text).map_err(internal)?),
            None => None,
        },
        claimed_by: row.try_get("claimed_by")?,
        driver_nonce: row.try_get("driver_nonce")?,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        completed_at: row.try_get("completed_at")?,
        cpu_ms: get_u64(row, "cpu_ms")?,
        peak_memory_bytes: get_u64(row, "peak_memory_bytes")?,
    })
}

fn workspace_from_row(row: &AnyRow) -> StoreResult<WorkspaceRow> {
    let roots: String = row.try_get("allowed_roots")?;
    Ok(WorkspaceRow {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        repo_access: RepoAccess {
            any_local_path: row.try_get::<i64, _>("allow_any_local")? != 0,
            allowed_roots: serde_json::from_str(&roots).map_err(internal)?,
        },
        created_at: row.try_get("created_at")?,
    })
}

/// The columns of a model key: `model_key_select!("SELECT", "FROM …")`, or after an
/// `INSERT … RETURNING`.
macro_rules! model_key_select {
    ($head:literal) => {
        concat!(
            $head,
            " workspace_id, api, key_ciphertext, key_nonce, label, created_at"
        )
    };
    ($head:literal, $tail:literal) => {
        concat!(model_key_select!($head), " ", $tail)
    };
}

/// `head`, the columns of a forge connection, then `tail`.
macro_rules! forge_connection_select {
    ($head:literal, $tail:literal) => {
        concat!(
            $head,
            " workspace_id, host, kind, api_base, token_ciphertext, token_nonce, created_at, app_id, ",
            "webhook_secret_ciphertext, webhook_secret_nonce, triggers ",
            $tail
        )
    };
}

fn forge_connection_from_row(row: &AnyRow) -> StoreResult<ForgeConnectionRow> {
    let kind: String = row.try_get("kind")?;
    Ok(ForgeConnectionRow {
        workspace_id: row.try_get("workspace_id")?,
        host: row.try_get("host")?,
        kind: ForgeKind::from_str(&kind)
            .map_err(|_| internal(format!("unknown forge kind {kind:?} in forge_connections")))?,
        api_base: row.try_get("api_base")?,
        token_ciphertext: row.try_get("token_ciphertext")?,
        token_nonce: row.try_get("token_nonce")?,
        created_at: row.try_get("created_at")?,
        app_id: row.try_get("app_id")?,
        webhook_secret: match (
            row.try_get::<Option<String>, _>("webhook_secret_ciphertext")?,
            row.try_get::<Option<String>, _>("webhook_secret_nonce")?,
        ) {
            (Some(ciphertext), Some(nonce)) => Some((ciphertext, nonce)),
            _ => None,
        },
        triggers: row.try_get("triggers")?,
    })
}

fn model_key_from_row(row: &AnyRow) -> StoreResult<ModelKeyRow> {
    let api: String = row.try_get("api")?;
    Ok(ModelKeyRow {
        workspace_id: row.try_get("workspace_id")?,
        api: ModelApi::from_str(&api).map_err(|_| internal(format!("unknown model api {api:?} in model_keys")))?,
        key_ciphertext: row.try_get("key_ciphertext")?,
        key_nonce: row.try_get("key_nonce")?,
        label: row.try_get("label")?,
        created_at: row.try_get("created_at")?,
    })
}

fn prefixed_ulid(prefix: &str) -> String {
    format!("{prefix}{}", ulid::Ulid::generate().to_string().to_ascii_lowercase())
}

#[async_trait]
impl ControlPlane for SqlStore {
    async fn queued_turns(&self) -> StoreResult<u64> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM turns WHERE status = 'accepted'")
            .fetch_one(&self.pool)
            .await?;
        get_u64(&row, "n")
    }

    async fn raise_budget(
        &self,
        workspace_id: &str,
        session_id: &SessionId,
        tokens: Option<u64>,
        compute_ms: Option<u64>,
    ) -> StoreResult<SessionRow> {
        let mut tx = self.begin_write().await?;
        let exists = sqlx::query("SELECT id FROM sessions WHERE id = $1 AND workspace_id = $2")
            .bind(session_id.as_str())
            .bind(workspace_id)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(StoreError::NotFound);
        }
        // Raised again and again, a cap stops at the largest figure accepted (never past an i64).
        let most = i64::try_from(sortie_protocol::api::LIMIT_MAX).map_err(internal)?;
        if let Some(tokens) = tokens {
            sqlx::query(
                "UPDATE sessions SET budget_tokens = CASE WHEN COALESCE(budget_tokens, input_tokens + output_tokens) \
                 + $2 > $4 THEN $4 ELSE COALESCE(budget_tokens, input_tokens + output_tokens) + $2 END, \
                 updated_at = $3 WHERE id = $1",
            )
            .bind(session_id.as_str())
            .bind(i64::try_from(tokens.min(sortie_protocol::api::LIMIT_MAX)).map_err(internal)?)
            .bind(now_ms())
            .bind(most)
            .execute(&mut *tx)
            .await?;
        }
        if let Some(compute_ms) = compute_ms {
            let most_ms = most.saturating_mul(1000);
            sqlx::query(
                "UPDATE sessions SET budget_compute_ms = CASE WHEN COALESCE(budget_compute_ms, compute_ms) + $2 > $4 \
                 THEN $4 ELSE COALESCE(budget_compute_ms, compute_ms) + $2 END, updated_at = $3 WHERE id = $1",
            )
            .bind(session_id.as_str())
            .bind(i64::try_from(compute_ms).map_err(internal)?.min(most_ms))
            .bind(now_ms())
            .bind(most_ms)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        self.session(workspace_id, session_id).await
    }

    async fn workspace_limits(&self, workspace_id: &str) -> StoreResult<sortie_protocol::api::WorkspaceLimits> {
        let row = sqlx::query("SELECT limits FROM workspaces WHERE id = $1")
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        let text: String = row.try_get("limits")?;
        serde_json::from_str(&text).map_err(internal)
    }

    async fn set_workspace_limits(
        &self,
        workspace_id: &str,
        limits: &sortie_protocol::api::WorkspaceLimits,
    ) -> StoreResult<()> {
        let text = serde_json::to_string(limits).map_err(internal)?;
        let updated = sqlx::query("UPDATE workspaces SET limits = $2 WHERE id = $1")
            .bind(workspace_id)
            .bind(text)
            .execute(&self.writer)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1 FROM workspaces LIMIT 1")
            .fetch_optional(&self.pool)
            .await?;
        Ok(())
    }

    async fn create_workspace(&self, name: &str, repo_access: RepoAccess) -> StoreResult<WorkspaceRow> {
        let id = prefixed_ulid("ws_");
        let roots = serde_json::to_string(&repo_access.allowed_roots).map_err(internal)?;
        let row = sqlx::query(
            "INSERT INTO workspaces (id, name, allow_any_local, allowed_roots, created_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (name) DO NOTHING RETURNING id, name, allow_any_local, allowed_roots, created_at",
        )
        .bind(&id)
        .bind(name)
        .bind(i64::from(repo_access.any_local_path))
        .bind(roots)
        .bind(now_ms())
        .fetch_optional(&self.writer)
        .await?
        .ok_or_else(|| StoreError::Conflict(format!("a workspace named {name:?} exists")))?;
        workspace_from_row(&row)
    }

    async fn workspace_by_name(&self, name: &str) -> StoreResult<WorkspaceRow> {
        let row =
            sqlx::query("SELECT id, name, allow_any_local, allowed_roots, created_at FROM workspaces WHERE name = $1")
                .bind(name)
                .fetch_optional(&self.pool)
                .await?
                .ok_or(StoreError::NotFound)?;
        workspace_from_row(&row)
    }

    async fn workspace(&self, workspace_id: &str) -> StoreResult<WorkspaceRow> {
        let row =
            sqlx::query("SELECT id, name, allow_any_local, allowed_roots, created_at FROM workspaces WHERE id = $1")
                .bind(workspace_id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or(StoreError::NotFound)?;
        workspace_from_row(&row)
    }

    async fn create_token(
        &self,
        workspace_id: &str,
        role: Role,
        token_hash: &str,
        label: Option<&str>,
        expires_at: Option<i64>,
    ) -> StoreResult<String> {
        let id = prefixed_ulid("tok_");
        sqlx::query(
            "INSERT INTO tokens (id, workspace_id, role, token_hash, label, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&id)
        .bind(workspace_id)
        .bind(role.as_str())
        .bind(token_hash)
        .bind(label)
        .bind(now_ms())
        .bind(expires_at)
        .execute(&self.writer)
        .await?;
        Ok(id)
    }

    async fn touch_token(&self, token_id: &str, at: i64) -> StoreResult<()> {
        sqlx::query("UPDATE tokens SET last_used_at = $2 WHERE id = $1")
            .bind(token_id)
            .bind(at)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn record_audit(&self, entry: &AuditEntry) -> StoreResult<()> {
        sqlx::query("INSERT INTO audit_log (workspace_id, at, actor, action, target) VALUES ($1, $2, $3, $4, $5)")
            .bind(&entry.workspace_id)
            .bind(now_ms())
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.target)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn audit_log(&self, workspace_id: &str, before: Option<i64>, limit: u32) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(
            "SELECT id, at, actor, action, target FROM audit_log WHERE workspace_id = $1 AND id < $2 \
             ORDER BY id DESC LIMIT $3",
        )
        .bind(workspace_id)
        .bind(before.unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(AuditRow {
                    id: row.try_get("id")?,
                    at: row.try_get("at")?,
                    actor: row.try_get("actor")?,
                    action: row.try_get("action")?,
                    target: row.try_get("target")?,
                })
            })
            .collect()
    }

    async fn principal_by_token_hash(&self, token_hash: &str) -> StoreResult<Principal> {
        let row = sqlx::query(
            "SELECT t.id, t.workspace_id, w.name, t.role FROM tokens t JOIN workspaces w ON w.id = t.workspace_id \
             WHERE t.token_hash = $1 AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > $2)",
        )
        .bind(token_hash)
        .bind(now_ms())
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound)?;
        let role: String = row.try_get("role")?;
        Ok(Principal {
            token_id: row.try_get("id")?,
            workspace_id: row.try_get("workspace_id")?,
            workspace_name: row.try_get("name")?,
            role: Role::from_str(&role).map_err(internal)?,
        })
    }

    async fn create_session(&self, new: NewSession) -> StoreResult<SessionRow> {
        let now = now_ms();
        let egress = serde_json::to_string(&new.egress_allow).map_err(internal)?;
        let prompt_bytes = i64::try_from(new.task.len()).map_err(internal)?;
        let mut tx = self.begin_write().await?;
        if let Some(breach) = self.quota_breach(&mut tx, &new.workspace_id, true).await? {
            tx.rollback().await?;
            return Err(StoreError::QuotaExceeded(breach));
        }
        sqlx::query(
            "INSERT INTO sessions (id, workspace_id, repo, base, agent, model, title, phase, n_turns, n_waiting, \
             egress_allow, setup, prompts_bytes, created_at, updated_at, budget_tokens, budget_compute_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'queued', 1, 1, $8, $9, $10, $11, $11, $12, $13)",
        )
        .bind(new.id.as_str())
        .bind(&new.workspace_id)
        .bind(&new.repo)
        .bind(new.base.as_deref())
        .bind(&new.agent)
        .bind(new.model.as_deref())
        .bind(&new.title)
        .bind(egress)
        .bind(new.setup.as_deref())
        .bind(prompt_bytes)
        .bind(now)
        .bind(new.budget.tokens.map(i64::try_from).transpose().map_err(internal)?)
        .bind(
            new.budget
                .compute_seconds
                .map(|seconds| i64::try_from(seconds.saturating_mul(1000)))
                .transpose()
                .map_err(internal)?,
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO turns (session_id, n, prompt, status, mode, created_at) VALUES ($1, 1, $2, 'accepted', 'queue', $3)")
            .bind(new.id.as_str())
            .bind(&new.task)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        self.record_event(
            &mut tx,
            &new.id,
            None,
            EventChange::Phase(SessionPhase::Queued),
            None,
            now,
        )
        .await?;
        self.record_event(
            &mut tx,
            &new.id,
            Some(1),
            EventChange::Status(TurnStatus::Accepted),
            None,
            now,
        )
        .await?;
        self.commit_events(tx).await?;
        self.fetch_session(&new.workspace_id, &new.id).await
    }

    async fn list_sessions(&self, workspace_id: &str, filter: &SessionFilter) -> StoreResult<Vec<SessionRow>> {
        let rows = sqlx::query(session_select!(
            "WHERE s.workspace_id = $1 AND s.archived = $2 AND ($3 IS NULL OR s.phase = $3) \
             AND ($4 IS NULL OR s.repo = $4) AND ($5 IS NULL OR s.id < $5) ORDER BY s.id DESC LIMIT $6"
        ))
        .bind(workspace_id)
        .bind(i64::from(filter.archived))
        .bind(filter.phase.map(SessionPhase::as_str))
        .bind(filter.repo.as_deref())
        .bind(filter.before.as_ref().map(SessionId::as_str))
        .bind(i64::from(filter.limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(session_from_row).collect()
    }

    async fn request_stop(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<TurnRow> {
        let session = self.fetch_session(workspace_id, session_id).await?;
        let row = sqlx::query(
            "UPDATE turns SET stop_requested = 'stop' WHERE session_id = $1 AND status = 'running' \
             AND (stop_requested IS NULL OR stop_requested = 'interrupt') RETURNING n",
        )
        .bind(session.id.as_str())
        .fetch_optional(&self.writer)
        .await?;
        match row {
            Some(row) => self.fetch_turn(session_id, get_u32(&row, "n")?).await,
            None => {
                // Already asked to stop (or cancel): answer with the running turn so the call is idempotent.
                let running = sqlx::query(turn_select!("WHERE session_id = $1 AND status = 'running'"))
                    .bind(session.id.as_str())
                    .fetch_optional(&self.pool)
                    .await?;
                match running {
                    Some(row) => turn_from_row(&row),
                    None => Err(StoreError::NoTurnRunning),
                }
            }
        }
    }

    async fn cancel(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow> {
        for _ in 0..CAS_ATTEMPTS {
            let session = self.fetch_session(workspace_id, session_id).await?;
            if matches!(session.phase, SessionPhase::Canceled | SessionPhase::Canceling) {
                return Ok(session);
            }
            // A turn in flight is stopped, delivered and torn down by its worker, which then says
            // `canceled`; a resting session is canceled at once.
            let to = if session.phase.has_active_turn() && session.phase != SessionPhase::Queued {
                SessionPhase::Canceling
            } else {
                SessionPhase::Canceled
            };
            let now = now_ms();
            let mut tx = self.begin_write().await?;
            let changed = sqlx::query(
                "UPDATE sessions SET phase = $4, n_waiting = 0, queued_reason = NULL, resume_requested = 0, \
                 updated_at = $3 WHERE id = $1 AND phase = $2",
            )
            .bind(session_id.as_str())
            .bind(session.phase.as_str())
            .bind(now)
            .bind(to.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if changed == 0 {
                tx.rollback().await?;
                continue;
            }
            let dropped = sqlx::query(
                "UPDATE turns SET status = 'canceled', completed_at = $2 WHERE session_id = $1 AND status = 'accepted' \
                 RETURNING n",
            )
            .bind(session_id.as_str())
            .bind(now)
            .fetch_all(&mut *tx)
            .await?;
            sqlx::query("UPDATE turns SET stop_requested = 'cancel' WHERE session_id = $1 AND status = 'running'")
                .bind(session_id.as_str())
                .execute(&mut *tx)
                .await?;
            self.record_event(&mut tx, session_id, None, EventChange::Phase(to), None, now)
                .await?;
            let mut dropped = dropped
                .iter()
                .map(|row| get_u32(row, "n"))
                .collect::<StoreResult<Vec<u32>>>()?;
            dropped.sort_unstable();
            for n in dropped {
                self.record_event(
                    &mut tx,
                    session_id,
                    Some(n),
                    EventChange::Status(TurnStatus::Canceled),
                    None,
                    now,
                )
                .await?;
            }
            self.commit_events(tx).await?;
            return self.fetch_session(workspace_id, session_id).await;
        }
        Err(StoreError::Conflict(
            "the session changed too often while canceling; try again".into(),
        ))
    }

    async fn resume(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow> {
        for _ in 0..CAS_ATTEMPTS {
            let session = self.fetch_session(workspace_id, session_id).await?;
            if matches!(session.phase, SessionPhase::Canceled | SessionPhase::Canceling) {
                return Err(StoreError::NotSteerable("canceled"));
            }
            if session.archived {
                return Err(StoreError::NotSteerable("archived"));
            }
            if session.pruned_at.is_some() {
                return Err(StoreError::NotSteerable("pruned by retention (its workspace is gone)"));
            }
            if session.phase != SessionPhase::Hibernated {
                return Ok(session);
            }
            let now = now_ms();
            let mut tx = self.begin_write().await?;
            let changed = sqlx::query(
                "UPDATE sessions SET phase = 'queued', resume_requested = 1, updated_at = $2 \
                 WHERE id = $1 AND phase = 'hibernated' AND archived = 0 AND pruned_at IS NULL",
            )
            .bind(session_id.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if changed == 1 {
                self.record_event(
                    &mut tx,
                    session_id,
                    None,
                    EventChange::Phase(SessionPhase::Queued),
                    None,
                    now,
                )
                .await?;
                self.commit_events(tx).await?;
                return self.fetch_session(workspace_id, session_id).await;
            }
            tx.rollback().await?;
        }
        Err(StoreError::Conflict(
            "the session changed too often while resuming; try again".into(),
        ))
    }

    async fn set_egress_allow(
        &self,
        workspace_id: &str,
        session_id: &SessionId,
        allow: &[String],
    ) -> StoreResult<SessionRow> {
        let encoded = serde_json::to_string(allow).map_err(internal)?;
        let changed = sqlx::query(
            "UPDATE sessions SET egress_allow = $3, updated_at = $4 WHERE id = $1 AND workspace_id = $2 AND phase <> 'canceled'",
        )
        .bind(session_id.as_str())
        .bind(workspace_id)
        .bind(encoded)
        .bind(now_ms())
        .execute(&self.writer)
        .await?
        .rows_affected();
        let session = self.fetch_session(workspace_id, session_id).await?;
        if changed == 0 {
            return Err(StoreError::NotSteerable("canceled"));
        }
        Ok(session)
    }

    async fn set_archived(
        &self,
        workspace_id: &str,
        session_id: &SessionId,
        archived: bool,
    ) -> StoreResult<SessionRow> {
        for _ in 0..CAS_ATTEMPTS {
            let session = self.fetch_session(workspace_id, session_id).await?;
            if session.archived == archived {
                return Ok(session);
            }
            if archived && session.phase.has_active_turn() {
                return Err(StoreError::SessionActive(session.phase));
            }
            let changed = sqlx::query(
                "UPDATE sessions SET archived = $2, updated_at = $3 WHERE id = $1 AND phase = $4 AND archived = $5",
            )
            .bind(session_id.as_str())
            .bind(i64::from(archived))
            .bind(now_ms())
            .bind(session.phase.as_str())
            .bind(i64::from(session.archived))
            .execute(&self.writer)
            .await?
            .rows_affected();
            if changed == 1 {
                return self.fetch_session(workspace_id, session_id).await;
            }
        }
        Err(StoreError::Conflict(
            "the session changed too often while archiving; try again".into(),
        ))
    }

    async fn tokens(&self, workspace_id: Option<&str>) -> StoreResult<Vec<TokenRow>> {
        macro_rules! token_select {
            ($where:literal) => {
                concat!(
                    "SELECT t.id, t.workspace_id, w.name, t.role, t.label, t.created_at, t.revoked_at, ",
                    "t.expires_at, t.last_used_at FROM tokens t JOIN workspaces w ON w.id = t.workspace_id ",
                    $where,
                    " ORDER BY t.created_at DESC, t.id DESC"
                )
            };
        }
        let rows = match workspace_id {
            Some(workspace_id) => {
                sqlx::query(token_select!("WHERE t.workspace_id = $1"))
                    .bind(workspace_id)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => sqlx::query(token_select!("")).fetch_all(&self.pool).await?,
        };
        rows.iter()
            .map(|row| {
                let role: String = row.try_get("role")?;
                Ok(TokenRow {
                    id: row.try_get("id")?,
                    workspace_id: row.try_get("workspace_id")?,
                    workspace_name: row.try_get("name")?,
                    role: Role::from_str(&role).map_err(internal)?,
                    label: row.try_get("label")?,
                    created_at: row.try_get("created_at")?,
                    revoked_at: row.try_get("revoked_at")?,
                    expires_at: row.try_get("expires_at")?,
                    last_used_at: row.try_get("last_used_at")?,
                })
            })
            .collect()
    }

    async fn revoke_token(&self, workspace_id: &str, token_id: &str) -> StoreResult<bool> {
        let updated =
            sqlx::query("UPDATE tokens SET revoked_at = $3 WHERE workspace_id = $1 AND id = $2 AND revoked_at IS NULL")
                .bind(workspace_id)
                .bind(token_id)
                .bind(now_ms())
                .execute(&self.writer)
                .await?
                .rows_affected();
        Ok(updated > 0)
    }

    async fn presets(&self, workspace_id: &str) -> StoreResult<Vec<PresetRow>> {
        let rows = sqlx::query(
            "SELECT repo, agent, setup, egress_allow, updated_at FROM repo_presets WHERE workspace_id = $1 ORDER BY repo",
        )
        .bind(workspace_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let allow: String = row.try_get("egress_allow")?;
                Ok(PresetRow {
                    repo: row.try_get("repo")?,
                    agent: row.try_get("agent")?,
                    setup: row.try_get("setup")?,
                    egress_allow: serde_json::from_str(&allow).map_err(internal)?,
                    updated_at: row.try_get("updated_at")?,
                })
            })
            .collect()
    }

    async fn put_preset(&self, workspace_id: &str, preset: &PresetRow) -> StoreResult<()> {
        let allow = serde_json::to_string(&preset.egress_allow).map_err(internal)?;
        sqlx::query(
            "INSERT INTO repo_presets (workspace_id, repo, agent, setup, egress_allow, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (workspace_id, repo) DO UPDATE SET \
             agent = excluded.agent, setup = excluded.setup, egress_allow = excluded.egress_allow, \
             updated_at = excluded.updated_at",
        )
        .bind(workspace_id)
        .bind(&preset.repo)
        .bind(preset.agent.as_deref())
        .bind(preset.setup.as_deref())
        .bind(allow)
        .bind(preset.updated_at)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn delete_preset(&self, workspace_id: &str, repo: &str) -> StoreResult<bool> {
        let deleted = sqlx::query("DELETE FROM repo_presets WHERE workspace_id = $1 AND repo = $2")
            .bind(workspace_id)
            .bind(repo)
            .execute(&self.writer)
            .await?
            .rows_affected();
        Ok(deleted > 0)
    }

    async fn branch_diff(&self, session_id: &SessionId) -> StoreResult<Option<sortie_protocol::api::StoredDiff>> {
        let row = sqlx::query("SELECT body FROM branch_diffs WHERE session_id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let body: String = row.try_get("body")?;
        serde_json::from_str(&body).map(Some).map_err(internal)
    }

    fn event_signal(&self) -> tokio::sync::watch::Receiver<u64> {
        self.events.subscribe()
    }

    fn hears_other_processes(&self) -> bool {
        self.listener.is_some()
    }

    async fn latest_event(&self) -> StoreResult<u64> {
        let row = sqlx::query("SELECT COALESCE(MAX(seq), 0) AS seq FROM events")
            .fetch_one(&self.pool)
            .await?;
        get_u64(&row, "seq")
    }

    async fn events_after(&self, workspace_id: Option<&str>, after: u64, limit: u32) -> StoreResult<EventPage> {
        let after = i64::try_from(after).unwrap_or(i64::MAX);
        // The horizon is read first: an event pruned after this read was still there to be read.
        let horizon = sqlx::query("SELECT pruned_through FROM event_horizon WHERE id = 1")
            .fetch_one(&self.pool)
            .await?;
        let pruned_through = get_u64(&horizon, "pruned_through")?;
        let rows = match workspace_id {
            Some(workspace_id) => {
                sqlx::query(
                    "SELECT seq, workspace_id, session_id, turn, kind, state, failure_code, failure_reason, at \
                     FROM events WHERE workspace_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(workspace_id)
                .bind(after)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(
                    "SELECT seq, workspace_id, session_id, turn, kind, state, failure_code, failure_reason, at \
                     FROM events WHERE seq > $1 ORDER BY seq LIMIT $2",
                )
                .bind(after)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?
            }
        };
        Ok(EventPage {
            events: rows.iter().map(event_from_row).collect::<StoreResult<_>>()?,
            pruned_through,
        })
    }

    async fn prune_events(&self, before_ms: i64) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let newest = sqlx::query("SELECT MAX(seq) AS seq FROM events WHERE at < $1")
            .bind(before_ms)
            .fetch_one(&mut *tx)
            .await?;
        let Some(through) = newest.try_get::<Option<i64>, _>("seq")? else {
            tx.rollback().await?;
            return Ok(0);
        };
        // Everything up to the newest old event goes, so what is kept has no hole a reader could miss.
        let pruned = sqlx::query("DELETE FROM events WHERE seq <= $1")
            .bind(through)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        sqlx::query("UPDATE event_horizon SET pruned_through = $1 WHERE id = 1 AND pruned_through < $1")
            .bind(through)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(pruned)
    }

    async fn claim_idempotency_key(
        &self,
        workspace_id: &str,
        key: &str,
        scope: &str,
        request_hash: &str,
        expired_before_ms: i64,
    ) -> StoreResult<IdempotencyClaim> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM idempotency_keys WHERE created_at < $1")
            .bind(expired_before_ms)
            .execute(&mut *tx)
            .await?;
        let claimed = sqlx::query(
            "INSERT INTO idempotency_keys (workspace_id, idem_key, scope, request_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (workspace_id, idem_key) DO NOTHING",
        )
        .bind(workspace_id)
        .bind(key)
        .bind(scope)
        .bind(request_hash)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if claimed == 1 {
            tx.commit().await?;
            return Ok(IdempotencyClaim::Fresh);
        }
        let row = sqlx::query(
            "SELECT scope, request_hash, status, body FROM idempotency_keys WHERE workspace_id = $1 AND idem_key = $2",
        )
        .bind(workspace_id)
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        let (held_scope, held_hash): (String, String) = (row.try_get("scope")?, row.try_get("request_hash")?);
        if held_scope != scope || held_hash != request_hash {
            return Ok(IdempotencyClaim::OtherRequest);
        }
        let status: Option<i64> = row.try_get("status")?;
        let body: Option<String> = row.try_get("body")?;
        Ok(match (status, body) {
            (Some(status), Some(body)) => IdempotencyClaim::Answered {
                status: u16::try_from(status).map_err(internal)?,
                body,
            },
            _ => IdempotencyClaim::InFlight,
        })
    }

    async fn answer_idempotency_key(&self, workspace_id: &str, key: &str, status: u16, body: &str) -> StoreResult<()> {
        sqlx::query("UPDATE idempotency_keys SET status = $3, body = $4 WHERE workspace_id = $1 AND idem_key = $2")
            .bind(workspace_id)
            .bind(key)
            .bind(i64::from(status))
            .bind(body)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn release_idempotency_key(&self, workspace_id: &str, key: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM idempotency_keys WHERE workspace_id = $1 AND idem_key = $2 AND status IS NULL")
            .bind(workspace_id)
            .bind(key)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn create_webhook(&self, new: NewWebhook) -> StoreResult<WebhookRow> {
        let events = serde_json::to_string(&new.events).map_err(internal)?;
        sqlx::query(
            "INSERT INTO webhooks (id, workspace_id, url, secret_ciphertext, secret_nonce, events, event_cursor, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&new.id)
        .bind(&new.workspace_id)
        .bind(&new.url)
        .bind(&new.secret_ciphertext)
        .bind(&new.secret_nonce)
        .bind(events)
        .bind(i64::try_from(new.cursor).map_err(internal)?)
        .bind(now_ms())
        .execute(&self.writer)
        .await?;
        let row = sqlx::query(webhook_select!("WHERE id = $1"))
            .bind(&new.id)
            .fetch_one(&self.pool)
            .await?;
        webhook_from_row(&row)
    }

    async fn webhooks(&self, workspace_id: Option<&str>) -> StoreResult<Vec<WebhookRow>> {
        let rows = sqlx::query(webhook_select!(
            "WHERE ($1 IS NULL OR workspace_id = $1) ORDER BY created_at, id"
        ))
        .bind(workspace_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(webhook_from_row).collect()
    }

    async fn delete_webhook(&self, workspace_id: &str, webhook_id: &str) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let owned = sqlx::query("SELECT id FROM webhooks WHERE id = $1 AND workspace_id = $2")
            .bind(webhook_id)
            .bind(workspace_id)
            .fetch_optional(&mut *tx)
            .await?;
        if owned.is_none() {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query("DELETE FROM webhook_deliveries WHERE webhook_id = $1")
            .bind(webhook_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM webhooks WHERE id = $1")
            .bind(webhook_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn enqueue_deliveries(
        &self,
        webhook_id: &str,
        from: u64,
        to: u64,
        deliveries: &[NewDelivery],
    ) -> StoreResult<bool> {
        let now = now_ms();
        let mut tx = self.begin_write().await?;
        let moved = sqlx::query("UPDATE webhooks SET event_cursor = $3 WHERE id = $1 AND event_cursor = $2")
            .bind(webhook_id)
            .bind(i64::try_from(from).map_err(internal)?)
            .bind(i64::try_from(to).map_err(internal)?)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if moved != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        for delivery in deliveries {
            sqlx::query(
                "INSERT INTO webhook_deliveries (id, webhook_id, event_seq, kind, payload, state, attempts, next_at, created_at) \
                 VALUES ($1, $2, $3, $4, $5, 'pending', 0, $6, $6) ON CONFLICT (webhook_id, event_seq) DO NOTHING",
            )
            .bind(&delivery.id)
            .bind(webhook_id)
            .bind(i64::try_from(delivery.event_seq).map_err(internal)?)
            .bind(&delivery.kind)
            .bind(&delivery.payload)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn claim_due_deliveries(
        &self,
        now_ms: i64,
        lease_until_ms: i64,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryRow>> {
        let candidates = sqlx::query(
            "SELECT id FROM webhook_deliveries WHERE state = 'pending' AND next_at <= $1 \
             AND (lease_until IS NULL OR lease_until < $1) ORDER BY next_at, id LIMIT $2",
        )
        .bind(now_ms)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut claimed = Vec::new();
        for candidate in &candidates {
            let id: String = candidate.try_get("id")?;
            let row = sqlx::query(delivery_select!(
                "UPDATE webhook_deliveries SET lease_until = $3 WHERE id = $1 AND state = 'pending' \
                 AND (lease_until IS NULL OR lease_until < $2) RETURNING "
            ))
            .bind(&id)
            .bind(now_ms)
            .bind(lease_until_ms)
            .fetch_optional(&self.writer)
            .await?;
            if let Some(row) = row {
                claimed.push(delivery_from_row(&row)?);
            }
        }
        Ok(claimed)
    }

    async fn record_delivery_attempt(&self, delivery_id: &str, outcome: &AttemptOutcome) -> StoreResult<()> {
        let now = now_ms();
        let (state, status, error, next_at, delivered_at) = match outcome {
            AttemptOutcome::Delivered { status } => (DeliveryState::Delivered, Some(*status), None, now, Some(now)),
            AttemptOutcome::Retry { status, error, next_at } => {
                (DeliveryState::Pending, *status, Some(error.as_str()), *next_at, None)
            }
            AttemptOutcome::GaveUp { status, error } => {
                (DeliveryState::Failed, *status, Some(error.as_str()), now, None)
            }
        };
        sqlx::query(
            "UPDATE webhook_deliveries SET state = $2, attempts = attempts + 1, last_status = $3, last_error = $4, \
             next_at = $5, delivered_at = $6, lease_until = NULL WHERE id = $1",
        )
        .bind(delivery_id)
        .bind(state.as_str())
        .bind(status.map(i64::from))
        .bind(error)
        .bind(next_at)
        .bind(delivered_at)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn webhook_deliveries(
        &self,
        workspace_id: &str,
        webhook_id: &str,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryRow>> {
        let rows = sqlx::query(delivery_select!(
            "SELECT ",
            " FROM webhook_deliveries WHERE webhook_id = $1 AND EXISTS \
             (SELECT 1 FROM webhooks w WHERE w.id = $1 AND w.workspace_id = $2) ORDER BY event_seq DESC LIMIT $3"
        ))
        .bind(webhook_id)
        .bind(workspace_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(delivery_from_row).collect()
    }

    async fn usage(&self, workspace_id: &str, session_id: Option<&SessionId>) -> StoreResult<UsageRecords> {
        let session_filter = session_id.map(SessionId::as_str);
        let token_rows = sqlx::query(
            "SELECT u.session_id, u.day, u.model, CAST(SUM(u.input_tokens) AS BIGINT) AS input_tokens, \
             CAST(SUM(u.output_tokens) AS BIGINT) AS output_tokens FROM usage_tokens u JOIN sessions s ON s.id = u.session_id \
             WHERE s.workspace_id = $1 AND ($2 IS NULL OR u.session_id = $2) GROUP BY u.session_id, u.day, u.model \
             ORDER BY u.day DESC, u.session_id, u.model",
        )
        .bind(workspace_id)
        .bind(session_filter)
        .fetch_all(&self.pool)
        .await?;
        let compute_rows = sqlx::query(
            "SELECT u.session_id, u.day, CAST(SUM(u.compute_ms) AS BIGINT) AS compute_ms FROM usage_compute u \
             JOIN sessions s ON s.id = u.session_id WHERE s.workspace_id = $1 AND ($2 IS NULL OR u.session_id = $2) \
             GROUP BY u.session_id, u.day ORDER BY u.day DESC, u.session_id",
        )
        .bind(workspace_id)
        .bind(session_filter)
        .fetch_all(&self.pool)
        .await?;
        let session_of = |row: &AnyRow| -> StoreResult<SessionId> {
            let id: String = row.try_get("session_id")?;
            SessionId::parse(&id).map_err(internal)
        };
        let mut records = UsageRecords::default();
        for row in &token_rows {
            records.tokens.push((
                session_of(row)?,
                row.try_get("day")?,
                row.try_get("model")?,
                get_u64(row, "input_tokens")?,
                get_u64(row, "output_tokens")?,
            ));
        }
        for row in &compute_rows {
            records
                .compute
                .push((session_of(row)?, row.try_get("day")?, get_u64(row, "compute_ms")?));
        }
        Ok(records)
    }
}

#[async_trait]
impl Ledger for SqlStore {
    async fn claim_turn(&self, session_id: &SessionId, warm: bool, worker_id: &str) -> StoreResult<Option<TurnRow>> {
        let to = if warm {
            SessionPhase::Running
        } else {
            SessionPhase::Provisioning
        };
        let session = self.fetch_session_any_workspace(session_id).await?;
        if session.phase != SessionPhase::Queued || session.n_waiting == 0 {
            return Ok(None);
        }
        let next = sqlx::query("SELECT MIN(n) AS n FROM turns WHERE session_id = $1 AND status = 'accepted'")
            .bind(session_id.as_str())
            .fetch_one(&self.pool)
            .await?;
        let Some(n) = next.try_get::<Option<i64>, _>("n")? else {
            return Ok(None);
        };
        let now = now_ms();
        let (_turn, mut tx) = self.begin_background_write().await?;
        if self.backend == Backend::Postgres {
            // Another worker claiming this session right now holds its row: move on to the next
            // session instead of queueing behind its lock (SQLite's BEGIN IMMEDIATE already serialises).
            let free = sqlx::query("SELECT id FROM sessions WHERE id = $1 AND phase = 'queued' FOR UPDATE SKIP LOCKED")
                .bind(session_id.as_str())
                .fetch_optional(&mut *tx)
                .await?;
            if free.is_none() {
                tx.rollback().await?;
                return Ok(None);
            }
        }
        let session_claimed = sqlx::query(
            "UPDATE sessions SET phase = $2, n_waiting = n_waiting - 1, current_turn = $3, queued_reason = NULL, \
             resume_requested = 0, updated_at = $4 WHERE id = $1 AND phase = 'queued' AND n_waiting > 0 \
             AND NOT EXISTS (SELECT 1 FROM turns WHERE session_id = $1 AND status = 'running')",
        )
        .bind(session_id.as_str())
        .bind(to.as_str())
        .bind(n)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let turn_claimed = if session_claimed == 1 {
            sqlx::query("UPDATE turns SET status = 'running', started_at = $3, claimed_by = $4 WHERE session_id = $1 AND n = $2 AND status = 'accepted'")
                .bind(session_id.as_str())
                .bind(n)
                .bind(now)
                .bind(worker_id)
                .execute(&mut *tx)
                .await?
                .rows_affected()
        } else {
            0
        };
        if turn_claimed != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        let n = u32::try_from(n).map_err(internal)?;
        self.record_event(&mut tx, session_id, None, EventChange::Phase(to), None, now)
            .await?;
        self.record_event(
            &mut tx,
            session_id,
            Some(n),
            EventChange::Status(TurnStatus::Running),
            None,
            now,
        )
        .await?;
        self.commit_events(tx).await?;
        Ok(Some(self.fetch_turn(session_id, n).await?))
    }

    async fn transition_session(
        &self,
        session_id: &SessionId,
        from: SessionPhase,
        to: SessionPhase,
    ) -> StoreResult<bool> {
        if !from.can_become(to) {
            return Err(StoreError::IllegalTransition {
                from: from.to_string(),
                to: to.to_string(),
            });
        }
        let now = now_ms();
        let (_turn, mut tx) = self.begin_background_write().await?;
        let changed = sqlx::query("UPDATE sessions SET phase = $3, updated_at = $4 WHERE id = $1 AND phase = $2")
            .bind(session_id.as_str())
            .bind(from.as_str())
            .bind(to.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if changed != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        self.record_event(&mut tx, session_id, None, EventChange::Phase(to), None, now)
            .await?;
        self.commit_events(tx).await?;
        Ok(true)
    }

    async fn finish_turn(&self, session_id: &SessionId, n: u32, outcome: TurnOutcome) -> StoreResult<bool> {
        check_turn_end(outcome.status)?;
        let now = now_ms();
        let mut tx = self.begin_write().await?;
        if !self.write_turn_end(&mut tx, session_id, n, &outcome, now).await? {
            tx.rollback().await?;
            return Ok(false);
        }
        self.commit_events(tx).await?;
        Ok(true)
    }

    async fn end_turn(&self, session_id: &SessionId, n: u32, ending: TurnOutcome) -> StoreResult<SessionPhase> {
        check_turn_end(ending.status)?;
        let failed = matches!(ending.status, TurnStatus::Failed | TurnStatus::Lost);
        let now = now_ms();
        let (_turn, mut tx) = self.begin_background_write().await?;
        let lock = match self.backend {
            // SQLite's BEGIN IMMEDIATE already serialises writers; PostgreSQL holds the session's row
            // so a steer cannot slip a waiting turn in between the read and the write below.
            Backend::Postgres => "SELECT phase FROM sessions WHERE id = $1 FOR UPDATE",
            Backend::Sqlite => "SELECT phase FROM sessions WHERE id = $1",
        };
        let row = sqlx::query(lock)
            .bind(session_id.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound)?;
        let phase: String = row.try_get("phase")?;
        let before = SessionPhase::from_str(&phase).map_err(internal)?;
        let turn_ended = self.write_turn_end(&mut tx, session_id, n, &ending, now).await?;
        let settles = matches!(
            before,
            SessionPhase::Provisioning | SessionPhase::Running | SessionPhase::Delivering
        );
        if !settles {
            if turn_ended {
                self.commit_events(tx).await?;
            } else {
                tx.rollback().await?;
            }
            return Ok(before);
        }
        let row = sqlx::query(
            "UPDATE sessions SET phase = CASE WHEN n_waiting > 0 THEN 'queued' WHEN $2 = 1 THEN 'failed' \
             ELSE 'idle' END, updated_at = $3, budget_paused_at = NULL WHERE id = $1 RETURNING phase",
        )
        .bind(session_id.as_str())
        .bind(i64::from(failed))
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let phase: String = row.try_get("phase")?;
        let after = SessionPhase::from_str(&phase).map_err(internal)?;
        if before == SessionPhase::Running {
            // Every turn's session passes through `delivering` (what watchers of phases rely on).
            let delivering = EventChange::Phase(SessionPhase::Delivering);
            self.record_event(&mut tx, session_id, None, delivering, None, now)
                .await?;
        }
        self.record_event(&mut tx, session_id, None, EventChange::Phase(after), None, now)
            .await?;
        self.commit_events(tx).await?;
        Ok(after)
    }

    async fn requeue_unstarted_turn(&self, session_id: &SessionId, n: u32) -> StoreResult<bool> {
        let now = now_ms();
        let mut tx = self.begin_write().await?;
        let turn = sqlx::query(
            "UPDATE turns SET status = 'accepted', started_at = NULL, claimed_by = NULL \
             WHERE session_id = $1 AND n = $2 AND status = 'running' AND driver_nonce IS NULL \
             AND NOT EXISTS (SELECT 1 FROM parts WHERE session_id = $1 AND turn = $2)",
        )
        .bind(session_id.as_str())
        .bind(i64::from(n))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let session = if turn == 1 {
            sqlx::query(
                "UPDATE sessions SET phase = 'queued', n_waiting = n_waiting + 1, updated_at = $2 \
                 WHERE id = $1 AND phase = 'provisioning'",
            )
            .bind(session_id.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        } else {
            0
        };
        if session != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        self.record_event(
            &mut tx,
            session_id,
            None,
            EventChange::Phase(SessionPhase::Queued),
            None,
            now,
        )
        .await?;
        self.record_event(
            &mut tx,
            session_id,
            Some(n),
            EventChange::Status(TurnStatus::Accepted),
            None,
            now,
        )
        .await?;
        self.commit_events(tx).await?;
        Ok(true)
    }

    async fn claimable_sessions(&self, limit: u32) -> StoreResult<Vec<SessionRow>> {
        let rows = sqlx::query(session_select!(
            "WHERE s.phase = 'queued' AND (s.n_waiting > 0 OR s.resume_requested = 1) ORDER BY s.updated_at, s.id LIMIT $1"
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(session_from_row).collect()
    }

    async fn sessions_in_phases(&self, phases: &[SessionPhase]) -> StoreResult<Vec<SessionRow>> {
        let mut found = Vec::new();
        for phase in phases {
            let rows = sqlx::query(session_select!("WHERE s.phase = $1 ORDER BY s.id"))
                .bind(phase.as_str())
                .fetch_all(&self.pool)
                .await?;
            for row in &rows {
                found.push(session_from_row(row)?);
            }
        }
        Ok(found)
    }

    async fn session_by_id(&self, session_id: &SessionId) -> StoreResult<SessionRow> {
        self.fetch_session_any_workspace(session_id).await
    }

    async fn turn(&self, session_id: &SessionId, n: u32) -> StoreResult<TurnRow> {
        self.fetch_turn(session_id, n).await
    }

    async fn set_queued_reason(&self, session_id: &SessionId, reason: Option<&str>) -> StoreResult<()> {
        sqlx::query(
            "UPDATE sessions SET queued_reason = $2 WHERE id = $1 AND phase = 'queued' \
             AND COALESCE(queued_reason, '') <> COALESCE($2, '')",
        )
        .bind(session_id.as_str())
        .bind(reason)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn settle_session(
        &self,
        session_id: &SessionId,
        from: SessionPhase,
        failed: bool,
    ) -> StoreResult<Option<SessionPhase>> {
        for to in [SessionPhase::Queued, SessionPhase::Failed, SessionPhase::Idle] {
            if !from.can_become(to) {
                return Err(StoreError::IllegalTransition {
                    from: from.to_string(),
                    to: to.to_string(),
                });
            }
        }
        let now = now_ms();
        let mut tx = self.begin_write().await?;
        let row = sqlx::query(
            "UPDATE sessions SET phase = CASE WHEN n_waiting > 0 THEN 'queued' WHEN $3 = 1 THEN 'failed' ELSE 'idle' END, \
             updated_at = $4 WHERE id = $1 AND phase = $2 RETURNING phase",
        )
        .bind(session_id.as_str())
        .bind(from.as_str())
        .bind(i64::from(failed))
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            return Ok(None);
        };
        let phase: String = row.try_get("phase")?;
        let phase = SessionPhase::from_str(&phase).map_err(internal)?;
        self.record_event(&mut tx, session_id, None, EventChange::Phase(phase), None, now)
            .await?;
        self.commit_events(tx).await?;
        Ok(Some(phase))
    }

    async fn claim_resume(&self, session_id: &SessionId) -> StoreResult<bool> {
        let now = now_ms();
        let mut tx = self.begin_write().await?;
        let changed = sqlx::query(
            "UPDATE sessions SET phase = 'provisioning', resume_requested = 0, queued_reason = NULL, updated_at = $2 \
             WHERE id = $1 AND phase = 'queued' AND resume_requested = 1 AND n_waiting = 0",
        )
        .bind(session_id.as_str())
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        self.record_event(
            &mut tx,
            session_id,
            None,
            EventChange::Phase(SessionPhase::Provisioning),
            None,
            now,
        )
        .await?;
        self.commit_events(tx).await?;
        Ok(true)
    }

    async fn set_turn_details(
        &self,
        session_id: &SessionId,
        n: u32,
        priming: Option<&str>,
        timings: Option<&std::collections::BTreeMap<String, u64>>,
    ) -> StoreResult<()> {
        let timings = timings.map(serde_json::to_string).transpose().map_err(internal)?;
        sqlx::query(
            "UPDATE turns SET priming = COALESCE($3, priming), timings = COALESCE($4, timings) \
             WHERE session_id = $1 AND n = $2",
        )
        .bind(session_id.as_str())
        .bind(i64::from(n))
        .bind(priming)
        .bind(timings.as_deref())
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn set_pushed_head(&self, session_id: &SessionId, head: &str) -> StoreResult<()> {
        let updated = sqlx::query("UPDATE sessions SET pushed_head = $2, wip_head = NULL WHERE id = $1")
            .bind(session_id.as_str())
            .bind(head)
            .execute(&self.writer)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn pushed_head(&self, session_id: &SessionId) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT pushed_head FROM sessions WHERE id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        Ok(row.try_get("pushed_head")?)
    }

    async fn set_wip_head(&self, session_id: &SessionId, head: Option<&str>) -> StoreResult<()> {
        let updated = sqlx::query("UPDATE sessions SET wip_head = $2 WHERE id = $1")
            .bind(session_id.as_str())
            .bind(head)
            .execute(&self.writer)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn wip_head(&self, session_id: &SessionId) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT wip_head FROM sessions WHERE id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        Ok(row.try_get("wip_head")?)
    }

    async fn set_driver_nonce(&self, session_id: &SessionId, n: u32, nonce: &str) -> StoreResult<()> {
        let updated = sqlx::query("UPDATE turns SET driver_nonce = $3 WHERE session_id = $1 AND n = $2")
            .bind(session_id.as_str())
            .bind(i64::from(n))
            .bind(nonce)
            .execute(&self.writer)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn set_home_snapshot(&self, session_id: &SessionId, tar: &[u8]) -> StoreResult<()> {
        use base64::Engine as _;
        let body = base64::engine::general_purpose::STANDARD.encode(tar);
        sqlx::query(
            "INSERT INTO home_snapshots (session_id, body, bytes, updated_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (session_id) DO UPDATE SET body = excluded.body, bytes = excluded.bytes, \
             updated_at = excluded.updated_at",
        )
        .bind(session_id.as_str())
        .bind(body)
        .bind(i64::try_from(tar.len()).map_err(internal)?)
        .bind(now_ms())
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn home_snapshot(&self, session_id: &SessionId) -> StoreResult<Option<Vec<u8>>> {
        use base64::Engine as _;
        let row = sqlx::query("SELECT body FROM home_snapshots WHERE session_id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let body: String = row.try_get("body")?;
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .map(Some)
            .map_err(internal)
    }

    async fn set_branch_diff(
        &self,
        session_id: &SessionId,
        diff: &sortie_protocol::api::StoredDiff,
    ) -> StoreResult<()> {
        let body = serde_json::to_string(diff).map_err(internal)?;
        sqlx::query(
            "INSERT INTO branch_diffs (session_id, head_sha, body, updated_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (session_id) DO UPDATE SET head_sha = excluded.head_sha, body = excluded.body, \
             updated_at = excluded.updated_at",
        )
        .bind(session_id.as_str())
        .bind(&diff.head_sha)
        .bind(body)
        .bind(now_ms())
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn set_session_pr(&self, session_id: &SessionId, url: &str, number: u64) -> StoreResult<bool> {
        let number = i64::try_from(number).map_err(internal)?;
        let updated = sqlx::query(
            "UPDATE sessions SET pr_url = $2, pr_number = $3, updated_at = $4 WHERE id = $1 AND pr_url IS NULL",
        )
        .bind(session_id.as_str())
        .bind(url)
        .bind(number)
        .bind(now_ms())
        .execute(&self.writer)
        .await?
        .rows_affected();
        Ok(updated > 0)
    }

    async fn put_sandbox(
        &self,
        session_id: &SessionId,
        backend: &str,
        handle: &str,
        worker_id: &str,
    ) -> StoreResult<()> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO sandboxes (session_id, backend, handle, state, worker_id, created_at, updated_at) \
             VALUES ($1, $2, $3, 'live', $4, $5, $5) ON CONFLICT (session_id) DO UPDATE SET backend = $2, \
             handle = $3, state = 'live', worker_id = $4, updated_at = $5, \
             cpu_ms = CASE WHEN sandboxes.handle = $3 THEN sandboxes.cpu_ms ELSE 0 END",
        )
        .bind(session_id.as_str())
        .bind(backend)
        .bind(handle)
        .bind(worker_id)
        .bind(now)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn delete_sandbox(&self, session_id: &SessionId) -> StoreResult<()> {
        sqlx::query("DELETE FROM sandboxes WHERE session_id = $1")
            .bind(session_id.as_str())
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn sandboxes(&self) -> StoreResult<Vec<SandboxRow>> {
        let rows = sqlx::query(
            "SELECT b.session_id, s.workspace_id, b.backend, b.handle, b.worker_id, b.created_at \
             FROM sandboxes b JOIN sessions s ON s.id = b.session_id ORDER BY b.created_at",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let id: String = row.try_get("session_id")?;
                Ok(SandboxRow {
                    session_id: SessionId::parse(&id).map_err(internal)?,
                    workspace_id: row.try_get("workspace_id")?,
                    backend: row.try_get("backend")?,
                    handle: row.try_get("handle")?,
                    worker_id: row.try_get("worker_id")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect()
    }

    async fn record_token_usage(&self, usage: &TokenUsage) -> StoreResult<()> {
        let day = sortie_protocol::api::utc_day_from_epoch_ms(usage.epoch_ms);
        let input = i64::try_from(usage.input_tokens).map_err(internal)?;
        let output = i64::try_from(usage.output_tokens).map_err(internal)?;
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO usage_tokens (session_id, turn, model, day, input_tokens, output_tokens, requests) \
             VALUES ($1, $2, $3, $4, $5, $6, 1) ON CONFLICT (session_id, turn, model, day) DO UPDATE SET \
             input_tokens = usage_tokens.input_tokens + $5, output_tokens = usage_tokens.output_tokens + $6, \
             requests = usage_tokens.requests + 1",
        )
        .bind(usage.session_id.as_str())
        .bind(i64::from(usage.turn))
        .bind(&usage.model)
        .bind(day)
        .bind(input)
        .bind(output)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE sessions SET input_tokens = input_tokens + $2, output_tokens = output_tokens + $3 WHERE id = $1",
        )
        .bind(usage.session_id.as_str())
        .bind(input)
        .bind(output)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn register_worker(&self, worker_id: &str, feed_url: Option<&str>) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO workers (id, feed_url, registered_at) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET feed_url = $2, registered_at = $3",
        )
        .bind(worker_id)
        .bind(feed_url)
        .bind(now_ms())
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn set_budget_paused(&self, session_id: &SessionId, paused: bool) -> StoreResult<bool> {
        let query = if paused {
            "UPDATE sessions SET budget_paused_at = $2 WHERE id = $1 AND budget_paused_at IS NULL"
        } else {
            "UPDATE sessions SET budget_paused_at = NULL WHERE id = $1 AND budget_paused_at IS NOT NULL AND $2 > 0"
        };
        let changed = sqlx::query(query)
            .bind(session_id.as_str())
            .bind(now_ms())
            .execute(&self.writer)
            .await?
            .rows_affected();
        Ok(changed > 0)
    }

    async fn meter_sandbox(
        &self,
        session_id: &SessionId,
        turn: u32,
        epoch_ms: i64,
        reading: SandboxReading,
    ) -> StoreResult<()> {
        let day = sortie_protocol::api::utc_day_from_epoch_ms(epoch_ms);
        let cumulative = i64::try_from(reading.cpu_ms).map_err(internal)?;
        let peak = i64::try_from(reading.peak_memory_bytes).map_err(internal)?;
        let (_turn, mut tx) = self.begin_background_write().await?;
        let metered = sqlx::query("SELECT cpu_ms FROM sandboxes WHERE session_id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| row.try_get::<i64, _>("cpu_ms"))
            .transpose()?
            .unwrap_or(0);
        // A reading below what was metered is a new sandbox's (its cgroup counts from zero).
        let used = if cumulative >= metered {
            cumulative - metered
        } else {
            cumulative
        };
        sqlx::query(
            "UPDATE sandboxes SET cpu_ms = $2, peak_memory_bytes = CASE WHEN peak_memory_bytes < $3 THEN $3 \
             ELSE peak_memory_bytes END WHERE session_id = $1",
        )
        .bind(session_id.as_str())
        .bind(cumulative)
        .bind(peak)
        .execute(&mut *tx)
        .await?;
        if used > 0 {
            sqlx::query(
                "INSERT INTO usage_compute (session_id, turn, day, compute_ms) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (session_id, turn, day) DO UPDATE SET compute_ms = usage_compute.compute_ms + $4",
            )
            .bind(session_id.as_str())
            .bind(i64::from(turn))
            .bind(day)
            .bind(used)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            "UPDATE sessions SET compute_ms = compute_ms + $2, peak_memory_bytes = CASE WHEN \
             peak_memory_bytes < $3 THEN $3 ELSE peak_memory_bytes END WHERE id = $1",
        )
        .bind(session_id.as_str())
        .bind(used)
        .bind(peak)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE turns SET cpu_ms = cpu_ms + $3, peak_memory_bytes = CASE WHEN peak_memory_bytes < $4 \
             THEN $4 ELSE peak_memory_bytes END WHERE session_id = $1 AND n = $2",
        )
        .bind(session_id.as_str())
        .bind(i64::from(turn))
        .bind(used)
        .bind(peak)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

#[async_trait]
impl Transcripts for SqlStore {
    async fn session(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<SessionRow> {
        self.fetch_session(workspace_id, session_id).await
    }

    async fn turns(&self, workspace_id: &str, session_id: &SessionId) -> StoreResult<Vec<TurnRow>> {
        // The workspace check and the read are one statement, so a foreign session yields nothing.
        let rows = sqlx::query(turn_select!(
            "WHERE session_id = $1 AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = $1 AND s.workspace_id = $2) ORDER BY n"
        ))
        .bind(session_id.as_str())
        .bind(workspace_id)
        .fetch_all(&self.pool)
        .await?;
        if rows.is_empty() {
            // Every session has turn 1, so no rows means no such session here.
            return Err(StoreError::NotFound);
        }
        rows.iter().map(turn_from_row).collect()
    }

    async fn append_parts(&self, session_id: &SessionId, turn: u32, parts: &[NewPart]) -> StoreResult<u64> {
        if parts.is_empty() {
            return Ok(0);
        }
        let count = i64::try_from(parts.len()).map_err(internal)?;
        let now = now_ms();
        let (_turn, mut tx) = self.begin_background_write().await?;
        let reserved =
            sqlx::query("UPDATE sessions SET next_part_seq = next_part_seq + $2 WHERE id = $1 RETURNING next_part_seq")
                .bind(session_id.as_str())
                .bind(count)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(StoreError::NotFound)?;
        let end: i64 = reserved.try_get("next_part_seq")?;
        let mut inserted = 0;
        let mut inserted_bytes = 0_i64;
        let mut first_seq = end - count;
        // One statement per slice of rows instead of one per row: a round trip per part made a
        // recorder's batch (and a long turn's harvest) cost as many round trips as parts. The rows it
        // added come back, so a replayed part counts neither in the session's parts nor its bytes.
        for slice in parts.chunks(INSERT_PARTS_PER_STATEMENT) {
            let mut query =
                sqlx::query(sqlx::AssertSqlSafe(insert_parts_sql(self.backend, slice.len()))).persistent(false);
            if self.backend == Backend::Postgres {
                query = query.bind(session_id.as_str()).bind(i64::from(turn)).bind(now);
            }
            for (offset, part) in (0_i64..).zip(slice) {
                if self.backend == Backend::Sqlite {
                    query = query.bind(session_id.as_str()).bind(i64::from(turn)).bind(now);
                }
                query = query
                    .bind(i64::from(part.part_index))
                    .bind(first_seq + offset)
                    .bind(&part.payload)
                    .bind(part.driver_index.map(i64::from));
            }
            let added = query.fetch_all(&mut *tx).await?;
            let by_index: std::collections::HashMap<u32, &NewPart> =
                slice.iter().map(|part| (part.part_index, part)).collect();
            for row in &added {
                let index = get_u32(row, "part_index")?;
                if let Some(part) = by_index.get(&index) {
                    inserted += 1;
                    inserted_bytes += i64::try_from(part.payload.len()).map_err(internal)?;
                }
            }
            first_seq += i64::try_from(slice.len()).map_err(internal)?;
        }
        if inserted > 0 {
            sqlx::query("UPDATE sessions SET part_count = part_count + $2, part_bytes = part_bytes + $3 WHERE id = $1")
                .bind(session_id.as_str())
                .bind(i64::try_from(inserted).map_err(internal)?)
                .bind(inserted_bytes)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(inserted)
    }

    async fn parts(&self, session_id: &SessionId) -> StoreResult<Vec<StoredPart>> {
        let rows = sqlx::query(
            "SELECT turn, part_index, seq, payload FROM parts WHERE session_id = $1 ORDER BY turn, part_index",
        )
        .bind(session_id.as_str())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(part_from_row).collect()
    }

    async fn transcript_progress(&self, session_id: &SessionId, turn: u32) -> StoreResult<TranscriptProgress> {
        // Bytes, not characters, on both backends.
        let query = match self.backend {
            Backend::Sqlite => {
                "SELECT MAX(part_index) AS last_index, MAX(driver_index) AS driver_cursor, COUNT(*) AS parts, \
                 COALESCE(SUM(LENGTH(CAST(payload AS BLOB))), 0) AS bytes FROM parts WHERE session_id = $1 AND turn = $2"
            }
            Backend::Postgres => {
                "SELECT MAX(part_index) AS last_index, MAX(driver_index) AS driver_cursor, COUNT(*) AS parts, \
                 COALESCE(SUM(OCTET_LENGTH(payload)), 0)::BIGINT AS bytes FROM parts WHERE session_id = $1 AND turn = $2"
            }
        };
        let row = sqlx::query(query)
            .bind(session_id.as_str())
            .bind(i64::from(turn))
            .fetch_one(&self.pool)
            .await?;
        let session = sqlx::query("SELECT part_count, part_bytes FROM sessions WHERE id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        Ok(TranscriptProgress {
            last_index: get_opt_u32(&row, "last_index")?,
            driver_cursor: get_opt_u32(&row, "driver_cursor")?,
            turn_parts: get_u64(&row, "parts")?,
            turn_bytes: get_u64(&row, "bytes")?,
            session_parts: get_u64(&session, "part_count")?,
            session_bytes: get_u64(&session, "part_bytes")?,
        })
    }

    async fn turn_parts(&self, session_id: &SessionId, n: u32) -> StoreResult<Vec<StoredPart>> {
        self.turn_parts_after(session_id, n, None, PartsLimit::NONE).await
    }

    async fn turn_parts_after(
        &self,
        session_id: &SessionId,
        n: u32,
        after: Option<u32>,
        limit: PartsLimit,
    ) -> StoreResult<Vec<StoredPart>> {
        // A range of the primary key (session_id, turn, part_index) on both databases, so the work is
        // what the answer holds, however long the session's other turns are. Rows are taken one by one,
        // so that no more than one row past the byte limit is ever held.
        let mut rows = sqlx::query(
            "SELECT turn, part_index, seq, payload FROM parts \
             WHERE session_id = $1 AND turn = $2 AND part_index > $3 ORDER BY part_index LIMIT $4",
        )
        .bind(session_id.as_str())
        .bind(i64::from(n))
        .bind(after.map_or(-1, i64::from))
        .bind(i64::from(limit.parts))
        .fetch(&self.pool);
        let mut parts = Vec::new();
        let mut bytes: u64 = 0;
        while let Some(row) = rows.try_next().await? {
            let part = part_from_row(&row)?;
            bytes = bytes.saturating_add(part.payload.len() as u64);
            if bytes > limit.bytes && !parts.is_empty() {
                break;
            }
            parts.push(part);
        }
        Ok(parts)
    }

    async fn parts_size(&self, session_id: &SessionId, turn: Option<u32>) -> StoreResult<PartsSize> {
        // Bytes, not characters: SQLite's `length` of TEXT counts characters, and its `octet_length` is
        // younger (3.43) than some system libraries sqlx may link; a BLOB's `length` is its bytes.
        let query = match (self.backend, turn) {
            (Backend::Sqlite, Some(_)) => {
                "SELECT COUNT(*) AS parts, COALESCE(SUM(length(CAST(payload AS BLOB))), 0) AS bytes FROM parts \
                 WHERE session_id = $1 AND turn = $2"
            }
            (Backend::Sqlite, None) => {
                "SELECT COUNT(*) AS parts, COALESCE(SUM(length(CAST(payload AS BLOB))), 0) AS bytes FROM parts \
                 WHERE session_id = $1"
            }
            (Backend::Postgres, Some(_)) => {
                "SELECT COUNT(*) AS parts, COALESCE(SUM(octet_length(payload)), 0) AS bytes FROM parts \
                 WHERE session_id = $1 AND turn = $2"
            }
            (Backend::Postgres, None) => {
                "SELECT COUNT(*) AS parts, COALESCE(SUM(octet_length(payload)), 0) AS bytes FROM parts \
                 WHERE session_id = $1"
            }
        };
        let mut query = sqlx::query(query).bind(session_id.as_str());
        if let Some(n) = turn {
            query = query.bind(i64::from(n));
        }
        let row = query.fetch_one(&self.pool).await?;
        Ok(PartsSize {
            parts: get_u64(&row, "parts")?,
            bytes: get_u64(&row, "bytes")?,
        })
    }

    async fn live_feed(&self, session_id: &SessionId, n: u32) -> StoreResult<Option<String>> {
        let row = sqlx::query(
            "SELECT w.feed_url FROM turns t JOIN workers w ON w.id = t.claimed_by \
             WHERE t.session_id = $1 AND t.n = $2 AND t.status = 'running'",
        )
        .bind(session_id.as_str())
        .bind(i64::from(n))
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(row.try_get::<Option<String>, _>("feed_url")?),
            None => Ok(None),
        }
    }

    async fn steer(&self, workspace_id: &str, session_id: &SessionId, steer: NewTurn) -> StoreResult<TurnRow> {
        let prompt_bytes = u64::try_from(steer.prompt.len()).map_err(internal)?;
        for _ in 0..CAS_ATTEMPTS {
            let session = self.fetch_session(workspace_id, session_id).await?;
            let Some(next_phase) = session.phase.after_steer() else {
                return Err(StoreError::NotSteerable("canceled"));
            };
            if session.archived {
                return Err(StoreError::NotSteerable("archived"));
            }
            if session.pruned_at.is_some() {
                return Err(StoreError::NotSteerable("pruned by retention (its workspace is gone)"));
            }
            if session.n_waiting >= TURN_QUEUE_MAX {
                return Err(StoreError::TurnQueueFull(session.n_waiting));
            }
            let would_be = session.prompts_bytes + prompt_bytes;
            if would_be > SESSION_PROMPTS_MAX_BYTES {
                return Err(StoreError::PromptsTooLarge {
                    would_be,
                    limit: SESSION_PROMPTS_MAX_BYTES,
                });
            }
            let clear_failure = next_phase != session.phase;
            let now = now_ms();
            let mut tx = self.begin_write().await?;
            if let Some(breach) = self.quota_breach(&mut tx, workspace_id, false).await? {
                tx.rollback().await?;
                return Err(StoreError::QuotaExceeded(breach));
            }
            let claimed = sqlx::query(
                "UPDATE sessions SET n_turns = n_turns + 1, n_waiting = n_waiting + 1, prompts_bytes = prompts_bytes + $3, \
                 phase = $4, failure_code = CASE WHEN $5 = 1 THEN NULL ELSE failure_code END, \
                 failure_reason = CASE WHEN $5 = 1 THEN NULL ELSE failure_reason END, updated_at = $6 \
                 WHERE id = $1 AND workspace_id = $2 AND phase = $7 AND archived = 0 AND pruned_at IS NULL AND n_waiting < $8 \
                 AND prompts_bytes + $3 <= $9 RETURNING n_turns",
            )
            .bind(session_id.as_str())
            .bind(workspace_id)
            .bind(i64::try_from(prompt_bytes).map_err(internal)?)
            .bind(next_phase.as_str())
            .bind(i64::from(clear_failure))
            .bind(now)
            .bind(session.phase.as_str())
            .bind(i64::from(TURN_QUEUE_MAX))
            .bind(i64::try_from(SESSION_PROMPTS_MAX_BYTES).map_err(internal)?)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(claimed) = claimed else {
                // Someone changed the session since we read it: read again and decide afresh.
                tx.rollback().await?;
                continue;
            };
            let n: i64 = claimed.try_get("n_turns")?;
            sqlx::query("INSERT INTO turns (session_id, n, prompt, status, mode, created_at) VALUES ($1, $2, $3, 'accepted', $4, $5)")
                .bind(session_id.as_str())
                .bind(n)
                .bind(&steer.prompt)
                .bind(steer.mode.as_str())
                .bind(now)
                .execute(&mut *tx)
                .await?;
            if steer.mode == TurnMode::Interrupt {
                sqlx::query("UPDATE turns SET stop_requested = 'interrupt' WHERE session_id = $1 AND status = 'running' AND stop_requested IS NULL")
                    .bind(session_id.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
            let n = u32::try_from(n).map_err(internal)?;
            if next_phase != session.phase {
                self.record_event(&mut tx, session_id, None, EventChange::Phase(next_phase), None, now)
                    .await?;
            }
            self.record_event(
                &mut tx,
                session_id,
                Some(n),
                EventChange::Status(TurnStatus::Accepted),
                None,
                now,
            )
            .await?;
            self.commit_events(tx).await?;
            return self.fetch_turn(session_id, n).await;
        }
        Err(StoreError::Conflict(
            "the session changed too often while steering; try again".into(),
        ))
    }
}

#[async_trait]
impl Tickets for SqlStore {
    async fn claim_ticket_nonce(&self, nonce: &str, expires_at_ms: i64) -> StoreResult<bool> {
        let now = now_ms();
        // Expired nonces can be forgotten: a ticket carrying one fails its expiry check first.
        sqlx::query("DELETE FROM ticket_nonces WHERE expires_at < $1")
            .bind(now - 60_000)
            .execute(&self.writer)
            .await?;
        let inserted =
            sqlx::query("INSERT INTO ticket_nonces (nonce, expires_at) VALUES ($1, $2) ON CONFLICT (nonce) DO NOTHING")
                .bind(nonce)
                .bind(expires_at_ms)
                .execute(&self.writer)
                .await?
                .rows_affected();
        Ok(inserted == 1)
    }

    async fn instance_secret(&self, name: &str, candidate: &str) -> StoreResult<String> {
        sqlx::query(
            "INSERT INTO instance_secrets (name, value, created_at) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(candidate)
        .bind(now_ms())
        .execute(&self.writer)
        .await?;
        let row = sqlx::query("SELECT value FROM instance_secrets WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get("value")?)
    }
}

#[async_trait]
impl Secrets for SqlStore {
    async fn put_model_key(
        &self,
        workspace_id: &str,
        api: ModelApi,
        key_ciphertext: &str,
        key_nonce: &str,
        label: Option<&str>,
    ) -> StoreResult<ModelKeyRow> {
        let row = sqlx::query(model_key_select!(
            "INSERT INTO model_keys (workspace_id, api, key_ciphertext, key_nonce, label, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (workspace_id, api) DO UPDATE SET \
             key_ciphertext = $3, key_nonce = $4, label = $5, created_at = $6 RETURNING"
        ))
        .bind(workspace_id)
        .bind(api.as_str())
        .bind(key_ciphertext)
        .bind(key_nonce)
        .bind(label)
        .bind(now_ms())
        .fetch_one(&self.writer)
        .await?;
        model_key_from_row(&row)
    }

    async fn model_key(&self, workspace_id: &str, api: ModelApi) -> StoreResult<Option<ModelKeyRow>> {
        sqlx::query(model_key_select!(
            "SELECT",
            "FROM model_keys WHERE workspace_id = $1 AND api = $2"
        ))
        .bind(workspace_id)
        .bind(api.as_str())
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(model_key_from_row)
        .transpose()
    }

    async fn model_keys(&self, workspace_id: &str) -> StoreResult<Vec<ModelKeyRow>> {
        let rows = sqlx::query(model_key_select!(
            "SELECT",
            "FROM model_keys WHERE workspace_id = $1 ORDER BY api"
        ))
        .bind(workspace_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(model_key_from_row).collect()
    }

    async fn delete_model_key(&self, workspace_id: &str, api: ModelApi) -> StoreResult<bool> {
        let deleted = sqlx::query("DELETE FROM model_keys WHERE workspace_id = $1 AND api = $2")
            .bind(workspace_id)
            .bind(api.as_str())
            .execute(&self.writer)
            .await?
            .rows_affected();
        Ok(deleted > 0)
    }

    async fn put_forge_connection(
        &self,
        workspace_id: &str,
        host: &str,
        kind: ForgeKind,
        api_base: &str,
        token_ciphertext: &str,
        token_nonce: &str,
        app_id: Option<&str>,
    ) -> StoreResult<ForgeConnectionRow> {
        let row = sqlx::query(forge_connection_select!(
            "INSERT INTO forge_connections (workspace_id, host, kind, api_base, token_ciphertext, token_nonce, \
             created_at, app_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (workspace_id, host) DO UPDATE \
             SET kind = $3, api_base = $4, token_ciphertext = $5, token_nonce = $6, created_at = $7, app_id = $8 \
             RETURNING",
            ""
        ))
        .bind(workspace_id)
        .bind(host)
        .bind(kind.as_str())
        .bind(api_base)
        .bind(token_ciphertext)
        .bind(token_nonce)
        .bind(now_ms())
        .bind(app_id)
        .fetch_one(&self.writer)
        .await?;
        forge_connection_from_row(&row)
    }

    async fn forge_connection(&self, workspace_id: &str, host: &str) -> StoreResult<Option<ForgeConnectionRow>> {
        sqlx::query(forge_connection_select!(
            "SELECT",
            "FROM forge_connections WHERE workspace_id = $1 AND host = $2"
        ))
        .bind(workspace_id)
        .bind(host)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(forge_connection_from_row)
        .transpose()
    }

    async fn forge_connections(&self, workspace_id: &str) -> StoreResult<Vec<ForgeConnectionRow>> {
        let rows = sqlx::query(forge_connection_select!(
            "SELECT",
            "FROM forge_connections WHERE workspace_id = $1 ORDER BY host"
        ))
        .bind(workspace_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(forge_connection_from_row).collect()
    }

    async fn delete_forge_connection(&self, workspace_id: &str, host: &str) -> StoreResult<bool> {
        let deleted = sqlx::query("DELETE FROM forge_connections WHERE workspace_id = $1 AND host = $2")
            .bind(workspace_id)
            .bind(host)
            .execute(&self.writer)
            .await?
            .rows_affected();
        Ok(deleted > 0)
    }
}

#[async_trait]
impl crate::ForgeEvents for SqlStore {
    async fn set_forge_triggers(
        &self,
        workspace_id: &str,
        host: &str,
        webhook_secret: Option<(&str, &str)>,
        triggers: Option<&str>,
    ) -> StoreResult<bool> {
        let updated = sqlx::query(
            "UPDATE forge_connections SET webhook_secret_ciphertext = $3, webhook_secret_nonce = $4, triggers = $5 \
             WHERE workspace_id = $1 AND host = $2",
        )
        .bind(workspace_id)
        .bind(host)
        .bind(webhook_secret.map(|(ciphertext, _)| ciphertext))
        .bind(webhook_secret.map(|(_, nonce)| nonce))
        .bind(triggers)
        .execute(&self.writer)
        .await
        .map_err(|error| match &error {
            sqlx::Error::Database(db) if db.is_unique_violation() => {
                StoreError::Conflict("another connection already takes this GitHub App's webhook deliveries".into())
            }
            _ => error.into(),
        })?
        .rows_affected();
        Ok(updated > 0)
    }

    async fn app_connections(&self, app_id: &str) -> StoreResult<Vec<ForgeConnectionRow>> {
        let rows = sqlx::query(forge_connection_select!(
            "SELECT",
            "FROM forge_connections WHERE app_id = $1 AND webhook_secret_ciphertext IS NOT NULL \
             ORDER BY created_at, workspace_id"
        ))
        .bind(app_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(forge_connection_from_row).collect()
    }

    async fn record_forge_delivery(&self, delivery: &NewForgeDelivery) -> StoreResult<bool> {
        let inserted = sqlx::query(
            "INSERT INTO forge_deliveries (delivery_id, request_key, workspace_id, host, event, payload, received_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
        )
        .bind(&delivery.delivery_id)
        .bind(&delivery.request_key)
        .bind(&delivery.workspace_id)
        .bind(&delivery.host)
        .bind(&delivery.event)
        .bind(&delivery.payload)
        .bind(now_ms())
        .execute(&self.writer)
        .await?
        .rows_affected();
        Ok(inserted > 0)
    }

    async fn pending_forge_deliveries(&self, workspace_id: &str) -> StoreResult<u64> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM forge_deliveries WHERE done_at IS NULL AND workspace_id = $1")
            .bind(workspace_id)
            .fetch_one(&self.pool)
            .await?;
        let n: i64 = row.try_get("n")?;
        Ok(u64::try_from(n).unwrap_or_default())
    }

    async fn claim_forge_delivery(&self, worker_id: &str, lease_ms: i64) -> StoreResult<Option<ForgeDeliveryRow>> {
        let now = now_ms();
        // The UPDATE checks the claim again: of two workers picking the same row, one updates it.
        let row = sqlx::query(
            "UPDATE forge_deliveries SET claimed_by = $1, claimed_at = $2 WHERE delivery_id = ( \
               SELECT delivery_id FROM forge_deliveries WHERE done_at IS NULL \
               AND (claimed_at IS NULL OR claimed_at < $3) ORDER BY received_at, delivery_id LIMIT 1) \
             AND done_at IS NULL AND (claimed_at IS NULL OR claimed_at < $3) \
             RETURNING delivery_id, workspace_id, host, event, payload, received_at",
        )
        .bind(worker_id)
        .bind(now)
        .bind(now - lease_ms)
        .fetch_optional(&self.writer)
        .await?;
        row.map(|row| {
            Ok(ForgeDeliveryRow {
                delivery_id: row.try_get("delivery_id")?,
                workspace_id: row.try_get("workspace_id")?,
                host: row.try_get("host")?,
                event: row.try_get("event")?,
                payload: row.try_get("payload")?,
                received_at: row.try_get("received_at")?,
            })
        })
        .transpose()
    }

    async fn finish_forge_delivery(&self, delivery_id: &str, outcome: &str) -> StoreResult<()> {
        // The payload has served: only the keys that refuse a replay stay.
        sqlx::query("UPDATE forge_deliveries SET done_at = $2, outcome = $3, payload = '' WHERE delivery_id = $1")
            .bind(delivery_id)
            .bind(now_ms())
            .bind(outcome)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    async fn forge_delivery_outcome(&self, delivery_id: &str) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT outcome FROM forge_deliveries WHERE delivery_id = $1 AND done_at IS NOT NULL")
            .bind(delivery_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row
            .map(|row| row.try_get::<Option<String>, _>("outcome"))
            .transpose()?
            .flatten())
    }

    async fn set_session_origin(&self, session_id: &SessionId, origin: &str) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO session_origins (session_id, origin) VALUES ($1, $2) \
             ON CONFLICT (session_id) DO UPDATE SET origin = $2",
        )
        .bind(session_id.as_str())
        .bind(origin)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn session_origin(&self, session_id: &SessionId) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT origin FROM session_origins WHERE session_id = $1")
            .bind(session_id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| row.try_get("origin")).transpose()?)
    }

    async fn session_by_pr_url(&self, workspace_id: &str, pr_url: &str) -> StoreResult<Option<SessionId>> {
        let row = sqlx::query(
            "SELECT id FROM sessions WHERE workspace_id = $1 AND pr_url = $2 ORDER BY created_at DESC LIMIT 1",
        )
        .bind(workspace_id)
        .bind(pr_url)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            let id: String = row.try_get("id")?;
            SessionId::parse(&id).map_err(|_| internal(format!("session id {id:?} in sessions is not one")))
        })
        .transpose()
    }
}

/// A session retention may prune at cutoff `$1` (a condition on `sessions`, unaliased): ended
/// (canceled, failed) or archived while idle or hibernated, untouched since the cutoff, holding no
/// sandbox, not pruned yet.
macro_rules! prunable {
    () => {
        "pruned_at IS NULL AND updated_at < $1 \
         AND (phase IN ('canceled', 'failed') OR (archived = 1 AND phase IN ('idle', 'hibernated'))) \
         AND NOT EXISTS (SELECT 1 FROM sandboxes b WHERE b.session_id = sessions.id)"
    };
}

#[async_trait]
impl Retention for SqlStore {
    async fn prunable_sessions(&self, cutoff: i64, limit: u32) -> StoreResult<Vec<PrunableSession>> {
        let rows = sqlx::query(concat!(
            "SELECT id, repo, phase, updated_at, part_count, part_bytes FROM sessions WHERE ",
            prunable!(),
            " ORDER BY updated_at, id LIMIT $2"
        ))
        .bind(cutoff)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let phase: String = row.try_get("phase")?;
                let id: String = row.try_get("id")?;
                Ok(PrunableSession {
                    id: SessionId::parse(&id).map_err(internal)?,
                    repo: row.try_get("repo")?,
                    phase: SessionPhase::from_str(&phase).map_err(internal)?,
                    updated_at: row.try_get("updated_at")?,
                    parts: get_u64(row, "part_count")?,
                    parts_bytes: get_u64(row, "part_bytes")?,
                })
            })
            .collect()
    }

    async fn prune_session(&self, session_id: &SessionId, cutoff: i64) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let marked = sqlx::query(concat!(
            // The condition on the row itself: PostgreSQL checks it again on the locked row if a steer
            // changed it meanwhile.
            "UPDATE sessions SET pruned_at = $3 WHERE id = $2 AND ",
            prunable!()
        ))
        .bind(cutoff)
        .bind(session_id.as_str())
        .bind(now_ms())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if marked == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        for table in [
            "DELETE FROM parts WHERE session_id = $1",
            "DELETE FROM branch_diffs WHERE session_id = $1",
            "DELETE FROM home_snapshots WHERE session_id = $1",
        ] {
            sqlx::query(table).bind(session_id.as_str()).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn kept_repos(&self) -> StoreResult<Vec<String>> {
        let rows = sqlx::query("SELECT DISTINCT repo FROM sessions WHERE pruned_at IS NULL")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(|row| Ok(row.try_get("repo")?)).collect()
    }

    async fn compact(&self) -> StoreResult<u64> {
        if self.backend != Backend::Sqlite {
            // PostgreSQL's autovacuum reuses the space; `VACUUM FULL` would lock every table.
            return Ok(0);
        }
        let pages = |row: &AnyRow, column: &str| get_u64(row, column);
        let size = |row: &AnyRow| -> StoreResult<(u64, u64)> {
            Ok((pages(row, "page_count")?, pages(row, "freelist_count")?))
        };
        let read = "SELECT p.page_count, f.freelist_count, s.page_size FROM pragma_page_count() p, \
                    pragma_freelist_count() f, pragma_page_size() s";
        let before = sqlx::query(read).fetch_one(&self.pool).await?;
        let (count, free) = size(&before)?;
        let page_size = pages(&before, "page_size")?;
        if free == 0 || free * 4 < count {
            return Ok(0);
        }
        sqlx::query("VACUUM").execute(&self.writer).await?;
        let after = sqlx::query(read).fetch_one(&self.pool).await?;
        let (count_after, _) = size(&after)?;
        Ok(count.saturating_sub(count_after) * page_size)
    }
}
