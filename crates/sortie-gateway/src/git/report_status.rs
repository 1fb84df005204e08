//! The upstream's answer to a forwarded `receive-pack` (`ref/git-proxy.md` §3): report-status (v1
//! or v2), side-band multiplexed or not, read to learn what the upstream did with each ref. The git
//! proxy's record of a push ([`crate::git::config::PushOutcome`]) comes from here, never from
//! anything the sandbox says.
//!
//! Pure and strict: the caller bounds the answer before handing it in; anything that is not what
//! receive-pack writes is an error (and a push whose answer cannot be read is never taken as accepted).

use crate::git::pktline::{self, Packet, PacketError};

/// What the upstream said about one ref.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefReport {
    pub refname: String,
    /// `Ok` for `ok <ref>`; `Err(reason)` for `ng <ref> <reason>`.
    pub result: Result<(), String>,
}

/// A whole report-status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// `Ok` for `unpack ok`; `Err(text)` for `unpack <text>`.
    pub unpack: Result<(), String>,
    pub refs: Vec<RefReport>,
}

impl Report {
    /// Whether the upstream took `refname`: the pack unpacked and the ref reported `ok`.
    pub fn accepted(&self, refname: &str) -> bool {
        self.unpack.is_ok() && self.refs.iter().any(|r| r.refname == refname && r.result.is_ok())
    }

    /// Why the upstream did not take `refname` (`None` if it did).
    pub fn rejection(&self, refname: &str) -> Option<String> {
        if let Err(text) = &self.unpack {
            return Some(format!("the upstream could not unpack the push: {text}"));
        }
        match self.refs.iter().find(|r| r.refname == refname) {
            Some(RefReport { result: Ok(()), .. }) => None,
            Some(RefReport {
                result: Err(reason), ..
            }) => Some(format!("the upstream refused it: {reason}")),
            None => Some("the upstream did not report on this ref".to_owned()),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("the upstream's answer ended before its report was complete")]
    Incomplete,
    #[error("the upstream's answer is not a report-status: {0}")]
    Malformed(String),
    #[error("the upstream reported an error: {0}")]
    Remote(String),
}

/// Reads `answer` (the whole body of the upstream's 200 answer). `side_band`: the push asked for
/// `side-band` or `side-band-64k` (the report then travels in band 1, progress in band 2 and a fatal
/// error in band 3).
pub fn parse(answer: &[u8], side_band: bool) -> Result<Report, ReportError> {
    if !side_band {
        let (report, used) = read_report(answer)?;
        if used != answer.len() {
            return Err(malformed("data after the report's flush"));
        }
        return Ok(report);
    }
    let mut report = Vec::new();
    let mut offset = 0;
    loop {
        let (packet, used) = pktline::read(&answer[offset..]).map_err(packet_error)?;
        offset += used;
        match packet {
            Packet::Flush => break,
            Packet::Data(data) => match data.split_first() {
                Some((1, rest)) => report.extend_from_slice(rest),
                Some((2, _)) => {}
                Some((3, message)) => return Err(ReportError::Remote(text(message))),
                _ => return Err(malformed("a packet on no known side-band")),
            },
            Packet::Delimiter | Packet::ResponseEnd => return Err(malformed("an unexpected special packet")),
        }
    }
    if offset != answer.len() {
        return Err(malformed("data after the final flush"));
    }
    let (parsed, used) = read_report(&report)?;
    if used != report.len() {
        return Err(malformed("data after the report's flush"));
    }
    Ok(parsed)
}

/// One report-status up to its flush; returns it and how many bytes it took.
fn read_report(input: &[u8]) -> Result<(Report, usize), ReportError> {
    let mut offset = 0;
    let mut unpack = None;
    let mut refs = Vec::new();
    loop {
        let (packet, used) = pktline::read(&input[offset..]).map_err(packet_error)?;
        offset += used;
        let line = match packet {
            Packet::Flush => break,
            Packet::Data(line) => line.strip_suffix(b"\n").unwrap_or(line),
            Packet::Delimiter | Packet::ResponseEnd => return Err(malformed("an unexpected special packet")),
        };
        if let Some(message) = line.strip_prefix(b"ERR ") {
            return Err(ReportError::Remote(text(message)));
        }
        if unpack.is_none() {
            let Some(status) = line.strip_prefix(b"unpack ") else {
                return Err(malformed("it does not start with an unpack status"));
            };
            unpack = Some(if status == b"ok" { Ok(()) } else { Err(text(status)) });
            continue;
        }
        if let Some(refname) = line.strip_prefix(b"ok ") {
            refs.push(RefReport {
                refname: refname_of(refname)?,
                result: Ok(()),
            });
        } else if let Some(rest) = line.strip_prefix(b"ng ") {
            let (refname, reason) = match rest.iter().position(|b| *b == b' ') {
                Some(space) => (&rest[..space], &rest[space + 1..]),
                None => (rest, &b""[..]),
            };
            refs.push(RefReport {
                refname: refname_of(refname)?,
                result: Err(text(reason)),
            });
        } else if line.starts_with(b"option ") {
            // report-status-v2 adds `option refname|old-oid|new-oid|forced-update` after an `ok`;
            // sortie pushes one ref by its own name, so the options change nothing it records.
            if refs.is_empty() {
                return Err(malformed("an option before any ref status"));
            }
        } else {
            return Err(malformed("an unknown line"));
        }
    }
    let unpack = unpack.ok_or_else(|| malformed("it has no unpack status"))?;
    Ok((Report { unpack, refs }, offset))
}

fn refname_of(bytes: &[u8]) -> Result<String, ReportError> {
    match std::str::from_utf8(bytes) {
        Ok(name) if !name.is_empty() && !name.contains(' ') => Ok(name.to_owned()),
        _ => Err(malformed("a ref status without a usable refname")),
    }
}

fn packet_error(error: PacketError) -> ReportError {
    match error {
        PacketError::Incomplete => ReportError::Incomplete,
        PacketError::BadLength(text) => ReportError::Malformed(format!("bad pkt-line length {text:?}")),
    }
}

fn malformed(what: &str) -> ReportError {
    ReportError::Malformed(what.to_owned())
}

/// Text from the upstream, on one line and short (it ends up in a refusal reason and a log).
fn text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim().replace(['\n', '\r'], " ");
    text.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2w";

    fn lines(lines: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for line in lines {
            out.extend(pktline::encode(line.as_bytes()));
        }
        out.extend_from_slice(pktline::FLUSH);
        out
    }

    /// `report` wrapped in band 1 (cut into `piece`-byte packets), with progress in band 2 first.
    fn side_band(report: &[u8], piece: usize) -> Vec<u8> {
        let mut out = pktline::encode(b"\x02Resolving deltas: 100% (1/1)\n");
        for chunk in report.chunks(piece) {
            out.extend(pktline::encode(&[&[1_u8][..], chunk].concat()));
        }
        out.extend_from_slice(pktline::FLUSH);
        out
    }

    #[test]
    fn what_receive_pack_writes_is_read_per_ref() {
        let accepted = lines(&["unpack ok\n", &format!("ok {OWN}\n")]);
        let v2 = lines(&[
            "unpack ok\n",
            &format!("ok {OWN}\n"),
            &format!("option refname {OWN}\n"),
            "option forced-update\n",
        ]);
        let stale = lines(&["unpack ok\n", &format!("ng {OWN} stale info\n")]);
        let unpack_failed = lines(&["unpack index-pack failed\n", &format!("ng {OWN} unpacker error\n")]);
        for piece in [1, 7, 65515] {
            for (answer, accepted_, reason) in [
                (&accepted, true, None),
                (&v2, true, None),
                (&stale, false, Some("the upstream refused it: stale info")),
                (
                    &unpack_failed,
                    false,
                    Some("the upstream could not unpack the push: index-pack failed"),
                ),
            ] {
                for report in [
                    parse(answer, false).expect("plain"),
                    parse(&side_band(answer, piece), true).expect("side-band"),
                ] {
                    assert_eq!(report.accepted(OWN), accepted_);
                    assert_eq!(report.rejection(OWN).as_deref(), reason);
                    assert!(!report.accepted("refs/heads/main"));
                    let unpack_failed = reason.filter(|r| r.contains("unpack"));
                    assert_eq!(
                        report.rejection("refs/heads/main").as_deref(),
                        Some(unpack_failed.unwrap_or("the upstream did not report on this ref"))
                    );
                }
            }
        }
    }

    #[test]
    fn anything_else_is_an_error_never_an_acceptance() {
        let ok = format!("ok {OWN}\n");
        let cases: Vec<(Vec<u8>, bool)> = vec![
            (Vec::new(), false),
            (b"0000".to_vec(), false),
            (lines(&[&ok]), false),
            (lines(&["unpack ok\n", "hello\n"]), false),
            (lines(&["unpack ok\n", "ok \n"]), false),
            (lines(&["unpack ok\n", "option refname x\n"]), false),
            (lines(&["ERR access denied\n"]), false),
            (pktline::encode(b"unpack ok\n"), false),
            (side_band(&lines(&["unpack ok\n", &ok]), 5)[..20].to_vec(), true),
            (
                [pktline::encode(b"\x03fatal: out of memory\n"), b"0000".to_vec()].concat(),
                true,
            ),
            ([pktline::encode(b"\x05what\n"), b"0000".to_vec()].concat(), true),
            (
                [
                    side_band(&lines(&["unpack ok\n", &ok]), 9),
                    pktline::encode(b"\x01more"),
                ]
                .concat(),
                true,
            ),
            (
                side_band(&[lines(&["unpack ok\n", &ok]), b"junk".to_vec()].concat(), 9),
                true,
            ),
            (b"zzzz".to_vec(), false),
            (b"HTTP/1.1 200 OK\r\n".to_vec(), true),
        ];
        for (answer, side_band) in cases {
            let parsed = parse(&answer, side_band);
            assert!(
                parsed.as_ref().map_or(true, |report| !report.accepted(OWN)),
                "{:?} was read as accepted",
                String::from_utf8_lossy(&answer)
            );
        }
        assert_eq!(
            parse(
                &[pktline::encode(b"\x03fatal: out of memory\n"), b"0000".to_vec()].concat(),
                true
            ),
            Err(ReportError::Remote("fatal: out of memory".into()))
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state: u64 = 0x51_7CC1_B727_220A;
        let alphabet = b"0123456789abcdef \n\x01\x02\x03okngunpack refs/heads";
        for _ in 0..5_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 120) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| alphabet[((state.rotate_left(i as u32 % 64)) % alphabet.len() as u64) as usize])
                .collect();
            let _ = parse(&bytes, state.is_multiple_of(2));
        }
    }
}
