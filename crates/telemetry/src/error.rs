//! The crate's one error: why a metric could not be registered or found, or a ledger operation refused.

use std::fmt;

use crate::metrics::UNIT_WORDS;

/// Why a telemetry operation was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TelemetryError {
    /// Metric name not `[a-z][a-z0-9_]*` without doubled or trailing underscores.
    InvalidName { name: String },
    /// No unit word where the rules need one.
    NoUnit { name: String },
    /// A unit other than the base units (`ms`, `percent`, `mib`, ...).
    NonBaseUnit { name: String, unit: String },
    /// A duration whose name does not end in `_seconds` (or `_seconds_total`).
    DurationNotSeconds { name: String },
    /// A counter whose name does not end in `_total`.
    CounterWithoutTotal { name: String },
    /// The metric name is already registered.
    DuplicateMetric { name: String },
    /// A label name that is not `[a-z_][a-z0-9_]*` or is reserved (`le`, `__*`).
    InvalidLabel { name: String, label: String },
    /// `with` got a different number of label values than the metric has label names.
    LabelCount { name: String, expected: usize, got: usize },
    /// Histogram bounds empty, unsorted, or not finite.
    InvalidBuckets { name: String },
    /// A peer alias reads a metric that is not registered, is a histogram, or lacks a label it filters on.
    UnknownAliasSource { name: String, family: String },
    /// The request id is already live in the ledger.
    DuplicateRequest { id: String },
    /// The ledger holds its maximum number of entries.
    LedgerFull { capacity: usize },
    /// No live request has this id.
    UnknownRequest { id: String },
}

impl fmt::Display for TelemetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TelemetryError::InvalidName { name } => write!(f, "metric name {name:?} is not snake_case"),
            TelemetryError::NoUnit { name } => {
                write!(f, "metric name {name:?} has no unit (end it in one of {})", UNIT_WORDS.join(", "))
            }
            TelemetryError::NonBaseUnit { name, unit } => {
                write!(f, "metric name {name:?} uses unit {unit:?}; use seconds, bytes or a ratio")
            }
            TelemetryError::DurationNotSeconds { name } => {
                write!(f, "duration metric {name:?} must end in _seconds")
            }
            TelemetryError::CounterWithoutTotal { name } => write!(f, "counter {name:?} must end in _total"),
            TelemetryError::UnknownAliasSource { name, family } => {
                write!(f, "alias {name:?} reads {family:?}, which is not a registered counter or gauge with those labels")
            }
            TelemetryError::DuplicateMetric { name } => write!(f, "metric {name:?} is already registered"),
            TelemetryError::InvalidLabel { name, label } => {
                write!(f, "metric {name:?} has invalid label {label:?}")
            }
            TelemetryError::LabelCount { name, expected, got } => {
                write!(f, "metric {name:?} takes {expected} label values, got {got}")
            }
            TelemetryError::InvalidBuckets { name } => {
                write!(f, "histogram {name:?} has invalid bucket bounds")
            }
            TelemetryError::DuplicateRequest { id } => write!(f, "request {id} is already live"),
            TelemetryError::LedgerFull { capacity } => {
                write!(f, "request ledger is full ({capacity} live requests)")
            }
            TelemetryError::UnknownRequest { id } => write!(f, "no live request {id}"),
        }
    }
}

impl std::error::Error for TelemetryError {}
