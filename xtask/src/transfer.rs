//! `cargo xtask bench transfer`: the KV transfer as served, between two worker processes. Two pairs
//! of release workers run at once on the default model (Q4 weights, f16 KV): one whose prefill worker
//! keeps its KV in shared memory (`--kv-shm`, the decode worker copies named blocks out of
//! `/dev/shm`), one over TCP (blocks inline over loopback). For each prompt size, alternating the two
//! pairs, a prompt unique to the run is prefilled and its KV pulled by the decode worker; the decode
//! worker's own `kv_pull_ms` (from its first frame until the KV is usable: the last block in its KV
//! memory and the prefill worker's confirmation that the blocks' lease held) and
//! `kv_pulled_bytes` give the rate, set beside a memcpy of the same bytes in this process right after
//! each pull, from cold caches as the pull's source and destination are (and, once per size, the
//! best of three warm copies). Raw results in `target/bench/transfer.json`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::serve::{stop_all, Proc};

const USAGE: &str = "cargo xtask bench transfer [--tokens 128,2048,8000] [--repeat 3] [--out PATH]

Starts a prefill + decode pair over shared memory and one over TCP (release builds, the default
model), and for each prompt size pulls the KV of prompts unique to the run, alternating the pairs,
--repeat times each. Reports the decode worker's pull time as GB/s and its ratio to a memcpy of the
same bytes from cold caches run right after each pull (medians, min-max), and the ratio to the best
of three warm copies.";

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

/// Memory a memcpy yardstick copies between: `src` (the bytes of a pull, as the prefill worker's
/// region holds them) into `dst` (resident, as a decode worker's KV pool is), block by block as the KV
/// moves (368,640-byte blocks), and `scratch` (twice the last-level cache), read through before a
/// cold copy so that neither end is in the caches, as a pull's are not: its source was written by
/// another process while it prefilled, and the destination is a pool of hundreds of MB. The copy is
/// a plain one (each destination line read before it is written), where a pull writes with streaming
/// stores.
struct Yardstick {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    scratch: Vec<u8>,
}

impl Yardstick {
    const BLOCK: usize = 368_640;

    fn new() -> Yardstick {
        // Twice the last-level cache (32 MiB on the AMD EPYC of BENCHMARKS.md), 64 MiB if unknown.
        let llc = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
            .ok()
            .and_then(|s| s.trim().strip_suffix('K').and_then(|k| k.parse::<usize>().ok()))
            .map_or(32 << 20, |kib| kib << 10);
        Yardstick { src: Vec::new(), dst: Vec::new(), scratch: vec![1; 2 * llc] }
    }

    /// Seconds to copy `bytes`' blocks, once; `cold`: with the caches first filled with other data.
    fn copy(&mut self, bytes: u64, cold: bool) -> (u64, f64) {
        let n = (bytes as usize).div_ceil(Self::BLOCK).max(1);
        while self.src.len() < n {
            // Never all zeros: a zeroed allocation would map the kernel's one zero page, always cached.
            self.src.push(vec![(self.src.len() % 255 + 1) as u8; Self::BLOCK]);
            self.dst.push(vec![1; Self::BLOCK]);
        }
        if cold {
            // Read, not written: the lines it evicts are clean, so no write-back lands in the copy.
            let sum = self.scratch.chunks_exact(64).fold(0u8, |a, line| a.wrapping_add(line[0]));
            std::hint::black_box(sum);
        }
        let t = Instant::now();
        for (d, s) in self.dst.iter_mut().zip(&self.src).take(n) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        ((n * Self::BLOCK) as u64, t.elapsed().as_secs_f64())
    }

    /// GB/s of a copy of `bytes` from cold caches.
    fn cold_gbps(&mut self, bytes: u64) -> f64 {
        let (b, s) = self.copy(bytes, true);
        b as f64 / s / 1e9
    }

    /// GB/s of the best of three copies of `bytes` one after another (what is left of the source and
    /// destination in the caches helps the later ones: the yardstick of earlier runs).
    fn warm_gbps(&mut self, bytes: u64) -> f64 {
        let best =
            (0..3).map(|_| self.copy(bytes, false)).fold((0, f64::MAX), |a, b| if b.1 < a.1 { b } else { a });
        best.0 as f64 / best.1 / 1e9
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(procs: &[Proc], sizes: &[usize], repeat: usize, out: &str) -> Result<()> {
    let url = |name: &str| procs.iter().find(|p| p.name == name).map(|p| p.url.clone()).unwrap_or_default();
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos();
    let mut yardstick = Yardstick::new();
    let mut raw = Vec::new();
    println!(
        "{:>6} {:>6} {:>6} {:>6} {:>20} {:>18} {:>20} {:>18}",
        "tokens",
        "MB",
        "cold",
        "warm",
        "shm GB/s (min-max)",
        "/cold (min-max)",
        "tcp GB/s (min-max)",
        "/cold (min-max)"
    );
    let mut rows = Vec::new();
    for &tokens in sizes {
        // Per pair: each pull's rate, and its ratio to a cold memcpy of the same bytes run right
        // after it (A B A B: the machine's swings touch both alike).
        let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut ratios: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut colds = Vec::new();
        let mut bytes_seen = 0u64;
        for r in 0..repeat * 2 {
            let (pair, which) = if r % 2 == 0 { ("shm", 0) } else { ("tcp", 1) };
            // About one token per word of this vocabulary; each prompt starts with the run's nonce
            // and its own number, so no prefix cache holds any of it.
            let words = pdserve_loadgen::words(
                tokens.saturating_sub(8).max(1),
                (nonce as u64) ^ (r as u64 * 7919 + tokens as u64),
            );
            let prompt = format!("Run {nonce} try {r}: {words}");
            let (prefill, decode) = (url(&format!("{pair}-prefill")), url(&format!("{pair}-decode")));
            let (prompt_tokens, bytes, ms, transfer_ms) = pull(&prefill, &decode, &prompt)?;
            let gbps = bytes as f64 / (ms / 1e3) / 1e9;
            let cold = yardstick.cold_gbps(bytes);
            bytes_seen = bytes_seen.max(bytes);
            rates[which].push(gbps);
            ratios[which].push(gbps / cold);
            colds.push(cold);
            raw.push(json!({
                "tokens": tokens, "prompt_tokens": prompt_tokens, "pair": pair, "bytes": bytes,
                "kv_pull_ms": ms, "transfer_ms": transfer_ms, "gbps": gbps, "memcpy_cold_gbps": cold,
            }));
        }
        let warm = yardstick.warm_gbps(bytes_seen);
        let cell = |v: &mut Vec<f64>, digits: usize| {
            let (lo, hi) =
                (v.iter().copied().fold(f64::MAX, f64::min), v.iter().copied().fold(0.0, f64::max));
            let m = median(v);
            (m, format!("{m:.digits$} ({lo:.digits$}-{hi:.digits$})"))
        };
        let cold = median(&mut colds);
        let [(shm, shm_cell), (tcp, tcp_cell)] = [cell(&mut rates[0], 2), cell(&mut rates[1], 2)];
        let [(shm_ratio, shm_ratio_cell), (tcp_ratio, tcp_ratio_cell)] =
            [cell(&mut ratios[0], 3), cell(&mut ratios[1], 3)];
        let mb = bytes_seen as f64 / 1e6;
        println!(
            "{tokens:>6} {mb:>6.1} {cold:>6.2} {warm:>6.2} {shm_cell:>20} {shm_ratio_cell:>18} \
             {tcp_cell:>20} {tcp_ratio_cell:>18}"
        );
        println!("{:>6} against the warm best-of-3 memcpy: shm {:.3}, tcp {:.3}", "", shm / warm, tcp / warm);
        rows.push(json!({
            "tokens": tokens, "bytes": bytes_seen, "memcpy_cold_gbps": cold, "memcpy_warm_gbps": warm,
            "shm_gbps": shm, "tcp_gbps": tcp, "shm_over_cold": shm_ratio, "tcp_over_cold": tcp_ratio,
        }));
    }
    let path = crate::workspace_root().join(out);
    if let Some(dir) = Path::new(&path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json!({"rows": rows, "runs": raw}))?)?;
    println!("raw results: {}", path.display());
    Ok(())
}
