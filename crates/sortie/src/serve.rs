//! `sortie serve`: opens the store, bootstraps the first workspace and admin token, binds the
//! listener and runs the roles it was given (api, gateway, worker, and the webhook dispatcher beside
//! the api) until Ctrl-C or SIGTERM.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use sortie_server::bootstrap;
use sortie_server::{AgentCatalog, ApiState};
use sortie_store::SqlStore;

use crate::cli::{ClientArgs, ServeArgs, ServeRole};
use crate::config::{self, DATABASE_FILE, env};

/// Connections one address may hold to a worker's link listener: a pod's link and its agent's egress
/// connections (each sandbox's own cap is `MAX_CONNECTIONS_PER_SANDBOX`, 128), and a spare.
const LINK_CONNECTIONS_PER_IP: usize = 130;

pub async fn serve(client: ClientArgs, args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Before any role records a metric: a process without the api role serves them on its feed listener.
    sortie_server::install_metrics_recorder();
    // Before anything opens a descriptor: every cap on connections is sized from this limit.
    let descriptors = sortie_server::DescriptorPlan::for_limit(
        bootstrap::raise_open_files_limit(),
        sortie_gateway::egress::proxy::FDS_PER_CONNECTION as u64,
        sortie_server::ConnectionCaps {
            total: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
            per_ip: usize::try_from(args.max_connections_per_ip).unwrap_or(usize::MAX),
        },
    );
    sortie_gateway::egress::proxy::HostConnections::set_process_wide(descriptors.egress_connections);
    tracing::info!(
        open_files = descriptors.open_files_limit,
        reserve = sortie_server::DESCRIPTOR_RESERVE,
        api_connections = descriptors.api_connections,
        api_connections_per_ip = descriptors.api_connections_per_ip,
        tail_connections = descriptors.tail_connections,
        egress_connections = descriptors.egress_connections,
        "file descriptors shared"
    );
    let data_dir = config::data_dir(client.data_dir);
    let database_url = config::database_url(args.store.database_url, &data_dir);
    // Agents an operator's manifest adds are as good as the built-in ones.
    let profiles = sortie_driver::profile::load(args.worker.agent_profiles.as_deref())?;
    let agents_dir = args.worker.agents_dir(&data_dir);
    let mut agents =
        AgentCatalog::for_host(profiles.clone(), agents_dir.clone(), args.default_agent).map_err(anyhow::Error::msg)?;
    if let Some(installed) = &args.agents_installed {
        agents = agents.declared(installed).map_err(anyhow::Error::msg)?;
    }

    // The same host checks as `sortie doctor`: what is missing is said once, at start.
    let work_dir = args.worker.work_dir(&data_dir);
    let checks = sortie_worker::host::host_checks(&sortie_worker::host::HostInputs {
        data_dir: &data_dir,
        work_dir: work_dir.clone(),
        sandbox_uid: args.worker.sandbox_uid,
        agents_dir: &agents_dir,
        profiles: &profiles,
    });
    for check in checks.iter().filter(|c| !c.ok) {
        // The host's checks are about local sandboxes; on Kubernetes the sandboxes are pods.
        if check.required && args.roles.contains(&ServeRole::Worker) && !args.kube.is_kubernetes() {
            tracing::warn!(check = check.name, "{}", check.says);
        } else {
            tracing::info!(check = check.name, "{}", check.says);
        }
    }

    bootstrap::create_data_dir(&data_dir)?;
    let store = Arc::new(
        SqlStore::connect(&database_url)
            .await
            .context("cannot open the store")?,
    );
    if let Some(admin) = bootstrap::first_start(store.as_ref(), store.backend(), &data_dir).await? {
        announce(&format!(
            "created workspace `default` and an admin token (shown once, saved to {}):\n{}",
            admin.saved_to.display(),
            admin.token
        ));
    }
    let ticket_secret = bootstrap::ticket_secret(store.as_ref(), std::env::var(env::TICKET_SECRET).ok()).await?;

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
    bootstrap::check_keyring(store.as_ref(), &keyring, env::KEYRING_KEY).await?;
    let keyring = Arc::new(keyring);
    let roles = args.roles.clone();
    let runs_worker = roles.contains(&ServeRole::Worker);
    if args.worker.feed_listen.is_some() && !runs_worker {
        anyhow::bail!("--feed-listen is the worker's: serve it with --roles worker");
    }
    // The worker's feed listener, for gateways on other hosts.
    let feed_listener = match (runs_worker, args.worker.feed_listen) {
        (true, Some(listen)) => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on --feed-listen {listen}"))?;
            let bound = listener.local_addr().context("the feed listener has no address")?;
            let url = args.worker.advertised_feed(bound)?;
            Some((listener, bound, url))
        }
        _ => None,
    };
    // On Kubernetes, the listener the worker's sandbox pods dial: their links and egress, nothing else.
    let mut pod_links = None;
    let mut worker = if !runs_worker {
        None
    } else if args.kube.is_kubernetes() {
        let listen = args.kube.link_listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on --link-listen {listen}"))?;
        let bound = listener.local_addr().context("the link listener has no address")?;
        let cluster = args.kube.connect(bound.port()).await?;
        tracing::info!(namespace = %cluster.namespace, pool = %cluster.pool, link_url = %cluster.link_url, "sandboxes are pods");
        pod_links = Some((listener, bound, cluster.links));
        Some(
            args.worker
                .resolve_on_pods(&data_dir, store.clone(), keyring.clone(), cluster.pods)?,
        )
    } else {
        if work_dir.starts_with(&data_dir) && nix::unistd::geteuid().is_root() {
            open_data_dir_to_sandboxes(&data_dir)?;
        }
        let exe = std::env::current_exe().context("cannot find the sortie binary")?;
        Some(args.worker.resolve(&data_dir, exe, store.clone(), keyring.clone())?)
    };
    // The worker's feed, with its /metrics and /healthz.
    let feed = match (&mut worker, feed_listener) {
        (Some(worker), Some((listener, _, url))) => {
            worker.advertise_feed(&url);
            let router = worker
                .feed_router(Arc::from(ticket_secret.expose()))
                .merge(sortie_server::operations_router());
            Some((listener, router, url))
        }
        _ => None,
    };
    // Any gateway serves any live tail: this process's worker, a worker beside it on this host, or the
    // worker the store says runs the turn, through its feed.
    let tails: Arc<dyn sortie_gateway::live::LiveTails> = Arc::new(sortie_gateway::live::RoutedTails {
        near: match &worker {
            Some(worker) => worker.live_tails(),
            None => sortie_worker::work_dir_tails(&work_dir),
        },
        store: store.clone(),
        secret: Arc::from(ticket_secret.expose()),
        connections: Arc::new(tokio::sync::Semaphore::new(
            descriptors.tail_connections.min(tokio::sync::Semaphore::MAX_PERMITS),
        )),
    });

    let cors_origins = args
        .cors_origin
        .iter()
        .map(|origin| {
            anyhow::ensure!(
                sortie_gateway::attach::is_origin(origin),
                "--cors-origin {origin:?} is not an origin: give scheme and host (and port), e.g. https://tools.example.com"
            );
            Ok(origin.clone())
        })
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
    // The api's listener and the feed's share the API's descriptors; the link listener's connections
    // are the pods' egress, within the egress budget.
    let serves_api = roles.contains(&ServeRole::Api) || roles.contains(&ServeRole::Gateway);
    let listeners = usize::from(serves_api) + usize::from(feed.is_some());
    let listener_limits = descriptors.shared_listener_limits(listeners);
    if let Some((listener, router, url)) = feed {
        announce(&format!("sortie worker feed on {url}"));
        let stopped = stopped();
        let limits = listener_limits.clone();
        tokio::spawn(async move {
            if let Err(error) = sortie_server::serve_bounded(listener, router, limits, stopped).await {
                tracing::error!(%error, "the worker's feed listener stopped");
            }
        });
    }
    // Served before the reconciliation: a pod that outlived the last process dials its worker here to be
    // taken up.
    if let Some((listener, bound, links)) = pod_links {
        announce(&format!("sortie worker links on http://{bound}"));
        let stopped = stopped();
        // Bounded as the api's, and closer per address: every sandbox pod (an address each) reaches this
        // listener, and one must not hold the slots of the others.
        let limits = sortie_server::ListenerLimits {
            max_connections: descriptors.egress_connections.max(1),
            max_connections_per_ip: LINK_CONNECTIONS_PER_IP,
            ..listener_limits.clone()
        };
        let router = sortie_gateway::links::link_router(links);
        tokio::spawn(async move {
            if let Err(error) = sortie_server::serve_bounded(listener, router, limits, stopped).await {
                tracing::error!(%error, "the worker's link listener stopped");
            }
        });
    }
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
            announce(&bootstrap::signin_banner(&data_dir, address, &signins));
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
            listener_limits,
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

/// The sandbox uid must pass through the data dir to its workspace: searchable, not listable. Its
/// own files (the database, the admin token) stay private to root.
fn open_data_dir_to_sandboxes(data_dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o711))
        .with_context(|| format!("cannot open {} for the sandbox uid", data_dir.display()))?;
    for name in [DATABASE_FILE, "sortie.db-wal", "sortie.db-shm"] {
        let path = data_dir.join(name);
        if path.exists() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
    }
    Ok(())
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
