//! The router's metrics, every name with its unit.

use pdserve_api::{ErrorKind, Outcome, Stage};
use pdserve_telemetry::{
    Buckets, Counter, CounterVec, Gauge, GaugeVec, LatencyHistogram, Registry, TelemetryError,
};

#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub registry: Registry,
    finished: CounterVec,
    errors: CounterVec,
    pub in_flight: Gauge,
    pub queued: Gauge,
    pub worker_in_flight: GaugeVec,
    pub worker_connections: GaugeVec,
    pub workers_up: GaugeVec,
    pub retries: Counter,
    pub stale_retries: Counter,
    pub probes: CounterVec,
    pub aborts_sent: Counter,
    pub migrations: CounterVec,
    pub latency: LatencyHistogram,
    pub ttfb: LatencyHistogram,
    pub queue_wait: LatencyHistogram,
    pub prefill_leg: LatencyHistogram,
    pub client_connections: Gauge,
    discovery_lookups: CounterVec,
    pub discovery_addresses: GaugeVec,
    pub otlp_spans: CounterVec,
    pub dispatched: CounterVec,
    pub kv_event_batches: CounterVec,
}

impl Metrics {
    pub fn new() -> Result<Metrics, TelemetryError> {
        let r = Registry::new();
        Ok(Metrics {
            finished: r.counter_vec(
                "router_requests_finished_total",
                "Client requests that reached a terminal state, by outcome and the stage they ended in.",
                &["outcome", "stage"],
            )?,
            errors: r.counter_vec(
                "router_errors_total",
                "Client requests that ended with an error, by its type.",
                &["type"],
            )?,
            in_flight: r.gauge("router_requests_in_flight", "Client requests dispatched to workers.")?,
            queued: r.gauge("router_requests_queued", "Client requests waiting in the router's queue.")?,
            worker_in_flight: r.gauge_vec(
                "router_worker_requests_in_flight",
                "Requests (legs) in flight to each worker.",
                &["worker", "role"],
            )?,
            worker_connections: r.gauge_vec(
                "router_worker_connections",
                "Open pooled connections to each worker, busy or idle.",
                &["worker", "role"],
            )?,
            workers_up: r.gauge_vec(
                "router_workers",
                "Registered workers by role and state (up, down, draining).",
                &["role", "state"],
            )?,
            retries: r.counter(
                "router_connect_retries_total",
                "Legs re-sent to another worker after a refused connect or a draining worker's not_ready answer (moves mid-request are router_migrations_total).",
            )?,
            stale_retries: r.counter(
                "router_stale_connection_retries_total",
                "Legs re-sent on a fresh connection after a pooled one the worker had closed failed before any response byte.",
            )?,
            probes: r.counter_vec(
                "router_probes_total",
                "Health probes by kind and result.",
                &["kind", "result"],
            )?,
            aborts_sent: r.counter("router_aborts_sent_total", "POST /abort/{id} calls sent to workers.")?,
            migrations: r.counter_vec(
                "router_migrations_total",
                "Requests moved to another worker mid-request, by cause (prefill_lost, decode_lost, stalled, kv_transfer) and the request's final outcome.",
                &["cause", "outcome"],
            )?,
            latency: r.histogram(
                "router_request_latency_seconds",
                "From request received to its terminal state.",
                Buckets::latency_seconds(),
            )?,
            ttfb: r.histogram(
                "router_time_to_first_byte_seconds",
                "From request received to the response head sent to the client.",
                Buckets::latency_seconds(),
            )?,
            queue_wait: r.histogram(
                "router_queue_wait_seconds",
                "Time dispatched requests spent in the router's queue.",
                Buckets::latency_seconds(),
            )?,
            prefill_leg: r.histogram(
                "router_prefill_leg_seconds",
                "Duration of the prefill leg in PD mode (request sent to KV handle received).",
                Buckets::latency_seconds(),
            )?,
            client_connections: r.gauge("router_client_connections", "Open client connections.")?,
            discovery_lookups: r.counter_vec(
                "router_discovery_lookups_total",
                "DNS lookups of --discover sources, by source and result (ok, failed; a failed one keeps the workers as they were).",
                &["source", "result"],
            )?,
            discovery_addresses: r.gauge_vec(
                "router_discovered_workers",
                "Workers (addresses) the last successful lookup of each --discover source returned.",
                &["source"],
            )?,
            otlp_spans: r.counter_vec(
                "router_otlp_spans_total",
                "Spans for --otlp-traces-endpoint: exported (the collector took them) or dropped (a full \
                 queue, or a batch the collector refused or never answered).",
                &["result"],
            )?,
            dispatched: r.counter_vec(
                "router_requests_dispatched_total",
                "Client requests sent on from the router's queue, by plan: unified, disaggregated (prefill then \
                 decode), decode_local (a decode worker holding the conversation computes its short new \
                 tail itself), forward.",
                &["plan"],
            )?,
            kv_event_batches: r.counter_vec(
                "router_kv_event_batches_total",
                "Workers' KV event batches (--tokenizer): applied to the router's index of their caches, \
                 gap (missing batches no replay could fill: the worker is routed by the prompts sent there \
                 until its next AllBlocksCleared), failed (a subscription that failed or ended).",
                &["result"],
            )?,
            registry: r,
        })
    }

    pub fn finished(&self, outcome: Outcome, stage: Stage) {
        if let Ok(c) = self.finished.with(&[outcome.as_str(), stage.as_str()]) {
            c.inc();
        }
    }

    pub fn discovery_lookup(&self, source: &str, result: &str) {
        if let Ok(c) = self.discovery_lookups.with(&[source, result]) {
            c.inc();
        }
    }

    pub fn error(&self, kind: ErrorKind) {
        if let Ok(c) = self.errors.with(&[kind.as_str()]) {
            c.inc();
        }
    }
}
