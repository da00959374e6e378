//! Converts a llama-architecture GGUF file into a Hugging Face model folder: `config.json`,
//! `model.safetensors` (f32), `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.
//!
//! GGUF stores the rows of the Q and K projections permuted for interleaved ("GPT-J style") rope; the
//! engine implements only Hugging Face's rotate-half rope, so import undoes the permutation: per head,
//! reshape `(n_head, head_dim/2, 2, in)` and swap axes 1 and 2.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::gguf::{GgufFile, Value};
use crate::ImportError;

/// Progress reporting for long steps (a bar on stderr, or nothing).
pub trait Progress {
    fn update(&mut self, done: usize, total: usize, what: &str);
}

/// No output.
#[derive(Debug, Default)]
pub struct Silent;

impl Progress for Silent {
    fn update(&mut self, _: usize, _: usize, _: &str) {}
}

/// A one-line text bar on stderr.
#[derive(Debug, Default)]
pub struct StderrBar {
    last_percent: Option<usize>,
}

impl Progress for StderrBar {
    fn update(&mut self, done: usize, total: usize, what: &str) {
        let percent = done * 100 / total.max(1);
        if self.last_percent == Some(percent) && done != total {
            return;
        }
        self.last_percent = Some(percent);
        let filled = percent * 30 / 100;
        let mut err = std::io::stderr().lock();
        let _ =
            write!(err, "\r[{}{}] {percent:>3}% {what:<40.40}", "=".repeat(filled), " ".repeat(30 - filled));
        if done == total {
            let _ = writeln!(err);
        }
    }
}

/// Undoes GGUF's rope permutation of a `[n_head * head_dim, cols]` projection.
pub fn unpermute_qk(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    move_qk_rows(w, n_head, cols, true)
}

/// The inverse of [`unpermute_qk`]: what GGUF stores for a Hugging Face projection.
pub fn permute_qk(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    move_qk_rows(w, n_head, cols, false)
}

/// Within each head, GGUF row `(i, j)` (`i < head_dim / 2`, `j < 2`) is Hugging Face row `(j, i)`.
fn move_qk_rows(w: &[f32], n_head: usize, cols: usize, to_hf: bool) -> Vec<f32> {
    let hd = w.len() / cols / n_head;
    let half = hd / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf = (h * hd + i * 2 + j) * cols;
                let hf = (h * hd + j * half + i) * cols;
                let (src, dst) = if to_hf { (gguf, hf) } else { (hf, gguf) };
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// The Hugging Face name of a GGUF tensor outside the layers (every architecture names them alike).
pub(crate) fn global_name(gguf: &str) -> Option<&'static str> {
    match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    }
}

fn hf_name(gguf: &str) -> Option<String> {
    if let Some(n) = global_name(gguf) {
        return Some(n.to_owned());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Writes the Hugging Face folder for `gguf_path` into `out_dir` (created; must not exist yet). The
/// files are written to a temporary sibling folder and renamed into place, so a half-written folder
/// is never seen.
pub fn import_gguf(gguf_path: &Path, out_dir: &Path, progress: &mut dyn Progress) -> Result<(), ImportError> {
    let g = GgufFile::open(gguf_path)?;
    let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("");
    match arch {
        "llama" => {}
        "deepseek2" => return crate::deepseek::import(&g, out_dir, progress),
        _ => {
            return Err(ImportError::Unsupported {
                field: "general.architecture".into(),
                value: format!("{arch} (llama and deepseek2 are imported)"),
            })
        }
    }
    let key = |k: &str| format!("llama.{k}");
    let n_layer = g.u64(&key("block_count"))? as usize;
    let hidden = g.u64(&key("embedding_length"))? as usize;
    let n_head = g.u64(&key("attention.head_count"))? as usize;
    let n_kv =
        g.get(&key("attention.head_count_kv")).and_then(Value::as_u64).unwrap_or(n_head as u64) as usize;
    let tokens = g.strings("tokenizer.ggml.tokens")?;
    let vocab = g.get(&key("vocab_size")).and_then(Value::as_u64).unwrap_or(tokens.len() as u64) as usize;
    let tied = g.tensor("output.weight").is_none();
    let bos = g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64).unwrap_or(1);
    let eos = g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64).unwrap_or(2);

    let tmp = tmp_sibling(out_dir)?;
    let result = (|| {
        let config = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": g.u64(&key("feed_forward_length"))?,
            "num_hidden_layers": n_layer,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": hidden / n_head,
            "hidden_act": "silu",
            "rms_norm_eps": g.f64(&key("attention.layer_norm_rms_epsilon"))?,
            "rope_theta": g.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10_000.0),
            "max_position_embeddings": g.u64(&key("context_length"))?,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
            "rope_scaling": null,
            "attention_bias": false,
            "mlp_bias": false,
        });
        write_json(&tmp.join("config.json"), &config)?;
        write_tokenizer(&g, &tokens, &tmp)?;
        write_json(
            &tmp.join("generation_config.json"),
            &json!({ "bos_token_id": bos, "eos_token_id": eos }),
        )?;
        write_weights(&g, n_head, n_kv, &tmp.join("model.safetensors"), progress)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, out_dir).map_err(|e| ImportError::io(out_dir, e))
}

pub(crate) fn tmp_sibling(out_dir: &Path) -> Result<PathBuf, ImportError> {
    let parent = out_dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| ImportError::io(parent, e))?;
    let name = out_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ImportError::io(&tmp, e))?;
    Ok(tmp)
}

pub(crate) fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), ImportError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| ImportError::format(path, e.to_string()))?;
    std::fs::write(path, text).map_err(|e| ImportError::io(path, e))
}

/// The Hugging Face pre-tokenizer of a GGUF's `tokenizer.ggml.pre`: DeepSeek V3's three splits
/// (numbers of up to 3 digits, CJK runs, then words, punctuation and spaces; llama.cpp's
/// `deepseek-v3` regexes, which are DeepSeek's `tokenizer.json`'s), or SmolLM's digits and byte-level
/// words for the rest.
fn pre_tokenizer(pre: &str) -> serde_json::Value {
    match pre {
        "deepseek-v3" => {
            let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
            json!({"type": "Sequence", "pretokenizers": [
                split("\\p{N}{1,3}"),
                split("[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"),
                split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
            ]})
        }
        _ => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]}),
    }
}

pub(crate) fn write_tokenizer(g: &GgufFile, tokens: &[&str], dir: &Path) -> Result<(), ImportError> {
    let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if model != "gpt2" {
        return Err(ImportError::Unsupported { field: "tokenizer.ggml.model".into(), value: model.into() });
    }
    let merges = g.strings("tokenizer.ggml.merges")?;
    let types: Vec<u64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        .unwrap_or_else(|| vec![1; tokens.len()]);
    let vocab: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| ((*t).to_owned(), json!(i))).collect();
    // Token types 3 (control) and 4 (user defined) are matched whole, before the BPE model.
    let added: Vec<serde_json::Value> = types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == 3 || t == 4)
        .map(|(i, &t)| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": t == 3})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("")),
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    write_json(&dir.join("tokenizer.json"), &tokenizer)?;
    let name = |key: &str| {
        g.get(key).and_then(Value::as_u64).and_then(|id| tokens.get(id as usize)).map(|t| (*t).to_owned())
    };
    let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
    let context = ["llama", "deepseek2"]
        .iter()
        .find_map(|a| g.get(&format!("{a}.context_length")).and_then(Value::as_u64));
    let add_bos = matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
    let config = json!({
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "chat_template": template,
        "model_max_length": context,
    });
    write_json(&dir.join("tokenizer_config.json"), &config)
}

fn write_weights(
    g: &GgufFile,
    n_head: usize,
    n_kv: usize,
    path: &Path,
    progress: &mut dyn Progress,
) -> Result<(), ImportError> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(g.tensors.len());
    let total = g.tensors.len();
    for (i, t) in g.tensors.iter().enumerate() {
        progress.update(i, total, &format!("converting {}", t.name));
        let Some(name) = hf_name(&t.name) else {
            return Err(ImportError::Unsupported { field: "GGUF tensor".into(), value: t.name.clone() });
        };
        let shape = t.shape();
        let mut values = g.dequantize(t);
        let cols = shape.last().copied().unwrap_or(1);
        if t.name.ends_with("attn_q.weight") {
            values = unpermute_qk(&values, n_head, cols);
        } else if t.name.ends_with("attn_k.weight") {
            values = unpermute_qk(&values, n_kv, cols);
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, shape, bytes));
    }
    progress.update(total, total, "writing model.safetensors");
    write_f32_safetensors(&tensors, path)
}

/// `(name, shape, little-endian f32 bytes)` tensors written as one safetensors file.
pub(crate) fn write_f32_safetensors(
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    path: &Path,
) -> Result<(), ImportError> {
    write_safetensors(tensors, path, |_| safetensors::Dtype::F32)
}

/// `(name, shape, little-endian bytes)` tensors written as one safetensors file, each of the dtype
/// `dtype` gives its name.
pub(crate) fn write_safetensors(
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    path: &Path,
    dtype: impl Fn(&str) -> safetensors::Dtype,
) -> Result<(), ImportError> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(dtype(n), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ImportError::format(path, e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let meta: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    safetensors::tensor::serialize_to_file(views, Some(meta), path)
        .map_err(|e| ImportError::format(path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_permute() {
        let (n_head, hd, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..n_head * hd * cols).map(|i| i as f32).collect();
        let p = permute_qk(&w, n_head, cols);
        assert_ne!(p, w);
        assert_eq!(unpermute_qk(&p, n_head, cols), w);
        // Within a head, GGUF interleaves the two rotate-half halves: rows 0, hd/2, 1, hd/2+1, ...
        let row = |m: &[f32], r: usize| m[r * cols];
        assert_eq!(row(&p, 1), row(&w, hd / 2));
        assert_eq!(row(&p, 2), row(&w, 1));
    }

    #[test]
    fn tensor_names() {
        assert_eq!(
            hf_name("blk.12.ffn_gate.weight").as_deref(),
            Some("model.layers.12.mlp.gate_proj.weight")
        );
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.x.ffn_gate.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
