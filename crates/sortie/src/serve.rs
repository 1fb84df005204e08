//! `sortie serve`: opens the store, bootstraps the first workspace and admin token, binds the
//! listener and runs the api role until Ctrl-C or SIGTERM.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use sortie_protocol::api::Role;
use sortie_server::{AgentCatalog, ApiState, Secret, tokens};
use sortie_store::{Backend, RepoAccess, SqlStore, Store, StoreError};

use crate::cli::{ClientArgs, ServeArgs};
use crate::config::{self, ADMIN_TOKEN_FILE, env};

pub async fn serve(client: ClientArgs, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let data_dir = config::data_dir(client.data_dir);
    let database_url = config::database_url(args.store.database_url, &data_dir);
    let mut agents = AgentCatalog::default();
    if let Some(default_agent) = args.default_agent {
        anyhow::ensure!(
            agents.known.contains(&default_agent),
            "--default-agent {default_agent:?} is not a known agent ({})",
            agents.known.join(", ")
        );
        agents.default = default_agent;
    }

    create_private_dir(&data_dir).with_context(|| format!("cannot create the data dir {}", data_dir.display()))?;
    let store = Arc::new(
        SqlStore::connect(&database_url)
            .await
            .context("cannot open the store")?,
    );
    bootstrap(store.as_ref(), &data_dir).await?;
    let ticket_secret = match std::env::var(env::TICKET_SECRET) {
        Ok(secret) if !secret.is_empty() => Secret::new(secret.into_bytes()),
        _ => {
            let candidate = tokens::random_text(32).context("no randomness for the ticket secret")?;
            Secret::new(
                store
                    .instance_secret("ticket-hmac", &candidate)
                    .await
                    .context("cannot read the ticket secret")?
                    .into_bytes(),
            )
        }
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let address = listener.local_addr().context("the listener has no address")?;
    println!("sortie listening on http://{address}");
    tracing::info!(%address, data_dir = %data_dir.display(), backend = ?store.backend(), "serving");

    let attach = sortie_gateway::attach::AttachState {
        store: store.clone(),
        ticket_secret: Arc::from(ticket_secret.expose()),
        // Sandboxes and their drivers come with the worker; until then a stream waits for its turn.
        drivers: Arc::new(NoDrivers),
        allowed_origins: Arc::new(Vec::new()),
        heartbeat: std::time::Duration::from_secs(15),
    };
    let state = ApiState {
        store: store.clone(),
        agents: Arc::new(agents),
        ticket_secret,
    };
    sortie_server::run_with(
        listener,
        state,
        sortie_gateway::attach::router(attach),
        shutdown_signal(),
    )
    .await
    .context("the server failed")?;
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

/// No session has a driver yet: the worker that starts sandboxes is not part of this build.
struct NoDrivers;

impl sortie_gateway::attach::DriverLocator for NoDrivers {
    fn driver_socket(&self, _session_id: &sortie_protocol::SessionId) -> Option<std::path::PathBuf> {
        None
    }
}

/// On first start: workspace `default` and an admin token, printed once and saved mode 0600.
/// The embedded (SQLite) install lets `default` use any local repository; a shared PostgreSQL
/// deployment gives it none until an operator creates workspaces with roots.
async fn bootstrap(store: &SqlStore, data_dir: &Path) -> anyhow::Result<()> {
    let repo_access = RepoAccess {
        any_local_path: store.backend() == Backend::Sqlite,
        allowed_roots: Vec::new(),
    };
    let workspace = match store.create_workspace("default", repo_access).await {
        Ok(workspace) => workspace,
        // Already bootstrapped (by an earlier start or another replica).
        Err(StoreError::Conflict(_)) => return Ok(()),
        Err(other) => return Err(other).context("cannot create the default workspace"),
    };
    let (token, hash) = tokens::generate_token().context("no randomness for the admin token")?;
    store
        .create_token(&workspace.id, Role::Admin, &hash, Some("first admin"))
        .await
        .context("cannot store the admin token")?;
    let path = data_dir.join(ADMIN_TOKEN_FILE);
    write_private_file(&path, &token).with_context(|| format!("cannot write {}", path.display()))?;
    println!(
        "created workspace `default` and an admin token (shown once, saved to {}):",
        path.display()
    );
    println!("{token}");
    Ok(())
}

fn create_private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path)
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

pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
