//! `cargo xtask bench memory`: what a worker holds resident, per weight format. One unified worker at
//! a time (`--weights f32`, `bf16`, `f16`, `q8`, `q4`), each asked for an answer, then measured: its resident set
//! (`VmRSS`) against the bytes of the weights it holds (every form it reads, as `/v1/models` reports
//! them) plus the KV pool, and its peak resident set (`VmHWM`, loading included). Everything it starts
//! it stops.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::serve::{start_stack, stop_all, Spec};

const USAGE: &str = "cargo xtask bench memory [--kv-blocks N] [--out PATH]

Starts one unified worker per weight format (f32, bf16, f16, q8, q4) on port 8103 with the default model, asks it
one question, and reports its resident memory (VmRSS) against the bytes of the weights it holds plus
its KV pool. Defaults: --kv-blocks 1024, out target/bench/memory.json.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut kv_blocks, mut out) = (1024usize, "target/bench/memory.json".to_owned());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--kv-blocks" => kv_blocks = v()?.parse()?,
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
    let logs = crate::workspace_root().join("target/bench/memory-logs");
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>14} {:>10} {:>10} {:>16} {:>10}",
        "weights", "weights MiB", "KV MiB", "RSS MiB", "RSS/(weights+KV)", "peak MiB"
    );
    for weights in ["f32", "bf16", "f16", "q8", "q4"] {
        let extra: Vec<String> = ["--weights", weights, "--kv-blocks", &kv_blocks.to_string()]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let spec = Spec::unified_worker(8103, &model, &extra, &logs);
        let mut stack = start_stack(&spec)?;
        let measured = (|| -> Result<(u64, u64, u64, u64)> {
            let body = br#"{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16}"#;
            let (status, _) = crate::where_::call("POST", &stack.url, "/v1/chat/completions", body)?;
            if status != 200 {
                bail!("the {weights} worker answered {status}");
            }
            let (_, models) = crate::where_::get(&stack.url, "/v1/models")?;
            let models: serde_json::Value = serde_json::from_slice(&models)?;
            let m = &models["data"][0];
            let field = |k: &str| m[k].as_u64().with_context(|| format!("/v1/models has no {k}"));
            let status = std::fs::read_to_string(format!("/proc/{}/status", stack.procs[0].child.id()))?;
            let kib = |key: &str| -> Result<u64> {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse::<u64>().ok())
                    .with_context(|| key.to_owned())
            };
            Ok((field("weight_bytes")?, field("kv_bytes")?, kib("VmRSS:")? * 1024, kib("VmHWM:")? * 1024))
        })();
        stop_all(&mut stack.procs, Duration::from_secs(10));
        let (w, kv, rss, peak) = measured?;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let ratio = rss as f64 / (w + kv) as f64;
        println!(
            "{weights:<8} {:>14.1} {:>10.1} {:>10.1} {ratio:>16.2} {:>10.1}",
            mib(w),
            mib(kv),
            mib(rss),
            mib(peak)
        );
        rows.push(
            serde_json::json!({"weights": weights, "weight_bytes": w, "kv_bytes": kv, "rss_bytes": rss,
            "ratio": ratio, "peak_rss_bytes": peak}),
        );
    }
    if let Some(dir) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&rows)?)?;
    println!("raw figures in {out}");
    Ok(())
}
