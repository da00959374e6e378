//! `cargo xtask bench kv-bytes`: what a request's KV costs in DeepSeek V4's compact layout, beside
//! DeepSeek V3's latent cache and an expanded per-head cache, at 4k and 64k tokens of context, read
//! from running servers' `/v1/models`.
//!
//! Two checkpoints with the real models' KV geometry and nothing else of their size (hidden 64, a
//! couple of experts), written once under `~/.cache/pdserve/bench/`: V4-Flash's 43 layers (two
//! sliding, then compressed sparse at 4 with a 128-wide indexer and heavily compressed at 128,
//! alternating; one K=V head of 512, a window of 128, its MTP layer), by the V4 test fixture
//! (`crates/model/tests/fixtures/deepseek_v4_reference.py`, numpy), and V3's 61 layers of
//! `kv_lora_rank` 512 + rope 64 (`pdserve_import::RandomDeepSeek`). Each is served by a unified
//! worker in turn, answers one completion, and its `/v1/models` gives the bytes per token of each kind
//! of row and the fixed per-request state; a context's bytes are `tokens x per token + state`. The
//! expanded cache (per-head K and V, as transformers keeps V3's) is V3's config arithmetic: 128 heads
//! x (192 + 128) values per layer.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::serve::{start_stack, stop_all, Spec};

const USAGE: &str = "cargo xtask bench kv-bytes

DeepSeek V4's compact KV (f16: its compressed rows' bytes per token by kind, and each request's state)
beside DeepSeek V3's latent cache and V3's per-head K and V expanded, at 4,096 and 65,536 tokens, from
unified workers (port 8123) serving checkpoints of the real models' KV geometry. Table:
target/bench/kv-bytes.md.";

const CONTEXTS: [usize; 2] = [4096, 65536];

fn cache() -> PathBuf {
    pdserve_import::fetch::models_dir().parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// V4-Flash's KV geometry, everything else tiny (the fixture's overrides).
fn v4_config() -> Value {
    let mut ratios: Vec<u32> = vec![0, 0];
    ratios.extend((2..43).map(|l| if l % 2 == 0 { 4 } else { 128 }));
    ratios.push(0);
    json!({
        "vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 43, "num_attention_heads": 2,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 16, "o_groups": 1, "o_lora_rank": 16,
        "sliding_window": 128, "compress_ratios": ratios, "index_n_heads": 1, "index_head_dim": 128,
        "index_topk": 512, "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16,
        "max_position_embeddings": 1048576
    })
}

/// V3's KV geometry, everything else tiny.
fn v3_shape() -> pdserve_import::RandomDeepSeek {
    pdserve_import::RandomDeepSeek {
        hidden: 64,
        layers: 61,
        heads: 1,
        q_lora: 16,
        experts: 2,
        top_k: 1,
        moe_intermediate: 16,
        dense_intermediate: 32,
        dense_layers: 3,
        groups: 1,
        topk_groups: 1,
        context: 163840,
        ..pdserve_import::RandomDeepSeek::bench()
    }
}

/// A checkpoint folder written once by `write` (the default model's tokenizer beside it).
fn written(default: &Path, name: &str, write: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    let dir = cache().join("bench").join(name);
    if dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    eprintln!("bench: writing {}", dir.display());
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    write(&tmp)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(default.join(f), tmp.join(f)).with_context(|| format!("copying {f}"))?;
    }
    std::fs::rename(&tmp, &dir)?;
    Ok(dir)
}

/// Serves `model` on a unified worker, has it answer one completion, and returns its `/v1/models`
/// entry.
fn served(model: &Path, logs: &Path) -> Result<Value> {
    let extra: Vec<String> = Vec::new();
    let mut stack = start_stack(&Spec::unified_worker(8123, model, &extra, logs))?;
    let result = (|| -> Result<Value> {
        let body = json!({"prompt": "The cache holds", "max_tokens": 4, "temperature": 0}).to_string();
        let (status, answer) = crate::where_::call_within(
            "POST",
            &stack.url,
            "/v1/completions",
            body.as_bytes(),
            Duration::from_secs(120),
        )?;
        if status != 200 {
            bail!(
                "{}: a completion answered {status}: {}",
                model.display(),
                String::from_utf8_lossy(&answer)
            );
        }
        let (_, body) = crate::where_::get(&stack.url, "/v1/models")?;
        let models: Value = serde_json::from_slice(&body).context("/v1/models")?;
        Ok(models["data"][0].clone())
    })();
    stop_all(&mut stack.procs, Duration::from_secs(20));
    result
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        if a == "-h" || a == "--help" {
            println!("{USAGE}");
            return Ok(());
        }
        bail!("unknown option {a}\n{USAGE}");
    }
    let default = crate::fetch_model(&[])?;
    let python = crate::test_venv()?;
    let fixture = crate::workspace_root().join("crates/model/tests/fixtures/deepseek_v4_reference.py");
    let v4 = written(&default, "deepseek-v4-flash-kv", |dir| {
        crate::run(Command::new(&python).arg(&fixture).arg("write").arg(dir).arg(v4_config().to_string()))
    })?;
    let v3 = written(&default, "deepseek-v3-kv", |dir| Ok(v3_shape().write(dir)?))?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server"])?;
    crate::sys::install_stop_handler();
    let logs = crate::workspace_root().join("target/bench/kv-bytes-logs");
    let (m4, m3) = (served(&v4, &logs.join("v4"))?, served(&v3, &logs.join("v3"))?);
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let (state, v4_token, v3_token) = (
        num(&m4["kv_state_bytes_per_request"]),
        num(&m4["kv_bytes_per_token"]),
        num(&m3["kv_bytes_per_token"]),
    );
    let s = v3_shape();
    // V3's 128 heads' K (nope 128 + rope 64) and V (128) per layer, f16.
    let expanded = (s.layers * 128 * (s.nope + s.rope + s.v) * 2) as f64;
    let mut table = format!(
        "| cache | bytes per token | per request | at {} tokens | at {} tokens |\n|---|---|---|---|---|\n",
        CONTEXTS[0], CONTEXTS[1]
    );
    let mut row = |name: &str, per_token: f64, fixed: f64| {
        let at = |n: usize| mib(per_token * n as f64 + fixed);
        table.push_str(&format!(
            "| {name} | {per_token:.0} | {} | {} | {} |\n",
            if fixed > 0.0 { mib(fixed) } else { "-".into() },
            at(CONTEXTS[0]),
            at(CONTEXTS[1])
        ));
    };
    for r in m4["kv_rows"].as_array().into_iter().flatten() {
        row(
            &format!("V4 compact: {} rows (every layer)", r["name"].as_str().unwrap_or("?")),
            num(&r["bytes_per_token"]),
            0.0,
        );
    }
    row("V4 compact: the state (windows, partial groups)", 0.0, state);
    row("**V4 compact, in all**", v4_token, state);
    row("**V3 latent** (61 x (512 + 64))", v3_token, 0.0);
    row("V3 expanded per head (61 x 128 x (192 + 128))", expanded, 0.0);
    let at = |per: f64, fixed: f64, n: usize| per * n as f64 + fixed;
    let ratio = |n: usize| {
        (at(v3_token, 0.0, n) / at(v4_token, state, n), at(expanded, 0.0, n) / at(v4_token, state, n))
    };
    let (r4, r64) = (ratio(CONTEXTS[0]), ratio(CONTEXTS[1]));
    table.push_str(&format!(
        "\nV3's latent cache holds {:.1}x V4's compact bytes at {} tokens and {:.1}x at {}; the expanded cache {:.0}x and {:.0}x. \
         (KV in f16, both servers' default; V4 itself keeps its rows' nope part in FP8.)\n",
        r4.0, CONTEXTS[0], r64.0, CONTEXTS[1], r4.1, r64.1
    ));
    println!("{table}");
    let out = crate::workspace_root().join("target/bench/kv-bytes.md");
    std::fs::create_dir_all(out.parent().context("target/bench")?)?;
    std::fs::write(&out, &table)?;
    println!("(written to {})", out.display());
    Ok(())
}
