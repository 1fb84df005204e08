//! The client commands over the REST API. Errors print the server's code and sentence and exit
//! non-zero.

use std::io::{IsTerminal, Read};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use reqwest::Method;
use serde_json::Value;
use sortie_protocol::ApiErrorBody;
use sortie_protocol::api::{
    CreateSessionRequest, CreateWebhookRequest, EgressAmendment, EgressRequest, ForgeConnection, ForgeConnectionList,
    GitHubAppCredentials, MODEL_KEY_MAX_BYTES, ModelApi, ModelKey, ModelKeyList, Session, SessionList,
    SetForgeConnectionRequest, SetModelKeyRequest, SignInLink, SteerRequest, Turn, TurnList, Webhook,
    WebhookDeliveryList, WebhookList,
};
use sortie_protocol::phase::TurnMode;

use crate::args::{ClientCommand as Command, ForgeCommand, KeysCommand, LsArgs, RunArgs, WebhookCommand};
use crate::http::{Answer, Client, Login, TOKEN_ENV, Target, login_file};

/// Runs one client command against the server `target` names.
pub async fn run(target: Target, command: Command) -> anyhow::Result<ExitCode> {
    if matches!(command, Command::Login) {
        return login(&target).await;
    }
    let client = Client::resolve(&target)?;
    match command {
        Command::Run(run) => create(&client, run).await,
        Command::Logs(logs) => {
            let follow = crate::follow::Follow {
                live: logs.follow,
                turn: logs.turn,
                full: logs.full,
            };
            crate::follow::logs(&client, &logs.id, follow).await
        }
        Command::SigninLink => {
            let answer = client.call::<SignInLink>(Method::POST, "/v1/auth/links").await?;
            let server = client.server.trim_end_matches('/').to_owned();
            finish(&client, answer, |link| {
                let minutes = link.expires_in_seconds / 60;
                format!("{server}/signin#{}\n(works once, for {minutes} minutes)", link.code)
            })
        }
        Command::Resume { id } => {
            let answer = client
                .call::<Session>(Method::POST, &format!("/v1/sessions/{id}/resume"))
                .await?;
            finish(&client, answer, |session| format!("{} {}", session.id, session.phase))
        }
        Command::Archive { id, undo } => {
            let method = if undo { Method::DELETE } else { Method::POST };
            let answer = client
                .call::<Session>(method, &format!("/v1/sessions/{id}/archive"))
                .await?;
            finish(&client, answer, |session| {
                format!(
                    "{} {}",
                    session.id,
                    if session.archived { "archived" } else { "not archived" }
                )
            })
        }
        Command::Allow { id, hosts } => allow(&client, &id, hosts).await,
        Command::Ls(ls) => list(&client, ls).await,
        Command::Show { id } => show(&client, &id).await,
        Command::Steer { id, prompt, interrupt } => {
            let mode = if interrupt {
                TurnMode::Interrupt
            } else {
                TurnMode::Queue
            };
            let steer = SteerRequest {
                prompt,
                mode: Some(mode),
            };
            let answer = client
                .send::<Turn>(Method::POST, &format!("/v1/sessions/{id}/steer"), &steer)
                .await?;
            finish(&client, answer, |turn| {
                format!("turn {} {} on {id}", turn.n, turn.status)
            })
        }
        Command::Stop { id } => {
            let answer = client
                .call::<Turn>(Method::POST, &format!("/v1/sessions/{id}/stop"))
                .await?;
            finish(&client, answer, |turn| format!("stopping turn {} of {id}", turn.n))
        }
        Command::Budget {
            id,
            tokens,
            compute_seconds,
        } => {
            let request = sortie_protocol::api::RaiseBudgetRequest {
                tokens,
                compute_seconds,
            };
            let answer = client
                .send::<Session>(Method::POST, &format!("/v1/sessions/{id}/budget"), &request)
                .await?;
            finish(&client, answer, |session| {
                let budget = session.budget.clone().unwrap_or_default();
                let shown = |cap: Option<u64>| cap.map_or_else(|| "none".to_owned(), |n| n.to_string());
                format!(
                    "{}: budget {} tokens, {} compute seconds",
                    session.id,
                    shown(budget.tokens),
                    shown(budget.compute_seconds)
                )
            })
        }
        Command::Cancel { id } => {
            let answer = client
                .call::<Session>(Method::POST, &format!("/v1/sessions/{id}/cancel"))
                .await?;
            finish(&client, answer, |session| format!("{} {}", session.id, session.phase))
        }
        Command::Keys(command) => keys(&client, command).await,
        Command::Forge(command) => forge(&client, command).await,
        Command::Webhook(command) => webhook(&client, command).await,
        Command::Mcp => {
            let api = sortie_mcp::HttpApi {
                client: client.http.clone(),
                base: client.server.clone(),
            };
            sortie_mcp::serve_stdio(std::sync::Arc::new(api), format!("Bearer {}", client.token))
                .await
                .map_err(|error| anyhow::anyhow!("mcp: {error}"))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Login => login(&target).await,
    }
}

/// Prints an answer: the JSON body with `--json`, else the given line; a refusal goes to stderr.
fn finish<T>(client: &Client, answer: Answer<T>, describe: impl FnOnce(&T) -> String) -> anyhow::Result<ExitCode> {
    match answer {
        Answer::Ok(value, raw) => {
            if client.json {
                say!("{raw}");
            } else {
                say!("{}", describe(&value));
            }
            Ok(ExitCode::SUCCESS)
        }
        Answer::Refused(refusal) => Ok(refused(client, &refusal)),
    }
}

/// Says what the server refused (on stderr) and how the command ends.
pub(crate) fn refused(client: &Client, refusal: &ApiErrorBody) -> ExitCode {
    if client.json {
        eprintln!("{}", serde_json::to_string(refusal).unwrap_or_default());
    } else {
        eprintln!("error: {}: {}", refusal.error.code, refusal.error.message);
        if let Some(entries) = refusal.error.details.get("entries").and_then(Value::as_array) {
            for entry in entries {
                eprintln!(
                    "  {}: {}",
                    entry["entry"].as_str().unwrap_or_default(),
                    entry["reason"].as_str().unwrap_or_default()
                );
            }
        }
    }
    ExitCode::FAILURE
}

/// `sortie allow ID HOST…`: the session's allowlist with the hosts added (the server checks each).
async fn allow(client: &Client, id: &str, hosts: Vec<String>) -> anyhow::Result<ExitCode> {
    let session = match client
        .call::<Session>(Method::GET, &format!("/v1/sessions/{id}"))
        .await?
    {
        Answer::Ok(session, _) => session,
        Answer::Refused(refusal) => return Ok(refused(client, &refusal)),
    };
    let mut allow = session.egress.allow;
    for host in hosts {
        if !allow.contains(&host) {
            allow.push(host);
        }
    }
    let answer = client
        .send::<Session>(
            Method::POST,
            &format!("/v1/sessions/{id}/egress"),
            &EgressAmendment { allow },
        )
        .await?;
    finish(client, answer, |session| {
        format!("{} may reach: {}", session.id, session.egress.allow.join(", "))
    })
}

async fn create(client: &Client, run: RunArgs) -> anyhow::Result<ExitCode> {
    // A local path is sent absolute and resolved, so `--repo .` works from inside a repository.
    let repo = if run.repo.starts_with("https://") || run.repo.contains("://") || run.repo.starts_with("git@") {
        run.repo
    } else {
        let resolved = std::fs::canonicalize(Path::new(&run.repo))
            .with_context(|| format!("--repo {} does not exist", run.repo))?;
        resolved
            .into_os_string()
            .into_string()
            .map_err(|_| anyhow::anyhow!("--repo is not valid UTF-8"))?
    };
    let setup = match &run.setup {
        Some(path) => {
            Some(std::fs::read_to_string(path).with_context(|| format!("cannot read --setup {}", path.display()))?)
        }
        None => None,
    };
    let request = CreateSessionRequest {
        repo,
        task: run.task,
        agent: run.agent,
        base: run.base,
        model: run.model,
        egress: (!run.allow.is_empty()).then_some(EgressRequest { allow: run.allow }),
        setup,
        title: run.title,
        budget: (run.budget_tokens.is_some() || run.budget_compute_seconds.is_some()).then_some(
            sortie_protocol::api::Budget {
                tokens: run.budget_tokens,
                compute_seconds: run.budget_compute_seconds,
            },
        ),
    };
    let answer = client.send::<Session>(Method::POST, "/v1/sessions", &request).await?;
    if run.follow
        && let Answer::Ok(session, _) = &answer
    {
        return crate::follow::run(client, session, run.full).await;
    }
    finish(client, answer, |session| {
        format!(
            "{}  {}  {}\nbranch {}",
            session.id, session.phase, session.title, session.branch
        )
    })
}

async fn list(client: &Client, ls: LsArgs) -> anyhow::Result<ExitCode> {
    let mut path = format!("/v1/sessions?limit={}&archived={}", ls.limit, ls.archived);
    if let Some(phase) = &ls.phase {
        path.push_str(&format!("&phase={phase}"));
    }
    let answer = client.call::<SessionList>(Method::GET, &path).await?;
    finish(client, answer, |list| {
        if list.sessions.is_empty() {
            return "no sessions".to_owned();
        }
        let mut out = format!(
            "{:<30}  {:<12}  {:>5}  {:<12}  {}",
            "ID", "PHASE", "TURNS", "AGENT", "TITLE"
        );
        for session in &list.sessions {
            out.push_str(&format!(
                "\n{:<30}  {:<12}  {:>5}  {:<12}  {}",
                session.id,
                session.phase.as_str(),
                session.turns,
                session.agent,
                session.title
            ));
        }
        out
    })
}

async fn show(client: &Client, id: &str) -> anyhow::Result<ExitCode> {
    let session = match client
        .call::<Session>(Method::GET, &format!("/v1/sessions/{id}"))
        .await?
    {
        Answer::Ok(session, raw) => (session, raw),
        refused @ Answer::Refused(_) => {
            return finish(client, refused, |_: &Session| String::new());
        }
    };
    let turns = client
        .call::<TurnList>(Method::GET, &format!("/v1/sessions/{id}/turns"))
        .await?;
    let (session, raw_session) = session;
    let (turns, raw_turns) = match turns {
        Answer::Ok(turns, raw) => (turns, raw),
        refused @ Answer::Refused(_) => {
            return finish(client, refused, |_: &TurnList| String::new());
        }
    };
    if client.json {
        let mut combined = raw_session;
        combined["turn_list"] = raw_turns["turns"].clone();
        say!("{combined}");
        return Ok(ExitCode::SUCCESS);
    }
    say!("{}  {}", session.id, session.title);
    say!(
        "  phase    {}{}",
        session.phase,
        session
            .queued_reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    let sandbox = match session.sandbox {
        sortie_protocol::api::SandboxState::Live => "live",
        sortie_protocol::api::SandboxState::Released => "released",
    };
    say!("  sandbox  {sandbox}");
    say!("  repo     {}", session.repo);
    say!("  base     {}", session.base.as_deref().unwrap_or("(default branch)"));
    say!("  branch   {}", session.branch);
    say!(
        "  agent    {}{}",
        session.agent,
        session.model.as_deref().map(|m| format!(" / {m}")).unwrap_or_default()
    );
    if let Some(sha) = &session.head_sha {
        say!("  head     {sha}");
    }
    if let Some(pr) = &session.pr {
        say!("  pr       #{} {}", pr.number, pr.url);
    }
    if let Some(failure) = &session.failure {
        say!(
            "  failure  {}: {}",
            serde_json::to_value(failure.code)
                .unwrap_or_default()
                .as_str()
                .unwrap_or_default(),
            failure.reason
        );
    }
    if !session.egress.allow.is_empty() {
        say!("  egress   {}", session.egress.allow.join(", "));
    }
    say!("  created  {}", session.created_at);
    say!("turns:");
    for turn in &turns.turns {
        let first_line = turn.prompt.lines().next().unwrap_or_default();
        say!(
            "  {:>3}  {:<10}  {}",
            turn.n,
            turn.status.as_str(),
            first_line.chars().take(100).collect::<String>()
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn keys(client: &Client, command: KeysCommand) -> anyhow::Result<ExitCode> {
    match command {
        KeysCommand::Set { api, label, workspace } => {
            if std::io::stdin().is_terminal() {
                eprintln!("paste the {api} key, then Enter and Ctrl-D (or pipe it: `sortie keys set {api} < key.txt`)");
            }
            let key = read_key(std::io::stdin().lock(), api)?;
            if let Some(code) = refuse_another_workspace(client, workspace.workspace.as_deref()).await? {
                return Ok(code);
            }
            let request = SetModelKeyRequest { key, label };
            let answer = client
                .send::<ModelKey>(Method::PUT, &format!("/v1/model-keys/{api}"), &request)
                .await?;
            finish(client, answer, |key| {
                format!("set {} key {}", key.api, shown_fingerprint(key))
            })
        }
        KeysCommand::List { workspace } => {
            let answer = client.call::<ModelKeyList>(Method::GET, "/v1/model-keys").await?;
            if let (Answer::Ok(list, _), Some(expected)) = (&answer, &workspace.workspace) {
                refuse_mismatch(&list.workspace, expected)?;
            }
            finish(client, answer, |list| {
                if list.keys.is_empty() {
                    return format!("no model keys in workspace {}", list.workspace);
                }
                let mut out = format!("{:<10}  {:<10}  {:<24}  {}", "API", "KEY", "SET", "LABEL");
                for key in &list.keys {
                    out.push_str(&format!(
                        "\n{:<10}  {:<10}  {:<24}  {}",
                        key.api.as_str(),
                        shown_fingerprint(key),
                        key.created_at,
                        key.label.as_deref().unwrap_or_default()
                    ));
                }
                out
            })
        }
        KeysCommand::Rm { api, workspace } => {
            if let Some(code) = refuse_another_workspace(client, workspace.workspace.as_deref()).await? {
                return Ok(code);
            }
            let answer = client
                .call::<Value>(Method::DELETE, &format!("/v1/model-keys/{api}"))
                .await?;
            match answer {
                Answer::Ok(..) => {
                    if client.json {
                        say!(
                            "{}",
                            Removed {
                                api: Some(api),
                                host: None,
                                removed: true
                            }
                        );
                    } else {
                        say!("removed {api} key");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                refused @ Answer::Refused(_) => finish(client, refused, |_: &Value| String::new()),
            }
        }
    }
}

async fn forge(client: &Client, command: ForgeCommand) -> anyhow::Result<ExitCode> {
    match command {
        ForgeCommand::Set {
            host,
            kind,
            api_base,
            app_id,
            private_key,
            webhook_secret_file,
            trigger_repos,
            trigger_agent,
            trigger_others_prs,
            dashboard_url,
            trigger_assignee,
        } => {
            let request = match (app_id, private_key) {
                (Some(app_id), Some(path)) => {
                    let private_key = std::fs::read_to_string(&path)
                        .with_context(|| format!("cannot read the App's private key {}", path.display()))?;
                    let webhook_secret = webhook_secret_file
                        .map(|path| {
                            std::fs::read_to_string(&path)
                                .map(|secret| secret.trim().to_owned())
                                .with_context(|| format!("cannot read the webhook secret {}", path.display()))
                        })
                        .transpose()?;
                    let triggers = (!trigger_repos.is_empty()).then(|| sortie_protocol::api::ForgeTriggers {
                        repositories: trigger_repos,
                        agent: trigger_agent,
                        others_pull_requests: trigger_others_prs,
                        dashboard_url,
                        assignee: trigger_assignee,
                        ..Default::default()
                    });
                    SetForgeConnectionRequest {
                        token: String::new(),
                        github_app: Some(GitHubAppCredentials {
                            app_id,
                            private_key,
                            webhook_secret,
                        }),
                        kind,
                        api_base,
                        triggers,
                    }
                }
                _ => {
                    if std::io::stdin().is_terminal() {
                        eprintln!(
                            "paste the token for {host}, then Enter and Ctrl-D (or pipe it: `sortie forge set {host} < token.txt`)"
                        );
                    }
                    let token = read_secret(
                        std::io::stdin().lock(),
                        "token",
                        &format!("sortie forge set {host} < token.txt"),
                    )?;
                    SetForgeConnectionRequest {
                        token,
                        github_app: None,
                        kind,
                        api_base,
                        triggers: None,
                    }
                }
            };
            let answer = client
                .send::<ForgeConnection>(Method::PUT, &format!("/v1/forge-connections/{host}"), &request)
                .await?;
            finish(client, answer, |connection| match &connection.app_id {
                Some(app_id) => format!(
                    "set GitHub App {app_id} for {} {}{}{}",
                    connection.host,
                    shown(connection.fingerprint.as_deref()),
                    if connection.webhook { ", webhook secret set" } else { "" },
                    connection
                        .triggers
                        .as_ref()
                        .map(|t| format!(", @sortie in {}", t.repositories.join(" ")))
                        .unwrap_or_default()
                ),
                None => format!(
                    "set the {} token for {} {}",
                    connection.kind.as_str(),
                    connection.host,
                    shown(connection.fingerprint.as_deref())
                ),
            })
        }
        ForgeCommand::List => {
            let answer = client
                .call::<ForgeConnectionList>(Method::GET, "/v1/forge-connections")
                .await?;
            finish(client, answer, |list| {
                if list.connections.is_empty() {
                    return format!("no forge connections in workspace {}", list.workspace);
                }
                let mut out = format!(
                    "{:<32}  {:<7}  {:<10}  {:<24}  {}",
                    "HOST", "KIND", "TOKEN", "SET", "API"
                );
                for connection in &list.connections {
                    out.push_str(&format!(
                        "\n{:<32}  {:<7}  {:<10}  {:<24}  {}",
                        connection.host,
                        connection.kind.as_str(),
                        shown(connection.fingerprint.as_deref()),
                        connection.created_at,
                        connection.api_base
                    ));
                }
                out
            })
        }
        ForgeCommand::Rm { host } => {
            let answer = client
                .call::<Value>(Method::DELETE, &format!("/v1/forge-connections/{host}"))
                .await?;
            match answer {
                Answer::Ok(..) => {
                    if client.json {
                        say!(
                            "{}",
                            Removed {
                                api: None,
                                host: Some(&host),
                                removed: true
                            }
                        );
                    } else {
                        say!("removed the connection to {host}");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                refused @ Answer::Refused(_) => finish(client, refused, |_: &Value| String::new()),
            }
        }
    }
}

/// What `keys rm` and `forge rm` print with `--json`: what was removed.
#[derive(serde::Serialize)]
struct Removed<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    api: Option<ModelApi>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host: Option<&'a str>,
    removed: bool,
}

impl std::fmt::Display for Removed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

/// `…abcd`, or why there is nothing to show.
fn shown_fingerprint(key: &ModelKey) -> String {
    shown(key.fingerprint.as_deref())
}

fn shown(fingerprint: Option<&str>) -> String {
    match fingerprint {
        Some("") => "(short)".to_owned(),
        Some(fingerprint) => format!("…{fingerprint}"),
        None => "(does not open: set it again)".to_owned(),
    }
}

/// With `--workspace W`: the token decides the workspace, so refuse unless it is W. `Some` is the
/// exit code after the server refused to say.
async fn refuse_another_workspace(client: &Client, expected: Option<&str>) -> anyhow::Result<Option<ExitCode>> {
    let Some(expected) = expected else {
        return Ok(None);
    };
    match client.call::<ModelKeyList>(Method::GET, "/v1/model-keys").await? {
        Answer::Ok(list, _) => {
            refuse_mismatch(&list.workspace, expected)?;
            Ok(None)
        }
        refused @ Answer::Refused(_) => finish(client, refused, |_: &ModelKeyList| String::new()).map(Some),
    }
}

fn refuse_mismatch(actual: &str, expected: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        actual == expected,
        "the token is an admin token of workspace {actual:?}, not {expected:?}: the token decides the \
         workspace, so set {TOKEN_ENV} to an admin token of {expected:?} (`sortie token create --workspace {expected} --role admin`)"
    );
    Ok(())
}

/// `sortie login`: the token on stdin is checked against the server, then saved (0600) with it.
async fn login(target: &Target) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = login_file().context("no HOME: cannot tell where to save the login")?;
    let server = target
        .server
        .clone()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| crate::DEFAULT_SERVER.to_owned());
    if std::io::stdin().is_terminal() {
        eprintln!("paste the token, then Enter and Ctrl-D:");
    }
    let token = read_secret(
        std::io::stdin().lock(),
        "token",
        "sortie token create --workspace default --role operator | sortie login",
    )?;
    let token = token.trim().to_owned();
    let client = Client::with(server.clone(), token.clone(), target.json);
    if let Answer::Refused(refusal) = client.call::<Value>(Method::GET, "/v1/agents").await? {
        anyhow::bail!(
            "{} refused the token: {}: {}",
            client.server,
            refusal.error.code,
            refusal.error.message
        );
    }
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let body = serde_json::to_vec_pretty(&Login {
        server: client.server.clone(),
        token,
    })?;
    let partial = path.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .with_context(|| format!("cannot write {}", partial.display()))?;
    file.write_all(&body)?;
    file.sync_all()?;
    std::fs::rename(&partial, &path).with_context(|| format!("cannot write {}", path.display()))?;
    say!("logged in to {} (saved in {})", client.server, path.display());
    Ok(ExitCode::SUCCESS)
}

/// The key from stdin: one trailing newline dropped, never empty, at most the server's limit.
fn read_key(input: impl Read, api: ModelApi) -> anyhow::Result<String> {
    read_secret(input, "key", &format!("sortie keys set {api} < key.txt"))
}

/// A secret from stdin: one trailing newline dropped, never empty, at most the limit of a model key.
async fn webhook(client: &Client, command: WebhookCommand) -> anyhow::Result<ExitCode> {
    match command {
        WebhookCommand::Add { url, events } => {
            let secret = read_secret(
                std::io::stdin().lock(),
                "webhook secret",
                "openssl rand -hex 32 | tee secret.txt | sortie webhook add URL",
            )?;
            let request = CreateWebhookRequest {
                url,
                secret,
                events: (!events.is_empty()).then_some(events),
            };
            let answer = client.send::<Webhook>(Method::POST, "/v1/webhooks", &request).await?;
            finish(client, answer, |hook| {
                format!("{}  {}  {}", hook.id, kinds(&hook.events), hook.url)
            })
        }
        WebhookCommand::List => {
            let answer = client.call::<WebhookList>(Method::GET, "/v1/webhooks").await?;
            finish(client, answer, |list| {
                if list.webhooks.is_empty() {
                    return "no webhooks".to_owned();
                }
                list.webhooks
                    .iter()
                    .map(|hook| format!("{}  {}  {}", hook.id, kinds(&hook.events), hook.url))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
        }
        WebhookCommand::Rm { id } => {
            let answer = client
                .call::<Value>(Method::DELETE, &format!("/v1/webhooks/{id}"))
                .await?;
            finish(client, answer, |_| format!("removed {id}"))
        }
        WebhookCommand::Deliveries { id } => {
            let answer = client
                .call::<WebhookDeliveryList>(Method::GET, &format!("/v1/webhooks/{id}/deliveries"))
                .await?;
            finish(client, answer, |list| {
                if list.deliveries.is_empty() {
                    return "no deliveries yet".to_owned();
                }
                list.deliveries
                    .iter()
                    .map(|d| {
                        let state = serde_json::to_value(d.state).ok();
                        let state = state.as_ref().and_then(Value::as_str).unwrap_or("?");
                        let last = match (&d.last_status, &d.last_error) {
                            (Some(status), _) => format!("HTTP {status}"),
                            (None, Some(error)) => error.clone(),
                            (None, None) => String::new(),
                        };
                        format!(
                            "{}  event {}  {}  {state}  {} attempts  {last}",
                            d.id, d.event, d.kind, d.attempts
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            })
        }
    }
}

fn kinds(events: &[sortie_protocol::api::EventKind]) -> String {
    events.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(",")
}

fn read_secret(input: impl Read, what: &str, example: &str) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    input
        .take(MODEL_KEY_MAX_BYTES as u64 + 3)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read the {what} from stdin"))?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    anyhow::ensure!(!bytes.is_empty(), "no {what} on stdin: pipe it in, e.g. `{example}`");
    anyhow::ensure!(
        bytes.len() <= MODEL_KEY_MAX_BYTES,
        "the {what} on stdin is longer than {MODEL_KEY_MAX_BYTES} bytes"
    );
    String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("the {what} on stdin is not text (it is printable ASCII)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_from_stdin_loses_one_trailing_newline_and_is_never_empty() {
        let read = |input: &[u8]| read_key(input, ModelApi::Anthropic);
        assert_eq!(read(b"sk-ant-1\n").expect("key"), "sk-ant-1");
        assert_eq!(read(b"sk-ant-1\r\n").expect("key"), "sk-ant-1");
        assert_eq!(read(b"sk-ant-1").expect("key"), "sk-ant-1");
        assert_eq!(
            read(b"sk-ant-1\n\n").expect("key"),
            "sk-ant-1\n",
            "only one newline goes"
        );
        for empty in [&b""[..], b"\n", b"\r\n"] {
            assert!(read(empty).is_err(), "{empty:?}");
        }
        assert!(read(&[b'k'; MODEL_KEY_MAX_BYTES + 1]).is_err());
        assert!(read(&[b'k'; MODEL_KEY_MAX_BYTES]).is_ok());
        assert!(read(&[0xff, 0xfe]).is_err());
    }
}
