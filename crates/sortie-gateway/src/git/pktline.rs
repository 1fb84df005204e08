//! pkt-line framing (git `pkt-line.h`): four lowercase hex digits give the length including
//! themselves; `0000` is a flush, `0001` a delimiter, `0002` a response end. Bounded: a packet is at
//! most [`MAX_PACKET`] bytes. No I/O: callers hand in bytes and get packets and consumed lengths back.

/// The largest packet git writes (header included).
pub const MAX_PACKET: usize = 65520;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packet<'a> {
    Flush,
    Delimiter,
    ResponseEnd,
    Data(&'a [u8]),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// More bytes are needed to finish the packet.
    #[error("incomplete packet")]
    Incomplete,
    #[error("malformed pkt-line length {0:?}")]
    BadLength(String),
}

/// Reads one packet from the front of `input`; returns it and how many bytes it took.
pub fn read(input: &[u8]) -> Result<(Packet<'_>, usize), PacketError> {
    let Some(header) = input.get(..4) else {
        return Err(PacketError::Incomplete);
    };
    let text = String::from_utf8_lossy(header).into_owned();
    // Git writes lowercase; anything else is not something git wrote.
    if !header.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)) {
        return Err(PacketError::BadLength(text));
    }
    let length = usize::from_str_radix(&text, 16).map_err(|_| PacketError::BadLength(text.clone()))?;
    match length {
        0 => Ok((Packet::Flush, 4)),
        1 => Ok((Packet::Delimiter, 4)),
        2 => Ok((Packet::ResponseEnd, 4)),
        3 | 4 => Err(PacketError::BadLength(text)),
        _ if length > MAX_PACKET => Err(PacketError::BadLength(text)),
        _ => match input.get(4..length) {
            Some(data) => Ok((Packet::Data(data), length)),
            None => Err(PacketError::Incomplete),
        },
    }
}

/// Frames `data` as one packet (the caller keeps it within [`MAX_PACKET`] - 4 bytes).
pub fn encode(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:04x}", data.len() + 4).into_bytes();
    out.extend_from_slice(data);
    out
}

/// The flush packet.
pub const FLUSH: &[u8] = b"0000";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_are_read_with_their_lengths() {
        assert_eq!(read(b"0000rest"), Ok((Packet::Flush, 4)));
        assert_eq!(read(b"0001"), Ok((Packet::Delimiter, 4)));
        assert_eq!(read(b"0002"), Ok((Packet::ResponseEnd, 4)));
        assert_eq!(read(b"0009done\nmore"), Ok((Packet::Data(b"done\n"), 9)));
        assert_eq!(read(b"0005"), Err(PacketError::Incomplete));
        assert_eq!(read(b"000"), Err(PacketError::Incomplete));
        for bad in [
            &b"0003"[..],
            b"0004",
            b"zzzz",
            b"00A9abcd",
            b"fff1",
            b"+001",
            b"-001",
            b" 001",
        ] {
            assert!(
                matches!(read(bad), Err(PacketError::BadLength(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(encode(b"done\n"), b"0009done\n");
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state: u64 = 0x2545_F491_4F6C_DD1D;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 24) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| b"0123456789abcdef\0\n "[((state >> (i % 60)) % 19) as usize])
                .collect();
            let _ = read(&bytes);
        }
    }
}
