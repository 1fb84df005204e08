//! The proxy reads a session's allowlist from the store at every connection, so an amendment
//! through the API opens the next connection without a restart.

use std::collections::HashMap;
use std::sync::Arc;

use sortie_gateway::egress::policy::Cidr;
use sortie_gateway::egress::proxy::{EgressProxy, SessionAllowlist, StaticResolver};
use sortie_protocol::SessionId;
use sortie_store::testing::TestDatabase;
use sortie_store::{NewSession, RepoAccess, SqlStore, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get_through(socket: &std::path::Path, url: &str) -> String {
    let mut stream = tokio::net::UnixStream::connect(socket).await.expect("connect");
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    stream
        .write_all(format!("GET {url} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read");
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amended_allowlist_opens_the_next_connection() {
    let dir = tempfile::tempdir().expect("temp");
    let store: Arc<dyn Store> = Arc::new(
        SqlStore::connect(&TestDatabase::sqlite(dir.path()).url)
            .await
            .expect("store"),
    );
    let workspace = store
        .create_workspace("default", RepoAccess::default())
        .await
        .expect("workspace");
    let session_id = SessionId::generate();
    store
        .create_session(NewSession {
            id: session_id.clone(),
            workspace_id: workspace.id.clone(),
            repo: "https://github.com/o/r.git".into(),
            base: None,
            agent: "scripted".into(),
            model: None,
            title: "t".into(),
            egress_allow: vec!["pkg.sortie-test.dev".into()],
            setup: None,
            task: "t".into(),
            budget: Default::default(),
        })
        .await
        .expect("session");

    let server = sortie_testkit::http::respond("ok").await;
    let port = server.port();
    let names: HashMap<String, Vec<std::net::IpAddr>> = ["pkg.sortie-test.dev", "late.sortie-test.dev"]
        .iter()
        .map(|n| ((*n).to_owned(), vec!["127.0.0.1".parse().expect("ip")]))
        .collect();
    let source = Arc::new(SessionAllowlist {
        store: store.clone(),
        workspace_id: workspace.id.clone(),
        session_id: session_id.clone(),
    });
    let proxy = EgressProxy::new(
        source,
        vec![Cidr::parse("127.0.0.1/32").expect("cidr")],
        Arc::new(StaticResolver(names)),
        None,
        None,
    );
    let socket = dir.path().join("egress.sock");
    tokio::spawn(proxy.serve(tokio::net::UnixListener::bind(&socket).expect("socket")));

    let allowed = get_through(&socket, &format!("http://pkg.sortie-test.dev:{port}/")).await;
    assert!(
        allowed.starts_with("HTTP/1.1 200") && allowed.ends_with("ok"),
        "{allowed}"
    );
    let before = get_through(&socket, &format!("http://late.sortie-test.dev:{port}/")).await;
    assert!(
        before.starts_with("HTTP/1.1 403") && before.contains("not on this session's egress allowlist"),
        "{before}"
    );
    store
        .set_egress_allow(
            &workspace.id,
            &session_id,
            &["pkg.sortie-test.dev".into(), "late.sortie-test.dev".into()],
        )
        .await
        .expect("amend");
    let after = get_through(&socket, &format!("http://late.sortie-test.dev:{port}/")).await;
    assert!(after.starts_with("HTTP/1.1 200"), "{after}");
    store.cancel(&workspace.id, &session_id).await.expect("cancel");
    let https = get_through(&socket, "https://pkg.sortie-test.dev/").await;
    assert!(https.starts_with("HTTP/1.1 400"), "https goes through CONNECT: {https}");
}
