//! The model proxy (DESIGN §7.4): `/_sortie/model/{anthropic,openai,gemini}/…` on a sandbox's egress
//! socket. Whatever credential the agent sent is dropped and the workspace's key is injected the
//! vendor's way; the request goes to the configured upstream and its answer comes back unchanged and
//! unbuffered, while [`usage`] reads the token counts from the frames as they pass. A vendor 401/403
//! is relayed and reported at once ([`UsageSink::auth_rejected`]), a missing key is answered here
//! without contacting the vendor ([`UsageSink::key_missing`]), and a redirect is never relayed.
//!
//! Only the routes agents need are forwarded ([`routes`]): anything else is refused with a 403 before
//! a key is looked up. Vendor headers that pick an organization, project or billing account are
//! dropped (and can be pinned by configuration, [`PinnedHeader`]). One session's router bounds what
//! it holds ([`ModelProxyLimits`]): requests in flight, bytes of request bodies buffered, and the
//! time a body may take to arrive.
//!
//! The key never reaches the sandbox, the logs or an error message; one router serves one session.

mod proxy;
pub mod routes;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use sortie_protocol::SessionId;

pub use proxy::MAX_REQUEST_BYTES;
pub use routes::Route;
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
    /// Headers the operator sets on every request to an API, replacing whatever the agent sent
    /// under that name (e.g. `OpenAI-Organization`/`OpenAI-Project` to pick the billed tenant);
    /// empty by default. Credential, framing and hop-by-hop names are refused at build.
    pub pinned_headers: Vec<PinnedHeader>,
    /// What one session may hold at once; [`ModelProxyLimits::default`] in production.
    pub limits: ModelProxyLimits,
}

/// A header the proxy sets on every request to `api` (see [`ModelProxyConfig::pinned_headers`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedHeader {
    pub api: ModelApi,
    pub name: String,
    pub value: String,
}

/// Vendor request headers that choose the organization, project or billing account a key acts
/// for. The agent's are never forwarded (the workspace's key must not be pointed at another
/// tenant it can reach); the operator may pin them ([`PinnedHeader`]). Anthropic has none: an
/// Anthropic key belongs to one workspace (`anthropic-organization-id` is a response header).
pub const TENANCY_HEADERS: [&str; 3] = ["openai-organization", "openai-project", "x-goog-user-project"];

/// The model requests one session may have in flight at once (from the start of the request to
/// the end of its answer). Claude Code runs a title request beside its turn and up to ~10
/// subagents in parallel; 16 leaves room for that. A request over the cap waits up to
/// [`MODEL_QUEUE_WAIT`] for a slot and is then answered 429 with `retry-after` (every agent's
/// SDK retries a 429 with backoff).
pub const MAX_REQUESTS_IN_FLIGHT: usize = 16;
/// How long a request over [`MAX_REQUESTS_IN_FLIGHT`] waits for a slot before its 429. Waiting
/// smooths an agent's short bursts without an error the model sees; it holds one connection and
/// no body bytes (the body stays in the socket until the slot is granted), and the egress socket's
/// connection cap bounds how many can wait.
pub const MODEL_QUEUE_WAIT: Duration = Duration::from_secs(10);
/// How long a request body may take to arrive in full, from the moment its slot is granted. The
/// agent sends over a local socket, so a whole 32 MiB body takes milliseconds; a body still
/// incomplete after this is stalled on purpose and is cut (408, connection closed).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The bytes of request bodies one session may hold buffered at once (read from the agent and not
/// yet sent upstream), two bodies at [`MAX_REQUEST_BYTES`]. Without it the bound would be
/// [`MAX_REQUESTS_IN_FLIGHT`] × [`MAX_REQUEST_BYTES`] = 512 MiB; with it a session's model
/// requests hold at most 64 MiB of bodies, whatever the agent sends. A request whose body would
/// pass it is answered 429 at once.
pub const MAX_BUFFERED_BYTES: usize = 2 * MAX_REQUEST_BYTES;

/// What one session's model proxy may hold at once (see the constants for why each value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelProxyLimits {
    /// Requests in flight ([`MAX_REQUESTS_IN_FLIGHT`]).
    pub max_in_flight: usize,
    /// How long a request waits for a slot ([`MODEL_QUEUE_WAIT`]).
    pub queue_wait: Duration,
    /// How long a body may take to arrive ([`BODY_READ_TIMEOUT`]).
    pub body_read_timeout: Duration,
    /// Body bytes buffered at once ([`MAX_BUFFERED_BYTES`]); below [`MAX_REQUEST_BYTES`] it also
    /// lowers the largest body that can pass.
    pub max_buffered_bytes: usize,
}

impl Default for ModelProxyLimits {
    fn default() -> Self {
        Self {
            max_in_flight: MAX_REQUESTS_IN_FLIGHT,
            queue_wait: MODEL_QUEUE_WAIT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_buffered_bytes: MAX_BUFFERED_BYTES,
        }
    }
}

/// The workspace's stored key for an API, already decrypted by the caller; `None` when none is set.
#[async_trait::async_trait]
pub trait KeySource: Send + Sync + 'static {
    async fn key(&self, api: ModelApi) -> Option<String>;
}

/// Where the proxy reports what it saw, and asks whether a request may go. Called from request tasks:
/// keep each report short.
#[async_trait::async_trait]
pub trait UsageSink: Send + Sync + 'static {
    /// Whether the agent's request may go to the vendor now: waits while it may not (a budget's
    /// cap holds it, and the agent just waits), `Err(reason)` refuses it. Asked before the request's
    /// body is read or a slot taken.
    async fn admit(&self, _api: ModelApi) -> Result<(), String> {
        Ok(())
    }
    /// An admitted request's answer is over (its usage, if any, was reported just before).
    /// `metered` is false for a successful generation whose answer reported no usage (a stream the
    /// agent asked without it, an answer too large to read): its tokens are unknown.
    fn answer_ended(&self, _api: ModelApi, _metered: bool) {}
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
    #[error("the pinned header {name:?} for {api} cannot be used: {reason}")]
    PinnedHeader {
        api: ModelApi,
        name: String,
        reason: &'static str,
    },
    #[error("the model proxy's limits must allow at least one request and one byte in flight")]
    Limits,
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
