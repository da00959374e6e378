//! What a model folder says beyond its weights, honoured by a real worker: `generation_config.json`'s
//! end-of-sequence ids and sampling defaults, `tokenizer_config.json`'s `add_bos_token`.

mod common;

use std::path::{Path, PathBuf};

use common::{chat, Worker};
use serde_json::{json, Value};

/// A model folder of the default model's files (linked), with `generation_config.json` replaced and
/// `tokenizer_config.json` patched.
fn folder(name: &str, generation: &Value, tokenizer_patch: &Value) -> PathBuf {
    let model = common::default_model();
    let dir = std::env::temp_dir().join(format!("pdserve-meta-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::os::unix::fs::symlink(model.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("generation_config.json"), generation.to_string()).unwrap();
    let mut tc: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap()).unwrap();
    for (k, v) in tokenizer_patch.as_object().unwrap() {
        tc[k] = v.clone();
    }
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    dir
}

fn tokens(w: &Worker, text: &str) -> Vec<u64> {
    let (s, v) = w.json("POST", "/tokenize", &json!({"prompt": text}).to_string());
    assert_eq!(s, 200, "{v}");
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

fn start(dir: &Path) -> Worker {
    Worker::start(&["--model", dir.to_str().unwrap()])
}

/// An extra EOS id in `generation_config.json` ends the answer there (the model's own ids stay EOS),
/// and its `temperature: 0` makes a request that names none greedy, whatever its seed.
#[test]
fn generation_config_eos_ids_and_sampling_defaults() {
    let plain = Worker::start(&[]);
    let paris = tokens(&plain, " Paris");
    assert_eq!(paris.len(), 1, "{paris:?}");
    drop(plain);
    let dir = folder(
        "gen",
        &json!({"bos_token_id": 1, "eos_token_id": [2, paris[0]], "temperature": 0.0}),
        &json!({}),
    );
    let w = start(&dir);
    for seed in 1..4 {
        let (s, v) = w.json(
            "POST",
            "/v1/chat/completions",
            &chat("What is the capital of France?", &format!(r#","max_tokens":20,"seed":{seed}"#)),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], "The capital of France is", "seed {seed}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    // A request's own temperature still wins: sampled at 1.0, seeds give different answers.
    let answers: std::collections::HashSet<String> = (1..6)
        .map(|seed| {
            let body = chat(
                "Write a sentence about the sea.",
                &format!(r#","max_tokens":12,"temperature":1.0,"seed":{seed}"#),
            );
            w.json("POST", "/v1/chat/completions", &body).1["choices"][0]["message"]["content"].to_string()
        })
        .collect();
    assert!(answers.len() > 1, "{answers:?}");
    drop(w);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `add_bos_token: true` puts the BOS token before a completion's prompt (and in `/tokenize`), once;
/// the default model's `false` does not; chat prompts come from the template either way.
#[test]
fn add_bos_token_prefixes_completion_prompts() {
    let dir = folder("bos", &json!({"bos_token_id": 1, "eos_token_id": 2}), &json!({"add_bos_token": true}));
    let (with, without) = (start(&dir), Worker::start(&[]));
    let bos = tokens(&without, "<|im_start|>");
    assert_eq!(tokens(&with, "Hello there"), [bos.clone(), tokens(&without, "Hello there")].concat());
    assert_eq!(tokens(&with, "<|im_start|>Hi"), tokens(&without, "<|im_start|>Hi"), "never twice");
    let usage = |w: &Worker| {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0});
        let (s, v) = w.json("POST", "/v1/completions", &body.to_string());
        assert_eq!(s, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    assert_eq!(usage(&with), usage(&without) + 1);
    let chat_tokens = |w: &Worker| {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
        w.json("POST", "/v1/chat/completions", &body.to_string()).1["usage"]["prompt_tokens"].clone()
    };
    assert_eq!(chat_tokens(&with), chat_tokens(&without));
    drop((with, without));
    std::fs::remove_dir_all(&dir).unwrap();
}
