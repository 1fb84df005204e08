//! The driver: inside the sandbox it spawns the agent, speaks ACP to it, maps every update to AI SDK
//! UI message chunks, keeps each turn in a hub (memory) and a log (file), and serves turns on a local
//! HTTP API (DESIGN §6.2).
//!
//! It must never hold a credential: everything it reaches outside the sandbox goes through the gateway.

pub mod agent;
pub mod api;
pub mod driver;
pub mod hub;
pub mod mapping;
pub mod profile;
pub mod relay;
