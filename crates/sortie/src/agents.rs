//! `sortie agents`: installs an agent's pinned npm package under `<data dir>/agents/<id>` (the
//! worker binds that directory read-only into the agent's sandboxes) and lists the agents sortie
//! knows, whether each is installed and what it needs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use sortie_driver::profile::{self, AgentProfile, ModelApi};

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

fn needs(agent: &AgentProfile) -> String {
    match agent.model_api {
        ModelApi::Anthropic => "an anthropic key (sortie keys set anthropic)".into(),
        ModelApi::Openai => "an openai key (sortie keys set openai)".into(),
        ModelApi::Gemini => "a gemini key (sortie keys set gemini)".into(),
        ModelApi::None => "no model key".into(),
    }
}

/// Where this host runs `agent` from: its install under `agents_dir`, else its command next to the
/// running binary or on PATH; `None` when it has none (what `agents list` and `/v1/agents` report).
pub fn locate(agents_dir: &Path, agent: &AgentProfile) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(ToOwned::to_owned));
    profile::installed_command(agents_dir, agent)
        .or_else(|| profile::resolve_command(&agent.command, beside.as_deref(), Some(&path)))
}

/// The agents this host can run, looked up at each question (an install while `serve` runs counts).
pub struct HostAgents {
    pub profiles: Vec<AgentProfile>,
    pub agents_dir: PathBuf,
}

impl sortie_server::AgentProbe for HostAgents {
    fn needs(&self, id: &str) -> Option<String> {
        let profile = self.profiles.iter().find(|p| p.id == id)?;
        locate(&self.agents_dir, profile)
            .is_none()
            .then(|| install_hint(profile))
    }
}

/// What a host without `agent` does to get it.
pub fn install_hint(agent: &AgentProfile) -> String {
    match &agent.npm_package {
        Some(_) => format!("sortie agents install {}", agent.id),
        None => format!("put {} on PATH", agent.command),
    }
}

fn list(agents_dir: &Path, profiles: &[AgentProfile], json: bool) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for agent in profiles {
        let found = locate(agents_dir, agent);
        rows.push(serde_json::json!({
            "id": agent.id,
            "installed": found.is_some(),
            "command": found.map(|p| p.display().to_string()),
            "npm_package": agent.npm_package,
            "installed_version": profile::installed_version(agents_dir, agent),
            "outdated": profile::install_outdated(agents_dir, agent),
            "install": install_hint(agent),
            "needs": needs(agent),
        }));
    }
    if json {
        say!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    for row in &rows {
        let state = if row["outdated"] == true {
            format!(
                "outdated {} (sortie agents install {})",
                row["installed_version"].as_str().unwrap_or("?"),
                row["id"].as_str().unwrap_or("")
            )
        } else if row["installed"] == true {
            "installed".to_owned()
        } else {
            format!("not installed ({})", row["install"].as_str().unwrap_or(""))
        };
        say!(
            "{:<12} {:<40} needs {}",
            row["id"].as_str().unwrap_or(""),
            state,
            row["needs"].as_str().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}
