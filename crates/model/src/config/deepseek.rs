//! DeepSeek's `config.json` fields (V2, V3, V3.2): multi-head latent attention, its sparse
//! attention indexer, DeepSeekMoE's routing, and block-scaled FP8 weights.

use super::{ExpertGroups, GroupScore, Moe, MoeNames, RawConfig, RopeScaling, Scoring};
use crate::ModelError;

/// Multi-head latent attention (DeepSeek V2/V3): every head's keys and values come from one latent
/// per token, `c_kv` (`kv_lora_rank` values, RMS-normed) and one rope key shared by every head
/// (`qk_rope_head_dim`); the KV cache holds only `[c_kv | k_rope]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mla {
    /// The query's low-rank width (`q_a_proj`, normed, then `q_b_proj`); `None`: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Each head's query and key: `qk_nope_head_dim` values from the latent, then `qk_rope_head_dim`
    /// rotated ones.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// What scores are multiplied by before the softmax: `(nope + rope)^-0.5`, times YaRN's
    /// `mscale(factor, mscale_all_dim)^2` where `rope_scaling` sets `mscale_all_dim`.
    pub softmax_scale: f32,
    /// DeepSeek Sparse Attention (V3.2): a lightning indexer picks the positions each query attends
    /// to; its keys are cached beside the latent.
    pub indexer: Option<Indexer>,
}

/// V3.2's lightning indexer: `heads` query heads of `head_dim` (its first `qk_rope_head_dim` rotated,
/// half-split) scored against one cached key per position (`head_dim`, LayerNorm-ed and rotated
/// alike), `Σ_h w_h relu(q_h . k)` with per-head weights from the hidden state; each query attends to
/// its `topk` best positions (all of them while it sees no more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Indexer {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

impl Mla {
    /// Values attention reads per token and layer: the latent, then the rope key.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Values the KV cache holds per token and layer: the latent and the rope key, then the
    /// indexer's key (V3.2).
    pub fn row_width(&self) -> usize {
        self.latent_width() + self.indexer.map_or(0, |i| i.head_dim)
    }

    /// One head's query and key width.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// A `quantization_config` this engine loads: block-scaled FP8 (e4m3 values; `weight_block_size`,
/// by default 128 x 128). Other methods (GPTQ, AWQ, bitsandbytes, ...) are refused by name.
pub(crate) fn fp8_block(q: &serde_json::Value) -> Result<[usize; 2], ModelError> {
    let bad = |field: &str, value: String| ModelError::Unsupported {
        field: format!("quantization_config.{field}"),
        value,
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    if method != "fp8" {
        return Err(bad("quant_method", format!("{method:?} (fp8 is supported)")));
    }
    if let Some(fmt) = q.get("fmt").and_then(|f| f.as_str()).filter(|&f| f != "e4m3") {
        return Err(bad("fmt", format!("{fmt} (e4m3 is supported)")));
    }
    match q.get("weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok([128, 128]),
        Some(v) => match v.as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect::<Vec<_>>()) {
            Some(b) if b.len() == 2 && b[0] > 0 && b[1] > 0 => Ok([b[0] as usize, b[1] as usize]),
            _ => Err(bad("weight_block_size", v.to_string())),
        },
    }
}

/// Whether `quantization_config` is ModelOpt's NVFP4.
pub(super) fn nvfp4(q: &serde_json::Value) -> bool {
    let algo = q.get("quant_algo").or_else(|| q.get("quantization").and_then(|x| x.get("quant_algo")));
    algo.and_then(|a| a.as_str()).is_some_and(|a| a.eq_ignore_ascii_case("nvfp4"))
}

/// NVFP4's group of columns per scale (`group_size`, 16 when not given; the kernels take 16 or 32).
pub(super) fn fp4_group(q: &serde_json::Value) -> Result<usize, ModelError> {
    match q.get("group_size").and_then(|g| g.as_u64()) {
        None => Ok(16),
        Some(g @ (16 | 32)) => Ok(g as usize),
        Some(g) => Err(ModelError::Unsupported {
            field: "quantization_config.group_size".into(),
            value: format!("{g} (NVFP4 groups of 16 or 32 are supported)"),
        }),
    }
}

/// DeepSeek's attention fields (V2 and V3 name them alike).
pub(super) fn mla(raw: &RawConfig, rope: &RopeScaling) -> Result<Mla, ModelError> {
    let need = |field: &str, v: Option<usize>| {
        v.filter(|&n| n > 0)
            .ok_or_else(|| ModelError::format("config.json", format!("DeepSeek attention needs {field}")))
    };
    let (nope, rope_dim) =
        (need("qk_nope_head_dim", raw.qk_nope_head_dim)?, need("qk_rope_head_dim", raw.qk_rope_head_dim)?);
    if !rope_dim.is_multiple_of(2) {
        return Err(ModelError::format("config.json", format!("qk_rope_head_dim {rope_dim} must be even")));
    }
    if raw.rope_interleave == Some(false) {
        return Err(ModelError::Unsupported { field: "rope_interleave".into(), value: "false".into() });
    }
    let mut softmax_scale = 1.0 / ((nope + rope_dim) as f32).sqrt();
    // YaRN's mscale of the whole head (`mscale_all_dim`) scales the softmax twice over; its
    // `attention_factor` (mscale / mscale_all_dim) scales cos and sin, as `RopeScaling` does.
    if let (RopeScaling::Yarn { factor, .. }, Some(all)) =
        (rope, raw.rope_scaling.as_ref().and_then(|v| v.get("mscale_all_dim")).and_then(|m| m.as_f64()))
    {
        if all != 0.0 && *factor > 1.0 {
            let m = 0.1 * all as f32 * factor.ln() + 1.0;
            softmax_scale *= m * m;
        }
    }
    let indexer = match (raw.index_n_heads, raw.index_head_dim, raw.index_topk) {
        (None, None, None) => None,
        (Some(heads), Some(head_dim), Some(topk)) if heads > 0 && topk > 0 && head_dim >= rope_dim => {
            if raw.q_lora_rank.is_none_or(|r| r == 0) {
                return Err(ModelError::format("config.json", "the sparse attention indexer reads the query LoRA: q_lora_rank is needed"));
            }
            Some(Indexer { heads, head_dim, topk })
        }
        (h, d, k) => {
            return Err(ModelError::format(
                "config.json",
                format!("the sparse attention indexer needs index_n_heads ({h:?}), index_head_dim ({d:?}, at least qk_rope_head_dim) and index_topk ({k:?})"),
            ))
        }
    };
    Ok(Mla {
        indexer,
        q_lora_rank: raw.q_lora_rank.filter(|&n| n > 0),
        kv_lora_rank: need("kv_lora_rank", raw.kv_lora_rank)?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope_dim,
        v_head_dim: need("v_head_dim", raw.v_head_dim)?,
        softmax_scale,
    })
}

/// DeepSeekMoE from a V2/V3 `config.json`: `None` without routed experts.
pub(super) fn deepseek_moe(raw: &RawConfig) -> Result<Option<Moe>, ModelError> {
    let Some(experts) = raw.n_routed_experts.filter(|&n| n > 0) else { return Ok(None) };
    let unsupported =
        |field: &str, value: String| Err(ModelError::Unsupported { field: field.into(), value });
    let top_k = raw.num_experts_per_tok.unwrap_or(0);
    if top_k == 0 || top_k > experts {
        return unsupported("num_experts_per_tok", format!("{top_k} of {experts} experts"));
    }
    // V2's code defaults to softmax and plain top-k; V3's (transformers hard-codes them) to sigmoid
    // and noaux_tc.
    let v2 =
        raw.model_type == "deepseek_v2" || raw.architectures.iter().any(|a| a == "DeepseekV2ForCausalLM");
    let scoring = match raw.scoring_func.as_deref().unwrap_or(if v2 { "softmax" } else { "sigmoid" }) {
        "softmax" => Scoring::Softmax,
        "sigmoid" => Scoring::Sigmoid,
        other => return unsupported("scoring_func", other.into()),
    };
    let group = |score| -> Result<Option<ExpertGroups>, ModelError> {
        let (groups, topk_groups) = (raw.n_group.unwrap_or(1).max(1), raw.topk_group.unwrap_or(1).max(1));
        if !experts.is_multiple_of(groups) || topk_groups > groups || topk_groups * (experts / groups) < top_k
        {
            return Err(ModelError::Unsupported {
                field: "n_group".into(),
                value: format!("{groups} groups, {topk_groups} kept, of {experts} experts choosing {top_k}"),
            });
        }
        Ok(Some(ExpertGroups { groups, topk_groups, score }))
    };
    // DeepSeek-V2's own code spells its default "gready".
    let (groups, correction_bias) =
        match raw.topk_method.as_deref().unwrap_or(if v2 { "greedy" } else { "noaux_tc" }) {
            "greedy" | "gready" => (None, false),
            "group_limited_greedy" => (group(GroupScore::Max)?, false),
            "noaux_tc" => (group(GroupScore::TopTwoSum)?, true),
            other => return unsupported("topk_method", other.into()),
        };
    let intermediate_size = raw
        .moe_intermediate_size
        .filter(|&n| n > 0)
        .ok_or_else(|| ModelError::format("config.json", "DeepSeekMoE needs moe_intermediate_size"))?;
    let (first_dense, freq) =
        (raw.first_k_dense_replace.unwrap_or(0), raw.moe_layer_freq.unwrap_or(1).max(1));
    Ok(Some(Moe {
        experts,
        top_k,
        // Softmax scores (V2) are never renormalized (DeepSeek's reference and transformers both skip
        // it whatever the field says); sigmoid ones (V3) are by default, as transformers' V3 is.
        norm_topk_prob: scoring == Scoring::Sigmoid && raw.norm_topk_prob.unwrap_or(!v2),
        intermediate_size,
        // The draft layer after the last one follows the same rule (V3's is a layer of experts).
        dense_layers: (0..raw.num_hidden_layers + raw.num_nextn_predict_layers.unwrap_or(0).min(1))
            .filter(|&l| !(l >= first_dense && l % freq == 0))
            .collect(),
        names: MoeNames::Qwen,
        scoring,
        groups,
        correction_bias,
        routed_scaling_factor: raw.routed_scaling_factor.unwrap_or(1.0) as f32,
        shared_intermediate: raw.n_shared_experts.filter(|&n| n > 0).map(|n| n * intermediate_size),
    }))
}
