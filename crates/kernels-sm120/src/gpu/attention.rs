//! The attention kernels' wrappers: paged decode attention (flash-decoding, tensor-core and CUDA-core
//! kernels, split plans) and causal prefill attention over a paged prefix.
#![allow(clippy::too_many_arguments)]

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{check_len, decode_kernel, fits_i32, rows_cfg, Gpu};
use crate::launch::{self, DecodePlan};
use crate::{sys, KernelError};

/// Inputs of [`Gpu::decode_attention`]: one query row per sequence.
#[derive(Debug)]
pub struct DecodeAttention<'a> {
    /// Query rows (the Q heads at the start of each row, f32).
    pub q: &'a CudaView<'a, f32>,
    pub q_row_stride: usize,
    /// Row of `q` (and of `out`) for each sequence.
    pub rows: &'a CudaView<'a, i32>,
    /// One layer's K and V cache, `[slot][kv head][head dim]` bf16.
    pub k_cache: &'a CudaView<'a, u16>,
    pub v_cache: &'a CudaView<'a, u16>,
    /// `batch x bt_stride` block ids.
    pub block_tables: &'a CudaView<'a, i32>,
    pub bt_stride: usize,
    /// Context length (positions 0..len attended) per sequence.
    pub ctx_lens: &'a CudaView<'a, i32>,
    /// The longest context in `ctx_lens` (sizes the split).
    pub max_ctx: usize,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Slots the cache holds (bounds-checks the block tables' reach).
    pub num_slots: usize,
    pub scale: f32,
}

/// Which decode attention kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `decode_attn_tc_d*`: QK and PV on the tensor cores (Q and P rounded to bf16), up to 16 query
    /// heads per KV head, 64-token tiles; block sizes must be powers of two. The default.
    TensorCore,
    /// `decode_attn_d*_g*`: CUDA cores, f32 throughout, up to 8 query heads per KV head.
    CudaCore,
}

/// How [`Gpu::decode_attention_with`] runs: which kernel, and optionally a fixed split count instead of
/// the one [`launch::decode_splits`] derives (for measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    pub kernel: DecodeKernel,
    pub splits: Option<usize>,
}

impl DecodeOptions {
    pub fn kernel(kernel: DecodeKernel) -> DecodeOptions {
        DecodeOptions { kernel, splits: None }
    }
}

/// Partial results of decode attention, grown as needed and reused across calls.
#[derive(Debug, Default)]
pub struct DecodeScratch {
    out: Option<CudaSlice<f32>>,
    ml: Option<CudaSlice<f32>>,
}

impl DecodeScratch {
    /// Values held (partial outputs, partial max/sum): a caller that captured launches using this
    /// scratch knows its graphs are stale when this grows.
    pub fn capacity(&self) -> (usize, usize) {
        (self.out.as_ref().map_or(0, |b| b.len()), self.ml.as_ref().map_or(0, |b| b.len()))
    }
}

/// Inputs of [`Gpu::prefill_attention`].
#[derive(Debug)]
pub struct PrefillAttention<'a> {
    pub q: &'a CudaView<'a, f32>,
    pub q_row_stride: usize,
    pub k_cache: &'a CudaView<'a, u16>,
    pub v_cache: &'a CudaView<'a, u16>,
    pub block_tables: &'a CudaView<'a, i32>,
    pub bt_stride: usize,
    /// From [`launch::prefill_tiles`], on the device.
    pub tiles: &'a CudaView<'a, i32>,
    pub n_tiles: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
}

impl Gpu {
    /// The split plan [`decode_attention`](Self::decode_attention) will use on this device.
    pub fn decode_plan(
        &self,
        kind: DecodeKernel,
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        max_ctx: usize,
    ) -> DecodePlan {
        let group = q_heads / kv_heads.max(1);
        let per_sm = self.decode_occupancy.get(&decode_kernel(kind, head_dim, group)).copied().unwrap_or(1);
        launch::decode_plan(batch, kv_heads, group, head_dim, max_ctx, per_sm * self.sms)
    }

    /// Paged decode attention with the kernel that measured faster for the step's size: the CUDA-core
    /// kernel for steps reading little KV ([`launch::cuda_core_decode_pays`]) and for block sizes
    /// that are not powers of two, the tensor-core kernel otherwise.
    pub fn decode_attention(
        &self,
        a: &DecodeAttention<'_>,
        scratch: &mut DecodeScratch,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<DecodePlan, KernelError> {
        let group = a.q_heads / a.kv_heads.max(1);
        let small = launch::cuda_core_decode_pays(a.batch, a.max_ctx, a.kv_heads, a.head_dim, group);
        let kind = if a.block_size.is_power_of_two() && !small {
            DecodeKernel::TensorCore
        } else {
            DecodeKernel::CudaCore
        };
        self.decode_attention_with(DecodeOptions::kernel(kind), a, scratch, out, out_row_stride)
    }

    /// Paged decode attention (flash-decoding): `out[rows[b]]` (the Q-head part, `q_heads * head_dim`
    /// values at the start of the row, `out_row_stride` apart) for each sequence. Returns the plan used.
    pub fn decode_attention_with(
        &self,
        opts: DecodeOptions,
        a: &DecodeAttention<'_>,
        scratch: &mut DecodeScratch,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<DecodePlan, KernelError> {
        if let Some(p) = launch::attention_shape_problem(a.q_heads, a.kv_heads, a.head_dim) {
            return Err(KernelError::shape(p));
        }
        let kind = opts.kernel;
        let group = a.q_heads / a.kv_heads;
        if kind != DecodeKernel::CudaCore && !a.block_size.is_power_of_two() {
            return Err(KernelError::shape("the tensor-core kernels need a power-of-two block size"));
        }
        if kind == DecodeKernel::CudaCore && group > launch::DECODE_MAX_GROUP {
            return Err(KernelError::shape(format!(
                "the CUDA-core kernel takes at most {} query heads per KV head",
                launch::DECODE_MAX_GROUP
            )));
        }
        if a.batch == 0 {
            return Ok(self.decode_plan(kind, 0, a.q_heads, a.kv_heads, a.head_dim, 0));
        }
        if a.max_ctx == 0 || a.max_ctx > a.bt_stride * a.block_size {
            return Err(KernelError::shape(format!(
                "max context {} with block tables of {} x {} slots",
                a.max_ctx, a.bt_stride, a.block_size
            )));
        }
        let kv_dim = a.kv_heads * a.head_dim;
        check_len("rows", a.rows.len(), a.batch)?;
        check_len("ctx_lens", a.ctx_lens.len(), a.batch)?;
        check_len("block tables", a.block_tables.len(), a.batch * a.bt_stride)?;
        check_len("K cache", a.k_cache.len(), a.num_slots * kv_dim)?;
        check_len("V cache", a.v_cache.len(), a.num_slots * kv_dim)?;
        if a.q_row_stride < a.q_heads * a.head_dim || out_row_stride < a.q_heads * a.head_dim {
            return Err(KernelError::shape("row stride shorter than the query heads"));
        }
        let plan = match opts.splits {
            Some(n) => launch::decode_plan_with_splits(a.batch, a.kv_heads, group, a.head_dim, n),
            None => self.decode_plan(kind, a.batch, a.q_heads, a.kv_heads, a.head_dim, a.max_ctx),
        };
        for (buf, need) in [(&mut scratch.out, plan.partial_out), (&mut scratch.ml, plan.partial_ml)] {
            if buf.as_ref().is_none_or(|b| b.len() < need) {
                *buf = Some(self.zeros::<f32>(need)?);
            }
        }
        let (part_o, part_ml) = (scratch.out.as_mut().unwrap(), scratch.ml.as_mut().unwrap());
        let (qs, bts, nkv, bs) = (
            fits_i32("q_row_stride", a.q_row_stride)?,
            fits_i32("bt_stride", a.bt_stride)?,
            a.kv_heads as i32,
            fits_i32("block_size", a.block_size)?,
        );
        let splits = plan.splits as i32;
        let name = decode_kernel(kind, a.head_dim, group);
        let group_i = group as i32;
        let mut b = self.stream.launch_builder(self.func(&name));
        b.arg(a.q).arg(&qs).arg(a.rows).arg(a.k_cache).arg(a.v_cache).arg(a.block_tables).arg(&bts);
        b.arg(a.ctx_lens).arg(&nkv);
        let shift = a.block_size.trailing_zeros() as i32;
        if kind == DecodeKernel::CudaCore {
            b.arg(&bs);
        } else {
            b.arg(&group_i).arg(&shift);
        }
        b.arg(&a.scale).arg(&splits);
        b.arg(&mut *part_o).arg(&mut *part_ml);
        let shared_mem_bytes = match kind {
            DecodeKernel::TensorCore => launch::decode_tc_dynamic_smem_bytes(a.head_dim) as u32,
            DecodeKernel::CudaCore => 0,
        };
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (plan.grid_x, plan.splits as u32, 1),
                block_dim: (launch::DECODE_THREADS, 1, 1),
                shared_mem_bytes,
            },
        )?;
        let (nq, hd, ors) =
            (a.q_heads as i32, a.head_dim as i32, fits_i32("out_row_stride", out_row_stride)?);
        let mut r = self.stream.launch_builder(self.func("decode_attn_reduce"));
        r.arg(&*part_o).arg(&*part_ml).arg(a.rows).arg(out).arg(&ors).arg(&nq).arg(&hd).arg(&splits);
        sys::launch(r, rows_cfg(a.batch * a.q_heads, a.head_dim as u32)?)?;
        Ok(plan)
    }

    /// Causal prefill attention over paged KV on the tensor cores, for the tiles of
    /// [`launch::prefill_tiles`].
    pub fn prefill_attention(
        &self,
        a: &PrefillAttention<'_>,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<(), KernelError> {
        self.prefill_attention_with(launch::PrefillKernel::TensorCore, a, out, out_row_stride)
    }

    /// [`prefill_attention`](Self::prefill_attention) with a chosen kernel; `a.tiles` from
    /// [`launch::prefill_tiles_for`] with the same kernel.
    pub fn prefill_attention_with(
        &self,
        kernel: launch::PrefillKernel,
        a: &PrefillAttention<'_>,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<(), KernelError> {
        if let Some(p) = launch::attention_shape_problem(a.q_heads, a.kv_heads, a.head_dim) {
            return Err(KernelError::shape(p));
        }
        if a.n_tiles == 0 {
            return Ok(());
        }
        check_len("tiles", a.tiles.len(), a.n_tiles * 4)?;
        if a.q_row_stride < a.q_heads * a.head_dim || out_row_stride < a.q_heads * a.head_dim {
            return Err(KernelError::shape("row stride shorter than the query heads"));
        }
        let group = (a.q_heads / a.kv_heads) as i32;
        let (qs, bts, nkv, bs, ors) = (
            fits_i32("q_row_stride", a.q_row_stride)?,
            fits_i32("bt_stride", a.bt_stride)?,
            a.kv_heads as i32,
            fits_i32("block_size", a.block_size)?,
            fits_i32("out_row_stride", out_row_stride)?,
        );
        let name = match (kernel, a.head_dim) {
            (launch::PrefillKernel::TensorCore, 64) => "prefill_attn_tc_d64",
            (launch::PrefillKernel::TensorCore, _) => "prefill_attn_tc_d128",
            (launch::PrefillKernel::CudaCore, 64) => "prefill_attn_d64",
            (launch::PrefillKernel::CudaCore, _) => "prefill_attn_d128",
        };
        let threads = match kernel {
            launch::PrefillKernel::TensorCore => launch::PREFILL_TC_THREADS,
            launch::PrefillKernel::CudaCore => launch::PREFILL_THREADS,
        };
        let mut b = self.stream.launch_builder(self.func(name));
        b.arg(a.q).arg(&qs).arg(a.k_cache).arg(a.v_cache).arg(a.block_tables).arg(&bts).arg(a.tiles);
        b.arg(&nkv).arg(&group).arg(&bs).arg(&a.scale).arg(out).arg(&ors);
        let tiles = u32::try_from(a.n_tiles).map_err(|_| KernelError::shape("too many tiles"))?;
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (tiles, a.kv_heads as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }
}
