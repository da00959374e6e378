//! A metrics registry that refuses names without units, and its Prometheus text exposition.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{LatencyHistogram, TelemetryError};

/// Words a metric name may end in (or, for a gauge counting things, contain) to state its unit.
/// Durations are always `seconds`; sizes always `bytes`.
pub const UNIT_WORDS: &[&str] = &[
    "seconds",
    "bytes",
    "tokens",
    "ratio",
    "total",
    "blocks",
    "requests",
    "connections",
    "transfers",
    "sequences",
    "workers",
    "leases",
    "events",
    "errors",
    "threads",
    "pages",
    "bits",
    "info",
    "steps",
    "batches",
    "entries",
    "celsius",
    "joules",
    "volts",
];

/// Unit words that are refused outright: durations are seconds and sizes are bytes (a latency logged
/// in microseconds and read as nanoseconds is the failure this rule exists for).
const REFUSED_UNITS: &[&str] = &[
    "ms",
    "us",
    "ns",
    "msec",
    "usec",
    "nsec",
    "millis",
    "micros",
    "nanos",
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kb",
    "mb",
    "gb",
    "kib",
    "mib",
    "gib",
    "percent",
];

/// Words that make a name a duration, which must then be in seconds.
const TIME_WORDS: &[&str] =
    &["latency", "duration", "time", "elapsed", "age", "delay", "uptime", "wait", "timeout"];

/// The kind of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl MetricKind {
    fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// Checks `name` against the unit rules for `kind`:
/// - snake_case;
/// - no non-base unit anywhere (`_ms`, `_percent`, `_mib`, ...);
/// - a name about time (`latency`, `duration`, `wait`, ...) ends in `_seconds` (`_seconds_total` for a
///   counter);
/// - a counter ends in `_total`; a histogram ends in a unit word; a gauge ends in a unit word or, when it
///   counts things in a state, contains one (`requests_waiting`, `kv_transfers_in_flight`).
pub fn check_metric_name(name: &str, kind: MetricKind) -> Result<(), TelemetryError> {
    let err_name = || name.to_owned();
    let valid = name.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.contains("__")
        && !name.ends_with('_');
    if !valid {
        return Err(TelemetryError::InvalidName { name: err_name() });
    }
    let words: Vec<&str> = name.split('_').collect();
    if let Some(unit) = words.iter().find(|w| REFUSED_UNITS.contains(w)) {
        return Err(TelemetryError::NonBaseUnit { name: err_name(), unit: (*unit).to_owned() });
    }
    let last = words[words.len() - 1];
    let about_time = words.iter().any(|w| TIME_WORDS.contains(w));
    let seconds_suffix = name.ends_with("_seconds") || name.ends_with("_seconds_total");
    if about_time && !seconds_suffix {
        return Err(TelemetryError::DurationNotSeconds { name: err_name() });
    }
    match kind {
        MetricKind::Counter if last != "total" => {
            Err(TelemetryError::CounterWithoutTotal { name: err_name() })
        }
        MetricKind::Counter => Ok(()),
        // A histogram is a latency histogram: it records durations, in seconds.
        MetricKind::Histogram if last == "seconds" => Ok(()),
        MetricKind::Histogram => Err(TelemetryError::DurationNotSeconds { name: err_name() }),
        MetricKind::Gauge if words.iter().any(|w| UNIT_WORDS.contains(w) && *w != "total") => Ok(()),
        _ => Err(TelemetryError::NoUnit { name: err_name() }),
    }
}

fn check_label(name: &str, label: &str) -> Result<(), TelemetryError> {
    let valid = label.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !label.starts_with("__")
        && label != "le";
    if valid {
        Ok(())
    } else {
        Err(TelemetryError::InvalidLabel { name: name.to_owned(), label: label.to_owned() })
    }
}

/// A monotonically increasing count.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    pub fn add(&self, delta: f64) {
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
            Some((f64::from_bits(b) + delta).to_bits())
        });
    }
    pub fn inc(&self) {
        self.add(1.0);
    }
    pub fn dec(&self) {
        self.add(-1.0);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Bucket bounds for histograms.
#[derive(Debug)]
pub struct Buckets;

impl Buckets {
    /// 1 ms to 120 s, for request and token latencies in seconds.
    pub fn latency_seconds() -> Vec<f64> {
        vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
    }

    /// `count` bounds starting at `start`, each `factor` times the previous.
    pub fn exponential(start: f64, factor: f64, count: usize) -> Vec<f64> {
        std::iter::successors(Some(start), |b| Some(b * factor)).take(count).collect()
    }
}

#[derive(Debug, Clone)]
enum Series {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(LatencyHistogram),
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: MetricKind,
    labels: Vec<String>,
    bounds: Arc<[f64]>,
    series: Mutex<BTreeMap<Vec<String>, Series>>,
}

impl Family {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Vec<String>, Series>> {
        self.series.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn series(&self, values: &[&str]) -> Result<Series, TelemetryError> {
        if values.len() != self.labels.len() {
            return Err(TelemetryError::LabelCount {
                name: self.name.clone(),
                expected: self.labels.len(),
                got: values.len(),
            });
        }
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let mut map = self.lock();
        let s = map.entry(key).or_insert_with(|| match self.kind {
            MetricKind::Counter => Series::Counter(Counter::default()),
            MetricKind::Gauge => Series::Gauge(Gauge::default()),
            MetricKind::Histogram => Series::Histogram(LatencyHistogram::new()),
        });
        Ok(s.clone())
    }
}

macro_rules! family_handle {
    ($vec:ident, $one:ident, $variant:ident) => {
        /// A labelled family; `with` returns the series for one set of label values (keep the handle).
        #[derive(Debug, Clone)]
        pub struct $vec(Arc<Family>);

        impl $vec {
            /// The series for `values`, in the order of the family's label names.
            pub fn with(&self, values: &[&str]) -> Result<$one, TelemetryError> {
                match self.0.series(values)? {
                    Series::$variant(s) => Ok(s),
                    _ => unreachable!("a family holds one kind of series"),
                }
            }

            /// Drops the series for `values` from the exposition (a worker that left, say); a
            /// handle kept to it still works but is no longer shown. True if it was there.
            pub fn remove(&self, values: &[&str]) -> bool {
                let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
                self.0.lock().remove(&key).is_some()
            }
        }
    };
}

family_handle!(CounterVec, Counter, Counter);
family_handle!(GaugeVec, Gauge, Gauge);
family_handle!(HistogramVec, LatencyHistogram, Histogram);

/// The name prefixes of other servers whose metric names a registry may expose as aliases.
pub const PEER_PREFIXES: &[&str] = &["vllm:"];

/// Where a peer's alias reads its value at each scrape.
#[derive(Debug, Clone, PartialEq)]
pub enum AliasSource {
    /// The sum of `family`'s series (counters or gauges) whose labels hold every `(label, value)`
    /// pair of `only`.
    Sum { family: String, only: Vec<(String, String)> },
    /// Seconds since the Unix epoch at the scrape (an info gauge's value, as vLLM sets its
    /// `vllm:lora_requests_info`).
    UnixTime,
    /// A fixed value (an info gauge whose labels are the information: vLLM's
    /// `vllm:cache_config_info` is 1).
    Constant(f64),
}

impl AliasSource {
    /// Every series of `family`.
    pub fn all(family: &str) -> AliasSource {
        AliasSource::Sum { family: family.to_owned(), only: Vec::new() }
    }

    /// The series of `family` whose `label` is `value`.
    pub fn only(family: &str, label: &str, value: &str) -> AliasSource {
        AliasSource::Sum { family: family.to_owned(), only: vec![(label.to_owned(), value.to_owned())] }
    }
}

/// A metric under another server's name: one series, fixed labels, computed from this registry's
/// own metrics at each scrape (so it can never disagree with them).
#[derive(Debug)]
struct Alias {
    name: String,
    help: String,
    kind: MetricKind,
    labels: Vec<(String, String)>,
    source: AliasSource,
}

/// The set of metrics a process exposes. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    families: Arc<Mutex<Vec<Arc<Family>>>>,
    aliases: Arc<Mutex<Vec<Alias>>>,
}

impl Registry {
    pub fn new() -> Self {
        Registry::default()
    }

    fn register(
        &self,
        name: &str,
        help: &str,
        kind: MetricKind,
        labels: &[&str],
        bounds: Vec<f64>,
    ) -> Result<Arc<Family>, TelemetryError> {
        check_metric_name(name, kind)?;
        for l in labels {
            check_label(name, l)?;
        }
        if kind == MetricKind::Histogram
            && (bounds.is_empty()
                || bounds.iter().any(|b| !b.is_finite())
                || bounds.windows(2).any(|w| w[0] >= w[1]))
        {
            return Err(TelemetryError::InvalidBuckets { name: name.to_owned() });
        }
        let mut families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        if families.iter().any(|f| f.name == name) {
            return Err(TelemetryError::DuplicateMetric { name: name.to_owned() });
        }
        let family = Arc::new(Family {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
            bounds: bounds.into(),
            series: Mutex::new(BTreeMap::new()),
        });
        if labels.is_empty() {
            // An unlabelled metric is exposed (as zero) from the start.
            family.series(&[])?;
        }
        families.push(Arc::clone(&family));
        Ok(family)
    }

    pub fn counter(&self, name: &str, help: &str) -> Result<Counter, TelemetryError> {
        self.counter_vec(name, help, &[])?.with(&[])
    }

    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> Result<CounterVec, TelemetryError> {
        Ok(CounterVec(self.register(name, help, MetricKind::Counter, labels, Vec::new())?))
    }

    pub fn gauge(&self, name: &str, help: &str) -> Result<Gauge, TelemetryError> {
        self.gauge_vec(name, help, &[])?.with(&[])
    }

    pub fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> Result<GaugeVec, TelemetryError> {
        Ok(GaugeVec(self.register(name, help, MetricKind::Gauge, labels, Vec::new())?))
    }

    /// A latency histogram exposed with buckets at `bounds` (seconds); its name ends in `_seconds`.
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        bounds: Vec<f64>,
    ) -> Result<LatencyHistogram, TelemetryError> {
        self.histogram_vec(name, help, &[], bounds)?.with(&[])
    }

    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        bounds: Vec<f64>,
    ) -> Result<HistogramVec, TelemetryError> {
        Ok(HistogramVec(self.register(name, help, MetricKind::Histogram, labels, bounds)?))
    }

    /// Exposes `name`, another server's metric name (its prefix one of [`PEER_PREFIXES`]; the unit
    /// rule is the peer's, not this project's), as a counter or gauge with the fixed `labels`, its
    /// value read from `source` at each scrape. A `Sum` source must already be registered.
    pub fn peer_alias(
        &self,
        name: &str,
        help: &str,
        kind: MetricKind,
        labels: &[(&str, &str)],
        source: AliasSource,
    ) -> Result<(), TelemetryError> {
        let rest = PEER_PREFIXES.iter().find_map(|p| name.strip_prefix(p));
        let valid = rest.is_some_and(|r| {
            r.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
                && r.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        });
        if !valid || kind == MetricKind::Histogram {
            return Err(TelemetryError::InvalidName { name: name.to_owned() });
        }
        if kind == MetricKind::Counter && !name.ends_with("_total") {
            return Err(TelemetryError::CounterWithoutTotal { name: name.to_owned() });
        }
        for (l, _) in labels {
            check_label(name, l)?;
        }
        if let AliasSource::Sum { family, only } = &source {
            let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
            let f = families.iter().find(|f| &f.name == family);
            let known = f.is_some_and(|f| {
                f.kind != MetricKind::Histogram && only.iter().all(|(l, _)| f.labels.contains(l))
            });
            if !known {
                return Err(TelemetryError::UnknownAliasSource {
                    name: name.to_owned(),
                    family: family.clone(),
                });
            }
        }
        let mut aliases = self.aliases.lock().unwrap_or_else(|e| e.into_inner());
        if aliases.iter().any(|a| a.name == name) {
            return Err(TelemetryError::DuplicateMetric { name: name.to_owned() });
        }
        aliases.push(Alias {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            labels: labels.iter().map(|(l, v)| ((*l).to_owned(), (*v).to_owned())).collect(),
            source,
        });
        Ok(())
    }

    /// An alias's value now.
    fn alias_value(&self, source: &AliasSource) -> f64 {
        match source {
            AliasSource::Constant(v) => *v,
            AliasSource::UnixTime => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            AliasSource::Sum { family, only } => {
                let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
                let Some(f) = families.iter().find(|f| &f.name == family).cloned() else { return 0.0 };
                drop(families);
                let at: Vec<(usize, &str)> = only
                    .iter()
                    .filter_map(|(l, v)| Some((f.labels.iter().position(|x| x == l)?, v.as_str())))
                    .collect();
                let series = f.lock();
                let sum = series
                    .iter()
                    .filter(|(values, _)| at.iter().all(|&(i, v)| values.get(i).is_some_and(|x| x == v)))
                    .map(|(_, series)| match series {
                        Series::Counter(c) => c.get() as f64,
                        Series::Gauge(g) => g.get(),
                        Series::Histogram(_) => 0.0,
                    })
                    .sum();
                sum
            }
        }
    }

    /// The Prometheus text exposition format (version 0.0.4) of every metric, in registration order,
    /// then the peers' aliases.
    pub fn render(&self) -> String {
        let families: Vec<Arc<Family>> = self.families.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut out = String::with_capacity(4096);
        for f in families {
            let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
            for (values, series) in f.lock().iter() {
                let labels = label_pairs(&f.labels, values);
                match series {
                    Series::Counter(c) => line(&mut out, &f.name, "", &labels, None, c.get() as f64),
                    Series::Gauge(g) => line(&mut out, &f.name, "", &labels, None, g.get()),
                    Series::Histogram(h) => {
                        let cumulative = h.cumulative(&f.bounds);
                        for (i, c) in cumulative.iter().enumerate() {
                            let le = f.bounds.get(i).map_or_else(|| "+Inf".to_owned(), |b| format_value(*b));
                            line(&mut out, &f.name, "_bucket", &labels, Some(&le), *c as f64);
                        }
                        line(&mut out, &f.name, "_sum", &labels, None, h.sum_seconds());
                        // The count is the +Inf bucket, so the two always agree in one scrape.
                        let count = cumulative.last().copied().unwrap_or(0);
                        line(&mut out, &f.name, "_count", &labels, None, count as f64);
                    }
                }
            }
        }
        let aliases = self.aliases.lock().unwrap_or_else(|e| e.into_inner());
        for a in aliases.iter() {
            let _ = writeln!(out, "# HELP {} {}", a.name, escape_help(&a.help));
            let _ = writeln!(out, "# TYPE {} {}", a.name, a.kind.as_str());
            let (names, values): (Vec<String>, Vec<String>) = a.labels.iter().cloned().unzip();
            line(&mut out, &a.name, "", &label_pairs(&names, &values), None, self.alias_value(&a.source));
        }
        out
    }
}

fn label_pairs(names: &[String], values: &[String]) -> String {
    let mut s = String::new();
    for (i, (n, v)) in names.iter().zip(values).enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{n}=\"{}\"", escape_label(v));
    }
    s
}

fn line(out: &mut String, name: &str, suffix: &str, labels: &str, le: Option<&str>, value: f64) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        out.push_str(labels);
        if let Some(le) = le {
            if !labels.is_empty() {
                out.push(',');
            }
            let _ = write!(out, "le=\"{le}\"");
        }
        out.push('}');
    }
    let _ = writeln!(out, " {}", format_value(value));
}

fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    type IsWanted = fn(&TelemetryError) -> bool;

    #[test]
    fn name_rules() {
        use MetricKind::*;
        let ok = [
            ("requests_finished_total", Counter),
            ("tokens_generated_total", Counter),
            ("busy_seconds_total", Counter),
            ("requests_waiting", Gauge),
            ("kv_blocks", Gauge),
            ("kv_transfers_in_flight", Gauge),
            ("kv_cache_usage_ratio", Gauge),
            ("time_to_first_token_seconds", Histogram),
            ("queue_wait_seconds", Histogram),
        ];
        for (name, kind) in ok {
            assert_eq!(check_metric_name(name, kind), Ok(()), "{name}");
        }
        let bad: [(&str, MetricKind, IsWanted); 10] = [
            ("prompt_tokens", Histogram, |e| matches!(e, TelemetryError::DurationNotSeconds { .. })),
            ("latency", Histogram, |e| matches!(e, TelemetryError::DurationNotSeconds { .. })),
            ("request_latency_ms", Histogram, |e| matches!(e, TelemetryError::NonBaseUnit { .. })),
            ("request_latency_us", Gauge, |e| matches!(e, TelemetryError::NonBaseUnit { .. })),
            ("queue_len", Gauge, |e| matches!(e, TelemetryError::NoUnit { .. })),
            ("requests", Counter, |e| matches!(e, TelemetryError::CounterWithoutTotal { .. })),
            ("wait_total", Counter, |e| matches!(e, TelemetryError::DurationNotSeconds { .. })),
            ("Requests_total", Counter, |e| matches!(e, TelemetryError::InvalidName { .. })),
            ("requests__total", Counter, |e| matches!(e, TelemetryError::InvalidName { .. })),
            ("memory_mib", Gauge, |e| matches!(e, TelemetryError::NonBaseUnit { .. })),
        ];
        for (name, kind, want) in bad {
            let err = check_metric_name(name, kind).unwrap_err();
            assert!(want(&err), "{name}: {err:?}");
        }
    }

    #[test]
    fn a_removed_series_leaves_the_exposition_and_can_come_back() {
        let r = Registry::new();
        let v = r.gauge_vec("worker_requests_in_flight", "Requests.", &["worker"]).unwrap();
        v.with(&["a"]).unwrap().set(3.0);
        v.with(&["b"]).unwrap().set(1.0);
        assert!(v.remove(&["a"]));
        assert!(!v.remove(&["a"]));
        let text = r.render();
        assert!(!text.contains("worker=\"a\"") && text.contains("worker=\"b\"} 1"), "{text}");
        v.with(&["a"]).unwrap().set(2.0);
        assert!(r.render().contains("worker=\"a\"} 2"));
    }
}
