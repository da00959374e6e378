//! Exposition tests, including `promtool check metrics` on real output.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;

use pdserve_telemetry::{AliasSource, Buckets, MetricKind, Registry, TelemetryError};

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

/// What promtool finds in `text` beyond the one lint a peer's alias always draws (vLLM's names hold a
/// colon, which Prometheus reserves for recording rules but scrapes and stores like any name).
fn promtool_beyond_peer_colons(text: &str) -> Vec<String> {
    let (_, msg) = promtool(text);
    msg.lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(l.starts_with("vllm:") && l.ends_with("metric names should not contain ':'")))
        .map(str::to_owned)
        .collect()
}

/// Another server's names, computed from this registry's series at each scrape: sums (all, or the
/// series with one label's value), fixed labels, vLLM's Unix-time info gauge; bad aliases refused.
#[test]
fn peer_aliases_follow_their_sources() {
    let reg = worker_registry();
    let tokens = reg.counter_vec("prefix_cache_tokens_total", "x", &["result"]).unwrap();
    let waiting = reg.gauge("requests_queued", "x").unwrap();
    let labels = [("model_name", "m"), ("engine", "0")];
    reg.peer_alias(
        "vllm:num_requests_waiting",
        "w",
        MetricKind::Gauge,
        &labels,
        AliasSource::all("requests_queued"),
    )
    .unwrap();
    let all = AliasSource::all("prefix_cache_tokens_total");
    reg.peer_alias("vllm:prefix_cache_queries_total", "q", MetricKind::Counter, &labels, all).unwrap();
    let hits = AliasSource::only("prefix_cache_tokens_total", "result", "hit");
    reg.peer_alias("vllm:prefix_cache_hits_total", "h", MetricKind::Counter, &labels, hits).unwrap();
    let lora = [("max_lora", "0"), ("running_lora_adapters", "")];
    reg.peer_alias("vllm:lora_requests_info", "l", MetricKind::Gauge, &lora, AliasSource::UnixTime).unwrap();
    let value = |text: &str, series: &str| -> f64 {
        let line =
            text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let text = reg.render();
    assert_eq!(value(&text, "vllm:prefix_cache_queries_total{model_name=\"m\",engine=\"0\"}"), 0.0);
    tokens.with(&["hit"]).unwrap().add(48);
    tokens.with(&["miss"]).unwrap().add(100);
    waiting.set(5.0);
    let text = reg.render();
    assert_eq!(value(&text, "vllm:prefix_cache_queries_total{"), 148.0);
    assert_eq!(value(&text, "vllm:prefix_cache_hits_total{"), 48.0);
    assert_eq!(value(&text, "vllm:num_requests_waiting{"), 5.0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let info = value(&text, "vllm:lora_requests_info{max_lora=\"0\",running_lora_adapters=\"\"}");
    assert!((info - now).abs() < 60.0, "{info} vs {now}");
    assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    assert_eq!(promtool_beyond_peer_colons(&text), Vec::<String>::new(), "\n{text}");
    // Refused: a name without a peer's prefix, a counter without _total, a histogram, a source not
    // registered or filtered on a label it lacks, a duplicate.
    for (name, kind, source) in [
        ("num_requests_waiting", MetricKind::Gauge, AliasSource::all("requests_waiting")),
        ("sglang:num_requests", MetricKind::Gauge, AliasSource::all("requests_waiting")),
        ("vllm:prefix_cache_hits", MetricKind::Counter, AliasSource::all("prefix_cache_tokens_total")),
        ("vllm:ttft", MetricKind::Histogram, AliasSource::UnixTime),
        ("vllm:x", MetricKind::Gauge, AliasSource::all("nope_total")),
        ("vllm:y", MetricKind::Gauge, AliasSource::only("requests_waiting", "result", "hit")),
        ("vllm:num_requests_waiting", MetricKind::Gauge, AliasSource::all("requests_waiting")),
    ] {
        assert!(reg.peer_alias(name, "x", kind, &[], source).is_err(), "{name} was taken");
    }
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
