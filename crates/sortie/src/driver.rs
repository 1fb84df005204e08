//! `sortie driver`: runs one agent behind the driver API on a Unix socket, outside any sandbox too,
//! so that it can be tested and used alone.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use sortie_driver::agent::AgentLaunch;
use sortie_driver::driver::{Driver, DriverConfig};
use sortie_driver::profile;

use crate::cli::DriverArgs;

pub async fn run(args: DriverArgs) -> anyhow::Result<ExitCode> {
    let profiles = profile::load(args.profiles.as_deref())?;
    let profile = profile::find(&profiles, &args.agent)?;
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".to_owned());
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(ToOwned::to_owned));
    let command = profile::resolve_command(&profile.command, beside.as_deref(), Some(&path)).with_context(|| {
        format!(
            "agent {:?}: cannot find {:?} next to sortie or on PATH",
            profile.id, profile.command
        )
    })?;
    let workspace = std::fs::canonicalize(&args.workspace)
        .with_context(|| format!("--workspace {} does not exist", args.workspace.display()))?;
    std::fs::create_dir_all(&args.home).with_context(|| format!("cannot create --home {}", args.home.display()))?;
    let home = std::fs::canonicalize(&args.home)?;
    let turns_dir = args.state_dir.unwrap_or_else(|| home.join(".sortie/turns"));

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
