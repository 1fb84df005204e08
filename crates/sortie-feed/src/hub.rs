//! The turn hub: every part of a turn in memory for any number of subscribers, and (optionally) in
//! the turn's append-only log `turns/{n}.jsonl`.
//!
//! Publishing never waits for a subscriber: parts go into a shared list and a `watch` channel says
//! "there is more"; each subscriber reads from its own position at its own pace. Memory is bounded:
//! past [`HUB_MEMORY_LIMIT`] bytes the oldest parts leave memory (the log is flushed first), and a
//! subscriber that needs them reads them from the log. The log is buffered and flushed when parts
//! leave memory and when the turn ends: the worker's recorder, not the log, is the live copy.
//! `?after=K` resumes exactly after part K: no gap, no duplicate.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use sortie_protocol::chunk::UiChunk;
use tokio::sync::watch;

/// Encoded parts a hub keeps in memory before it serves the oldest from the log instead.
pub const HUB_MEMORY_LIMIT: usize = 64 * 1024 * 1024;

/// One part: its index in the turn and its chunk as JSON, shared by every subscriber.
pub type Part = (u64, Arc<str>);

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("turn log {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
}

struct Inner {
    /// Parts from `first_index` on; earlier ones are only in the log.
    parts: Vec<Arc<str>>,
    first_index: u64,
    bytes: usize,
    done: bool,
    log: Option<BufWriter<File>>,
    log_failed: bool,
}

pub struct TurnHub {
    n: u32,
    log_path: Option<PathBuf>,
    memory_limit: usize,
    inner: Mutex<Inner>,
    /// The number of parts published; `changed` wakes subscribers (and carries `done` via `inner`).
    published: watch::Sender<u64>,
}

impl TurnHub {
    /// A hub for turn `n`, logging to `log_path` (created, or truncated if a previous attempt left one).
    pub fn new(n: u32, log_path: Option<PathBuf>, memory_limit: usize) -> Result<Arc<Self>, HubError> {
        let log = match &log_path {
            Some(path) => {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(|source| HubError::Log {
                        path: path.clone(),
                        source,
                    })?;
                }
                Some(BufWriter::new(File::create(path).map_err(|source| HubError::Log {
                    path: path.clone(),
                    source,
                })?))
            }
            None => None,
        };
        let inner = Inner {
            parts: Vec::new(),
            first_index: 0,
            bytes: 0,
            done: false,
            log,
            log_failed: false,
        };
        Ok(Arc::new(Self {
            n,
            log_path,
            memory_limit,
            inner: Mutex::new(inner),
            published: watch::channel(0).0,
        }))
    }

    /// A hub without a log (when the log cannot be created): everything stays in memory.
    pub fn in_memory(n: u32) -> Arc<Self> {
        Self::in_memory_from(n, 0)
    }

    /// A hub without a log whose first part gets index `first_index`: the parts before it are kept
    /// elsewhere (the host's store), and a subscriber asking for them gets nothing older than it.
    pub fn in_memory_from(n: u32, first_index: u64) -> Arc<Self> {
        let inner = Inner {
            parts: Vec::new(),
            first_index,
            bytes: 0,
            done: false,
            log: None,
            log_failed: false,
        };
        Arc::new(Self {
            n,
            log_path: None,
            memory_limit: usize::MAX,
            inner: Mutex::new(inner),
            published: watch::channel(first_index).0,
        })
    }

    pub fn turn(&self) -> u32 {
        self.n
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Appends chunks as the next parts. Ignored once the turn is done.
    pub fn publish(&self, chunks: &[UiChunk]) {
        if chunks.is_empty() {
            return;
        }
        let encoded: Vec<Arc<str>> = chunks.iter().map(|chunk| Arc::from(chunk.to_json())).collect();
        self.publish_encoded(encoded);
    }

    /// Appends chunks already encoded as JSON as the next parts; returns the index of the first one
    /// (`None` once the turn is done: nothing is added).
    pub fn publish_encoded(&self, encoded: impl IntoIterator<Item = Arc<str>>) -> Option<u64> {
        let (first, count) = {
            let mut inner = self.lock();
            if inner.done {
                return None;
            }
            let first = inner.first_index + inner.parts.len() as u64;
            for (index, json) in (first..).zip(encoded) {
                write_log_line(&mut inner, |w| writeln!(w, r#"{{"index":{index},"chunk":{json}}}"#));
                inner.bytes += json.len();
                inner.parts.push(json);
            }
            self.evict(&mut inner);
            (first, inner.first_index + inner.parts.len() as u64)
        };
        if count > first {
            self.published.send_replace(count);
        }
        Some(first)
    }

    /// Keeps an update the mapper did not understand, raw, in the log (not a part).
    pub fn log_raw(&self, raw: &Value) {
        let mut inner = self.lock();
        write_log_line(&mut inner, |w| writeln!(w, r#"{{"raw":{raw}}}"#));
    }

    /// Marks the turn done: subscribers drain and end. Flushes the log.
    pub fn finish(&self) {
        let count = {
            let mut inner = self.lock();
            inner.done = true;
            if let Some(log) = inner.log.as_mut() {
                let _ = log.flush();
                let _ = log.get_ref().sync_data();
            }
            inner.first_index + inner.parts.len() as u64
        };
        self.published.send_replace(count);
    }

    pub fn is_done(&self) -> bool {
        self.lock().done
    }

    /// How many parts were published.
    pub fn len(&self) -> u64 {
        let inner = self.lock();
        inner.first_index + inner.parts.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of encoded parts held in memory.
    pub fn memory_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The first part a subscriber gets whole from this hub: 0 when its log holds what left memory,
    /// else the first part it holds (the parts before it are kept elsewhere, or were lost with a log).
    pub fn serves_from(&self) -> u64 {
        let inner = self.lock();
        if self.log_path.is_some() && !inner.log_failed {
            0
        } else {
            inner.first_index
        }
    }

    /// Whether writing the log ever failed (the worker then relies on its own recording).
    pub fn log_failed(&self) -> bool {
        self.lock().log_failed
    }

    fn evict(&self, inner: &mut Inner) {
        if inner.bytes <= self.memory_limit || self.log_path.is_none() || inner.log_failed {
            return;
        }
        // Readers of evicted parts read the log: it must hold them before they leave memory.
        flush_log(inner);
        if inner.log_failed {
            return;
        }
        // Drop the oldest half of the budget at once, so eviction is rare.
        let target = self.memory_limit / 2;
        let mut dropped = 0;
        while inner.bytes > target && dropped < inner.parts.len() {
            inner.bytes -= inner.parts[dropped].len();
            dropped += 1;
        }
        inner.parts.drain(..dropped);
        inner.first_index += dropped as u64;
    }

    /// A subscriber that receives the parts after index `after` (all parts when `None`).
    pub fn subscribe(self: &Arc<Self>, after: Option<u64>) -> Subscription {
        Subscription {
            hub: self.clone(),
            next: after.map_or(0, |k| k + 1),
            changes: self.published.subscribe(),
        }
    }
}

fn write_log_line(inner: &mut Inner, write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) {
    if let Some(log) = inner.log.as_mut()
        && write(log).is_err()
    {
        inner.log_failed = true;
    }
}

fn flush_log(inner: &mut Inner) {
    if let Some(log) = inner.log.as_mut()
        && log.flush().is_err()
    {
        inner.log_failed = true;
    }
}

/// One reader of a hub.
pub struct Subscription {
    hub: Arc<TurnHub>,
    next: u64,
    changes: watch::Receiver<u64>,
}

impl Subscription {
    /// Waits for parts after the last one returned and appends up to `max` of them to `out`.
    /// Returns `false` when the turn is done and everything was returned.
    pub async fn next_batch(&mut self, max: usize, out: &mut Vec<Part>) -> bool {
        loop {
            let (from_memory, first_index, total, done) = {
                let inner = self.hub.lock();
                let total = inner.first_index + inner.parts.len() as u64;
                let mut from_memory = Vec::new();
                if self.next >= inner.first_index && self.next < total {
                    let start = (self.next - inner.first_index) as usize;
                    let end = (start + max).min(inner.parts.len());
                    from_memory.extend(inner.parts[start..end].iter().cloned());
                }
                (from_memory, inner.first_index, total, inner.done)
            };
            if self.next < first_index {
                // Evicted from memory: read this stretch from the log.
                if let Some(path) = &self.hub.log_path {
                    let parts = read_log(
                        path,
                        self.next.checked_sub(1),
                        Some(first_index.min(self.next + max as u64)),
                    );
                    if let Ok(parts) = parts
                        && !parts.is_empty()
                    {
                        self.next = parts.last().map_or(self.next, |(i, _)| i + 1);
                        out.extend(parts);
                        return true;
                    }
                }
                // The log cannot serve it (it failed); skip to what memory has rather than hang.
                self.next = first_index;
                continue;
            }
            if !from_memory.is_empty() {
                for json in from_memory {
                    out.push((self.next, json));
                    self.next += 1;
                }
                return true;
            }
            if done && self.next >= total {
                return false;
            }
            if self.changes.changed().await.is_err() {
                return false;
            }
        }
    }

    /// The index the next part will have.
    pub fn position(&self) -> u64 {
        self.next
    }
}

/// Reads parts from a turn log: those with index > `after` and < `before`, in order. Raw lines and a
/// torn last line (the driver died mid-write) are skipped.
pub fn read_log(path: &Path, after: Option<u64>, before: Option<u64>) -> std::io::Result<Vec<Part>> {
    let mut parts = Vec::new();
    read_log_from(File::open(path)?, after, before, &LogBounds::UNBOUNDED, |part| {
        parts.push(part);
        std::ops::ControlFlow::Continue(())
    })?;
    Ok(parts)
}

/// How much of a log a reader takes: a line longer than `line_max` is skipped (not held), and reading
/// stops once `total_max` bytes of lines were read. A log written by someone the reader does not
/// trust (a sandbox) is read with both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogBounds {
    pub line_max: usize,
    pub total_max: u64,
}

impl LogBounds {
    pub const UNBOUNDED: Self = Self {
        line_max: usize::MAX,
        total_max: u64::MAX,
    };
}

/// Streams the parts of a log (as [`read_log`]) to `each`, which may stop the reading early; never
/// holds more than one line (of at most `bounds.line_max` bytes) at a time. Returns how many bytes
/// were read.
pub fn read_log_from(
    log: impl std::io::Read,
    after: Option<u64>,
    before: Option<u64>,
    bounds: &LogBounds,
    mut each: impl FnMut(Part) -> std::ops::ControlFlow<()>,
) -> std::io::Result<u64> {
    let first = after.map_or(0, |k| k + 1);
    let mut reader = BufReader::with_capacity(64 * 1024, log.take(bounds.total_max));
    let mut line = Vec::new();
    let mut read_total = 0_u64;
    loop {
        line.clear();
        let (read, complete) = read_line_bounded(&mut reader, &mut line, bounds.line_max)?;
        if read == 0 {
            break;
        }
        read_total += read as u64;
        // A line past the bound is skipped whole, and a torn last line is not a part.
        if !complete {
            continue;
        }
        // Bytes, not `lines()`: a line torn inside a multi-byte character is skipped, not an error
        // that would lose the whole log.
        let Ok(record) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        let (Some(index), Some(chunk)) = (record.get("index").and_then(Value::as_u64), record.get("chunk")) else {
            continue;
        };
        if index < first {
            continue;
        }
        if before.is_some_and(|b| index >= b) {
            break;
        }
        if each((index, Arc::from(chunk.to_string()))).is_break() {
            break;
        }
    }
    Ok(read_total)
}

/// Reads one line into `line`, keeping at most `max` bytes of it (the rest is consumed and dropped).
/// Returns the bytes consumed and whether the line was whole (ended by `\n` within the bound).
fn read_line_bounded(reader: &mut impl BufRead, line: &mut Vec<u8>, max: usize) -> std::io::Result<(usize, bool)> {
    let mut consumed = 0;
    let mut overflowed = false;
    loop {
        let available = reader.fill_buf()?;
        if available.is_empty() {
            return Ok((consumed, false));
        }
        let (take, ends) = match available.iter().position(|b| *b == b'\n') {
            Some(end) => (end + 1, true),
            None => (available.len(), false),
        };
        if !overflowed && line.len() + take <= max.saturating_add(1) {
            line.extend_from_slice(&available[..take]);
        } else {
            overflowed = true;
            line.clear();
        }
        reader.consume(take);
        consumed += take;
        if ends {
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            return Ok((consumed, !overflowed));
        }
    }
}

/// The log file of turn `n` under a driver's state directory.
pub fn log_path(turns_dir: &Path, n: u32) -> PathBuf {
    turns_dir.join(format!("{n}.jsonl"))
}
