//! The gateway (DESIGN §7): the only way into a sandbox and the only way out of one.
//!
//! Attach (§7.1: ticketed streams, a client that takes nothing dropped, never the agent; `stall`
//! resets its connection; `live`: the host's own copy of a running turn, the only live source), the
//! egress proxy (§7.2: allowlisted names only, resolved and vetted here, `/_sortie/…` routed inside),
//! the git smart-HTTP proxy (§7.3: every `receive-pack` request decided before git sees a byte,
//! refusals that `git push` prints) and the model proxy (§7.4); `links`: drivers that dial out (§15)
//! offer their API here, identified by the cluster.
//! Nothing here may ever forward a byte it has not understood, or a credential into a sandbox.

pub mod attach;
pub mod egress;
pub mod git;
pub mod links;
pub mod live;
pub mod model;
pub mod stall;
pub mod tickets;
