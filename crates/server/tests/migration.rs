//! Mid-request migration through the real router and real worker processes: a prefill worker killed
//! before its answer and a decode worker killed mid-stream each cost the client nothing (the answer
//! completes, the stream goes on with every token once and the same text as an unbroken run), and
//! with no worker left to move to the stream ends with an explicit error instead of hanging.

mod common;

use std::time::{Duration, Instant};

use common::migrate::{
    add_worker, completed_text, long_stream_body, router_metric, stream, stream_killing_holder,
};
use common::router::RouterThread;
use common::{chat, Worker};
use pdserve_http::{Header, Request};
use pdserve_router::Role;
use serde_json::Value;

#[test]
fn killed_workers_cost_the_client_nothing_and_none_left_is_an_explicit_error() {
    let prefill_a = Worker::start(&["--role", "prefill"]);
    let decode_a = Worker::start(&["--role", "decode"]);
    let router = RouterThread::start(&[(&prefill_a, Role::Prefill), (&decode_a, Role::Decode)]);
    let max_tokens = 160;
    let body = long_stream_body("Tell me a long story about a lighthouse keeper and a storm.", max_tokens);
    // What the request gives without any failure. (Greedy: a moved request's next tokens come from
    // logits the new worker computes by prefill, whose batched arithmetic differs from decode's in the
    // last bits; a seeded sampler goes on with the same random stream, but a near-tie may then fall
    // the other way.)
    let reference = completed_text(&stream(&router, &body, "reference", |_| {}), max_tokens);

    // A prefill worker that dies before answering: the request is prefilled again elsewhere.
    prefill_a.signal("-STOP");
    let pending = {
        let (addr, body) = (router.addr, chat("Name three birds.", r#","temperature":0,"max_tokens":8"#));
        std::thread::spawn(move || {
            let client = pdserve_http::HttpClient::new(Default::default());
            let mut req = Request::new("POST", "/v1/chat/completions");
            req.body = body.into_bytes();
            req.headers.push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
            let r = client.send(addr, &req, Instant::now() + Duration::from_secs(60)).unwrap();
            (r.status(), String::from_utf8(r.read_to_end().unwrap()).unwrap())
        })
    };
    let prefill_b = Worker::start(&["--role", "prefill"]);
    std::thread::sleep(Duration::from_millis(300)); // the request is at the stopped worker
    add_worker(&router, &prefill_b, "prefill");
    let mut prefill_a = prefill_a;
    prefill_a.child.kill().unwrap();
    let (status, answer) = pending.join().unwrap();
    assert_eq!(status, 200, "{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
    // Moved (a fresh connection broke) or re-sent (a pooled one broke before any answer byte: the
    // router cannot tell it from one the worker had closed while idle).
    let moved =
        router_metric(&router, r#"router_migrations_total{cause="prefill_lost",outcome="completed"}"#);
    let resent = router_metric(&router, "router_stale_connection_retries_total");
    assert!(moved + resent >= 1.0, "moved {moved}, re-sent {resent}");

    // A decode worker killed mid-stream: the stream goes on from another, the same text.
    let decode_b = Worker::start(&["--role", "decode"]);
    add_worker(&router, &decode_b, "decode");
    let (events, killed) = stream_killing_holder(&router, &body, "moved", &[&decode_a, &decode_b]);
    assert_eq!(
        completed_text(&events, max_tokens),
        reference,
        "the moved stream differs from the unbroken one"
    );
    assert_eq!(
        router_metric(&router, r#"router_migrations_total{cause="decode_lost",outcome="completed"}"#),
        1.0
    );

    // The other decode worker killed too: no worker is left to move to, and the stream says so.
    let survivor = if killed == decode_a.addr { &decode_b } else { &decode_a };
    let start = Instant::now();
    let (events, _) = stream_killing_holder(&router, &body, "stranded", &[survivor]);
    let error = events.iter().find_map(|e| e.get("error")).expect("an error event ends the stream");
    assert_eq!(error["type"], "no_capacity", "{error}");
    assert!(start.elapsed() < Duration::from_secs(30), "the stranded stream took {:?}", start.elapsed());
}

#[test]
fn a_unified_worker_killed_mid_stream_hands_over_and_migration_can_be_turned_off() {
    let a = Worker::start(&[]);
    let b = Worker::start(&[]);
    let router = RouterThread::start(&[(&a, Role::Unified), (&b, Role::Unified)]);
    let max_tokens = 120;
    let body = long_stream_body("Explain how a bicycle works, part by part.", max_tokens);
    let reference = completed_text(&stream(&router, &body, "u-reference", |_| {}), max_tokens);
    let (events, killed) = stream_killing_holder(&router, &body, "u-moved", &[&a, &b]);
    assert_eq!(
        completed_text(&events, max_tokens),
        reference,
        "the moved stream differs from the unbroken one"
    );
    assert_eq!(
        router_metric(&router, r#"router_migrations_total{cause="decode_lost",outcome="completed"}"#),
        1.0
    );

    // `--migrations 0`: the same fault ends the stream with an explicit error, as before migration.
    let survivor = if killed == a.addr { &b } else { &a };
    let off = RouterThread::start_with(&[(survivor, Role::Unified)], |c| c.migrations_max = 0);
    let (events, _) = stream_killing_holder(&off, &body, "u-off", &[survivor]);
    let error = events.iter().find_map(|e| e.get("error")).expect("an error event ends the stream");
    assert_eq!(error["type"], "upstream_failed", "{error}");
    let m = String::from_utf8(off.send("GET", "/metrics", "").read_to_end().unwrap()).unwrap();
    assert!(!m.lines().any(|l| l.starts_with("router_migrations_total{")), "a migration with --migrations 0");
}

/// The token ids a worker's resume marks name, in order, and the stream's text.
fn marked_stream(w: &Worker, body: &str) -> (Vec<u32>, String) {
    let mut r = w.request("POST", "/v1/chat/completions", body, &[("x-pdserve-resumable", "1")]);
    assert_eq!(r.status(), 200);
    let mut raw = Vec::new();
    while let Some(chunk) = r.next_chunk().unwrap() {
        raw.extend_from_slice(&chunk);
    }
    let raw = String::from_utf8(raw).unwrap();
    let (mut ids, mut text) = (Vec::new(), String::new());
    for event in raw.split("\n\n") {
        if let Some(rest) = event.strip_prefix(": pdserve-tokens ") {
            ids.extend(rest.split(' ').skip(1).map(|t| t.parse::<u32>().unwrap()));
        } else if let Some(data) = event.strip_prefix("data: ").filter(|d| *d != "[DONE]") {
            let v: Value = serde_json::from_str(data).unwrap();
            text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    (ids, text)
}

#[test]
fn a_worker_goes_on_from_resumed_tokens() {
    let w = Worker::start(&[]);
    let extra = r#","temperature":0,"max_tokens":24,"ignore_eos":true"#;
    let prompt = "Write a short poem about rain.";
    let (ids, text) = marked_stream(&w, &chat(prompt, &format!(r#"{extra},"stream":true"#)));
    assert_eq!(ids.len(), 24, "a mark names every token: {ids:?}");
    let resumed = |tokens: &[u32], more: &str| {
        let body = chat(
            prompt,
            &format!(r#"{extra}{more},"pd_resume":{{"request_id":"orig","created":7,"tokens":{tokens:?}}}"#),
        );
        let (s, v) = w.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{v}");
        v
    };
    // From the middle: the answer is the whole text (the replayed part included), usage counts 24.
    let v = resumed(&ids[..10], "");
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["id"], "chatcmpl-orig");
    assert_eq!(v["created"], 7);
    // Every token already there: it ends at once with `length`, nothing generated past max_tokens.
    let v = resumed(&ids, "");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
    // A stop string the resumed text already holds: it ends there, as it would have at the first worker.
    let words: Vec<&str> = text.split_whitespace().collect();
    let stop = words[words.len() / 2];
    let cut = text.find(stop).unwrap();
    let v = resumed(&ids, &format!(r#","stop":[{stop:?}]"#));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], &text[..cut]);
    // Only from inside the stack: with a cluster secret, a client's pd_resume is refused.
    let secret = std::env::temp_dir().join(format!("pdserve-resume-secret-{}", std::process::id()));
    std::fs::write(&secret, "s3cret").unwrap();
    let guarded = Worker::start(&["--cluster-secret-file", secret.to_str().unwrap(), "--api-key", "k"]);
    let body = chat(prompt, &format!(r#"{extra},"pd_resume":{{"request_id":"x","tokens":[1]}}"#));
    let r = guarded.request("POST", "/v1/chat/completions", &body, &[("authorization", "Bearer k")]);
    assert_eq!(r.status(), 401);
    let _ = std::fs::remove_file(&secret);
}
