//! DeepSeek V4 (`DeepseekV4ForCausalLM`) through the real server processes: a tiny seeded checkpoint
//! in the real tensor layout (`crates/model/tests/fixtures/deepseek_v4_reference.py`: layers sliding,
//! sliding, compressed sparse at 4 with its indexer, heavily compressed at 16; a window of 16,
//! `index_topk` 8), with the default model's tokenizer, answers as the script's independent numpy
//! forward pass does on a short and a 3,000-token prompt (it slides, compresses and selects); a
//! prefix hit (resumed from a restore point: V4's KV is in its compact layout, compressed rows in
//! blocks and each request's windows and partial groups in a state slot), prefill and decode workers
//! behind the router (the state moved with the blocks), and a stream moved off a killed worker all
//! give the cold unified answer. Needs `python3` with numpy.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::{self, assert_matches};
use common::migrate::{completed_text, long_stream_body, router_metric, stream, stream_killing_holder};
use common::router::RouterThread;
use common::Worker;
use pdserve_router::Role;
use serde_json::{json, Value};

const STEPS: usize = 8;
/// V4's fixture script.
const V4: &str = "deepseek_v4_reference.py";

/// The tiny V4 checkpoint (with the script's `overrides`) with the default model's vocabulary and
/// tokenizer files.
fn checkpoint(name: &str, overrides: Value) -> PathBuf {
    // (Not named `pdserve-...`: the model's id is the folder's name, and a stream's chunks carry it
    // where the migration helpers check that no resume mark `pdserve-...` reached the client.)
    let dir = std::env::temp_dir().join(format!("tiny-v4-{name}-{}", std::process::id()));
    let mut config = json!({"vocab_size": 49152, "max_position_embeddings": 8192});
    for (k, v) in overrides.as_object().unwrap() {
        config[k] = v.clone();
    }
    fixtures::checkpoint(V4, &dir, &config);
    dir
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 200 + (i * 997) % 20_000).collect()
}

fn body(ids: &[u32]) -> String {
    json!({"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": true, "logprobs": 1})
        .to_string()
}

/// The numpy reference's answer for `ids` on the checkpoint in `dir`.
fn reference(dir: &str, ids: &[u32]) -> Value {
    fixtures::reference(V4, Path::new(dir), ids, STEPS)
}

fn logprobs(v: &Value) -> &Value {
    &v["choices"][0]["logprobs"]["token_logprobs"]
}

#[test]
fn deepseek_v4_answers_the_reference_unified_after_a_prefix_hit_through_pd_and_moved() {
    let dir = checkpoint("served", json!({}));
    let model = dir.to_str().unwrap();
    let long = prompt(3000);

    // Unified, f32 KV: the reference's answers.
    let unified = Worker::start(&["--model", model, "--kv-dtype", "f32"]);
    let (_, models) = unified.json("GET", "/v1/models", "");
    let m = &models["data"][0];
    // The compact layout: blocks hold the compressed rows only, the compressed sparse layer's (32
    // values per 4 tokens) and its indexer's keys (16 per 4), the heavily compressed layer's (32 per
    // 16): 14 values a token (a row per position and layer would be 272 in each of 5 layers); the
    // windows and partial groups are each request's state.
    assert_eq!(m["kv_bytes_per_token"], 14 * 4, "{models}");
    assert_eq!(m["kv_groups"][0]["name"], "v4-compressed", "{models}");
    let rows: Vec<(&str, f64)> = m["kv_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), r["bytes_per_token"].as_f64().unwrap()))
        .collect();
    assert_eq!(rows, [("c4", 32.0), ("c4-index", 16.0), ("c16", 8.0)], "{models}");
    assert!(m["kv_state_bytes_per_request"].as_u64().unwrap() > 0, "{models}");
    assert_eq!(m["speculative"], "mtp", "{models}");
    let mut cold = Value::Null;
    for ids in [prompt(20), long.clone()] {
        let (s, v) = unified.json("POST", "/v1/completions", &body(&ids));
        assert_eq!(s, 200, "{v}");
        assert_matches(&unified, &v, &reference(model, &ids), &format!("{} tokens", ids.len()), true);
        cold = v;
    }
    // Every decode step drafted (a random model's guesses are refused; the answers above are exact).
    assert!(common::metric(&unified, "spec_draft_tokens_total") > 0.0);
    // The long prompt again: its blocks come from the prefix cache; the answer is the cold one's.
    let warm = unified.json("POST", "/v1/completions", &body(&long)).1;
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 2_900, "{cached} of 3,000 prompt tokens from the cache: {warm}");
    assert_eq!(logprobs(&cold), logprobs(&warm), "a prefix hit changed the answer");
    // It resumed from the state saved at the prompt's last block boundary (its prefill's last chunk
    // ended there).
    assert!(common::metric(&unified, "kv_state_restores_total") >= 1.0);
    assert!(common::metric(&unified, "kv_state_entries{state=\"restore_points\"}") >= 1.0);
    // Prompts sharing a 100-token system prompt, then each its own: the first caches the shared
    // blocks (its state is saved only where its chunk ends, past them), the second ends its first
    // chunk where those blocks end (96 tokens) and saves its state there, the third resumes there,
    // answering as the reference does.
    let system: Vec<u32> = (0..100).map(|i| 400 + (i * 37) % 9_000).collect();
    let hits: Vec<u64> = (0..3u32)
        .map(|k| {
            let ids: Vec<u32> = system.iter().copied().chain((0..50).map(|i| 700 + k * 50 + i)).collect();
            let (s, v) = unified.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{v}");
            if k == 2 {
                assert_matches(&unified, &v, &reference(model, &ids), "after a shared system prompt", true);
            }
            v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
        })
        .collect();
    assert_eq!(hits, [0, 0, 96], "prompt tokens resumed from a restore point");
    // Requests batched together (their steps run as one, layer by layer) answer as each alone.
    let prompts: Vec<Vec<u32>> =
        (0..4).map(|k| (0..60 + 37 * k).map(|i| 300 + (i * 131 + k * 7) % 9_000).collect()).collect();
    let alone: Vec<Value> =
        prompts.iter().map(|p| unified.json("POST", "/v1/completions", &body(p)).1).collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> =
            prompts.iter().map(|p| s.spawn(|| unified.json("POST", "/v1/completions", &body(p)).1)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (k, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(logprobs(a), logprobs(t), "request {k} batched with others answered otherwise");
    }
    drop(unified);

    // f16 KV (the default): unified, then prefill and decode workers behind the router, the KV
    // moved over shared memory and over TCP.
    let unified = Worker::start(&["--model", model]);
    for (transport, moved) in [(&["--kv-shm"][..], "shared"), (&[], "received")] {
        // A fresh decode worker each time: nothing of the prompts in its prefix cache.
        let decode = Worker::start(&["--model", model, "--role", "decode"]);
        let prefill = Worker::start(&[&["--model", model, "--role", "prefill"][..], transport].concat());
        let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
        for ids in [prompt(20), long.clone()] {
            let (s, want) = unified.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{want}");
            let (s, got) = router.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{got}");
            let what = format!("{} tokens over {transport:?}", ids.len());
            assert_eq!(
                got["choices"][0]["text"], want["choices"][0]["text"],
                "{what}: PD differs from unified"
            );
            assert_eq!(logprobs(&got), logprobs(&want), "{what}: PD's log-probabilities differ");
        }
        // Every prompt block moved (20 tokens' 2 blocks and 3,000's 188, at 16 tokens a block), by
        // the transport asked for.
        let blocks = common::metric(&decode, "kv_transfer_blocks_total{result=\"transferred\"}");
        let bytes = common::metric(&decode, &format!("kv_transfer_bytes_total{{direction=\"{moved}\"}}"));
        assert!(blocks >= 190.0 && bytes > 0.0, "{transport:?}: {blocks} blocks, {bytes} bytes {moved}");
    }
    drop(unified);

    // A stream moved off a unified worker killed at its 20th token goes on with the same text.
    let (a, b) = (Worker::start(&["--model", model]), Worker::start(&["--model", model]));
    let router = RouterThread::start(&[(&a, Role::Unified), (&b, Role::Unified)]);
    let max_tokens = 600;
    let chat = long_stream_body("Tell me about compressed attention.", max_tokens);
    let reference = completed_text(&stream(&router, &chat, "v4-reference", |_| {}), max_tokens);
    let (events, _) = stream_killing_holder(&router, &chat, "v4-moved", &[&a, &b]);
    assert_eq!(completed_text(&events, max_tokens), reference, "the moved stream differs");
    let moved = router_metric(&router, r#"router_migrations_total{cause="decode_lost",outcome="completed"}"#);
    assert_eq!(moved, 1.0);
    drop((router, a, b));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// V4 as shipped (dense projections in FP8 with ue8m0 block scales, experts in MXFP4) is served in
/// those formats: the reference's answers, under half the bytes of the bf16 checkpoint, and a
/// format it cannot hold them in is refused before serving.
#[test]
fn deepseek_v4_as_shipped_is_served_in_fp8_and_mxfp4() {
    let shipped = checkpoint("shipped", json!({"as_shipped": true}));
    let plain = checkpoint("plain", json!({}));
    let (held, bf16) = (Worker::start(&["--model", shipped.to_str().unwrap(), "--kv-dtype", "f32"]), {
        // Blocks of 4 tokens asked: the compact layout's rows of 16 tokens need 16 (the pool keeps
        // its 64 tokens).
        let w =
            Worker::start(&["--model", plain.to_str().unwrap(), "--block-size", "4", "--kv-blocks", "16"]);
        let blocks = common::metric(&w, "kv_cache_block_size_tokens{block_size=\"16\",num_gpu_blocks=\"4\"}");
        assert_eq!(blocks, 16.0, "the block length grown to the compression ratio's multiple");
        let (_, m) = w.json("GET", "/v1/models", "");
        assert_eq!(m["data"][0]["weights"], "bf16", "{m}");
        m["data"][0]["weight_bytes"].as_u64().unwrap()
    });
    let (_, m) = held.json("GET", "/v1/models", "");
    assert_eq!(m["data"][0]["weights"], "fp4", "{m}");
    let bytes = m["data"][0]["weight_bytes"].as_u64().unwrap();
    // (The embedding and LM head ship in bf16 here and take most of the bytes at this vocabulary;
    // the model crate's test measures the projections' share.)
    assert!(bytes < bf16, "held as shipped {bytes} bytes, the bf16 checkpoint {bf16}");
    for ids in [prompt(20), prompt(300)] {
        let (s, v) = held.json("POST", "/v1/completions", &body(&ids));
        assert_eq!(s, 200, "{v}");
        let what = format!("as shipped, {} tokens", ids.len());
        assert_matches(&held, &v, &reference(shipped.to_str().unwrap(), &ids), &what, true);
    }
    drop(held);
    let (ok, err) = common::failed_start(&["--model", shipped.to_str().unwrap(), "--weights", "q8"]);
    assert!(!ok && err.contains("weights") && err.contains("DeepSeek V4"), "{err}");
    for dir in [shipped, plain] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
