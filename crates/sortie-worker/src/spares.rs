//! Session disks made ahead (local runtime, as root: only then has a session a disk of its own), in
//! `<work dir>/spares`.
//!
//! - [`SPARE_DISKS`] formatted images: a new session's first disk is a rename, a check and a mount, not
//!   a `mkfs`.
//! - In `spares/primed`, up to `--primed-workspaces` ([`PRIMED_WORKSPACES`] by default) disks that
//!   also hold a workspace checked out ahead ([`prepare::prime_workspace`]) for a repository a session
//!   used lately: the next new session of that repository adopts the checkout instead of making one,
//!   which on a large repository is most of its preparation. A primed disk is named
//!   `<mirror>_<name>.img`; the session takes it as it mounts its disk, and the adoption, after the
//!   session's fetch, brings the clone's refs to the mirror's of that moment and starts the session
//!   where the mirror says (the tree changes where that start differs from the primed commit), so a
//!   workspace never starts from older refs than its fetch brought. One primed for a repository no
//!   longer among the latest, or whose mirror is gone, is deleted.
//!
//! No sandbox has a disk before a session takes it: a primed workspace's files are as the host's git
//! wrote them (root made the clone's `.git`, the sandbox uid checked it out, as for any session). Primed
//! disks are made again after a restart rather than trusted across it (the sandbox uid, or a mirror,
//! may have changed meanwhile).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sortie_sandbox::local::disk::{self, SessionDisk};
use sortie_sandbox::local::{cgroup, priority};

use crate::pool::fresh_name;
use crate::prepare;

/// How many formatted session disks the worker keeps ready: a session's first disk is then a rename,
/// a check and a mount, not a `mkfs` (about 18 ms here).
pub const SPARE_DISKS: usize = 2;
/// How many repositories (the latest a session used) have a disk with a workspace checked out ahead, by
/// default (`--primed-workspaces`). Each costs the host what its checkout holds, on the host's
/// filesystem.
pub const PRIMED_WORKSPACES: usize = 2;
/// How long the keeper waits before it tries again after a disk could not be made.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How often a keeper with nothing to do looks again.
const LOOK_AGAIN_EVERY: Duration = Duration::from_secs(30);
/// How long a primed disk's loop device may take to be let go after its unmount.
const LOOP_RELEASE_DEADLINE: Duration = Duration::from_secs(10);

/// Session disks made ahead, plain and primed.
pub(crate) struct SpareDisks {
    pub dir: PathBuf,
    primed_dir: PathBuf,
    size_bytes: u64,
    git: PathBuf,
    /// The sandbox uid and gid: a primed workspace is checked out as them.
    owner: (u32, u32),
    /// How many repositories have a primed disk at most.
    primed_limit: usize,
    /// The mirrors whose next session should find a primed disk, the latest last.
    wanted: std::sync::Mutex<Vec<PathBuf>>,
    taken: tokio::sync::Notify,
}

impl SpareDisks {
    pub fn new(work_dir: &Path, size_bytes: u64, git: PathBuf, owner: (u32, u32), primed_limit: usize) -> Self {
        let dir = work_dir.join("spares");
        Self {
            primed_dir: dir.join("primed"),
            dir,
            size_bytes,
            git,
            owner,
            primed_limit,
            wanted: std::sync::Mutex::new(Vec::new()),
            taken: tokio::sync::Notify::new(),
        }
    }

    /// Says one may have been taken: the keeper makes another.
    pub fn taken(&self) {
        self.taken.notify_one();
    }

    /// Asks for a primed disk for the next session of `mirror`'s repository (the latest asked are kept).
    pub fn want_primed(&self, mirror: &Path) {
        if self.primed_limit == 0 {
            return;
        }
        {
            let mut wanted = self.wanted.lock().unwrap_or_else(|p| p.into_inner());
            wanted.retain(|other| other != mirror);
            wanted.push(mirror.to_owned());
            let over = wanted.len().saturating_sub(self.primed_limit);
            wanted.drain(..over);
        }
        self.taken.notify_one();
    }

    /// Claims a disk primed for `mirror` as `image` (the rename is the claim, never over an existing
    /// file); `false` when there is none.
    pub fn take_primed(&self, mirror: &Path, image: &Path) -> bool {
        let taken = disk::take_spare_named(&self.primed_dir, image, self.size_bytes, &primed_prefix(mirror));
        if taken {
            self.taken();
        }
        taken
    }

    fn plain_count(&self) -> usize {
        std::fs::read_dir(&self.dir).map_or(0, |entries| {
            entries
                .flatten()
                .filter(|entry| disk::is_spare(&entry.path(), self.size_bytes))
                .count()
        })
    }

    /// The finished primed images: file name and path.
    fn primed_images(&self) -> Vec<(String, PathBuf)> {
        std::fs::read_dir(&self.primed_dir).map_or_else(
            |_| Vec::new(),
            |entries| {
                entries
                    .flatten()
                    .filter(|entry| disk::is_spare(&entry.path(), self.size_bytes))
                    .map(|entry| (entry.file_name().to_string_lossy().into_owned(), entry.path()))
                    .collect()
            },
        )
    }
}

/// A mirror's name without `.git` (a digest of the repository's address).
fn mirror_key(mirror: &Path) -> String {
    mirror
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The start of the name of a disk primed for `mirror`.
fn primed_prefix(mirror: &Path) -> String {
    format!("{}_", mirror_key(mirror))
}

/// Keeps [`SPARE_DISKS`] plain spares, and a primed disk for each wanted repository, until `shutdown`
/// (plain spares stay for the next start; primed ones are made again).
/// The processes it runs (`mkfs`, `e2fsck`, `mount`, a checkout's git) are work ahead
/// ([`priority::HostWork::Ahead`]): they take only the CPU that `serve` and the sandboxes leave.
pub(crate) async fn keep_spare_disks(spares: Arc<SpareDisks>, shutdown: tokio::sync::oneshot::Receiver<()>) {
    let group = match cgroup::create_for_work_ahead(Path::new(crate::git_proxy::CGROUP_ROOT)) {
        Ok(procs) => procs,
        Err(error) => {
            tracing::warn!(%error, "disks made ahead run niced only, in no CPU group of their own");
            Vec::new()
        }
    };
    priority::ahead(group.into(), keep(spares, shutdown)).await;
}

async fn keep(spares: Arc<SpareDisks>, mut shutdown: tokio::sync::oneshot::Receiver<()>) {
    if let Err(error) = std::fs::create_dir_all(&spares.primed_dir) {
        tracing::warn!(%error, dir = %spares.primed_dir.display(), "no spare session disks");
        return;
    }
    // What a crash left half-made, and spares of another disk size than this start's.
    if let Ok(entries) = std::fs::read_dir(&spares.dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_file()) && !disk::is_spare(&entry.path(), spares.size_bytes) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    clear_primed(&spares.primed_dir).await;
    loop {
        let mut pause = LOOK_AGAIN_EVERY;
        while spares.plain_count() < SPARE_DISKS {
            if !matches!(
                shutdown.try_recv(),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
            ) {
                return;
            }
            let image = spares.dir.join(format!("{}.img", disk_name()));
            if let Err(error) = disk::make_spare(&image, spares.size_bytes).await {
                tracing::warn!(%error, "a spare session disk could not be made; trying again in 5 s");
                pause = RETRY_AFTER;
                break;
            }
        }
        tokio::select! {
            _ = &mut shutdown => {
                // A disk being primed is left half-made: it goes now, its mount with it.
                clear_making(&spares.primed_dir).await;
                return;
            }
            () = prime_wanted(&spares) => {}
        }
        tokio::select! {
            _ = &mut shutdown => return,
            () = spares.taken.notified() => {}
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// A name no other disk of this host has had.
fn disk_name() -> String {
    fresh_name().replacen(crate::pool::NAME_PREFIX, "disk_", 1)
}

/// Deletes the primed disks of repositories no longer wanted or whose mirror is gone (retention deleted
/// it), and primes one for each wanted repository that has none, the latest first. A repository whose
/// workspace cannot be checked out ahead is no longer wanted (until its next session asks again).
async fn prime_wanted(spares: &SpareDisks) {
    let wanted = spares.wanted.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let live: Vec<(&PathBuf, String)> = wanted
        .iter()
        .filter(|mirror| mirror.join("HEAD").is_file())
        .map(|mirror| (mirror, primed_prefix(mirror)))
        .collect();
    for (name, path) in spares.primed_images() {
        if !live.iter().any(|(_, prefix)| name.starts_with(prefix.as_str())) {
            let _ = std::fs::remove_file(path);
        }
    }
    for (mirror, prefix) in live.iter().rev() {
        let primed = spares
            .primed_images()
            .iter()
            .any(|(name, _)| name.starts_with(prefix.as_str()));
        if primed {
            continue;
        }
        if let Err(error) = prime_one(spares, mirror, prefix).await {
            tracing::warn!(%error, mirror = %mirror.display(), "the repository's workspace could not be checked out ahead");
            spares
                .wanted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|other| other != *mirror);
        }
    }
}

/// Makes one disk primed for `mirror`: formatted, mounted beside the others, the workspace checked
/// out into it, unmounted, and once its loop device is let go, named with `prefix` (which is what makes
/// it one a session can take).
async fn prime_one(spares: &SpareDisks, mirror: &Path, prefix: &str) -> Result<(), String> {
    let clock = Instant::now();
    let name = disk_name();
    let image = spares.primed_dir.join(format!("{name}.making"));
    let mount_point = spares.primed_dir.join(format!("{name}.mnt"));
    let made = async {
        // The clone borrows the mirror's objects: retention must not delete it meanwhile.
        let _hold = prepare::hold_mirror(mirror).await.map_err(|e| e.0)?;
        disk::make_spare(&image, spares.size_bytes)
            .await
            .map_err(|e| e.to_string())?;
        SessionDisk::ensure(&image, &mount_point, spares.size_bytes)
            .await
            .map_err(|e| e.to_string())?;
        prepare::prime_workspace(
            &spares.git,
            mirror,
            &mount_point.join(prepare::PRIMED_DIR),
            Some(spares.owner),
        )
        .await
        .map_err(|e| e.0)
    };
    let made = made.await;
    let unmounted = disk::unmount(&mount_point).await;
    let _ = std::fs::remove_dir(&mount_point);
    let commit = match (made, unmounted) {
        (Ok(commit), Ok(disk::Unmounted::Unmounted)) => commit,
        (Err(error), _) => {
            let _ = std::fs::remove_file(&image);
            return Err(error);
        }
        (Ok(_), unmounted) => {
            let _ = std::fs::remove_file(&image);
            return Err(format!("the primed disk was not unmounted cleanly: {unmounted:?}"));
        }
    };
    // A session's mount would join a loop device still holding the image rather than attach its own.
    let canonical = std::fs::canonicalize(&image).map_err(|e| format!("cannot resolve {}: {e}", image.display()))?;
    let deadline = Instant::now() + LOOP_RELEASE_DEADLINE;
    while !disk::loop_devices_backed_by(&canonical).is_empty() {
        if Instant::now() > deadline {
            let _ = std::fs::remove_file(&image);
            return Err(format!("the loop device of {} was not let go", image.display()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ready = spares.primed_dir.join(format!("{prefix}{name}.img"));
    std::fs::rename(&image, &ready).map_err(|e| format!("cannot name {}: {e}", ready.display()))?;
    tracing::debug!(mirror = %mirror.display(), %commit, ms = clock.elapsed().as_millis() as u64, "a workspace was checked out ahead");
    Ok(())
}

/// Deletes every primed disk, finished or not (at start: none is trusted across a restart).
async fn clear_primed(dir: &Path) {
    clear_making(dir).await;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_file()) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Deletes the primed disks being made: their mount points unmounted (lazily if busy) and removed, their
/// images deleted.
async fn clear_making(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".mnt") && entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            // Only an empty mount point is removed: one still mounted keeps its files.
            if disk::unmount(&path).await.is_ok() {
                let _ = std::fs::remove_dir(&path);
            }
        } else if !name.ends_with(".img") && entry.file_type().is_ok_and(|kind| kind.is_file()) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_repositories_are_wanted_each_once() {
        let spares = SpareDisks::new(Path::new("/srv/work"), 1 << 30, "git".into(), (1, 1), 2);
        for mirror in ["/m/a.git", "/m/b.git", "/m/a.git", "/m/c.git"] {
            spares.want_primed(Path::new(mirror));
        }
        let wanted = spares.wanted.lock().expect("lock").clone();
        assert_eq!(wanted, [PathBuf::from("/m/a.git"), PathBuf::from("/m/c.git")]);
        let none = SpareDisks::new(Path::new("/srv/work"), 1 << 30, "git".into(), (1, 1), 0);
        none.want_primed(Path::new("/m/a.git"));
        assert!(none.wanted.lock().expect("lock").is_empty());
    }

    #[test]
    fn a_primed_disk_is_named_by_its_mirror() {
        let prefix = primed_prefix(Path::new("/w/mirrors/0a1b2c.git"));
        assert_eq!(prefix, "0a1b2c_");
        assert!(disk_name().starts_with("disk_"));
    }
}
