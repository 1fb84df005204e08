//! Workspace preparation (DESIGN §2 step 2): one bare mirror per upstream repository, made with
//! `--no-local` (never hardlinked to the source: inside its user namespace a sandbox owns the files it
//! is given, so a shared inode could be rewritten) and only ever fetched into, never pruned; each
//! session's `/workspace` is a `git clone --shared` of it (objects borrowed through `alternates`, the
//! mirror bound read-only at the same path) on branch `sortie/<session-id>`, with `origin` pointing at
//! the gateway's git proxy so nothing inside holds a credential.
//!
//! Host-side git never runs as root inside a repository root does not own (DESIGN §9 invariant 11,
//! S5), and never runs hooks: the mirror of a local repository owned by another user is made and
//! fetched with that repository's side of the transfer (`upload-pack`) run as its owner, through
//! `setpriv`; the worker's own side works in its own directories only, and a workspace's working
//! tree is checked out as the sandbox uid after root hands it the new `.git`. No `safe.directory`
//! override exists anywhere: git as the owner does not need one, and root's git is never in a
//! foreign repository.

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
    /// The session's own filesystem (DESIGN §9 invariant 10, S10): a sparse image of the disk quota's
    /// size, mounted at `disk`, which holds `/workspace` and `$HOME`. A session made before disks has
    /// neither: its directories stay where they were, without a quota.
    pub image: PathBuf,
    pub disk: PathBuf,
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
    /// The git proxy's own state (its push quarantines and the objects of accepted pushes): the
    /// host's, never bound into the sandbox.
    pub git_state: PathBuf,
}

impl SessionDirs {
    pub fn new(work_dir: &Path, session_id: &SessionId) -> Self {
        let root = work_dir.join("sessions").join(session_id.as_str());
        let disk = root.join("disk");
        let legacy = root.join("workspace").exists() && !root.join("disk.img").exists();
        let within = if legacy { root.clone() } else { disk.clone() };
        Self {
            image: root.join("disk.img"),
            disk,
            workspace: within.join("workspace"),
            home: within.join("home"),
            host: root.join("host"),
            egress: root.join("egress"),
            known_secrets: root.join("known-secrets"),
            git_state: root.join("git"),
            root,
        }
    }

    /// Whether the session's directories are on a disk of its own (not a session made before disks).
    pub fn has_disk(&self) -> bool {
        self.workspace.starts_with(&self.disk)
    }

    pub fn driver_socket(&self) -> PathBuf {
        self.host.join("driver.sock")
    }

    /// The commit the workspace was cloned at, written by the host beside (never inside) the
    /// sandbox's directories.
    pub fn start_commit(&self) -> PathBuf {
        self.root.join("start-commit")
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
    /// The config the token travels in (the environment's `GIT_CONFIG_*`, never argv).
    fn config(&self) -> Vec<(&'static str, String)> {
        let header = format!(
            "Authorization: {}",
            sortie_gateway::git::http::forge_authorization(self.token.expose())
        );
        vec![
            ("http.extraHeader", header),
            // The credential must not follow a redirect to another host.
            ("http.followRedirects", "false".to_owned()),
        ]
    }
}

/// Sets git configuration through `GIT_CONFIG_COUNT`/`KEY_n`/`VALUE_n`: never in argv, and inherited
/// by git's own children (except across a local transport, which clears it: see [`upload_pack_as`]).
fn set_config(command: &mut tokio::process::Command, pairs: &[(&str, String)]) {
    command.env("GIT_CONFIG_COUNT", pairs.len().to_string());
    for (index, (key, value)) in pairs.iter().enumerate() {
        command
            .env(format!("GIT_CONFIG_KEY_{index}"), key)
            .env(format!("GIT_CONFIG_VALUE_{index}"), value);
    }
}

/// `text` as one word for `sh`.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// The `upload-pack` command host git runs for a local repository whose side runs as `owner` (see
/// [`local_owner`]; git runs the command through `sh`, with the repository's path appended), or
/// `None` for git's own.
///
/// The repository's side of the transfer then runs as that uid and gid (no supplementary groups, no
/// capabilities, no new privileges), with no global config and hooks off — set inside the command,
/// since git's local transport clears `GIT_CONFIG_*` before it starts upload-pack.
fn upload_pack_as(binary: &Path, owner: Option<(u32, u32)>) -> Result<Option<String>, PrepareError> {
    let Some((uid, gid)) = owner else {
        return Ok(None);
    };
    let git = binary
        .to_str()
        .ok_or_else(|| PrepareError(format!("the git binary path {} is not UTF-8", binary.display())))?;
    Ok(Some(format!(
        "setpriv --reuid={uid} --regid={gid} --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs \
         env HOME=/nonexistent GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_COUNT=1 \
         GIT_CONFIG_KEY_0=core.hooksPath GIT_CONFIG_VALUE_0=/dev/null {git} upload-pack",
        git = shell_quote(git),
    )))
}

/// Who git must run as in the local repository `repo`: its owner (uid, gid) when this process is
/// root and the repository is not root's; `None`: this process.
fn local_owner(repo: &Path) -> Result<Option<(u32, u32)>, PrepareError> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(repo).map_err(|e| PrepareError(format!("cannot read {}: {e}", repo.display())))?;
    if !nix::unistd::geteuid().is_root() || metadata.uid() == 0 {
        return Ok(None);
    }
    Ok(Some((metadata.uid(), metadata.gid())))
}

/// Whether the mirror holds what a session starting from `base` (a branch; `None`: the default
/// branch) needs of the local repository `repo` as it is now, so that a fetch would change nothing
/// it uses: the repository's refs are read as its owner (as its upload-pack runs), the mirror's as
/// this process, at once. Any failure says no: the fetch runs.
async fn mirror_is_current(
    binary: &Path,
    repo: &Path,
    mirror: &Path,
    owner: Option<(u32, u32)>,
    base: Option<&str>,
) -> bool {
    const LISTING: &str = "--format=%(objectname) %(refname)";
    let (theirs, ours) = tokio::join!(
        git_as(
            binary,
            Some(repo),
            &["for-each-ref", LISTING],
            LOCAL_DEADLINE,
            None,
            owner
        ),
        git(binary, Some(mirror), &["for-each-ref", LISTING], LOCAL_DEADLINE),
    );
    match (theirs, ours) {
        (Ok(theirs), Ok(ours)) => refs_within(&theirs, &ours, base),
        _ => false,
    }
}

/// Whether every `<object> <ref>` line of `theirs` is a line of `ours` (the mirror keeps refs the
/// repository deleted since: a fetch does not prune them), sortie's own refs aside: every session's
/// delivery adds its branch to the repository, and a session starts from one of them only when it
/// names it as its `base`.
fn refs_within(theirs: &str, ours: &str, base: Option<&str>) -> bool {
    let session_branches = format!("refs/heads/{}", sortie_protocol::ids::SESSION_BRANCH_PREFIX);
    let base = base.map(|base| format!("refs/heads/{base}"));
    let sortie_own = |line: &str| {
        let name = line.split_once(' ').map_or("", |(_, name)| name);
        (name.starts_with(&session_branches) || name.starts_with(sortie_protocol::ids::SORTIE_REFS))
            && base.as_deref() != Some(name)
    };
    let ours: std::collections::HashSet<&str> = ours.lines().collect();
    theirs.lines().all(|line| sortie_own(line) || ours.contains(line))
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
    git_as(binary, dir, args, deadline, auth, None).await
}

/// Runs git, as `owner` (uid, gid) when given: then with no global config (root's home is not its to
/// read) and, as std does when root changes uid, no supplementary groups.
async fn git_as(
    binary: &Path,
    dir: Option<&Path>,
    args: &[&str],
    deadline: Duration,
    auth: Option<&ForgeAuth>,
    owner: Option<(u32, u32)>,
) -> Result<String, PrepareError> {
    git_fed(binary, dir, args, deadline, auth, owner, None).await
}

/// [`git_as`], with `input` on git's stdin when given.
async fn git_fed(
    binary: &Path,
    dir: Option<&Path>,
    args: &[&str],
    deadline: Duration,
    auth: Option<&ForgeAuth>,
    owner: Option<(u32, u32)>,
    input: Option<&[u8]>,
) -> Result<String, PrepareError> {
    let mut command = tokio::process::Command::new(binary);
    if let Some((uid, gid)) = owner {
        // Nothing of the worker's environment (its keys among it) goes to a process of the sandbox uid.
        command
            .env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
            )
            .gid(gid)
            .uid(uid)
            .env("HOME", "/nonexistent")
            .env("GIT_CONFIG_GLOBAL", "/dev/null");
    }
    command
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("LC_ALL", "C")
        .stdin(if input.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut config = vec![("core.hooksPath", "/dev/null".to_owned())];
    if let Some(auth) = auth {
        config.extend(auth.config());
        if let Some(bundle) = &auth.ca_bundle {
            command.env("GIT_SSL_CAINFO", bundle);
        }
    }
    set_config(&mut command, &config);
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    let what = format!("git {}", args.first().copied().unwrap_or_default());
    let run = async {
        let mut child = sortie_sandbox::local::priority::spawn(command).await?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            use tokio::io::AsyncWriteExt;
            stdin.write_all(input).await?;
        }
        child.wait_with_output().await
    };
    let output = tokio::time::timeout(deadline, run)
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

/// A session's shared hold on a mirror, from its fetch to the end of its clone: a file lock beside the
/// mirror, so `sortie gc` (another process, perhaps) deletes a mirror only under the exclusive lock,
/// never while a session fetches or borrows from it.
pub struct MirrorHold {
    _lock: std::fs::File,
}

/// The lock file of `mirror` (kept: removing it would let two holders lock two files).
pub fn mirror_lock_path(mirror: &Path) -> PathBuf {
    mirror.with_extension("lock")
}

/// Waits for a shared hold on `mirror` (only retention holds it exclusively, briefly).
pub async fn hold_mirror(mirror: &Path) -> Result<MirrorHold, PrepareError> {
    let path = mirror_lock_path(mirror);
    let shown = path.display().to_string();
    tokio::task::spawn_blocking(move || -> std::io::Result<MirrorHold> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&path)?;
        file.lock_shared()?;
        Ok(MirrorHold { _lock: file })
    })
    .await
    .map_err(|e| PrepareError(format!("cannot lock {shown}: {e}")))?
    .map_err(|e| PrepareError(format!("cannot lock {shown}: {e}")))
}

/// Makes or refreshes the mirror of `repo` (a local path, or a forge URL reached with `auth`).
/// Callers serialise calls per mirror.
pub async fn ensure_mirror(
    binary: &Path,
    mirrors: &Path,
    repo: &str,
    base: Option<&str>,
    auth: Option<&ForgeAuth>,
) -> Result<PathBuf, PrepareError> {
    let mirror = mirror_path(mirrors, repo);
    // A local repository's side of the transfer runs as its owner (S5); a forge's is the forge's.
    let local = repo.starts_with('/');
    let owner = if local { local_owner(Path::new(repo))? } else { None };
    let upload_pack = upload_pack_as(binary, owner)?;
    if mirror.join("HEAD").is_file() {
        // A local repository that did not move since is not fetched: the fetch's chain of processes
        // (a shell, setpriv, env, upload-pack, a connectivity check) costs tens of milliseconds for
        // nothing on every session's start.
        if local && mirror_is_current(binary, Path::new(repo), &mirror, owner, base).await {
            return Ok(mirror);
        }
        // Its automatic maintenance would be a process more for nothing: a mirror is never collected.
        let mut args = vec!["-c", "maintenance.auto=false", "fetch", "--quiet", "--force"];
        if let Some(command) = &upload_pack {
            args.extend(["--upload-pack", command.as_str()]);
        }
        args.push("origin");
        git_with(binary, Some(&mirror), &args, FETCH_DEADLINE, auth)
            .await
            .map_err(|e| PrepareError(format!("cannot fetch {repo}: {}", e.0)))?;
        return Ok(mirror);
    }
    std::fs::create_dir_all(mirrors).map_err(|e| PrepareError(format!("cannot create {}: {e}", mirrors.display())))?;
    let partial = mirror.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let partial_text = partial.to_string_lossy().into_owned();
    let mut args = vec!["clone", "--quiet", "--mirror", "--no-local"];
    if let Some(command) = &upload_pack {
        args.extend(["--upload-pack", command.as_str()]);
    }
    args.extend(["--", repo, partial_text.as_str()]);
    git_with(binary, None, &args, FETCH_DEADLINE, auth)
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

/// The commit a session starts at, resolved in the host's own mirror: the tip of branch `base`, or of
/// the repository's default branch. A pod's workspace is checked out at it (the pod is not asked).
pub async fn start_commit(binary: &Path, mirror: &Path, base: Option<&str>) -> Result<String, PrepareError> {
    let start = match base {
        Some(base) => format!("refs/heads/{base}^{{commit}}"),
        None => "HEAD^{commit}".to_owned(),
    };
    git(
        binary,
        Some(mirror),
        &["rev-parse", "--verify", "--quiet", &start],
        LOCAL_DEADLINE,
    )
    .await
    .map(|commit| commit.trim().to_owned())
    .map_err(|_| {
        PrepareError(match base {
            Some(base) => format!("the repository has no branch {base:?} to start from"),
            None => "the repository has no default branch with a commit to start from".to_owned(),
        })
    })
}

/// What [`ensure_workspace`] made: the commit the new workspace starts from, as the host's git read
/// it from the mirror (the base the first delivery is counted against), and whether it was a primed one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewWorkspace {
    pub start_commit: String,
    pub primed: bool,
}

/// The name of a primed workspace at the root of a session disk made ahead: becomes the session's
/// `workspace` once it is adopted.
pub const PRIMED_DIR: &str = "primed";

/// Clones the session's workspace from the mirror unless it exists (a hibernated or retried session
/// keeps it); a workspace `primed` ahead ([`prime_workspace`]) on the session's disk is adopted
/// instead of a new clone, and one that cannot be is removed and the clone made. A new workspace
/// answers the commit it starts from.
///
/// With `owner` (the sandbox's uid and gid, when the host is root), the working tree is checked out
/// as that uid: nothing is chowned after (the sandbox's hand-over still walks the tree, but only reads
/// each owner), so the index's record of each file (its ctime among it) stays true. Root makes only the
/// `.git` of a `--no-checkout` clone (a few dozen entries, then handed over), and never runs git in the
/// workspace after that.
#[allow(clippy::too_many_arguments)]
pub async fn ensure_workspace(
    binary: &Path,
    mirror: &Path,
    workspace: &Path,
    primed: Option<&Path>,
    branch: &str,
    base: Option<&str>,
    origin_url: &str,
    owner: Option<(u32, u32)>,
) -> Result<Option<NewWorkspace>, PrepareError> {
    if workspace.join(".git").exists() {
        return Ok(None);
    }
    if let Some(primed) = primed.filter(|primed| primed.join(".git").is_dir()) {
        match adopt_primed(binary, mirror, primed, workspace, branch, base, origin_url, owner).await {
            Ok(start_commit) => {
                return Ok(Some(NewWorkspace {
                    start_commit,
                    primed: true,
                }));
            }
            Err(error) => {
                tracing::warn!(%error, primed = %primed.display(), "the primed workspace could not be adopted; cloning a new one");
            }
        }
    }
    if let Some(primed) = primed {
        // A primed workspace not adopted (or half-made) is nobody's: none ever had it.
        let _ = std::fs::remove_dir_all(primed);
        let _ = std::fs::remove_file(primed_refs_path(primed));
    }
    let partial = workspace.with_extension("partial");
    let start = start_ref(base);
    let cloned = async {
        clone_shared(binary, mirror, &partial).await?;
        hand_over(&partial, owner)
    };
    if let Err(error) = cloned.await {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    let start_commit = format!("{start}^{{commit}}");
    let Ok(start_commit) = git_as(
        binary,
        Some(&partial),
        &["rev-parse", "--verify", "--quiet", &start_commit],
        LOCAL_DEADLINE,
        None,
        owner,
    )
    .await
    else {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(no_start(base));
    };
    let made = async {
        git_as(
            binary,
            Some(&partial),
            &["remote", "set-url", "origin", origin_url],
            LOCAL_DEADLINE,
            None,
            owner,
        )
        .await?;
        git_as(
            binary,
            Some(&partial),
            &["checkout", "--quiet", "--no-track", "-b", branch, &start],
            LOCAL_DEADLINE,
            None,
            owner,
        )
        .await
    };
    if let Err(error) = made.await {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, workspace)
        .map_err(|e| PrepareError(format!("cannot move the workspace into place: {e}")))?;
    Ok(Some(NewWorkspace {
        start_commit: start_commit.trim().to_owned(),
        primed: false,
    }))
}

/// The workspace's ref a session starts from: its base branch as cloned from the mirror, or the
/// mirror's default branch.
fn start_ref(base: Option<&str>) -> String {
    match base {
        Some(base) => format!("refs/remotes/origin/{base}"),
        None => "refs/remotes/origin/HEAD".to_owned(),
    }
}

fn no_start(base: Option<&str>) -> PrepareError {
    PrepareError(match base {
        Some(base) => format!("the repository has no branch {base:?} to start from"),
        None => "the repository has no default branch with a commit to start from".to_owned(),
    })
}

/// A `--shared --no-checkout` clone of `mirror` at `dest`, made by root: a few dozen entries of `.git`,
/// handed to the sandbox uid ([`hand_over`]) before anything is checked out.
async fn clone_shared(binary: &Path, mirror: &Path, dest: &Path) -> Result<(), PrepareError> {
    let _ = std::fs::remove_dir_all(dest);
    let mirror_text = mirror.to_string_lossy().into_owned();
    let dest_text = dest.to_string_lossy().into_owned();
    git(
        binary,
        None,
        &[
            "clone",
            "--quiet",
            "--shared",
            "--no-checkout",
            &mirror_text,
            &dest_text,
        ],
        LOCAL_DEADLINE,
    )
    .await
    .map(drop)
}

/// Hands root's new clone at `dest` to `owner` (the sandbox uid), who checks it out.
fn hand_over(dest: &Path, owner: Option<(u32, u32)>) -> Result<(), PrepareError> {
    if let Some((uid, gid)) = owner {
        sortie_sandbox::local::chown_tree(dest, uid, gid)
            .map_err(|e| PrepareError(format!("cannot hand the new clone to the sandbox uid: {e}")))?;
    }
    Ok(())
}

/// Checks a workspace out ahead of any session, at `primed` (on a session disk made ahead, which no
/// sandbox has had): a `--shared` clone of `mirror` at its default branch, detached, checked out as
/// `owner`, its index then refreshed once the clock has left the second of the checkout. A checkout
/// writes its files in the same second as its index, so git holds every entry "racily clean" and
/// hashes each file again on its next look; after the refresh the index holds each file's true stat,
/// and the session's first `git status` or delivery reads stats only. The clone's refs, as root read
/// them before handing it over, are kept beside it ([`primed_refs_path`]) for the adoption. Answers
/// the commit.
pub async fn prime_workspace(
    binary: &Path,
    mirror: &Path,
    primed: &Path,
    owner: Option<(u32, u32)>,
) -> Result<String, PrepareError> {
    let partial = primed.with_extension("partial");
    let refs = primed_refs_path(primed);
    let made = async {
        clone_shared(binary, mirror, &partial).await?;
        // Root's own clone still: its refs are read before anyone else could touch it.
        let listing = git(
            binary,
            Some(&partial),
            &[
                "for-each-ref",
                "--format=%(objectname) %(refname) %(symref)",
                "refs/remotes/origin",
                "refs/tags",
            ],
            LOCAL_DEADLINE,
        )
        .await?;
        let recorded = PrimedRefs::parse(&listing)
            .ok_or_else(|| PrepareError("the repository has no default branch to check out ahead".to_owned()))?;
        hand_over(&partial, owner)?;
        git_as(
            binary,
            Some(&partial),
            &["checkout", "--quiet", "--detach", &recorded.commit],
            LOCAL_DEADLINE,
            None,
            owner,
        )
        .await?;
        let index = partial.join(".git").join("index");
        let written = std::fs::metadata(&index)
            .and_then(|meta| meta.modified())
            .map_err(|e| PrepareError(format!("cannot read {}: {e}", index.display())))?;
        tokio::time::sleep(until_the_second_after(written, std::time::SystemTime::now())).await;
        git_as(
            binary,
            Some(&partial),
            &["update-index", "-q", "--refresh"],
            LOCAL_DEADLINE,
            None,
            owner,
        )
        .await?;
        std::fs::write(&refs, listing.as_bytes())
            .map_err(|e| PrepareError(format!("cannot write {}: {e}", refs.display())))?;
        Ok(recorded.commit)
    };
    match made.await {
        Ok(commit) => {
            std::fs::rename(&partial, primed)
                .map_err(|e| PrepareError(format!("cannot move the primed workspace into place: {e}")))?;
            Ok(commit)
        }
        Err(error) => {
            let _ = std::fs::remove_dir_all(&partial);
            let _ = std::fs::remove_file(&refs);
            Err(error)
        }
    }
}

/// Where the refs of the workspace primed at `primed` are recorded: beside it, root's.
pub fn primed_refs_path(primed: &Path) -> PathBuf {
    primed.with_extension("refs")
}

/// How long from `now` until the wall clock is past the whole second `written` falls in (with a margin
/// for the filesystem's coarser clock): a file stamped before then is "racily clean" to git.
fn until_the_second_after(written: std::time::SystemTime, now: std::time::SystemTime) -> Duration {
    let since_epoch = written.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let next_second =
        std::time::UNIX_EPOCH + Duration::from_secs(since_epoch.as_secs() + 1) + Duration::from_millis(20);
    next_second.duration_since(now).unwrap_or_default()
}

/// The refs of a primed clone, from `for-each-ref --format='%(objectname) %(refname) %(symref)'` over
/// `refs/remotes/origin` and `refs/tags`.
#[derive(Debug, PartialEq, Eq)]
struct PrimedRefs {
    /// What `refs/remotes/origin/HEAD` names (the mirror's default branch, as the clone saw it).
    head: String,
    /// Its commit: the primed checkout's.
    commit: String,
    /// Every other ref and its object.
    refs: std::collections::BTreeMap<String, String>,
}

impl PrimedRefs {
    /// `None` without an `origin/HEAD` to check out.
    fn parse(listing: &str) -> Option<Self> {
        let mut head = None;
        let mut refs = std::collections::BTreeMap::new();
        for line in listing.lines() {
            let mut words = line.split(' ');
            let (Some(object), Some(name)) = (words.next(), words.next()) else {
                continue;
            };
            match words.next().filter(|target| !target.is_empty()) {
                Some(target) if name == "refs/remotes/origin/HEAD" => {
                    head = Some((target.to_owned(), object.to_owned()));
                }
                Some(_) => {}
                None => {
                    refs.insert(name.to_owned(), object.to_owned());
                }
            }
        }
        let (head, commit) = head?;
        Some(Self { head, commit, refs })
    }
}

/// What adopting a primed workspace takes, planned from its recorded refs and the mirror's now.
#[derive(Debug, PartialEq, Eq)]
struct Adoption {
    start_commit: String,
    /// `git update-ref --stdin` lines that make the clone's refs the mirror's (empty when they are).
    updates: String,
}

/// Plans the adoption of a clone with `recorded` refs, given the mirror's `listing`
/// (`for-each-ref --format='%(objectname) %(refname) %(HEAD)'` over `refs/heads` and `refs/tags`): the
/// clone's remote branches and tags become the mirror's as they are now, and the session starts at
/// `base` (or the default branch) as the mirror has it. An error when that start is not there, or the
/// mirror's default branch is another than the clone's (a new clone is made then).
fn plan_adoption(recorded: &PrimedRefs, listing: &str, base: Option<&str>) -> Result<Adoption, String> {
    let mut now = std::collections::BTreeMap::new();
    let mut head = None;
    for line in listing.lines() {
        let mut words = line.splitn(3, ' ');
        let (Some(object), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        let local = if let Some(branch) = name.strip_prefix("refs/heads/") {
            format!("refs/remotes/origin/{branch}")
        } else if name.starts_with("refs/tags/") {
            name.to_owned()
        } else {
            continue;
        };
        if words.next() == Some("*") {
            head = Some(local.clone());
        }
        now.insert(local, object.to_owned());
    }
    if head.as_deref() != Some(recorded.head.as_str()) {
        return Err(format!(
            "the repository's default branch is {head:?} now, {:?} when the workspace was checked out ahead",
            recorded.head
        ));
    }
    let start = match base {
        Some(_) => start_ref(base),
        None => recorded.head.clone(),
    };
    let start_commit = now.get(&start).cloned().ok_or_else(|| no_start(base).0)?;
    let mut updates = String::new();
    for (name, object) in &now {
        if recorded.refs.get(name) != Some(object) {
            updates.push_str(&format!("update {name} {object}\n"));
        }
    }
    for name in recorded.refs.keys().filter(|name| !now.contains_key(*name)) {
        updates.push_str(&format!("delete {name}\n"));
    }
    Ok(Adoption { start_commit, updates })
}

/// Makes the primed workspace at `primed` the session's `workspace`: its remote branches and tags made
/// the mirror's as they are now, on its branch started at `base` (or the default branch) as the mirror
/// has it, with origin the session's proxy. Root reads the mirror (its own); the sandbox uid's git
/// changes the clone (two or three processes); its tree changes only where the start differs from the
/// primed commit.
#[allow(clippy::too_many_arguments)]
async fn adopt_primed(
    binary: &Path,
    mirror: &Path,
    primed: &Path,
    workspace: &Path,
    branch: &str,
    base: Option<&str>,
    origin_url: &str,
    owner: Option<(u32, u32)>,
) -> Result<String, PrepareError> {
    let refs = primed_refs_path(primed);
    let recorded = std::fs::read_to_string(&refs)
        .ok()
        .and_then(|listing| PrimedRefs::parse(&listing))
        .ok_or_else(|| PrepareError(format!("no refs recorded at {}", refs.display())))?;
    // `origin` becomes the session's proxy meanwhile: its config is touched by nothing else here.
    let set_url = ["remote", "set-url", "origin", origin_url];
    let (listing, set_url) = tokio::join!(
        git(
            binary,
            Some(mirror),
            &[
                "for-each-ref",
                "--format=%(objectname) %(refname) %(HEAD)",
                "refs/heads",
                "refs/tags",
            ],
            LOCAL_DEADLINE,
        ),
        git_as(binary, Some(primed), &set_url, LOCAL_DEADLINE, None, owner,)
    );
    set_url?;
    let listing = listing?;
    let adoption = plan_adoption(&recorded, &listing, base).map_err(PrepareError)?;
    if !adoption.updates.is_empty() {
        git_fed(
            binary,
            Some(primed),
            &["update-ref", "--stdin"],
            LOCAL_DEADLINE,
            None,
            owner,
            Some(adoption.updates.as_bytes()),
        )
        .await?;
    }
    let checkout: Vec<&str> = if adoption.start_commit == recorded.commit {
        // The branch where HEAD is: no tree to compare.
        vec!["checkout", "--quiet", "-b", branch]
    } else {
        vec![
            "checkout",
            "--quiet",
            "--no-track",
            "-b",
            branch,
            &adoption.start_commit,
        ]
    };
    git_as(binary, Some(primed), &checkout, LOCAL_DEADLINE, None, owner).await?;
    std::fs::rename(primed, workspace)
        .map_err(|e| PrepareError(format!("cannot move the workspace into place: {e}")))?;
    let _ = std::fs::remove_file(&refs);
    Ok(adoption.start_commit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    fn run(dir: &Path, args: &[&str]) {
        sortie_testkit::git::git(dir, args);
    }

    fn chown(path: &Path, owner: u32) {
        let status = Command::new("chown")
            .args(["-R", &format!("{owner}:{owner}")])
            .arg(path)
            .status()
            .expect("chown");
        assert!(status.success());
    }

    #[tokio::test]
    async fn a_repository_of_another_user_is_mirrored_with_its_side_run_as_that_user() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mirroring a repository of another user as that user needs root");
            return;
        }
        let owner = 1234;
        let temp = tempfile::tempdir().expect("temp");
        let root = temp.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let seed = root.join("seed");
        let repo = root.join("upstream.git");
        run(root, &["init", "-q", seed.to_str().expect("utf-8")]);
        std::fs::write(seed.join("a.txt"), "a\n").expect("write");
        run(&seed, &["add", "."]);
        run(&seed, &["commit", "-q", "-m", "a"]);
        run(
            root,
            &[
                "clone",
                "-q",
                "--bare",
                "--no-local",
                seed.to_str().expect("utf-8"),
                repo.to_str().expect("utf-8"),
            ],
        );
        chown(&repo, owner);
        // Every git this mirror starts reports who runs it, where and for what, then is the real git.
        let log = root.join("log");
        std::fs::create_dir(&log).expect("log");
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        // Written by root and by the owner alike.
        std::fs::write(log.join("calls"), "").expect("calls");
        std::fs::set_permissions(log.join("calls"), std::fs::Permissions::from_mode(0o666)).expect("chmod");
        let real = Command::new("sh").args(["-c", "command -v git"]).output().expect("sh");
        let wrapper = root.join("git-wrapper");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\necho \"$(id -u) [$(grep '^Groups:' /proc/$$/status | cut -f2 | tr -d ' ')] $*\" >> {}/calls\nexec {} \"$@\"\n",
                log.display(),
                String::from_utf8_lossy(&real.stdout).trim()
            ),
        )
        .expect("wrapper");
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");

        let mirrors = root.join("mirrors");
        let repo_text = repo.to_str().expect("utf-8");
        let mirror = ensure_mirror(&wrapper, &mirrors, repo_text, None, None)
            .await
            .expect("mirror");
        let head = |dir: &Path| sortie_testkit::git::rev(dir, "refs/heads/main").unwrap_or_default();
        assert_eq!(head(&mirror), head(&repo));
        // A new commit upstream reaches the mirror through a fetch, the same way.
        std::fs::write(seed.join("b.txt"), "b\n").expect("write");
        run(&seed, &["add", "."]);
        run(&seed, &["commit", "-q", "-m", "b"]);
        // (The test's own push goes in as root: the repository is root's for that moment.)
        chown(&repo, 0);
        run(&seed, &["push", "-q", repo_text, "HEAD:refs/heads/main"]);
        chown(&repo, owner);
        ensure_mirror(&wrapper, &mirrors, repo_text, None, None)
            .await
            .expect("fetch");
        assert_eq!(head(&mirror), head(&repo));
        // Nothing new upstream: its refs are read, and nothing is fetched.
        let fetches = |calls: &str| calls.lines().filter(|c| c.contains(" fetch ")).count();
        let before = std::fs::read_to_string(log.join("calls")).expect("calls");
        assert_eq!(fetches(&before), 1, "{before}");
        ensure_mirror(&wrapper, &mirrors, repo_text, None, None)
            .await
            .expect("no fetch");
        let calls = std::fs::read_to_string(log.join("calls")).expect("calls");
        assert_eq!(fetches(&calls), 1, "a mirror that is current was fetched: {calls}");
        assert!(calls.len() > before.len(), "the upstream's refs were not read");

        // `<uid> [<groups>] <git's arguments>`: the repository's side is git's `upload-pack`, and the
        // reading of its refs.
        let serves = |call: &str| matches!(call.split(' ').nth(2), Some("upload-pack" | "for-each-ref"));
        let serving: Vec<&str> = calls.lines().filter(|c| serves(c) && !c.starts_with("0 ")).collect();
        assert_eq!(
            serving.iter().filter(|c| c.contains("upload-pack")).count(),
            2,
            "the clone and the fetch: {calls}"
        );
        assert_eq!(
            serving.iter().filter(|c| c.contains("for-each-ref")).count(),
            2,
            "the fetch's look and the last one: {calls}"
        );
        for call in &serving {
            assert!(
                call.starts_with(&format!("{owner} [] ")),
                "the repository's side ran as someone else, or with groups: {call}"
            );
        }
        for call in calls.lines().filter(|c| !serving.contains(c)) {
            assert!(call.starts_with("0 "), "{call}");
        }
        owned_by(&repo, owner, owner);
    }

    #[test]
    fn a_mirror_is_current_when_it_holds_every_ref_of_the_repository_at_its_object() {
        let ours = "aaaa refs/heads/main\nbbbb refs/heads/gone\ncccc refs/tags/v1\n";
        assert!(refs_within("aaaa refs/heads/main\ncccc refs/tags/v1\n", ours, None));
        assert!(refs_within("", ours, None), "a repository without refs");
        assert!(!refs_within("abab refs/heads/main\n", ours, None), "a ref moved");
        assert!(
            !refs_within("aaaa refs/heads/main\ndddd refs/heads/new\n", ours, None),
            "a new ref"
        );
        assert!(!refs_within("aaaa refs/heads/main", "", None), "an empty mirror");
        // Sessions' deliveries are not waited for, unless the session starts from one.
        let delivered = "aaaa refs/heads/main\neeee refs/heads/sortie/ses_1\nffff refs/sortie/wip/ses_2\n";
        assert!(refs_within(delivered, ours, None));
        assert!(refs_within(delivered, ours, Some("main")));
        assert!(!refs_within(delivered, ours, Some("sortie/ses_1")));
        assert!(
            !refs_within("eeee refs/heads/sortiex\n", ours, None),
            "not a session's branch"
        );
    }

    /// A repository `seed` under `root` with `files` files in `src/` committed on `main`; `root` made
    /// searchable by the sandbox uid, as a user's data dir is (serve opens it so).
    fn searchable_seed(root: &Path, files: usize) -> PathBuf {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let seed = root.join("seed");
        run(root, &["init", "-q", "-b", "main", seed.to_str().expect("utf-8")]);
        std::fs::create_dir(seed.join("src")).expect("mkdir");
        for i in 0..files {
            std::fs::write(seed.join(format!("src/f{i}.rs")), format!("fn f{i}() {{}}\n")).expect("write");
        }
        run(&seed, &["add", "."]);
        run(&seed, &["commit", "-q", "-m", "seed"]);
        seed
    }

    /// Asserts every entry under `root` is `uid`'s and `gid`'s; answers how many there are.
    fn owned_by(root: &Path, uid: u32, gid: u32) -> usize {
        use std::os::unix::fs::MetadataExt;
        let mut stack = vec![root.to_owned()];
        let mut entries = 0;
        while let Some(path) = stack.pop() {
            let metadata = std::fs::symlink_metadata(&path).expect("metadata");
            assert_eq!(
                (metadata.uid(), metadata.gid()),
                (uid, gid),
                "{} is someone else's",
                path.display()
            );
            entries += 1;
            if metadata.is_dir() {
                stack.extend(std::fs::read_dir(&path).expect("dir").map(|e| e.expect("entry").path()));
            }
        }
        entries
    }

    /// The worker as root makes a workspace for the sandbox uid: every file of it is that uid's, git as
    /// that uid finds the tree clean on its branch (started at the mirror's head) with origin the proxy,
    /// and the mirror stays root's.
    #[tokio::test]
    async fn a_workspace_is_checked_out_as_the_sandbox_uid() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: checking a workspace out as another uid needs root");
            return;
        }
        let sandbox = 61234;
        let temp = tempfile::tempdir().expect("temp");
        let root = temp.path();
        let seed = searchable_seed(root, 50);
        let git = Path::new("git");
        let mirror = ensure_mirror(git, &root.join("mirrors"), seed.to_str().expect("utf-8"), None, None)
            .await
            .expect("mirror");
        let workspace = root.join("ws");
        let origin = "http://127.0.0.1:3128/_sortie/git/ses_x.git";
        let started = ensure_workspace(
            git,
            &mirror,
            &workspace,
            None,
            "sortie/ses_x",
            None,
            origin,
            Some((sandbox, sandbox)),
        )
        .await
        .expect("workspace")
        .expect("a new workspace");
        assert!(!started.primed);
        assert_eq!(
            Some(started.start_commit),
            sortie_testkit::git::rev(&mirror, "refs/heads/main")
        );

        let files = owned_by(&workspace, sandbox, sandbox);
        assert!(files > 50, "{files}");
        let as_sandbox = |args: &[&str]| git_as_uid(sandbox, &workspace, args);
        assert_eq!(as_sandbox(&["status", "--porcelain"]), "");
        assert_eq!(as_sandbox(&["rev-parse", "--abbrev-ref", "HEAD"]), "sortie/ses_x");
        assert_eq!(as_sandbox(&["remote", "get-url", "origin"]), origin);
        // The mirror stays root's: the sandbox uid only ever read it.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(mirror.join("HEAD")).expect("mirror").uid(), 0);
        // A second call finds the workspace and leaves it be.
        let again = ensure_workspace(
            git,
            &mirror,
            &workspace,
            None,
            "sortie/ses_x",
            None,
            origin,
            Some((sandbox, sandbox)),
        )
        .await
        .expect("again");
        assert_eq!(again, None);
    }

    /// Runs git as `uid` in `dir`, as the sandbox would; its stdout.
    fn git_as_uid(uid: u32, dir: &Path, args: &[&str]) -> String {
        let output = Command::new("setpriv")
            .args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"])
            .args(["env", "HOME=/nonexistent", "GIT_CONFIG_GLOBAL=/dev/null", "git"])
            .args(args)
            .current_dir(dir)
            .output()
            .expect("git as the sandbox uid");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// A workspace checked out ahead is the sandbox uid's, its index holds every file's own stat (none
    /// left "racily clean", which git would hash again), and adopting it gives what a clone made for the
    /// session would: its branch at the base asked for, origin the proxy, a clean tree.
    #[tokio::test]
    async fn a_primed_workspace_is_adopted_as_a_new_clone_would_be_made() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: checking a workspace out as another uid needs root");
            return;
        }
        let sandbox = 61235;
        let temp = tempfile::tempdir().expect("temp");
        let root = temp.path();
        let seed = searchable_seed(root, 40);
        run(&seed, &["checkout", "-q", "-b", "other"]);
        std::fs::write(seed.join("other.txt"), "other\n").expect("write");
        run(&seed, &["add", "."]);
        run(&seed, &["commit", "-q", "-m", "other"]);
        run(&seed, &["checkout", "-q", "main"]);
        let git = Path::new("git");
        let mirror = ensure_mirror(git, &root.join("mirrors"), seed.to_str().expect("utf-8"), None, None)
            .await
            .expect("mirror");
        let main = sortie_testkit::git::rev(&mirror, "refs/heads/main").expect("main");
        let other = sortie_testkit::git::rev(&mirror, "refs/heads/other").expect("other");
        let owner = Some((sandbox, sandbox));
        let origin = "http://127.0.0.1:3128/_sortie/git/ses_p.git";

        for (n, base, expected) in [(0, None, &main), (1, Some("other"), &other)] {
            let disk = root.join(format!("disk{n}"));
            std::fs::create_dir(&disk).expect("disk");
            let primed = disk.join(PRIMED_DIR);
            let commit = prime_workspace(git, &mirror, &primed, owner).await.expect("primed");
            assert_eq!(&commit, &main, "primed at the default branch");
            owned_by(&primed, sandbox, sandbox);
            // Git (as built without USE_NSEC) holds an entry stamped in the index's own second as racily
            // clean.
            let index = git_as_uid(sandbox, &primed, &["ls-files", "--debug"]);
            let stamps: Vec<u64> = index
                .lines()
                .filter_map(|line| line.trim().strip_prefix("mtime: "))
                .filter_map(|stamp| stamp.split(':').next()?.parse().ok())
                .collect();
            assert_eq!(stamps.len(), 40, "{index}");
            let written = std::fs::metadata(primed.join(".git/index"))
                .and_then(|meta| meta.modified())
                .expect("index")
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_secs();
            assert!(
                stamps.iter().all(|stamp| *stamp < written),
                "entries of the index's second ({written}), which git would hash again:\n{index}"
            );

            let workspace = disk.join("workspace");
            let made = ensure_workspace(
                git,
                &mirror,
                &workspace,
                Some(&primed),
                "sortie/ses_p",
                base,
                origin,
                owner,
            )
            .await
            .expect("workspace")
            .expect("a new workspace");
            assert_eq!(
                made,
                NewWorkspace {
                    start_commit: expected.clone(),
                    primed: true
                }
            );
            assert!(!primed.exists());
            owned_by(&workspace, sandbox, sandbox);
            assert_eq!(git_as_uid(sandbox, &workspace, &["status", "--porcelain"]), "");
            assert_eq!(
                git_as_uid(sandbox, &workspace, &["rev-parse", "--abbrev-ref", "HEAD"]),
                "sortie/ses_p"
            );
            assert_eq!(&git_as_uid(sandbox, &workspace, &["rev-parse", "HEAD"]), expected);
            assert_eq!(
                git_as_uid(sandbox, &workspace, &["remote", "get-url", "origin"]),
                origin
            );
            assert_eq!(workspace.join("other.txt").exists(), base.is_some());
        }

        // A primed workspace left half-made is removed and a clone made instead.
        let disk = root.join("disk2");
        let primed = disk.join(PRIMED_DIR);
        std::fs::create_dir_all(primed.join(".git")).expect("half-made");
        let workspace = disk.join("workspace");
        let made = ensure_workspace(
            git,
            &mirror,
            &workspace,
            Some(&primed),
            "sortie/ses_q",
            None,
            origin,
            owner,
        )
        .await
        .expect("workspace")
        .expect("a new workspace");
        assert_eq!(
            made,
            NewWorkspace {
                start_commit: main.clone(),
                primed: false
            }
        );
        assert!(!primed.exists());
        assert_eq!(git_as_uid(sandbox, &workspace, &["status", "--porcelain"]), "");
    }

    const A: &str = "1111111111111111111111111111111111111111";
    const B: &str = "2222222222222222222222222222222222222222";
    const C: &str = "3333333333333333333333333333333333333333";

    fn recorded() -> PrimedRefs {
        PrimedRefs::parse(&format!(
            "{A} refs/remotes/origin/HEAD refs/remotes/origin/main\n{A} refs/remotes/origin/main \n\
             {B} refs/remotes/origin/old \n{C} refs/tags/v1 \n"
        ))
        .expect("an origin/HEAD")
    }

    #[test]
    fn a_primed_clones_refs_are_read_with_its_head() {
        let refs = recorded();
        assert_eq!(refs.head, "refs/remotes/origin/main");
        assert_eq!(refs.commit, A);
        assert_eq!(refs.refs.len(), 3);
        assert_eq!(PrimedRefs::parse(&format!("{A} refs/remotes/origin/main \n")), None);
    }

    /// The adoption makes the clone's refs the mirror's now (moved, new and gone ones) and starts where
    /// the mirror says; nothing to update when nothing moved.
    #[test]
    fn the_adoption_brings_the_clones_refs_to_the_mirrors_now() {
        let same = format!("{A} refs/heads/main *\n{B} refs/heads/old  \n{C} refs/tags/v1  \n");
        let plan = plan_adoption(&recorded(), &same, None).expect("plan");
        assert_eq!(
            plan,
            Adoption {
                start_commit: A.into(),
                updates: String::new()
            }
        );

        let moved = format!("{B} refs/heads/main *\n{C} refs/heads/sortie/ses_1  \n{C} refs/tags/v1  \n");
        let plan = plan_adoption(&recorded(), &moved, None).expect("plan");
        assert_eq!(plan.start_commit, B);
        assert_eq!(
            plan.updates,
            format!(
                "update refs/remotes/origin/main {B}\nupdate refs/remotes/origin/sortie/ses_1 {C}\n\
                 delete refs/remotes/origin/old\n"
            )
        );
        let plan = plan_adoption(&recorded(), &moved, Some("sortie/ses_1")).expect("plan");
        assert_eq!(plan.start_commit, C);
        assert!(plan_adoption(&recorded(), &moved, Some("gone")).is_err());
        // Another default branch now: a new clone is made instead.
        let renamed = format!("{A} refs/heads/main  \n{A} refs/heads/trunk *\n");
        assert!(plan_adoption(&recorded(), &renamed, None).is_err());
    }

    #[test]
    fn a_refresh_waits_until_the_checkouts_second_is_over() {
        let at = |ms: u64| std::time::UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(until_the_second_after(at(5_300), at(5_400)), Duration::from_millis(620));
        assert_eq!(until_the_second_after(at(5_300), at(7_000)), Duration::ZERO);
    }

    #[test]
    fn mirrors_are_named_by_the_repository() {
        let a = mirror_path(Path::new("/m"), "/srv/a.git");
        assert_eq!(a, mirror_path(Path::new("/m"), "/srv/a.git"));
        assert_ne!(a, mirror_path(Path::new("/m"), "/srv/b.git"));
        assert!(a.starts_with("/m") && a.extension().is_some_and(|e| e == "git"));
    }
}
