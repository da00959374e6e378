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

/// `body` sent to the chat endpoint at `addr`, observed until 60 s (plus 1 s of grace).
fn chat_within_60s(addr: std::net::SocketAddr, body: &serde_json::Value) -> pdserve_loadgen::Observation {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    pdserve_loadgen::Conn::new(addr).request(
        "/v1/chat/completions",
        &bytes,
        deadline,
        Duration::from_secs(1),
        None,
    )
}

/// One streamed chat request of `priority` (vLLM's field: lower first), `i` its prompt's seed.
fn prioritized(addr: std::net::SocketAddr, i: usize, priority: i32) -> pdserve_loadgen::Observation {
    let mut body: serde_json::Value = serde_json::from_slice(&chat_body(16, 60.0, i)).unwrap_or_default();
    body["priority"] = serde_json::json!(priority);
    chat_within_60s(addr, &body)
}

/// SGLang #25060: priority was silently first-come-first-served in PD mode. Here the router admits 4
/// at a time with 8 queued (`--max-in-flight 4 --max-queued 8`) and 24 clients keep sending
/// background requests (`priority` 10) as fast as they are answered, while one client sends urgent
/// ones (`priority` 0) one after another: every urgent request completes, none refused, each waiting
/// at most for a slot while the background ones queue behind it; the background ones get explicit
/// 429s with Retry-After (displaced, or refused at a full queue), nothing hangs, nothing else fails.
pub(super) fn priority_overload(s: &mut Stack, short: bool) -> Result<Row> {
    let addr: std::net::SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let secs = if short { 12 } else { 30 };
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    let background: Vec<_> = (0..24)
        .map(|c| {
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut i = 0;
                while std::time::Instant::now() < until {
                    let o = prioritized(addr, 10_000 + c * 1000 + i, 10);
                    if o.status == 429 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    seen.push(o);
                    i += 1;
                }
                seen
            })
        })
        .collect();
    // The background fills the queue first.
    std::thread::sleep(Duration::from_secs(2));
    let mut urgent = Vec::new();
    let mut i = 0;
    while std::time::Instant::now() + Duration::from_secs(2) < until {
        urgent.push(prioritized(addr, i, 0));
        i += 1;
    }
    let low: Vec<_> = background.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect();
    let refused = urgent.iter().filter(|o| !o.ok()).count();
    ensure!(
        refused == 0,
        "{refused} of {} urgent requests did not complete: {:?}",
        urgent.len(),
        urgent.iter().find(|o| !o.ok()).map(|o| (o.status, o.error.clone()))
    );
    let hung = low.iter().filter(|o| o.hung || !o.terminal).count();
    ensure!(hung == 0, "{hung} background requests hung");
    let other: Vec<_> =
        low.iter().filter(|o| !o.ok() && o.status != 429).map(|o| (o.status, o.error.clone())).collect();
    ensure!(other.is_empty(), "background failures other than 429: {other:?}");
    let low_done: Vec<f64> = low.iter().filter(|o| o.ok()).map(|o| o.e2e.as_secs_f64()).collect();
    let refused_low = low.iter().filter(|o| o.status == 429).count();
    ensure!(
        refused_low > 0,
        "no background request was refused: the queue never filled, the scenario tested nothing"
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (hi, lo) = (median(urgent.iter().map(|o| o.e2e.as_secs_f64()).collect()), median(low_done.clone()));
    ensure!(hi < lo, "urgent requests took {hi:.1} s (median) against the background's {lo:.1} s: priority changed nothing");
    s.recovered(&[])?;
    Ok(Row {
        sent: urgent.len() + low.len(),
        completed: urgent.len() + low_done.len(),
        errors: refused_low,
        hung: 0,
        note: format!(
            "24 background clients (priority 10) saturating 4 in flight + 8 queued for {secs} s, urgent requests (priority 0) one after another: {} of {} urgent completed, median {hi:.1} s against {lo:.1} s for the background's {} completed; {refused_low} background answered 429",
            urgent.len(),
            urgent.len(),
            low_done.len()
        ),
    })
}

/// SGLang #31800 / vLLM #50719 ("Timeout waiting for P side ready"): a receiver stuck mid-transfer
/// never checked its timeout and throughput collapsed with the KV pool empty. Here the prefill
/// worker's test hooks fault its own offers by prompt length: prompts of 300 tokens and more send
/// their first block and then nothing (`--test-stall-transfer 300`), prompts of 100-299 never hear the
/// receiver's done notice (`--test-drop-done 100`); the decode worker gives a pull 4 s
/// (`--kv-transfer-timeout-s 4`). Each faulted request ends with an explicit error well within its
/// deadline (after its retries, if the router makes any), short requests served meanwhile all
/// complete, and both workers' leases and blocks are back to zero after.
pub(super) fn transfer_stalled(s: &mut Stack, short: bool) -> Result<Row> {
    let addr: std::net::SocketAddr = s.router.trim_start_matches("http://").parse()?;
    let n = if short { 2 } else { 4 };
    let send = move |words: usize, i: usize| {
        std::thread::spawn(move || {
            let content = format!("Case {i}: {}", pdserve_loadgen::words(words, 90_000 + i as u64));
            let body = serde_json::json!({"messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": true, "timeout": 60});
            chat_within_60s(addr, &body)
        })
    };
    // Stalled mid-transfer (about 350 tokens), the done notice lost (about 130), and short ones.
    let stalled: Vec<_> = (0..n).map(|i| send(250, i)).collect();
    let deaf: Vec<_> = (0..n).map(|i| send(80, 100 + i)).collect();
    let healthy: Vec<_> = (0..2 * n).map(|i| send(8, 200 + i)).collect();
    let join = |v: Vec<std::thread::JoinHandle<pdserve_loadgen::Observation>>| -> Vec<_> {
        v.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    };
    let (stalled, deaf, healthy) = (join(stalled), join(deaf), join(healthy));
    for (what, v) in [("stalled", &stalled), ("done lost", &deaf)] {
        for o in v.iter() {
            ensure!(o.terminal && !o.hung, "a {what} transfer's request hung");
            ensure!(!o.ok(), "a {what} transfer's request completed: the hook did not fire");
            ensure!(o.e2e < Duration::from_secs(40), "a {what} transfer's request took {:?} to end", o.e2e);
        }
    }
    let ok = healthy.iter().filter(|o| o.ok()).count();
    ensure!(
        ok == healthy.len(),
        "{ok} of {} short requests completed beside the faulted ones",
        healthy.len()
    );
    s.recovered(&[])?;
    let errors: std::collections::BTreeSet<String> = stalled
        .iter()
        .chain(&deaf)
        .map(|o| format!("{} {}", o.status, o.error.clone().unwrap_or_default()))
        .collect();
    let slowest = stalled.iter().chain(&deaf).map(|o| o.e2e.as_secs_f64()).fold(0.0, f64::max);
    Ok(Row {
        sent: 4 * n,
        completed: ok,
        errors: 2 * n,
        hung: 0,
        note: format!(
            "{n} senders stuck after the first block and {n} done notices lost, pull timeout 4 s: each ended explicitly ({errors:?}) within {slowest:.1} s, {ok} short requests beside them completed, leases and blocks freed on both sides"
        ),
    })
}

/// `n` required string properties, each with a pattern: about 70 bytes of schema and (at 16,000) a
/// third of a millisecond of compiling each, growing faster than linearly.
fn patterned_properties(n: usize) -> serde_json::Value {
    let props: serde_json::Map<String, serde_json::Value> = (0..n)
        .map(|i| (format!("p{i}"), serde_json::json!({"type": "string", "pattern": "[a-z]{1,40}(x|y){3,9}"})))
        .collect();
    let required: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    serde_json::json!({"type": "object", "properties": props, "required": required})
}

/// 40 definitions, each `anyOf` an array of, an object of two of, or the one before it, under a
/// `oneOf` 30 deep: a small schema whose expansion would be exponential.
fn nested_schema() -> serde_json::Value {
    let mut defs = serde_json::Map::new();
    defs.insert("d0".into(), serde_json::json!({"type": "integer"}));
    for i in 1..=40 {
        let p = format!("#/$defs/d{}", i - 1);
        defs.insert(
            format!("d{i}"),
            serde_json::json!({"anyOf": [{"type": "array", "items": {"$ref": p}},
                {"type": "object", "properties": {"x": {"$ref": p}, "y": {"$ref": p}}}, {"$ref": p}]}),
        );
    }
    let mut s = serde_json::json!({"$ref": "#/$defs/d40"});
    for i in 0..30 {
        s = serde_json::json!({"oneOf": [s, {"type": "object", "properties": {format!("k{i}"): {"type": "boolean"}}}]});
    }
    s["$defs"] = serde_json::Value::Object(defs);
    s
}

/// What an adversarial request must come to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bounded {
    /// A 400 naming the compile bound.
    CompileTimeout,
    /// A 200, or a 400 for its constraint: the worker stays up either way.
    AnswerOr400,
    /// A 200 whose whitespace runs are at most 16 long.
    ShortWhitespace,
}

/// vLLM #54003 / #45012: a grammar compile with no time bound blocked a request forever or crashed
/// the engine; a schema allowing unbounded whitespace ran to `max_tokens`. Here the workers bound a
/// compile at 2 s (`--grammar-compile-timeout-s 2`), and while 4 neighbours stream, six adversarial
/// constrained requests arrive at once: 16,000 patterned properties (1.1 MB, about 6 s of compiling: a
/// 400 naming the bound), 8,000 of them (540 kB: its compile once overflowed the thread's stack and
/// aborted the worker), 40 `anyOf` definitions under a 30-deep `oneOf`, a recursive `$ref` tree, an
/// integer list asking for flexible whitespace, and a grammar with an unbounded whitespace run: each
/// ends in bounded time (a 400, or an answer), no worker exits, the flexible JSON's whitespace runs
/// stay at most 16, and the neighbours' worst gap between tokens stays within 1 s of what it is
/// without them (compiles run beside the text thread, at a lower priority than the steps).
pub(super) fn adversarial_schema(s: &mut Stack, short: bool) -> Result<Row> {
    let tokens = if short { 64 } else { 128 };
    let worst_gap = |obs: &[Observation]| {
        obs.iter().flat_map(|o| o.itl.iter()).map(Duration::as_secs_f64).fold(0.0, f64::max)
    };
    let alone = streams(&s.router.clone(), 4, tokens, 120.0, || {});
    ensure!(alone.iter().all(Observation::ok), "neighbours alone failed: {:?}", tally(&alone));
    let chat = |content: &str, max_tokens: u64| {
        serde_json::json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                           "temperature": 0, "timeout": 60})
    };
    let schema = |name: &str, s: serde_json::Value| {
        let mut b = chat("Answer in JSON.", 32);
        b["response_format"] =
            serde_json::json!({"type": "json_schema", "json_schema": {"name": name, "schema": s}});
        b
    };
    let recursive = serde_json::json!({"$defs": {"n": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "children": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "required": ["name", "children"]}}, "$ref": "#/$defs/n"});
    let flexible = serde_json::json!({"type": "array", "items": {"type": "integer"},
                                      "x-guidance": {"whitespace_flexible": true}});
    let mut spaces = chat("Write a, then as many spaces as you like, then b.", 48);
    spaces["guided_grammar"] = serde_json::json!("start: \"a\" WS \"b\"\nWS: /[ \\t\\n]*/\n");
    let cases: Vec<(&str, serde_json::Value, Bounded)> = vec![
        ("16,000 properties", schema("big", patterned_properties(16_000)), Bounded::CompileTimeout),
        ("8,000 properties", schema("deep", patterned_properties(8_000)), Bounded::AnswerOr400),
        ("nested anyOf/oneOf", schema("nested", nested_schema()), Bounded::AnswerOr400),
        ("recursive $ref", schema("tree", recursive), Bounded::AnswerOr400),
        ("flexible whitespace", schema("list", flexible), Bounded::ShortWhitespace),
        ("unbounded whitespace grammar", spaces, Bounded::AnswerOr400),
    ];
    let n = cases.len();
    let cases = Arc::new(cases);
    let mut results = Vec::new();
    let url = s.router.clone();
    let with = {
        let cases = Arc::clone(&cases);
        streams(&s.router.clone(), 4, tokens, 120.0, || {
            results = in_parallel(n, n, move |i| {
                let start = std::time::Instant::now();
                let body = serde_json::to_vec(&cases[i].1).unwrap_or_default();
                let r = call_within("POST", &url, "/v1/chat/completions", &body, Duration::from_secs(70));
                (r.map_err(|e| format!("{e:#}")), start.elapsed())
            });
        })
    };
    let mut notes = Vec::new();
    let mut answered = 0;
    for ((name, _, want), (r, took)) in cases.iter().zip(&results) {
        let (status, body) = r.as_ref().map_err(|e| anyhow::anyhow!("{name}: no answer in {took:?}: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let message = v["error"]["message"].as_str().unwrap_or_default();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        match want {
            Bounded::CompileTimeout => ensure!(
                *status == 400 && message.contains("did not compile within") && took.as_secs_f64() < 20.0,
                "{name}: status {status} ({message}) in {took:?}, wanted a 400 for the compile bound"
            ),
            Bounded::AnswerOr400 => {
                ensure!(
                    matches!(status, 200 | 400),
                    "{name}: status {status} ({message}), wanted an answer or a 400"
                )
            }
            Bounded::ShortWhitespace => {
                ensure!(*status == 200, "{name}: status {status} ({message})");
                let run = text.split(|c: char| !c.is_whitespace()).map(str::len).max().unwrap_or(0);
                ensure!(run <= 16, "{name}: a whitespace run of {run} in {text:?}");
            }
        }
        answered += usize::from(*status == 200);
        notes.push(format!("{name}: {status} in {:.1} s", took.as_secs_f64()));
    }
    ensure!(
        with.iter().all(Observation::ok),
        "neighbours failed beside the adversarial requests: {:?}",
        tally(&with)
    );
    let (before, after) = (worst_gap(&alone), worst_gap(&with));
    ensure!(
        after <= before + 1.0,
        "the neighbours' worst gap between tokens went from {before:.2} s to {after:.2} s beside the adversarial requests"
    );
    s.recovered(&[])?;
    let mut row = tally(&with);
    row.sent += n;
    row.completed += answered;
    row.errors += n - answered;
    row.note = format!(
        "{}; the neighbours' worst token gap {before:.2} s alone, {after:.2} s beside them; no worker exited",
        notes.join(", ")
    );
    Ok(row)
}
