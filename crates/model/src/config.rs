//! `config.json` of a Llama-family model, checked for what this engine implements.

use std::path::Path;

use serde::Deserialize;

use crate::ModelError;

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
}

impl ModelConfig {
    /// Reads and checks `config.json`. Anything the engine cannot run faithfully is an error naming the
    /// field, never a silent approximation.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Format { problem, .. } => ModelError::format(path, problem),
            other => other,
        })
    }

    pub fn from_json(text: &str) -> Result<ModelConfig, ModelError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ModelError::format("config.json", e.to_string()))?;
        let unsupported =
            |field: &str, value: String| Err(ModelError::Unsupported { field: field.into(), value });
        let arch = raw.architectures.first().cloned().unwrap_or_default();
        let (qkv_bias, o_bias) = match (arch.as_str(), raw.model_type.as_str()) {
            ("LlamaForCausalLM", _) | (_, "llama") => (raw.attention_bias, raw.attention_bias),
            ("MistralForCausalLM", _) | (_, "mistral") => (false, false),
            ("Qwen2ForCausalLM", _) | (_, "qwen2") => (true, false),
            _ => return unsupported("architectures", format!("{arch} (model_type {:?})", raw.model_type)),
        };
        if raw.hidden_act != "silu" {
            return unsupported("hidden_act", raw.hidden_act);
        }
        if let Some(s) = raw.rope_scaling.filter(|v| !v.is_null()) {
            return unsupported("rope_scaling", s.to_string());
        }
        if raw.mlp_bias {
            return unsupported("mlp_bias", "true".into());
        }
        let sliding =
            raw.sliding_window.filter(|_| raw.use_sliding_window.unwrap_or(raw.model_type != "qwen2"));
        if let Some(w) = sliding.filter(|&w| w < raw.max_position_embeddings) {
            return unsupported("sliding_window", w.to_string());
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
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
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads);
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
        })
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
            "rope_scaling"
        );
        assert_eq!(field(parse(r#", "model_type": "mistral", "sliding_window": 128"#)), "sliding_window");
        assert_eq!(field(parse(r#", "model_type": "llama", "hidden_act": "gelu""#)), "hidden_act");
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
