//! Checks of request fields that need nothing but the value. Each returns the error code and a
//! sentence naming what is wrong; the api answers with them and writes nothing.

use crate::error::ErrorCode;
use crate::limits::{
    BASE_MAX_BYTES, MODEL_MAX_BYTES, PROMPT_MAX_BYTES, REPO_MAX_BYTES, SETUP_MAX_BYTES, TITLE_MAX_CHARS,
};

/// A refused field: the code to answer with and a sentence for people.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

/// A task or steer prompt: not blank, at most 100 KiB.
pub fn check_prompt(field: &str, prompt: &str) -> Result<(), Refusal> {
    if prompt.len() > PROMPT_MAX_BYTES {
        return Err(refuse(
            ErrorCode::PromptTooLarge,
            format!(
                "{field} is {} bytes; the limit is {PROMPT_MAX_BYTES} bytes (100 KiB)",
                prompt.len()
            ),
        ));
    }
    if prompt.trim().is_empty() {
        return Err(refuse(ErrorCode::InvalidRequest, format!("{field} is empty")));
    }
    Ok(())
}

pub fn check_title(title: &str) -> Result<(), Refusal> {
    let chars = title.chars().count();
    if chars > TITLE_MAX_CHARS {
        return Err(refuse(
            ErrorCode::TitleTooLong,
            format!("title is {chars} characters; the limit is {TITLE_MAX_CHARS}"),
        ));
    }
    if title.chars().any(char::is_control) {
        return Err(refuse(ErrorCode::InvalidRequest, "title has control characters"));
    }
    Ok(())
}

pub fn check_setup(setup: &str) -> Result<(), Refusal> {
    if setup.len() > SETUP_MAX_BYTES {
        return Err(refuse(
            ErrorCode::SetupTooLarge,
            format!("setup is {} bytes; the limit is {SETUP_MAX_BYTES} bytes", setup.len()),
        ));
    }
    Ok(())
}

/// A model name as vendors spell them: letters, digits and `-._:/@`, at most 200 bytes.
pub fn check_model(model: &str) -> Result<(), Refusal> {
    let well_formed = !model.is_empty()
        && model.len() <= MODEL_MAX_BYTES
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:/@".contains(&b));
    if well_formed {
        Ok(())
    } else {
        Err(refuse(
            ErrorCode::ModelInvalid,
            format!(
                "model {model:?} is not a model name (letters, digits and -._:/@, at most {MODEL_MAX_BYTES} bytes)"
            ),
        ))
    }
}

/// A branch name git would accept (the rules of `git check-ref-format --branch`, minus `@{-N}`).
pub fn check_base(base: &str) -> Result<(), Refusal> {
    let bad = |why: &str| {
        Err(refuse(
            ErrorCode::BaseInvalid,
            format!("base {base:?} is not a valid branch name: {why}"),
        ))
    };
    if base.is_empty() {
        return bad("it is empty");
    }
    if base.len() > BASE_MAX_BYTES {
        return bad("it is too long");
    }
    if base.starts_with('-') {
        return bad("it starts with a hyphen");
    }
    if base.bytes().any(|b| b.is_ascii_control() || b" ~^:?*[\\".contains(&b)) {
        return bad("it has a space, a control character or one of ~^:?*[\\");
    }
    if base.contains("..") || base.contains("@{") || base.contains("//") {
        return bad("it contains '..', '@{' or '//'");
    }
    if base == "@" || base.starts_with('/') || base.ends_with('/') || base.ends_with('.') {
        return bad("it starts or ends with '/', ends with '.', or is '@'");
    }
    if base
        .split('/')
        .any(|component| component.starts_with('.') || component.ends_with(".lock"))
    {
        return bad("a component starts with '.' or ends with '.lock'");
    }
    Ok(())
}

/// What a `repo` field names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RepoLocation {
    /// An `https://` git URL without credentials.
    Https(String),
    /// An absolute local path (not yet resolved: the server canonicalizes it and checks access).
    LocalPath(String),
}

/// Sorts a `repo` field into a URL or a path and refuses anything else.
pub fn check_repo(repo: &str) -> Result<RepoLocation, Refusal> {
    let bad = |why: &str| Err(refuse(ErrorCode::RepoInvalid, format!("repo {repo:?} {why}")));
    if repo.is_empty() {
        return bad("is empty");
    }
    if repo.len() > REPO_MAX_BYTES {
        return bad("is too long");
    }
    if repo.chars().any(|c| c.is_control()) {
        return bad("has control characters");
    }
    if let Some(rest) = repo.strip_prefix("https://") {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        if authority.contains('@') {
            return bad(
                "carries credentials: give the plain URL; credentials come from the workspace's forge connection",
            );
        }
        let host = authority.rsplit_once(':').map_or(authority, |(host, _port)| host);
        if host.is_empty() || rest.len() == authority.len() || repo.chars().any(char::is_whitespace) {
            return bad("is not a repository URL (https://host/owner/name)");
        }
        return Ok(RepoLocation::Https(repo.to_owned()));
    }
    if repo.contains("://") || repo.starts_with("git@") {
        return bad("uses a scheme sortie does not clone from: give an https:// URL or an absolute local path");
    }
    if !repo.starts_with('/') {
        return bad("is not absolute: give an https:// URL or an absolute local path");
    }
    Ok(RepoLocation::LocalPath(repo.to_owned()))
}

/// The title a session gets when the request names none: the task's first non-blank line, shortened.
pub fn default_title(task: &str) -> String {
    const MAX: usize = 80;
    let line = task
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("untitled");
    let clean: String = line.chars().filter(|c| !c.is_control()).collect();
    if clean.chars().count() <= MAX {
        clean
    } else {
        let mut short: String = clean.chars().take(MAX - 1).collect();
        short.push('…');
        short
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_bounded_at_exactly_100_kib() {
        assert_eq!(check_prompt("task", &"a".repeat(PROMPT_MAX_BYTES)), Ok(()));
        assert_eq!(
            check_prompt("task", &"a".repeat(PROMPT_MAX_BYTES + 1)).map_err(|r| r.code),
            Err(ErrorCode::PromptTooLarge)
        );
        assert_eq!(
            check_prompt("task", " \n\t").map_err(|r| r.code),
            Err(ErrorCode::InvalidRequest)
        );
        // Multi-byte characters count by bytes.
        let euros = "€".repeat(PROMPT_MAX_BYTES / 3 + 1);
        assert_eq!(
            check_prompt("task", &euros).map_err(|r| r.code),
            Err(ErrorCode::PromptTooLarge)
        );
    }

    #[test]
    fn titles_count_characters() {
        assert_eq!(check_title(&"é".repeat(TITLE_MAX_CHARS)), Ok(()));
        assert_eq!(
            check_title(&"é".repeat(TITLE_MAX_CHARS + 1)).map_err(|r| r.code),
            Err(ErrorCode::TitleTooLong)
        );
        assert!(check_title("a\u{7}b").is_err());
    }

    #[test]
    fn base_names_follow_git_rules() {
        for good in ["main", "release/1.2", "feature/x-y_z", "v1.0.0"] {
            assert_eq!(check_base(good), Ok(()), "{good}");
        }
        for bad in [
            "", "-main", "a..b", "a b", "a~1", "a^", "a:b", "a?", "a*", "a[", "a\\b", "/a", "a/", "a.", "a//b",
            ".hidden", "a/.b", "x.lock", "@", "a@{1}", "a\u{1}",
        ] {
            assert_eq!(
                check_base(bad).map_err(|r| r.code),
                Err(ErrorCode::BaseInvalid),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn models_are_vendor_names() {
        for good in [
            "claude-sonnet-4-5",
            "gpt-5.1-codex",
            "gemini-2.5-pro",
            "openrouter/anthropic/claude@latest",
            "ft:gpt-4o:org:x",
        ] {
            assert_eq!(check_model(good), Ok(()), "{good}");
        }
        for bad in ["", "a b", "x;rm", &"m".repeat(MODEL_MAX_BYTES + 1)] {
            assert_eq!(
                check_model(bad).map_err(|r| r.code),
                Err(ErrorCode::ModelInvalid),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn repos_are_https_urls_or_absolute_paths() {
        assert_eq!(
            check_repo("https://github.com/o/r.git"),
            Ok(RepoLocation::Https("https://github.com/o/r.git".into()))
        );
        assert_eq!(
            check_repo("https://git.example.com:8443/o/r"),
            Ok(RepoLocation::Https("https://git.example.com:8443/o/r".into()))
        );
        assert_eq!(
            check_repo("/srv/git/r"),
            Ok(RepoLocation::LocalPath("/srv/git/r".into()))
        );
        for bad in [
            "",
            "https://user:pw@github.com/o/r",
            "https://token@github.com/o/r",
            "https://github.com",
            "https:///o/r",
            "http://github.com/o/r",
            "ssh://git@github.com/o/r",
            "git@github.com:o/r.git",
            "file:///srv/r",
            "relative/path",
            "./r",
            "/srv/r\nx",
        ] {
            assert_eq!(
                check_repo(bad).map_err(|r| r.code),
                Err(ErrorCode::RepoInvalid),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn default_titles_take_the_first_line() {
        assert_eq!(default_title("\n  Fix the login bug  \nmore"), "Fix the login bug");
        assert_eq!(default_title("   "), "untitled");
        let long = default_title(&"x".repeat(200));
        assert_eq!(long.chars().count(), 80);
        assert!(long.ends_with('…'));
    }
}
