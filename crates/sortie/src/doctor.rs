//! `sortie doctor`: what this host has of what sortie needs, one line a check with the fix for each
//! miss: the worker's host checks (`sortie_worker::host`) and the default workspace's model keys.

use std::path::{Path, PathBuf};

use sortie_worker::host::{Check, HostInputs, host_checks};
use std::process::ExitCode;

use sortie_driver::profile;
use sortie_store::{ControlPlane, Secrets};

use crate::cli::{ClientArgs, DoctorArgs};
use crate::config;
use crate::say;

/// The model keys of the default workspace, from the store when it exists.
async fn keys(data_dir: &Path, database_url: Option<String>) -> Check {
    let url = config::database_url(database_url, data_dir);
    if url.starts_with("sqlite://") && !data_dir.join(config::DATABASE_FILE).exists() {
        return Check::ok(
            "keys",
            "no store yet: `sortie serve` makes it; then `sortie keys set anthropic < key.txt`",
        );
    }
    let store = match sortie_store::SqlStore::connect(&url).await {
        Ok(store) => store,
        Err(error) => {
            return Check::miss(
                "keys",
                false,
                format!("cannot open the store to list the keys: {error}"),
            );
        }
    };
    let listed = match store.workspace_by_name("default").await {
        Ok(workspace) => store
            .model_keys(&workspace.id)
            .await
            .map(|keys| keys.iter().map(|k| k.api.to_string()).collect::<Vec<_>>()),
        Err(error) => Err(error),
    };
    store.close().await;
    match listed {
        Ok(apis) if apis.is_empty() => Check::miss(
            "keys",
            false,
            "workspace default has no model key: the model agents need one (`sortie keys set anthropic < key.txt`); the scripted agent does not",
        ),
        Ok(apis) => Check::ok("keys", format!("workspace default has keys for {}", apis.join(", "))),
        Err(error) => Check::miss("keys", false, format!("cannot list the model keys: {error}")),
    }
}

fn print(check: &Check) {
    let mark = match (check.ok, check.required) {
        (true, _) => "ok  ",
        (false, true) => "FIX ",
        (false, false) => "warn",
    };
    say!("{mark} {:<10} {}", check.name, check.says);
}

pub async fn run(client: &ClientArgs, args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let data_dir = config::data_dir(client.data_dir.clone());
    let profiles = profile::load(args.agent_profiles.as_deref())?;
    let agents_dir = args.agents_dir.clone().unwrap_or_else(|| config::agents_dir(&data_dir));
    let mut checks = host_checks(&HostInputs {
        data_dir: &data_dir,
        work_dir: std::env::var_os(sortie_worker::settings::env::WORK_DIR)
            .filter(|v| !v.is_empty())
            .map_or_else(|| data_dir.join("work"), PathBuf::from),
        sandbox_uid: args.sandbox_uid,
        agents_dir: &agents_dir,
        profiles: &profiles,
    });
    checks.push(keys(&data_dir, args.store.database_url.clone()).await);
    if client.json {
        say!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        checks.iter().for_each(print);
    }
    let failed = checks.iter().any(|c| c.required && !c.ok);
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
