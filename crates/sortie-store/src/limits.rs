//! A workspace's quotas and default budget. The store enforces the quotas where sessions and turns
//! are written (`create_session`, `steer`: every path, the api's, the dashboard's chat and a forge's
//! request alike); the default budget is applied by the paths that create sessions.

use sortie_protocol::api::Budget;

use crate::{ControlPlane, StoreResult};

/// A quota a new session or turn would pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaBreach {
    /// `sessions_per_day` or `tokens_per_month`.
    pub quota: &'static str,
    pub limit: u64,
    pub used: u64,
}

impl std::fmt::Display for QuotaBreach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.quota {
            "sessions_per_day" => write!(
                f,
                "the workspace created {} of its {} sessions for today (UTC); an admin raises the quota with PUT /v1/limits",
                self.used, self.limit
            ),
            _ => write!(
                f,
                "the workspace used {} of its {} model tokens this month (UTC); an admin raises the quota with PUT /v1/limits",
                self.used, self.limit
            ),
        }
    }
}

/// The budget a new session gets: what it asked for, field by field, else the workspace's default.
pub async fn session_budget(
    store: &dyn ControlPlane,
    workspace_id: &str,
    asked: Option<Budget>,
) -> StoreResult<Budget> {
    let default = store.workspace_limits(workspace_id).await?.budget;
    Ok(asked.unwrap_or_default().or(default))
}
