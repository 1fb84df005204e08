//! The REST calls sortie makes about one repository once it holds a token for it (`ref/github.md` §4,
//! §6): the sender's permission, a reaction, a comment, a pull request's head and body, and check runs.
//! Every call pins the API version, names sortie as its user agent, has a deadline and reads a bounded
//! answer; a refusal comes back as [`GitHubError::Refused`] with GitHub's message.

use serde::Deserialize;

use crate::API_VERSION;
use crate::tokens::{GitHubError, RepoName, read_answer, refusal};

/// How long one call may take, answer included.
const CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);
/// GitHub's cap on a comment's or a pull request body's length, in characters.
pub const BODY_MAX_CHARS: usize = 65_536;

/// One repository on GitHub, reached with `token`.
pub struct Repo<'a> {
    http: &'a reqwest::Client,
    /// `https://api.github.com`, or a GHES `https://HOST/api/v3`.
    api_base: &'a str,
    repo: &'a RepoName,
    token: &'a str,
    /// GitHub answered a call 401: the token is no longer good (revoked, or the App's key rotated).
    refused: std::sync::atomic::AtomicBool,
}

/// What a sender may do in a repository, by the permission API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permission {
    Admin,
    Write,
    Read,
    None,
}

impl Permission {
    /// Whether the sender may ask sortie for work (`admin` or `write`; `maintain` reads as write).
    pub fn may_ask(self) -> bool {
        matches!(self, Self::Admin | Self::Write)
    }
}

/// What a comment was made on, for its reactions' route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommentKind {
    /// A comment in an issue's or a pull request's conversation.
    Issue,
    /// A comment on a line of a pull request's diff.
    Review,
}

/// How a check run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conclusion {
    Success,
    Failure,
    Cancelled,
    Neutral,
}

impl Conclusion {
    fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Cancelled => "cancelled",
            Self::Neutral => "neutral",
        }
    }
}

#[derive(Deserialize)]
struct PermissionAnswer {
    permission: String,
}

#[derive(Deserialize)]
struct Created {
    id: u64,
}

#[derive(Deserialize)]
struct Pull {
    head: Head,
}

#[derive(Deserialize)]
struct Head {
    #[serde(rename = "ref")]
    name: String,
    #[serde(default)]
    repo: Option<HeadRepository>,
}

#[derive(Deserialize)]
struct HeadRepository {
    full_name: String,
}

/// `text` cut to GitHub's body cap.
fn capped(text: &str) -> String {
    text.chars().take(BODY_MAX_CHARS).collect()
}

impl<'a> Repo<'a> {
    pub fn new(http: &'a reqwest::Client, api_base: &'a str, repo: &'a RepoName, token: &'a str) -> Self {
        Self {
            http,
            api_base,
            repo,
            token,
            refused: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether GitHub refused the token (401) in any call so far: its holder should not use it again.
    pub fn token_refused(&self) -> bool {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn call(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(
                method,
                format!("{}/repos/{}{path}", self.api_base.trim_end_matches('/'), self.repo),
            )
            .bearer_auth(self.token)
            .header(reqwest::header::ACCEPT, "application/vnd.github+json")
            .header("X-GitHub-Api-Version", API_VERSION)
            .header(
                reqwest::header::USER_AGENT,
                concat!("sortie/", env!("CARGO_PKG_VERSION")),
            )
            .timeout(CALL_DEADLINE)
    }

    /// Sends, and reads a 2xx answer (else the refusal).
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<Vec<u8>, GitHubError> {
        let (status, body) = read_answer(request).await?;
        if status == 401 {
            self.refused.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if (200..300).contains(&status) {
            Ok(body)
        } else {
            Err(refusal(status, &body))
        }
    }

    /// What `login` may do here. A login GitHub does not know, or any other refusal, is an error: the
    /// caller denies on it.
    pub async fn permission(&self, login: &str) -> Result<Permission, GitHubError> {
        let plain = !login.is_empty()
            && login.len() <= 100
            && login
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '[' | ']'));
        if !plain {
            return Err(GitHubError::BadName(login.chars().take(100).collect()));
        }
        let body = self
            .send(self.call(reqwest::Method::GET, &format!("/collaborators/{login}/permission")))
            .await?;
        let answer: PermissionAnswer =
            serde_json::from_slice(&body).map_err(|e| GitHubError::Malformed(e.to_string()))?;
        Ok(match answer.permission.as_str() {
            "admin" => Permission::Admin,
            "write" | "maintain" => Permission::Write,
            "read" | "triage" => Permission::Read,
            _ => Permission::None,
        })
    }

    /// Reacts to a comment (`eyes`: seen and taken).
    pub async fn react(&self, kind: CommentKind, comment_id: u64, content: &str) -> Result<(), GitHubError> {
        let path = match kind {
            CommentKind::Issue => format!("/issues/comments/{comment_id}/reactions"),
            CommentKind::Review => format!("/pulls/comments/{comment_id}/reactions"),
        };
        self.send(
            self.call(reqwest::Method::POST, &path)
                .json(&serde_json::json!({"content": content})),
        )
        .await
        .map(drop)
    }

    /// Comments in issue (or pull request) `number`'s conversation; the comment's id.
    pub async fn comment(&self, number: u64, body: &str) -> Result<u64, GitHubError> {
        let answer = self
            .send(
                self.call(reqwest::Method::POST, &format!("/issues/{number}/comments"))
                    .json(&serde_json::json!({"body": capped(body)})),
            )
            .await?;
        let created: Created = serde_json::from_slice(&answer).map_err(|e| GitHubError::Malformed(e.to_string()))?;
        Ok(created.id)
    }

    /// Pull request `number`'s head branch and the repository it is in (`owner/name`; none when that
    /// repository is gone).
    pub async fn pull_head(&self, number: u64) -> Result<(String, Option<String>), GitHubError> {
        let answer = self
            .send(self.call(reqwest::Method::GET, &format!("/pulls/{number}")))
            .await?;
        let pull: Pull = serde_json::from_slice(&answer).map_err(|e| GitHubError::Malformed(e.to_string()))?;
        Ok((pull.head.name, pull.head.repo.map(|repo| repo.full_name)))
    }

    /// Replaces pull request `number`'s description.
    pub async fn set_pull_body(&self, number: u64, body: &str) -> Result<(), GitHubError> {
        self.send(
            self.call(reqwest::Method::PATCH, &format!("/pulls/{number}"))
                .json(&serde_json::json!({"body": capped(body)})),
        )
        .await
        .map(drop)
    }

    /// Starts a check run named `name` on `head_sha`, in progress; its id.
    pub async fn start_check(&self, name: &str, head_sha: &str, details_url: Option<&str>) -> Result<u64, GitHubError> {
        let mut body = serde_json::json!({"name": name, "head_sha": head_sha, "status": "in_progress"});
        if let Some(url) = details_url {
            body["details_url"] = url.into();
        }
        let answer = self
            .send(self.call(reqwest::Method::POST, "/check-runs").json(&body))
            .await?;
        let created: Created = serde_json::from_slice(&answer).map_err(|e| GitHubError::Malformed(e.to_string()))?;
        Ok(created.id)
    }

    /// Completes check run `id` with `conclusion` and a title and summary.
    pub async fn complete_check(
        &self,
        id: u64,
        conclusion: Conclusion,
        title: &str,
        summary: &str,
    ) -> Result<(), GitHubError> {
        let body = serde_json::json!({
            "status": "completed",
            "conclusion": conclusion.as_str(),
            "output": {"title": title.chars().take(200).collect::<String>(), "summary": capped(summary)},
        });
        self.send(
            self.call(reqwest::Method::PATCH, &format!("/check-runs/{id}"))
                .json(&body),
        )
        .await
        .map(drop)
    }
}
