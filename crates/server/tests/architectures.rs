//! The model families through the real server process: tiny seeded checkpoints (bf16 safetensors in
//! each architecture's tensor layout, written by `crates/model/tests/fixtures/tiny_reference.py`,
//! with the default model's tokenizer) answer a greedy `/v1/completions` with the tokens and
//! log-probabilities of that script's independent numpy forward pass; broken checkpoints stop the
//! server with one error naming the file and the tensor or field. Needs `python3` with numpy.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::{self, assert_matches};
use common::Worker;
use serde_json::{json, Value};

const STEPS: usize = 8;
/// The families' fixture script.
const TINY: &str = "tiny_reference.py";

/// A tiny checkpoint of `config` with the default model's vocabulary and tokenizer files.
fn tiny(name: &str, config: Value) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdserve-served-arch-{}-{name}", std::process::id()));
    let mut c = json!({"vocab_size": 49152});
    for (k, v) in config.as_object().unwrap() {
        c[k] = v.clone();
    }
    fixtures::checkpoint(TINY, &dir, &c);
    dir
}

fn prompt() -> Vec<u32> {
    (0..40).map(|i| 200 + (i * 997) % 20_000).collect()
}

/// The numpy forward pass's answer for `ids` on the checkpoint in `dir`: `greedy` token ids and their
/// `logprobs`, `steps` of each.
fn reference(dir: &Path, ids: &[u32], steps: usize) -> Value {
    fixtures::reference(TINY, dir, ids, steps)
}

#[test]
fn each_architecture_answers_the_reference_through_v1_completions() {
    let cases = [
        (
            "llama3-rope",
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
        ),
        (
            "mistral-window",
            json!({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 12}),
        ),
        ("qwen2", json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})),
        ("qwen3", json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})),
        (
            "mixtral",
            json!({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2}),
        ),
        (
            "qwen3-moe",
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 6,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]}),
        ),
    ];
    let ids = prompt();
    for (name, config) in cases {
        let dir = tiny(name, config);
        let reference = reference(&dir, &ids, STEPS);
        // f32 KV: the reference path, so near-ties between logits cannot flip a token.
        let w = Worker::start(&["--model", dir.to_str().unwrap(), "--kv-dtype", "f32", "--weights", "f32"]);
        let body =
            json!({"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": true, "logprobs": 1});
        let (s, v) = w.json("POST", "/v1/completions", &body.to_string());
        assert_eq!(s, 200, "{name}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], STEPS, "{name}: {v}");
        assert_matches(&w, &v, &reference, name, true);
        drop(w);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// DeepSeek V3, V3.2 (sparse attention: the indexer's keys cached and moved beside the latent) and
/// V2 through the server: a short and a ~3,000-token prompt answer the numpy
/// reference's greedy tokens and log-probabilities on a unified worker (f32 KV); through the router to
/// a prefill and a decode worker (f16 KV, the latent blocks moved over shared memory) the text is the
/// unified worker's with f16 KV; `/v1/models` reports the latent cache's bytes per token.
#[test]
fn deepseek_answers_the_reference_unified_and_through_pd() {
    let long: Vec<u32> = (0..3000).map(|i| 200 + (i * 997) % 20_000).collect();
    // The latent, the rope key and (V3.2) the indexer's key, per layer, over the base's 2 layers
    // and the MTP layer where V3 ships one.
    let latent = |c: &Value| {
        let key = |k: &str| c[k].as_u64().unwrap_or(0);
        (key("kv_lora_rank") + key("qk_rope_head_dim") + key("index_head_dim"))
            * (2 + key("num_nextn_predict_layers"))
    };
    let cases = [
        (
            "deepseek-v3",
            json!({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "q_lora_rank": 24,
            "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4,
            "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
            "routed_scaling_factor": 2.5, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}}),
        ),
        ("deepseek-v3.2", deepseek_v32()),
        (
            "deepseek-v2",
            json!({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "q_lora_rank": null,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "n_routed_experts": 6, "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
            "routed_scaling_factor": 1.5, "moe_intermediate_size": 16, "max_position_embeddings": 4096}),
        ),
    ];
    for (name, config) in cases {
        let dir = tiny(name, config.clone());
        let model = dir.to_str().unwrap();
        let unified = Worker::start(&["--model", model, "--kv-dtype", "f32"]);
        let (_, models) = unified.json("GET", "/v1/models", "");
        assert_eq!(models["data"][0]["kv_bytes_per_token"], latent(&config) * 4, "{name}: {models}");
        let group = &models["data"][0]["kv_groups"][0];
        assert_eq!(group["name"], "latent", "{name}: {models}");
        assert_eq!(group["bytes_per_token"].as_f64(), Some((latent(&config) * 4) as f64), "{name}: {models}");
        // V3 ships its MTP layer: drafts come from it by default.
        let mtp = config.get("num_nextn_predict_layers").is_some();
        let mode = if mtp { "mtp" } else { "prompt-lookup" };
        assert_eq!(models["data"][0]["speculative"], mode, "{name}: {models}");
        let body = |ids: &[u32]| {
            json!({"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": true, "logprobs": 1})
                .to_string()
        };
        let mut cold = Value::Null;
        for ids in [prompt(), long.clone()] {
            let reference = reference(&dir, &ids, STEPS);
            let (s, v) = unified.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{name}: {v}");
            assert_matches(&unified, &v, &reference, &format!("{name}, {} tokens", ids.len()), true);
            cold = v;
        }
        // Every decode step drafted one guess (a random model's guesses are refused, and a refusal
        // pauses drafting for two steps).
        let drafted = common::metric(&unified, "spec_draft_tokens_total");
        assert_eq!(drafted > 0.0, mtp, "{name}: {drafted} drafts");
        // The long prompt again: its latent blocks come from the prefix cache, and the answer is the
        // cold one's to the bit (the tail's rows computed as a cold prefill computes them).
        let warm = unified.json("POST", "/v1/completions", &body(&long)).1;
        let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        assert!(cached >= 2_900, "{name}: {cached} of 3,000 prompt tokens from the cache: {warm}");
        assert_eq!(
            cold["choices"][0]["logprobs"], warm["choices"][0]["logprobs"],
            "{name}: a prefix hit changed the answer"
        );
        drop(unified);
        // f16 KV: unified, then prefill and decode workers behind the router.
        let unified = Worker::start(&["--model", model]);
        let prefill = Worker::start(&["--model", model, "--role", "prefill", "--kv-shm"]);
        let decode = Worker::start(&["--model", model, "--role", "decode"]);
        let router = common::router::RouterThread::start(&[
            (&prefill, pdserve_router::Role::Prefill),
            (&decode, pdserve_router::Role::Decode),
        ]);
        for ids in [prompt(), long.clone()] {
            let (s, want) = unified.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{name}: {want}");
            let (s, got) = router.json("POST", "/v1/completions", &body(&ids));
            assert_eq!(s, 200, "{name}: {got}");
            assert_eq!(
                got["choices"][0]["text"], want["choices"][0]["text"],
                "{name}: PD differs from unified"
            );
            assert_eq!(
                got["choices"][0]["logprobs"]["token_logprobs"],
                want["choices"][0]["logprobs"]["token_logprobs"],
                "{name}: PD's log-probabilities differ from unified's"
            );
        }
        let (_, models) = decode.json("GET", "/v1/models", "");
        assert_eq!(models["data"][0]["kv_bytes_per_token"], latent(&config) * 2, "{name}: {models}");
        drop((router, prefill, decode, unified));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The tiny DeepSeek V3.2 shape: its indexer keeps 64 positions.
fn deepseek_v32() -> Value {
    json!({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "q_lora_rank": 32,
    "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
    "routed_scaling_factor": 2.5, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096})
}

/// A DeepSeek V3.2 checkpoint that ships no chat template (as DeepSeek's does) gets DeepSeek's own
/// encoder: chat prompts in its turns with the tools offered in DSML, forced calls written in V3.2's
/// DSML block and parsed back, and the thinking mode's prompt opening the thinking (the answer is
/// `reasoning_content` until the model closes it).
#[test]
fn deepseek_without_a_template_gets_its_own_encoder_and_dsml() {
    let dir = tiny("deepseek-v3.2-encoder", deepseek_v32());
    // The tokenizer's settings without the default model's template.
    let cfg = dir.join("tokenizer_config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("chat_template");
    std::fs::remove_file(&cfg).unwrap();
    std::fs::write(&cfg, c.to_string()).unwrap();
    let w = Worker::start(&["--model", dir.to_str().unwrap()]);
    let tools = json!([{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
        "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}}]);
    let messages = json!([{"role": "user", "content": "Read a.txt"}]);
    let (s, t) = w.json("POST", "/tokenize", &json!({"messages": messages, "tools": tools}).to_string());
    assert_eq!(s, 200, "{t}");
    let (_, text) = w.json("POST", "/detokenize", &json!({"tokens": t["tokens"]}).to_string());
    let text = text["prompt"].as_str().unwrap();
    assert!(
        text.starts_with("<｜begin▁of▁sentence｜>## Tools")
            && text.contains("<｜DSML｜function_calls>")
            && text.ends_with("<｜User｜>Read a.txt<｜Assistant｜></think>"),
        "{text}"
    );
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 120, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "read_file"}}});
    let (s, v) = w.json("POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(s, 200, "{v}");
    let calls = &v["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls[0]["function"]["name"], "read_file", "{v}");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["path"].as_str().is_some_and(|p| p.chars().count() <= 12), "{v}");
    // Thinking mode: the prompt opens the thinking, so the (random) model's words are its thinking.
    let body = json!({"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "chat_template_kwargs": {"thinking": true}});
    let (s, v) = w.json("POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(s, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(m["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    drop(w);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sliding window serves a request longer than the whole KV pool: blocks outside the window go
/// back as it runs, and the text is still the reference's (the window decides what each token sees).
#[test]
fn a_sliding_window_answers_past_the_kv_pool() {
    const LONG: usize = 120;
    let dir = tiny(
        "window-pool",
        json!({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "sliding_window": 12}),
    );
    let ids = prompt();
    let reference = reference(&dir, &ids, LONG);
    // 6 blocks of 16 positions: 96, for 40 + 120.
    let w = Worker::start(&[
        "--model",
        dir.to_str().unwrap(),
        "--kv-dtype",
        "f32",
        "--kv-blocks",
        "6",
        "--weights",
        "f32",
    ]);
    let body = json!({"prompt": ids, "max_tokens": LONG, "temperature": 0, "ignore_eos": true});
    let (s, v) = w.json("POST", "/v1/completions", &body.to_string());
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], LONG, "{v}");
    assert_matches(&w, &v, &reference, "window 12 in 96 positions", false);
    drop(w);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint is served in its own precision by default (`--weights auto`): bf16 in bf16 (half the
/// bytes of f32; where the CPU has no AVX-512 BF16 the values are widened exactly as they are read,
/// so the log-probabilities are the f32 copy's, bit for bit, and the reference's; only the portable
/// kernels keep f32, as the card says) and f16 in f16 (the projections; exact, so its
/// log-probabilities are the reference's), with the reference's greedy text; `--weights f32` still
/// expands them.
#[test]
fn a_checkpoint_is_served_in_its_own_precision_by_default() {
    for (name, config) in [("bf16", json!({})), ("f16", json!({"torch_dtype": "float16"}))] {
        let dir = tiny(&format!("auto-{name}"), config);
        let ids = prompt();
        let reference = reference(&dir, &ids, STEPS);
        let mut held = Vec::new();
        let (mut auto_f32, mut exact_bf16, mut answers) = (false, false, Vec::new());
        for extra in [&[][..], &["--weights", "f32"][..]] {
            let mut args = vec!["--model", dir.to_str().unwrap(), "--kv-dtype", "f32"];
            args.extend_from_slice(extra);
            let w = Worker::start(&args);
            let (_, models) = w.json("GET", "/v1/models", "");
            let m = &models["data"][0];
            let bf16_product = m["cpu_kernels"] == "amx"
                || m["cpu_kernels"] == "avx512" && std::arch::is_x86_feature_detected!("avx512bf16");
            let auto = if name == "bf16" && m["cpu_kernels"] == "portable" { "f32" } else { name };
            auto_f32 |= extra.is_empty() && auto == "f32";
            assert_eq!(m["weights"], if extra.is_empty() { auto } else { "f32" }, "{models}");
            held.push(m["weight_bytes"].as_u64().unwrap());
            let body = json!({"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": true,
                "logprobs": 1});
            let (s, v) = w.json("POST", "/v1/completions", &body.to_string());
            assert_eq!(s, 200, "{v}");
            // Every product but the bf16 GEMM's (which rounds the activations to bf16) is exact.
            let rounded = name == "bf16" && extra.is_empty() && bf16_product;
            assert_matches(&w, &v, &reference, &format!("{name} {extra:?}"), !rounded);
            exact_bf16 |= name == "bf16" && extra.is_empty() && auto == "bf16" && !bf16_product;
            answers.push(v["choices"][0]["logprobs"]["token_logprobs"].clone());
        }
        if exact_bf16 {
            assert_eq!(answers[0], answers[1], "bf16 rows' log-probabilities against the f32 copy's");
        }
        // (f16 keeps the embedding and the LM head, most of this tiny model, in f32.)
        let less = match name {
            "f16" => held[0] < held[1],
            _ if auto_f32 => held[0] == held[1],
            _ => held[0] * 10 < held[1] * 6,
        };
        assert!(less, "{name} holds {} bytes, f32 {}", held[0], held[1]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// An NVFP4 checkpoint (ModelOpt's layout) is served as it ships, 4 bits a weight: the reference's
/// answer, and log-probabilities equal to its f32 copy's (the codes widen to the loader's values).
#[test]
fn an_nvfp4_checkpoint_is_served_in_four_bits() {
    let dir = tiny(
        "nvfp4",
        json!({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}),
    );
    let ids = prompt();
    let reference = reference(&dir, &ids, STEPS);
    let body =
        json!({"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let mut answers = Vec::new();
    let mut held = Vec::new();
    for weights in ["auto", "f32"] {
        let w = Worker::start(&["--model", dir.to_str().unwrap(), "--kv-dtype", "f32", "--weights", weights]);
        let (_, models) = w.json("GET", "/v1/models", "");
        let want = if weights == "auto" { "fp4" } else { "f32" };
        assert_eq!(models["data"][0]["weights"], want, "{models}");
        held.push(models["data"][0]["weight_bytes"].as_u64().unwrap());
        let (s, v) = w.json("POST", "/v1/completions", &body.to_string());
        assert_eq!(s, 200, "{v}");
        assert_matches(&w, &v, &reference, &format!("nvfp4 --weights {weights}"), true);
        answers.push(v["choices"][0]["logprobs"]["token_logprobs"].clone());
    }
    assert_eq!(answers[0], answers[1], "FP4 held: log-probabilities against the f32 copy's");
    assert!(held[0] < held[1], "FP4 holds {} bytes, f32 {}", held[0], held[1]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn broken_checkpoints_are_one_error_naming_the_file_and_what_is_wrong() {
    let edit_config = |dir: &Path, patch: Value| {
        let path = dir.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (k, v) in patch.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(path, c.to_string()).unwrap();
    };
    type Break = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Break, [&str; 2])> = vec![
        (
            // Qwen2 has Q/K/V biases this Llama checkpoint lacks.
            "missing-tensor",
            Box::new(move |d: &Path| {
                edit_config(d, json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
            }),
            ["model.safetensors", "missing tensor model.layers.0.self_attn.q_proj.bias"],
        ),
        (
            "wrong-shape",
            Box::new(move |d: &Path| edit_config(d, json!({"intermediate_size": 128}))),
            [
                "model.safetensors",
                "model.layers.0.mlp.gate_proj.weight has shape [96, 64], expected [128, 64]",
            ],
        ),
        (
            "truncated",
            Box::new(|d: &Path| {
                let f = std::fs::OpenOptions::new().write(true).open(d.join("model.safetensors")).unwrap();
                let len = f.metadata().unwrap().len();
                f.set_len(len / 2).unwrap();
            }),
            ["model.safetensors", ""],
        ),
        (
            "unknown-architecture",
            Box::new(move |d: &Path| {
                edit_config(d, json!({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
            }),
            ["config.json", "architectures"],
        ),
        (
            "unknown-rope",
            Box::new(move |d: &Path| {
                edit_config(d, json!({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
            }),
            ["config.json", "rope_scaling.rope_type"],
        ),
    ];
    for (name, breaks, [file, what]) in cases {
        let dir = tiny(name, json!({}));
        breaks(&dir);
        let (ok, err) = common::failed_start(&["--model", dir.to_str().unwrap()]);
        assert!(!ok, "{name}: the server exited successfully");
        assert!(!err.contains("panicked"), "{name}: {err}");
        let line = err
            .lines()
            .find(|l| l.contains(file))
            .unwrap_or_else(|| panic!("{name}: no error names {file}: {err}"));
        assert!(line.contains(what), "{name}: {line}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
