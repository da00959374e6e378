//! Prefill / decode disaggregation end to end: a prefill worker and a decode worker (the test plays the
//! router) give the same greedy text as a unified worker, streamed or not; a broken handle fails the
//! request with a reason instead of hanging.

mod common;

use std::time::{Duration, Instant};

use common::{chat, Worker};

/// The prefill leg, then the decode leg with the prefill worker's handle.
fn disaggregated(prefill: &Worker, decode: &Worker, body: &str, stream: bool) -> (u16, String) {
    let (s, handle) = prefill.json("POST", "/v1/chat/completions", body);
    assert_eq!(s, 200, "prefill leg: {handle}");
    let mut b: serde_json::Value = serde_json::from_str(body).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    b["stream"] = serde_json::Value::Bool(stream);
    if stream {
        let (s, events) = decode.stream("/v1/chat/completions", &b.to_string());
        let text = events
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
            .collect();
        (s, text)
    } else {
        let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
        (s, v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned())
    }
}

#[test]
fn prefill_plus_decode_equals_unified() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let prompts = [
        "What is the capital of France?",
        "Write one sentence about the sea.",
        "List three colours of the rainbow, separated by commas, and then explain in detail why the sky is blue during the day.",
    ];
    for (i, p) in prompts.iter().enumerate() {
        let body = chat(p, r#","temperature":0,"max_tokens":24"#);
        let (s, v) = unified.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200);
        let want = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        let (s, got) = disaggregated(&prefill, &decode, &body, i % 2 == 1);
        assert_eq!(s, 200);
        assert_eq!(got, want, "prompt {p:?}");
    }
    // Nothing stays behind on either side.
    let start = Instant::now();
    for w in [&prefill, &decode] {
        loop {
            let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
            let held: f64 = ["sequence", "transfer"]
                .iter()
                .filter_map(|o| {
                    m.lines().find_map(|l| l.strip_prefix(&format!("kv_blocks{{owner=\"{o}\"}} ")))
                })
                .filter_map(|v| v.parse::<f64>().ok())
                .sum();
            if held == 0.0 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "KV still held after the transfers: {held}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn the_first_tokens_logprobs_come_from_the_prefill_worker() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let body = chat(
        "What is the capital of France?",
        r#","temperature":0,"max_tokens":4,"logprobs":true,"top_logprobs":2"#,
    );
    let (s, want) = unified.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{want}");
    let (s, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{handle}");
    let mut keys: Vec<&String> = handle["pd_transfer"].as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["addr", "epoch", "shm", "transfer"], "the handle names where the KV is, nothing more");
    let mut b: serde_json::Value = serde_json::from_str(&body).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    let (s, got) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!(s, 200, "{got}");
    let (want, got) = (&want["choices"][0]["logprobs"]["content"], &got["choices"][0]["logprobs"]["content"]);
    assert_eq!(want.as_array().unwrap().len(), got.as_array().unwrap().len());
    for (w, g) in want.as_array().unwrap().iter().zip(got.as_array().unwrap()) {
        assert_eq!(w["token"], g["token"]);
        let (w, g) = (w["logprob"].as_f64().unwrap(), g["logprob"].as_f64().unwrap());
        assert!((w - g).abs() < 1e-3, "logprob {g} on the PD path, {w} unified");
    }
    let first = &got[0];
    assert!(first["logprob"].as_f64().unwrap() < 0.0, "the first token's real logprob, not 0: {first}");
    assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2, "{first}");
}

#[test]
fn a_bad_handle_fails_the_request_with_a_reason() {
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":8"#);
    let (_, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    let mut h = handle["pd_transfer"].clone();
    // Another epoch: the prefill side refuses, the decode side ends the request at once.
    h["epoch"] = serde_json::json!(h["epoch"].as_u64().unwrap() ^ 1);
    let mut b: serde_json::Value = serde_json::from_str(&body).unwrap();
    b["pd_transfer"] = h.clone();
    let start = Instant::now();
    let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!((s, v["error"]["type"].as_str()), (502, Some("kv_transfer_failed")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("stale_epoch"), "{v}");
    assert!(start.elapsed() < Duration::from_secs(10));
    // A prefill worker nobody listens on: refused, ended, not hung.
    h["addr"] = serde_json::json!("127.0.0.1:1");
    b["pd_transfer"] = h;
    let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!((s, v["error"]["type"].as_str()), (502, Some("kv_transfer_failed")), "{v}");
    // The prefill worker refuses a body with a handle.
    let mut with = serde_json::from_str::<serde_json::Value>(&body).unwrap();
    with["pd_transfer"] = handle["pd_transfer"].clone();
    assert_eq!(prefill.json("POST", "/v1/chat/completions", &with.to_string()).0, 400);
}

/// The pull waits until the request's deadline; running out is the request timing out (504), not a
/// broken transfer (502), so a router does not hold it against the pair.
#[test]
fn a_pull_that_runs_out_of_time_is_a_timeout_not_a_failed_transfer() {
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":8,"timeout":1"#);
    let (_, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    // A prefill worker that takes the connection and never says a word.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut b: serde_json::Value = serde_json::from_str(&body).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    b["pd_transfer"]["addr"] = serde_json::json!(silent.local_addr().unwrap().to_string());
    let start = Instant::now();
    let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!((s, v["error"]["type"].as_str()), (504, Some("deadline_exceeded")), "{v}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(decode.json("GET", "/debug/requests", "").1["requests"].as_array().unwrap().is_empty());
}

/// The transfer handshake states the KV dtype: an f32 prefill worker and an f16 decode worker (the
/// default) refuse each other's blocks with an explicit error instead of reading them as the wrong type;
/// both sides' transfer bookkeeping ends.
#[test]
fn a_kv_dtype_mismatch_is_an_explicit_error() {
    let prefill = Worker::start(&["--role", "prefill", "--kv-dtype", "f32"]);
    let decode = Worker::start(&["--role", "decode"]);
    let (_, models) = decode.json("GET", "/v1/models", "");
    assert_eq!(models["data"][0]["kv_dtype"], "f16", "{models}");
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":8"#);
    let start = Instant::now();
    let (s, got) = disaggregated(&prefill, &decode, &body, false);
    assert_eq!((s, got.as_str()), (502, ""));
    let (_, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    let mut b: serde_json::Value = serde_json::from_str(&body).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!((s, v["error"]["type"].as_str()), (502, Some("kv_transfer_failed")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("F32, decode has"), "{v}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn same_host_transfers_copy_from_the_shared_kv_memory() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill", "--kv-shm"]);
    let decode = Worker::start(&["--role", "decode"]);
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":16"#);
    let (_, v) = unified.json("POST", "/v1/chat/completions", &body);
    let want = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let (_, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    assert!(handle["pd_transfer"]["shm"].as_str().unwrap().starts_with("/dev/shm/pdserve-kv-"), "{handle}");
    for stream in [false, true] {
        let (s, got) = disaggregated(&prefill, &decode, &body, stream);
        assert_eq!((s, got.as_str()), (200, want.as_str()));
    }
    let m = String::from_utf8(decode.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    let shared: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("kv_transfer_bytes_total{direction=\"shared\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(shared > 0.0, "blocks were copied from shared memory:\n{m}");
    assert!(!m.contains("kv_transfer_bytes_total{direction=\"received\"}"), "no block came over TCP");
}

#[test]
fn aborting_a_prefilled_request_releases_its_offered_kv() {
    let prefill = Worker::start(&["--role", "prefill"]);
    let body = chat("What is the capital of France?", r#","max_tokens":8"#);
    let r = prefill.request("POST", "/v1/chat/completions", &body, &[("x-request-id", "pf-1")]);
    assert_eq!(r.status(), 200);
    r.read_to_end().unwrap();
    let transfer_blocks = |w: &Worker| -> f64 {
        let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
        m.lines()
            .find_map(|l| l.strip_prefix("kv_blocks{owner=\"transfer\"} "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    // The gauges are published by the engine loop right after the step that answered: wait for it.
    let start = Instant::now();
    while transfer_blocks(&prefill) <= 0.0 {
        assert!(start.elapsed() < Duration::from_secs(2), "the KV waits under a lease");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (s, v) = prefill.json("POST", "/abort/pf-1", "");
    assert_eq!((s, v["stage"].as_str()), (200, Some("kv_held")), "{v}");
    let start = Instant::now();
    while transfer_blocks(&prefill) != 0.0 {
        assert!(start.elapsed() < Duration::from_secs(2), "the lease was not released");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Idempotent.
    assert_eq!(prefill.json("POST", "/abort/pf-1", "").0, 200);
}

const MISS: &str = "prefix_cache_tokens_total{result=\"miss\"}";

/// Two rounds of one conversation: the second resends the first with its answer and a new question.
/// On a unified worker and through prefill + decode, the second round computes only what is new (the
/// prefill worker kept the first prompt cached after its transfer), the decode worker pulls only the
/// blocks it lacks (it kept the first round's prompt and answer), `usage` says how much was cached, the
/// text is the same either way, and afterwards nothing is held but evictable cache.
#[test]
fn the_next_round_of_a_conversation_computes_and_transfers_only_what_is_new() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let system = "You are a careful assistant working in a repository. ".repeat(12);
    let first = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "Which file holds the build settings?"},
    ]);
    let body = |messages: &serde_json::Value| {
        serde_json::json!({"messages": messages, "temperature": 0, "max_tokens": 20}).to_string()
    };
    let (s, v1) = unified.json("POST", "/v1/chat/completions", &body(&first));
    assert_eq!(s, 200, "{v1}");
    let answer = v1["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let (s, pd1) = disaggregated(&prefill, &decode, &body(&first), false);
    assert_eq!((s, pd1.as_str()), (200, answer.as_str()));
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    assert_eq!(v1["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v1}");

    let mut second = first.clone();
    let second_list = second.as_array_mut().unwrap();
    second_list.push(serde_json::json!({"role": "assistant", "content": answer}));
    second_list.push(serde_json::json!({"role": "user", "content": "And where are the tests run from?"}));
    let (miss_u, miss_p) = (common::metric(&unified, MISS), common::metric(&prefill, MISS));
    let (skipped, pulled) = (
        common::metric(&decode, "kv_transfer_blocks_total{result=\"skipped\"}"),
        common::metric(&decode, "kv_transfer_blocks_total{result=\"transferred\"}"),
    );
    let (s, v2) = unified.json("POST", "/v1/chat/completions", &body(&second));
    assert_eq!(s, 200, "{v2}");
    let p2 = v2["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let new = p2 - p1;
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap();
    assert!(cached >= p1 - 16.0, "unified: {cached} of {p2} prompt tokens cached, round 1 had {p1}");
    assert!(common::metric(&unified, MISS) - miss_u <= p2 - cached, "unified computed more than it missed");

    // Through prefill + decode, the decode leg's answer carries the prefill worker's usage.
    let (s, handle) = prefill.json("POST", "/v1/chat/completions", &body(&second));
    assert_eq!(s, 200, "{handle}");
    let computed = common::metric(&prefill, MISS) - miss_p;
    assert!(computed <= new + 16.0, "prefill computed {computed} tokens for {new} new ones");
    let mut b: serde_json::Value = serde_json::from_str(&body(&second)).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    let (s, v) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], v2["choices"][0]["message"]["content"], "same text");
    let pd_cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap();
    assert_eq!(pd_cached, p2 - computed, "usage reports the prefill worker's cache hit");
    let skipped = common::metric(&decode, "kv_transfer_blocks_total{result=\"skipped\"}") - skipped;
    let pulled = common::metric(&decode, "kv_transfer_blocks_total{result=\"transferred\"}") - pulled;
    assert!(skipped >= (p1 / 16.0).floor(), "the decode worker skipped {skipped} blocks it held");
    assert!(pulled <= (new / 16.0).ceil() + 1.0, "pulled {pulled} blocks for {new} new tokens");
    // Sent without a handle (the router's choice for a short new tail), the decode worker computes the
    // round itself over what it holds: the same text, only the last partial block computed.
    let miss_d = common::metric(&decode, MISS);
    let (s, local) = decode.json("POST", "/v1/chat/completions", &body(&second));
    assert_eq!(s, 200, "{local}");
    assert_eq!(local["choices"][0]["message"]["content"], v2["choices"][0]["message"]["content"]);
    let local_cached = local["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap();
    assert!(local_cached >= p2 - 16.0, "decode computed round 2 with {local_cached} of {p2} cached");
    assert!(common::metric(&decode, MISS) - miss_d <= 16.0, "decode computed what it held");

    // Streamed, the usage chunk says the same (the whole conversation is cached by now).
    let streamed = serde_json::json!({
        "messages": second, "temperature": 0, "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (s, events) = unified.stream("/v1/chat/completions", &streamed.to_string());
    assert_eq!(s, 200);
    let usage = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("a usage chunk");
    assert!(usage["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap() >= p2 - 16.0, "{usage}");

    // Nothing held but cache, which stays (and is evictable).
    let until = Instant::now() + Duration::from_secs(10);
    for w in [&unified, &prefill, &decode] {
        while common::metric(w, "kv_blocks{owner=\"sequence\"}")
            + common::metric(w, "kv_blocks{owner=\"transfer\"}")
            > 0.0
        {
            assert!(Instant::now() < until, "KV still held after the requests");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(common::metric(w, "kv_blocks{owner=\"cache\"}") > 0.0);
        assert_eq!(
            common::metric(w, "kv_blocks{owner=\"cache\"}") + common::metric(w, "kv_blocks{owner=\"free\"}"),
            256.0
        );
    }
}

/// SIGTERM on a prefill worker whose answered request's KV is still waiting to be pulled: the worker
/// stays until the decode side has pulled it (the request completes), then exits by itself.
#[test]
fn a_draining_prefill_worker_waits_for_its_offered_kv_to_be_pulled() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":12"#);
    let (s, want) = unified.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200);
    let (s, handle) = prefill.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{handle}");
    prefill.signal("-TERM");
    // Well past the moment its last live request left: it is still there for the pull.
    std::thread::sleep(Duration::from_millis(700));
    let mut b: serde_json::Value = serde_json::from_str(&body).unwrap();
    b["pd_transfer"] = handle["pd_transfer"].clone();
    let (s, got) = decode.json("POST", "/v1/chat/completions", &b.to_string());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
    // Pulled: now it leaves.
    let mut prefill = prefill;
    let start = Instant::now();
    loop {
        if let Some(status) = prefill.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "the prefill worker did not exit once drained");
        std::thread::sleep(Duration::from_millis(20));
    }
}
