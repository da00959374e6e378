//! The behaviour contracts: overload answered at once, disconnects abort and free KV, deadlines end
//! requests with an explicit error, bad input gets the right status, a panic fails one request only,
//! and SIGTERM drains.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use common::{chat, Worker};

fn long(extra: &str) -> String {
    chat(
        "Tell me a very long story about a dragon.",
        &format!(r#","max_tokens":400,"ignore_eos":true{extra}"#),
    )
}

/// The value of the series `key` (name and labels) in the worker's /metrics, or -1 if it is missing.
fn metric(w: &Worker, key: &str) -> f64 {
    let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

fn kv_sequence_blocks(w: &Worker) -> f64 {
    metric(w, "kv_blocks{owner=\"sequence\"}")
}

#[test]
fn overload_is_answered_at_once_with_429_even_for_streams() {
    let w = Worker::start(&["--max-queued", "1", "--max-running", "1"]);
    // One running and one queued request fill the worker; their clients stay connected until the end.
    // They are sent one after the other: two at once could race for the one queue slot.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut busy = Vec::new();
    for live in 1..=2 {
        let (addr, body, done) = (w.addr, long(""), std::sync::Arc::clone(&done));
        busy.push(thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).unwrap();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(20));
            }
        }));
        // Wait until the engine holds it (the first running, then the second queued behind it).
        let start = Instant::now();
        loop {
            let v = w.json("GET", "/debug/requests", "").1;
            let reqs = v["requests"].as_array().unwrap().clone();
            let running = reqs.iter().filter(|r| r["stage"] != "prefill_queued").count();
            if reqs.len() == live && running >= 1 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "request {live} was never admitted: {v}");
            thread::sleep(Duration::from_millis(20));
        }
    }
    // `/debug/requests` says what the queued one waits for, and per stage how long the oldest has.
    let start = Instant::now();
    loop {
        let v = w.json("GET", "/debug/requests", "").1;
        let queued =
            v["requests"].as_array().unwrap().iter().find(|r| r["stage"] == "prefill_queued").cloned();
        let stage = &v["stages"]["prefill_queued"];
        if queued.is_some_and(|q| q["waiting_for"] == "running_slot")
            && stage["waiting_for"] == "running_slot"
        {
            assert_eq!(stage["requests"], 1, "{v}");
            assert!(stage["oldest_ms"].as_u64().is_some(), "{v}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no reason given for the queued request: {v}");
        thread::sleep(Duration::from_millis(20));
    }
    for stream in [false, true] {
        let start = Instant::now();
        let r = w.request("POST", "/v1/chat/completions", &long(&format!(r#","stream":{stream}"#)), &[]);
        let took = start.elapsed();
        assert_eq!(r.status(), 429, "stream={stream}");
        assert!(r.head().header_str("retry-after").is_some_and(|v| v.parse::<u32>().unwrap() >= 1));
        let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
        assert_eq!(v["error"]["type"], "queue_full");
        // Generation would take tens of seconds; the refusal comes at once (bound generous for a loaded CI).
        assert!(took < Duration::from_secs(2), "429 took {took:?}");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
}

#[test]
fn a_client_that_disconnects_is_aborted_and_its_kv_freed() {
    let w = Worker::start(&[]);
    for read_first in [true, false] {
        let mut s = TcpStream::connect(w.addr).unwrap();
        let body = long(r#","stream":true"#);
        let req = format!("POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
        s.write_all(req.as_bytes()).unwrap();
        if read_first {
            // Read until a few content chunks have arrived: tokens flow and the request holds KV.
            let mut got = String::new();
            let mut buf = [0u8; 4096];
            while got.matches("\"content\"").count() < 3 {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "stream ended early: {got}");
                got.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            assert!(got.starts_with("HTTP/1.1 200"));
            assert!(kv_sequence_blocks(&w) > 0.0);
            // What fleet routers (the Gateway API Inference Extension's endpoint picker) read.
            assert_eq!(metric(&w, "requests_running"), 1.0);
            assert_eq!(metric(&w, "requests_waiting"), 0.0);
            let usage = metric(&w, "kv_cache_usage_ratio");
            assert!(usage > 0.0 && usage < 0.2, "{usage}");
            let config = "kv_cache_block_size_tokens{block_size=\"16\",num_gpu_blocks=\"256\"}";
            assert_eq!(metric(&w, config), 16.0);
        }
        drop(s);
        let start = Instant::now();
        loop {
            let (_, v) = w.json("GET", "/debug/requests", "");
            let idle = kv_sequence_blocks(&w) == 0.0 && metric(&w, "kv_cache_usage_ratio") == 0.0;
            if v["requests"].as_array().unwrap().is_empty() && idle {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(2), "still live after {:?}: {v}", start.elapsed());
            thread::sleep(Duration::from_millis(5));
        }
        eprintln!("disconnect (read first: {read_first}) freed in {:?}", start.elapsed());
    }
}

#[test]
fn deadlines_end_requests_with_an_explicit_error() {
    let w = Worker::start(&[]);
    let start = Instant::now();
    let (s, v) = w.json("POST", "/v1/chat/completions", &long(r#","timeout":0.4"#));
    assert_eq!((s, v["error"]["type"].as_str()), (504, Some("deadline_exceeded")), "{v}");
    assert!(start.elapsed() < Duration::from_secs(10));
    // Mid-stream: an error event, a final chunk with finish_reason "error", then [DONE].
    let r = w.request(
        "POST",
        "/v1/chat/completions",
        &long(r#","stream":true"#),
        &[("x-request-deadline-ms", "600")],
    );
    assert_eq!(r.status(), 200);
    let mut sse = pdserve_http::SseDecoder::new(1 << 20);
    let mut events = Vec::new();
    let mut r = r;
    while let Some(c) = r.next_chunk().unwrap() {
        sse.push(&c);
        while let Some(e) = sse.next_event().unwrap() {
            events.push(e.data);
        }
    }
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    let last: serde_json::Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "error");
    let err: serde_json::Value = serde_json::from_str(&events[n - 3]).unwrap();
    assert_eq!(err["error"]["type"], "deadline_exceeded");
}

#[test]
fn bad_input_gets_the_right_status_and_nothing_else_is_disturbed() {
    let w = Worker::start(&["--max-context", "64"]);
    let long_prompt = "word ".repeat(200);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "invalid_request"),
        ("/v1/chat/completions", r#"{"messages": "hi"}"#.into(), 400, "invalid_request"),
        ("/v1/chat/completions", r#"{"messages": []}"#.into(), 400, "invalid_request"),
        ("/v1/chat/completions", chat("hi", r#","temperature":"warm""#), 400, "invalid_request"),
        ("/v1/chat/completions", chat("hi", r#","n":17"#), 400, "invalid_request"),
        ("/v1/chat/completions", chat("hi", r#","model":"gpt-9""#), 404, "model_not_found"),
        ("/v1/completions", format!(r#"{{"prompt":"{long_prompt}"}}"#), 400, "context_length_exceeded"),
        ("/v1/completions", r#"{"prompt":"hi","max_tokens":100}"#.into(), 400, "context_length_exceeded"),
        ("/v1/nope", "{}".into(), 404, "not_found"),
    ];
    for (path, body, status, ty) in cases {
        let (s, v) = w.json("POST", path, &body);
        assert_eq!((s, v["error"]["type"].as_str()), (status, Some(ty)), "{path} {body}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let (_, v) = w.json("POST", "/v1/completions", &format!(r#"{{"prompt":"{long_prompt}"}}"#));
    assert!(v["error"]["message"].as_str().unwrap().contains("64"), "the message names the context: {v}");
    // An oversized body: 413 and the connection closed.
    let mut s = TcpStream::connect(w.addr).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    // Everyone else is still served.
    let (s, v) = w.json("POST", "/v1/completions", r#"{"prompt":"Hello","max_tokens":2}"#);
    assert_eq!(s, 200, "{v}");
}

/// A chat completion of exactly `tokens` tokens on a thread of its own: its status and body.
fn chat_in_background(w: &Worker, content: &str, tokens: u32) -> thread::JoinHandle<(u16, Vec<u8>)> {
    let (addr, body) = (w.addr, chat(content, &format!(r#","max_tokens":{tokens},"ignore_eos":true"#)));
    thread::spawn(move || {
        let client = pdserve_http::HttpClient::new(Default::default());
        let mut r = pdserve_http::Request::new("POST", "/v1/chat/completions");
        r.body = body.into_bytes();
        let resp = client.send(addr, &r, Instant::now() + Duration::from_secs(120)).unwrap();
        (resp.status(), resp.read_to_end().unwrap())
    })
}

#[test]
fn a_panic_fails_one_request_and_the_worker_keeps_serving() {
    let w = Worker::start(&["--test-panic-on", "PANIC-NOW"]);
    let (s, v) = w.json("POST", "/v1/chat/completions", &chat("please PANIC-NOW", ""));
    assert_eq!((s, v["error"]["type"].as_str()), (500, Some("internal")), "{v}");
    let (s, _) = w.json("POST", "/v1/chat/completions", &chat("Hi", r#","max_tokens":2"#));
    assert_eq!(s, 200);
    assert_eq!(w.json("GET", "/health/ready", "").0, 200);
    // Panics inside the engine and while rendering: each fails its own request, with the place named,
    // while another request in the same batches runs to its end.
    let bystander = chat_in_background(&w, "Count from one to fifty.", 48);
    thread::sleep(Duration::from_millis(200));
    for (site, says) in [("sample", "sampling"), ("detokenize", "detokenizing"), ("output", "rendering")] {
        let (s, v) =
            w.json("POST", "/v1/chat/completions", &chat(&format!("PANIC-NOW@{site}"), r#","max_tokens":8"#));
        assert_eq!(s, 500, "{site}: {v}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(says), "{site}: {v}");
        // Streamed: an error event ends the stream.
        let (s, events) = w.stream(
            "/v1/chat/completions",
            &chat(&format!("PANIC-NOW@{site}"), r#","max_tokens":8,"stream":true"#),
        );
        assert!(s == 200 || s == 500, "{site}: {s}");
        if s == 200 {
            assert!(events.iter().any(|e| e.contains("\"error\"")), "{site}: {events:?}");
        }
    }
    let (status, body) = bystander.join().unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
    assert_eq!(w.json("GET", "/health/ready", "").0, 200);
    let (s, v) = w.json("GET", "/debug/requests", "");
    assert_eq!((s, v["requests"].as_array().map(Vec::len)), (200, Some(0)), "nothing left behind: {v}");
}

#[test]
fn sigterm_drains_then_exits() {
    let mut w = Worker::start(&[]);
    let running = chat_in_background(&w, "Count from one to twenty.", 40);
    // SIGTERM only once the request is in the engine (a request that arrives while draining gets 503).
    let start = Instant::now();
    while w.json("GET", "/debug/requests", "").1["requests"].as_array().unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "the request never reached the engine");
        thread::sleep(Duration::from_millis(10));
    }
    w.signal("-TERM");
    thread::sleep(Duration::from_millis(100));
    let (s, v) = w.json("GET", "/health/ready", "");
    assert_eq!((s, v["status"].as_str()), (503, Some("not_ready")), "{v}");
    let (s, v) = w.json("POST", "/v1/chat/completions", &chat("Hi", ""));
    assert_eq!((s, v["error"]["type"].as_str()), (503, Some("not_ready")));
    let (status, body) = running.join().unwrap();
    assert_eq!(status, 200, "the running request finished: {}", String::from_utf8_lossy(&body));
    let start = Instant::now();
    loop {
        if let Some(code) = w.child.try_wait().unwrap() {
            assert!(code.success(), "{code}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "did not exit after draining");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn abort_by_request_id_ends_a_live_stream() {
    let w = Worker::start(&[]);
    let (addr, body) = (w.addr, long(r#","stream":true"#));
    let reader = thread::spawn(move || {
        let client = pdserve_http::HttpClient::new(Default::default());
        let mut r = pdserve_http::Request::new("POST", "/v1/chat/completions");
        r.body = body.into_bytes();
        r.headers.push(pdserve_http::Header { name: "x-request-id".into(), value: b"abort-me".to_vec() });
        let mut resp = client.send(addr, &r, Instant::now() + Duration::from_secs(60)).unwrap();
        let mut all = Vec::new();
        while let Some(c) = resp.next_chunk().unwrap() {
            all.extend(c);
        }
        String::from_utf8(all).unwrap()
    });
    let start = Instant::now();
    loop {
        let (_, v) = w.json("GET", "/debug/requests", "");
        if v["requests"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["id"] == "abort-me" && r["tokens_out"].as_u64() > Some(0))
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20));
        thread::sleep(Duration::from_millis(20));
    }
    let (s, v) = w.json("POST", "/abort/abort-me", "");
    assert_eq!((s, v["aborted"].as_str()), (200, Some("abort-me")));
    let text = reader.join().unwrap();
    assert!(
        text.contains("\"cancelled\"")
            && text.contains("\"finish_reason\":\"error\"")
            && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    assert_eq!(w.json("POST", "/abort/abort-me", "").0, 404, "a second abort finds nothing");
}
