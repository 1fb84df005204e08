//! A pod's way out (DESIGN §15): each connection of its driver's egress relay is an upgraded
//! `GET /v1/drivers/egress` with the pod's identity token, served by the egress proxy of the session
//! the worker bound that pod to. A pod bound to nothing, a token the apiserver does not accept and a
//! sandbox at its connection cap get nothing; an accepted token is reviewed once, not per connection.
//!
//! The apiserver is `sortie-testkit`'s fake (real `TokenReview` JSON); the gateway, the proxy and the
//! upstream are real servers on loopback.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::routing::get;
use hyper_util::rt::TokioIo;
use sortie_gateway::egress::policy::Cidr;
use sortie_gateway::egress::proxy::{EgressLimits, EgressProxy, FixedAllowlist, StaticResolver};
use sortie_gateway::links::{CachedIdentity, DriverLinks, EgressBindings, KubeTokenReview, LinkState, link_router};
use sortie_protocol::driver::{EGRESS_PATH, EGRESS_PROTOCOL, LINK_AUDIENCE};
use sortie_testkit::kube::FakeApiserver;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);
const NAMESPACE: &str = "sortie";
const ALLOWED: &str = "pkg.sortie-test.dev";

/// An upgraded egress connection, or the status the gateway refused it with.
async fn dial(gateway: &str, token: &str) -> Result<TokioIo<hyper::upgrade::Upgraded>, StatusCode> {
    let authority = gateway.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(authority).await.expect("gateway");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection.with_upgrades());
    let request = Request::get(EGRESS_PATH)
        .header(header::HOST, authority)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, EGRESS_PROTOCOL)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .expect("request");
    let response = sender.send_request(request).await.expect("answer");
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(response.status());
    }
    Ok(TokioIo::new(hyper::upgrade::on(response).await.expect("upgraded")))
}

/// What the proxy answers on `tunnel` to an absolute-URI `GET url` (the connection then closes).
async fn get_through(tunnel: &mut TokioIo<hyper::upgrade::Upgraded>, url: &str) -> String {
    let request = format!("GET {url} HTTP/1.1\r\nhost: {ALLOWED}\r\nconnection: close\r\n\r\n");
    tunnel.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, tunnel.read_to_end(&mut answer))
        .await
        .expect("the proxy answers")
        .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn a_pod_reaches_only_its_sessions_egress_and_its_token_is_reviewed_once() {
    // The process's TLS provider, as `sortie serve` installs it at start (the review's client needs one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let apiserver = FakeApiserver::start("gateway-account-token").await;
    let upstream =
        sortie_testkit::http::serve(Router::new().route("/hello", get(|| async { "hello from upstream" }))).await;
    let port = upstream.url().rsplit(':').next().expect("port").to_owned();
    let names: HashMap<String, Vec<IpAddr>> = [(ALLOWED.to_owned(), vec!["127.0.0.1".parse().expect("ip")])].into();
    // One connection at a time, so the cap is reached by holding one tunnel.
    let proxy = EgressProxy::with_limits(
        FixedAllowlist::new(vec![ALLOWED.to_owned()]),
        vec![Cidr::parse("127.0.0.1/32").expect("cidr")],
        Arc::new(StaticResolver(names)),
        None,
        None,
        EgressLimits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            host_connections: None,
        },
    );
    let bindings = EgressBindings::new();
    let review = KubeTokenReview {
        apiserver: apiserver.url(),
        bearer: "gateway-account-token".into(),
        sandbox_account: format!("system:serviceaccount:{NAMESPACE}:sandbox"),
        http: reqwest::Client::new(),
    };
    let gateway = sortie_testkit::http::serve(link_router(LinkState {
        links: DriverLinks::new(),
        identity: Arc::new(CachedIdentity::new(Arc::new(review))),
        egress: bindings.clone(),
    }))
    .await;
    let gateway = gateway.url();
    let pod_a = apiserver.issue_token(NAMESPACE, "sandbox", "pool-a", "uid-a", &[LINK_AUDIENCE]);
    let pod_b = apiserver.issue_token(NAMESPACE, "sandbox", "pool-b", "uid-b", &[LINK_AUDIENCE]);
    let wrong_audience = apiserver.issue_token(NAMESPACE, "sandbox", "pool-c", "uid-c", &["kubernetes"]);

    assert_eq!(
        dial(&gateway, &pod_a).await.err(),
        Some(StatusCode::FORBIDDEN),
        "a pod bound to no session has no way out"
    );
    bindings.bind("uid-a", proxy.clone());
    let mut tunnel = dial(&gateway, &pod_a)
        .await
        .expect("a bound pod's connection is upgraded");
    let url = format!("http://{ALLOWED}:{port}/hello");
    let answer = get_through(&mut tunnel, &url).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("hello from upstream"), "{answer}");

    let mut denied = dial(&gateway, &pod_a).await.expect("upgraded");
    let answer = get_through(&mut denied, &format!("http://elsewhere.sortie-test.dev:{port}/hello")).await;
    assert!(
        answer.starts_with("HTTP/1.1 403") && answer.contains("denied"),
        "the session's allowlist still decides: {answer}"
    );

    // Another pod's valid identity reaches nothing of pod a's session.
    assert_eq!(dial(&gateway, &pod_b).await.err(), Some(StatusCode::FORBIDDEN));
    assert_eq!(
        dial(&gateway, &wrong_audience).await.err(),
        Some(StatusCode::UNAUTHORIZED)
    );
    assert_eq!(
        dial(&gateway, "eyJhbGciOiJSUzI1NiJ9.forged.sig").await.err(),
        Some(StatusCode::UNAUTHORIZED)
    );

    // At the sandbox's cap a connection is refused at once, not held waiting.
    let held = dial(&gateway, &pod_a).await.expect("the one slot");
    assert_eq!(dial(&gateway, &pod_a).await.err(), Some(StatusCode::TOO_MANY_REQUESTS));
    drop(held);
    let started = Instant::now();
    let mut again = loop {
        match dial(&gateway, &pod_a).await {
            Ok(tunnel) => break tunnel,
            Err(status) => {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
                assert!(started.elapsed() < DEADLINE, "a closed connection gives its slot back");
                tokio::task::yield_now().await;
            }
        }
    };
    assert!(get_through(&mut again, &url).await.ends_with("hello from upstream"));

    let reviews = apiserver.reviews();
    for _ in 0..5 {
        let mut tunnel = dial(&gateway, &pod_a).await.expect("upgraded");
        assert!(get_through(&mut tunnel, &url).await.ends_with("hello from upstream"));
    }
    assert_eq!(
        apiserver.reviews(),
        reviews,
        "an accepted token is not reviewed again for each connection"
    );

    // A token the apiserver refused is refused again for a while without asking it.
    let reviews = apiserver.reviews();
    for _ in 0..3 {
        assert_eq!(
            dial(&gateway, "eyJhbGciOiJSUzI1NiJ9.forged-again.sig").await.err(),
            Some(StatusCode::UNAUTHORIZED)
        );
    }
    assert_eq!(
        apiserver.reviews(),
        reviews + 1,
        "one review for the same refused token"
    );

    // Letting the pod go ends the connections it still holds, and it opens none again.
    let mut open = dial(&gateway, &pod_a).await.expect("upgraded");
    bindings.unbind("uid-a");
    let mut rest = Vec::new();
    tokio::time::timeout(DEADLINE, open.read_to_end(&mut rest))
        .await
        .expect("the held connection is closed when the pod is unbound")
        .expect("read");
    assert!(rest.is_empty(), "{rest:?}");
    assert_eq!(
        dial(&gateway, &pod_a).await.err(),
        Some(StatusCode::FORBIDDEN),
        "a pod whose claim was let go has no way out, whatever its token"
    );
}
