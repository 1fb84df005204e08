//! The dashboard's sign-in: a one-time code for an HttpOnly, SameSite=Strict cookie that the control
//! plane accepts only together with the CSRF header; the stream's tickets are not affected.

mod harness;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use harness::{Harness, Transport};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sortie_server::tokens::hash_token;
use sortie_store::testing::TestBackend;
use tower::ServiceExt;

async fn send(
    h: &Harness,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (StatusCode, axum::http::HeaderMap, Value) {
    let mut request = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = match body {
        Some(json) => {
            request = request.header("content-type", "application/json");
            Body::from(serde_json::to_vec(&json).expect("json"))
        }
        None => Body::empty(),
    };
    let response = h
        .router
        .clone()
        .oneshot(request.body(body).expect("request"))
        .await
        .expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Signs in with a fresh code for `token`; the cookie's `name=value`.
async fn sign_in(h: &Harness, token: &str) -> String {
    let code = h.signins.issue_code(&hash_token(token)).expect("code");
    let (status, headers, _) = send(h, "POST", "/v1/auth/signin", &[], Some(json!({ "code": code }))).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let set_cookie = headers.get("set-cookie").expect("a cookie").to_str().expect("ascii");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/v1"] {
        assert!(set_cookie.contains(attribute), "{set_cookie}");
    }
    set_cookie.split(';').next().expect("name=value").to_owned()
}

#[tokio::test]
async fn the_cookie_works_only_with_the_csrf_header() {
    let h = Harness::start(Transport::InProcess, TestBackend::Sqlite).await;
    let cookie = sign_in(&h, &h.admin).await;

    let (status, _, body) = send(
        &h,
        "GET",
        "/v1/sessions",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["sessions"].is_array());
    // The cookie stands for the admin token: admin-only endpoints answer too.
    let (status, _, _) = send(
        &h,
        "GET",
        "/v1/model-keys",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    // A cookie without the header: refused (what a cross-site form would send).
    let (status, _, body) = send(&h, "GET", "/v1/sessions", &[("cookie", &cookie)], None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["code"], "UNAUTHORIZED");
    let create = json!({ "repo": h.repo, "task": "x" });
    let (status, _, _) = send(&h, "POST", "/v1/sessions", &[("cookie", &cookie)], Some(create.clone())).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // The header without a cookie, or with a made-up one: refused.
    let (status, _, _) = send(&h, "GET", "/v1/sessions", &[("x-sortie-csrf", "1")], None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = send(
        &h,
        "GET",
        "/v1/sessions",
        &[("cookie", "sortie_session=forged"), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // With both, the cookie mints attach tickets (the stream itself takes tickets only).
    let (status, _, session) = send(
        &h,
        "POST",
        "/v1/sessions",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        Some(create),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{session}");
    let id = session["id"].as_str().expect("id");
    let (status, _, ticket) = send(
        &h,
        "POST",
        &format!("/v1/sessions/{id}/attach-ticket"),
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{ticket}");

    // Signing out ends the cookie.
    let (status, headers, _) = send(
        &h,
        "POST",
        "/v1/auth/signout",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(
        headers
            .get("set-cookie")
            .expect("cleared")
            .to_str()
            .expect("ascii")
            .contains("Max-Age=0")
    );
    let (status, _, _) = send(
        &h,
        "GET",
        "/v1/sessions",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_code_works_once_and_not_after_expiry_or_revocation() {
    let h = Harness::start(Transport::InProcess, TestBackend::Sqlite).await;
    let code = h.signins.issue_code(&hash_token(&h.viewer)).expect("code");
    let (status, _, _) = send(&h, "POST", "/v1/auth/signin", &[], Some(json!({ "code": code }))).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, headers, body) = send(&h, "POST", "/v1/auth/signin", &[], Some(json!({ "code": code }))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a used code");
    assert_eq!(body["error"]["code"], "UNAUTHORIZED");
    assert!(headers.get("set-cookie").is_none());

    let (status, _, _) = send(
        &h,
        "POST",
        "/v1/auth/signin",
        &[],
        Some(json!({ "code": "never-issued" })),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let expired = h
        .signins
        .issue_code_for(&hash_token(&h.viewer), std::time::Duration::ZERO)
        .expect("code");
    let (status, _, _) = send(&h, "POST", "/v1/auth/signin", &[], Some(json!({ "code": expired }))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "an expired code");

    // A cookie has its token's role: a viewer's cookie cannot create sessions.
    let cookie = sign_in(&h, &h.viewer).await;
    let (status, _, body) = send(
        &h,
        "POST",
        "/v1/sessions",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        Some(json!({ "repo": h.repo, "task": "x" })),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
}

#[tokio::test]
async fn the_dashboard_is_told_to_sign_in_by_a_401_with_a_stable_code() {
    // The app sends every request with the CSRF header and goes to /signin on any 401.
    let h = Harness::start(Transport::InProcess, TestBackend::Sqlite).await;
    for path in ["/v1/sessions", "/v1/usage"] {
        let (status, _, body) = send(&h, "GET", path, &[("x-sortie-csrf", "1")], None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(body["error"]["code"], "UNAUTHORIZED");
    }
    let (status, _, doc) = send(&h, "GET", "/v1/openapi.json", &[], None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(doc["paths"]["/v1/auth/signin"]["post"].is_object());
}

#[tokio::test]
async fn a_bearer_token_mints_links_that_sign_in_as_itself_and_a_cookie_cannot() {
    let h = Harness::start(Transport::InProcess, TestBackend::Sqlite).await;
    // What `sortie signin-link` asks for: a code for the caller's own token (here a viewer's).
    let bearer = format!("Bearer {}", h.viewer);
    let (status, _, link) = send(&h, "POST", "/v1/auth/links", &[("authorization", &bearer)], None).await;
    assert_eq!(status, StatusCode::CREATED, "{link}");
    assert_eq!(link["expires_in_seconds"], 900);
    let code = link["code"].as_str().expect("code");
    let (status, headers, _) = send(&h, "POST", "/v1/auth/signin", &[], Some(json!({ "code": code }))).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let cookie = headers
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .expect("a cookie")
        .to_owned();
    // The cookie is the viewer's, no more: an admin endpoint refuses it.
    let (status, _, _) = send(
        &h,
        "GET",
        "/v1/model-keys",
        &[("cookie", &cookie), ("x-sortie-csrf", "1")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // A browser's cookie cannot mint codes for other browsers, and neither can an unknown token.
    for headers in [
        vec![("cookie", cookie.as_str()), ("x-sortie-csrf", "1")],
        vec![("authorization", "Bearer sortie_not-a-token")],
        vec![],
    ] {
        let (status, _, body) = send(&h, "POST", "/v1/auth/links", &headers, None).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::UNAUTHORIZED, Some("UNAUTHORIZED")),
            "{headers:?}"
        );
    }
}
