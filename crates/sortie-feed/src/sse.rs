//! A subscription as the SSE body of a UI message stream (DESIGN §5.1): batches of events as parts
//! come, each event's id its part index, then `data: [DONE]` when the turn is done.

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
    let state = State {
        subscription,
        parts: Vec::with_capacity(PARTS_PER_WRITE),
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
