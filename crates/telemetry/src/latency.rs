//! The one latency histogram of the workspace: hdrhistogram underneath, shared by clones, exposed to
//! Prometheus through a [`crate::Registry`] and summarized as percentiles with the unit in every
//! label. Workers, the router and the load generator all record into it.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hdrhistogram::Histogram;

#[derive(Debug)]
struct Inner {
    h: Histogram<u64>,
    clamped: u64,
    /// The exact sum of what was recorded, in seconds.
    sum_s: f64,
}

/// Records durations at microsecond resolution (1 µs to 1 hour, 3 significant digits) and summarizes
/// them. Longer durations are clamped to the top of the range and counted in `clamped`. Cloning shares
/// the histogram (one lock around it; recording is a few tens of nanoseconds).
#[derive(Debug, Clone)]
pub struct LatencyHistogram(Arc<Mutex<Inner>>);

const MAX_MICROS: u64 = 3_600_000_000;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new()
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl LatencyHistogram {
    pub fn new() -> Self {
        let h = Histogram::new_with_bounds(1, MAX_MICROS, 3)
            .unwrap_or_else(|_| unreachable!("static bounds are valid"));
        LatencyHistogram(Arc::new(Mutex::new(Inner { h, clamped: 0, sum_s: 0.0 })))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Counts only: a histogram poisoned by a panic elsewhere is still consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn record(&self, d: Duration) {
        let us = micros(d);
        let mut g = self.lock();
        if us > MAX_MICROS {
            g.clamped += 1;
        }
        g.h.saturating_record(us.clamp(1, MAX_MICROS));
        g.sum_s += d.as_secs_f64();
    }

    /// Adds everything `other` recorded.
    pub fn merge(&self, other: &LatencyHistogram) {
        if Arc::ptr_eq(&self.0, &other.0) {
            return;
        }
        let o = other.lock();
        let (h, clamped, sum_s) = (o.h.clone(), o.clamped, o.sum_s);
        drop(o);
        let mut g = self.lock();
        // Both share the same bounds, so adding cannot fail.
        let _ = g.h.add(&h);
        g.clamped += clamped;
        g.sum_s += sum_s;
    }

    pub fn len(&self) -> u64 {
        self.lock().h.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().h.is_empty()
    }

    /// Seconds recorded, summed exactly.
    pub fn sum_seconds(&self) -> f64 {
        self.lock().sum_s
    }

    /// How many recorded durations were at most each bound (seconds), for the Prometheus buckets;
    /// values are bucketed to 3 significant digits, so a bound is exact to 0.1%. The last entry is
    /// the total count.
    pub(crate) fn cumulative(&self, bounds_s: &[f64]) -> Vec<u64> {
        let g = self.lock();
        let mut out: Vec<u64> = bounds_s
            .iter()
            .map(|&b| {
                let us = (b * 1e6).floor();
                if us < 1.0 {
                    0
                } else {
                    g.h.count_between(0, (us as u64).min(MAX_MICROS))
                }
            })
            .collect();
        out.push(g.h.len());
        out
    }

    pub fn summary(&self) -> LatencySummary {
        let g = self.lock();
        let h = &g.h;
        let q = |p: f64| Duration::from_micros(if h.is_empty() { 0 } else { h.value_at_quantile(p) });
        LatencySummary {
            count: h.len(),
            mean: Duration::from_secs_f64(if h.is_empty() { 0.0 } else { h.mean() / 1e6 }),
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            p999: q(0.999),
            max: Duration::from_micros(if h.is_empty() { 0 } else { h.max() }),
            clamped: g.clamped,
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

fn ms_of(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl LatencySummary {
    /// The median in milliseconds.
    pub fn p50_ms(&self) -> f64 {
        ms_of(self.p50)
    }

    pub fn p90_ms(&self) -> f64 {
        ms_of(self.p90)
    }

    pub fn p99_ms(&self) -> f64 {
        ms_of(self.p99)
    }

    pub fn max_ms(&self) -> f64 {
        ms_of(self.max)
    }

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
        let h = LatencyHistogram::new();
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
        assert!((h.sum_seconds() - 500.5).abs() < 1e-6, "the sum is exact");
        let c = h.cumulative(&[0.0005, 0.1, 0.5, 2.0]);
        assert_eq!((c[0], c[1], c[3], c[4]), (0, 100, 1000, 1000));
        assert!((c[2] as i64 - 500).abs() <= 1, "{c:?}");
    }

    #[test]
    fn merge_and_clamp() {
        let a = LatencyHistogram::new();
        let b = LatencyHistogram::new();
        a.record(Duration::from_millis(1));
        b.record(Duration::from_secs(7200));
        a.merge(&b);
        let s = a.summary();
        assert_eq!((s.count, s.clamped), (2, 1));
        assert!(s.max >= Duration::from_secs(3599));
        assert_eq!(LatencyHistogram::new().summary().p99, Duration::ZERO);
    }
}
