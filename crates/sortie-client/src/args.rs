//! The client commands' arguments (clap derive); the binary flattens [`ClientCommand`] into its own.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use sortie_protocol::api::{EventKind, ForgeKind, ModelApi};

/// The commands that talk to a running server.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Save a token (read from stdin) and the server for this user's client commands, after checking
    /// that the server takes it. An admin makes one with `sortie token create`.
    Login,
    /// Start a session: an agent works on TASK in a sandbox and delivers a branch.
    Run(RunArgs),
    /// List sessions, newest first.
    Ls(LsArgs),
    /// Show a session and its turns.
    Show { id: String },
    /// Print a session's conversation: every ended turn, or `-f` to follow the running ones live.
    /// Exits with the last turn's outcome: 0 completed, 1 failed, 3 stopped or canceled.
    Logs(LogsArgs),
    /// Add a turn to a session.
    Steer {
        id: String,
        prompt: String,
        /// Stop the running turn first instead of queueing behind it.
        #[arg(long)]
        interrupt: bool,
    },
    /// Stop the running turn; its work so far is delivered.
    Stop { id: String },
    /// Raise a session's budget; a turn paused at its token cap goes on.
    Budget {
        id: String,
        /// Model tokens to add to its token cap.
        #[arg(long = "add", value_name = "TOKENS")]
        tokens: Option<u64>,
        /// CPU seconds to add to its compute cap.
        #[arg(long)]
        compute_seconds: Option<u64>,
    },
    /// End the session for good.
    Cancel { id: String },
    /// Wake a hibernated session: its sandbox comes back with its workspace and agent state.
    Resume { id: String },
    /// Hide a resting session from `sortie ls` (`--undo` shows it again).
    Archive {
        id: String,
        #[arg(long)]
        undo: bool,
    },
    /// Print a fresh one-time link that signs a browser in to the dashboard as this token.
    SigninLink,
    /// Let the session's agent reach HOST (added to its egress allowlist; the next connection goes through).
    Allow {
        id: String,
        #[arg(required = true)]
        hosts: Vec<String>,
    },
    /// The workspace's model keys (vendor API keys for the model proxy), as its admin token allows.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// The workspace's forge connections (tokens for `https://` repositories), as its admin token allows.
    #[command(subcommand)]
    Forge(ForgeCommand),
    /// Serve MCP on stdin/stdout: tools to create, follow and steer sessions on the server, with this
    /// CLI's credentials (for an MCP client that starts servers as commands).
    Mcp,
    /// The workspace's webhooks (signed POSTs of session and turn changes), as its admin token allows.
    #[command(subcommand)]
    Webhook(WebhookCommand),
}

/// Webhooks, through the server with an admin token: the token's workspace is the one changed.
#[derive(Debug, Subcommand)]
pub enum WebhookCommand {
    /// Add a webhook posting to URL; its signing secret is read from stdin (never an argument).
    Add {
        url: String,
        /// Only these event kinds (`session.phase`, `turn.status`), comma-separated; default all.
        #[arg(long, value_delimiter = ',', value_parser = parse_event_kind)]
        events: Vec<EventKind>,
    },
    /// List the workspace's webhooks: id, events, URL.
    #[command(alias = "ls")]
    List,
    /// Remove a webhook and its delivery log.
    #[command(alias = "remove")]
    Rm { id: String },
    /// A webhook's recent deliveries: state, attempts, the receiver's last answer.
    Deliveries { id: String },
}

/// Model keys, through the server with an admin token: the token's workspace is the one changed.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Set the key for API (anthropic, openai, gemini), read from stdin (never an argument).
    Set {
        #[arg(value_parser = parse_model_api)]
        api: ModelApi,
        /// A note saying whose key it is.
        #[arg(long)]
        label: Option<String>,
        #[command(flatten)]
        workspace: KeysWorkspaceArgs,
    },
    /// List the workspace's keys: API, fingerprint, label; never a key.
    #[command(alias = "ls")]
    List {
        #[command(flatten)]
        workspace: KeysWorkspaceArgs,
    },
    /// Remove the key for API.
    #[command(alias = "remove")]
    Rm {
        #[arg(value_parser = parse_model_api)]
        api: ModelApi,
        #[command(flatten)]
        workspace: KeysWorkspaceArgs,
    },
}

/// Forge connections, through the server with an admin token: the token's workspace is the one changed.
#[derive(Debug, Subcommand)]
pub enum ForgeCommand {
    /// Set the token for HOST (`github.com`, `git.example.com:8443`), read from stdin (never an argument),
    /// or connect it as a GitHub App (`--app-id ID --private-key FILE`): installation tokens are then
    /// minted per repository.
    Set {
        host: String,
        /// `github` (default) or `git` (any other smart-HTTP host: branches only).
        #[arg(long, value_parser = parse_forge_kind)]
        kind: Option<ForgeKind>,
        /// The forge's REST API base, when it is not GitHub's default for HOST.
        #[arg(long)]
        api_base: Option<String>,
        /// A GitHub App's ID (or client ID), instead of a token.
        #[arg(long, requires = "private_key")]
        app_id: Option<String>,
        /// The App's private key (the PEM GitHub downloads, or PKCS#8).
        #[arg(long, requires = "app_id")]
        private_key: Option<std::path::PathBuf>,
        /// A file holding the App's webhook secret: its deliveries to `/v1/forges/github/webhook` are
        /// then taken.
        #[arg(long, requires = "app_id")]
        webhook_secret_file: Option<std::path::PathBuf>,
        /// A repository (`owner/name`, or `owner/*`) whose `@sortie` comments start and steer sessions
        /// in this workspace; repeat for more.
        #[arg(long = "trigger-repo", requires = "app_id")]
        trigger_repos: Vec<String>,
        /// The agent of the sessions comments start (default: the server's).
        #[arg(long, requires = "trigger_repos")]
        trigger_agent: Option<String>,
        /// A comment on a pull request sortie did not open starts a session on its branch.
        #[arg(long, requires = "trigger_repos")]
        trigger_others_prs: bool,
        /// The dashboard's address, for the links sortie comments with.
        #[arg(long, requires = "trigger_repos")]
        dashboard_url: Option<String>,
        /// A login (the App's bot user, `<app-slug>[bot]`) whose assignment to an issue starts a session.
        #[arg(long, requires = "trigger_repos")]
        trigger_assignee: Option<String>,
    },
    /// List the workspace's forge connections: host, kind, fingerprint; never a token.
    #[command(alias = "ls")]
    List,
    /// Remove the connection to HOST.
    #[command(alias = "remove")]
    Rm { host: String },
}

fn parse_forge_kind(text: &str) -> Result<ForgeKind, String> {
    text.parse().map_err(|_| "one of github, git".to_owned())
}

#[derive(Debug, Args)]
pub struct KeysWorkspaceArgs {
    /// Refuse unless the token is an admin token of this workspace (the token decides the workspace;
    /// for another one, set SORTIE_TOKEN to an admin token of it).
    #[arg(long)]
    pub workspace: Option<String>,
}

fn parse_model_api(text: &str) -> Result<ModelApi, String> {
    text.parse().map_err(|_| "one of anthropic, openai, gemini".to_owned())
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// An https:// git URL or a local repository path.
    #[arg(long)]
    pub repo: String,
    /// The agent profile (default: the server's).
    #[arg(long)]
    pub agent: Option<String>,
    /// The branch to start from (default: the repository's default branch).
    #[arg(long)]
    pub base: Option<String>,
    /// The model the agent should use.
    #[arg(long)]
    pub model: Option<String>,
    /// A host the agent may reach (repeatable).
    #[arg(long = "allow")]
    pub allow: Vec<String>,
    /// A title (default: the task's first line).
    #[arg(long)]
    pub title: Option<String>,
    /// A file with a setup script to run before the agent starts.
    #[arg(long)]
    pub setup: Option<PathBuf>,
    /// Model tokens the session may use (default: the workspace's); at the cap it pauses for more.
    #[arg(long)]
    pub budget_tokens: Option<u64>,
    /// CPU seconds its sandboxes may use (default: the workspace's); at the cap the turn stops.
    #[arg(long)]
    pub budget_compute_seconds: Option<u64>,
    /// Stay and show the turn as it happens; exit with its outcome (0 completed, 1 failed, 3 stopped
    /// or canceled). Ctrl-C detaches: the session goes on.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// With --follow: every line of command output and diffs, not only the last ones.
    #[arg(long, requires = "follow")]
    pub full: bool,
    /// What the agent should do.
    pub task: String,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only sessions in this phase.
    #[arg(long)]
    pub phase: Option<String>,
    /// Archived sessions instead of the others.
    #[arg(long)]
    pub archived: bool,
    /// How many (1 to 200).
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    pub id: String,
    /// Follow the running turn, and the turns after it, as they happen, until the session rests.
    /// Ctrl-C detaches: the session goes on.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Only turn N.
    #[arg(long)]
    pub turn: Option<u32>,
    /// Every line of command output and diffs, not only the last ones.
    #[arg(long)]
    pub full: bool,
}

fn parse_event_kind(text: &str) -> Result<EventKind, String> {
    EventKind::ALL
        .into_iter()
        .find(|kind| kind.as_str() == text)
        .ok_or_else(|| format!("one of {}", EventKind::ALL.map(EventKind::as_str).join(", ")))
}
