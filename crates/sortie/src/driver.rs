//! `sortie driver`: runs one agent behind the driver API on a Unix socket, outside any sandbox too,
//! so that it can be tested and used alone.

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
    let command = installed
        .or_else(|| profile::resolve_command(&profile.command, beside.as_deref(), Some(&path)))
        .with_context(|| {
            format!(
                "agent {:?}: cannot find {:?} among the installed agents, next to sortie or on PATH \
                 (sortie agents install {})",
                profile.id, profile.command, profile.id
            )
        })?;
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

    if args.socket.exists() {
        std::fs::remove_file(&args.socket).with_context(|| format!("cannot replace {}", args.socket.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(&args.socket)
        .with_context(|| format!("cannot listen on {}", args.socket.display()))?;
    println!("sortie driver listening on {}", args.socket.display());
    let driver = Driver::new(config);
    sortie_driver::api::run(listener, driver.clone(), crate::serve::shutdown_signal())
        .await
        .context("the driver API failed")?;
    driver.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
