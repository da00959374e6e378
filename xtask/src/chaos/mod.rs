//! `cargo xtask chaos [NAME ...] [--short]`: faults against real processes (the router in front of a
//! prefill and a decode worker), each scenario with assertions: every request sent got a terminal
//! outcome within its deadline plus 1 s; `/health/ready` told the truth; requests after recovery
//! succeed; KV, transfer and request ledgers return to their baseline; no process other than the one
//! killed exited. One table row per scenario.

mod k8s;
mod netns;
mod pd2026;
mod scenarios;
mod stack;
mod supervisor;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use pdserve_loadgen::{run_point, Conn, Load, Observation, Progress, Shape, Slo, Target};

use k8s::k8s_topology;
use netns::netns_partition;
use pd2026::{
    accuracy_soak, adversarial_schema, decode_admission_saturated, idle_then_burst, priority_overload,
    transfer_stalled,
};
use scenarios::*;
use stack::{worker_args, Readiness, Stack};

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
    "k8s_topology",
    "accuracy_soak",
    "idle_then_burst",
    "decode_admission_saturated",
    "priority_overload",
    "transfer_stalled",
    "adversarial_schema",
    "supervisor",
];

/// Scenarios that never take the last working path away: readiness must hold in every sample, load
/// included (an 8,000-token prefill, 32 agents, 10x overload: pair probes queue like any request and
/// the scheduler keeps steps short while others wait).
const ALWAYS_READY: &[&str] = &[
    "disconnect_storm",
    "slowloris",
    "hung_worker",
    "bad_input",
    "long_context",
    "overload",
    "soak",
    "accuracy_soak",
    "idle_then_burst",
    "decode_admission_saturated",
    "priority_overload",
    "adversarial_schema",
];

/// The scenarios CI runs (`cargo xtask test`), in their short form.
pub(crate) const CI_SCENARIOS: &[&str] = &[
    "decode_kill",
    "disconnect_storm",
    "hung_worker",
    "k8s_topology",
    "accuracy_soak",
    "idle_then_burst",
    "decode_admission_saturated",
    "priority_overload",
    "transfer_stalled",
    "adversarial_schema",
    "supervisor",
];

/// What a scenario reports for its table row.
#[derive(Debug, Default)]
pub(super) struct Row {
    sent: usize,
    completed: usize,
    errors: usize,
    hung: usize,
    note: String,
}

pub(super) fn shape(max_tokens: u64, timeout_s: f64) -> Shape {
    Shape {
        prompt_words: 30,
        max_tokens,
        timeout: Duration::from_secs_f64(timeout_s),
        grace: Duration::from_secs(1),
        ..Shape::default()
    }
}

pub(super) fn chat_body(max_tokens: u64, timeout_s: f64, i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "messages": [{"role": "user", "content": format!("Story {i}: tell me about {}", pdserve_loadgen::words(20, i as u64))}],
        "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "timeout": timeout_s,
    }))
    .unwrap_or_default()
}

/// `n` streams at once, each in its own thread; `during` runs while they stream.
pub(super) fn streams(
    router: &str,
    n: usize,
    max_tokens: u64,
    timeout_s: f64,
    during: impl FnOnce(),
) -> Vec<Observation> {
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

pub(super) fn tally(outcomes: &[Observation]) -> Row {
    Row {
        sent: outcomes.len(),
        completed: outcomes.iter().filter(|o| o.ok()).count(),
        errors: outcomes.iter().filter(|o| !o.ok() && !o.hung).count(),
        hung: outcomes.iter().filter(|o| o.hung || !o.terminal).count(),
        note: String::new(),
    }
}

/// A few requests after recovery, every one of which must succeed.
pub(super) fn after_recovery(router: &str) -> Result<()> {
    let t = Target::parse(router)?;
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

/// Prints scenario `name`'s table row, and adds it in markdown to `table` (what RELIABILITY.md shows,
/// every cell measured by this run).
pub(super) fn report(
    name: &str,
    started: Instant,
    result: Result<Row>,
    failed: &mut Vec<String>,
    table: &mut Vec<String>,
) {
    let secs = started.elapsed().as_secs_f64();
    match result {
        Ok(r) => {
            println!(
                "{name:<18} {secs:>7.1}s {:>5} {:>9} {:>6} {:>4}  pass: {}",
                r.sent, r.completed, r.errors, r.hung, r.note
            );
            table.push(format!(
                "| {name} | {secs:.1} s | {} | {} | {} | {} | pass: {} |",
                r.sent, r.completed, r.errors, r.hung, r.note
            ));
        }
        Err(e) => {
            println!("{name:<18} {secs:>7.1}s {:>5} {:>9} {:>6} {:>4}  FAIL: {e:#}", "-", "-", "-", "-");
            table.push(format!("| {name} | {secs:.1} s | - | - | - | - | FAIL: {e:#} |"));
            failed.push(name.to_owned());
        }
    }
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
    let mut table = vec![
        "| scenario | time | sent | completed | errors | hung | result |".to_owned(),
        "|---|---|---|---|---|---|---|".to_owned(),
    ];
    for name in &names {
        let started = Instant::now();
        let stall = STALL_TIMEOUT_S.to_string();
        let router_extra: &[&str] = match name.as_str() {
            "overload" => &["--max-in-flight", "8", "--max-queued", "8", "--queue-timeout-s", "3"],
            "decode_stall" => &["--stall-timeout-s", &stall],
            "priority_overload" => &["--max-in-flight", "4", "--max-queued", "8", "--queue-timeout-s", "20"],
            _ => &[],
        };
        // Workers that close idle connections long before the router's pool would (20 s), as
        // vLLM's 5 s keep-alive does behind gateways.
        let worker_extra: &[&str] = match name.as_str() {
            "idle_then_burst" => &["--keep-alive-timeout-s", "2"],
            "adversarial_schema" => &["--grammar-compile-timeout-s", "2"],
            // (Only the prefill worker offers; the decode worker's pulls wait 4 s at most.)
            "transfer_stalled" => {
                &["--test-stall-transfer", "300", "--test-drop-done", "100", "--kv-transfer-timeout-s", "4"]
            }
            _ => &[],
        };
        // A decode worker that admits 4 requests at a time.
        let decode_extra: &[&str] = match name.as_str() {
            "decode_admission_saturated" => &["--max-running", "4"],
            _ => &[],
        };
        if name == "netns_partition" || name == "k8s_topology" || name == "supervisor" {
            let result = match name.as_str() {
                "k8s_topology" => k8s_topology(&bins, &model, short),
                "supervisor" => supervisor::supervisor(short),
                _ => netns_partition(&bins, &model, short),
            };
            report(name, started, result, &mut failed, &mut table);
            continue;
        }
        // Readiness, sampled all along (stopped before the stack is): where the scenario never takes
        // the last path away, it must never have dropped.
        let result = Stack::start(name, (router_extra, worker_extra, decode_extra), &bins, &model).and_then(|mut s| {
            let sampler = Readiness::start(&s.router);
            let result = match name.as_str() {
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
                "accuracy_soak" => accuracy_soak(&mut s, short),
                "idle_then_burst" => idle_then_burst(&mut s, short),
                "decode_admission_saturated" => decode_admission_saturated(&mut s, short),
                "priority_overload" => priority_overload(&mut s, short),
                "transfer_stalled" => transfer_stalled(&mut s, short),
                "adversarial_schema" => adversarial_schema(&mut s, short),
                _ => unreachable!("checked above"),
            };
            let (ready, total, down) = sampler.stop();
            let mut row = result?;
            if ALWAYS_READY.contains(&name.as_str()) {
                ensure!(
                    ready == total,
                    "the router was not ready in {} of {total} samples, though every path stayed (at ms {down:?})",
                    total - ready
                );
            }
            row.note.push_str(&format!("; ready in {ready} of {total} samples (every 100 ms)"));
            Ok(row)
        });
        report(name, started, result, &mut failed, &mut table);
    }
    let out = crate::workspace_root().join("target/chaos/results.md");
    table.push(String::new());
    std::fs::write(&out, table.join("\n"))?;
    println!("table: {}", out.display());
    if !failed.is_empty() {
        bail!("chaos scenarios failed: {} (logs in target/chaos/<scenario>/)", failed.join(", "));
    }
    Ok(())
}
