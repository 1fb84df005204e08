//! The attach-ticket verifier on arbitrary strings: it never panics, and it accepts exactly the
//! tickets signed with the secret whose claims are of this version, for the session and action
//! asked, and not expired.
//!
//! Inputs: a raw ticket string; arbitrary bytes signed as the claims (the decoding behind the
//! signature); a signed ticket with one character changed (never accepted); or claims built from
//! fuzzed fields and signed (accepted exactly when the rules say so).

#![no_main]

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use sortie_protocol::api::TicketAction;
use sortie_protocol::ticket::{TICKET_VERSION, TicketError, verify};

const SECRET: &[u8] = b"fuzz-ticket-secret";
const SESSION: &str = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w";
const NOW: i64 = 1_800_000_000;

#[derive(Debug, Arbitrary)]
enum Input {
    Raw(String),
    Signed(Vec<u8>),
    Tampered { payload: Vec<u8>, at: u16 },
    Claims(Claims),
}

#[derive(Debug, Arbitrary)]
struct Claims {
    v: u32,
    sub: String,
    ws: String,
    /// The session asked for, else `other_session`.
    right_session: bool,
    other_session: String,
    turn: bool,
    /// Seconds from now (wide enough to cross zero and overflow nothing).
    exp_offset: i32,
    nonce: String,
    unknown_field: Option<String>,
    ask_turn: bool,
}

fn sign(payload: &[u8]) -> String {
    let encoded = URL_SAFE_NO_PAD.encode(payload);
    let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(SECRET).expect("any key length");
    mac.update(encoded.as_bytes());
    let tag = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{encoded}.{tag}")
}

fn action(turn: bool) -> TicketAction {
    if turn { TicketAction::Turn } else { TicketAction::Attach }
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw(ticket) => {
            // Without the secret nothing verifies (the fuzzer cannot forge HMAC-SHA256).
            for asked in [TicketAction::Attach, TicketAction::Turn] {
                assert!(verify(SECRET, &ticket, NOW, SESSION, asked).is_err(), "{ticket}");
            }
        }
        Input::Signed(payload) => {
            let ticket = sign(&payload);
            if let Ok(claims) = verify(SECRET, &ticket, NOW, SESSION, TicketAction::Attach) {
                assert_eq!(claims.v, TICKET_VERSION);
                assert_eq!(claims.ses, SESSION);
                assert_eq!(claims.act, TicketAction::Attach);
                assert!(claims.exp > NOW);
            }
        }
        Input::Tampered { payload, at } => {
            let mut ticket = sign(&payload).into_bytes();
            let index = usize::from(at) % ticket.len();
            // Another base64url character (or the separator), never the same one: the tag is
            // compared after decoding, so a non-canonical encoding of the same bytes must not pass.
            ticket[index] = if ticket[index] == b'A' { b'B' } else { b'A' };
            let ticket = String::from_utf8_lossy(&ticket).into_owned();
            for asked in [TicketAction::Attach, TicketAction::Turn] {
                assert!(verify(SECRET, &ticket, NOW, SESSION, asked).is_err(), "{ticket}");
            }
        }
        Input::Claims(claims) => {
            let ses = if claims.right_session {
                SESSION.to_owned()
            } else {
                claims.other_session.clone()
            };
            let exp = NOW + i64::from(claims.exp_offset);
            let mut json = serde_json::json!({
                "v": claims.v,
                "sub": claims.sub,
                "ws": claims.ws,
                "ses": ses,
                "act": if claims.turn { "turn" } else { "attach" },
                "exp": exp,
                "nonce": claims.nonce,
            });
            if let Some(value) = &claims.unknown_field {
                json["extra"] = serde_json::Value::String(value.clone());
            }
            let ticket = sign(json.to_string().as_bytes());
            let asked = action(claims.ask_turn);
            // The verifier reads at most 2048 characters of ticket.
            let expected = if ticket.len() > 2048 || claims.unknown_field.is_some() || claims.v != TICKET_VERSION {
                Err(TicketError::Invalid)
            } else if ses != SESSION || claims.turn != claims.ask_turn {
                Err(TicketError::WrongTarget)
            } else if exp <= NOW {
                Err(TicketError::Expired)
            } else {
                Ok(())
            };
            let verified = verify(SECRET, &ticket, NOW, SESSION, asked);
            assert_eq!(verified.as_ref().map(|_| ()).map_err(Clone::clone), expected, "{json}");
            if let Ok(verified) = verified {
                assert_eq!(
                    (verified.ses.as_str(), verified.act, verified.exp),
                    (SESSION, asked, exp)
                );
            }
            assert!(verify(b"another secret", &ticket, NOW, SESSION, asked).is_err());
        }
    }
});
