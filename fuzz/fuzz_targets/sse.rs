//! The host's SSE reader on arbitrary bytes split anywhere: it never panics, never keeps a line past its
//! bound, and reads the same events however the bytes are split.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sortie_feed::sse::{SseDecoder, SseEvent};

const LINE_MAX: usize = 64;

fn decode(pieces: &[&[u8]]) -> Result<Vec<SseEvent>, sortie_feed::sse::SseError> {
    let mut decoder = SseDecoder::new(LINE_MAX);
    let mut events = Vec::new();
    for piece in pieces {
        decoder.feed(piece, &mut events)?;
    }
    Ok(events)
}

fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else { return };
    let at = usize::from(split) % (bytes.len() + 1);
    let whole = decode(&[bytes]);
    let split = decode(&[&bytes[..at], &bytes[at..]]);
    assert_eq!(whole, split, "split at {at}");
    if let Ok(events) = whole {
        for event in events {
            for line in event.data.split('\n') {
                assert!(line.len() <= LINE_MAX);
            }
        }
    }
});
