//! GitHub as the place work is asked for and reported (issue 21): the worker acts on the webhook
//! deliveries the api recorded ([`run_triggers`]), and follows each turn of a session on GitHub with
//! a check run, an up-to-date pull request description (the session's evidence) and, for a session asked
//! for in an issue, a comment there when its pull request opens.
//!
//! A comment becomes work only when every guard holds: it is new (`created`), not a bot's, not made
//! through sortie's own App, mentions `@sortie`, is on a repository the connection's triggers take, and
//! its author has write or admin permission by GitHub's permission API (any error there denies). A
//! refusal is answered in the thread with its reason, except for the silent guards (a bot, an edit, no
//! mention), which would otherwise make loops and noise.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sortie_github::rest::{CommentKind, Conclusion, Repo};
use sortie_github::tokens::RepoName;
use sortie_github::webhook::{self, Comment, Thread};
use sortie_protocol::api::ForgeTriggers;
use sortie_protocol::phase::TurnMode;
use sortie_protocol::{SessionId, TurnStatus};
use sortie_store::{ForgeConnectionRow, ForgeDeliveryRow, NewSession, NewTurn, SessionRow, StoreError};

use crate::Context;

/// How often the store is asked for deliveries.
const TRIGGER_POLL: Duration = Duration::from_millis(250);
/// A delivery claimed this long ago and not done is taken again (its worker died).
const DELIVERY_LEASE_MS: i64 = 5 * 60 * 1000;
/// The name of sortie's check run.
const CHECK_NAME: &str = "sortie";

/// How long after answering a refusal to someone in a repository sortie stays silent to them there.
const REFUSAL_QUIET: Duration = Duration::from_secs(10 * 60);
/// The most people a worker remembers having refused.
const REFUSALS_REMEMBERED: usize = 10_000;

/// Whom a refusal was last answered to, so that anyone writing `@sortie` again and again on a public
/// repository gets one answer in a while, not one each time.
#[derive(Default)]
pub(crate) struct Refusals(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

impl Refusals {
    /// Whether to answer `who` now (and remember that it was).
    fn answer_now(&self, who: String) -> bool {
        let now = std::time::Instant::now();
        let mut answered = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if answered
            .get(&who)
            .is_some_and(|at| now.duration_since(*at) < REFUSAL_QUIET)
        {
            return false;
        }
        if answered.len() >= REFUSALS_REMEMBERED {
            answered.retain(|_, at| now.duration_since(*at) < REFUSAL_QUIET);
            if answered.len() >= REFUSALS_REMEMBERED {
                return false;
            }
        }
        answered.insert(who, now);
        true
    }
}

/// Where a session was asked for, kept with it (`session_origins`) to answer there.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Origin {
    pub host: String,
    pub repo: String,
    /// The issue or pull request the comment was made in.
    pub number: u64,
    pub comment_id: u64,
}

/// Acts on recorded deliveries until `shutdown`, one at a time.
pub(crate) async fn run_triggers(context: Arc<Context>, shutdown: impl std::future::Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let claimed = context
            .store
            .claim_forge_delivery(&context.config.worker_id, DELIVERY_LEASE_MS)
            .await;
        match claimed {
            Ok(Some(delivery)) => {
                let outcome = act_on(&context, &delivery).await;
                tracing::info!(delivery = %delivery.delivery_id, event = %delivery.event, %outcome, "forge delivery");
                if let Err(error) = context
                    .store
                    .finish_forge_delivery(&delivery.delivery_id, &outcome)
                    .await
                {
                    tracing::warn!(%error, delivery = %delivery.delivery_id, "cannot record what was made of a delivery");
                }
                continue;
            }
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "cannot claim forge deliveries"),
        }
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(TRIGGER_POLL) => {}
        }
    }
}

/// What one delivery led to, in a few words for the store and the log.
async fn act_on(context: &Arc<Context>, delivery: &ForgeDeliveryRow) -> String {
    let comment = match webhook::comment(&delivery.event, delivery.payload.as_bytes()) {
        Ok(Some(comment)) => comment,
        Ok(None) => return "ignored: not a comment".into(),
        Err(error) => return format!("ignored: {error}"),
    };
    let connection = match context
        .store
        .forge_connection(&delivery.workspace_id, &delivery.host)
        .await
    {
        Ok(Some(connection)) => connection,
        Ok(None) => return "ignored: the connection is gone".into(),
        Err(error) => return format!("failed: {error}"),
    };
    let Some(app_id) = connection.app_id.clone() else {
        return "ignored: the connection is not a GitHub App".into();
    };
    let triggers: Option<ForgeTriggers> = connection
        .triggers
        .as_deref()
        .and_then(|json| serde_json::from_str(json).ok());
    let assignee = triggers.as_ref().and_then(|t| t.assignee.as_deref());
    if let Some(reason) = comment.ignored(&app_id, assignee) {
        return format!("ignored: {reason}");
    }
    if comment.host().as_deref() != Some(connection.host.as_str()) {
        return "ignored: the repository is on another host".into();
    }
    let Some(http) = context.config.forge_http.clone() else {
        return "failed: this worker cannot reach forges".into();
    };
    let credential =
        match crate::forge::conversation(context, &connection.workspace_id, &connection.host, &comment.repo).await {
            Ok(credential) => credential,
            Err(error) => return format!("failed: {error}"),
        };
    let token = String::from_utf8_lossy(credential.token.expose()).into_owned();
    let repo = Repo::new(&http, &connection.api_base, &comment.repo, &token);
    let outcome = act(context, &repo, &connection, &comment, triggers).await;
    forget_if_refused(&repo, credential.renewal.as_ref(), &token).await;
    outcome
}

/// A token GitHub refused is not used again: the next call mints another.
async fn forget_if_refused(repo: &Repo<'_>, renewal: Option<&crate::forge::Renewal>, token: &str) {
    if repo.token_refused()
        && let Some(renewal) = renewal
    {
        tracing::warn!(repo = %renewal.repo, "GitHub refused the conversation token; the next call mints another");
        renewal.forget(token).await;
    }
}

/// Acts on a request from a repository the connection may take (`triggers` permitting).
async fn act(
    context: &Arc<Context>,
    repo: &Repo<'_>,
    connection: &ForgeConnectionRow,
    comment: &Comment,
    triggers: Option<ForgeTriggers>,
) -> String {
    let Some(triggers) = triggers.filter(|t| t.takes(&comment.repo.owner, &comment.repo.name)) else {
        refuse(
            context,
            repo,
            comment,
            &format!(
                "@{} this repository is not connected to a sortie workspace, so sortie cannot work on it. An \
                 admin adds `{}` to the triggers of the workspace's GitHub App connection.",
                comment.sender, comment.repo
            ),
        )
        .await;
        return "refused: repository not connected".into();
    };
    // Deny on any error: only a yes from GitHub lets a comment through.
    match repo.permission(&comment.sender).await {
        Ok(permission) if permission.may_ask() => {}
        Ok(permission) => {
            refuse(
                context,
                repo,
                comment,
                &format!(
                    "@{} only people with write access to {} can ask sortie for work.",
                    comment.sender, comment.repo
                ),
            )
            .await;
            return format!("refused: {} has {permission:?} permission", comment.sender);
        }
        Err(error) => {
            refuse(
                context,
                repo,
                comment,
                &format!(
                    "@{} sortie could not confirm that you have write access to {}, so it did not start.",
                    comment.sender, comment.repo
                ),
            )
            .await;
            return format!("refused: no permission answer ({error})");
        }
    }
    let instruction = webhook::instruction(&comment.body).unwrap_or_default();
    match &comment.on {
        Thread::Issue {
            number,
            title,
            body,
            url,
        } => {
            // The context first and the request last, as a person would write it.
            let task = format!(
                "Issue #{number} of {} ({url}):\n\n## {title}\n\n{body}\n\n---\n\n@{} {}:\n\n{}",
                comment.repo,
                comment.sender,
                if comment.assignee.is_some() {
                    "assigned it to sortie"
                } else {
                    "asks"
                },
                if instruction.is_empty() {
                    "Resolve this issue."
                } else {
                    &instruction
                },
            );
            let title = format!("#{number}: {title}");
            start(context, repo, connection, &triggers, comment, task, title, None).await
        }
        Thread::PullRequest { url, number } | Thread::ReviewLine { url, number, .. } => {
            let prompt = match &comment.on {
                Thread::ReviewLine {
                    path, line, diff_hunk, ..
                } => {
                    let at = line.map(|line| format!(" line {line}")).unwrap_or_default();
                    let fence = "`".repeat(diff_hunk.split(|c| c != '`').map(str::len).max().unwrap_or(0).max(2) + 1);
                    format!("A review comment on `{path}`{at}:\n\n{fence}diff\n{diff_hunk}\n{fence}\n\n{instruction}")
                }
                _ => instruction.clone(),
            };
            let found = context.store.session_by_pr_url(&connection.workspace_id, url).await;
            match found {
                Ok(Some(session)) => steer(context, repo, connection, comment, &session, prompt).await,
                Ok(None) if triggers.others_pull_requests => {
                    let head = match &comment.on {
                        Thread::ReviewLine {
                            head_ref, head_repo, ..
                        } => Ok((head_ref.clone(), head_repo.clone())),
                        _ => repo.pull_head(*number).await,
                    };
                    let same_repo = |from: &Option<String>| {
                        from.as_deref()
                            .is_some_and(|from| from.eq_ignore_ascii_case(&comment.repo.to_string()))
                    };
                    let head = match head {
                        // A fork's branch is not this repository's: its name here may be another branch.
                        Ok((_, from)) if !same_repo(&from) => {
                            answer(
                                repo,
                                comment,
                                &format!(
                                    "@{} sortie works on pull requests whose branch is in {} itself; this one's is in {}.",
                                    comment.sender,
                                    comment.repo,
                                    from.as_deref().unwrap_or("a repository that is gone")
                                ),
                            )
                            .await;
                            return "refused: a pull request from another repository".into();
                        }
                        Ok((head, _)) if sortie_protocol::validate::check_base(&head).is_err() => {
                            return format!("refused: the branch {head:?} is not one sortie takes");
                        }
                        Ok((head, _)) => head,
                        Err(error) => {
                            answer(
                                repo,
                                comment,
                                &format!(
                                    "@{} sortie could not read this pull request's branch: {error}",
                                    comment.sender
                                ),
                            )
                            .await;
                            return format!("failed: {error}");
                        }
                    };
                    let task = format!(
                        "Pull request #{number} of {} ({url}), on its branch `{head}`. @{} asks:\n\n{prompt}",
                        comment.repo, comment.sender
                    );
                    let title = format!("#{number}: {}", sortie_protocol::validate::default_title(&instruction));
                    start(context, repo, connection, &triggers, comment, task, title, Some(head)).await
                }
                Ok(None) => {
                    answer(
                        repo,
                        comment,
                        &format!(
                            "@{} sortie did not open this pull request, and this workspace does not take work on \
                             pull requests sortie did not open.",
                            comment.sender
                        ),
                    )
                    .await;
                    "refused: not sortie's pull request".into()
                }
                Err(error) => format!("failed: {error}"),
            }
        }
    }
}

/// 👀 on a comment whose request was taken. An assignment has no comment to react to: the answer says
/// it was taken.
async fn acknowledge(repo: &Repo<'_>, comment: &Comment) {
    let kind = match comment.on {
        Thread::ReviewLine { .. } => CommentKind::Review,
        _ => CommentKind::Issue,
    };
    if comment.comment_id != 0
        && let Err(error) = repo.react(kind, comment.comment_id, "eyes").await
    {
        tracing::warn!(%error, repo = %comment.repo, "cannot react to a comment");
    }
}

/// Answers a refusal in the comment's thread, unless its author was answered one there a moment ago.
async fn refuse(context: &Context, repo: &Repo<'_>, comment: &Comment, body: &str) {
    if context
        .github_refusals
        .answer_now(format!("{}:{}", comment.repo, comment.sender.to_ascii_lowercase()))
    {
        answer(repo, comment, body).await;
    }
}

/// Answers in the comment's thread; a failure is logged (nothing else can be done about it).
async fn answer(repo: &Repo<'_>, comment: &Comment, body: &str) {
    if let Err(error) = repo.comment(comment.on.number(), body).await {
        tracing::warn!(%error, repo = %comment.repo, "cannot answer a comment");
    }
}

/// A new session for a comment, answered with its link.
#[allow(clippy::too_many_arguments)]
async fn start(
    context: &Arc<Context>,
    repo: &Repo<'_>,
    connection: &ForgeConnectionRow,
    triggers: &ForgeTriggers,
    comment: &Comment,
    task: String,
    title: String,
    base: Option<String>,
) -> String {
    let mut task = task;
    if task.len() > sortie_protocol::limits::PROMPT_MAX_BYTES {
        let mut end = sortie_protocol::limits::PROMPT_MAX_BYTES;
        while !task.is_char_boundary(end) {
            end -= 1;
        }
        task.truncate(end);
    }
    let title: String = title.chars().take(200).collect();
    let workspace_id = &connection.workspace_id;
    // The workspace's default budget holds for a forge's request as for the api's (its quotas, the
    // store's, too).
    let budget = match sortie_store::limits::session_budget(context.store.as_ref(), workspace_id, None).await {
        Ok(budget) => budget,
        Err(error) => return could_not(repo, comment, "start", &error).await,
    };
    let id = SessionId::generate();
    let new = NewSession {
        id: id.clone(),
        workspace_id: connection.workspace_id.clone(),
        // From the connection's host and the checked name, not from the payload's URL.
        repo: format!("https://{}/{}.git", connection.host, comment.repo),
        base,
        agent: triggers
            .agent
            .clone()
            .unwrap_or_else(|| sortie_protocol::agents::DEFAULT_AGENT.to_owned()),
        model: triggers.model.clone(),
        title,
        egress_allow: triggers.egress_allow.clone(),
        setup: triggers.setup.clone(),
        task,
        budget,
    };
    if let Err(error) = context.store.create_session(new).await {
        return could_not(repo, comment, "start", &error).await;
    }
    acknowledge(repo, comment).await;
    let origin = Origin {
        host: connection.host.clone(),
        repo: comment.repo.to_string(),
        number: comment.on.number(),
        comment_id: comment.comment_id,
    };
    if let Err(error) = context
        .store
        .set_session_origin(&id, &serde_json::to_string(&origin).unwrap_or_default())
        .await
    {
        tracing::warn!(%error, session = %id, "cannot record where a session was asked for");
    }
    let link = triggers
        .session_link(id.as_str())
        .map(|link| format!(" ([follow it live]({link}))"))
        .unwrap_or_default();
    answer(
        repo,
        comment,
        &format!(
            "sortie is on it: session `{id}`{link}. Its work is pushed to `{}`, and the draft pull request will be linked here.",
            id.branch()
        ),
    )
    .await;
    format!("started {id}")
}

/// Answers a request the store could not take, and says so for the delivery's outcome.
async fn could_not(repo: &Repo<'_>, comment: &Comment, what: &str, error: &StoreError) -> String {
    answer(
        repo,
        comment,
        &format!("@{} sortie could not {what}: {}", comment.sender, said(error)),
    )
    .await;
    format!("failed: {error}")
}

/// What a thread on GitHub (perhaps public) is told of a refusal: the user's part of it, never the
/// store's own words.
fn said(error: &StoreError) -> String {
    match error {
        StoreError::NotSteerable(_)
        | StoreError::TurnQueueFull(_)
        | StoreError::PromptsTooLarge { .. }
        | StoreError::QuotaExceeded(_) => error.to_string(),
        _ => "sortie could not record it; write the comment again in a while".to_owned(),
    }
}

/// Another turn of the session whose pull request the comment is on.
async fn steer(
    context: &Arc<Context>,
    repo: &Repo<'_>,
    connection: &ForgeConnectionRow,
    comment: &Comment,
    session: &SessionId,
    prompt: String,
) -> String {
    let turn = context
        .store
        .steer(
            &connection.workspace_id,
            session,
            NewTurn {
                prompt,
                mode: TurnMode::Queue,
            },
        )
        .await;
    match turn {
        Ok(turn) => {
            acknowledge(repo, comment).await;
            format!("steered {session} (turn {})", turn.n)
        }
        Err(error) => could_not(repo, comment, "take this", &error).await,
    }
}

/// A session's repository on GitHub, and a token to talk there, when it is on a GitHub connection.
async fn github_repo(context: &Context, session: &SessionRow) -> Option<Talk> {
    let host = sortie_protocol::api::repo_forge_host(&session.repo)?;
    let name = crate::forge::repo_name(&session.repo)?;
    let credential = crate::forge::conversation(context, &session.workspace_id, &host, &name)
        .await
        .inspect_err(|error| tracing::debug!(%error, session = %session.id, "no GitHub conversation token"))
        .ok()?;
    let connection = credential.connection;
    if connection.kind != sortie_protocol::api::ForgeKind::Github || connection.api_base.is_empty() {
        return None;
    }
    Some(Talk {
        connection,
        name,
        token: String::from_utf8_lossy(credential.token.expose()).into_owned(),
        renewal: credential.renewal,
        http: context.config.forge_http.clone()?,
    })
}

/// What talking in a session's repository takes.
struct Talk {
    connection: ForgeConnectionRow,
    name: RepoName,
    token: String,
    renewal: Option<crate::forge::Renewal>,
    http: reqwest::Client,
}

impl Talk {
    fn repo(&self) -> Repo<'_> {
        Repo::new(&self.http, &self.connection.api_base, &self.name, &self.token)
    }
}

/// A turn of a session with a pull request starts: its check run goes in progress on the branch's
/// head (GitHub Apps only: a personal token cannot make check runs). The head and the run's id, for
/// [`turn_ended`].
pub(crate) async fn turn_started(context: &Arc<Context>, session: &SessionRow) -> Option<(String, u64)> {
    let (Some(_), Some(head)) = (&session.pr, &session.head_sha) else {
        return None;
    };
    let talk = github_repo(context, session).await?;
    talk.connection.app_id.as_ref()?;
    let repo = talk.repo();
    let link = sortie_store::dashboard_link(context.store.as_ref(), session).await;
    let started = match repo.start_check(CHECK_NAME, head, link.as_deref()).await {
        Ok(id) => Some((head.clone(), id)),
        Err(error) => {
            tracing::warn!(%error, session = %session.id, "cannot start the check run");
            None
        }
    };
    forget_if_refused(&repo, talk.renewal.as_ref(), &talk.token).await;
    started
}

/// A turn of `before` (the session as it was when the turn was claimed) ended: its pull request's
/// description is made the session's evidence, the check run `started` is completed (and reported on
/// the new head), and an issue that asked for the session hears of a pull request opened by this turn.
pub(crate) async fn turn_ended(context: &Arc<Context>, before: &SessionRow, n: u32, started: Option<(String, u64)>) {
    let Ok(session) = context.store.session(&before.workspace_id, &before.id).await else {
        return;
    };
    let Some((pr_url, pr_number)) = session.pr.clone() else {
        return;
    };
    let Some(talk) = github_repo(context, &session).await else {
        return;
    };
    let (connection, name) = (&talk.connection, &talk.name);
    let repo = talk.repo();
    let link = sortie_store::dashboard_link(context.store.as_ref(), &session).await;
    match sortie_store::session_evidence(context.store.as_ref(), &session, link.clone()).await {
        Ok(evidence) => {
            if let Err(error) = repo.set_pull_body(pr_number, &evidence.markdown()).await {
                tracing::warn!(%error, session = %session.id, "cannot update the pull request's description");
            }
        }
        Err(error) => tracing::warn!(%error, session = %session.id, "cannot read the session's evidence"),
    }
    if connection.app_id.is_some() {
        let turn = context.store.turn(&session.id, n).await.ok();
        let (conclusion, title) = match turn.as_ref().map(|turn| turn.status) {
            Some(TurnStatus::Completed) => (Conclusion::Success, format!("Turn {n} completed")),
            Some(TurnStatus::Canceled) => (Conclusion::Cancelled, format!("Turn {n} was stopped")),
            Some(TurnStatus::Failed) => (Conclusion::Failure, format!("Turn {n} failed")),
            _ => (Conclusion::Neutral, format!("Turn {n} ended")),
        };
        let summary = turn
            .and_then(|turn| turn.failure)
            .map(|(_, reason)| reason)
            .unwrap_or_else(|| format!("The session's work is on `{}`.", session.id.branch()));
        if let Some((head, id)) = &started
            && let Err(error) = repo.complete_check(*id, conclusion, &title, &summary).await
        {
            tracing::warn!(%error, session = %session.id, head, "cannot complete the check run");
        }
        // The pull request shows its head's checks: a new head gets the outcome too.
        let moved = session
            .head_sha
            .as_ref()
            .filter(|head| started.as_ref().is_none_or(|(started, _)| started != *head));
        if let Some(head) = moved {
            match repo.start_check(CHECK_NAME, head, link.as_deref()).await {
                Ok(id) => {
                    if let Err(error) = repo.complete_check(id, conclusion, &title, &summary).await {
                        tracing::warn!(%error, session = %session.id, "cannot complete the check run");
                    }
                }
                Err(error) => tracing::warn!(%error, session = %session.id, "cannot report the check run"),
            }
        }
    }
    if before.pr.is_none() {
        let origin = context
            .store
            .session_origin(&session.id)
            .await
            .ok()
            .flatten()
            .and_then(|json| serde_json::from_str::<Origin>(&json).ok());
        if let Some(origin) = origin.filter(|origin| origin.repo == name.to_string()) {
            let said = repo
                .comment(
                    origin.number,
                    &format!(
                        "sortie opened a draft pull request for session `{}`: {pr_url}",
                        session.id
                    ),
                )
                .await;
            if let Err(error) = said {
                tracing::warn!(%error, session = %session.id, "cannot link the pull request from where it was asked for");
            }
        }
    }
    forget_if_refused(&repo, talk.renewal.as_ref(), &talk.token).await;
}
