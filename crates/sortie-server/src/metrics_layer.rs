//! Request metrics: a counter and a latency histogram per route and status, rendered at `/metrics`.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static RECORDER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide recorder once; later calls (a second server in one test process) reuse it.
pub fn install_recorder() {
    RECORDER.get_or_init(|| match recorder().install_recorder() {
        Ok(handle) => Some(handle),
        Err(error) => {
            tracing::warn!(%error, "metrics recorder not installed");
            None
        }
    });
}

/// Every `*_seconds` series is a histogram (what alerts and `histogram_quantile` need across replicas),
/// with buckets from an HTTP request's milliseconds to a long turn's hour.
fn recorder() -> PrometheusBuilder {
    const SECONDS: [f64; 18] = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ];
    match PrometheusBuilder::new().set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS) {
        Ok(builder) => builder,
        Err(error) => {
            tracing::warn!(%error, "histogram buckets not set: latencies are summaries");
            PrometheusBuilder::new()
        }
    }
}

pub fn render() -> String {
    install_recorder();
    RECORDER
        .get()
        .and_then(Option::as_ref)
        .map(PrometheusHandle::render)
        .unwrap_or_default()
}

pub async fn track(request: Request, next: Next) -> Response {
    let started = Instant::now();
    // The route template, not the raw path, so session ids do not explode the label set.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    let method = request.method().as_str().to_owned();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("sortie_http_requests_total", "method" => method.clone(), "route" => route.clone(), "status" => status).increment(1);
    metrics::histogram!("sortie_http_request_duration_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}
