//! The router's metrics, every name with its unit.

use pdserve_telemetry::{Buckets, Counter, CounterVec, Gauge, GaugeVec, Histogram, MetricError, Registry};

/// Terminal outcomes of client requests, the `outcome` label of `router_requests_finished_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The worker's answer (2xx) reached the client.
    Ok,
    /// The worker answered with an error status, forwarded as is.
    WorkerError,
    /// Refused by the router before dispatch: bad input, auth.
    Invalid,
    QueueFull,
    NoCapacity,
    DeadlineExceeded,
    UpstreamFailed,
    /// The client went away first.
    Cancelled,
}

impl Outcome {
    const ALL: [Outcome; 8] = [
        Outcome::Ok,
        Outcome::WorkerError,
        Outcome::Invalid,
        Outcome::QueueFull,
        Outcome::NoCapacity,
        Outcome::DeadlineExceeded,
        Outcome::UpstreamFailed,
        Outcome::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::WorkerError => "worker_error",
            Outcome::Invalid => "invalid",
            Outcome::QueueFull => "queue_full",
            Outcome::NoCapacity => "no_capacity",
            Outcome::DeadlineExceeded => "deadline_exceeded",
            Outcome::UpstreamFailed => "upstream_failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub registry: Registry,
    finished: Vec<Counter>,
    pub in_flight: Gauge,
    pub queued: Gauge,
    pub worker_in_flight: GaugeVec,
    pub worker_connections: GaugeVec,
    pub workers_up: GaugeVec,
    pub retries: Counter,
    pub stale_retries: Counter,
    pub probes: CounterVec,
    pub aborts_sent: Counter,
    pub latency: Histogram,
    pub ttfb: Histogram,
    pub queue_wait: Histogram,
    pub prefill_leg: Histogram,
    pub client_connections: Gauge,
}

impl Metrics {
    pub fn new() -> Result<Metrics, MetricError> {
        let r = Registry::new();
        let finished_vec = r.counter_vec(
            "router_requests_finished_total",
            "Client requests that reached a terminal state, by outcome.",
            &["outcome"],
        )?;
        let finished =
            Outcome::ALL.iter().map(|o| finished_vec.with(&[o.as_str()])).collect::<Result<_, _>>()?;
        Ok(Metrics {
            finished,
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
                "Legs re-sent to another worker after a refused connect (nothing else is retried).",
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
            registry: r,
        })
    }

    pub fn finished(&self, outcome: Outcome) {
        let i = Outcome::ALL.iter().position(|&o| o == outcome).unwrap_or(0);
        self.finished[i].inc();
    }
}
