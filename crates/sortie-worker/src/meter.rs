//! The worker's side of the model proxy (DESIGN §7.4): each sandbox's proxy gets the workspace's
//! decrypted key per request, and reports to a [`TurnMeter`] what it read: token usage into the
//! ledger (and a `data-acp-usage` part with id `tokens`: the turn's totals so far), a vendor's 401/403 or a missing key, which fails the
//! running turn at once with `VENDOR_AUTH_REJECTED`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sortie_gateway::model::{KeySource, ModelApi, Usage, UsageSink};
use sortie_protocol::SessionId;
use sortie_store::{KeyRing, Store, TokenUsage};

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
    driver_socket: PathBuf,
    rejection: Mutex<Option<Rejection>>,
    /// Tokens read so far in each turn: (turn, input, output), of the turn last reported.
    turn_totals: Arc<Mutex<(u32, u64, u64)>>,
}

impl TurnMeter {
    pub fn new(store: Arc<dyn Store>, session_id: SessionId, driver_socket: PathBuf) -> Arc<Self> {
        Arc::new(Self {
            store,
            session_id,
            driver_socket,
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
        let socket = self.driver_socket.clone();
        let usage = usage.clone();
        let turn_totals = self.turn_totals.clone();
        tokio::spawn(async move {
            let turn = store
                .session_by_id(&session_id)
                .await
                .ok()
                .and_then(|s| s.current_turn)
                .unwrap_or(1);
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
            // ACP agent's own context-window report is `data-acp-usage` with id `usage`.
            let part = serde_json::json!({
                "name": "acp-usage",
                "id": "tokens",
                "data": {
                    "api": api.as_str(),
                    "model": usage.model,
                    "inputTokens": input_tokens,
                    "outputTokens": output_tokens,
                },
            });
            let _ = crate::client::DriverClient::new(socket).post_part(&part).await;
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
