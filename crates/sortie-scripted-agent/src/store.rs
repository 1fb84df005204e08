//! Sessions on disk: `$HOME/.scripted-agent/<sessionId>.json`, so a new process can `session/load` them.

use std::io;
use std::path::PathBuf;

use agent_client_protocol::v1::schema::{ContentBlock, SessionUpdate};
use serde::{Deserialize, Serialize};

/// The directory under `$HOME` that holds the session files.
pub(crate) const STATE_DIR_NAME: &str = ".scripted-agent";

/// Everything needed to resume a session: where it runs, its mode and every turn so far.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SessionRecord {
    pub(crate) session_id: String,
    pub(crate) cwd: PathBuf,
    pub(crate) mode_id: String,
    pub(crate) turns: Vec<TurnRecord>,
}

/// One prompt and the updates the agent sent while answering it, in order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TurnRecord {
    pub(crate) prompt: Vec<ContentBlock>,
    pub(crate) updates: Vec<SessionUpdate>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error("HOME is not set, so there is nowhere to keep sessions")]
    HomeNotSet,
    #[error("`{0}` is not a session id of this agent")]
    InvalidSessionId(String),
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} is not a valid session file: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
}

#[derive(Debug, Clone)]
pub(crate) struct SessionStore {
    directory: PathBuf,
}

impl SessionStore {
    /// The store under `$HOME/.scripted-agent`.
    pub(crate) fn in_home() -> Result<Self, StoreError> {
        let home = std::env::var_os("HOME")
            .filter(|home| !home.is_empty())
            .ok_or(StoreError::HomeNotSet)?;
        Ok(SessionStore {
            directory: PathBuf::from(home).join(STATE_DIR_NAME),
        })
    }

    pub(crate) async fn save(&self, record: &SessionRecord) -> Result<(), StoreError> {
        let path = self.path_of(&record.session_id)?;
        let json = serde_json::to_vec_pretty(record).map_err(|source| StoreError::Corrupt {
            path: path.clone(),
            source,
        })?;
        tokio::fs::create_dir_all(&self.directory)
            .await
            .map_err(|source| StoreError::Io {
                path: self.directory.clone(),
                source,
            })?;
        // Write-then-rename so a crash mid-write never leaves a truncated session behind.
        let temporary = path.with_extension("json.tmp");
        tokio::fs::write(&temporary, json)
            .await
            .map_err(|source| StoreError::Io {
                path: temporary.clone(),
                source,
            })?;
        tokio::fs::rename(&temporary, &path)
            .await
            .map_err(|source| StoreError::Io { path, source })
    }

    /// The stored session, or `None` if there is no such session (including ids this agent never issues).
    pub(crate) async fn load(&self, session_id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let path = match self.path_of(session_id) {
            Ok(path) => path,
            Err(StoreError::InvalidSessionId(_)) => return Ok(None),
            Err(error) => return Err(error),
        };
        let json = match tokio::fs::read(&path).await {
            Ok(json) => json,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(StoreError::Io { path, source }),
        };
        serde_json::from_slice(&json)
            .map(Some)
            .map_err(|source| StoreError::Corrupt { path, source })
    }

    fn path_of(&self, session_id: &str) -> Result<PathBuf, StoreError> {
        // Session ids come from the client on session/load; only plain names may become file names.
        if !is_plain_file_stem(session_id) {
            return Err(StoreError::InvalidSessionId(session_id.to_owned()));
        }
        Ok(self.directory.join(format!("{session_id}.json")))
    }
}

fn is_plain_file_stem(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || character == '-' || character == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_are_session_ids() {
        assert!(is_plain_file_stem("01JABCDEF0123456789"));
        assert!(is_plain_file_stem("sess_1-a"));
        assert!(!is_plain_file_stem(""));
        assert!(!is_plain_file_stem("../etc/passwd"));
        assert!(!is_plain_file_stem("a/b"));
        assert!(!is_plain_file_stem("a.json"));
        assert!(!is_plain_file_stem(&"a".repeat(129)));
    }
}
