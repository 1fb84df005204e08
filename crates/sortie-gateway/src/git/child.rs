//! The one place this crate calls into the OS unsafely: what a git child does between fork and exec.
//! Joining the session's cgroup there, rather than from a gate process the proxy releases once it
//! has moved the pid, saves a shell and a round trip on every git the proxy runs (seven per push).

#![allow(unsafe_code)]

use std::fs::File;

use super::process::Identity;

/// Makes `command`'s child join the cgroups whose `cgroup.procs` files are `cgroups` (opened by this
/// process: the kernel judges a migration by the opener's credentials), then drop to `identity`, gid
/// first and without supplementary groups, before it runs anything.
pub(crate) fn confine(command: &mut tokio::process::Command, cgroups: Vec<File>, identity: Option<Identity>) {
    // SAFETY: the closure runs in the forked child before exec. It allocates nothing and makes only
    // async-signal-safe system calls (write, setgroups, setgid, setuid) on memory made before the fork.
    unsafe {
        command.pre_exec(move || enter(&cgroups, identity));
    }
}

fn enter(cgroups: &[File], identity: Option<Identity>) -> std::io::Result<()> {
    for file in cgroups {
        // `0` names the writer itself.
        if nix::unistd::write(file, b"0").map_err(std::io::Error::from)? != 1 {
            // Nothing is allocated in the child: an error is its number.
            return Err(std::io::Error::from(nix::errno::Errno::EIO));
        }
    }
    if let Some(identity) = identity {
        nix::unistd::setgroups(&[]).map_err(std::io::Error::from)?;
        nix::unistd::setgid(nix::unistd::Gid::from_raw(identity.gid)).map_err(std::io::Error::from)?;
        nix::unistd::setuid(nix::unistd::Uid::from_raw(identity.uid)).map_err(std::io::Error::from)?;
    }
    Ok(())
}
