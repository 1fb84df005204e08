//! A session's branch against the commit it started from: the files it changes, their line counts and
//! their unified diffs, read by the host from object stores it trusts (the objects of accepted pushes,
//! the mirror), never from the sandbox's repository. Attributes, textconv and external diffs are off, as
//! in the push scan, so nothing the agent committed decides what runs or what the reviewer sees.

use std::path::{Path, PathBuf};

use sortie_protocol::api::{FileDiff, FileStatus, StoredDiff};
use sortie_protocol::limits::{DIFF_FILE_PATCH_MAX_BYTES, DIFF_FILES_MAX, DIFF_PATCH_MAX_BYTES};

use crate::git::process::{GitCommand, Spawner};
use crate::git::scan::{Input, ObjectFormat, Quarantine, ScanContext, run};
use sortie_secrets::KnownSecrets;

/// What `to` changes since `from` (the empty tree when `None`), capped as `sortie_protocol::limits`
/// says: every file counted, the first 3,000 listed, 64 KiB of patch a file and 2 MiB in all.
pub async fn branch_diff(
    git: &Path,
    scratch: &Path,
    trusted: &[PathBuf],
    from: Option<&str>,
    to: &str,
) -> Result<StoredDiff, String> {
    let hex = |oid: &str| matches!(oid.len(), 40 | 64) && oid.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(to) || from.is_some_and(|from| !hex(from)) {
        return Err("not commit ids".into());
    }
    let format = ObjectFormat::of(to);
    let quarantine =
        Quarantine::create(scratch, format, trusted).map_err(|e| format!("cannot make a scratch repository: {e}"))?;
    let base = from.unwrap_or(format.empty_tree());
    let command = |what: &[&str]| {
        let command = GitCommand::new(git)
            .env("GIT_DIR", quarantine.git_dir())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_ATTR_NOSYSTEM", "1")
            .env("GIT_NO_REPLACE_OBJECTS", "1")
            .env("GIT_OPTIONAL_LOCKS", "0")
            .env("HOME", quarantine.home())
            .config(&[
                ("core.hooksPath", "/dev/null".into()),
                ("core.attributesFile", "/dev/null".into()),
                ("attr.tree", format.empty_tree().into()),
                ("core.fsmonitor", "false".into()),
                ("core.quotePath", "false".into()),
                ("diff.noprefix", "false".into()),
                ("diff.mnemonicPrefix", "false".into()),
                ("color.ui", "false".into()),
            ])
            .arg("diff");
        let command = what.iter().fold(command, |command, arg| command.arg(*arg));
        command
            .arg("--no-ext-diff")
            .arg("--no-textconv")
            .arg("--no-renames")
            .arg(base)
            .arg(to)
    };
    let spawner = Spawner::new(Vec::new(), None);
    let context = ScanContext {
        git,
        spawner: &spawner,
        known: &KnownSecrets::default(),
    };
    // Every file is counted up to 16 MiB of counts (about 300,000 files); the status list is bounded
    // by the file cap (a path is at most 4 KiB); the patch by its own cap.
    let list_cap = (DIFF_FILES_MAX + 1) * 4200;
    let mut numstat = Vec::new();
    let mut status = Vec::new();
    let mut patch = Vec::new();
    fn collect(into: &mut Vec<u8>, cap: usize) -> impl FnMut(&[u8]) + '_ {
        move |bytes| {
            let room = cap.saturating_sub(into.len());
            into.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }
    let (a, b, c) = tokio::join!(
        run(
            &context,
            command(&["--numstat", "-z"]),
            Input::Bytes(Vec::new()),
            collect(&mut numstat, NUMSTAT_MAX_BYTES)
        ),
        run(
            &context,
            command(&["--name-status", "-z"]),
            Input::Bytes(Vec::new()),
            collect(&mut status, list_cap)
        ),
        run(
            &context,
            command(&["--patch", "--no-color", "--full-index"]),
            Input::Bytes(Vec::new()),
            collect(&mut patch, DIFF_PATCH_MAX_BYTES + DIFF_FILE_PATCH_MAX_BYTES)
        ),
    );
    a?;
    b?;
    c?;
    let counted_all = numstat.len() < NUMSTAT_MAX_BYTES;
    let mut diff = assemble(base, to, &numstat, &status, &patch);
    diff.truncated |= !counted_all;
    Ok(diff)
}

const NUMSTAT_MAX_BYTES: usize = 16 << 20;

/// One file's counts as `--numstat -z` gives them (`-` for a binary file).
struct Counts {
    insertions: Option<u64>,
    deletions: Option<u64>,
    path: String,
}

/// `--numstat -z` (renames off): `<added>\t<deleted>\t<path>\0` for each file.
fn parse_numstat(bytes: &[u8]) -> Vec<Counts> {
    bytes
        .split(|b| *b == 0)
        .filter(|record| !record.is_empty())
        .filter_map(|record| {
            let text = String::from_utf8_lossy(record);
            let mut fields = text.splitn(3, '\t');
            let (added, deleted, path) = (fields.next()?, fields.next()?, fields.next()?);
            Some(Counts {
                insertions: added.parse().ok(),
                deletions: deleted.parse().ok(),
                path: path.trim_start_matches('\n').to_owned(),
            })
        })
        .collect()
}

/// `--name-status -z` (renames off): `<letter>\0<path>\0` for each file.
fn parse_name_status(bytes: &[u8]) -> Vec<(FileStatus, String)> {
    let mut fields = bytes.split(|b| *b == 0).filter(|f| !f.is_empty());
    let mut out = Vec::new();
    while let (Some(letter), Some(path)) = (fields.next(), fields.next()) {
        let status = match letter.first() {
            Some(b'A') => FileStatus::Added,
            Some(b'D') => FileStatus::Deleted,
            Some(b'T') => FileStatus::TypeChanged,
            _ => FileStatus::Modified,
        };
        out.push((status, String::from_utf8_lossy(path).into_owned()));
    }
    out
}

/// The patch cut into one piece per file, in git's order: each begins at a `diff --git ` line (a line
/// of a file's content cannot: it starts with a space, `+` or `-`).
fn split_patch(patch: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new();
    let mut at = 0;
    while at < patch.len() {
        if patch[at..].starts_with(b"diff --git ") {
            starts.push(at);
        }
        at = match patch[at..].iter().position(|b| *b == b'\n') {
            Some(end) => at + end + 1,
            None => patch.len(),
        };
    }
    starts
        .iter()
        .enumerate()
        .map(|(i, start)| &patch[*start..starts.get(i + 1).copied().unwrap_or(patch.len())])
        .collect()
}

/// A file's patch as kept: whole, or cut at the last line end within the cap.
fn capped(piece: &[u8]) -> (String, bool) {
    if piece.len() <= DIFF_FILE_PATCH_MAX_BYTES {
        return (String::from_utf8_lossy(piece).into_owned(), false);
    }
    let cut = piece[..DIFF_FILE_PATCH_MAX_BYTES]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(DIFF_FILE_PATCH_MAX_BYTES, |end| end + 1);
    (String::from_utf8_lossy(&piece[..cut]).into_owned(), true)
}

/// The three outputs of one diff as the stored diff. Every file is counted; the listed ones take their
/// status from `--name-status` and their patch from the patch in the same order (git sorts all three
/// the same way), until the patch budget is spent.
fn assemble(base: &str, head: &str, numstat: &[u8], status: &[u8], patch: &[u8]) -> StoredDiff {
    let counts = parse_numstat(numstat);
    let statuses = parse_name_status(status);
    let pieces = split_patch(patch);
    let mut budget = DIFF_PATCH_MAX_BYTES;
    let mut files = Vec::new();
    for (i, count) in counts.iter().take(DIFF_FILES_MAX).enumerate() {
        let binary = count.insertions.is_none() && count.deletions.is_none();
        let status = statuses
            .get(i)
            .filter(|(_, path)| *path == count.path)
            .map_or(FileStatus::Modified, |(status, _)| *status);
        let (patch, patch_truncated) = match pieces.get(i) {
            Some(piece) if !binary && budget > 0 => {
                let (text, cut) = capped(piece);
                budget = budget.saturating_sub(text.len());
                (Some(text), cut)
            }
            _ => (None, false),
        };
        files.push(FileDiff {
            path: count.path.clone(),
            status,
            insertions: count.insertions.unwrap_or(0),
            deletions: count.deletions.unwrap_or(0),
            binary,
            patch,
            patch_truncated,
        });
    }
    StoredDiff {
        base_sha: base.to_owned(),
        head_sha: head.to_owned(),
        files_changed: counts.len() as u64,
        insertions: counts.iter().filter_map(|c| c.insertions).sum(),
        deletions: counts.iter().filter_map(|c| c.deletions).sum(),
        truncated: counts.len() > DIFF_FILES_MAX,
        files,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATCH: &str = "diff --git a/src/greet.js b/src/greet.js\nindex 1..2 100644\n--- a/src/greet.js\n+++ b/src/greet.js\n@@ -1,3 +1,3 @@\n-export function greet() {\n+export function greet(name) {\n+diff --git looks like a header but is content\n   return 1;\n }\ndiff --git a/logo.png b/logo.png\nnew file mode 100644\nBinary files /dev/null and b/logo.png differ\ndiff --git a/old.txt b/old.txt\ndeleted file mode 100644\n--- a/old.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n";

    #[test]
    fn the_three_outputs_make_one_file_list() {
        let numstat = b"2\t1\tsrc/greet.js\0-\t-\tlogo.png\x000\t1\told.txt\0";
        let status = b"M\0src/greet.js\0A\0logo.png\0D\0old.txt\0";
        let diff = assemble(
            "a".repeat(40).as_str(),
            "b".repeat(40).as_str(),
            numstat,
            status,
            PATCH.as_bytes(),
        );
        assert_eq!((diff.files_changed, diff.insertions, diff.deletions), (3, 2, 2));
        let shape: Vec<_> = diff
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.status, f.insertions, f.deletions, f.binary))
            .collect();
        assert_eq!(
            shape,
            [
                ("src/greet.js", FileStatus::Modified, 2, 1, false),
                ("logo.png", FileStatus::Added, 0, 0, true),
                ("old.txt", FileStatus::Deleted, 0, 1, false),
            ]
        );
        assert!(
            diff.files[0]
                .patch
                .as_deref()
                .is_some_and(|p| p.starts_with("diff --git a/src/greet.js") && p.contains("looks like a header"))
        );
        assert_eq!(diff.files[1].patch, None, "a binary file has no patch");
        assert!(diff.files[2].patch.as_deref().is_some_and(|p| p.ends_with("-gone\n")));
        assert!(!diff.truncated);
    }

    #[test]
    fn a_long_patch_is_cut_at_a_line_end_and_marked() {
        let body: String = (0..20_000).map(|i| format!("+line {i}\n")).collect();
        let patch = format!("diff --git a/big b/big\n@@ -0,0 +1,20000 @@\n{body}");
        let (text, cut) = capped(patch.as_bytes());
        assert!(cut);
        assert!(text.len() <= DIFF_FILE_PATCH_MAX_BYTES && text.ends_with('\n'));
    }

    #[test]
    fn files_past_the_cap_are_counted_not_listed() {
        let numstat: Vec<u8> = (0..DIFF_FILES_MAX + 5)
            .flat_map(|i| format!("1\t0\tf{i:05}\0").into_bytes())
            .collect();
        let diff = assemble("a", "b", &numstat, b"", b"");
        assert_eq!(diff.files.len(), DIFF_FILES_MAX);
        assert_eq!(diff.files_changed, DIFF_FILES_MAX as u64 + 5);
        assert_eq!(diff.insertions, DIFF_FILES_MAX as u64 + 5);
        assert!(diff.truncated);
    }

    #[test]
    fn garbage_gives_what_it_can_and_never_panics() {
        for bytes in [&b""[..], b"\0\0\0", b"x\ty", b"1\t2", b"\xff\xfe\t\t\0"] {
            let _ = assemble("a", "b", bytes, bytes, bytes);
        }
    }
}
