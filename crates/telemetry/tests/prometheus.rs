//! Exposition tests, including `promtool check metrics` on real output.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;

use pdserve_telemetry::{Buckets, Registry, TelemetryError};

/// A registry shaped like a worker's, with some traffic recorded.
fn worker_registry() -> Registry {
    let reg = Registry::new();
    let finished = reg
        .counter_vec(
            "requests_finished_total",
            "Requests that reached a terminal state.",
            &["outcome", "stage"],
        )
        .unwrap();
    finished.with(&["completed", "decoding"]).unwrap().add(41);
    finished.with(&["timed_out", "prefill_queued"]).unwrap().inc();
    reg.gauge("requests_waiting", "Requests in the admission queue.").unwrap().set(3.0);
    reg.gauge("requests_running", "Requests in the running batch.").unwrap().set(8.0);
    let kv = reg.gauge_vec("kv_blocks", "KV blocks by owner.", &["owner"]).unwrap();
    kv.with(&["free"]).unwrap().set(900.0);
    kv.with(&["sequence"]).unwrap().set(100.0);
    kv.with(&["weird \"owner\"\\\n"]).unwrap().set(1.0);
    let ttft = reg
        .histogram(
            "time_to_first_token_seconds",
            "Time to first token.\nSecond line.",
            Buckets::latency_seconds(),
        )
        .unwrap();
    for ms in [3u64, 12, 40, 250, 9000] {
        ttft.record(std::time::Duration::from_millis(ms));
    }
    let prefill = reg
        .histogram_vec("prefill_seconds", "Prefill time.", &["route"], Buckets::exponential(0.001, 2.0, 10))
        .unwrap();
    prefill.with(&["chat"]).unwrap().record(std::time::Duration::from_millis(412));
    reg.counter("tokens_generated_total", "Tokens sampled.").unwrap().add(12345);
    reg
}

fn promtool(text: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed for this test: apt-get install prometheus (.ci/run installs it)");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let msg = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), msg)
}

#[test]
fn promtool_accepts_the_exposition() {
    let text = worker_registry().render();
    let (ok, msg) = promtool(&text);
    assert!(ok, "promtool refused:\n{msg}\n---\n{text}");
}

/// The check above can fail: promtool does flag a badly named counter.
#[test]
fn promtool_rejects_what_the_registry_refuses() {
    let (ok, _) = promtool("# HELP requests Requests.\n# TYPE requests counter\nrequests 1\n");
    assert!(!ok);
    assert!(matches!(
        Registry::new().counter("requests", "Requests."),
        Err(TelemetryError::CounterWithoutTotal { .. })
    ));
}

#[test]
fn histogram_lines_are_cumulative_and_consistent() {
    let reg = Registry::new();
    let h = reg.histogram("queue_wait_seconds", "Queue wait.", vec![0.1, 1.0]).unwrap();
    for ms in [50, 100, 500, 2000] {
        h.record(std::time::Duration::from_millis(ms));
    }
    let text = reg.render();
    for want in [
        "queue_wait_seconds_bucket{le=\"0.1\"} 2\n",
        "queue_wait_seconds_bucket{le=\"1\"} 3\n",
        "queue_wait_seconds_bucket{le=\"+Inf\"} 4\n",
        "queue_wait_seconds_sum 2.65\n",
        "queue_wait_seconds_count 4\n",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn registration_errors() {
    let reg = Registry::new();
    reg.counter("tokens_prompt_total", "x").unwrap();
    assert!(matches!(reg.counter("tokens_prompt_total", "x"), Err(TelemetryError::DuplicateMetric { .. })));
    assert!(matches!(reg.gauge_vec("kv_blocks", "x", &["le"]), Err(TelemetryError::InvalidLabel { .. })));
    assert!(matches!(
        reg.histogram("request_latency_seconds", "x", vec![]),
        Err(TelemetryError::InvalidBuckets { .. })
    ));
    assert!(matches!(
        reg.histogram("request_latency_seconds", "x", vec![1.0, 0.5]),
        Err(TelemetryError::InvalidBuckets { .. })
    ));
    let v = reg.counter_vec("requests_finished_total", "x", &["outcome", "stage"]).unwrap();
    assert!(matches!(v.with(&["completed"]), Err(TelemetryError::LabelCount { expected: 2, got: 1, .. })));
    assert!(matches!(reg.gauge("request_age_ms", "x"), Err(TelemetryError::NonBaseUnit { .. })));
}

#[test]
fn concurrent_updates_are_not_lost() {
    let reg = Registry::new();
    let c = reg.counter("events_total", "x").unwrap();
    let h = Arc::new(reg.histogram("step_seconds", "x", Buckets::latency_seconds()).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (c, h) = (c.clone(), Arc::clone(&h));
            thread::spawn(move || {
                for _ in 0..10_000 {
                    c.inc();
                    h.record(std::time::Duration::from_millis(500));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(c.get(), 40_000);
    assert_eq!(h.len(), 40_000);
    assert!((h.sum_seconds() - 20_000.0).abs() < 1e-6);
}
