//! The model crate's seeded checkpoints and their independent numpy references
//! (`crates/model/tests/fixtures/*.py`), as the served-model tests use them.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use super::Worker;

/// Runs fixture script `name` with `args`; its standard output. Needs `python3` with numpy
/// (`PYTHON` names another interpreter).
pub fn script(name: &str, args: &[&str]) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures").join(name);
    let out = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(&path)
        .args(args)
        .output()
        .expect("python3 (with numpy) runs");
    assert!(out.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// The checkpoint fixture script `name` writes in `dir` for `config` (replacing what is there), with
/// the default model's tokenizer files beside it.
pub fn checkpoint(name: &str, dir: &Path, config: &Value) {
    let model = super::default_model();
    let _ = std::fs::remove_dir_all(dir);
    script(name, &["write", dir.to_str().unwrap(), &config.to_string()]);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::os::unix::fs::symlink(model.join(f), dir.join(f)).unwrap();
    }
}

/// Script `name`'s numpy forward pass on the checkpoint in `dir` for `ids`: `greedy` token ids and
/// their `logprobs`, `steps` of each.
pub fn reference(name: &str, dir: &Path, ids: &[u32], steps: usize) -> Value {
    let (ids, steps) = (serde_json::to_string(ids).unwrap(), steps.to_string());
    serde_json::from_slice(&script(name, &["run", dir.to_str().unwrap(), &ids, &steps])).unwrap()
}

/// `v` (a completion from `w`) has the reference's greedy text, and with `logprobs` each token's
/// log-probability within 2e-3 of the reference's.
pub fn assert_matches(w: &Worker, v: &Value, reference: &Value, what: &str, logprobs: bool) {
    let (s, text) = w.json("POST", "/detokenize", &json!({"tokens": reference["greedy"]}).to_string());
    assert_eq!(s, 200, "{what}: {text}");
    assert_eq!(v["choices"][0]["text"], text["prompt"], "{what}: greedy text differs from the reference");
    if logprobs {
        let ours = v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
        let theirs = reference["logprobs"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{what}: {v}");
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            let d = (a.as_f64().unwrap() - b.as_f64().unwrap()).abs();
            assert!(d < 2e-3, "{what}: token {i}'s log-probability {a} vs the reference's {b}");
        }
    }
}
