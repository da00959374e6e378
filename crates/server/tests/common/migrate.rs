//! Streams through the router, and the workers that hold them: what the migration tests read.

use std::time::{Duration, Instant};

use pdserve_http::{Header, Request, SseDecoder};
use serde_json::Value;

use super::router::RouterThread;
use super::{chat, Worker};

/// A streamed chat request read as it comes; `on_delta` sees the number of content deltas so far.
pub fn stream(router: &RouterThread, body: &str, rid: &str, mut on_delta: impl FnMut(usize)) -> Vec<Value> {
    let mut req = Request::new("POST", "/v1/chat/completions");
    req.body = body.as_bytes().to_vec();
    req.headers.push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
    req.headers.push(Header { name: "x-request-id".into(), value: rid.as_bytes().to_vec() });
    let mut r = router.client.send(router.addr, &req, Instant::now() + Duration::from_secs(120)).unwrap();
    assert_eq!(r.status(), 200);
    let mut sse = SseDecoder::new(1 << 20);
    let mut events = Vec::new();
    let mut deltas = 0;
    while let Ok(Some(chunk)) = r.next_chunk() {
        sse.push(&chunk);
        while let Ok(Some(e)) = sse.next_event() {
            assert!(!e.data.contains("pdserve-"), "a resume mark reached the client: {}", e.data);
            if e.data == "[DONE]" {
                events.push(Value::String(e.data));
                continue;
            }
            let v: Value = serde_json::from_str(&e.data).unwrap_or_else(|_| panic!("event: {}", e.data));
            if v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
                deltas += 1;
                on_delta(deltas);
            }
            events.push(v);
        }
    }
    events
}

/// What a client reads of a completed stream: its text, checked for one id, one `created`, one role
/// chunk, one finish and `usage` counting every token once.
pub fn completed_text(events: &[Value], max_tokens: u64) -> String {
    assert_eq!(events.last(), Some(&Value::String("[DONE]".into())), "{events:?}");
    let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "an error event: {events:?}");
    let id = &chunks[0]["id"];
    let created = &chunks[0]["created"];
    assert!(chunks.iter().all(|c| &c["id"] == id && &c["created"] == created), "id or created changed");
    let roles = chunks.iter().filter(|c| c["choices"][0]["delta"]["role"].is_string()).count();
    assert_eq!(roles, 1, "the opening chunk once");
    let finishes = chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).count();
    assert_eq!(finishes, 1, "one finish_reason");
    let usage = chunks.iter().find_map(|c| c.get("usage").filter(|u| u.is_object())).expect("usage chunk");
    assert_eq!(usage["completion_tokens"].as_u64(), Some(max_tokens), "usage counts each token once");
    chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect()
}

/// The worker whose `/debug/requests` lists a request whose id starts with `rid`.
pub fn holder<'a>(workers: &[&'a Worker], rid: &str) -> Option<&'a Worker> {
    workers.iter().copied().find(|w| {
        let (_, v) = w.json("GET", "/debug/requests", "");
        v["requests"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["id"].as_str().is_some_and(|i| i.starts_with(rid))))
    })
}

pub fn router_metric(router: &RouterThread, series: &str) -> f64 {
    let m = String::from_utf8(router.send("GET", "/metrics", "").read_to_end().unwrap()).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

pub fn add_worker(router: &RouterThread, w: &Worker, role: &str) {
    let series = format!("router_workers{{role=\"{role}\",state=\"up\"}}");
    let want = router_metric(router, &series) + 1.0;
    let body = format!(r#"{{"url":"http://{}","role":"{role}"}}"#, w.addr);
    let (s, v) = router.json("POST", "/workers", &body);
    assert!(s < 300, "{s} {v}");
    let until = Instant::now() + Duration::from_secs(30);
    while router_metric(router, &series) < want {
        assert!(Instant::now() < until, "the added {role} worker never came up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A greedy streamed chat request of `max_tokens` tokens (no early end), with the usage chunk.
pub fn long_stream_body(prompt: &str, max_tokens: u64) -> String {
    chat(
        prompt,
        &format!(
            r#","temperature":0,"max_tokens":{max_tokens},"ignore_eos":true,"stream":true,"stream_options":{{"include_usage":true}}"#
        ),
    )
}

/// Streams `body` as `rid` and SIGKILLs whichever of `workers` holds it at its 20th token; the
/// stream's events and the killed worker's address.
pub fn stream_killing_holder(
    router: &RouterThread,
    body: &str,
    rid: &str,
    workers: &[&Worker],
) -> (Vec<Value>, std::net::SocketAddr) {
    let mut killed = None;
    let events = stream(router, body, rid, |n| {
        if n == 20 && killed.is_none() {
            let w = holder(workers, rid).expect("a worker holds the stream");
            w.signal("-KILL");
            killed = Some(w.addr);
        }
    });
    (events, killed.expect("the stream never reached 20 tokens"))
}
