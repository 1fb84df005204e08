//! A session's local repository, checked at create so that what the server accepts, a worker can run
//! (DESIGN §13): the path is under one of the workspace's roots, is a git repository, can be read by
//! whoever serves it to sortie, and has the `base` branch asked for.
//!
//! Nothing here runs git. Root's git never works in a repository root does not own (DESIGN §9
//! invariant 11), and reading refs needs no git: a branch is a file under `refs/heads` or a line of
//! `packed-refs`. A repository in another ref format (reftable) is not judged here; the worker's clone
//! is then the one to say.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sortie_protocol::ErrorCode;
use sortie_store::RepoAccess;

use crate::error::ApiError;

/// Resolves `path` to the canonical path of a local repository this workspace may use (inside its
/// roots, checked before and after symlinks are resolved, so that neither `..` nor a link leads out)
/// and whose owner can read it.
///
/// The file system is looked at in one blocking task: a dozen `stat`s each handed to the blocking
/// pool and back cost an accept one wake-up apiece, tens of ms in all on a busy machine.
pub(crate) async fn resolve(path: &str, access: &RepoAccess) -> Result<String, ApiError> {
    let (path, access) = (path.to_owned(), access.clone());
    tokio::task::spawn_blocking(move || resolve_now(&path, &access))
        .await
        .unwrap_or_else(|error| {
            tracing::error!(%error, "the repository check failed");
            Err(ApiError::new(
                ErrorCode::Internal,
                "the server failed; the log has the detail",
            ))
        })
}

fn resolve_now(path: &str, access: &RepoAccess) -> Result<String, ApiError> {
    let not_allowed = || {
        ApiError::new(
            ErrorCode::RepoNotAllowed,
            format!("repo {path:?} is not under a local root this workspace may use"),
        )
    };
    let requested = Path::new(path);
    if requested
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(ApiError::new(
            ErrorCode::RepoInvalid,
            format!("repo {path:?} has '.' or '..' components: give the plain absolute path"),
        ));
    }
    let within_roots =
        |candidate: &Path| access.any_local_path || access.allowed_roots.iter().any(|root| candidate.starts_with(root));
    // Checked before touching the file system, so a workspace learns nothing about paths outside its roots.
    if !within_roots(requested) {
        return Err(not_allowed());
    }
    let resolved: PathBuf = match std::fs::canonicalize(requested) {
        Ok(resolved) => resolved,
        Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(not_readable(
                path,
                format!(
                    "the server (uid {}) may not search a directory on the way",
                    nix::unistd::geteuid()
                ),
            ));
        }
        Err(_) => {
            return Err(ApiError::new(
                ErrorCode::RepoInvalid,
                format!("repo {path:?} does not exist"),
            ));
        }
    };
    if !within_roots(&resolved) {
        return Err(not_allowed());
    }
    let git_dir = match git_dir(&resolved) {
        Ok(Some(dir)) => dir,
        Ok(None) => {
            return Err(ApiError::new(
                ErrorCode::RepoInvalid,
                format!("repo {path:?} is not a git repository"),
            ));
        }
        Err(error) => return Err(not_readable(path, format!("the server cannot read it: {error}"))),
    };
    if let GitDir::At(git_dir) = &git_dir
        && let Some(why) = owner_cannot_read(&resolved, git_dir)
    {
        return Err(not_readable(path, why));
    }
    resolved
        .into_os_string()
        .into_string()
        .map_err(|_| ApiError::new(ErrorCode::RepoInvalid, format!("repo {path:?} is not valid UTF-8")))
}

/// Refuses a `base` the local repository at `repo` (as [`resolve`] answered it) does not have.
pub(crate) async fn check_base(repo: &str, base: &str) -> Result<(), ApiError> {
    let (root, wanted) = (PathBuf::from(repo), base.to_owned());
    let found = tokio::task::spawn_blocking(move || match git_dir(&root) {
        Ok(Some(GitDir::At(git_dir))) => has_branch(&git_dir, &wanted),
        _ => None,
    })
    .await
    .ok()
    .flatten();
    match found {
        Some(false) => Err(ApiError::new(
            ErrorCode::BaseNotFound,
            format!("repo {repo:?} has no branch {base:?}: name one it has, or leave base out for its default branch"),
        )
        .with_details(sortie_protocol::error::details::BaseNotFound { base: base.to_owned() })),
        _ => Ok(()),
    }
}

fn not_readable(path: &str, why: String) -> ApiError {
    ApiError::new(
        ErrorCode::RepoNotReadable,
        format!("repo {path:?} cannot be read: {why}"),
    )
    .with_details(sortie_protocol::error::details::RepoNotReadable { path: path.to_owned() })
}

/// The repository's git dir: `.git` of a work tree, or the directory itself when bare. `None` when it
/// is neither; an error when the server may not look.
fn git_dir(root: &Path) -> std::io::Result<Option<GitDir>> {
    let dot_git = root.join(".git");
    match std::fs::metadata(&dot_git) {
        Ok(meta) if meta.is_dir() => return Ok(Some(GitDir::At(dot_git))),
        // A linked work tree or a submodule: `.git` is a file naming the real one, which the worker's
        // clone follows; it is not judged here.
        Ok(_) => return Ok(Some(GitDir::Elsewhere)),
        Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => return Err(error),
        Err(_) => {}
    }
    let head = std::fs::metadata(root.join("HEAD"));
    let objects = std::fs::metadata(root.join("objects"));
    for probe in [&head, &objects] {
        if let Err(error) = probe
            && error.kind() == std::io::ErrorKind::PermissionDenied
        {
            return Err(std::io::Error::new(error.kind(), error.to_string()));
        }
    }
    let bare = head.is_ok_and(|m| m.is_file()) && objects.is_ok_and(|m| m.is_dir());
    Ok(bare.then(|| GitDir::At(root.to_owned())))
}

/// Where a repository keeps its git data.
enum GitDir {
    At(PathBuf),
    /// Named by a `.git` file (a linked work tree, a submodule).
    Elsewhere,
}

/// Why the repository's owner cannot read it, when the server runs as root and the owner is someone
/// else: host git serves such a repository as its owner (without supplementary groups), so what the
/// owner may not search or read, the worker cannot clone.
fn owner_cannot_read(root: &Path, git_dir: &Path) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let owner = std::fs::metadata(root).ok()?;
    if owner.uid() == 0 {
        return None;
    }
    let (uid, gid) = (owner.uid(), owner.gid());
    let may = |path: &Path, want: u32| -> Result<(), String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mode = meta.permissions().mode();
        let granted = if meta.uid() == uid {
            (mode >> 6) & 0o7
        } else if meta.gid() == gid {
            (mode >> 3) & 0o7
        } else {
            mode & 0o7
        };
        if granted & want == want {
            return Ok(());
        }
        let what = match want {
            0o1 => "search (x)",
            0o4 => "read (r)",
            _ => "read and search (r-x)",
        };
        Err(format!(
            "its owner, uid {uid}, who serves it to sortie, may not {what} {} (mode {:04o}, owner {}:{}); fix with \
             chmod or chown, e.g. `chmod u+rwX -R {}`",
            path.display(),
            mode & 0o7777,
            meta.uid(),
            meta.gid(),
            root.display()
        ))
    };
    let checks = root
        .ancestors()
        .skip(1)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| (dir.to_owned(), 0o1))
        .chain([
            (root.to_owned(), 0o5),
            (git_dir.to_owned(), 0o5),
            (git_dir.join("HEAD"), 0o4),
            (git_dir.join("objects"), 0o5),
            (git_dir.join("refs"), 0o5),
        ]);
    for (path, want) in checks {
        if let Err(why) = may(&path, want) {
            return Some(why);
        }
    }
    None
}

/// Whether `git_dir` has branch `base`: a loose ref or a packed one. `None` when the repository
/// keeps its refs in a way this does not read (reftable), or cannot be read.
fn has_branch(git_dir: &Path, base: &str) -> Option<bool> {
    if git_dir.join("reftable").exists() {
        return None;
    }
    let loose = git_dir.join("refs/heads").join(base);
    match std::fs::metadata(&loose) {
        Ok(meta) if meta.is_file() => return Some(true),
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) if error.raw_os_error() == Some(nix::libc::ENOTDIR) => {}
        Err(_) => return None,
    }
    let packed = match std::fs::read_to_string(git_dir.join("packed-refs")) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Some(false),
        Err(_) => return None,
    };
    let wanted = format!("refs/heads/{base}");
    Some(
        packed
            .lines()
            .filter(|line| !line.starts_with('#') && !line.starts_with('^'))
            .any(|line| line.split_once(' ').is_some_and(|(_, name)| name == wanted)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_branch_is_a_loose_ref_or_a_packed_one() {
        let dir = tempfile::tempdir().expect("temp");
        let git = dir.path();
        std::fs::create_dir_all(git.join("refs/heads/feature")).expect("mkdir");
        std::fs::write(git.join("refs/heads/main"), "0123\n").expect("ref");
        std::fs::write(git.join("refs/heads/feature/x"), "0123\n").expect("ref");
        assert_eq!(has_branch(git, "main"), Some(true));
        assert_eq!(has_branch(git, "feature/x"), Some(true));
        assert_eq!(
            has_branch(git, "feature"),
            Some(false),
            "a directory of refs is no branch"
        );
        assert_eq!(has_branch(git, "main/deeper"), Some(false), "below a ref file");
        assert_eq!(has_branch(git, "release"), Some(false));
        std::fs::write(
            git.join("packed-refs"),
            "# pack-refs with: peeled fully-peeled sorted\n0123 refs/heads/release\n0456 refs/tags/v1\n^0789\n",
        )
        .expect("packed");
        assert_eq!(has_branch(git, "release"), Some(true));
        assert_eq!(has_branch(git, "v1"), Some(false), "a tag is no branch");
        std::fs::create_dir(git.join("reftable")).expect("mkdir");
        assert_eq!(has_branch(git, "anything"), None, "reftable is not read here");
    }
}
