//! Mapping + SSE encoding on one core (DESIGN issue target: ≥ 500k chunks/s): raw agent lines →
//! JSON → the ACP mapper → chunk JSON → SSE events, the whole per-part path of the driver, beside a
//! baseline of parsing the same lines alone.
//!
//! `cargo bench -p sortie-driver --bench mapping`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use sortie_driver::mapping::Mapper;
use sortie_protocol::chunk::write_sse_event;

/// A realistic mix of what an agent writes: mostly message chunks, some thoughts and tool updates.
fn agent_lines() -> Vec<String> {
    let mut lines = Vec::new();
    for i in 0..1000 {
        let update = match i % 10 {
            0 => {
                json!({"sessionUpdate": "agent_thought_chunk", "content": {"type": "text", "text": "Considering the next step of the change."}})
            }
            1 => {
                json!({"sessionUpdate": "tool_call", "toolCallId": format!("c{i}"), "title": "Edit src/lib.rs", "kind": "edit", "status": "pending", "rawInput": {"path": "src/lib.rs"}})
            }
            2 => {
                json!({"sessionUpdate": "tool_call_update", "toolCallId": format!("c{}", i - 1), "status": "completed", "content": [{"type": "content", "content": {"type": "text", "text": "ok"}}]})
            }
            _ => {
                json!({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": format!("word {i} of a longer answer ")}})
            }
        };
        lines.push(
            json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s", "update": update}})
                .to_string(),
        );
    }
    lines
}

fn bench(c: &mut Criterion) {
    let lines = agent_lines();
    let chunks_per_pass = {
        let mut mapper = Mapper::new("ses_bench-t1");
        let mut chunks = Vec::new();
        for line in &lines {
            let message: Value = serde_json::from_str(line).expect("json");
            mapper.on_update(&message["params"]["update"], "2026-12-02T00:00:00.000Z", &mut chunks);
        }
        chunks.len() as u64
    };
    let mut group = c.benchmark_group("driver");
    group.throughput(Throughput::Elements(chunks_per_pass));
    group.bench_function("map_and_encode_sse", |b| {
        let mut out = Vec::with_capacity(1 << 20);
        let mut chunks = Vec::with_capacity(4);
        b.iter(|| {
            let mut mapper = Mapper::new("ses_bench-t1");
            out.clear();
            let mut index = 0;
            for line in &lines {
                let message: Value = serde_json::from_str(line).expect("json");
                mapper.on_update(&message["params"]["update"], "2026-12-02T00:00:00.000Z", &mut chunks);
                for chunk in chunks.drain(..) {
                    write_sse_event(&mut out, index, &chunk.to_json());
                    index += 1;
                }
            }
            out.len()
        });
    });
    group.bench_function("baseline_parse_lines_only", |b| {
        b.iter(|| {
            lines
                .iter()
                .map(|line| {
                    serde_json::from_str::<Value>(line)
                        .map(|v| v.is_object())
                        .unwrap_or(false) as usize
                })
                .sum::<usize>()
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
