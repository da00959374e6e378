//! One trace per request across the router, the prefill worker and the decode worker
//! (`--otlp-traces-endpoint`), read by an OTLP collector built on the official `opentelemetry-proto`
//! definitions: parented on the client's span, each leg's worker spans under that leg's span, the
//! stages below them, a migration's second decode leg in the same trace; the router's and the
//! decode worker's `/debug/requests` name the trace; without a router, the KV handle carries the trace
//! from the prefill worker to the decode worker. The collector stopped mid-run costs the
//! requests nothing: only spans are lost, and every process counts them.

#[path = "../../trace/tests/collector/mod.rs"]
mod collector;
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use collector::Collector;

use common::router::RouterThread;
use common::{chat, metric, Worker};
use pdserve_http::{Header, Request, SseDecoder};
use pdserve_router::Role;
use serde_json::Value;

/// Every span of `trace_id` that arrives until `done` holds of them (60 s at most).
fn spans_of(c: &Collector, trace_id: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(60);
    while !done(&got) {
        let left = until.saturating_duration_since(Instant::now());
        let Ok(v) = c.spans.recv_timeout(left) else { panic!("trace {trace_id} incomplete: {got:#?}") };
        assert!(v.is_object() && v["decode_error"].is_null(), "{v}");
        if v["trace_id"] == trace_id {
            got.push(v);
        }
    }
    got
}

fn find<'a>(spans: &'a [Value], service: &str, name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["service"] == service && s["name"] == name).collect()
}

fn one<'a>(spans: &'a [Value], service: &str, name: &str) -> &'a Value {
    let f = find(spans, service, name);
    assert_eq!(f.len(), 1, "{service} {name}: {spans:#?}");
    f[0]
}

/// `child` is `parent`'s child, and within it in time.
fn under(child: &Value, parent: &Value) {
    assert_eq!(child["parent_span_id"], parent["span_id"], "{} under {}", child["name"], parent["name"]);
    let t = |v: &Value, k: &str| v[k].as_u64().unwrap();
    assert!(t(child, "start") + 1_000_000 >= t(parent, "start"), "{child} starts before {parent}");
    assert!(t(child, "end") <= t(parent, "end") + 50_000_000, "{child} ends after {parent}");
}

fn send(router: &RouterThread, body: &str, rid: &str, traceparent: &str) -> pdserve_http::ClientResponse {
    let mut req = Request::new("POST", "/v1/chat/completions");
    req.body = body.as_bytes().to_vec();
    for (k, v) in [("content-type", "application/json"), ("x-request-id", rid), ("traceparent", traceparent)]
    {
        req.headers.push(Header { name: k.into(), value: v.as_bytes().to_vec() });
    }
    router.client.send(router.addr, &req, Instant::now() + Duration::from_secs(120)).unwrap()
}

#[test]
fn one_trace_across_router_prefill_and_decode_through_a_migration() {
    let mut c = Collector::start();
    let url = format!("http://127.0.0.1:{}", c.port);
    let args = |role: &'static str| vec!["--role", role, "--otlp-traces-endpoint", url.as_str()];
    let prefill = Worker::start(&args("prefill"));
    let decode_a = Worker::start(&args("decode"));
    let decode_b = Worker::start(&args("decode"));
    let router = RouterThread::start_with(
        &[(&prefill, Role::Prefill), (&decode_a, Role::Decode), (&decode_b, Role::Decode)],
        |cfg| cfg.otlp_traces_endpoint = Some(pdserve_trace::Endpoint::parse(&url).unwrap()),
    );

    // A request through PD, under the client's span.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let body = chat("Name three rivers.", r#","temperature":0,"max_tokens":8"#);
    let r = send(&router, &body, "traced-1", &format!("00-{trace}-{client_span}-01"));
    assert_eq!(r.status(), 200);
    let _ = r.read_to_end();
    let expected = [
        ("pdserve-router", "POST /v1/chat/completions"),
        ("pdserve-router", "router queue"),
        ("pdserve-router", "prefill leg"),
        ("pdserve-router", "decode leg"),
        ("pdserve-prefill", "POST /v1/chat/completions"),
        ("pdserve-prefill", "queue"),
        ("pdserve-prefill", "prefill"),
        ("pdserve-prefill", "kv transfer (served)"),
        ("pdserve-decode", "POST /v1/chat/completions"),
        ("pdserve-decode", "kv transfer"),
        ("pdserve-decode", "kv pull"),
        ("pdserve-decode", "queue"),
        ("pdserve-decode", "decode"),
    ];
    let spans = spans_of(&c, trace, |s| expected.iter().all(|(svc, name)| !find(s, svc, name).is_empty()));
    let root = one(&spans, "pdserve-router", "POST /v1/chat/completions");
    assert_eq!((root["parent_span_id"].as_str(), root["kind"].as_u64()), (Some(client_span), Some(2)));
    assert_eq!(
        (root["attributes"]["gen_ai.request.id"].as_str(), root["status_code"].as_u64()),
        (Some("traced-1"), Some(1))
    );
    under(one(&spans, "pdserve-router", "router queue"), root);
    let p_leg = one(&spans, "pdserve-router", "prefill leg");
    let d_leg = one(&spans, "pdserve-router", "decode leg");
    for leg in [p_leg, d_leg] {
        under(leg, root);
        assert_eq!(leg["kind"], 3);
    }
    let p = one(&spans, "pdserve-prefill", "POST /v1/chat/completions");
    let d = one(&spans, "pdserve-decode", "POST /v1/chat/completions");
    under(p, p_leg);
    under(d, d_leg);
    assert_eq!(p["attributes"]["pdserve.role"], "prefill");
    assert_eq!(d["attributes"]["gen_ai.usage.completion_tokens"], 8);
    for (svc, parent, stages) in [
        ("pdserve-prefill", p, &["queue", "prefill", "kv transfer (served)"][..]),
        ("pdserve-decode", d, &["kv transfer", "kv pull", "queue", "decode"][..]),
    ] {
        for s in stages {
            under(one(&spans, svc, s), parent);
        }
    }
    // The prefill side of the transfer: its offer served to the decode worker's pull.
    let served = one(&spans, "pdserve-prefill", "kv transfer (served)");
    assert_eq!(served["attributes"]["pdserve.transfer.outcome"], "completed", "{served}");

    // A decode worker killed mid-stream: the request moves; the second decode leg, its worker's
    // spans and the migration are in the same trace.
    let trace2 = "0af7651916cd43dd8448eb211c80319c";
    let body = chat(
        "Tell me a long story about a lighthouse keeper and a storm.",
        r#","temperature":0,"max_tokens":120,"ignore_eos":true,"stream":true"#,
    );
    let mut r = send(&router, &body, "traced-2", &format!("00-{trace2}-b7ad6b7169203331-01"));
    assert_eq!(r.status(), 200);
    let mut sse = SseDecoder::new(1 << 20);
    let (mut deltas, mut killed) = (0, None);
    while let Ok(Some(chunk)) = r.next_chunk() {
        sse.push(&chunk);
        while let Ok(Some(e)) = sse.next_event() {
            if e.data.contains("\"content\":\"") {
                deltas += 1;
            }
            if deltas == 10 && killed.is_none() {
                let holder = [&decode_a, &decode_b].into_iter().find(|w| {
                    let (_, v) = w.json("GET", "/debug/requests", "");
                    v["requests"].as_array().is_some_and(|r| {
                        r.iter().any(|r| r["id"].as_str().is_some_and(|i| i.starts_with("traced-2")))
                    })
                });
                let w = holder.expect("a decode worker holds the stream");
                w.signal("-KILL");
                killed = Some(w.addr);
            }
        }
    }
    assert!(killed.is_some(), "the stream ended before its 10th token");
    let spans = spans_of(&c, trace2, |s| {
        find(s, "pdserve-router", "decode leg").len() == 2
            && find(s, "pdserve-decode", "POST /v1/chat/completions").len() == 1
            && find(s, "pdserve-decode", "decode").len() == 1
            && !find(s, "pdserve-router", "POST /v1/chat/completions").is_empty()
    });
    let root = one(&spans, "pdserve-router", "POST /v1/chat/completions");
    assert!(root["events"].as_array().unwrap().iter().any(|e| e == "migration: decode_lost"), "{root}");
    assert_eq!(root["attributes"]["pdserve.migrations"], 1);
    let legs = find(&spans, "pdserve-router", "decode leg");
    let by_status: HashMap<u64, &Value> =
        legs.iter().map(|l| (l["status_code"].as_u64().unwrap(), *l)).collect();
    assert!(
        by_status.contains_key(&2) && by_status.contains_key(&1),
        "one leg failed, one completed: {legs:#?}"
    );
    // The first leg the migration opened says why (a prefill leg, where the move computes the
    // prompt again; else the decode leg); every leg names the request.
    let all_legs: Vec<&Value> = spans
        .iter()
        .filter(|s| {
            s["service"] == "pdserve-router" && s["name"].as_str().is_some_and(|n| n.ends_with(" leg"))
        })
        .collect();
    let moved: Vec<_> =
        all_legs.iter().filter(|l| l["attributes"]["pdserve.migration"] == "decode_lost").collect();
    assert_eq!(moved.len(), 1, "{all_legs:#?}");
    assert!(all_legs.iter().all(|l| l["attributes"]["gen_ai.request.id"] == "traced-2"), "{all_legs:#?}");
    let survivor = one(&spans, "pdserve-decode", "POST /v1/chat/completions");
    under(survivor, by_status[&1]);
    let stage = one(&spans, "pdserve-decode", "decode");
    assert!(
        stage["attributes"]["gen_ai.request.id"].as_str().is_some_and(|i| i.starts_with("traced-2")),
        "{stage}"
    );

    // The router's /debug/requests names a live request's trace.
    let body = chat("Count to fifty.", r#","max_tokens":200,"ignore_eos":true,"stream":true"#);
    let r = send(&router, &body, "traced-3", "00-11111111111111111111111111111111-2222222222222222-01");
    assert_eq!(r.status(), 200);
    let (_, v) = router.json("GET", "/debug/requests", "");
    let entry = v["requests"].as_array().unwrap().iter().find(|e| e["id"] == "traced-3").cloned();
    assert_eq!(
        entry.map(|e| e["trace_id"].clone()),
        Some(Value::String("11111111111111111111111111111111".into())),
        "{v}"
    );
    // So does the decode worker's, which holds it now.
    let survivor = [&decode_a, &decode_b].into_iter().find(|w| Some(w.addr) != killed).unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    let held = loop {
        let (_, v) = survivor.json("GET", "/debug/requests", "");
        let e = v["requests"].as_array().and_then(|r| {
            r.iter().find(|e| e["id"].as_str().is_some_and(|i| i.starts_with("traced-3"))).cloned()
        });
        match e {
            Some(e) => break e,
            None if Instant::now() < until => std::thread::sleep(Duration::from_millis(50)),
            None => panic!("the decode worker never listed traced-3: {v}"),
        }
    };
    assert_eq!(held["trace_id"], "11111111111111111111111111111111", "{held}");
    drop(r);

    // No router: a client sends the prompt to the prefill worker under its span, then the KV handle
    // to the decode worker without a `traceparent`: the handle carries the trace across.
    let trace4 = "5eed0000000000000000000000000004";
    let body = chat("Name a color.", r#","temperature":0,"max_tokens":4"#);
    let tp = format!("00-{trace4}-4444444444444444-01");
    let r = prefill.request("POST", "/v1/chat/completions", &body, &[("traceparent", tp.as_str())]);
    assert_eq!(r.status(), 200);
    let answer: Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
    let handle = &answer["pd_transfer"];
    assert_eq!(handle["traceparent"].as_str().map(|t| &t[3..35]), Some(trace4), "{answer}");
    let mut body: Value = serde_json::from_str(&body).unwrap();
    body["pd_transfer"] = handle.clone();
    let r = survivor.request("POST", "/v1/chat/completions", &body.to_string(), &[]);
    assert_eq!(r.status(), 200);
    let _ = r.read_to_end();
    let spans = spans_of(&c, trace4, |s| {
        !find(s, "pdserve-prefill", "POST /v1/chat/completions").is_empty()
            && !find(s, "pdserve-decode", "POST /v1/chat/completions").is_empty()
    });
    let p = one(&spans, "pdserve-prefill", "POST /v1/chat/completions");
    assert_eq!(p["parent_span_id"], "4444444444444444");
    let d = one(&spans, "pdserve-decode", "POST /v1/chat/completions");
    assert_eq!(d["parent_span_id"], p["span_id"], "the decode worker's span under the prefill worker's");

    // A router that exports nothing passes the client's `traceparent` on unchanged: the workers'
    // spans still join the client's trace, under the client's span.
    let plain = RouterThread::start(&[(&prefill, Role::Prefill), (survivor, Role::Decode)]);
    let trace5 = "5eed0000000000000000000000000005";
    let body = chat("Name a fruit.", r#","temperature":0,"max_tokens":4"#);
    let r = send(&plain, &body, "passed-on", &format!("00-{trace5}-5555555555555555-01"));
    assert_eq!(r.status(), 200);
    let _ = r.read_to_end();
    let spans = spans_of(&c, trace5, |s| {
        !find(s, "pdserve-prefill", "POST /v1/chat/completions").is_empty()
            && !find(s, "pdserve-decode", "POST /v1/chat/completions").is_empty()
    });
    for svc in ["pdserve-prefill", "pdserve-decode"] {
        assert_eq!(one(&spans, svc, "POST /v1/chat/completions")["parent_span_id"], "5555555555555555");
    }
    assert!(find(&spans, "pdserve-router", "POST /v1/chat/completions").is_empty());

    // The collector stopped mid-run: requests are served as before; their spans are dropped, and
    // the router and both workers count them.
    c.stop();
    let router_dropped = || {
        let text = String::from_utf8(router.send("GET", "/metrics", "").read_to_end().unwrap()).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("router_otlp_spans_total{result=\"dropped\"} "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let dropped = |w: &Worker| metric(w, "otlp_spans_total{result=\"dropped\"}");
    let before = (router_dropped(), dropped(&prefill), dropped(survivor));
    for i in 0..4 {
        let body = chat(&format!("Say hello to friend number {i}."), r#","temperature":0,"max_tokens":6"#);
        let trace = format!("{:032x}", 0x5eed_0000 + i);
        let r = send(&router, &body, &format!("uncollected-{i}"), &format!("00-{trace}-3333333333333333-01"));
        assert_eq!(r.status(), 200, "request {i} with the collector gone");
        let v: Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    }
    let until = Instant::now() + Duration::from_secs(60);
    let mut now = before;
    while Instant::now() < until {
        now = (router_dropped(), dropped(&prefill), dropped(survivor));
        if now.0 > before.0 && now.1 > before.1 && now.2 > before.2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        now.0 > before.0 && now.1 > before.1 && now.2 > before.2,
        "spans dropped (router, prefill, decode) before the requests {before:?}, after {now:?}"
    );
}
