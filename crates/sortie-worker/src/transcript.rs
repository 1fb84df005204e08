//! The host's transcript of a turn (DESIGN §8; §9 invariants 6, 9 and 10): one task per running turn
//! is its only author. It takes the agent's chunks from the sandbox's stream only once
//! [`AgentStream`] has checked them and written them out again from their type, adds sortie's own
//! parts ([`SortieData`]: phase, priming, usage, egress denials, delivery, notices) and the message's
//! envelope (`start`, `error`, `finish`) itself, numbers every part, publishes it at once to the
//! turn's live feed (what attach serves) and stores it in batches (32 parts, 1 MiB or 100 ms) through a
//! task of its own, so the live feed never waits for the store (batches that queue meanwhile are
//! written together).
//!
//! Bounded: a turn keeps at most [`TURN_PARTS_MAX`] parts and [`TURN_BYTES_MAX`] bytes, a session
//! [`SESSION_PARTS_MAX`] and [`SESSION_BYTES_MAX`]; past a cap the sandbox's parts are dropped, one
//! notice says so, and the turn is stopped ([`Transcript::limit_reached`]). Each part from the sandbox
//! keeps its index there (`driver_index`), so a recorder that starts again goes on after the last
//! one stored.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sortie_feed::hub::TurnHub;
use sortie_gateway::live::Feeds;
use sortie_protocol::agent_stream::{AgentStream, ChunkRefusal};
use sortie_protocol::chunk::{FinishMetadata, UiChunk};
use sortie_protocol::sortie_data::{NoticeData, SortieData};
use sortie_protocol::{FailureCode, SessionId, limits};
use sortie_store::{NewPart, Store, StoreError};
use tokio::sync::{mpsc, oneshot};

pub const BATCH_PARTS: usize = 32;
pub const BATCH_BYTES: usize = 1 << 20;
pub const BATCH_DELAY: Duration = Duration::from_millis(100);

/// Room the caps leave for the parts that close a turn (the notice, what the sandbox left open, the
/// delivery, `error`, `finish`), which are always written: a turn never holds more than the limits of
/// `sortie_protocol::limits`, which is all that `/messages` reads of it.
const CLOSING_RESERVE_PARTS: u64 = 1_000;
const CLOSING_RESERVE_BYTES: u64 = 1 << 20;

/// The most parts one turn's transcript takes from the sandbox and sortie's running parts.
pub const TURN_PARTS_MAX: u64 = limits::TURN_PARTS_MAX as u64 - CLOSING_RESERVE_PARTS;
/// The most bytes of parts one turn's transcript takes.
pub const TURN_BYTES_MAX: u64 = limits::TURN_PART_BYTES_MAX - CLOSING_RESERVE_BYTES;
/// The most parts one session's transcript takes.
pub const SESSION_PARTS_MAX: u64 = limits::SESSION_PARTS_MAX - CLOSING_RESERVE_PARTS;
/// The most bytes of parts one session's transcript takes.
pub const SESSION_BYTES_MAX: u64 = limits::SESSION_PART_BYTES_MAX - CLOSING_RESERVE_BYTES;

/// The caps of one transcript ([`Caps::DEFAULT`] in production; tests make them small).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub turn_parts: u64,
    pub turn_bytes: u64,
    pub session_parts: u64,
    pub session_bytes: u64,
}

impl Caps {
    pub const DEFAULT: Self = Self {
        turn_parts: TURN_PARTS_MAX,
        turn_bytes: TURN_BYTES_MAX,
        session_parts: SESSION_PARTS_MAX,
        session_bytes: SESSION_BYTES_MAX,
    };
}

/// How many writes may wait for the writer; the recorder waits when it is full, sortie's own parts
/// that find it full are dropped (the next usage part replaces a dropped one).
const QUEUE: usize = 4096;
/// How long a failed batch waits before it is written again (the store may be restarting).
const RETRY_DELAY: Duration = Duration::from_millis(500);
/// How often a batch is tried at the end of a turn before its parts are given up (the live feed had them).
const FINAL_ATTEMPTS: u32 = 20;

/// How the turn ends, for its closing parts.
#[derive(Clone, Debug, Default)]
pub struct Ending {
    /// The turn failed: an `error` part with the reason, `finish` with reason `error`.
    pub failure: Option<(FailureCode, String)>,
    /// Why the agent stopped (`end_turn`, `max_tokens`, `cancelled`, …), when it did.
    pub stop_reason: Option<String>,
    /// Parts of sortie's own that close the turn (the delivery, the last phase), before `finish`.
    pub parts: Vec<SortieData>,
}

/// What the writer did, once the turn's transcript is closed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub parts: u64,
    /// Parts of the sandbox's stream that were refused (malformed, or sortie's to write).
    pub refused: u64,
    /// Parts that could not be stored although the live feed had them.
    pub lost: u64,
}

enum Write {
    Agent {
        driver_index: u64,
        json: String,
    },
    Host(UiChunk),
    Barrier(oneshot::Sender<()>),
    Finish {
        ending: Ending,
        done: oneshot::Sender<Written>,
    },
}

#[derive(Default)]
struct Shared {
    /// The highest index of the sandbox's stream handed to the writer so far (`u64::MAX`: none): where
    /// a recorder goes on.
    driver_cursor: AtomicU64,
    /// Why the transcript stopped taking the sandbox's parts, once a cap was reached.
    limit: Mutex<Option<String>>,
    limited: AtomicBool,
    /// When the first part of the agent's own (not a step marker) was taken.
    first_agent_part: OnceLock<Instant>,
}

/// A running turn's transcript: cheap to clone, every clone writes to the same task.
#[derive(Clone)]
pub struct Transcript {
    pub session_id: SessionId,
    pub n: u32,
    tx: mpsc::Sender<Write>,
    shared: Arc<Shared>,
}

/// What the writer task owns.
struct Writer {
    feeds: Arc<Feeds>,
    session_id: SessionId,
    n: u32,
    hub: Arc<TurnHub>,
    shared: Arc<Shared>,
    stream: AgentStream,
    /// The highest index of the sandbox's stream the writer took (`None`: none yet).
    taken: Option<u64>,
    batch: Vec<NewPart>,
    batch_bytes: usize,
    batch_since: Option<tokio::time::Instant>,
    /// The store task's queue: full batches go there, so the live feed never waits for the store.
    /// Unbounded, yet bounded by the caps: only parts counted under them are queued.
    jobs: mpsc::UnboundedSender<StoreJob>,
    turn_parts: u64,
    turn_bytes: u64,
    session_parts: u64,
    session_bytes: u64,
    written: Written,
    refusal_noticed: bool,
    caps: Caps,
}

impl Transcript {
    /// Opens turn `n`'s transcript: a fresh one starts with the message's `start`; one that has
    /// parts already (a worker that started again) goes on after them, its stream state rebuilt from
    /// what is stored.
    pub async fn open(
        store: Arc<dyn Store>,
        feeds: Arc<Feeds>,
        session_id: &SessionId,
        n: u32,
    ) -> Result<Self, StoreError> {
        Self::open_with(store, feeds, session_id, n, Caps::DEFAULT).await
    }

    /// [`Transcript::open`] with caps of its own.
    pub async fn open_with(
        store: Arc<dyn Store>,
        feeds: Arc<Feeds>,
        session_id: &SessionId,
        n: u32,
        caps: Caps,
    ) -> Result<Self, StoreError> {
        let progress = store.transcript_progress(session_id, n).await?;
        let next = progress.last_index.map_or(0, |last| u64::from(last) + 1);
        let hub = TurnHub::in_memory_from(n, next);
        let shared = Arc::new(Shared {
            driver_cursor: AtomicU64::new(progress.driver_cursor.map_or(u64::MAX, u64::from)),
            ..Shared::default()
        });
        let mut stream = AgentStream::new();
        if progress.last_index.is_some() {
            // The blocks and tool calls this turn opened before are open still: the turn's own parts,
            // read slice by slice (never the rest of the session). What was stored passed these checks
            // once, so a refusal now changes nothing.
            let slice = sortie_store::PartsLimit {
                parts: 1024,
                bytes: 4 << 20,
            };
            let mut after = None;
            loop {
                let parts = store.turn_parts_after(session_id, n, after, slice).await?;
                let Some(last) = parts.last().map(|part| part.part_index) else {
                    break;
                };
                for part in &parts {
                    let _ = stream.admit(&part.payload);
                }
                after = Some(last);
            }
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let (jobs_tx, jobs_rx) = mpsc::unbounded_channel();
        tokio::spawn(
            StoreTask {
                store,
                session_id: session_id.clone(),
                n,
                pending: Vec::new(),
                retry_at: None,
            }
            .run(jobs_rx),
        );
        let writer = Writer {
            feeds: feeds.clone(),
            session_id: session_id.clone(),
            n,
            hub: hub.clone(),
            shared: shared.clone(),
            stream,
            taken: progress.driver_cursor.map(u64::from),
            batch: Vec::new(),
            batch_bytes: 0,
            batch_since: None,
            jobs: jobs_tx,
            turn_parts: progress.turn_parts,
            turn_bytes: progress.turn_bytes,
            session_parts: progress.session_parts,
            session_bytes: progress.session_bytes,
            written: Written::default(),
            refusal_noticed: false,
            caps,
        };
        feeds.insert(session_id, n, hub);
        let transcript = Self {
            session_id: session_id.clone(),
            n,
            tx,
            shared,
        };
        let fresh = progress.last_index.is_none();
        tokio::spawn(writer.run(rx, fresh));
        Ok(transcript)
    }

    /// A part of the sandbox's stream, with its index there; one at or before the last one taken is a
    /// repeat and dropped. Waits while the writer is behind.
    pub async fn agent(&self, driver_index: u64, json: String) {
        if self.tx.send(Write::Agent { driver_index, json }).await.is_ok() {
            let _ = self
                .shared
                .driver_cursor
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cursor| {
                    (cursor == u64::MAX || driver_index > cursor).then_some(driver_index)
                });
        }
    }

    /// A part of sortie's own, in stream order; dropped (and logged) if the writer is far behind.
    pub fn host(&self, part: SortieData) {
        if self.tx.try_send(Write::Host(part.into_chunk())).is_err() {
            tracing::warn!(session = %self.session_id, turn = self.n, "the transcript writer is behind; a part of sortie's own was dropped");
        }
    }

    /// A part of sortie's own that must not be dropped: waits for room.
    pub async fn host_now(&self, part: SortieData) {
        let _ = self.tx.send(Write::Host(part.into_chunk())).await;
    }

    /// Waits until everything written so far is stored (or was tried and kept for later).
    pub async fn flush(&self) {
        let (done, flushed) = oneshot::channel();
        if self.tx.send(Write::Barrier(done)).await.is_ok() {
            let _ = flushed.await;
        }
    }

    /// Closes the turn's message: what the sandbox left open is ended, `ending`'s parts, an `error` for
    /// a failure, then `finish`; everything is stored and the live feed ends.
    pub async fn finish(self, ending: Ending) -> Written {
        let (done, finished) = oneshot::channel();
        if self.tx.send(Write::Finish { ending, done }).await.is_err() {
            return Written::default();
        }
        finished.await.unwrap_or_default()
    }

    /// The index in the sandbox's stream of the last part taken (a recorder goes on after it).
    pub fn driver_cursor(&self) -> Option<u64> {
        match self.shared.driver_cursor.load(Ordering::Acquire) {
            u64::MAX => None,
            index => Some(index),
        }
    }

    /// Why the transcript stopped taking the sandbox's parts, once a cap was reached.
    pub fn limit_reached(&self) -> Option<String> {
        if !self.shared.limited.load(Ordering::Acquire) {
            return None;
        }
        self.shared.limit.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// When the agent's first own part (not a step marker) was taken.
    pub fn first_agent_part(&self) -> Option<Instant> {
        self.shared.first_agent_part.get().copied()
    }
}

/// The `finish` chunk's reason for an agent's stop reason (as the AI SDK names them).
fn finish_reason(ending: &Ending) -> &'static str {
    if ending.failure.is_some() {
        return "error";
    }
    match ending.stop_reason.as_deref() {
        Some("end_turn") | None => "stop",
        Some("max_tokens" | "max_turn_requests") => "length",
        Some("refusal") => "content-filter",
        Some(_) => "other",
    }
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Write>, fresh: bool) {
        if fresh {
            self.push(
                UiChunk::Start {
                    message_id: format!("{}-t{}", self.session_id, self.n),
                    metadata: None,
                },
                None,
                true,
            );
        }
        loop {
            let wake = self.batch_since.map(|since| since + BATCH_DELAY);
            let next = match wake {
                Some(at) => match tokio::time::timeout_at(at, rx.recv()).await {
                    Ok(next) => next,
                    Err(_) => {
                        self.send_batch();
                        continue;
                    }
                },
                None => rx.recv().await,
            };
            match next {
                Some(Write::Agent { driver_index, json }) => self.agent(driver_index, &json),
                Some(Write::Host(chunk)) => self.push(chunk, None, false),
                Some(Write::Barrier(done)) => {
                    self.send_batch();
                    let _ = self.jobs.send(StoreJob::Barrier(done));
                }
                Some(Write::Finish { ending, done }) => {
                    self.finish(ending).await;
                    let _ = done.send(self.written);
                    return;
                }
                None => {
                    // Every handle is gone without a finish (the worker is stopping): what is kept is
                    // stored; the live feed stays open for the next worker's recorder to go on from.
                    self.send_batch();
                    self.stored().await;
                    self.feeds.remove(&self.session_id, self.n, &self.hub);
                    return;
                }
            }
            if self.batch_due() {
                self.send_batch();
            }
        }
    }

    /// Hands the batch to the store task.
    fn send_batch(&mut self) {
        self.batch_since = None;
        if self.batch.is_empty() {
            return;
        }
        self.batch_bytes = 0;
        let _ = self.jobs.send(StoreJob::Batch(std::mem::take(&mut self.batch)));
    }

    /// Waits until the store task has tried everything queued before.
    async fn stored(&self) {
        let (done, stored) = oneshot::channel();
        if self.jobs.send(StoreJob::Barrier(done)).is_ok() {
            let _ = stored.await;
        }
    }

    fn agent(&mut self, driver_index: u64, json: &str) {
        if self.taken.is_some_and(|taken| driver_index <= taken) {
            return;
        }
        self.taken = Some(driver_index);
        if self.shared.limited.load(Ordering::Acquire) {
            return;
        }
        match self.stream.admit(json) {
            Ok(chunk) => {
                if !matches!(chunk, UiChunk::StartStep | UiChunk::FinishStep) {
                    let _ = self.shared.first_agent_part.set(Instant::now());
                }
                self.push(chunk, u32::try_from(driver_index).ok(), false);
            }
            // The driver's own envelope of its stream: expected, and replaced by the host's.
            Err(ChunkRefusal::HostOnly(kind))
                if matches!(kind.as_str(), "start" | "finish" | "error" | "message-metadata") => {}
            Err(refusal) => {
                self.written.refused += 1;
                tracing::info!(session = %self.session_id, turn = self.n, %refusal, "a part of the sandbox's stream was refused");
                if !self.refusal_noticed {
                    self.refusal_noticed = true;
                    self.push(
                        SortieData::Notice(NoticeData {
                            code: "STREAM_PART_REFUSED".into(),
                            message: format!(
                                "sortie dropped a part of the sandbox's stream ({refusal}); the sandbox writes the \
                                 agent's words only, never sortie's"
                            ),
                        })
                        .into_chunk(),
                        None,
                        false,
                    );
                }
            }
        }
    }

    /// Numbers `chunk`, publishes it to the live feed and queues it for the store. A part that would
    /// pass a cap is not added (unless `always`: the turn's closing parts), and the cap is noted once.
    fn push(&mut self, chunk: UiChunk, driver_index: Option<u32>, always: bool) {
        let json = chunk.to_json();
        let bytes = json.len() as u64;
        if !always && !self.shared.limited.load(Ordering::Acquire) {
            let caps = self.caps;
            let over = if self.turn_parts + 1 > caps.turn_parts {
                Some(format!("more than {} parts", caps.turn_parts))
            } else if self.turn_bytes + bytes > caps.turn_bytes {
                Some(format!("more than {} bytes of parts", caps.turn_bytes))
            } else if self.session_parts + 1 > caps.session_parts {
                Some(format!("more than {} parts in the whole session", caps.session_parts))
            } else if self.session_bytes + bytes > caps.session_bytes {
                Some(format!(
                    "more than {} bytes of parts in the whole session",
                    caps.session_bytes
                ))
            } else {
                None
            };
            if let Some(over) = over {
                let reason = format!(
                    "the agent's output passed the transcript's limit ({over}); the rest of it was not kept and the \
                     turn was stopped"
                );
                *self.shared.limit.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
                self.shared.limited.store(true, Ordering::Release);
                self.push(
                    SortieData::Notice(NoticeData {
                        code: "TRANSCRIPT_LIMIT".into(),
                        message: reason,
                    })
                    .into_chunk(),
                    None,
                    true,
                );
                return;
            }
        }
        if !always && self.shared.limited.load(Ordering::Acquire) && driver_index.is_none() {
            // Past a cap, sortie's own running parts (usage, denials) stop too; the closing ones stay.
            return;
        }
        let Some(index) = self.hub.publish_encoded([Arc::<str>::from(json.as_str())]) else {
            return;
        };
        let Ok(part_index) = u32::try_from(index) else {
            return;
        };
        self.turn_parts += 1;
        self.turn_bytes += bytes;
        self.session_parts += 1;
        self.session_bytes += bytes;
        self.written.parts += 1;
        self.batch_bytes += json.len();
        self.batch.push(NewPart {
            part_index,
            payload: json,
            driver_index,
        });
        self.batch_since.get_or_insert_with(tokio::time::Instant::now);
    }

    fn batch_due(&self) -> bool {
        self.batch.len() >= BATCH_PARTS || self.batch_bytes >= BATCH_BYTES
    }

    async fn finish(&mut self, ending: Ending) {
        let ended_at = sortie_protocol::api::rfc3339_from_epoch_ms(sortie_store::now_ms());
        for chunk in self.stream.close(Some(&ended_at)) {
            self.push(chunk, None, true);
        }
        let reason = finish_reason(&ending);
        let metadata = match &ending.failure {
            Some((code, _)) => FinishMetadata::failed(*code).to_value(),
            None => {
                FinishMetadata::<FailureCode>::stopped(ending.stop_reason.as_deref().unwrap_or("end_turn")).to_value()
            }
        };
        let failure = ending.failure.clone();
        for part in ending.parts {
            self.push(part.into_chunk(), None, true);
        }
        if let Some((_, reason)) = failure {
            self.push(UiChunk::Error { error_text: reason }, None, true);
        }
        self.push(
            UiChunk::Finish {
                finish_reason: reason,
                metadata: Some(metadata),
            },
            None,
            true,
        );
        self.send_batch();
        let (done, lost) = oneshot::channel();
        if self.jobs.send(StoreJob::Final(done)).is_ok() {
            self.written.lost = lost.await.unwrap_or_default();
        }
        self.hub.finish();
        if self.written.lost == 0 {
            // It holds what the store holds: a reader just after the end is served from it.
            self.feeds.retire(&self.session_id, self.n, &self.hub);
        } else {
            self.feeds.remove(&self.session_id, self.n, &self.hub);
        }
    }
}

/// What the writer asks of the store task, in order.
enum StoreJob {
    Batch(Vec<NewPart>),
    /// Answered once everything queued before was tried (stored, or kept to be tried again).
    Barrier(oneshot::Sender<()>),
    /// The turn's last job: what is kept is tried [`FINAL_ATTEMPTS`] times; the answer is how many
    /// parts the store never took.
    Final(oneshot::Sender<u64>),
}

/// Stores a turn's parts behind its writer, so that the live feed runs at the agent's pace, not at
/// the store's: batches that queue up while one is written go in together.
struct StoreTask {
    store: Arc<dyn Store>,
    session_id: SessionId,
    n: u32,
    /// Parts not stored yet, in order.
    pending: Vec<NewPart>,
    /// When a write the store refused is tried again (`None`: the store took the last one).
    retry_at: Option<tokio::time::Instant>,
}

/// The most parts one write takes when batches have queued up.
const COALESCE_PARTS: usize = 8 * BATCH_PARTS;

impl StoreTask {
    async fn run(mut self, mut jobs: mpsc::UnboundedReceiver<StoreJob>) {
        let mut held = None;
        loop {
            let job = match held.take() {
                Some(job) => Some(job),
                None => match self.retry_at {
                    Some(at) => match tokio::time::timeout_at(at, jobs.recv()).await {
                        Ok(job) => job,
                        Err(_) => {
                            self.write().await;
                            continue;
                        }
                    },
                    None => jobs.recv().await,
                },
            };
            match job {
                Some(StoreJob::Batch(batch)) => {
                    self.pending.extend(batch);
                    while self.pending.len() < COALESCE_PARTS {
                        match jobs.try_recv() {
                            Ok(StoreJob::Batch(more)) => self.pending.extend(more),
                            Ok(other) => {
                                held = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    // A store that refused the last write is asked again at its time, not sooner.
                    if self.retry_at.is_none() {
                        self.write().await;
                    }
                }
                Some(StoreJob::Barrier(done)) => {
                    if !self.pending.is_empty() {
                        self.write().await;
                    }
                    let _ = done.send(());
                }
                Some(StoreJob::Final(done)) => {
                    let mut attempts = 0;
                    while !self.write().await {
                        attempts += 1;
                        if attempts >= FINAL_ATTEMPTS {
                            tracing::error!(session = %self.session_id, turn = self.n, lost = self.pending.len(), "the store did not take the turn's last parts");
                            break;
                        }
                        tokio::time::sleep(RETRY_DELAY).await;
                    }
                    let _ = done.send(self.pending.len() as u64);
                    return;
                }
                None => {
                    self.write().await;
                    return;
                }
            }
        }
    }

    /// Writes what is pending; a refused write is kept and tried again after [`RETRY_DELAY`].
    async fn write(&mut self) -> bool {
        if self.pending.is_empty() {
            self.retry_at = None;
            return true;
        }
        match self.store.append_parts(&self.session_id, self.n, &self.pending).await {
            Ok(_) => {
                self.pending.clear();
                self.retry_at = None;
                true
            }
            Err(error) => {
                tracing::warn!(%error, session = %self.session_id, turn = self.n, "storing parts failed; trying again");
                self.retry_at = Some(tokio::time::Instant::now() + RETRY_DELAY);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_follow_the_sdk() {
        let ending = |stop: Option<&str>, failed: bool| Ending {
            failure: failed.then(|| (FailureCode::AgentError, "x".to_owned())),
            stop_reason: stop.map(str::to_owned),
            parts: Vec::new(),
        };
        for (stop, failed, expected) in [
            (Some("end_turn"), false, "stop"),
            (None, false, "stop"),
            (Some("max_tokens"), false, "length"),
            (Some("max_turn_requests"), false, "length"),
            (Some("refusal"), false, "content-filter"),
            (Some("cancelled"), false, "other"),
            (Some("end_turn"), true, "error"),
        ] {
            assert_eq!(finish_reason(&ending(stop, failed)), expected, "{stop:?} {failed}");
        }
    }
}
