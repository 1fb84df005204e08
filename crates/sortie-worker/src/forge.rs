//! The credential a session reaches its forge with (DESIGN §7.3): the workspace's connection to the
//! repository's host, opened with the keyring — a personal token as it was set, or, for a GitHub App,
//! an installation token minted for that one repository ([`sortie_github::tokens::TokenCache`], one per
//! connection, kept by the worker) and minted again when the forge refuses it. Only the gateway's git
//! proxy, the mirror fetch and the pull-request calls ever hold it. Talking on GitHub (comments,
//! reactions, check runs) takes a token of its own ([`conversation`]): the App's two scopes never mix.

use std::collections::HashMap;
use std::sync::Arc;

use sortie_github::app::AppKey;
use sortie_github::tokens::{GitHubApp, RepoName, Scope, TokenCache};
use sortie_store::{ForgeConnectionRow, KeyError, Secret};

use crate::Context;

/// Why a session has no credential for its forge: a sentence for the user.
#[derive(Debug, thiserror::Error)]
pub enum ForgeError {
    #[error("the workspace has no connection to {0}: an admin adds one with `sortie forge set {0}`, then retry")]
    NoConnection(String),
    #[error("the store did not answer; retry")]
    Store,
    #[error(
        "the stored credential for {0} does not open with this server's master key: set it again with `sortie forge set {0}`"
    )]
    Sealed(String),
    #[error("the GitHub App of {host} cannot reach {repo}: {reason}")]
    App { host: String, repo: String, reason: String },
}

/// A session's credential for its forge.
pub struct ForgeCredential {
    pub connection: ForgeConnectionRow,
    /// What the forge takes: the token, or the installation token minted now.
    pub token: Secret,
    /// For an App: where a refused token is minted again.
    pub renewal: Option<Renewal>,
}

/// An App connection's tokens of one scope for one repository.
#[derive(Clone)]
pub struct Renewal {
    pub tokens: Arc<TokenCache>,
    pub repo: RepoName,
    pub scope: Scope,
}

impl Renewal {
    /// GitHub refused `token`: it is not handed out again.
    pub async fn forget(&self, token: &str) {
        self.tokens.refused(&self.repo, token).await;
    }

    /// A token other than `refused`, minted if need be.
    pub async fn renew(&self, refused: &str) -> Option<Secret> {
        self.tokens.refused(&self.repo, refused).await;
        match self.tokens.token_for(&self.repo, self.scope).await {
            Ok(token) => Some(Secret::new(token.token().as_bytes().to_vec())),
            Err(error) => {
                tracing::warn!(%error, repo = %self.repo, "no fresh installation token");
                None
            }
        }
    }
}

/// A connection: its workspace and host.
type ConnectionKey = (String, String);

/// One setting of an App connection (its sealed key's ciphertext) and that App's tokens.
type HeldApp = (String, Arc<TokenCache>);

/// The App token caches, one per workspace connection (replaced when the connection is set again).
#[derive(Default)]
pub struct AppTokens {
    caches: std::sync::Mutex<HashMap<ConnectionKey, HeldApp>>,
}

/// `owner/name` of `https://host/owner/name(.git)`.
pub fn repo_name(repo: &str) -> Option<RepoName> {
    let rest = repo.strip_prefix("https://")?;
    let (_, path) = rest.split_once('/')?;
    RepoName::parse(path.trim_end_matches('/')).ok()
}

/// The workspace's connection to `host` and its opened secret.
async fn connection(
    context: &Context,
    workspace_id: &str,
    host: &str,
) -> Result<(ForgeConnectionRow, Secret), ForgeError> {
    let ring = context
        .config
        .keyring
        .as_ref()
        .ok_or_else(|| ForgeError::NoConnection(host.to_owned()))?;
    match sortie_store::workspace_forge_token(context.store.as_ref(), ring, workspace_id, host).await {
        Ok(Some(found)) => Ok(found),
        Ok(None) => Err(ForgeError::NoConnection(host.to_owned())),
        Err(KeyError::Store(_)) => Err(ForgeError::Store),
        Err(_) => Err(ForgeError::Sealed(host.to_owned())),
    }
}

/// The token cache of an App connection (`connection` with its opened key), made once per setting of
/// the connection.
fn app_tokens(
    context: &Context,
    connection: &ForgeConnectionRow,
    app_id: &str,
    key: &Secret,
) -> Result<Arc<TokenCache>, String> {
    let mut caches = context.app_tokens.caches.lock().unwrap_or_else(|p| p.into_inner());
    let cache_key = (connection.workspace_id.clone(), connection.host.clone());
    // The sealed key's ciphertext names this setting of the connection: set again, a new cache.
    let identity = connection.token_ciphertext.clone();
    if let Some((held, tokens)) = caches.get(&cache_key)
        && *held == identity
    {
        return Ok(tokens.clone());
    }
    let key_pem = AppKey::from_pem(key.expose()).map_err(|e| e.to_string())?;
    let http = context
        .config
        .forge_http
        .clone()
        .ok_or_else(|| "this server cannot reach forges".to_owned())?;
    let tokens = Arc::new(TokenCache::new(GitHubApp::new(
        &connection.api_base,
        app_id,
        key_pem,
        http,
    )));
    caches.insert(cache_key, (identity, tokens.clone()));
    Ok(tokens)
}

/// The credential for `repo` (an `https://` URL on `host`) in `workspace_id`: for an App, a delivery
/// token.
pub async fn credential(
    context: &Context,
    workspace_id: &str,
    host: &str,
    repo: &str,
) -> Result<ForgeCredential, ForgeError> {
    scoped(context, workspace_id, host, repo, || repo_name(repo), Scope::Delivery).await
}

/// A token that may talk in `repo`'s issues and pull requests and report check runs (an App's
/// conversation token, or the workspace's personal token), with the connection.
pub async fn conversation(
    context: &Context,
    workspace_id: &str,
    host: &str,
    repo: &RepoName,
) -> Result<ForgeCredential, ForgeError> {
    let shown = repo.to_string();
    scoped(
        context,
        workspace_id,
        host,
        &shown,
        || Some(repo.clone()),
        Scope::Conversation,
    )
    .await
}

/// The workspace's credential for a repository on `host` (`shown` in errors; `name` read only for an
/// App): the personal token, or an installation token of `scope` for that one repository.
async fn scoped(
    context: &Context,
    workspace_id: &str,
    host: &str,
    shown: &str,
    name: impl FnOnce() -> Option<RepoName>,
    scope: Scope,
) -> Result<ForgeCredential, ForgeError> {
    let (connection, secret) = connection(context, workspace_id, host).await?;
    let Some(app_id) = connection.app_id.clone() else {
        return Ok(ForgeCredential {
            connection,
            token: secret,
            renewal: None,
        });
    };
    let app_error = |reason: String| ForgeError::App {
        host: host.to_owned(),
        repo: shown.to_owned(),
        reason,
    };
    let name = name().ok_or_else(|| app_error("it is not an https://host/owner/name URL".into()))?;
    let tokens = app_tokens(context, &connection, &app_id, &secret).map_err(app_error)?;
    let minted = tokens
        .token_for(&name, scope)
        .await
        .map_err(|e| app_error(e.to_string()))?;
    Ok(ForgeCredential {
        connection,
        token: Secret::new(minted.token().as_bytes().to_vec()),
        renewal: Some(Renewal {
            tokens,
            repo: name,
            scope,
        }),
    })
}
