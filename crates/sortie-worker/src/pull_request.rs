//! The draft pull request of a session delivered to a GitHub forge (DESIGN §1: a branch, and a draft
//! PR where the repo lives on a forge). Opened once, after the first delivery, through GitHub's REST
//! API with the workspace's forge token; an existing PR for the branch (a retry, another worker) is
//! found and recorded instead of a second one. A failure fails the turn with `PR_OPEN_FAILED` and the
//! forge's reason; the branch stays delivered, and the next turn (a steer) tries again.

use std::time::Duration;

use serde_json::Value;
use sortie_protocol::api::ForgeKind;
use sortie_store::{SessionRow, Store};

/// How long one call to the forge's API may take.
const API_DEADLINE: Duration = Duration::from_secs(20);
/// The most of the task a PR's description quotes.
const BODY_TASK_MAX_CHARS: usize = 4000;

/// What became of the session's pull request.
#[derive(Debug, PartialEq, Eq)]
pub enum PullRequest {
    /// The forge is not GitHub (or has no API base): branches only.
    NotApplicable,
    Opened {
        url: String,
        number: u64,
    },
    Failed(String),
}

/// `owner` and `name` of `https://host/owner/name(.git)`.
fn owner_and_name(repo: &str) -> Option<(String, String)> {
    let rest = repo.strip_prefix("https://")?;
    let (_, path) = rest.split_once('/')?;
    let path = path.trim_end_matches('/');
    let path = path.strip_suffix(".git").unwrap_or(path);
    let (owner, name) = path.split_once('/')?;
    // No leading dot: `.` and `..` would collapse the API path.
    let plain = |s: &str| {
        !s.is_empty() && !s.starts_with('.') && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    (plain(owner) && plain(name)).then(|| (owner.to_owned(), name.to_owned()))
}

/// Opens (or finds) the draft PR of `session`'s branch against `base` and records it on the session,
/// with the session's forge `credential` (none: the repository is not on a forge sortie reaches).
pub(crate) async fn ensure_draft(
    store: &dyn Store,
    credential: Option<crate::forge::ForgeCredential>,
    http: Option<&reqwest::Client>,
    session: &SessionRow,
    base: impl Future<Output = Result<String, String>>,
    task: &str,
) -> PullRequest {
    let (Some(crate::forge::ForgeCredential { connection, token, .. }), Some(http)) = (credential, http) else {
        return PullRequest::NotApplicable;
    };
    let host = connection.host.clone();
    if connection.kind != ForgeKind::Github || connection.api_base.is_empty() {
        return PullRequest::NotApplicable;
    }
    let Some((owner, name)) = owner_and_name(&session.repo) else {
        return PullRequest::Failed(format!(
            "{} is not an owner/name repository URL; no pull request was opened",
            session.repo
        ));
    };
    let base = match base.await {
        Ok(base) => base,
        Err(reason) => return PullRequest::Failed(reason),
    };
    let token = String::from_utf8_lossy(token.expose()).into_owned();
    let pulls = format!("{}/repos/{owner}/{name}/pulls", connection.api_base);
    let branch = session.id.branch();
    let title = if session.title.trim().is_empty() {
        format!("sortie: {}", session.id)
    } else {
        session.title.clone()
    };
    let task: String = task.chars().take(BODY_TASK_MAX_CHARS).collect();
    /// GitHub's "create a pull request" body.
    #[derive(serde::Serialize)]
    struct NewPullRequest<'a> {
        title: &'a str,
        head: &'a str,
        base: &'a str,
        draft: bool,
        body: String,
    }
    let body = NewPullRequest {
        title: &title,
        head: &branch,
        base: &base,
        draft: true,
        body: format!(
            "{task}\n\n---\nOpened by sortie session `{}`; every push to `{branch}` updates it.",
            session.id
        ),
    };
    // Strings and a flag: encoding cannot fail.
    let body = serde_json::to_string(&body).unwrap_or_default();
    let request = |request: reqwest::RequestBuilder| {
        request
            .bearer_auth(&token)
            .header(reqwest::header::ACCEPT, "application/vnd.github+json")
            .header("x-github-api-version", "2022-11-28")
            .header(reqwest::header::USER_AGENT, "sortie")
            .timeout(API_DEADLINE)
    };
    let created = request(http.post(&pulls))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    let answer = match created {
        Ok(answer) => answer,
        Err(error) => return PullRequest::Failed(format!("{host} did not answer the pull request call: {error}")),
    };
    let status = answer.status();
    let text = answer.text().await.unwrap_or_default();
    let found = if status == reqwest::StatusCode::CREATED {
        serde_json::from_str::<Value>(&text).ok()
    } else if status == reqwest::StatusCode::UNPROCESSABLE_ENTITY && text.contains("already exists") {
        // Opened before (a retried turn, another worker): find it by its head.
        // Owner and branch are plain URL characters (checked above; a session id is lowercase ULID).
        let existing = request(http.get(format!("{pulls}?head={owner}:{branch}&state=all")))
            .send()
            .await;
        match existing {
            Ok(answer) if answer.status().is_success() => answer
                .text()
                .await
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|list| list.as_array().and_then(|l| l.first().cloned())),
            _ => None,
        }
    } else {
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["message"].as_str().map(ToOwned::to_owned))
            .unwrap_or_default();
        return PullRequest::Failed(format!(
            "{host} refused to open the pull request ({}{}{message})",
            status.as_u16(),
            if message.is_empty() { "" } else { ": " }
        ));
    };
    let Some((url, number)) = found.and_then(|pr| Some((pr["html_url"].as_str()?.to_owned(), pr["number"].as_u64()?)))
    else {
        return PullRequest::Failed(format!("{host} answered the pull request call without one"));
    };
    if let Err(error) = store.set_session_pr(&session.id, &url, number).await {
        return PullRequest::Failed(format!("the pull request {url} was opened but not recorded: {error}"));
    }
    PullRequest::Opened { url, number }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_urls_name_their_owner_and_repository() {
        let pair = |o: &str, n: &str| Some((o.to_owned(), n.to_owned()));
        assert_eq!(owner_and_name("https://github.com/acme/app.git"), pair("acme", "app"));
        assert_eq!(
            owner_and_name("https://ghe.example.com:8443/acme/app"),
            pair("acme", "app")
        );
        assert_eq!(owner_and_name("https://github.com/acme/app/"), pair("acme", "app"));
        for bad in [
            "https://github.com/acme",
            "https://github.com/a/b/c",
            "/srv/git/app",
            "https://h/a%2F/b",
        ] {
            assert_eq!(owner_and_name(bad), None, "{bad}");
        }
    }
}
