//! The delivery's push spoken straight to the session's git proxy: one `git pack-objects` and one
//! HTTP request. `git push` starts git, `git remote-http` and `git send-pack`, and first asks the
//! proxy for the remote's refs — a round trip to a `git http-backend` on the host — though the
//! delivery already knows what the remote holds: its last delivered commit and the commit the
//! workspace was cloned at.
//!
//! Nothing is trusted for it: the proxy checks this request as it checks any push (DESIGN §9). Any
//! answer but the branch's "ok" is left to `git push`, whose words, retries and reading of the remote
//! the delivery already understands; a push that landed without its answer is then found there.

use std::time::Duration;

use futures::StreamExt;
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::{Bytes, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::delivery::Git;

/// The sandbox's relay to the host; only a remote behind it is pushed to this way.
pub const RELAY: &str = "127.0.0.1:3128";
/// The most of the proxy's answer read (a report names one ref).
const ANSWER_MAX_BYTES: usize = 64 << 10;
/// How much of the pack is read from `git pack-objects` at a time.
const CHUNK_BYTES: usize = 64 << 10;

/// One ref update for [`push`].
pub struct Update<'a> {
    /// `refs/heads/…`
    pub refname: &'a str,
    pub new: &'a str,
    /// Where the ref must be now (the lease); `None`: it must not exist.
    pub old: Option<&'a str>,
    /// Commits the remote has, so the pack leaves them and their history out.
    pub haves: &'a [&'a str],
}

/// The path on `relay` (`host:port`) of a push URL `git remote get-url --push` gave, when it is
/// that relay's.
pub fn relay_path<'u>(url: &'u str, relay: &str) -> Option<&'u str> {
    let path = url.strip_prefix("http://")?.strip_prefix(relay)?;
    let plain = path.starts_with('/')
        && !path.contains(['?', '#', ' ', '\n', '\r'])
        && path.split('/').all(|part| part != "." && part != "..");
    plain.then_some(path)
}

/// The receive-pack request's command section: the update with its capabilities, then a flush.
/// Without side-band the answer is plain report-status lines.
fn command_section(update: &Update<'_>) -> Vec<u8> {
    let zero = "0".repeat(update.new.len());
    let old = update.old.unwrap_or(&zero);
    let line = format!(
        "{old} {} {}\0report-status ofs-delta agent=sortie-driver\n",
        update.new, update.refname
    );
    let mut section = format!("{:04x}", line.len() + 4).into_bytes();
    section.extend_from_slice(line.as_bytes());
    section.extend_from_slice(b"0000");
    section
}

/// Whether a report-status answer says the pack was unpacked and `refname` updated.
pub fn reports_ok(answer: &[u8], refname: &str) -> bool {
    let mut unpacked = false;
    let mut updated = false;
    let mut rest = answer;
    while rest.len() >= 4 {
        let Some(length) = std::str::from_utf8(&rest[..4])
            .ok()
            .and_then(|hex| usize::from_str_radix(hex, 16).ok())
        else {
            return false;
        };
        if length == 0 {
            return unpacked && updated;
        }
        if length < 4 || length > rest.len() {
            return false;
        }
        let line = &rest[4..length];
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        match line {
            b"unpack ok" => unpacked = true,
            _ if line.starts_with(b"ok ") && &line[3..] == refname.as_bytes() => updated = true,
            _ => {}
        }
        rest = &rest[length..];
    }
    false
}

/// Pushes `update` to the proxy at `path` on `relay`; `Err` says why it did not land as asked (for
/// the log: the caller pushes again with git).
pub async fn push(git: &Git, relay: &str, path: &str, update: &Update<'_>, within: Duration) -> Result<(), String> {
    tokio::time::timeout(within, push_now(git, relay, path, update))
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", within.as_secs())))
}

async fn push_now(git: &Git, relay: &str, path: &str, update: &Update<'_>) -> Result<(), String> {
    let mut command = git.command(&[
        "pack-objects",
        "--revs",
        "--thin",
        "--stdout",
        "--delta-base-offset",
        "-q",
    ]);
    command.stdin(std::process::Stdio::piped());
    let mut packer = command
        .spawn()
        .map_err(|e| format!("cannot run git pack-objects: {e}"))?;
    let (Some(mut stdin), Some(stdout)) = (packer.stdin.take(), packer.stdout.take()) else {
        return Err("git pack-objects has no pipes".into());
    };
    let mut revisions = format!("{}\n", update.new);
    for have in update.old.iter().chain(update.haves) {
        revisions.push_str(&format!("^{have}\n"));
    }
    stdin
        .write_all(revisions.as_bytes())
        .await
        .map_err(|e| format!("cannot tell git pack-objects what to pack: {e}"))?;
    drop(stdin);

    let section = Bytes::from(command_section(update));
    let head = futures::stream::once(async move { Ok::<_, std::io::Error>(Frame::data(section)) });
    let pack = futures::stream::unfold(stdout, |mut stdout| async move {
        let mut chunk = vec![0; CHUNK_BYTES];
        match stdout.read(&mut chunk).await {
            Ok(0) => None,
            Ok(read) => {
                chunk.truncate(read);
                Some((Ok(Frame::data(Bytes::from(chunk))), stdout))
            }
            Err(error) => Some((Err(error), stdout)),
        }
    });
    let body = StreamBody::new(head.chain(pack));
    let request = hyper::Request::post(format!("{path}/git-receive-pack"))
        .header(hyper::header::HOST, relay)
        .header(hyper::header::CONTENT_TYPE, "application/x-git-receive-pack-request")
        .header(hyper::header::ACCEPT, "application/x-git-receive-pack-result")
        .header(hyper::header::USER_AGENT, "git/sortie-driver")
        .body(body)
        .map_err(|e| format!("cannot make the push request: {e}"))?;

    let connection = tokio::net::TcpStream::connect(relay)
        .await
        .map_err(|e| format!("cannot reach the relay: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(connection))
        .await
        .map_err(|e| format!("cannot speak HTTP to the relay: {e}"))?;
    let connection = tokio::spawn(connection);
    let answered = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("the push request failed: {e}"))?;
        if response.status() != hyper::StatusCode::OK {
            return Err(format!("the git proxy answered {}", response.status()));
        }
        let answer = Limited::new(response.into_body(), ANSWER_MAX_BYTES)
            .collect()
            .await
            .map_err(|e| format!("the answer to the push broke off: {e}"))?
            .to_bytes();
        if reports_ok(&answer, update.refname) {
            Ok(())
        } else {
            Err(format!(
                "the push was not taken: {}",
                String::from_utf8_lossy(&answer[..answer.len().min(512)]).trim()
            ))
        }
    }
    .await;
    connection.abort();
    let packed = packer.wait().await.map_err(|e| format!("git pack-objects: {e}"))?;
    if answered.is_ok() && !packed.success() {
        // The proxy took what came: a pack cut short would not have unpacked.
        tracing::warn!(%packed, "git pack-objects failed after a push the proxy took");
    }
    answered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_path_on_the_relay_is_pushed_to() {
        assert_eq!(
            relay_path("http://127.0.0.1:3128/_sortie/git/srv/repo.git", RELAY),
            Some("/_sortie/git/srv/repo.git")
        );
        for other in [
            "https://127.0.0.1:3128/_sortie/git/r",
            "http://127.0.0.1:31280/_sortie/git/r",
            "http://github.com/o/r",
            "/srv/repo.git",
            "origin",
            "http://127.0.0.1:3128/_sortie/git/r?x=1",
            "http://127.0.0.1:3128/_sortie/git/../r",
            "http://127.0.0.1:3128",
        ] {
            assert_eq!(relay_path(other, RELAY), None, "{other}");
        }
    }

    #[test]
    fn the_command_section_is_one_pkt_line_and_a_flush() {
        let update = Update {
            refname: "refs/heads/sortie/ses_1",
            new: &"b".repeat(40),
            old: None,
            haves: &[],
        };
        let section = command_section(&update);
        let text = String::from_utf8_lossy(&section);
        assert!(text.ends_with("\n0000"), "{text}");
        let length = usize::from_str_radix(&text[..4], 16).expect("hex length");
        assert_eq!(length, section.len() - 4);
        assert!(text[4..].starts_with(&format!(
            "{} {} refs/heads/sortie/ses_1\0report-status",
            "0".repeat(40),
            "b".repeat(40)
        )));
    }

    #[test]
    fn only_an_unpacked_pack_and_an_updated_ref_is_ok() {
        let report = |lines: &[&str]| {
            let mut out = Vec::new();
            for line in lines {
                out.extend_from_slice(format!("{:04x}{line}\n", line.len() + 5).as_bytes());
            }
            out.extend_from_slice(b"0000");
            out
        };
        let refname = "refs/heads/sortie/ses_1";
        assert!(reports_ok(
            &report(&["unpack ok", "ok refs/heads/sortie/ses_1"]),
            refname
        ));
        for bad in [
            report(&["unpack ok", "ng refs/heads/sortie/ses_1 stale info"]),
            report(&[
                "unpack index-pack abnormal exit",
                "ng refs/heads/sortie/ses_1 unpacker error",
            ]),
            report(&["unpack ok", "ok refs/heads/other"]),
            report(&["ok refs/heads/sortie/ses_1"]),
            b"0010unpack ok\n".to_vec(),
            b"zzzz".to_vec(),
            b"0002".to_vec(),
            Vec::new(),
        ] {
            assert!(!reports_ok(&bad, refname), "{}", String::from_utf8_lossy(&bad));
        }
    }
}
