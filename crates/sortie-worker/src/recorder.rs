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
use sortie_feed::sse::SseDecoder;
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
