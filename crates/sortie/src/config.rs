//! Configuration the binary itself reads: its environment variables (each role's own are declared
//! with its settings, e.g. `sortie_worker::settings::env`) and the defaults derived from them.
//! Loading has no side effects; `serve` creates directories only after everything is resolved.

use std::path::{Path, PathBuf};

/// The environment variables of `serve`'s own flags and of the client commands.
pub mod env {
    /// Address `sortie serve` listens on (`--listen`).
    pub const LISTEN: &str = "SORTIE_LISTEN";
    /// Directory of the embedded database, the admin token and later workspaces (`--data-dir`).
    pub const DATA_DIR: &str = "SORTIE_DATA_DIR";
    /// `sqlite://…` or `postgres://…` (`--database-url`); default SQLite in the data dir.
    pub const DATABASE_URL: &str = "SORTIE_DATABASE_URL";
    /// The agent used when a request names none (`--default-agent`).
    pub const DEFAULT_AGENT: &str = "SORTIE_DEFAULT_AGENT";
    /// The agents the sandboxes hold, comma-separated (`--agents-installed`), instead of probing this
    /// host: an api replica on Kubernetes, whose sandboxes are pods of another image.
    pub const AGENTS_INSTALLED: &str = "SORTIE_AGENTS_INSTALLED";
    /// Secret for attach tickets, shared by every replica; generated and kept in the store if unset.
    pub const TICKET_SECRET: &str = "SORTIE_TICKET_SECRET";
    /// The server the client commands talk to (`--server`).
    pub const SERVER: &str = "SORTIE_SERVER";
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info,sortie_server=debug`.
    pub const LOG: &str = "SORTIE_LOG";
    /// The roles `serve` runs (`--roles`): any of `api`, `gateway`, `worker`, comma-separated.
    pub const ROLES: &str = "SORTIE_ROLES";
    /// Browser origins allowed to attach to streams from another site, comma-separated (`--cors-origin`).
    pub const CORS_ORIGINS: &str = "SORTIE_CORS_ORIGINS";
    /// CIDRs webhooks may reach although private (an internal receiver), comma-separated.
    pub const WEBHOOK_EXEMPT: &str = "SORTIE_WEBHOOK_EXEMPT";
    /// API connections open at once (`--max-connections`).
    pub const MAX_CONNECTIONS: &str = "SORTIE_MAX_CONNECTIONS";
    /// API connections one address may hold at once (`--max-connections-per-ip`).
    pub const MAX_CONNECTIONS_PER_IP: &str = "SORTIE_MAX_CONNECTIONS_PER_IP";
    /// Master key sealing model keys at rest, base64 of 32 bytes; default: the file `<data dir>/keyring.key` (created once, 0600).
    pub const KEYRING_KEY: &str = "SORTIE_KEYRING_KEY";
}

/// Where `sortie agents install` puts agents: `<data dir>/agents/<id>`.
pub fn agents_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("agents")
}

pub use sortie_server::bootstrap::ADMIN_TOKEN_FILE;
/// The embedded database's file name in the data dir.
pub const DATABASE_FILE: &str = "sortie.db";

pub use sortie_worker::settings::SYSTEM_DATA_DIR;

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
