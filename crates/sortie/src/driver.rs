//! `sortie driver`: runs one agent behind the driver API on a Unix socket, outside any sandbox too,
//! so that it can be tested and used alone. In a sandbox it serves on the listening socket the worker
//! passes as its stdin, and makes itself undumpable first: the agent (same uid) can then neither read
//! its memory nor take its descriptors.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sortie_driver::agent::AgentLaunch;
use sortie_driver::delivery::{self, DeliveryConfig};
use sortie_driver::driver::{Driver, DriverConfig};
use sortie_driver::profile;
use sortie_driver::secrets::KnownSecrets;

use crate::cli::DriverArgs;

pub async fn run(args: DriverArgs) -> anyhow::Result<ExitCode> {
    // Before anything else: from here on, a process of the same uid (the agent) cannot ptrace this
    // one, read its memory or environment, or take a descriptor from it.
    nix::sys::prctl::set_dumpable(false).context("cannot make the driver undumpable")?;
    let profiles = profile::load(args.profiles.as_deref())?;
    let profile = profile::find(&profiles, &args.agent)?.rendered(&profile::Render {
        model_proxy: args.model_proxy.clone(),
        model: args.model.clone(),
    });
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".to_owned());
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(ToOwned::to_owned));
    let installed = args
        .agents_dir
        .as_deref()
        .and_then(|dir| profile::installed_command(dir, &profile));
    let Some(command) =
        installed.or_else(|| profile::resolve_command(&profile.command, beside.as_deref(), Some(&path)))
    else {
        eprintln!(
            "error: agent {:?}: cannot find {:?} among the installed agents, next to sortie or on PATH \
             ({})",
            profile.id,
            profile.command,
            crate::agents::install_hint(&profile)
        );
        return Ok(ExitCode::from(sortie_protocol::driver::EXIT_AGENT_NOT_FOUND));
    };
    let workspace = std::fs::canonicalize(&args.workspace)
        .with_context(|| format!("--workspace {} does not exist", args.workspace.display()))?;
    std::fs::create_dir_all(&args.home).with_context(|| format!("cannot create --home {}", args.home.display()))?;
    let home = std::fs::canonicalize(&args.home)?;
    let turns_dir = args.state_dir.unwrap_or_else(|| home.join(".sortie/turns"));
    profile
        .write_files(&home)
        .with_context(|| format!("cannot write agent {:?}'s files under {}", profile.id, home.display()))?;
    let delivery = match args.branch {
        Some(branch) => {
            delivery::validate_branch(&branch)?;
            let known_secrets = match &args.secret_digests {
                Some(path) => delivery::load_known_secrets(path)?,
                None => KnownSecrets::default(),
            };
            Some(DeliveryConfig {
                branch,
                remote: args.remote,
                author_name: args.author_name,
                author_email: args.author_email,
                known_secrets: Arc::new(known_secrets),
                known_secrets_file: args.secret_digests.clone(),
                git_timeout: delivery::GIT_TIMEOUT,
                unreachable_wait: delivery::UNREACHABLE_WAIT,
            })
        }
        None => None,
    };

    // The agent's whole environment: nothing of the driver's leaks in but PATH.
    let mut env = vec![
        ("HOME".to_owned(), home.to_string_lossy().into_owned()),
        ("PATH".to_owned(), path),
        ("LANG".to_owned(), "C.UTF-8".to_owned()),
    ];
    env.extend(profile.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    if let Some(socket) = &args.egress_socket {
        sortie_driver::relay::start(socket)
            .await
            .with_context(|| format!("cannot listen on {}", sortie_driver::relay::RELAY_ADDRESS))?;
        env.extend(sortie_driver::relay::proxy_env(sortie_driver::relay::RELAY_ADDRESS));
    }
    let config = DriverConfig {
        launch: AgentLaunch {
            command,
            args: profile.args.clone(),
            env,
            cwd: workspace,
            mode: profile.mode.clone(),
            resume_session: None,
        },
        turns_dir,
        session_id: args.session,
        turn_timeout: Duration::from_secs(args.turn_timeout.max(1)),
        start_timeout: Duration::from_secs(args.start_timeout.max(1)),
        kill_grace: Duration::from_secs(args.kill_grace),
        persist_dir: home.join(".sortie"),
        delivery,
    };

    let listener = match &args.socket {
        Some(socket) => {
            if socket.exists() {
                std::fs::remove_file(socket).with_context(|| format!("cannot replace {}", socket.display()))?;
            }
            let listener = tokio::net::UnixListener::bind(socket)
                .with_context(|| format!("cannot listen on {}", socket.display()))?;
            println!("sortie driver listening on {}", socket.display());
            listener
        }
        None => listener_from_stdin()?,
    };
    let driver = Driver::new(config);
    sortie_driver::api::run(listener, driver.clone(), crate::serve::shutdown_signal())
        .await
        .context("the driver API failed")?;
    driver.shutdown().await;
    Ok(ExitCode::SUCCESS)
}

/// The listening socket the worker passed as stdin, taken over (its copy is close-on-exec) and stdin
/// pointed at /dev/null, so no child of the driver ever inherits the driver's socket.
fn listener_from_stdin() -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::fd::AsFd;
    let owned = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .context("cannot take the driver socket from stdin")?;
    let listener = std::os::unix::net::UnixListener::from(owned);
    // Not a listening Unix socket: a clear error instead of a driver that never answers.
    listener
        .local_addr()
        .context("stdin is not the driver's listening socket")?;
    listener.set_nonblocking(true)?;
    let null = std::fs::File::open("/dev/null").context("cannot open /dev/null")?;
    nix::unistd::dup2_stdin(&null).context("cannot point stdin at /dev/null")?;
    tokio::net::UnixListener::from_std(listener).context("cannot serve the driver socket")
}
