//! The one place this crate calls into the OS unsafely: what a child does between fork and exec.
//!
//! A sandbox's first process joins the sandbox's cgroups, takes the status file as fd 3 (bwrap's
//! `--json-status-fd`), and, when the runtime is root, drops to the sandbox uid and gid with no
//! supplementary groups, an empty bounding set and nothing to inherit — what a shell and `setpriv`
//! did as two more programs before every bwrap. bwrap then never runs as root (ref/sandbox-recipe.md
//! §0: as root, the sandbox's uid would map to host root).
//!
//! A process the host runs for sessions ([`super::priority`]) lowers its CPU priority, and may join a
//! CPU group, before it runs anything.

#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

/// Makes `command`'s child raise its nice value by `nice_increment` and join the cgroups whose
/// `cgroup.procs` files are `cgroups` (opened by this process), before it runs anything. Best effort:
/// a child that can do neither runs as its parent would have.
pub fn lower_priority(command: &mut tokio::process::Command, nice_increment: i32, cgroups: Vec<File>) {
    // SAFETY: the closure runs in the forked child before exec. It allocates nothing and makes only
    // async-signal-safe system calls (nice, write) on memory made before the fork.
    unsafe {
        command.pre_exec(move || {
            // Raising one's own nice value needs no privilege; a failure leaves it as it was.
            let _ = libc::nice(nice_increment);
            for file in &cgroups {
                // `0` names the writer itself.
                let _ = libc::write(file.as_raw_fd(), b"0".as_ptr().cast(), 1);
            }
            Ok(())
        });
    }
}

/// The fd bwrap reports the sandbox's pid on.
pub const STATUS_FD: u32 = 3;

/// What the sandbox's first process does before it becomes bwrap, prepared by the runtime (or the
/// keeper) as root: every file is opened here, so the child only writes, duplicates and drops.
pub struct Confinement {
    cgroups: Vec<File>,
    status: File,
    drop_to: Option<(u32, u32)>,
    last_cap: u32,
}

impl Confinement {
    /// `procs`: the sandbox's `cgroup.procs` files (the kernel judges a migration by the credentials
    /// a file was opened with); `status_file` is created or emptied; `drop_to`: the uid and gid to run
    /// as (root only).
    pub fn prepare(procs: &[PathBuf], status_file: &Path, drop_to: Option<(u32, u32)>) -> std::io::Result<Self> {
        let cgroups = procs
            .iter()
            .map(|path| std::fs::OpenOptions::new().write(true).open(path))
            .collect::<std::io::Result<Vec<File>>>()?;
        let status = File::create(status_file)?;
        // The kernel's highest capability; an unreadable file leaves the highest this code knows of
        // (dropping a capability past the kernel's is refused, and ignored below).
        let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(63);
        Ok(Self {
            cgroups,
            status,
            drop_to,
            last_cap,
        })
    }

    /// Makes `command`'s child confined before it runs anything.
    pub fn apply(self, command: &mut std::process::Command) {
        // SAFETY: the closure runs in the forked child before exec. It allocates nothing and makes only
        // async-signal-safe system calls (write, dup2, fcntl, prctl, capget/capset, setgroups,
        // setresgid, setresuid) on memory made before the fork.
        unsafe {
            command.pre_exec(move || self.enter());
        }
    }

    fn enter(&self) -> std::io::Result<()> {
        for file in &self.cgroups {
            // `0` names the writer itself.
            if nix::unistd::write(file, b"0").map_err(std::io::Error::from)? != 1 {
                // Nothing is allocated here: an error is its number.
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
        }
        let status = self.status.as_raw_fd();
        // SAFETY: plain system calls on descriptors this process holds.
        let target = STATUS_FD as libc::c_int;
        let moved = unsafe {
            if status == target {
                libc::fcntl(target, libc::F_SETFD, 0)
            } else {
                libc::dup2(status, target)
            }
        };
        if moved < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Some((uid, gid)) = self.drop_to {
            drop_privileges(uid, gid, self.last_cap)?;
        }
        Ok(())
    }
}

/// As root: an empty bounding set and inheritable set first (they take privilege to change), then no
/// groups, the gid, the uid — after which nothing is permitted or effective.
fn drop_privileges(uid: u32, gid: u32, last_cap: u32) -> std::io::Result<()> {
    let check = |result: libc::c_int| {
        if result < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    for cap in 0..=last_cap {
        // SAFETY: prctl with integer arguments only.
        let dropped = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        if dropped < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(std::io::Error::last_os_error());
        }
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget and capset with a version 3 header and the two data words that version takes.
    unsafe {
        check(libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) as libc::c_int)?;
        for word in &mut data {
            word.inheritable = 0;
        }
        check(libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int)?;
    }
    nix::unistd::setgroups(&[]).map_err(std::io::Error::from)?;
    let gid = nix::unistd::Gid::from_raw(gid);
    nix::unistd::setresgid(gid, gid, gid).map_err(std::io::Error::from)?;
    let uid = nix::unistd::Uid::from_raw(uid);
    nix::unistd::setresuid(uid, uid, uid).map_err(std::io::Error::from)?;
    Ok(())
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}
