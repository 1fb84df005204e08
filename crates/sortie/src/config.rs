//! Configuration: every environment variable declared once, and the defaults derived from them.
//! Loading has no side effects; `serve` creates directories only after everything is resolved.

use std::path::{Path, PathBuf};

/// Every environment variable sortie reads.
pub mod env {
    /// Address `sortie serve` listens on (`--listen`).
    pub const LISTEN: &str = "SORTIE_LISTEN";
    /// Directory of the embedded database, the admin token and later workspaces (`--data-dir`).
    pub const DATA_DIR: &str = "SORTIE_DATA_DIR";
    /// `sqlite://…` or `postgres://…` (`--database-url`); default SQLite in the data dir.
    pub const DATABASE_URL: &str = "SORTIE_DATABASE_URL";
    /// The agent used when a request names none (`--default-agent`).
    pub const DEFAULT_AGENT: &str = "SORTIE_DEFAULT_AGENT";
    /// Secret for attach tickets, shared by every replica; generated and kept in the store if unset.
    pub const TICKET_SECRET: &str = "SORTIE_TICKET_SECRET";
    /// The server the client commands talk to (`--server`).
    pub const SERVER: &str = "SORTIE_SERVER";
    /// The host uid sandboxes run as when sortie runs as root (default 61000; needs no passwd entry).
    pub const SANDBOX_UID: &str = "SORTIE_SANDBOX_UID";
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info,sortie_server=debug`.
    pub const LOG: &str = "SORTIE_LOG";
    /// The roles `serve` runs (`--roles`): any of `api`, `gateway`, `worker`, comma-separated.
    pub const ROLES: &str = "SORTIE_ROLES";
    /// Mirrors, session workspaces and homes, sandbox state (`--work-dir`); default `<data dir>/work`.
    pub const WORK_DIR: &str = "SORTIE_WORK_DIR";
    /// Live sandboxes per workspace; more turns wait in `queued` (`--sandboxes-per-workspace`).
    pub const SANDBOXES_PER_WORKSPACE: &str = "SORTIE_SANDBOXES_PER_WORKSPACE";
    /// Seconds a turn may run before `TURN_TIMEOUT` (`--turn-timeout`).
    pub const TURN_TIMEOUT: &str = "SORTIE_TURN_TIMEOUT";
    /// Seconds a warm sandbox may idle before its session is hibernated (`--idle-grace`).
    pub const IDLE_GRACE: &str = "SORTIE_IDLE_GRACE";
    pub const SANDBOX_ORPHAN_GRACE: &str = "SORTIE_SANDBOX_ORPHAN_GRACE";
    /// MiB of each session's own disk, its `/workspace` and `$HOME` together (`--sandbox-disk-mib`);
    /// a sparse image, so a session costs only what it writes. Needs root; without it, no quota.
    pub const SANDBOX_DISK_MIB: &str = "SORTIE_SANDBOX_DISK_MIB";
    /// Seconds a setup script may run (`--setup-timeout`).
    pub const SETUP_TIMEOUT: &str = "SORTIE_SETUP_TIMEOUT";
    /// Hosts reachable during the setup phase only, comma-separated (`--setup-hosts`); default: the
    /// registries of the host's npm, pip, cargo and apt settings.
    pub const SETUP_HOSTS: &str = "SORTIE_SETUP_HOSTS";
    /// CIDRs the egress proxy may reach although private (an internal registry), comma-separated.
    pub const EGRESS_EXEMPT: &str = "SORTIE_EGRESS_EXEMPT";
    /// Fixed answers for the egress proxy's resolver, `name=ip` comma-separated (internal names; tests).
    pub const EGRESS_HOSTS: &str = "SORTIE_EGRESS_HOSTS";
    /// Browser origins allowed to attach to streams from another site, comma-separated (`--cors-origin`).
    pub const CORS_ORIGINS: &str = "SORTIE_CORS_ORIGINS";
    pub const WEBHOOK_EXEMPT: &str = "SORTIE_WEBHOOK_EXEMPT";
    /// An agent manifest (TOML) adding or overriding profiles (`--agent-profiles`).
    pub const AGENT_PROFILES: &str = "SORTIE_AGENT_PROFILES";
    /// Where installed agents live (`--agents-dir`); default `<data dir>/agents`.
    pub const AGENTS_DIR: &str = "SORTIE_AGENTS_DIR";
    /// The model proxy's upstream for Anthropic (`--upstream-anthropic`).
    pub const UPSTREAM_ANTHROPIC: &str = "SORTIE_UPSTREAM_ANTHROPIC";
    /// The model proxy's upstream for OpenAI (`--upstream-openai`).
    pub const UPSTREAM_OPENAI: &str = "SORTIE_UPSTREAM_OPENAI";
    /// The model proxy's upstream for Gemini (`--upstream-gemini`).
    pub const UPSTREAM_GEMINI: &str = "SORTIE_UPSTREAM_GEMINI";
    /// PEM roots trusted for forges (`https://` repositories) besides the platform's (`--forge-ca-file`).
    pub const FORGE_CA_FILE: &str = "SORTIE_FORGE_CA_FILE";
    /// Master key sealing model keys at rest, base64 of 32 bytes; default: the file `<data dir>/keyring.key` (created once, 0600).
    pub const KEYRING_KEY: &str = "SORTIE_KEYRING_KEY";
}

/// Where `sortie agents install` puts agents: `<data dir>/agents/<id>`.
pub fn agents_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("agents")
}

/// The file `serve` writes the first admin token to.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The embedded database's file name in the data dir.
pub const DATABASE_FILE: &str = "sortie.db";

/// The data dir of a server run as root: sandboxes run as an unprivileged uid that must reach the
/// work dir inside it, which a home (0700 on most systems) would not let it.
pub const SYSTEM_DATA_DIR: &str = "/var/lib/sortie";

/// As root [`SYSTEM_DATA_DIR`]; otherwise `$XDG_DATA_HOME/sortie`, else `~/.local/share/sortie`.
pub fn default_data_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from(SYSTEM_DATA_DIR);
    }
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(xdg).join("sortie");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/"), PathBuf::from);
    home.join(".local/share/sortie")
}

pub fn data_dir(flag: Option<PathBuf>) -> PathBuf {
    flag.unwrap_or_else(default_data_dir)
}

pub fn database_url(flag: Option<String>, data_dir: &Path) -> String {
    flag.unwrap_or_else(|| format!("sqlite://{}", data_dir.join(DATABASE_FILE).display()))
}
