//! Admin commands that work on the store directly: they need the data dir or database URL, not a
//! running server or a token.

use std::process::ExitCode;

use anyhow::Context;
use sortie_store::{ControlPlane, RepoAccess, SqlStore, StoreError};

use crate::cli::{ClientArgs, TokenCommand, WorkspaceCommand};
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
            store,
        } => {
            let store = open_store(client, store.database_url).await?;
            let workspace = match store.workspace_by_name(&workspace).await {
                Ok(workspace) => workspace,
                Err(StoreError::NotFound) => anyhow::bail!("no workspace named {workspace:?}"),
                Err(other) => return Err(other.into()),
            };
            let (token, hash) = sortie_server::tokens::generate_token().context("no randomness for the token")?;
            store
                .create_token(&workspace.id, role, &hash, label.as_deref())
                .await
                .context("cannot store the token")?;
            say!("{token}");
            store.close().await;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn is_workspace_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}
