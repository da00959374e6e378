//! Scenarios from the PD stacks' 2026 issue trackers: failures that were hangs or silent corruption
//! in production elsewhere, each asserted not to happen here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::where_::call_within;

use super::stack::Metrics;
use super::*;

/// A greedy chat request `i` of the soak: prompts from 20 to about 320 words, so their KV spans from
/// a few blocks to dozens.
fn soak_body(i: usize) -> Vec<u8> {
    let content = format!(
        "Item {i}. Summarize in one sentence: {}",
        pdserve_loadgen::words(20 + (i * 37) % 300, 7_000 + i as u64)
    );
    serde_json::to_vec(&serde_json::json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24, "temperature": 0,
    }))
    .unwrap_or_default()
}

/// The answer's text, or why there is none.
fn answer(url: &str, body: &[u8]) -> Result<String> {
    let (status, b) = call_within("POST", url, "/v1/chat/completions", body, Duration::from_secs(300))?;
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
    ensure!(status == 200, "status {status}: {v}");
    v["choices"][0]["message"]["content"].as_str().map(str::to_owned).context("no content")
}

/// `f(i)` for every `i < n` on `threads` threads; the results in order.
fn in_parallel<T: Send + 'static>(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let next = Arc::new(AtomicUsize::new(0));
    let out: Arc<Mutex<Vec<Option<T>>>> = Arc::new(Mutex::new((0..n).map(|_| None).collect()));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (next, out, f) = (Arc::clone(&next), Arc::clone(&out), Arc::clone(&f));
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let r = f(i);
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
    out.drain(..).map(|r| r.expect("every index ran")).collect()
}

/// SGLang #23020: accuracy fell from 95% to about 50% over 150 PD requests, no error anywhere (the KV
/// a decode worker decoded from was not the KV prefill computed). Here a unified worker of the same
/// configuration answers every prompt greedily first; then the same prompts go through the PD stack
/// (prefill, KV over shared memory with its checksums, decode), eight at a time, and every answer
/// must be the unified worker's exactly: batch invariance makes greedy output independent of what
/// shares a step, so any difference is a fault, not noise.
pub(super) fn accuracy_soak(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 24 } else { 150 };
    let u = s.worker("unified-0", "unified")?;
    let unified = u.url.clone();
    s.procs.push(u);
    let want = in_parallel(n, 4, move |i| answer(&unified, &soak_body(i)));
    let want: Vec<String> = want.into_iter().collect::<Result<_>>().context("the unified reference")?;
    let router = s.router.clone();
    let got = in_parallel(n, 8, move |i| answer(&router, &soak_body(i)));
    let mut errors = 0;
    let mut differ = Vec::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        match g {
            Err(e) => {
                errors += 1;
                eprintln!("accuracy_soak: request {i} through PD failed: {e:#}");
            }
            Ok(g) if g != w => differ.push(i),
            Ok(_) => {}
        }
    }
    ensure!(errors == 0, "{errors} of {n} PD requests failed");
    ensure!(
        differ.is_empty(),
        "{} of {n} PD answers differ from the unified worker's (requests {differ:?}): the KV decoded from is not the KV computed",
        differ.len()
    );
    s.recovered(&[])?;
    Ok(Row {
        sent: 2 * n,
        completed: 2 * n,
        errors: 0,
        hung: 0,
        note: format!(
            "{n} greedy prompts of 20-320 words through PD, 8 at a time: every answer the unified worker's, word for word"
        ),
    })
}

/// SMG #2162: pooled upstream connections idle longer than the worker's keep-alive gave 500s on
/// reuse. The workers here close idle connections after 2 s (`--keep-alive-timeout-s 2`, as vLLM's 5 s
/// behind a gateway), the router keeps them pooled for 20 s: after each idle spell a burst of 16
/// streams reuses connections the workers have closed, and not one request may fail.
pub(super) fn idle_then_burst(s: &mut Stack, short: bool) -> Result<Row> {
    let rounds = if short { 2 } else { 5 };
    let mut all = Vec::new();
    for _ in 0..rounds {
        // Connections into the router's pools, both legs.
        all.extend(streams(&s.router.clone(), 4, 4, 30.0, || {}));
        // Idle past the workers' keep-alive, well within the router's pool timeout.
        std::thread::sleep(Duration::from_secs(4));
        all.extend(streams(&s.router.clone(), 16, 8, 60.0, || {}));
    }
    let mut row = tally(&all);
    ensure!(
        row.hung == 0 && row.errors == 0,
        "{} errors and {} hung after idle spells",
        row.errors,
        row.hung
    );
    // The workers did close the router's idle connections: the bursts met a pool of closed ones.
    let mut closed = 0.0;
    for w in ["prefill-0", "decode-0"] {
        closed += Metrics::read(&s.url_of(w))?.value("http_idle_closed_total")?;
    }
    ensure!(
        closed >= rounds as f64,
        "the workers closed {closed} idle connections: the scenario did not test reuse after their keep-alive"
    );
    let stale = Metrics::read(&s.router)?.value("router_stale_connection_retries_total")?;
    s.recovered(&[])?;
    row.note = format!(
        "{rounds} rounds of 4 s idle (workers' keep-alive 2 s, router's pool 20 s) then 16 streams: 0 errors; the workers closed {closed} idle connections, {stale} legs re-sent after meeting a closed one"
    );
    Ok(row)
}

/// SMG #2463: the prefill side's transfer clock started at arrival but only decode admission
/// stopped it, so with decode admission full, merely queued requests timed out as failed transfers
/// and their slots lingered for 300 s. Here the decode worker admits 4 requests (`--max-running 4`)
/// while 32 stream at once: a request waits (or is refused with an explicit 429 and Retry-After), it
/// never fails as a transfer timeout; every failure frees both legs; both workers' ledgers are back to
/// zero within seconds of the last answer.
pub(super) fn decode_admission_saturated(s: &mut Stack, short: bool) -> Result<Row> {
    let n = if short { 16 } else { 32 };
    let outcomes = streams(&s.router.clone(), n, 24, 180.0, || {});
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for o in outcomes.iter().filter(|o| !o.ok()) {
        *kinds.entry(format!("{} {}", o.status, o.error.clone().unwrap_or_default())).or_default() += 1;
    }
    // Only explicit refusals: no transfer failure, no timeout, no upstream error.
    let unexplained: Vec<_> = kinds.iter().filter(|(k, _)| !k.starts_with("429 ")).collect();
    ensure!(unexplained.is_empty(), "failures other than 429s with decode admission full: {unexplained:?}");
    ensure!(row.completed >= 4, "only {} of {n} completed", row.completed);
    // Nothing lingers: no prefill lease waits out its expiry (`baseline`: 15 s at most).
    s.recovered(&[])?;
    row.note = format!(
        "{n} streams against decode admission 4: {} completed, refusals {:?}; no transfer timeout, both ledgers at zero after",
        row.completed, kinds
    );
    Ok(row)
}
