//! Ticket checks for the conversation plane (DESIGN §5, §9.4): the ticket comes only in
//! `Authorization: Ticket <ticket>` (never the URL, never a cookie), its signature, expiry, session
//! and action are checked, then its nonce is claimed once in the store, so a replay fails on every
//! replica.

use axum::http::{HeaderMap, Uri, header};
use sortie_protocol::api::TicketAction;
use sortie_protocol::ticket::{self, TicketClaims, TicketError};
use sortie_protocol::{ErrorCode, SessionId};
use sortie_store::Tickets;

/// A refused ticket: the code (401) and a sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TicketRefusal {
    pub code: ErrorCode,
    pub message: String,
}

fn refuse(code: ErrorCode, message: &str) -> TicketRefusal {
    TicketRefusal {
        code,
        message: message.to_owned(),
    }
}

/// Checks the ticket of a stream request for `session` and `action`; `now` is epoch seconds.
pub async fn check(
    store: &dyn Tickets,
    secret: &[u8],
    headers: &HeaderMap,
    uri: &Uri,
    session: &SessionId,
    action: TicketAction,
    now: i64,
) -> Result<TicketClaims, TicketRefusal> {
    let in_url = uri.query().is_some_and(|q| {
        q.split('&')
            .any(|pair| pair.split('=').next().is_some_and(|k| k.eq_ignore_ascii_case("ticket")))
    });
    if in_url {
        return Err(refuse(
            ErrorCode::TicketInvalid,
            "tickets go in the Authorization header, never in the URL",
        ));
    }
    let value = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let Some(presented) = value
        .and_then(|v| v.strip_prefix("Ticket "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
    else {
        let reason = if headers.contains_key(header::COOKIE) {
            "cookies are ignored here: send the ticket as Authorization: Ticket <ticket>"
        } else {
            "send the ticket as Authorization: Ticket <ticket>"
        };
        return Err(refuse(ErrorCode::TicketInvalid, reason));
    };
    let claims = match ticket::verify(secret, presented, now, session.as_str(), action) {
        Ok(claims) => claims,
        Err(TicketError::Expired) => {
            return Err(refuse(
                ErrorCode::TicketExpired,
                "the ticket has expired; mint a new one",
            ));
        }
        Err(TicketError::WrongTarget) => {
            return Err(refuse(
                ErrorCode::TicketInvalid,
                "the ticket is for another session or action",
            ));
        }
        Err(TicketError::Invalid) => return Err(refuse(ErrorCode::TicketInvalid, "the ticket is malformed or forged")),
    };
    match store
        .claim_ticket_nonce(&claims.nonce, claims.exp.saturating_mul(1000))
        .await
    {
        Ok(true) => Ok(claims),
        Ok(false) => Err(refuse(
            ErrorCode::TicketReplayed,
            "the ticket was already used; mint a new one",
        )),
        Err(error) => {
            tracing::warn!(%error, "cannot claim a ticket nonce");
            Err(refuse(
                ErrorCode::StoreUnavailable,
                "the store did not answer; try again",
            ))
        }
    }
}
