//! `cargo xtask bench observability`: what KV events and traces cost serving. Two PD stacks (router,
//! prefill and decode worker each) on this machine: one plain, one with every process exporting spans
//! to an OTLP collector (`--otlp-traces-endpoint`) and every worker publishing KV events that its
//! router follows (`--kv-events`: precise prefix routing). The load generator runs against both,
//! alternating (A B A B), every point's prompts unique to it; the collector here answers 200 to every
//! batch and counts the bytes, so spans really leave each process. Everything it starts it stops.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::peer::Isa;
use crate::serve::{start_stack, stop_all, Spec, Stack};
use crate::vs_llamacpp::{bench_pair, pick_rows, repeat_and_rows, table_row};

const USAGE: &str = "cargo xtask bench observability [--repeat K] [--rows LIST]

Starts two PD stacks of the default model (ports 8141: plain; 8142: spans exported by the router and
both workers to a collector started here, and KV events published by both workers and followed by
the router), then runs `cargo xtask bench llamacpp`'s rows against both, alternating, K pairs (default
5): streams32 and single by default (see `cargo xtask bench llamacpp --help`). The tables (throughput,
plain against observed: above 1 is the plain stack ahead; and the CPU seconds each stack's processes
used over the row, the same requests to both) are printed and written to
target/bench/observability.md; raw JSON to target/bench/observability-ROW.json.";

/// A collector that takes every OTLP/HTTP batch (any path) and answers 200, counting batches and
/// bytes; it stops with the flag.
fn collector(stop: Arc<AtomicBool>, batches: Arc<AtomicU64>, bytes: Arc<AtomicU64>) -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    l.set_nonblocking(true)?;
    let port = l.local_addr()?.port();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok((mut s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let (mut got, mut buf) = (Vec::new(), [0u8; 16 * 1024]);
            // The head, then Content-Length bytes of body (the exporters send no chunked bodies).
            let total = loop {
                let Ok(n) = s.read(&mut buf) else { break None };
                if n == 0 {
                    break None;
                }
                got.extend_from_slice(&buf[..n]);
                let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok())
                    })
                    .unwrap_or(0);
                break Some(end + 4 + len);
            };
            let Some(total) = total else { continue };
            while got.len() < total {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            batches.fetch_add(1, Ordering::Relaxed);
            bytes.fetch_add(got.len() as u64, Ordering::Relaxed);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    Ok(port)
}

/// User + system CPU seconds each of the stack's processes (every thread) has used, in the stack's
/// order (prefill, decode, router), from `/proc/PID/stat` (clock ticks of 1/100 s, as Linux reports
/// them).
fn cpu_seconds(stack: &Stack) -> Vec<f64> {
    stack
        .procs
        .iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.child.id())).unwrap_or_default();
            // Fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            (ticks(11) + ticks(12)) / 100.0
        })
        .collect()
}

/// `after - before`, per process, as "name s, name s" and the total.
fn cpu_used(stack: &Stack, before: &[f64]) -> (String, f64) {
    let after = cpu_seconds(stack);
    let used: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    let each = stack.procs.iter().zip(&used).map(|(p, u)| format!("{} {u:.1}", p.name)).collect::<Vec<_>>();
    (each.join(", "), used.iter().sum())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let Some((repeat, rows)) = repeat_and_rows(args, (5, pick_rows("streams32,single")?), USAGE)? else {
        return Ok(());
    };
    let root = crate::workspace_root();
    crate::serve::build_stack()?;
    let model = crate::fetch_model(&[])?;
    crate::sys::install_stop_handler();
    let (stop, batches, bytes) = (Arc::new(AtomicBool::new(false)), Arc::default(), Arc::default());
    let port = collector(Arc::clone(&stop), Arc::clone(&batches), Arc::clone(&bytes))?;
    let otlp = format!("http://127.0.0.1:{port}");
    let logs = root.join("target/bench/observability-logs");
    let extra = vec!["--speculative".to_owned(), "off".to_owned()];
    let mut observed_extra = extra.clone();
    observed_extra.extend([
        "--otlp-traces-endpoint".to_owned(),
        otlp.clone(),
        "--kv-events-config".to_owned(),
        r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#
            .to_owned(),
    ]);
    let observed_router = vec![
        "--otlp-traces-endpoint".to_owned(),
        otlp,
        "--tokenizer".to_owned(),
        model.display().to_string(),
    ];
    let spec = |port, extra, router_extra, logs| Spec {
        port,
        model: &model,
        native_q4: true,
        unified: false,
        prefills: 1,
        decodes: 1,
        extra,
        logs,
        secret: true,
        server_bin: None,
        bin_dir: None,
        router_extra,
        divide_cores: None,
    };
    let (plain_logs, observed_logs) = (logs.join("plain"), logs.join("observed"));
    let mut stacks: Vec<Stack> = Vec::new();
    let mut table = "| figure | plain PD stack, median (min-max) | events + traces, median (min-max) | plain vs observed, median of the pairs (min-max) |\n|---|---|---|---|\n".to_owned();
    let mut cpu = "\n| figure | plain stack's CPU seconds (per process) | observed stack's CPU seconds (per process) | observed vs plain |\n|---|---|---|---|\n".to_owned();
    let result = (|| -> Result<()> {
        stacks.push(start_stack(&spec(8141, &extra, &[], &plain_logs))?);
        stacks.push(start_stack(&spec(8142, &observed_extra, &observed_router, &observed_logs))?);
        let (plain, observed) = (stacks[0].url.clone(), stacks[1].url.clone());
        for row in &rows {
            let out = root.join(format!("target/bench/observability-{}", row.name));
            println!("\n== {}: {plain} plain, {observed} with events and traces", row.what);
            let before = (cpu_seconds(&stacks[0]), cpu_seconds(&stacks[1]));
            let json = bench_pair(row, (&plain, &observed), repeat, &out)?;
            // The same requests went to both (each point's prompts its own), the stacks side by side
            // throughout: what each used is its cost, the observed one's events and spans included.
            let ((ea, a), (eb, b)) = (cpu_used(&stacks[0], &before.0), cpu_used(&stacks[1], &before.1));
            let ratio = b / a.max(1e-9);
            cpu.push_str(&format!("| {} | {a:.1} ({ea}) | {b:.1} ({eb}) | {ratio:.3}x |\n", row.what));
            // The first column is the native ISA's: both stacks run this machine's kernels.
            let line = table_row(Isa::Native, row, &json, &plain, &observed)?;
            table.push_str(&line.splitn(3, '|').nth(2).map_or(line.clone(), |rest| format!("|{rest}")));
        }
        Ok(())
    })();
    for s in &mut stacks {
        stop_all(&mut s.procs, Duration::from_secs(20));
    }
    stop.store(true, Ordering::Relaxed);
    result?;
    let (n, b) = (batches.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed));
    if n == 0 {
        bail!("the collector got no spans: the observed stack exported nothing");
    }
    table.push_str(&cpu);
    table.push_str(&format!(
        "\nThe collector took {n} batches of spans ({b} bytes) from the observed stack.\n"
    ));
    let path = root.join("target/bench/observability.md");
    std::fs::write(&path, &table)?;
    println!("\n{table}\nwritten to {}", path.display());
    Ok(())
}
