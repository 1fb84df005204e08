//! Git smart HTTP: pkt-line framing, the receive-pack confinement rule, the host-side git the proxy
//! runs, the secret scan of pushed packs, the upstream's report-status and the proxy itself.

mod child;
pub mod config;
pub mod diff;
pub mod http;
pub mod launch;
pub mod pktline;
pub(crate) mod process;
pub mod receive_pack;
pub mod report_status;
pub mod scan;
