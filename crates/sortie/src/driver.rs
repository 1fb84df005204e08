//! `sortie driver`: one agent behind the driver API (`sortie_driver::launch`), in a sandbox or alone.

use std::process::ExitCode;

use sortie_driver::launch::{DriverSettings, LaunchError};

pub async fn run(settings: DriverSettings) -> anyhow::Result<ExitCode> {
    match settings.serve(crate::serve::shutdown_signal()).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(error @ LaunchError::AgentNotFound { .. }) => {
            eprintln!("error: {error}");
            Ok(ExitCode::from(sortie_protocol::driver::EXIT_AGENT_NOT_FOUND))
        }
        Err(error) => Err(error.into()),
    }
}
