//! How the processes the worker runs on the host (a session's clone, fetch and checkout, a disk's
//! `mkfs`, `e2fsck` and `mount`) are started: off the runtime's threads ([`spawn`]), and with only as
//! much of a contended CPU as their work deserves.
//!
//! - [`HostWork::Session`], nice +5 (weight 335 against `serve`'s threads' 1024): a session being
//!   prepared, which someone waits for, yields to API requests, streams and the git proxy's answers.
//! - [`HostWork::Ahead`], nice 19 and in [`super::cgroup::WORK_AHEAD`], a CPU group scheduled idle
//!   beside the sandboxes' groups: what is made for a later session (spare disks, a workspace checked
//!   out ahead) takes only the CPU neither `serve` nor a sandbox wants.
//!
//! Nice alone cannot rank a host process against sandboxes: it counts within the scheduling group the
//! process is in, which is `serve`'s own when the kernel groups by session (autogroup, as on this
//! project's machines) or on cgroup v2, and that whole group weighs 4× all sandboxes together. Made
//! ahead outside a group, a spare disk's `mkfs` and a primed checkout ran at that weight, beside the
//! delivery of the session they were made after.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

/// What a host process is run for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostWork {
    /// A session someone waits for.
    Session,
    /// A later session: made ahead, waited for by nobody yet.
    Ahead,
}

impl HostWork {
    /// How far above `serve`'s nice value a process of this work runs (at most 19 in all).
    pub fn nice_increment(self) -> i32 {
        match self {
            HostWork::Session => 5,
            HostWork::Ahead => 19,
        }
    }
}

tokio::task_local! {
    /// Within [`ahead`]: the `cgroup.procs` files of the group work ahead runs in (none, to run it
    /// niced only).
    static AHEAD: Arc<[PathBuf]>;
}

/// Runs `work` so that every host process it starts (through [`yield_cpu`]) is [`HostWork::Ahead`],
/// in the group whose `cgroup.procs` files are `cgroup` ([`super::cgroup::create_for_work_ahead`]).
/// A task it spawns is not.
pub async fn ahead<F: Future>(cgroup: Arc<[PathBuf]>, work: F) -> F::Output {
    AHEAD.scope(cgroup, work).await
}

/// The work the current task does: [`HostWork::Ahead`] within [`ahead`], else [`HostWork::Session`].
pub fn current() -> HostWork {
    if AHEAD.try_with(|_| ()).is_ok() {
        HostWork::Ahead
    } else {
        HostWork::Session
    }
}

/// Makes `command` start at the priority of the current task's work ([`current`]): its nice value
/// raised relative to this process's own (so never above it, even as root), and for work ahead in its
/// group. Best effort: a process whose priority cannot be lowered runs as its parent does.
pub fn yield_cpu(command: &mut tokio::process::Command) {
    let cgroups = AHEAD
        .try_with(|procs| {
            procs
                .iter()
                .filter_map(|path| std::fs::OpenOptions::new().write(true).open(path).ok())
                .collect()
        })
        .unwrap_or_default();
    super::child::lower_priority(command, current().nice_increment(), cgroups);
}

/// Starts `command` at the current work's priority ([`yield_cpu`]), from a blocking thread: a spawn
/// returns only once the child has exec'd (after its cgroup migration, for work ahead, which may wait
/// out an RCU grace period), and on a runtime thread that thread serves nothing else meanwhile. While
/// 60 sessions started, each of serve's two runtime threads waited over 3 ms in some 650 forks and
/// exec waits, up to 155 ms, about 9 s in all under strace, as API requests and streams waited.
pub async fn spawn(mut command: tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    yield_cpu(&mut command);
    tokio::task::spawn_blocking(move || command.spawn())
        .await
        .unwrap_or_else(|joined| Err(std::io::Error::other(joined)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nice_of(pid: u32) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        // The fields after the command's closing parenthesis; nice is the 19th field of the line.
        let after = &stat[stat.rfind(')').expect(")") + 2..];
        after.split(' ').nth(16).expect("nice").parse().expect("a number")
    }

    async fn started_nice() -> i32 {
        let mut command = tokio::process::Command::new("sleep");
        command.arg("5").kill_on_drop(true);
        yield_cpu(&mut command);
        let child = command.spawn().expect("sleep");
        nice_of(child.id().expect("pid"))
    }

    #[tokio::test]
    async fn host_processes_yield_to_serve_and_work_ahead_yields_most() {
        let own = nice_of(std::process::id());
        let session = (own + HostWork::Session.nice_increment()).min(19);
        // A nice value never goes past 19: from a parent already niced, both levels may meet there.
        assert_eq!(started_nice().await, session);
        assert_eq!(current(), HostWork::Session);
        let (inside, work) = ahead(Arc::from([]), async { (started_nice().await, current()) }).await;
        assert_eq!(work, HostWork::Ahead);
        assert_eq!(inside, 19);
        assert_eq!(started_nice().await, session);
    }

    #[tokio::test]
    async fn work_ahead_joins_its_idle_group_as_root_and_as_the_sandbox_uid() {
        let root = std::path::Path::new("/sys/fs/cgroup");
        let procs: Arc<[PathBuf]> = crate::local::cgroup::create_for_work_ahead(root)
            .expect("the group (tests run as root, as the worker does when it makes disks ahead)")
            .into();
        let group = procs[0].parent().expect("a directory").to_owned();
        // Idle where the kernel can mark a group so (this project's machines), else the least weight.
        match std::fs::read_to_string(group.join("cpu.idle")) {
            Ok(idle) => assert_eq!(idle.trim(), "1"),
            Err(_) => {
                let weight = ["cpu.shares", "cpu.weight"]
                    .iter()
                    .find_map(|file| std::fs::read_to_string(group.join(file)).ok())
                    .expect("a weight");
                assert!(["2", "1"].contains(&weight.trim()), "{weight}");
            }
        }
        // As root, and as the sandbox uid a workspace is checked out as (the child joins after std
        // dropped its uid: the kernel judges by the credentials the file was opened with).
        for owner in [None, Some(65534)] {
            let joined = ahead(procs.clone(), async {
                let mut command = tokio::process::Command::new("sleep");
                command.arg("5").kill_on_drop(true);
                if let Some(id) = owner {
                    command.uid(id).gid(id);
                }
                yield_cpu(&mut command);
                let child = command.spawn().expect("sleep");
                let pid = child.id().expect("pid");
                let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
                drop(child);
                cgroups
            })
            .await;
            assert!(
                joined.lines().any(|line| line.ends_with("/sortie/work-ahead")),
                "{owner:?}: {joined}"
            );
        }
    }
}
