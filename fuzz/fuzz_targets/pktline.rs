//! The pkt-line reader on arbitrary bytes: it never panics, never claims more bytes than it was
//! given, keeps every packet within `MAX_PACKET`, and what it reads is exactly what `encode` writes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sortie_gateway::git::pktline::{self, MAX_PACKET, Packet, PacketError};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    loop {
        match pktline::read(rest) {
            Ok((packet, used)) => {
                assert!((4..=rest.len()).contains(&used), "used {used} of {}", rest.len());
                assert!(used <= MAX_PACKET);
                match packet {
                    Packet::Flush => assert_eq!(&rest[..used], b"0000"),
                    Packet::Delimiter => assert_eq!(&rest[..used], b"0001"),
                    Packet::ResponseEnd => assert_eq!(&rest[..used], b"0002"),
                    Packet::Data(payload) => {
                        assert_eq!(payload.len(), used - 4);
                        assert_eq!(pktline::encode(payload), &rest[..used], "read and encode agree");
                    }
                }
                rest = &rest[used..];
            }
            Err(PacketError::Incomplete) => {
                // Only a prefix of a well-formed packet is incomplete: a header cut short, or a
                // valid length with fewer bytes behind it.
                if let Some(header) = rest.get(..4) {
                    let length = std::str::from_utf8(header)
                        .ok()
                        .and_then(|h| usize::from_str_radix(h, 16).ok())
                        .expect("an incomplete packet has a hex length");
                    assert!(length > rest.len() && length <= MAX_PACKET);
                }
                break;
            }
            Err(PacketError::BadLength(_)) => break,
        }
    }
});
