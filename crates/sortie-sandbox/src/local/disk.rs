//! A session's own disk (S10 of the security review): its `/workspace` and `$HOME` live on a filesystem of
//! their own, a sparse ext4 image (`<session dir>/disk.img`, as long as the quota) loop-mounted under the
//! session's directory, so an agent that fills its disk gets `ENOSPC` and the host filesystem (the database,
//! the mirrors, the other sessions) loses at most the quota. The host's filesystem has no project quotas,
//! which is why the limit is a filesystem rather than an accounting rule.
//!
//! Lifecycle, driven by the worker: [`SessionDisk::ensure`] before the workspace is prepared (it makes the
//! image the first time, mounts it again after a hibernation or a reboot, and does nothing when it is
//! mounted: a mount is kernel state, so it outlives the `sortie serve` that made it and the next one finds it
//! in `/proc/self/mountinfo`); [`unmount`] once the sandbox is destroyed at hibernation (the image stays);
//! [`remove`] when the session's data is deleted. [`SessionDisk::usage`] is one `statvfs`: it tells a turn
//! that failed because the disk is full. Without root there are no loop mounts: the session's directory is
//! then a plain directory and [`Quota::Unenforced`] says why.
//!
//! It must never attach one image to two loop devices (two ext4 instances over one file corrupt it: a
//! mount reuses the loop device that already holds the image, e.g. for a sandbox that still has the disk
//! bound after the host unmounted it), never run `e2fsck` on an image a loop device holds, never mount
//! over files (they would vanish from view), never mount with `noexec` (agents run what they build in
//! `/workspace`), and never unmount or delete anything but the mount point and image it is given.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// The default size of a session's disk. The image is sparse, so a session costs the host only what it
/// writes; 10 GiB holds a large checkout with its dependencies and a build (this repository's debug
/// `target/` is 3 GiB, a `node_modules` often 1 GiB) while one runaway agent cannot take more.
pub const DEFAULT_DISK_BYTES: u64 = 10 << 30;
/// The smallest disk: ext4's journal and tables need a few MiB of their own.
pub const MIN_DISK_BYTES: u64 = 16 << 20;
/// Options of every mount: no set-uid programs or device nodes from an agent's files; `discard` gives the
/// space of deleted files back to the host (the image is punched); `noatime` saves a write per read. Not
/// `noexec`: agents run the programs they build in `/workspace`.
pub const MOUNT_OPTIONS: &str = "loop,nosuid,nodev,noatime,discard";

const MKFS_DEADLINE: Duration = Duration::from_secs(120);
const MOUNT_DEADLINE: Duration = Duration::from_secs(60);
/// A damaged filesystem of many files can take a while to repair; a clean one takes milliseconds.
const E2FSCK_DEADLINE: Duration = Duration::from_secs(600);
/// How many stacked mounts of one mount point [`unmount`] takes off before giving up.
const MAX_STACKED_MOUNTS: usize = 16;

/// The programs a session disk needs (Debian: `e2fsprogs` and `mount`).
#[derive(Clone, Debug)]
pub struct DiskTools {
    pub mkfs_ext4: PathBuf,
    pub e2fsck: PathBuf,
    pub mount: PathBuf,
}

impl Default for DiskTools {
    fn default() -> Self {
        Self {
            mkfs_ext4: PathBuf::from("/usr/sbin/mkfs.ext4"),
            e2fsck: PathBuf::from("/usr/sbin/e2fsck"),
            mount: PathBuf::from("/usr/bin/mount"),
        }
    }
}

/// Whether a session's writes are limited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Quota {
    /// The session's directory is a filesystem of this many bytes (ext4 keeps a little of it for itself).
    Enforced { size_bytes: u64 },
    /// The session's directory is a plain directory on the host's filesystem; the reason is a sentence for
    /// the log.
    Unenforced { reason: String },
}

/// What [`SessionDisk::ensure`] had to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensured {
    /// A new image was made and mounted.
    Created,
    /// The existing image was checked and mounted again, its files as they were.
    Remounted,
    /// It was mounted already: nothing was done.
    AlreadyMounted,
    /// No quota (see [`Quota::Unenforced`]): the directory exists.
    PlainDirectory,
}

/// What [`unmount`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmounted {
    /// Nothing was mounted there.
    NotMounted,
    Unmounted,
    /// A process still used the disk: it was detached from its mount point and the kernel releases it (and
    /// its loop device) when the last user lets go. Mounting the image again meanwhile reuses that loop device.
    Detached,
}

/// Why a session's disk could not be made, mounted or removed. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{tool} not found: apt-get install {package}")]
    ToolMissing { tool: PathBuf, package: &'static str },
    #[error("a session disk of {size_bytes} bytes is too small: at least {MIN_DISK_BYTES} bytes (16 MiB)")]
    TooSmall { size_bytes: u64 },
    #[error("{0} must be an absolute path")]
    NotAbsolute(PathBuf),
    #[error("{0} is not a regular file, so it is not a session disk image; move it away")]
    NotAnImage(PathBuf),
    #[error(
        "the session's disk image {image} is not mounted and only root can mount it: run sortie as root (the session's files are in that image)"
    )]
    NeedsRoot { image: PathBuf },
    #[error(
        "{mount_point} has {what} mounted on it, not the session's disk {image}: unmount it (umount {mount_point})"
    )]
    ForeignMount {
        mount_point: PathBuf,
        image: PathBuf,
        what: String,
    },
    #[error(
        "{mount_point} holds files while the session's disk {image} is not mounted, and mounting would hide them: move them into the disk (mount it by hand) or delete them"
    )]
    MountPointNotEmpty { mount_point: PathBuf, image: PathBuf },
    #[error("e2fsck could not repair the session's disk {image}: {detail}; repair it by hand with e2fsck -f {image}")]
    Damaged { image: PathBuf, detail: String },
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    #[error("the session's disk is not mounted at {0} any more: ensure it again")]
    NotMounted(PathBuf),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DiskError {
    let what = what.into();
    move |source| DiskError::Io { what, source }
}

/// A session's disk, mounted (or, without a quota, a plain directory).
#[derive(Clone, Debug)]
pub struct SessionDisk {
    image: PathBuf,
    mount_point: PathBuf,
    quota: Quota,
    ensured: Ensured,
    /// `st_dev` of the mounted filesystem: `usage` reads the host's numbers if this is gone.
    device_id: Option<u64>,
}

impl SessionDisk {
    /// Makes sure the session's disk `image` is mounted at `mount_point`, making a new image of
    /// `size_bytes` (rounded up to 4 KiB) if there is none. An existing image keeps its size. Idempotent;
    /// the caller must not run two for one session at once (the worker holds its session).
    pub async fn ensure(image: &Path, mount_point: &Path, size_bytes: u64) -> Result<Self, DiskError> {
        Self::ensure_with(&DiskTools::default(), image, mount_point, size_bytes).await
    }

    /// [`SessionDisk::ensure`], taking a spare image from `spares` ([`make_spare`]) instead of making
    /// one when there is none yet: a spare of another size, or one another caller took first, is passed
    /// over.
    pub async fn ensure_from_spares(
        image: &Path,
        mount_point: &Path,
        size_bytes: u64,
        spares: &Path,
    ) -> Result<Self, DiskError> {
        if takes_a_spare(image, mount_point) {
            take_spare(spares, image, size_bytes.div_ceil(4096) * 4096);
        }
        Self::ensure(image, mount_point, size_bytes).await
    }

    pub async fn ensure_with(
        tools: &DiskTools,
        image: &Path,
        mount_point: &Path,
        size_bytes: u64,
    ) -> Result<Self, DiskError> {
        for path in [image, mount_point] {
            if !path.is_absolute() {
                return Err(DiskError::NotAbsolute(path.to_owned()));
            }
        }
        if size_bytes < MIN_DISK_BYTES {
            return Err(DiskError::TooSmall { size_bytes });
        }
        let size_bytes = size_bytes.div_ceil(4096) * 4096;
        std::fs::create_dir_all(mount_point).map_err(io_error(format!("cannot create {}", mount_point.display())))?;
        let mount_point = std::fs::canonicalize(mount_point)
            .map_err(io_error(format!("cannot resolve {}", mount_point.display())))?;
        let image = canonical_image(image)?;
        let image_exists = match std::fs::symlink_metadata(&image) {
            Ok(meta) if meta.file_type().is_file() => true,
            Ok(_) => return Err(DiskError::NotAnImage(image)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => false,
            Err(error) => return Err(io_error(format!("cannot read {}", image.display()))(error)),
        };
        let facts = Facts {
            mount: mount_state(&image, &mount_point)?,
            image_exists,
            mount_point_empty: is_empty_dir(&mount_point)?,
            as_root: nix::unistd::geteuid().is_root(),
        };
        let ensured = match plan(&facts) {
            Plan::UseMounted => Ensured::AlreadyMounted,
            Plan::Plain { reason } => {
                return Ok(Self {
                    image,
                    mount_point,
                    quota: Quota::Unenforced { reason },
                    ensured: Ensured::PlainDirectory,
                    device_id: None,
                });
            }
            Plan::Refuse(refusal) => return Err(refusal.into_error(&image, &mount_point)),
            Plan::Create => {
                create_image(tools, &image, size_bytes).await?;
                mount_image(tools, &image, &mount_point).await?;
                Ensured::Created
            }
            Plan::Remount => {
                // A loop device still holding the image means a live filesystem (a sandbox may still have it
                // bound, or a lazy unmount is pending): checking it would write under the kernel's feet, and
                // the mount below joins that same filesystem.
                if loop_devices_backed_by(&image).is_empty() {
                    check_image(tools, &image).await?;
                }
                mount_image(tools, &image, &mount_point).await?;
                Ensured::Remounted
            }
        };
        match mount_state(&image, &mount_point)? {
            MountState::Ours => {}
            MountState::NotMounted => {
                return Err(DiskError::Command {
                    what: format!("mounting {}", image.display()),
                    detail: format!("mount reported success but {} is not mounted", mount_point.display()),
                });
            }
            MountState::Foreign { what } => {
                return Err(DiskError::ForeignMount {
                    mount_point,
                    image,
                    what,
                });
            }
        }
        let size_bytes = std::fs::metadata(&image)
            .map_err(io_error(format!("cannot read {}", image.display())))?
            .len();
        let device_id = std::fs::metadata(&mount_point)
            .map_err(io_error(format!("cannot read {}", mount_point.display())))?
            .dev();
        Ok(Self {
            image,
            mount_point,
            quota: Quota::Enforced { size_bytes },
            ensured,
            device_id: Some(device_id),
        })
    }

    /// Where the disk is mounted (canonical): the session's workspace and home are directories in it.
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    pub fn image(&self) -> &Path {
        &self.image
    }

    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    pub fn ensured(&self) -> Ensured {
        self.ensured
    }

    /// The disk's space now (one `stat` and one `statvfs`; cheap enough for every turn). Without a quota,
    /// the numbers of the host filesystem that holds the directory.
    pub fn usage(&self) -> Result<DiskUsage, DiskError> {
        if let Some(device_id) = self.device_id {
            let now = std::fs::metadata(&self.mount_point)
                .map_err(io_error(format!("cannot read {}", self.mount_point.display())))?
                .dev();
            if now != device_id {
                return Err(DiskError::NotMounted(self.mount_point.clone()));
            }
        }
        filesystem_usage(&self.mount_point)
    }
}

/// The space of the filesystem that holds `path` (one `statvfs`): for the host's own filesystem too, e.g.
/// to see whether it can still hold the disks it has promised.
pub fn filesystem_usage(path: &Path) -> Result<DiskUsage, DiskError> {
    let stats = nix::sys::statvfs::statvfs(path).map_err(|errno| DiskError::Io {
        what: format!("cannot statvfs {}", path.display()),
        source: errno.into(),
    })?;
    let block = stats.fragment_size();
    Ok(DiskUsage {
        total_bytes: stats.blocks().saturating_mul(block),
        free_bytes: stats.blocks_free().saturating_mul(block),
        available_bytes: stats.blocks_available().saturating_mul(block),
        total_inodes: stats.files(),
        free_inodes: stats.files_free(),
    })
}

/// The space of a session's disk, from `statvfs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskUsage {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// What the agent can still write (with `-m 0` there is no root reserve: the same as `free_bytes`).
    pub available_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
}

/// Below this much space (or 1 % of the disk, whichever is more) a disk counts as full: the write that
/// failed was most likely bigger than what is left.
const FULL_MARGIN_BYTES: u64 = 4 << 20;
/// Below this many free inodes (or 1 % of them) a disk counts as full.
const FULL_MARGIN_INODES: u64 = 64;

impl DiskUsage {
    pub fn used_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.free_bytes)
    }

    /// Whether the disk is full or nearly: then an agent's failure is most likely `ENOSPC` from the
    /// quota (out of space or out of inodes), and the turn should fail saying so.
    pub fn is_full(&self) -> bool {
        let space_left = FULL_MARGIN_BYTES.max(self.total_bytes / 100);
        let inodes_left = FULL_MARGIN_INODES.max(self.total_inodes / 100);
        self.available_bytes < space_left || (self.total_inodes > 0 && self.free_inodes < inodes_left)
    }

    /// A sentence for a failure reason: how full the disk is and what to do.
    pub fn describe(&self) -> String {
        let inodes = if self.total_inodes > 0 && self.free_inodes < FULL_MARGIN_INODES.max(self.total_inodes / 100) {
            format!(", {} of {} files left", self.free_inodes, self.total_inodes)
        } else {
            String::new()
        };
        format!(
            "the session's disk is full: {} of {} used, {} left{inodes}; delete files in /workspace or /home/agent, or raise the session disk limit",
            human_bytes(self.used_bytes()),
            human_bytes(self.total_bytes),
            human_bytes(self.available_bytes),
        )
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for next in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    format!("{value:.1} {unit}")
}

/// Unmounts whatever is mounted at `mount_point` (a stack of mounts too). A disk still in use on the host
/// is detached lazily ([`Unmounted::Detached`]) rather than refused: the caller is done with it, and a
/// later [`SessionDisk::ensure`] joins the same filesystem instead of attaching the image twice.
pub async fn unmount(mount_point: &Path) -> Result<Unmounted, DiskError> {
    let mount_point = match std::fs::canonicalize(mount_point) {
        Ok(path) => path,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Unmounted::NotMounted),
        Err(error) => return Err(io_error(format!("cannot resolve {}", mount_point.display()))(error)),
    };
    tokio::task::spawn_blocking(move || unmount_blocking(&mount_point))
        .await
        .map_err(|join| DiskError::Command {
            what: "unmounting".into(),
            detail: join.to_string(),
        })?
}

fn unmount_blocking(mount_point: &Path) -> Result<Unmounted, DiskError> {
    use nix::mount::{MntFlags, umount2};
    let mut outcome = Unmounted::NotMounted;
    for _ in 0..MAX_STACKED_MOUNTS {
        if !is_mount_point(mount_point)? {
            return Ok(outcome);
        }
        match umount2(mount_point, MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) => {
                if outcome == Unmounted::NotMounted {
                    outcome = Unmounted::Unmounted;
                }
            }
            Err(nix::errno::Errno::EBUSY) => {
                umount2(mount_point, MntFlags::UMOUNT_NOFOLLOW | MntFlags::MNT_DETACH).map_err(|errno| {
                    DiskError::Io {
                        what: format!("cannot detach {}", mount_point.display()),
                        source: errno.into(),
                    }
                })?;
                outcome = Unmounted::Detached;
            }
            // Gone between the check and the call.
            Err(nix::errno::Errno::EINVAL) => {}
            Err(errno) => {
                return Err(DiskError::Io {
                    what: format!("cannot unmount {}", mount_point.display()),
                    source: errno.into(),
                });
            }
        }
    }
    Err(DiskError::Command {
        what: format!("unmounting {}", mount_point.display()),
        detail: format!("still mounted after {MAX_STACKED_MOUNTS} unmounts"),
    })
}

/// Deletes a session's disk: unmounts it (lazily if busy), deletes the image, then the mount point and
/// whatever is in it (without a quota, that is the session's files). Missing parts are not an error.
pub async fn remove(image: &Path, mount_point: &Path) -> Result<(), DiskError> {
    unmount(mount_point).await?;
    if let Ok(resolved) = std::fs::canonicalize(mount_point)
        && is_mount_point(&resolved)?
    {
        return Err(DiskError::Command {
            what: format!("removing {}", mount_point.display()),
            detail: "it is still mounted".into(),
        });
    }
    for file in [image.to_owned(), partial_image(image)] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(io_error(format!("cannot delete {}", file.display()))(error)),
        }
    }
    match std::fs::remove_dir_all(mount_point) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_error(format!("cannot delete {}", mount_point.display()))(error)),
    }
}

/// Whether `image` is the disk mounted (topmost) at `mount_point`.
pub fn is_mounted(image: &Path, mount_point: &Path) -> Result<bool, DiskError> {
    let Ok(mount_point) = std::fs::canonicalize(mount_point) else {
        return Ok(false);
    };
    Ok(mount_state(&canonical_image(image)?, &mount_point)? == MountState::Ours)
}

/// The loop devices (e.g. `/dev/loop3`) whose backing file is `image` (compared as given: pass a
/// canonical path). Normally none or one.
pub fn loop_devices_backed_by(image: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut devices: Vec<PathBuf> = entries
        .flatten()
        .filter(|entry| entry.file_name().as_bytes().starts_with(b"loop"))
        .filter(|entry| {
            std::fs::read(entry.path().join("loop/backing_file")).is_ok_and(|content| backing_file_is(&content, image))
        })
        .map(|entry| Path::new("/dev").join(entry.file_name()))
        .collect();
    devices.sort();
    devices
}

/// sysfs's `loop/backing_file`: the path and a newline (and " (deleted)" once the file is unlinked, which is
/// then not `image` any more).
fn backing_file_is(content: &[u8], image: &Path) -> bool {
    content.strip_suffix(b"\n").unwrap_or(content) == image.as_os_str().as_bytes()
}

fn canonical_image(image: &Path) -> Result<PathBuf, DiskError> {
    let (Some(parent), Some(name)) = (image.parent(), image.file_name()) else {
        return Err(DiskError::NotAnImage(image.to_owned()));
    };
    let parent = std::fs::canonicalize(parent).map_err(io_error(format!("cannot resolve {}", parent.display())))?;
    Ok(parent.join(name))
}

fn partial_image(image: &Path) -> PathBuf {
    let mut name = image.file_name().map(OsStr::to_owned).unwrap_or_default();
    name.push(".partial");
    image.with_file_name(name)
}

fn is_empty_dir(dir: &Path) -> Result<bool, DiskError> {
    let mut entries = std::fs::read_dir(dir).map_err(io_error(format!("cannot read {}", dir.display())))?;
    Ok(entries.next().is_none())
}

/// Whether a session disk at `image`, mounted at `mount_point`, would be a spare taken now: it has no image
/// yet, and its mount point is empty (one with something in it is refused, spare or not: none is spent
/// on it).
pub fn takes_a_spare(image: &Path, mount_point: &Path) -> bool {
    let mount_point_empty = !mount_point.exists() || is_empty_dir(mount_point).unwrap_or(false);
    !image.exists() && mount_point_empty
}

/// Makes a spare image of `size_bytes` (rounded up to 4 KiB) at `image`, formatted and never mounted,
/// for [`SessionDisk::ensure_from_spares`]: a session's first disk then costs a rename and a mount.
pub async fn make_spare(image: &Path, size_bytes: u64) -> Result<(), DiskError> {
    if size_bytes < MIN_DISK_BYTES {
        return Err(DiskError::TooSmall { size_bytes });
    }
    create_image(&DiskTools::default(), image, size_bytes.div_ceil(4096) * 4096).await
}

/// Whether `path` is a spare image [`make_spare`] finished (a partial one is not) of `size_bytes`
/// (rounded up to 4 KiB, as made).
pub fn is_spare(path: &Path, size_bytes: u64) -> bool {
    path.extension().is_some_and(|ext| ext == "img")
        && std::fs::symlink_metadata(path)
            .is_ok_and(|meta| meta.file_type().is_file() && meta.len() == size_bytes.div_ceil(4096) * 4096)
}

/// Moves a whole spare of `size_bytes` from `spares` to `image`; `false` when there was none. The rename
/// is the claim: of two callers, one gets a spare and the other `ENOENT`.
fn take_spare(spares: &Path, image: &Path, size_bytes: u64) -> bool {
    take_spare_named(spares, image, size_bytes, "")
}

/// [`take_spare`] of a spare whose file name starts with `prefix` only (e.g. one made ahead for a
/// particular repository). `size_bytes` is rounded up to 4 KiB, as made.
pub fn take_spare_named(spares: &Path, image: &Path, size_bytes: u64, prefix: &str) -> bool {
    let size_bytes = size_bytes.div_ceil(4096) * 4096;
    let Ok(entries) = std::fs::read_dir(spares) else {
        return false;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        // Never over an image that appeared meanwhile: that one is the session's.
        let taken = entry.file_name().to_string_lossy().starts_with(prefix)
            && is_spare(&path, size_bytes)
            && nix::fcntl::renameat2(
                nix::fcntl::AT_FDCWD,
                &path,
                nix::fcntl::AT_FDCWD,
                image,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            )
            .is_ok();
        if taken {
            return true;
        }
    }
    false
}

async fn create_image(tools: &DiskTools, image: &Path, size_bytes: u64) -> Result<(), DiskError> {
    // Made under another name and renamed when whole, so a crash mid-way never leaves a half-made image
    // that the next ensure would mount; a stale partial one is from such a crash.
    let partial = partial_image(image);
    let _ = std::fs::remove_file(&partial);
    let file = std::fs::File::create_new(&partial).map_err(io_error(format!("cannot create {}", partial.display())))?;
    file.set_len(size_bytes)
        .map_err(io_error(format!("cannot size {}", partial.display())))?;
    drop(file);
    let mut args: Vec<OsString> = mkfs_arguments().into_iter().map(OsString::from).collect();
    args.push(partial.clone().into_os_string());
    let made = run(&tools.mkfs_ext4, "e2fsprogs", &args, MKFS_DEADLINE)
        .await
        .and_then(|ran| ran.success(format!("mkfs.ext4 {}", partial.display())));
    if let Err(error) = made {
        // Never mounted: a half-made image is worth nothing.
        let _ = std::fs::remove_file(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, image).map_err(io_error(format!("cannot rename {} into place", partial.display())))
}

/// `mkfs.ext4`'s flags: quiet, no questions, no root reserve (the agent may use all of its quota), and the
/// inode tables and journal left unwritten so the image stays sparse (mke2fs punches the whole file first,
/// so the tables read as zeroes and the kernel has nothing to initialise later).
fn mkfs_arguments() -> Vec<&'static str> {
    vec![
        "-q",
        "-F",
        "-m",
        "0",
        "-E",
        "lazy_itable_init=1,lazy_journal_init=1",
        "-L",
        "sortie-session",
    ]
}

/// `e2fsck -p` (repairs what is safe without questions): milliseconds on a clean filesystem, a journal
/// replay or repair after a crash.
async fn check_image(tools: &DiskTools, image: &Path) -> Result<(), DiskError> {
    let args = [OsString::from("-p"), image.as_os_str().to_owned()];
    let ran = run(&tools.e2fsck, "e2fsprogs", &args, E2FSCK_DEADLINE).await?;
    match ran.code {
        Some(0) => Ok(()),
        // 1: errors corrected; 2: corrected, "reboot" (which is meant for a root filesystem).
        Some(1 | 2) => {
            tracing::warn!(image = %image.display(), said = %ran.said, "e2fsck repaired a session disk");
            Ok(())
        }
        _ => Err(DiskError::Damaged {
            image: image.to_owned(),
            detail: ran.describe(),
        }),
    }
}

async fn mount_image(tools: &DiskTools, image: &Path, mount_point: &Path) -> Result<(), DiskError> {
    // `-o loop` attaches a free loop device (made on demand through /dev/loop-control) with autoclear, so
    // unmounting frees it; if one already holds this image, mount uses that one instead of a second.
    let args = [
        OsString::from("-t"),
        OsString::from("ext4"),
        OsString::from("-o"),
        OsString::from(MOUNT_OPTIONS),
        image.as_os_str().to_owned(),
        mount_point.as_os_str().to_owned(),
    ];
    let ran = run(&tools.mount, "mount", &args, MOUNT_DEADLINE).await?;
    let what = format!("mounting {} at {}", image.display(), mount_point.display());
    if ran.code != Some(0) && ran.said.contains("loop device") {
        return Err(DiskError::Command {
            what,
            detail: format!(
                "{} (is the loop module loaded and /dev/loop-control there? modprobe loop)",
                ran.describe()
            ),
        });
    }
    ran.success(what)
}

/// How a tool ended.
struct Ran {
    /// `None`: killed by a signal.
    code: Option<i32>,
    /// The tail of its stderr and stdout.
    said: String,
}

impl Ran {
    fn describe(&self) -> String {
        match self.code {
            Some(code) => format!("exit status {code}: {}", self.said),
            None => format!("killed by a signal: {}", self.said),
        }
    }

    fn success(self, what: String) -> Result<(), DiskError> {
        if self.code == Some(0) {
            return Ok(());
        }
        Err(DiskError::Command {
            what,
            detail: self.describe(),
        })
    }
}

/// Runs a tool to completion within `deadline`.
async fn run(program: &Path, package: &'static str, args: &[OsString], deadline: Duration) -> Result<Ran, DiskError> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = match super::priority::spawn(command).await {
        Ok(child) => child,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(DiskError::ToolMissing {
                tool: program.to_owned(),
                package,
            });
        }
        Err(error) => return Err(io_error(format!("cannot run {}", program.display()))(error)),
    };
    let output = tokio::time::timeout(deadline, child.wait_with_output())
        .await
        .map_err(|_| DiskError::Command {
            what: format!("{} {:?}", program.display(), args),
            detail: format!("took longer than {} s", deadline.as_secs()),
        })?
        .map_err(io_error(format!("cannot run {}", program.display())))?;
    let mut said = String::from_utf8_lossy(&output.stderr).into_owned();
    said.push_str(&String::from_utf8_lossy(&output.stdout));
    let said = said.trim();
    let tail = said.char_indices().rev().nth(1999).map_or(said, |(at, _)| &said[at..]);
    Ok(Ran {
        code: output.status.code(),
        said: tail.to_owned(),
    })
}

/// What is mounted at a session's mount point.
#[derive(Clone, Debug, PartialEq, Eq)]
enum MountState {
    NotMounted,
    /// The session's image, through a loop device.
    Ours,
    Foreign {
        what: String,
    },
}

fn read_mountinfo() -> Result<Vec<MountEntry>, DiskError> {
    let text = std::fs::read("/proc/self/mountinfo").map_err(io_error("cannot read /proc/self/mountinfo"))?;
    Ok(parse_mountinfo(&text))
}

fn is_mount_point(path: &Path) -> Result<bool, DiskError> {
    Ok(read_mountinfo()?.iter().any(|entry| entry.mount_point == path))
}

/// The topmost mount at `mount_point`, and whether its device is a loop device backed by `image` (both
/// canonical).
fn mount_state(image: &Path, mount_point: &Path) -> Result<MountState, DiskError> {
    let entries = read_mountinfo()?;
    let Some(top) = entries.iter().rev().find(|entry| entry.mount_point == mount_point) else {
        return Ok(MountState::NotMounted);
    };
    let (major, minor) = top.device;
    let backing = std::fs::read(format!("/sys/dev/block/{major}:{minor}/loop/backing_file"));
    Ok(match backing {
        Ok(content) if backing_file_is(&content, image) => MountState::Ours,
        Ok(content) => MountState::Foreign {
            what: format!(
                "a loop device over {}",
                String::from_utf8_lossy(content.strip_suffix(b"\n").unwrap_or(&content))
            ),
        },
        Err(_) => MountState::Foreign {
            what: format!("{} from {}", top.fs_type, top.source),
        },
    })
}

/// The facts [`plan`] decides on.
#[derive(Clone, Debug)]
struct Facts {
    mount: MountState,
    image_exists: bool,
    mount_point_empty: bool,
    as_root: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Plan {
    UseMounted,
    Create,
    Remount,
    Plain { reason: String },
    Refuse(Refusal),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Refusal {
    Foreign(String),
    NeedsRoot,
    NotEmpty,
}

impl Refusal {
    fn into_error(self, image: &Path, mount_point: &Path) -> DiskError {
        match self {
            Self::Foreign(what) => DiskError::ForeignMount {
                mount_point: mount_point.to_owned(),
                image: image.to_owned(),
                what,
            },
            Self::NeedsRoot => DiskError::NeedsRoot {
                image: image.to_owned(),
            },
            Self::NotEmpty => DiskError::MountPointNotEmpty {
                mount_point: mount_point.to_owned(),
                image: image.to_owned(),
            },
        }
    }
}

/// What [`SessionDisk::ensure`] does, given what it found.
fn plan(facts: &Facts) -> Plan {
    match &facts.mount {
        MountState::Ours => return Plan::UseMounted,
        MountState::Foreign { what } => return Plan::Refuse(Refusal::Foreign(what.clone())),
        MountState::NotMounted => {}
    }
    match (facts.image_exists, facts.mount_point_empty, facts.as_root) {
        (false, false, _) => Plan::Plain {
            reason: "the session's files predate its disk quota (they are in a plain directory, not an image), so its disk is not limited".into(),
        },
        (true, _, false) => Plan::Refuse(Refusal::NeedsRoot),
        (false, true, false) => Plan::Plain {
            reason: "sortie does not run as root and only root can mount a session's disk, so the session's disk is not limited".into(),
        },
        (true, false, true) => Plan::Refuse(Refusal::NotEmpty),
        (true, true, true) => Plan::Remount,
        (false, true, true) => Plan::Create,
    }
}

/// One line of `/proc/self/mountinfo`: the parts this module needs.
#[derive(Clone, Debug, PartialEq, Eq)]
struct MountEntry {
    /// `major:minor` of the mounted device.
    device: (u32, u32),
    mount_point: PathBuf,
    fs_type: String,
    source: String,
}

/// Parses `/proc/self/mountinfo` (proc(5)): `id parent major:minor root mount-point options [optional…] -
/// fstype source super-options`, paths with space, tab, newline and backslash written as `\ooo`. Lines
/// that do not parse are skipped.
fn parse_mountinfo(text: &[u8]) -> Vec<MountEntry> {
    text.split(|&b| b == b'\n').filter_map(parse_mountinfo_line).collect()
}

fn parse_mountinfo_line(line: &[u8]) -> Option<MountEntry> {
    let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    let separator = fields.iter().skip(6).position(|field| *field == b"-")? + 6;
    let (major, minor) = std::str::from_utf8(fields.get(2)?).ok()?.split_once(':')?;
    let device = (major.parse().ok()?, minor.parse().ok()?);
    let mount_point = PathBuf::from(OsString::from_vec(unescape(fields.get(4)?)));
    let fs_type = String::from_utf8_lossy(&unescape(fields.get(separator + 1)?)).into_owned();
    let source = String::from_utf8_lossy(&unescape(fields.get(separator + 2)?)).into_owned();
    Some(MountEntry {
        device,
        mount_point,
        fs_type,
        source,
    })
}

/// Undoes the kernel's `\ooo` octal escapes.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|digits| digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match (field[i], octal) {
            (b'\\', Some(digits)) => {
                let value = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_are_parsed_with_their_escapes() {
        let text = b"22 27 0:21 / /proc rw,relatime - proc proc rw\n\
45 27 7:0 / /tmp/a\\040b/disk rw,nosuid,nodev,noatime shared:5 master:1 - ext4 /dev/loop0 rw,discard\n\
46 27 7:1 /ws /tmp/tab\\011and\\134slash rw - ext4 /dev/loop1 rw\n\
garbage line\n\
47 27 x:y / /bad rw - ext4 /dev/loop2 rw\n";
        let entries = parse_mountinfo(text);
        assert_eq!(entries.len(), 3, "{entries:?}");
        assert_eq!(
            entries[1],
            MountEntry {
                device: (7, 0),
                mount_point: PathBuf::from("/tmp/a b/disk"),
                fs_type: "ext4".into(),
                source: "/dev/loop0".into(),
            }
        );
        assert_eq!(entries[2].mount_point, PathBuf::from("/tmp/tab\tand\\slash"));
        assert_eq!(entries[0].device, (0, 21));
    }

    #[test]
    fn unescape_leaves_what_is_not_an_escape() {
        for (input, expected) in [
            (&b"plain"[..], &b"plain"[..]),
            (b"a\\040b", b"a b"),
            (b"new\\012line", b"new\nline"),
            (b"trailing\\", b"trailing\\"),
            (b"short\\04", b"short\\04"),
            (b"not\\089octal", b"not\\089octal"),
        ] {
            assert_eq!(unescape(input), expected, "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn the_backing_file_matches_only_the_same_path() {
        let image = Path::new("/srv/sessions/ses 1/disk.img");
        assert!(backing_file_is(b"/srv/sessions/ses 1/disk.img\n", image));
        assert!(backing_file_is(b"/srv/sessions/ses 1/disk.img", image));
        assert!(!backing_file_is(b"/srv/sessions/ses 1/disk.img (deleted)\n", image));
        assert!(!backing_file_is(b"/srv/sessions/ses 10/disk.img\n", image));
    }

    #[test]
    fn the_plan_follows_what_was_found() {
        let facts = |mount: MountState, image_exists, mount_point_empty, as_root| Facts {
            mount,
            image_exists,
            mount_point_empty,
            as_root,
        };
        let foreign = MountState::Foreign { what: "tmpfs".into() };
        let table = [
            (facts(MountState::Ours, true, false, true), "mounted"),
            (facts(MountState::Ours, true, false, false), "mounted"),
            (facts(foreign.clone(), true, false, true), "foreign"),
            (facts(foreign, false, true, false), "foreign"),
            (facts(MountState::NotMounted, false, true, true), "create"),
            (facts(MountState::NotMounted, true, true, true), "remount"),
            (facts(MountState::NotMounted, true, false, true), "not empty"),
            (facts(MountState::NotMounted, true, true, false), "needs root"),
            (facts(MountState::NotMounted, false, true, false), "plain"),
            (facts(MountState::NotMounted, false, false, true), "plain"),
            (facts(MountState::NotMounted, false, false, false), "plain"),
        ];
        for (facts, expected) in table {
            let got = match plan(&facts) {
                Plan::UseMounted => "mounted",
                Plan::Create => "create",
                Plan::Remount => "remount",
                Plan::Plain { .. } => "plain",
                Plan::Refuse(Refusal::Foreign(_)) => "foreign",
                Plan::Refuse(Refusal::NeedsRoot) => "needs root",
                Plan::Refuse(Refusal::NotEmpty) => "not empty",
            };
            assert_eq!(got, expected, "{facts:?}");
        }
    }

    #[test]
    fn a_disk_is_full_near_its_end_in_space_or_files() {
        let usage = |total_bytes: u64, available_bytes: u64, total_inodes: u64, free_inodes: u64| DiskUsage {
            total_bytes,
            free_bytes: available_bytes,
            available_bytes,
            total_inodes,
            free_inodes,
        };
        for (case, full) in [
            (usage(10 << 30, 5 << 30, 655_360, 600_000), false),
            (usage(10 << 30, 0, 655_360, 600_000), true),
            (usage(10 << 30, 50 << 20, 655_360, 600_000), true),
            (usage(10 << 30, 200 << 20, 655_360, 600_000), false),
            (usage(10 << 30, 5 << 30, 655_360, 10), true),
            (usage(64 << 20, 3 << 20, 16_384, 16_000), true),
            (usage(64 << 20, 8 << 20, 16_384, 16_000), false),
            (usage(64 << 20, 8 << 20, 0, 0), false),
        ] {
            assert_eq!(case.is_full(), full, "{case:?}");
        }
        let full = usage(64 << 20, 0, 16_384, 16_000);
        assert_eq!(
            full.describe(),
            "the session's disk is full: 64.0 MiB of 64.0 MiB used, 0 B left; delete files in /workspace or /home/agent, or raise the session disk limit"
        );
        assert!(
            usage(10 << 30, 5 << 30, 655_360, 3)
                .describe()
                .contains("3 of 655360 files left")
        );
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        for (bytes, text) in [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (10 << 30, "10.0 GiB")] {
            assert_eq!(human_bytes(bytes), text);
        }
    }

    #[test]
    fn the_partial_image_sits_beside_the_image() {
        assert_eq!(
            partial_image(Path::new("/s/ses 1/disk.img")),
            PathBuf::from("/s/ses 1/disk.img.partial")
        );
    }
}
