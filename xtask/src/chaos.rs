//! `cargo xtask chaos [NAME ...] [--short]`: faults against real processes (the router in front of a
//! prefill and a decode worker), each scenario with assertions: every request sent got a terminal
//! outcome within its deadline plus 1 s; `/health/ready` told the truth; requests after recovery
//! succeed; KV, transfer and request ledgers return to their baseline; no process other than the one
//! killed exited. One table row per scenario.

use std::io::{Read, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use pdserve_loadgen::{run_point, Conn, Load, Outcome, Progress, Shape, Slo, Target};

use crate::serve::{stop_all, Proc};
use crate::where_::{call, get};

const SCENARIOS: &[&str] = &[
    "decode_kill",
    "prefill_kill",
    "decode_stall",
    "disconnect_storm",
    "slowloris",
    "overload",
    "hung_worker",
    "restart_readd",
    "bad_input",
    "long_context",
    "soak",
    "netns_partition",
];

/// The scenarios CI runs (`cargo xtask test`), in their short form.
pub(crate) const CI_SCENARIOS: &[&str] = &["decode_kill", "disconnect_storm", "hung_worker"];

struct Stack {
    procs: Vec<Proc>,
    router: String,
    logs: PathBuf,
    bins: (PathBuf, PathBuf),
    model: PathBuf,
}

impl Stack {
    fn start(name: &str, router_extra: &[&str], bins: &(PathBuf, PathBuf), model: &Path) -> Result<Stack> {
        let logs = crate::workspace_root().join("target/chaos").join(name);
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs)?;
        let mut s = Stack {
            procs: Vec::new(),
            router: String::new(),
            logs,
            bins: bins.clone(),
            model: model.to_owned(),
        };
        let p = s.worker("prefill-0", "prefill")?;
        s.procs.push(p);
        let d = s.worker("decode-0", "decode")?;
        s.procs.push(d);
        let mut args: Vec<String> = vec![
            "--port".into(),
            "0".into(),
            "--probe-interval-s".into(),
            "0.5".into(),
            "--probe-timeout-s".into(),
            "2".into(),
            "--prefill".into(),
            s.procs[0].url.clone(),
            "--decode".into(),
            s.procs[1].url.clone(),
        ];
        args.extend(router_extra.iter().map(|a| (*a).to_owned()));
        let r = Proc::start("router", &s.bins.1, &args, &s.logs)?;
        s.router = r.url.clone();
        s.procs.push(r);
        s.wait_ready(true, Duration::from_secs(60))?;
        Ok(s)
    }

    fn worker(&self, name: &str, role: &str) -> Result<Proc> {
        let mut args = worker_args(name, role, &self.model);
        if role == "prefill" {
            args.push("--kv-shm".into());
        }
        Proc::start(name, &self.bins.0, &args, &self.logs)
    }

    fn url_of(&self, name: &str) -> String {
        self.procs.iter().find(|p| p.name == name).map(|p| p.url.clone()).unwrap_or_default()
    }

    fn signal(&self, name: &str, sig: &str) -> Result<()> {
        let p = self.procs.iter().find(|p| p.name == name).context("no such process")?;
        let ok = Command::new("kill").args([sig, &p.child.id().to_string()]).status()?.success();
        ensure!(ok, "kill {sig} {name} failed");
        Ok(())
    }

    fn ready(&self) -> bool {
        crate::serve::http_status(&self.router, "/health/ready") == Some(200)
    }

    fn wait_ready(&self, want: bool, within: Duration) -> Result<Duration> {
        let t = Instant::now();
        while self.ready() != want {
            ensure!(t.elapsed() < within, "router ready stayed {} for {within:?}", !want);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(t.elapsed())
    }

    /// Every process except `killed` still runs.
    fn all_alive_but(&mut self, killed: &[&str]) -> Result<()> {
        for p in self.procs.iter_mut() {
            if killed.contains(&p.name.as_str()) {
                continue;
            }
            if let Some(status) = p.child.try_wait()? {
                bail!("{}", p.death_report(status));
            }
        }
        Ok(())
    }

    /// Ledgers, KV blocks, transfers and the router's upstream connections back to their baseline
    /// everywhere, within 15 s.
    /// After a fault: requests succeed again, no process but `dead` exited, and every ledger and KV
    /// gauge is back to zero.
    fn recovered(&mut self, dead: &[&str]) -> Result<()> {
        after_recovery(&self.router)?;
        self.all_alive_but(dead)?;
        self.baseline(dead)
    }

    fn baseline(&self, skip: &[&str]) -> Result<()> {
        let t = Instant::now();
        loop {
            let mut left = Vec::new();
            let (_, body) = get(&self.router, "/debug/requests")?;
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            let n = v["requests"].as_array().map_or(0, Vec::len);
            if n > 0 {
                left.push(format!("router: {n} live requests"));
            }
            // Every upstream connection the router holds is back in its pool (none left busy).
            let (_, body) = get(&self.router, "/workers")?;
            let w: serde_json::Value = serde_json::from_slice(&body)?;
            for w in w["workers"].as_array().into_iter().flatten() {
                let busy = w["connections"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(w["idle_connections"].as_u64().unwrap_or(0));
                let in_flight = w["in_flight"].as_u64().unwrap_or(0);
                if busy > 0 || in_flight > 0 {
                    left.push(format!(
                        "router -> {}: {busy} busy connections, {in_flight} in flight",
                        w["url"]
                    ));
                }
            }
            for p in self.procs.iter().filter(|p| p.name != "router" && !skip.contains(&p.name.as_str())) {
                let (_, m) = get(&p.url, "/metrics")?;
                let m = String::from_utf8_lossy(&m);
                for key in [
                    "kv_blocks{owner=\"sequence\"}",
                    "kv_blocks{owner=\"transfer\"}",
                    "kv_transfers_in_flight",
                    "requests_running",
                    "requests_waiting",
                ] {
                    let val = m
                        .lines()
                        .find_map(|l| l.strip_prefix(key).map(str::trim))
                        .and_then(|v| v.parse::<f64>().ok());
                    if val.is_some_and(|x| x != 0.0) {
                        left.push(format!("{}: {key} = {}", p.name, val.unwrap_or_default()));
                    }
                }
            }
            if left.is_empty() {
                return Ok(());
            }
            ensure!(
                t.elapsed() < Duration::from_secs(15),
                "not back to baseline after 15 s: {}",
                left.join("; ")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn add_worker(&self, url: &str, role: &str) -> Result<()> {
        let body = format!(r#"{{"url":"{url}","role":"{role}"}}"#);
        let (s, b) = call("POST", &self.router, "/workers", body.as_bytes())?;
        ensure!(s == 201, "POST /workers answered {s}: {}", String::from_utf8_lossy(&b));
        Ok(())
    }

    /// Starts `new` in `role`, adds it to the router and removes `old` (dead or alive).
    fn replace_worker(&mut self, old: &str, new: &str, role: &str) -> Result<()> {
        let p = self.worker(new, role)?;
        let url = p.url.clone();
        self.procs.push(p);
        self.add_worker(&url, role)?;
        self.remove_worker(&self.url_of(old))
    }

    fn remove_worker(&self, url: &str) -> Result<()> {
        let (s, b) = call("DELETE", &self.router, &format!("/workers?url={url}"), b"")?;
        ensure!(s == 200, "DELETE /workers answered {s}: {}", String::from_utf8_lossy(&b));
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        stop_all(&mut self.procs, Duration::from_secs(10));
    }
}

/// What a scenario reports for its table row.
#[derive(Debug, Default)]
struct Row {
    sent: usize,
    completed: usize,
    errors: usize,
    hung: usize,
    note: String,
}

fn shape(max_tokens: u64, timeout_s: f64) -> Shape {
    Shape {
        prompt_words: 30,
        max_tokens,
        timeout: Duration::from_secs_f64(timeout_s),
        grace: Duration::from_secs(1),
        ..Shape::default()
    }
}

fn chat_body(max_tokens: u64, timeout_s: f64, i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "messages": [{"role": "user", "content": format!("Story {i}: tell me about {}", pdserve_loadgen::words(20, i as u64))}],
        "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "timeout": timeout_s,
    }))
    .unwrap_or_default()
}

/// `n` streams at once, each in its own thread; `during` runs while they stream.
/// A worker's arguments in every scenario: the served configuration (`cargo xtask serve`: Q4 decode
/// weights, bf16 multi-row steps) with a small KV cache.
fn worker_args(name: &str, role: &str, model: &Path) -> Vec<String> {
    let mut args: Vec<String> =
        ["--port", "0", "--name", name, "--role", role, "--kv-blocks", "512", "--weights", "q4", "--model"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
    args.push(model.display().to_string());
    args
}

fn streams(router: &str, n: usize, max_tokens: u64, timeout_s: f64, during: impl FnOnce()) -> Vec<Outcome> {
    let addr: SocketAddr = router.trim_start_matches("http://").parse().expect("router address");
    let handles: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let mut c = Conn::new(addr);
                let deadline = Instant::now() + Duration::from_secs_f64(timeout_s);
                c.request(
                    "/v1/chat/completions",
                    &chat_body(max_tokens, timeout_s, i),
                    deadline,
                    Duration::from_secs(1),
                    None,
                )
            })
        })
        .collect();
    during();
    handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
}

fn tally(outcomes: &[Outcome]) -> Row {
    Row {
        sent: outcomes.len(),
        completed: outcomes.iter().filter(|o| o.ok()).count(),
        errors: outcomes.iter().filter(|o| !o.ok() && !o.hung).count(),
        hung: outcomes.iter().filter(|o| o.hung || !o.terminal).count(),
        note: String::new(),
    }
}

/// A few requests after recovery, every one of which must succeed.
fn after_recovery(router: &str) -> Result<()> {
    let t = Target::parse(router).map_err(anyhow::Error::msg)?;
    let r = run_point(
        &t,
        &Load::Closed { concurrency: 2, requests: 4 },
        &shape(8, 30.0),
        &Slo::default(),
        &Progress::quiet(),
    );
    ensure!(r.ok == 4, "after recovery only {} of 4 requests succeeded: {:?}", r.ok, r.errors);
    Ok(())
}

fn decode_kill(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 8 } else { 32 };
    kill_and_replace(s, "decode", n, 400, Duration::from_millis(1500), "")
}

/// Kills the only worker of `role` (`ROLE-0`) with SIGKILL `after` into `n` streams of `max_tokens`,
/// and asserts: every stream ends, readiness drops within 5 s, a replacement (`ROLE-1`, added through
/// `/workers`) brings readiness back, requests succeed again, nothing else died, ledgers return to
/// zero. `also` goes into the row's note between the two readiness figures.
fn kill_and_replace(
    s: &mut Stack,
    role: &str,
    n: usize,
    max_tokens: u64,
    after: Duration,
    also: &str,
) -> Result<Row> {
    let (dead, fresh) = (format!("{role}-0"), format!("{role}-1"));
    let mut not_ready_after = Duration::ZERO;
    let outcomes = streams(&s.router.clone(), n, max_tokens, 60.0, || {
        std::thread::sleep(after);
        let _ = s.signal(&dead, "-KILL");
        not_ready_after = s.wait_ready(false, Duration::from_secs(5)).unwrap_or(Duration::MAX);
    });
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    ensure!(not_ready_after < Duration::from_secs(5), "still ready after the only {role} worker died");
    s.replace_worker(&dead, &fresh, role)?;
    let back = s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[&dead])?;
    row.note = format!(
        "not ready {} ms after the kill; {also}ready {} ms after a new {role} worker joined",
        not_ready_after.as_millis(),
        back.as_millis()
    );
    Ok(row)
}

fn decode_stall(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 4 } else { 16 };
    let stall = if short { 5 } else { 10 };
    let mut saw_not_ready = false;
    let outcomes = streams(&s.router.clone(), n, 200, 6.0, || {
        std::thread::sleep(Duration::from_millis(800));
        let _ = s.signal("decode-0", "-STOP");
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(stall) {
            saw_not_ready |= !s.ready();
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = s.signal("decode-0", "-CONT");
    });
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    ensure!(saw_not_ready, "the router stayed ready while the only decode worker was stopped");
    let back = s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[])?;
    row.note = format!(
        "stalled {stall} s; not ready during the stall; ready again {} ms after SIGCONT",
        back.as_millis()
    );
    Ok(row)
}

fn disconnect_storm(s: &mut Stack, short: bool) -> Result<Row> {
    let total = if short { 60 } else { 500 };
    let addr: SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let next = Arc::clone(&next);
            std::thread::spawn(move || {
                let mut dropped = 0usize;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return dropped;
                    }
                    let Ok(mut c) = TcpStream::connect(addr) else { continue };
                    let body = chat_body(64, 30.0, i);
                    let _ = write!(
                        c,
                        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = c.write_all(&body);
                    // Leave at a point that depends on i: at once (before or during the prefill leg and
                    // the transfer), or after some events of the stream.
                    let events = i % 7;
                    let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
                    let mut seen = 0;
                    let mut buf = [0u8; 4096];
                    if events == 0 {
                        std::thread::sleep(Duration::from_millis((i % 5) as u64 * 20));
                    }
                    while seen < events {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => seen += buf[..n].windows(5).filter(|w| w == b"data:").count(),
                        }
                    }
                    drop(c);
                    dropped += 1;
                }
            })
        })
        .collect();
    let dropped: usize = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    s.baseline(&[])?;
    after_recovery(&s.router)?;
    s.all_alive_but(&[])?;
    Ok(Row {
        sent: total,
        completed: 0,
        errors: 0,
        hung: 0,
        note: format!("{dropped} clients left at random points; every ledger back to zero"),
    })
}

fn overload(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router).map_err(anyhow::Error::msg)?;
    let secs = if short { 10.0 } else { 30.0 };
    // Well past what the stack sustains (about 10 requests/s of this shape with Q4 weights on 2 vCPUs).
    let rate = 32.0;
    let load = Load::Poisson { rate, duration: Duration::from_secs_f64(secs), connections: 128 };
    let r = run_point(&t, &load, &shape(16, 15.0), &Slo::default(), &Progress::quiet());
    ensure!(r.hung == 0, "{} hung requests under overload", r.hung);
    let refused: u64 =
        r.errors.iter().filter(|(k, _)| k.starts_with("429") || k.starts_with("503")).map(|(_, v)| v).sum();
    ensure!(
        refused > 0 || r.ok == r.sent,
        "overload produced neither refusals nor only successes: {:?}",
        r.errors
    );
    s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[])?;
    let errs: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(Row {
        sent: r.sent as usize,
        completed: r.ok as usize,
        errors: (r.sent - r.ok) as usize,
        hung: 0,
        note: format!(
            "{rate} req/s for {secs} s into 8 in flight + 8 queued; {:.1} req/s completed, the rest answered {}",
            r.ok as f64 / secs,
            errs.join(" ")
        ),
    })
}

fn prefill_kill(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 8 } else { 24 };
    // Long prompts keep the prefill worker busy (prefilling, holding and handing over KV) when it dies.
    kill_and_replace(s, "prefill", n, 64, Duration::from_millis(700), "the decode worker dropped its pulls; ")
}

fn slowloris(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 200 } else { 1000 };
    let addr: SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let mut held = Vec::new();
    for i in 0..n {
        let mut c = TcpStream::connect(addr)?;
        // Half a request head, never finished; every tenth connection sends nothing at all.
        if i % 10 != 0 {
            let _ = c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-le");
        }
        held.push(c);
    }
    // Normal traffic is served while they sit there.
    let t = Instant::now();
    after_recovery(&s.router)?;
    let served_in = t.elapsed();
    // The router cuts them off at its head deadline (408) instead of holding them forever.
    let mut answered = 0;
    for c in held.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut buf = [0u8; 64];
        match c.read(&mut buf) {
            Ok(0) => answered += 1,
            Ok(k) if buf[..k].starts_with(b"HTTP/1.1 408") => answered += 1,
            _ => {}
        }
    }
    ensure!(answered == n, "only {answered} of {n} stalled connections were cut off");
    s.all_alive_but(&[])?;
    s.baseline(&[])?;
    Ok(Row {
        sent: n,
        completed: 4,
        errors: 0,
        hung: 0,
        note: format!("{n} half-sent requests held open; 4 normal requests served in {} ms meanwhile; all {n} cut off (408 or close) at the head deadline", served_in.as_millis()),
    })
}

fn bad_input(s: &mut Stack, _short: bool) -> Result<Row> {
    let raw: Vec<(&str, Vec<u8>)> = vec![
        ("broken request line", b"GARBAGE\r\n\r\n".to_vec()),
        ("HTTP/9", b"GET / HTTP/9.0\r\n\r\n".to_vec()),
        (
            "bad chunk size",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
                .to_vec(),
        ),
        ("header flood", {
            let mut v = b"GET /health/live HTTP/1.1\r\n".to_vec();
            for i in 0..200 {
                v.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
            }
            v.extend_from_slice(b"\r\n");
            v
        }),
        (
            "body longer than declared",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}}}}}".to_vec(),
        ),
        ("null bytes in the head", b"GET /health\x00/live HTTP/1.1\r\n\r\n".to_vec()),
        (
            "oversized body",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", 64 << 20)
                .into_bytes(),
        ),
    ];
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("invalid UTF-8", b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec()),
        ("wrong types", br#"{"messages":"hello","max_tokens":"ten"}"#.to_vec()),
        ("huge number", br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1e308}"#.to_vec()),
        ("negative max_tokens", br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":-5}"#.to_vec()),
        ("deeply nested", format!("{{\"messages\":{}1{}}}", "[".repeat(5000), "]".repeat(5000)).into_bytes()),
        (
            "enormous stop list",
            format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"stop":[{}]}}"#,
                vec!["\"x\""; 100_000].join(",")
            )
            .into_bytes(),
        ),
        ("empty messages", br#"{"messages":[]}"#.to_vec()),
        ("not JSON", b"hello".to_vec()),
    ];
    let mut checked = 0;
    for target in [s.router.clone(), s.url_of("decode-0"), s.url_of("prefill-0")] {
        let addr: SocketAddr = target.trim_start_matches("http://").parse()?;
        for (what, bytes) in &raw {
            let mut c = TcpStream::connect(addr)?;
            c.set_read_timeout(Some(Duration::from_secs(15)))?;
            let _ = c.write_all(bytes);
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out);
            let text = String::from_utf8_lossy(&out);
            let status: u16 = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
            ensure!(
                out.is_empty() || (400..500).contains(&status) || status == 501 || status == 505,
                "{target}: {what}: answered {:?}",
                text.lines().next()
            );
            if !out.is_empty() {
                ensure!(text.contains("\"error\""), "{target}: {what}: the {status} has no JSON error body");
            }
            checked += 1;
        }
        for (what, body) in &bodies {
            let (status, answer) = call("POST", &target, "/v1/chat/completions", body)?;
            ensure!((400..500).contains(&status), "{target}: {what}: answered {status}");
            let v: serde_json::Value =
                serde_json::from_slice(&answer).with_context(|| format!("{target}: {what}: not JSON"))?;
            ensure!(v["error"]["type"].is_string(), "{target}: {what}: {v}");
            checked += 1;
        }
    }
    s.recovered(&[])?;
    Ok(Row {
        sent: checked,
        completed: 0,
        errors: checked,
        hung: 0,
        note: format!("{} malformed HTTP and {} malformed API bodies to the router and both workers: each a 4xx with a JSON error or a clean close; service unaffected", raw.len(), bodies.len()),
    })
}

fn long_context(s: &mut Stack, short: bool) -> Result<Row> {
    // A prompt that fills the model's context (8,192 tokens) but for the answer, decoded in a batch with
    // short requests.
    let prompt_tokens = if short { 2000 } else { 8000 };
    let max_tokens = 150u64;
    let ids: Vec<u32> = (0..prompt_tokens).map(|i| 1000 + (i * 7919) % 40000).collect();
    // The count comes from the stream's usage chunk: a token can decode to no text (a special token
    // the model emits under `ignore_eos`, or the first byte of a character), so text events undercount.
    let body = serde_json::to_vec(&serde_json::json!({
        "prompt": ids, "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "timeout": 900,
        "stream_options": {"include_usage": true},
    }))?;
    let addr: SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let long = std::thread::spawn(move || {
        let mut c = Conn::new(addr);
        c.request(
            "/v1/completions",
            &body,
            Instant::now() + Duration::from_secs(900),
            Duration::from_secs(1),
            None,
        )
    });
    std::thread::sleep(Duration::from_millis(500));
    let short_ones = streams(&s.router.clone(), 4, 32, 900.0, || {});
    let long = long.join().map_err(|_| anyhow::anyhow!("client thread panicked"))?;
    ensure!(long.ok(), "the long-context request failed: {:?} (status {})", long.error, long.status);
    ensure!(long.output_tokens == max_tokens, "the long-context request gave {} tokens", long.output_tokens);
    let row = tally(&short_ones);
    ensure!(row.completed == 4, "short requests beside it: {row:?}");
    s.all_alive_but(&[])?;
    s.baseline(&[])?;
    Ok(Row {
        sent: 5,
        completed: 5,
        errors: 0,
        hung: 0,
        note: format!(
            "{prompt_tokens} prompt tokens + {max_tokens} generated (to position {}), TTFT {:.1} s, {:.0} ms per token after; 4 short requests in the same batch completed",
            prompt_tokens as u64 + max_tokens,
            long.ttft.unwrap_or_default().as_secs_f64(),
            long.e2e.saturating_sub(long.ttft.unwrap_or_default()).as_secs_f64() * 1000.0 / (max_tokens - 1) as f64
        ),
    })
}

fn soak(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router).map_err(anyhow::Error::msg)?;
    let (agents, rounds) = if short { (8, 3) } else { (32, 10) };
    let shape = Shape { disconnect_one_in: 5, ..shape(32, 600.0) };
    let r = run_point(
        &t,
        &Load::Agents { agents, rounds, tool_words: 40 },
        &shape,
        &Slo::default(),
        &Progress::quiet(),
    );
    ensure!(r.hung == 0, "{} hung requests", r.hung);
    let left: u64 = r.errors.iter().filter(|(k, _)| k.ends_with(" client_disconnect")).map(|(_, v)| v).sum();
    let other: u64 = r.errors.values().sum::<u64>() - left;
    ensure!(other == 0, "errors besides client disconnects: {:?}", r.errors);
    s.recovered(&[])?;
    Ok(Row {
        sent: r.sent as usize,
        completed: r.ok as usize,
        errors: left as usize,
        hung: 0,
        note: format!(
            "{agents} agents x {rounds} rounds, growing contexts, one request in five abandoned by its client at a random token: {left} disconnects, {:.0} output tokens/s, nothing leaked",
            r.tokens_per_s()
        ),
    })
}

fn hung_worker(s: &mut Stack, short: bool) -> Result<Row> {
    // A "decode worker" that accepts connections and never answers anything.
    let l = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", l.local_addr()?);
    let stop = Arc::new(AtomicBool::new(false));
    let st = Arc::clone(&stop);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        l.set_nonblocking(true).ok();
        while !st.load(Ordering::Relaxed) {
            if let Ok((c, _)) = l.accept() {
                held.push(c);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    s.add_worker(&url, "decode")?;
    let n = if short { 6 } else { 16 };
    let outcomes = streams(&s.router.clone(), n, 16, 8.0, || {});
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    // The breaker has taken it out.
    let (_, list) = get(&s.router, "/workers")?;
    let v: serde_json::Value = serde_json::from_slice(&list)?;
    let state = v["workers"]
        .as_array()
        .and_then(|a| a.iter().find(|w| w["url"] == url.as_str()))
        .map(|w| w["state"].clone());
    ensure!(state == Some(serde_json::json!("down")), "the silent worker is {state:?}, not down");
    after_recovery(&s.router)?;
    s.remove_worker(&url)?;
    stop.store(true, Ordering::Relaxed);
    s.all_alive_but(&[])?;
    s.baseline(&[])?;
    row.note = "a worker that never answers: its requests end at their deadline, probes take it out".into();
    Ok(row)
}

fn restart_readd(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router).map_err(anyhow::Error::msg)?;
    let secs = if short { 8.0 } else { 20.0 };
    let load = Load::Poisson { rate: 1.0, duration: Duration::from_secs_f64(secs), connections: 16 };
    let traffic = std::thread::spawn(move || {
        run_point(&t, &load, &shape(16, 60.0), &Slo::default(), &Progress::quiet())
    });
    std::thread::sleep(Duration::from_secs(2));
    s.signal("decode-0", "-KILL")?;
    s.replace_worker("decode-0", "decode-1", "decode")?;
    let r = traffic.join().map_err(|_| anyhow::anyhow!("traffic thread panicked"))?;
    ensure!(r.hung == 0, "{} hung requests", r.hung);
    ensure!(r.ok > 0, "no request succeeded around the restart: {:?}", r.errors);
    s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&["decode-0"])?;
    let errs: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(Row {
        sent: r.sent as usize,
        completed: r.ok as usize,
        errors: (r.sent - r.ok) as usize,
        hung: 0,
        note: format!(
            "1 req/s for {secs} s; decode worker killed 2 s in and replaced through /workers; errors {}",
            if errs.is_empty() { "none".to_owned() } else { errs.join(" ") }
        ),
    })
}

fn report(name: &str, started: Instant, result: Result<Row>, failed: &mut Vec<String>) {
    let secs = started.elapsed().as_secs_f64();
    match result {
        Ok(r) => println!(
            "{name:<18} {secs:>7.1}s {:>5} {:>9} {:>6} {:>4}  pass: {}",
            r.sent, r.completed, r.errors, r.hung, r.note
        ),
        Err(e) => {
            println!("{name:<18} {secs:>7.1}s {:>5} {:>9} {:>6} {:>4}  FAIL: {e:#}", "-", "-", "-", "-");
            failed.push(name.to_owned());
        }
    }
}

/// Network namespaces for the partition scenario, deleted when dropped.
struct Netns {
    names: Vec<String>,
}

impl Netns {
    fn ip(args: &[&str]) -> Result<()> {
        let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
        ensure!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// Prefill and decode workers on two "hosts" (network namespaces), KV over TCP across a veth link
/// between them, each reachable from the router (in the root namespace) over a veth link of its own.
/// The prefill-decode link is cut while requests move KV across it, then restored.
fn netns_partition(bins: &(PathBuf, PathBuf), model: &Path, short: bool) -> Result<Row> {
    let tag = std::process::id() % 10000;
    let (np, nd) = (format!("pdp{tag}"), format!("pdd{tag}"));
    let ns = Netns { names: vec![np.clone(), nd.clone()] };
    let (rp, ep, rd, ed, xp, xd) = (
        format!("rp{tag}"),
        format!("ep{tag}"),
        format!("rd{tag}"),
        format!("ed{tag}"),
        format!("xp{tag}"),
        format!("xd{tag}"),
    );
    for n in &ns.names {
        Netns::ip(&["netns", "add", n])?;
        Netns::ip(&["-n", n, "link", "set", "lo", "up"])?;
    }
    // router <-> prefill host, router <-> decode host, prefill host <-> decode host.
    let links = [
        (&rp, None, "10.78.1.1/24", &ep, &np, "10.78.1.2/24"),
        (&rd, None, "10.78.2.1/24", &ed, &nd, "10.78.2.2/24"),
        (&xp, Some(&np), "10.77.0.1/24", &xd, &nd, "10.77.0.2/24"),
    ];
    let mut root_links = Vec::new();
    for (a, a_ns, a_ip, b, b_ns, b_ip) in links {
        Netns::ip(&["link", "add", a, "type", "veth", "peer", "name", b])?;
        Netns::ip(&["link", "set", b, "netns", b_ns])?;
        Netns::ip(&["-n", b_ns, "addr", "add", b_ip, "dev", b])?;
        Netns::ip(&["-n", b_ns, "link", "set", b, "up"])?;
        match a_ns {
            Some(n) => {
                Netns::ip(&["link", "set", a, "netns", n])?;
                Netns::ip(&["-n", n, "addr", "add", a_ip, "dev", a])?;
                Netns::ip(&["-n", n, "link", "set", a, "up"])?;
            }
            None => {
                Netns::ip(&["addr", "add", a_ip, "dev", a])?;
                Netns::ip(&["link", "set", a, "up"])?;
                root_links.push(a.clone());
            }
        }
    }
    let logs = crate::workspace_root().join("target/chaos/netns_partition");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;
    let worker = |name: &str, netns: &str, role: &str, extra: &[&str], host_ip: &str| -> Result<Proc> {
        let mut args: Vec<String> = ["netns", "exec", netns].iter().map(|s| (*s).to_owned()).collect();
        args.push(bins.0.display().to_string());
        args.extend(worker_args(name, role, model));
        args.extend(["--host".to_owned(), "0.0.0.0".to_owned()]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut p = Proc::start(name, Path::new("ip"), &args, &logs)?;
        p.url = p.url.replace("0.0.0.0", host_ip);
        Ok(p)
    };
    let p = worker("prefill-0", &np, "prefill", &["--transfer-addr", "10.77.0.1:0"], "10.78.1.2")?;
    let d = worker("decode-0", &nd, "decode", &[], "10.78.2.2")?;
    let router_args: Vec<String> = [
        "--port",
        "0",
        "--probe-interval-s",
        "0.5",
        "--probe-timeout-s",
        "2",
        "--pair-probe-interval-s",
        "1",
        "--prefill",
        &p.url,
        "--decode",
        &d.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let r = Proc::start("router", &bins.1, &router_args, &logs)?;
    let mut s = Stack {
        router: r.url.clone(),
        procs: vec![p, d, r],
        logs,
        bins: bins.clone(),
        model: model.to_owned(),
    };
    s.wait_ready(true, Duration::from_secs(60))?;
    let n = if short { 4 } else { 12 };
    let cut_for = Duration::from_secs(if short { 4 } else { 8 });
    let mut not_ready_after = Duration::MAX;
    let router = s.router.clone();
    let mut late = None;
    let mut outcomes = streams(&s.router.clone(), n, 32, 15.0, || {
        std::thread::sleep(Duration::from_millis(600));
        let cut = Instant::now();
        let _ = Netns::ip(&["-n", &np, "link", "set", &xp, "down"]);
        // A second wave arrives during the cut, so its KV transfers meet the partition however fast
        // the first wave finished.
        late = Some(std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            streams(&router, n, 32, 15.0, || {})
        }));
        while cut.elapsed() < cut_for {
            if !s.ready() && not_ready_after == Duration::MAX {
                not_ready_after = cut.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Netns::ip(&["-n", &np, "link", "set", &xp, "up"]);
    });
    if let Some(h) = late {
        outcomes.extend(h.join().map_err(|_| anyhow::anyhow!("client thread panicked"))?);
    }
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    ensure!(
        not_ready_after < cut_for,
        "the router stayed ready while prefill and decode could not reach each other"
    );
    let back = s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[])?;
    drop(s);
    for l in root_links {
        let _ = Command::new("ip").args(["link", "del", &l]).output();
    }
    drop(ns);
    row.note = format!(
        "prefill and decode in separate network namespaces, KV over TCP on a veth link cut for {} s under {n} streams and {n} more sent during the cut: \
         not ready {} ms after the cut, ready {} ms after the link came back",
        cut_for.as_secs(),
        not_ready_after.as_millis(),
        back.as_millis()
    );
    Ok(row)
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut names: Vec<String> = Vec::new();
    let mut short = false;
    for a in args {
        match a.as_str() {
            "--short" => short = true,
            "--ci" => {
                short = true;
                names.extend(CI_SCENARIOS.iter().map(|s| (*s).to_owned()));
            }
            n if SCENARIOS.contains(&n) => names.push(n.to_owned()),
            other => bail!("unknown scenario {other:?}; scenarios: {}", SCENARIOS.join(", ")),
        }
    }
    if names.is_empty() {
        names = SCENARIOS.iter().map(|s| (*s).to_owned()).collect();
    }
    let model = crate::fetch_model(&[])?;
    // Short runs reuse the test build (the model crate is optimized there too); full runs use release.
    let profile = if short { "debug" } else { "release" };
    if short {
        crate::cargo(&["build", "-p", "pdserve-server", "-p", "pdserve-router"])?;
    } else {
        crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-router"])?;
    }
    let root = crate::workspace_root().join("target").join(profile);
    let bins = (root.join("pdserve-server"), root.join("pdserve-router"));
    println!(
        "{:<18} {:>8} {:>5} {:>9} {:>6} {:>4}  result",
        "scenario", "time", "sent", "completed", "errors", "hung"
    );
    let mut failed = Vec::new();
    for name in &names {
        let started = Instant::now();
        let router_extra: &[&str] = if name == "overload" {
            &["--max-in-flight", "8", "--max-queued", "8", "--queue-timeout-s", "3"]
        } else {
            &[]
        };
        if name == "netns_partition" {
            let result = netns_partition(&bins, &model, short);
            report(name, started, result, &mut failed);
            continue;
        }
        let result = Stack::start(name, router_extra, &bins, &model).and_then(|mut s| match name.as_str() {
            "decode_kill" => decode_kill(&mut s, short),
            "decode_stall" => decode_stall(&mut s, short),
            "disconnect_storm" => disconnect_storm(&mut s, short),
            "overload" => overload(&mut s, short),
            "hung_worker" => hung_worker(&mut s, short),
            "prefill_kill" => prefill_kill(&mut s, short),
            "slowloris" => slowloris(&mut s, short),
            "bad_input" => bad_input(&mut s, short),
            "long_context" => long_context(&mut s, short),
            "soak" => soak(&mut s, short),
            "restart_readd" => restart_readd(&mut s, short),
            _ => unreachable!("checked above"),
        });
        report(name, started, result, &mut failed);
    }
    if !failed.is_empty() {
        bail!("chaos scenarios failed: {} (logs in target/chaos/<scenario>/)", failed.join(", "));
    }
    Ok(())
}
