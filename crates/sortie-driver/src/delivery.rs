//! Delivery at turn end (DESIGN §2 step 4, §7.3): commit the workspace, scan every commit that
//! would become visible on the remote for secrets (`secrets`), and publish the branch idempotently.
//!
//! The pure parts come first (the commit message, the parser of `ls-remote`, the decision what to do
//! with the remote's ref); the git I/O is at the bottom. Behind the sandbox's relay the push goes
//! straight to the git proxy ([`crate::push`]), with `git push` as its fallback. It must never push
//! what the scan has not read, nor write a secret value anywhere.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

use crate::secrets::{Finding, KnownSecrets, PatchScanner, SecretsError, secret_reason};
pub use sortie_protocol::driver::DeliveryReport;
use sortie_protocol::driver::{DriverFailureCode, TurnFailure};

/// The longest subject line of a commit message.
const SUBJECT_MAX_CHARS: usize = 72;
/// The most of the prompt a commit message carries.
const BODY_MAX_BYTES: usize = 2048;
/// How much of git's stderr a failure reason quotes.
const STDERR_TAIL_BYTES: usize = 2048;
/// Every git command is killed after this long unless the config says otherwise.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(120);

/// How the driver delivers a turn's work.
#[derive(Clone, Debug)]
pub struct DeliveryConfig {
    /// The branch to publish, without `refs/heads/` (e.g. `sortie/ses_…`).
    pub branch: String,
    /// A remote name or URL (a local path works too).
    pub remote: String,
    pub author_name: String,
    pub author_email: String,
    pub known_secrets: Arc<KnownSecrets>,
    /// Where `known_secrets` came from: read again at each delivery (the operator may have added a
    /// secret since), and added to what was read before.
    pub known_secrets_file: Option<PathBuf>,
    pub git_timeout: Duration,
    /// How long a push keeps being tried while the gateway cannot be reached (the server may be
    /// restarting: its sandboxes outlive it).
    pub unreachable_wait: Duration,
    /// A pod's: where what a failed delivery could not push is kept (a pod keeps nothing once let go).
    pub keep: Option<KeptWork>,
}

/// A pod's kept work: a failed delivery pushes HEAD to `refname` (the session's WIP ref, which only
/// that session's git proxy lets through), and the next delivery that lands deletes it again.
#[derive(Clone, Debug)]
pub struct KeptWork {
    pub refname: String,
    /// Whether the ref holds work this workspace has (kept here, or restored into it at the checkout).
    pub outstanding: Arc<std::sync::atomic::AtomicBool>,
}

/// The default of [`DeliveryConfig::unreachable_wait`]: the server's default grace for sandboxes
/// it left behind, so a push outlasts any restart the sandbox itself outlasts.
pub const UNREACHABLE_WAIT: Duration = Duration::from_secs(120);
/// The longest pause between two attempts of a push the gateway did not answer.
const UNREACHABLE_MAX_PAUSE: Duration = Duration::from_secs(4);

/// Why the known secrets' digests file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KnownSecretsError {
    #[error("cannot read the secret digests {path}: {source}")]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Invalid(#[from] SecretsError),
}

/// Reads and parses a digests file (the host writes it; see `sortie_secrets::KnownSecrets::parse`).
pub fn load_known_secrets(path: &Path) -> Result<KnownSecrets, KnownSecretsError> {
    let text = std::fs::read_to_string(path).map_err(|source| KnownSecretsError::Unreadable {
        path: path.to_owned(),
        source,
    })?;
    Ok(KnownSecrets::parse(&text, path)?)
}

/// Why a delivery failed; `code()` is the turn's failure code.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("{0}")]
    SecretDetected(String),
    #[error("{0}")]
    PushConflict(String),
    #[error(transparent)]
    Git(#[from] GitError),
}

impl DeliveryError {
    pub fn code(&self) -> DriverFailureCode {
        match self {
            Self::SecretDetected(_) => DriverFailureCode::SecretDetected,
            Self::PushConflict(_) => DriverFailureCode::PushConflict,
            Self::Git(_) => DriverFailureCode::DeliveryFailed,
        }
    }

    pub fn to_failure(&self) -> TurnFailure {
        TurnFailure {
            code: self.code(),
            reason: self.to_string(),
        }
    }
}

/// A git command that did not do its job.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("cannot run git to {what}: {source}")]
    Spawn { what: &'static str, source: std::io::Error },
    #[error("git did not {what} within {seconds}s and was killed")]
    TimedOut { what: &'static str, seconds: u64 },
    #[error("git could not {what} ({status}): {stderr}")]
    Failed {
        what: &'static str,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{refname} points at {found}, not at {expected} as the host recorded it")]
    Moved {
        refname: String,
        expected: String,
        found: String,
    },
}

impl GitError {
    /// Whether git says the remote could not be reached at all (the gateway is down or restarting):
    /// worth trying again, unlike an answer that refused the push.
    pub fn is_unreachable(&self) -> bool {
        // Not "Send failure": an upstream that refuses a large pack early leaves git writing into a
        // closed connection, and that refusal must not be uploaded again and again.
        const SIGNS: [&str; 8] = [
            "Empty reply from server",
            "Connection refused",
            "Connection reset by peer",
            "Failed to connect",
            "Couldn't connect",
            "Could not connect",
            "Recv failure",
            "the repository's forge did not answer",
        ];
        match self {
            // A report-status line means the remote answered: a refusal, whatever its words.
            Self::Failed { stderr, .. } => {
                !stderr.contains("[remote rejected]") && SIGNS.iter().any(|sign| stderr.contains(sign))
            }
            Self::Spawn { .. } | Self::TimedOut { .. } | Self::Moved { .. } => false,
        }
    }
}

/// A branch name the driver will not push to.
#[derive(Debug, thiserror::Error)]
#[error("{branch:?} is not a usable branch name: {why}")]
pub struct BranchError {
    pub branch: String,
    pub why: &'static str,
}

// ---------------------------------------------------------------------------------------------
// Pure parts.
// ---------------------------------------------------------------------------------------------

/// Checks a branch name (without `refs/heads/`) against the rules of `git check-ref-format` that
/// matter here, with a narrower alphabet: it ends up in argv and in a refspec.
pub fn validate_branch(branch: &str) -> Result<(), BranchError> {
    let refuse = |why| {
        Err(BranchError {
            branch: branch.to_owned(),
            why,
        })
    };
    if branch.is_empty() || branch.len() > 200 {
        return refuse("it must have 1 to 200 characters");
    }
    if !branch
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/'))
    {
        return refuse("only letters, digits, `_`, `-`, `.` and `/` are allowed");
    }
    if branch.starts_with(['-', '/', '.']) || branch.ends_with(['/', '.']) || branch.ends_with(".lock") {
        return refuse("it must not start with `-`, `/` or `.`, nor end with `/`, `.` or `.lock`");
    }
    if branch.contains("..") || branch.contains("//") || branch.contains("/.") {
        return refuse("it must not contain `..`, `//` or `/.`");
    }
    Ok(())
}

/// The commit message of a turn: the prompt's first line as the subject (≤ 72 characters), the
/// prompt (≤ 2 KiB) as the body unless it is just that line, and a `Sortie-Session` trailer.
pub fn commit_message(prompt: &str, session_id: &str) -> String {
    // A NUL cannot travel in argv; nothing of value is lost with it.
    let prompt = prompt.replace('\0', "");
    let prompt = prompt.trim();
    let first = prompt
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("");
    let subject = if first.is_empty() {
        "sortie: agent turn".to_owned()
    } else if first.chars().count() > SUBJECT_MAX_CHARS {
        let mut cut: String = first.chars().take(SUBJECT_MAX_CHARS - 1).collect();
        cut.truncate(cut.trim_end().len());
        cut.push('…');
        cut
    } else {
        first.to_owned()
    };
    let mut message = subject.clone();
    if !prompt.is_empty() && prompt != subject {
        let mut body = prompt;
        let truncated = body.len() > BODY_MAX_BYTES;
        if truncated {
            let mut end = BODY_MAX_BYTES;
            while !body.is_char_boundary(end) {
                end -= 1;
            }
            body = &body[..end];
        }
        message.push_str("\n\n");
        message.push_str(body.trim_end());
        if truncated {
            message.push_str("\n[…]");
        }
    }
    message.push_str("\n\nSortie-Session: ");
    message.push_str(session_id);
    message.push('\n');
    message
}

/// The remote's commit for `refs/heads/<branch>` in `git ls-remote` output.
pub fn parse_ls_remote(output: &str, branch: &str) -> Option<String> {
    let wanted = format!("refs/heads/{branch}");
    output.lines().find_map(|line| {
        let (sha, name) = line.split_once('\t')?;
        (name.trim_end() == wanted).then(|| sha.trim().to_owned())
    })
}

/// What to do given where the remote branch is (§7.3).
#[derive(Debug, PartialEq, Eq)]
pub enum Publication {
    /// The remote already has the candidate.
    AlreadyThere,
    /// The remote is where this turn expects it: push with a lease on that.
    Push,
    /// Someone else moved the branch.
    Conflict,
}

pub fn decide(remote: Option<&str>, candidate: &str, baseline: Option<&str>) -> Publication {
    if remote == Some(candidate) {
        Publication::AlreadyThere
    } else if remote == baseline {
        Publication::Push
    } else {
        Publication::Conflict
    }
}

fn conflict_reason(branch: &str, remote: Option<&str>, baseline: Option<&str>) -> String {
    let place = |sha: Option<&str>| sha.map_or_else(|| "absent".to_owned(), |sha| format!("at {sha}"));
    format!(
        "someone else moved the branch {branch}: the remote has it {}, this turn expected it {}; nothing \
         was pushed",
        place(remote),
        place(baseline)
    )
}

/// The last lines of a command's stderr that fit in a failure reason.
fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.len() <= STDERR_TAIL_BYTES {
        return text.to_owned();
    }
    let mut start = text.len() - STDERR_TAIL_BYTES;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let tail = &text[start..];
    // Start at a line, not in the middle of one.
    tail.split_once('\n').map_or(tail, |(_, rest)| rest).to_owned()
}

// ---------------------------------------------------------------------------------------------
// Git I/O.
// ---------------------------------------------------------------------------------------------

/// Settings for every git command: the agent may have written the workspace's and $HOME's git
/// config, so whatever would run its code or change the output the scanner reads is overridden.
const GIT_OVERRIDES: &[&str] = &[
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.pager=cat",
    "core.quotePath=false",
    "core.askPass=",
    "credential.helper=",
    "color.ui=false",
    "commit.gpgSign=false",
    "push.gpgSign=false",
    // The workspace may belong to another uid than the driver's (a clone lent to the sandbox).
    "safe.directory=*",
    // A workspace lives one session: the maintenance git starts after each commit (and the delivery
    // waits on) would tidy objects that go with the sandbox.
    "maintenance.auto=false",
    "gc.auto=0",
];

/// Runs git in the workspace with the agent's environment, bounded in time.
#[derive(Clone, Debug)]
pub struct Git {
    pub workspace: PathBuf,
    pub env: Vec<(String, String)>,
    pub timeout: Duration,
}

/// A finished git command.
pub(crate) struct Ran {
    pub(crate) status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Git {
    pub(crate) fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("git");
        for setting in GIT_OVERRIDES {
            command.arg("-c").arg(setting);
        }
        command
            .args(args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("GIT_TERMINAL_PROMPT", "0")
            // Messages are parsed (`commit`'s status): no translation.
            .env("LC_ALL", "C")
            .current_dir(&self.workspace)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A whole group, so that a timeout also kills git's helpers (remote-http, pack-objects).
            .process_group(0)
            .kill_on_drop(true);
        command
    }

    /// Runs `git <args>`; a non-zero exit is returned, not an error.
    pub(crate) async fn run_with(
        &self,
        what: &'static str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Ran, GitError> {
        let mut command = self.command(args);
        command.envs(env.iter().copied());
        let child = command.spawn().map_err(|source| GitError::Spawn { what, source })?;
        let group = child.id().and_then(|pid| i32::try_from(pid).ok());
        match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(Ok(output)) => Ok(Ran {
                status: output.status,
                stdout: output.stdout,
                stderr: output.stderr,
            }),
            Ok(Err(source)) => Err(GitError::Spawn { what, source }),
            Err(_) => {
                kill_group(group);
                Err(GitError::TimedOut {
                    what,
                    seconds: self.timeout.as_secs(),
                })
            }
        }
    }

    async fn run(&self, what: &'static str, args: &[&str]) -> Result<Ran, GitError> {
        self.run_with(what, args, &[]).await
    }

    /// Runs `git <args>` and fails unless it exits 0; returns its stdout, trimmed.
    async fn output(&self, what: &'static str, args: &[&str]) -> Result<String, GitError> {
        let ran = self.run(what, args).await?;
        if !ran.status.success() {
            return Err(GitError::Failed {
                what,
                status: ran.status,
                stderr: stderr_tail(&ran.stderr),
            });
        }
        Ok(String::from_utf8_lossy(&ran.stdout).trim().to_owned())
    }

    /// Clones `url` into the empty workspace and starts `branch` at `commit` there (a pod's workspace,
    /// made at its assignment).
    pub async fn checkout(&self, url: &str, commit: &str, branch: &str) -> Result<(), GitError> {
        self.output("clone", &["clone", "--quiet", "--no-checkout", url, "."])
            .await?;
        self.output("checkout", &["checkout", "--quiet", "--no-track", "-B", branch, commit])
            .await?;
        Ok(())
    }

    /// Makes the working tree hold the files of `commit`, kept at `refname` by the session's last pod,
    /// on top of HEAD (whose index stays): the next delivery commits them. The ref must still point
    /// at `commit`: a ref someone moved since is not taken.
    pub async fn restore_kept(&self, refname: &str, commit: &str) -> Result<(), GitError> {
        self.output(
            "fetch the kept work",
            &["fetch", "--quiet", "--no-tags", "origin", refname],
        )
        .await?;
        let fetched = self
            .output(
                "read the kept work",
                &["rev-parse", "--verify", "--quiet", "FETCH_HEAD^{commit}"],
            )
            .await?;
        if fetched != commit {
            return Err(GitError::Moved {
                refname: refname.to_owned(),
                expected: commit.to_owned(),
                found: fetched,
            });
        }
        self.output("restore the kept work", &["read-tree", "-u", "--reset", commit])
            .await?;
        self.output("restore the kept work", &["reset", "--quiet"]).await?;
        Ok(())
    }

    /// The commit HEAD points at, `None` on an unborn branch.
    pub async fn head(&self) -> Result<Option<String>, GitError> {
        self.commit_at("read HEAD", "HEAD^{commit}").await
    }

    /// The first parent of `commit`; `None` for a root commit.
    async fn first_parent(&self, commit: &str) -> Result<Option<String>, GitError> {
        self.commit_at("read the commit's parent", &format!("{commit}^1^{{commit}}"))
            .await
    }

    /// The commit `revision` names; `None` when it names none (an unborn branch, a root's parent).
    async fn commit_at(&self, what: &'static str, revision: &str) -> Result<Option<String>, GitError> {
        let ran = self.run(what, &["rev-parse", "--verify", "--quiet", revision]).await?;
        if ran.status.success() {
            Ok(Some(String::from_utf8_lossy(&ran.stdout).trim().to_owned()))
        } else if ran.status.code() == Some(1) {
            Ok(None)
        } else {
            Err(GitError::Failed {
                what,
                status: ran.status,
                stderr: stderr_tail(&ran.stderr),
            })
        }
    }

    /// Feeds every line of `git <args>`'s stdout to `line`, never holding the whole output.
    async fn stream_lines(
        &self,
        what: &'static str,
        args: &[&str],
        mut line: impl FnMut(&[u8]),
    ) -> Result<(), GitError> {
        let mut child = self
            .command(args)
            .spawn()
            .map_err(|source| GitError::Spawn { what, source })?;
        let group = child.id().and_then(|pid| i32::try_from(pid).ok());
        let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
            return Err(GitError::Spawn {
                what,
                source: std::io::Error::other("git's output was not piped"),
            });
        };
        let run = async {
            let collect_stderr = async {
                let mut bytes = Vec::new();
                let _ = stderr.read_to_end(&mut bytes).await;
                bytes
            };
            let read_stdout = async {
                let mut reader = BufReader::with_capacity(64 * 1024, stdout);
                let mut buffer = Vec::new();
                loop {
                    buffer.clear();
                    match reader.read_until(b'\n', &mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => line(buffer.strip_suffix(b"\n").unwrap_or(&buffer)),
                    }
                }
            };
            let (stderr, ()) = tokio::join!(collect_stderr, read_stdout);
            (child.wait().await, stderr)
        };
        match tokio::time::timeout(self.timeout, run).await {
            Ok((Ok(status), _)) if status.success() => Ok(()),
            Ok((Ok(status), stderr)) => Err(GitError::Failed {
                what,
                status,
                stderr: stderr_tail(&stderr),
            }),
            Ok((Err(source), _)) => Err(GitError::Spawn { what, source }),
            Err(_) => {
                kill_group(group);
                Err(GitError::TimedOut {
                    what,
                    seconds: self.timeout.as_secs(),
                })
            }
        }
    }

    async fn remote_head(&self, remote: &str, branch: &str) -> Result<Option<String>, GitError> {
        let reference = format!("refs/heads/{branch}");
        let listed = self
            .output("read the remote branch", &["ls-remote", "--", remote, &reference])
            .await?;
        Ok(parse_ls_remote(&listed, branch))
    }
}

fn kill_group(group: Option<i32>) {
    if let Some(group) = group {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(group), nix::sys::signal::Signal::SIGKILL);
    }
}

/// What a turn hands to its delivery.
#[derive(Debug)]
pub struct DeliveryInput<'a> {
    /// The user's prompt (not the primed one): the commit message comes from it.
    pub prompt: &'a str,
    pub session_id: &'a str,
    /// The branch's last delivered commit; `None`: the branch must not exist on the remote yet.
    pub baseline: Option<&'a str>,
    /// HEAD when the driver first ran a turn in this workspace: where the changes start when there
    /// is no baseline.
    pub start_head: Option<&'a str>,
    /// Told once, in a sentence, when the push waits for an unreachable gateway.
    pub waiting: Option<tokio::sync::mpsc::UnboundedSender<String>>,
    /// The index was refreshed while the agent worked ([`crate::refresh`]): only what the agent touched
    /// since can be stale, which `git add` looks at anyway.
    pub index_refreshed: bool,
}

/// Commits, scans and publishes; the report says what happened, its `error` what went wrong.
pub async fn deliver(config: &DeliveryConfig, git: &Git, input: &DeliveryInput<'_>) -> DeliveryReport {
    let mut report = DeliveryReport::default();
    let delivered = try_deliver(config, git, input, &mut report).await;
    let kept = match &config.keep {
        Some(keep) => keep_or_let_go(config, keep, git, &report, &delivered).await,
        None => None,
    };
    if let Err(error) = delivered {
        tracing::warn!(code = error.code().as_str(), %error, "delivery failed");
        let mut failure = error.to_failure();
        if let Some(refname) = kept {
            failure.reason = format!(
                "{}; the work is kept at {refname} for the session's next sandbox",
                failure.reason
            );
        }
        report.error = Some(failure);
    }
    report
}

/// A pod's work that did not land is pushed to its WIP ref (never after a secret was found: the
/// gateway would refuse it, and it is to go nowhere); once a delivery lands, a ref this workspace's
/// work was kept at goes. `Some(ref)` when the work was kept now.
async fn keep_or_let_go(
    config: &DeliveryConfig,
    keep: &KeptWork,
    git: &Git,
    report: &DeliveryReport,
    delivered: &Result<(), DeliveryError>,
) -> Option<String> {
    use std::sync::atomic::Ordering;
    match delivered {
        Ok(()) if report.pushed && keep.outstanding.load(Ordering::SeqCst) => {
            let delete = format!(":{}", keep.refname);
            match git
                .output(
                    "delete the kept work",
                    &["push", "--porcelain", "--", &config.remote, &delete],
                )
                .await
            {
                Ok(_) => keep.outstanding.store(false, Ordering::SeqCst),
                Err(error) => tracing::warn!(%error, "the kept work's ref stays"),
            }
            None
        }
        Err(DeliveryError::SecretDetected(_)) | Ok(()) => None,
        Err(_) if !report.changed => None,
        Err(_) => {
            let refspec = format!("+HEAD:{}", keep.refname);
            match git
                .output(
                    "keep the work",
                    &["push", "--porcelain", "--", &config.remote, &refspec],
                )
                .await
            {
                Ok(_) => {
                    keep.outstanding.store(true, Ordering::SeqCst);
                    Some(keep.refname.clone())
                }
                Err(error) => {
                    tracing::warn!(%error, "the undelivered work could not be kept");
                    None
                }
            }
        }
    }
}

async fn try_deliver(
    config: &DeliveryConfig,
    git: &Git,
    input: &DeliveryInput<'_>,
    report: &mut DeliveryReport,
) -> Result<(), DeliveryError> {
    // A fresh checkout's files are "racily clean" (written in the index's second) and, seen through the
    // sandbox's user namespace, under another owner than the index says: `add` would hash every file
    // again and write each as a loose object (1.8 s for 2,000 files), where a refresh only compares
    // (~0.1 s) and leaves `add` the changed files. Its status says nothing `add` does not: ignored. An
    // index refreshed while the agent worked needs none (see `refresh`).
    if !input.index_refreshed {
        let _ = git.run("refresh the index", &["update-index", "-q", "--refresh"]).await;
    }
    git.output("stage the workspace", &["add", "--all"]).await?;
    let committed = commit(config, git, input).await?;
    let head = match committed.then(|| committed_head(&git.workspace)).flatten() {
        Some(head) => Some(head),
        None => git.head().await?,
    };
    let Some(candidate) = head else {
        // An unborn branch and nothing to commit: there is nothing to deliver.
        return Ok(());
    };
    report.head_sha = Some(candidate.clone());
    let start = input.baseline.or(input.start_head);
    if start == Some(candidate.as_str()) {
        // Nothing new since the last delivery (or since the clone, for a branch never pushed).
        return Ok(());
    }
    report.changed = true;

    // The changes are counted by the host, from what the git proxy took (the card's diff stat). The
    // push URL is read beside the scan: behind the sandbox's relay, the push goes straight to the proxy.
    let get_url = ["remote", "get-url", "--push", "--", &config.remote];
    let (findings, push_url) = tokio::join!(
        scan(config, git, start, &candidate),
        git.output("read the push URL", &get_url)
    );
    let findings = findings?;
    if !findings.is_empty() {
        report.head_sha = None;
        if committed {
            // HEAD before the commit, read only on this rare path: `commit` made its first parent.
            let before = git.first_parent(&candidate).await?;
            undo_commit(git, before.as_deref()).await?;
        }
        return Err(DeliveryError::SecretDetected(secret_reason(&findings, committed)));
    }

    let haves: Vec<&str> = input.start_head.into_iter().collect();
    let relay = crate::push::RELAY;
    let pushed_straight = match push_url
        .ok()
        .as_deref()
        .and_then(|url| crate::push::relay_path(url, relay))
    {
        Some(path) => {
            let refname = format!("refs/heads/{}", config.branch);
            let update = crate::push::Update {
                refname: &refname,
                new: &candidate,
                old: input.baseline,
                haves: &haves,
            };
            crate::push::push(git, relay, path, &update, git.timeout)
                .await
                .inspect_err(|why| tracing::info!(%why, "the push goes through git instead"))
                .is_ok()
        }
        None => false,
    };
    if !pushed_straight {
        publish(config, git, &candidate, input).await?;
    }
    report.pushed = true;
    Ok(())
}

/// The commit `git commit` just made, read where it left it: HEAD's branch as a loose ref (or HEAD
/// itself, detached). `None` when it is anywhere else (packed, another ref format): git is asked.
/// Only right after our own commit: then the ref names the new commit, no tag or other object.
fn committed_head(workspace: &Path) -> Option<String> {
    let git_dir = workspace.join(".git");
    let head = std::fs::read_to_string(git_dir.join("HEAD")).ok()?;
    let head = head.trim_end();
    let oid = match head.strip_prefix("ref: ") {
        Some(branch) => {
            let plain = branch.starts_with("refs/heads/")
                && branch
                    .split('/')
                    .all(|part| !part.is_empty() && part != "." && part != "..");
            if !plain {
                return None;
            }
            std::fs::read_to_string(git_dir.join(branch)).ok()?
        }
        None => head.to_owned(),
    };
    let oid = oid.trim_end();
    (matches!(oid.len(), 40 | 64) && oid.bytes().all(|b| b.is_ascii_hexdigit())).then(|| oid.to_owned())
}

/// Commits what is staged; `false` when nothing was (the index is HEAD's tree). One git process when
/// there is something to commit: git's own "nothing to commit" (exit 1, said on stdout) tells the other
/// case, and any other exit 1 is settled by comparing the index.
async fn commit(config: &DeliveryConfig, git: &Git, input: &DeliveryInput<'_>) -> Result<bool, GitError> {
    let message = commit_message(input.prompt, input.session_id);
    let name = format!("user.name={}", config.author_name);
    let email = format!("user.email={}", config.author_email);
    let identity = [
        ("GIT_AUTHOR_NAME", config.author_name.as_str()),
        ("GIT_AUTHOR_EMAIL", config.author_email.as_str()),
        ("GIT_COMMITTER_NAME", config.author_name.as_str()),
        ("GIT_COMMITTER_EMAIL", config.author_email.as_str()),
    ];
    let ran = git
        .run_with(
            "commit the workspace",
            &[
                "-c",
                &name,
                "-c",
                &email,
                "commit",
                "--quiet",
                "--no-verify",
                "--no-gpg-sign",
                // Verbatim: a prompt's `#` lines are not comments.
                "--cleanup=verbatim",
                "--message",
                &message,
            ],
            &identity,
        )
        .await?;
    if ran.status.success() {
        return Ok(true);
    }
    let failed = |ran: &Ran, what| GitError::Failed {
        what,
        status: ran.status,
        stderr: stderr_tail(&ran.stderr),
    };
    if ran.status.code() != Some(1) {
        return Err(failed(&ran, "commit the workspace"));
    }
    if says_nothing_to_commit(&ran.stdout) {
        return Ok(false);
    }
    let staged = git
        .run(
            "compare the index",
            &["diff", "--cached", "--quiet", "--no-ext-diff", "--no-textconv"],
        )
        .await?;
    match staged.status.code() {
        Some(0) => Ok(false),
        // Something is staged and the commit was refused: its words say why.
        Some(1) => Err(failed(&ran, "commit the workspace")),
        _ => Err(failed(&staged, "compare the index")),
    }
}

/// Whether `git commit`'s stdout (in the C locale) is its status of an index with nothing to commit:
/// git's words for it begin a line ("nothing to commit, working tree clean", "nothing added to commit but
/// untracked files present", "no changes added to commit …").
fn says_nothing_to_commit(stdout: &[u8]) -> bool {
    const SAYINGS: [&[u8]; 3] = [
        b"nothing to commit",
        b"nothing added to commit",
        b"no changes added to commit",
    ];
    stdout
        .split(|b| *b == b'\n')
        .any(|line| SAYINGS.iter().any(|saying| line.starts_with(saying)))
}

/// Scans every commit the push would make visible (each one's own patch: a secret added and then
/// removed again would still be in the history).
async fn scan(
    config: &DeliveryConfig,
    git: &Git,
    start: Option<&str>,
    candidate: &str,
) -> Result<Vec<Finding>, GitError> {
    let range = match start {
        Some(start) => format!("{start}..{candidate}"),
        None => candidate.to_owned(),
    };
    let mut known = KnownSecrets::clone(&config.known_secrets);
    if let Some(path) = &config.known_secrets_file {
        match load_known_secrets(path) {
            Ok(reread) => known.extend(&reread),
            Err(error) => {
                tracing::warn!(%error, "cannot read the known secrets again; scanning with the list read at start")
            }
        }
    }
    let mut scanner = PatchScanner::new(&known);
    git.stream_lines(
        "read the changes to scan them",
        &[
            "log",
            "--patch",
            "-m",
            "--unified=0",
            // Binary or `-diff` files would show no lines to scan; the gateway's scan, the one that
            // counts, reads them the same way.
            "--text",
            "--no-ext-diff",
            "--no-textconv",
            "--no-color",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            "--format=commit %H",
            &range,
            "--",
        ],
        |line| scanner.line(line),
    )
    .await?;
    let mut findings = scanner.into_findings();
    findings.sort();
    findings.dedup();
    Ok(findings)
}

/// Takes back the commit the delivery made, keeping its files in the working tree.
async fn undo_commit(git: &Git, before: Option<&str>) -> Result<(), GitError> {
    match before {
        Some(before) => git.output("undo the commit", &["reset", "--soft", before]).await?,
        // The commit was the first: back to an unborn branch.
        None => git.output("undo the commit", &["update-ref", "-d", "HEAD"]).await?,
    };
    Ok(())
}

/// Publication, tried again while the gateway cannot be reached (an attempt after one that landed
/// unanswered finds the branch already at the candidate: git sends nothing, or the read after a failed
/// lease says so).
async fn publish(
    config: &DeliveryConfig,
    git: &Git,
    candidate: &str,
    input: &DeliveryInput<'_>,
) -> Result<(), DeliveryError> {
    let deadline = tokio::time::Instant::now() + config.unreachable_wait;
    let mut pause = Duration::from_millis(250);
    let mut told = false;
    loop {
        match publish_once(config, git, candidate, input.baseline).await {
            Err(DeliveryError::Git(error))
                if error.is_unreachable() && tokio::time::Instant::now() + pause < deadline =>
            {
                tracing::warn!(%error, ?pause, "the gateway is unreachable; the push is tried again");
                if !told && let Some(waiting) = &input.waiting {
                    let _ = waiting.send(format!(
                        "the gateway cannot be reached; the push is tried again for up to {}s",
                        config.unreachable_wait.as_secs()
                    ));
                    told = true;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(UNREACHABLE_MAX_PAUSE);
            }
            outcome => return outcome,
        }
    }
}

/// Idempotent publication (§7.3): the push itself holds the lease (the branch must still be at the
/// baseline, or absent), so the remote is read only when it fails — to tell a push that landed
/// unanswered, or a branch someone moved, from a failure.
async fn publish_once(
    config: &DeliveryConfig,
    git: &Git,
    candidate: &str,
    baseline: Option<&str>,
) -> Result<(), DeliveryError> {
    let branch = &config.branch;
    let lease = format!("--force-with-lease=refs/heads/{branch}:{}", baseline.unwrap_or(""));
    let refspec = format!("{candidate}:refs/heads/{branch}");
    let pushed = git
        .run(
            "push the branch",
            &["push", "--porcelain", &lease, "--", &config.remote, &refspec],
        )
        .await;
    let failure = match pushed {
        Ok(ran) if ran.status.success() => return Ok(()),
        Ok(ran) => {
            // `--porcelain` puts the reason of a rejected ref on stdout, git's own errors on stderr.
            let mut said = ran.stderr;
            said.extend_from_slice(&ran.stdout);
            GitError::Failed {
                what: "push the branch",
                status: ran.status,
                stderr: stderr_tail(&said),
            }
        }
        Err(error) => error,
    };
    // The push may have landed before it failed (a lost answer): a fresh read decides. A read that fails
    // too leaves the push's own failure to say what happened (and whether to try again).
    let Ok(after) = git.remote_head(&config.remote, branch).await else {
        return Err(failure.into());
    };
    match decide(after.as_deref(), candidate, baseline) {
        Publication::AlreadyThere => Ok(()),
        Publication::Conflict => Err(DeliveryError::PushConflict(conflict_reason(
            branch,
            after.as_deref(),
            baseline,
        ))),
        Publication::Push => Err(failure.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `commit` just made is read from HEAD's loose branch, or from HEAD detached, as git reads
    /// it; a packed branch, or a HEAD that is not a plain branch, is left to git.
    #[test]
    fn a_new_commit_is_read_where_git_left_it() {
        use sortie_testkit::git::{git, rev};
        let temp = tempfile::tempdir().expect("temp");
        let work = temp.path();
        git(work, &["init", "-q", "-b", "sortie/ses_1"]);
        std::fs::write(work.join("a.txt"), "a\n").expect("write");
        git(work, &["add", "."]);
        git(
            work,
            &[
                "-c",
                "user.name=a",
                "-c",
                "user.email=a@example.com",
                "commit",
                "-q",
                "-m",
                "a",
            ],
        );
        let head = rev(work, "HEAD").expect("a commit");
        assert_eq!(committed_head(work), Some(head.clone()));
        git(work, &["checkout", "-q", "--detach"]);
        assert_eq!(committed_head(work), Some(head.clone()), "detached");
        git(work, &["checkout", "-q", "sortie/ses_1"]);
        git(work, &["pack-refs", "--all"]);
        assert_eq!(committed_head(work), None, "packed: git is asked");
        std::fs::write(work.join(".git/HEAD"), "ref: refs/heads/../../HEAD\n").expect("write");
        assert_eq!(committed_head(work), None, "not a plain branch");
    }

    #[test]
    fn commit_messages() {
        let long_line = "word ".repeat(30);
        let long_prompt = format!("Fix it\n\n{}", "é".repeat(2000));
        let cases: Vec<(&str, String)> = vec![
            ("Add a README", "Add a README\n\nSortie-Session: ses_1\n".into()),
            (
                "  Fix the build\nIt fails on CI.\n",
                "Fix the build\n\nFix the build\nIt fails on CI.\n\nSortie-Session: ses_1\n".into(),
            ),
            ("", "sortie: agent turn\n\nSortie-Session: ses_1\n".into()),
            (
                "\n\n#!scripted\nsay: hi",
                "#!scripted\n\n#!scripted\nsay: hi\n\nSortie-Session: ses_1\n".into(),
            ),
            ("nul\0byte", "nulbyte\n\nSortie-Session: ses_1\n".into()),
        ];
        for (prompt, expected) in cases {
            assert_eq!(commit_message(prompt, "ses_1"), expected, "{prompt:?}");
        }
        let message = commit_message(&long_line, "ses_1");
        let subject = message.lines().next().unwrap_or_default();
        assert!(subject.chars().count() <= 72 && subject.ends_with('…'), "{subject}");
        let message = commit_message(&long_prompt, "ses_1");
        assert!(message.len() < 2048 + 100, "{}", message.len());
        assert!(message.ends_with("[…]\n\nSortie-Session: ses_1\n"), "{message}");
    }

    #[test]
    fn gits_words_for_nothing_to_commit_are_told_apart() {
        for said in [
            "On branch main\nnothing to commit, working tree clean\n",
            "On branch main\n\nInitial commit\n\nnothing to commit (create/copy files and use \"git add\" to track)\n",
            "On branch main\nUntracked files:\n\tx\n\nnothing added to commit but untracked files present\n",
            "no changes added to commit (use \"git add\" and/or \"git commit -a\")\n",
        ] {
            assert!(says_nothing_to_commit(said.as_bytes()), "{said}");
        }
        for said in ["", "Changes to be committed:\n\tnew file:   nothing to commit\n"] {
            assert!(!says_nothing_to_commit(said.as_bytes()), "{said}");
        }
    }

    #[test]
    fn branch_names() {
        for good in ["sortie/ses_01K0ABC", "feature-1", "a.b/c_d"] {
            assert!(validate_branch(good).is_ok(), "{good}");
        }
        for bad in [
            "", "-x", "/x", "x/", "a..b", "a//b", "a/.b", "x.lock", "a b", "a:b", "a~1", "a^", "refs*", ".x", "x.",
        ] {
            assert!(validate_branch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn remote_refs_and_decisions() {
        let listed = "aaa\trefs/heads/sortie/ses_1/x\nbbb\trefs/heads/sortie/ses_1\n";
        assert_eq!(parse_ls_remote(listed, "sortie/ses_1"), Some("bbb".into()));
        assert_eq!(parse_ls_remote(listed, "ses_1"), None);
        assert_eq!(parse_ls_remote("", "sortie/ses_1"), None);

        let cases = [
            (Some("c"), "c", Some("b"), Publication::AlreadyThere),
            (Some("b"), "c", Some("b"), Publication::Push),
            (None, "c", None, Publication::Push),
            (Some("x"), "c", Some("b"), Publication::Conflict),
            (Some("x"), "c", None, Publication::Conflict),
            (None, "c", Some("b"), Publication::Conflict),
        ];
        for (remote, candidate, baseline, expected) in cases {
            assert_eq!(decide(remote, candidate, baseline), expected, "{remote:?} {baseline:?}");
        }
    }

    #[test]
    fn stderr_tails_keep_the_last_whole_lines() {
        let long: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        let tail = stderr_tail(long.as_bytes());
        assert!(tail.len() <= STDERR_TAIL_BYTES && tail.starts_with("line ") && tail.ends_with("line 999"));
        assert_eq!(stderr_tail(b"  fatal: no\n"), "fatal: no");
    }
}
