//! The gateway (DESIGN §7): the only way into a sandbox and the only way out of one.
//!
//! So far: the pure core of the git smart-HTTP proxy (§7.3), which decides whether a `receive-pack`
//! request may reach the upstream and, when it may not, writes the answer `git push` prints. The
//! proxies and attach build on it. Nothing here may ever forward a byte it has not understood.

pub mod git;
