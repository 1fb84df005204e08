//! Attach tickets (DESIGN §5): `base64url(claims) "." base64url(HMAC-SHA256(secret, claims))`.
//!
//! Minted by the api, verified by the gateway. This module checks signature, expiry, session and
//! action; claiming the nonce once is the store's job, since only the store can see every replica.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::api::TicketAction;

/// The claims format version.
pub const TICKET_VERSION: u32 = 1;
/// The longest a ticket may live (DESIGN §5).
pub const TICKET_MAX_TTL_SECONDS: i64 = 90;
/// The longest encoded ticket the verifier reads; anything longer is invalid without decoding.
const TICKET_MAX_LEN: usize = 2048;

/// What a ticket says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TicketClaims {
    pub v: u32,
    /// The token that minted it (its public id, never the secret).
    pub sub: String,
    /// The workspace.
    pub ws: String,
    /// The session.
    pub ses: String,
    pub act: TicketAction,
    /// Expiry, epoch seconds.
    pub exp: i64,
    /// Random; claimed once in the store.
    pub nonce: String,
}

/// Why a ticket was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error("the ticket is malformed or its signature does not match")]
    Invalid,
    #[error("the ticket is for another session or action")]
    WrongTarget,
    #[error("the ticket has expired")]
    Expired,
}

type HmacSha256 = Hmac<Sha256>;

fn signature(secret: &[u8], payload: &[u8]) -> Vec<u8> {
    // HMAC takes keys of any length, so this cannot fail; an empty tag would never verify anyway.
    match <HmacSha256 as KeyInit>::new_from_slice(secret) {
        Ok(mut mac) => {
            mac.update(payload);
            mac.finalize().into_bytes().to_vec()
        }
        Err(_) => Vec::new(),
    }
}

/// Encodes and signs claims.
pub fn mint(secret: &[u8], claims: &TicketClaims) -> String {
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap_or_default());
    let tag = URL_SAFE_NO_PAD.encode(signature(secret, payload.as_bytes()));
    format!("{payload}.{tag}")
}

/// Checks signature (constant time), expiry, session and action. `now` is epoch seconds.
pub fn verify(
    secret: &[u8],
    ticket: &str,
    now: i64,
    session_id: &str,
    action: TicketAction,
) -> Result<TicketClaims, TicketError> {
    if ticket.len() > TICKET_MAX_LEN {
        return Err(TicketError::Invalid);
    }
    let (payload, tag) = ticket.split_once('.').ok_or(TicketError::Invalid)?;
    let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| TicketError::Invalid)?;
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret).map_err(|_| TicketError::Invalid)?;
    mac.update(payload.as_bytes());
    mac.verify_slice(&tag).map_err(|_| TicketError::Invalid)?;
    let json = URL_SAFE_NO_PAD.decode(payload).map_err(|_| TicketError::Invalid)?;
    let claims: TicketClaims = serde_json::from_slice(&json).map_err(|_| TicketError::Invalid)?;
    if claims.v != TICKET_VERSION {
        return Err(TicketError::Invalid);
    }
    if claims.ses != session_id || claims.act != action {
        return Err(TicketError::WrongTarget);
    }
    if claims.exp <= now {
        return Err(TicketError::Expired);
    }
    Ok(claims)
}

/// How long a feed token lives: a gateway mints one for each request it routes to a worker's feed.
pub const FEED_TOKEN_TTL_SECONDS: i64 = 60;

/// What a feed token signs: domain-separated from attach tickets (whose signed text is base64, never
/// holding a NUL byte).
fn feed_message(session_id: &str, n: u32, exp: i64) -> Vec<u8> {
    format!("sortie-feed\0{session_id}\0{n}\0{exp}").into_bytes()
}

/// A gateway's proof, to a worker in another process, that it may read the live copy of turn `n` of a
/// session: `<expiry, epoch seconds>.<base64url(HMAC-SHA256(secret, …))>`, under the ticket secret
/// every replica shares.
pub fn mint_feed_token(secret: &[u8], session_id: &str, n: u32, exp: i64) -> String {
    let tag = URL_SAFE_NO_PAD.encode(signature(secret, &feed_message(session_id, n, exp)));
    format!("{exp}.{tag}")
}

/// Checks a feed token (constant time) for turn `n` of `session_id`. `now` is epoch seconds; a token
/// that would live longer than [`FEED_TOKEN_TTL_SECONDS`] from now is refused too.
pub fn verify_feed_token(secret: &[u8], token: &str, now: i64, session_id: &str, n: u32) -> Result<(), TicketError> {
    if token.len() > TICKET_MAX_LEN {
        return Err(TicketError::Invalid);
    }
    let (exp, tag) = token.split_once('.').ok_or(TicketError::Invalid)?;
    let exp: i64 = exp.parse().map_err(|_| TicketError::Invalid)?;
    let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| TicketError::Invalid)?;
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret).map_err(|_| TicketError::Invalid)?;
    mac.update(&feed_message(session_id, n, exp));
    mac.verify_slice(&tag).map_err(|_| TicketError::WrongTarget)?;
    if exp <= now || exp > now.saturating_add(FEED_TOKEN_TTL_SECONDS) {
        return Err(TicketError::Expired);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(exp: i64) -> TicketClaims {
        TicketClaims {
            v: TICKET_VERSION,
            sub: "tok_1".into(),
            ws: "default".into(),
            ses: "ses_01jd8x3k4m5n6p7q8r9s0t1v2w".into(),
            act: TicketAction::Attach,
            exp,
            nonce: "n1".into(),
        }
    }

    #[test]
    fn a_minted_ticket_verifies_until_it_expires() {
        let ticket = mint(b"secret", &claims(1_060));
        let ses = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
        assert_eq!(
            verify(b"secret", &ticket, 1_000, ses, TicketAction::Attach),
            Ok(claims(1_060))
        );
        assert_eq!(
            verify(b"secret", &ticket, 1_060, ses, TicketAction::Attach),
            Err(TicketError::Expired)
        );
        assert_eq!(
            verify(b"other", &ticket, 1_000, ses, TicketAction::Attach),
            Err(TicketError::Invalid)
        );
        assert_eq!(
            verify(b"secret", &ticket, 1_000, "ses_x", TicketAction::Attach),
            Err(TicketError::WrongTarget)
        );
        assert_eq!(
            verify(b"secret", &ticket, 1_000, ses, TicketAction::Turn),
            Err(TicketError::WrongTarget)
        );
    }

    #[test]
    fn tampering_and_garbage_are_invalid() {
        let ticket = mint(b"secret", &claims(1_060));
        let (payload, tag) = ticket.split_once('.').expect("two parts");
        let forged_payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims(9_999)).expect("json"));
        let ses = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
        for bad in [
            String::new(),
            ".".into(),
            payload.to_owned(),
            format!("{forged_payload}.{tag}"),
            format!("{payload}.{tag}x"),
            format!("{payload}.!!"),
            "a".repeat(5000),
        ] {
            assert_eq!(
                verify(b"secret", &bad, 1_000, ses, TicketAction::Attach),
                Err(TicketError::Invalid),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_feed_token_opens_one_turn_of_one_session_for_a_minute() {
        let secret = b"shared by every replica";
        let session = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
        let now = 1_800_000_000;
        let token = mint_feed_token(secret, session, 2, now + FEED_TOKEN_TTL_SECONDS);
        assert_eq!(verify_feed_token(secret, &token, now, session, 2), Ok(()));
        // Another turn, another session, another secret: the signature does not match.
        assert_eq!(
            verify_feed_token(secret, &token, now, session, 3),
            Err(TicketError::WrongTarget)
        );
        assert_eq!(
            verify_feed_token(secret, &token, now, "ses_01jd8x3k4m5n6p7q8r9s0t1v2x", 2),
            Err(TicketError::WrongTarget)
        );
        assert_eq!(
            verify_feed_token(b"another", &token, now, session, 2),
            Err(TicketError::WrongTarget)
        );
        // Expired, or minted to live longer than a feed token may.
        assert_eq!(
            verify_feed_token(secret, &token, now + FEED_TOKEN_TTL_SECONDS, session, 2),
            Err(TicketError::Expired)
        );
        let long = mint_feed_token(secret, session, 2, now + FEED_TOKEN_TTL_SECONDS + 1);
        assert_eq!(
            verify_feed_token(secret, &long, now, session, 2),
            Err(TicketError::Expired)
        );
        // A moved expiry breaks the signature; garbage is invalid.
        let (_, tag) = token.split_once('.').expect("dot");
        let moved = format!("{}.{tag}", now + 30);
        assert_eq!(
            verify_feed_token(secret, &moved, now, session, 2),
            Err(TicketError::WrongTarget)
        );
        for garbage in ["", ".", "x.y", "12", "12.!!", &"9".repeat(5000)] {
            assert!(
                verify_feed_token(secret, garbage, now, session, 2).is_err(),
                "{garbage:?}"
            );
        }
    }
}
