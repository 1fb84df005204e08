//! Live tails (DESIGN §7.1): where attach gets the parts of a running turn that the store does not
//! have yet. The source is always the host's own copy of the turn — the worker's [`Feeds`], written by
//! the host after it checked every part — never a socket of the sandbox (DESIGN §9 invariants 8, 9).
//!
//! In one process the attach subscribes to the worker's feeds directly; a gateway started without the
//! worker role reaches them through the worker's feed socket ([`feed_router`] served by the worker,
//! [`SocketTails`] on the gateway's side), a Unix socket in a directory only the host can open.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sortie_feed::hub::TurnHub;
use sortie_protocol::SessionId;

/// The SSE bytes of a live tail: events after the asked index, then `[DONE]` when the turn ends.
pub type TailBody = Pin<Box<dyn Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// Where attach finds the live copy of a running turn.
pub trait LiveTails: Send + Sync + 'static {
    /// Turn `n`'s parts after index `after` as they come; `None` when there is no live copy of it here
    /// (not started yet, ended, or run by a worker this gateway cannot reach): the store has the rest.
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>>;
}

/// The worker's live turns: one hub per running turn, registered while the host writes it.
#[derive(Default)]
pub struct Feeds {
    hubs: RwLock<HashMap<(SessionId, u32), Arc<TurnHub>>>,
}

impl Feeds {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Makes `hub` the live copy of turn `n` of `session` (replacing any earlier one).
    pub fn insert(&self, session: &SessionId, n: u32, hub: Arc<TurnHub>) {
        self.hubs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert((session.clone(), n), hub);
    }

    /// Forgets turn `n`'s live copy, if it is still `hub` (a newer one stays).
    pub fn remove(&self, session: &SessionId, n: u32, hub: &Arc<TurnHub>) {
        let mut hubs = self.hubs.write().unwrap_or_else(|p| p.into_inner());
        if hubs
            .get(&(session.clone(), n))
            .is_some_and(|held| Arc::ptr_eq(held, hub))
        {
            hubs.remove(&(session.clone(), n));
        }
    }

    pub fn get(&self, session: &SessionId, n: u32) -> Option<Arc<TurnHub>> {
        self.hubs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(session.clone(), n))
            .cloned()
    }
}

impl LiveTails for Feeds {
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        let hub = self.get(session, n);
        Box::pin(async move {
            let subscription = hub?.subscribe(after);
            let body = sortie_feed::sse::body(subscription).map(|chunk| chunk.map_err(std::io::Error::other));
            Some(Box::pin(body) as TailBody)
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AfterQuery {
    after: Option<u64>,
}

/// The worker's feed socket: `GET /sessions/{id}/turns/{n}/stream?after=K`, for a gateway in another
/// process on this host.
pub fn feed_router(feeds: Arc<Feeds>) -> Router {
    Router::new()
        .route("/sessions/{id}/turns/{n}/stream", get(feed_stream))
        .with_state(feeds)
}

async fn feed_stream(
    State(feeds): State<Arc<Feeds>>,
    Path((id, n)): Path<(String, u32)>,
    Query(query): Query<AfterQuery>,
) -> Response {
    let Ok(session) = SessionId::parse(&id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let Some(hub) = feeds.get(&session, n) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut response = Response::new(Body::from_stream(sortie_feed::sse::body(hub.subscribe(query.after))));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    response
}

/// The live tails of a worker in another process, through its feed socket.
pub struct SocketTails(pub PathBuf);

impl LiveTails for SocketTails {
    fn open<'a>(
        &'a self,
        session: &'a SessionId,
        n: u32,
        after: Option<u64>,
    ) -> Pin<Box<dyn Future<Output = Option<TailBody>> + Send + 'a>> {
        Box::pin(async move {
            let stream = tokio::net::UnixStream::connect(&self.0).await.ok()?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
            tokio::spawn(connection);
            let path = match after {
                Some(k) => format!("/sessions/{session}/turns/{n}/stream?after={k}"),
                None => format!("/sessions/{session}/turns/{n}/stream"),
            };
            let request = axum::http::Request::get(path)
                .header(header::HOST, "worker")
                .body(http_body_util::Empty::<Bytes>::new())
                .ok()?;
            let response = sender.send_request(request).await.ok()?;
            if !response.status().is_success() {
                return None;
            }
            let body = http_body_util::BodyStream::new(response.into_body()).filter_map(|frame| async move {
                match frame {
                    Ok(frame) => frame.into_data().ok().map(Ok),
                    Err(error) => Some(Err(std::io::Error::other(error))),
                }
            });
            Some(Box::pin(body) as TailBody)
        })
    }
}
