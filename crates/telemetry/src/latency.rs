//! Latency summaries over hdrhistogram, with the unit in every printed label.

use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;

/// Records durations at microsecond resolution (1 µs to 1 hour, 3 significant digits) and summarizes
/// them. Longer durations are clamped to the top of the range and counted in `clamped`.
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    h: Histogram<u64>,
    clamped: u64,
}

const MAX_MICROS: u64 = 3_600_000_000;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new()
    }
}

impl LatencyHistogram {
    pub fn new() -> Self {
        let h = Histogram::new_with_bounds(1, MAX_MICROS, 3)
            .unwrap_or_else(|_| unreachable!("static bounds are valid"));
        LatencyHistogram { h, clamped: 0 }
    }

    pub fn record(&mut self, d: Duration) {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if micros > MAX_MICROS {
            self.clamped += 1;
        }
        self.h.saturating_record(micros.clamp(1, MAX_MICROS));
    }

    pub fn merge(&mut self, other: &LatencyHistogram) {
        // Both share the same bounds, so adding cannot fail.
        let _ = self.h.add(&other.h);
        self.clamped += other.clamped;
    }

    pub fn len(&self) -> u64 {
        self.h.len()
    }

    pub fn is_empty(&self) -> bool {
        self.h.is_empty()
    }

    pub fn summary(&self) -> LatencySummary {
        let q =
            |p: f64| Duration::from_micros(if self.h.is_empty() { 0 } else { self.h.value_at_quantile(p) });
        LatencySummary {
            count: self.h.len(),
            mean: Duration::from_secs_f64(if self.h.is_empty() { 0.0 } else { self.h.mean() / 1e6 }),
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            p999: q(0.999),
            max: Duration::from_micros(if self.h.is_empty() { 0 } else { self.h.max() }),
            clamped: self.clamped,
        }
    }
}

/// Percentiles of a [`LatencyHistogram`]. Printed and serialized with the unit in each label
/// (`p50_ms=12.345`), so nobody reads microseconds as nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySummary {
    pub count: u64,
    pub mean: Duration,
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub p999: Duration,
    pub max: Duration,
    /// Observations over one hour, recorded as one hour.
    pub clamped: u64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl LatencySummary {
    /// `{"count":..,"mean_ms":..,"p50_ms":..,"p90_ms":..,"p99_ms":..,"p99_9_ms":..,"max_ms":..}`
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "mean_ms": ms(self.mean),
            "p50_ms": ms(self.p50),
            "p90_ms": ms(self.p90),
            "p99_ms": ms(self.p99),
            "p99_9_ms": ms(self.p999),
            "max_ms": ms(self.max),
        })
    }
}

impl fmt::Display for LatencySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "count={} mean_ms={:.3} p50_ms={:.3} p90_ms={:.3} p99_ms={:.3} p99.9_ms={:.3} max_ms={:.3}",
            self.count,
            ms(self.mean),
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.p999),
            ms(self.max)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut h = LatencyHistogram::new();
        for i in 1..=1000u64 {
            h.record(Duration::from_micros(i * 1000));
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        let close = |d: Duration, want_ms: f64| (ms(d) - want_ms).abs() / want_ms < 0.01;
        assert!(close(s.p50, 500.0), "{s}");
        assert!(close(s.p90, 900.0), "{s}");
        assert!(close(s.p99, 990.0), "{s}");
        assert!(close(s.max, 1000.0), "{s}");
        assert!(s.to_string().contains("p50_ms=50"), "{s}");
        assert_eq!(s.to_json()["count"], 1000);
    }

    #[test]
    fn merge_and_clamp() {
        let mut a = LatencyHistogram::new();
        let mut b = LatencyHistogram::new();
        a.record(Duration::from_millis(1));
        b.record(Duration::from_secs(7200));
        a.merge(&b);
        let s = a.summary();
        assert_eq!((s.count, s.clamped), (2, 1));
        assert!(s.max >= Duration::from_secs(3599));
        assert_eq!(LatencyHistogram::new().summary().p99, Duration::ZERO);
    }
}
