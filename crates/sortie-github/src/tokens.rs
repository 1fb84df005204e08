//! Installation tokens (`ref/github.md` §1): the App's JWT finds the installation holding a repository
//! (`GET /repos/{owner}/{repo}/installation`) and mints a token for that repository alone with
//! `contents:write`, `pull_requests:write` and `metadata:read` (`POST
//! /app/installations/{id}/access_tokens`). A token lives an hour; [`TokenCache`] hands out the one it
//! holds until a minute before it expires, and mints again after the forge refused it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::API_VERSION;
use crate::app::{AppKey, AppKeyError};

/// A cached token is used until this long before it expires.
pub const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(60);
/// The most of any GitHub answer that is read.
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// How long one call to GitHub may take, answer included.
const REQUEST_DEADLINE: Duration = Duration::from_secs(20);
/// The longest token taken (a stateless `ghs_` token is about 520 characters).
const MAX_TOKEN_CHARS: usize = 4096;

/// Why no token could be had.
#[derive(Debug, thiserror::Error)]
pub enum GitHubError {
    #[error("{0:?} is not a GitHub repository name (owner/name)")]
    BadName(String),
    #[error("the GitHub App is not installed on {0}: install it on that repository (or its owner), then retry")]
    NotInstalled(String),
    #[error("GitHub refused the App ({status}): {message}")]
    Refused { status: u16, message: String },
    #[error("GitHub could not be reached: {0}")]
    Unreachable(String),
    #[error("GitHub's answer could not be read: {0}")]
    Malformed(String),
    #[error(transparent)]
    Key(#[from] AppKeyError),
}

/// `owner/name` of a repository on GitHub.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RepoName {
    pub owner: String,
    pub name: String,
}

impl RepoName {
    /// `owner/name` (a trailing `.git` is dropped); GitHub's characters only, so it goes into a path as is.
    pub fn parse(full: &str) -> Result<Self, GitHubError> {
        let bad = || GitHubError::BadName(full.chars().take(200).collect());
        let trimmed = full.strip_suffix(".git").unwrap_or(full);
        let (owner, name) = trimmed.split_once('/').ok_or_else(bad)?;
        let fine = |part: &str| {
            !part.is_empty()
                && part.len() <= 100
                && part != "."
                && part != ".."
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if !fine(owner) || !fine(name) {
            return Err(bad());
        }
        Ok(Self {
            owner: owner.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for RepoName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.owner, self.name)
    }
}

/// What an installation token may do: each is minted and cached apart, so the token the git proxy
/// holds for a session can do no more than deliver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Fetch, push and open pull requests: `contents:write`, `pull_requests:write`, `metadata:read`.
    Delivery,
    /// Talk in the repository's issues and pull requests and report check runs: `issues:write`,
    /// `pull_requests:write`, `checks:write`, `metadata:read` (no contents).
    Conversation,
}

impl Scope {
    fn permissions(self) -> serde_json::Value {
        match self {
            Self::Delivery => serde_json::json!({"contents": "write", "pull_requests": "write", "metadata": "read"}),
            Self::Conversation => serde_json::json!({
                "issues": "write", "pull_requests": "write", "checks": "write", "metadata": "read"
            }),
        }
    }
}

/// An installation token and when it stops working. Its `Debug` shows no token.
#[derive(Clone)]
pub struct InstallationToken {
    token: String,
    pub expires_at: SystemTime,
}

impl InstallationToken {
    pub fn token(&self) -> &str {
        &self.token
    }

    fn fresh_at(&self, now: SystemTime) -> bool {
        now + REFRESH_BEFORE_EXPIRY < self.expires_at
    }
}

impl std::fmt::Debug for InstallationToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstallationToken")
            .field("token", &"[redacted]")
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// A GitHub App as the API knows it: its base URL (`https://api.github.com`, or a GHES
/// `https://HOST/api/v3`), the JWT's issuer (App ID or client ID) and its key.
pub struct GitHubApp {
    api: String,
    issuer: String,
    key: AppKey,
    http: reqwest::Client,
}

impl std::fmt::Debug for GitHubApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitHubApp")
            .field("api", &self.api)
            .field("issuer", &self.issuer)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Installation {
    id: u64,
}

#[derive(Deserialize)]
struct MintedToken {
    token: String,
    expires_at: String,
}

#[derive(Deserialize)]
struct ErrorBody {
    message: Option<String>,
}

impl GitHubApp {
    pub fn new(api_base: &str, issuer: &str, key: AppKey, http: reqwest::Client) -> Self {
        Self {
            api: api_base.trim_end_matches('/').to_owned(),
            issuer: issuer.to_owned(),
            key,
            http,
        }
    }

    /// A call authenticated as the App.
    fn as_app(&self, method: reqwest::Method, path: &str) -> Result<reqwest::RequestBuilder, GitHubError> {
        let jwt = self.key.jwt(&self.issuer, SystemTime::now())?;
        Ok(self
            .http
            .request(method, format!("{}{path}", self.api))
            .bearer_auth(jwt)
            .header(reqwest::header::ACCEPT, "application/vnd.github+json")
            .header("X-GitHub-Api-Version", API_VERSION)
            .header(
                reqwest::header::USER_AGENT,
                concat!("sortie/", env!("CARGO_PKG_VERSION")),
            )
            .timeout(REQUEST_DEADLINE))
    }

    /// The installation holding `repo`.
    pub async fn installation(&self, repo: &RepoName) -> Result<u64, GitHubError> {
        let request = self.as_app(reqwest::Method::GET, &format!("/repos/{repo}/installation"))?;
        match read_answer(request).await? {
            (404, _) => Err(GitHubError::NotInstalled(repo.to_string())),
            (200, body) => serde_json::from_slice::<Installation>(&body)
                .map(|installation| installation.id)
                .map_err(|e| GitHubError::Malformed(e.to_string())),
            (status, body) => Err(refusal(status, &body)),
        }
    }

    /// A token of `installation` for `repo` alone, with the permissions of `scope`.
    pub async fn mint(
        &self,
        installation: u64,
        repo: &RepoName,
        scope: Scope,
    ) -> Result<InstallationToken, GitHubError> {
        let body = serde_json::json!({
            "repositories": [repo.name],
            "permissions": scope.permissions(),
        });
        let request = self
            .as_app(
                reqwest::Method::POST,
                &format!("/app/installations/{installation}/access_tokens"),
            )?
            .json(&body);
        let (status, answer) = read_answer(request).await?;
        if status != 201 {
            return Err(refusal(status, &answer));
        }
        let minted: MintedToken = serde_json::from_slice(&answer).map_err(|e| GitHubError::Malformed(e.to_string()))?;
        let usable = !minted.token.is_empty()
            && minted.token.len() <= MAX_TOKEN_CHARS
            && minted
                .token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !usable {
            return Err(GitHubError::Malformed("the token is not one GitHub mints".into()));
        }
        let expires_at = humantime::parse_rfc3339(&minted.expires_at)
            .map_err(|e| GitHubError::Malformed(format!("expires_at {:?}: {e}", minted.expires_at)))?;
        Ok(InstallationToken {
            token: minted.token,
            expires_at,
        })
    }
}

/// Sends and reads at most [`MAX_ANSWER_BYTES`] of the answer.
pub(crate) async fn read_answer(request: reqwest::RequestBuilder) -> Result<(u16, Vec<u8>), GitHubError> {
    let mut response = request
        .send()
        .await
        .map_err(|e| GitHubError::Unreachable(e.to_string()))?;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| GitHubError::Unreachable(e.to_string()))?
    {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(GitHubError::Malformed(format!(
                "the answer is larger than {MAX_ANSWER_BYTES} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((status, body))
}

pub(crate) fn refusal(status: u16, body: &[u8]) -> GitHubError {
    let message = serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .and_then(|error| error.message)
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(300).collect());
    GitHubError::Refused {
        status,
        message: message.chars().take(300).collect(),
    }
}

/// The App's tokens, per repository: one minted when none is fresh, kept until a minute before it
/// expires or until the forge refuses it. Each repository has its own lock: a slow answer about one
/// holds up no other.
#[derive(Debug)]
pub struct TokenCache {
    app: GitHubApp,
    held: std::sync::Mutex<HashMap<(RepoName, Scope), HeldToken>>,
}

/// One repository's token of one scope, behind its own lock.
type HeldToken = Arc<tokio::sync::Mutex<Held>>;

#[derive(Debug, Default)]
struct Held {
    installation: Option<u64>,
    token: Option<InstallationToken>,
}

impl TokenCache {
    pub fn new(app: GitHubApp) -> Self {
        Self {
            app,
            held: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn entry(&self, repo: &RepoName, scope: Scope) -> Arc<tokio::sync::Mutex<Held>> {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((repo.clone(), scope))
            .or_default()
            .clone()
    }

    /// A fresh delivery token for `repo` (one mint at a time per repository: callers wait for the same
    /// token).
    pub async fn token(&self, repo: &RepoName) -> Result<InstallationToken, GitHubError> {
        self.token_for(repo, Scope::Delivery).await
    }

    /// A fresh token of `scope` for `repo`.
    pub async fn token_for(&self, repo: &RepoName, scope: Scope) -> Result<InstallationToken, GitHubError> {
        let entry = self.entry(repo, scope);
        let mut entry = entry.lock().await;
        if let Some(token) = entry.token.as_ref().filter(|token| token.fresh_at(SystemTime::now())) {
            return Ok(token.clone());
        }
        let installation = match entry.installation {
            Some(id) => id,
            None => {
                let id = self.app.installation(repo).await?;
                entry.installation = Some(id);
                id
            }
        };
        let minted = match self.app.mint(installation, repo, scope).await {
            Ok(minted) => minted,
            Err(error) => {
                // The App may have been installed again (another id) since.
                entry.installation = None;
                return Err(error);
            }
        };
        tracing::info!(repo = %repo, installation, ?scope, "minted an installation token");
        entry.token = Some(minted.clone());
        Ok(minted)
    }

    /// The forge refused `token` (a 401): it is not handed out again. A newer token minted meanwhile
    /// stays.
    pub async fn refused(&self, repo: &RepoName, token: &str) {
        for scope in [Scope::Delivery, Scope::Conversation] {
            let entry = self.entry(repo, scope);
            let mut entry = entry.lock().await;
            if entry.token.as_ref().is_some_and(|held| held.token == token) {
                entry.token = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_names_are_githubs_characters_only() {
        let parsed = RepoName::parse("octo-org/hello.world.git").expect("name");
        assert_eq!(parsed.to_string(), "octo-org/hello.world");
        for bad in [
            "", "nobody", "a/b/c", "../x", "a/..", "a/b c", "a/b?x=1", "a/%2e%2e", "/b", "a/",
        ] {
            assert!(RepoName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_token_is_fresh_until_a_minute_before_it_expires() {
        let now = SystemTime::now();
        let token = |left: u64| InstallationToken {
            token: "ghs_x".into(),
            expires_at: now + Duration::from_secs(left),
        };
        assert!(token(3600).fresh_at(now));
        assert!(!token(60).fresh_at(now));
        assert!(!token(0).fresh_at(now));
        assert!(!format!("{:?}", token(5)).contains("ghs_x"));
    }
}
