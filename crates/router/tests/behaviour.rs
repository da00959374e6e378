//! The router's promises, against mock workers on loopback: every request gets an answer, fast when
//! nothing can serve it, at its deadline when a worker hangs, and workers hear about clients that left.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use pdserve_router::{AdmissionConfig, Role};

#[test]
fn all_workers_down_is_503_at_once() {
    let (a, b) = (dead_url(), dead_url());
    let r = RouterHandle::start(config(&[(&a, Role::Unified), (&b, Role::Unified)]));
    let mut fastest = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let resp = r.request("POST", "/v1/chat/completions", CHAT, &[]);
        let took = t.elapsed();
        fastest = fastest.min(took);
        assert_eq!(resp.status(), 503);
        assert!(resp.head().header_str("retry-after").is_some(), "503 carries Retry-After");
        let body: serde_json::Value = serde_json::from_slice(&resp.read_to_end().unwrap()).unwrap();
        assert_eq!(body["error"]["type"], "no_capacity", "{body}");
        assert!(took < Duration::from_millis(500), "{took:?}");
    }
    println!("all workers down: 503 in {fastest:?} (fastest of 5)");
    assert!(fastest < Duration::from_millis(50), "{fastest:?}");
    assert!(!r.ready());
}

#[test]
fn refused_connect_is_retried_on_another_worker() {
    let gone = MockWorker::start(MockRole::Unified, Mode::Ok);
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let mut cfg = config(&[(&gone.url, Role::Unified), (&w.url, Role::Unified)]);
    cfg.policy = pdserve_router::PolicyKind::RoundRobin;
    // One probe round at start (both pass), then none: routing itself meets the refusal.
    cfg.probe_interval = Duration::from_secs(3600);
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    // Both first probes have come back (one still out when `gone` dies would take it out of
    // rotation before any request could meet the refusal).
    r.wait_probed(2, Duration::from_secs(5));
    gone.kill();
    for _ in 0..4 {
        let (status, body) = r.json("POST", "/v1/chat/completions", CHAT);
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(w.seen.lock().unwrap().posts.len(), 4);
    let retries = r.metric("router_connect_retries_total");
    assert!(retries >= 1.0, "the refused worker was never tried ({retries} retries)");
    let (_, list) = r.json("GET", "/workers", "");
    assert_eq!(list["workers"][0]["state"], "down", "a refused connect takes the worker out: {list}");
}

#[test]
fn a_request_on_a_connection_the_worker_closed_is_sent_again() {
    let w = MockWorker::start(MockRole::Unified, Mode::DropReused);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    // One probe at start; its kept-alive connection is the one the request is sent on.
    cfg.probe_interval = Duration::from_secs(3600);
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    r.wait_probed(1, Duration::from_secs(5));
    let (status, body) = r.json("POST", "/v1/chat/completions", CHAT);
    assert_eq!(status, 200, "{body}");
    assert_eq!(w.seen.lock().unwrap().dropped, 1, "the request went out on the reused connection first");
    assert_eq!(r.metric("router_stale_connection_retries_total"), 1.0);
    let (_, list) = r.json("GET", "/workers", "");
    assert_eq!(list["workers"][0]["state"], "up", "a closed idle connection is not a failure: {list}");
}

#[test]
fn probes_on_connections_the_worker_closed_are_sent_again_and_do_not_fail() {
    // Every probe after the first goes out on a kept-alive connection the worker then drops unanswered.
    let w = MockWorker::start(MockRole::Unified, Mode::DropReused);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    cfg.probe_interval = Duration::from_millis(50);
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    let until = Instant::now() + Duration::from_secs(10);
    while w.seen.lock().unwrap().dropped < 4 {
        assert!(Instant::now() < until, "the probes never reused a connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, list) = r.json("GET", "/workers", "");
    let worker = &list["workers"][0];
    assert_eq!(worker["state"], "up", "a probe on a stale connection is not a failed probe: {list}");
    assert!(worker["last_error"].is_null(), "{list}");
    assert!(r.metric("router_stale_connection_retries_total") >= 4.0);
    let (status, body) = r.json("GET", "/health/ready", "");
    assert_eq!(status, 200, "{body}");
}

#[test]
fn hanging_worker_gives_504_at_the_deadline() {
    let w = MockWorker::start(MockRole::Unified, Mode::HangPost);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    let t = Instant::now();
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"timeout":0.5}"#;
    let (status, v) = r.json("POST", "/v1/chat/completions", body);
    let took = t.elapsed();
    assert_eq!(status, 504, "{v}");
    assert_eq!(v["error"]["type"], "deadline_exceeded");
    assert!(took >= Duration::from_millis(480) && took < Duration::from_millis(1500), "{took:?}");
    // The worker was told the remaining time, and told to abort.
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let g = w.seen.lock().unwrap();
        let deadline = g.posts[0].2.expect("x-request-deadline-ms");
        assert!(deadline <= 500 && deadline > 300, "{deadline}");
        if g.aborts.contains(&g.posts[0].1) && !g.disconnects.is_empty() {
            break;
        }
        drop(g);
        assert!(Instant::now() < until, "no abort reached the worker");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn worker_dying_mid_stream_ends_the_stream_with_an_error() {
    let w = MockWorker::start(MockRole::Unified, Mode::DieMidStream);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    let (status, events) = r.stream(CHAT_STREAM);
    assert_eq!(status, 200);
    assert_eq!(events.iter().filter(|e| e.contains(r#""content":"t"#)).count(), 2, "{events:?}");
    let err: serde_json::Value = serde_json::from_str(&events[events.len() - 3]).unwrap();
    assert_eq!(err["error"]["type"], "upstream_failed", "{events:?}");
    let last: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "error");
    assert_eq!(events.last().unwrap(), "[DONE]");
}

#[test]
fn queue_overflow_is_429_with_retry_after() {
    let w = MockWorker::start(MockRole::Unified, Mode::HangPost);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    cfg.admission =
        AdmissionConfig { in_flight_max: 1, queued_max: 1, queue_timeout: Duration::from_secs(5) };
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"timeout":3}"#;
    let send = |addr| {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    };
    let _running = send(r.addr);
    std::thread::sleep(Duration::from_millis(100));
    let _queued = send(r.addr);
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let resp = r.request("POST", "/v1/chat/completions", body, &[]);
    assert_eq!(resp.status(), 429);
    assert!(t.elapsed() < Duration::from_millis(500));
    let retry: u32 = resp.head().header_str("retry-after").expect("Retry-After").parse().unwrap();
    assert!(retry >= 1);
    let v: serde_json::Value = serde_json::from_slice(&resp.read_to_end().unwrap()).unwrap();
    assert_eq!(v["error"]["type"], "queue_full");
    assert!(v["error"]["message"].as_str().unwrap().contains("limit 1"), "{v}");
}

#[test]
fn client_disconnect_reaches_the_worker() {
    let w = MockWorker::start(MockRole::Unified, Mode::HangPost);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    let mut s = TcpStream::connect(r.addr).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: leave-early\r\ncontent-length: {}\r\n\r\n{CHAT}", CHAT.len()).unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    while w.seen.lock().unwrap().live.is_empty() {
        assert!(Instant::now() < until);
        std::thread::sleep(Duration::from_millis(5));
    }
    // Where is it? The router's view joins the worker's.
    let (_, dbg) = r.json("GET", "/debug/requests", "");
    let entry = &dbg["requests"][0];
    assert_eq!(entry["id"], "leave-early", "{dbg}");
    assert_eq!(entry["stage"], "decoding");
    assert_eq!(entry["worker"], w.url.as_str());
    assert_eq!(entry["hops"][0]["process"], "mock", "{dbg}");
    let left = Instant::now();
    drop(s);
    loop {
        let g = w.seen.lock().unwrap();
        if let Some((_, at)) = g.disconnects.iter().find(|(id, _)| id == "leave-early") {
            let took = at.saturating_duration_since(left);
            println!("disconnect reached the worker in {took:?}");
            assert!(took < Duration::from_millis(1000), "{took:?}");
            break;
        }
        drop(g);
        assert!(Instant::now() < left + Duration::from_secs(2), "the worker never saw the disconnect");
        std::thread::sleep(Duration::from_millis(2));
    }
    let (_, dbg) = r.json("GET", "/debug/requests", "");
    assert_eq!(dbg["requests"].as_array().unwrap().len(), 0, "{dbg}");
}

#[test]
fn readiness_follows_the_last_worker() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let cfg = config(&[(&w.url, Role::Unified)]);
    let interval = cfg.probe_interval;
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    let (s, _) = r.json("GET", "/health/live", "");
    assert_eq!(s, 200);
    let (s, v) = r.json("GET", "/health/generate", "");
    assert_eq!((s, v["status"].as_str()), (200, Some("ok")), "a real request through the path: {v}");
    let killed = Instant::now();
    w.kill();
    while r.ready() {
        assert!(
            killed.elapsed() < interval * 2 + Duration::from_millis(100),
            "still ready after {:?}",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "ready turned false {:?} after the last worker died (probe interval {interval:?})",
        killed.elapsed()
    );
    let (s, v) = r.json("GET", "/health/ready", "");
    assert_eq!(s, 503);
    assert!(v["reason"].as_str().unwrap().contains("no working path"), "{v}");
    assert_eq!(r.json("GET", "/health/live", "").0, 200, "live says only that the process is up");
    let (s, v) = r.json("GET", "/health/generate", "");
    assert_eq!((s, v["status"].as_str()), (503, Some("failed")), "{v}");
}

#[test]
fn a_hung_worker_is_taken_out_and_put_back() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    w.set_mode(Mode::Hang);
    let until = Instant::now() + Duration::from_secs(3);
    while r.ready() {
        assert!(Instant::now() < until, "a worker that never answers probes stays in");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (s, v) = r.json("POST", "/v1/chat/completions", CHAT);
    assert_eq!((s, v["error"]["type"].as_str()), (503, Some("no_capacity")), "{v}");
    w.set_mode(Mode::Ok);
    r.wait_ready(Duration::from_secs(3));
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 200);
}

#[test]
fn pd_mode_runs_prefill_then_decode() {
    let p = MockWorker::start(MockRole::Prefill, Mode::Ok);
    let d = MockWorker::start(MockRole::Decode, Mode::Ok);
    let r = RouterHandle::start(config(&[(&p.url, Role::Prefill), (&d.url, Role::Decode)]));
    r.wait_ready(Duration::from_secs(5));
    let task = "Review the compaction code of the storage engine; the diff follows. ".repeat(4);
    let body = |text: &str, stream: bool| {
        serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 5, "stream": stream})
            .to_string()
    };
    let (s, v) = r.json("POST", "/v1/chat/completions", &body(&task, false));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "mock answer (transfer 7)");
    let posts = |w: &MockWorker| {
        let g = w.seen.lock().unwrap();
        g.posts
            .iter()
            .filter(|x| !x.1.starts_with("probe-"))
            .map(|x| (x.1.clone(), x.3.clone()))
            .collect::<Vec<_>>()
    };
    // The decode leg carried the prefill handle and the same request id.
    let (pp, dp) = (posts(&p), posts(&d));
    assert_eq!(pp.last().unwrap().0, dp.last().unwrap().0);
    assert!(dp.last().unwrap().1.starts_with(r#"{"pd_transfer":{"transfer":7"#), "{}", dp.last().unwrap().1);
    let stream = |text: &str| body(text, true);
    // The same conversation's next round: the decode worker holds its history and the new tail is
    // short, so that worker alone computes it (no prefill leg, no handle).
    let next = format!("{task}\nmock answer\nand now?");
    let (s, events) = r.stream(&stream(&next));
    assert_eq!(s, 200);
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(posts(&p).len(), pp.len(), "no prefill leg");
    let local = posts(&d).last().unwrap().1.clone();
    assert!(!local.contains("pd_transfer") && local.contains("and now?"), "{local}");
    assert_eq!(r.metric("router_requests_dispatched_total{plan=\"decode_local\"}"), 1.0);
    // A new tail longer than --max-local-prefill-bytes goes through the prefill worker.
    let long = format!("{next}\n{}", "the tool printed a long log line here. ".repeat(120));
    let (s, events) = r.stream(&stream(&long));
    assert_eq!((s, events.last().map(String::as_str)), (200, Some("[DONE]")));
    assert_eq!(posts(&p).len(), pp.len() + 1, "a prefill leg");
    assert!(posts(&d).last().unwrap().1.starts_with(r#"{"pd_transfer""#));
    assert_eq!(r.metric("router_requests_dispatched_total{plan=\"disaggregated\"}"), 2.0);
}

/// A decode worker that holds a conversation but has no room to compute its next round (429) gets it
/// through the prefill worker instead, on the same stream; and when the client then leaves, that worker
/// is told to abort, although it had answered the first leg with an error.
#[test]
fn a_busy_decode_worker_gets_the_round_through_prefill_and_still_its_abort() {
    let p = MockWorker::start(MockRole::Prefill, Mode::Ok);
    let d = MockWorker::start(MockRole::Decode, Mode::Ok);
    let r = RouterHandle::start(config(&[(&p.url, Role::Prefill), (&d.url, Role::Decode)]));
    r.wait_ready(Duration::from_secs(5));
    let task = "Review the compaction code of the storage engine; the diff follows. ".repeat(4);
    let body = |text: &str, extra: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":{}}}]{extra}}}"#,
            serde_json::Value::String(text.into())
        )
    };
    assert_eq!(r.json("POST", "/v1/chat/completions", &body(&task, r#","max_tokens":5"#)).0, 200);
    d.set_mode(Mode::BusyLocal);
    let posts =
        |w: &MockWorker| w.seen.lock().unwrap().posts.iter().filter(|x| !x.1.starts_with("probe-")).count();
    let before = posts(&p);
    let next = body(&format!("{task}\nmock answer\nand now?"), r#","max_tokens":400,"stream":true"#);
    let mut s = TcpStream::connect(r.addr).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: busy-1\r\ncontent-length: {}\r\n\r\n{next}", next.len()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
    assert_eq!(posts(&p), before + 1, "the round went through the prefill worker");
    {
        let g = d.seen.lock().unwrap();
        let mine: Vec<_> = g.posts.iter().filter(|x| x.1 == "busy-1").collect();
        assert_eq!(mine.len(), 2, "refused alone, then given the handle");
        assert!(!mine[0].3.contains("pd_transfer") && mine[1].3.contains("pd_transfer"));
    }
    drop(s);
    let until = Instant::now() + Duration::from_secs(3);
    while !d.seen.lock().unwrap().aborts.iter().any(|a| a == "busy-1") {
        assert!(Instant::now() < until, "the decode worker was never told to abort");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pd_prefill_failure_ends_the_request_at_once() {
    let p = MockWorker::start(MockRole::Prefill, Mode::Ok);
    let d = MockWorker::start(MockRole::Decode, Mode::Ok);
    let r = RouterHandle::start(config(&[(&p.url, Role::Prefill), (&d.url, Role::Decode)]));
    r.wait_ready(Duration::from_secs(5));
    p.kill();
    let t = Instant::now();
    let (s, v) = r.json("POST", "/v1/chat/completions", CHAT);
    assert!(s == 503 || s == 502, "{s} {v}");
    assert!(t.elapsed() < Duration::from_millis(500));
    let d_posts = d.seen.lock().unwrap().posts.iter().filter(|x| !x.1.starts_with("probe-")).count();
    assert_eq!(d_posts, 0, "decode never called after a failed prefill");
}

#[test]
fn workers_api_adds_lists_and_drains() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let r = RouterHandle::start(config(&[]));
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 503);
    let (s, v) = r.json("POST", "/workers", &format!(r#"{{"url":"{}","role":"unified"}}"#, w.url));
    assert_eq!(s, 201, "{v}");
    let (s, _) = r.json("POST", "/workers", &format!(r#"{{"url":"{}"}}"#, w.url));
    assert_eq!(s, 409);
    assert_eq!(r.json("POST", "/workers", r#"{"url":"ftp://x"}"#).0, 400);
    assert_eq!(r.json("POST", "/workers", r#"{"url":"http://127.0.0.1:1","role":"chef"}"#).0, 400);
    r.wait_ready(Duration::from_secs(5));
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 200);
    let (_, list) = r.json("GET", "/workers", "");
    assert_eq!(list["workers"][0]["state"], "up", "{list}");
    assert_eq!(list["workers"][0]["requests_total"], 1);
    let resp = r.request("DELETE", &format!("/workers?url={}", w.url), "", &[]);
    assert_eq!(resp.status(), 200);
    let _ = resp.read_to_end();
    let (_, list) = r.json("GET", "/workers", "");
    assert_eq!(list["workers"].as_array().unwrap().len(), 0, "{list}");
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 503);
}

#[test]
fn api_keys_guard_their_routes() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    cfg.api_key = Some("user-key".into());
    cfg.admin_key = Some("admin-key".into());
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    let status = |path: &str, method: &str, key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let resp = r.request(method, path, if method == "POST" { CHAT } else { "" }, &headers);
        let s = resp.status();
        let _ = resp.read_to_end();
        s
    };
    assert_eq!(status("/v1/chat/completions", "POST", None), 401);
    assert_eq!(status("/v1/chat/completions", "POST", Some("admin-key")), 401);
    assert_eq!(status("/v1/chat/completions", "POST", Some("user-key")), 200);
    assert_eq!(status("/workers", "GET", Some("user-key")), 401);
    assert_eq!(status("/workers", "GET", Some("admin-key")), 200);
    assert_eq!(status("/debug/requests", "GET", None), 401);
    assert_eq!(status("/health/ready", "GET", None), 200, "health is open to probes");
}

#[test]
fn bad_input_gets_a_json_error_and_nothing_else_is_disturbed() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    for body in ["{not json", r#"{"stream":"yes"}"#, r#"{"timeout":-3}"#, "[]"] {
        let (s, v) = r.json("POST", "/v1/chat/completions", body);
        assert_eq!(s, 400, "{body}");
        assert_eq!(v["error"]["type"], "invalid_request", "{v}");
    }
    assert_eq!(r.json("GET", "/nope", "").0, 404);
    assert_eq!(r.json("PUT", "/v1/chat/completions", "").0, 405);
    assert_eq!(w.seen.lock().unwrap().posts.iter().filter(|p| !p.1.starts_with("probe-")).count(), 0);
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 200);
    let mut s = TcpStream::connect(r.addr).unwrap();
    s.write_all(b"GARBAGE / HTTP/9\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
}

#[test]
fn metrics_carry_units_and_outcomes() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let r = RouterHandle::start(config(&[(&w.url, Role::Unified)]));
    r.wait_ready(Duration::from_secs(5));
    assert_eq!(r.json("POST", "/v1/chat/completions", CHAT).0, 200);
    let text = String::from_utf8(r.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    assert!(
        text.contains("router_requests_finished_total{outcome=\"completed\",stage=\"decoding\"} 1"),
        "{text}"
    );
    assert!(text.contains("router_request_latency_seconds_count 1"), "{text}");
    assert!(
        text.contains(&format!(
            "router_worker_requests_in_flight{{worker=\"{}\",role=\"unified\"}} 0",
            w.url
        )),
        "{text}"
    );
}

#[test]
fn an_exhausted_pool_is_503_not_a_wait() {
    let w = MockWorker::start(MockRole::Unified, Mode::HangPost);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    cfg.connections_per_worker_max = 1;
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"timeout":3}"#;
    let mut held = TcpStream::connect(r.addr).unwrap();
    write!(
        held,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    while w.seen.lock().unwrap().live.is_empty() {
        assert!(Instant::now() < until);
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    let (s, v) = r.json("POST", "/v1/chat/completions", body);
    assert_eq!((s, v["error"]["type"].as_str()), (503, Some("no_capacity")), "{v}");
    assert!(t.elapsed() < Duration::from_millis(500));
    // The busy worker stays in rotation: a full pool is not a failure.
    std::thread::sleep(Duration::from_millis(300));
    let (_, list) = r.json("GET", "/workers", "");
    assert_eq!(list["workers"][0]["state"], "up", "{list}");
}

#[test]
fn a_draining_router_finishes_its_streams_refuses_new_requests_and_exits() {
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let r = std::sync::Arc::new(RouterHandle::start(config(&[(&w.url, Role::Unified)])));
    r.wait_ready(Duration::from_secs(5));
    // A stream of 40 chunks 20 ms apart is under way when the drain starts.
    let r2 = std::sync::Arc::clone(&r);
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":40,"stream":true}"#;
    let stream = std::thread::spawn(move || r2.stream(body));
    let until = Instant::now() + Duration::from_secs(5);
    while w.seen.lock().unwrap().posts.is_empty() {
        assert!(Instant::now() < until, "the stream never reached the worker");
        std::thread::sleep(Duration::from_millis(5));
    }
    r.drain();
    std::thread::sleep(Duration::from_millis(50));
    let resp = r.request("POST", "/v1/chat/completions", CHAT, &[]);
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.head().header_str("retry-after"), Some("1"));
    let v: serde_json::Value = serde_json::from_slice(&resp.read_to_end().unwrap()).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("shutting down"), "{v}");
    let (status, ready) = r.json("GET", "/health/ready", "");
    assert_eq!(status, 503, "{ready}");
    assert!(!r.exited(), "the router left before its stream finished");
    let (status, events) = stream.join().unwrap();
    assert_eq!(status, 200);
    assert_eq!(events.len(), 42, "the stream was cut: {events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let until = Instant::now() + Duration::from_secs(2);
    while !r.exited() {
        assert!(Instant::now() < until, "the router did not exit once drained");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(w.seen.lock().unwrap().posts.len(), 1, "the refused request reached the worker");
}

#[test]
fn a_drain_that_runs_out_of_time_ends_what_is_left_with_an_explicit_error() {
    let w = MockWorker::start(MockRole::Unified, Mode::HangPost);
    let mut cfg = config(&[(&w.url, Role::Unified)]);
    cfg.drain_timeout = Duration::from_millis(300);
    let r = std::sync::Arc::new(RouterHandle::start(cfg));
    r.wait_ready(Duration::from_secs(5));
    let r2 = std::sync::Arc::clone(&r);
    let hung = std::thread::spawn(move || r2.json("POST", "/v1/chat/completions", CHAT));
    let until = Instant::now() + Duration::from_secs(5);
    while w.seen.lock().unwrap().posts.is_empty() {
        assert!(Instant::now() < until, "the request never reached the worker");
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    r.drain();
    let (status, v) = hung.join().unwrap();
    let took = t.elapsed();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["type"], "not_ready", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("shut down before the request finished"), "{v}");
    assert!(took >= Duration::from_millis(280) && took < Duration::from_secs(2), "{took:?}");
    // The worker heard that the request is over.
    let until = Instant::now() + Duration::from_secs(2);
    while w.seen.lock().unwrap().aborts.is_empty() {
        assert!(Instant::now() < until, "no abort reached the worker");
        std::thread::sleep(Duration::from_millis(10));
    }
    let until = Instant::now() + Duration::from_secs(2);
    while !r.exited() {
        assert!(Instant::now() < until, "the router did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_draining_workers_refusal_is_sent_to_another_worker() {
    let draining = MockWorker::start(MockRole::Unified, Mode::Draining);
    let w = MockWorker::start(MockRole::Unified, Mode::Ok);
    let mut cfg = config(&[(&draining.url, Role::Unified), (&w.url, Role::Unified)]);
    cfg.policy = pdserve_router::PolicyKind::RoundRobin;
    let r = RouterHandle::start(cfg);
    r.wait_ready(Duration::from_secs(5));
    for _ in 0..4 {
        let (status, body) = r.json("POST", "/v1/chat/completions", CHAT);
        assert_eq!(status, 200, "{body}");
        let (status, events) = r.stream(CHAT_STREAM);
        assert_eq!((status, events.last().map(String::as_str)), (200, Some("[DONE]")));
    }
    assert_eq!(w.seen.lock().unwrap().posts.len(), 8);
    let refused = draining.seen.lock().unwrap().posts.len();
    assert!(refused >= 1, "round robin never tried the draining worker");
    assert_eq!(r.metric("router_connect_retries_total"), refused as f64);
    // With every worker draining, the client gets the refusal itself, not a hang.
    w.set_mode(Mode::Draining);
    let (status, body) = r.json("POST", "/v1/chat/completions", CHAT);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["type"], "not_ready", "{body}");
}
