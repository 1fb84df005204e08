//! `sortie serve`: opens the store, bootstraps the first workspace and admin token, binds the
//! listener and runs the roles it was given (api, gateway, worker, and the webhook dispatcher beside
//! the api) until Ctrl-C or SIGTERM.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use sortie_protocol::api::Role;
use sortie_server::{AgentCatalog, ApiState, Secret, tokens};
use sortie_store::{Backend, ControlPlane, RepoAccess, SqlStore, StoreError, Tickets};

use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_worker::{Worker, WorkerConfig};

use crate::cli::{ClientArgs, ServeArgs, ServeRole, WorkerArgs};
use crate::config::{self, ADMIN_TOKEN_FILE, DATABASE_FILE, env};

pub async fn serve(client: ClientArgs, args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Before anything opens a descriptor: every cap on connections is sized from this limit.
    let descriptors = sortie_server::DescriptorPlan::for_limit(
        raise_open_files_limit(),
        sortie_gateway::egress::proxy::FDS_PER_CONNECTION as u64,
    );
    sortie_gateway::egress::proxy::HostConnections::set_process_wide(descriptors.egress_connections);
    tracing::info!(
        open_files = descriptors.open_files_limit,
        reserve = sortie_server::DESCRIPTOR_RESERVE,
        api_connections = descriptors.api_connections,
        api_connections_per_ip = descriptors.api_connections_per_ip,
        egress_connections = descriptors.egress_connections,
        "file descriptors shared"
    );
    let data_dir = config::data_dir(client.data_dir);
    let database_url = config::database_url(args.store.database_url, &data_dir);
    let mut agents = AgentCatalog::default();
    // Agents an operator's manifest adds are as good as the built-in ones.
    let profiles = sortie_driver::profile::load(args.worker.agent_profiles.as_deref())?;
    let agents_dir = args
        .worker
        .agents_dir
        .clone()
        .unwrap_or_else(|| config::agents_dir(&data_dir));
    for profile in &profiles {
        if !agents.known.contains(&profile.id) {
            agents.known.push(profile.id.clone());
        }
    }
    agents.probe = Arc::new(crate::agents::HostAgents {
        profiles: profiles.clone(),
        agents_dir: agents_dir.clone(),
    });
    if let Some(default_agent) = args.default_agent {
        anyhow::ensure!(
            agents.known.contains(&default_agent),
            "--default-agent {default_agent:?} is not a known agent ({})",
            agents.known.join(", ")
        );
        agents.default = default_agent;
    }

    // The same host checks as `sortie doctor`: what is missing is said once, at start.
    let work_dir = args.worker.work_dir.clone().unwrap_or_else(|| data_dir.join("work"));
    let checks = crate::doctor::host_checks(&crate::doctor::HostInputs {
        data_dir: &data_dir,
        work_dir: work_dir.clone(),
        sandbox_uid: args.worker.sandbox_uid,
        agents_dir: &agents_dir,
        profiles: &profiles,
    });
    for check in checks.iter().filter(|c| !c.ok) {
        if check.required && args.roles.contains(&ServeRole::Worker) {
            tracing::warn!(check = check.name, "{}", check.says);
        } else {
            tracing::info!(check = check.name, "{}", check.says);
        }
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

    let keyring = sortie_store::KeyRing::from_env_or_file(
        std::env::var(env::KEYRING_KEY).ok().as_deref(),
        &data_dir.join(sortie_store::keys::KEYRING_FILE),
    )
    .with_context(|| {
        format!(
            "cannot load the model keys' master key ({} or keyring.key)",
            env::KEYRING_KEY
        )
    })?;
    let keyring = Arc::new(keyring);
    let roles = args.roles.clone();
    let worker = if roles.contains(&ServeRole::Worker) {
        Some(build_worker(&data_dir, &args.worker, store.clone(), keyring.clone())?)
    } else {
        None
    };
    let tails: Arc<dyn sortie_gateway::live::LiveTails> = match &worker {
        Some(worker) => worker.live_tails(),
        // A gateway without the worker role serves the live tails of a worker on this host, if any.
        None => sortie_worker::work_dir_tails(&args.worker.work_dir.clone().unwrap_or_else(|| data_dir.join("work"))),
    };

    let cors_origins = args
        .cors_origin
        .iter()
        .map(|origin| valid_origin(origin))
        .collect::<anyhow::Result<Vec<_>>>()?;

    // One shutdown signal for every role.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = move || {
        let mut stop_rx = stop_rx.clone();
        async move {
            let _ = stop_rx.wait_for(|stop| *stop).await;
        }
    };
    if let Some(worker) = &worker {
        worker.reconcile().await;
    }
    let worker_task = worker.map(|worker| tokio::spawn(worker.run(stopped())));

    if roles.contains(&ServeRole::Api) || roles.contains(&ServeRole::Gateway) {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let address = listener.local_addr().context("the listener has no address")?;
        announce(&format!("sortie listening on http://{address}"));
        tracing::info!(%address, data_dir = %data_dir.display(), backend = ?store.backend(), ?roles, "serving");

        let gateway = if roles.contains(&ServeRole::Gateway) {
            sortie_gateway::attach::router(sortie_gateway::attach::AttachState {
                store: store.clone(),
                ticket_secret: Arc::from(ticket_secret.expose()),
                tails,
                allowed_origins: Arc::new(cors_origins),
                heartbeat: std::time::Duration::from_secs(15),
                slow_client_limit: sortie_gateway::attach::SLOW_CLIENT_LIMIT,
            })
        } else {
            axum::Router::new()
        };
        let signins = Arc::new(sortie_server::signin::SignIns::default());
        let mut webhook_exempt = Vec::new();
        for text in args.webhook_exempt.iter().filter(|t| !t.is_empty()) {
            let cidr = sortie_protocol::egress::Cidr::parse(text)
                .with_context(|| format!("--webhook-exempt {text:?} is not an address or CIDR"))?;
            webhook_exempt.push(cidr);
        }
        if roles.contains(&ServeRole::Api) {
            print_signin_link(&data_dir, address, &signins);
            tokio::spawn(sortie_server::events::prune_forever(store.clone()));
            // Webhook deliveries run beside the api role (any number of replicas share the work).
            tokio::spawn(
                sortie_webhooks::Dispatcher {
                    store: store.clone(),
                    keyring: keyring.clone(),
                    exempt: webhook_exempt.clone(),
                    backoff: sortie_webhooks::Backoff::default(),
                    tick: std::time::Duration::from_millis(500),
                }
                .run(),
            );
        }
        let state = ApiState {
            store: store.clone(),
            agents: Arc::new(agents),
            ticket_secret,
            keyring,
            signins,
            webhook_exempt: Arc::new(webhook_exempt),
        };
        // MCP over streamable HTTP at /mcp: its tools call the api router in process with each request's
        // token, so the token's workspace and role apply as over REST.
        let gateway = if roles.contains(&ServeRole::Api) {
            let api = sortie_mcp::RouterApi(sortie_server::router(state.clone()));
            let mcp = axum::Router::new()
                .nest_service("/mcp", sortie_mcp::http_service(Arc::new(api)))
                .layer(axum::middleware::from_fn_with_state(
                    state.clone(),
                    sortie_server::require_bearer,
                ));
            gateway.merge(mcp)
        } else {
            gateway
        };
        // A client that leaves a write blocked past the limit (a stalled stream) is reset, never waited for.
        let listener = sortie_gateway::stall::StalledWrites::new(listener, sortie_gateway::attach::SLOW_CLIENT_LIMIT);
        sortie_server::run_with_limits(
            listener,
            state,
            gateway,
            Some(sortie_web::router()),
            descriptors.listener_limits(),
            stopped(),
        )
        .await
        .context("the server failed")?;
    } else {
        stopped().await;
    }
    if let Some(task) = worker_task {
        let _ = task.await;
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the most this process may open without
/// privileges it should not need) and returns the limit in force. A failure keeps the soft limit:
/// the caps sized from it are then smaller, never unsafe.
fn raise_open_files_limit() -> u64 {
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

/// The worker role on the local sandbox runtime, configured from flags and env.
fn build_worker(
    data_dir: &Path,
    args: &WorkerArgs,
    store: Arc<SqlStore>,
    keyring: Arc<sortie_store::KeyRing>,
) -> anyhow::Result<Worker> {
    use std::os::unix::fs::PermissionsExt;
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the worker runs sandboxes, which needs root: sortie joins each sandbox's cgroups and drops it to an \
         unprivileged uid itself. Run `sudo sortie serve`, or `sortie serve --roles api,gateway` to serve \
         without the worker (a worker elsewhere runs the sessions)"
    );
    let work_dir = args.work_dir.clone().unwrap_or_else(|| data_dir.join("work"));
    if work_dir.starts_with(data_dir) {
        // The sandbox uid must pass through the data dir to its workspace: searchable, not listable.
        // Its own files (the database, the admin token) stay private to root.
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("cannot open {} for the sandbox uid", data_dir.display()))?;
        for name in [DATABASE_FILE, "sortie.db-wal", "sortie.db-shm"] {
            let path = data_dir.join(name);
            if path.exists() {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    std::fs::create_dir_all(&work_dir).with_context(|| format!("cannot create {}", work_dir.display()))?;
    std::fs::set_permissions(&work_dir, std::fs::Permissions::from_mode(0o755))?;
    let mut local = LocalConfig::new(work_dir.join("state"));
    // The tools the operator's PATH names, as `sortie doctor` finds them.
    for (tool, slot) in [("bwrap", &mut local.bwrap), ("setpriv", &mut local.setpriv)] {
        *slot = crate::doctor::on_path(tool).unwrap_or_else(|| PathBuf::from(tool));
    }
    local.sandbox_uid = args.sandbox_uid;
    local.sandbox_gid = args.sandbox_uid;
    // Sandboxes outlive a restart of serve (the next one adopts them), for this long at most.
    local.keeper = Some(sortie_sandbox::local::Keeper {
        program: std::env::current_exe().context("cannot find the sortie binary")?,
        args: vec!["sandbox".into(), "keep".into()],
        orphan_grace: std::time::Duration::from_secs(args.sandbox_orphan_grace.max(1)),
    });
    let runtime = LocalRuntime::new(local).context(
        "the worker cannot run sandboxes on this host (`sortie doctor` says what is missing; \
         `sortie serve --roles api,gateway` runs without the worker)",
    )?;
    // Refused here, once, rather than as SANDBOX_START_FAILED on every session.
    if let Some(blocked) = runtime.unreachable_parent(&work_dir.join("sessions")) {
        anyhow::bail!(
            "the work dir {} is not reachable by the sandbox uid {}: {} is not searchable by it. Use the default \
             data dir as root ({}), put --data-dir or --work-dir under a directory others may search, or `chmod o+x {}`",
            work_dir.display(),
            args.sandbox_uid,
            blocked.display(),
            config::SYSTEM_DATA_DIR,
            blocked.display()
        );
    }

    let mut exe = std::env::current_exe().context("cannot find the sortie binary")?;
    if !runtime.is_reachable(&exe) {
        // The sandbox uid cannot reach where this binary lives (`~/.cargo/bin` under a 0700 home, a
        // private checkout): the sandboxes run a copy (the scripted agent is in it).
        let bin = work_dir.join("bin");
        std::fs::create_dir_all(&bin)?;
        std::fs::copy(&exe, bin.join("sortie")).context("cannot copy sortie for the sandboxes")?;
        exe = bin.join("sortie");
    }

    let mut config = WorkerConfig::new(work_dir, exe);
    config.sandboxes_per_workspace = args.sandboxes_per_workspace.max(1);
    config.turn_timeout = std::time::Duration::from_secs(args.turn_timeout.max(1));
    config.idle_grace = std::time::Duration::from_secs(args.idle_grace);
    config.setup_timeout = std::time::Duration::from_secs(args.setup_timeout.max(1));
    config.limits.disk_bytes = args.sandbox_disk_mib << 20;
    config.agent_profiles = args.agent_profiles.clone();
    config.agents_dir = Some(args.agents_dir.clone().unwrap_or_else(|| config::agents_dir(data_dir)));
    config.keyring = Some(keyring);
    for (api, value) in [
        ("anthropic", &args.upstream_anthropic),
        ("openai", &args.upstream_openai),
        ("gemini", &args.upstream_gemini),
    ] {
        let Some(url) = value.as_ref().filter(|u| !u.is_empty()) else {
            continue;
        };
        anyhow::ensure!(
            url.starts_with("https://") || url.starts_with("http://"),
            "the {api} upstream {url:?} is not an http(s) URL"
        );
        match api {
            "anthropic" => config.model_upstreams.anthropic = url.clone(),
            "openai" => config.model_upstreams.openai = url.clone(),
            _ => config.model_upstreams.gemini = url.clone(),
        }
    }
    if let Some(ca_file) = args.forge_ca_file.as_ref().filter(|p| !p.as_os_str().is_empty()) {
        let extra =
            std::fs::read(ca_file).with_context(|| format!("cannot read the forge CA file {}", ca_file.display()))?;
        config.forge_http = Some(
            sortie_gateway::git::http::forge_client(&sortie_gateway::git::http::ForgeTls {
                extra_roots_pem: extra.clone(),
            })
            .with_context(|| format!("the forge CA file {}", ca_file.display()))?,
        );
        // Host-side git takes one bundle: the platform's roots, then the operator's.
        let platform = std::env::var_os("SSL_CERT_FILE")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| "/etc/ssl/certs/ca-certificates.crt".into());
        // git takes this bundle instead of its own: without the platform's roots every public forge
        // would fail, so a missing bundle stops the start rather than the first clone.
        let mut bundle = std::fs::read(&platform).with_context(|| {
            format!(
                "--forge-ca-file needs the platform's CA bundle at {} (set SSL_CERT_FILE to it)",
                platform.display()
            )
        })?;
        bundle.push(b'\n');
        bundle.extend_from_slice(&extra);
        let path = config.work_dir.join("forge-ca-bundle.pem");
        std::fs::write(&path, bundle).with_context(|| format!("cannot write {}", path.display()))?;
        config.forge_ca_bundle = Some(path);
    }
    config.setup_hosts = match &args.setup_hosts {
        Some(hosts) => hosts.iter().filter(|h| !h.is_empty()).cloned().collect(),
        None => {
            let home = std::env::var_os("HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_default();
            sortie_gateway::egress::registries::from_host(&home)
        }
    };
    for text in args.egress_exempt.iter().filter(|t| !t.is_empty()) {
        let cidr = sortie_gateway::egress::policy::Cidr::parse(text)
            .with_context(|| format!("--egress-exempt {text:?} is not an address or CIDR"))?;
        config.egress_exempt.push(cidr);
    }
    let mut table = std::collections::HashMap::new();
    for pair in args.egress_hosts.iter().filter(|t| !t.is_empty()) {
        let (name, ip) = pair
            .split_once('=')
            .with_context(|| format!("--egress-hosts {pair:?} is not name=ip"))?;
        let ip: std::net::IpAddr = ip
            .parse()
            .with_context(|| format!("--egress-hosts {pair:?}: {ip:?} is not an IP address"))?;
        table.entry(name.to_ascii_lowercase()).or_insert_with(Vec::new).push(ip);
    }
    if !table.is_empty() {
        config.resolver = Arc::new(TableFirst(sortie_gateway::egress::proxy::StaticResolver(table)));
    }
    Ok(Worker::new(config, store, Arc::new(runtime)))
}

/// Fixed answers first (operator-configured internal names), then the host's resolver.
struct TableFirst(sortie_gateway::egress::proxy::StaticResolver);

impl sortie_gateway::egress::proxy::Resolver for TableFirst {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<Vec<std::net::SocketAddr>>> + Send + 'a>> {
        Box::pin(async move {
            match self.0.resolve(host, port).await {
                Ok(found) => Ok(found),
                Err(_) => sortie_gateway::egress::proxy::SystemResolver.resolve(host, port).await,
            }
        })
    }
}

/// Prints a one-time link that signs a browser in to the dashboard as the saved admin token.
fn print_signin_link(data_dir: &Path, address: std::net::SocketAddr, signins: &sortie_server::signin::SignIns) {
    let Ok(token) = std::fs::read_to_string(data_dir.join(ADMIN_TOKEN_FILE)) else {
        announce(&format!("dashboard: http://{address}/ (sign in with a token)"));
        return;
    };
    match signins.issue_code(&tokens::hash_token(token.trim())) {
        Ok(code) => {
            let mut shown = address;
            if shown.ip().is_unspecified() {
                shown.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            let minutes = sortie_server::signin::CODE_TTL.as_secs() / 60;
            announce(&format!(
                "dashboard sign-in link (works once, for {minutes} minutes): http://{shown}/signin#{code}"
            ));
        }
        Err(error) => tracing::warn!(%error, "no randomness for a sign-in code"),
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

/// A line on stdout for whoever started the server; a reader that went away must not stop it.
fn announce(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// A browser origin as the `Origin` header carries it: `http(s)://host[:port]`, nothing after.
fn valid_origin(origin: &str) -> anyhow::Result<String> {
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .unwrap_or_default();
    let well_formed = !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    anyhow::ensure!(
        well_formed,
        "--cors-origin {origin:?} is not an origin: give scheme and host (and port), e.g. https://tools.example.com"
    );
    Ok(origin.to_owned())
}
