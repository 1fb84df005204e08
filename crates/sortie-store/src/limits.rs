//! A workspace's quotas and default budget as the paths that create sessions apply them (the api, and
//! the worker acting on a forge's request), so both refuse the same way.

use sortie_protocol::api::{Budget, utc_day_from_epoch_ms};

use crate::{ControlPlane, StoreResult, now_ms};

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

/// What a session about to be created (`creating`) or steered may not pass: `Ok(Some(breach))` when
/// one of the workspace's quotas is used up.
pub async fn quota_breach(
    store: &dyn ControlPlane,
    workspace_id: &str,
    creating: bool,
) -> StoreResult<Option<QuotaBreach>> {
    let quotas = store.workspace_limits(workspace_id).await?.quotas;
    let now = now_ms();
    let today = utc_day_from_epoch_ms(now);
    if creating && let Some(limit) = quotas.sessions_per_day {
        let midnight = now - now.rem_euclid(86_400_000);
        let used = store.sessions_created_since(workspace_id, midnight).await?;
        if used >= limit {
            return Ok(Some(QuotaBreach {
                quota: "sessions_per_day",
                limit,
                used,
            }));
        }
    }
    if let Some(limit) = quotas.tokens_per_month {
        let first_of_month = format!("{}-01", &today[..7]);
        let used = store.workspace_tokens_since(workspace_id, &first_of_month).await?;
        if used >= limit {
            return Ok(Some(QuotaBreach {
                quota: "tokens_per_month",
                limit,
                used,
            }));
        }
    }
    Ok(None)
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
