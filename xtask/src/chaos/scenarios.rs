//! The fault scenarios, each with its assertions (RELIABILITY.md).

use std::io::{Read, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use pdserve_loadgen::{run_point, Conn, Load, Progress, Shape, Slo, Target};

use crate::where_::{call, get};

use super::stack::{Metrics, Readiness};
use super::*;

pub(super) fn decode_kill(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 8 } else { 32 };
    migrate_then_strand(s, "decode", n, 400, Duration::from_millis(1500), "")
}

/// Requests the router moved to another worker so far (migrations of every cause, and legs re-sent
/// after a pooled connection broke before any answer byte, which the router cannot tell from one the
/// worker had closed while idle).
fn migrations(s: &Stack) -> Result<f64> {
    let (_, body) = get(&s.router, "/metrics")?;
    let text = String::from_utf8_lossy(&body);
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("router_migrations_total{")
                || l.starts_with("router_stale_connection_retries_total ")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Two acts. With a second worker of `role` beside it, `ROLE-0` is killed (SIGKILL) `after` into `n`
/// streams of `max_tokens`: every stream must complete (the router moves the ones it held), with no
/// error. Then `ROLE-1`, now the only one, is killed the same way: the streams it held end with an
/// explicit error (nothing to move to), and [`kill_and_replace`]'s checks follow.
pub(super) fn migrate_then_strand(
    s: &mut Stack,
    role: &str,
    n: usize,
    max_tokens: u64,
    after: Duration,
    also: &str,
) -> Result<Row> {
    let (first, second) = (format!("{role}-0"), format!("{role}-1"));
    let p = s.worker(&second, role)?;
    let url = p.url.clone();
    s.procs.push(p);
    s.add_worker(&url, role)?;
    let joined = s.wait_ready(true, Duration::from_secs(30))?;
    // Readiness may still rest on `first` alone; `second` must be proven before `first` dies.
    let proven = joined + s.wait_proven(&url, Duration::from_secs(30))?;
    let before = migrations(s)?;
    // A prefill worker's part is over in milliseconds: it is stopped first, so the streams it takes
    // are surely in its hands when it dies. A decode worker dies mid-stream.
    if role == "prefill" {
        s.signal(&first, "-STOP")?;
    }
    // One worker then carries all `n` (the moved ones computed again): a deadline it can keep.
    let sampler = Readiness::start(&s.router);
    let outcomes = streams(&s.router.clone(), n, max_tokens, 150.0, || {
        std::thread::sleep(after);
        let _ = s.signal(&first, "-KILL");
    });
    let (ready, samples, down) = sampler.stop();
    let moved = migrations(s)? - before;
    let act1 = tally(&outcomes);
    ensure!(
        ready == samples,
        "not ready in {} of {samples} samples while {second} could serve (at ms {down:?})",
        samples - ready
    );
    ensure!(act1.hung == 0, "{} requests without a terminal outcome", act1.hung);
    ensure!(act1.errors == 0, "{} of {n} streams failed although {second} could take them", act1.errors);
    ensure!(moved >= 1.0, "no stream was moved off {first}");
    s.remove_worker(&s.url_of(&first))?;
    s.procs.retain(|p| p.name != first);
    let mut act2 = kill_and_replace(s, role, 1, n, max_tokens, after, also)?;
    // With the only decode worker dead nothing can carry its streams: they end in an explicit error.
    // With the only prefill worker dead the decode worker may compute the prompts itself (the
    // router's local prefill): each stream completes or ends in an explicit error.
    if role == "decode" {
        ensure!(act2.errors >= 1, "no stream failed when the only {role} worker died");
    }
    act2.note = format!(
        "{first} killed under {n} streams with {second} beside it (proven {} ms after it joined): {moved} moved, {} of {n} completed, 0 errors, ready throughout ({samples} samples); then {second}, the only one, killed: {} of {n} ended with an explicit error, {} completed; {}",
        proven.as_millis(),
        act1.completed,
        act2.errors,
        act2.completed,
        act2.note
    );
    Ok(Row {
        sent: act1.sent + act2.sent,
        completed: act1.completed + act2.completed,
        errors: act2.errors,
        hung: 0,
        note: act2.note,
    })
}

/// Kills the only worker of `role` (`ROLE-{k}`) with SIGKILL `after` into `n` streams of `max_tokens`,
/// and asserts: every stream ends, readiness drops within 5 s, a replacement (`ROLE-{k+1}`, added
/// through `/workers`) brings readiness back, requests succeed again, nothing else died, ledgers
/// return to zero. `also` goes into the row's note between the two readiness figures.
pub(super) fn kill_and_replace(
    s: &mut Stack,
    role: &str,
    k: usize,
    n: usize,
    max_tokens: u64,
    after: Duration,
    also: &str,
) -> Result<Row> {
    let (dead, fresh) = (format!("{role}-{k}"), format!("{role}-{}", k + 1));
    let mut not_ready_after = Duration::ZERO;
    if role == "prefill" {
        // As in the first act: the streams it takes are surely in its hands when it dies.
        s.signal(&dead, "-STOP")?;
    }
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

pub(super) fn decode_stall(s: &mut Stack, short: bool) -> Result<Row> {
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
    // Act two: a second decode worker beside it; the first stops mid-stream again, and the streams
    // it held move on once they have been quiet for the router's stall timeout.
    let p = s.worker("decode-1", "decode")?;
    let url = p.url.clone();
    s.procs.push(p);
    s.add_worker(&url, "decode")?;
    s.wait_ready(true, Duration::from_secs(30))?;
    let before = migrations(s)?;
    // A stream counts as stalled only after its first token (before it, a queued request is not
    // told from a stopped worker's; its deadline bounds it): decode-0 stops once every request it
    // holds has one (at most 20 s in; on a slow machine 0.8 s came before most first tokens).
    let decode0 = s.url_of("decode-0");
    let outcomes = streams(&s.router.clone(), n, 200, 60.0, || {
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(800));
        while t.elapsed() < Duration::from_secs(20) && !all_started(&decode0) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = s.signal("decode-0", "-STOP");
    });
    let _ = s.signal("decode-0", "-CONT");
    let moved = migrations(s)? - before;
    let act2 = tally(&outcomes);
    ensure!(act2.hung == 0, "{} requests without a terminal outcome", act2.hung);
    ensure!(act2.errors == 0, "{} of {n} streams failed although decode-1 could take them", act2.errors);
    ensure!(moved >= 1.0, "no stream was moved off the stopped decode worker");
    s.recovered(&[])?;
    row.sent += act2.sent;
    row.completed += act2.completed;
    row.note = format!(
        "stalled {stall} s; not ready during the stall; ready again {} ms after SIGCONT; then with decode-1 beside it, decode-0 stopped under {n} streams: {moved} moved after {STALL_TIMEOUT_S} s quiet, {} of {n} completed, 0 errors",
        back.as_millis(),
        act2.completed
    );
    Ok(row)
}

/// Whether the worker at `url` holds requests, each with a token out (its `/debug/requests`).
fn all_started(url: &str) -> bool {
    let Ok((200, body)) = get(url, "/debug/requests") else { return false };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else { return false };
    let requests = v["requests"].as_array().map_or(&[][..], Vec::as_slice);
    !requests.is_empty() && requests.iter().all(|r| r["tokens_out"].as_u64().unwrap_or(0) >= 1)
}

/// The router's stall timeout in `decode_stall` (its default is 30 s).
pub(super) const STALL_TIMEOUT_S: u64 = 2;

/// Clients that leave at random points while other streams run: each left request must be gone from
/// every process (router, prefill, decode: none lists it in `/debug/requests`) soon after its client
/// closed the connection. Reports that time's p50/p99/max (goal: p99 within 100 ms with 32 streams
/// running; asserted here within 1 s, the bound a loaded CI machine keeps).
/// Milliseconds from `left` until each process at `lists` (the router first) no longer lists `rid` in
/// `/debug/requests`: each process is asked on its own thread, every 5 ms, and its time is when the
/// first answer that no longer lists the request arrived (an upper bound: the process let go of it
/// before it answered). A worker's answer counts only if it was asked after the router had let go (a
/// leg may not have reached it yet). Asking them one after another would add the other processes'
/// answer times, under load tens of milliseconds each.
fn until_unlisted(lists: &[String], rid: &str, left: Instant) -> Result<Vec<f64>> {
    let router_gone = AtomicBool::new(false);
    let router_gone = &router_gone;
    let times = std::thread::scope(|scope| {
        let asks: Vec<_> = lists
            .iter()
            .enumerate()
            .map(|(i, u)| {
                scope.spawn(move || -> Result<f64> {
                    loop {
                        let after_router = i == 0 || router_gone.load(Ordering::SeqCst);
                        let listed = get(u, "/debug/requests")
                            .map_or(true, |(_, b)| b.windows(rid.len()).any(|w| w == rid.as_bytes()));
                        if !listed && after_router {
                            router_gone.store(true, Ordering::SeqCst);
                            return Ok(left.elapsed().as_secs_f64() * 1e3);
                        }
                        ensure!(
                            left.elapsed() < Duration::from_secs(5),
                            "{rid} still listed at {u} 5 s after its client left"
                        );
                        std::thread::sleep(Duration::from_millis(5));
                    }
                })
            })
            .collect();
        asks.into_iter()
            .map(|a| a.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a poller panicked"))))
            .collect::<Vec<_>>()
    });
    times.into_iter().collect()
}

pub(super) fn disconnect_storm(s: &mut Stack, short: bool) -> Result<Row> {
    let (total, background) = if short { (40, 4) } else { (200, 32) };
    let addr: SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let lists: Vec<String> =
        ["router", "prefill-0", "decode-0"].iter().map(|n| s.url_of(n)).collect::<Vec<_>>();
    let stop = Arc::new(AtomicBool::new(false));
    // The streams that keep running meanwhile: one request after another, to their end.
    let load: Vec<_> = (0..background)
        .map(|k| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let Ok(mut c) = TcpStream::connect(addr) else { continue };
                    let body = chat_body(48, 60.0, 100_000 + k * 1000 + i);
                    let head = format!(
                        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = c.write_all(head.as_bytes()).and_then(|()| c.write_all(&body));
                    let _ = c.set_read_timeout(Some(Duration::from_secs(60)));
                    let mut buf = [0u8; 4096];
                    while !stop.load(Ordering::Relaxed) {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) if buf[..n].windows(6).any(|w| w == b"[DONE]") => break,
                            Ok(_) => {}
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    // Each worker's engine steps while clients leave (an abort no longer waits for the step in
    // progress: the row shows how long those steps are).
    let workers = [s.url_of("prefill-0"), s.url_of("decode-0")];
    let steps = || -> Result<Vec<(f64, f64)>> {
        workers
            .iter()
            .map(|u| {
                let m = Metrics::read(u)?;
                Ok((m.value("engine_step_seconds_sum")?, m.value("engine_step_seconds_count")?))
            })
            .collect()
    };
    let steps_before = match steps() {
        Ok(v) => v,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            load.into_iter().for_each(|l| drop(l.join()));
            return Err(e);
        }
    };
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let lists = Arc::new(lists);
    let droppers: Vec<_> = (0..4)
        .map(|_| {
            let (next, lists) = (Arc::clone(&next), Arc::clone(&lists));
            std::thread::spawn(move || -> Result<Vec<(usize, usize, Vec<f64>)>> {
                let mut gone_ms = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok(gone_ms);
                    }
                    let rid = format!("drop-{}-{i}", std::process::id());
                    let Ok(mut c) = TcpStream::connect(addr) else { continue };
                    let body = chat_body(64, 30.0, i);
                    let head = format!(
                        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: {rid}\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = c.write_all(head.as_bytes()).and_then(|()| c.write_all(&body));
                    // Leave at a point that depends on i: at once (before or during the prefill leg
                    // and the transfer), or after some events of the stream.
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
                    let left = Instant::now();
                    gone_ms.push((i, events, until_unlisted(&lists, &rid, left)?));
                }
            })
        })
        .collect();
    // Per request: when each process let go of it.
    let mut each: Vec<(usize, usize, Vec<f64>)> = Vec::new();
    let mut failure = None;
    for d in droppers {
        match d.join() {
            Ok(Ok(v)) => each.extend(v),
            Ok(Err(e)) => failure = Some(e),
            Err(_) => failure = Some(anyhow::anyhow!("a client thread panicked")),
        }
    }
    let steps_after = steps();
    stop.store(true, Ordering::Relaxed);
    for l in load {
        let _ = l.join();
    }
    if let Some(e) = failure {
        return Err(e);
    }
    // The raw figures, for a closer look: which client, after how many events, each process's time.
    each.sort_by_key(|e| e.0);
    let csv: String = std::iter::once("client,events_read,router_ms,prefill_ms,decode_ms\n".to_owned())
        .chain(each.iter().map(|(i, n, t)| format!("{i},{n},{:.1},{:.1},{:.1}\n", t[0], t[1], t[2])))
        .collect();
    std::fs::write(s.logs.join("gone.csv"), csv)?;
    let each: Vec<Vec<f64>> = each.into_iter().map(|e| e.2).collect();
    let mean_step_ms: Vec<String> = ["prefill", "decode"]
        .iter()
        .zip(steps_before.iter().zip(steps_after?))
        .map(|(name, (a, b))| format!("{name} {:.0}", (b.0 - a.0) / (b.1 - a.1).max(1.0) * 1e3))
        .collect();
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let pct = |v: &[f64], p: f64| {
        v.get(((v.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
    };
    let gone = sorted(each.iter().map(|t| t.iter().copied().fold(0.0, f64::max)).collect());
    let (p50, p99, max) = (pct(&gone, 0.5), pct(&gone, 0.99), gone.last().copied().unwrap_or(0.0));
    let per_process: Vec<String> = ["router", "prefill", "decode"]
        .iter()
        .enumerate()
        .map(|(i, name)| format!("{name} {:.0}", pct(&sorted(each.iter().map(|t| t[i]).collect()), 0.99)))
        .collect();
    ensure!(p99 <= 1000.0, "p99 from a client leaving to no process listing its request: {p99:.0} ms");
    s.baseline(&[])?;
    after_recovery(&s.router)?;
    s.all_alive_but(&[])?;
    Ok(Row {
        sent: total,
        completed: 0,
        errors: 0,
        hung: 0,
        note: format!(
            "{} clients left at random points with {background} other streams running; gone from every process in p50 {p50:.0} / p99 {p99:.0} / max {max:.0} ms (p99 per process: {}; mean engine step ms: {}); every ledger back to zero",
            gone.len(),
            per_process.join(", "),
            mean_step_ms.join(", ")
        ),
    })
}

pub(super) fn overload(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router)?;
    let secs = if short { 10.0 } else { 30.0 };
    // What the stack sustains with this shape, measured first (closed loop at its in-flight limit);
    // then ten times that, which it cannot take: the excess must be refused, explicitly, at once.
    let sustained = run_point(
        &t,
        &Load::Closed { concurrency: 8, requests: 24 },
        &shape(16, 30.0),
        &Slo::default(),
        &Progress::quiet(),
    );
    ensure!(sustained.ok == sustained.sent, "the calibration run failed: {:?}", sustained.errors);
    let capacity = sustained.requests_per_s();
    let rate = (capacity * 10.0).max(1.0);
    let load = Load::Poisson { rate, duration: Duration::from_secs_f64(secs), connections: 256 };
    let r = run_point(&t, &load, &shape(16, 15.0), &Slo::default(), &Progress::quiet());
    ensure!(r.hung == 0, "{} hung requests under overload", r.hung);
    let refused: u64 = r.errors.iter().filter(|(k, _)| k.starts_with("429")).map(|(_, v)| v).sum();
    ensure!(refused > 0, "10x the sustainable rate produced no 429: {:?}", r.errors);
    s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[])?;
    let errs: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(Row {
        sent: r.sent as usize,
        completed: r.ok as usize,
        errors: (r.sent - r.ok) as usize,
        hung: 0,
        note: format!(
            "sustains {capacity:.1} req/s (measured); {rate:.0} req/s for {secs} s into 8 in flight + 8 queued: {:.1} req/s completed, the rest answered {}",
            r.ok as f64 / secs,
            errs.join(" ")
        ),
    })
}

pub(super) fn prefill_kill(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 8 } else { 24 };
    // Long prompts keep the prefill worker busy (prefilling, holding and handing over KV) when it dies.
    migrate_then_strand(
        s,
        "prefill",
        n,
        64,
        Duration::from_millis(700),
        "the decode worker dropped its pulls; ",
    )
}

pub(super) fn slowloris(s: &mut Stack, short: bool) -> Result<Row> {
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

pub(super) fn bad_input(s: &mut Stack, _short: bool) -> Result<Row> {
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

pub(super) fn long_context(s: &mut Stack, short: bool) -> Result<Row> {
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

pub(super) fn soak(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router)?;
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
    let count =
        |suffix: &str| -> u64 { r.errors.iter().filter(|(k, _)| k.ends_with(suffix)).map(|(_, v)| v).sum() };
    let (left, full) = (count(" client_disconnect"), count("429 queue_full"));
    // The decode worker's KV (512 blocks) is far smaller than 32 growing conversations: a pull it has
    // no room for is an explicit 429 with Retry-After, the one error allowed besides the clients' own.
    let other: u64 = r.errors.values().sum::<u64>() - left - full;
    ensure!(other == 0, "errors besides client disconnects and 429s: {:?}", r.errors);
    s.recovered(&[])?;
    Ok(Row {
        sent: r.sent as usize,
        completed: r.ok as usize,
        errors: (left + full) as usize,
        hung: 0,
        note: format!(
            "{agents} agents x {rounds} rounds, growing contexts, one request in five abandoned by its client at a random token: {left} disconnects, {full} answered 429 (KV full), {:.0} output tokens/s, nothing leaked",
            r.tokens_per_s()
        ),
    })
}

pub(super) fn hung_worker(s: &mut Stack, short: bool) -> Result<Row> {
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

pub(super) fn restart_readd(s: &mut Stack, short: bool) -> Result<Row> {
    let t = Target::parse(&s.router)?;
    let secs = if short { 8.0 } else { 20.0 };
    let load = Load::Poisson { rate: 1.0, duration: Duration::from_secs_f64(secs), connections: 16 };
    let traffic = std::thread::spawn(move || {
        run_point(&t, &load, &shape(16, 60.0), &Slo::default(), &Progress::quiet())
    });
    std::thread::sleep(Duration::from_secs(2));
    // Killed, then started again with the same options on the same address (as a supervisor does):
    // the router, never told, must take it back through its probes.
    s.signal("decode-0", "-KILL")?;
    let i = s.procs.iter().position(|p| p.name == "decode-0").context("decode-0")?;
    let _ = s.procs[i].child.wait();
    let url = s.procs[i].url.clone();
    let fresh = s.procs[i].restart(1)?;
    ensure!(fresh.url == url, "decode-0 came back on {} instead of {url}", fresh.url);
    s.procs[i] = fresh;
    let r = traffic.join().map_err(|_| anyhow::anyhow!("traffic thread panicked"))?;
    ensure!(r.hung == 0, "{} hung requests", r.hung);
    ensure!(r.ok > 0, "no request succeeded around the restart: {:?}", r.errors);
    let back = s.wait_ready(true, Duration::from_secs(30))?;
    let after = tally(&streams(&s.router.clone(), 4, 8, 30.0, || {}));
    ensure!(after.completed == 4, "after the restart {} of 4 requests completed", after.completed);
    s.recovered(&[])?;
    let errs: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(Row {
        sent: r.sent as usize + 4,
        completed: r.ok as usize + 4,
        errors: (r.sent - r.ok) as usize,
        hung: 0,
        note: format!(
            "1 req/s for {secs} s; decode worker killed 2 s in and started again on {url}: the router took it back (ready {} ms after), 4 of 4 requests served after; errors {}",
            back.as_millis(),
            if errs.is_empty() { "none".to_owned() } else { errs.join(" ") }
        ),
    })
}
