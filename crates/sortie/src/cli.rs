//! The command line (clap derive). Every flag that has an environment variable names it from
//! [`crate::config::env`].

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use sortie_protocol::api::Role;

use sortie_worker::settings::env as worker_env;

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
    /// The sortie server; default: the one `sortie login` saved, else http://127.0.0.1:7700.
    #[arg(long, global = true, env = env::SERVER)]
    pub server: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Data directory: the embedded database and the admin token the client commands use when
    /// SORTIE_TOKEN is unset. Default `/var/lib/sortie` as root, else `$XDG_DATA_HOME/sortie` or
    /// `~/.local/share/sortie`.
    #[arg(long, global = true, env = env::DATA_DIR)]
    pub data_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server: api role with an embedded SQLite store by default.
    Serve(Box<ServeArgs>),
    /// Run the in-sandbox driver: an agent behind a local HTTP API on a Unix socket.
    Driver(Box<sortie_driver::launch::DriverSettings>),
    /// Local sandboxes (bubblewrap).
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Inside a sandbox: relay 127.0.0.1:3128 to the egress socket while running a command.
    #[command(hide = true)]
    Relay(RelayArgs),
    /// The git proxy's parked launcher: waits in a session's cgroup for a launch frame on stdin, then
    /// becomes the git it names.
    #[command(hide = true)]
    GitLaunch,
    /// The scripted agent: an ACP agent on stdin/stdout whose prompts are scripts (no model needed);
    /// the `scripted` profile runs it.
    ScriptedAgent,
    /// Manage workspaces (works on the store directly).
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// Manage tokens (works on the store directly).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Free what ended sessions left (transcripts, workspaces, homes) and mirrors unused for the age;
    /// never a queued, running or idle session's. Prints what it freed.
    Gc(GcArgs),
    /// Install and list coding agents (their pinned npm packages, under the data dir).
    #[command(subcommand)]
    Agents(AgentsCommand),
    /// Check this host for what sortie needs (sandboxes, git, agents, keys) and say how to fix each miss.
    Doctor(DoctorArgs),
    /// Measure every DESIGN §10 target end to end on this machine (as root: real sandboxes), each beside a
    /// baseline measured in the same run; prints a table, `--json` or `--markdown` (docs/benchmarks.md).
    Bench(BenchArgs),
    /// The commands that talk to a running server.
    #[command(flatten)]
    Client(sortie_client::ClientCommand),
}

#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// Install an agent's pinned npm package under `<data dir>/agents/<id>` (npm uses the host's settings).
    Install {
        id: String,
        /// An agent manifest (TOML) adding or overriding profiles.
        #[arg(long, env = worker_env::AGENT_PROFILES)]
        profiles: Option<PathBuf>,
        /// Install under this directory instead of `<data dir>/agents`.
        #[arg(long, env = worker_env::AGENTS_DIR)]
        agents_dir: Option<PathBuf>,
    },
    /// The agents sortie knows: installed or not, and what each needs.
    List {
        #[arg(long, env = worker_env::AGENT_PROFILES)]
        profiles: Option<PathBuf>,
        #[arg(long, env = worker_env::AGENTS_DIR)]
        agents_dir: Option<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Where installed agents live; default `<data dir>/agents`.
    #[arg(long, env = worker_env::AGENTS_DIR)]
    pub agents_dir: Option<PathBuf>,
    /// An agent manifest (TOML) adding or overriding profiles.
    #[arg(long, env = worker_env::AGENT_PROFILES)]
    pub agent_profiles: Option<PathBuf>,
    /// The host uid sandboxes run as.
    #[arg(long, env = worker_env::SANDBOX_UID, default_value_t = 61000)]
    pub sandbox_uid: u32,
}

#[derive(Debug, Args)]
pub struct StoreArgs {
    /// `sqlite://…` or `postgres://…`; default: SQLite in the data dir.
    #[arg(long, env = env::DATABASE_URL)]
    pub database_url: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Print the rows as JSON (for tracking).
    #[arg(long, conflicts_with = "markdown")]
    pub json: bool,
    /// Print the rows as the Markdown page `docs/benchmarks.md` holds.
    #[arg(long)]
    pub markdown: bool,
    /// Measured sessions per row on the small repository (the large one gets up to 5).
    #[arg(long, default_value_t = 10)]
    pub sessions: usize,
    /// The small repository only (no large one): a check that the harness runs, in seconds.
    #[arg(long)]
    pub quick: bool,
    /// Where the run's repositories and data dir go (removed after); default the temp dir.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Only what ended (or was archived) longer ago than this (`30d`, `12h`, `0s`).
    #[arg(long, default_value = "30d", value_parser = humantime::parse_duration)]
    pub older_than: std::time::Duration,
    /// Say what would be freed, free nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// The worker's directory of mirrors and sessions; default `<data dir>/work`.
    #[arg(long, env = sortie_worker::settings::env::WORK_DIR)]
    pub work_dir: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Run a command in a fresh local sandbox laid out like a session's; exits with its code.
    Exec(SandboxExecArgs),
    /// Hold a sandbox for `serve` so it outlives a restart of `serve` (internal).
    #[command(hide = true)]
    Keep(SandboxKeepArgs),
}

#[derive(Debug, Args)]
pub struct SandboxKeepArgs {
    /// The file `serve` touches while it holds the sandbox.
    #[arg(long)]
    pub lease: PathBuf,
    /// Seconds the lease may go untouched before the sandbox is killed.
    #[arg(long)]
    pub grace_secs: u64,
    /// A `cgroup.procs` file the command joins before it runs (repeatable).
    #[arg(long)]
    pub cgroup_procs: Vec<PathBuf>,
    /// The file the command gets as fd 3 (bwrap's status), created or emptied.
    #[arg(long)]
    pub status_file: Option<PathBuf>,
    /// The uid the command runs as (with `--gid`; the keeper runs as root).
    #[arg(long, requires = "gid")]
    pub uid: Option<u32>,
    /// The gid the command runs as.
    #[arg(long, requires = "uid")]
    pub gid: Option<u32>,
    /// The sandbox's command (bwrap and its arguments).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
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
    /// A host path bound read-only at the same path inside (repeatable), e.g. an installed agent.
    #[arg(long = "ro")]
    pub read_only: Vec<PathBuf>,
    /// The host uid sandboxes run as when sortie runs as root.
    #[arg(long, env = worker_env::SANDBOX_UID, default_value_t = sortie_sandbox::local::DEFAULT_SANDBOX_UID)]
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
    /// The agents the sandboxes can run, comma-separated, instead of what this host has installed (an
    /// api replica on Kubernetes: the sandbox image holds the agents).
    #[arg(long, env = env::AGENTS_INSTALLED, value_delimiter = ',')]
    pub agents_installed: Option<Vec<String>>,
    /// The roles to run, comma-separated: `api` (REST), `gateway` (streams), `worker` (sandboxes).
    #[arg(long, env = env::ROLES, value_delimiter = ',', default_value = "api,gateway,worker")]
    pub roles: Vec<ServeRole>,
    /// Browser origins (`https://tools.example.com`) whose pages may attach to streams; the
    /// dashboard sortie serves itself needs none.
    #[arg(long, env = env::CORS_ORIGINS, value_delimiter = ',')]
    pub cors_origin: Vec<String>,
    /// CIDRs webhooks may reach although private (an internal receiver).
    #[arg(long, env = env::WEBHOOK_EXEMPT, value_delimiter = ',')]
    pub webhook_exempt: Vec<String>,
    /// API connections open at once (streams included). Granted as far as the open-files limit
    /// allows: each takes one descriptor; the API takes at most half of them, three quarters when
    /// this is raised past its default.
    #[arg(long, env = env::MAX_CONNECTIONS, default_value_t = sortie_server::MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// API connections one address may hold at once; raise it behind a reverse proxy, where every
    /// client has the proxy's address.
    #[arg(long, env = env::MAX_CONNECTIONS_PER_IP, default_value_t = sortie_server::MAX_CONNECTIONS_PER_IP as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections_per_ip: u64,
    #[command(flatten)]
    pub worker: sortie_worker::WorkerSettings,
    #[command(flatten)]
    pub kube: sortie_kube::settings::KubeSettings,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeRole {
    Api,
    Gateway,
    Worker,
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
    /// Create a token and print it (only the token, once; the store keeps its hash). With `--json`:
    /// `{"id", "token"}`.
    Create {
        #[arg(long)]
        workspace: String,
        #[arg(long, value_parser = parse_role)]
        role: Role,
        /// A note saying who or what the token is for.
        #[arg(long)]
        label: Option<String>,
        /// It stops working after this long (`90d`, `12h`; at least a minute); it never does without.
        #[arg(long, value_parser = parse_expiry)]
        expires_in: Option<std::time::Duration>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List tokens: id, workspace, role, label, created, last used, expiry, state. Never a token's value.
    List {
        /// Only this workspace's (default: every workspace's).
        #[arg(long)]
        workspace: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Revoke a token by its id (`tok_…`): its next request gets 401.
    Revoke {
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

fn parse_expiry(text: &str) -> Result<std::time::Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| format!("{e} (try 90d or 12h)"))?;
    let max = std::time::Duration::from_secs(sortie_protocol::api::TOKEN_EXPIRY_MAX_SECONDS);
    if duration < std::time::Duration::from_secs(60) || duration > max {
        return Err("between a minute and ten years".into());
    }
    Ok(duration)
}

fn parse_role(text: &str) -> Result<Role, String> {
    text.parse().map_err(|_| "one of viewer, operator, admin".to_owned())
}
