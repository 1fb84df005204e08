//! The receive-pack decision on arbitrary bytes: it never panics; an `Allow` names only
//! `refs/heads/sortie/<the session>` (never deleting it) and the session's `refs/sortie/wip/<the
//! session>`, and git's own reading of the same bytes (a model of receive-pack's `read_head_info`) would
//! update nothing else; a refusal is well-formed pkt-lines.
//!
//! The first byte picks how the rest is used: raw, or as pkt-line payloads separated by 0xFE with
//! the last piece after the flush (0xFD stands for the session's ref, 0xFC for an object id, and
//! bit 2 puts the session's own command first), so the fuzzer reaches well-framed commands, and
//! the `Allow` they may earn, quickly. Bit 1 says whether the body is complete.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sortie_gateway::git::pktline::{self, MAX_PACKET, Packet};
use sortie_gateway::git::receive_pack::{Decision, decide, refusal};

const SESSION: &str = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
const OID: &[u8] = b"f79d4fbde24febe8088ff784ace21d6755abbba9";

fn structured(rest: &[u8], own_command_first: bool) -> Vec<u8> {
    let own = format!("refs/heads/sortie/{SESSION}");
    let expand = |piece: &[u8]| -> Vec<u8> {
        let mut out = Vec::new();
        for byte in piece {
            match byte {
                0xFD => out.extend_from_slice(own.as_bytes()),
                0xFC => out.extend_from_slice(OID),
                other => out.push(*other),
            }
        }
        out
    };
    let pieces: Vec<&[u8]> = rest.split(|b| *b == 0xFE).collect();
    let Some((tail, lines)) = pieces.split_last() else {
        return Vec::new();
    };
    let mut body = Vec::new();
    if own_command_first {
        let first = format!(
            "{oid} {oid} {own}\0 report-status side-band-64k",
            oid = String::from_utf8_lossy(OID)
        );
        body.extend(pktline::encode(first.as_bytes()));
    }
    for line in lines {
        let mut line = expand(line);
        line.truncate(MAX_PACKET - 4);
        body.extend(pktline::encode(&line));
    }
    body.extend_from_slice(pktline::FLUSH);
    body.extend(expand(tail));
    body
}

/// What git would do with the command section: the ref updates it would queue (`None` if it would
/// die on the section or apply a push certificate's commands), and whether the section ended.
struct GitReading {
    updates: Option<Vec<(String, String, String)>>,
    ended: bool,
}

fn is_hex_oid(text: &[u8]) -> bool {
    (text.len() == 40 || text.len() == 64) && text.iter().all(u8::is_ascii_hexdigit)
}

fn git_reading(body: &[u8]) -> GitReading {
    let mut updates = Vec::new();
    let mut offset = 0;
    loop {
        let line = match pktline::read(&body[offset..]) {
            Ok((Packet::Data(line), used)) => {
                offset += used;
                line
            }
            Ok(_) => {
                return GitReading {
                    updates: Some(updates),
                    ended: true,
                };
            }
            Err(_) => {
                return GitReading {
                    updates: None,
                    ended: false,
                };
            }
        };
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        if line.len() > 8 && line.starts_with(b"shallow ") {
            continue;
        }
        // git reads the command up to the first NUL (capabilities follow it, on any line).
        let text = line.split(|b| *b == 0).next().unwrap_or_default();
        if text == b"push-cert" {
            // Its commands would come from inside the certificate.
            return GitReading {
                updates: None,
                ended: true,
            };
        }
        let oid_len = if text.len() > 41 && text[40] == b' ' { 40 } else { 64 };
        let (Some(old), Some(new)) = (text.get(..oid_len), text.get(oid_len + 1..2 * oid_len + 1)) else {
            return GitReading {
                updates: None,
                ended: true,
            };
        };
        if !is_hex_oid(old)
            || !is_hex_oid(new)
            || text.get(oid_len) != Some(&b' ')
            || text.get(2 * oid_len + 1) != Some(&b' ')
        {
            return GitReading {
                updates: None,
                ended: true,
            };
        }
        let refname = &text[2 * oid_len + 2..];
        updates.push((
            String::from_utf8_lossy(old).into_owned(),
            String::from_utf8_lossy(new).into_owned(),
            String::from_utf8_lossy(refname).into_owned(),
        ));
    }
}

/// Reads a whole answer as pkt-lines ending in a flush; returns the data payloads.
fn well_formed(answer: &[u8]) -> Vec<Vec<u8>> {
    let mut offset = 0;
    let mut payloads = Vec::new();
    loop {
        match pktline::read(&answer[offset..]) {
            Ok((Packet::Data(data), used)) => {
                payloads.push(data.to_vec());
                offset += used;
            }
            Ok((Packet::Flush, used)) => {
                offset += used;
                assert_eq!(offset, answer.len(), "nothing after the final flush");
                return payloads;
            }
            other => panic!("a refusal that is not pkt-lines: {other:?} at {offset}"),
        }
    }
}

fn check_refusal(reason: &str, refnames: &[String], side_band: bool) {
    let answer = refusal(reason, refnames, side_band);
    let report = if side_band {
        let mut report = Vec::new();
        for payload in well_formed(&answer) {
            match payload.split_first() {
                Some((1, data)) => report.extend_from_slice(data),
                Some((2, _)) => {}
                other => panic!("unexpected band {other:?}"),
            }
        }
        report
    } else {
        answer
    };
    let lines = well_formed(&report);
    assert_eq!(lines.first().map(Vec::as_slice), Some(&b"unpack ok\n"[..]));
    let expected = refnames.len().max(1);
    assert_eq!(lines.len(), 1 + expected, "one ng line per command");
    for (line, refname) in lines[1..].iter().zip(refnames) {
        assert!(
            line.starts_with(format!("ng {refname} ").as_bytes()),
            "ng names its ref"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    let body = if mode & 1 == 1 {
        structured(rest, mode & 4 == 4)
    } else {
        rest.to_vec()
    };
    let complete = mode & 2 == 2;
    let own = format!("refs/heads/sortie/{SESSION}");
    // The session's work kept when a delivery fails: it may be written, forced and deleted.
    let wip = format!("refs/sortie/wip/{SESSION}");
    match decide(&body, SESSION, complete) {
        Decision::Allow { updates, .. } => {
            assert!(!updates.is_empty());
            for update in &updates {
                assert!(update.refname == own || update.refname == wip, "{}", update.refname);
                if update.refname == own {
                    assert!(update.new.bytes().any(|b| b != b'0'), "a delete of the branch was allowed");
                }
            }
            let git = git_reading(&body);
            assert!(git.ended, "allowed before the command section ended");
            let Some(git_updates) = git.updates else {
                panic!(
                    "allowed a request git would read differently: {:?}",
                    String::from_utf8_lossy(&body)
                );
            };
            assert_eq!(git_updates.len(), updates.len());
            for (old, new, refname) in git_updates {
                assert!(refname == own || refname == wip, "git would update another ref: {refname}");
                if refname == own {
                    assert!(new.bytes().any(|b| b != b'0'), "git would delete the branch");
                }
                assert!(updates.iter().any(|u| u.old == old && u.new == new));
            }
        }
        Decision::Probe => {
            assert_eq!(body, pktline::FLUSH, "only the bare flush is the probe");
            assert!(complete);
        }
        Decision::Refuse {
            reason,
            updates,
            side_band,
        } => {
            let refnames: Vec<String> = updates.into_iter().map(|update| update.refname).collect();
            check_refusal(&reason, &refnames, side_band)
        }
        Decision::NeedMore => assert!(!complete),
    }
});
