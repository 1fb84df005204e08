//! The worker's side of the model proxy (DESIGN §7.4): each sandbox's proxy gets the workspace's
//! decrypted key per request, and reports to a [`TurnMeter`] what it read: token usage into the
//! ledger (and a `data-sortie-usage` part with id `tokens`: the turn's totals so far — the only usage
//! sortie shows, read by the host, never reported by the sandbox), a vendor's 401/403 or a missing
//! key, which fails the running turn at once with `VENDOR_AUTH_REJECTED`.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sortie_gateway::model::{KeySource, ModelApi, Usage, UsageSink};
use sortie_protocol::SessionId;
use sortie_protocol::sortie_data::{SortieData, UsageData};
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

/// One sandbox's meter: what its model proxy saw.
pub struct TurnMeter {
    store: Arc<dyn Store>,
    session_id: SessionId,
    current: Arc<CurrentTurn>,
    rejection: Mutex<Option<Rejection>>,
    /// Tokens read so far in each turn: (turn, input, output), of the turn last reported.
    turn_totals: Arc<Mutex<(u32, u64, u64)>>,
}

impl TurnMeter {
    pub fn new(store: Arc<dyn Store>, session_id: SessionId, current: Arc<CurrentTurn>) -> Arc<Self> {
        Arc::new(Self {
            store,
            session_id,
            current,
            rejection: Mutex::new(None),
            turn_totals: Arc::new(Mutex::new((0, 0, 0))),
        })
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

impl UsageSink for TurnMeter {
    fn usage(&self, api: ModelApi, usage: &Usage) {
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
