//! The recorder against a driver socket: a batch that is not full is written within its delay while
//! the turn goes on, and a stream that breaks is taken up after the last stored part with nothing lost
//! and nothing twice.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Query;
use futures::StreamExt;
use sortie_protocol::SessionId;
use sortie_protocol::chunk::{SSE_DONE, write_sse_event};
use sortie_store::testing::TestDatabase;
use sortie_store::{NewSession, RepoAccess, SqlStore, Store};
use sortie_worker::client::DriverClient;
use sortie_worker::recorder::{BATCH_PARTS, record};

fn event(index: u64) -> Bytes {
    let mut out = Vec::new();
    let json = format!(r#"{{"type":"text-delta","id":"t","delta":"part {index}"}}"#);
    write_sse_event(&mut out, index, &json);
    Bytes::from(out)
}

async fn store_with_session(dir: &std::path::Path) -> (Arc<dyn Store>, SessionId) {
    let store = SqlStore::connect(&TestDatabase::sqlite(dir).url).await.expect("store");
    let workspace = store
        .create_workspace("default", RepoAccess::default())
        .await
        .expect("workspace");
    let session = SessionId::generate();
    store
        .create_session(NewSession {
            id: session.clone(),
            workspace_id: workspace.id,
            repo: "/srv/repo.git".into(),
            base: None,
            agent: "scripted".into(),
            model: None,
            title: "t".into(),
            egress_allow: Vec::new(),
            setup: None,
            task: "t".into(),
        })
        .await
        .expect("session");
    (Arc::new(store), session)
}

fn serve(socket: PathBuf, app: axum::Router) {
    let listener = tokio::net::UnixListener::bind(socket).expect("bind the driver socket");
    tokio::spawn(async move { axum::serve(listener, app).await });
}

async fn stored_indices(store: &Arc<dyn Store>, session: &SessionId) -> Vec<u32> {
    store
        .parts(session)
        .await
        .expect("parts")
        .iter()
        .map(|p| p.part_index)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_batch_is_written_within_its_delay_while_the_turn_goes_on() {
    let temp = tempfile::tempdir().expect("temp");
    let (store, session) = store_with_session(temp.path()).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let held = release.clone();
    let stream = move || {
        let release = held.clone();
        async move {
            let first = futures::stream::iter((0..3).map(|i| Ok::<_, std::convert::Infallible>(event(i))));
            let rest = futures::stream::once(async move {
                release.notified().await;
                let mut tail: Vec<u8> = (3..3 + 2 * BATCH_PARTS as u64)
                    .flat_map(|i| event(i).to_vec())
                    .collect();
                tail.extend_from_slice(SSE_DONE);
                Ok(Bytes::from(tail))
            });
            Body::from_stream(first.chain(rest))
        }
    };
    let socket = temp.path().join("driver.sock");
    serve(
        socket.clone(),
        axum::Router::new().route("/turns/1/stream", axum::routing::get(stream)),
    );

    let recording = {
        let (store, session) = (store.clone(), session.clone());
        tokio::spawn(async move { record(&store, &DriverClient::new(socket), &session, 1, None).await })
    };
    // Three parts are far from a full batch; the driver holds the rest back until they are stored.
    let deadline = Instant::now() + Duration::from_secs(5);
    while stored_indices(&store, &session).await.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "a partial batch was not written while the turn went on"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    release.notify_one();
    let recorded = recording.await.expect("join");
    let total = 3 + 2 * BATCH_PARTS as u32;
    assert!(recorded.complete && !recorded.store_failed, "{recorded:?}");
    assert_eq!(recorded.last_index, Some(u64::from(total - 1)));
    assert_eq!(stored_indices(&store, &session).await, (0..total).collect::<Vec<_>>());
}

#[derive(serde::Deserialize)]
struct After {
    after: Option<u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_is_taken_up_after_the_last_stored_part() {
    const TOTAL: u64 = 100;
    let temp = tempfile::tempdir().expect("temp");
    let (store, session) = store_with_session(temp.path()).await;
    // The first subscription breaks after 40 parts (and half an event); the next, from `after`, ends.
    let stream = |Query(query): Query<After>| async move {
        match query.after {
            None => {
                // The connection ends inside an event and without `[DONE]`.
                let mut bytes: Vec<u8> = (0..40).flat_map(|i| event(i).to_vec()).collect();
                bytes.extend_from_slice(b"id: 40\ndata: {\"type\":\"text-de");
                Body::from(bytes)
            }
            Some(after) => {
                let mut bytes: Vec<u8> = (after + 1..TOTAL).flat_map(|i| event(i).to_vec()).collect();
                bytes.extend_from_slice(SSE_DONE);
                Body::from(bytes)
            }
        }
    };
    let socket = temp.path().join("driver.sock");
    serve(
        socket.clone(),
        axum::Router::new().route("/turns/1/stream", axum::routing::get(stream)),
    );
    let driver = DriverClient::new(socket);

    let broken = record(&store, &driver, &session, 1, None).await;
    assert!(!broken.complete && !broken.store_failed, "{broken:?}");
    assert_eq!(broken.last_index, Some(39), "the torn event is not stored");
    let resumed = record(&store, &driver, &session, 1, broken.last_index).await;
    assert!(resumed.complete, "{resumed:?}");
    assert_eq!(
        stored_indices(&store, &session).await,
        (0..TOTAL as u32).collect::<Vec<_>>(),
        "every part once"
    );
}
