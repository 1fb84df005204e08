//! The driver: inside the sandbox it spawns the agent (a fresh process each turn), speaks ACP to it,
//! maps every update to AI SDK UI message chunks, keeps each turn in a hub (memory) and a log (file),
//! serves turns on an HTTP API (DESIGN §6.2, bodies in `sortie_protocol::driver`) on the host's
//! socket or on a link it dials to the gateway (§15), primes a fresh agent with the session's context
//! (§6.4), runs the setup script, and delivers each turn's work as a commit pushed to the session's
//! branch (§7.3).
//!
//! It must never hold a credential: everything it reaches outside the sandbox goes through the
//! gateway. The host believes nothing it says (DESIGN §9 invariant 9): the driver's stream carries
//! the agent's chunks only, and sortie's own parts (`data-sortie-*`) are the host's to write.

pub mod agent;
pub mod api;
pub mod assignment;
pub mod delivery;
pub mod driver;
pub mod home;
pub mod launch;
pub mod link;
pub mod mapping;
pub mod priming;
pub mod push;
pub mod refresh;
/// Agent profiles live in their own crate, which the worker reads without linking the driver.
pub use sortie_profile as profile;
pub mod relay;
/// What counts as a secret: its own crate, shared with the gateway's scan of pushed packs.
pub use sortie_secrets as secrets;
pub mod setup;
