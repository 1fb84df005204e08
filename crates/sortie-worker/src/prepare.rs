//! Workspace preparation (DESIGN §2 step 2): one bare mirror per upstream repository, made with
//! `--no-local` (never hardlinked to the source: inside its user namespace a sandbox owns the files it
//! is given, so a shared inode could be rewritten) and only ever fetched into, never pruned; each
//! session's `/workspace` is a `git clone --shared` of it (objects borrowed through `alternates`, the
//! mirror bound read-only at the same path) on branch `sortie/<session-id>`, with `origin` pointing at
//! the gateway's git proxy so nothing inside holds a credential.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sortie_protocol::SessionId;

/// How long a mirror clone or fetch may take.
const FETCH_DEADLINE: Duration = Duration::from_secs(600);
/// How long a local clone or checkout may take.
const LOCAL_DEADLINE: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PrepareError(pub String);

/// Where a session's host-side directories live under the worker's work dir.
#[derive(Clone, Debug)]
pub struct SessionDirs {
    pub root: PathBuf,
    /// Becomes `/workspace`.
    pub workspace: PathBuf,
    /// Becomes `/home/agent`; kept across hibernation.
    pub home: PathBuf,
    /// The host's own (0700, never bound into a sandbox): the driver's socket.
    pub host: PathBuf,
    /// Becomes `/run/sortie-egress`: the gateway's `egress.sock` for this sandbox.
    pub egress: PathBuf,
    /// The digests of the workspace's secret values, bound read-only at the same path (the
    /// sandbox cannot rewrite the list its delivery is checked against).
    pub known_secrets: PathBuf,
}

impl SessionDirs {
    pub fn new(work_dir: &Path, session_id: &SessionId) -> Self {
        let root = work_dir.join("sessions").join(session_id.as_str());
        Self {
            workspace: root.join("workspace"),
            home: root.join("home"),
            host: root.join("host"),
            egress: root.join("egress"),
            known_secrets: root.join("known-secrets"),
            root,
        }
    }

    pub fn driver_socket(&self) -> PathBuf {
        self.host.join("driver.sock")
    }

    pub fn egress_socket(&self) -> PathBuf {
        self.egress.join("egress.sock")
    }
}

/// The mirror of `repo` under `mirrors`: named by a digest of the repository's address.
pub fn mirror_path(mirrors: &Path, repo: &str) -> PathBuf {
    let digest = Sha256::digest(repo.as_bytes());
    let name: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    mirrors.join(format!("{name}.git"))
}

/// How host-side git reaches a forge: the token (sent as Basic `x-access-token:<token>`, as the git
/// proxy does) and the CA bundle to trust. It goes to git through its environment, never its argv
/// (which every local user can read) nor any config file. `Debug` never shows the token.
#[derive(Clone)]
pub struct ForgeAuth {
    pub token: sortie_store::Secret,
    pub ca_bundle: Option<PathBuf>,
}

impl std::fmt::Debug for ForgeAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForgeAuth")
            .field("token", &"[redacted]")
            .field("ca_bundle", &self.ca_bundle)
            .finish()
    }
}

impl ForgeAuth {
    fn apply(&self, command: &mut tokio::process::Command) {
        let header = format!(
            "Authorization: {}",
            sortie_gateway::git::http::forge_authorization(self.token.expose())
        );
        command
            .env("GIT_CONFIG_COUNT", "2")
            .env("GIT_CONFIG_KEY_0", "http.extraHeader")
            .env("GIT_CONFIG_VALUE_0", header)
            // The credential must not follow a redirect to another host.
            .env("GIT_CONFIG_KEY_1", "http.followRedirects")
            .env("GIT_CONFIG_VALUE_1", "false");
        if let Some(bundle) = &self.ca_bundle {
            command.env("GIT_SSL_CAINFO", bundle);
        }
    }
}

/// Runs git with a deadline; stdout on success, else a sentence with the tail of its stderr.
pub async fn git(binary: &Path, dir: Option<&Path>, args: &[&str], deadline: Duration) -> Result<String, PrepareError> {
    git_with(binary, dir, args, deadline, None).await
}

async fn git_with(
    binary: &Path,
    dir: Option<&Path>,
    args: &[&str],
    deadline: Duration,
    auth: Option<&ForgeAuth>,
) -> Result<String, PrepareError> {
    let mut command = tokio::process::Command::new(binary);
    command
        .args(["-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null"])
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("LC_ALL", "C")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    if let Some(auth) = auth {
        auth.apply(&mut command);
    }
    let what = format!("git {}", args.first().copied().unwrap_or_default());
    let output = tokio::time::timeout(deadline, command.output())
        .await
        .map_err(|_| PrepareError(format!("{what} took longer than {}s", deadline.as_secs())))?
        .map_err(|e| PrepareError(format!("cannot run {}: {e}", binary.display())))?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(PrepareError(format!("{what} failed: {}", tail.join(" / "))))
}

/// Makes or refreshes the mirror of `repo` (a local path, or a forge URL reached with `auth`).
/// Callers serialise calls per mirror.
pub async fn ensure_mirror(
    binary: &Path,
    mirrors: &Path,
    repo: &str,
    auth: Option<&ForgeAuth>,
) -> Result<PathBuf, PrepareError> {
    let mirror = mirror_path(mirrors, repo);
    if mirror.join("HEAD").is_file() {
        git_with(
            binary,
            Some(&mirror),
            &["fetch", "--quiet", "--force", "origin"],
            FETCH_DEADLINE,
            auth,
        )
        .await
        .map_err(|e| PrepareError(format!("cannot fetch {repo}: {}", e.0)))?;
        return Ok(mirror);
    }
    std::fs::create_dir_all(mirrors).map_err(|e| PrepareError(format!("cannot create {}: {e}", mirrors.display())))?;
    let partial = mirror.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let partial_text = partial.to_string_lossy().into_owned();
    git_with(
        binary,
        None,
        &["clone", "--quiet", "--mirror", "--no-local", repo, &partial_text],
        FETCH_DEADLINE,
        auth,
    )
    .await
    .map_err(|e| PrepareError(format!("cannot clone {repo}: {}", e.0)))?;
    // Sessions borrow the mirror's objects: nothing may ever delete one.
    for (key, value) in [
        ("gc.auto", "0"),
        ("gc.pruneExpire", "never"),
        ("core.logAllRefUpdates", "false"),
    ] {
        git(binary, Some(&partial), &["config", key, value], LOCAL_DEADLINE).await?;
    }
    std::fs::rename(&partial, &mirror).map_err(|e| PrepareError(format!("cannot move the mirror into place: {e}")))?;
    Ok(mirror)
}

/// Clones the session's workspace from the mirror unless it exists (a hibernated or retried session keeps it).
pub async fn ensure_workspace(
    binary: &Path,
    mirror: &Path,
    workspace: &Path,
    branch: &str,
    base: Option<&str>,
    origin_url: &str,
) -> Result<bool, PrepareError> {
    if workspace.join(".git").exists() {
        return Ok(false);
    }
    let partial = workspace.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let mirror_text = mirror.to_string_lossy().into_owned();
    let partial_text = partial.to_string_lossy().into_owned();
    git(
        binary,
        None,
        &[
            "clone",
            "--quiet",
            "--shared",
            "--no-checkout",
            &mirror_text,
            &partial_text,
        ],
        LOCAL_DEADLINE,
    )
    .await?;
    let start = match base {
        Some(base) => format!("refs/remotes/origin/{base}"),
        None => "refs/remotes/origin/HEAD".to_owned(),
    };
    if git(
        binary,
        Some(&partial),
        &["rev-parse", "--verify", "--quiet", &start],
        LOCAL_DEADLINE,
    )
    .await
    .is_err()
    {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(PrepareError(match base {
            Some(base) => format!("the repository has no branch {base:?} to start from"),
            None => "the repository has no default branch with a commit to start from".to_owned(),
        }));
    }
    git(
        binary,
        Some(&partial),
        &["checkout", "--quiet", "--no-track", "-b", branch, &start],
        LOCAL_DEADLINE,
    )
    .await?;
    git(
        binary,
        Some(&partial),
        &["remote", "set-url", "origin", origin_url],
        LOCAL_DEADLINE,
    )
    .await?;
    std::fs::rename(&partial, workspace)
        .map_err(|e| PrepareError(format!("cannot move the workspace into place: {e}")))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_are_named_by_the_repository() {
        let a = mirror_path(Path::new("/m"), "/srv/a.git");
        assert_eq!(a, mirror_path(Path::new("/m"), "/srv/a.git"));
        assert_ne!(a, mirror_path(Path::new("/m"), "/srv/b.git"));
        assert!(a.starts_with("/m") && a.extension().is_some_and(|e| e == "git"));
    }
}
