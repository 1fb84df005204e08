//! The index's stat cache made true while the agent works, so that a turn's delivery only looks at
//! what the agent changed.
//!
//! A fresh checkout's index is written in the same second as its files, and git's stat cache has
//! whole-second times: every entry is "racily clean" and every later refresh must read and hash the
//! file again. Seen through the sandbox's user namespace each file also has another owner than the
//! index recorded (the checkout ran as the sandbox uid on the host). So the first delivery in a fresh
//! workspace hashed the whole tree on the path to the push: on a 96 MiB tree, last words → delivery
//! card took 850–1,230 ms for a turn too short for this refresh and 210–230 ms for one of 3 s.
//!
//! Once the wall clock has passed the index's second, [`EarlyRefresh`] refreshes a *copy* of the index
//! (`GIT_INDEX_FILE`): it never takes the index's own lock, so the agent's git is never refused. At
//! delivery, [`EarlyRefresh::hand_over`] puts the copy in place only if it finished and the index is
//! byte for byte what was copied, under the index's lock; otherwise the delivery refreshes as before.
//! Once the copy is in place the delivery refreshes no more: what can still be stale is a file the
//! agent wrote after the copy's refresh (a newer time than the copy recorded) or in the copy's own
//! second (marked racy by git when it wrote the copy), and `git add` hashes exactly those, as it
//! hashes every file the agent changed.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::delivery::Git;

/// Beside the index: where the copy is refreshed.
const COPY_SUFFIX: &str = "sortie-refresh";
/// The most the index's time may lie ahead of the clock before the wait is not worth it.
const LONGEST_WAIT: Duration = Duration::from_secs(5);
/// After the index's second ends: file times come from a coarse clock that can lag a few ms.
const SECOND_MARGIN: Duration = Duration::from_millis(20);

/// A refresh of a copy of the index, running beside the agent; dropping it stops it.
pub struct EarlyRefresh {
    index: PathBuf,
    task: tokio::task::JoinHandle<Option<Vec<u8>>>,
}

impl EarlyRefresh {
    /// Starts it for `git`'s workspace when its `.git` is a directory with an index (a workspace
    /// whose git lives elsewhere is left to the delivery).
    pub fn start(git: &Git) -> Option<Self> {
        let index = git.workspace.join(".git/index");
        if !git.workspace.join(".git").is_dir() {
            return None;
        }
        let copy = copy_path(&index);
        let task = tokio::spawn({
            let (git, index) = (git.clone(), index.clone());
            async move { refresh_copy(&git, &index, &copy).await }
        });
        Some(Self { index, task })
    }

    /// Whether the refresh is over (done, or given up).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Puts the refreshed copy in place of the index if the refresh finished and the index is still
    /// what it copied; `true` if it did. Whatever happens, the copy is gone after.
    pub async fn hand_over(mut self) -> bool {
        if !self.task.is_finished() {
            return false;
        }
        let copied = match (&mut self.task).await {
            Ok(Some(copied)) => copied,
            _ => return false,
        };
        let index = self.index.clone();
        let copy = copy_path(&index);
        tokio::task::spawn_blocking(move || install(&index, &copy, &copied))
            .await
            .unwrap_or(false)
    }
}

impl Drop for EarlyRefresh {
    fn drop(&mut self) {
        // Kills a git still refreshing (it is `kill_on_drop`) before its copy goes.
        self.task.abort();
        let _ = std::fs::remove_file(copy_path(&self.index));
    }
}

fn copy_path(index: &Path) -> PathBuf {
    let mut name = index.as_os_str().to_owned();
    name.push(".");
    name.push(COPY_SUFFIX);
    PathBuf::from(name)
}

/// Waits out the index's second, copies it and refreshes the copy; the index's bytes as copied, or
/// `None` when there was nothing worth doing or it failed.
async fn refresh_copy(git: &Git, index: &Path, copy: &Path) -> Option<Vec<u8>> {
    let written = tokio::fs::metadata(index).await.ok()?.modified().ok()?;
    let second_ends = second_after(written)?;
    let wait = second_ends.duration_since(SystemTime::now()).unwrap_or_default();
    if wait > LONGEST_WAIT {
        return None;
    }
    tokio::time::sleep(wait + SECOND_MARGIN).await;
    // A git killed while it refreshed an earlier copy may have left its lock.
    let mut copy_lock = copy.as_os_str().to_owned();
    copy_lock.push(".lock");
    let _ = tokio::fs::remove_file(PathBuf::from(copy_lock)).await;
    let original = tokio::fs::read(index).await.ok()?;
    tokio::fs::write(copy, &original).await.ok()?;
    // The copy must carry the index's time, never a later one: git judges which entries are racily
    // clean against it. Stamped with the copy's own (later) time, a file the agent rewrote in the
    // checkout's second at the same size would pass as unchanged and its edit would never be
    // delivered. `written` was read before the bytes, so it is never later than theirs.
    let stamped = std::fs::File::options()
        .write(true)
        .open(copy)
        .and_then(|file| file.set_modified(written));
    if stamped.is_err() {
        let _ = tokio::fs::remove_file(copy).await;
        return None;
    }
    let copy_text = copy.to_str()?;
    let ran = git
        .run_with(
            "refresh a copy of the index",
            &["update-index", "-q", "--refresh"],
            &[("GIT_INDEX_FILE", copy_text)],
        )
        .await
        .ok()?;
    // 1: some entries need an update (the agent's changes), which is what a refresh leaves them.
    matches!(ran.status.code(), Some(0 | 1)).then_some(original)
}

/// The start of the second after `time`'s.
fn second_after(time: SystemTime) -> Option<SystemTime> {
    let seconds = time.duration_since(UNIX_EPOCH).ok()?.as_secs();
    UNIX_EPOCH.checked_add(Duration::from_secs(seconds + 1))
}

/// Under the index's lock (git's own protocol: `index.lock` made exclusively), replaces the index
/// with `copy` if it still holds `copied`. Leaves neither the lock nor the copy behind.
fn install(index: &Path, copy: &Path, copied: &[u8]) -> bool {
    let mut lock_name = index.as_os_str().to_owned();
    lock_name.push(".lock");
    let lock = PathBuf::from(lock_name);
    let installed = match std::fs::OpenOptions::new().write(true).create_new(true).open(&lock) {
        // Held by a git of the agent's (it runs on past its turn): the delivery refreshes as before.
        Err(_) => false,
        Ok(_) => {
            let unchanged = std::fs::read(index).is_ok_and(|now| now == copied);
            let installed = unchanged && std::fs::rename(copy, index).is_ok();
            let _ = std::fs::remove_file(&lock);
            installed
        }
    };
    let _ = std::fs::remove_file(copy);
    installed
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_testkit::git::{commit_files, git, init};

    fn files(count: usize) -> Vec<(String, Vec<u8>)> {
        (0..count)
            .map(|n| (format!("file-{n:02}.txt"), format!("content {n:02}\n").into_bytes()))
            .collect()
    }

    /// A fresh clone of a repository of `count` files: its index written in its files' second.
    fn fresh_checkout(root: &Path, count: usize) -> (PathBuf, Git) {
        let seed = init(&root.join("seed"));
        let files = files(count);
        let named: Vec<(&str, &[u8])> = files.iter().map(|(n, c)| (n.as_str(), c.as_slice())).collect();
        commit_files(&seed, &named, "files");
        git(root, &["clone", "-q", "seed", "work"]);
        let work = root.join("work");
        let driver_git = Git {
            workspace: work.clone(),
            env: vec![
                ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
                ("HOME".into(), root.display().to_string()),
                ("GIT_CONFIG_NOSYSTEM".into(), "1".into()),
            ],
            timeout: Duration::from_secs(30),
        };
        (work, driver_git)
    }

    async fn finished(early: &EarlyRefresh) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !early.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "the refresh did not finish");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn seconds(text: &str, field: &str) -> u64 {
        let line = text
            .lines()
            .find(|line| line.trim_start().starts_with(field))
            .unwrap_or_else(|| panic!("no {field} in {text}"));
        // `  mtime: 1796623953:324862420`, `  size: 11\tflags: 0`
        let value = line.trim_start().trim_start_matches(field).trim_start();
        let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("no figure in {line:?}"))
    }

    #[tokio::test]
    async fn a_fresh_checkouts_index_is_refreshed_beside_the_agent_and_no_edit_is_missed() {
        let temp = tempfile::tempdir().expect("temp");
        let (work, driver_git) = fresh_checkout(temp.path(), 40);
        // The agent's edits keep each file's size: only a time or the content can tell them apart.
        std::fs::write(work.join("file-00.txt"), "CONTENT 00\n").expect("edit");
        let early = EarlyRefresh::start(&driver_git).expect("a .git directory");
        finished(&early).await;
        std::fs::write(work.join("file-01.txt"), "CONTENT 01\n").expect("edit");
        assert!(
            early.hand_over().await,
            "nothing touched the index: the refreshed copy goes in"
        );
        assert!(!work.join(".git/index.sortie-refresh").exists());

        // The untouched files are recorded in an earlier second than the index's: a refresh only
        // compares their times, it reads none of them.
        let index_second = std::fs::metadata(work.join(".git/index"))
            .expect("index")
            .modified()
            .expect("mtime")
            .duration_since(UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs();
        let entry = git(&work, &["ls-files", "--debug", "file-02.txt"]);
        assert!(
            seconds(&entry, "mtime:") < index_second,
            "{entry} (index {index_second})"
        );
        assert_ne!(seconds(&entry, "size:"), 0, "{entry}");
        // And both edits are seen, the one before the refresh and the one after.
        let status = git(&work, &["status", "--porcelain"]);
        // (`git` trims the first line's leading space.)
        assert_eq!(status, "M file-00.txt\n M file-01.txt");
    }

    #[tokio::test]
    async fn an_index_the_agents_git_wrote_is_kept() {
        let temp = tempfile::tempdir().expect("temp");
        let (work, driver_git) = fresh_checkout(temp.path(), 3);
        let early = EarlyRefresh::start(&driver_git).expect("a .git directory");
        finished(&early).await;
        std::fs::write(work.join("new.txt"), "new\n").expect("write");
        git(&work, &["add", "new.txt"]);
        assert!(!early.hand_over().await);
        assert_eq!(git(&work, &["diff", "--cached", "--name-only"]), "new.txt");
        assert!(!work.join(".git/index.sortie-refresh").exists());
    }

    #[tokio::test]
    async fn a_refresh_not_done_by_the_delivery_is_stopped_and_leaves_nothing() {
        let temp = tempfile::tempdir().expect("temp");
        let (work, driver_git) = fresh_checkout(temp.path(), 3);
        // An index three seconds ahead keeps the refresh waiting however slowly this test runs.
        let index = std::fs::File::options()
            .write(true)
            .open(work.join(".git/index"))
            .expect("index");
        index
            .set_modified(SystemTime::now() + Duration::from_secs(3))
            .expect("mtime");
        let before = std::fs::read(work.join(".git/index")).expect("index");
        let early = EarlyRefresh::start(&driver_git).expect("a .git directory");
        assert!(!early.hand_over().await);
        assert_eq!(std::fs::read(work.join(".git/index")).expect("index"), before);
        assert!(!work.join(".git/index.sortie-refresh").exists());
    }

    #[test]
    fn the_wait_ends_at_the_next_whole_second() {
        let at = UNIX_EPOCH + Duration::from_millis(1_796_623_953_324);
        assert_eq!(second_after(at), Some(UNIX_EPOCH + Duration::from_secs(1_796_623_954)));
        let whole = UNIX_EPOCH + Duration::from_secs(7);
        assert_eq!(second_after(whole), Some(UNIX_EPOCH + Duration::from_secs(8)));
    }

    #[test]
    fn a_copy_is_installed_only_over_the_index_it_copied() {
        let temp = tempfile::tempdir().expect("temp");
        let index = temp.path().join("index");
        let copy = copy_path(&index);
        std::fs::write(&index, b"before").expect("index");
        std::fs::write(&copy, b"refreshed").expect("copy");
        assert!(install(&index, &copy, b"before"));
        assert_eq!(std::fs::read(&index).expect("index"), b"refreshed");
        assert!(!copy.exists() && !temp.path().join("index.lock").exists());

        // The agent's git wrote the index since: it stays, and the copy goes.
        std::fs::write(&copy, b"stale").expect("copy");
        assert!(!install(&index, &copy, b"before"));
        assert_eq!(std::fs::read(&index).expect("index"), b"refreshed");
        assert!(!copy.exists());

        // A git holds the index's lock: nothing is touched but the copy.
        std::fs::write(&copy, b"stale").expect("copy");
        std::fs::write(temp.path().join("index.lock"), b"").expect("lock");
        assert!(!install(&index, &copy, b"refreshed"));
        assert_eq!(std::fs::read(&index).expect("index"), b"refreshed");
        assert!(
            temp.path().join("index.lock").exists(),
            "another's lock is not ours to remove"
        );
    }
}
