//! sortie as an MCP server (DESIGN §14): tools another agent or tool uses to create, follow, steer and
//! stop sessions. Every tool is a call to the control plane's REST API under the caller's token, so
//! the token's workspace and role apply exactly as they do over REST (a viewer token cannot create),
//! and every refusal comes back as a tool error with sortie's code and sentence.
//!
//! Two ways in: [`http_service`] serves streamable HTTP at `/mcp` beside the api role, calling the
//! api router in process with the `Authorization` header of each MCP request; `sortie mcp` serves
//! stdio and calls a server over HTTP with the CLI's credentials ([`HttpApi`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{Method, Request, header};
use futures::future::BoxFuture;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Extensions, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{ServerHandler, schemars, tool, tool_handler, tool_router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sortie_protocol::SessionPhase;
use sortie_protocol::api::{
    CreateSessionRequest, EgressAmendment, EgressRequest, Failure, PullRequest, Session, SessionList, SteerRequest,
};
use sortie_protocol::phase::TurnMode;
use tower::ServiceExt;

/// The longest `await_session` waits in one call.
pub const AWAIT_MAX: Duration = Duration::from_secs(300);
/// How often `await_session` looks at the session.
const AWAIT_POLL: Duration = Duration::from_millis(250);
/// The largest answer body read from the control plane.
const ANSWER_MAX_BYTES: usize = 8 << 20;

/// The control plane as the tools reach it: a method, a path, the caller's `Authorization` value and
/// a JSON body in; the status and the JSON answer out.
pub trait Api: Send + Sync + 'static {
    fn call(
        &self,
        method: Method,
        path: String,
        authorization: Option<String>,
        body: Option<Value>,
    ) -> BoxFuture<'_, Result<(u16, Value), String>>;
}

/// The api router in this process.
pub struct RouterApi(pub axum::Router);

impl Api for RouterApi {
    fn call(
        &self,
        method: Method,
        path: String,
        authorization: Option<String>,
        body: Option<Value>,
    ) -> BoxFuture<'_, Result<(u16, Value), String>> {
        Box::pin(async move {
            let mut request = Request::builder().method(method).uri(path);
            if let Some(authorization) = authorization {
                request = request.header(header::AUTHORIZATION, authorization);
            }
            let body = match body {
                Some(body) => {
                    request = request.header(header::CONTENT_TYPE, "application/json");
                    axum::body::Body::from(body.to_string())
                }
                None => axum::body::Body::empty(),
            };
            let request = request.body(body).map_err(|error| error.to_string())?;
            let response = self
                .0
                .clone()
                .oneshot(request)
                .await
                .map_err(|error| error.to_string())?;
            let status = response.status().as_u16();
            let bytes = axum::body::to_bytes(response.into_body(), ANSWER_MAX_BYTES)
                .await
                .map_err(|error| error.to_string())?;
            Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
        })
    }
}

/// A sortie server over HTTP (what `sortie mcp` talks to).
pub struct HttpApi {
    pub client: reqwest::Client,
    /// `http://host:port`, no trailing slash.
    pub base: String,
}

impl Api for HttpApi {
    fn call(
        &self,
        method: Method,
        path: String,
        authorization: Option<String>,
        body: Option<Value>,
    ) -> BoxFuture<'_, Result<(u16, Value), String>> {
        Box::pin(async move {
            let method = reqwest::Method::from_bytes(method.as_str().as_bytes()).map_err(|error| error.to_string())?;
            let mut request = self.client.request(method, format!("{}{path}", self.base));
            if let Some(authorization) = authorization {
                request = request.header("authorization", authorization);
            }
            if let Some(body) = body {
                request = request.json(&body);
            }
            let response = request
                .send()
                .await
                .map_err(|error| format!("cannot reach the sortie server at {}: {error}", self.base))?;
            let status = response.status().as_u16();
            let bytes = response.bytes().await.map_err(|error| error.to_string())?;
            Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
        })
    }
}

/// The MCP server: sortie's tools over an [`Api`].
#[derive(Clone)]
pub struct Sortie {
    api: Arc<dyn Api>,
    /// The credential of every call (stdio); `None` takes each MCP request's own `Authorization`.
    authorization: Option<String>,
    tool_router: ToolRouter<Self>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct CreateSession {
    /// The repository: an https:// git URL, or an absolute path on the sortie server.
    pub repo: String,
    /// What the agent should do, in plain words.
    pub task: String,
    /// The agent (`claude-code`, `codex`, `gemini`, `opencode`, `scripted`, …); default: the server's.
    pub agent: Option<String>,
    /// The branch to start from; default: the repository's default branch.
    pub base: Option<String>,
    /// The model the agent should use; default: the agent's.
    pub model: Option<String>,
    /// A short title; default: the task's first line.
    pub title: Option<String>,
    /// Host names the agent may reach besides the repository (its egress allowlist).
    pub allow: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ListSessions {
    /// Only sessions in this phase (queued, provisioning, running, delivering, idle, hibernated,
    /// failed, canceling, canceled).
    pub phase: Option<String>,
    /// How many, newest first (1 to 200; default 20).
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SessionRef {
    /// The session id (`ses_…`).
    pub id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SteerSession {
    /// The session id (`ses_…`).
    pub id: String,
    /// What the agent should do next.
    pub prompt: String,
    /// Stop the running turn first instead of queueing behind it.
    pub interrupt: Option<bool>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RaiseBudget {
    /// The session id (`ses_…`).
    pub id: String,
    /// Model tokens to add to its token cap.
    pub tokens: Option<u64>,
    /// CPU seconds to add to its compute cap.
    pub compute_seconds: Option<u64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct AwaitSession {
    /// The session id (`ses_…`).
    pub id: String,
    /// How long to wait at most, in seconds (1 to 300).
    pub timeout_secs: u64,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct GetTranscript {
    /// The session id (`ses_…`).
    pub id: String,
    /// How many of the newest messages (default 20).
    pub last: Option<usize>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct AllowEgress {
    /// The session id (`ses_…`).
    pub id: String,
    /// Host names to add to the session's egress allowlist (exact public DNS names).
    pub hosts: Vec<String>,
}

/// A session id checked before it goes into a path: the tools build URLs from what a model wrote.
fn session_id(text: &str) -> Result<String, Failed> {
    sortie_protocol::SessionId::parse(text.trim())
        .map(|id| id.to_string())
        .map_err(|_| Failed(format!("SESSION_NOT_FOUND: {text:?} is not a session id (ses_…)")))
}

/// A refusal or fault, as the tool error a model reads.
struct Failed(String);

type Answer = Result<CallToolResult, rmcp::ErrorData>;

/// A request or a tool's answer as JSON: always one of the API's types or this crate's, never a literal.
fn body(value: &impl Serialize) -> Value {
    // Plain structs of strings, numbers and enums: encoding cannot fail.
    serde_json::to_value(value).unwrap_or_default()
}

/// The server's answer as the API's type it documents.
fn typed<T: DeserializeOwned>(value: Value) -> Result<T, Failed> {
    serde_json::from_value(value)
        .map_err(|error| Failed(format!("the server's answer has an unexpected shape: {error}")))
}

/// `list_sessions`: a session in a line.
#[derive(Serialize)]
struct SessionSummary {
    id: String,
    phase: SessionPhase,
    title: String,
    repo: String,
    branch: String,
}

impl SessionSummary {
    fn of(session: &Session) -> Self {
        Self {
            id: session.id.to_string(),
            phase: session.phase,
            title: session.title.clone(),
            repo: session.repo.clone(),
            branch: session.branch.clone(),
        }
    }
}

#[derive(Serialize)]
struct SessionSummaries {
    sessions: Vec<SessionSummary>,
}

/// `await_session`: where the session stands when the wait ends.
#[derive(Serialize)]
struct AwaitOutcome {
    id: String,
    phase: SessionPhase,
    finished: bool,
    failure: Option<Failure>,
    branch: String,
    head_sha: Option<String>,
    pr: Option<PullRequest>,
    last_turn_summary: String,
}

/// `allow_egress`: the session's allowlist now.
#[derive(Serialize)]
struct EgressAllowed {
    id: String,
    allow: Vec<String>,
}

fn ok(value: &Value) -> Answer {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
}

fn ok_text(text: String) -> Answer {
    Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
}

fn failed(error: Failed) -> Answer {
    Ok(CallToolResult::error(vec![ContentBlock::text(error.0)]))
}

/// Each tool returns through this: an answer, or its failure as a tool error.
fn answer(result: Result<Answer, Failed>) -> Answer {
    result.unwrap_or_else(failed)
}

#[tool_router]
impl Sortie {
    /// A server whose tools call `api`; with `authorization` (e.g. `Bearer sortie_…`) every call uses
    /// it, else each MCP request's own `Authorization` header.
    pub fn new(api: Arc<dyn Api>, authorization: Option<String>) -> Self {
        Self {
            api,
            authorization,
            tool_router: Self::tool_router(),
        }
    }

    async fn rest(
        &self,
        extensions: &Extensions,
        method: Method,
        path: String,
        body: Option<Value>,
    ) -> Result<Value, Failed> {
        let authorization = self.authorization.clone().or_else(|| {
            extensions
                .get::<axum::http::request::Parts>()
                .and_then(|parts| parts.headers.get(header::AUTHORIZATION))
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        });
        let (status, value) = self.api.call(method, path, authorization, body).await.map_err(Failed)?;
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let code = value["error"]["code"].as_str().unwrap_or("HTTP_ERROR");
        let message = value["error"]["message"].as_str().unwrap_or("the server refused");
        Err(Failed(format!("{code}: {message}")))
    }

    #[tool(
        description = "Start a coding agent on a repository in a fresh sandbox. It works in the background and delivers its commits to the branch sortie/<id>. Returns the new session (id, phase, branch); follow it with await_session."
    )]
    async fn create_session(&self, Parameters(p): Parameters<CreateSession>, extensions: Extensions) -> Answer {
        let request = CreateSessionRequest {
            repo: p.repo,
            task: p.task,
            agent: p.agent,
            base: p.base,
            model: p.model,
            egress: p.allow.map(|allow| EgressRequest { allow }),
            setup: None,
            title: p.title,
            budget: None,
        };
        answer(
            self.rest(&extensions, Method::POST, "/v1/sessions".into(), Some(body(&request)))
                .await
                .map(|session| ok(&session)),
        )
    }

    #[tool(
        description = "List sessions of your workspace, newest first, optionally only those in one phase. Returns id, phase, title, repo and branch of each."
    )]
    async fn list_sessions(&self, Parameters(p): Parameters<ListSessions>, extensions: Extensions) -> Answer {
        let mut path = format!("/v1/sessions?limit={}", p.limit.unwrap_or(20).clamp(1, 200));
        if let Some(phase) = p.phase {
            match phase.trim().parse::<sortie_protocol::SessionPhase>() {
                Ok(phase) => path.push_str(&format!("&phase={}", phase.as_str())),
                Err(_) => return failed(Failed(format!("INVALID_REQUEST: {phase:?} is not a phase"))),
            }
        }
        let result = async {
            let list: SessionList = typed(self.rest(&extensions, Method::GET, path, None).await?)?;
            let sessions = list.sessions.iter().map(SessionSummary::of).collect();
            Ok(ok(&body(&SessionSummaries { sessions })))
        }
        .await;
        answer(result)
    }

    #[tool(
        description = "Read one session: its phase, branch, head commit, pull request, failure (code and reason) and usage."
    )]
    async fn get_session(&self, Parameters(p): Parameters<SessionRef>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        answer(
            self.rest(&extensions, Method::GET, format!("/v1/sessions/{id}"), None)
                .await
                .map(|session| ok(&session)),
        )
    }

    #[tool(
        description = "Give a session's agent a further instruction. It runs after the current turn (or at once with interrupt: true). Returns the new turn."
    )]
    async fn steer_session(&self, Parameters(p): Parameters<SteerSession>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let mode = if p.interrupt.unwrap_or(false) {
            TurnMode::Interrupt
        } else {
            TurnMode::Queue
        };
        let request = SteerRequest {
            prompt: p.prompt,
            mode: Some(mode),
        };
        answer(
            self.rest(
                &extensions,
                Method::POST,
                format!("/v1/sessions/{id}/steer"),
                Some(body(&request)),
            )
            .await
            .map(|turn| ok(&turn)),
        )
    }

    #[tool(
        description = "Raise a session's budget by some model tokens and/or CPU seconds. A session paused at its token cap (its budget.paused_at is set) goes on at once. Returns the session."
    )]
    async fn raise_budget(&self, Parameters(p): Parameters<RaiseBudget>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let request = sortie_protocol::api::RaiseBudgetRequest {
            tokens: p.tokens,
            compute_seconds: p.compute_seconds,
        };
        answer(
            self.rest(
                &extensions,
                Method::POST,
                format!("/v1/sessions/{id}/budget"),
                Some(body(&request)),
            )
            .await
            .map(|session| ok(&session)),
        )
    }

    #[tool(
        description = "Stop the session's running turn; the work so far is delivered and the session stays open for more instructions."
    )]
    async fn stop_session(&self, Parameters(p): Parameters<SessionRef>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        answer(
            self.rest(&extensions, Method::POST, format!("/v1/sessions/{id}/stop"), None)
                .await
                .map(|turn| ok(&turn)),
        )
    }

    #[tool(
        description = "End a session for good: a running turn is stopped and delivered, waiting instructions are dropped."
    )]
    async fn cancel_session(&self, Parameters(p): Parameters<SessionRef>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        answer(
            self.rest(&extensions, Method::POST, format!("/v1/sessions/{id}/cancel"), None)
                .await
                .map(|session| ok(&session)),
        )
    }

    #[tool(
        description = "Wait until a session has finished its work (it is no longer queued, provisioning, running or delivering) or the timeout passes. Returns its phase, failure, branch, head commit, pull request and what the agent last said."
    )]
    async fn await_session(&self, Parameters(p): Parameters<AwaitSession>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let timeout = Duration::from_secs(p.timeout_secs.clamp(1, AWAIT_MAX.as_secs()));
        let deadline = Instant::now() + timeout;
        let path = format!("/v1/sessions/{id}");
        let result = async {
            loop {
                let session: Session = typed(self.rest(&extensions, Method::GET, path.clone(), None).await?)?;
                let working = matches!(
                    session.phase,
                    SessionPhase::Queued
                        | SessionPhase::Provisioning
                        | SessionPhase::Running
                        | SessionPhase::Delivering
                        | SessionPhase::Canceling
                );
                if !working || Instant::now() >= deadline {
                    let said = self.last_words(&extensions, &id).await.unwrap_or_default();
                    let outcome = AwaitOutcome {
                        id: session.id.to_string(),
                        phase: session.phase,
                        finished: !working,
                        failure: session.failure,
                        branch: session.branch,
                        head_sha: session.head_sha,
                        pr: session.pr,
                        last_turn_summary: said,
                    };
                    return Ok(ok(&body(&outcome)));
                }
                tokio::time::sleep(AWAIT_POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
            }
        }
        .await;
        answer(result)
    }

    #[tool(
        description = "Read the newest messages of a session's conversation as text: the prompts, what the agent said, and one line per tool call it made."
    )]
    async fn get_transcript(&self, Parameters(p): Parameters<GetTranscript>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let last = p.last.unwrap_or(20).clamp(1, 200);
        answer(
            self.rest(&extensions, Method::GET, format!("/v1/sessions/{id}/messages"), None)
                .await
                .map(|messages| ok_text(transcript_text(&messages, last))),
        )
    }

    #[tool(
        description = "Let a session's agent reach more hosts (exact public DNS names) by adding them to its egress allowlist; the next connection goes through."
    )]
    async fn allow_egress(&self, Parameters(p): Parameters<AllowEgress>, extensions: Extensions) -> Answer {
        let id = match session_id(&p.id) {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let result = async {
            let session: Session = typed(
                self.rest(&extensions, Method::GET, format!("/v1/sessions/{id}"), None)
                    .await?,
            )?;
            let mut allow = session.egress.allow;
            for host in p.hosts {
                if !allow.contains(&host) {
                    allow.push(host);
                }
            }
            let updated: Session = typed(
                self.rest(
                    &extensions,
                    Method::POST,
                    format!("/v1/sessions/{id}/egress"),
                    Some(body(&EgressAmendment { allow })),
                )
                .await?,
            )?;
            let allowed = EgressAllowed {
                id: updated.id.to_string(),
                allow: updated.egress.allow,
            };
            Ok(ok(&body(&allowed)))
        }
        .await;
        answer(result)
    }
}

impl Sortie {
    /// What the agent said last (the last assistant message's text, its last 600 characters).
    async fn last_words(&self, extensions: &Extensions, id: &str) -> Result<String, Failed> {
        let messages = self
            .rest(extensions, Method::GET, format!("/v1/sessions/{id}/messages"), None)
            .await?;
        let text = messages
            .as_array()
            .into_iter()
            .flatten()
            .rev()
            .find(|m| m["role"] == "assistant")
            .map(|m| message_text(m, false))
            .unwrap_or_default();
        let chars: Vec<char> = text.chars().collect();
        Ok(chars[chars.len().saturating_sub(600)..].iter().collect())
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Sortie {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("sortie", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "sortie runs coding agents on git repositories in sandboxes and delivers their work as branches \
                 sortie/<session id>. Start one with create_session, wait for it with await_session, read what it \
                 did with get_transcript, give it more to do with steer_session.",
            )
    }
}

/// The newest `last` messages of a `/messages` answer as text.
fn transcript_text(messages: &Value, last: usize) -> String {
    let all: Vec<&Value> = messages.as_array().into_iter().flatten().collect();
    let shown = &all[all.len().saturating_sub(last)..];
    let mut out = String::new();
    for message in shown {
        let role = message["role"].as_str().unwrap_or("?");
        out.push_str(&format!("[{role}]\n{}\n\n", message_text(message, true)));
    }
    out.trim_end().to_owned()
}

/// A message's text parts, and with `tools` one line per tool call.
fn message_text(message: &Value, tools: bool) -> String {
    let mut lines = Vec::new();
    for part in message["parts"].as_array().into_iter().flatten() {
        let kind = part["type"].as_str().unwrap_or_default();
        if kind == "text" {
            lines.push(part["text"].as_str().unwrap_or_default().trim().to_owned());
        } else if tools && (kind == "dynamic-tool" || kind.starts_with("tool-")) {
            let title = part["title"]
                .as_str()
                .or_else(|| part["toolName"].as_str())
                .unwrap_or("tool");
            let state = part["state"].as_str().unwrap_or_default();
            lines.push(format!("(tool: {title} — {state})"));
        } else if kind == "data-sortie-delivery" {
            let data = &part["data"];
            if let Some(error) = data["error"].as_object() {
                lines.push(format!(
                    "(delivery failed: {}: {})",
                    error.get("code").and_then(Value::as_str).unwrap_or_default(),
                    error.get("reason").and_then(Value::as_str).unwrap_or_default()
                ));
            } else if data["pushed"] == true {
                lines.push(format!(
                    "(delivered {} at {})",
                    data["branch"].as_str().unwrap_or_default(),
                    data["headSha"].as_str().unwrap_or_default()
                ));
            }
        }
    }
    lines.retain(|l| !l.is_empty());
    lines.join("\n")
}

/// `/mcp` over streamable HTTP, its tools calling `api` with each request's own `Authorization`.
pub fn http_service(
    api: Arc<dyn Api>,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    Sortie,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
    // Any Host: sortie is reached under its operator's names, and every request carries a token.
    let config = StreamableHttpServerConfig::default().disable_allowed_hosts();
    StreamableHttpService::new(move || Ok(Sortie::new(api.clone(), None)), Arc::default(), config)
}

/// Serves MCP on stdin/stdout until the client goes away.
pub async fn serve_stdio(api: Arc<dyn Api>, authorization: String) -> Result<(), String> {
    use rmcp::ServiceExt as _;
    let service = Sortie::new(api, Some(authorization))
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|error| error.to_string())?;
    service.waiting().await.map_err(|error| error.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_session_ids_go_into_paths() {
        assert!(session_id("ses_01jd8x3k4m5n6p7q8r9s0t1v2w").is_ok());
        for bad in [
            "ses_01jd8x3k4m5n6p7q8r9s0t1v2w/../../webhooks",
            "../v1/webhooks",
            "ses_x?phase=idle",
            "",
        ] {
            let refused = session_id(bad).err().map(|f| f.0).unwrap_or_default();
            assert!(refused.starts_with("SESSION_NOT_FOUND: "), "{bad}: {refused}");
        }
    }

    #[test]
    fn a_transcript_reads_as_text() {
        let messages = json!([
            {"role": "user", "parts": [{"type": "text", "text": "Fix it"}]},
            {"role": "assistant", "parts": [
                {"type": "text", "text": "Looking."},
                {"type": "dynamic-tool", "toolName": "execute", "title": "npm test", "state": "output-available"},
                {"type": "data-sortie-delivery", "data": {"branch": "sortie/ses_x", "pushed": true, "headSha": "abc"}},
                {"type": "text", "text": "Done."}
            ]}
        ]);
        assert_eq!(
            transcript_text(&messages, 20),
            "[user]\nFix it\n\n[assistant]\nLooking.\n(tool: npm test — output-available)\n(delivered sortie/ses_x at abc)\nDone."
        );
        assert_eq!(
            transcript_text(&messages, 1),
            "[assistant]\nLooking.\n(tool: npm test — output-available)\n(delivered sortie/ses_x at abc)\nDone."
        );
    }
}
