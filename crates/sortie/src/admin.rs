//! Admin commands that work on the store directly: they need the data dir or database URL, not a
//! running server or a token.

use std::process::ExitCode;

use anyhow::Context;
use sortie_protocol::api::rfc3339_from_epoch_ms;
use sortie_store::{AuditEntry, ControlPlane, RepoAccess, SqlStore, StoreError, TokenRow, now_ms};

use crate::cli::{ClientArgs, GcArgs, TokenCommand, WorkspaceCommand};
use crate::config;
use crate::say;

async fn open_store(client: &ClientArgs, database_url: Option<String>) -> anyhow::Result<SqlStore> {
    let data_dir = config::data_dir(client.data_dir.clone());
    let url = config::database_url(database_url, &data_dir);
    SqlStore::connect(&url)
        .await
        .context("cannot open the store (is --data-dir or --database-url right?)")
}

pub async fn workspace(client: &ClientArgs, command: WorkspaceCommand) -> anyhow::Result<ExitCode> {
    match command {
        WorkspaceCommand::Create {
            name,
            allow_roots,
            allow_any_local,
            store,
        } => {
            anyhow::ensure!(
                is_workspace_name(&name),
                "a workspace name is 1 to 64 lowercase letters, digits and hyphens: {name:?}"
            );
            let mut roots = Vec::new();
            for root in allow_roots {
                let resolved = std::fs::canonicalize(&root)
                    .with_context(|| format!("--allow-root {} does not exist", root.display()))?;
                roots.push(
                    resolved
                        .into_os_string()
                        .into_string()
                        .map_err(|_| anyhow::anyhow!("--allow-root is not valid UTF-8"))?,
                );
            }
            let store = open_store(client, store.database_url).await?;
            let created = match store
                .create_workspace(
                    &name,
                    RepoAccess {
                        any_local_path: allow_any_local,
                        allowed_roots: roots,
                    },
                )
                .await
            {
                Ok(workspace) => workspace,
                Err(StoreError::Conflict(_)) => anyhow::bail!("a workspace named {name:?} exists"),
                Err(other) => return Err(other.into()),
            };
            if client.json {
                /// What `workspace create --json` prints.
                #[derive(serde::Serialize)]
                struct Created<'a> {
                    id: &'a str,
                    name: &'a str,
                }
                let shown = Created {
                    id: &created.id,
                    name: &created.name,
                };
                say!("{}", serde_json::to_string(&shown)?);
            } else {
                say!("created workspace {}", created.name);
            }
            store.close().await;
            Ok(ExitCode::SUCCESS)
        }
    }
}

pub async fn token(client: &ClientArgs, command: TokenCommand) -> anyhow::Result<ExitCode> {
    match command {
        TokenCommand::Create {
            workspace,
            role,
            label,
            expires_in,
            store,
        } => {
            let store = open_store(client, store.database_url).await?;
            let workspace = match store.workspace_by_name(&workspace).await {
                Ok(workspace) => workspace,
                Err(StoreError::NotFound) => anyhow::bail!("no workspace named {workspace:?}"),
                Err(other) => return Err(other.into()),
            };
            let (token, hash) = sortie_server::tokens::generate_token().context("no randomness for the token")?;
            let expires_at = expires_in.map(|after| now_ms().saturating_add(after.as_millis() as i64));
            let id = store
                .create_token(&workspace.id, role, &hash, label.as_deref(), expires_at)
                .await
                .context("cannot store the token")?;
            audit(&store, &workspace.id, "token.create", &id).await;
            if client.json {
                say!("{}", serde_json::json!({"id": id, "token": token}));
            } else {
                say!("{token}");
            }
            store.close().await;
            Ok(ExitCode::SUCCESS)
        }
        TokenCommand::List { workspace, store } => {
            let store = open_store(client, store.database_url).await?;
            let workspace_id = match &workspace {
                Some(name) => match store.workspace_by_name(name).await {
                    Ok(workspace) => Some(workspace.id),
                    Err(StoreError::NotFound) => anyhow::bail!("no workspace named {name:?}"),
                    Err(other) => return Err(other.into()),
                },
                None => None,
            };
            let tokens = store.tokens(workspace_id.as_deref()).await?;
            store.close().await;
            let now = now_ms();
            if client.json {
                let listed: Vec<serde_json::Value> = tokens
                    .iter()
                    .map(|t| {
                        serde_json::json!({
                            "id": t.id,
                            "workspace": t.workspace_name,
                            "role": t.role.as_str(),
                            "label": t.label,
                            "created_at": rfc3339_from_epoch_ms(t.created_at),
                            "last_used_at": t.last_used_at.map(rfc3339_from_epoch_ms),
                            "expires_at": t.expires_at.map(rfc3339_from_epoch_ms),
                            "revoked_at": t.revoked_at.map(rfc3339_from_epoch_ms),
                            "state": token_state(t, now),
                        })
                    })
                    .collect();
                say!("{}", serde_json::Value::Array(listed));
                return Ok(ExitCode::SUCCESS);
            }
            say!(
                "{:<30}  {:<16}  {:<8}  {:<20}  {:<20}  {:<20}  {:<7}  LABEL",
                "ID",
                "WORKSPACE",
                "ROLE",
                "CREATED",
                "LAST USED",
                "EXPIRES",
                "STATE"
            );
            let when = |at: Option<i64>| at.map_or_else(|| "-".to_owned(), rfc3339_from_epoch_ms);
            for t in &tokens {
                say!(
                    "{:<30}  {:<16}  {:<8}  {:<20}  {:<20}  {:<20}  {:<7}  {}",
                    t.id,
                    t.workspace_name,
                    t.role.as_str(),
                    rfc3339_from_epoch_ms(t.created_at),
                    when(t.last_used_at),
                    when(t.expires_at),
                    token_state(t, now),
                    t.label.as_deref().map(printable).unwrap_or_default()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        TokenCommand::Revoke { id, store } => {
            let store = open_store(client, store.database_url).await?;
            let Some(token) = store.tokens(None).await?.into_iter().find(|t| t.id == id) else {
                anyhow::bail!("no token with id {id:?} (`sortie token list` shows them)");
            };
            if !store.revoke_token(&token.workspace_id, &id).await? {
                anyhow::bail!("token {id} was revoked already");
            }
            audit(&store, &token.workspace_id, "token.revoke", &id).await;
            store.close().await;
            say!("revoked {id}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

pub async fn gc(client: &ClientArgs, args: GcArgs) -> anyhow::Result<ExitCode> {
    let data_dir = config::data_dir(client.data_dir.clone());
    let work_dir = args.work_dir.clone().unwrap_or_else(|| data_dir.join("work"));
    let store = open_store(client, args.store.database_url).await?;
    let report = sortie_worker::retention::collect(&store, &work_dir, args.older_than, args.dry_run).await;
    store.close().await;
    let report = report?;
    let verb = if report.dry_run { "would free" } else { "freed" };
    if client.json {
        let sessions: Vec<serde_json::Value> = report
            .sessions
            .iter()
            .map(|s| serde_json::json!({"id": s.id, "parts": s.parts, "parts_bytes": s.parts_bytes, "disk_bytes": s.disk_bytes}))
            .collect();
        let mirrors: Vec<serde_json::Value> = report
            .mirrors
            .iter()
            .map(|(path, bytes)| serde_json::json!({"path": path, "bytes": bytes}))
            .collect();
        say!(
            "{}",
            serde_json::json!({
                "dry_run": report.dry_run,
                "sessions": sessions,
                "mirrors": mirrors,
                "store_bytes": report.store_bytes,
                "freed_bytes": report.freed_bytes(),
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    for session in &report.sessions {
        say!(
            "session {}: {} parts ({}), directories {}",
            session.id,
            session.parts,
            bytes(session.parts_bytes),
            bytes(session.disk_bytes)
        );
    }
    for (path, size) in &report.mirrors {
        say!("mirror {}: {}", path.display(), bytes(*size));
    }
    if report.store_bytes > 0 {
        say!("store file: {}", bytes(report.store_bytes));
    }
    say!(
        "{verb} {} ({} sessions, {} mirrors)",
        bytes(report.freed_bytes()),
        report.sessions.len(),
        report.mirrors.len()
    );
    Ok(ExitCode::SUCCESS)
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / f64::from(1 << 30)),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / f64::from(1 << 10)),
        n => format!("{n} B"),
    }
}

fn token_state(token: &TokenRow, now: i64) -> &'static str {
    if token.revoked_at.is_some() {
        "revoked"
    } else if token.expires_at.is_some_and(|at| at <= now) {
        "expired"
    } else {
        "live"
    }
}

/// A label as a terminal may show it: its control characters dropped.
fn printable(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).collect()
}

/// Records what the admin command did; the local admin is `cli` (whoever can open the store).
async fn audit(store: &SqlStore, workspace_id: &str, action: &str, target: &str) {
    let entry = AuditEntry {
        workspace_id: workspace_id.to_owned(),
        actor: "cli".to_owned(),
        action: action.to_owned(),
        target: target.to_owned(),
    };
    if let Err(error) = store.record_audit(&entry).await {
        tracing::error!(%error, action, target, "the audit log lost an entry");
    }
}

fn is_workspace_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}
