//! `GET /v1/events` (DESIGN §14): the workspace's session-phase and turn-status changes as server-sent
//! events, read from the store's event log, so any api replica serves any client and `Last-Event-ID`
//! resumes with nothing lost within the retention window ([`EVENTS_RETENTION`]).
//!
//! A connection reads the log after its last event whenever the store says this process wrote one
//! (at once), and otherwise checks the newest number on a slow timer ([`CROSS_PROCESS_CHECK`]), which
//! covers events written by a worker in another process.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sortie_protocol::api::Event;
use sortie_protocol::{ApiErrorBody, ErrorCode};
use sortie_store::{EventRow, Store};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::ApiState;
use crate::error::ApiError;
use crate::extract::{ApiQuery, Viewer};

/// How long events are kept (and so how far back `Last-Event-ID` can resume).
pub const EVENTS_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// How often an idle connection looks for events another process wrote.
pub const CROSS_PROCESS_CHECK: Duration = Duration::from_millis(500);
/// Events read from the store at a time.
const PAGE: u32 = 256;

pub fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::new().routes(routes!(events))
}

/// The query of `GET /v1/events`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Start after this event (as `Last-Event-ID` does, which wins when both are given); `0` replays
    /// every event the server still keeps. Without either, the stream starts with the next change.
    after: Option<u64>,
}

/// The workspace's changes as they happen: one SSE event per change (`id` = its `seq`, `data` = an
/// [`Event`]), a comment every 15 s while nothing happens.
#[utoipa::path(
    get, path = "/v1/events", tag = "events", security(("bearer" = [])),
    params(
        EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event's `seq`"),
    ),
    responses(
        (status = 200, description = "A text/event-stream; each event's data is one Event", body = Event, content_type = "text/event-stream"),
        (status = 400, description = "INVALID_REQUEST: Last-Event-ID is not a number", body = ApiErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ApiErrorBody),
        (status = 410, description = "EVENTS_PRUNED: the events after Last-Event-ID are no longer kept", body = ApiErrorBody),
    )
)]
async fn events(
    State(state): State<ApiState>,
    Viewer(caller): Viewer,
    ApiQuery(query): ApiQuery<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let resume = match headers.get("last-event-id") {
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
                .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "Last-Event-ID must be an event's seq"))?,
        ),
        None => query.after,
    };
    let after = match resume {
        Some(after) => after,
        None => state.store.latest_event().await?,
    };
    // Read once here, so a lost stretch is a clear 410 and a silent store a 503, not a broken stream.
    let first = state
        .store
        .events_after(Some(&caller.workspace_id), after, PAGE)
        .await?;
    if after != 0 && first.pruned_through > after {
        return Err(ApiError::new(
            ErrorCode::EventsPruned,
            format!(
                "the events after {after} are no longer kept (they are kept {} h): read the sessions again and \
                 reconnect without Last-Event-ID",
                EVENTS_RETENTION.as_secs() / 3600
            ),
        )
        .with_details(sortie_protocol::error::details::EventsPruned {
            pruned_through: first.pruned_through,
        }));
    }
    let reader = Reader {
        store: state.store.clone(),
        workspace_id: caller.workspace_id,
        after: first.events.last().map_or(after, |e| e.seq),
        pending: first.events.into(),
        signal: state.store.event_signal(),
    };
    let stream = futures::stream::unfold(reader, |mut reader| async move {
        let event = reader.next().await;
        Some((Ok::<_, Infallible>(event), reader))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// One connection's place in the event log.
struct Reader {
    store: Arc<dyn Store>,
    workspace_id: String,
    after: u64,
    pending: VecDeque<EventRow>,
    signal: tokio::sync::watch::Receiver<u64>,
}

impl Reader {
    /// The next event of the workspace, waiting for it as long as it takes.
    async fn next(&mut self) -> SseEvent {
        loop {
            if let Some(row) = self.pending.pop_front() {
                return sse_event(&row);
            }
            // Marked seen before the read: a commit after it changes the signal again.
            self.signal.borrow_and_update();
            match self
                .store
                .events_after(Some(&self.workspace_id), self.after, PAGE)
                .await
            {
                Ok(page) if !page.events.is_empty() => {
                    self.after = page.events.last().map_or(self.after, |e| e.seq);
                    self.pending.extend(page.events);
                    continue;
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "events: the store did not answer; asking again"),
            }
            self.wait().await;
        }
    }

    /// Until this process writes an event, or another process has written one.
    async fn wait(&mut self) {
        loop {
            tokio::select! {
                changed = self.signal.changed() => {
                    if changed.is_ok() {
                        return;
                    }
                    // The store is going away; only the timer is left.
                    tokio::time::sleep(CROSS_PROCESS_CHECK).await;
                }
                () = tokio::time::sleep(CROSS_PROCESS_CHECK) => {}
            }
            match self.store.latest_event().await {
                Ok(latest) if latest <= self.after => {}
                _ => return,
            }
        }
    }
}

fn sse_event(row: &EventRow) -> SseEvent {
    let data = serde_json::to_string(&row.to_event()).unwrap_or_else(|_| "{}".to_owned());
    SseEvent::default().id(row.seq.to_string()).data(data)
}

/// Forgets events older than the retention window, now and then, for as long as the process runs.
pub async fn prune_forever(store: Arc<dyn Store>) {
    let mut every = tokio::time::interval(Duration::from_secs(10 * 60));
    loop {
        every.tick().await;
        let retention = i64::try_from(EVENTS_RETENTION.as_millis()).unwrap_or(i64::MAX);
        match store
            .prune_events(sortie_store::now_ms().saturating_sub(retention))
            .await
        {
            Ok(0) => {}
            Ok(pruned) => tracing::debug!(pruned, "events: forgot events past the retention window"),
            Err(error) => tracing::warn!(%error, "events: pruning failed; trying again later"),
        }
    }
}
