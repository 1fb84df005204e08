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
    Serve(ServeArgs),
    /// Run the in-sandbox driver: an agent behind a local HTTP API on a Unix socket.
    Driver(DriverArgs),
    /// Local sandboxes (bubblewrap).
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Inside a sandbox: relay 127.0.0.1:3128 to the egress socket while running a command.
    #[command(hide = true)]
    Relay(RelayArgs),
    /// The scripted agent: an ACP agent on stdin/stdout whose prompts are scripts (no model needed);
    /// the `scripted` profile runs it.
    ScriptedAgent,
    /// Manage workspaces (works on the store directly).
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// Manage tokens (works on the store directly).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Install and list coding agents (their pinned npm packages, under the data dir).
    #[command(subcommand)]
    Agents(AgentsCommand),
    /// Check this host for what sortie needs (sandboxes, git, agents, keys) and say how to fix each miss.
    Doctor(DoctorArgs),
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
        #[arg(long, env = env::AGENT_PROFILES)]
        profiles: Option<PathBuf>,
        /// Install under this directory instead of `<data dir>/agents`.
        #[arg(long, env = env::AGENTS_DIR)]
        agents_dir: Option<PathBuf>,
    },
    /// The agents sortie knows: installed or not, and what each needs.
    List {
        #[arg(long, env = env::AGENT_PROFILES)]
        profiles: Option<PathBuf>,
        #[arg(long, env = env::AGENTS_DIR)]
        agents_dir: Option<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Where installed agents live; default `<data dir>/agents`.
    #[arg(long, env = env::AGENTS_DIR)]
    pub agents_dir: Option<PathBuf>,
    /// An agent manifest (TOML) adding or overriding profiles.
    #[arg(long, env = env::AGENT_PROFILES)]
    pub agent_profiles: Option<PathBuf>,
    /// The host uid sandboxes run as.
    #[arg(long, env = env::SANDBOX_UID, default_value_t = 61000)]
    pub sandbox_uid: u32,
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
    #[arg(long, required_unless_present = "listen_on_stdin")]
    pub socket: Option<PathBuf>,
    /// Serve the driver API on the listening Unix socket passed as stdin (how the worker starts the
    /// driver in a sandbox: the socket's name is the host's, out of the sandbox's reach).
    #[arg(long, conflicts_with = "socket")]
    pub listen_on_stdin: bool,
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
    /// Deliver each turn's work to this branch (e.g. `sortie/ses_…`): commit, scan for secrets, push.
    /// Without it the work stays in the workspace.
    #[arg(long)]
    pub branch: Option<String>,
    /// The remote to push to: a name in the workspace's git config, a URL or a path.
    #[arg(long, default_value = "origin", requires = "branch")]
    pub remote: String,
    /// The author and committer name of delivered commits.
    #[arg(long, default_value = "sortie", requires = "branch")]
    pub author_name: String,
    /// The author and committer email of delivered commits.
    #[arg(long, default_value = "sortie@localhost", requires = "branch")]
    pub author_email: String,
    /// A file of known secret values' SHA-256 digests (lowercase hex, one a line): a delivery whose
    /// changes hold one of them fails SECRET_DETECTED.
    #[arg(long, requires = "branch")]
    pub secret_digests: Option<PathBuf>,
    /// The gateway's model proxy as the agent reaches it; `/<api>` is appended for the profile's API.
    #[arg(long, default_value = "http://127.0.0.1:3128/_sortie/model")]
    pub model_proxy: String,
    /// The model the agent uses; default: its profile's.
    #[arg(long)]
    pub model: Option<String>,
    /// Where `sortie agents install` put agents (`<dir>/<id>/node_modules/.bin`), searched first.
    #[arg(long)]
    pub agents_dir: Option<PathBuf>,
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
    /// The sandbox's command (the cgroup wrapper, setpriv, bwrap).
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
    #[command(flatten)]
    pub worker: WorkerArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeRole {
    Api,
    Gateway,
    Worker,
}

/// How the worker role runs sandboxes.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Mirrors, session workspaces and homes, sandbox state; default `<data dir>/work`.
    #[arg(long, env = env::WORK_DIR)]
    pub work_dir: Option<PathBuf>,
    /// Live sandboxes per workspace; more turns wait in `queued`.
    #[arg(long, env = env::SANDBOXES_PER_WORKSPACE, default_value_t = 4)]
    pub sandboxes_per_workspace: usize,
    /// Seconds a turn may run before it fails with TURN_TIMEOUT (never disabled).
    #[arg(long, env = env::TURN_TIMEOUT, default_value_t = 1800)]
    pub turn_timeout: u64,
    /// Seconds a warm sandbox may idle before its session is hibernated.
    #[arg(long, env = env::IDLE_GRACE, default_value_t = 600)]
    pub idle_grace: u64,
    /// Seconds a setup script may run.
    #[arg(long, env = env::SETUP_TIMEOUT, default_value_t = 600)]
    pub setup_timeout: u64,
    /// MiB of each session's disk (its /workspace and $HOME together); writes past it fail with
    /// ENOSPC and the turn with DISK_QUOTA_EXCEEDED. At least 16.
    #[arg(long, env = env::SANDBOX_DISK_MIB, default_value_t = 10 * 1024, value_parser = clap::value_parser!(u64).range(16..))]
    pub sandbox_disk_mib: u64,
    /// Seconds a sandbox runs on after `serve` is gone, waiting for the next `serve` to adopt it.
    #[arg(long, env = env::SANDBOX_ORPHAN_GRACE, default_value_t = 120)]
    pub sandbox_orphan_grace: u64,
    /// Hosts reachable during the setup phase only; default: the host's package registries.
    #[arg(long, env = env::SETUP_HOSTS, value_delimiter = ',')]
    pub setup_hosts: Option<Vec<String>>,
    /// CIDRs the egress proxy may reach although private (an internal registry).
    #[arg(long, env = env::EGRESS_EXEMPT, value_delimiter = ',')]
    pub egress_exempt: Vec<String>,
    /// Fixed resolver answers for the egress proxy, `name=ip` (internal names).
    #[arg(long, env = env::EGRESS_HOSTS, value_delimiter = ',')]
    pub egress_hosts: Vec<String>,
    /// An agent manifest (TOML) adding or overriding profiles.
    #[arg(long, env = env::AGENT_PROFILES)]
    pub agent_profiles: Option<PathBuf>,
    /// The host uid sandboxes run as when sortie runs as root.
    #[arg(long, env = env::SANDBOX_UID, default_value_t = sortie_sandbox::local::DEFAULT_SANDBOX_UID)]
    pub sandbox_uid: u32,
    /// Where `sortie agents install` put the agents; default `<data dir>/agents`.
    #[arg(long, env = env::AGENTS_DIR)]
    pub agents_dir: Option<PathBuf>,
    /// Where the model proxy sends Anthropic requests (default: Anthropic's public API).
    #[arg(long, env = env::UPSTREAM_ANTHROPIC)]
    pub upstream_anthropic: Option<String>,
    /// Where the model proxy sends OpenAI requests (default: OpenAI's public API).
    #[arg(long, env = env::UPSTREAM_OPENAI)]
    pub upstream_openai: Option<String>,
    /// Where the model proxy sends Gemini requests (default: Google's public Gemini API).
    #[arg(long, env = env::UPSTREAM_GEMINI)]
    pub upstream_gemini: Option<String>,
    /// PEM certificates trusted as roots for forges besides the platform's (an internal forge's CA).
    #[arg(long, env = env::FORGE_CA_FILE)]
    pub forge_ca_file: Option<PathBuf>,
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
