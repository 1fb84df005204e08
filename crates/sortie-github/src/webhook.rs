//! GitHub's webhook deliveries (`ref/github.md` §6): the `X-Hub-Signature-256` check, in constant time,
//! and the comments sortie acts on read out of a payload into a [`Comment`]. Pure logic: nothing here
//! calls GitHub, and nothing in a payload is trusted until its signature was checked by the caller.
//!
//! What makes a comment a trigger is decided here too ([`Comment::ignored`]): only `action: created`,
//! never a bot (by type or `[bot]` login), never a comment made through sortie's own App, and only one
//! that mentions `@sortie` as a word. Whether the sender may ask is the permission API's answer, which
//! the caller gets with [`crate::rest`].

use hmac::{Hmac, KeyInit, Mac};
use serde::Deserialize;
use sha2::Sha256;

use crate::tokens::RepoName;

/// The handle a comment mentions to ask sortie for work.
pub const MENTION: &str = "@sortie";
/// The longest instruction taken from one comment (GitHub caps a comment at 65,536 characters).
pub const INSTRUCTION_MAX_CHARS: usize = 65_536;

/// `sha256=<hex>` of `body` under `secret`: what GitHub sends as `X-Hub-Signature-256`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    // HMAC takes a key of any length: this never fails.
    let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret) else {
        return String::new();
    };
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// Whether `header` (the whole `X-Hub-Signature-256` value) signs `body` under `secret`. The digest is
/// compared in constant time (`verify_slice`); a malformed header is simply no match.
pub fn signature_matches(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(hex) = header.trim().strip_prefix("sha256=") else {
        return false;
    };
    if hex.len() != 64 {
        return false;
    }
    let mut digest = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        let Ok(text) = std::str::from_utf8(pair) else {
            return false;
        };
        let Ok(byte) = u8::from_str_radix(text, 16) else {
            return false;
        };
        digest[i] = byte;
    }
    let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret) else {
        return false;
    };
    mac.update(body);
    mac.verify_slice(&digest).is_ok()
}

/// The instruction a comment gives sortie: its text with the mention taken out, when it mentions
/// `@sortie` as a word (`(^|\s)@sortie([\s.,!?;:]|$)`, any case), else `None`.
pub fn instruction(body: &str) -> Option<String> {
    let lower = body.to_ascii_lowercase();
    let mut from = 0;
    while let Some(found) = lower[from..].find(MENTION) {
        let start = from + found;
        let end = start + MENTION.len();
        let before_ok = start == 0 || lower[..start].chars().next_back().is_some_and(char::is_whitespace);
        let after_ok = lower[end..]
            .chars()
            .next()
            .is_none_or(|c| c.is_whitespace() || ".,!?;:".contains(c));
        if before_ok && after_ok {
            let mut text = String::with_capacity(body.len());
            text.push_str(&body[..start]);
            text.push_str(&body[end..]);
            let text = text.trim().trim_start_matches([',', ':', ';']).trim();
            return Some(text.chars().take(INSTRUCTION_MAX_CHARS).collect());
        }
        from = end;
    }
    None
}

/// A comment on GitHub that may ask sortie for work, as a delivery tells of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Comment {
    pub repo: RepoName,
    /// The repository's page (`https://host/owner/name`): its host is the forge's.
    pub repo_url: String,
    /// `created`, `edited` or `deleted`.
    pub action: String,
    pub comment_id: u64,
    pub body: String,
    pub comment_url: String,
    pub sender: String,
    /// The comment's author is a bot (`type: Bot`, or a login ending `[bot]`).
    pub by_bot: bool,
    /// The App the comment was made through, if any.
    pub via_app: Option<u64>,
    pub installation: Option<u64>,
    pub on: Thread,
    /// For an issue assigned (an `issues` delivery, `action: assigned`, no comment: `comment_id` 0 and
    /// an empty body): who it was assigned to.
    pub assignee: Option<String>,
    /// For an issue assigned: when the issue was last changed (the assignment), to tell one assignment
    /// from the next.
    pub changed_at: Option<String>,
}

/// Where a comment was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Thread {
    /// An issue (not a pull request).
    Issue {
        number: u64,
        title: String,
        body: String,
        url: String,
    },
    /// A pull request's conversation (an `issue_comment` on a pull request). The head branch is not in
    /// the payload.
    PullRequest { number: u64, url: String },
    /// A line of a pull request's diff (`pull_request_review_comment`).
    ReviewLine {
        number: u64,
        url: String,
        head_ref: String,
        /// The repository the head branch is in (`owner/name`; another for a fork's pull request).
        head_repo: Option<String>,
        path: String,
        line: Option<u64>,
        diff_hunk: String,
    },
}

impl Thread {
    /// The issue or pull request number.
    pub fn number(&self) -> u64 {
        match self {
            Self::Issue { number, .. } | Self::PullRequest { number, .. } | Self::ReviewLine { number, .. } => *number,
        }
    }
}

/// Why a delivery was not read as a comment.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PayloadError {
    #[error("the payload is not the JSON of a {0} event: {1}")]
    Malformed(&'static str, String),
    #[error("the payload names no repository sortie can use: {0}")]
    Repository(String),
}

#[derive(Deserialize)]
struct User {
    login: String,
    #[serde(rename = "type", default)]
    kind: String,
}

#[derive(Deserialize)]
struct AppRef {
    id: u64,
}

#[derive(Deserialize)]
struct CommentPayload {
    id: u64,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    html_url: String,
    user: User,
    #[serde(default)]
    performed_via_github_app: Option<AppRef>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    line: Option<u64>,
    #[serde(default)]
    diff_hunk: Option<String>,
}

#[derive(Deserialize)]
struct Repository {
    full_name: String,
    html_url: String,
}

#[derive(Deserialize)]
struct Installation {
    id: u64,
}

#[derive(Deserialize)]
struct IssuePayload {
    number: u64,
    #[serde(default)]
    title: String,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    html_url: String,
    #[serde(default)]
    pull_request: Option<IssuePullRequest>,
    #[serde(default)]
    updated_at: Option<String>,
}

#[derive(Deserialize)]
struct IssuePullRequest {
    #[serde(default)]
    html_url: String,
}

#[derive(Deserialize)]
struct Branch {
    #[serde(rename = "ref")]
    name: String,
    #[serde(default)]
    repo: Option<BranchRepository>,
}

#[derive(Deserialize)]
struct BranchRepository {
    full_name: String,
}

#[derive(Deserialize)]
struct PullRequestPayload {
    number: u64,
    #[serde(default)]
    html_url: String,
    head: Branch,
}

#[derive(Deserialize)]
struct IssueComment {
    action: String,
    issue: IssuePayload,
    comment: CommentPayload,
    repository: Repository,
    #[serde(default)]
    installation: Option<Installation>,
}

#[derive(Deserialize)]
struct ReviewComment {
    action: String,
    pull_request: PullRequestPayload,
    comment: CommentPayload,
    repository: Repository,
    #[serde(default)]
    installation: Option<Installation>,
}

/// The comment a delivery of `event` carries, or `None` for an event sortie does not act on.
pub fn comment(event: &str, payload: &[u8]) -> Result<Option<Comment>, PayloadError> {
    let (action, comment, repository, installation, on) = match event {
        "issue_comment" => {
            let delivery: IssueComment =
                serde_json::from_slice(payload).map_err(|e| PayloadError::Malformed("issue_comment", e.to_string()))?;
            let issue = delivery.issue;
            let on = match issue.pull_request {
                Some(pull) => Thread::PullRequest {
                    number: issue.number,
                    url: if pull.html_url.is_empty() {
                        issue.html_url
                    } else {
                        pull.html_url
                    },
                },
                None => Thread::Issue {
                    number: issue.number,
                    title: issue.title,
                    body: issue.body.unwrap_or_default(),
                    url: issue.html_url,
                },
            };
            (
                delivery.action,
                delivery.comment,
                delivery.repository,
                delivery.installation,
                on,
            )
        }
        "pull_request_review_comment" => {
            let delivery: ReviewComment = serde_json::from_slice(payload)
                .map_err(|e| PayloadError::Malformed("pull_request_review_comment", e.to_string()))?;
            let pull = delivery.pull_request;
            let on = Thread::ReviewLine {
                number: pull.number,
                url: pull.html_url,
                head_repo: pull.head.repo.map(|repo| repo.full_name),
                head_ref: pull.head.name,
                path: delivery.comment.path.clone().unwrap_or_default(),
                line: delivery.comment.line,
                diff_hunk: delivery.comment.diff_hunk.clone().unwrap_or_default(),
            };
            (
                delivery.action,
                delivery.comment,
                delivery.repository,
                delivery.installation,
                on,
            )
        }
        "issues" => return assignment(payload),
        _ => return Ok(None),
    };
    let repo = RepoName::parse(&repository.full_name).map_err(|e| PayloadError::Repository(e.to_string()))?;
    let by_bot = comment.user.kind.eq_ignore_ascii_case("bot") || comment.user.login.ends_with("[bot]");
    Ok(Some(Comment {
        repo,
        repo_url: repository.html_url,
        action,
        comment_id: comment.id,
        body: comment.body.unwrap_or_default(),
        comment_url: comment.html_url,
        sender: comment.user.login,
        by_bot,
        via_app: comment.performed_via_github_app.map(|app| app.id),
        installation: installation.map(|i| i.id),
        on,
        assignee: None,
        changed_at: None,
    }))
}

#[derive(Deserialize)]
struct IssueEvent {
    action: String,
    issue: IssuePayload,
    #[serde(default)]
    assignee: Option<User>,
    sender: User,
    repository: Repository,
    #[serde(default)]
    installation: Option<Installation>,
}

/// An `issues` delivery: only an assignment is read, as a request without a comment.
fn assignment(payload: &[u8]) -> Result<Option<Comment>, PayloadError> {
    let delivery: IssueEvent =
        serde_json::from_slice(payload).map_err(|e| PayloadError::Malformed("issues", e.to_string()))?;
    let Some(assignee) = delivery.assignee.filter(|_| delivery.action == "assigned") else {
        return Ok(None);
    };
    // An assignment on a pull request is not a request for a new session.
    if delivery.issue.pull_request.is_some() {
        return Ok(None);
    }
    let repo = RepoName::parse(&delivery.repository.full_name).map_err(|e| PayloadError::Repository(e.to_string()))?;
    let issue = delivery.issue;
    let changed_at = issue.updated_at.clone();
    let by_bot = delivery.sender.kind.eq_ignore_ascii_case("bot") || delivery.sender.login.ends_with("[bot]");
    Ok(Some(Comment {
        repo,
        repo_url: delivery.repository.html_url,
        action: delivery.action,
        comment_id: 0,
        body: String::new(),
        comment_url: issue.html_url.clone(),
        sender: delivery.sender.login,
        by_bot,
        via_app: None,
        installation: delivery.installation.map(|i| i.id),
        on: Thread::Issue {
            number: issue.number,
            title: issue.title,
            body: issue.body.unwrap_or_default(),
            url: issue.html_url,
        },
        assignee: Some(assignee.login),
        changed_at,
    }))
}

impl Comment {
    /// Why this comment asks nothing of sortie (the loop guards and the mention), or `None` when it is
    /// a request, still subject to the sender's permission. `own_app` is sortie's App ID; `assignee` the
    /// login whose assignment to an issue asks for work (none: assignments are not taken).
    pub fn ignored(&self, own_app: &str, assignee: Option<&str>) -> Option<&'static str> {
        if let Some(assigned) = &self.assignee {
            if self.by_bot {
                return Some("assigned by a bot");
            }
            return match assignee {
                Some(login) if login.eq_ignore_ascii_case(assigned) => None,
                _ => Some("assigned to someone other than sortie"),
            };
        }
        if self.action != "created" {
            return Some("not a new comment");
        }
        if self.by_bot {
            return Some("written by a bot");
        }
        if self.via_app.is_some_and(|id| id.to_string() == own_app) {
            return Some("written through sortie's own App");
        }
        if instruction(&self.body).is_none() {
            return Some("does not mention @sortie");
        }
        None
    }

    /// What this request is, from its signed body alone: the comment (ids are unique on a host), or the
    /// assignment of an issue at the time it was made. The same body delivered again under another
    /// delivery id has the same key.
    pub fn request_key(&self, host: &str) -> String {
        match &self.assignee {
            None => format!("comment:{host}/{}#{}", self.repo, self.comment_id),
            Some(assignee) => format!(
                "assigned:{host}/{}#{}:{assignee}@{}",
                self.repo,
                self.on.number(),
                self.changed_at.as_deref().unwrap_or_default()
            ),
        }
    }

    /// The comment's host: the authority of the repository's page.
    pub fn host(&self) -> Option<String> {
        let rest = self.repo_url.strip_prefix("https://")?;
        let host = rest.split('/').next()?;
        (!host.is_empty()).then(|| host.to_ascii_lowercase())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_githubs_documented_test_vector() {
        let expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert_eq!(signature(b"It's a Secret to Everybody", b"Hello, World!"), expected);
        assert!(signature_matches(
            b"It's a Secret to Everybody",
            b"Hello, World!",
            expected
        ));
        for wrong in [
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e18",
            "sha1=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
            "sha256=757107",
            "sha256=zz7107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
            "",
            "sha256=é57107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e1",
        ] {
            assert!(
                !signature_matches(b"It's a Secret to Everybody", b"Hello, World!", wrong),
                "{wrong}"
            );
        }
        assert!(!signature_matches(b"another secret", b"Hello, World!", expected));
        assert!(!signature_matches(
            b"It's a Secret to Everybody",
            b"Hello, World?",
            expected
        ));
    }

    #[test]
    fn a_mention_is_a_word_and_the_rest_is_the_instruction() {
        assert_eq!(
            instruction("@sortie add a CHANGELOG entry").as_deref(),
            Some("add a CHANGELOG entry")
        );
        assert_eq!(
            instruction("Hey @Sortie, also add a test").as_deref(),
            Some("Hey , also add a test")
        );
        assert_eq!(
            instruction("please\n@sortie: fix it").as_deref(),
            Some("please\n: fix it")
        );
        assert_eq!(instruction("@sortie").as_deref(), Some(""));
        for none in ["email@sortie.dev", "@sortiebot do it", "nothing here", "x@sortie y"] {
            assert_eq!(instruction(none), None, "{none}");
        }
        assert_eq!(
            instruction("@sortiebot no, but @sortie yes").as_deref(),
            Some("@sortiebot no, but  yes")
        );
    }

    fn issue_comment(action: &str, login: &str, kind: &str, body: &str, via: Option<u64>) -> Vec<u8> {
        serde_json::json!({
            "action": action,
            "issue": {"number": 7, "title": "Changelog", "body": "We need one.", "html_url": "https://github.com/acme/app/issues/7"},
            "comment": {"id": 99, "body": body, "html_url": "https://github.com/acme/app/issues/7#issuecomment-99",
                        "user": {"login": login, "type": kind},
                        "performed_via_github_app": via.map(|id| serde_json::json!({"id": id}))},
            "repository": {"full_name": "acme/app", "html_url": "https://github.com/acme/app"},
            "sender": {"login": login, "type": kind},
            "installation": {"id": 5},
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn an_issue_comment_reads_as_a_request_and_the_loop_guards_hold() {
        let read = |payload: Vec<u8>| comment("issue_comment", &payload).expect("parses").expect("a comment");
        let asked = read(issue_comment("created", "octocat", "User", "@sortie add it", None));
        assert_eq!(asked.ignored("1", None), None);
        assert_eq!(asked.repo.to_string(), "acme/app");
        assert_eq!(asked.host().as_deref(), Some("github.com"));
        assert_eq!(asked.installation, Some(5));
        assert!(matches!(&asked.on, Thread::Issue { number: 7, title, .. } if title == "Changelog"));
        assert_eq!(
            read(issue_comment("edited", "octocat", "User", "@sortie add it", None)).ignored("1", None),
            Some("not a new comment")
        );
        assert_eq!(
            read(issue_comment(
                "created",
                "dependabot[bot]",
                "Bot",
                "@sortie add it",
                None
            ))
            .ignored("1", None),
            Some("written by a bot")
        );
        assert_eq!(
            read(issue_comment("created", "sneaky[bot]", "User", "@sortie add it", None)).ignored("1", None),
            Some("written by a bot")
        );
        assert_eq!(
            read(issue_comment("created", "octocat", "User", "@sortie again", Some(1))).ignored("1", None),
            Some("written through sortie's own App")
        );
        assert_eq!(
            read(issue_comment("created", "octocat", "User", "just a remark", None)).ignored("1", None),
            Some("does not mention @sortie")
        );
        assert_eq!(comment("push", b"{}"), Ok(None));
        assert!(comment("issue_comment", b"{\"action\":1}").is_err());
    }

    #[test]
    fn an_issue_assigned_to_sortie_is_a_request() {
        let assigned = |to: &str, by: &str, kind: &str| {
            serde_json::json!({
                "action": "assigned",
                "issue": {"number": 9, "title": "Flaky test", "body": null, "html_url": "https://github.com/acme/app/issues/9"},
                "assignee": {"login": to, "type": "Bot"},
                "sender": {"login": by, "type": kind},
                "repository": {"full_name": "acme/app", "html_url": "https://github.com/acme/app"},
            })
            .to_string()
        };
        let read = |payload: String| {
            comment("issues", payload.as_bytes())
                .expect("parses")
                .expect("a request")
        };
        let ours = read(assigned("sortie-app[bot]", "octocat", "User"));
        assert_eq!(ours.ignored("1", Some("Sortie-App[bot]")), None);
        assert!(matches!(&ours.on, Thread::Issue { number: 9, .. }));
        assert_eq!(ours.ignored("1", None), Some("assigned to someone other than sortie"));
        assert_eq!(
            read(assigned("octocat", "octocat", "User")).ignored("1", Some("sortie-app[bot]")),
            Some("assigned to someone other than sortie")
        );
        assert_eq!(
            read(assigned("sortie-app[bot]", "renovate[bot]", "Bot")).ignored("1", Some("sortie-app[bot]")),
            Some("assigned by a bot")
        );
        let opened = serde_json::json!({"action": "opened", "issue": {"number": 1}, "sender": {"login": "o"},
            "repository": {"full_name": "acme/app", "html_url": "https://github.com/acme/app"}});
        assert_eq!(comment("issues", opened.to_string().as_bytes()), Ok(None));
    }

    #[test]
    fn a_review_comment_carries_its_line() {
        let payload = serde_json::json!({
            "action": "created",
            "pull_request": {"number": 3, "html_url": "https://github.com/acme/app/pull/3", "head": {"ref": "sortie/x"}},
            "comment": {"id": 4, "body": "@sortie rename this", "user": {"login": "octocat", "type": "User"},
                        "path": "src/lib.rs", "line": 12, "diff_hunk": "@@ -1 +1 @@\n-a\n+b"},
            "repository": {"full_name": "acme/app", "html_url": "https://github.com/acme/app"},
        });
        let read = comment("pull_request_review_comment", payload.to_string().as_bytes())
            .expect("parses")
            .expect("a comment");
        assert!(
            matches!(&read.on, Thread::ReviewLine { number: 3, path, line: Some(12), head_ref, .. }
            if path == "src/lib.rs" && head_ref == "sortie/x")
        );
    }
}
