//! The session endpoints of DESIGN §4: create, list, read, steer, stop, cancel, resume, archive,
//! attach tickets, and usage.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sortie_protocol::api::{
    AttachTicket, AttachTicketRequest, BranchDiff, CreateSessionRequest, EgressAmendment, LIMIT_MAX, ModelUsage,
    RaiseBudgetRequest, Role, Session, SessionList, SteerRequest, TicketAction, Turn, TurnList, UiMessage, UsageReport,
    UsageRow, WorkspaceLimits, rfc3339_from_epoch_ms,
};
use sortie_protocol::limits::{
    DIFF_PAGE_FILES_DEFAULT, DIFF_PAGE_FILES_MAX, LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX, MESSAGES_PAGE_TURNS_DEFAULT,
    MESSAGES_PAGE_TURNS_MAX, TICKET_TTL_SECONDS,
};
use sortie_protocol::ticket::{TICKET_VERSION, TicketClaims};
use sortie_protocol::validate::{self, RepoLocation};
use sortie_protocol::{ApiErrorBody, ErrorCode, SessionId, SessionPhase, egress};
use sortie_store::{NewSession, NewTurn, SessionFilter, now_ms};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::extract::{Admin, ApiJson, ApiQuery, NoInput, Operator, OptionalJson, SessionPath, Viewer};
use crate::idempotency::{self, Begun};
use crate::transcript::{self, PageStart};
use crate::{local_repo, tokens, views};

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new()
        .routes(routes!(create_session, list_sessions))
        .routes(routes!(get_session))
        .routes(routes!(list_turns))
        .routes(routes!(get_messages))
        .routes(routes!(get_diff))
        .routes(routes!(steer))
        .routes(routes!(stop))
        .routes(routes!(cancel))
        .routes(routes!(resume))
        .routes(routes!(archive, unarchive))
        .routes(routes!(attach_ticket))
        .routes(routes!(amend_egress))
        .routes(routes!(usage))
        .routes(routes!(evidence))
        .routes(routes!(raise_budget))
        .routes(routes!(get_limits, put_limits))
}

/// What the session did, as its pull request's description shows it: each turn's outcome and summary,
/// the commands run with their exit codes and output tails, the files changed, timings and usage.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/evidence", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses(
        (status = 200, body = sortie_protocol::evidence::SessionEvidence),
        (status = 401, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn evidence(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
) -> Result<Json<sortie_protocol::evidence::SessionEvidence>, ApiError> {
    let row = state.store.session(&caller.workspace_id, &id).await?;
    let link = sortie_store::dashboard_link(state.store.as_ref(), &row).await;
    Ok(Json(
        sortie_store::session_evidence(state.store.as_ref(), &row, link).await?,
    ))
}

/// Create a session: validates, writes the session and its first turn, answers at once.
#[utoipa::path(
    post, path = "/v1/sessions", tag = "sessions", request_body = CreateSessionRequest, security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "A retry with the same key and body gets the first answer (24 h)")),
    responses(
        (status = 202, description = "Accepted; turn 1 waits for a worker (a replay under an Idempotency-Key carries `Idempotent-Replayed: true`)", body = Session),
        (status = 400, description = "INVALID_REQUEST, EGRESS_ALLOWLIST_INVALID, AGENT_UNKNOWN, REPO_INVALID, REPO_NOT_READABLE, BASE_INVALID, BASE_NOT_FOUND, MODEL_INVALID, TITLE_TOO_LONG", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN, REPO_NOT_ALLOWED", body = ApiErrorBody),
        (status = 409, description = "AGENT_NOT_INSTALLED, IDEMPOTENCY_KEY_IN_USE", body = ApiErrorBody),
        (status = 413, description = "PROMPT_TOO_LARGE, SETUP_TOO_LARGE, BODY_TOO_LARGE", body = ApiErrorBody),
        (status = 415, description = "UNSUPPORTED_MEDIA_TYPE", body = ApiErrorBody),
        (status = 422, description = "IDEMPOTENCY_KEY_REUSED", body = ApiErrorBody),
    )
)]
async fn create_session(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    headers: HeaderMap,
    ApiJson(request): ApiJson<CreateSessionRequest>,
) -> Response {
    let held = match idempotency::begin(&state, &caller.workspace_id, &headers, "POST /v1/sessions", &request).await {
        Ok(Begun::Fresh(held)) => held,
        Ok(Begun::Replay(first)) => return first,
        Err(refusal) => return refusal.into_response(),
    };
    let result = create(&state, caller, request).await;
    idempotency::settle(&state, held, result).await
}

async fn create(
    state: &ApiState,
    caller: sortie_store::Principal,
    request: CreateSessionRequest,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    validate::check_prompt("task", &request.task)?;
    if let Some(title) = &request.title {
        validate::check_title(title)?;
    }
    if let Some(setup) = &request.setup {
        validate::check_setup(setup)?;
    }
    let egress_allow = request.egress.map(|egress| egress.allow).unwrap_or_default();
    check_allowlist("egress.allow", &egress_allow)?;
    let agent = choose_agent(&state.agents, request.agent)?;
    if let Some(base) = &request.base {
        validate::check_base(base)?;
    }
    if let Some(model) = &request.model {
        validate::check_model(model)?;
    }
    let workspace = state.store.workspace(&caller.workspace_id).await?;
    let repo = match validate::check_repo(&request.repo)? {
        RepoLocation::Https(url) => url,
        RepoLocation::LocalPath(path) => {
            let resolved = local_repo::resolve(&path, &workspace.repo_access).await?;
            if let Some(base) = &request.base {
                local_repo::check_base(&resolved, base).await?;
            }
            resolved
        }
    };
    if let Some(budget) = &request.budget {
        check_budget("budget", budget.tokens, budget.compute_seconds)?;
    }
    let budget =
        sortie_store::limits::session_budget(state.store.as_ref(), &caller.workspace_id, request.budget).await?;
    let title = request.title.unwrap_or_else(|| validate::default_title(&request.task));
    let new = NewSession {
        id: SessionId::generate(),
        workspace_id: caller.workspace_id,
        repo,
        base: request.base,
        agent,
        model: request.model,
        title,
        egress_allow,
        setup: request.setup,
        task: request.task,
        budget,
    };
    let row = state.store.create_session(new).await?;
    metrics::counter!("sortie_sessions_created_total").increment(1);
    Ok((StatusCode::ACCEPTED, Json(views::session(&row))))
}

/// Each figure of a budget is 1 to [`LIMIT_MAX`].
fn check_budget(field: &str, tokens: Option<u64>, compute_seconds: Option<u64>) -> Result<(), ApiError> {
    for (name, value) in [("tokens", tokens), ("compute_seconds", compute_seconds)] {
        if value.is_some_and(|value| value == 0 || value > LIMIT_MAX) {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!("{field}.{name} must be 1 to {LIMIT_MAX}"),
            ));
        }
    }
    Ok(())
}

/// Raise a session's budget: a request the model proxy holds at the token cap goes on at once if the
/// new cap allows it (within a second).
#[utoipa::path(
    post, path = "/v1/sessions/{id}/budget", tag = "sessions", request_body = RaiseBudgetRequest,
    params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses(
        (status = 200, description = "The session with its new budget", body = Session),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn raise_budget(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    ApiJson(request): ApiJson<RaiseBudgetRequest>,
) -> Result<Json<Session>, ApiError> {
    if request.tokens.is_none() && request.compute_seconds.is_none() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "name how much to add: tokens, compute_seconds or both",
        ));
    }
    check_budget("budget", request.tokens, request.compute_seconds)?;
    let row = state
        .store
        .raise_budget(
            &caller.workspace_id,
            &id,
            request.tokens,
            request.compute_seconds.map(|seconds| seconds * 1000),
        )
        .await?;
    tracing::info!(session = %id, tokens = ?request.tokens, compute_seconds = ?request.compute_seconds, by = %caller.token_id, "budget raised");
    Ok(Json(views::session(&row)))
}

/// The workspace's default budget for new sessions and its quotas.
#[utoipa::path(
    get, path = "/v1/limits", tag = "usage", security(("bearer" = [])),
    responses((status = 200, body = WorkspaceLimits), (status = 401, body = ApiErrorBody))
)]
async fn get_limits(State(state): State<ApiState>, Viewer(caller): Viewer) -> Result<Json<WorkspaceLimits>, ApiError> {
    Ok(Json(state.store.workspace_limits(&caller.workspace_id).await?))
}

/// Set the workspace's default budget and quotas (replacing them; `{}` removes every one).
#[utoipa::path(
    put, path = "/v1/limits", tag = "usage", request_body = WorkspaceLimits, security(("bearer" = [])),
    responses(
        (status = 200, body = WorkspaceLimits),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN: only an admin token", body = ApiErrorBody),
    )
)]
async fn put_limits(
    State(state): State<ApiState>,
    Admin(caller): Admin,
    ApiJson(limits): ApiJson<WorkspaceLimits>,
) -> Result<Json<WorkspaceLimits>, ApiError> {
    check_budget("budget", limits.budget.tokens, limits.budget.compute_seconds)?;
    for (name, value) in [
        ("sessions_per_day", limits.quotas.sessions_per_day),
        ("tokens_per_month", limits.quotas.tokens_per_month),
    ] {
        if value.is_some_and(|value| value > LIMIT_MAX) {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!("quotas.{name} must be at most {LIMIT_MAX}"),
            ));
        }
    }
    state.store.set_workspace_limits(&caller.workspace_id, &limits).await?;
    crate::audit::record(&state, &caller, "limits.set", &caller.workspace_name).await;
    Ok(Json(limits))
}

/// The agent a session runs: the one named, known and installed, or else the default if it is
/// installed. What the server accepts, a worker on it can start (DESIGN §13).
fn choose_agent(agents: &crate::AgentCatalog, named: Option<String>) -> Result<String, ApiError> {
    let installed = agents.installed();
    let details = |agent: &str, install: &str| sortie_protocol::error::details::AgentNotInstalled {
        agent: agent.to_owned(),
        install: install.to_owned(),
        installed: installed.clone(),
    };
    match named {
        Some(agent) => {
            if !agents.known.contains(&agent) {
                return Err(ApiError::new(
                    ErrorCode::AgentUnknown,
                    format!("no agent profile {agent:?}; known: {}", agents.known.join(", ")),
                )
                .with_details(sortie_protocol::error::details::Known {
                    known: agents.known.clone(),
                }));
            }
            match agents.needs(&agent) {
                None => Ok(agent),
                Some(install) => Err(ApiError::new(
                    ErrorCode::AgentNotInstalled,
                    format!(
                        "agent {agent:?} is not installed on this server: `{install}` installs it (installed: {})",
                        list_or_none(&installed)
                    ),
                )
                .with_details(details(&agent, &install))),
            }
        }
        None => match agents.needs(&agents.default) {
            None => Ok(agents.default.clone()),
            Some(install) => Err(ApiError::new(
                ErrorCode::AgentNotInstalled,
                format!(
                    "no agent named, and the default agent {:?} is not installed on this server: name one of the \
                     installed agents ({}), or `{install}`",
                    agents.default,
                    list_or_none(&installed)
                ),
            )
            .with_details(details(&agents.default, &install))),
        },
    }
}

fn list_or_none(ids: &[String]) -> String {
    if ids.is_empty() { "none".into() } else { ids.join(", ") }
}

/// An egress allowlist (the request's `field`) as the gateway will read it, or `EGRESS_ALLOWLIST_INVALID`
/// naming every offending entry.
pub(crate) fn check_allowlist(field: &str, allow: &[String]) -> Result<(), ApiError> {
    egress::validate_allowlist(allow).map_err(|violations| {
        let named: Vec<&str> = violations.iter().map(|v| v.entry.as_str()).collect();
        ApiError::new(
            ErrorCode::EgressAllowlistInvalid,
            format!("{field} has invalid entries: {named:?}"),
        )
        .with_details(sortie_protocol::error::details::AllowlistRefused { entries: violations })
    })
}

/// Replace a session's egress allowlist; its next connection sees the new one (DESIGN §12).
#[utoipa::path(
    post, path = "/v1/sessions/{id}/egress", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    request_body = EgressAmendment, security(("bearer" = [])),
    responses(
        (status = 200, body = Session),
        (status = 400, description = "INVALID_REQUEST, EGRESS_ALLOWLIST_INVALID", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody), (status = 403, description = "FORBIDDEN", body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
        (status = 409, description = "SESSION_NOT_STEERABLE", body = ApiErrorBody),
    )
)]
async fn amend_egress(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    ApiJson(request): ApiJson<EgressAmendment>,
) -> Result<Json<Session>, ApiError> {
    check_allowlist("egress.allow", &request.allow)?;
    let row = state
        .store
        .set_egress_allow(&caller.workspace_id, &id, &request.allow)
        .await?;
    Ok(Json(views::session(&row)))
}

/// The query of `GET /v1/sessions`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Only sessions in this phase.
    phase: Option<String>,
    /// Only sessions of this repository (as stored: the URL, or the resolved local path).
    repo: Option<String>,
    /// `true` lists archived sessions instead of the others.
    archived: Option<bool>,
    /// Page size, 1 to 200 (default 50).
    limit: Option<u32>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// List sessions, newest first.
#[utoipa::path(
    get, path = "/v1/sessions", tag = "sessions", params(ListQuery), security(("bearer" = [])),
    responses(
        (status = 200, body = SessionList),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
    )
)]
async fn list_sessions(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<SessionList>, ApiError> {
    let phase = query
        .phase
        .map(|phase| {
            phase
                .parse::<SessionPhase>()
                .map_err(|_| ApiError::invalid(format!("phase {phase:?} is not a session phase")))
        })
        .transpose()?;
    let limit = query.limit.unwrap_or(LIST_LIMIT_DEFAULT);
    if !(1..=LIST_LIMIT_MAX).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {LIST_LIMIT_MAX}"
        )));
    }
    let before = query
        .cursor
        .map(|cursor| {
            SessionId::parse(&cursor).map_err(|_| ApiError::invalid("cursor is not a cursor this API returned"))
        })
        .transpose()?;
    let filter = SessionFilter {
        phase,
        repo: query.repo,
        archived: query.archived.unwrap_or(false),
        limit: limit + 1,
        before,
    };
    let mut rows = state.store.list_sessions(&caller.workspace_id, &filter).await?;
    let next_cursor = if rows.len() > limit as usize {
        rows.truncate(limit as usize);
        rows.last().map(|row| row.id.to_string())
    } else {
        None
    };
    Ok(Json(SessionList {
        sessions: rows.iter().map(views::session).collect(),
        next_cursor,
    }))
}

/// Read one session.
#[utoipa::path(
    get, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses((status = 200, body = Session), (status = 401, body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody))
)]
async fn get_session(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
) -> Result<Json<Session>, ApiError> {
    let row = state.store.session(&caller.workspace_id, &id).await?;
    Ok(Json(views::session(&row)))
}

/// The session's turn ledger.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/turns", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses((status = 200, body = TurnList), (status = 401, body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody))
)]
async fn list_turns(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
) -> Result<Json<TurnList>, ApiError> {
    let rows = state.store.turns(&caller.workspace_id, &id).await?;
    Ok(Json(TurnList {
        turns: rows.iter().map(views::turn).collect(),
    }))
}

// The cursors travel in headers, not in a wrapper object, so that the body stays the array of
// `UIMessage`s every client already reads (the dashboard, scripts, `sortie` tests): a client that knows
// nothing of pages gets the newest page in the shape it expects.

/// The response header naming the cursor to the page of older turns (pass it as `before`).
const OLDER_CURSOR_HEADER: &str = "sortie-older-cursor";
/// The response header naming the cursor to the page of newer turns (pass it as `after`).
const NEWER_CURSOR_HEADER: &str = "sortie-newer-cursor";

/// The query of `GET /v1/sessions/{id}/messages`. With none, the page holds the newest turns.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct MessagesQuery {
    /// Only turns numbered below this one, the newest of them first: the `Sortie-Older-Cursor` of a
    /// page, for the page before it.
    before: Option<u32>,
    /// Only turns numbered above this one, the oldest of them first: the `Sortie-Newer-Cursor` of a
    /// page, for the page after it. Not with `before`.
    after: Option<u32>,
    /// The most turns in the page, 1 to 100 (default 20).
    limit: Option<u32>,
}

/// The transcript as AI SDK `UIMessage`s, a page of turns at a time.
///
/// Each turn's prompt, then the agent's answer to it, oldest first. Without a cursor the page holds the
/// newest 20 turns (`limit` changes it), so a session of up to 20 turns comes back whole. A page takes
/// no turn after the one that brings it to 16 MiB of stored transcript, and no more of one turn than
/// the transcript caps (100,000 parts, 64 MiB): a turn stored past them ends with a
/// `data-sortie-truncated` part. The cursors to the pages beside this one are in the
/// `Sortie-Older-Cursor` and `Sortie-Newer-Cursor` headers, each absent when no turn lies that way.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/messages", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), MessagesQuery), security(("bearer" = [])),
    responses(
        (status = 200, body = Vec<UiMessage>, headers(
            ("Sortie-Older-Cursor" = u32, description = "Present when older turns exist: the first turn of this page; ask again with `before` set to it."),
            ("Sortie-Newer-Cursor" = u32, description = "Present when newer turns exist: the last turn of this page; ask again with `after` set to it."),
        )),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn get_messages(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
    ApiQuery(query): ApiQuery<MessagesQuery>,
) -> Result<(HeaderMap, Json<Vec<UiMessage>>), ApiError> {
    let limit = query.limit.unwrap_or(MESSAGES_PAGE_TURNS_DEFAULT);
    if !(1..=MESSAGES_PAGE_TURNS_MAX).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {MESSAGES_PAGE_TURNS_MAX}"
        )));
    }
    let start = match (query.before, query.after) {
        (None, None) => PageStart::Newest,
        (Some(before), None) => PageStart::Before(before),
        (None, Some(after)) => PageStart::After(after),
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "before and after name pages on either side: give one of them",
            ));
        }
    };
    let turns = state.store.turns(&caller.workspace_id, &id).await?;
    let page = transcript::read_page(state.store.as_ref(), &id, &turns, start, limit).await?;
    let mut headers = HeaderMap::new();
    for (name, cursor) in [
        (OLDER_CURSOR_HEADER, page.older_cursor),
        (NEWER_CURSOR_HEADER, page.newer_cursor),
    ] {
        if let Some(turn) = cursor {
            headers.insert(name, HeaderValue::from(turn));
        }
    }
    Ok((headers, Json(page.messages)))
}

/// The query of `GET /v1/sessions/{id}/diff`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct DiffQuery {
    /// Files to skip: the `next_offset` of the page before.
    offset: Option<u32>,
    /// The most files in the page, 1 to 200 (default 50).
    limit: Option<u32>,
}

/// The files the session's branch changes against the commit it started from.
///
/// What `git diff <base>...sortie/<id>` shows, as the host read it at the session's last delivery: every
/// file's status and line counts, and its unified diff (64 KiB a file, 2 MiB a branch; a binary file
/// has none), a page of files at a time. Before the first delivery the list is empty and the commits
/// are null.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/diff", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), DiffQuery), security(("bearer" = [])),
    responses(
        (status = 200, body = BranchDiff),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn get_diff(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
    ApiQuery(query): ApiQuery<DiffQuery>,
) -> Result<Json<BranchDiff>, ApiError> {
    let limit = query.limit.unwrap_or(DIFF_PAGE_FILES_DEFAULT);
    if !(1..=DIFF_PAGE_FILES_MAX).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {DIFF_PAGE_FILES_MAX}"
        )));
    }
    let offset = query.offset.unwrap_or(0);
    let session = state.store.session(&caller.workspace_id, &id).await?;
    let stored = state.store.branch_diff(&id).await?;
    let Some(stored) = stored else {
        return Ok(Json(BranchDiff {
            branch: id.branch(),
            base: session.base,
            base_sha: None,
            head_sha: None,
            files_changed: 0,
            insertions: 0,
            deletions: 0,
            files: Vec::new(),
            next_offset: None,
            truncated: false,
        }));
    };
    let start = (offset as usize).min(stored.files.len());
    let end = start.saturating_add(limit as usize).min(stored.files.len());
    let next_offset = (end < stored.files.len()).then(|| u32::try_from(end).unwrap_or(u32::MAX));
    Ok(Json(BranchDiff {
        branch: id.branch(),
        base: session.base,
        base_sha: Some(stored.base_sha),
        head_sha: Some(stored.head_sha),
        files_changed: stored.files_changed,
        insertions: stored.insertions,
        deletions: stored.deletions,
        files: stored.files.into_iter().skip(start).take(end - start).collect(),
        next_offset,
        truncated: stored.truncated,
    }))
}

/// Add a turn. `queue` waits for the running turn; `interrupt` stops it first.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/steer", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    request_body = SteerRequest, security(("bearer" = [])),
    responses(
        (status = 202, body = Turn),
        (status = 400, description = "INVALID_REQUEST", body = ApiErrorBody),
        (status = 401, body = ApiErrorBody), (status = 403, description = "FORBIDDEN", body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
        (status = 409, description = "TURN_QUEUE_FULL, SESSION_NOT_STEERABLE, IDEMPOTENCY_KEY_IN_USE", body = ApiErrorBody),
        (status = 413, description = "PROMPT_TOO_LARGE, SESSION_PROMPTS_TOO_LARGE", body = ApiErrorBody),
        (status = 422, description = "IDEMPOTENCY_KEY_REUSED", body = ApiErrorBody),
    )
)]
async fn steer(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    headers: HeaderMap,
    ApiJson(request): ApiJson<SteerRequest>,
) -> Response {
    let scope = format!("POST /v1/sessions/{id}/steer");
    let held = match idempotency::begin(&state, &caller.workspace_id, &headers, &scope, &request).await {
        Ok(Begun::Fresh(held)) => held,
        Ok(Begun::Replay(first)) => return first,
        Err(refusal) => return refusal.into_response(),
    };
    let result = add_turn(&state, &caller.workspace_id, &id, request).await;
    idempotency::settle(&state, held, result).await
}

async fn add_turn(
    state: &ApiState,
    workspace_id: &str,
    id: &SessionId,
    request: SteerRequest,
) -> Result<(StatusCode, Json<Turn>), ApiError> {
    validate::check_prompt("prompt", &request.prompt)?;
    let turn = state
        .store
        .steer(
            workspace_id,
            id,
            NewTurn {
                prompt: request.prompt,
                mode: request.mode.unwrap_or_default(),
            },
        )
        .await?;
    Ok((StatusCode::ACCEPTED, Json(views::turn(&turn))))
}

/// Stop the running turn; its work so far is delivered and the session goes idle.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/stop", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses(
        (status = 202, description = "The turn being stopped", body = Turn),
        (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
        (status = 409, description = "NO_TURN_RUNNING", body = ApiErrorBody),
    )
)]
async fn stop(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    OptionalJson(_no_input): OptionalJson<NoInput>,
) -> Result<(StatusCode, Json<Turn>), ApiError> {
    let turn = state.store.request_stop(&caller.workspace_id, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(views::turn(&turn))))
}

/// End the session: the running turn stops (its work is delivered), waiting turns are canceled,
/// the sandbox is destroyed. Terminal; canceling again changes nothing.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/cancel", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses((status = 202, body = Session), (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody))
)]
async fn cancel(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    OptionalJson(_no_input): OptionalJson<NoInput>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let row = state.store.cancel(&caller.workspace_id, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(views::session(&row))))
}

/// Re-provision a hibernated session without a prompt; a session that is awake is left as it is.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/resume", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses(
        (status = 202, body = Session), (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody), (status = 409, description = "SESSION_NOT_STEERABLE", body = ApiErrorBody),
    )
)]
async fn resume(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    OptionalJson(_no_input): OptionalJson<NoInput>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let row = state.store.resume(&caller.workspace_id, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(views::session(&row))))
}

/// Hide the session from the default list and release its sandbox. A session with a turn in flight
/// is refused: stop or cancel it first.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/archive", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses(
        (status = 200, body = Session), (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody),
        (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody), (status = 409, description = "SESSION_ACTIVE", body = ApiErrorBody),
    )
)]
async fn archive(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
    OptionalJson(_no_input): OptionalJson<NoInput>,
) -> Result<Json<Session>, ApiError> {
    let row = state.store.set_archived(&caller.workspace_id, &id, true).await?;
    Ok(Json(views::session(&row)))
}

/// Show an archived session in the default list again.
#[utoipa::path(
    delete, path = "/v1/sessions/{id}/archive", tag = "sessions", params(("id" = String, Path, description = "Session id")), security(("bearer" = [])),
    responses((status = 200, body = Session), (status = 401, body = ApiErrorBody), (status = 403, body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody))
)]
async fn unarchive(
    State(state): State<ApiState>,
    Operator(caller): Operator,
    SessionPath(id): SessionPath,
) -> Result<Json<Session>, ApiError> {
    let row = state.store.set_archived(&caller.workspace_id, &id, false).await?;
    Ok(Json(views::session(&row)))
}

/// Mint a single-use ticket for the session's stream (valid 60 s). `turn` tickets need the operator role.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/attach-ticket", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    request_body(content = AttachTicketRequest, description = "Optional; `{}` or no body mints an `attach` ticket"), security(("bearer" = [])),
    responses(
        (status = 201, body = AttachTicket), (status = 400, body = ApiErrorBody), (status = 401, body = ApiErrorBody),
        (status = 403, description = "FORBIDDEN", body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody),
    )
)]
async fn attach_ticket(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    SessionPath(id): SessionPath,
    OptionalJson(request): OptionalJson<AttachTicketRequest>,
) -> Result<(StatusCode, Json<AttachTicket>), ApiError> {
    let action = request.action.unwrap_or_default();
    if action == TicketAction::Turn && caller.role < Role::Operator {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "a turn ticket submits a steer: it needs the operator role",
        ));
    }
    let session = state.store.session(&caller.workspace_id, &id).await?;
    let nonce = tokens::random_text(16).map_err(|error| {
        tracing::error!(%error, "no randomness for a ticket nonce");
        ApiError::new(ErrorCode::Internal, "the server failed; the log has the detail")
    })?;
    let expires_at_ms = now_ms() + TICKET_TTL_SECONDS * 1000;
    let claims = TicketClaims {
        v: TICKET_VERSION,
        sub: caller.token_id,
        ws: caller.workspace_id,
        ses: session.id.to_string(),
        act: action,
        exp: expires_at_ms / 1000,
        nonce,
    };
    let ticket = sortie_protocol::ticket::mint(state.ticket_secret.expose(), &claims);
    Ok((
        StatusCode::CREATED,
        Json(AttachTicket {
            ticket,
            expires_at: rfc3339_from_epoch_ms(claims.exp * 1000),
            stream_url: format!("/v1/sessions/{}/stream", session.id),
        }),
    ))
}

/// The query of `GET /v1/usage`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct UsageQuery {
    /// Only this session.
    session: Option<String>,
    /// `json` (the default) or `csv`: one line per session, day and model, for a spreadsheet.
    #[param(inline)]
    format: Option<UsageFormat>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
enum UsageFormat {
    #[default]
    Json,
    Csv,
}

/// Usage by session and UTC day: compute seconds and tokens by model.
#[utoipa::path(
    get, path = "/v1/usage", tag = "usage", params(UsageQuery), security(("bearer" = [])),
    responses((status = 200, body = UsageReport, description = "JSON, or with `format=csv` text/csv: `session_id,day,model,input_tokens,output_tokens,compute_seconds` (compute on the line with an empty model)"), (status = 400, body = ApiErrorBody), (status = 401, body = ApiErrorBody), (status = 404, description = "SESSION_NOT_FOUND", body = ApiErrorBody))
)]
async fn usage(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    ApiQuery(query): ApiQuery<UsageQuery>,
) -> Result<Response, ApiError> {
    let session = match query.session {
        Some(text) => {
            let id = SessionId::parse(&text).map_err(|_| ApiError::session_not_found())?;
            state.store.session(&caller.workspace_id, &id).await?;
            Some(id)
        }
        None => None,
    };
    let records = state.store.usage(&caller.workspace_id, session.as_ref()).await?;
    let mut rows: Vec<UsageRow> = Vec::new();
    let row_for = |rows: &mut Vec<UsageRow>, session_id: &SessionId, day: &str| -> usize {
        if let Some(index) = rows
            .iter()
            .position(|row| &row.session_id == session_id && row.day == day)
        {
            return index;
        }
        rows.push(UsageRow {
            session_id: session_id.clone(),
            day: day.to_owned(),
            compute_seconds: 0,
            models: Vec::new(),
        });
        rows.len() - 1
    };
    for (session_id, day, compute_ms) in &records.compute {
        let index = row_for(&mut rows, session_id, day);
        rows[index].compute_seconds = compute_ms / 1000;
    }
    for (session_id, day, model, input_tokens, output_tokens) in &records.tokens {
        let index = row_for(&mut rows, session_id, day);
        rows[index].models.push(ModelUsage {
            model: model.clone(),
            input_tokens: *input_tokens,
            output_tokens: *output_tokens,
        });
    }
    rows.sort_by(|a, b| b.day.cmp(&a.day).then_with(|| a.session_id.cmp(&b.session_id)));
    let report = UsageReport { rows };
    Ok(match query.format.unwrap_or_default() {
        UsageFormat::Json => Json(report).into_response(),
        UsageFormat::Csv => (
            [
                (header::CONTENT_TYPE, "text/csv; charset=utf-8"),
                (header::CONTENT_DISPOSITION, "attachment; filename=\"sortie-usage.csv\""),
            ],
            usage_csv(&report),
        )
            .into_response(),
    })
}

/// The report as CSV (RFC 4180): a line per session, day and model, and one with an empty model for the
/// day's compute. A model name is the caller's text, so it is quoted and cannot start a formula.
fn usage_csv(report: &UsageReport) -> String {
    let mut out = String::from("session_id,day,model,input_tokens,output_tokens,compute_seconds\r\n");
    for row in &report.rows {
        out.push_str(&format!(
            "{},{},,0,0,{}\r\n",
            row.session_id, row.day, row.compute_seconds
        ));
        for model in &row.models {
            out.push_str(&format!(
                "{},{},{},{},{},0\r\n",
                row.session_id,
                row.day,
                csv_text(&model.model),
                model.input_tokens,
                model.output_tokens
            ));
        }
    }
    out
}

fn csv_text(text: &str) -> String {
    let inert = if text.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        format!("'{text}")
    } else {
        text.to_owned()
    };
    format!("\"{}\"", inert.replace('"', "\"\""))
}
