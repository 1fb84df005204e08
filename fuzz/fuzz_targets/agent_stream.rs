//! What the host takes of a sandbox's stream, on arbitrary lines: it never panics, nothing it admits is
//! sortie's to write (`start`, `finish`, `error`, `message-metadata`, `data-sortie-*`), what it admits
//! reads back as the same chunk, and closing leaves nothing open (a second close adds nothing).

#![no_main]

use libfuzzer_sys::fuzz_target;
use sortie_protocol::agent_stream::AgentStream;

fuzz_target!(|data: &[u8]| {
    let mut stream = AgentStream::new();
    let mut again = AgentStream::new();
    for line in data.split(|b| *b == b'\n') {
        let Ok(json) = std::str::from_utf8(line) else { continue };
        if let Ok(chunk) = stream.admit(json) {
            let written = chunk.to_json();
            let value: serde_json::Value = serde_json::from_str(&written).expect("admitted chunks are JSON");
            let kind = value["type"].as_str().expect("a type");
            assert!(!kind.starts_with("data-sortie-"), "{kind}");
            assert!(!["start", "finish", "error", "message-metadata"].contains(&kind), "{kind}");
            // Written out again from its type, the chunk is admitted as itself.
            let reread = again.admit(&written).expect("an admitted chunk is admitted again");
            assert_eq!(reread, chunk);
        }
    }
    stream.close(None);
    assert!(stream.close(None).is_empty());
});
