//! The GPU backend (feature `cuda`): the whole batch step on the kernels of pdserve-kernels-sm120.
//!
//! Weights and KV are bf16 on the device; the residual stream, GEMM outputs and every reduction are
//! f32. One step: embedding gather, then per layer RMSNorm (fused with the residual add), the fused
//! QKV GEMM, RoPE, the KV write into paged blocks, attention (flash-decoding for one-token steps,
//! causal prefill attention over the paged prefix for longer ones), the output GEMM, RMSNorm, the
//! fused gate/up GEMM, SwiGLU and the down GEMM; then the final norm on the rows that want logits
//! and the LM head. KV memory per layer is `[slot][kv head][head dim]` for K and for V, with
//! `slot = block * block_size + position in block`, so one block of one layer is one contiguous run.

use pdserve_kernels_sm120::launch::{prefill_tiles, PrefillSeq};
use pdserve_kernels_sm120::{CudaSlice, DecodeAttention, DecodeScratch, Gpu, KernelError, PrefillAttention};
use pdserve_kvcache::{BlockCopy, BlockId};

use crate::backend::{check_block, check_steps, Backend, KvDtype, KvLayout, SeqStep};
use crate::bits16::{bf16_bits, bf16_value};
use crate::weights::Weights;
use crate::{ModelConfig, ModelError};

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
}

/// Activations for up to `rows` tokens, reused across steps.
struct StepBuffers {
    rows: usize,
    x: CudaSlice<f32>,
    h: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_bf: CudaSlice<u16>,
    o: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
}

/// Runs a Llama-family model on one NVIDIA GPU.
pub struct GpuBackend {
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
    scratch: DecodeScratch,
    bufs: Option<StepBuffers>,
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

impl GpuBackend {
    /// Uploads `weights` (as bf16) to GPU `ordinal` and allocates KV memory for `num_blocks` blocks of
    /// `block_size` tokens. Models with attention biases are not supported here yet.
    pub fn new(
        cfg: ModelConfig,
        weights: &Weights,
        num_blocks: usize,
        block_size: usize,
        ordinal: usize,
    ) -> Result<GpuBackend, ModelError> {
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
        if cfg.qk_norm {
            return Err(ModelError::Unsupported {
                field: "per-head q/k norms (Qwen3) on the GPU backend".into(),
                value: "true".into(),
            });
        }
        let (inv, rope_attention_factor) = cfg.rope();
        if rope_attention_factor != 1.0 {
            return Err(ModelError::Unsupported {
                field: "rope_scaling attention factor (YaRN) on the GPU backend".into(),
                value: rope_attention_factor.to_string(),
            });
        }
        if cfg.qkv_bias || cfg.o_bias {
            return Err(ModelError::Unsupported {
                field: "attention biases on the GPU backend".into(),
                value: "true".into(),
            });
        }
        if let Some(p) = pdserve_kernels_sm120::launch::attention_shape_problem(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        ) {
            return Err(ModelError::Unsupported {
                field: "attention shape on the GPU backend".into(),
                value: p,
            });
        }
        let gpu = Gpu::new(ordinal).map_err(dev)?;
        let layout = KvLayout::for_model(&cfg, num_blocks, block_size, KvDtype::F32);
        let up = |parts: &[&[f32]]| bf16(&gpu, parts).map_err(dev);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in &weights.layers {
            layers.push(DevLayer {
                input_norm: up(&[&l.input_norm])?,
                qkv: up(&[&l.q, &l.k, &l.v])?,
                o: up(&[&l.o])?,
                post_norm: up(&[&l.post_norm])?,
                gate_up: up(&[&l.gate, &l.up])?,
                down: up(&[&l.down])?,
            });
        }
        let slots = num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim;
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(gpu.zeros::<u16>(slots).map_err(dev)?);
            v.push(gpu.zeros::<u16>(slots).map_err(dev)?);
        }
        Ok(GpuBackend {
            embed: up(&[&weights.embed])?,
            lm_head: weights.lm_head.as_ref().map(|w| up(&[w])).transpose()?,
            final_norm: up(&[&weights.final_norm])?,
            inv_freq: gpu.upload(&inv).map_err(dev)?,
            layers,
            k,
            v,
            gpu,
            cfg,
            layout,
            scratch: DecodeScratch::default(),
            bufs: None,
        })
    }

    /// The device, e.g. for its name.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn buffers(&mut self, rows: usize) -> Result<(), KernelError> {
        if self.bufs.as_ref().is_some_and(|b| b.rows >= rows) {
            return Ok(());
        }
        let n = rows.next_power_of_two().max(16);
        let c = &self.cfg;
        let (h, q, inter) = (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size);
        let qkv = q + 2 * c.num_kv_heads * c.head_dim;
        let g = &self.gpu;
        self.bufs = Some(StepBuffers {
            rows: n,
            x: g.zeros(n * h)?,
            h: g.zeros(n * h)?,
            qkv: g.zeros(n * qkv)?,
            attn: g.zeros(n * q)?,
            attn_bf: g.zeros(n * q)?,
            o: g.zeros(n * h)?,
            gu: g.zeros(n * 2 * inter)?,
            act: g.zeros(n * inter)?,
        });
        Ok(())
    }

    fn run(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, KernelError> {
        let c = self.cfg.clone();
        let (hsz, hd, nq, nkv, inter, vocab) =
            (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size);
        let (q_dim, kv_dim) = (nq * hd, nkv * hd);
        let qkv_w = q_dim + 2 * kv_dim;
        let bs = self.layout.block_size;
        let num_slots = self.layout.num_blocks * bs;

        // Host-side step description.
        let (mut ids, mut pos, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let (mut d_rows, mut d_ctx, mut d_tables) = (Vec::new(), Vec::new(), Vec::<&[BlockId]>::new());
        let (mut p_seqs, mut p_tables) = (Vec::new(), Vec::<&[BlockId]>::new());
        let mut logit_rows = Vec::new();
        let mut row = 0usize;
        for s in steps {
            for (j, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + j;
                ids.push(t);
                pos.push(p as i32);
                slots.push(s.block_table[p / bs].0 as i64 * bs as i64 + (p % bs) as i64);
            }
            let n = s.tokens.len();
            if n == 1 {
                d_rows.push(row as i32);
                d_ctx.push((s.start_pos + 1) as i32);
                d_tables.push(s.block_table);
            } else {
                p_seqs.push(PrefillSeq {
                    seq: p_tables.len(),
                    first_row: row,
                    rows: n,
                    first_pos: s.start_pos,
                });
                p_tables.push(s.block_table);
            }
            logit_rows.extend((row + n - s.logits..row + n).map(|r| r as i32));
            row += n;
        }
        let t = row;
        let flat = |tables: &[&[BlockId]]| -> (Vec<i32>, usize) {
            let stride = tables.iter().map(|b| b.len()).max().unwrap_or(1).max(1);
            let mut out = vec![0i32; tables.len() * stride];
            for (i, tb) in tables.iter().enumerate() {
                for (j, b) in tb.iter().enumerate() {
                    out[i * stride + j] = b.0 as i32;
                }
            }
            (out, stride)
        };
        let (d_bt, d_stride) = flat(&d_tables);
        let (p_bt, p_stride) = flat(&p_tables);
        let tiles = prefill_tiles(&p_seqs, nq / nkv);
        let max_ctx = d_ctx.iter().copied().max().unwrap_or(0) as usize;

        self.buffers(t)?;
        let g = &self.gpu;
        let ids_d = g.upload(&ids)?;
        let pos_d = g.upload(&pos)?;
        let slots_d = g.upload(&slots)?;
        let (d_rows_d, d_ctx_d, d_bt_d) = (g.upload(&d_rows)?, g.upload(&d_ctx)?, g.upload(&d_bt)?);
        let (p_bt_d, tiles_d) = (g.upload(&p_bt)?, g.upload(&tiles)?);
        let b = self.bufs.as_mut().expect("buffers allocated above");
        let eps = c.rms_norm_eps;
        let scale = 1.0 / (hd as f32).sqrt();

        g.embed_gather(&self.embed.as_view(), vocab, hsz, &ids_d.as_view(), &mut b.x.as_view_mut())?;
        for (l, lw) in self.layers.iter().enumerate() {
            let ov = b.o.as_view();
            g.rmsnorm_residual(
                &mut b.x.as_view_mut(),
                (l > 0).then_some(&ov),
                &lw.input_norm.as_view(),
                &mut b.h.as_view_mut(),
                t,
                hsz,
                eps,
            )?;
            g.gemm_bf16(&b.h.as_view(), &lw.qkv.as_view(), &mut b.qkv.as_view_mut(), t, hsz, qkv_w)?;
            g.rope_qk(
                &mut b.qkv.as_view_mut(),
                &pos_d.as_view(),
                &self.inv_freq.as_view(),
                qkv_w,
                nq + nkv,
                hd,
            )?;
            g.kv_write(
                &b.qkv.as_view(),
                qkv_w,
                (q_dim, q_dim + kv_dim, kv_dim),
                &slots_d.as_view(),
                &mut self.k[l].as_view_mut(),
                &mut self.v[l].as_view_mut(),
                num_slots,
            )?;
            let (qv, kc, vc) = (b.qkv.as_view(), self.k[l].as_view(), self.v[l].as_view());
            if !d_rows.is_empty() {
                let (rv, cv, tv) = (d_rows_d.as_view(), d_ctx_d.as_view(), d_bt_d.as_view());
                let a = DecodeAttention {
                    q: &qv,
                    q_row_stride: qkv_w,
                    rows: &rv,
                    k_cache: &kc,
                    v_cache: &vc,
                    block_tables: &tv,
                    bt_stride: d_stride,
                    ctx_lens: &cv,
                    max_ctx,
                    batch: d_rows.len(),
                    q_heads: nq,
                    kv_heads: nkv,
                    head_dim: hd,
                    block_size: bs,
                    num_slots,
                    scale,
                };
                g.decode_attention(&a, &mut self.scratch, &mut b.attn.as_view_mut(), q_dim)?;
            }
            if !p_seqs.is_empty() {
                let (tv, tl) = (p_bt_d.as_view(), tiles_d.as_view());
                let a = PrefillAttention {
                    q: &qv,
                    q_row_stride: qkv_w,
                    k_cache: &kc,
                    v_cache: &vc,
                    block_tables: &tv,
                    bt_stride: p_stride,
                    tiles: &tl,
                    n_tiles: tiles.len() / 4,
                    q_heads: nq,
                    kv_heads: nkv,
                    head_dim: hd,
                    block_size: bs,
                    scale,
                };
                g.prefill_attention(&a, &mut b.attn.as_view_mut(), q_dim)?;
            }
            g.cast_bf16(&b.attn.as_view(), &mut b.attn_bf.as_view_mut(), t * q_dim)?;
            g.gemm_bf16(&b.attn_bf.as_view(), &lw.o.as_view(), &mut b.o.as_view_mut(), t, q_dim, hsz)?;
            let ov = b.o.as_view();
            g.rmsnorm_residual(
                &mut b.x.as_view_mut(),
                Some(&ov),
                &lw.post_norm.as_view(),
                &mut b.h.as_view_mut(),
                t,
                hsz,
                eps,
            )?;
            g.gemm_bf16(&b.h.as_view(), &lw.gate_up.as_view(), &mut b.gu.as_view_mut(), t, hsz, 2 * inter)?;
            g.swiglu(&b.gu.as_view(), &mut b.act.as_view_mut(), t, inter)?;
            g.gemm_bf16(&b.act.as_view(), &lw.down.as_view(), &mut b.o.as_view_mut(), t, inter, hsz)?;
        }
        if logit_rows.is_empty() {
            g.synchronize()?;
            return Ok(Vec::new());
        }
        let ov = b.o.as_view();
        g.rmsnorm_residual(
            &mut b.x.as_view_mut(),
            Some(&ov),
            &self.final_norm.as_view(),
            &mut b.h.as_view_mut(),
            t,
            hsz,
            eps,
        )?;
        let n = logit_rows.len();
        let rows_d = g.upload(&logit_rows)?;
        let mut picked = g.zeros::<u16>(n * hsz)?;
        g.gather_rows_bf16(&b.h.as_view(), t, &rows_d.as_view(), &mut picked.as_view_mut(), hsz)?;
        let mut logits = g.zeros::<f32>(n * vocab)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        g.gemm_bf16(&picked.as_view(), &head.as_view(), &mut logits.as_view_mut(), n, hsz, vocab)?;
        let host = g.download(&logits.as_view())?;
        Ok(host.chunks(vocab).map(<[f32]>::to_vec).collect())
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
        self.run(steps).map_err(dev)
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
