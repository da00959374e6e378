//! DeepSeek V4's `config.json`, as its checkpoints ship it.

use serde_json::Value;

use crate::{ModelError, RopeScaling};

/// What one layer's attention keeps besides its sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Layer {
    /// The window only (`compress_ratios` 0).
    Sliding,
    /// Rows compressed every 4 tokens from overlapping groups, a lightning indexer keeping
    /// `index_topk` of them per query (`compress_ratios` 4).
    CompressedSparse,
    /// Rows compressed every `ratio` tokens, all of them attended to (128 in the release).
    HeavilyCompressed { ratio: usize },
}

impl V4Layer {
    /// Tokens per compressed row (0: none).
    pub fn ratio(self) -> usize {
        match self {
            V4Layer::Sliding => 0,
            V4Layer::CompressedSparse => 4,
            V4Layer::HeavilyCompressed { ratio } => ratio,
        }
    }
}

/// The shape of a `DeepseekV4ForCausalLM` checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct V4Config {
    pub hidden: usize,
    pub vocab: usize,
    pub layers: usize,
    pub heads: usize,
    /// The one K=V head's width; its last `rope_dim` dimensions are rotated.
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub window: usize,
    /// Each main layer's kind, then each MTP layer's.
    pub kinds: Vec<V4Layer>,
    pub rope_theta: f32,
    pub compress_rope_theta: f32,
    /// YaRN of the compressed layers (their attention factor 1: cos and sin unscaled).
    pub compress_scaling: RopeScaling,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub experts: usize,
    pub shared_experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    /// The first layers route by token id (`tid2eid`), not by score.
    pub hash_layers: usize,
    pub routed_scaling: f32,
    /// Gate values capped at it and up values clamped to ±it (0: none).
    pub swiglu_limit: f32,
    pub hc_mult: usize,
    pub hc_iters: usize,
    pub hc_eps: f32,
    pub eps: f32,
    pub mtp_layers: usize,
    pub max_positions: usize,
    /// Block-scaled FP8 projections (`quantization_config` `fp8`): the scale blocks' shape.
    pub fp8_block: Option<[usize; 2]>,
}

impl V4Config {
    /// Whether `config.json`'s text describes a V4 model.
    pub fn is_v4(text: &str) -> bool {
        serde_json::from_str::<Value>(text).is_ok_and(|v| v["model_type"] == "deepseek_v4")
    }

    /// Reads and checks the fields; anything the forward pass cannot follow is an error naming it.
    pub fn from_json(text: &str) -> Result<V4Config, ModelError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| ModelError::format("config.json", e.to_string()))?;
        let bad = |field: &str, value: String| ModelError::Unsupported { field: field.into(), value };
        let need = |field: &str| -> Result<usize, ModelError> {
            v[field]
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| bad(field, format!("{} (a count is needed)", v[field])))
        };
        let num = |field: &str, default: f64| -> Result<f32, ModelError> {
            match &v[field] {
                Value::Null => Ok(default as f32),
                x => x.as_f64().map(|f| f as f32).ok_or_else(|| bad(field, x.to_string())),
            }
        };
        let (layers, mtp_layers) =
            (need("num_hidden_layers")?, v["num_nextn_predict_layers"].as_u64().unwrap_or(0) as usize);
        let ratios: Vec<u64> = match &v["compress_ratios"] {
            Value::Array(a) => a
                .iter()
                .map(|r| r.as_u64().ok_or_else(|| bad("compress_ratios", r.to_string())))
                .collect::<Result<_, _>>()?,
            other => return Err(bad("compress_ratios", format!("{other} (a list per layer is needed)"))),
        };
        let kinds = (0..layers + mtp_layers)
            .map(|l| match ratios.get(l).copied().unwrap_or(0) {
                0 => V4Layer::Sliding,
                4 => V4Layer::CompressedSparse,
                r => V4Layer::HeavilyCompressed { ratio: r as usize },
            })
            .collect();
        if v["num_key_value_heads"].as_u64().is_some_and(|n| n != 1) {
            return Err(bad(
                "num_key_value_heads",
                format!("{} (V4 has one K=V head)", v["num_key_value_heads"]),
            ));
        }
        if let Some(s) = v["scoring_func"].as_str().filter(|&s| s != "sqrtsoftplus") {
            return Err(bad("scoring_func", format!("{s} (V4 scores by sqrtsoftplus)")));
        }
        let max_positions = need("max_position_embeddings")?;
        let mut compress_scaling = match &v["rope_scaling"] {
            Value::Null => RopeScaling::None,
            s => RopeScaling::parse(s, max_positions)?,
        };
        if let RopeScaling::Yarn { attention_factor, .. } = &mut compress_scaling {
            *attention_factor = 1.0;
        }
        let c = V4Config {
            hidden: need("hidden_size")?,
            vocab: need("vocab_size")?,
            layers,
            heads: need("num_attention_heads")?,
            head_dim: need("head_dim")?,
            rope_dim: need("qk_rope_head_dim")?,
            q_lora: need("q_lora_rank")?,
            o_groups: need("o_groups")?,
            o_lora: need("o_lora_rank")?,
            window: need("sliding_window")?,
            kinds,
            rope_theta: num("rope_theta", 10000.0)?,
            compress_rope_theta: num("compress_rope_theta", 160000.0)?,
            compress_scaling,
            index_heads: need("index_n_heads")?,
            index_dim: need("index_head_dim")?,
            index_topk: need("index_topk")?,
            experts: need("n_routed_experts")?,
            shared_experts: v["n_shared_experts"].as_u64().unwrap_or(1) as usize,
            top_k: need("num_experts_per_tok")?,
            moe_intermediate: need("moe_intermediate_size")?,
            hash_layers: v["num_hash_layers"].as_u64().unwrap_or(0) as usize,
            routed_scaling: num("routed_scaling_factor", 1.0)?,
            swiglu_limit: num("swiglu_limit", 0.0)?,
            hc_mult: need("hc_mult")?,
            hc_iters: need("hc_sinkhorn_iters")?,
            hc_eps: num("hc_eps", 1e-6)?,
            eps: num("rms_norm_eps", 1e-6)?,
            mtp_layers,
            max_positions,
            fp8_block: match &v["quantization_config"] {
                Value::Null => None,
                q => Some(super::fp8_block(q)?),
            },
        };
        let shape_ok = c.rope_dim.is_multiple_of(2)
            && c.rope_dim <= c.head_dim
            && c.o_groups > 0
            && (c.heads * c.head_dim).is_multiple_of(c.o_groups)
            && c.window > 0
            && c.hc_mult > 0
            && c.hc_iters > 0
            && c.top_k <= c.experts
            && c.index_dim >= c.rope_dim;
        if !shape_ok {
            return Err(bad(
                "DeepSeek V4 shape",
                "head, rope, group or expert counts that do not fit".into(),
            ));
        }
        Ok(c)
    }

    /// The least block length (tokens) the compact KV layout can use: a multiple of every layer's
    /// compression ratio, the indexer's included, so no compressed row straddles two blocks.
    pub fn block_multiple(&self) -> usize {
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let ratios = self.kinds.iter().map(|k| k.ratio()).filter(|&r| r > 0);
        ratios.fold(4, |m, r| m / gcd(m, r) * r)
    }

    /// Rope's inverse frequencies for a layer of `kind`: plain from `rope_theta` for window-only
    /// layers, YaRN from `compress_rope_theta` for compressed ones.
    pub fn rope(&self, kind: V4Layer) -> Vec<f32> {
        match kind {
            V4Layer::Sliding => RopeScaling::None.frequencies(self.rope_dim, self.rope_theta).0,
            _ => self.compress_scaling.frequencies(self.rope_dim, self.compress_rope_theta).0,
        }
    }
}
