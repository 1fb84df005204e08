//! The push confinement rule (DESIGN §7.3, `ref/git-proxy.md` §2–§4): a `receive-pack` request may
//! reach the upstream only if every command updates exactly `refs/heads/sortie/<session-id>` or the
//! session's own `refs/sortie/wip/<session-id>` (where a pod keeps what a failed delivery could not
//! push; it alone may also be deleted) and nothing in the command section is something this parser
//! does not recognise. Fail closed: a `push-cert` block (applied by receive-pack even when never
//! advertised), a delete of the branch, any other ref, push options, an unknown line, malformed or
//! oversized input — each refuses the whole push.

use crate::git::pktline::{self, Packet, PacketError};

/// The command section (everything before the pack) may not be larger: a sortie push has one command.
pub const MAX_COMMAND_SECTION: usize = 64 * 1024;

/// One ref update of a push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefUpdate {
    pub old: String,
    pub new: String,
    pub refname: String,
}

/// What to do with a receive-pack request, decided from its first bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not enough bytes yet to decide (and fewer than [`MAX_COMMAND_SECTION`]).
    NeedMore,
    /// The empty probe git sends before a large push: forward it.
    Probe,
    /// Forward the request: its commands touch only the session's branch. `side_band` says how
    /// to answer should the upstream fail it; the pack starts at `pack_offset` (right after the
    /// command section's flush).
    Allow {
        updates: Vec<RefUpdate>,
        side_band: bool,
        pack_offset: usize,
    },
    /// Refuse the whole push with this reason; answer with [`refusal`]. `updates` are the commands
    /// read before the refusal (none when the first line was already refused).
    Refuse {
        reason: String,
        updates: Vec<RefUpdate>,
        side_band: bool,
    },
}

fn is_hex_oid(text: &str) -> bool {
    (text.len() == 40 || text.len() == 64) && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn is_zero_oid(text: &str) -> bool {
    text.bytes().all(|b| b == b'0')
}

/// Decides on a receive-pack request body for session `session_id`, given its first bytes (`complete`
/// says whether that is the whole body).
pub fn decide(body: &[u8], session_id: &str, complete: bool) -> Decision {
    let allowed_ref = format!("refs/heads/sortie/{session_id}");
    let wip_ref = sortie_protocol::ids::wip_ref(session_id);
    let mut offset = 0;
    let mut updates: Vec<RefUpdate> = Vec::new();
    let mut side_band = false;
    let mut seen_command = false;
    let refuse = |reason: String, updates: &[RefUpdate], side_band: bool| Decision::Refuse {
        reason,
        updates: updates.to_vec(),
        side_band,
    };
    loop {
        if offset > MAX_COMMAND_SECTION {
            return refuse("the push's command section is too large".into(), &updates, side_band);
        }
        let packet = match pktline::read(&body[offset..]) {
            Ok((packet, used)) => {
                offset += used;
                packet
            }
            Err(PacketError::Incomplete) if !complete && body.len() - offset < MAX_COMMAND_SECTION => {
                return Decision::NeedMore;
            }
            Err(PacketError::Incomplete) => return refuse("the push request ended early".into(), &updates, side_band),
            Err(PacketError::BadLength(text)) => {
                return refuse(
                    format!("malformed push request (pkt-line {text:?})"),
                    &updates,
                    side_band,
                );
            }
        };
        let line = match packet {
            Packet::Flush => break,
            Packet::Delimiter | Packet::ResponseEnd => {
                return refuse("unexpected packet in the push request".into(), &updates, side_band);
            }
            Packet::Data(line) => line,
        };
        if line.starts_with(b"push-cert") {
            return refuse("signed pushes (push-cert) are not accepted".into(), &updates, side_band);
        }
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let (command, capabilities) = match line.iter().position(|b| *b == 0) {
            Some(nul) if !seen_command => (&line[..nul], Some(&line[nul + 1..])),
            Some(_) => {
                return refuse(
                    "malformed push request (capabilities after the first command)".into(),
                    &updates,
                    side_band,
                );
            }
            None => (line, None),
        };
        let Ok(command) = std::str::from_utf8(command) else {
            return refuse("malformed push request (not UTF-8)".into(), &updates, side_band);
        };
        if let Some(oid) = command.strip_prefix("shallow ") {
            if seen_command || !is_hex_oid(oid) || capabilities.is_some() {
                return refuse("malformed push request (shallow line)".into(), &updates, side_band);
            }
            continue;
        }
        if let Some(capabilities) = capabilities {
            let capabilities = String::from_utf8_lossy(capabilities);
            for capability in capabilities.split_ascii_whitespace() {
                let name = capability.split('=').next().unwrap_or_default();
                match name {
                    "side-band" | "side-band-64k" => side_band = true,
                    "push-options" | "push-cert" => {
                        return refuse(
                            format!("the push asks for {name}, which this gateway does not accept"),
                            &updates,
                            side_band,
                        );
                    }
                    _ => {}
                }
            }
        }
        let mut fields = command.splitn(3, ' ');
        let (Some(old), Some(new), Some(refname)) = (fields.next(), fields.next(), fields.next()) else {
            return refuse(
                format!("unrecognised line in the push request: {:?}", truncate(command)),
                &updates,
                side_band,
            );
        };
        if !is_hex_oid(old) || !is_hex_oid(new) || old.len() != new.len() || refname.is_empty() || refname.contains(' ')
        {
            return refuse(
                format!("unrecognised line in the push request: {:?}", truncate(command)),
                &updates,
                side_band,
            );
        }
        seen_command = true;
        updates.push(RefUpdate {
            old: old.to_owned(),
            new: new.to_owned(),
            refname: refname.to_owned(),
        });
    }
    if updates.is_empty() {
        // Only the probe (`0000`, nothing else) is a push without commands: shallow lines and no command
        // are not one.
        let bare_flush = offset == pktline::FLUSH.len();
        return match (offset == body.len() && bare_flush, complete) {
            (true, true) => Decision::Probe,
            (true, false) => Decision::NeedMore,
            (false, _) => refuse("a push without commands".into(), &updates, side_band),
        };
    }
    if let Some(foreign) = updates
        .iter()
        .find(|u| u.refname != allowed_ref && u.refname != wip_ref)
    {
        return refuse(
            format!(
                "{} may not be pushed; this session may only push {allowed_ref}",
                truncate(&foreign.refname)
            ),
            &updates,
            side_band,
        );
    }
    if updates.iter().any(|u| u.refname == allowed_ref && is_zero_oid(&u.new)) {
        return refuse(format!("{allowed_ref} may not be deleted"), &updates, side_band);
    }
    let rest = &body[offset..];
    // After the flush comes the pack (or its first bytes, or nothing yet): anything else is refused.
    let pack_or_its_start = rest.starts_with(b"PACK") || b"PACK".starts_with(rest);
    if !pack_or_its_start {
        return refuse(
            "unexpected data between the commands and the pack".into(),
            &updates,
            side_band,
        );
    }
    if rest.is_empty() && !complete {
        // The pack's first bytes decide whether something else follows the flush.
        return Decision::NeedMore;
    }
    Decision::Allow {
        updates,
        side_band,
        pack_offset: offset,
    }
}

impl Decision {
    /// The refnames a refusal names (every command gets an `ng` line).
    pub fn refnames(updates: &[RefUpdate]) -> Vec<String> {
        updates.iter().map(|u| u.refname.clone()).collect()
    }
}

fn truncate(text: &str) -> String {
    text.chars().take(120).collect()
}

/// The longest reason a refusal carries (git shows it on one line).
const MAX_REASON: usize = 300;

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The answer `git push` prints a refusal from (`ref/git-proxy.md` §3): a 200 body with band-2
/// messages, then a band-1 report-status giving every command an `ng` line, then a flush.
pub fn refusal(reason: &str, refnames: &[String], side_band: bool) -> Vec<u8> {
    let reason = reason.replace(['\n', '\r'], " ");
    let reason = cut(&reason, MAX_REASON);
    let mut report = pktline::encode(b"unpack ok\n");
    let names: Vec<String> = if refnames.is_empty() {
        vec!["(push)".to_owned()]
    } else {
        refnames.to_vec()
    };
    // Each `ng <refname> <reason>` fits one packet: the reason gives way to a long refname (a
    // refname too long for a packet, which no command could carry, is cut too).
    let max_line = pktline::MAX_PACKET - 4;
    for refname in &names {
        let room = max_line.saturating_sub("ng ".len() + refname.len() + " \n".len());
        let mut line = format!("ng {refname} {}", cut(reason, room));
        line.truncate(cut(&line, max_line - 1).len());
        line.push('\n');
        report.extend(pktline::encode(line.as_bytes()));
    }
    report.extend_from_slice(pktline::FLUSH);
    if !side_band {
        return report;
    }
    let mut out = Vec::new();
    for message in ["sortie: push refused".to_owned(), format!("sortie: {reason}")] {
        let mut band = vec![2_u8];
        band.extend_from_slice(message.as_bytes());
        band.push(b'\n');
        out.extend(pktline::encode(&band));
    }
    for piece in report.chunks(pktline::MAX_PACKET - 5) {
        let mut band = vec![1_u8];
        band.extend_from_slice(piece);
        out.extend(pktline::encode(&band));
    }
    out.extend_from_slice(pktline::FLUSH);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SESSION: &str = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
    const ZERO: &str = "0000000000000000000000000000000000000000";
    const A: &str = "f79d4fbde24febe8088ff784ace21d6755abbba9";
    const B: &str = "4f3fa14e4f3fa14e4f3fa14e4f3fa14e4f3fa14e";
    const CAPS: &str = " report-status-v2 side-band-64k quiet object-format=sha1 agent=git/2.47.3";

    fn own() -> String {
        format!("refs/heads/sortie/{SESSION}")
    }

    /// A request body: the commands (the first with capabilities), a flush, then `tail`.
    fn body(commands: &[(&str, &str, &str)], tail: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, (old, new, refname)) in commands.iter().enumerate() {
            let line = if i == 0 {
                format!("{old} {new} {refname}\0{CAPS}")
            } else {
                format!("{old} {new} {refname}")
            };
            out.extend(pktline::encode(line.as_bytes()));
        }
        out.extend_from_slice(pktline::FLUSH);
        out.extend_from_slice(tail);
        out
    }

    const PACK: &[u8] = b"PACK\0\0\0\x02\0\0\0\x03rest-of-pack";

    fn refused(decision: &Decision) -> Option<&str> {
        match decision {
            Decision::Refuse { reason, .. } => Some(reason),
            _ => None,
        }
    }

    #[test]
    fn the_sessions_own_branch_may_be_pushed() {
        let own = own();
        for commands in [
            [(ZERO, A, own.as_str())],
            [(A, B, own.as_str())],
            [(B, A, own.as_str())],
        ] {
            let decision = decide(&body(&commands, PACK), SESSION, true);
            assert!(matches!(decision, Decision::Allow { .. }), "{commands:?}: {decision:?}");
        }
        // The pack starts right after the command section's flush.
        let request = body(&[(A, B, own.as_str())], PACK);
        let Decision::Allow { pack_offset, .. } = decide(&request, SESSION, true) else {
            panic!("not allowed")
        };
        assert_eq!(&request[pack_offset..], PACK);
        // A shallow clone's push starts with shallow lines; a sha256 repository has longer oids.
        let mut shallow = pktline::encode(format!("shallow {A}\n").as_bytes());
        shallow.extend(body(&[(A, B, own.as_str())], PACK));
        assert!(matches!(decide(&shallow, SESSION, true), Decision::Allow { .. }));
        let (z64, a64) = ("0".repeat(64), "ab".repeat(32));
        assert!(matches!(
            decide(&body(&[(&z64, &a64, &own)], PACK), SESSION, true),
            Decision::Allow { .. }
        ));
        // An empty pack (objects the server has) and a pack still arriving are fine too.
        assert_eq!(decide(&body(&[(A, B, &own)], b""), SESSION, false), Decision::NeedMore);
        assert!(matches!(
            decide(&body(&[(A, B, &own)], b"PA"), SESSION, false),
            Decision::Allow { .. }
        ));
    }

    #[test]
    fn the_sessions_own_wip_ref_may_be_pushed_forced_and_deleted() {
        let wip = sortie_protocol::ids::wip_ref(SESSION);
        for commands in [
            [(ZERO, A, wip.as_str())],
            [(B, A, wip.as_str())],
            [(A, ZERO, wip.as_str())],
        ] {
            let decision = decide(&body(&commands, PACK), SESSION, true);
            assert!(matches!(decision, Decision::Allow { .. }), "{commands:?}: {decision:?}");
        }
        // A delete sends no pack at all.
        assert!(matches!(
            decide(&body(&[(A, ZERO, &wip)], b""), SESSION, true),
            Decision::Allow { .. }
        ));
        let other = sortie_protocol::ids::wip_ref("ses_01jd8x3k4m5n6p7q8r9s0t1v2x");
        for refname in [other, format!("{wip}x"), format!("{wip}/x"), "refs/sortie/wip".into()] {
            let decision = decide(&body(&[(ZERO, A, &refname)], PACK), SESSION, true);
            assert!(
                refused(&decision).is_some_and(|r| r.contains("may not be pushed")),
                "{refname}: {decision:?}"
            );
        }
    }

    #[test]
    fn the_probe_passes() {
        assert_eq!(decide(b"0000", SESSION, true), Decision::Probe);
        assert_eq!(decide(b"", SESSION, false), Decision::NeedMore);
        assert_eq!(
            decide(b"0000", SESSION, false),
            Decision::NeedMore,
            "a streamed probe is decided at its end"
        );
        assert!(
            refused(&decide(b"0000PACK", SESSION, true)).is_some(),
            "a flush followed by data is no probe"
        );
        // Found by the fuzzer: shallow lines and no command are no probe either.
        let mut shallow_only = pktline::encode(format!("shallow {A}").as_bytes());
        shallow_only.extend_from_slice(pktline::FLUSH);
        for complete in [true, false] {
            assert!(
                refused(&decide(&shallow_only, SESSION, complete)).is_some(),
                "complete: {complete}"
            );
        }
    }

    #[test]
    fn every_other_push_is_refused_whole() {
        let own = own();
        let other_session = "refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2x".to_owned();
        let prefix_trick = format!("{own}x");
        let nested = format!("{own}/x");
        type Case<'a> = (Vec<(&'a str, &'a str, &'a str)>, &'a str);
        let cases: Vec<Case> = vec![
            (vec![(A, B, "refs/heads/main")], "refs/heads/main may not be pushed"),
            (vec![(ZERO, A, &prefix_trick)], "may not be pushed"),
            (vec![(ZERO, A, &nested)], "may not be pushed"),
            (vec![(ZERO, A, &other_session)], "may not be pushed"),
            (vec![(ZERO, A, "refs/tags/v1")], "may not be pushed"),
            (vec![(ZERO, A, "refs/tags/sortie/x")], "may not be pushed"),
            (vec![(ZERO, A, "refs/notes/commits")], "may not be pushed"),
            (vec![(A, ZERO, &own)], "may not be deleted"),
            (vec![(A, ZERO, "refs/heads/main")], "may not be pushed"),
            (
                vec![(A, B, &own), (A, B, "refs/heads/main")],
                "refs/heads/main may not be pushed",
            ),
            (
                vec![(A, B, "refs/heads/main"), (A, B, &own)],
                "refs/heads/main may not be pushed",
            ),
        ];
        for (commands, reason) in cases {
            let decision = decide(&body(&commands, PACK), SESSION, true);
            let Decision::Refuse {
                reason: said,
                updates,
                side_band,
            } = &decision
            else {
                panic!("{commands:?} was not refused: {decision:?}")
            };
            assert!(said.contains(reason), "{commands:?}: {said}");
            assert_eq!(updates.len(), commands.len(), "every command gets an ng line");
            assert!(side_band);
        }
    }

    #[test]
    fn what_the_parser_does_not_recognise_is_refused() {
        let own = own();
        // A push-cert block whose inner command names main: receive-pack would apply it.
        let cert =
            format!("push-cert\0{CAPS}\ncertificate version 0.1\npusher x\n\n{A} {B} refs/heads/main\npush-cert-end\n");
        let mut push_cert = pktline::encode(cert.as_bytes());
        push_cert.extend_from_slice(pktline::FLUSH);
        push_cert.extend_from_slice(PACK);
        assert!(refused(&decide(&push_cert, SESSION, true)).is_some_and(|r| r.contains("push-cert")));

        let raw = |lines: &[&[u8]], tail: &[u8]| {
            let mut out = Vec::new();
            for line in lines {
                out.extend(pktline::encode(line));
            }
            out.extend_from_slice(pktline::FLUSH);
            out.extend_from_slice(tail);
            out
        };
        let own_line = format!("{A} {B} {own}\0{CAPS}");
        let upper = format!("{} {B} {own}\0{CAPS}", A.to_uppercase());
        let mixed = format!("{A} {} {own}\0{CAPS}", "ab".repeat(32));
        let second_with_nul = format!("{A} {B} {own}\0 side-band-64k");
        let options = format!("{A} {B} {own}\0 push-options side-band-64k");
        let with_space = format!("{A} {B} {own} extra");
        let cases: Vec<Vec<u8>> = vec![
            raw(&[b"hello"], PACK),
            raw(&[own_line.as_bytes(), b"unexpected line"], PACK),
            raw(&[upper.as_bytes()], PACK),
            raw(&[mixed.as_bytes()], PACK),
            raw(&[own_line.as_bytes(), second_with_nul.as_bytes()], PACK),
            raw(&[options.as_bytes()], PACK),
            raw(&[with_space.as_bytes()], PACK),
            raw(&[format!("{A} {B} ").as_bytes()], PACK),
            raw(&[own_line.as_bytes(), format!("shallow {A}").as_bytes()], PACK),
            raw(&[b"shallow nothex"], PACK),
            raw(&[own_line.as_bytes()], b"0009extra"),
            b"00zzjunk".to_vec(),
            b"0003".to_vec(),
            [&b"0001"[..], &pktline::encode(own_line.as_bytes())].concat(),
            pktline::encode(own_line.as_bytes()),
            vec![0xff; 100],
        ];
        for case in cases {
            assert!(
                refused(&decide(&case, SESSION, true)).is_some(),
                "{:?}",
                String::from_utf8_lossy(&case)
            );
        }
        // Oversized: more command lines than any sortie push has, with no flush in sight.
        let line = pktline::encode(format!("{A} {B} {own}").as_bytes());
        let huge: Vec<u8> = line.iter().copied().cycle().take(MAX_COMMAND_SECTION + 4096).collect();
        assert!(
            refused(&decide(&huge, SESSION, false)).is_some_and(|r| r.contains("too large") || r.contains("may not"))
        );
    }

    #[test]
    fn refusals_are_what_git_push_prints() {
        let refs = vec!["refs/heads/main".to_owned()];
        let answer = refusal("refs/heads/main may not be pushed", &refs, true);
        let mut expected = Vec::new();
        expected.extend(pktline::encode(b"\x02sortie: push refused\n"));
        expected.extend(pktline::encode(b"\x02sortie: refs/heads/main may not be pushed\n"));
        let report = [
            pktline::encode(b"unpack ok\n"),
            pktline::encode(b"ng refs/heads/main refs/heads/main may not be pushed\n"),
            pktline::FLUSH.to_vec(),
        ]
        .concat();
        expected.extend(pktline::encode(&[&[1_u8][..], &report].concat()));
        expected.extend_from_slice(pktline::FLUSH);
        assert_eq!(answer, expected);
        assert_eq!(
            refusal("x\ny", &refs, false),
            [
                pktline::encode(b"unpack ok\n"),
                pktline::encode(b"ng refs/heads/main x y\n"),
                pktline::FLUSH.to_vec()
            ]
            .concat()
        );
    }

    /// Reads `answer` as pkt-lines up to its final flush; returns the data payloads.
    fn payloads(answer: &[u8]) -> Vec<Vec<u8>> {
        let mut offset = 0;
        let mut out = Vec::new();
        loop {
            match pktline::read(&answer[offset..]) {
                Ok((Packet::Data(data), used)) => {
                    out.push(data.to_vec());
                    offset += used;
                }
                Ok((Packet::Flush, used)) if offset + used == answer.len() => return out,
                other => panic!("not pkt-lines at {offset}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_refusal_naming_a_huge_refname_is_still_pkt_lines() {
        // The longest refname a first command (with its capabilities) can carry.
        let huge = format!(
            "refs/heads/{}",
            "x".repeat(pktline::MAX_PACKET - 4 - 82 - 11 - 1 - CAPS.len())
        );
        let body = body(&[(A, B, huge.as_str())], PACK);
        let Decision::Refuse {
            reason,
            updates,
            side_band,
        } = decide(&body, SESSION, true)
        else {
            panic!("not refused")
        };
        let refnames = Decision::refnames(&updates);
        assert!(
            refnames == [huge.clone()],
            "refused for another reason: {}",
            truncate(&reason)
        );
        for side_band in [side_band, false] {
            let answer = refusal(&reason, &refnames, side_band);
            let report = if side_band {
                payloads(&answer)
                    .into_iter()
                    .filter_map(|p| p.strip_prefix(&[1_u8][..]).map(<[u8]>::to_vec))
                    .flatten()
                    .collect()
            } else {
                answer
            };
            let lines = payloads(&report);
            assert_eq!(lines.len(), 2);
            assert!(lines[1].starts_with(format!("ng {huge} ").as_bytes()));
        }
    }

    #[test]
    fn arbitrary_input_never_panics() {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let alphabet = b"0123456789abcdef \0\nPACKrefs/heads/sortie/push-cert";
        for _ in 0..5_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 300) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| alphabet[((state.rotate_left(i as u32 % 64)) % alphabet.len() as u64) as usize])
                .collect();
            let _ = decide(&bytes, SESSION, state.is_multiple_of(2));
        }
    }
}
