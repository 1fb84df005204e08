//! GitHub as sortie's forge (DESIGN §7.3, `ref/github.md`): a GitHub App signs its RS256 JWT with its
//! private key ([`app::AppKey`], on ring, from the PKCS#1 PEM GitHub hands out or its PKCS#8 form), finds
//! the installation that holds a repository, and mints installation tokens scoped to that one repository
//! with only the permissions sortie needs ([`tokens::GitHubApp`]); [`tokens::TokenCache`] keeps each until
//! a minute before it expires and drops one the forge refused. Nothing here is ever handed to a sandbox.
//!
//! [`webhook`] checks a delivery's signature and reads the comments that ask sortie for work; [`rest`]
//! makes the calls that answer them (permission, reaction, comment, pull request body, check runs).

pub mod app;
pub mod rest;
pub mod tokens;
pub mod webhook;

/// The REST API version every call pins (2022-11-28 stays supported into 2028; GHES lacks newer ones).
pub const API_VERSION: &str = "2022-11-28";
