//! The secret scan of a push at the gateway (S7, DESIGN §9 invariant 12): the request is spooled to
//! a file in a fresh quarantine (bounded, never held in memory), its pack indexed into a bare
//! quarantine repository whose alternates are object stores the host trusts (the session's mirror,
//! the objects of its earlier accepted pushes, a local upstream's own), and every commit in the pack
//! is read: its whole object (message and headers) and the lines its diff against its first parent
//! (or the empty tree) adds, with `--text --no-textconv --no-ext-diff`, no attributes
//! (`core.attributesFile=/dev/null`, `attr.tree` = the empty tree, a bare repository) and no hooks.
//! A commit whose parents the trusted stores cannot resolve refuses the push (fail closed).
//!
//! The quarantine is the host's: it is never bound into a sandbox, and nothing in it ever reaches
//! the upstream but the bytes the client sent, after the scan passed.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Bytes;
use futures::{Stream, StreamExt};
use sortie_secrets::{Finding, KnownSecrets, PatchScanner};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use crate::git::process::{self, GitCommand, Spawner};
use crate::git::receive_pack::RefUpdate;

/// A line of git's output longer than this is scanned in pieces ([`LineSplitter`]).
const MAX_LINE: usize = 1 << 20;
/// How much of the end of one piece the next one repeats (longer than any key the scan knows).
const LINE_OVERLAP: usize = 4096;
/// A commit object larger than this is refused (sortie's commits are small; a huge one is a way to
/// hide things from a scan with bounds).
const MAX_COMMIT_BYTES: usize = 4 << 20;
/// How much of a child's stderr is kept (for the reason of a failure).
const MAX_STDERR: usize = 64 << 10;

/// The object format of a repository, read from a push's oids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ObjectFormat {
    Sha1,
    Sha256,
}

impl ObjectFormat {
    pub fn of(oid: &str) -> Self {
        if oid.len() == 64 { Self::Sha256 } else { Self::Sha1 }
    }

    fn hex_len(self) -> usize {
        match self {
            Self::Sha1 => 40,
            Self::Sha256 => 64,
        }
    }

    pub(crate) fn empty_tree(self) -> &'static str {
        match self {
            Self::Sha1 => "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
            Self::Sha256 => "6ef19b41225c5369f1c104d45d8d85efa9b057b53b14b4b9b939dd74decc5321",
        }
    }
}

/// One push's quarantine: a temporary bare repository (removed when dropped) and the spooled request.
pub(crate) struct Quarantine {
    dir: tempfile::TempDir,
    format: ObjectFormat,
}

impl Quarantine {
    /// A fresh quarantine under `parent`, borrowing objects from `trusted` (those that exist).
    pub fn create(parent: &Path, format: ObjectFormat, trusted: &[PathBuf]) -> std::io::Result<Self> {
        create_private_dir(parent)?;
        let dir = tempfile::Builder::new().prefix("push-").tempdir_in(parent)?;
        let git_dir = dir.path().join("repo.git");
        for sub in ["objects/info", "objects/pack", "refs"] {
            std::fs::create_dir_all(git_dir.join(sub))?;
        }
        std::fs::write(git_dir.join("HEAD"), "ref: refs/heads/quarantine\n")?;
        let config = match format {
            ObjectFormat::Sha1 => "[core]\n\trepositoryformatversion = 0\n\tbare = true\n".to_owned(),
            ObjectFormat::Sha256 => {
                "[core]\n\trepositoryformatversion = 1\n\tbare = true\n[extensions]\n\tobjectformat = sha256\n"
                    .to_owned()
            }
        };
        std::fs::write(git_dir.join("config"), config)?;
        let mut alternates = String::new();
        for store in trusted.iter().filter(|store| store.is_dir()) {
            // A path with a newline cannot be written as one alternate; it is left out (fail closed:
            // a parent only it holds then refuses the push).
            if let Some(text) = store.to_str().filter(|t| !t.contains('\n')) {
                alternates.push_str(text);
                alternates.push('\n');
            }
        }
        std::fs::write(git_dir.join("objects/info/alternates"), alternates)?;
        Ok(Self { dir, format })
    }

    /// A directory of the quarantine's own, for a child's `HOME`.
    pub fn home(&self) -> &Path {
        self.dir.path()
    }

    pub fn request_path(&self) -> PathBuf {
        self.dir.path().join("request")
    }

    pub(crate) fn git_dir(&self) -> PathBuf {
        self.dir.path().join("repo.git")
    }

    /// Moves the push's indexed pack into `delivered` (an object directory), `.idx` last so that git
    /// never sees a pack without its index.
    pub fn keep_objects(&self, delivered: &Path) -> std::io::Result<()> {
        let pack_dir = delivered.join("pack");
        std::fs::create_dir_all(&pack_dir)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(self.git_dir().join("objects/pack"))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| {
                path.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("pack-"))
            })
            .collect();
        files.sort_by_key(|path| path.extension().is_some_and(|e| e == "idx"));
        for file in files {
            let Some(name) = file.file_name() else { continue };
            let target = pack_dir.join(name);
            if std::fs::rename(&file, &target).is_err() {
                std::fs::copy(&file, &target)?;
            }
        }
        Ok(())
    }
}

/// Creates `dir` (and its parents) readable by its owner only, if it is not there yet.
pub(crate) fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Why a request could not be spooled.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpoolError {
    #[error("the push is larger than {0} bytes")]
    TooLarge(u64),
    #[error("the push request sent nothing for {0} s")]
    Idle(u64),
    #[error("the push request broke off")]
    Broken,
    #[error("cannot spool the push: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes `head` then the rest of `body` to `path`: at most `max` bytes, each chunk within `idle`.
pub(crate) async fn spool<S, E>(
    path: &Path,
    head: &[u8],
    body: &mut S,
    max: u64,
    idle: std::time::Duration,
) -> Result<u64, SpoolError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    let mut file = tokio::fs::File::create(path).await?;
    let mut written = head.len() as u64;
    if written > max {
        return Err(SpoolError::TooLarge(max));
    }
    file.write_all(head).await?;
    loop {
        let chunk = match tokio::time::timeout(idle, body.next()).await {
            Err(_) => return Err(SpoolError::Idle(idle.as_secs())),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(SpoolError::Broken),
            Ok(Some(Ok(chunk))) => chunk,
        };
        written += chunk.len() as u64;
        if written > max {
            return Err(SpoolError::TooLarge(max));
        }
        file.write_all(&chunk).await?;
    }
    file.flush().await?;
    Ok(written)
}

/// What the scan found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing: the push may be forwarded.
    Clean,
    /// A secret (the reason names kinds, files and commits, never a value).
    Secret(String),
    /// The push cannot be checked (a pack git cannot read, a parent no trusted store has…).
    Unverifiable(String),
}

/// What a scan runs with.
pub(crate) struct ScanContext<'a> {
    pub git: &'a Path,
    pub spawner: &'a Arc<Spawner>,
    pub known: &'a KnownSecrets,
}

/// Scans the pack of the request spooled in `quarantine` (it starts at `pack_offset`).
pub(crate) async fn scan(
    context: &ScanContext<'_>,
    quarantine: &Quarantine,
    pack_offset: u64,
    updates: &[RefUpdate],
) -> Verdict {
    match scan_inner(context, quarantine, pack_offset, updates).await {
        Ok(verdict) => verdict,
        Err(reason) => Verdict::Unverifiable(reason),
    }
}

async fn scan_inner(
    context: &ScanContext<'_>,
    quarantine: &Quarantine,
    pack_offset: u64,
    updates: &[RefUpdate],
) -> Result<Verdict, String> {
    let request = quarantine.request_path();
    let objects = pack_object_count(&request, pack_offset)
        .await
        .map_err(|e| format!("cannot read the pushed pack: {e}"))?;
    if objects == Some(0) || objects.is_none() {
        // No pack, or an empty one: the push brings no content of its own.
        return Ok(Verdict::Clean);
    }
    let format = quarantine.format;
    let git = |args: &[&str]| {
        let mut command = GitCommand::new(context.git)
            .env("GIT_DIR", quarantine.git_dir())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_ATTR_NOSYSTEM", "1")
            .env("GIT_NO_REPLACE_OBJECTS", "1")
            .env("GIT_OPTIONAL_LOCKS", "0")
            .env("HOME", quarantine.dir.path())
            .config(&[
                ("core.hooksPath", "/dev/null".into()),
                ("core.attributesFile", "/dev/null".into()),
                ("attr.tree", format.empty_tree().into()),
                ("core.fsmonitor", "false".into()),
                ("core.quotePath", "false".into()),
                ("diff.noprefix", "false".into()),
                // The quarantine is scratch until the push is accepted: its pack is not synced to
                // disk (three fsyncs, on the push's path).
                ("core.fsync", "none".into()),
            ]);
        for arg in args {
            command = command.arg(*arg);
        }
        command
    };

    // The pack, with the bases of its deltas fetched from the trusted stores.
    let mut indexed = Vec::new();
    run(
        context,
        git(&["index-pack", "--stdin", "--fix-thin"]),
        Input::File {
            path: request.clone(),
            offset: pack_offset,
        },
        |chunk| indexed.extend_from_slice(chunk),
    )
    .await
    .map_err(|e| format!("the pushed pack could not be indexed: {e}"))?;
    let hash = String::from_utf8_lossy(&indexed);
    let hash = hash.split_whitespace().last().unwrap_or_default().to_owned();
    let index = quarantine.git_dir().join(format!("objects/pack/pack-{hash}.idx"));
    if hash.len() != format.hex_len() || !index.is_file() {
        return Err("the pushed pack could not be indexed".into());
    }

    // Every object of the pack (read from the index git just wrote), then their types.
    let index_file = std::fs::read(&index).map_err(|e| format!("cannot read the pack's index: {e}"))?;
    let pack_oids = pack_index_oids(&index_file, format)?;
    let mut cat_file = CatFile::start(context, git(&["cat-file", CAT_FILE_FORMAT, "--buffer"])).await?;
    let types = cat_file.types(&pack_oids).await?;
    let in_pack: HashSet<&str> = types.iter().map(|(oid, _)| oid.as_str()).collect();
    let commits: Vec<String> = types
        .iter()
        .filter(|(_, kind)| kind == "commit")
        .map(|(oid, _)| oid.clone())
        .collect();

    // Each commit's whole object is pushed content; its parents are read from it.
    let known = context.known;
    let mut scanner = PatchScanner::new(known);
    let mut first_parents: Vec<(String, Option<String>)> = Vec::new();
    let mut parents_to_check: Vec<String> = Vec::new();
    let mut seen_parents: HashSet<String> = HashSet::new();
    let mut parser = BatchParser::new(MAX_COMMIT_BYTES);
    let mut failure = None;
    cat_file
        .contents(&commits, &mut parser, |item| match item {
            Ok(object) => {
                let origin = format!("the commit object {}", short(&object.oid));
                for line in object.content.split(|b| *b == b'\n') {
                    scanner.added(&origin, line);
                }
                let parents = match commit_parents(&object.content, format) {
                    Ok(parents) => parents,
                    Err(malformed) => {
                        failure.get_or_insert(format!("commit {} {malformed}", short(&object.oid)));
                        return;
                    }
                };
                for parent in &parents {
                    if !in_pack.contains(parent.as_str()) && seen_parents.insert(parent.clone()) {
                        parents_to_check.push(parent.clone());
                    }
                }
                first_parents.push((object.oid, parents.into_iter().next()));
            }
            Err(error) => {
                failure.get_or_insert(error);
            }
        })
        .await
        .map_err(|e| format!("cannot read the pushed commits: {e}"))?;
    if let Some(error) = failure {
        return Err(error);
    }
    if first_parents.len() != commits.len() {
        return Err("cannot read every pushed commit".into());
    }

    // Parents must come from the trusted stores (or the pack itself), and be commits; a branch points
    // at a commit. One lookup answers both, in order.
    let tips: Vec<String> = updates.iter().map(|u| u.new.to_ascii_lowercase()).collect();
    let parent_count = parents_to_check.len();
    let mut lookups = parents_to_check;
    lookups.extend(tips);
    let mut looked_up = cat_file.types(&lookups).await?;
    cat_file
        .end()
        .await
        .map_err(|e| format!("cannot look up the pushed objects: {e}"))?;
    let tip_types = looked_up.split_off(parent_count);
    for (parent, kind) in &looked_up {
        if kind != "commit" {
            let child = first_parents
                .iter()
                .find(|(_, p)| p.as_deref() == Some(parent.as_str()))
                .map_or_else(|| "a pushed commit".to_owned(), |(c, _)| format!("commit {}", short(c)));
            return Err(format!(
                "{child} has parent {}, which is not in the session's repository (its mirror or its earlier pushes): \
                 the push cannot be checked",
                short(parent)
            ));
        }
    }
    if let Some((tip, kind)) = tip_types.iter().find(|(_, kind)| kind != "commit" && kind != "missing") {
        return Err(format!("{} is a {kind}, not a commit", short(tip)));
    }

    // The lines each commit adds to its first parent (or to nothing).
    let mut input = String::new();
    for (commit, parent) in &first_parents {
        input.push_str(commit);
        if let Some(parent) = parent {
            input.push(' ');
            input.push_str(parent);
        }
        input.push('\n');
    }
    let mut commit_of_findings: Vec<(usize, String)> = Vec::new();
    let mut current = String::new();
    let mut splitter = LineSplitter::new(MAX_LINE, LINE_OVERLAP);
    let hex_len = format.hex_len();
    run(
        context,
        git(&[
            "diff-tree",
            "--stdin",
            "--root",
            "-r",
            "-p",
            "--text",
            "--no-textconv",
            "--no-ext-diff",
            "--no-color",
            "--no-renames",
            "--unified=0",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            "--ignore-submodules=none",
        ]),
        Input::Bytes(input.into_bytes()),
        |chunk| {
            splitter.push(chunk, &mut |piece| {
                let before = scanner.findings().len();
                match piece {
                    Piece::Line(line) => {
                        if !scanner.in_hunk() && line.len() == hex_len && line.iter().all(u8::is_ascii_hexdigit) {
                            current = String::from_utf8_lossy(line).into_owned();
                        } else {
                            scanner.line(line);
                        }
                    }
                    Piece::Continuation(piece) => scanner.continuation(piece),
                }
                if scanner.findings().len() > before {
                    commit_of_findings.push((before, current.clone()));
                }
            })
        },
    )
    .await
    .map_err(|e| format!("cannot read the pushed changes: {e}"))?;
    splitter.finish(&mut |piece| match piece {
        Piece::Line(line) => scanner.line(line),
        Piece::Continuation(piece) => scanner.continuation(piece),
    });

    let findings = scanner.into_findings();
    if findings.is_empty() {
        return Ok(Verdict::Clean);
    }
    Ok(Verdict::Secret(secret_reason(&findings, &commit_of_findings)))
}

/// The refusal's sentence: what was found where (kinds, files, commits; never a value).
fn secret_reason(findings: &[Finding], commits: &[(usize, String)]) -> String {
    let mut named: Vec<String> = Vec::new();
    for (index, finding) in findings.iter().enumerate().take(3) {
        let commit = commits
            .iter()
            .rev()
            .find(|(first, _)| *first <= index)
            .map(|(_, commit)| commit.as_str())
            .filter(|c| !c.is_empty() && !finding.file.starts_with("the commit object"));
        let what = sortie_secrets::describe(std::slice::from_ref(finding));
        named.push(match commit {
            Some(commit) => format!("{what} (commit {})", short(commit)),
            None => what,
        });
    }
    let more = findings.len().saturating_sub(named.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!(
        "the push seems to contain a secret: {}{more}; remove it from every pushed commit (rewrite the history), then push again",
        named.join(", ")
    )
}

fn short(oid: &str) -> &str {
    oid.get(..12).unwrap_or(oid)
}

/// The object names a version-2 pack index lists (`git index-pack` writes no other): after the
/// 8-byte header, 256 big-endian fan-out counts (the last is the number of objects), then the names,
/// sorted. Read in place of a `git show-index` child; anything else is refused.
fn pack_index_oids(index: &[u8], format: ObjectFormat) -> Result<Vec<String>, String> {
    const HEADER: usize = 8;
    const FANOUT: usize = 256 * 4;
    let malformed = |what: &str| format!("the pushed pack's index is not one git writes: {what}");
    if index.get(..HEADER) != Some(b"\xfftOc\x00\x00\x00\x02".as_slice()) {
        return Err(malformed("not a version 2 index"));
    }
    let last = index
        .get(HEADER + FANOUT - 4..HEADER + FANOUT)
        .and_then(|count| <[u8; 4]>::try_from(count).ok())
        .ok_or_else(|| malformed("it ends in its fan-out table"))?;
    let count = u32::from_be_bytes(last) as usize;
    let width = format.hex_len() / 2;
    let names = count
        .checked_mul(width)
        .and_then(|len| index.get(HEADER + FANOUT..HEADER + FANOUT + len))
        .ok_or_else(|| malformed("it ends before its object names"))?;
    Ok(names
        .chunks_exact(width)
        .map(|name| {
            name.iter().fold(String::with_capacity(width * 2), |mut hex, byte| {
                let _ = write!(hex, "{byte:02x}");
                hex
            })
        })
        .collect())
}

/// The format of every answer of the scan's `cat-file`: `<oid> <type> <size>`, or `<oid> missing`.
const CAT_FILE_FORMAT: &str = "--batch-command=%(objectname) %(objecttype) %(objectsize)";

/// The scan's one `git cat-file --batch-command --buffer`, asked in rounds (each round's questions
/// depend on the answers before): a round writes its commands and a `flush`, and reads git's answers
/// while it writes, so neither side ever waits on a full pipe. One process where three ran.
struct CatFile {
    child: tokio::process::Child,
    /// Dropped at the end: git sees the end of its input only once the pipe is closed.
    stdin: Option<tokio::process::ChildStdin>,
    stdout: tokio::process::ChildStdout,
    errors: tokio::task::JoinHandle<Vec<u8>>,
    buffer: Vec<u8>,
}

impl CatFile {
    async fn start(context: &ScanContext<'_>, command: GitCommand) -> Result<Self, String> {
        let process::Spawned {
            child,
            stdin,
            stdout,
            stderr,
        } = context.spawner.spawn(command).await.map_err(|e| e.to_string())?;
        let errors = tokio::spawn(stderr_tail_of(stderr));
        Ok(Self {
            child,
            stdin: Some(stdin),
            stdout,
            errors,
            buffer: vec![0_u8; 64 << 10],
        })
    }

    /// Writes `command` before each of `oids`, then `flush`, and hands git's answers to `on_output`
    /// until it says they are all in (`true`); git ending first is an error.
    async fn round(
        &mut self,
        command: &str,
        oids: &[String],
        mut on_output: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), String> {
        let mut commands = Vec::with_capacity(oids.len() * (command.len() + 66) + 6);
        for oid in oids {
            commands.extend_from_slice(command.as_bytes());
            commands.push(b' ');
            commands.extend_from_slice(oid.as_bytes());
            commands.push(b'\n');
        }
        commands.extend_from_slice(b"flush\n");
        let Self {
            stdin, stdout, buffer, ..
        } = self;
        let writer = async move {
            // A child that stopped reading says why on stderr (read at the end).
            if let Some(stdin) = stdin.as_mut() {
                let _ = stdin.write_all(&commands).await;
                let _ = stdin.flush().await;
            }
        };
        let reader = async move {
            loop {
                match stdout.read(buffer).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => {
                        if on_output(&buffer[..n]) {
                            return true;
                        }
                    }
                }
            }
        };
        let ((), answered) = tokio::join!(writer, reader);
        if answered {
            Ok(())
        } else {
            Err(self
                .end()
                .await
                .err()
                .unwrap_or_else(|| "git ended before it answered".into()))
        }
    }

    /// The type of each of `oids` (`missing` for one no store has), in order.
    async fn types(&mut self, oids: &[String]) -> Result<Vec<(String, String)>, String> {
        if oids.is_empty() {
            return Ok(Vec::new());
        }
        let mut types = Vec::with_capacity(oids.len());
        let mut splitter = LineSplitter::new(512, 0);
        let mut cut = false;
        let wanted = oids.len();
        self.round("info", oids, |chunk| {
            splitter.push(chunk, &mut |piece| match piece {
                Piece::Line(line) => {
                    let line = String::from_utf8_lossy(line);
                    let mut fields = line.split(' ');
                    if let (Some(oid), Some(kind)) = (fields.next(), fields.next()) {
                        types.push((oid.to_owned(), kind.to_owned()));
                    }
                }
                // No answer of git's to a name is this long: the line was not a name.
                Piece::Continuation(_) => cut = true,
            });
            cut || types.len() >= wanted
        })
        .await
        .map_err(|e| format!("cannot look up the pushed objects: {e}"))?;
        if cut {
            return Err("cannot look up the pushed objects: git answered a line too long to be an object's".into());
        }
        if types.len() != oids.len() {
            return Err("cannot look up every pushed object".into());
        }
        Ok(types)
    }

    /// Each of `oids` whole, in order, to `on_object` (an object larger than `parser` keeps, or a
    /// missing one, is an error it is handed).
    async fn contents(
        &mut self,
        oids: &[String],
        parser: &mut BatchParser,
        mut on_object: impl FnMut(Result<BatchObject, String>),
    ) -> Result<(), String> {
        if oids.is_empty() {
            return Ok(());
        }
        let (wanted, mut answered) = (oids.len(), 0);
        self.round("contents", oids, |chunk| {
            parser.push(chunk, &mut |item| {
                answered += 1;
                on_object(item);
            });
            parser.stopped() || answered >= wanted
        })
        .await
    }

    /// Closes git's input and waits for its end: an error names its exit and the tail of its stderr.
    async fn end(&mut self) -> Result<(), String> {
        drop(self.stdin.take());
        let status = self.child.wait().await.map_err(|e| e.to_string())?;
        let said = (&mut self.errors).await.unwrap_or_default();
        if status.success() {
            Ok(())
        } else {
            Err(format!("git {status}: {}", process::stderr_tail(&said)))
        }
    }
}

/// What a child says on stderr, up to [`MAX_STDERR`] bytes kept (the rest read and dropped).
async fn stderr_tail_of(mut stderr: tokio::process::ChildStderr) -> Vec<u8> {
    let mut said = Vec::new();
    let mut buffer = vec![0_u8; 8 << 10];
    loop {
        match stderr.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) if said.len() < MAX_STDERR => said.extend_from_slice(&buffer[..n]),
            Ok(_) => {}
        }
    }
    said
}

/// What a child reads on its stdin.
pub(crate) enum Input {
    Bytes(Vec<u8>),
    /// A file from `offset` to its end.
    File {
        path: PathBuf,
        offset: u64,
    },
}

/// Runs a scan child to its end: `input` on its stdin, its stdout handed to `on_output` chunk by
/// chunk; an error names its exit and the tail of its stderr.
pub(crate) async fn run(
    context: &ScanContext<'_>,
    command: GitCommand,
    input: Input,
    mut on_output: impl FnMut(&[u8]),
) -> Result<(), String> {
    let spawned = context.spawner.spawn(command).await.map_err(|e| e.to_string())?;
    let process::Spawned {
        mut child,
        mut stdin,
        mut stdout,
        stderr,
    } = spawned;
    let writer = async move {
        let result: std::io::Result<()> = async {
            match input {
                Input::Bytes(bytes) => stdin.write_all(&bytes).await?,
                Input::File { path, offset } => {
                    let mut file = tokio::fs::File::open(&path).await?;
                    file.seek(std::io::SeekFrom::Start(offset)).await?;
                    tokio::io::copy(&mut file, &mut stdin).await?;
                }
            }
            stdin.shutdown().await
        }
        .await;
        // A child that stops reading early says why on stderr; the broken pipe adds nothing.
        drop(result);
    };
    let reader = async {
        let mut buffer = vec![0_u8; 64 << 10];
        loop {
            match stdout.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => on_output(&buffer[..n]),
            }
        }
    };
    let errors = stderr_tail_of(stderr);
    let ((), (), said) = tokio::join!(writer, reader, errors);
    let status = child.wait().await.map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("git {status}: {}", process::stderr_tail(&said)))
    }
}

/// The number of objects the pack at `offset` of `path` announces; `None` when there is no pack.
async fn pack_object_count(path: &Path, offset: u64) -> std::io::Result<Option<u32>> {
    let mut file = tokio::fs::File::open(path).await?;
    file.seek(std::io::SeekFrom::Start(offset)).await?;
    let mut header = Vec::with_capacity(12);
    (&mut file).take(12).read_to_end(&mut header).await?;
    Ok(parse_pack_header(&header))
}

/// `PACK`, a version (2 or 3), then the object count, big-endian. `None`: no (readable) header;
/// the scan then lets index-pack say what is wrong with anything that is not empty.
fn parse_pack_header(header: &[u8]) -> Option<u32> {
    if header.is_empty() {
        return None;
    }
    match header {
        [b'P', b'A', b'C', b'K', _, _, _, _, a, b, c, d] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        // Not a pack header: index-pack refuses it (a count of u32::MAX forces that path).
        _ => Some(u32::MAX),
    }
}

/// The parents of a commit object (its `parent` header lines, before the first blank line).
/// The parents a commit object names in its header. Each must be an object name of the repository's
/// format, lowercase hex and nothing else: a pushed commit is hostile, and a `parent` line of any other
/// text would be looked up (and answered) as something it is not, and skipped by the diff that scans
/// its changes.
fn commit_parents(content: &[u8], format: ObjectFormat) -> Result<Vec<String>, String> {
    let mut parents = Vec::new();
    for line in content.split(|b| *b == b'\n') {
        if line.is_empty() {
            break;
        }
        if let Some(oid) = line.strip_prefix(b"parent ") {
            let plain = oid.len() == format.hex_len() && oid.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !plain {
                return Err("has a parent line that is not an object name: the push cannot be checked".into());
            }
            parents.push(String::from_utf8_lossy(oid).into_owned());
        }
    }
    Ok(parents)
}

/// One piece of output from a [`LineSplitter`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// A whole line (without its newline), or the start of one longer than the cap.
    Line(&'a [u8]),
    /// More of a line that was longer than the cap; it repeats the end of the piece before.
    Continuation(&'a [u8]),
}

/// Splits output into lines of at most `max` bytes: a longer line comes as its start, then as
/// continuations that each repeat the last `overlap` bytes of the piece before (so nothing shorter
/// than `overlap` is ever cut in two).
pub(crate) struct LineSplitter {
    max: usize,
    overlap: usize,
    pending: Vec<u8>,
    cut: bool,
}

impl LineSplitter {
    pub fn new(max: usize, overlap: usize) -> Self {
        Self {
            max: max.max(overlap + 1),
            overlap,
            pending: Vec::new(),
            cut: false,
        }
    }

    pub fn push(&mut self, mut chunk: &[u8], emit: &mut impl FnMut(Piece<'_>)) {
        while let Some(newline) = chunk.iter().position(|b| *b == b'\n') {
            self.pending.extend_from_slice(&chunk[..newline]);
            self.spill(emit);
            self.flush_pending(emit);
            chunk = &chunk[newline + 1..];
        }
        self.pending.extend_from_slice(chunk);
        self.spill(emit);
    }

    /// The last line, if the output did not end with a newline.
    pub fn finish(&mut self, emit: &mut impl FnMut(Piece<'_>)) {
        if !self.pending.is_empty() || self.cut {
            self.flush_pending(emit);
        }
    }

    /// Hands out full pieces while more than `max` bytes wait.
    fn spill(&mut self, emit: &mut impl FnMut(Piece<'_>)) {
        while self.pending.len() > self.max {
            let piece = &self.pending[..self.max];
            emit(if self.cut {
                Piece::Continuation(piece)
            } else {
                Piece::Line(piece)
            });
            self.cut = true;
            self.pending.drain(..self.max - self.overlap);
        }
    }

    fn flush_pending(&mut self, emit: &mut impl FnMut(Piece<'_>)) {
        emit(if self.cut {
            Piece::Continuation(&self.pending)
        } else {
            Piece::Line(&self.pending)
        });
        self.pending.clear();
        self.cut = false;
    }
}

/// One object of `git cat-file --batch` output.
pub(crate) struct BatchObject {
    pub oid: String,
    pub content: Vec<u8>,
}

/// Reads `git cat-file --batch` output (`<oid> <type> <size>\n<content>\n`, or `<oid> missing\n`),
/// keeping objects of at most `max` bytes (a larger one is an error, and so is a missing one).
pub(crate) struct BatchParser {
    max: usize,
    buffer: Vec<u8>,
    /// The object being read: its oid and size.
    reading: Option<(String, usize)>,
    /// An object was too large: nothing after it is read (the scan fails anyway).
    stopped: bool,
}

impl BatchParser {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            buffer: Vec::new(),
            reading: None,
            stopped: false,
        }
    }

    /// Whether it stopped reading (an object was too large): no answer after it is read.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    pub fn push(&mut self, chunk: &[u8], emit: &mut impl FnMut(Result<BatchObject, String>)) {
        if self.stopped {
            return;
        }
        self.buffer.extend_from_slice(chunk);
        loop {
            match &self.reading {
                None => {
                    let Some(newline) = self.buffer.iter().position(|b| *b == b'\n') else {
                        if self.buffer.len() > 512 {
                            emit(Err("git's object listing is not readable".into()));
                            self.buffer.clear();
                        }
                        return;
                    };
                    let header = String::from_utf8_lossy(&self.buffer[..newline]).into_owned();
                    self.buffer.drain(..=newline);
                    let fields: Vec<&str> = header.split(' ').collect();
                    match fields.as_slice() {
                        [oid, "missing"] => emit(Err(format!("the pushed object {} is missing", short(oid)))),
                        [oid, _kind, size] => match size.parse::<usize>() {
                            Ok(size) if size <= self.max => self.reading = Some(((*oid).to_owned(), size)),
                            Ok(_) => {
                                emit(Err(format!(
                                    "the pushed commit {} is larger than {} MiB",
                                    short(oid),
                                    self.max >> 20
                                )));
                                self.buffer.clear();
                                self.stopped = true;
                                return;
                            }
                            Err(_) => emit(Err("git's object listing is not readable".into())),
                        },
                        _ => emit(Err("git's object listing is not readable".into())),
                    }
                }
                Some((oid, size)) => {
                    let (oid, size) = (oid.clone(), *size);
                    if self.buffer.len() < size + 1 {
                        return;
                    }
                    let content = self.buffer[..size].to_vec();
                    self.buffer.drain(..=size);
                    self.reading = None;
                    emit(Ok(BatchObject { oid, content }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(oids: &[String]) -> Vec<u8> {
        oids.iter().flat_map(|oid| oid.bytes().chain([b'\n'])).collect()
    }

    fn split(max: usize, overlap: usize, chunks: &[&[u8]]) -> Vec<(bool, String)> {
        let mut splitter = LineSplitter::new(max, overlap);
        let mut out = Vec::new();
        let mut emit = |piece: Piece<'_>| {
            out.push(match piece {
                Piece::Line(line) => (true, String::from_utf8_lossy(line).into_owned()),
                Piece::Continuation(rest) => (false, String::from_utf8_lossy(rest).into_owned()),
            })
        };
        for chunk in chunks {
            splitter.push(chunk, &mut emit);
        }
        splitter.finish(&mut emit);
        out
    }

    #[test]
    fn lines_are_whole_up_to_the_cap_and_overlap_past_it() {
        let line = |text: &str| (true, text.to_owned());
        let more = |text: &str| (false, text.to_owned());
        assert_eq!(
            split(8, 2, &[b"ab\ncd", b"ef\n\ng"]),
            vec![line("ab"), line("cdef"), line(""), line("g")]
        );
        assert_eq!(
            split(4, 1, &[b"abcdefghij\nx\n"]),
            vec![line("abcd"), more("defg"), more("ghij"), line("x")]
        );
        assert_eq!(split(4, 1, &[b"abcd", b"e", b"\n"]), vec![line("abcd"), more("de")]);
        assert_eq!(split(4, 0, &[b""]), Vec::<(bool, String)>::new());
        // A key longer than nothing but the overlap is whole in one piece, however the output is cut.
        let key = b"AKIAZQ3DRSTUVWXY2345";
        let text: Vec<u8> = [&[b'x'; 37][..], key, &[b'y'; 50][..], b"\n"].concat();
        for chunk in [1, 3, 64] {
            let chunks: Vec<&[u8]> = text.chunks(chunk).collect();
            let pieces = split(32, 24, &chunks);
            assert!(
                pieces.iter().any(|(_, p)| p.contains("AKIAZQ3DRSTUVWXY2345")),
                "{chunk}: {pieces:?}"
            );
        }
    }

    #[test]
    fn batch_output_is_read_object_by_object_and_bounded() {
        let a = "a".repeat(40);
        let b = "b".repeat(40);
        let output = format!("{a} commit 5\ntree \n{b} commit 3\nxyz\n");
        for cut in [1, 2, 7, 1000] {
            let mut parser = BatchParser::new(100);
            let mut objects = Vec::new();
            for chunk in output.as_bytes().chunks(cut) {
                parser.push(chunk, &mut |item| objects.push(item.map(|o| (o.oid, o.content))));
            }
            assert_eq!(
                objects,
                vec![Ok((a.clone(), b"tree ".to_vec())), Ok((b.clone(), b"xyz".to_vec()))]
            );
        }
        let mut parser = BatchParser::new(4);
        let mut results = Vec::new();
        parser.push(output.as_bytes(), &mut |item| results.push(item.is_ok()));
        assert_eq!(
            results,
            vec![false],
            "an oversized commit is an error and ends the reading"
        );
        let mut parser = BatchParser::new(4);
        let mut errors = Vec::new();
        parser.push(format!("{a} missing\n").as_bytes(), &mut |item| {
            errors.push(item.err().unwrap_or_default())
        });
        assert!(errors[0].contains("missing"));
    }

    #[test]
    fn a_pack_index_lists_what_git_show_index_lists() {
        let dir = tempfile::tempdir().expect("temp");
        let git = |args: &[&str], input: Option<&[u8]>| {
            use std::io::Write;
            let mut child = std::process::Command::new("git")
                .args(args)
                .current_dir(dir.path())
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_CONFIG_GLOBAL", "/dev/null")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("git");
            let mut stdin = child.stdin.take().expect("stdin");
            stdin.write_all(input.unwrap_or_default()).expect("write");
            drop(stdin);
            let output = child.wait_with_output().expect("git ran");
            assert!(output.status.success(), "git {args:?}");
            output.stdout
        };
        git(&["init", "-q", "--bare", "."], None);
        let blobs: Vec<String> = (0..300)
            .map(|i| {
                let oid = git(
                    &["hash-object", "-w", "--stdin"],
                    Some(format!("blob {i}\n").as_bytes()),
                );
                String::from_utf8_lossy(&oid).trim().to_owned()
            })
            .collect();
        let pack = git(&["pack-objects", "--stdout"], Some(lines_of(&blobs).as_slice()));
        let written = git(&["index-pack", "--stdin", "-o", "p.idx", "p.pack"], Some(&pack));
        assert!(!written.is_empty());
        let index = std::fs::read(dir.path().join("p.idx")).expect("idx");
        let shown = git(&["show-index"], Some(&index));
        let mut expected: Vec<String> = String::from_utf8_lossy(&shown)
            .lines()
            .filter_map(|line| line.split(' ').nth(1).map(str::to_owned))
            .collect();
        expected.sort();
        let listed = pack_index_oids(&index, ObjectFormat::Sha1).expect("a real index");
        assert_eq!(listed.len(), 300);
        assert_eq!(listed, expected, "sorted, as the index keeps them");

        // Cut short, or not an index at all: refused, never read past its end.
        for cut in [0, 7, 8 + 1020, 8 + 1024, 8 + 1024 + 20 * 300 - 1] {
            assert!(
                pack_index_oids(&index[..cut], ObjectFormat::Sha1).is_err(),
                "cut at {cut}"
            );
        }
        let mut version_one = index.clone();
        version_one[7] = 1;
        assert!(pack_index_oids(&version_one, ObjectFormat::Sha1).is_err());
        let mut huge = index.clone();
        huge[8 + 1020..8 + 1024].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(pack_index_oids(&huge, ObjectFormat::Sha256).is_err());
    }

    #[test]
    fn parents_and_pack_headers() {
        let (a, b) = ("a".repeat(40), "b".repeat(40));
        let commit = format!("tree 1111\nparent {a}\nparent {b}\nauthor x <x@y> 1 +0000\n\nmessage\nparent cccc\n");
        assert_eq!(
            commit_parents(commit.as_bytes(), ObjectFormat::Sha1),
            Ok(vec![a.clone(), b])
        );
        assert_eq!(commit_parents(b"tree 1111\n\n", ObjectFormat::Sha1), Ok(Vec::new()));
        // A parent line of anything but a name of the repository's format is refused, not looked up:
        // `x commit<spaces>y` would read back from a cut batch-check line as a commit.
        let hostile = format!("tree 1111\nparent x commit{}y\n\n", " ".repeat(504));
        for commit in [
            hostile,
            format!("tree 1\nparent {a} \n\n"),
            format!("tree 1\nparent {}\n\n", a.to_uppercase()),
        ] {
            assert!(
                commit_parents(commit.as_bytes(), ObjectFormat::Sha1).is_err(),
                "{commit:?}"
            );
        }
        assert!(commit_parents(format!("tree 1\nparent {a}\n\n").as_bytes(), ObjectFormat::Sha256).is_err());
        assert_eq!(parse_pack_header(b""), None);
        assert_eq!(parse_pack_header(b"PACK\0\0\0\x02\0\0\0\x03"), Some(3));
        assert_eq!(parse_pack_header(b"PACK\0\0\0\x02\0\0\0\0"), Some(0));
        assert_eq!(parse_pack_header(b"PAC"), Some(u32::MAX));
        assert_eq!(parse_pack_header(b"junkjunkjunk"), Some(u32::MAX));
    }
}
