//! The GPU backend (feature `cuda`): the whole batch step on the kernels of pdserve-kernels-sm120.
//!
//! Weights and KV are bf16 on the device; the residual stream, GEMM outputs and every reduction are
//! f32. One step: embedding gather, then per layer RMSNorm (fused with the residual add), the fused
//! QKV GEMM, RoPE, the KV write into paged blocks, attention (flash-decoding for one-token steps,
//! causal prefill attention over the paged prefix for longer ones), the output GEMM, RMSNorm, the
//! fused gate/up GEMM, SwiGLU and the down GEMM; then the final norm on the rows that want logits
//! and the LM head. Attention biases (Qwen2, `attention_bias`) are added after their GEMMs, Qwen3's
//! per-head q/k norms run before RoPE, YaRN's attention factor scales RoPE's cos and sin. Mixtures of
//! experts and sliding windows are refused. Step inputs (token ids, positions, slots, block tables)
//! go into device buffers kept across steps, so a step allocates nothing once they fit; with
//! [`GpuBackend::forward_greedy`] only the picked token ids come back to the host. Decode steps are
//! captured as CUDA graphs per (batch bucket, context bucket) and replayed (`step.rs`). KV memory per
//! layer is `[slot][kv head][head dim]` for K and for V, with
//! `slot = block * block_size + position in block`, so one block of one layer is one contiguous run.

use pdserve_kernels_sm120::{CudaSlice, DecodeScratch, Gpu, KernelError};
use pdserve_kvcache::{BlockCopy, BlockId};

use crate::backend::{check_block, check_steps, Backend, KvDtype, KvLayout, SeqStep};
use crate::bits16::{bf16_bits, bf16_value};
use crate::weights::Weights;
use crate::{ModelConfig, ModelError};

mod step;

pub use step::StepTimes;
use step::{Graphs, Output, StepBuffers, StepInputs, StepOut};

fn dev(e: KernelError) -> ModelError {
    ModelError::Device { problem: e.to_string() }
}

struct DevLayer {
    input_norm: CudaSlice<u16>,
    /// `[q; k; v]` rows: `(q_dim + 2 kv_dim) x hidden`.
    qkv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    post_norm: CudaSlice<u16>,
    /// `[gate; up]` rows: `2 inter x hidden`.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
    /// `[q; k; v]` biases (zeros for a part without one), f32.
    qkv_bias: Option<CudaSlice<f32>>,
    o_bias: Option<CudaSlice<f32>>,
    /// Qwen3's per-head (q, k) RMSNorm weights, f32.
    qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

/// Runs a Llama-family model on one NVIDIA GPU.
pub struct GpuBackend {
    /// First, so the graphs go before the modules and the cuBLAS handle they hold kernels of.
    graphs: Graphs,
    gpu: Gpu,
    cfg: ModelConfig,
    layout: KvLayout,
    embed: CudaSlice<u16>,
    lm_head: Option<CudaSlice<u16>>,
    final_norm: CudaSlice<u16>,
    layers: Vec<DevLayer>,
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    inv_freq: CudaSlice<f32>,
    rope_factor: f32,
    scratch: DecodeScratch,
    bufs: Option<StepBuffers>,
    inputs: StepInputs,
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend").field("gpu", &self.gpu).field("layout", &self.layout).finish()
    }
}

fn bf16(gpu: &Gpu, parts: &[&[f32]]) -> Result<CudaSlice<u16>, KernelError> {
    let v: Vec<u16> = parts.iter().flat_map(|p| p.iter().map(|&x| bf16_bits(x))).collect();
    gpu.upload(&v)
}

/// The model features this backend runs; the rest are refused with a clear error.
fn check_supported(cfg: &ModelConfig) -> Result<(), ModelError> {
    if cfg.mla.is_some() {
        return Err(ModelError::Unsupported {
            field: "latent attention (DeepSeek) on the GPU backend".into(),
            value: "kv_lora_rank set (serve it with --device cpu)".into(),
        });
    }
    if cfg.moe.is_some() || cfg.sliding_window.is_some() {
        return Err(ModelError::Unsupported {
            field: "mixture-of-experts or sliding-window attention on the GPU backend".into(),
            value: format!(
                "experts {:?}, window {:?}",
                cfg.moe.as_ref().map(|m| m.experts),
                cfg.sliding_window
            ),
        });
    }
    if let Some(p) =
        pdserve_kernels_sm120::launch::attention_shape_problem(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    {
        return Err(ModelError::Unsupported { field: "attention shape on the GPU backend".into(), value: p });
    }
    Ok(())
}

/// Scale of the random weights of [`GpuBackend::random`]: uniform in +-0.0346, a standard deviation
/// of 0.02 (Hugging Face's initializer range).
pub const RANDOM_WEIGHT_SCALE: f32 = 0.0346;

impl GpuBackend {
    /// Uploads `weights` (as bf16; biases and q/k norm weights as f32) to GPU `ordinal` and allocates
    /// KV memory for `num_blocks` blocks of `block_size` tokens.
    pub fn new(
        cfg: ModelConfig,
        weights: &Weights,
        num_blocks: usize,
        block_size: usize,
        ordinal: usize,
    ) -> Result<GpuBackend, ModelError> {
        check_supported(&cfg)?;
        let gpu = Gpu::new(ordinal).map_err(dev)?;
        let up = |parts: &[&[f32]]| bf16(&gpu, parts).map_err(dev);
        let up32 = |v: &[f32]| gpu.upload(v).map_err(dev);
        let (q_dim, kv_dim) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in &weights.layers {
            let qkv_bias = if l.q_bias.is_some() || l.k_bias.is_some() || l.v_bias.is_some() {
                let part = |b: &Option<Vec<f32>>, n: usize| b.clone().unwrap_or_else(|| vec![0.0; n]);
                let fused =
                    [part(&l.q_bias, q_dim), part(&l.k_bias, kv_dim), part(&l.v_bias, kv_dim)].concat();
                Some(up32(&fused)?)
            } else {
                None
            };
            let qk_norm = match (&l.q_norm, &l.k_norm) {
                (Some(q), Some(k)) => Some((up32(q)?, up32(k)?)),
                _ => None,
            };
            layers.push(DevLayer {
                input_norm: up(&[&l.input_norm])?,
                qkv: up(&[&l.q, &l.k, &l.v])?,
                o: up(&[&l.o])?,
                post_norm: up(&[&l.post_norm])?,
                gate_up: up(&[&l.gate, &l.up])?,
                down: up(&[&l.down])?,
                qkv_bias,
                o_bias: l.o_bias.as_deref().map(up32).transpose()?,
                qk_norm,
            });
        }
        let embed = up(&[&weights.embed])?;
        let lm_head = weights.lm_head.as_ref().map(|w| up(&[w])).transpose()?;
        let final_norm = up(&[&weights.final_norm])?;
        GpuBackend::assemble(gpu, cfg, (embed, lm_head, final_norm, layers), num_blocks, block_size)
    }

    /// A model of `cfg`'s shape with seeded random bf16 weights made on the device (uniform, see
    /// [`RANDOM_WEIGHT_SCALE`]; norm weights 1, no biases), for measuring real-size shapes without
    /// their checkpoints: nothing of the size of the weights passes through the host.
    pub fn random(
        cfg: ModelConfig,
        seed: u64,
        num_blocks: usize,
        block_size: usize,
        ordinal: usize,
    ) -> Result<GpuBackend, ModelError> {
        check_supported(&cfg)?;
        if cfg.qkv_bias || cfg.o_bias || cfg.qk_norm {
            return Err(ModelError::Unsupported {
                field: "biases or q/k norms in a random-weight GPU model".into(),
                value: "true".into(),
            });
        }
        let gpu = Gpu::new(ordinal).map_err(dev)?;
        let mut next = seed;
        let mut rand = |n: usize| -> Result<CudaSlice<u16>, ModelError> {
            let mut m = gpu.zeros::<u16>(n).map_err(dev)?;
            next = next.wrapping_add(0x632b_e59b_d9b4_e019);
            gpu.fill_random_bf16(&mut m.as_view_mut(), next, RANDOM_WEIGHT_SCALE).map_err(dev)?;
            Ok(m)
        };
        let c = &cfg;
        let (h, q_dim, kv_dim, inter) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        let ones = || gpu.upload(&vec![bf16_bits(1.0); h]).map_err(dev);
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            layers.push(DevLayer {
                input_norm: ones()?,
                qkv: rand((q_dim + 2 * kv_dim) * h)?,
                o: rand(h * q_dim)?,
                post_norm: ones()?,
                gate_up: rand(2 * inter * h)?,
                down: rand(h * inter)?,
                qkv_bias: None,
                o_bias: None,
                qk_norm: None,
            });
        }
        let embed = rand(c.vocab_size * h)?;
        let lm_head = if c.tie_word_embeddings { None } else { Some(rand(c.vocab_size * h)?) };
        let final_norm = ones()?;
        GpuBackend::assemble(gpu, cfg, (embed, lm_head, final_norm, layers), num_blocks, block_size)
    }

    /// The KV memory and the rest of the backend around uploaded weights.
    fn assemble(
        gpu: Gpu,
        cfg: ModelConfig,
        (embed, lm_head, final_norm, layers): (
            CudaSlice<u16>,
            Option<CudaSlice<u16>>,
            CudaSlice<u16>,
            Vec<DevLayer>,
        ),
        num_blocks: usize,
        block_size: usize,
    ) -> Result<GpuBackend, ModelError> {
        let layout = KvLayout::for_model(&cfg, num_blocks, block_size, KvDtype::F32);
        let slots = num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim;
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(gpu.zeros::<u16>(slots).map_err(dev)?);
            v.push(gpu.zeros::<u16>(slots).map_err(dev)?);
        }
        let (inv, rope_factor) = cfg.rope();
        gpu.synchronize().map_err(dev)?;
        Ok(GpuBackend {
            inv_freq: gpu.upload(&inv).map_err(dev)?,
            rope_factor,
            embed,
            lm_head,
            final_norm,
            layers,
            k,
            v,
            gpu,
            cfg,
            layout,
            scratch: DecodeScratch::default(),
            bufs: None,
            inputs: StepInputs::new(),
            graphs: Graphs::new(),
        })
    }

    /// Bytes of device memory the weights take (bf16 matrices, norms, biases).
    pub fn weight_bytes(&self) -> usize {
        let mut n =
            (self.embed.len() + self.final_norm.len() + self.lm_head.as_ref().map_or(0, |w| w.len())) * 2;
        for l in &self.layers {
            n += (l.input_norm.len()
                + l.qkv.len()
                + l.o.len()
                + l.post_norm.len()
                + l.gate_up.len()
                + l.down.len())
                * 2;
            n += (l.qkv_bias.as_ref().map_or(0, |b| b.len()) + l.o_bias.as_ref().map_or(0, |b| b.len())) * 4;
            n += l.qk_norm.as_ref().map_or(0, |(q, k)| q.len() + k.len()) * 4;
        }
        n
    }

    /// The device, e.g. for its name.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Where one block's values sit in each layer's K (and V) cache: (first element, length).
    fn block_range(&self, block: BlockId) -> (usize, usize) {
        let run = self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim;
        (block.0 as usize * run, run)
    }
}

impl Backend for GpuBackend {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        check_steps(&self.cfg, &self.layout, steps)?;
        match self.run(steps, Output::Logits).map_err(dev)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Greedy(_) => unreachable!("asked for logits"),
        }
    }

    /// Picks on the device (argmax and log-sum-exp per row): the logits never leave it.
    fn forward_greedy(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<(u32, f32)>, ModelError> {
        check_steps(&self.cfg, &self.layout, steps)?;
        match self.run(steps, Output::Greedy).map_err(dev)? {
            StepOut::Greedy(picks) => Ok(picks),
            StepOut::Logits(_) => unreachable!("asked for greedy picks"),
        }
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), ModelError> {
        if copies.is_empty() {
            return Ok(());
        }
        // Through a staging buffer: cudarc does not hand out two views of one allocation at once.
        let (_, run) = self.block_range(BlockId(0));
        let mut tmp = self.gpu.zeros::<u16>(run).map_err(dev)?;
        for c in copies {
            check_block(&self.layout, c.src, self.layout.block_bytes())?;
            check_block(&self.layout, c.dst, self.layout.block_bytes())?;
            let (src, _) = self.block_range(c.src);
            let (dst, _) = self.block_range(c.dst);
            for cache in self.k.iter_mut().chain(self.v.iter_mut()) {
                self.gpu.copy(&cache.slice(src..src + run), &mut tmp.as_view_mut()).map_err(dev)?;
                self.gpu.copy(&tmp.as_view(), &mut cache.slice_mut(dst..dst + run)).map_err(dev)?;
            }
        }
        Ok(())
    }

    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), ModelError> {
        check_block(&self.layout, block, out.len())?;
        let (start, run) = self.block_range(block);
        for (l, (k, v)) in self.k.iter().zip(&self.v).enumerate() {
            for (kind, cache) in [k, v].into_iter().enumerate() {
                let host = self.gpu.download(&cache.slice(start..start + run)).map_err(dev)?;
                let dst = &mut out[(l * 2 + kind) * run * 4..][..run * 4];
                for (d, &s) in dst.chunks_exact_mut(4).zip(&host) {
                    d.copy_from_slice(&bf16_value(s).to_le_bytes());
                }
            }
        }
        Ok(())
    }

    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), ModelError> {
        check_block(&self.layout, block, data.len())?;
        let (start, run) = self.block_range(block);
        for l in 0..self.layout.num_layers {
            for kind in 0..2 {
                let src: Vec<u16> = data[(l * 2 + kind) * run * 4..][..run * 4]
                    .chunks_exact(4)
                    .map(|b| bf16_bits(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                    .collect();
                let cache = if kind == 0 { &mut self.k[l] } else { &mut self.v[l] };
                self.gpu.write(&src, &mut cache.slice_mut(start..start + run)).map_err(dev)?;
            }
        }
        self.gpu.synchronize().map_err(dev)
    }
}
