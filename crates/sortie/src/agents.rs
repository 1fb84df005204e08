//! `sortie agents`: installs an agent's pinned npm package under `<data dir>/agents/<id>` (the
//! worker binds that directory read-only into the agent's sandboxes) and lists the agents sortie
//! knows, whether each is installed and what it needs.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use sortie_driver::profile::{self, AgentProfile, install_hint, locate, needs};

use crate::cli::{AgentsCommand, ClientArgs};
use crate::config;
use crate::say;

pub async fn run(client: &ClientArgs, command: AgentsCommand) -> anyhow::Result<ExitCode> {
    let data_dir = config::data_dir(client.data_dir.clone());
    match command {
        AgentsCommand::Install {
            id,
            profiles,
            agents_dir,
        } => {
            let profiles = profile::load(profiles.as_deref())?;
            let agent = profile::find(&profiles, &id)?;
            install(&agents_dir.unwrap_or_else(|| config::agents_dir(&data_dir)), &agent).await
        }
        AgentsCommand::List { profiles, agents_dir } => {
            let profiles = profile::load(profiles.as_deref())?;
            list(
                &agents_dir.unwrap_or_else(|| config::agents_dir(&data_dir)),
                &profiles,
                client.json,
            )
        }
    }
}

async fn install(agents_dir: &Path, agent: &AgentProfile) -> anyhow::Result<ExitCode> {
    use std::os::unix::fs::PermissionsExt;
    let Some(package) = &agent.npm_package else {
        anyhow::bail!(
            "agent {:?} has no npm package to install: put {:?} on PATH or name its absolute path in an agent manifest",
            agent.id,
            agent.command
        );
    };
    let dir = profile::install_dir(agents_dir, &agent.id);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Sandboxes run as an unprivileged uid: it must reach the install, read-only.
    for path in [agents_dir, dir.as_path()] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    eprintln!("installing {package} into {} …", dir.display());
    let status = tokio::process::Command::new("npm")
        .args(["install", "--no-audit", "--no-fund", "--omit=dev", "--prefix"])
        .arg(&dir)
        .arg(package)
        .status()
        .await
        .context("cannot run npm (is Node.js installed?)")?;
    anyhow::ensure!(status.success(), "npm install {package} failed ({status})");
    let installed = profile::installed_command(agents_dir, agent)
        .with_context(|| format!("{package} installed no {:?} program", agent.command))?;
    say!("installed {} ({package}): {}", agent.id, installed.display());
    Ok(ExitCode::SUCCESS)
}

/// One agent as `sortie agents list` shows it (`--json` prints these).
#[derive(serde::Serialize)]
struct AgentRow<'a> {
    id: &'a str,
    installed: bool,
    command: Option<String>,
    npm_package: Option<&'a str>,
    installed_version: Option<String>,
    outdated: bool,
    install: String,
    needs: &'static str,
}

fn list(agents_dir: &Path, profiles: &[AgentProfile], json: bool) -> anyhow::Result<ExitCode> {
    let rows: Vec<AgentRow<'_>> = profiles
        .iter()
        .map(|agent| {
            let found = locate(agents_dir, agent);
            AgentRow {
                id: &agent.id,
                installed: found.is_some(),
                command: found.map(|p| p.display().to_string()),
                npm_package: agent.npm_package.as_deref(),
                installed_version: profile::installed_version(agents_dir, agent),
                outdated: profile::install_outdated(agents_dir, agent),
                install: install_hint(agent),
                needs: needs(agent),
            }
        })
        .collect();
    if json {
        say!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    for row in &rows {
        let state = if row.outdated {
            format!(
                "outdated {} (sortie agents install {})",
                row.installed_version.as_deref().unwrap_or("?"),
                row.id
            )
        } else if row.installed {
            "installed".to_owned()
        } else {
            format!("not installed ({})", row.install)
        };
        say!("{:<12} {:<40} needs {}", row.id, state, row.needs);
    }
    Ok(ExitCode::SUCCESS)
}
