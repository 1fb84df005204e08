//! The agent's home as a tar (`GET /home`, `PUT /home`): what a pod's agent keeps — its own sessions,
//! which `session/load` reads — given up when the session hibernates and unpacked into the session's
//! next pod before its assignment. The driver's turn logs stay out (the host has the transcript), links
//! are archived as links and never followed, and either way the size is capped
//! ([`HOME_SNAPSHOT_MAX_BYTES`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use sortie_protocol::driver::HOME_SNAPSHOT_MAX_BYTES;

/// Where the driver keeps its turn logs under the home (the default `--state-dir`).
const TURN_LOGS: &str = ".sortie/turns";

#[derive(Debug, thiserror::Error)]
pub enum HomeError {
    #[error("the agent's home is larger than {HOME_SNAPSHOT_MAX_BYTES} bytes")]
    TooLarge,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A writer that refuses to grow past the cap, and remembers that it did.
#[derive(Default)]
struct Capped {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl Write for Capped {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + bytes.len() > HOME_SNAPSHOT_MAX_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("home too large"));
        }
        self.bytes.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The home under `home` as a tar, without the turn logs.
pub fn snapshot(home: &Path) -> Result<Vec<u8>, HomeError> {
    let mut builder = tar::Builder::new(Capped::default());
    builder.follow_symlinks(false);
    let skip = home.join(TURN_LOGS);
    let mut pending: Vec<PathBuf> = vec![home.to_owned()];
    while let Some(dir) = pending.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for entry in entries {
            let path = entry.path();
            if path == skip {
                continue;
            }
            let Ok(relative) = path.strip_prefix(home) else {
                continue;
            };
            let kind = entry.file_type()?;
            if let Err(error) = builder.append_path_with_name(&path, relative) {
                return Err(if builder.get_ref().overflowed {
                    HomeError::TooLarge
                } else {
                    HomeError::Io(error)
                });
            }
            if kind.is_dir() {
                pending.push(path);
            }
        }
    }
    if builder.get_ref().overflowed {
        return Err(HomeError::TooLarge);
    }
    let capped = builder.into_inner()?;
    if capped.overflowed {
        return Err(HomeError::TooLarge);
    }
    Ok(capped.bytes)
}

/// Unpacks `tar` into `home`: entries that would land outside it are refused by the tar reader, and
/// nothing keeps the modes or owners it names.
pub fn restore(home: &Path, tar: &[u8]) -> Result<(), HomeError> {
    if tar.len() > HOME_SNAPSHOT_MAX_BYTES {
        return Err(HomeError::TooLarge);
    }
    std::fs::create_dir_all(home)?;
    let mut archive = tar::Archive::new(tar);
    archive.set_preserve_permissions(false);
    archive.set_preserve_ownerships(false);
    archive.set_overwrite(true);
    for entry in archive.entries()? {
        let mut entry = entry?;
        // `unpack_in` skips a path with `..` or a root, and never writes through a link it made.
        entry.unpack_in(home)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_goes_to_another_home_without_the_turn_logs() {
        let from = tempfile::tempdir().expect("temp");
        std::fs::create_dir_all(from.path().join(".scripted-agent")).expect("dir");
        std::fs::write(from.path().join(".scripted-agent/s1.json"), "{\"turns\":[]}").expect("file");
        std::fs::create_dir_all(from.path().join(".sortie/turns")).expect("dir");
        std::fs::write(from.path().join(".sortie/turns/1.log"), "the transcript").expect("file");
        std::fs::write(from.path().join(".sortie/acp-session"), "s1").expect("file");
        std::os::unix::fs::symlink("/etc/passwd", from.path().join("link")).expect("link");
        let tar = snapshot(from.path()).expect("snapshot");

        let to = tempfile::tempdir().expect("temp");
        restore(to.path(), &tar).expect("restore");
        assert_eq!(
            std::fs::read_to_string(to.path().join(".scripted-agent/s1.json")).expect("kept"),
            "{\"turns\":[]}"
        );
        assert_eq!(
            std::fs::read_to_string(to.path().join(".sortie/acp-session")).expect("kept"),
            "s1"
        );
        assert!(!to.path().join(".sortie/turns/1.log").exists(), "turn logs stay out");
        assert_eq!(
            std::fs::read_link(to.path().join("link")).expect("a link stays a link"),
            Path::new("/etc/passwd")
        );
    }

    #[test]
    fn an_entry_outside_the_home_is_not_written_and_an_oversized_home_is_refused() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(4);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        // Written raw: the builder itself refuses such a name.
        header.as_gnu_mut().expect("gnu").name[..13].copy_from_slice(b"../escaped.tx");
        header.set_cksum();
        builder.append(&header, &b"evil"[..]).expect("append");
        let tar = builder.into_inner().expect("tar");
        let root = tempfile::tempdir().expect("temp");
        let home = root.path().join("home");
        let _ = restore(&home, &tar);
        assert!(!root.path().join("escaped.tx").exists());

        let big = tempfile::tempdir().expect("temp");
        // Real bytes: a sparse file's holes take no room in the archive.
        std::fs::write(big.path().join("big"), vec![7_u8; HOME_SNAPSHOT_MAX_BYTES + 1]).expect("file");
        assert!(matches!(snapshot(big.path()), Err(HomeError::TooLarge)));
        assert!(matches!(
            restore(&home, &vec![0; HOME_SNAPSHOT_MAX_BYTES + 1]),
            Err(HomeError::TooLarge)
        ));
    }
}
