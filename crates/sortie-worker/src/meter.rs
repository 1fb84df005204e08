//! The worker's side of the model proxy (DESIGN §7.4): each sandbox's proxy gets the workspace's
//! decrypted key per request, and reports to a [`TurnMeter`] what it read: token usage into the
//! ledger (and a `data-sortie-usage` part with id `tokens`: the turn's totals so far — the only usage
//! sortie shows, read by the host, never reported by the sandbox), a vendor's 401/403 or a missing
//! key, which fails the running turn at once with `VENDOR_AUTH_REJECTED`. It also holds the agent's
//! next request at the session's token budget (DESIGN §12, §16): a `data-sortie-budget` part says so,
//! the session shows it needs input, and a raise lets the request go; past the wait, the turn ends
//! `BUDGET_EXCEEDED` with its work delivered (the request held until the agent is stopped). An answer
//! that reported no usage is charged the rest of the budget.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sortie_gateway::model::{KeySource, ModelApi, Usage, UsageSink};
use sortie_protocol::SessionId;
use sortie_protocol::sortie_data::{BudgetData, SortieData, UsageData};
use sortie_store::{KeyRing, Store, TokenUsage};

use crate::transcript::Transcript;

/// The transcript of the turn a sandbox runs, while one runs: where sortie's own parts of the moment
/// (token usage, egress denials) go.
#[derive(Default)]
pub struct CurrentTurn(Mutex<Option<Transcript>>);

impl CurrentTurn {
    pub fn set(&self, transcript: Option<Transcript>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = transcript;
    }

    pub fn get(&self) -> Option<Transcript> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The workspace's key for an API, decrypted per request (a key set or changed mid-session is used at once).
pub struct WorkspaceKeys {
    pub store: Arc<dyn Store>,
    pub ring: Option<Arc<KeyRing>>,
    pub workspace_id: String,
}

#[async_trait]
impl KeySource for WorkspaceKeys {
    async fn key(&self, api: ModelApi) -> Option<String> {
        let ring = self.ring.as_ref()?;
        let api: sortie_protocol::api::ModelApi = api.as_str().parse().ok()?;
        match sortie_store::keys::workspace_model_key(self.store.as_ref(), ring, &self.workspace_id, api).await {
            Ok(Some(secret)) => String::from_utf8(secret.expose().to_vec()).ok(),
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(%error, api = %api, "cannot open the workspace's model key");
                None
            }
        }
    }
}

impl WorkspaceKeys {
    /// The SHA-256 digests of every model key the workspace has, one lowercase hex line each: the
    /// driver's delivery refuses changes holding any of them (`SECRET_DETECTED`), and the values
    /// themselves never enter the sandbox.
    pub async fn digests(&self) -> String {
        let mut lines = String::new();
        for api in ModelApi::ALL {
            if let Some(key) = self.key(api).await {
                lines.push_str(&sortie_secrets::digest_line(key.as_bytes()));
            }
        }
        lines
    }
}

/// Why the vendor refused, once: the turn fails with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
}

/// How often a request held at the budget looks at it again: a raise lets it go within this.
const BUDGET_POLL: Duration = Duration::from_millis(250);
/// How long a request stays held once the wait for a raise is over: the turn is being stopped and
/// the agent with it, which drops the request; this only bounds a stop that never comes.
const HOLD_AFTER_WAIT: Duration = Duration::from_secs(60);
/// How long a request of a session with a token budget waits for answers still streaming to report
/// their usage before it is weighed against the cap.
const SETTLE_WAIT: Duration = Duration::from_millis(250);

/// One sandbox's meter: what its model proxy saw.
pub struct TurnMeter {
    store: Arc<dyn Store>,
    session_id: SessionId,
    current: Arc<CurrentTurn>,
    rejection: Mutex<Option<Rejection>>,
    /// Tokens read so far in each turn: (turn, input, output), of the turn last reported.
    turn_totals: Arc<Mutex<(u32, u64, u64)>>,
    /// Tokens reported by the proxy and not yet written to the store.
    pending: Arc<AtomicU64>,
    /// Held across a usage write and the `pending` it settles, and across a budget read of both: a
    /// read between the two would count the write twice (and show the user that figure).
    usage_settling: Arc<tokio::sync::Mutex<()>>,
    /// Admitted requests whose answers are not over yet.
    open: AtomicUsize,
    answer_over: tokio::sync::Notify,
    /// How long a request is held at the token cap before the turn ends `BUDGET_EXCEEDED`.
    budget_wait: Duration,
    /// Why the turn must end `BUDGET_EXCEEDED`, once.
    over_budget: Mutex<Option<String>>,
    /// The budget ran out in this sandbox's current turn (the reason was handed over once).
    exceeded: std::sync::atomic::AtomicBool,
    /// This meter marked the session paused at its cap (the store is written once per pause).
    paused: std::sync::atomic::AtomicBool,
    /// Generations that ended without reporting usage, not yet charged.
    unmetered: std::sync::atomic::AtomicU32,
    /// Tokens charged for them.
    estimated: AtomicU64,
}

impl TurnMeter {
    pub fn new(
        store: Arc<dyn Store>,
        session_id: SessionId,
        current: Arc<CurrentTurn>,
        budget_wait: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            session_id,
            current,
            rejection: Mutex::new(None),
            turn_totals: Arc::new(Mutex::new((0, 0, 0))),
            pending: Arc::new(AtomicU64::new(0)),
            usage_settling: Arc::new(tokio::sync::Mutex::new(())),
            open: AtomicUsize::new(0),
            answer_over: tokio::sync::Notify::new(),
            budget_wait,
            over_budget: Mutex::new(None),
            exceeded: Default::default(),
            paused: Default::default(),
            unmetered: Default::default(),
            estimated: AtomicU64::new(0),
        })
    }

    /// Why the running turn must end `BUDGET_EXCEEDED`, once.
    pub fn take_over_budget(&self) -> Option<String> {
        self.over_budget.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// A new turn starts: what the last one's budget did is forgotten.
    pub fn new_turn(&self) {
        self.over_budget.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.exceeded.store(false, Ordering::Release);
        // The store's mark went with the last turn's end.
        self.paused.store(false, Ordering::Release);
    }

    fn note_budget(&self, state: &str, spent: u64, limit: u64) {
        let how = match state {
            "paused" => format!(
                "The session used {spent} of its {limit} tokens: the agent's next model request waits. Raise the \
                 budget (POST /v1/sessions/{id}/budget, or `sortie budget {id} --add N`) to let it go on; in {} s the \
                 turn ends and its work is delivered.",
                self.budget_wait.as_secs(),
                id = self.session_id
            ),
            "raised" => format!("The budget was raised to {limit} tokens: the agent goes on."),
            _ => format!(
                "Nobody raised the budget of {limit} tokens in time: the turn ends and its work is delivered. Raise it \
                 and steer the session to go on."
            ),
        };
        if let Some(transcript) = self.current.get() {
            transcript.host(SortieData::Budget(BudgetData {
                state: state.to_owned(),
                kind: "tokens".to_owned(),
                spent,
                limit,
                how,
            }));
        }
    }

    /// Waits (bounded) until every admitted answer has reported its usage.
    async fn settle_open_answers(&self) {
        let until = tokio::time::Instant::now() + SETTLE_WAIT;
        while self.open.load(Ordering::Acquire) > 0 {
            let notified = self.answer_over.notified();
            if self.open.load(Ordering::Acquire) == 0 || tokio::time::timeout_at(until, notified).await.is_err() {
                break;
            }
        }
    }

    /// Whether the agent's request may go now, holding it while the session is at its token cap.
    async fn weigh(&self) -> Result<(), String> {
        // The wait for a raise starts when the request is first held at the cap.
        let mut held_since: Option<Instant> = None;
        let mut settled = false;
        loop {
            // What is reported but not yet stored, and what is stored, read with no write settling
            // in between: each token counts once.
            let settling = self.usage_settling.lock().await;
            let pending = self.pending.load(Ordering::Acquire);
            let read = self.store.session_by_id(&self.session_id).await;
            drop(settling);
            let session = match read {
                Ok(session) => session,
                Err(error) => {
                    // The store holds the usage too: while it does not answer, nothing is metered.
                    tracing::warn!(%error, session = %self.session_id, "cannot read the budget: the request goes");
                    return Ok(());
                }
            };
            let Some(limit) = session.budget_tokens else {
                return Ok(());
            };
            if !settled {
                settled = true;
                self.settle_open_answers().await;
                continue;
            }
            let mut spent = session.input_tokens + session.output_tokens + pending;
            // An answer that reported no usage cost an unknown amount: it is charged all that was left.
            if self.unmetered.swap(0, Ordering::AcqRel) > 0 {
                let left = limit.saturating_sub(spent + self.estimated.load(Ordering::Acquire));
                self.estimated.fetch_add(left, Ordering::AcqRel);
                tracing::warn!(session = %self.session_id, "a model answer reported no usage: it is charged the rest of the budget");
            }
            spent += self.estimated.load(Ordering::Acquire);
            // Near the cap, answers still streaming are waited for: in parallel they would all pass it.
            if spent < limit
                && (spent.saturating_mul(4) < limit.saturating_mul(3) || self.open.load(Ordering::Acquire) == 0)
            {
                if self.paused.swap(false, Ordering::AcqRel)
                    && self
                        .store
                        .set_budget_paused(&self.session_id, false)
                        .await
                        .unwrap_or(false)
                {
                    self.note_budget("raised", spent, limit);
                }
                return Ok(());
            }
            if spent >= limit {
                held_since.get_or_insert_with(Instant::now);
                if self.current.get().is_none() {
                    // No turn runs: nothing may spend past the cap until one does.
                    return Err("the session is at its token budget and no turn runs".to_owned());
                }
                if !self.paused.swap(true, Ordering::AcqRel)
                    && self
                        .store
                        .set_budget_paused(&self.session_id, true)
                        .await
                        .unwrap_or(false)
                {
                    metrics::counter!("sortie_budget_pauses_total").increment(1);
                    tracing::info!(session = %self.session_id, spent, limit, "the token budget holds the agent's request");
                    self.note_budget("paused", spent, limit);
                }
            }
            if let Some(since) = held_since
                && since.elapsed() >= self.budget_wait
            {
                let reason = format!(
                    "the session used {spent} of its {limit} tokens and the budget was not raised within {} s; \
                     raise it (sortie budget {} --add N) and steer the session to go on",
                    self.budget_wait.as_secs(),
                    self.session_id
                );
                {
                    let mut over = self.over_budget.lock().unwrap_or_else(|p| p.into_inner());
                    if over.is_none() && !self.exceeded.swap(true, Ordering::AcqRel) {
                        *over = Some(reason.clone());
                        self.note_budget("exceeded", spent, limit);
                    }
                }
                // The turn stops now (the watch takes the reason): the request stays held so the agent
                // does nothing more before it is stopped, its work delivered as it was.
                if since.elapsed() >= self.budget_wait + HOLD_AFTER_WAIT {
                    return Err(reason);
                }
            }
            let answer_over = self.answer_over.notified();
            let _ = tokio::time::timeout(BUDGET_POLL, answer_over).await;
        }
    }

    /// The vendor's refusal since the last call, if any.
    pub fn take_rejection(&self) -> Option<Rejection> {
        self.rejection.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn reject(&self, reason: String) {
        let mut slot = self.rejection.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(Rejection { reason });
        }
    }
}

#[async_trait]
impl UsageSink for TurnMeter {
    async fn admit(&self, _api: ModelApi) -> Result<(), String> {
        self.weigh().await?;
        self.open.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn answer_ended(&self, _api: ModelApi, metered: bool) {
        if !metered {
            self.unmetered.fetch_add(1, Ordering::AcqRel);
        }
        // Saturating: an answer admitted before this meter counted (none today) cannot underflow it.
        let _ = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| open.checked_sub(1));
        self.answer_over.notify_waiters();
    }

    fn usage(&self, api: ModelApi, usage: &Usage) {
        let tokens = usage.input_tokens.saturating_add(usage.output_tokens);
        self.pending.fetch_add(tokens, Ordering::AcqRel);
        let pending = self.pending.clone();
        let settling = self.usage_settling.clone();
        let store = self.store.clone();
        let session_id = self.session_id.clone();
        let current = self.current.get();
        let usage = usage.clone();
        let turn_totals = self.turn_totals.clone();
        tokio::spawn(async move {
            let turn = match &current {
                Some(transcript) => transcript.n,
                None => store
                    .session_by_id(&session_id)
                    .await
                    .ok()
                    .and_then(|s| s.current_turn)
                    .unwrap_or(1),
            };
            let settled = settling.lock().await;
            let recorded = store
                .record_token_usage(&TokenUsage {
                    session_id: session_id.clone(),
                    turn,
                    model: usage.model.clone(),
                    epoch_ms: sortie_store::now_ms(),
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                })
                .await;
            pending.fetch_sub(tokens, Ordering::AcqRel);
            drop(settled);
            if let Err(error) = recorded {
                tracing::warn!(%error, session = %session_id, "cannot record token usage");
            }
            let (input_tokens, output_tokens) = {
                let mut totals = turn_totals.lock().unwrap_or_else(|p| p.into_inner());
                if totals.0 != turn {
                    *totals = (turn, 0, 0);
                }
                totals.1 += usage.input_tokens;
                totals.2 += usage.output_tokens;
                (totals.1, totals.2)
            };
            // One part per turn, replaced in place (id `tokens`): the turn's token totals so far. The
            // ACP agent's own context-window report is `data-acp-usage`, its claim, not sortie's.
            if let Some(transcript) = current {
                transcript.host(SortieData::Usage(UsageData {
                    api: api.as_str().to_owned(),
                    model: usage.model,
                    input_tokens,
                    output_tokens,
                }));
            }
        });
    }

    fn auth_rejected(&self, api: ModelApi, status: u16) {
        self.reject(format!(
            "the {api} API refused the workspace's {api} key (HTTP {status}): set a valid one with `sortie keys set {api}`, \
             then steer the session to continue"
        ));
    }

    fn key_missing(&self, api: ModelApi) {
        self.reject(format!(
            "this workspace has no {api} key: set one with `sortie keys set {api}`, then steer the session to continue"
        ));
    }
}
