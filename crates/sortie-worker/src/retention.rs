//! Retention (DESIGN §16): what `sortie gc` and the worker's periodic task free. The store picks the
//! sessions (ended or archived before the cutoff, no sandbox; never a queued, running or idle one) and
//! prunes each one's transcript in one transaction; then its directories go (workspace, home, disk
//! image, the git proxy's state). A mirror goes when it was not fetched for the age and no session
//! kept by the store is of its repository (their workspaces borrow its objects). Last, the store gives
//! free space back.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sortie_protocol::SessionId;
use sortie_store::{Store, StoreError, now_ms};

use crate::prepare::{SessionDirs, mirror_lock_path, mirror_path};

/// Sessions pruned per store read: a large backlog is taken in pages.
const PAGE: u32 = 200;

/// What one run freed (or, dry, would free).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub dry_run: bool,
    pub sessions: Vec<PrunedSession>,
    /// Mirrors removed, with the bytes they held on disk.
    pub mirrors: Vec<(PathBuf, u64)>,
    /// Bytes the store's file shrank by (SQLite's `VACUUM`; 0 on PostgreSQL or when not worth it).
    pub store_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrunedSession {
    pub id: SessionId,
    pub parts: u64,
    pub parts_bytes: u64,
    /// Bytes its directories held on disk.
    pub disk_bytes: u64,
}

impl GcReport {
    pub fn freed_bytes(&self) -> u64 {
        let sessions: u64 = self.sessions.iter().map(|s| s.parts_bytes + s.disk_bytes).sum();
        let mirrors: u64 = self.mirrors.iter().map(|(_, bytes)| bytes).sum();
        sessions + mirrors + self.store_bytes
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("the store: {0}")]
    Store(#[from] StoreError),
}

/// Frees what is older than `older_than` under `work_dir` and in `store`; with `dry_run`, only says.
pub async fn collect(
    store: &dyn Store,
    work_dir: &Path,
    older_than: Duration,
    dry_run: bool,
) -> Result<GcReport, GcError> {
    let age_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    let cutoff = now_ms().saturating_sub(age_ms);
    let mut report = GcReport {
        dry_run,
        ..GcReport::default()
    };
    let mut seen = std::collections::HashSet::new();
    loop {
        let page = store.prunable_sessions(cutoff, PAGE).await?;
        let fresh: Vec<_> = page.into_iter().filter(|s| seen.insert(s.id.clone())).collect();
        if fresh.is_empty() {
            break;
        }
        for session in fresh {
            let dirs = SessionDirs::new(work_dir, &session.id);
            if is_mounted(&dirs) {
                // A disk still mounted is a sandbox's that was not torn down: not retention's to touch.
                tracing::warn!(session = %session.id, "retention skips a session whose disk is mounted");
                continue;
            }
            if !dry_run && !store.prune_session(&session.id, cutoff).await? {
                continue;
            }
            let disk_bytes = disk_usage(&dirs.root);
            if !dry_run && let Err(error) = remove_tree(&dirs.root) {
                tracing::warn!(%error, session = %session.id, "retention could not remove the session's directories");
            }
            report.sessions.push(PrunedSession {
                id: session.id,
                parts: session.parts,
                parts_bytes: session.parts_bytes,
                disk_bytes,
            });
        }
        if dry_run {
            // Nothing changed in the store: the next page would be this one.
            break;
        }
    }
    report.mirrors = stale_mirrors(store, work_dir, older_than, dry_run).await?;
    if !dry_run {
        report.store_bytes = store.compact().await?;
    }
    Ok(report)
}

/// The mirrors not fetched for `older_than` that no kept session's workspace borrows from.
async fn stale_mirrors(
    store: &dyn Store,
    work_dir: &Path,
    older_than: Duration,
    dry_run: bool,
) -> Result<Vec<(PathBuf, u64)>, GcError> {
    let mirrors = work_dir.join("mirrors");
    let Ok(entries) = std::fs::read_dir(&mirrors) else {
        return Ok(Vec::new());
    };
    // A dry run prunes nothing, so the sessions it would prune still count as kept here: it may
    // promise fewer mirrors than a real run frees, never more.
    let kept: std::collections::HashSet<PathBuf> = store
        .kept_repos()
        .await?
        .iter()
        .map(|repo| mirror_path(&mirrors, repo))
        .collect();
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|ext| ext != "git") || kept.contains(&path) {
            continue;
        }
        let stale = |path: &Path| now.duration_since(last_fetched(path)).unwrap_or_default() >= older_than;
        if !stale(&path) {
            continue;
        }
        let bytes = disk_usage(&path);
        if dry_run {
            removed.push((path, bytes));
            continue;
        }
        // Under the mirror's exclusive lock (see `prepare::hold_mirror`): a session fetching or cloning
        // it now holds it shared, and a fetch that ended just now made it fresh.
        let Ok(lock) = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(mirror_lock_path(&path))
        else {
            continue;
        };
        if lock.try_lock().is_err() || !stale(&path) {
            continue;
        }
        if let Err(error) = remove_tree(&path) {
            tracing::warn!(%error, mirror = %path.display(), "retention could not remove a mirror");
            continue;
        }
        drop(lock);
        removed.push((path, bytes));
    }
    Ok(removed)
}

/// When a mirror was last made or fetched (`git fetch` writes `FETCH_HEAD`).
fn last_fetched(mirror: &Path) -> SystemTime {
    ["FETCH_HEAD", "HEAD", ""]
        .iter()
        .filter_map(|name| std::fs::symlink_metadata(mirror.join(name)).ok()?.modified().ok())
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Whether the session's disk is mounted (its mount point on another device than its directory).
fn is_mounted(dirs: &SessionDirs) -> bool {
    match (
        std::fs::symlink_metadata(&dirs.disk),
        std::fs::symlink_metadata(&dirs.root),
    ) {
        (Ok(disk), Ok(root)) => disk.is_dir() && disk.dev() != root.dev(),
        _ => false,
    }
}

/// The bytes a tree holds on disk (allocated blocks: a sparse disk image counts what it uses), never
/// following a symbolic link a sandbox may have left.
fn disk_usage(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let mut total = meta.blocks() * 512;
    if meta.is_dir()
        && let Ok(entries) = std::fs::read_dir(path)
    {
        for entry in entries.flatten() {
            total += disk_usage(&entry.path());
        }
    }
    total
}

/// Removes a tree; `std::fs::remove_dir_all` removes symbolic links, never what they point at.
fn remove_tree(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_blocks_and_never_follows_a_link_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("big"), vec![1_u8; 1 << 20]).expect("write");
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("a")).expect("mkdir");
        std::fs::write(tree.join("a/file"), vec![1_u8; 64 << 10]).expect("write");
        std::os::unix::fs::symlink(outside.path(), tree.join("escape")).expect("symlink");
        let used = disk_usage(&tree);
        assert!((64 << 10..1 << 20).contains(&used), "{used}");
        remove_tree(&tree).expect("remove");
        assert!(!tree.exists());
        assert!(outside.path().join("big").exists(), "what a link pointed at stays");
        remove_tree(&tree).expect("removing what is gone is no error");
    }
}
