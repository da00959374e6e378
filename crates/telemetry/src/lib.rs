//! Telemetry that cannot lie about units, and the ledger that answers "where is request X".
//!
//! - [`Registry`]: counters, gauges and latency histograms with labels; a name without a unit is refused
//!   at registration ([`check_metric_name`]); [`Registry::render`] writes the Prometheus text format.
//! - [`LatencyHistogram`]: the one latency histogram (hdrhistogram underneath): registered, it is a
//!   Prometheus histogram; alone (the load generator), it summarizes percentiles with the unit in every
//!   label.
//! - [`RequestLedger`]: each live request's stage, ages, deadline and owner, for `/debug/requests`, and
//!   the watchdog scan [`RequestLedger::overdue`]. It takes `now` as an argument.
//!
//! ```
//! use pdserve_telemetry::{Buckets, Registry};
//! let reg = Registry::new();
//! let finished = reg.counter_vec("requests_finished_total", "Requests ended", &["outcome"]).unwrap();
//! finished.with(&["completed"]).unwrap().inc();
//! let ttft = reg.histogram("time_to_first_token_seconds", "TTFT", Buckets::latency_seconds()).unwrap();
//! ttft.record(std::time::Duration::from_millis(42));
//! assert_eq!(ttft.summary().count, 1);
//! assert!(reg.histogram("ttft_ms", "no", Buckets::latency_seconds()).is_err());
//! assert!(reg.render().contains("requests_finished_total{outcome=\"completed\"} 1"));
//! ```
#![forbid(unsafe_code)]

mod error;
mod latency;
mod ledger;
mod metrics;

pub use error::TelemetryError;
pub use latency::{LatencyHistogram, LatencySummary};
pub use ledger::{LedgerEntry, Overdue, RequestLedger};
pub use metrics::{
    check_metric_name, AliasSource, Buckets, Counter, CounterVec, Gauge, GaugeVec, HistogramVec, MetricKind,
    Registry, PEER_PREFIXES, UNIT_WORDS,
};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
