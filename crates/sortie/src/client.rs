//! The client commands: `run`, `ls`, `show`, `steer`, `stop`, `cancel` over the REST API. Errors
//! print the server's code and sentence and exit non-zero.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sortie_protocol::ApiErrorBody;
use sortie_protocol::api::{Session, SessionList, Turn, TurnList};

use crate::cli::{ClientArgs, Command, LsArgs, RunArgs};
use crate::config::{self, ADMIN_TOKEN_FILE, env};

struct Client {
    http: reqwest::Client,
    server: String,
    token: String,
    json: bool,
}

/// What a call answered: the body of a success, or the server's refusal.
enum Answer<T> {
    Ok(T, Value),
    Refused(ApiErrorBody),
}

impl Client {
    fn new(args: &ClientArgs) -> anyhow::Result<Self> {
        let token = match std::env::var(env::TOKEN) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_owned(),
            _ => {
                let path = config::data_dir(args.data_dir.clone()).join(ADMIN_TOKEN_FILE);
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!(
                            "no token: set {} or start `sortie serve` once so that {} exists",
                            env::TOKEN,
                            path.display()
                        )
                    })?
                    .trim()
                    .to_owned()
            }
        };
        Ok(Self {
            http: reqwest::Client::new(),
            server: args.server.trim_end_matches('/').to_owned(),
            token,
            json: args.json,
        })
    }

    async fn call<T: DeserializeOwned>(
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
            let value: Value = serde_json::from_str(&text)
                .with_context(|| format!("the server answered {status} with a body that is not JSON"))?;
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
    let client = Client::new(&args)?;
    match command {
        Command::Run(run) => create(&client, run).await,
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
        Command::Serve(_)
        | Command::Driver(_)
        | Command::Sandbox(_)
        | Command::Relay(_)
        | Command::Workspace(_)
        | Command::Token(_) => unreachable_command(),
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
                println!("{raw}");
            } else {
                println!("{}", describe(&value));
            }
            Ok(ExitCode::SUCCESS)
        }
        Answer::Refused(refusal) => {
            if client.json {
                eprintln!("{}", serde_json::to_string(&refusal).unwrap_or_default());
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
            Ok(ExitCode::FAILURE)
        }
    }
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
        println!("{combined}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}  {}", session.id, session.title);
    println!(
        "  phase    {}{}",
        session.phase,
        session
            .queued_reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    println!("  repo     {}", session.repo);
    println!("  base     {}", session.base.as_deref().unwrap_or("(default branch)"));
    println!("  branch   {}", session.branch);
    println!(
        "  agent    {}{}",
        session.agent,
        session.model.as_deref().map(|m| format!(" / {m}")).unwrap_or_default()
    );
    if let Some(sha) = &session.head_sha {
        println!("  head     {sha}");
    }
    if let Some(pr) = &session.pr {
        println!("  pr       #{} {}", pr.number, pr.url);
    }
    if let Some(failure) = &session.failure {
        println!(
            "  failure  {}: {}",
            serde_json::to_value(failure.code)
                .unwrap_or_default()
                .as_str()
                .unwrap_or_default(),
            failure.reason
        );
    }
    if !session.egress.allow.is_empty() {
        println!("  egress   {}", session.egress.allow.join(", "));
    }
    println!("  created  {}", session.created_at);
    println!("turns:");
    for turn in &turns.turns {
        let first_line = turn.prompt.lines().next().unwrap_or_default();
        println!(
            "  {:>3}  {:<10}  {}",
            turn.n,
            turn.status.as_str(),
            first_line.chars().take(100).collect::<String>()
        );
    }
    Ok(ExitCode::SUCCESS)
}
