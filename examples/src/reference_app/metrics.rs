//! `GET /metrics`: the middleware's metrics in the Prometheus text format, through
//! metrics-exporter-prometheus (its HTTP listener left out: Actix serves the route).

use std::sync::OnceLock;

use actix_web::{HttpResponse, get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Store latency buckets, in seconds: 100 µs to the 2 s store timeout.
const LATENCY_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
];

/// The process-wide Prometheus recorder's handle, installed on first use.
///
/// If the process already has another recorder (an embedding app's, a test's), that one
/// keeps the metrics and `GET /metrics` answers what this one saw: nothing.
pub(super) fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &LATENCY_BUCKETS)
            // Only an empty bucket list is refused; without buckets, histograms are summaries.
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let handle = builder.install_recorder().unwrap_or_else(|error| {
            eprintln!("reference_server: GET /metrics stays empty: {error}");
            PrometheusBuilder::new().build_recorder().handle()
        });
        idempotency_actix::describe_metrics();
        handle
    })
}

/// The metrics in the Prometheus text exposition format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((
        status = 200,
        description = "The middleware's metrics in the Prometheus text exposition format 0.0.4.",
        body = String,
        content_type = "text/plain",
    )),
)]
#[get("/metrics")]
pub(crate) async fn scrape() -> HttpResponse {
    let handle = handle();
    handle.run_upkeep();
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(handle.render())
}
