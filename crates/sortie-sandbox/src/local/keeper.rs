//! The sandbox keeper (`sortie sandbox keep`): the parent of a sandbox's process in place of `serve`,
//! so that a sandbox outlives a restart of `serve` (the next one adopts it), never `serve` for good.
//! bwrap's parent-death signal is tied to the keeper; the keeper SIGKILLs its child once the lease
//! file has gone untouched for the grace, and bwrap's parent-death signal takes the rest with it.

use std::path::Path;
use std::process::ExitStatus;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use super::child::Confinement;

/// How often the keeper looks at the lease.
const LEASE_CHECK: Duration = Duration::from_millis(500);

/// Runs `command`, confined as `confinement` says, and waits for it, killing it once `lease` has gone
/// untouched for `grace`. Blocks: the keeper is a process of its own and needs no runtime.
pub fn keep(
    lease: &Path,
    grace: Duration,
    confinement: Option<Confinement>,
    command: &[String],
) -> std::io::Result<ExitStatus> {
    let (program, rest) = command
        .split_first()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no command to keep"))?;
    let mut command = std::process::Command::new(program);
    command.args(rest);
    if let Some(confinement) = confinement {
        confinement.apply(&mut command);
    }
    let mut child = command.spawn()?;
    // What bwrap was confined with (cgroup files, the status file) is not the keeper's to hold.
    drop(command);
    let child_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).map_err(std::io::Error::other)?);
    let (ended_tx, ended) = channel();
    std::thread::spawn(move || {
        // The receiver only goes when the keeper is already ending.
        let _ = ended_tx.send(child.wait());
    });
    let mut killed = false;
    loop {
        match ended.recv_timeout(LEASE_CHECK) {
            Ok(status) => return status,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(std::io::Error::other("the sandbox's waiter vanished"));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        let renewed = std::fs::metadata(lease)
            .and_then(|meta| meta.modified())
            .ok()
            .and_then(|at| at.elapsed().ok());
        if !killed && renewed.is_none_or(|age| age > grace) {
            // A failed kill means the child is already gone: its waiter reports it next.
            let _ = nix::sys::signal::kill(child_pid, nix::sys::signal::Signal::SIGKILL);
            killed = true;
        }
    }
}
