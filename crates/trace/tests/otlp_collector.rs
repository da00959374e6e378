//! Spans posted to a collector built on the official `opentelemetry-proto` definitions, which
//! decodes every batch: ids, parents, names, kinds, times, attributes and status as sent; and a
//! collector that goes away mid-run costs dropped spans, never a wait.

mod collector;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use collector::Collector;
use pdserve_trace::{AttrValue, Endpoint, Exporter, Span, SpanKind, Status, TraceContext};

#[test]
fn the_official_protobuf_definitions_decode_what_the_exporter_posts() {
    let c = Collector::start();
    let e =
        Exporter::start(Endpoint::parse(&format!("http://127.0.0.1:{}", c.port)).unwrap(), "pdserve-decode")
            .unwrap();
    let client = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
    let t0 = Instant::now();
    let mut root =
        Span::between(&client, "chat request", SpanKind::Server, t0, t0 + Duration::from_millis(30));
    root.attr("gen_ai.request.id", AttrValue::Str("req-9".into()))
        .attr("gen_ai.usage.prompt_tokens", AttrValue::Int(-3))
        .attr("gen_ai.latency.e2e", AttrValue::Float(0.03))
        .attr("pdserve.migrated", AttrValue::Bool(true));
    root.events.push((root.start_unix_nanos + 1000, "first token".into()));
    root.status = Status::Error("timed out in decoding".into());
    let child =
        Span::between(&root.context, "decode", SpanKind::Internal, t0, t0 + Duration::from_millis(20));
    let (root_id, child_id) = (root.context.span_id, child.context.span_id);
    e.export(root.clone());
    e.export(child);
    let mut got = Vec::new();
    while got.len() < 2 {
        let v = c.spans.recv_timeout(Duration::from_secs(10)).expect("both spans arrive");
        assert!(v["decode_error"].is_null(), "{v}");
        got.push(v);
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let r = got.iter().find(|s| s["name"] == "chat request").unwrap();
    assert_eq!(r["service"], "pdserve-decode");
    assert_eq!(r["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(r["parent_span_id"], "00f067aa0ba902b7", "parented on the client's span");
    assert_eq!(r["span_id"], hex(&root_id));
    assert_eq!((r["kind"].as_u64(), r["flags"].as_u64()), (Some(2), Some(1)));
    assert_eq!(r["end"].as_u64().unwrap() - r["start"].as_u64().unwrap(), 30_000_000);
    assert_eq!(r["start"].as_u64(), Some(root.start_unix_nanos));
    assert_eq!(r["attributes"]["gen_ai.request.id"], "req-9");
    assert_eq!(r["attributes"]["gen_ai.usage.prompt_tokens"], -3);
    assert_eq!(r["attributes"]["gen_ai.latency.e2e"], 0.03);
    assert_eq!(r["attributes"]["pdserve.migrated"], true);
    assert_eq!(r["events"], serde_json::json!(["first token"]));
    assert_eq!(
        (r["status_code"].as_u64(), r["status_message"].as_str()),
        (Some(2), Some("timed out in decoding"))
    );
    let d = got.iter().find(|s| s["name"] == "decode").unwrap();
    assert_eq!(
        (d["parent_span_id"].as_str(), d["span_id"].as_str()),
        (Some(hex(&root_id).as_str()), Some(hex(&child_id).as_str()))
    );
    assert_eq!(d["trace_id"], r["trace_id"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while e.stats().spans_exported.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    // The collector goes away: spans are dropped and counted; export never waits.
    drop(c);
    let t = Instant::now();
    for _ in 0..20_000 {
        e.export(Span::start(&client, "late", SpanKind::Internal));
    }
    assert!(t.elapsed() < Duration::from_secs(2), "export waited: {:?}", t.elapsed());
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.stats().spans_dropped.load(Ordering::Relaxed) < 20_000 {
        assert!(Instant::now() < deadline, "dropped {}", e.stats().spans_dropped.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(e.stats().spans_exported.load(Ordering::Relaxed), 2);
}

#[test]
fn endpoints_are_otlp_http_urls() {
    let e = Endpoint::parse("http://otel:4318").unwrap();
    assert_eq!((e.host.as_str(), e.port, e.path.as_str()), ("otel", 4318, "/v1/traces"));
    assert_eq!(Endpoint::parse("http://c:9/custom/v1/traces").unwrap().path, "/custom/v1/traces");
    assert_eq!(Endpoint::parse("http://c").unwrap().port, 4318);
    assert!(Endpoint::parse("https://c:4318").unwrap_err().contains("http://"));
    assert!(Endpoint::parse("c:4317").is_err());
    let v6 = Endpoint::parse("http://[::1]:4319").unwrap();
    assert_eq!((v6.host.as_str(), v6.port), ("::1", 4319));
    assert_eq!(Endpoint::parse("http://[::1]").unwrap().port, 4318);
}
