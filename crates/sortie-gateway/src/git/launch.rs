//! Parked launchers: a session's next git child, started ahead into the session's cgroup and waiting
//! for what to become. Joining a cgroup takes the kernel's threadgroup lock for writing, and the first
//! migration after a quiet spell waits out an RCU grace period (6–13 ms on this machine, every time a
//! push or fetch begins); a process parked there ahead pays it off the request's path. It is
//! `sortie git-launch`: it reads one frame from its stdin, unbuffered (what follows is the child's
//! own input), then execs git with exactly the frame's arguments, environment and identity.
//!
//! The frame: a 4-byte big-endian length, then NUL-terminated fields: the program, the argument
//! count and each argument, the variable count and each `NAME=VALUE`, then the uid and gid (`-` for
//! none). Only the proxy writes it, on a pipe the sandbox never sees; it is bounded all the same.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::CommandExt;

use super::process::{GitCommand, Identity};

/// A frame larger than this is refused (git's argv and a CGI environment are a few KiB).
const FRAME_MAX_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaunchError {
    #[error("the launch frame is cut short")]
    Truncated,
    #[error("the launch frame is {0} bytes; at most {FRAME_MAX_BYTES}")]
    TooLarge(usize),
    #[error("the launch frame's {0} is malformed")]
    Malformed(&'static str),
}

/// What a parked launcher becomes.
#[derive(Debug, PartialEq, Eq)]
pub struct Launch {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub identity: Option<(u32, u32)>,
}

pub(crate) fn encode(command: &GitCommand) -> Vec<u8> {
    let mut body = Vec::new();
    let mut field = |bytes: &[u8]| {
        body.extend_from_slice(bytes);
        body.push(0);
    };
    field(command.git.as_os_str().as_bytes());
    field(command.args.len().to_string().as_bytes());
    for arg in &command.args {
        field(arg.as_bytes());
    }
    field(command.env.len().to_string().as_bytes());
    for (name, value) in &command.env {
        let mut pair = name.as_bytes().to_vec();
        pair.push(b'=');
        pair.extend_from_slice(value.as_bytes());
        field(&pair);
    }
    match command.identity {
        Some(Identity { uid, gid }) => {
            field(uid.to_string().as_bytes());
            field(gid.to_string().as_bytes());
        }
        None => {
            field(b"-");
            field(b"-");
        }
    }
    let mut frame = u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

/// Reads a frame's body (after its length).
pub fn decode(body: &[u8]) -> Result<Launch, LaunchError> {
    if body.last() != Some(&0) {
        return Err(LaunchError::Truncated);
    }
    let mut fields = body[..body.len() - 1].split(|b| *b == 0);
    let mut next = || fields.next().ok_or(LaunchError::Truncated);
    let count = |bytes: &[u8], what| {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<usize>().ok())
            .filter(|n| *n <= FRAME_MAX_BYTES)
            .ok_or(LaunchError::Malformed(what))
    };
    let program = OsString::from_vec(next()?.to_vec());
    if program.is_empty() {
        return Err(LaunchError::Malformed("program"));
    }
    let mut args = Vec::new();
    for _ in 0..count(next()?, "argument count")? {
        args.push(OsString::from_vec(next()?.to_vec()));
    }
    let mut env = Vec::new();
    for _ in 0..count(next()?, "variable count")? {
        let pair = next()?;
        let at = pair
            .iter()
            .position(|b| *b == b'=')
            .filter(|at| *at > 0)
            .ok_or(LaunchError::Malformed("variable"))?;
        env.push((
            OsStr::from_bytes(&pair[..at]).to_owned(),
            OsStr::from_bytes(&pair[at + 1..]).to_owned(),
        ));
    }
    let id = |bytes: &[u8]| match bytes {
        b"-" => Ok(None),
        _ => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<u32>().ok())
            .map(Some)
            .ok_or(LaunchError::Malformed("identity")),
    };
    let identity = match (id(next()?)?, id(next()?)?) {
        (Some(uid), Some(gid)) => Some((uid, gid)),
        (None, None) => None,
        _ => return Err(LaunchError::Malformed("identity")),
    };
    if next().is_ok() {
        return Err(LaunchError::Malformed("end"));
    }
    Ok(Launch {
        program,
        args,
        env,
        identity,
    })
}

/// `sortie git-launch`: waits for the frame on stdin, then becomes what it says; returns only when
/// that fails.
pub fn exec_from_stdin() -> std::io::Error {
    let launch = match read_frame() {
        Ok(launch) => launch,
        Err(error) => return error,
    };
    let mut command = std::process::Command::new(&launch.program);
    command
        .args(&launch.args)
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .current_dir("/");
    if let Some((uid, gid)) = launch.identity {
        // As root, std also clears the supplementary groups before it drops the uid.
        command.gid(gid).uid(uid);
    }
    command.exec()
}

fn read_frame() -> std::io::Result<Launch> {
    // Unbuffered: a buffered reader would take the child's input that follows the frame.
    let mut stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
    let mut length = [0_u8; 4];
    stdin.read_exact(&mut length)?;
    let length = u32::from_be_bytes(length) as usize;
    if length > FRAME_MAX_BYTES {
        return Err(std::io::Error::other(LaunchError::TooLarge(length)));
    }
    let mut body = vec![0_u8; length];
    stdin.read_exact(&mut body)?;
    decode(&body).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_frame_reads_back_as_the_command_it_was_made_from() {
        let mut command = GitCommand::new(Path::new("/usr/bin/git"))
            .arg("http-backend")
            .arg("")
            .arg("a=b")
            .env("QUERY_STRING", "service=git-receive-pack&x=y=z");
        command.identity = Some(Identity { uid: 1000, gid: 100 });
        let frame = encode(&command);
        let length = u32::from_be_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
        assert_eq!(length, frame.len() - 4);
        let launch = decode(&frame[4..]).expect("decodes");
        assert_eq!(launch.program, OsString::from("/usr/bin/git"));
        assert_eq!(
            launch.args,
            vec![OsString::from("http-backend"), "".into(), "a=b".into()]
        );
        assert!(
            launch
                .env
                .contains(&("QUERY_STRING".into(), "service=git-receive-pack&x=y=z".into()))
        );
        assert!(launch.env.contains(&("LC_ALL".into(), "C".into())));
        assert_eq!(launch.identity, Some((1000, 100)));

        command.identity = None;
        assert_eq!(decode(&encode(&command)[4..]).expect("decodes").identity, None);
    }

    /// A frame body of these fields, each NUL-terminated.
    fn body(fields: &[&str]) -> Vec<u8> {
        fields.iter().flat_map(|field| field.bytes().chain([0])).collect()
    }

    #[test]
    fn malformed_frames_are_refused() {
        let good = encode(&GitCommand::new(Path::new("git")).arg("x"));
        let good = &good[4..];
        assert_eq!(decode(&good[..good.len() - 1]), Err(LaunchError::Truncated));
        assert_eq!(decode(&good[..good.len() - 3]), Err(LaunchError::Truncated));
        assert_eq!(decode(b""), Err(LaunchError::Truncated));
        for (fields, error) in [
            (&[""][..], LaunchError::Malformed("program")),
            (&["git", "many"][..], LaunchError::Malformed("argument count")),
            (&["git", "9999999999"][..], LaunchError::Malformed("argument count")),
            (
                &["git", "0", "1", "=x", "-", "-"][..],
                LaunchError::Malformed("variable"),
            ),
            (&["git", "0", "0", "1", "-"][..], LaunchError::Malformed("identity")),
            (&["git", "0", "0", "-", "-", "more"][..], LaunchError::Malformed("end")),
        ] {
            assert_eq!(decode(&body(fields)), Err(error), "{fields:?}");
        }
        assert!(decode(&body(&["git", "0", "0", "-", "-"])).is_ok());
    }
}
