//! Git smart HTTP: pkt-line framing and the receive-pack confinement rule.

pub mod http;
pub mod pktline;
pub mod receive_pack;
