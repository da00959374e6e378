//! `cargo xtask bench deepseek`: the DeepSeek path (latent attention, DeepSeekMoE) against llama.cpp's
//! `deepseek2` path, through HTTP, alternating run by run (A B A B), on a random DeepSeek-V3-shaped
//! model the repository makes (`pdserve_import::RandomDeepSeek::bench()`: about 1.2B parameters, 0.3B
//! active) with the default model's tokenizer. llama.cpp gets the same checkpoint converted by its own
//! `convert_hf_to_gguf.py` (bf16), run in a virtual environment of the converter's pinned torch and
//! transformers under `~/.cache/pdserve/peers/`. The rows are `cargo xtask bench llamacpp`'s; then
//! the KV bytes per token (the latent cache's beside an expanded per-head cache's) and each server's
//! peak resident memory. Everything it starts it stops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::peer::Isa;
use crate::serve::{start_stack, stop_all, Spec};
use crate::vs_llamacpp::{bench_pair, peak_rss_mb, pick_rows, table_row, PeerPerRow, Row, ROWS};

const USAGE: &str = "cargo xtask bench deepseek [--repeat K] [--rows LIST] [--prepare]

A random DeepSeek-V3-shaped model (hidden 1024, 12 layers, 16 heads, kv_lora 512 + rope 64, 64
experts of 512 in 8 groups, top 6 + 1 shared; bf16) written once to ~/.cache/pdserve/bench/, and its
GGUF (bf16) made once by llama.cpp's convert_hf_to_gguf.py (torch 2.11.0 and transformers 4.57.6 in
~/.cache/pdserve/peers/convert-venv, installed on first use: about 3 GB). One unified worker of ours
(--weights auto: bf16, --speculative off) on 8121 and llama-server (-t 2, -c 16384, in its fastest
setting per row: -np 1, or -np 32 -kvu for 32 streams) on 8189; `cargo xtask bench llamacpp`'s
rows (single, streams32, prefill, long) alternating, K pairs (default 3). Table: target/bench/vs-llamacpp-deepseek.md. --prepare: only write the model and its GGUF.";

/// The converter's pinned Python packages.
const CONVERT_PACKAGES: &[&str] = &["torch==2.11.0", "transformers==4.57.6", "numpy", "pyyaml", "tqdm"];

fn cache() -> PathBuf {
    pdserve_import::fetch::models_dir().parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The random model's folder (written once, the default model's tokenizer beside it).
pub(crate) fn model(default: &Path) -> Result<PathBuf> {
    model_shaped(default, false)
}

/// The random model with a multi-token prediction layer (`cargo xtask bench spec --model
/// deepseek-mtp`), in a folder of its own.
pub(crate) fn model_with_mtp(default: &Path) -> Result<PathBuf> {
    model_shaped(default, true)
}

/// The random model with its routed experts shipped in MXFP4 (`cargo xtask bench formats --formats
/// mxfp4,bf16`): the same values, each rounded to its e2m1 code and power of two.
pub(crate) fn model_mxfp4(default: &Path) -> Result<PathBuf> {
    let shape =
        pdserve_import::RandomDeepSeek { mxfp4_experts: true, ..pdserve_import::RandomDeepSeek::bench() };
    model_written(default, "bench/deepseek-v3-random-1b-mxfp4", shape)
}

fn model_shaped(default: &Path, mtp: bool) -> Result<PathBuf> {
    let name = if mtp { "bench/deepseek-v3-random-1b-mtp" } else { "bench/deepseek-v3-random-1b" };
    model_written(
        default,
        name,
        pdserve_import::RandomDeepSeek { mtp, ..pdserve_import::RandomDeepSeek::bench() },
    )
}

fn model_written(default: &Path, name: &str, shape: pdserve_import::RandomDeepSeek) -> Result<PathBuf> {
    let dir = cache().join(name);
    if dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let (total, active) = shape.parameters();
    eprintln!(
        "bench: writing a random DeepSeek-V3 shape ({:.2}B parameters, {:.2}B active) to {}",
        total as f64 / 1e9,
        active as f64 / 1e9,
        dir.display()
    );
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    shape.write(&tmp)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(default.join(f), tmp.join(f)).with_context(|| format!("copying {f}"))?;
    }
    std::fs::rename(&tmp, &dir)?;
    Ok(dir)
}

/// llama.cpp's converter's Python, its packages installed on first use.
fn convert_python() -> Result<PathBuf> {
    let venv = cache().join("peers/convert-venv");
    let python = venv.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", "import torch, transformers, yaml, tqdm, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ready {
        return Ok(python);
    }
    eprintln!(
        "bench: installing llama.cpp's converter's packages into {} (once; about 3 GB)",
        venv.display()
    );
    crate::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    crate::run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(CONVERT_PACKAGES),
    )?;
    Ok(python)
}

/// The model's bf16 GGUF, made once by llama.cpp's own converter.
fn gguf(model: &Path, llama: &Path) -> Result<PathBuf> {
    let out = model.with_extension("bf16.gguf");
    if out.exists() {
        return Ok(out);
    }
    let python = convert_python()?;
    let partial = out.with_extension("partial");
    crate::run(
        Command::new(python)
            .arg(llama.join("convert_hf_to_gguf.py"))
            .arg(model)
            .args(["--outtype", "bf16", "--outfile"])
            .arg(&partial),
    )?;
    std::fs::rename(&partial, &out)?;
    Ok(out)
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut repeat, mut rows): (usize, Vec<&Row>) = (3, ROWS.iter().collect());
    let mut prepare = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--repeat" => repeat = v()?.parse()?,
            "--rows" => rows = pick_rows(&v()?)?,
            "--prepare" => prepare = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let default = crate::fetch_model(&[])?;
    let model = model(&default)?;
    if prepare {
        crate::peer::llamacpp_source_only()?;
        let gguf = gguf(&model, &crate::peer::llamacpp_source())?;
        println!("{}\n{}", model.display(), gguf.display());
        return Ok(());
    }
    let (server, _) = crate::peer::llamacpp_for(Isa::Native)?;
    let gguf = gguf(&model, &crate::peer::llamacpp_source())?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    crate::sys::install_stop_handler();
    let root = crate::workspace_root();
    let logs = root.join("target/bench/vs-llamacpp-deepseek-logs");
    let extra = ["--speculative".to_owned(), "off".into()];
    let ours_logs = logs.join("ours");
    let spec = Spec::unified_worker(8121, &model, &extra, &ours_logs);
    let mut table = format!(
        "| ISA | figure | ours (bf16, latent KV), median (min-max) | llama.cpp (bf16, deepseek2 MLA), median (min-max) | ours vs llama.cpp, median of {repeat} pairs (min-max) |\n|---|---|---|---|---|\n"
    );
    let mut ours = start_stack(&spec)?;
    let result = (|| -> Result<String> {
        let mut peers = PeerPerRow::new(&server, &gguf, &logs);
        for row in &rows {
            let peer = peers.for_row(row)?;
            let out = root.join(format!("target/bench/vs-llamacpp-deepseek-{}", row.name));
            println!("\n== deepseek {}: {} ours, {} llama.cpp", row.what, ours.url, peer.url);
            let json = bench_pair(row, (&ours.url, &peer.url), repeat, &out)?;
            table.push_str(&table_row(Isa::Native, row, &json, &ours.url, &peer.url)?);
        }
        let (_, body) = crate::where_::get(&ours.url, "/v1/models")?;
        let models: serde_json::Value = serde_json::from_slice(&body).context("/v1/models")?;
        let m = &models["data"][0];
        let shape = pdserve_import::RandomDeepSeek::bench();
        let expanded = shape.layers * shape.heads * (shape.nope + shape.rope + shape.v) * 2;
        let ours_pid = ours.procs.first().context("no worker")?.child.id();
        let peer_rss = peers.peak_rss_mb()?;
        Ok(format!(
            "\nKV per token: {} bytes in the latent cache ({} layers x ({} + {}) f16 values), against {expanded} bytes \
             for the same heads' K and V expanded ({:.1}x)\nMemory: ours {} MB (weights {} MB, KV pool {} MB), llama.cpp {} MB \
             (-np {}; peak resident, VmHWM)\n",
            m["kv_bytes_per_token"],
            shape.layers,
            shape.kv_lora,
            shape.rope,
            expanded as f64 / m["kv_bytes_per_token"].as_f64().unwrap_or(f64::NAN),
            peak_rss_mb(ours_pid)?,
            m["weight_bytes"].as_u64().unwrap_or(0) / 1_000_000,
            m["kv_bytes"].as_u64().unwrap_or(0) / 1_000_000,
            peer_rss.1,
            peer_rss.0
        ))
    })();
    stop_all(&mut ours.procs, Duration::from_secs(20));
    table.push_str(&result?);
    let path = root.join("target/bench/vs-llamacpp-deepseek.md");
    std::fs::write(&path, &table)?;
    println!("\n{table}\nwritten to {}", path.display());
    Ok(())
}
