//! A small model of random weights written as a Hugging Face folder, for tests that need a real
//! engine, real processes and a real tokenizer but not a trained model, and must not fetch one:
//! `config.json` (Llama), `model.safetensors` (f32, seeded), `tokenizer.json` (byte-level BPE over
//! the 256 bytes, no merges: any text round-trips) and `tokenizer_config.json` (a ChatML template,
//! `<|im_end|>` the end of a turn and of generation).

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
        crate::import::write_f32_safetensors(&bytes, &dir.join("model.safetensors"))?;
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

/// A DeepSeek-V3-shaped model of seeded random weights (latent attention, DeepSeekMoE with sigmoid
/// group routing, a correction bias, shared experts, dense first layers), written as a Hugging Face
/// folder's `config.json` and bf16 `model.safetensors`; the tokenizer files are the caller's (the
/// benchmark copies the default model's, which llama.cpp's converter knows). For measuring the
/// DeepSeek path against a peer at a size no public checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomDeepSeek {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shared: usize,
    pub moe_intermediate: usize,
    pub dense_intermediate: usize,
    pub dense_layers: usize,
    pub groups: usize,
    pub topk_groups: usize,
    pub vocab: usize,
    pub context: usize,
    pub seed: u64,
    /// Ships a multi-token prediction layer (`num_nextn_predict_layers` 1: a layer of experts after
    /// the last, with `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`; the embedding and LM head
    /// copies DeepSeek ships beside it are left out, as pdserve reads the model's own).
    pub mtp: bool,
    /// Ships the routed experts in MXFP4, as DeepSeek V4 does (see [`mxfp4`]): the same random
    /// values rounded to e2m1 codes, two a byte (u8 `[out, in / 2]`), with a ue8m0 power of two per
    /// 32 columns (`weight_scale_inv`, `F8_E8M0` `[out, in / 32]`).
    pub mxfp4_experts: bool,
}

impl RandomDeepSeek {
    /// About 1.2B parameters, 0.3B active per token: hidden 1,024, 12 layers (the first dense), 16
    /// heads, V3's latent widths (kv_lora 512, rope 64, nope and v 128), 64 routed experts of 512 in
    /// 8 groups (4 kept), 6 chosen, one shared; SmolLM2's vocabulary of 49,152.
    pub fn bench() -> RandomDeepSeek {
        RandomDeepSeek {
            hidden: 1024,
            layers: 12,
            heads: 16,
            q_lora: 384,
            kv_lora: 512,
            nope: 128,
            rope: 64,
            v: 128,
            experts: 64,
            top_k: 6,
            shared: 1,
            moe_intermediate: 512,
            dense_intermediate: 2816,
            dense_layers: 1,
            groups: 8,
            topk_groups: 4,
            vocab: 49152,
            context: 8192,
            seed: 11,
            mtp: false,
            mxfp4_experts: false,
        }
    }

    /// Parameters in all (`total`) and those one token's forward pass reads (`active`).
    pub fn parameters(&self) -> (usize, usize) {
        let (h, nh) = (self.hidden, self.heads);
        let attn = h * self.q_lora
            + self.q_lora * nh * (self.nope + self.rope)
            + h * (self.kv_lora + self.rope)
            + self.kv_lora * nh * (self.nope + self.v)
            + nh * self.v * h;
        let expert = 3 * h * self.moe_intermediate;
        let dense = 3 * h * self.dense_intermediate;
        let moe_layers = self.layers - self.dense_layers;
        let embed = 2 * self.vocab * h;
        let total = self.layers * attn
            + self.dense_layers * dense
            + moe_layers * (expert * (self.experts + self.shared) + self.experts * h)
            + embed;
        let active = self.layers * attn
            + self.dense_layers * dense
            + moe_layers * (expert * (self.top_k + self.shared) + self.experts * h)
            + embed;
        (total, active)
    }

    /// Writes `config.json` and `model.safetensors` (bf16) into `dir` (made if missing).
    pub fn write(&self, dir: &Path) -> Result<(), ImportError> {
        std::fs::create_dir_all(dir).map_err(|e| ImportError::io(dir, e))?;
        let (h, nh, qk) = (self.hidden, self.heads, self.nope + self.rope);
        write_json(
            &dir.join("config.json"),
            &json!({
                "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "hidden_size": h, "intermediate_size": self.dense_intermediate,
                "moe_intermediate_size": self.moe_intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": nh, "num_key_value_heads": nh, "q_lora_rank": self.q_lora,
                "kv_lora_rank": self.kv_lora, "qk_nope_head_dim": self.nope, "qk_rope_head_dim": self.rope,
                "v_head_dim": self.v, "n_routed_experts": self.experts, "n_shared_experts": self.shared,
                "num_experts_per_tok": self.top_k, "n_group": self.groups, "topk_group": self.topk_groups,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
                "routed_scaling_factor": 2.5, "first_k_dense_replace": self.dense_layers, "moe_layer_freq": 1,
                "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": null,
                "max_position_embeddings": self.context, "vocab_size": self.vocab,
                "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 0,
                "attention_bias": false, "torch_dtype": "bfloat16",
                "num_nextn_predict_layers": usize::from(self.mtp),
            }),
        )?;
        let mut seed = self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let ones = |n: usize| -> Vec<u8> {
            (0..n).flat_map(|_| half::bf16::from_f32(1.0).to_bits().to_le_bytes()).collect()
        };
        // Scaled so activations neither vanish nor blow up over the layers.
        let w = |k: usize| 2.0 / (k as f32).sqrt();
        add(&mut tensors, "model.embed_tokens.weight".into(), vec![self.vocab, h], 2.0, &mut seed);
        add(&mut tensors, "lm_head.weight".into(), vec![self.vocab, h], w(h), &mut seed);
        let mut norms = vec![("model.norm.weight".to_owned(), h)];
        for l in 0..self.layers + usize::from(self.mtp) {
            let p = format!("model.layers.{l}.");
            if l == self.layers {
                // The MTP layer's own tensors; its decoder layer follows as any other's.
                add(&mut tensors, format!("{p}eh_proj.weight"), vec![h, 2 * h], w(2 * h), &mut seed);
                for n in ["enorm", "hnorm", "shared_head.norm"] {
                    norms.push((format!("{p}{n}.weight"), h));
                }
            }
            let a = format!("{p}self_attn.");
            add(&mut tensors, format!("{a}q_a_proj.weight"), vec![self.q_lora, h], w(h), &mut seed);
            add(
                &mut tensors,
                format!("{a}q_b_proj.weight"),
                vec![nh * qk, self.q_lora],
                w(self.q_lora),
                &mut seed,
            );
            add(
                &mut tensors,
                format!("{a}kv_a_proj_with_mqa.weight"),
                vec![self.kv_lora + self.rope, h],
                w(h),
                &mut seed,
            );
            add(
                &mut tensors,
                format!("{a}kv_b_proj.weight"),
                vec![nh * (self.nope + self.v), self.kv_lora],
                w(self.kv_lora),
                &mut seed,
            );
            add(&mut tensors, format!("{a}o_proj.weight"), vec![h, nh * self.v], w(nh * self.v), &mut seed);
            norms.extend([
                (format!("{a}q_a_layernorm.weight"), self.q_lora),
                (format!("{a}kv_a_layernorm.weight"), self.kv_lora),
                (format!("{p}input_layernorm.weight"), h),
                (format!("{p}post_attention_layernorm.weight"), h),
            ]);
            let swiglu = |tensors: &mut Vec<_>, pre: String, inter: usize, seed: &mut u64| {
                add(tensors, format!("{pre}gate_proj.weight"), vec![inter, h], w(h), seed);
                add(tensors, format!("{pre}up_proj.weight"), vec![inter, h], w(h), seed);
                add(tensors, format!("{pre}down_proj.weight"), vec![h, inter], w(inter), seed);
            };
            if l < self.dense_layers {
                swiglu(&mut tensors, format!("{p}mlp."), self.dense_intermediate, &mut seed);
                continue;
            }
            for e in 0..self.experts {
                let first = tensors.len();
                swiglu(&mut tensors, format!("{p}mlp.experts.{e}."), self.moe_intermediate, &mut seed);
                if self.mxfp4_experts {
                    for (name, shape, bytes) in tensors.split_off(first) {
                        let values: Vec<f32> = bytes
                            .chunks_exact(2)
                            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                            .collect();
                        let (codes, scales) = mxfp4(&values, shape[1]);
                        tensors.push((format!("{name}_scale_inv"), vec![shape[0], shape[1] / 32], scales));
                        tensors.push((name, vec![shape[0], shape[1] / 2], codes));
                    }
                }
            }
            swiglu(
                &mut tensors,
                format!("{p}mlp.shared_experts."),
                self.shared * self.moe_intermediate,
                &mut seed,
            );
            add(&mut tensors, format!("{p}mlp.gate.weight"), vec![self.experts, h], w(h), &mut seed);
            // The correction bias, in f32 as DeepSeek ships it.
            let bias: Vec<u8> =
                random(self.experts, &mut seed, 0.2).iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((format!("{p}mlp.gate.e_score_correction_bias"), vec![self.experts], bias));
        }
        for (name, n) in norms {
            tensors.push((name, vec![n], ones(n)));
        }
        let path = dir.join("model.safetensors");
        // The correction bias in f32, as DeepSeek ships it; the rest bf16.
        crate::import::write_safetensors(&tensors, &path, |n| {
            if n.ends_with("e_score_correction_bias") {
                safetensors::Dtype::F32
            } else if n.ends_with("_scale_inv") {
                safetensors::Dtype::F8_E8M0
            } else if self.mxfp4_experts && n.contains(".experts.") {
                safetensors::Dtype::U8
            } else {
                safetensors::Dtype::BF16
            }
        })
    }
}

/// Row-major `values` of rows `cols` wide in OCP MXFP4: e2m1 codes two a byte (the even column in
/// the low nibble) and, per row and 32 columns, the smallest power of two that brings the group's
/// largest magnitude within e2m1's 6, as a ue8m0 byte (2^(byte - 127)); each value rounded to the
/// nearest code (ties to the even one).
pub fn mxfp4(values: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>) {
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    assert!(cols.is_multiple_of(32) && values.len().is_multiple_of(cols), "MXFP4 takes rows of 32s");
    let mut codes = vec![0u8; values.len() / 2];
    let mut scales = Vec::with_capacity(values.len() / 32);
    for (g, group) in values.chunks_exact(32).enumerate() {
        let max = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if max > 0.0 { (max / 6.0).log2().ceil().clamp(-127.0, 127.0) as i32 } else { -127 };
        scales.push((e + 127) as u8);
        let scale = 2f32.powi(e);
        for (j, &v) in group.iter().enumerate() {
            let a = (v / scale).abs();
            let mut best = 0usize;
            for (c, &q) in E2M1.iter().enumerate() {
                let (d, db) = ((q - a).abs(), (E2M1[best] - a).abs());
                if d < db || (d == db && c % 2 == 0) {
                    best = c;
                }
            }
            let code = best as u8 | if v < 0.0 { 8 } else { 0 };
            let i = g * 32 + j;
            codes[i / 2] |= code << (4 * (i % 2));
        }
    }
    (codes, scales)
}

/// Appends a tensor of `shape` of random values (see [`random`]) in bf16.
fn add(
    tensors: &mut Vec<(String, Vec<usize>, Vec<u8>)>,
    name: String,
    shape: Vec<usize>,
    scale: f32,
    seed: &mut u64,
) {
    let n = shape.iter().product();
    let bytes = random(n, seed, scale)
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
        .collect();
    tensors.push((name, shape, bytes));
}

#[cfg(test)]
mod tests {
    use super::mxfp4;

    /// Values that are e2m1 codes times a power of two come back as those codes and that power;
    /// others round to the nearest code; a group's largest value sets its power.
    #[test]
    fn mxfp4_codes_and_powers() {
        let mut row: Vec<f32> = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0].iter().map(|v| v * 0.25).collect();
        row.extend(row.clone().iter().map(|v| -v));
        row.extend([1.0, 1.3, 1.24, 2.6, 5.1, -0.74, 0.0, 0.1].iter().map(|v| v * 0.25));
        row.extend([0.0; 8]);
        row.extend([0.0; 32]);
        let (codes, scales) = mxfp4(&row, 64);
        // 6 x 0.25 within 6 x 2^-2: 2^-2 (byte 125); a group of zeros takes the smallest power.
        assert_eq!(scales, vec![125, 0]);
        let code = |i: usize| (codes[i / 2] >> (4 * (i % 2))) & 15;
        // (-0 written as 0.)
        assert_eq!(
            (0..16).map(code).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]
        );
        // 1.3 -> 1.5, 1.24 -> 1.0, 2.6 -> 3, 5.1 -> 6, -0.74 -> -0.5, 0.1 -> 0.
        assert_eq!((16..24).map(code).collect::<Vec<_>>(), [2, 3, 2, 5, 7, 9, 0, 0]);
    }
}
