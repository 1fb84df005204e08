//! What `serve` does once before it serves: the process's descriptor limit raised, the data dir
//! made private, the first workspace and admin token on a fresh store, the ticket secret every replica
//! shares, the check that every replica seals with the same master key, and the one-time dashboard
//! sign-in link printed for whoever started the server.

use std::path::{Path, PathBuf};

use sortie_protocol::api::Role;
use sortie_store::{Backend, ControlPlane, KeyRing, RepoAccess, StoreError, Tickets};

use crate::signin::{CODE_TTL, SignIns};
use crate::tokens::{self, Secret};

/// The file `serve` writes the first admin token to, in the data dir.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";

/// Why the server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("{what}")]
    Store {
        what: &'static str,
        #[source]
        source: StoreError,
    },
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no randomness for {0}")]
    Randomness(&'static str),
    #[error(
        "this server's master key ({env} or <data dir>/keyring.key) is not the one the store's model keys and forge \
         tokens are sealed with: give every replica the same key (e.g. from one Kubernetes Secret in {env})"
    )]
    KeyRingMismatch { env: &'static str },
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the most this process may open without
/// privileges it should not need) and returns the limit in force. A failure keeps the soft limit:
/// the caps sized from it ([`crate::DescriptorPlan`]) are then smaller, never unsafe.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    /// Where an unlimited hard limit is taken at its word no further (Linux's default `nr_open`).
    const CEILING: u64 = 1 << 20;
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(error) => {
            tracing::warn!(%error, "cannot read RLIMIT_NOFILE; assuming 1024");
            return 1024;
        }
    };
    let wanted = hard.min(CEILING);
    if soft >= wanted {
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, wanted, hard) {
        Ok(()) => wanted,
        Err(error) => {
            tracing::warn!(%error, soft, hard, "cannot raise RLIMIT_NOFILE; keeping the soft limit");
            soft
        }
    }
}

/// The data dir, created 0700 if missing (the database and the admin token live in it).
pub fn create_data_dir(path: &Path) -> Result<(), BootstrapError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|source| BootstrapError::Io {
            what: format!("cannot create the data dir {}", path.display()),
            source,
        })
}

/// The admin token a first start made: shown once to whoever started the server, kept at `saved_to`.
pub struct FirstAdmin {
    pub token: String,
    pub saved_to: PathBuf,
}

/// On first start: workspace `default` and an admin token, saved mode 0600 in the data dir and
/// answered for the caller to show once; `None` when an earlier start (or another replica) made
/// them. The embedded (SQLite) install lets `default` use any local repository; a shared PostgreSQL
/// deployment gives it none until an operator creates workspaces with roots.
pub async fn first_start(
    store: &dyn ControlPlane,
    backend: Backend,
    data_dir: &Path,
) -> Result<Option<FirstAdmin>, BootstrapError> {
    let repo_access = RepoAccess {
        any_local_path: backend == Backend::Sqlite,
        allowed_roots: Vec::new(),
    };
    let workspace = match store.create_workspace("default", repo_access).await {
        Ok(workspace) => workspace,
        // Already bootstrapped (by an earlier start or another replica).
        Err(StoreError::Conflict(_)) => return Ok(None),
        Err(source) => {
            return Err(BootstrapError::Store {
                what: "cannot create the default workspace",
                source,
            });
        }
    };
    let (token, hash) = tokens::generate_token().map_err(|_| BootstrapError::Randomness("the admin token"))?;
    store
        .create_token(&workspace.id, Role::Admin, &hash, Some("first admin"), None)
        .await
        .map_err(|source| BootstrapError::Store {
            what: "cannot store the admin token",
            source,
        })?;
    let path = data_dir.join(ADMIN_TOKEN_FILE);
    write_private_file(&path, &token).map_err(|source| BootstrapError::Io {
        what: format!("cannot write {}", path.display()),
        source,
    })?;
    Ok(Some(FirstAdmin { token, saved_to: path }))
}

/// The attach tickets' secret: the operator's (`configured`, the same on every replica), else one
/// generated once and kept in the store for every replica to share.
pub async fn ticket_secret(store: &dyn Tickets, configured: Option<String>) -> Result<Secret, BootstrapError> {
    if let Some(secret) = configured.filter(|s| !s.is_empty()) {
        return Ok(Secret::new(secret.into_bytes()));
    }
    let candidate = tokens::random_text(32).map_err(|_| BootstrapError::Randomness("the ticket secret"))?;
    let kept = store
        .instance_secret("ticket-hmac", &candidate)
        .await
        .map_err(|source| BootstrapError::Store {
            what: "cannot read the ticket secret",
            source,
        })?;
    Ok(Secret::new(kept.into_bytes()))
}

/// Makes sure every replica seals with the same master key: the first to start stores a check sealed
/// with its key; any later one whose key cannot open it is refused (`env` names the setting to fix).
pub async fn check_keyring(store: &dyn Tickets, keyring: &KeyRing, env: &'static str) -> Result<(), BootstrapError> {
    let candidate = keyring
        .check_value()
        .map_err(|_| BootstrapError::Randomness("the master key's check"))?;
    let kept = store
        .instance_secret("keyring-check", &candidate)
        .await
        .map_err(|source| BootstrapError::Store {
            what: "cannot read the master key's check",
            source,
        })?;
    if keyring.opens_check(&kept) {
        Ok(())
    } else {
        Err(BootstrapError::KeyRingMismatch { env })
    }
}

/// The line that tells whoever started the server how to open the dashboard: a one-time link that
/// signs a browser in as the saved admin token, or where to sign in when there is none.
pub fn signin_banner(data_dir: &Path, address: std::net::SocketAddr, signins: &SignIns) -> String {
    let Ok(token) = std::fs::read_to_string(data_dir.join(ADMIN_TOKEN_FILE)) else {
        return format!("dashboard: http://{address}/ (sign in with a token)");
    };
    let mut shown = address;
    if shown.ip().is_unspecified() {
        shown.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    match signins.issue_code(&tokens::hash_token(token.trim())) {
        Ok(code) => {
            let minutes = CODE_TTL.as_secs() / 60;
            format!("dashboard sign-in link (works once, for {minutes} minutes): http://{shown}/signin#{code}")
        }
        Err(error) => {
            tracing::warn!(%error, "no randomness for a sign-in code");
            format!("dashboard: http://{shown}/ (sign in with a token)")
        }
    }
}

fn write_private_file(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(contents.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}
