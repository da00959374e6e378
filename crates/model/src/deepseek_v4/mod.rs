//! `DeepseekV4ForCausalLM` on the CPU, one request at a time, following transformers' `deepseek_v4`
//! model: each layer attends to a sliding window of its single K=V head (with per-head attention
//! sinks) and, in compressed layers, to rows pooled from every `ratio` tokens (at 4 from overlapping
//! groups, chosen per query by a lightning indexer; at 128 all of them); a query LoRA, a grouped
//! output LoRA, per-kind rope (plain in window-only layers, YaRN in compressed ones; the output turned
//! back), `hc_mult` residual streams mixed by Sinkhorn-normalised hyper-connections, and a mixture of
//! experts scored by `sqrt(softplus)` (the first layers routed by token id), SwiGLU clamped at
//! `swiglu_limit`.
//!
//! A request's state is what V4 keeps per request: per layer the window's last `sliding_window` rows,
//! each compressor's partial group (and, at ratio 4, the previous group's half it overlaps), and the
//! compressed rows so far (the indexer's keys beside them). Tokens run one at a time through every
//! layer, which is the causal model exactly. Not yet served: the engine's paged KV groups
//! (`pdserve_kvcache::KvGroups`) and the multi-token prediction drafts are the next steps; this is the
//! numerics, checked against an independent numpy reference (`tests/deepseek_v4.rs`).

mod config;
mod layer;
mod weights;

use std::path::Path;

pub use config::{V4Config, V4Layer};
use layer::LayerState;
use weights::V4Weights;

use crate::ModelError;

/// A DeepSeek V4 checkpoint loaded in f32.
#[derive(Debug)]
pub struct DeepseekV4 {
    cfg: V4Config,
    w: V4Weights,
    /// Inverse rope frequencies: window-only layers, compressed layers.
    rope_main: Vec<f32>,
    rope_compressed: Vec<f32>,
}

/// One request's state (see the module documentation).
#[derive(Debug, Clone)]
pub struct V4State {
    layers: Vec<LayerState>,
    /// Tokens run so far (the next one's position).
    pub tokens: usize,
}

impl V4State {
    /// Bytes of the per-request state outside the compressed rows (windows and partial groups), and
    /// of the compressed rows, in f32.
    pub fn bytes(&self) -> (usize, usize) {
        self.layers.iter().fold((0, 0), |(f, r), l| {
            let (lf, lr) = l.bytes();
            (f + lf, r + lr)
        })
    }

    /// Compressed rows layer `l` holds (its indexer's keys not counted).
    pub fn compressed_rows(&self, l: usize) -> usize {
        self.layers[l].rows()
    }
}

impl DeepseekV4 {
    /// `config.json` and the safetensors in `dir`.
    pub fn load(dir: &Path) -> Result<DeepseekV4, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let cfg = V4Config::from_json(&text)?;
        let w = V4Weights::load(dir, &cfg)?;
        let rope_main = cfg.rope(V4Layer::Sliding);
        let rope_compressed = cfg.rope(V4Layer::CompressedSparse);
        Ok(DeepseekV4 { cfg, w, rope_main, rope_compressed })
    }

    pub fn config(&self) -> &V4Config {
        &self.cfg
    }

    /// A new request's empty state.
    pub fn new_state(&self) -> V4State {
        let layers = self.w.layers.iter().map(|l| LayerState::new(l, &self.cfg)).collect();
        V4State { layers, tokens: 0 }
    }

    /// Runs `ids` after the state's tokens; the logits after the last of them.
    pub fn forward(&self, state: &mut V4State, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let (d, n) = (self.cfg.hidden, self.cfg.hc_mult);
        let mut last = None;
        for &id in ids {
            let id = id as usize;
            if id >= self.cfg.vocab {
                return Err(ModelError::format("input", format!("token {id} is past the vocabulary")));
            }
            let t = state.tokens;
            // Every stream starts as the token's embedding.
            let embed = &self.w.embed[id * d..(id + 1) * d];
            let mut streams: Vec<f32> = (0..n).flat_map(|_| embed.iter().copied()).collect();
            for (l, lw) in self.w.layers.iter().enumerate() {
                let rope = if lw.kind == V4Layer::Sliding { &self.rope_main } else { &self.rope_compressed };
                let ctx = layer::Ctx { c: &self.cfg, rope, pos: t, token: id };
                streams = layer::run(&ctx, lw, &mut state.layers[l], &streams);
            }
            state.tokens += 1;
            last = Some(streams);
        }
        let streams = last.ok_or_else(|| ModelError::format("input", "no tokens"))?;
        let (pre, _, _) = layer::mix(&self.w.hc_head, &streams, n, d, &self.cfg, 1);
        let y = layer::combine(&pre, &streams, d);
        let y = layer::rms_norm(&y, Some(&self.w.norm), self.cfg.eps);
        Ok(layer::matvec(&self.w.head, &y, d))
    }
}
