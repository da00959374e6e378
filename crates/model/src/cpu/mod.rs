//! The CPU backend: a batched forward pass over paged KV.
//!
//! KV memory layout: `[block][layer][k|v][position in block][kv head][head dim]`, values of the
//! layout's [`KvDtype`] (f32, or f16/bf16 rounded when stored and widened to f32 a block's rows at a
//! time when read). One block's K and V for every layer are one contiguous run of `block_values()`
//! values, so moving a block (a PD transfer, a copy-on-write copy) is a single memcpy.

use std::sync::Arc;

use pdserve_kvcache::{BlockCopy, BlockId};

use crate::backend::{check_steps, Backend, DraftStep, KvDtype, KvLayout, KvStore, SeqStep};
use crate::bits16::{bf16_bits, bf16_value};
use crate::fp4::Fp4Matrix;
use crate::fp8::Fp8Matrix;
use crate::prepare::{PreparedLayers, PreparedWeights};
use crate::quant::{
    Bf16Layout, Bf16Matrix, Bf16Weights, F16Matrix, Q4Weights, Q8Weights, QuantLayer, QuantMatrix,
    QuantWeights, WeightFormat,
};
use crate::weights::Weights;

mod attention;
mod draft;
mod layer;
mod mla;
mod moe;
mod products;
mod rows;

use crate::{ModelConfig, ModelError};
pub(crate) use attention::KvMemory;
use layer::{keep_rows, kept_rows, step_rows};
use products::{matmul, matmul_bf16, matmul_quant_rows, matvec_int8, matvec_quant, matvec_wide};
use rows::{rms_norm, rms_norm_rows};

/// Runs a model on the CPU with rayon's thread pool.
#[derive(Debug)]
pub struct CpuBackend {
    cfg: ModelConfig,
    w: Arc<Weights>,
    /// The decode path's weights when they are quantized (prefill keeps using `w`).
    decode: Option<DecodeWeights>,
    /// Packed bf16 weights for every step, with `--weights bf16`.
    multi: Option<Arc<Bf16Weights>>,
    /// Whether multi-row steps (prefill, batched decode) read the quantized weights too, widened to
    /// bf16 a block at a time (the CPU has AVX-512 BF16 and every matrix's rows are a multiple of 32).
    quant_multi: bool,
    /// Whether products with quantized weights round their inputs to int8 (`--activations q8`).
    int8_activations: bool,
    scratch: Scratch,
    kv: KvMemory,
    layout: KvLayout,
    inv_freq: Vec<f32>,
    /// What cos and sin are scaled by (YaRN's attention factor; 1 otherwise).
    rope_attention_factor: f32,
    format: WeightFormat,
    /// Where the embedding is read from, in place of the f32 one, once that is freed.
    embed: Option<EmbedRows>,
    /// The LM head in bf16 rows, where the projections are f16, FP8 or FP4 and the head's values are
    /// all bf16 values (a bf16 checkpoint's): the f32 head's products (bits) at half its bytes.
    head_rows: Option<Arc<Bf16Matrix>>,
    /// What the draft pass reads of the last forward pass (with a draft layer).
    last: draft::LastPass,
}

/// Where embedding rows are read from when the f32 embedding is freed.
#[derive(Debug)]
enum EmbedRows {
    /// Its own rows in bf16 (`--weights bf16`, untied).
    Bf16(Vec<u16>),
    /// The tied LM head's bf16 copy (panels or rows).
    HeadPanels,
    /// Its own rows in Q8 (`--weights q8|q4`, untied).
    Q8(crate::quant::Q8Matrix),
    /// The tied LM head's Q8 rows (`--weights q8|q4`).
    HeadQ8,
}

impl CpuBackend {
    /// Allocates f32 KV memory (the reference) for `num_blocks` blocks of `block_size` tokens.
    pub fn new(cfg: ModelConfig, weights: Arc<Weights>, num_blocks: usize, block_size: usize) -> Self {
        CpuBackend::with_kv_dtype(cfg, weights, num_blocks, block_size, KvDtype::F32)
    }

    /// Like [`new`](Self::new), with KV values of `dtype`.
    pub fn with_kv_dtype(
        cfg: ModelConfig,
        weights: Arc<Weights>,
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        let layout = KvLayout::for_model(&cfg, num_blocks, block_size, dtype);
        // Hugging Face computes the inverse frequencies in f32; so do we, to match its numbers.
        let (inv_freq, rope_attention_factor) = cfg.rope();
        CpuBackend {
            kv: KvMemory::heap(layout.block_bytes() * num_blocks),
            cfg,
            w: weights,
            decode: None,
            multi: None,
            quant_multi: false,
            int8_activations: false,
            scratch: Scratch::default(),
            layout,
            inv_freq,
            rope_attention_factor,
            format: WeightFormat::F32,
            embed: None,
            head_rows: None,
            last: draft::LastPass::default(),
        }
    }

    /// Switches every step's projections to `format`: Q8 or Q4 quantize every projection and the LM
    /// head once (widths that are not multiples of 32 are an error), read by the bf16 rows product
    /// where the CPU has AVX-512 BF16 and by the dot tiles elsewhere, whatever a step's row count;
    /// then the f32 projections and embedding are freed (when this backend holds the only reference
    /// to them) and the embedding's rows come from the Q8 LM head (tied) or a Q8 copy. Bf16 packs
    /// every projection once. (`Auto`, unresolved here, is f32.)
    pub fn with_weight_format(self, format: WeightFormat) -> Result<Self, ModelError> {
        let mut p = PreparedWeights::new(format, &self.cfg)?;
        for l in &self.w.layers {
            p.push(l, &self.cfg)?;
        }
        self.with_prepared(p)
    }

    /// [`with_weight_format`](Self::with_weight_format) with every layer converted already (by
    /// `ModelFiles::load_for`, which drops the f32 projections as it goes).
    pub fn with_prepared(self, p: PreparedWeights) -> Result<Self, ModelError> {
        let (format, head) = (p.format, self.w.lm_head());
        let quantized = || ModelError::Unsupported {
            field: "quantized weights".into(),
            value: "an LM head whose width is not a multiple of 32".into(),
        };
        let (mut decode, mut multi) = (None, None);
        match p.layers {
            PreparedLayers::None => {}
            PreparedLayers::Q8(l) => {
                let w = QuantWeights::from_layers(l, head, &self.cfg).ok_or_else(quantized)?;
                decode = Some(DecodeWeights::Q8(Arc::new(w)));
            }
            PreparedLayers::Q4(l) => {
                let w = QuantWeights::from_layers(l, head, &self.cfg).ok_or_else(quantized)?;
                decode = Some(DecodeWeights::Q4(Arc::new(w)));
            }
            PreparedLayers::Bf16(l) => multi = Some(Arc::new(Bf16Weights::from_layers(l, head, &self.cfg))),
            PreparedLayers::F16(l) => decode = Some(DecodeWeights::F16(Arc::new(l))),
            PreparedLayers::Fp8(l) => decode = Some(DecodeWeights::Fp8(Arc::new(l))),
            PreparedLayers::Fp4(l) => decode = Some(DecodeWeights::Fp4(Arc::new(l))),
        }
        // Q4 and Q8 products take the bf16 rows product where the CPU has AVX-512 BF16 and every
        // stacked projection's widths are multiples of 32, else the dot tiles; either way every step
        // reads the quantized matrices, the LM head's too.
        let quantized = matches!(decode, Some(DecodeWeights::Q8(_) | DecodeWeights::Q4(_)));
        let quant_multi = quantized && PreparedWeights::rows_bf16_fits(&self.cfg);
        let mut b = CpuBackend { decode, multi, quant_multi, format, ..self };
        // Every projection product now reads the quantized copies or the bf16 ones: the f32 ones
        // would only hold memory. (A backend sharing its f32 weights with others keeps them.)
        let tied = b.w.lm_head.is_none();
        let head_panels = b.multi.as_ref().is_some_and(|m| m.lm_head.is_some());
        // f16, FP8 and FP4 projections keep the LM head as loaded: in bf16 rows where its values are
        // all bf16 values and the AVX2 kernels read rows (exact: the f32 head's very products), else
        // in f32. (A tied head stays the embedding's.)
        let widened =
            matches!(b.decode, Some(DecodeWeights::F16(_) | DecodeWeights::Fp8(_) | DecodeWeights::Fp4(_)));
        if widened && !tied && crate::sys::avx2() {
            let h = b.w.lm_head();
            if h.iter().all(|&v| bf16_value(bf16_bits(v)).to_bits() == v.to_bits()) {
                let values = h.iter().map(|&v| bf16_bits(v)).collect();
                let (rows, cols) = (b.cfg.vocab_size, b.cfg.hidden_size);
                b.head_rows = Some(Arc::new(Bf16Matrix { rows, cols, values, layout: Bf16Layout::Rows }));
            }
        }
        let frees_head = if b.multi.is_some() { head_panels } else { quantized || b.head_rows.is_some() };
        if b.multi.is_some() || b.decode.is_some() {
            if let Some(w) = Arc::get_mut(&mut b.w) {
                w.release_projections(frees_head);
                // The embedding too: rows are widened as they are looked up (a tied LM head still
                // reads the f32 one where it has no other copy for every step).
                let bf16_rows =
                    |w: &Weights| EmbedRows::Bf16(w.embed.iter().map(|&v| bf16_bits(v)).collect());
                let embed = if head_panels {
                    Some(if tied { EmbedRows::HeadPanels } else { bf16_rows(w) })
                } else if quantized {
                    match tied {
                        true => Some(EmbedRows::HeadQ8),
                        false => <crate::quant::Q8Matrix as QuantMatrix>::quantize(
                            &w.embed,
                            b.cfg.vocab_size,
                            b.cfg.hidden_size,
                        )
                        .map(EmbedRows::Q8),
                    }
                } else if b.decode.is_none() {
                    // bf16 projections with the LM head in f32 (its rows not a multiple of 32).
                    (!tied).then(|| bf16_rows(w))
                } else {
                    // f16 and FP8 keep the LM head, and the embedding, in f32 (its products exact on
                    // the checkpoint's bf16 values: no activation rounded).
                    None
                };
                if embed.is_some() {
                    b.embed = embed;
                    w.embed = Vec::new();
                }
            }
        }
        Ok(b)
    }

    /// Bytes of the weights this backend holds, in every form it reads (f32, quantized, bf16).
    pub fn weight_bytes(&self) -> usize {
        let decode = match &self.decode {
            None => 0,
            Some(DecodeWeights::Q8(q)) => q.bytes(),
            Some(DecodeWeights::Q4(q)) => q.bytes(),
            Some(DecodeWeights::F16(l)) => {
                l.iter().flat_map(QuantLayer::matrices).map(F16Matrix::bytes).sum()
            }
            Some(DecodeWeights::Fp8(l)) => {
                l.iter().flat_map(QuantLayer::matrices).map(Fp8Matrix::bytes).sum()
            }
            Some(DecodeWeights::Fp4(l)) => {
                l.iter().flat_map(QuantLayer::matrices).map(Fp4Matrix::bytes).sum()
            }
        };
        let multi = self.multi.as_ref().map_or(0, |m| m.bytes())
            + self.head_rows.as_ref().map_or(0, |h| 2 * h.values.len());
        let embed = match &self.embed {
            Some(EmbedRows::Bf16(e)) => e.len() * 2,
            Some(EmbedRows::Q8(e)) => e.bytes(),
            _ => 0,
        };
        self.w.bytes() + decode + multi + embed
    }

    /// What every step's projections read, whatever its row count: "bf16", "q8", "q4", "f16", "fp8",
    /// "fp4" or "f32".
    pub fn multi_row_format(&self) -> &'static str {
        if self.decode.is_some() {
            self.format.name()
        } else if self.multi.is_some() {
            "bf16"
        } else {
            "f32"
        }
    }

    /// The format the decode path reads.
    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }

    /// With `on`, products with Q8 or Q4 weights round their input rows to int8 in groups of 32 (a
    /// scale each) and sum integer products (`vpmaddubsw` on AVX2 CPUs), as llama.cpp does with its
    /// quantized weights, in every step (each row's values those of a one-row step). Faster where the
    /// CPU lacks AVX-512 (one row's product 1.5-1.7x), at the cost of rounding the activations: logits
    /// move by up to about 2 on a scale of about ±30, and greedy text may part from the f32 path's at
    /// near-ties. No effect on other formats.
    pub fn with_int8_activations(mut self, on: bool) -> Self {
        self.int8_activations = on;
        self
    }

    /// Whether [`with_int8_activations`](Self::with_int8_activations) is on.
    pub fn int8_activations(&self) -> bool {
        self.int8_activations
    }

    /// Like [`with_kv_dtype`](Self::with_kv_dtype), with the KV memory in `store` (which must hold
    /// `num_blocks` blocks of `dtype` values and be 4-byte aligned; a memory mapping is). Its contents
    /// are the cache's.
    pub fn with_kv_store(
        cfg: ModelConfig,
        weights: Arc<Weights>,
        (num_blocks, block_size): (usize, usize),
        dtype: KvDtype,
        store: Box<dyn KvStore>,
    ) -> Result<Self, ModelError> {
        let mut b = CpuBackend::with_kv_dtype(cfg, weights, 0, block_size, dtype);
        b.layout.num_blocks = num_blocks;
        b.kv = KvMemory::from_store(store, &b.layout)?;
        Ok(b)
    }

    fn kv_at(&self, block: BlockId, layer: usize, kind: usize, pos: usize) -> usize {
        let l = &self.layout;
        (((block.0 as usize * l.num_layers + layer) * l.parts() + kind) * l.block_size + pos)
            * l.num_kv_heads
            * l.head_dim
    }
}

impl Backend for CpuBackend {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn verify_rows_multiple(&self) -> usize {
        match (&self.decode, self.int8_activations) {
            // f32 weights: every row its own dot products.
            (None, _) => 1,
            (Some(_), true) => crate::sys::int8_tile_rows(),
            (Some(_), false) => crate::sys::dot_tile_rows(),
        }
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), ModelError> {
        self.kv.copy_blocks(&self.layout, copies)
    }

    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), ModelError> {
        self.kv.read_block(&self.layout, block, out)
    }

    fn block_bytes(&self, block: BlockId) -> Option<&[u8]> {
        self.kv.block(&self.layout, block)
    }

    fn block_bytes_mut(&mut self, block: BlockId) -> Option<&mut [u8]> {
        self.kv.block_mut(&self.layout, block)
    }

    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), ModelError> {
        self.kv.write_block(&self.layout, block, data)
    }

    fn draft_layers(&self) -> usize {
        usize::from(self.w.draft.is_some())
    }

    fn draft(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.draft_pass(steps)
    }

    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.last.steps.clear();
        check_steps(&self.cfg, &self.layout, steps)?;
        // The step's buffers live from step to step: multi-megabyte allocations freed and made again
        // every layer would cost a page fault per 4 KiB each time.
        let mut sc = std::mem::take(&mut self.scratch);
        // The whole step runs on one of the pool's threads, so each parallel section within it is a
        // work-stealing fork from a running worker rather than a job handed across from this thread
        // (two thread wake-ups per section, a few hundred sections per token).
        let this = &mut *self;
        let out = rayon::scope(|_| this.forward_with(steps, &mut sc));
        self.scratch = sc;
        Ok(out)
    }
}

/// Buffers a step reuses (grown to the largest step seen, never shrunk).
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    /// Each row: Q, K and V of one new token.
    qkv: Vec<f32>,
    /// Each row: cos then sin of the token's position, `head_dim / 2` each.
    rope: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    /// Each row: gate then up.
    gate_up: Vec<f32>,
    act: Vec<f32>,
    xb: Vec<u16>,
}

/// `v` resized to `len` (contents unspecified: callers overwrite every element).
fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    v.resize(len, 0.0);
    &mut v[..len]
}

impl CpuBackend {
    fn mats(&self) -> Mats {
        Mats {
            decode: self.decode.clone(),
            multi: self.multi.clone(),
            quant_multi: self.quant_multi,
            quant_head: self.quant_multi && self.cfg.vocab_size.is_multiple_of(32),
            int8: self.int8_activations,
            head_rows: self.head_rows.clone(),
        }
    }

    /// Appends the embedding rows of `tokens` to `x`.
    fn embed_rows(&self, tokens: impl Iterator<Item = u32>, mats: &Mats, x: &mut Vec<f32>) {
        let hsz = self.cfg.hidden_size;
        for tok in tokens {
            let row = tok as usize;
            let head16 = || mats.multi.as_ref().and_then(|m| m.lm_head.as_ref()).expect("bf16 head");
            match &self.embed {
                Some(EmbedRows::Bf16(e)) => x.extend(e[row * hsz..][..hsz].iter().map(|&b| bf16_value(b))),
                Some(EmbedRows::HeadPanels) => {
                    x.extend((0..hsz).map(|col| bf16_value(head16().at(row, col))))
                }
                Some(EmbedRows::Q8(e)) => x.extend(e.dequantize_row(row)),
                Some(EmbedRows::HeadQ8) => match mats.decode.as_ref().and_then(DecodeWeights::head) {
                    Some(QRef::Q8(h)) => x.extend(h.dequantize_row(row)),
                    _ => unreachable!("a tied Q8 embedding without a Q8 head"),
                },
                None => x.extend_from_slice(&self.w.embed[row * hsz..][..hsz]),
            }
        }
    }

    /// The rotary angles of each row's position (cos then sin, `head_dim / 2` each), once for every
    /// layer.
    fn rope_table(&self, rows: &[(usize, usize)], rope: &mut Vec<f32>) {
        let hd = self.cfg.head_dim;
        let half = hd / 2;
        let rope = sized(rope, rows.len() * hd);
        for (r, &(_, pos)) in rows.iter().enumerate() {
            for i in 0..half {
                let (sin, cos) = (pos as f32 * self.inv_freq[i]).sin_cos();
                rope[r * hd + i] = cos * self.rope_attention_factor;
                rope[r * hd + half + i] = sin * self.rope_attention_factor;
            }
        }
    }

    /// The logits of hidden rows `x` (already normed): the LM head's product.
    fn head_logits(&self, x: &[f32], mats: &Mats, xb: &mut Vec<u16>) -> Vec<Vec<f32>> {
        let (hsz, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let n = x.len() / hsz.max(1);
        if n == 0 {
            return Vec::new();
        }
        let mut logits = vec![0.0; n * vocab];
        if !mats.head(x, n, hsz, xb, &mut logits) {
            logits = matmul(x, n, hsz, self.w.lm_head(), vocab);
        }
        logits.chunks(vocab.max(1)).map(<[f32]>::to_vec).collect()
    }

    fn forward_with(&mut self, steps: &[SeqStep<'_>], sc: &mut Scratch) -> Vec<Vec<f32>> {
        let mats = self.mats();
        let hsz = self.cfg.hidden_size;
        let rows = step_rows(steps);
        let kept = kept_rows(steps);
        sc.x.clear();
        self.embed_rows(steps.iter().flat_map(|s| s.tokens.iter().copied()), &mats, &mut sc.x);
        self.rope_table(&rows, &mut sc.rope);
        // With a draft layer, every row's final hidden state is kept for the draft pass that follows.
        self.last.steps.clear();
        let drafting = self.w.draft.is_some();
        let main = self.cfg.num_layers;
        for li in 0..main {
            let cut = (li + 1 == main && !drafting).then_some(kept.as_slice());
            if !self.layer(li, steps, &rows, cut, &mats, sc) {
                break;
            }
        }
        let w = Arc::clone(&self.w);
        if drafting {
            let normed = sized(&mut self.last.hidden, rows.len() * hsz);
            rms_norm_rows(&sc.x, &w.final_norm, self.cfg.rms_norm_eps, normed);
            self.last.steps = steps.iter().map(|s| (s.start_pos, s.tokens.len())).collect();
            sc.h.clear();
            for &r in &kept {
                sc.h.extend_from_slice(&self.last.hidden[r * hsz..][..hsz]);
            }
            let h = std::mem::take(&mut sc.h);
            let logits = self.head_logits(&h, &mats, &mut sc.xb);
            sc.h = h;
            return logits;
        }
        // Logits only for the last rows of the steps that want them: the rows the last layer kept
        // (all of a step's rows still, in a model without layers).
        if sc.x.len() > kept.len() * hsz {
            keep_rows(&kept, hsz, &mut sc.x);
        }
        if kept.is_empty() {
            return Vec::new();
        }
        let picked = &sc.x[..kept.len() * hsz];
        let mut normed = vec![0.0; picked.len()];
        rms_norm(picked, &w.final_norm, self.cfg.rms_norm_eps, &mut normed);
        self.head_logits(&normed, &mats, &mut sc.xb)
    }
}

/// Quantized decode weights, shared by every step.
#[derive(Debug, Clone)]
enum DecodeWeights {
    Q8(Arc<Q8Weights>),
    Q4(Arc<Q4Weights>),
    /// The projections only: the LM head stays f32.
    F16(Arc<Vec<QuantLayer<F16Matrix>>>),
    /// The projections only: the LM head stays f32.
    Fp8(Arc<Vec<QuantLayer<Fp8Matrix>>>),
    /// The projections only: the LM head stays f32.
    Fp4(Arc<Vec<QuantLayer<Fp4Matrix>>>),
}

/// One quantized matrix of either format.
#[derive(Debug, Clone, Copy)]
enum QRef<'a> {
    Q8(&'a crate::quant::Q8Matrix),
    Q4(&'a crate::quant::Q4Matrix),
    F16(&'a F16Matrix),
    Fp8(&'a Fp8Matrix),
    Fp4(&'a Fp4Matrix),
}

/// A layer's projection.
#[derive(Debug, Clone, Copy)]
enum Proj {
    Qkv,
    O,
    GateUp,
    Down,
    /// Expert `e`'s gate and up, and its down.
    ExpertGateUp(usize),
    ExpertDown(usize),
    /// The shared experts'.
    SharedGateUp,
    SharedDown,
    /// Latent attention's query LoRA, query, latent, and head `h`'s absorbed key and value.
    QA,
    QB,
    KvA,
    KUp(usize),
    VUp(usize),
}

fn matvec_ref(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) {
    if matvec_wide(x, t, k, m, out) {
        return;
    }
    match m {
        QRef::Q8(m) => matvec_quant(x, t, k, m, out),
        QRef::Q4(m) => matvec_quant(x, t, k, m, out),
        QRef::F16(m) => matvec_quant(x, t, k, m, out),
        QRef::Fp8(m) => matvec_quant(x, t, k, m, out),
        QRef::Fp4(m) => matvec_quant(x, t, k, m, out),
    }
}

/// The weights other than the loaded f32 ones that a step may read, and how each product reads
/// them. Every product computes each row the same way whatever the step's row count (batch
/// invariance: a row's values never depend on what else its step holds): Q4 and Q8 through the bf16
/// rows product where the CPU has AVX-512 BF16 (`matmul_quant_rows`), else through the dot tiles
/// (`matvec_quant`, every row's value that of a one-row step), as are f16 weights, where long steps
/// on the AVX2 arithmetic take `sys::gemm_rows_f32`'s widened tiles instead (`matvec_wide`, the same
/// bits); bf16 weights through the bf16 GEMM's panels where the CPU has AVX-512 BF16, else row-major
/// through the dot kernel and `gemm_rows_f32`'s tiles (`matmul_bf16`); int8 activations through the
/// int8 tiles; f32 weights
/// through `gemm_rows_f32`'s tiles (`matmul`: `sys::dot`'s bits).
pub(super) struct Mats {
    decode: Option<DecodeWeights>,
    multi: Option<Arc<Bf16Weights>>,
    /// The projections' shapes suit the bf16 rows product (every width a multiple of 32).
    quant_multi: bool,
    /// ... and the LM head's.
    quant_head: bool,
    /// Products with quantized weights round their inputs to int8 (`--activations q8`).
    int8: bool,
    /// The LM head in bf16 rows (see `CpuBackend::head_rows`).
    head_rows: Option<Arc<Bf16Matrix>>,
}

impl Mats {
    /// `out = x[t×k] · W^T` for layer `li`'s projection `p` (Q/K/V and gate/up stacked) from
    /// quantized or bf16 weights (`xb`: room for x in bf16). False, touching nothing, where the step
    /// reads the f32 weights instead.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        li: usize,
        p: Proj,
        x: &[f32],
        t: usize,
        k: usize,
        xb: &mut Vec<u16>,
        out: &mut [f32],
    ) -> bool {
        if let Some(d) = self.decode.as_ref().filter(|_| self.int8) {
            if matvec_int8(x, t, k, d.layer(li, p), out) {
                return true;
            }
        }
        match (&self.decode, &self.multi) {
            (Some(d), _) => self.quantized(x, t, k, d.layer(li, p), self.quant_multi, xb, out),
            (None, Some(b)) => matmul_bf16(x, t, k, p.of(&b.layers[li]), xb, out),
            (None, None) => return false,
        }
        true
    }

    /// `out = x[t×k] · W^T` for layer `li`'s projection `p` in the served format, or with `f32`
    /// (its `[n, k]` f32 matrix) where the step reads the f32 weights.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        (li, p): (usize, Proj),
        f32: &[f32],
        x: &[f32],
        (t, k, n): (usize, usize, usize),
        xb: &mut Vec<u16>,
        out: &mut [f32],
    ) {
        if !self.layer(li, p, x, t, k, xb, &mut out[..t * n]) {
            out[..t * n].copy_from_slice(&matmul(x, t, k, f32, n));
        }
    }

    /// A product with quantized weights: the bf16 rows product for Q4 and Q8 where the CPU has
    /// AVX-512 BF16 and `rows_bf16` (the widths suit it), else the dot tiles.
    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &self,
        x: &[f32],
        t: usize,
        k: usize,
        m: QRef<'_>,
        rows_bf16: bool,
        xb: &mut Vec<u16>,
        out: &mut [f32],
    ) {
        match m {
            QRef::Q4(_) | QRef::Q8(_) if rows_bf16 && crate::sys::has_rows_bf16() => {
                matmul_quant_rows(x, t, k, m, xb, out)
            }
            _ => matvec_ref(x, t, k, m, out),
        }
    }

    /// The LM head's product, likewise.
    fn head(&self, x: &[f32], t: usize, k: usize, xb: &mut Vec<u16>, out: &mut [f32]) -> bool {
        if let Some(h) = self.decode.as_ref().and_then(DecodeWeights::head).filter(|_| self.int8) {
            if matvec_int8(x, t, k, h, out) {
                return true;
            }
        }
        match (
            self.decode.as_ref().and_then(DecodeWeights::head),
            self.multi.as_ref().and_then(|b| b.lm_head.as_ref()),
        ) {
            (Some(h), _) => self.quantized(x, t, k, h, self.quant_head, xb, out),
            (None, Some(h)) => matmul_bf16(x, t, k, h, xb, out),
            (None, None) => match &self.head_rows {
                Some(h) => matmul_bf16(x, t, k, h, xb, out),
                None => return false,
            },
        }
        true
    }
}

impl Proj {
    fn of<M>(self, l: &QuantLayer<M>) -> &M {
        let shared = || l.shared.as_ref().expect("a layer with shared experts");
        let mla = || l.mla.as_ref().expect("a latent-attention layer");
        match self {
            Proj::Qkv => &l.qkv,
            Proj::O => &l.o,
            Proj::GateUp => &l.gate_up,
            Proj::Down => &l.down,
            Proj::ExpertGateUp(e) => &l.experts[e].gate_up,
            Proj::ExpertDown(e) => &l.experts[e].down,
            Proj::SharedGateUp => &shared().gate_up,
            Proj::SharedDown => &shared().down,
            Proj::QA => mla().q_a.as_ref().expect("a query LoRA"),
            Proj::QB => &mla().q_b,
            Proj::KvA => &mla().kv_a,
            Proj::KUp(h) => &mla().k_up_t[h],
            Proj::VUp(h) => &mla().v_up[h],
        }
    }
}

impl DecodeWeights {
    fn layer(&self, li: usize, p: Proj) -> QRef<'_> {
        match self {
            DecodeWeights::Q8(w) => QRef::Q8(p.of(&w.layers[li])),
            DecodeWeights::Q4(w) => QRef::Q4(p.of(&w.layers[li])),
            DecodeWeights::F16(w) => QRef::F16(p.of(&w[li])),
            DecodeWeights::Fp8(w) => QRef::Fp8(p.of(&w[li])),
            DecodeWeights::Fp4(w) => QRef::Fp4(p.of(&w[li])),
        }
    }

    /// The quantized LM head; `None` where it stays f32.
    fn head(&self) -> Option<QRef<'_>> {
        match self {
            DecodeWeights::Q8(w) => Some(QRef::Q8(&w.lm_head)),
            DecodeWeights::Q4(w) => Some(QRef::Q8(&w.lm_head)),
            DecodeWeights::F16(_) | DecodeWeights::Fp8(_) | DecodeWeights::Fp4(_) => None,
        }
    }
}

#[cfg(test)]
mod invariance_tests;
