//! The model proxy (DESIGN §7.4): `/_sortie/model/{anthropic,openai,gemini}/…` on a sandbox's egress
//! socket. Whatever credential the agent sent is dropped and the workspace's key is injected the
//! vendor's way; the request goes to the configured upstream and its answer comes back unchanged and
//! unbuffered, while [`usage`] reads the token counts from the frames as they pass. A vendor 401/403
//! is relayed and reported at once ([`UsageSink::auth_rejected`]), a missing key is answered here
//! without contacting the vendor ([`UsageSink::key_missing`]), and a redirect is never relayed.
//!
//! The key never reaches the sandbox, the logs or an error message; one router serves one session.

mod proxy;
pub mod usage;

use std::sync::Arc;

use axum::Router;
use sortie_protocol::SessionId;

pub use proxy::MAX_REQUEST_BYTES;
pub use usage::Usage;

/// A vendor API the proxy speaks for, named by the path segment after `/_sortie/model/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelApi {
    /// Anthropic Messages (`x-api-key`).
    Anthropic,
    /// OpenAI Responses and Chat Completions (`Authorization: Bearer`).
    Openai,
    /// Google Gemini API (`x-goog-api-key`).
    Gemini,
}

impl ModelApi {
    pub const ALL: [Self; 3] = [Self::Anthropic, Self::Openai, Self::Gemini];

    /// The path segment (`anthropic`, `openai`, `gemini`), also the name `sortie keys set` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Anthropic => "anthropic",
            Self::Openai => "openai",
            Self::Gemini => "gemini",
        }
    }

    pub fn parse(segment: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|api| api.as_str() == segment)
    }
}

impl std::fmt::Display for ModelApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The base URL each API is forwarded to (the request's path after `/_sortie/model/<api>/` is
/// appended, so a base may carry a path prefix of its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstreams {
    pub anthropic: String,
    pub openai: String,
    pub gemini: String,
}

impl Default for Upstreams {
    /// The vendors' public endpoints.
    fn default() -> Self {
        Self {
            anthropic: "https://api.anthropic.com".to_owned(),
            openai: "https://api.openai.com".to_owned(),
            gemini: "https://generativelanguage.googleapis.com".to_owned(),
        }
    }
}

impl Upstreams {
    pub fn base(&self, api: ModelApi) -> &str {
        match api {
            ModelApi::Anthropic => &self.anthropic,
            ModelApi::Openai => &self.openai,
            ModelApi::Gemini => &self.gemini,
        }
    }
}

/// What one session's model proxy needs besides its key source and its sink.
#[derive(Clone, Debug)]
pub struct ModelProxyConfig {
    /// The session the router serves (named in its log lines).
    pub session_id: SessionId,
    pub upstreams: Upstreams,
    /// PEM certificates trusted as roots besides the platform's (an internal gateway's CA, or a
    /// test's); empty for none.
    pub extra_roots_pem: Vec<u8>,
}

/// The workspace's stored key for an API, already decrypted by the caller; `None` when none is set.
#[async_trait::async_trait]
pub trait KeySource: Send + Sync + 'static {
    async fn key(&self, api: ModelApi) -> Option<String>;
}

/// Where the proxy reports what it saw. Called from request tasks: keep each call short.
pub trait UsageSink: Send + Sync + 'static {
    /// One answer's token counts, once, when its body ended (or was dropped); not called for an
    /// answer that reported none.
    fn usage(&self, api: ModelApi, usage: &Usage);
    /// The vendor answered 401 or 403 to the injected key; called as soon as the status arrives,
    /// before the answer is relayed.
    fn auth_rejected(&self, api: ModelApi, status: u16);
    /// The agent called an API the workspace has no (usable) key for; the vendor was not contacted.
    fn key_missing(&self, api: ModelApi);
}

/// Why the router could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ModelProxyError {
    #[error("the upstream base URL for {api} is not an http(s) URL: {url:?}")]
    Upstream { api: ModelApi, url: String },
    #[error(transparent)]
    Tls(#[from] crate::git::http::ForgeTlsError),
}

/// The routes `/_sortie/model/{api}/{*rest}` for one session, to merge into its egress proxy's
/// internal router.
pub fn router(
    config: ModelProxyConfig,
    keys: Arc<dyn KeySource>,
    sink: Arc<dyn UsageSink>,
) -> Result<Router, ModelProxyError> {
    proxy::router(config, keys, sink)
}
