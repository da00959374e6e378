//! KV over UCX (`--kv-transport ucx`, feature `ucx`) between real worker processes, through the
//! router: the same greedy text as a unified worker, blocks read out of the prefill worker's memory by
//! the decode worker, on one host (UCX's shared-memory transports) and between two network namespaces
//! over veth (`UCX_TLS=tcp`); after aborted requests and a killed prefill worker, every ledger is back
//! to its baseline. Run by `cargo xtask test` as `cargo test -p pdserve-server --features ucx --test
//! ucx` (needs libucx-dev, and root for the namespaces).
#![cfg(feature = "ucx")]

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::router::RouterThread;
use common::{chat, Worker};
use pdserve_router::Role;

/// One test at a time: the namespace test adds network interfaces to this host, and UCX processes
/// started before and after such a change may not agree which of them reach each other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A series of a worker's `/metrics` (0 when absent: counters appear with their first count).
fn metric(w: &Worker, series: &str) -> f64 {
    let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until neither worker holds a KV block for a sequence or a transfer, nor a live transfer.
fn back_to_baseline(workers: &[&Worker]) {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let held: f64 = workers
            .iter()
            .map(|w| {
                metric(w, "kv_blocks{owner=\"sequence\"}")
                    + metric(w, "kv_blocks{owner=\"transfer\"}")
                    + metric(w, "kv_transfers_in_flight")
                    + metric(w, "requests_running")
            })
            .sum();
        if held == 0.0 {
            return;
        }
        assert!(Instant::now() < until, "{held} blocks, transfers or requests still held");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each prompt's greedy answer through the PD pair equals the unified worker's.
fn same_text_as_unified(unified: &Worker, router: &RouterThread) {
    for p in ["What is the capital of France?", "Write one sentence about the sea.", "Name a fruit."] {
        let body = chat(p, r#","temperature":0,"max_tokens":24"#);
        let (s, want) = unified.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{want}");
        let (s, got) = router.json("POST", "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{got}");
        assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"], "{p}");
    }
}

/// Requests whose clients leave mid-stream (the router aborts them on both workers).
fn abandoned_streams(router: &RouterThread, n: usize) {
    for i in 0..n {
        let body = chat(
            &format!("Story {i}: tell me about the sea."),
            r#","max_tokens":200,"ignore_eos":true,"stream":true"#,
        );
        let mut s = TcpStream::connect(router.addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        while !String::from_utf8_lossy(&got).contains("data: ") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "the stream ended before its first event");
            got.extend_from_slice(&buf[..n]);
        }
        drop(s);
    }
}

#[test]
fn pd_over_ucx_on_one_host_equals_unified_and_recovers_from_aborts_and_a_killed_prefill_worker() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let unified = Worker::start(&[]);
    let prefill = Worker::start(&["--role", "prefill", "--kv-transport", "ucx"]);
    let decode = Worker::start(&["--role", "decode", "--kv-transport", "ucx"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    same_text_as_unified(&unified, &router);
    // The decode worker read the blocks out of the prefill worker's memory: none came inline.
    let (read, inline) = (
        metric(&decode, "kv_transfer_bytes_total{direction=\"shared\"}"),
        metric(&decode, "kv_transfer_bytes_total{direction=\"received\"}"),
    );
    assert!(read > 0.0 && inline == 0.0, "read {read} bytes through UCX, {inline} inline");
    abandoned_streams(&router, 4);
    back_to_baseline(&[&prefill, &decode]);
    same_text_as_unified(&unified, &router);
    let inline = metric(&decode, "kv_transfer_bytes_total{direction=\"received\"}");
    assert_eq!(inline, 0.0, "after the aborts, blocks came inline: UCX stopped reaching the prefill worker");
    // The prefill worker dies with a request's KV offered: the decode side lets go of everything.
    let body =
        chat("Tell me a long story about a dragon.", r#","max_tokens":300,"ignore_eos":true,"stream":true"#);
    let mut r = router.send("POST", "/v1/chat/completions", &body);
    assert_eq!(r.status(), 200);
    prefill.signal("-KILL");
    while let Ok(Some(_)) = r.next_chunk() {}
    back_to_baseline(&[&decode]);
    assert_eq!(metric(&decode, "kv_blocks{owner=\"transfer\"}"), 0.0);
}

/// Network namespaces, deleted (with their veth links) when dropped.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip (iproute2) is needed");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn pd_over_ucx_between_network_namespaces_over_veth_equals_unified() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Two hosts: prefill in one namespace, decode in another, a veth link between them for UCX, and
    // one from each to the root namespace, where the router and the test run.
    let tag = std::process::id() % 10000;
    let (np, nd) = (format!("uxp{tag}"), format!("uxd{tag}"));
    let ns = Namespaces(vec![np.clone(), nd.clone()]);
    for n in &ns.0 {
        ip(&["netns", "add", n]);
        ip(&["-n", n, "link", "set", "lo", "up"]);
    }
    let links = [
        (format!("uxrp{tag}"), None, "10.81.1.1/24", format!("uxpr{tag}"), &np, "10.81.1.2/24"),
        (format!("uxrd{tag}"), None, "10.81.2.1/24", format!("uxdr{tag}"), &nd, "10.81.2.2/24"),
        (format!("uxpd{tag}"), Some(&np), "10.81.3.1/24", format!("uxdp{tag}"), &nd, "10.81.3.2/24"),
    ];
    for (a, a_ns, a_ip, b, b_ns, b_ip) in &links {
        ip(&["link", "add", a, "type", "veth", "peer", "name", b]);
        ip(&["link", "set", b, "netns", b_ns]);
        ip(&["-n", b_ns, "addr", "add", b_ip, "dev", b]);
        ip(&["-n", b_ns, "link", "set", b, "up"]);
        match a_ns {
            Some(n) => {
                ip(&["link", "set", a, "netns", n]);
                ip(&["-n", n, "addr", "add", a_ip, "dev", a]);
                ip(&["-n", n, "link", "set", a, "up"]);
            }
            None => {
                ip(&["addr", "add", a_ip, "dev", a]);
                ip(&["link", "set", a, "up"]);
            }
        }
    }
    // UCX over TCP on the link between the two hosts only, as an operator points it at the fast NIC.
    let (pd_link, dp_link) = (links[2].0.clone(), links[2].3.clone());
    let prefill = Worker::start_in(
        Some((&np, "10.81.1.2")),
        &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", &pd_link)],
        &[
            "--role",
            "prefill",
            "--kv-transport",
            "ucx",
            "--host",
            "0.0.0.0",
            // The two namespaces' private links: open, as on a trusted network.
            "--allow-unauthenticated",
            "--transfer-addr",
            "10.81.3.1:0",
        ],
    );
    let decode = Worker::start_in(
        Some((&nd, "10.81.2.2")),
        &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", &dp_link)],
        &["--role", "decode", "--kv-transport", "ucx", "--host", "0.0.0.0", "--allow-unauthenticated"],
    );
    let unified = Worker::start(&[]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    same_text_as_unified(&unified, &router);
    let read = metric(&decode, "kv_transfer_bytes_total{direction=\"shared\"}");
    assert!(read > 0.0, "no block was read through UCX across the namespaces");
    abandoned_streams(&router, 2);
    back_to_baseline(&[&prefill, &decode]);
    drop((router, prefill, decode));
    for (a, a_ns, ..) in &links {
        if a_ns.is_none() {
            let _ = Command::new("ip").args(["link", "del", a]).output();
        }
    }
    drop(ns);
}

/// DeepSeek V4 (its compact KV: compressed rows in blocks, each request's windows and partial groups
/// in a state slot moved as that slot's blocks) through prefill and decode over UCX on one host: the
/// unified worker's log-probabilities, its state read out of the prefill worker's memory too.
#[test]
fn deepseek_v4_pd_over_ucx_equals_unified() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tiny-v4-ucx-{}", std::process::id()));
    let config = serde_json::json!({"vocab_size": 49152, "max_position_embeddings": 8192});
    common::fixtures::checkpoint("deepseek_v4_reference.py", &dir, &config);
    let model = dir.to_str().unwrap();
    let unified = Worker::start(&["--model", model]);
    let prefill = Worker::start(&["--model", model, "--role", "prefill", "--kv-transport", "ucx"]);
    let decode = Worker::start(&["--model", model, "--role", "decode", "--kv-transport", "ucx"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    for len in [20u32, 300] {
        let ids: Vec<u32> = (0..len).map(|i| 200 + (i * 997) % 20_000).collect();
        let body = serde_json::json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 1})
            .to_string();
        let (s, want) = unified.json("POST", "/v1/completions", &body);
        assert_eq!(s, 200, "{want}");
        let (s, got) = router.json("POST", "/v1/completions", &body);
        assert_eq!(s, 200, "{got}");
        let lp = |v: &serde_json::Value| v["choices"][0]["logprobs"]["token_logprobs"].clone();
        assert_eq!(lp(&got), lp(&want), "{len} tokens: PD over UCX differs from unified");
    }
    let read = metric(&decode, "kv_transfer_bytes_total{direction=\"shared\"}");
    assert!(read > 0.0, "read {read} bytes through UCX");
    drop((router, prefill, decode, unified));
    std::fs::remove_dir_all(&dir).unwrap();
}
