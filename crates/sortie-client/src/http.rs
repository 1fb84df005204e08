//! One REST call: the bearer token, the server's typed answer or its refusal (`ApiErrorBody`), and
//! where the server and token come from (flag, `sortie login`, the data dir's admin token).

use std::path::PathBuf;

use anyhow::Context;
use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sortie_protocol::ApiErrorBody;

/// The server the client commands talk to when neither `--server` nor `sortie login` names one.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7700";
/// The bearer token of the client commands; default: the saved login's, else the data dir's admin token.
pub const TOKEN_ENV: &str = "SORTIE_TOKEN";

/// Which server to talk to, as the command line gave it; [`Client::resolve`] fills in the rest.
#[derive(Clone, Debug)]
pub struct Target {
    /// `--server`; else the saved login's, else [`DEFAULT_SERVER`].
    pub server: Option<String>,
    /// Print the server's JSON instead of text.
    pub json: bool,
    /// The admin token `serve` saved: the token of last resort (the user who runs `serve` has it).
    pub admin_token_file: PathBuf,
}

pub(crate) struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) server: String,
    pub(crate) token: String,
    pub(crate) json: bool,
}

/// What a call answered: the body of a success, or the server's refusal.
pub(crate) enum Answer<T> {
    Ok(T, Value),
    Refused(ApiErrorBody),
}

/// What `sortie login` saved for this user.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Login {
    pub(crate) server: String,
    pub(crate) token: String,
}

/// Where `sortie login` keeps a user's server and token: `$XDG_CONFIG_HOME/sortie/login.json`, else
/// `~/.config/sortie/login.json` (mode 0600).
pub fn login_file() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(xdg) => PathBuf::from(xdg),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".config"),
    };
    Some(base.join("sortie/login.json"))
}

fn saved_login() -> Option<Login> {
    let text = std::fs::read_to_string(login_file()?).ok()?;
    serde_json::from_str(&text).ok()
}

impl Client {
    /// The server: `--server` (or `SORTIE_SERVER`), else the saved login's, else the default. The token:
    /// `SORTIE_TOKEN`, else the saved login's, else the data dir's admin token.
    pub(crate) fn resolve(target: &Target) -> anyhow::Result<Self> {
        let login = saved_login();
        let server = target
            .server
            .clone()
            .filter(|s| !s.trim().is_empty())
            .or_else(|| login.as_ref().map(|l| l.server.clone()))
            .unwrap_or_else(|| DEFAULT_SERVER.to_owned());
        let token = match std::env::var(TOKEN_ENV) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_owned(),
            _ => match login {
                Some(login) if !login.token.is_empty() => login.token,
                _ => {
                    let path = &target.admin_token_file;
                    std::fs::read_to_string(path)
                        .with_context(|| {
                            format!(
                                "no token: set {TOKEN_ENV}, or save one with `sortie login` (an admin makes it with \
                                 `sortie token create --workspace default --role operator`); the user who runs \
                                 `sortie serve` uses {} ",
                                path.display()
                            )
                        })?
                        .trim()
                        .to_owned()
                }
            },
        };
        Ok(Self::with(server, token, target.json))
    }

    pub(crate) fn with(server: String, token: String, json: bool) -> Self {
        Self {
            http: reqwest::Client::new(),
            server: server.trim_end_matches('/').to_owned(),
            token,
            json,
        }
    }

    /// A call without a body.
    pub(crate) async fn call<T: DeserializeOwned>(&self, method: Method, path: &str) -> anyhow::Result<Answer<T>> {
        self.exchange(method, path, None).await
    }

    /// A call with a request body of the API's own types.
    pub(crate) async fn send<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: &impl Serialize,
    ) -> anyhow::Result<Answer<T>> {
        let body = serde_json::to_vec(body).context("cannot encode the request")?;
        self.exchange(method, path, Some(body)).await
    }

    async fn exchange<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<Answer<T>> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.server))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach the sortie server at {}", self.server))?;
        let status = response.status();
        let text = response.text().await.context("the server's answer broke off")?;
        if status.is_success() {
            let value: Value = if status == StatusCode::NO_CONTENT {
                Value::Null
            } else {
                serde_json::from_str(&text)
                    .with_context(|| format!("the server answered {status} with a body that is not JSON"))?
            };
            let typed = serde_json::from_value(value.clone())
                .context("the server's answer has an unexpected shape (is it the same version?)")?;
            return Ok(Answer::Ok(typed, value));
        }
        match serde_json::from_str::<ApiErrorBody>(&text) {
            Ok(refusal) => Ok(Answer::Refused(refusal)),
            Err(_) if status == StatusCode::NOT_FOUND => {
                anyhow::bail!("{} does not look like a sortie server (404 on {path})", self.server)
            }
            Err(_) => anyhow::bail!(
                "the server answered {status}: {}",
                text.chars().take(300).collect::<String>()
            ),
        }
    }
}
