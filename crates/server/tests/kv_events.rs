//! A worker's KV events (`--kv-events-config`, vLLM's flag) read by a real ZMQ subscriber that
//! decodes them in vLLM's schema: the blocks a prompt stores carry exactly its tokens (fleet routers
//! recompute their keys from them), a prefix hit stores nothing again, evictions remove what was
//! stored, and a restarted worker starts over with `AllBlocksCleared`, which a replay recovers; and
//! the router routing on them.

mod common;
#[path = "../../kv-events/tests/subscriber/mod.rs"]
mod subscriber;

use std::time::{Duration, Instant};

use common::{metric, Worker};
use serde_json::{json, Value};
use subscriber::Subscriber;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(port: u16, pub_port: u16, replay_port: u16) -> Worker {
    start_with(port, pub_port, replay_port, &[])
}

fn start_with(port: u16, pub_port: u16, replay_port: u16, extra: &[&str]) -> Worker {
    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{pub_port}"), "replay_endpoint": format!("tcp://127.0.0.1:{replay_port}"),
        "topic": "kv@worker-0@smol"})
    .to_string();
    let port = port.to_string();
    // A small pool (64 blocks of 16 tokens), so a few prompts evict.
    let mut args =
        vec!["--port", &port, "--kv-blocks", "64", "--kv-events-config", &cfg, "--speculative", "off"];
    args.extend_from_slice(extra);
    Worker::start(&args)
}

fn complete(w: &Worker, prompt: &str) {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    let (s, v) = w.json("POST", "/v1/completions", &body);
    assert_eq!(s, 200, "{v}");
}

fn tokens(w: &Worker, text: &str) -> Vec<u64> {
    let (s, v) = w.json("POST", "/tokenize", &json!({"prompt": text}).to_string());
    assert_eq!(s, 200, "{v}");
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

/// Every batch the subscriber prints within `quiet` of the last one.
fn drain(s: &Subscriber, quiet: Duration) -> Vec<Value> {
    let mut out = Vec::new();
    while let Some(v) = s.try_next(quiet) {
        assert!(v["decode_error"].is_null(), "{v}");
        out.push(v);
    }
    out
}

fn events(batches: &[Value]) -> Vec<Value> {
    batches.iter().flat_map(|b| b["events"].as_array().cloned().unwrap_or_default()).collect()
}

fn prose(i: usize) -> String {
    format!(
        "Document {i}: {}",
        (0..30).map(|k| format!("w{}x{}", i * 7919 + k, k % 13)).collect::<Vec<_>>().join(" ")
    )
}

/// A subscriber to `w`'s events, its subscription in place: prompts (`prose(first..)`) until a batch
/// arrives (ZMQ drops what comes before), then what they stored drained.
fn subscribe(w: &Worker, pub_port: u16, replay_port: u16, first: usize) -> Subscriber {
    let s = Subscriber::start(
        &format!("127.0.0.1:{pub_port}"),
        &format!("127.0.0.1:{replay_port}"),
        "kv@worker-0",
    );
    let until = Instant::now() + Duration::from_secs(60);
    let mut warm = 0;
    loop {
        complete(w, &prose(first + warm));
        warm += 1;
        if s.try_next(Duration::from_millis(300)).is_some() {
            break;
        }
        assert!(Instant::now() < until, "no batch reached the subscriber");
    }
    drain(&s, Duration::from_millis(500));
    s
}

#[test]
fn a_zmq_subscriber_follows_a_workers_prefix_cache_in_vllm_schema() {
    let (port, pub_port, replay_port) = (free_port(), free_port(), free_port());
    let w = start(port, pub_port, replay_port);
    let s = subscribe(&w, pub_port, replay_port, 1000);

    // A prompt's blocks: stored in order, chained, each exactly 16 of its tokens.
    let text = prose(1);
    let ids = tokens(&w, &text);
    complete(&w, &text);
    let batches = drain(&s, Duration::from_millis(500));
    assert!(batches.iter().all(|b| b["topic"] == "kv@worker-0@smol" && b["rank"] == 0), "{batches:?}");
    let seqs: Vec<u64> = batches.iter().map(|b| b["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|p| p[1] == p[0] + 1), "{seqs:?}");
    let stored: Vec<Value> = events(&batches).into_iter().filter(|e| e["type"] == "BlockStored").collect();
    assert!(!stored.is_empty(), "{batches:?}");
    let first = &stored[0];
    assert!(first["parent_block_hash"].is_null(), "the prompt's first block has no parent: {first}");
    let mut got: Vec<u64> = Vec::new();
    let mut hashes: Vec<u64> = Vec::new();
    for e in &stored {
        assert_eq!((e["block_size"].as_u64(), e["medium"].as_str()), (Some(16), Some("GPU")));
        let h: Vec<u64> = e["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let t: Vec<u64> = e["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(t.len(), 16 * h.len());
        if let Some(p) = e["parent_block_hash"].as_u64() {
            assert_eq!(Some(&p), hashes.last(), "each store continues the one before");
        }
        hashes.extend(h);
        got.extend(t);
    }
    let full = ids.len() / 16 * 16;
    assert_eq!(got[..full], ids[..full], "the stored blocks hold the prompt's tokens, in order");

    // The same prompt again: a prefix hit; none of its blocks is stored again.
    let hits = metric(&w, "vllm:prefix_cache_hits_total{model_name=\"SmolLM2-135M-Instruct\",engine=\"0\"}");
    complete(&w, &text);
    let again = events(&drain(&s, Duration::from_millis(500)));
    let restored: Vec<u64> = again
        .iter()
        .filter(|e| e["type"] == "BlockStored")
        .flat_map(|e| {
            e["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>()
        })
        .collect();
    assert!(restored.iter().all(|h| !hashes.contains(h)), "a cached block was stored again: {again:?}");
    assert!(
        metric(&w, "vllm:prefix_cache_hits_total{model_name=\"SmolLM2-135M-Instruct\",engine=\"0\"}") > hits
    );

    // More prompts than the pool holds: the first prompt's blocks are evicted, each one announced.
    let mut removed: Vec<u64> = Vec::new();
    for i in 2..12 {
        complete(&w, &prose(i));
        for e in events(&drain(&s, Duration::from_millis(300))) {
            if e["type"] == "BlockRemoved" {
                assert_eq!(e["medium"], "GPU");
                removed.extend(e["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()));
            }
        }
    }
    assert!(
        hashes.iter().all(|h| removed.contains(h)),
        "evicted blocks not all announced: {hashes:?} vs {removed:?}"
    );
    assert!(metric(&w, "kv_event_batches_total{result=\"published\"}") > 0.0);
    assert_eq!(metric(&w, "kv_event_batches_total{result=\"dropped\"}"), 0.0);
    assert_eq!(metric(&w, "kv_event_subscriber_connections"), 1.0);

    // A restart on the same ports: the new process numbers from 0, and its first batch clears
    // everything. The subscriber reconnects by itself; a replay from 0 recovers what it missed.
    drop(w);
    let w = start(port, pub_port, replay_port);
    complete(&w, &prose(50));
    let after = drain(&s, Duration::from_millis(800));
    if let Some(b) = after.first() {
        assert!(b["seq"].as_u64().unwrap() < 5, "the new process numbers from 0: {b}");
    }
    let mut s = s;
    s.send("replay 0");
    let mut replayed = Vec::new();
    loop {
        let v = s.next(Duration::from_secs(10));
        if v["replay_end"] == true {
            break;
        }
        replayed.push(v);
    }
    assert_eq!(replayed[0]["seq"], 0);
    assert_eq!(replayed[0]["events"], json!([{"type": "AllBlocksCleared"}]), "{:?}", replayed[0]);
    assert!(events(&replayed).iter().any(|e| e["type"] == "BlockStored"), "{replayed:?}");
    drop(w);
}

/// With a KV offload tier, an evicted block is announced as removed from the pool (`GPU`) and stored
/// in host memory (`CPU`), and a prompt that takes it back the other way round.
#[test]
fn offloaded_blocks_are_announced_in_the_medium_they_move_to() {
    let (port, pub_port, replay_port) = (free_port(), free_port(), free_port());
    let w = start_with(port, pub_port, replay_port, &["--kv-offloading-size", "0.1"]);
    let s = subscribe(&w, pub_port, replay_port, 2000);
    let hashes_of = |evs: &[Value], ty: &str, medium: &str| -> Vec<u64> {
        evs.iter()
            .filter(|e| e["type"] == ty && e["medium"] == medium)
            .flat_map(|e| {
                e["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>()
            })
            .collect()
    };
    let text = prose(1);
    complete(&w, &text);
    let first = events(&drain(&s, Duration::from_millis(500)));
    let pool = hashes_of(&first, "BlockStored", "GPU");
    assert!(!pool.is_empty(), "{first:?}");
    // More prompts than the pool holds: the first prompt's blocks leave the pool for host memory.
    let mut moved = Vec::new();
    for i in 2..12 {
        complete(&w, &prose(i));
        moved.extend(events(&drain(&s, Duration::from_millis(300))));
    }
    let (left, offloaded) =
        (hashes_of(&moved, "BlockRemoved", "GPU"), hashes_of(&moved, "BlockStored", "CPU"));
    assert!(pool.iter().all(|h| left.contains(h) && offloaded.contains(h)), "{pool:?}: {moved:?}");
    // The first prompt again: its blocks come back from host memory into the pool.
    complete(&w, &text);
    let back = events(&drain(&s, Duration::from_millis(500)));
    let (from_cpu, to_pool) =
        (hashes_of(&back, "BlockRemoved", "CPU"), hashes_of(&back, "BlockStored", "GPU"));
    // (All but possibly the last: a prompt's last token is always computed, never found cached.)
    let wanted = &pool[..pool.len() - 1];
    assert!(wanted.iter().all(|h| from_cpu.contains(h) && to_pool.contains(h)), "{pool:?}: {back:?}");
    assert!(metric(&w, "kv_offload_blocks_moved_total{move=\"restored\"}") >= wanted.len() as f64);
}

/// Precise prefix routing: a router given the model's tokenizer (`--tokenizer`) follows both
/// workers' events and sends a conversation's next round (with tools, so the router must render the
/// prompt exactly as the workers do) to the worker whose cache holds it, although the router never
/// sent it there (a client went to that worker directly): the answer's cached tokens cover the
/// history and `/debug/requests` says the match came from the events. By the prompts it routed
/// alone, the router would have picked the other worker (the first, both caches being empty to it).
/// That worker restarted, the router forgets what it held.
#[test]
fn the_router_routes_on_the_events_to_the_worker_holding_the_prompt_whoever_sent_it() {
    let ports: Vec<u16> = (0..6).map(|_| free_port()).collect();
    let start_events = |i: usize| {
        let cfg = json!({"enable_kv_cache_events": true, "endpoint": format!("tcp://*:{}", ports[2 + 2 * i]),
            "replay_endpoint": format!("tcp://*:{}", ports[3 + 2 * i]), "topic": format!("kv@{i}")})
        .to_string();
        let port = ports[i].to_string();
        Worker::start(&["--port", &port, "--kv-events-config", &cfg, "--speculative", "off"])
    };
    let mut workers = [start_events(0), start_events(1)];
    let (_, card) = workers[1].json("GET", "/v1/models", "");
    assert_eq!(card["data"][0]["kv_events"]["endpoint"], format!("tcp://*:{}", ports[4]), "{card}");
    let model = common::default_model();
    let router = common::router::RouterThread::start_with(
        &[(&workers[0], pdserve_router::Role::Unified), (&workers[1], pdserve_router::Role::Unified)],
        |c| c.tokenizer = Some(model.clone()),
    );
    let router_metric = |series: &str| -> f64 {
        let r = router.send("GET", "/metrics", "");
        let text = String::from_utf8(r.read_to_end().unwrap()).unwrap();
        text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
    };
    let known = |i: usize| -> (u64, Value) {
        let (_, list) = router.json("GET", "/workers", "");
        let url = format!("http://127.0.0.1:{}", ports[i]);
        let w = list["workers"].as_array().unwrap().iter().find(|w| w["url"] == url.as_str()).cloned();
        let w = w.unwrap_or_else(|| panic!("{url} in {list}"));
        (w["kv_event_blocks"].as_u64().unwrap_or(0), w["kv_event_history"].clone())
    };
    let blocks = |i: usize| known(i).0;
    let tools = json!([{"type": "function", "function": {"name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    let mut messages = json!([
        {"role": "system", "content": format!("You are a careful build assistant. {}", prose(900))},
        {"role": "user", "content": "What does the Makefile build? Read it first."},
    ]);
    // Round 1 straight to the second worker: the router never sees it.
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0}).to_string();
    let (s, v) = workers[1].json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{v}");
    let until = Instant::now() + Duration::from_secs(30);
    while blocks(1) < 8 {
        assert!(Instant::now() < until, "the router never indexed the second worker's blocks: {}", blocks(1));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(blocks(0), 0);
    assert!(router_metric("router_kv_event_batches_total{result=\"applied\"}") >= 2.0);
    // Round 2 through the router, streamed and held open while `/debug/requests` is read.
    let answer = v["choices"][0]["message"].clone();
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": answer["content"].as_str().unwrap_or(""), "tool_calls": answer.get("tool_calls").cloned().unwrap_or(json!([]))}),
        json!({"role": "user", "content": "Now run it."}),
    ]);
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 200, "ignore_eos": true,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: round-2\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let (mut buf, mut got) = ([0u8; 4096], Vec::new());
    while String::from_utf8_lossy(&got).matches("data: ").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let (_, dbg) = router.json("GET", "/debug/requests", "");
    let entry = dbg["requests"].as_array().unwrap().iter().find(|r| r["id"] == "round-2").unwrap().clone();
    let leg = &entry["routing"][0];
    assert_eq!(leg["worker"], format!("http://{}", workers[1].addr), "{entry}");
    assert_eq!(
        (leg["rule"].as_str(), leg["match_source"].as_str()),
        (Some("cache_match"), Some("kv_events")),
        "{entry}"
    );
    // The rest of the stream: its usage counts the history as cached.
    loop {
        let n = s.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..n]);
        if n == 0 || String::from_utf8_lossy(&got).contains("data: [DONE]") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .map(|c| c["usage"].clone())
        .unwrap_or_else(|| panic!("no usage in {text}"));
    let (cached, prompt) = (
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(cached * 10 >= prompt * 8, "most of the prompt was cached there: {usage}");
    // The second worker restarts on the same addresses: a new instance, its history whole from its
    // first batch, holding nothing of the conversation; the router forgets what the old one held.
    drop(s);
    let before = blocks(1);
    assert!(before >= 16, "{before}");
    let _ = workers[1].child.kill();
    let _ = workers[1].child.wait();
    workers[1] = start_events(1);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (n, history) = known(1);
        // (The router's own health probes store a block or two there.)
        if n < 8 && history == "whole" {
            break;
        }
        assert!(
            Instant::now() < until,
            "the router still counts {n} blocks ({history}) of the restarted worker"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
