//! The command line (clap derive). Every flag that has an environment variable names it from
//! [`crate::config::env`].

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use sortie_protocol::api::Role;

use crate::config::env;

#[derive(Debug, Parser)]
#[command(
    name = "sortie",
    version,
    about = "Coding agents in sandboxes on your own machines, delivered as branches."
)]
pub struct Cli {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Options of the client commands (they talk to a running server).
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The sortie server.
    #[arg(long, global = true, env = env::SERVER, default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Data directory: the embedded database and the admin token the client commands use when
    /// SORTIE_TOKEN is unset. Default `$XDG_DATA_HOME/sortie` or `~/.local/share/sortie`.
    #[arg(long, global = true, env = env::DATA_DIR)]
    pub data_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server: api role with an embedded SQLite store by default.
    Serve(ServeArgs),
    /// Run the in-sandbox driver: an agent behind a local HTTP API on a Unix socket.
    Driver(DriverArgs),
    /// Local sandboxes (bubblewrap).
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Inside a sandbox: relay 127.0.0.1:3128 to the egress socket while running a command.
    #[command(hide = true)]
    Relay(RelayArgs),
    /// Manage workspaces (works on the store directly).
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// Manage tokens (works on the store directly).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Start a session: an agent works on TASK in a sandbox and delivers a branch.
    Run(RunArgs),
    /// List sessions, newest first.
    Ls(LsArgs),
    /// Show a session and its turns.
    Show { id: String },
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
    /// End the session for good.
    Cancel { id: String },
}

#[derive(Debug, Args)]
pub struct StoreArgs {
    /// `sqlite://…` or `postgres://…`; default: SQLite in the data dir.
    #[arg(long, env = env::DATABASE_URL)]
    pub database_url: Option<String>,
}

#[derive(Debug, Args)]
pub struct DriverArgs {
    /// The Unix socket to serve the driver API on (a stale file there is replaced).
    #[arg(long)]
    pub socket: PathBuf,
    /// The agent's working directory: the session's checkout.
    #[arg(long)]
    pub workspace: PathBuf,
    /// The agent's HOME (its state, kept across sandboxes).
    #[arg(long)]
    pub home: PathBuf,
    /// The agent profile to run.
    #[arg(long)]
    pub agent: String,
    /// An agent manifest (TOML) that adds or overrides profiles.
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// The sortie session id; assistant messages are `<session>-t<n>`.
    #[arg(long, default_value = "ses_local")]
    pub session: String,
    /// Where turn logs go; default `<home>/.sortie/turns`.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// A turn running longer than this many seconds fails with TURN_TIMEOUT.
    #[arg(long, default_value_t = 1800)]
    pub turn_timeout: u64,
    /// Seconds the agent has to finish the ACP handshake.
    #[arg(long, default_value_t = 60)]
    pub start_timeout: u64,
    /// Seconds between a cancel (or SIGTERM) and the next, harder step.
    #[arg(long, default_value_t = 5)]
    pub kill_grace: u64,
    /// Relay 127.0.0.1:3128 to this egress socket and point the agent's proxy variables at it.
    #[arg(long)]
    pub egress_socket: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Run a command in a fresh local sandbox laid out like a session's; exits with its code.
    Exec(SandboxExecArgs),
}

#[derive(Debug, Args)]
pub struct SandboxExecArgs {
    /// The directory that becomes /workspace (lent to the sandbox uid for the run); default: an empty one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// A host Unix socket the sandbox reaches through 127.0.0.1:3128 (the egress relay).
    #[arg(long)]
    pub egress_socket: Option<PathBuf>,
    /// Memory limit in bytes (default 2 GiB).
    #[arg(long)]
    pub memory: Option<u64>,
    /// Process limit (default 512).
    #[arg(long)]
    pub pids: Option<u64>,
    /// CPU limit in cores (default none).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Size of /tmp in bytes (default 512 MiB).
    #[arg(long)]
    pub tmp_size: Option<u64>,
    /// An environment variable inside, NAME=VALUE (repeatable).
    #[arg(long = "env")]
    pub env: Vec<String>,
    /// The host uid sandboxes run as when sortie runs as root.
    #[arg(long, env = env::SANDBOX_UID, default_value_t = sortie_sandbox::local::DEFAULT_SANDBOX_UID)]
    pub sandbox_uid: u32,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RelayArgs {
    /// The egress socket to relay to.
    #[arg(long)]
    pub socket: PathBuf,
    /// The command to run with the proxy environment.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on; port 0 picks a free one (the chosen address is printed).
    #[arg(long, env = env::LISTEN, default_value = "127.0.0.1:7700")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub store: StoreArgs,
    /// The agent used when a request names none.
    #[arg(long, env = env::DEFAULT_AGENT)]
    pub default_agent: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// Create a workspace.
    Create {
        name: String,
        /// A local directory whose repositories the workspace may use (repeatable).
        #[arg(long = "allow-root")]
        allow_roots: Vec<PathBuf>,
        /// Let the workspace use any local repository the server can read.
        #[arg(long)]
        allow_any_local: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create a token and print it (only the token, once; the store keeps its hash).
    Create {
        #[arg(long)]
        workspace: String,
        #[arg(long, value_parser = parse_role)]
        role: Role,
        /// A note saying who or what the token is for.
        #[arg(long)]
        label: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
}

fn parse_role(text: &str) -> Result<Role, String> {
    text.parse().map_err(|_| "one of viewer, operator, admin".to_owned())
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
