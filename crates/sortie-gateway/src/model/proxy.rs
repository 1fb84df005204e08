//! The forwarding half of the model proxy: one handler for every method under
//! `/_sortie/model/{api}/`. A route not on the allowlist ([`super::routes`]) is refused before
//! anything else; an allowed one takes one of the session's in-flight slots for as long as it
//! lives. The request body is read whole (it is bounded in size, in time and by the session's
//! buffer budget, and the model it names is the usage's fallback); the answer is streamed back
//! frame by frame through [`Metered`], which hands each frame to a [`UsageReader`] on its way,
//! reports once when the body ends or is dropped, and frees the slot then.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use futures::Stream;
use http_body_util::BodyExt;
use sortie_protocol::SessionId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::routes::{self, Route};
use super::usage::{BodyFormat, UsageReader, request_model};
use super::{
    BODY_READ_TIMEOUT, KeySource, ModelApi, ModelProxyConfig, ModelProxyError, ModelProxyLimits, PinnedHeader,
    TENANCY_HEADERS, UsageSink,
};
use crate::git::http::{ForgeTls, forge_client};

/// The largest request body forwarded; a larger one is answered 413 and not sent. It is the
/// vendors' own limit (Anthropic's Messages API refuses more than 32 MB), so no agent request that
/// a vendor would take is refused here.
pub const MAX_REQUEST_BYTES: usize = 32 << 20;

const PREFIX: &str = "/_sortie/model/";

/// Headers that belong to one connection (RFC 9110 §7.6.1), never forwarded either way.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Request headers not forwarded: the agent's credential (a placeholder at best; the workspace's key
/// replaces it), the length (recomputed) and the encodings it accepts (replaced by `identity`).
const REQUEST_DROPPED: [&str; 5] = [
    "authorization",
    "x-api-key",
    "x-goog-api-key",
    "content-length",
    "accept-encoding",
];

/// Query parameters that carry a Gemini credential.
const GEMINI_QUERY_CREDENTIALS: [&str; 2] = ["key", "access_token"];

struct Inner {
    session_id: SessionId,
    anthropic: reqwest::Url,
    openai: reqwest::Url,
    gemini: reqwest::Url,
    http: reqwest::Client,
    keys: Arc<dyn KeySource>,
    sink: Arc<dyn UsageSink>,
    pinned: Vec<(ModelApi, HeaderName, HeaderValue)>,
    limits: ModelProxyLimits,
    /// One permit per request in flight ([`ModelProxyLimits::max_in_flight`]).
    in_flight: Arc<Semaphore>,
    /// One permit per body byte buffered ([`ModelProxyLimits::max_buffered_bytes`]).
    buffered: Arc<Semaphore>,
}

impl Inner {
    fn base(&self, api: ModelApi) -> &reqwest::Url {
        match api {
            ModelApi::Anthropic => &self.anthropic,
            ModelApi::Openai => &self.openai,
            ModelApi::Gemini => &self.gemini,
        }
    }
}

pub(super) fn router(
    config: ModelProxyConfig,
    keys: Arc<dyn KeySource>,
    sink: Arc<dyn UsageSink>,
) -> Result<Router, ModelProxyError> {
    let parse = |api: ModelApi| {
        let url = config.upstreams.base(api);
        reqwest::Url::parse(url)
            .ok()
            .filter(|parsed| matches!(parsed.scheme(), "http" | "https") && parsed.host().is_some())
            .ok_or_else(|| ModelProxyError::Upstream {
                api,
                url: url.to_owned(),
            })
    };
    let (anthropic, openai, gemini) = (
        parse(ModelApi::Anthropic)?,
        parse(ModelApi::Openai)?,
        parse(ModelApi::Gemini)?,
    );
    let pinned = config
        .pinned_headers
        .iter()
        .map(pinned_header)
        .collect::<Result<Vec<_>, _>>()?;
    let limits = config.limits;
    if limits.max_in_flight == 0 || limits.max_buffered_bytes == 0 {
        return Err(ModelProxyError::Limits);
    }
    // No redirect is ever followed (the key would travel with it); extra roots as for forges.
    let http = forge_client(&ForgeTls {
        extra_roots_pem: config.extra_roots_pem,
    })?;
    let inner = Arc::new(Inner {
        session_id: config.session_id,
        anthropic,
        openai,
        gemini,
        http,
        keys,
        sink,
        pinned,
        in_flight: Arc::new(Semaphore::new(limits.max_in_flight.min(Semaphore::MAX_PERMITS))),
        buffered: Arc::new(Semaphore::new(limits.max_buffered_bytes.min(Semaphore::MAX_PERMITS))),
        limits,
    });
    Ok(Router::new()
        .route("/_sortie/model/{api}/{*rest}", any(handle))
        .with_state(inner))
}

/// A pinned header checked once, at build: a valid name and value, and not a name the proxy owns
/// (the credential it injects, the framing it computes, hop-by-hop headers).
fn pinned_header(pinned: &PinnedHeader) -> Result<(ModelApi, HeaderName, HeaderValue), ModelProxyError> {
    let refused = |reason| ModelProxyError::PinnedHeader {
        api: pinned.api,
        name: pinned.name.clone(),
        reason,
    };
    let name = HeaderName::from_bytes(pinned.name.trim().as_bytes()).map_err(|_| refused("not a header name"))?;
    if REQUEST_DROPPED.contains(&name.as_str()) || HOP_BY_HOP.contains(&name.as_str()) || name == header::HOST {
        return Err(refused("the proxy sets this header itself"));
    }
    let value = HeaderValue::from_str(pinned.value.trim()).map_err(|_| refused("not a header value"))?;
    Ok((pinned.api, name, value))
}

/// An answer made here, never the vendor's: `{"error": {"code", "message"}}`.
fn refusal(status: StatusCode, code: &str, message: &str) -> Response {
    #[derive(serde::Serialize)]
    struct Refusal<'a> {
        error: Said<'a>,
    }
    #[derive(serde::Serialize)]
    struct Said<'a> {
        code: &'a str,
        message: &'a str,
    }
    let body = Refusal {
        error: Said { code, message },
    };
    (status, axum::Json(body)).into_response()
}

/// `bytes` as people read a limit: `32 MiB`, `64 KiB`, `100 bytes`.
fn shown_bytes(bytes: usize) -> String {
    match bytes {
        bytes if bytes >= 1 << 20 && bytes % (1 << 20) == 0 => format!("{} MiB", bytes >> 20),
        bytes if bytes >= 1 << 10 && bytes % (1 << 10) == 0 => format!("{} KiB", bytes >> 10),
        bytes => format!("{bytes} bytes"),
    }
}

/// Why a request body was not read whole.
enum BodyError {
    /// Past the size limit.
    TooLarge,
    /// Past the session's buffer budget (other requests hold the rest).
    OverBudget,
    /// Not all there before the deadline.
    TimedOut,
    /// The connection broke off.
    Broken,
}

/// Reads `body` whole, by `deadline`, at most `max` bytes, each byte counted against `budget`;
/// the permits it returns stand for the bytes read and are held until the body is sent.
async fn read_body(
    mut body: Body,
    max: usize,
    budget: &Arc<Semaphore>,
    deadline: tokio::time::Instant,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), BodyError> {
    // Grown as bytes arrive, never sized from the declared length: a body announced and never sent
    // holds nothing.
    let mut buffer = Vec::new();
    let mut held: Option<OwnedSemaphorePermit> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::TimedOut),
            Ok(None) => break,
            Ok(Some(Err(error))) if is_length_limit(&error) => return Err(BodyError::TooLarge),
            Ok(Some(Err(_))) => return Err(BodyError::Broken),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if buffer.len() + data.len() > max {
            return Err(BodyError::TooLarge);
        }
        let Ok(count) = u32::try_from(data.len()) else {
            return Err(BodyError::TooLarge);
        };
        let permit = budget
            .clone()
            .try_acquire_many_owned(count)
            .map_err(|_| BodyError::OverBudget)?;
        match &mut held {
            Some(held) => held.merge(permit),
            None => held = Some(permit),
        }
        buffer.extend_from_slice(&data);
    }
    Ok((Bytes::from(buffer), held))
}

/// What the one log line of a request says, filled in as the request goes.
struct RequestLog {
    session_id: SessionId,
    api: ModelApi,
    method: String,
    /// The path after `/_sortie/model/<api>/`, without the query (which may hold a credential).
    path: String,
    started: Instant,
}

impl RequestLog {
    /// The line of a request answered here; counted under `outcome`.
    fn refused(&self, outcome: &'static str, status: StatusCode) {
        metrics::counter!("sortie_model_requests_total", "api" => self.api.as_str(), "outcome" => outcome).increment(1);
        tracing::info!(
            session = %self.session_id,
            api = %self.api,
            method = %self.method,
            path = %self.path,
            status = status.as_u16(),
            outcome,
            elapsed_ms = self.started.elapsed().as_millis() as u64,
            "model request refused"
        );
    }
}

async fn handle(State(proxy): State<Arc<Inner>>, request: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let after = parts.uri.path().strip_prefix(PREFIX).unwrap_or_default();
    let (segment, rest) = after.split_once('/').unwrap_or((after, ""));
    let Some(api) = ModelApi::parse(segment) else {
        return refusal(
            StatusCode::NOT_FOUND,
            "MODEL_API_UNKNOWN",
            &format!("no model API {segment:?}: anthropic, openai or gemini"),
        );
    };
    let log = RequestLog {
        session_id: proxy.session_id.clone(),
        api,
        method: parts.method.to_string(),
        path: rest.to_owned(),
        started,
    };
    // Before the key is even looked up: a route off the list never gets near it.
    let route = match routes::allowed(api, &parts.method, rest) {
        Ok(route) => route,
        Err(reason) => {
            log.refused("route_refused", StatusCode::FORBIDDEN);
            return refusal(StatusCode::FORBIDDEN, "MODEL_ROUTE_REFUSED", &reason);
        }
    };
    let max_body = MAX_REQUEST_BYTES.min(proxy.limits.max_buffered_bytes);
    let too_large = || {
        log.refused("too_large", StatusCode::PAYLOAD_TOO_LARGE);
        refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BODY_TOO_LARGE",
            &format!("model requests are limited to {}", shown_bytes(max_body)),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > max_body as u64) {
        return too_large();
    }

    // A slot first: a request waiting for one holds a connection but none of its body's bytes.
    let slot = match proxy.in_flight.clone().try_acquire_owned() {
        Ok(slot) => slot,
        Err(_) => match tokio::time::timeout(proxy.limits.queue_wait, proxy.in_flight.clone().acquire_owned()).await {
            Ok(Ok(slot)) => slot,
            _ => {
                log.refused("too_many_in_flight", StatusCode::TOO_MANY_REQUESTS);
                let mut answer = refusal(
                    StatusCode::TOO_MANY_REQUESTS,
                    "MODEL_REQUESTS_IN_FLIGHT",
                    &format!(
                        "sortie: this session already has {} model requests in flight; retry when one ends",
                        proxy.limits.max_in_flight
                    ),
                );
                answer
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                return answer;
            }
        },
    };

    // The session's budget may hold the request here, on its slot (so a sandbox holds at most the
    // proxy's in-flight requests waiting) but before its body is read.
    if let Err(reason) = proxy.sink.admit(api).await {
        log.refused("budget_exceeded", StatusCode::TOO_MANY_REQUESTS);
        return refusal(StatusCode::TOO_MANY_REQUESTS, "BUDGET_EXCEEDED", &reason);
    }
    let answered = AnswerEnded {
        sink: proxy.sink.clone(),
        api,
        metered: true,
    };

    let key = proxy.keys.key(api).await;
    let Some((key_name, key_value)) = key.as_deref().and_then(|key| key_header(api, key)) else {
        proxy.sink.key_missing(api);
        log.refused("key_missing", StatusCode::UNAUTHORIZED);
        return refusal(
            StatusCode::UNAUTHORIZED,
            "MODEL_KEY_MISSING",
            &format!("no {api} key is set for this workspace: sortie keys set {api}"),
        );
    };

    let now = tokio::time::Instant::now();
    let deadline = now
        .checked_add(proxy.limits.body_read_timeout)
        .unwrap_or(now + BODY_READ_TIMEOUT);
    let (body, buffered) = match read_body(body, max_body, &proxy.buffered, deadline).await {
        Ok(read) => read,
        Err(BodyError::TooLarge) => return too_large(),
        Err(BodyError::OverBudget) => {
            log.refused("over_budget", StatusCode::TOO_MANY_REQUESTS);
            let mut answer = refusal(
                StatusCode::TOO_MANY_REQUESTS,
                "MODEL_BODIES_BUFFERED",
                &format!(
                    "sortie: this session's model requests already hold {} of request bodies; retry when one is sent",
                    shown_bytes(proxy.limits.max_buffered_bytes)
                ),
            );
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return answer;
        }
        Err(BodyError::TimedOut) => {
            log.refused("body_timeout", StatusCode::REQUEST_TIMEOUT);
            let mut answer = refusal(
                StatusCode::REQUEST_TIMEOUT,
                "MODEL_BODY_TIMEOUT",
                &format!(
                    "sortie: the request body did not arrive within {} s",
                    proxy.limits.body_read_timeout.as_secs_f64()
                ),
            );
            // What is left of the body is never read: the connection cannot carry another request.
            answer
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return answer;
        }
        Err(BodyError::Broken) => {
            log.refused("bad_request", StatusCode::BAD_REQUEST);
            return refusal(StatusCode::BAD_REQUEST, "BAD_REQUEST", "the request body broke off");
        }
    };
    let fallback_model = request_model(api, rest, &body);

    let query = forwarded_query(api, parts.uri.query().unwrap_or_default());
    let Some(url) = target(proxy.base(api), rest, &query) else {
        log.refused("bad_path", StatusCode::BAD_REQUEST);
        return refusal(
            StatusCode::BAD_REQUEST,
            "BAD_REQUEST",
            "the model request's path does not stay under the upstream",
        );
    };
    let mut headers = forwarded_headers(&parts.headers, &REQUEST_DROPPED);
    for name in TENANCY_HEADERS {
        headers.remove(name);
    }
    for (_, name, value) in proxy.pinned.iter().filter(|(pinned_api, _, _)| *pinned_api == api) {
        headers.insert(name.clone(), value.clone());
    }
    // Identity, so the answer's bytes are readable here; the hop to the vendor is the only one
    // that loses compression.
    headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    headers.insert(key_name, key_value);

    let sent = proxy
        .http
        .request(parts.method.clone(), url)
        .headers(headers)
        .body(body)
        .send()
        .await;
    // The body went out with the request: its bytes no longer count against the budget.
    drop(buffered);
    let answer = match sent {
        Ok(answer) => answer,
        Err(error) => {
            tracing::warn!(session = %log.session_id, api = %api, error = %error.without_url(), "model upstream unreachable");
            log.refused("unreachable", StatusCode::BAD_GATEWAY);
            return refusal(
                StatusCode::BAD_GATEWAY,
                "MODEL_UPSTREAM_UNREACHABLE",
                &format!("the {api} API did not answer the gateway"),
            );
        }
    };
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if status.is_redirection() {
        log.refused("redirect", StatusCode::BAD_GATEWAY);
        return refusal(
            StatusCode::BAD_GATEWAY,
            "MODEL_UPSTREAM_REDIRECT",
            &format!("the {api} API answered with a redirect; not followed"),
        );
    }
    if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        // Before a byte of the answer: the worker fails the turn while the agent reads the error.
        proxy.sink.auth_rejected(api, status.as_u16());
        tracing::warn!(session = %log.session_id, api = %api, status = status.as_u16(), "the vendor rejected the workspace's key");
    }
    metrics::counter!("sortie_model_requests_total", "api" => api.as_str(), "outcome" => status_class(status))
        .increment(1);

    let answer_headers = forwarded_headers(answer.headers(), &[]);
    let encoded = answer_headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|encoding| encoding.as_bytes() != b"identity");
    let format = answer_headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(BodyFormat::of)
        .filter(|_| !encoded);
    let metered = Metered {
        frames: Box::pin(answer.bytes_stream()),
        reading: Some(Reading {
            reader: UsageReader::new(api, format),
            fallback_model,
            sink: proxy.sink.clone(),
            log,
            route,
            status,
            _slot: slot,
            _answered: answered,
        }),
    };
    let mut response = Response::new(Body::from_stream(metered));
    *response.status_mut() = status;
    *response.headers_mut() = answer_headers;
    response
}

/// The header that carries `key` the vendor's way, marked sensitive; `None` for a blank key or one
/// no header can hold.
fn key_header(api: ModelApi, key: &str) -> Option<(HeaderName, HeaderValue)> {
    let key = key.trim();
    if key.is_empty() {
        return None;
    }
    let (name, value) = match api {
        ModelApi::Anthropic => (HeaderName::from_static("x-api-key"), HeaderValue::from_str(key)),
        ModelApi::Openai => (header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {key}"))),
        ModelApi::Gemini => (HeaderName::from_static("x-goog-api-key"), HeaderValue::from_str(key)),
    };
    let mut value = value.ok()?;
    value.set_sensitive(true);
    Some((name, value))
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "401",
        403 => "403",
        429 => "429",
        200..=299 => "2xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// Whether reading a body failed on its length limit (rather than a broken connection).
fn is_length_limit(error: &axum::Error) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = current {
        if error.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        current = error.source();
    }
    false
}

/// `headers` without hop-by-hop ones (and those `Connection` names), `host`, and any of `also`.
fn forwarded_headers(headers: &HeaderMap, also: &[&str]) -> HeaderMap {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let dropped = HOP_BY_HOP.contains(&name.as_str())
            || also.contains(&name.as_str())
            || name == header::HOST
            || named_by_connection.iter().any(|named| named == name.as_str());
        if !dropped {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// The query as forwarded: for Gemini, without a credential parameter.
fn forwarded_query(api: ModelApi, query: &str) -> String {
    if api != ModelApi::Gemini {
        return query.to_owned();
    }
    query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or_default();
            !pair.is_empty() && !GEMINI_QUERY_CREDENTIALS.contains(&percent_decode(name).as_str())
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Form-urlencoded decoding of a query parameter's name (`%XX` and `+`), lossy.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = |offset: usize| {
            bytes
                .get(index + offset)
                .and_then(|digit| char::from(*digit).to_digit(16))
        };
        match (bytes[index], hex(1), hex(2)) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                index += 3;
            }
            (b'+', _, _) => {
                decoded.push(b' ');
                index += 1;
            }
            (byte, _, _) => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

/// The upstream URL for `rest` and `query`; `None` unless it stays on the base's origin and under
/// its path (a `..` in `rest` does not climb out).
fn target(base: &reqwest::Url, rest: &str, query: &str) -> Option<reqwest::Url> {
    let mut text = format!("{}/{rest}", base.as_str().trim_end_matches('/'));
    if !query.is_empty() {
        text.push('?');
        text.push_str(query);
    }
    let url = reqwest::Url::parse(&text).ok()?;
    let prefix = base.path().trim_end_matches('/');
    let under = url
        .path()
        .strip_prefix(prefix)
        .is_some_and(|tail| tail.is_empty() || tail.starts_with('/'));
    (url.origin() == base.origin() && under).then_some(url)
}

/// The usage half of an answer in flight.
struct Reading {
    reader: UsageReader,
    fallback_model: Option<String>,
    sink: Arc<dyn UsageSink>,
    log: RequestLog,
    route: Route,
    status: StatusCode,
    /// The request's in-flight slot, freed when the answer ends or the agent goes away.
    _slot: OwnedSemaphorePermit,
    /// Tells the sink the answer is over, after its usage.
    _answered: AnswerEnded,
}

/// Tells the sink an admitted request's answer is over when dropped: with its reading, or when the
/// request ends without one (refused, the vendor unreachable).
struct AnswerEnded {
    sink: Arc<dyn UsageSink>,
    api: ModelApi,
    /// False once a successful generation ended without reporting usage.
    metered: bool,
}

impl Drop for AnswerEnded {
    fn drop(&mut self) {
        self.sink.answer_ended(self.api, self.metered);
    }
}

impl Reading {
    /// Reports the usage (if any) and logs the request's line.
    fn finish(self) {
        let Self {
            reader,
            fallback_model,
            sink,
            log,
            route,
            status,
            _slot,
            mut _answered,
        } = self;
        let api = log.api;
        let usage = reader.finish(fallback_model.as_deref());
        _answered.metered = usage.is_some() || !route.generates() || !status.is_success();
        if let Some(usage) = &usage {
            metrics::counter!("sortie_model_tokens_total", "api" => api.as_str(), "kind" => "input")
                .increment(usage.input_tokens);
            metrics::counter!("sortie_model_tokens_total", "api" => api.as_str(), "kind" => "output")
                .increment(usage.output_tokens);
            sink.usage(api, usage);
        }
        tracing::info!(
            session = %log.session_id,
            api = %api,
            method = %log.method,
            path = %log.path,
            route = route.as_str(),
            status = status.as_u16(),
            model = usage.as_ref().map(|u| u.model.as_str()).or(fallback_model.as_deref()).unwrap_or("unknown"),
            input_tokens = usage.as_ref().map_or(0, |u| u.input_tokens),
            output_tokens = usage.as_ref().map_or(0, |u| u.output_tokens),
            elapsed_ms = log.started.elapsed().as_millis() as u64,
            "model request"
        );
    }
}

type Frames = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// The answer's body as the vendor sends it, each frame shown to the usage reader on its way; the
/// usage is reported at the end of the body, on its first error, or when the client goes away.
struct Metered {
    frames: Frames,
    reading: Option<Reading>,
}

impl Metered {
    fn finish(&mut self) {
        if let Some(reading) = self.reading.take() {
            reading.finish();
        }
    }
}

impl Stream for Metered {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let next = this.frames.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(reading) = &mut this.reading {
                    reading.reader.feed(frame);
                }
            }
            Poll::Ready(Some(Err(_)) | None) => this.finish(),
            Poll::Pending => {}
        }
        next
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_go_the_vendors_way() {
        let cases = [
            (ModelApi::Anthropic, " sk-ant \n", Some(("x-api-key", "sk-ant"))),
            (ModelApi::Openai, "sk-oa", Some(("authorization", "Bearer sk-oa"))),
            (ModelApi::Gemini, "AIza", Some(("x-goog-api-key", "AIza"))),
            (ModelApi::Gemini, "  ", None),
            (ModelApi::Openai, "line\nbreak", None),
        ];
        for (api, key, expected) in cases {
            let header = key_header(api, key);
            assert!(header.as_ref().is_none_or(|(_, value)| value.is_sensitive()));
            let header = header
                .as_ref()
                .map(|(name, value)| (name.as_str(), value.to_str().unwrap_or("?")));
            assert_eq!(header, expected, "{api} {key:?}");
        }
    }

    #[test]
    fn gemini_credentials_leave_the_query() {
        let cases = [
            (ModelApi::Gemini, "alt=sse&key=placeholder", "alt=sse"),
            (
                ModelApi::Gemini,
                "key=a&alt=sse&%6Bey=b&access_token=c&keys=d",
                "alt=sse&keys=d",
            ),
            (ModelApi::Gemini, "key", ""),
            (ModelApi::Gemini, "", ""),
            (ModelApi::Gemini, "a=1&&b=2", "a=1&b=2"),
            (ModelApi::Anthropic, "beta=true&key=x", "beta=true&key=x"),
        ];
        for (api, query, expected) in cases {
            assert_eq!(forwarded_query(api, query), expected, "{api} {query}");
        }
        assert_eq!(percent_decode("%6b%65y+%zz%"), "key %zz%");
    }

    #[test]
    fn targets_stay_under_the_upstream() {
        let base = reqwest::Url::parse("https://api.example.com").expect("url");
        let prefixed = reqwest::Url::parse("http://127.0.0.1:9/proxy/anthropic/").expect("url");
        let cases: [(&reqwest::Url, &str, &str, Option<&str>); 8] = [
            (
                &base,
                "v1/messages",
                "beta=true",
                Some("https://api.example.com/v1/messages?beta=true"),
            ),
            (
                &base,
                "v1beta/models/gemini-2.5-pro:streamGenerateContent",
                "alt=sse",
                Some("https://api.example.com/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"),
            ),
            (
                &base,
                "/evil.example/x",
                "",
                Some("https://api.example.com//evil.example/x"),
            ),
            (
                &base,
                "@evil.example/x",
                "",
                Some("https://api.example.com/@evil.example/x"),
            ),
            (&base, "../../etc", "", Some("https://api.example.com/etc")),
            (
                &prefixed,
                "v1/messages",
                "",
                Some("http://127.0.0.1:9/proxy/anthropic/v1/messages"),
            ),
            (&prefixed, "../openai/v1/responses", "", None),
            (&prefixed, "%2e%2e/openai", "", None),
        ];
        for (base, rest, query, expected) in cases {
            assert_eq!(
                target(base, rest, query).as_ref().map(reqwest::Url::as_str),
                expected,
                "{base} {rest}"
            );
        }
    }

    use axum::http::HeaderName;

    #[test]
    fn hop_by_hop_and_credentials_are_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("host", "127.0.0.1:3128"),
            ("content-length", "12"),
            ("authorization", "Bearer placeholder"),
            ("x-api-key", "placeholder"),
            ("x-goog-api-key", "placeholder"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "a"),
            ("anthropic-beta", "b"),
            ("content-type", "application/json"),
            ("accept-encoding", "gzip, br"),
        ] {
            headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        let request = forwarded_headers(&headers, &REQUEST_DROPPED);
        let mut names: Vec<_> = request.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["anthropic-beta", "anthropic-version", "content-type"]);
        assert_eq!(request.get_all("anthropic-beta").iter().count(), 2);
        let answer = forwarded_headers(&headers, &[]);
        assert_eq!(
            answer.get("content-length").map(HeaderValue::as_bytes),
            Some(&b"12"[..])
        );
        assert!(
            answer.get("authorization").is_some(),
            "an answer's headers are relayed as they are"
        );
        assert!(answer.get("x-private").is_none() && answer.get("transfer-encoding").is_none());
    }
}
