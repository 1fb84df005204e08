//! The recorder (DESIGN §2 step 3, §8): follows a running turn's stream on the driver and writes every
//! part into the store in batches (32 parts, 1 MiB or 100 ms, whichever comes first). Parts are
//! insert-or-ignore by index, so a second pass over the same turn (the turn-end harvest) only fills gaps.

use std::sync::Arc;
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use http_body_util::BodyExt;
use sortie_protocol::SessionId;
use sortie_store::{NewPart, Store};

use crate::client::DriverClient;

pub const BATCH_PARTS: usize = 32;
pub const BATCH_BYTES: usize = 1 << 20;
pub const BATCH_DELAY: Duration = Duration::from_millis(100);

/// How a recording ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The highest part index stored (or already stored) so far.
    pub last_index: Option<u64>,
    /// The stream ended with `[DONE]` and every batch was written.
    pub complete: bool,
    pub parts: u64,
    /// It stopped because the store refused a batch (not because the driver's stream broke).
    pub store_failed: bool,
}

struct Batch {
    parts: Vec<NewPart>,
    bytes: usize,
    since: Option<tokio::time::Instant>,
}

impl Batch {
    /// Full enough to write now (else it waits at most [`BATCH_DELAY`] from its first part).
    fn due(&self) -> bool {
        batch_due(self.parts.len(), self.bytes)
    }
}

/// A batch of `parts` parts holding `bytes` of payload is written at once.
fn batch_due(parts: usize, bytes: usize) -> bool {
    parts >= BATCH_PARTS || bytes >= BATCH_BYTES
}

/// Follows turn `n` from the part after `after` until `[DONE]` or a break, storing what it sees.
pub async fn record(
    store: &Arc<dyn Store>,
    driver: &DriverClient,
    session_id: &SessionId,
    n: u32,
    after: Option<u64>,
) -> Recorded {
    let mut recorded = Recorded {
        last_index: after,
        ..Recorded::default()
    };
    let Ok(body) = driver.stream(n, after).await else {
        return recorded;
    };
    let mut events = body.into_data_stream().eventsource();
    let mut batch = Batch {
        parts: Vec::new(),
        bytes: 0,
        since: None,
    };
    loop {
        let next = match batch.since {
            Some(since) => match tokio::time::timeout_at(since + BATCH_DELAY, events.next()).await {
                Ok(next) => next,
                Err(_) => {
                    if !flush(store, session_id, n, &mut batch, &mut recorded).await {
                        return recorded;
                    }
                    continue;
                }
            },
            None => events.next().await,
        };
        let event = match next {
            Some(Ok(event)) => event,
            // The subscription broke: what was read is kept; the harvest reads the rest.
            Some(Err(_)) | None => {
                flush(store, session_id, n, &mut batch, &mut recorded).await;
                return recorded;
            }
        };
        if event.data == "[DONE]" {
            recorded.complete = flush(store, session_id, n, &mut batch, &mut recorded).await;
            return recorded;
        }
        let Some(index) = event.id.parse::<u32>().ok() else {
            continue;
        };
        batch.bytes += event.data.len();
        batch.parts.push(NewPart {
            part_index: index,
            payload: event.data,
        });
        batch.since.get_or_insert_with(tokio::time::Instant::now);
        if batch.due() && !flush(store, session_id, n, &mut batch, &mut recorded).await {
            return recorded;
        }
    }
}

/// Writes the batch; `false` if the store refused it (the writer stops; the harvest fills the gap).
async fn flush(
    store: &Arc<dyn Store>,
    session_id: &SessionId,
    n: u32,
    batch: &mut Batch,
    recorded: &mut Recorded,
) -> bool {
    batch.since = None;
    batch.bytes = 0;
    if batch.parts.is_empty() {
        return true;
    }
    let parts = std::mem::take(&mut batch.parts);
    match store.append_parts(session_id, n, &parts).await {
        Ok(_) => {
            recorded.parts += parts.len() as u64;
            let highest = parts.iter().map(|p| u64::from(p.part_index)).max();
            recorded.last_index = recorded.last_index.max(highest);
            true
        }
        Err(error) => {
            tracing::warn!(%error, session = %session_id, turn = n, "storing parts failed; they are read again from the driver");
            recorded.store_failed = true;
            false
        }
    }
}

/// Stores the parts of a turn log the driver left on the host (`$HOME/.sortie/turns/{n}.jsonl`), for a
/// turn whose sandbox is gone. Only call it once nothing runs in the sandbox: the file belongs to it.
pub async fn harvest_log(store: &Arc<dyn Store>, home: &std::path::Path, session_id: &SessionId, n: u32) -> u64 {
    let path = home.join(".sortie/turns").join(format!("{n}.jsonl"));
    let home = home.to_owned();
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<(u64, Arc<str>)>> {
        // The sandbox owned this tree: a link must not lead the worker (root) to a host file.
        let real = std::fs::canonicalize(&path)?;
        let home = std::fs::canonicalize(&home)?;
        if !real.starts_with(&home) || !std::fs::symlink_metadata(&real)?.is_file() {
            return Err(std::io::Error::other(
                "the turn log is not a file under the session's home",
            ));
        }
        sortie_driver::hub::read_log(&real, None, None)
    })
    .await;
    let Ok(Ok(parts)) = read else {
        return 0;
    };
    let mut stored = 0;
    for chunk in parts.chunks(BATCH_PARTS * 8) {
        let batch: Vec<NewPart> = chunk
            .iter()
            .filter_map(|(index, json)| {
                Some(NewPart {
                    part_index: u32::try_from(*index).ok()?,
                    payload: json.to_string(),
                })
            })
            .collect();
        match store.append_parts(session_id, n, &batch).await {
            Ok(new) => stored += new,
            Err(_) => break,
        }
    }
    stored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_written_at_32_parts_or_1_mib() {
        for (parts, bytes, due) in [
            (0, 0, false),
            (1, 10, false),
            (31, 31 * 1000, false),
            (32, 32, true),
            (1, BATCH_BYTES - 1, false),
            (1, BATCH_BYTES, true),
            (5, 2 * BATCH_BYTES, true),
        ] {
            assert_eq!(batch_due(parts, bytes), due, "{parts} parts, {bytes} bytes");
        }
    }
}
