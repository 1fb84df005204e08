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
    /// The bearer token of the client commands; default: the data dir's admin token.
    pub const TOKEN: &str = "SORTIE_TOKEN";
    /// The host uid sandboxes run as when sortie runs as root (default 61000; needs no passwd entry).
    pub const SANDBOX_UID: &str = "SORTIE_SANDBOX_UID";
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info,sortie_server=debug`.
    pub const LOG: &str = "SORTIE_LOG";
}

/// The file `serve` writes the first admin token to.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The embedded database's file name in the data dir.
pub const DATABASE_FILE: &str = "sortie.db";

/// `$XDG_DATA_HOME/sortie`, else `~/.local/share/sortie`.
pub fn default_data_dir() -> PathBuf {
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
