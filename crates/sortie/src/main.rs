//! The `sortie` binary: `serve` runs the roles, the admin commands work on the store directly, and
//! the client commands (`sortie-client`) talk to a running server over REST. `main` parses, sets up
//! logging and hands off; each command lives in its own module or crate.

use sortie_client::say;

mod admin;
mod agents;
mod bench;
mod cli;
mod config;
mod doctor;
mod driver;
mod sandbox;
mod serve;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

// The driver and the gateway allocate per part (JSON in, JSON out); glibc's malloc under tokio's
// threads cost a third of the driver's time (perf), mimalloc halves it: `sortie-driver`'s flood
// bench goes from ~45k to ~75k parts/s on two cores.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // One TLS provider for the whole process (ref/deps.md §3): reqwest and the gateway share it.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    if let Command::GitLaunch = cli.command {
        // Before anything else: it is on the path of every git request (see `git::launch`).
        let error = sortie_gateway::git::launch::exec_from_stdin();
        eprintln!("error: cannot launch git: {error}");
        return ExitCode::from(127);
    }
    init_tracing(matches!(cli.command, Command::Serve(_) | Command::Driver(_)));
    if let Command::Sandbox(cli::SandboxCommand::Keep(args)) = &cli.command {
        return sandbox::keep(args).unwrap_or_else(|error| {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        });
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve::serve(cli.client, *args).await,
            Command::Driver(args) => driver::run(*args).await,
            Command::Sandbox(command) => sandbox::run(command).await,
            Command::Relay(args) => sandbox::relay(args).await,
            Command::ScriptedAgent => scripted_agent().await,
            Command::GitLaunch => Err(anyhow::anyhow!("git-launch runs before the runtime starts")),
            Command::Doctor(args) => doctor::run(&cli.client, args).await,
            Command::Workspace(command) => admin::workspace(&cli.client, command).await,
            Command::Token(command) => admin::token(&cli.client, command).await,
            Command::Gc(args) => admin::gc(&cli.client, args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Agents(command) => agents::run(&cli.client, command).await,
            Command::Client(command) => {
                let target = sortie_client::Target {
                    server: cli.client.server,
                    json: cli.client.json,
                    admin_token_file: config::data_dir(cli.client.data_dir).join(config::ADMIN_TOKEN_FILE),
                };
                sortie_client::run(target, command).await
            }
        }
    });
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// `sortie scripted-agent`: ACP on stdin/stdout until the client goes. It exits without dropping the
/// runtime: that would wait for the thread blocked on stdin and for turns still running (a `hang:`).
async fn scripted_agent() -> ! {
    let code = match sortie_scripted_agent::serve_stdio().await {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("sortie scripted-agent: {error:#}");
            1
        }
    };
    std::process::exit(code)
}

/// Logs go to stderr; `SORTIE_LOG` (or `RUST_LOG`) sets the filter. Client commands log only warnings.
fn init_tracing(serving: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if serving { "info,sqlx=warn" } else { "warn" };
    let filter = std::env::var(config::env::LOG)
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|text| EnvFilter::try_new(text).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    // Colour only for a person at a terminal: a log file or the journal gets plain text.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
}
