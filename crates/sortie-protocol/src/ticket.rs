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
}
