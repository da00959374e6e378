//! `cargo xtask bench transfer`: the KV transfer as served, between two worker processes. Two pairs
//! of release workers run at once on the default model (Q4 weights, f16 KV): one whose prefill worker
//! keeps its KV in shared memory (`--kv-shm`, the decode worker copies named blocks out of
//! `/dev/shm`), one over TCP (blocks inline over loopback). For each prompt size, alternating the two
//! pairs, a prompt unique to the run is prefilled and its KV pulled by the decode worker; the decode
//! worker's own `kv_pull_ms` (from its first frame to the last block in its KV memory) and
//! `kv_pulled_bytes` give the rate, set beside a memcpy of the same bytes measured in this process in
//! the same run. Raw results in `target/bench/transfer.json`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::serve::{stop_all, Proc};

const USAGE: &str = "cargo xtask bench transfer [--tokens 128,2048,8000] [--repeat 3] [--out PATH]

Starts a prefill + decode pair over shared memory and one over TCP (release builds, the default
model), and for each prompt size pulls the KV of prompts unique to the run, alternating the pairs,
--repeat times each. Reports the decode worker's pull time as GB/s beside memcpy of the same bytes.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut sizes, mut repeat) = (vec![128usize, 2048, 8000], 3usize);
    let mut out = "target/bench/transfer.json".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--tokens" => sizes = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--repeat" => repeat = v()?.parse()?,
            "--out" => out = v()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let model = crate::fetch_model(&[])?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server"])?;
    crate::sys::install_stop_handler();
    let bin = crate::workspace_root().join("target/release/pdserve-server");
    let logs = crate::workspace_root().join("target/bench/transfer-logs");
    std::fs::create_dir_all(&logs)?;
    let scope = format!("bench{}", std::process::id());
    let worker = |name: &str, extra: &[&str]| -> Result<Proc> {
        let mut a: Vec<String> = ["--port", "0", "--name", name, "--weights", "q4", "--shm-scope", &scope]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a.extend(["--model".to_owned(), model.display().to_string()]);
        Proc::start(name, &bin, &a, &logs)
    };
    let mut procs = vec![
        worker("shm-prefill", &["--role", "prefill", "--kv-shm"])?,
        worker("shm-decode", &["--role", "decode"])?,
        worker("tcp-prefill", &["--role", "prefill"])?,
        worker("tcp-decode", &["--role", "decode"])?,
    ];
    let result = measure(&procs, &sizes, repeat, &out);
    stop_all(&mut procs, std::time::Duration::from_secs(10));
    result
}

/// One pull: the prompt prefilled on `prefill`, its KV pulled by `decode`: (prompt tokens, bytes,
/// `kv_pull_ms`, `transfer_ms` (from the decode request's arrival, tokenizing included)).
fn pull(prefill: &str, decode: &str, prompt: &str) -> Result<(u64, u64, f64, f64)> {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    // An 8,000-token prefill takes a while on a CPU.
    let limit = std::time::Duration::from_secs(300);
    let (s, b) =
        crate::where_::call_within("POST", prefill, "/v1/completions", body.to_string().as_bytes(), limit)?;
    ensure!(s == 200, "prefill answered {s}: {}", String::from_utf8_lossy(&b));
    let handle: Value = serde_json::from_slice(&b)?;
    let mut body = body;
    body["pd_transfer"] = handle["pd_transfer"].clone();
    let (s, b) =
        crate::where_::call_within("POST", decode, "/v1/completions", body.to_string().as_bytes(), limit)?;
    ensure!(s == 200, "decode answered {s}: {}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b)?;
    let t = &v["timings"];
    let field = |k: &str| t[k].as_f64().with_context(|| format!("no timings.{k} in {v}"));
    let (tokens, bytes) =
        (v["usage"]["prompt_tokens"].as_u64().unwrap_or(0), field("kv_pulled_bytes")? as u64);
    Ok((tokens, bytes, field("kv_pull_ms")?, field("transfer_ms")?))
}

/// Best-of-3 memcpy rate of `bytes`, block by block as the KV moves (368,640-byte blocks).
fn memcpy_gbps(bytes: u64) -> f64 {
    const BLOCK: usize = 368_640;
    let n = (bytes as usize).div_ceil(BLOCK);
    let src: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; BLOCK]).collect();
    let mut dst: Vec<Vec<u8>> = vec![vec![0u8; BLOCK]; n];
    let best = (0..3)
        .map(|_| {
            let t = Instant::now();
            for (d, s) in dst.iter_mut().zip(&src) {
                d.copy_from_slice(std::hint::black_box(s));
            }
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min);
    (n * BLOCK) as f64 / best / 1e9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(procs: &[Proc], sizes: &[usize], repeat: usize, out: &str) -> Result<()> {
    let url = |name: &str| procs.iter().find(|p| p.name == name).map(|p| p.url.clone()).unwrap_or_default();
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos();
    let mut raw = Vec::new();
    println!(
        "{:>7} {:>9} {:>8} {:>22} {:>8} {:>22} {:>8}",
        "tokens", "MB", "memcpy", "shm GB/s (min-max)", "/memcpy", "tcp GB/s (min-max)", "/memcpy"
    );
    let mut rows = Vec::new();
    for &tokens in sizes {
        // About one token per word of this vocabulary; each prompt starts with the run's nonce and
        // its own number, so no prefix cache holds any of it.
        let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut bytes_seen = 0u64;
        for r in 0..repeat * 2 {
            let (pair, which) = if r % 2 == 0 { ("shm", 0) } else { ("tcp", 1) };
            let words = pdserve_loadgen::words(
                tokens.saturating_sub(8).max(1),
                (nonce as u64) ^ (r as u64 * 7919 + tokens as u64),
            );
            let prompt = format!("Run {nonce} try {r}: {words}");
            let (prefill, decode) = (url(&format!("{pair}-prefill")), url(&format!("{pair}-decode")));
            let (prompt_tokens, bytes, ms, transfer_ms) = pull(&prefill, &decode, &prompt)?;
            let gbps = bytes as f64 / (ms / 1e3) / 1e9;
            bytes_seen = bytes_seen.max(bytes);
            rates[which].push(gbps);
            raw.push(json!({
                "tokens": tokens, "prompt_tokens": prompt_tokens, "pair": pair, "bytes": bytes,
                "kv_pull_ms": ms, "transfer_ms": transfer_ms, "gbps": gbps,
            }));
        }
        let memcpy = memcpy_gbps(bytes_seen);
        let cell = |v: &mut Vec<f64>| {
            let (lo, hi) =
                (v.iter().copied().fold(f64::MAX, f64::min), v.iter().copied().fold(0.0, f64::max));
            let m = median(v);
            (m, format!("{m:.2} ({lo:.2}-{hi:.2})"))
        };
        let (shm, shm_cell) = cell(&mut rates[0]);
        let (tcp, tcp_cell) = cell(&mut rates[1]);
        println!(
            "{tokens:>7} {:>9.1} {memcpy:>8.2} {shm_cell:>22} {:>8.3} {tcp_cell:>22} {:>8.3}",
            bytes_seen as f64 / 1e6,
            shm / memcpy,
            tcp / memcpy
        );
        rows.push(json!({"tokens": tokens, "bytes": bytes_seen, "memcpy_gbps": memcpy, "shm_gbps": shm, "tcp_gbps": tcp}));
    }
    let path = crate::workspace_root().join(out);
    if let Some(dir) = Path::new(&path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json!({"rows": rows, "runs": raw}))?)?;
    println!("raw results: {}", path.display());
    Ok(())
}
