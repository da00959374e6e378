//! A small model of random weights written as a Hugging Face folder, for tests that need a real
//! engine, real processes and a real tokenizer but not a trained model, and must not fetch one:
//! `config.json` (Llama), `model.safetensors` (f32, seeded), `tokenizer.json` (byte-level BPE over
//! the 256 bytes, no merges: any text round-trips) and `tokenizer_config.json` (a ChatML template,
//! `<|im_end|>` the end of a turn and of generation).

use std::collections::HashMap;
use std::path::Path;

use serde_json::json;

use crate::ImportError;

/// The shape of a random model. Every width is a multiple of 32, so every weight format (Q4, Q8,
/// bf16) and every product kernel takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomModel {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    pub seed: u64,
}

impl Default for RandomModel {
    /// Two layers of 64: a forward pass in microseconds.
    fn default() -> Self {
        RandomModel {
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 32,
            context: 4096,
            seed: 7,
        }
    }
}

impl RandomModel {
    /// Token ids of the special tokens, after the 256 byte tokens: `<|im_start|>`, `<|im_end|>` (the
    /// end of a turn and of generation) and `<|endoftext|>`.
    pub const IM_START: u32 = 256;
    pub const IM_END: u32 = 257;
    pub const END_OF_TEXT: u32 = 258;
    /// The vocabulary: bytes, the three special tokens, padded to a multiple of 32 with unused tokens.
    pub const VOCAB: usize = 288;
}

/// GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut chars = vec!['\0'; 256];
    let mut next = 256;
    for b in 0..256u32 {
        chars[b as usize] = if printable.contains(&b) {
            char::from_u32(b).expect("a byte")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("a code point")
        };
    }
    chars
}

fn random(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), ImportError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| ImportError::format(path, e.to_string()))?;
    std::fs::write(path, text).map_err(|e| ImportError::io(path, e))
}

impl RandomModel {
    /// Writes the model into `dir` (made if missing; its files replaced).
    pub fn write(&self, dir: &Path) -> Result<(), ImportError> {
        std::fs::create_dir_all(dir).map_err(|e| ImportError::io(dir, e))?;
        let (h, i, q, kv) =
            (self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        write_json(
            &dir.join("config.json"),
            &json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": h, "intermediate_size": i, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "max_position_embeddings": self.context, "vocab_size": Self::VOCAB,
                "tie_word_embeddings": true, "hidden_act": "silu",
                "bos_token_id": Self::END_OF_TEXT, "eos_token_id": Self::IM_END,
            }),
        )?;
        // Weights scaled so activations neither vanish nor blow up over a few layers.
        let mut seed = self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        let w = 2.0 / (h as f32).sqrt();
        let v = Self::VOCAB;
        tensors.push(("model.embed_tokens.weight".into(), vec![v, h], random(v * h, &mut seed, 2.0)));
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            for (name, rows, cols) in [
                ("self_attn.q_proj", q, h),
                ("self_attn.k_proj", kv, h),
                ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, q),
                ("mlp.gate_proj", i, h),
                ("mlp.up_proj", i, h),
                ("mlp.down_proj", h, i),
            ] {
                tensors.push((
                    format!("{p}{name}.weight"),
                    vec![rows, cols],
                    random(rows * cols, &mut seed, w),
                ));
            }
            tensors.push((format!("{p}input_layernorm.weight"), vec![h], vec![1.0; h]));
            tensors.push((format!("{p}post_attention_layernorm.weight"), vec![h], vec![1.0; h]));
        }
        tensors.push(("model.norm.weight".into(), vec![h], vec![1.0; h]));
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        let path = dir.join("model.safetensors");
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| ImportError::format(&path, e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let meta: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
        safetensors::tensor::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| ImportError::format(&path, e.to_string()))?;
        // Byte-level BPE without merges: one token per byte, the special tokens matched whole.
        let chars = byte_chars();
        let mut vocab: serde_json::Map<String, serde_json::Value> =
            chars.iter().enumerate().map(|(b, c)| (c.to_string(), json!(b))).collect();
        let specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
        let mut added = Vec::new();
        for (k, s) in specials.iter().enumerate() {
            vocab.insert((*s).to_owned(), json!(256 + k));
            added.push(json!({"id": 256 + k, "content": s, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}));
        }
        for id in 256 + specials.len()..Self::VOCAB {
            let s = format!("<|unused_{id}|>");
            vocab.insert(s.clone(), json!(id));
            added.push(json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}));
        }
        let merges: Vec<String> = Vec::new();
        write_json(
            &dir.join("tokenizer.json"),
            &json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                "normalizer": null,
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
                "post_processor": null,
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                          "ignore_merges": false, "vocab": vocab, "merges": merges}
            }),
        )?;
        let template = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        write_json(
            &dir.join("tokenizer_config.json"),
            &json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": false,
                    "chat_template": template, "model_max_length": self.context}),
        )
    }
}
