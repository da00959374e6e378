//! The whole stack: the router (on a thread of the test) in front of real worker processes. PD through
//! the router gives the unified worker's greedy text; a decode worker killed mid-stream ends the stream
//! with an error event; a client that leaves is gone from the worker within a bound; `/debug/requests`
//! on the router shows where each request is on its worker.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::router::RouterThread;
use common::{chat, Worker};
use pdserve_http::SseDecoder;
use pdserve_router::Role;

fn text_of(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

/// KV blocks held by sequences or transfers.
fn held_blocks(w: &Worker) -> f64 {
    let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    let owned = |o: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("kv_blocks{{owner=\"{o}\"}} ")))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    owned("sequence") + owned("transfer")
}

#[test]
fn pd_through_the_router_equals_unified_and_leaves_nothing_behind() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill", "--kv-shm"]);
    let decode = Worker::start(&["--role", "decode"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    let prompts = ["What is the capital of France?", "Write one sentence about the sea.", "Name a fruit."];
    for (i, p) in prompts.iter().enumerate() {
        let body = chat(p, r#","temperature":0,"max_tokens":20"#);
        let (s, v) = unified.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200);
        let want = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        let got = if i % 2 == 0 {
            let (s, v) = router.json("POST", "/v1/chat/completions", &body);
            assert_eq!(s, 200, "{v}");
            // Where the time went, stage by stage, from both workers.
            for stage in ["prefill_queue_ms", "prefill_ms", "transfer_ms", "decode_queue_ms", "decode_ms"] {
                assert!(v["timings"][stage].as_f64().is_some_and(|t| t >= 0.0), "{stage}: {v}");
            }
            v["choices"][0]["message"]["content"].as_str().unwrap().to_owned()
        } else {
            let (s, events) = router.stream(&chat(p, r#","temperature":0,"max_tokens":20,"stream":true"#));
            assert_eq!(s, 200);
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            text_of(&events)
        };
        assert_eq!(got, want, "prompt {p:?}");
    }
    let until = Instant::now() + Duration::from_secs(10);
    while held_blocks(&prefill) + held_blocks(&decode) > 0.0 {
        assert!(Instant::now() < until, "KV still held after the requests");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A prompt over the context fails at the prefill leg, at once, with the worker's reason.
    let long = "word ".repeat(9000);
    let (s, v) = router.json("POST", "/v1/chat/completions", &chat(&long, ""));
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["type"], "context_length_exceeded");
}

#[test]
fn decode_worker_killed_mid_stream_ends_with_an_error_event() {
    let prefill = Worker::start(&["--role", "prefill"]);
    let decode = Worker::start(&["--role", "decode"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    let body =
        chat("Tell me a long story about a dragon.", r#","max_tokens":400,"ignore_eos":true,"stream":true"#);
    let mut r = router.send("POST", "/v1/chat/completions", &body);
    assert_eq!(r.status(), 200);
    let mut sse = SseDecoder::new(1 << 20);
    let mut events = Vec::new();
    let mut killed = false;
    let started = Instant::now();
    while let Ok(Some(chunk)) = r.next_chunk() {
        sse.push(&chunk);
        while let Ok(Some(e)) = sse.next_event() {
            events.push(e.data);
        }
        if events.len() >= 3 && !killed {
            decode.signal("-KILL");
            killed = true;
        }
        assert!(started.elapsed() < Duration::from_secs(60));
    }
    assert!(killed);
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]", "{events:?}");
    let last: serde_json::Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "error", "{events:?}");
    // The router tried to move the stream (migration) and found no other decode worker.
    let err: serde_json::Value = serde_json::from_str(&events[n - 3]).unwrap();
    assert_eq!(err["error"]["type"], "no_capacity", "{err}");
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("no decode worker")), "{err}");
    // The router takes the dead worker out and says so.
    let until = Instant::now() + Duration::from_secs(5);
    while router.json("GET", "/health/ready", "").0 == 200 {
        assert!(Instant::now() < until, "still ready with the only decode worker dead");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (s, v) = router.json("POST", "/v1/chat/completions", &chat("Hi", ""));
    assert_eq!(s, 503, "{v}");
}

#[test]
fn a_client_that_leaves_is_gone_from_the_worker_and_debug_shows_where_it_was() {
    let worker = Worker::start(&[]);
    let router = RouterThread::start(&[(&worker, Role::Unified)]);
    let body =
        chat("Tell me a long story about a dragon.", r#","max_tokens":400,"ignore_eos":true,"stream":true"#);
    let mut s = TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: walk-away\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let (_, dbg) = router.json("GET", "/debug/requests", "");
    let entry = &dbg["requests"][0];
    assert_eq!(entry["id"], "walk-away", "{dbg}");
    assert_eq!(entry["stage"], "streaming");
    assert_eq!(entry["hops"][0]["id"], "walk-away", "the worker's own view is joined: {dbg}");
    // Any stage of a live request: the stream's first event (the role) goes out at admission, which
    // can be before the worker's ledger has seen the first step.
    let hop_stage = entry["hops"][0]["stage"].as_str().unwrap_or_default();
    assert!(["prefill_queued", "prefilling", "decoding"].contains(&hop_stage), "{dbg}");
    assert_eq!(entry["hops"][0]["worker"], format!("http://{}", worker.addr));
    let left = Instant::now();
    drop(s);
    loop {
        let (_, w) = worker.json("GET", "/debug/requests", "");
        if w["requests"].as_array().is_some_and(|a| a.is_empty()) {
            break;
        }
        assert!(left.elapsed() < Duration::from_secs(2), "the worker still runs the request: {w}");
        std::thread::sleep(Duration::from_millis(2));
    }
    println!("client disconnect to worker request gone: {:?}", left.elapsed());
    let until = Instant::now() + Duration::from_secs(5);
    while held_blocks(&worker) > 0.0 {
        assert!(Instant::now() < until);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The next round of a conversation goes to the decode worker that kept the last round's KV (the
/// router follows prefixes for decode as for prefill), which then pulls only what it lacks; the
/// router's `/debug/requests` says why each leg went where it did. (Every round through the prefill
/// worker here, `--max-local-prefill-bytes 0`: the pull is what this follows. The next test has the
/// default, where that worker computes a short round itself.)
#[test]
fn a_conversation_returns_to_its_decode_worker_and_debug_explains_the_choice() {
    let prefill = Worker::start(&["--role", "prefill"]);
    let decodes = [Worker::start(&["--role", "decode"]), Worker::start(&["--role", "decode"])];
    let router = RouterThread::start_with(
        &[(&prefill, Role::Prefill), (&decodes[0], Role::Decode), (&decodes[1], Role::Decode)],
        |c| c.max_local_prefill_bytes = 0,
    );
    let system = "You are a build assistant. You read files and run commands for the user. ".repeat(8);
    let first = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "What does the Makefile build?"},
    ]);
    let (s, v) = router.json(
        "POST",
        "/v1/chat/completions",
        &serde_json::json!({"messages": first, "temperature": 0, "max_tokens": 16}).to_string(),
    );
    assert_eq!(s, 200, "{v}");
    let mut second = first.clone();
    second.as_array_mut().unwrap().extend([
        serde_json::json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}),
        serde_json::json!({"role": "user", "content": "Run it and tell me what fails."}),
    ]);
    let body = serde_json::json!({
        "messages": second, "max_tokens": 300, "ignore_eos": true, "stream": true
    })
    .to_string();
    let mut s = TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: round-2\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while String::from_utf8_lossy(&got).matches("data: ").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let (_, dbg) = router.json("GET", "/debug/requests", "");
    let entry = dbg["requests"].as_array().unwrap().iter().find(|r| r["id"] == "round-2").unwrap().clone();
    let routing = entry["routing"].as_array().unwrap_or_else(|| panic!("{entry}"));
    assert_eq!(entry["plan"], "disaggregated", "{entry}");
    let decode_leg = routing.iter().find(|r| r["leg"] == "decode").unwrap_or_else(|| panic!("{entry}"));
    // The worker chosen is the one that held the first round: it pulled only the blocks it lacked.
    let skipped = "kv_transfer_blocks_total{result=\"skipped\"}";
    // (Counted once the pull completes and the engine next tells its metrics: the first events can
    // come before that, so wait for it a while.)
    let until = Instant::now() + Duration::from_secs(10);
    let home = loop {
        if let Some(h) = decodes.iter().position(|d| common::metric(d, skipped) >= 8.0) {
            break h;
        }
        assert!(Instant::now() < until, "no decode worker reused the first round's blocks: {entry}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(common::metric(&decodes[1 - home], skipped) < 8.0);
    assert_eq!(decode_leg["worker"], format!("http://{}", decodes[home].addr), "{entry}");
    assert_eq!(decode_leg["rule"], "cache_match", "{entry}");
    let matched: Vec<u64> = decode_leg["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["matched_prefix_bytes"].as_u64().unwrap())
        .collect();
    assert!(matched.iter().any(|&m| m as usize >= system.len()), "{entry}");
    assert!(matched.contains(&0), "the other decode worker holds nothing of it: {entry}");
    assert!(routing.iter().any(|r| r["leg"] == "prefill" && r["rule"].is_string()), "{entry}");
    drop(s);
    let until = Instant::now() + Duration::from_secs(10);
    while held_blocks(&prefill) + held_blocks(&decodes[0]) + held_blocks(&decodes[1]) > 0.0 {
        assert!(Instant::now() < until, "KV still held after the client left");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Conditional disaggregation: a conversation's next round, its new tail short, goes to the decode
/// worker that holds the conversation alone (no prefill leg, no transfer), which computes only the
/// tail: the unified worker's greedy text, the history counted as cached, no transfer in its timings,
/// the router counting the choice.
#[test]
fn a_short_next_round_is_computed_on_the_decode_worker_holding_the_conversation() {
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill"]);
    let decodes = [Worker::start(&["--role", "decode"]), Worker::start(&["--role", "decode"])];
    let router = RouterThread::start(&[
        (&prefill, Role::Prefill),
        (&decodes[0], Role::Decode),
        (&decodes[1], Role::Decode),
    ]);
    let system = "You are a build assistant. You read files and run commands for the user. ".repeat(8);
    let mut messages = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "What does the Makefile build?"},
    ]);
    let body = |m: &serde_json::Value| {
        serde_json::json!({"messages": m, "temperature": 0, "max_tokens": 16}).to_string()
    };
    let (s, v) = router.json("POST", "/v1/chat/completions", &body(&messages));
    assert_eq!(s, 200, "{v}");
    assert!(v["timings"]["transfer_ms"].is_number(), "round 1 went through the prefill worker: {v}");
    let p1 = v["usage"]["prompt_tokens"].as_f64().unwrap();
    messages.as_array_mut().unwrap().extend([
        serde_json::json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}),
        serde_json::json!({"role": "user", "content": "Run it and tell me what fails."}),
    ]);
    let (s, v) = router.json("POST", "/v1/chat/completions", &body(&messages));
    assert_eq!(s, 200, "{v}");
    let (s, want) = unified.json("POST", "/v1/chat/completions", &body(&messages));
    assert_eq!(s, 200, "{want}");
    assert_eq!(v["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
    assert!(v["timings"]["transfer_ms"].is_null() && v["timings"]["prefill_ms"].is_number(), "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap();
    assert!(cached >= p1 - 16.0, "{cached} cached of round 2, round 1 had {p1} prompt tokens: {v}");
    let metrics = router.send("GET", "/metrics", "").read_to_end().unwrap();
    let metrics = String::from_utf8(metrics).unwrap();
    assert!(metrics.contains("router_requests_dispatched_total{plan=\"decode_local\"} 1"), "{metrics}");
}

#[test]
fn tool_calls_structured_output_and_anthropic_messages_through_pd() {
    let prefill = Worker::start(&["--role", "prefill", "--kv-shm"]);
    let decode = Worker::start(&["--role", "decode"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    // The router answers /v1/models itself: the model its workers serve, and each worker's role,
    // weights and KV bytes (not one decode worker's answer forwarded).
    let (s, v) = router.json("GET", "/v1/models", "");
    assert_eq!(s, 200, "{v}");
    let m = &v["data"][0];
    assert_eq!(
        (m["owned_by"].as_str(), v["data"].as_array().map(Vec::len)),
        (Some("pdserve"), Some(1)),
        "{v}"
    );
    let mut roles: Vec<&str> =
        m["workers"].as_array().unwrap().iter().filter_map(|w| w["role"].as_str()).collect();
    roles.sort_unstable();
    assert_eq!(roles, ["decode", "prefill"], "{v}");
    assert!(
        m["workers"].as_array().unwrap().iter().all(|w| w["kv_bytes_per_token"].as_u64() > Some(0)),
        "{v}"
    );
    let (s, one) = router.json("GET", &format!("/v1/models/{}", m["id"].as_str().unwrap()), "");
    assert_eq!((s, &one["id"]), (200, &m["id"]), "{one}");
    let (s, e) = router.json("GET", "/v1/models/no-such-model", "");
    assert_eq!((s, e["error"]["type"].as_str()), (404, Some("model_not_found")), "{e}");
    // The prefill worker samples the first token and the decode worker the rest, each under the
    // request's constraint: every call and every JSON answer must still parse.
    common::run_python("openai_tools.py", &format!("http://{}", router.addr), &["16"]);
    // Anthropic's Messages API and OpenAI's Responses API take the same path (the router keeps the
    // stored conversations: both workers get the whole one).
    common::run_python("anthropic_messages.py", &format!("http://{}", router.addr), &[]);
    common::run_python("openai_responses.py", &format!("http://{}", router.addr), &[]);
    let until = Instant::now() + Duration::from_secs(10);
    while held_blocks(&prefill) + held_blocks(&decode) > 0.0 {
        assert!(Instant::now() < until, "KV still held after the requests");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A KV block corrupted on its way to the decode worker (one bit flipped in the first block of its
/// second pull, the client's request's after the router's first pair probe's: `--test-corrupt-kv 2`)
/// is caught by its checksum, over TCP and out of shared memory
/// alike: the decode worker fails the transfer as `checksum`, the router computes the prompt again
/// from prefill, and the client gets the unified worker's answer, not one decoded from bad KV.
#[test]
fn a_corrupted_kv_block_is_caught_and_the_request_retried_from_prefill() {
    let unified = Worker::start(&[]);
    let body = chat("What is the capital of France?", r#","temperature":0,"max_tokens":16"#);
    let (s, want) = unified.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{want}");
    drop(unified);
    for transport in [&[][..], &["--kv-shm"][..]] {
        let prefill = Worker::start(&[&["--role", "prefill"][..], transport].concat());
        let decode = Worker::start(&["--role", "decode", "--test-corrupt-kv", "2"]);
        // (One pair probe only, the readiness one: the corrupted block is the client's request's.)
        let router = RouterThread::start_with(&[(&prefill, Role::Prefill), (&decode, Role::Decode)], |c| {
            c.pair_probe_interval = Duration::from_secs(3600)
        });
        let (s, got) = router.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{transport:?}: {got}");
        assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
        let caught =
            common::metric(&decode, "kv_transfers_finished_total{side=\"decode\",outcome=\"checksum\"}");
        assert_eq!(caught, 1.0, "{transport:?}: the corrupted block failed its transfer as a checksum");
        let m = String::from_utf8(router.send("GET", "/metrics", "").read_to_end().unwrap()).unwrap();
        assert!(
            m.lines().any(|l| l.starts_with("router_migrations_total{cause=\"kv_transfer\"")),
            "{transport:?}: the router computed the prompt again:\n{m}"
        );
    }
}
