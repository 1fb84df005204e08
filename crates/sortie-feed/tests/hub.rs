//! The turn hub: exact resumption at any join point, slow readers that slow nobody, bounded memory.

use std::sync::Arc;
use std::time::Duration;

use sortie_feed::hub::{Part, TurnHub, log_path, read_log};
use sortie_protocol::chunk::UiChunk;

fn chunk(i: u64) -> UiChunk {
    UiChunk::TextDelta {
        id: "t0".into(),
        delta: format!("part {i}"),
    }
}

async fn drain(mut subscription: sortie_feed::hub::Subscription) -> Vec<Part> {
    let mut all = Vec::new();
    while subscription.next_batch(64, &mut all).await {}
    all
}

fn indices(parts: &[Part]) -> Vec<u64> {
    parts.iter().map(|(i, _)| *i).collect()
}

/// A small deterministic generator, so a failing case can be replayed from its seed.
struct XorShift(u64);
impl XorShift {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound.max(1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_joining_anywhere_get_exactly_the_parts_after_their_index() {
    for seed in 1..=60_u64 {
        let dir = tempfile::tempdir().expect("temp");
        let mut random = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let total = 1 + random.below(400);
        // Small memory limits in some cases so that joins also cover parts already evicted to the log.
        let limit = if seed % 3 == 0 { 300 } else { 1 << 20 };
        let hub = TurnHub::new(1, Some(log_path(dir.path(), 1)), limit).expect("hub");
        let mut readers = Vec::new();
        let mut published = 0;
        while published < total {
            let burst = (1 + random.below(20)).min(total - published);
            let chunks: Vec<UiChunk> = (published..published + burst).map(chunk).collect();
            hub.publish(&chunks);
            published += burst;
            if random.below(3) == 0 {
                let after = match random.below(4) {
                    0 => None,
                    _ => Some(random.below(published + 5)),
                };
                readers.push((after, tokio::spawn(drain(hub.subscribe(after)))));
            }
            if random.below(4) == 0 {
                tokio::task::yield_now().await;
            }
        }
        let late_after = Some(random.below(total + 2));
        readers.push((late_after, tokio::spawn(drain(hub.subscribe(late_after)))));
        hub.finish();
        for (after, reader) in readers {
            let parts = tokio::time::timeout(Duration::from_secs(10), reader)
                .await
                .expect("in time")
                .expect("join");
            let first = after.map_or(0, |k| k + 1);
            let expected: Vec<u64> = (first..total.max(first)).collect();
            assert_eq!(indices(&parts), expected, "seed {seed}, after {after:?}, total {total}");
            // Compared as JSON, not text: a part read back from the log is re-serialized (normalized,
            // as the log's writer is the sandbox), and its key order is serde_json's, which the
            // `preserve_order` feature changes; this crate alone builds without it.
            for (index, json) in &parts {
                assert_eq!(
                    serde_json::from_str::<serde_json::Value>(json).expect("a part is JSON"),
                    serde_json::from_str::<serde_json::Value>(&chunk(*index).to_json()).expect("a chunk is JSON"),
                    "seed {seed}: content of part {index}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_never_reads_slows_neither_the_agent_nor_others() {
    let dir = tempfile::tempdir().expect("temp");
    let hub = TurnHub::new(1, Some(log_path(dir.path(), 1)), 1 << 30).expect("hub");
    let _stalled = hub.subscribe(None);
    let fast = tokio::spawn(drain(hub.subscribe(None)));
    let publisher = {
        let hub = hub.clone();
        tokio::spawn(async move {
            for batch in 0..1000_u64 {
                let chunks: Vec<UiChunk> = (batch * 100..batch * 100 + 100).map(chunk).collect();
                hub.publish(&chunks);
            }
            hub.finish();
        })
    };
    tokio::time::timeout(Duration::from_secs(30), publisher)
        .await
        .expect("the publisher never waits")
        .expect("join");
    let parts = tokio::time::timeout(Duration::from_secs(30), fast)
        .await
        .expect("fast reader done")
        .expect("join");
    assert_eq!(parts.len(), 100_000);
    assert_eq!(hub.len(), 100_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_bounded_and_the_log_serves_what_left_it() {
    let dir = tempfile::tempdir().expect("temp");
    let path = log_path(dir.path(), 3);
    let hub = TurnHub::new(3, Some(path.clone()), 4096).expect("hub");
    for i in 0..2000 {
        hub.publish(&[chunk(i)]);
        assert!(
            hub.memory_bytes() <= 4096 + 64,
            "memory stays under its bound: {}",
            hub.memory_bytes()
        );
    }
    hub.log_raw(&serde_json::json!({"sessionUpdate": "something_new"}));
    hub.finish();
    let parts = drain(hub.subscribe(Some(10))).await;
    assert_eq!(indices(&parts), (11..2000).collect::<Vec<_>>());
    let from_log = read_log(&path, Some(1997), None).expect("log");
    assert_eq!(indices(&from_log), vec![1998, 1999]);
    let text = std::fs::read_to_string(&path).expect("log text");
    assert!(
        text.contains(r#"{"raw":{"sessionUpdate":"something_new"}}"#),
        "unknown updates are kept raw"
    );
}

#[tokio::test]
async fn a_torn_last_log_line_is_skipped() {
    let dir = tempfile::tempdir().expect("temp");
    let path = log_path(dir.path(), 1);
    std::fs::write(
        &path,
        "{\"index\":0,\"chunk\":{\"type\":\"start-step\"}}\n{\"index\":1,\"chu",
    )
    .expect("write");
    let parts = read_log(&path, None, None).expect("read");
    assert_eq!(indices(&parts), vec![0]);
    let _ = Arc::strong_count(&parts[0].1);
}

#[tokio::test]
async fn a_log_torn_inside_a_multibyte_character_keeps_its_whole_lines() {
    let dir = tempfile::tempdir().expect("temp");
    let path = log_path(dir.path(), 1);
    let whole = "{\"index\":0,\"chunk\":{\"type\":\"text-delta\",\"id\":\"t\",\"delta\":\"héllo\"}}\n";
    let torn = "{\"index\":1,\"chunk\":{\"type\":\"text-delta\",\"id\":\"t\",\"delta\":\"é";
    let mut bytes = format!("{whole}{torn}").into_bytes();
    bytes.pop(); // half of the last `é`: not UTF-8 any more
    std::fs::write(&path, bytes).expect("write");
    let parts = read_log(&path, None, None).expect("read");
    assert_eq!(indices(&parts), vec![0]);
}
