//! A warm sandbox's slot: the directories a sandbox is started on before it has a session, and the
//! late binds that give it one (DESIGN §10, the warm pool).
//!
//! `binds/` is a mount of its own, shared, so the sandbox's copy of it (bwrap binds its `workspace`,
//! `home` and `mirrors`) is a slave: a mount the host makes under it once the sandbox runs appears
//! inside, and nothing the sandbox does comes back. Each bind is made on a private stage first, with
//! its flags (`nosuid`, `nodev`, read-only for a mirror), because a propagated copy takes the flags
//! its source had when it was made: a remount afterwards would change only the host's.
//!
//! The slots' directory is a private mount of its own ([`make_private`]), so none of these mounts
//! propagates to the host's other mount namespaces (a systemd service's) whatever the work dir's
//! filesystem shares. The sockets and the digests file the driver needs are hard links the host makes
//! in the slot's `host/` and `egress/`, which are elsewhere for that reason: a hard link does not
//! cross a mount, and the session's names are on the work dir's.
//!
//! As root only (the local runtime's sandboxes as a dedicated uid).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// Why a slot could not be made, bound or released.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{what}: {errno}")]
    Mount { what: String, errno: Errno },
    #[error("{0} is not a directory of the slot's binds")]
    Outside(PathBuf),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SlotError {
    let what = what.into();
    move |source| SlotError::Io { what, source }
}

fn mounting(what: impl Into<String>) -> impl FnOnce(Errno) -> SlotError {
    let what = what.into();
    move |errno| SlotError::Mount { what, errno }
}

/// One warm sandbox's directories: its mounts under `root` (in the private slots' directory) and the
/// host's names for it under `names` (beside the sessions', on the same mount).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmSlot {
    root: PathBuf,
    names: PathBuf,
}

impl WarmSlot {
    pub fn new(root: PathBuf, names: PathBuf) -> Self {
        Self { root, names }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn binds(&self) -> PathBuf {
        self.root.join("binds")
    }

    fn stage(&self) -> PathBuf {
        self.root.join("stage")
    }

    /// Becomes `/workspace`; the session's workspace is bound over it.
    pub fn workspace(&self) -> PathBuf {
        self.binds().join("workspace")
    }

    /// Becomes `/home/agent`; the session's home is bound over it.
    pub fn home(&self) -> PathBuf {
        self.binds().join("home")
    }

    /// Bound where the worker's mirrors are; the session's one mirror is bound under it.
    pub fn mirrors(&self) -> PathBuf {
        self.binds().join("mirrors")
    }

    /// The host's alone (0700): the driver's listening socket.
    pub fn host(&self) -> PathBuf {
        self.names.join("host")
    }

    /// Becomes `/run/sortie-egress` (read-only): the session's `egress.sock` and secret digests are
    /// linked into it at the assignment.
    pub fn egress(&self) -> PathBuf {
        self.names.join("egress")
    }

    /// Makes the slot's directories and its shared mount. Every directory is root's: what the sandbox
    /// may write is the session's, bound over `workspace` and `home` later; until then nothing in the
    /// sandbox can write under them, nor (started in `/`, [`crate::SandboxSpec::late_binds`]) keep
    /// a way into them once they are covered.
    pub fn prepare(&self) -> Result<(), SlotError> {
        if let Some(pool) = self.root.parent() {
            make_private(pool)?;
        }
        for dir in [
            self.workspace(),
            self.home(),
            self.mirrors(),
            self.host(),
            self.egress(),
            self.stage(),
        ] {
            std::fs::create_dir_all(&dir).map_err(io(format!("cannot create {}", dir.display())))?;
        }
        for (dir, mode) in [
            (self.root.clone(), 0o755),
            (self.names.clone(), 0o755),
            (self.binds(), 0o755),
            (self.workspace(), 0o755),
            (self.home(), 0o755),
            (self.mirrors(), 0o755),
            (self.egress(), 0o755),
            (self.host(), 0o700),
            (self.stage(), 0o700),
        ] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(io(format!("cannot set the mode of {}", dir.display())))?;
        }
        let binds = self.binds();
        let what = format!("cannot make {} a shared mount", binds.display());
        mount(Some(&binds), &binds, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(mounting(what.clone()))?;
        // Out of whatever peer group the parent is in, then a group of its own.
        for flags in [MsFlags::MS_PRIVATE, MsFlags::MS_SHARED] {
            if let Err(errno) = mount(None::<&str>, &binds, None::<&str>, flags, None::<&str>) {
                let _ = umount2(&binds, MntFlags::MNT_DETACH);
                return Err(SlotError::Mount { what, errno });
            }
        }
        Ok(())
    }

    /// Binds `source` over `target`, a directory of the slot's binds (made if it is missing, under
    /// the mirrors), so the running sandbox sees it: never set-uid or devices, and read-only if asked.
    pub fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SlotError> {
        let binds = self.binds();
        let inside = target
            .strip_prefix(&binds)
            .map_err(|_| SlotError::Outside(target.to_owned()))?;
        if inside
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
            || inside.as_os_str().is_empty()
        {
            return Err(SlotError::Outside(target.to_owned()));
        }
        std::fs::create_dir_all(target).map_err(io(format!("cannot create {}", target.display())))?;
        let stage = self.stage();
        let what = format!("cannot bind {} into the warm sandbox", source.display());
        mount(Some(source), &stage, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(mounting(what.clone()))?;
        let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        let bound = mount(None::<&str>, &stage, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>)
            .and_then(|()| mount(None::<&str>, &stage, None::<&str>, flags, None::<&str>))
            .and_then(|()| mount(Some(&stage), target, None::<&str>, MsFlags::MS_BIND, None::<&str>));
        let unstaged = umount2(&stage, MntFlags::MNT_DETACH);
        bound.map_err(mounting(what))?;
        unstaged.map_err(mounting(format!("cannot take down {}", stage.display())))
    }

    /// Unmounts everything bound in the slot (its sandbox's copies go with it) and removes its
    /// directories. A directory still holding another filesystem is left as it is, with its contents:
    /// nothing of a session's workspace is ever removed here.
    pub fn release(&self) -> Result<(), SlotError> {
        for mount_point in [self.stage(), self.binds()] {
            match umount2(&mount_point, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
                Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
                Err(errno) => {
                    return Err(SlotError::Mount {
                        what: format!("cannot unmount {}", mount_point.display()),
                        errno,
                    });
                }
            }
        }
        for dir in [&self.root, &self.names] {
            let device = match std::fs::symlink_metadata(dir) {
                Ok(meta) => meta.dev(),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => return Err(io(format!("cannot read {}", dir.display()))(error)),
            };
            remove_on_device(dir, device)?;
        }
        Ok(())
    }
}

/// Makes `dir` (the directory of every slot) a private mount, a bind of itself if it is not a mount
/// yet: what the host mounts under it (a stage, a slot's binds) then propagates nowhere else on the
/// host, whichever peer group the filesystem around it is in. Idempotent.
pub fn make_private(dir: &Path) -> Result<(), SlotError> {
    std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
    let what = format!("cannot make {} a private mount", dir.display());
    let private = || mount(None::<&str>, dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>);
    match private() {
        Ok(()) => Ok(()),
        // Not a mount point yet.
        Err(Errno::EINVAL) => {
            mount(Some(dir), dir, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(mounting(what.clone()))?;
            private().map_err(mounting(what))
        }
        Err(errno) => Err(SlotError::Mount { what, errno }),
    }
}

/// Unmounts the directory of the slots once it holds none (at shutdown), so a stopped worker leaves
/// no mount behind; `false` while a slot is left (an adopted sandbox's, for the next start).
pub fn unmount_if_empty(dir: &Path) -> bool {
    let empty = std::fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_none());
    if empty {
        let _ = umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW);
    }
    empty
}

/// Removes `dir` and what it holds, descending only into directories on `device`.
fn remove_on_device(dir: &Path, device: u64) -> Result<(), SlotError> {
    let entries = std::fs::read_dir(dir).map_err(io(format!("cannot read {}", dir.display())))?;
    for entry in entries {
        let entry = entry.map_err(io(format!("cannot read {}", dir.display())))?;
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(io(format!("cannot read {}", path.display())))?;
        if meta.dev() != device {
            return Err(SlotError::Mount {
                what: format!("{} is still a mount point", path.display()),
                errno: Errno::EBUSY,
            });
        }
        if meta.is_dir() {
            remove_on_device(&path, device)?;
        } else {
            std::fs::remove_file(&path).map_err(io(format!("cannot remove {}", path.display())))?;
        }
    }
    std::fs::remove_dir(dir).map_err(io(format!("cannot remove {}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_target_must_be_under_the_slots_binds() {
        let slot = WarmSlot::new(PathBuf::from("/srv/pool/warm_1"), PathBuf::from("/srv/warm/warm_1"));
        for target in [
            "/srv/pool/warm_1/host",
            "/srv/pool/warm_1/binds",
            "/srv/pool/warm_1/binds/../host",
        ] {
            let error = slot
                .bind(Path::new("/srv/x"), Path::new(target), true)
                .expect_err(target);
            assert!(matches!(error, SlotError::Outside(_)), "{target}: {error}");
        }
    }
}
