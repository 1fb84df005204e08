//! A subscription as the SSE body of a UI message stream (DESIGN §5.1): batches of events as parts
//! come, each event's id its part index, then `data: [DONE]` when the turn is done; and
//! [`SseDecoder`], which reads such a body back when it comes from someone the reader does not trust.

use bytes::Bytes;
use sortie_protocol::chunk::{SSE_DONE, write_sse_event};

use crate::hub::{Part, Subscription};

/// Parts encoded into one body chunk at most: large enough for throughput, small enough for latency.
pub const PARTS_PER_WRITE: usize = 256;

/// Encodes `parts` as SSE events after `out`.
pub fn encode(out: &mut Vec<u8>, parts: &[Part]) {
    for (index, json) in parts {
        write_sse_event(out, *index, json);
    }
}

/// The SSE body of one subscriber: batches of events as they come, then `[DONE]`.
pub fn body(subscription: Subscription) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send {
    struct State {
        subscription: Subscription,
        parts: Vec<Part>,
        done: bool,
    }
    // Grown by the batches that come, not made for the largest: a client of a quiet turn holds a few
    // bytes, where room for a whole batch was 6 KiB each (60 MiB for 10,000 watching one session).
    let state = State {
        subscription,
        parts: Vec::new(),
        done: false,
    };
    futures::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        state.parts.clear();
        let more = state.subscription.next_batch(PARTS_PER_WRITE, &mut state.parts).await;
        let mut out =
            Vec::with_capacity(state.parts.iter().map(|(_, json)| json.len() + 24).sum::<usize>() + SSE_DONE.len());
        encode(&mut out, &state.parts);
        if !more {
            out.extend_from_slice(SSE_DONE);
            state.done = true;
        }
        Some((Ok(Bytes::from(out)), state))
    })
}

/// One event of an SSE body: its `id:` and its `data:`.
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

/// A decoder of an SSE body (DESIGN §5.1: `id:` and `data:` lines, events ended by a blank
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
}
