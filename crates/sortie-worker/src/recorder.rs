//! The recorder (DESIGN §2 step 3): follows a running turn's stream on the driver and hands every event
//! to the turn's [`Transcript`], which decides what of it to keep. The stream is the sandbox's and
//! bounded before it is parsed: a line longer than [`STREAM_LINE_MAX_BYTES`] breaks it (DESIGN §9
//! invariant 10). After the sandbox is gone, [`harvest`] reads what its driver left in the turn log,
//! as untrusted as the stream: opened without following a link of the sandbox's, a regular file only,
//! bounded per line and in all.

use std::path::Path;

use futures::StreamExt;
use http_body_util::BodyExt;
use sortie_feed::hub::{LogBounds, read_log_from};
use sortie_protocol::driver::STREAM_LINE_MAX_BYTES;

use crate::client::DriverClient;
use crate::transcript::{TURN_BYTES_MAX, Transcript};

/// How a follow of the driver's stream ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Followed {
    /// The stream ended with `[DONE]`: the driver has nothing more of the turn.
    pub complete: bool,
    /// Events handed to the transcript.
    pub events: u64,
}

/// One event of the driver's stream: its `id:` and its `data:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub data: String,
}

/// Why the driver's stream could not be read on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("a line is longer than {0} bytes")]
    LineTooLong(usize),
    #[error("a line is not UTF-8")]
    NotUtf8,
}

/// A decoder of the driver's SSE (DESIGN §5.1: `id:` and `data:` lines, events ended by a blank
/// line, comments ignored), linear in the bytes it is given and bounded per line: a line longer
/// than `line_max` fails before it is held whole. (A general SSE parser re-reads a growing line at
/// every read; with a sandbox's 16 MiB lines that is quadratic.)
pub struct SseDecoder {
    line: Vec<u8>,
    line_max: usize,
    id: Option<String>,
    data: Option<String>,
    failed: bool,
}

impl SseDecoder {
    pub fn new(line_max: usize) -> Self {
        Self {
            line: Vec::new(),
            line_max,
            id: None,
            data: None,
            failed: false,
        }
    }

    /// Takes the next bytes of the stream and appends the events they complete to `events`.
    pub fn feed(&mut self, mut bytes: &[u8], events: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if self.failed {
            return Err(SseError::LineTooLong(self.line_max));
        }
        while !bytes.is_empty() {
            let (take, ends) = match bytes.iter().position(|b| *b == b'\n') {
                Some(end) => (end, true),
                None => (bytes.len(), false),
            };
            if self.line.len() + take > self.line_max {
                self.failed = true;
                self.line = Vec::new();
                return Err(SseError::LineTooLong(self.line_max));
            }
            self.line.extend_from_slice(&bytes[..take]);
            bytes = &bytes[(take + usize::from(ends))..];
            if ends {
                self.line_done(events)?;
            }
        }
        Ok(())
    }

    fn line_done(&mut self, events: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut line = std::mem::take(&mut self.line);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                events.push(SseEvent {
                    id: self.id.take(),
                    data,
                });
            }
            self.id = None;
            return Ok(());
        }
        let text = String::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
        let (field, value) = match text.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (text.as_str(), ""),
        };
        match field {
            "id" => self.id = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            // Comments (heartbeats) and fields the driver does not send.
            _ => {}
        }
        Ok(())
    }
}

/// Follows turn `n` on the driver from the part after the transcript's cursor until `[DONE]` or a
/// break, handing each event to the transcript.
pub async fn follow(driver: &DriverClient, n: u32, transcript: &Transcript) -> Followed {
    let mut followed = Followed::default();
    let Ok(body) = driver.stream(n, transcript.driver_cursor()).await else {
        return followed;
    };
    let mut body = body.into_data_stream();
    let mut decoder = SseDecoder::new(STREAM_LINE_MAX_BYTES);
    let mut events = Vec::new();
    while let Some(Ok(bytes)) = body.next().await {
        if let Err(error) = decoder.feed(&bytes, &mut events) {
            // What was taken stays; the caller decides whether the driver lives.
            tracing::warn!(%error, session = %transcript.session_id, turn = n, "the driver's stream broke");
            return followed;
        }
        for event in events.drain(..) {
            if event.data == "[DONE]" {
                followed.complete = true;
                return followed;
            }
            let Some(index) = event.id.and_then(|id| id.parse::<u64>().ok()) else {
                continue;
            };
            followed.events += 1;
            transcript.agent(index, event.data).await;
        }
    }
    // The stream broke: what was taken stays; the caller decides.
    followed
}

/// Hands the parts of the turn log a sandbox's driver left (`$HOME/.sortie/turns/{n}.jsonl`) after the
/// transcript's cursor to the transcript, for a turn whose sandbox is gone. Only call it once nothing
/// runs in the sandbox: the file is the sandbox's. Returns how many parts were handed over.
pub async fn harvest(home: &Path, transcript: &Transcript) -> u64 {
    let home = home.to_owned();
    let n = transcript.n;
    let after = transcript.driver_cursor();
    let (parts_tx, mut parts_rx) = tokio::sync::mpsc::channel::<(u64, String)>(256);
    let reading = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        let log = open_under(&home, &[".sortie", "turns", &format!("{n}.jsonl")])?;
        let bounds = LogBounds {
            line_max: STREAM_LINE_MAX_BYTES,
            total_max: TURN_BYTES_MAX * 2,
        };
        read_log_from(log, after, None, &bounds, |(index, json)| {
            if parts_tx.blocking_send((index, json.to_string())).is_err() {
                return std::ops::ControlFlow::Break(());
            }
            std::ops::ControlFlow::Continue(())
        })
    });
    let mut handed = 0;
    while let Some((index, json)) = parts_rx.recv().await {
        transcript.agent(index, json).await;
        handed += 1;
    }
    if let Ok(Err(error)) = reading.await
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::info!(%error, session = %transcript.session_id, turn = n, "the turn log was not read");
    }
    handed
}

/// Opens `root/components…` for reading without following a symbolic link at any step below `root`
/// (the sandbox owns everything under it), and only if the last one is a regular file (never a FIFO
/// or a device that could block or feed the host without end).
pub fn open_under(root: &Path, components: &[&str]) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    let (last, dirs) = components
        .split_last()
        .ok_or_else(|| std::io::Error::other("no file named"))?;
    let directory = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = nix::fcntl::open(root, directory, Mode::empty()).map_err(std::io::Error::from)?;
    for name in dirs {
        dir = openat(&dir, *name, directory, Mode::empty()).map_err(std::io::Error::from)?;
    }
    let file = openat(
        &dir,
        *last,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(std::io::Error::from)?;
    let file = std::fs::File::from(file);
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&[u8]], max: usize) -> Result<Vec<SseEvent>, SseError> {
        let mut decoder = SseDecoder::new(max);
        let mut events = Vec::new();
        for chunk in chunks {
            decoder.feed(chunk, &mut events)?;
        }
        Ok(events)
    }

    #[test]
    fn events_are_read_wherever_the_bytes_are_split() {
        let stream = b"id: 1\ndata: {\"a\":1}\n\n: keep-alive\n\nid: 2\r\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        let expected = vec![
            SseEvent {
                id: Some("1".into()),
                data: r#"{"a":1}"#.into(),
            },
            SseEvent {
                id: Some("2".into()),
                data: "x\ny".into(),
            },
            SseEvent {
                id: None,
                data: "[DONE]".into(),
            },
        ];
        for split in 0..=stream.len() {
            let (a, b) = stream.split_at(split);
            assert_eq!(decode(&[a, b], 64), Ok(expected.clone()), "split at {split}");
        }
    }

    #[test]
    fn a_line_past_the_bound_fails_wherever_it_is_split() {
        assert!(decode(&[b"abc\nde", b"f\n"], 3).is_ok());
        for chunks in [
            &[&b"abcd\n"[..]][..],
            &[b"ab", b"cd\n"],
            &[b"x\nabcd", b"\n"],
            &[b"x\n", b"ab", b"c", b"d"],
            &[b"a\nabcd\nb\n"],
        ] {
            assert_eq!(decode(chunks, 3), Err(SseError::LineTooLong(3)), "{chunks:?}");
        }
    }

    #[test]
    fn only_a_regular_file_under_the_root_opens_and_links_are_not_followed() {
        let dir = tempfile::tempdir().expect("temp");
        let root = dir.path();
        std::fs::create_dir_all(root.join(".sortie/turns")).expect("dirs");
        std::fs::write(root.join(".sortie/turns/1.jsonl"), "{}\n").expect("log");
        std::fs::write(dir.path().join("host-secret"), "secret").expect("host file");
        std::os::unix::fs::symlink(dir.path().join("host-secret"), root.join(".sortie/turns/2.jsonl")).expect("link");
        std::os::unix::fs::symlink(root.join(".sortie/turns"), root.join(".sortie/linked")).expect("dir link");
        nix::unistd::mkfifo(&root.join(".sortie/turns/3.jsonl"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        assert!(open_under(root, &[".sortie", "turns", "1.jsonl"]).is_ok());
        for path in [
            &[".sortie", "turns", "2.jsonl"][..],
            &[".sortie", "linked", "1.jsonl"],
            &[".sortie", "turns", "3.jsonl"],
            &[".sortie", "turns", "none.jsonl"],
        ] {
            assert!(open_under(root, path).is_err(), "{path:?}");
        }
    }
}
