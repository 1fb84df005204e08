//! A turn's parts as they are made, for any number of readers: [`hub::TurnHub`] keeps them in memory
//! (bounded, the oldest served from an optional append-only log past the bound), wakes readers without
//! ever waiting for one, and resumes a reader exactly after any part index; [`sse`] encodes what a
//! reader takes as the SSE body of a UI message stream.
//!
//! The driver keeps each turn it runs in one (with its log in the sandbox's `$HOME`); the worker keeps
//! the host's own copy of the running turn in one (no log: the store is the record), which the
//! gateway's attach serves live. It must never block a publisher on a reader.

pub mod hub;
pub mod sse;
