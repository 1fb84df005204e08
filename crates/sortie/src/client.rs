//! The client commands: `run`, `ls`, `show`, `steer`, `stop`, `cancel` and `keys` over the REST API.
//! Errors print the server's code and sentence and exit non-zero.

use std::io::{IsTerminal, Read};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sortie_protocol::ApiErrorBody;
use sortie_protocol::api::{
    ForgeConnection, ForgeConnectionList, MODEL_KEY_MAX_BYTES, ModelApi, ModelKey, ModelKeyList, Session, SessionList,
    Turn, TurnList, Webhook, WebhookDeliveryList, WebhookList,
};

use crate::cli::{ClientArgs, Command, ForgeCommand, KeysCommand, LsArgs, RunArgs, WebhookCommand};
use crate::config::{self, ADMIN_TOKEN_FILE, env};

pub(crate) struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) server: String,
    pub(crate) token: String,
    pub(crate) json: bool,
}

/// What a call answered: the body of a success, or the server's refusal.
pub(crate) enum Answer<T> {
    Ok(T, Value),
    Refused(ApiErrorBody),
}

/// What `sortie login` saved for this user.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Login {
    server: String,
    token: String,
}

fn saved_login() -> Option<Login> {
    let text = std::fs::read_to_string(config::login_file()?).ok()?;
    serde_json::from_str(&text).ok()
}

impl Client {
    /// The server: `--server` (or `SORTIE_SERVER`), else the saved login's, else the default. The token:
    /// `SORTIE_TOKEN`, else the saved login's, else the data dir's admin token (the user who runs
    /// `sortie serve` has it).
    fn new(args: &ClientArgs) -> anyhow::Result<Self> {
        let login = saved_login();
        let server = args
            .server
            .clone()
            .filter(|s| !s.trim().is_empty())
            .or_else(|| login.as_ref().map(|l| l.server.clone()))
            .unwrap_or_else(|| config::DEFAULT_SERVER.to_owned());
        let token = match std::env::var(env::TOKEN) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_owned(),
            _ => match login {
                Some(login) if !login.token.is_empty() => login.token,
                _ => {
                    let path = config::data_dir(args.data_dir.clone()).join(ADMIN_TOKEN_FILE);
                    std::fs::read_to_string(&path)
                        .with_context(|| {
                            format!(
                                "no token: set {}, or save one with `sortie login` (an admin makes it with \
                                 `sortie token create --workspace default --role operator`); the user who runs \
                                 `sortie serve` uses {} ",
                                env::TOKEN,
                                path.display()
                            )
                        })?
                        .trim()
                        .to_owned()
                }
            },
        };
        Ok(Self::with(server, token, args.json))
    }

    fn with(server: String, token: String, json: bool) -> Self {
        Self {
            http: reqwest::Client::new(),
            server: server.trim_end_matches('/').to_owned(),
            token,
            json,
        }
    }

    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Answer<T>> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.server))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach the sortie server at {}", self.server))?;
        let status = response.status();
        let text = response.text().await.context("the server's answer broke off")?;
        if status.is_success() {
            let value: Value = if status == StatusCode::NO_CONTENT {
                Value::Null
            } else {
                serde_json::from_str(&text)
                    .with_context(|| format!("the server answered {status} with a body that is not JSON"))?
            };
            let typed = serde_json::from_value(value.clone())
                .context("the server's answer has an unexpected shape (is it the same version?)")?;
            return Ok(Answer::Ok(typed, value));
        }
        match serde_json::from_str::<ApiErrorBody>(&text) {
            Ok(refusal) => Ok(Answer::Refused(refusal)),
            Err(_) if status == StatusCode::NOT_FOUND => {
                anyhow::bail!("{} does not look like a sortie server (404 on {path})", self.server)
            }
            Err(_) => anyhow::bail!(
                "the server answered {status}: {}",
                text.chars().take(300).collect::<String>()
            ),
        }
    }
}

pub async fn run(args: ClientArgs, command: Command) -> anyhow::Result<ExitCode> {
    if matches!(command, Command::Login) {
        return login(&args).await;
    }
    let client = Client::new(&args)?;
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
            let answer = client.call::<Value>(Method::POST, "/v1/auth/links", None).await?;
            let server = client.server.trim_end_matches('/').to_owned();
            finish(&client, answer, |link| {
                let minutes = link["expires_in_seconds"].as_u64().unwrap_or(0) / 60;
                format!(
                    "{server}/signin#{}\n(works once, for {minutes} minutes)",
                    link["code"].as_str().unwrap_or_default()
                )
            })
        }
        Command::Resume { id } => {
            let answer = client
                .call::<Session>(Method::POST, &format!("/v1/sessions/{id}/resume"), None)
                .await?;
            finish(&client, answer, |session| format!("{} {}", session.id, session.phase))
        }
        Command::Archive { id, undo } => {
            let method = if undo { Method::DELETE } else { Method::POST };
            let answer = client
                .call::<Session>(method, &format!("/v1/sessions/{id}/archive"), None)
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
            let mode = if interrupt { "interrupt" } else { "queue" };
            let answer = client
                .call::<Turn>(
                    Method::POST,
                    &format!("/v1/sessions/{id}/steer"),
                    Some(json!({"prompt": prompt, "mode": mode})),
                )
                .await?;
            finish(&client, answer, |turn| {
                format!("turn {} {} on {id}", turn.n, turn.status)
            })
        }
        Command::Stop { id } => {
            let answer = client
                .call::<Turn>(Method::POST, &format!("/v1/sessions/{id}/stop"), None)
                .await?;
            finish(&client, answer, |turn| format!("stopping turn {} of {id}", turn.n))
        }
        Command::Cancel { id } => {
            let answer = client
                .call::<Session>(Method::POST, &format!("/v1/sessions/{id}/cancel"), None)
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
        Command::Serve(_)
        | Command::Driver(_)
        | Command::Sandbox(_)
        | Command::Relay(_)
        | Command::ScriptedAgent
        | Command::Login
        | Command::Doctor(_)
        | Command::Workspace(_)
        | Command::Token(_)
        | Command::Agents(_) => unreachable_command(),
    }
}

fn unreachable_command() -> anyhow::Result<ExitCode> {
    anyhow::bail!("this command does not talk to a server")
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
        .call::<Session>(Method::GET, &format!("/v1/sessions/{id}"), None)
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
        .call::<Session>(
            Method::POST,
            &format!("/v1/sessions/{id}/egress"),
            Some(json!({"allow": allow})),
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
    let mut body = json!({"repo": repo, "task": run.task});
    let fields = [
        ("agent", run.agent),
        ("base", run.base),
        ("model", run.model),
        ("title", run.title),
        ("setup", setup),
    ];
    for (key, value) in fields {
        if let Some(value) = value {
            body[key] = json!(value);
        }
    }
    if !run.allow.is_empty() {
        body["egress"] = json!({"allow": run.allow});
    }
    let answer = client.call::<Session>(Method::POST, "/v1/sessions", Some(body)).await?;
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
    let answer = client.call::<SessionList>(Method::GET, &path, None).await?;
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
        .call::<Session>(Method::GET, &format!("/v1/sessions/{id}"), None)
        .await?
    {
        Answer::Ok(session, raw) => (session, raw),
        refused @ Answer::Refused(_) => {
            return finish(client, refused, |_: &Session| String::new());
        }
    };
    let turns = client
        .call::<TurnList>(Method::GET, &format!("/v1/sessions/{id}/turns"), None)
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
            let mut body = json!({"key": key});
            if let Some(label) = label {
                body["label"] = json!(label);
            }
            let answer = client
                .call::<ModelKey>(Method::PUT, &format!("/v1/model-keys/{api}"), Some(body))
                .await?;
            finish(client, answer, |key| {
                format!("set {} key {}", key.api, shown_fingerprint(key))
            })
        }
        KeysCommand::List { workspace } => {
            let answer = client.call::<ModelKeyList>(Method::GET, "/v1/model-keys", None).await?;
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
                .call::<Value>(Method::DELETE, &format!("/v1/model-keys/{api}"), None)
                .await?;
            match answer {
                Answer::Ok(..) => {
                    if client.json {
                        say!("{}", json!({"api": api, "removed": true}));
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
        ForgeCommand::Set { host, kind, api_base } => {
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
            let mut body = json!({"token": token});
            if let Some(kind) = kind {
                body["kind"] = json!(kind);
            }
            if let Some(api_base) = api_base {
                body["api_base"] = json!(api_base);
            }
            let answer = client
                .call::<ForgeConnection>(Method::PUT, &format!("/v1/forge-connections/{host}"), Some(body))
                .await?;
            finish(client, answer, |connection| {
                format!(
                    "set the {} token for {} {}",
                    connection.kind.as_str(),
                    connection.host,
                    shown(connection.fingerprint.as_deref())
                )
            })
        }
        ForgeCommand::List => {
            let answer = client
                .call::<ForgeConnectionList>(Method::GET, "/v1/forge-connections", None)
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
                .call::<Value>(Method::DELETE, &format!("/v1/forge-connections/{host}"), None)
                .await?;
            match answer {
                Answer::Ok(..) => {
                    if client.json {
                        say!("{}", json!({"host": host, "removed": true}));
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
    match client.call::<ModelKeyList>(Method::GET, "/v1/model-keys", None).await? {
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
         workspace, so set {} to an admin token of {expected:?} (`sortie token create --workspace {expected} --role admin`)",
        env::TOKEN
    );
    Ok(())
}

/// `sortie login`: the token on stdin is checked against the server, then saved (0600) with it.
async fn login(args: &ClientArgs) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = config::login_file().context("no HOME: cannot tell where to save the login")?;
    let server = args
        .server
        .clone()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| config::DEFAULT_SERVER.to_owned());
    if std::io::stdin().is_terminal() {
        eprintln!("paste the token, then Enter and Ctrl-D:");
    }
    let token = read_secret(
        std::io::stdin().lock(),
        "token",
        "sortie token create --workspace default --role operator | sortie login",
    )?;
    let token = token.trim().to_owned();
    let client = Client::with(server.clone(), token.clone(), args.json);
    if let Answer::Refused(refusal) = client.call::<Value>(Method::GET, "/v1/agents", None).await? {
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
            let mut body = json!({"url": url, "secret": secret});
            if !events.is_empty() {
                body["events"] = json!(events);
            }
            let answer = client.call::<Webhook>(Method::POST, "/v1/webhooks", Some(body)).await?;
            finish(client, answer, |hook| {
                format!("{}  {}  {}", hook.id, kinds(&hook.events), hook.url)
            })
        }
        WebhookCommand::List => {
            let answer = client.call::<WebhookList>(Method::GET, "/v1/webhooks", None).await?;
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
                .call::<Value>(Method::DELETE, &format!("/v1/webhooks/{id}"), None)
                .await?;
            finish(client, answer, |_| format!("removed {id}"))
        }
        WebhookCommand::Deliveries { id } => {
            let answer = client
                .call::<WebhookDeliveryList>(Method::GET, &format!("/v1/webhooks/{id}/deliveries"), None)
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
