//! The router beside SGLang's router in both its forms, each in front of the same nginx mock workers,
//! measured by `wrk` in the same run, alternating (ours, each peer, ours, each peer) so that the ratios
//! hold on a noisy machine: requests/s, p50/p99 latency and the router's CPU time per request, for round
//! robin and cache-aware, regular and PD mode, at 8 and 64 connections. The peers ([`PEERS`]) are
//! `sglang-router` (PyPI, the router as SGLang shipped it) and its successor the Shepherd Model
//! Gateway (PyPI `smg`, started as `smg launch` with the same arguments); every row and ratio names the
//! peer's version.
//!
//! As a floor for what any proxy can do on the machine, nginx itself as a reverse proxy (one process,
//! keep-alive upstreams, round robin) is measured in the regular round-robin cases too.
//!
//! Needs `nginx` and `wrk` on PATH (Debian: `apt-get install nginx wrk`). Each peer, pinned, lives in a
//! venv of its own at `$SGLANG_VENV` / `$SMG_VENV`, by default `~/.cache/pdserve/peers/<package>-<version>`;
//! the benchmark makes it with `python3 -m venv` and pip when it is missing, and leaves out a peer that
//! cannot be installed (or does not start), saying so.
//! Run with `cargo xtask bench router [--seconds N] [--reps N] [--peers sglang,smg]`. Writes
//! `target/bench/router.json`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PORTS: [u16; 4] = [18001, 18002, 18003, 18004];
const OURS: u16 = 30001;
const PEER: u16 = 30000;
const PROXY: u16 = 30002;

/// A router measured beside ours: a PyPI package, pinned, and how its venv starts it.
#[derive(Debug)]
struct Peer {
    /// The short name `--peers` takes.
    name: &'static str,
    package: &'static str,
    /// The PyPI version the figures were measured with.
    version: &'static str,
    /// The variable that names its venv instead of the default under `~/.cache/pdserve/peers/`.
    venv_var: &'static str,
    /// The Python module whose import proves the install.
    module: &'static str,
    /// The program in the venv's `bin/` and its arguments before the router's own.
    launch: (&'static str, &'static [&'static str]),
}

const PEERS: [Peer; 2] = [
    Peer {
        name: "sglang",
        package: "sglang-router",
        version: "0.3.2",
        venv_var: "SGLANG_VENV",
        module: "sglang_router",
        launch: ("python", &["-m", "sglang_router.launch_router"]),
    },
    Peer {
        name: "smg",
        package: "smg",
        version: "1.13.0",
        venv_var: "SMG_VENV",
        module: "smg",
        launch: ("smg", &["launch"]),
    },
];

impl Peer {
    /// The name every printed row and ratio carries: the package and its version.
    fn label(&self) -> String {
        format!("{} {}", self.package, self.version)
    }

    fn venv(&self) -> PathBuf {
        std::env::var_os(self.venv_var).map(PathBuf::from).unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
            home.join(format!(".cache/pdserve/peers/{}-{}", self.package, self.version))
        })
    }
}

/// nginx as a plain reverse proxy in front of the two regular mock workers: one process (no master),
/// upstream keep-alive, round robin.
fn proxy_conf(dir: &Path) -> String {
    format!(
        "worker_processes 1;\nmaster_process off;\ndaemon off;\npid {d}/proxy.pid;\nerror_log {d}/proxy-error.log warn;\n\
events {{ worker_connections 4096; multi_accept on; }}\n\
http {{\n    access_log off;\n    keepalive_requests 1000000;\n    keepalive_timeout 120s;\n    client_body_buffer_size 64k;\n\
    client_body_temp_path {d}/pbody;\n    proxy_temp_path {d}/pproxy;\n    fastcgi_temp_path {d}/pfcgi;\n    uwsgi_temp_path {d}/puwsgi;\n    scgi_temp_path {d}/pscgi;\n\
    upstream mock {{ server 127.0.0.1:{w1}; server 127.0.0.1:{w2}; keepalive 128; }}\n\
    server {{\n        listen 127.0.0.1:{port} backlog=4096;\n\
        location / {{ proxy_pass http://mock; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n    }}\n}}\n",
        d = dir.display(),
        w1 = PORTS[0],
        w2 = PORTS[1],
        port = PROXY
    )
}

fn nginx_conf(dir: &Path) -> String {
    let listen: String =
        PORTS.iter().map(|p| format!("        listen 127.0.0.1:{p} reuseport backlog=4096;\n")).collect();
    let chat = r#"{"id":"chatcmpl-mock","object":"chat.completion","created":0,"model":"mock-model","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from mock."},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":4,"total_tokens":12}}"#;
    // The prefill worker's answer in this project's PD protocol (SGLang's router ignores the body).
    let prefill = r#"{"pd_transfer":{"addr":"127.0.0.1:1","epoch":1,"shm":null,"transfer":1},"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
    let server_info = r#"{"model_path":"mock-model","tokenizer_path":"mock-model","served_model_name":"mock-model","dp_size":1,"tp_size":1,"disaggregation_mode":"$mock_role","disaggregation_bootstrap_port":8998,"version":"0.0.0-mock"}"#;
    format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
events {{ worker_connections 4096; multi_accept on; }}\n\
http {{\n    access_log off;\n    default_type application/json;\n    keepalive_requests 1000000;\n    keepalive_timeout 120s;\n\
    client_body_buffer_size 64k;\n    client_body_temp_path {d}/body;\n    proxy_temp_path {d}/proxy;\n    fastcgi_temp_path {d}/fcgi;\n    uwsgi_temp_path {d}/uwsgi;\n    scgi_temp_path {d}/scgi;\n\
    map $server_port $mock_role {{ 18003 prefill; 18004 decode; default worker; }}\n\
    server {{\n{listen}\
        location = /health {{ return 200 ''; }}\n\
        location = /health/live {{ return 200 '{{\"status\":\"live\"}}'; }}\n\
        location = /health/ready {{ return 200 '{{\"status\":\"ready\"}}'; }}\n\
        location = /health/generate {{ return 200 '{{\"status\":\"ok\"}}'; }}\n\
        location = /health_generate {{ return 200 ''; }}\n\
        location = /get_model_info {{ return 200 '{{\"model_path\":\"mock-model\",\"is_generation\":true}}'; }}\n\
        location = /model_info {{ return 200 '{{\"model_path\":\"mock-model\",\"is_generation\":true}}'; }}\n\
        location = /get_server_info {{ return 200 '{server_info}'; }}\n\
        location = /server_info {{ return 200 '{server_info}'; }}\n\
        location = /v1/models {{ return 200 '{{\"object\":\"list\",\"data\":[{{\"id\":\"mock-model\",\"object\":\"model\"}}]}}'; }}\n\
        location = /get_load {{ return 200 '[{{\"dp_rank\":0,\"num_reqs\":0,\"num_waiting_reqs\":0,\"num_tokens\":0}}]'; }}\n\
        location = /v1/chat/completions {{ if ($server_port = 18003) {{ return 200 '{prefill}'; }} return 200 '{chat}'; }}\n\
        location / {{ return 404 '{{\"error\":\"mock: no such endpoint\"}}'; }}\n\
    }}\n}}\n",
        d = dir.display()
    )
}

const LUA: &str = r#"
local filler = string.rep("The quick brown fox jumps over the lazy dog. ", 20)
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","stream":false,"max_tokens":16,"temperature":0,' ..
  '"messages":[{"role":"system","content":"You are a helpful assistant."},' ..
  '{"role":"user","content":"' .. filler .. '"}]}'
done = function(summary, latency, requests)
  io.write(string.format("RESULT p50_us=%d p99_us=%d requests=%d duration_us=%d non2xx=%d errors=%d\n",
    latency:percentile(50), latency:percentile(99), summary.requests, summary.duration,
    summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"#;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime), counted from the state field (3) after the command name.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Whether `port` answers a chat request within a minute.
fn routable(port: u16) -> bool {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = Command::new("curl")
            .args(["-sf", "-o", "/dev/null", "-X", "POST", "-H", "content-type: application/json", "-d"])
            .arg(r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#)
            .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    cpu_us_per_req: f64,
    non2xx: u64,
}

fn wrk(port: u16, conns: u32, secs: u32, lua: &Path, pid: u32) -> Sample {
    let t0 = cpu_ticks(pid);
    let out = Command::new("wrk")
        .args(["-t2", &format!("-c{conns}"), &format!("-d{secs}s"), "--latency", "-s"])
        .arg(lua)
        .arg(format!("http://127.0.0.1:{port}"))
        .output()
        .expect("wrk on PATH");
    let t1 = cpu_ticks(pid);
    let text = String::from_utf8_lossy(&out.stdout);
    let line =
        text.lines().find(|l| l.starts_with("RESULT")).unwrap_or_else(|| panic!("no wrk result: {text}"));
    let get = |k: &str| -> f64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let reqs = get("requests");
    Sample {
        rps: reqs / (get("duration_us") / 1e6),
        p50_ms: get("p50_us") / 1e3,
        p99_ms: get("p99_us") / 1e3,
        cpu_us_per_req: (t1 - t0) as f64 * 1e6 / clk_tck() / reqs.max(1.0),
        non2xx: (get("non2xx") + get("errors")) as u64,
    }
}

fn start_ours(pd: bool, policy: &str) -> Proc {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve-router"));
    c.args(["--port", &OURS.to_string(), "--policy", policy, "--probe-interval-s", "1"]);
    if pd {
        c.args(["--prefill", "http://127.0.0.1:18003", "--decode", "http://127.0.0.1:18004"]);
    } else {
        c.args(["--worker", "http://127.0.0.1:18001", "--worker", "http://127.0.0.1:18002"]);
    }
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("spawn pdserve-router");
    let out = child.stdout.take().expect("stdout");
    let _ = BufReader::new(out).lines().next();
    let p = Proc(child);
    assert!(routable(OURS), "pdserve-router never routed a request");
    p
}

/// Starts `peer` on [`PEER`]; `None` (and why, on stderr) if it never routes a request.
fn start_peer(peer: &Peer, pd: bool, policy: &str) -> Option<Proc> {
    let (program, pre) = peer.launch;
    let mut c = Command::new(peer.venv().join("bin").join(program));
    c.args(pre).args([
        "--host",
        "127.0.0.1",
        "--port",
        &PEER.to_string(),
        "--policy",
        policy,
        "--log-level",
        "warn",
    ]);
    if pd {
        c.args([
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:18003",
            "8998",
            "--decode",
            "http://127.0.0.1:18004",
        ]);
    } else {
        c.args(["--worker-urls", "http://127.0.0.1:18001", "http://127.0.0.1:18002"]);
    }
    let p = Proc(c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().ok()?);
    if routable(PEER) {
        Some(p)
    } else {
        eprintln!(
            "{} never routed a request ({} mode, {policy}): left out of this case",
            peer.label(),
            if pd { "pd" } else { "regular" }
        );
        None
    }
}

/// The median (the mean of the middle two for an even count); 0 for none.
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Makes the peer's venv if it is missing; false (and why, on stderr) when that fails.
fn ensure_peer(peer: &Peer) -> bool {
    let venv = peer.venv();
    let python = venv.join("bin/python");
    let installed = || {
        Command::new(&python)
            .args(["-c", &format!("import {}", peer.module)])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if installed() {
        return true;
    }
    eprintln!("installing {}=={} into {} (once)", peer.package, peer.version, venv.display());
    let made = Command::new("python3").arg("-m").arg("venv").arg(&venv).status().is_ok_and(|s| s.success())
        && Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("{}=={}", peer.package, peer.version))
            .status()
            .is_ok_and(|s| s.success());
    if !(made && installed()) {
        eprintln!("{} could not be installed in {}: left out", peer.label(), venv.display());
        return false;
    }
    true
}

fn arg(name: &str, default: u32) -> u32 {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

/// The peers `--peers a,b` names (default: all of [`PEERS`]).
fn chosen_peers() -> Vec<&'static Peer> {
    let args: Vec<String> = std::env::args().collect();
    let Some(list) = args.windows(2).find(|w| w[0] == "--peers").map(|w| w[1].clone()) else {
        return PEERS.iter().collect();
    };
    let names: Vec<&str> = list.split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
    for n in &names {
        assert!(PEERS.iter().any(|p| p.name == *n), "unknown peer {n:?}; peers: sglang, smg");
    }
    PEERS.iter().filter(|p| names.contains(&p.name)).collect()
}

/// The median (over repetitions) of one field of the samples.
fn med(v: &[Sample], f: fn(&Sample) -> f64) -> f64 {
    median(v.iter().map(f).collect())
}

fn print_row(who: &str, conns: u32, v: &[Sample]) {
    println!(
        "{:<44} {:>5} {:>10.0} {:>9.3} {:>9.3} {:>12.1} {:>7}",
        who,
        conns,
        med(v, |s| s.rps),
        med(v, |s| s.p50_ms),
        med(v, |s| s.p99_ms),
        med(v, |s| s.cpu_us_per_req),
        v.iter().map(|s| s.non2xx).sum::<u64>()
    );
}

/// Each repetition is a pair (ours, then the peer): the ratio's median and its spread.
fn pairs(ours: &[Sample], peer: &[Sample], f: fn(&Sample) -> f64) -> String {
    let r: Vec<f64> = ours.iter().zip(peer).map(|(a, b)| f(a) / f(b)).collect();
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(0.0, f64::max);
    format!("{:.2}x (pairs {lo:.2}-{hi:.2})", median(r))
}

fn samples_json(v: &[Sample]) -> Vec<serde_json::Value> {
    v.iter()
        .map(|s| serde_json::json!({"rps": s.rps, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "cpu_us_per_req": s.cpu_us_per_req, "non2xx": s.non2xx}))
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let secs = arg("--seconds", 8);
    let reps = arg("--reps", 2);
    let dir = std::env::temp_dir().join(format!("pdserve-bench-router-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    std::fs::write(dir.join("nginx.conf"), nginx_conf(&dir)).expect("conf");
    let lua = dir.join("chat.lua");
    std::fs::write(&lua, LUA).expect("lua");
    std::fs::write(dir.join("proxy.conf"), proxy_conf(&dir)).expect("proxy conf");
    let nginx_with = |conf: &str| {
        Proc(
            Command::new("nginx")
                .args(["-p", &dir.display().to_string(), "-c"])
                .arg(dir.join(conf))
                .stderr(Stdio::inherit())
                .spawn()
                .expect("nginx on PATH"),
        )
    };
    let nginx = nginx_with("nginx.conf");
    let proxy = nginx_with("proxy.conf");
    std::thread::sleep(Duration::from_millis(500));
    assert!(routable(PROXY), "the nginx proxy never routed a request");
    let peers: Vec<&Peer> = chosen_peers().into_iter().filter(|p| ensure_peer(p)).collect();
    println!(
        "peers: {}",
        if peers.is_empty() {
            "none".to_owned()
        } else {
            peers.iter().map(|p| p.label()).collect::<Vec<_>>().join(", ")
        }
    );
    println!(
        "{:<44} {:>5} {:>10} {:>9} {:>9} {:>12} {:>7}",
        "case", "conns", "req/s", "p50 ms", "p99 ms", "cpu us/req", "non2xx"
    );
    let mut results = Vec::new();
    for pd in [false, true] {
        for policy in ["round_robin", "cache_aware"] {
            for conns in [8u32, 64] {
                let mode = if pd { "pd" } else { "regular" };
                let mut ours_s = Vec::new();
                // Per peer: the repetitions it ran in (its pairs with ours) and its samples.
                let mut peer_s: Vec<(Vec<usize>, Vec<Sample>)> = vec![(Vec::new(), Vec::new()); peers.len()];
                let mut proxy_s = Vec::new();
                let with_proxy = !pd && policy == "round_robin";
                for rep in 0..reps as usize {
                    {
                        let p = start_ours(pd, policy);
                        ours_s.push(wrk(OURS, conns, secs, &lua, p.0.id()));
                    }
                    for (peer, (at, got)) in peers.iter().zip(&mut peer_s) {
                        if let Some(p) = start_peer(peer, pd, policy) {
                            got.push(wrk(PEER, conns, secs, &lua, p.0.id()));
                            at.push(rep);
                        }
                    }
                    if with_proxy {
                        proxy_s.push(wrk(PROXY, conns, secs, &lua, proxy.0.id()));
                    }
                }
                print_row(&format!("pdserve {mode} {policy}"), conns, &ours_s);
                for (peer, (_, got)) in peers.iter().zip(&peer_s) {
                    if !got.is_empty() {
                        print_row(&format!("{} {mode} {policy}", peer.label()), conns, got);
                    }
                }
                if with_proxy {
                    print_row(&format!("nginx-proxy {mode} {policy}"), conns, &proxy_s);
                }
                for (peer, (at, got)) in peers.iter().zip(&peer_s) {
                    if got.is_empty() {
                        continue;
                    }
                    let ours_paired: Vec<Sample> = at.iter().map(|&r| ours_s[r]).collect();
                    println!(
                        "{:<44} {:>5} {:>10} ratio req/s {}, cpu/req {}",
                        format!("  pdserve / {}", peer.label()),
                        conns,
                        "",
                        pairs(&ours_paired, got, |s| s.rps),
                        pairs(&ours_paired, got, |s| s.cpu_us_per_req)
                    );
                    if with_proxy {
                        let floor = med(&proxy_s, |s| s.rps) / med(got, |s| s.rps);
                        println!(
                            "{:<44} {:>5} {:>10} req/s {floor:.2}x",
                            format!("  nginx-proxy / {}", peer.label()),
                            conns,
                            ""
                        );
                    }
                }
                let peer_json: Vec<serde_json::Value> = peers
                    .iter()
                    .zip(&peer_s)
                    .map(|(p, (at, got))| {
                        serde_json::json!({
                            "peer": p.package, "version": p.version, "repetitions": at, "samples": samples_json(got),
                        })
                    })
                    .collect();
                results.push(serde_json::json!({
                    "mode": mode, "policy": policy, "connections": conns,
                    "ours": samples_json(&ours_s), "peers": peer_json, "nginx_proxy": samples_json(&proxy_s),
                }));
            }
        }
    }
    drop(proxy);
    drop(nginx);
    let doc = serde_json::json!({
        "seconds": secs,
        "repetitions": reps,
        "peers": peers.iter().map(|p| serde_json::json!({"package": p.package, "version": p.version})).collect::<Vec<_>>(),
        "cases": results,
    });
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&out);
    let _ = std::fs::write(out.join("router.json"), serde_json::to_string_pretty(&doc).unwrap_or_default());
    let _ = std::fs::remove_dir_all(&dir);
}
