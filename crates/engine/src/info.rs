//! What an engine runs, as its handle and reports (`/v1/models`) describe it.

use std::net::SocketAddr;
use std::path::PathBuf;

use pdserve_api::Role;
use pdserve_model::WeightFormat;

use crate::Device;

/// What the engine runs, for reports (`/v1/models`) and handles.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub role: Role,
    pub device: Device,
    pub weights: WeightFormat,
    /// What the quantized weights' products round their inputs to: "q8" (`--activations q8`) or "f32".
    pub activations: &'static str,
    /// What every step's products read, whatever its row count: "f32", "bf16", "f16", "fp8", "fp4", "q8" or "q4".
    pub multi_row_weights: &'static str,
    /// The KV cache's element type.
    pub kv_dtype: pdserve_model::KvDtype,
    /// Bytes of the weights as held (every form the backend reads: f32, quantized, bf16).
    pub weight_bytes: usize,
    /// Bytes of the KV pool.
    pub kv_bytes: usize,
    /// Bytes of KV one token holds over every layer: K and V of every KV head, or a latent-attention
    /// model's latent row (`kv_lora_rank + qk_rope_head_dim` values per layer).
    pub kv_bytes_per_token: usize,
    /// The KV groups (`pdserve_kvcache::KvGroups`): what each kind of layer keeps per token. A
    /// Llama-family or DeepSeek V2/V3 model is one group ("full", "window" or "latent").
    pub kv_groups: Vec<pdserve_kvcache::GroupSpec>,
    /// Bytes each request holds outside the blocks (a window's ring, compressors' partial groups): 0
    /// for a one-group model.
    pub kv_state_bytes: usize,
    /// A group whose blocks hold several kinds of rows (DeepSeek V4's compact layout: its compressed
    /// sparse layers' rows "c4" and indexer keys "c4-index", its heavily compressed layers' "c128"):
    /// bytes per token of each, over every layer.
    pub kv_rows: Vec<(String, f64)>,
    /// Where drafts come from: "mtp" (the model's draft layer), "prompt-lookup" or "off".
    pub speculative: &'static str,
    /// Where a request gives no sampling settings: the model's `generation_config.json` over the
    /// engine's defaults.
    pub sampling_defaults: pdserve_model::SamplingParams,
    /// Prompt plus generated tokens never exceed it.
    pub context_tokens: usize,
    pub vocab_size: usize,
    /// Prefill role: where decode workers pull KV from.
    pub transfer_addr: Option<SocketAddr>,
    /// Prefill role with shared KV memory: its file.
    pub kv_shm_path: Option<PathBuf>,
    /// KV over UCX (`EngineConfig::kv_ucx`).
    pub kv_ucx: bool,
    /// Prefill role over UCX: the KV region's export, as handles carry it.
    pub kv_ucx_region: Option<String>,
    /// Where its KV events are published (`--kv-events-config`): `{"endpoint", "connects_to",
    /// "replay_endpoint", "topic", "instance"}` with the ports bound (`tcp://*:PORT` when bound on
    /// every interface), for routers that subscribe; `endpoint` null and `connects_to` the subscriber
    /// when the publisher connects out; `None` without events.
    pub kv_events: Option<serde_json::Value>,
    /// The format the model writes tool calls in (the chat template's, or the configured one).
    pub tool_format: crate::ToolFormat,
    /// The most tool calls one answer makes (`EngineConfig::tool_calls_max`).
    pub tool_calls_max: usize,
    /// How the model marks its thinking (the chat template's, or the configured one).
    pub reasoning_format: crate::ReasoningFormat,
    /// The model's fill-in-the-middle tokens (prefix, suffix, middle), if its vocabulary has them:
    /// completions with a `suffix` are written `{prefix}{prompt}{suffix token}{suffix}{middle}`.
    pub fim: Option<[String; 3]>,
}

/// The fill-in-the-middle token spellings of the model families that have them (StarCoder and the
/// models trained on its format, Qwen2.5-Coder, CodeLlama).
const FIM_TOKENS: [[&str; 3]; 3] = [
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    ["▁<PRE>", "▁<SUF>", "▁<MID>"],
];

/// The first FIM token set `has` knows all three of.
pub(crate) fn fim_tokens(has: impl Fn(&str) -> bool) -> Option<[String; 3]> {
    FIM_TOKENS.iter().find(|set| set.iter().all(|t| has(t))).map(|set| set.map(str::to_owned))
}

#[cfg(test)]
mod tests {
    #[test]
    fn fim_tokens_are_found_by_their_spelling() {
        let qwen = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|im_end|>"];
        let got = super::fim_tokens(|t| qwen.contains(&t)).unwrap();
        assert_eq!(got[1], "<|fim_suffix|>");
        assert!(super::fim_tokens(|t| t == "<fim_prefix>" || t == "<fim_suffix>").is_none());
    }
}
