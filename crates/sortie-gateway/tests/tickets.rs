//! Tickets at the gateway: each way to get one wrong has its code; a valid one works exactly once.

use axum::http::{HeaderMap, HeaderValue, Uri, header};
use sortie_gateway::tickets::check;
use sortie_protocol::api::TicketAction;
use sortie_protocol::ticket::{TICKET_VERSION, TicketClaims, mint};
use sortie_protocol::{ErrorCode, SessionId};
use sortie_store::SqlStore;
use sortie_store::testing::TestDatabase;

const SECRET: &[u8] = b"gateway-test-secret";
/// The real clock: the store forgets nonces of tickets expired for a minute by the real clock.
fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn claims(session: &SessionId, action: TicketAction, exp: i64, nonce: &str) -> TicketClaims {
    TicketClaims {
        v: TICKET_VERSION,
        sub: "tok_1".into(),
        ws: "ws_1".into(),
        ses: session.to_string(),
        act: action,
        exp,
        nonce: nonce.into(),
    }
}

fn with_ticket(ticket: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Ticket {ticket}")).expect("header"),
    );
    headers
}

#[tokio::test]
async fn every_wrong_ticket_has_its_code_and_a_valid_one_works_once() {
    let dir = tempfile::tempdir().expect("temp");
    let store = SqlStore::connect(&TestDatabase::sqlite(dir.path()).url)
        .await
        .expect("store");
    let session = SessionId::generate();
    let now = now();
    let other = SessionId::generate();
    let uri: Uri = format!("/v1/sessions/{session}/stream").parse().expect("uri");
    let good = mint(SECRET, &claims(&session, TicketAction::Attach, now + 60, "n-good"));

    let run = |headers: HeaderMap, uri: Uri, action: TicketAction| {
        let store = &store;
        let session = session.clone();
        async move {
            check(store, SECRET, &headers, &uri, &session, action, now)
                .await
                .map_err(|r| r.code)
        }
    };
    let (payload, signature) = good.split_once('.').expect("ticket");
    let tampered = format!("{payload}x.{signature}");
    assert_eq!(
        run(with_ticket(&tampered), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid)
    );
    let forged = mint(
        b"another secret",
        &claims(&session, TicketAction::Attach, now + 60, "n-forged"),
    );
    assert_eq!(
        run(with_ticket(&forged), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid)
    );
    let expired = mint(SECRET, &claims(&session, TicketAction::Attach, now - 1, "n-expired"));
    assert_eq!(
        run(with_ticket(&expired), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketExpired)
    );
    let foreign = mint(SECRET, &claims(&other, TicketAction::Attach, now + 60, "n-foreign"));
    assert_eq!(
        run(with_ticket(&foreign), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid)
    );
    assert_eq!(
        run(with_ticket(&good), uri.clone(), TicketAction::Turn).await,
        Err(ErrorCode::TicketInvalid),
        "wrong action"
    );
    assert_eq!(
        run(HeaderMap::new(), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid),
        "missing"
    );
    let in_url: Uri = format!("/v1/sessions/{session}/stream?ticket={good}")
        .parse()
        .expect("uri");
    assert_eq!(
        run(with_ticket(&good), in_url, TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid),
        "in the URL"
    );
    let mut cookie = HeaderMap::new();
    cookie.insert(
        header::COOKIE,
        HeaderValue::from_str(&format!("ticket={good}")).expect("cookie"),
    );
    assert_eq!(
        run(cookie, uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid),
        "in a cookie"
    );
    let mut bearer = HeaderMap::new();
    bearer.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {good}")).expect("header"),
    );
    assert_eq!(
        run(bearer, uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketInvalid),
        "wrong scheme"
    );

    // None of the refusals above used the good ticket's nonce: it works now, exactly once.
    let accepted = run(with_ticket(&good), uri.clone(), TicketAction::Attach).await;
    assert!(accepted.is_ok(), "{accepted:?}");
    assert_eq!(
        run(with_ticket(&good), uri.clone(), TicketAction::Attach).await,
        Err(ErrorCode::TicketReplayed)
    );
}
