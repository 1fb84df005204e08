//! The store's errors: domain refusals the api turns into codes, and faults.

use sortie_protocol::SessionPhase;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("the session takes no more turns: it is {0}")]
    NotSteerable(&'static str),
    #[error("the session already has {0} turns waiting")]
    TurnQueueFull(u32),
    #[error("the session's prompts would add up to {would_be} bytes, over the limit of {limit}")]
    PromptsTooLarge { would_be: u64, limit: u64 },
    #[error("no turn is running")]
    NoTurnRunning,
    /// A quota of the workspace is used up.
    #[error("{0}")]
    QuotaExceeded(crate::limits::QuotaBreach),
    #[error("the session has a turn in flight (it is {0})")]
    SessionActive(SessionPhase),
    #[error("illegal transition {from} -> {to}")]
    IllegalTransition { from: String, to: String },
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error("store fault: {0}")]
    Internal(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        match &error {
            sqlx::Error::RowNotFound => StoreError::NotFound,
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Tls(_) => {
                StoreError::Unavailable(error.to_string())
            }
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict(db.message().to_owned()),
            _ => StoreError::Internal(error.to_string()),
        }
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(error: sqlx::migrate::MigrateError) -> Self {
        StoreError::Internal(format!("migration failed: {error}"))
    }
}
