//! `config.json` of a Llama-family model, checked for what this engine implements.

use std::path::Path;

use serde::Deserialize;

use crate::ModelError;

mod deepseek;
mod v4;

pub(crate) use deepseek::fp8_block;
use deepseek::{deepseek_moe, fp4_group, mla, nvfp4};
pub use deepseek::{Indexer, Mla};
pub use v4::{V4Config, V4Layer};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: String,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    // Mixture of experts: Mixtral's names, then Qwen3-MoE's.
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    norm_topk_prob: Option<bool>,
    moe_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default)]
    shared_expert_intermediate_size: Option<usize>,
    // DeepSeek V2/V3: multi-head latent attention and DeepSeekMoE.
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    routed_scaling_factor: Option<f64>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    rope_interleave: Option<bool>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    num_nextn_predict_layers: Option<usize>,
    #[serde(default)]
    quantization_config: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_act() -> String {
    "silu".into()
}

/// How rope's inverse frequencies are scaled for a context longer than the model was trained on
/// (`rope_scaling` in `config.json`, as Hugging Face's `modeling_rope_utils` computes it).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain rope; also `dynamic` NTK scaling, which changes the base only for sequences longer than
    /// `max_position_embeddings`, a context the engine never serves.
    None,
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, the band between smoothed.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_positions: f32 },
    /// YaRN: interpolated and extrapolated frequencies blended over a ramp of dimensions, cos and sin
    /// scaled by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_positions: f32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

impl RopeScaling {
    /// Rope's inverse frequencies for `hd` rotated dimensions (`hd / 2`, computed in f32 as Hugging
    /// Face does) from `base`, and the factor cos and sin are scaled by.
    pub fn frequencies(&self, hd: usize, base: f32) -> (Vec<f32>, f32) {
        let plain: Vec<f32> = (0..hd / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / hd as f32)).collect();
        match *self {
            RopeScaling::None => (plain, 1.0),
            RopeScaling::Linear { factor } => (plain.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions: old,
            } => {
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let inv = plain.iter().map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                });
                (inv.collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_positions: orig,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let dim = hd as f32;
                let correction =
                    |rot: f32| (dim * (orig / (rot * 2.0 * std::f32::consts::PI)).ln()) / (2.0 * base.ln());
                let (mut lo, mut hi) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (lo, hi) = (lo.floor(), hi.ceil());
                }
                let (lo, mut hi) = (lo.max(0.0), hi.min(dim - 1.0));
                if lo == hi {
                    hi += 0.001;
                }
                let inv = plain.iter().enumerate().map(|(i, &f)| {
                    let extrapolation = 1.0 - ((i as f32 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    (f / factor) * (1.0 - extrapolation) + f * extrapolation
                });
                (inv.collect(), attention_factor)
            }
        }
    }

    pub(crate) fn parse(v: &serde_json::Value, max_positions: usize) -> Result<RopeScaling, ModelError> {
        let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|k| k.as_str()).unwrap_or("default");
        let bad = |field: &str, value: String| ModelError::Unsupported {
            field: format!("rope_scaling.{field}"),
            value,
        };
        let num = |field: &str| -> Result<Option<f32>, ModelError> {
            match v.get(field) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x.as_f64().map(|f| Some(f as f32)).ok_or_else(|| bad(field, x.to_string())),
            }
        };
        let need = |field: &str| num(field)?.ok_or_else(|| bad(field, format!("missing (rope type {kind})")));
        // Factors and lengths that would make the frequencies infinite or NaN.
        let positive = |field: &str| match need(field)? {
            v if v > 0.0 && v.is_finite() => Ok(v),
            v => Err(bad(field, format!("{v} (must be positive)"))),
        };
        Ok(match kind {
            "default" | "dynamic" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: positive("factor")? },
            "llama3" => {
                let (low, high) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
                if high <= low {
                    return Err(bad(
                        "high_freq_factor",
                        format!("{high} (must exceed low_freq_factor {low})"),
                    ));
                }
                RopeScaling::Llama3 {
                    factor: positive("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_positions: positive("original_max_position_embeddings")?,
                }
            }
            "yarn" => {
                let factor = positive("factor")?;
                let mscale = |m: f32| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
                let attention_factor =
                    match (num("attention_factor")?, num("mscale")?, num("mscale_all_dim")?) {
                        (Some(a), _, _) => a,
                        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                        _ => mscale(1.0),
                    };
                RopeScaling::Yarn {
                    factor,
                    original_max_positions: num("original_max_position_embeddings")?
                        .unwrap_or(max_positions as f32),
                    beta_fast: num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                    attention_factor,
                    truncate: v.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
                }
            }
            other => return Err(bad("rope_type", other.to_owned())),
        })
    }
}

/// The model shape the engine runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry biases (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// The output projection carries a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub rope_scaling: RopeScaling,
    /// Per-head RMSNorm of Q and K before rope (Qwen3).
    pub qk_norm: bool,
    /// Each token attends to at most this many positions, its own included (Mistral's
    /// `sliding_window`); `None` for full causal attention.
    pub sliding_window: Option<usize>,
    /// Mixture-of-experts FFNs (Mixtral, Qwen3-MoE, DeepSeek); `None` for a dense model.
    pub moe: Option<Moe>,
    /// Block-scaled FP8 weights (`quantization_config` `fp8`, DeepSeek's checkpoints): each
    /// `X.weight` of e4m3 values has `X.weight_scale_inv`, one scale per block of `[rows, cols]`.
    pub fp8_block: Option<[usize; 2]>,
    /// NVFP4 weights as NVIDIA's ModelOpt writes them (`quantization_config` `modelopt` with
    /// `quant_algo` `NVFP4`): each quantized `X.weight` is u8 `[rows, cols / 2]`, two e2m1 codes a
    /// byte (the even column low), with `X.weight_scale` (e4m3, one per `group` columns) and
    /// `X.weight_scale_2` (one f32): weight = code x (scale x scale_2). The group (16).
    pub fp4_group: Option<usize>,
    /// Multi-head latent attention (DeepSeek V2/V3): `None` for per-head K and V. With it,
    /// `num_kv_heads` is 1 and `head_dim` is the rope part's width (what `rope` computes for).
    pub mla: Option<Mla>,
    /// Draft layers loaded (0 or 1): DeepSeek's multi-token prediction layer (`num_nextn_predict_layers`,
    /// weights `model.layers.{num_layers}.*`), read after the main model's last layer to guess the
    /// token after next (speculative decoding). Its KV is held as one more layer. Set to 0 before
    /// loading to leave it out.
    pub draft_layers: usize,
    /// DeepSeek V4 (`DeepseekV4ForCausalLM`): its own shape, served by `V4Backend`; the fields above
    /// then give what the engine reads (vocabulary, context, tokens), none of the layers' shape.
    pub v4: Option<Box<V4Config>>,
}

/// A mixture-of-experts FFN: a router picks `top_k` of `experts` SwiGLU experts per token and sums
/// their outputs weighted by the router's softmax probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    /// The chosen experts' probabilities are divided by their sum (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Each expert's intermediate width.
    pub intermediate_size: usize,
    /// Layers that keep a dense FFN (`intermediate_size` of the model) instead of experts.
    pub dense_layers: Vec<usize>,
    pub names: MoeNames,
    /// How the router's logits become scores.
    pub scoring: Scoring,
    /// DeepSeek's group-limited routing: only experts of the best groups can be chosen.
    pub groups: Option<ExpertGroups>,
    /// A per-expert bias (`e_score_correction_bias`, DeepSeek V3's `noaux_tc`) added to the scores
    /// to choose experts only; the chosen experts are weighted by their unbiased scores.
    pub correction_bias: bool,
    /// The chosen experts' weights are multiplied by this (DeepSeek's `routed_scaling_factor`; 1
    /// elsewhere).
    pub routed_scaling_factor: f32,
    /// Shared experts' intermediate width (DeepSeek: `n_shared_experts` x `moe_intermediate_size`),
    /// one SwiGLU every token runs besides its routed experts.
    pub shared_intermediate: Option<usize>,
}

/// A router's scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over every expert (Mixtral, Qwen3-MoE, DeepSeek V2).
    Softmax,
    /// Each expert's sigmoid (DeepSeek V3).
    Sigmoid,
}

/// Group-limited expert selection: the experts are cut into `groups` equal groups, each scored by
/// `score`, and only the experts of the best `topk_groups` groups are candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertGroups {
    pub groups: usize,
    pub topk_groups: usize,
    pub score: GroupScore,
}

/// How a group of experts is scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupScore {
    /// Its best expert's score (DeepSeek V2's `group_limited_greedy`).
    Max,
    /// The sum of its two best (biased) scores (DeepSeek V3's `noaux_tc`).
    TopTwoSum,
}

/// How a checkpoint names its expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeNames {
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down).
    Mixtral,
    /// `mlp.gate`, `mlp.experts.E.{gate_proj,up_proj,down_proj}` (Qwen3-MoE; DeepSeek, whose
    /// shared experts are `mlp.shared_experts.{gate_proj,up_proj,down_proj}` and whose router's bias
    /// is `mlp.gate.e_score_correction_bias`).
    Qwen,
}

impl Moe {
    /// Whether layer `layer` routes through experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.dense_layers.contains(&layer)
    }
}

impl ModelConfig {
    /// Rope's inverse frequencies (`head_dim / 2`, computed in f32 as Hugging Face does) and the factor
    /// cos and sin are scaled by.
    pub fn rope(&self) -> (Vec<f32>, f32) {
        self.rope_scaling.frequencies(self.head_dim, self.rope_theta)
    }

    /// Reads and checks `config.json`. Anything the engine cannot run faithfully is an error naming the
    /// field, never a silent approximation.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Format { problem, .. } => ModelError::format(path, problem),
            ModelError::Unsupported { field, value } => {
                ModelError::Unsupported { field: format!("{field} (in {})", path.display()), value }
            }
            other => other,
        })
    }

    pub fn from_json(text: &str) -> Result<ModelConfig, ModelError> {
        if V4Config::is_v4(text) {
            return ModelConfig::from_v4(text);
        }
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ModelError::format("config.json", e.to_string()))?;
        let unsupported =
            |field: &str, value: String| Err(ModelError::Unsupported { field: field.into(), value });
        let arch = raw.architectures.first().cloned().unwrap_or_default();
        let (qkv_bias, o_bias, qk_norm, moe_names) = match (arch.as_str(), raw.model_type.as_str()) {
            ("LlamaForCausalLM", _) | (_, "llama") => (raw.attention_bias, raw.attention_bias, false, None),
            ("MistralForCausalLM", _) | (_, "mistral") => (false, false, false, None),
            ("MixtralForCausalLM", _) | (_, "mixtral") => (false, false, false, Some(MoeNames::Mixtral)),
            ("Qwen2ForCausalLM", _) | (_, "qwen2") => (true, false, false, None),
            ("Qwen3ForCausalLM", _) | (_, "qwen3") => (raw.attention_bias, raw.attention_bias, true, None),
            ("Qwen3MoeForCausalLM", _) | (_, "qwen3_moe") => {
                (raw.attention_bias, raw.attention_bias, true, Some(MoeNames::Qwen))
            }
            ("DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM" | "DeepseekV32ForCausalLM", _)
            | (_, "deepseek_v2" | "deepseek_v3" | "deepseek_v32") => (false, false, false, None),
            _ => return unsupported("architectures", format!("{arch} (model_type {:?})", raw.model_type)),
        };
        let deepseek = raw.model_type.starts_with("deepseek") || arch.starts_with("Deepseek");
        let moe = match moe_names {
            None if deepseek => deepseek_moe(&raw)?,
            None => None,
            Some(names) => {
                let experts = raw.num_local_experts.or(raw.num_experts);
                let experts = experts.filter(|&e| e > 0).ok_or_else(|| {
                    ModelError::format("config.json", "a mixture-of-experts model needs num_experts")
                })?;
                let top_k = raw.num_experts_per_tok.unwrap_or(2);
                if top_k == 0 || top_k > experts {
                    return unsupported("num_experts_per_tok", format!("{top_k} of {experts} experts"));
                }
                if let Some(n) = raw.shared_expert_intermediate_size.filter(|&n| n > 0) {
                    return unsupported("shared_expert_intermediate_size", n.to_string());
                }
                let step = raw.decoder_sparse_step.unwrap_or(1).max(1);
                let dense_layers = (0..raw.num_hidden_layers)
                    .filter(|l| raw.mlp_only_layers.contains(l) || (l + 1) % step != 0)
                    .collect();
                Some(Moe {
                    experts,
                    top_k,
                    norm_topk_prob: names == MoeNames::Mixtral || raw.norm_topk_prob.unwrap_or(false),
                    intermediate_size: raw.moe_intermediate_size.unwrap_or(raw.intermediate_size),
                    dense_layers,
                    names,
                    scoring: Scoring::Softmax,
                    groups: None,
                    correction_bias: false,
                    routed_scaling_factor: 1.0,
                    shared_intermediate: None,
                })
            }
        };
        if raw.hidden_act != "silu" {
            return unsupported("hidden_act", raw.hidden_act);
        }
        let rope_scaling = match raw.rope_scaling.clone().filter(|v| !v.is_null()) {
            Some(v) => RopeScaling::parse(&v, raw.max_position_embeddings)?,
            None => RopeScaling::None,
        };
        if raw.mlp_bias {
            return unsupported("mlp_bias", "true".into());
        }
        // Mistral's window covers every layer; Qwen's (off unless `use_sliding_window`) only some,
        // chosen by `max_window_layers`, which is not implemented.
        let qwen = raw.model_type.starts_with("qwen");
        let sliding = raw
            .sliding_window
            .filter(|_| raw.use_sliding_window.unwrap_or(!qwen))
            .filter(|&w| w < raw.max_position_embeddings);
        match sliding {
            Some(0) => return unsupported("sliding_window", "0".into()),
            Some(w) if qwen => return unsupported("sliding_window (with use_sliding_window)", w.to_string()),
            _ => {}
        }
        let mla = if deepseek { Some(mla(&raw, &rope_scaling)?) } else { None };
        if deepseek && raw.attention_bias {
            return unsupported("attention_bias", "true (DeepSeek's projections have no biases)".into());
        }
        // The latent is one KV "head" shared by every query head; `head_dim` is what rope rotates.
        let num_kv_heads =
            if mla.is_some() { 1 } else { raw.num_key_value_heads.unwrap_or(raw.num_attention_heads) };
        if raw.num_attention_heads == 0
            || num_kv_heads == 0
            || !raw.num_attention_heads.is_multiple_of(num_kv_heads)
        {
            return Err(ModelError::format(
                "config.json",
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                    raw.num_attention_heads
                ),
            ));
        }
        let head_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads),
        };
        if !head_dim.is_multiple_of(2) || head_dim == 0 {
            return Err(ModelError::format("config.json", format!("head_dim {head_dim} must be even")));
        }
        Ok(ModelConfig {
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta: raw.rope_theta as f32,
            max_position_embeddings: raw.max_position_embeddings,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            qkv_bias,
            o_bias,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: match raw.eos_token_id {
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
                None => Vec::new(),
            },
            rope_scaling,
            qk_norm,
            sliding_window: sliding,
            moe,
            mla,
            fp8_block: match raw.quantization_config.as_ref().filter(|v| !v.is_null() && !nvfp4(v)) {
                Some(q) => Some(fp8_block(q)?),
                None => None,
            },
            fp4_group: match raw.quantization_config.as_ref().filter(|v| nvfp4(v)) {
                Some(q) => Some(fp4_group(q)?),
                None => None,
            },
            // DeepSeek's multi-token prediction layers (V3 ships one): the first is the draft layer.
            draft_layers: if deepseek { raw.num_nextn_predict_layers.unwrap_or(0).min(1) } else { 0 },
            v4: None,
        })
    }

    /// A DeepSeek V4 `config.json`: the engine's view of it beside its own shape.
    fn from_v4(text: &str) -> Result<ModelConfig, ModelError> {
        #[derive(Deserialize)]
        struct Tokens {
            bos_token_id: Option<u32>,
            eos_token_id: Option<OneOrMany>,
        }
        let v = V4Config::from_json(text)?;
        let t: Tokens =
            serde_json::from_str(text).map_err(|e| ModelError::format("config.json", e.to_string()))?;
        Ok(ModelConfig {
            hidden_size: v.hidden,
            intermediate_size: v.moe_intermediate,
            num_layers: v.layers,
            num_heads: v.heads,
            num_kv_heads: 1,
            head_dim: v.head_dim,
            rms_norm_eps: v.eps,
            rope_theta: v.rope_theta,
            max_position_embeddings: v.max_positions,
            vocab_size: v.vocab,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            bos_token_id: t.bos_token_id,
            eos_token_ids: match t.eos_token_id {
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
                None => Vec::new(),
            },
            rope_scaling: RopeScaling::None,
            qk_norm: false,
            // The compressed layers read every earlier group's row: no position's row is given back.
            sliding_window: None,
            moe: None,
            mla: None,
            fp8_block: v.fp8_block,
            fp4_group: None,
            // The first MTP layer drafts.
            draft_layers: v.mtp_layers.min(1),
            v4: Some(Box::new(v)),
        })
    }

    /// Values the KV cache holds per token and layer: K and V of every KV head, or MLA's latent
    /// (DeepSeek V4's differ by layer: `V4Backend::layout`).
    pub fn kv_values_per_token_layer(&self) -> usize {
        match &self.mla {
            Some(m) => m.row_width(),
            None => 2 * self.num_kv_heads * self.head_dim,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 100"#;

    fn parse(extra: &str) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_json(&format!("{{{BASE}{extra}}}"))
    }

    #[test]
    fn families_and_rejections() {
        let c = parse(r#", "architectures": ["LlamaForCausalLM"], "eos_token_id": [2, 7]"#).unwrap();
        assert_eq!((c.head_dim, c.num_kv_heads, c.qkv_bias), (16, 2, false));
        assert_eq!(c.eos_token_ids, [2, 7]);
        assert!(
            parse(r#", "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": false"#)
                .unwrap()
                .qkv_bias
        );
        let field = |r: Result<ModelConfig, ModelError>| match r {
            Err(ModelError::Unsupported { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(parse(r#", "model_type": "gpt2""#)), "architectures");
        assert_eq!(
            field(parse(r#", "model_type": "llama", "rope_scaling": {"type": "linear"}"#)),
            "rope_scaling.factor"
        );
        assert_eq!(
            field(parse(
                r#", "model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 4}"#
            )),
            "rope_scaling.rope_type"
        );
        let dynamic = parse(r#", "model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}"#);
        assert_eq!(dynamic.unwrap().rope_scaling, RopeScaling::None);
        // Llama 3.1's scaling (theta 500,000, head_dim 128): the highest frequency kept, the lowest
        // divided by the factor, one in the band between smoothed.
        let l3 = parse(
            r#", "model_type": "llama", "head_dim": 128, "rope_theta": 500000.0, "rope_scaling": {"rope_type":
            "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}"#,
        )
        .unwrap();
        let plain = ModelConfig { rope_scaling: RopeScaling::None, ..l3.clone() }.rope().0;
        let (inv, att) = l3.rope();
        assert_eq!((inv[0], att), (plain[0], 1.0));
        assert!((inv[63] - plain[63] / 8.0).abs() < 1e-12);
        let band = inv.iter().zip(&plain).filter(|(a, p)| **a < **p && **a > **p / 8.0).count();
        assert!(band > 0, "{inv:?}");
        let q3 = parse(r#", "model_type": "qwen3", "head_dim": 32, "sliding_window": 64"#).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias && q3.head_dim == 32);
        let mistral = parse(r#", "model_type": "mistral", "sliding_window": 128"#).unwrap();
        assert_eq!(mistral.sliding_window, Some(128));
        assert_eq!(
            parse(r#", "model_type": "mistral", "sliding_window": 4096"#).unwrap().sliding_window,
            None
        );
        assert_eq!(
            field(parse(r#", "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": true"#)),
            "sliding_window (with use_sliding_window)"
        );
        let mixtral = parse(r#", "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2"#);
        let m = mixtral.unwrap().moe.unwrap();
        assert_eq!((m.experts, m.top_k, m.norm_topk_prob, m.intermediate_size), (8, 2, true, 128));
        let q3moe = parse(
            r#", "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size":
            32, "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": false"#,
        )
        .unwrap();
        let m = q3moe.moe.unwrap();
        assert!(q3moe.qk_norm && !m.norm_topk_prob && !m.is_sparse(0) && m.is_sparse(1));
        assert_eq!(
            field(parse(r#", "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3"#)),
            "num_experts_per_tok"
        );
        assert_eq!(field(parse(r#", "model_type": "llama", "hidden_act": "gelu""#)), "hidden_act");
        assert_eq!(
            field(parse(r#", "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 0}"#)),
            "rope_scaling.factor"
        );
        assert_eq!(
            field(parse(
                r#", "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                "high_freq_factor": 4, "original_max_position_embeddings": 8192}"#
            )),
            "rope_scaling.high_freq_factor"
        );
        // DeepSeek V3 as shipped (its field names; the sizes small).
        let v3 = parse(
            r#", "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "q_lora_rank": 32, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
            "routed_scaling_factor": 2.5, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings":
            64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}"#,
        )
        .unwrap();
        let (mla, moe) = (v3.mla.clone().unwrap(), v3.moe.clone().unwrap());
        assert_eq!(
            (v3.num_kv_heads, v3.head_dim, mla.latent_width(), v3.kv_values_per_token_layer()),
            (1, 8, 72, 72)
        );
        // 24^-0.5 x (0.1 ln 40 + 1)^2, the softmax scale DeepSeek's yarn sets.
        assert!(
            (mla.softmax_scale - 1.368_888 * 1.368_888 / 24f32.sqrt()).abs() < 1e-5,
            "{}",
            mla.softmax_scale
        );
        assert_eq!(v3.rope().1, 1.0, "mscale / mscale_all_dim leaves cos and sin as they are");
        assert_eq!(
            (moe.dense_layers.clone(), moe.shared_intermediate, moe.scoring),
            (vec![0], Some(32), Scoring::Sigmoid)
        );
        assert_eq!(
            moe.groups,
            Some(ExpertGroups { groups: 4, topk_groups: 2, score: GroupScore::TopTwoSum })
        );
        assert!(moe.correction_bias && moe.norm_topk_prob && moe.routed_scaling_factor == 2.5);
        let v2 = parse(
            r#", "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "q_lora_rank": null,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "topk_method": "gready""#,
        )
        .unwrap();
        let moe = v2.moe.unwrap();
        assert!(v2.mla.unwrap().q_lora_rank.is_none() && moe.groups.is_none() && !moe.correction_bias);
        assert_eq!((moe.scoring, moe.shared_intermediate), (Scoring::Softmax, None));
        let v32 = parse(
            r#", "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "q_lora_rank": 32,
            "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "index_n_heads": 4, "index_head_dim": 16, "index_topk": 12"#,
        )
        .unwrap();
        let m = v32.mla.unwrap();
        assert_eq!((m.indexer, m.row_width()), (Some(Indexer { heads: 4, head_dim: 16, topk: 12 }), 88));
        assert!(matches!(
            parse(
                r#", "model_type": "deepseek_v32", "kv_lora_rank": 64, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 32, "index_n_heads": 4"#
            ),
            Err(ModelError::Format { .. })
        ));
        assert_eq!(
            field(parse(
                r#", "model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "topk_method": "noaux_tc", "n_group": 3"#
            )),
            "n_group"
        );
        let fp8 = parse(
            r#", "model_type": "llama", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}"#,
        );
        assert_eq!(fp8.unwrap().fp8_block, Some([128, 128]));
        assert_eq!(
            field(parse(
                r#", "model_type": "llama", "quantization_config": {"quant_method": "awq", "bits": 4}"#
            )),
            "quantization_config.quant_method"
        );
        assert!(matches!(ModelConfig::from_json("{}"), Err(ModelError::Format { .. })));
        assert!(matches!(
            ModelConfig::from_json(&format!(
                "{{{}, \"model_type\": \"llama\"}}",
                BASE.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3")
            )),
            Err(ModelError::Format { .. })
        ));
    }
}
