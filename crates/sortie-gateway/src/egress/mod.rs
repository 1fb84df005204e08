//! The egress proxy: the sandbox's only way out.

pub mod policy;
pub mod proxy;
pub mod registries;
