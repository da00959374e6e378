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

mod compact;
mod layer;
mod paged;
mod weights;

use std::path::Path;

use crate::config::{V4Config, V4Layer};
use layer::{LayerState, Memory};
pub use paged::V4Backend;
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
    /// The draft layer's own state, and how many positions it has run.
    draft: Option<(LayerState, usize)>,
    /// The main model's streams at the positions the draft layer has not run yet.
    pending: Vec<Vec<f32>>,
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
        V4State { layers, tokens: 0, draft: None, pending: Vec::new() }
    }

    /// A new request's empty state that drafts ([`draft`](Self::draft)): the main model's streams
    /// are kept for the draft layer until it runs over them. Errors without a draft layer.
    pub fn new_drafting_state(&self) -> Result<V4State, ModelError> {
        let d = self.w.draft.as_ref().ok_or_else(|| ModelError::format("config.json", "no draft layer"))?;
        Ok(V4State { draft: Some((LayerState::new(&d.layer, &self.cfg), 0)), ..self.new_state() })
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), ModelError> {
        match ids.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            Some(id) => Err(ModelError::format("input", format!("token {id} is past the vocabulary"))),
            None => Ok(()),
        }
    }

    fn ctx(&self, kind: V4Layer, (seq, layer): layer::Place, pos: usize, token: usize) -> layer::Ctx<'_> {
        let rope = if kind == V4Layer::Sliding { &self.rope_main } else { &self.rope_compressed };
        layer::Ctx { c: &self.cfg, rope, seq, layer, pos, token }
    }

    /// Tokens `(request, position, id)` through every main layer over `mem` (layer by layer, every
    /// request's tokens together: see `layer::run`; a request's tokens in position order): each
    /// one's final streams.
    fn run_tokens(&self, mem: &mut dyn Memory, toks: &[(usize, usize, u32)]) -> Vec<Vec<f32>> {
        let n = self.cfg.hc_mult;
        // Every stream starts as the token's embedding.
        let mut streams: Vec<Vec<f32>> = toks
            .iter()
            .map(|&(_, _, id)| {
                let embed = self.w.embed.row(id as usize);
                (0..n).flat_map(|_| embed.iter().copied()).collect()
            })
            .collect();
        for (l, lw) in self.w.layers.iter().enumerate() {
            let ctxs: Vec<_> =
                toks.iter().map(|&(seq, pos, id)| self.ctx(lw.kind, (seq, l), pos, id as usize)).collect();
            streams = layer::run(&ctxs, lw, mem, streams);
        }
        streams
    }

    /// The logits of the final streams a token's pass ended with.
    fn head_logits(&self, streams: &[f32]) -> Vec<f32> {
        self.logits(&self.w.hc_head, &self.w.norm, streams)
    }

    /// Logits from the final streams through a hyper-connection head and a norm.
    fn logits(&self, head: &weights::HyperConnection, norm: &[f32], streams: &[f32]) -> Vec<f32> {
        let (d, n) = (self.cfg.hidden, self.cfg.hc_mult);
        let (pre, _, _) = layer::mix(head, streams, n, d, &self.cfg, 1);
        let y = layer::rms_norm(&layer::combine(&pre, streams, d), Some(norm), self.cfg.eps);
        self.w.head.times(&y)
    }

    /// Rows `(request, position, token)` of the draft layer `dw` (layer `layer` of `mem`), row `j`
    /// given `streams[j]` (the main model's final streams at its position, or the row before's
    /// output): its input streams are the token's normed embedding and each stream normed, each
    /// projected, summed; the layer's output streams of each row.
    fn draft_rows(
        &self,
        dw: &weights::V4Draft,
        mem: &mut dyn Memory,
        layer: usize,
        toks: &[(usize, usize, u32)],
        streams: &[&[f32]],
    ) -> Vec<Vec<f32>> {
        let (d, eps) = (self.cfg.hidden, self.cfg.eps);
        let embeds: Vec<Vec<f32>> = toks
            .iter()
            .map(|&(_, _, t)| layer::rms_norm(&self.w.embed.row(t as usize), Some(&dw.enorm), eps))
            .collect();
        let es = dw.e_proj.times_many(&embeds);
        let normed: Vec<Vec<f32>> = streams
            .iter()
            .flat_map(|s| s.chunks_exact(d))
            .map(|s| layer::rms_norm(s, Some(&dw.hnorm), eps))
            .collect();
        let hs = dw.h_proj.times_many(&normed);
        let n = self.cfg.hc_mult;
        let inputs: Vec<Vec<f32>> = es
            .iter()
            .enumerate()
            .map(|(j, e)| {
                hs[j * n..(j + 1) * n].iter().flat_map(|h| h.iter().zip(e).map(|(h, e)| h + e)).collect()
            })
            .collect();
        let ctxs: Vec<_> = toks
            .iter()
            .map(|&(seq, pos, t)| self.ctx(dw.layer.kind, (seq, layer), pos, t as usize))
            .collect();
        layer::run(&ctxs, &dw.layer, mem, inputs)
    }

    /// The logits of a draft row's output streams (its own head's mixing and norm, the LM head).
    fn draft_logits(&self, dw: &weights::V4Draft, streams: &[f32]) -> Vec<f32> {
        self.logits(&dw.hc_head, &dw.norm, streams)
    }

    /// Bytes of the weights held: projections as shipped (FP8, FP4, bf16 where exact), the rest in
    /// f32.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// The format most of the weights are held in: FP4 where the experts shipped in it (MXFP4, as
    /// V4's do), else FP8 where the dense projections did, else bf16 or f32 as read.
    pub fn weight_format(&self) -> crate::WeightFormat {
        use crate::WeightFormat;
        use weights::Mat;
        let layer = &self.w.layers[0];
        match (&layer.experts[0].w1, &layer.wq_a) {
            (Mat::Fp4(m), _) if m.plain.is_none() => WeightFormat::Fp4,
            (_, Mat::Fp8(_)) => WeightFormat::Fp8,
            (_, Mat::Plain { values: crate::Plain::Bf16(_), .. }) => WeightFormat::Bf16,
            _ => WeightFormat::F32,
        }
    }

    /// Whether the checkpoint has a multi-token prediction layer ([`draft`](Self::draft)).
    pub fn has_draft(&self) -> bool {
        self.w.draft.is_some()
    }

    /// The multi-token prediction layer over the positions [`forward`](Self::forward) ran since the last
    /// call, each given the token after it (`next`, one per position): the logits of its guess after
    /// the last (the token after next), then `guesses - 1` more chained on it (the layer again, a
    /// position on, from its own streams and its last guess; their state is dropped after).
    pub fn draft(
        &self,
        state: &mut V4State,
        next: &[u32],
        guesses: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let dw = self.w.draft.as_ref().ok_or_else(|| ModelError::format("config.json", "no draft layer"))?;
        self.check_ids(next)?;
        if state.draft.is_none() {
            return Err(ModelError::format("input", "a state made without drafting (new_drafting_state)"));
        }
        if next.len() != state.pending.len() || next.is_empty() {
            return Err(ModelError::format(
                "input",
                format!("{} next tokens for {} positions", next.len(), state.pending.len()),
            ));
        }
        let (mut own, pos) = state.draft.take().expect("a draft layer's state");
        let pending = std::mem::take(&mut state.pending);
        let main: Vec<&[f32]> = pending.iter().map(Vec::as_slice).collect();
        let rows: Vec<_> = next.iter().enumerate().map(|(j, &t)| (0, pos + j, t)).collect();
        let mut last = self.draft_rows(dw, &mut own, 0, &rows, &main).pop().expect("rows");
        let pos = pos + next.len();
        let mut out = vec![self.draft_logits(dw, &last)];
        let (mut chained, mut at) = (own.clone(), pos);
        while out.len() < guesses {
            let guess = layer::argmax(out.last().expect("one")) as u32;
            last = self.draft_rows(dw, &mut chained, 0, &[(0, at, guess)], &[&last]).pop().expect("a row");
            at += 1;
            out.push(self.draft_logits(dw, &last));
        }
        state.draft = Some((own, pos));
        Ok(out)
    }

    /// Runs `ids` after the state's tokens; the logits after the last of them.
    pub fn forward(&self, state: &mut V4State, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        // (Every id checked first: a refused call changes nothing.)
        self.check_ids(ids)?;
        let toks: Vec<_> = ids.iter().enumerate().map(|(i, &id)| (0, state.tokens + i, id)).collect();
        let mut all = self.run_tokens(&mut layer::PerLayer(&mut state.layers), &toks);
        state.tokens += ids.len();
        let last = all.pop();
        if state.draft.is_some() {
            state.pending.extend(all);
            state.pending.extend(last.clone());
        }
        let streams = last.ok_or_else(|| ModelError::format("input", "no tokens"))?;
        Ok(self.head_logits(&streams))
    }
}
