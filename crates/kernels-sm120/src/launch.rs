//! Launch configuration: grid sizes, split counts and shared-memory budgets. Pure Rust, tested on the
//! CPU; the constants mirror the `#define`s of the CUDA sources (the check-kernels run compares the
//! shared-memory figures below with what ptxas reports).

/// Threads per block of the decode attention kernels (`DA_THREADS`).
pub const DECODE_THREADS: u32 = 128;
/// Tokens each lane group of decode attention takes per pipeline step (`DA_TB`).
pub const DECODE_TOKENS_PER_STEP: usize = 2;
/// Pipeline steps of decode attention in flight (`DA_STAGES`).
pub const DECODE_STAGES: usize = 5;
/// Most query heads per KV head of the CUDA-core decode kernels (`_g1` .. `_g8`).
pub const DECODE_MAX_GROUP: usize = 8;
/// Most query heads per KV head of the tensor-core decode kernel (one m16 tile of rows).
pub const DECODE_TC_MAX_GROUP: usize = 16;
/// Tokens per shared-memory tile of the tensor-core decode kernel (16 per warp).
pub const DECODE_TC_TILE: usize = 64;
/// Threads per block of prefill attention (`PA_THREADS`).
pub const PREFILL_THREADS: u32 = 128;
/// Keys per shared-memory tile of prefill attention (`PA_KT`).
pub const PREFILL_KEY_TILE: usize = 32;
/// Query vectors (rows x group) per block of the CUDA-core prefill attention (`PA_MAXP`).
pub const PREFILL_MAX_PAIRS: usize = 16;
/// Threads per block of the tensor-core prefill attention (`PT_THREADS`).
pub const PREFILL_TC_THREADS: u32 = 128;
/// Query vectors per block of the tensor-core prefill attention (`PT_PAIRS`: 16 per warp).
pub const PREFILL_TC_PAIRS: usize = 64;
/// Keys per shared-memory tile of the tensor-core prefill attention (`PT_KT`).
pub const PREFILL_TC_KEY_TILE: usize = 64;

/// Which prefill attention kernel: tensor cores (the default) or CUDA cores (kept for comparison).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    TensorCore,
    CudaCore,
}

impl PrefillKernel {
    /// Query vectors one block takes.
    pub fn pairs(self) -> usize {
        match self {
            PrefillKernel::TensorCore => PREFILL_TC_PAIRS,
            PrefillKernel::CudaCore => PREFILL_MAX_PAIRS,
        }
    }
}
/// Threads per block of the sampling kernels (`SAMPLE_THREADS`).
pub const SAMPLE_THREADS: u32 = 1024;
/// Most rows the skinny product (`gemv_bf16`) takes; `GEMV_MAX_ROWS` in gemv.cu.
pub const GEMV_MAX_ROWS: usize = 8;
/// Largest weight matrix (values) the skinny product takes inside `gemm_bf16`: on an H200 it beat
/// cuBLAS on the default model's layer matrices (0.6-3.5 M values: 4-6 us against 8 us) and lost on
/// larger ones (cuBLAS reads 17-117 M-value matrices at 0.67-1.0 of the copy rate, the skinny kernel
/// at 0.38-0.62).
pub const GEMV_MAX_WEIGHTS: usize = 1 << 22;
/// Warps per block of `gemv_bf16` (one output column each); `GEMV_WARPS` in gemv.cu.
pub const GEMV_WARPS: u32 = 8;
/// Threads per block of the row-wise kernels (norm, rope, gathers, KV write).
pub const ROW_THREADS: u32 = 256;
/// Head sizes the attention kernels are instantiated for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// A split of decode attention covers at least this many tokens (shorter ones cost more in the
/// reduction than they gain in parallelism).
pub const MIN_SPLIT_TOKENS: usize = 256;
/// Upper bound on splits per sequence (bounds the partial-result scratch).
pub const MAX_SPLITS: usize = 1024;
/// Longest context the kernels are checked at.
pub const MAX_CONTEXT: usize = 131_072;
/// Static shared memory a block may use without opting in to more.
pub const STATIC_SMEM_LIMIT: usize = 48 * 1024;

/// How decode attention is laid out for one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    /// Splits per sequence (grid y).
    pub splits: usize,
    /// Blocks in grid x: sequences x KV heads.
    pub grid_x: u32,
    /// f32 values of partial output scratch: batch x q heads x splits x head_dim.
    pub partial_out: usize,
    /// f32 values of partial max/sum scratch: batch x q heads x splits x 2.
    pub partial_ml: usize,
}

/// Full waves of resident blocks decode attention aims for when it splits a context: with blocks of
/// equal length, whole waves leave no SM idle at the end.
pub const DECODE_WAVES: usize = 2;

/// Splits per sequence for decode attention, given how many of its blocks the device holds at once
/// (`resident_blocks` = blocks per SM x SMs): at most [`DECODE_WAVES`] full waves, no split shorter
/// than [`MIN_SPLIT_TOKENS`] (except a single one), at most [`MAX_SPLITS`].
pub fn decode_splits(batch: usize, kv_heads: usize, max_ctx: usize, resident_blocks: usize) -> usize {
    let blocks = (batch * kv_heads).max(1);
    let want = DECODE_WAVES * resident_blocks.max(1) / blocks;
    let by_len = max_ctx.div_ceil(MIN_SPLIT_TOKENS).max(1);
    want.min(by_len).clamp(1, MAX_SPLITS)
}

/// The whole decode-attention plan.
pub fn decode_plan(
    batch: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    max_ctx: usize,
    resident_blocks: usize,
) -> DecodePlan {
    decode_plan_with_splits(
        batch,
        kv_heads,
        group,
        head_dim,
        decode_splits(batch, kv_heads, max_ctx, resident_blocks),
    )
}

/// The decode-attention plan for a given split count (clamped to 1..=[`MAX_SPLITS`]).
pub fn decode_plan_with_splits(
    batch: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    splits: usize,
) -> DecodePlan {
    let splits = splits.clamp(1, MAX_SPLITS);
    let rows = batch * kv_heads * group * splits;
    DecodePlan {
        splits,
        grid_x: (batch * kv_heads) as u32,
        partial_out: rows * head_dim,
        partial_ml: rows * 2,
    }
}

/// KV bytes a decode step reads at most for which [`cuda_core_decode_pays`] picks the CUDA-core
/// kernel: below it the tensor-core kernel's fixed cost per block dominates. H200, 2026-12-04, per
/// layer: one 8B-shape sequence at 512-4,096 tokens 27-31 us on CUDA cores against 41-45 us on tensor
/// cores; 64 sequences of 512 / 1,024 tokens (134 / 268 MB) 82 / 144 against 115 / 154 us; the
/// default model's shape at batch 32 x 4,096 (100 MB) 61 against 77 us, x 8,192 (201 MB) 98 against
/// 104, x 16,384 (402 MB) 174 against 157; the 8B shape at batch 32 x 4,096 (537 MB) 268 against 209.
pub const DECODE_CUDA_CORE_MAX_BYTES: usize = 320 << 20;

/// Whether the CUDA-core decode kernel is the faster one for a step reading the K and V of `batch`
/// sequences of up to `max_ctx` tokens (bf16), and can run it (at most [`DECODE_MAX_GROUP`] query
/// heads per KV head).
pub fn cuda_core_decode_pays(
    batch: usize,
    max_ctx: usize,
    kv_heads: usize,
    head_dim: usize,
    group: usize,
) -> bool {
    group <= DECODE_MAX_GROUP && 2 * batch * max_ctx * kv_heads * head_dim * 2 <= DECODE_CUDA_CORE_MAX_BYTES
}

/// Rows of one sequence per prefill attention tile of `kernel` for a query group size.
pub fn prefill_rows_per_tile(kernel: PrefillKernel, group: usize) -> usize {
    (kernel.pairs() / group.max(1)).max(1)
}

/// One prefill sequence's new tokens: which sequence (index into the block-table array), its first
/// row in the batch, how many rows and the position of the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSeq {
    pub seq: usize,
    pub first_row: usize,
    pub rows: usize,
    pub first_pos: usize,
}

/// The tile table of the default (tensor-core) prefill attention: 4 ints per tile (sequence, first
/// row, rows, first position).
pub fn prefill_tiles(seqs: &[PrefillSeq], group: usize) -> Vec<i32> {
    prefill_tiles_for(PrefillKernel::TensorCore, seqs, group)
}

/// The tile table of `kernel`'s prefill attention.
pub fn prefill_tiles_for(kernel: PrefillKernel, seqs: &[PrefillSeq], group: usize) -> Vec<i32> {
    let per = prefill_rows_per_tile(kernel, group);
    let mut out = Vec::new();
    for s in seqs {
        let mut r = 0;
        while r < s.rows {
            let n = per.min(s.rows - r);
            out.extend_from_slice(&[
                s.seq as i32,
                (s.first_row + r) as i32,
                n as i32,
                (s.first_pos + r) as i32,
            ]);
            r += n;
        }
    }
    out
}

/// Blocks for a grid-stride element-wise kernel over `n` values.
pub fn elementwise_blocks(n: usize, threads: u32) -> u32 {
    (n.div_ceil(threads as usize)).clamp(1, 65_535) as u32
}

/// The decode attention kernel for a head size and group.
pub fn decode_kernel_name(head_dim: usize, group: usize) -> String {
    format!("decode_attn_d{head_dim}_g{group}")
}

/// Static shared memory (bytes) of `decode_attn_d{head_dim}_g{group}`.
pub fn decode_smem_bytes(head_dim: usize, group: usize) -> usize {
    let lanes = head_dim / 8;
    let nsg = DECODE_THREADS as usize / lanes;
    let staging = DECODE_STAGES * DECODE_TOKENS_PER_STEP * 2 * DECODE_THREADS as usize * 16;
    staging + 4 * (group * head_dim + nsg * group * 2)
}

/// Pipeline depth of `decode_attn_tc_d{head_dim}` (the `STAGES` it is instantiated with).
pub fn decode_tc_stages(head_dim: usize) -> usize {
    if head_dim <= 64 {
        3
    } else {
        2
    }
}

/// Dynamic shared memory (bytes) `decode_attn_tc_d{head_dim}` is launched with: its K/V staging.
pub fn decode_tc_dynamic_smem_bytes(head_dim: usize) -> usize {
    decode_tc_stages(head_dim) * 2 * DECODE_TC_TILE * (head_dim + 8) * 2
}

/// Static shared memory (bytes) of `decode_attn_tc_d*`: the per-warp row maxima and sums.
pub const DECODE_TC_STATIC_SMEM: usize = 4 * 16 * 2 * 4;

/// Most dynamic shared memory a block may opt in to on the architectures checked (sm_120: 99 KiB).
pub const DYNAMIC_SMEM_LIMIT: usize = 99 * 1024;

/// Static shared memory (bytes) of `prefill_attn_d{head_dim}`.
pub fn prefill_smem_bytes(head_dim: usize) -> usize {
    let p = PREFILL_MAX_PAIRS;
    4 * (2 * p * head_dim + PREFILL_KEY_TILE * (head_dim + 1) + p * PREFILL_KEY_TILE + 3 * p)
        + 2 * PREFILL_KEY_TILE * head_dim
}

/// Static shared memory (bytes) of `prefill_attn_tc_d{head_dim}`: one K and one V tile, rows padded
/// by 16 bytes.
pub fn prefill_tc_smem_bytes(head_dim: usize) -> usize {
    2 * PREFILL_TC_KEY_TILE * (head_dim + 8) * 2
}

/// Why a model shape cannot use these attention kernels, if it cannot.
pub fn attention_shape_problem(q_heads: usize, kv_heads: usize, head_dim: usize) -> Option<String> {
    if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Some(format!("{q_heads} query heads are not a multiple of {kv_heads} KV heads"));
    }
    if !HEAD_DIMS.contains(&head_dim) {
        return Some(format!("head_dim {head_dim} is not one of {HEAD_DIMS:?}"));
    }
    let group = q_heads / kv_heads;
    if group > DECODE_TC_MAX_GROUP {
        return Some(format!("{group} query heads per KV head exceed {DECODE_TC_MAX_GROUP}"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_token_context_uses_one_split() {
        assert_eq!(decode_splits(1, 3, 1, 132), 1);
        assert_eq!(decode_splits(32, 8, 1, 188), 1);
        assert_eq!(decode_splits(0, 0, 0, 0), 1, "degenerate input still gives a valid launch");
    }

    #[test]
    fn splits_fill_whole_waves_at_small_batch_and_long_context() {
        // One sequence, 3 KV heads (SmolLM2), 132 SMs x 4 resident blocks: two full waves.
        let s = decode_splits(1, 3, MAX_CONTEXT, 528);
        assert_eq!(s, 352);
        assert_eq!(s * 3, DECODE_WAVES * 528);
        // Batch 32 x 8 KV heads: 4 splits make 1,024 blocks, just under two waves of 528.
        assert_eq!(decode_splits(32, 8, 32_768, 528), 4);
        // A batch that fills the device needs no split.
        assert_eq!(decode_splits(256, 8, 32_768, 528), 1);
        // Short contexts are not cut below the minimum split length.
        assert_eq!(decode_splits(1, 3, 1000, 528), 4);
    }

    #[test]
    fn splits_never_shorter_than_the_minimum_nor_more_than_the_cap() {
        for ctx in [1, 2, 255, 256, 257, 1000, 4096, 32_768, MAX_CONTEXT] {
            for batch in [1, 2, 7, 32, 256] {
                for resident in [1, 84, 528, 1000, 100_000] {
                    let s = decode_splits(batch, 8, ctx, resident);
                    assert!(s == 1 || batch * 8 * s <= DECODE_WAVES * resident, "never more than the waves");
                    assert!((1..=MAX_SPLITS).contains(&s));
                    if s > 1 {
                        assert!(ctx.div_ceil(s) >= MIN_SPLIT_TOKENS / 2, "ctx {ctx} s {s}");
                        assert!(
                            ctx / (s - 1) >= MIN_SPLIT_TOKENS,
                            "ctx {ctx}: one split fewer would be too short"
                        );
                    }
                    // The splits cover the whole context.
                    assert!(ctx.div_ceil(s) * s >= ctx);
                }
            }
        }
    }

    #[test]
    fn plan_scratch_sizes() {
        let p = decode_plan(2, 3, 3, 64, 4096, 132);
        assert_eq!(p.grid_x, 6);
        assert_eq!(p.partial_out, 2 * 9 * p.splits * 64);
        assert_eq!(p.partial_ml, 2 * 9 * p.splits * 2);
    }

    #[test]
    fn small_decode_steps_take_the_cuda_core_kernel() {
        // One 8B-shape sequence (8 KV heads of 128) up to 32K tokens: 128 MiB at 32,768.
        assert!(cuda_core_decode_pays(1, 4096, 8, 128, 4));
        assert!(cuda_core_decode_pays(1, 32_768, 8, 128, 4));
        assert!(cuda_core_decode_pays(64, 1024, 8, 128, 4));
        assert!(!cuda_core_decode_pays(32, 4096, 8, 128, 4));
        // The default model's shape (3 KV heads of 64) at batch 32: 4,096 yes, 16,384 no.
        assert!(cuda_core_decode_pays(32, 4096, 3, 64, 3));
        assert!(!cuda_core_decode_pays(32, 16_384, 3, 64, 3));
        // Groups past 8 have only the tensor-core kernel.
        assert!(!cuda_core_decode_pays(1, 16, 1, 64, 16));
    }

    #[test]
    fn prefill_tiles_cover_every_row_once() {
        let seqs = [
            PrefillSeq { seq: 0, first_row: 0, rows: 11, first_pos: 5 },
            PrefillSeq { seq: 2, first_row: 11, rows: 1, first_pos: 0 },
            PrefillSeq { seq: 3, first_row: 12, rows: 5, first_pos: 100 },
        ];
        let t = prefill_tiles_for(PrefillKernel::CudaCore, &seqs, 3); // 5 rows per tile
        let tiles: Vec<&[i32]> = t.chunks(4).collect();
        assert_eq!(tiles.len(), 3 + 1 + 1);
        assert_eq!(tiles[0], &[0, 0, 5, 5]);
        assert_eq!(tiles[2], &[0, 10, 1, 15]);
        assert_eq!(tiles[3], &[2, 11, 1, 0]);
        assert_eq!(tiles[4], &[3, 12, 5, 100]);
        let rows: i32 = tiles.iter().map(|t| t[2]).sum();
        assert_eq!(rows, 17);
        for t in &tiles {
            assert!(t[2] as usize * 3 <= PREFILL_MAX_PAIRS);
        }
        assert_eq!(prefill_rows_per_tile(PrefillKernel::CudaCore, 1), 16);
        assert_eq!(prefill_rows_per_tile(PrefillKernel::CudaCore, 8), 2);
        assert_eq!(prefill_rows_per_tile(PrefillKernel::CudaCore, 16), 1);
        // Tensor cores: 64 query vectors a block (a group of 3 leaves one unused).
        assert_eq!(prefill_rows_per_tile(PrefillKernel::TensorCore, 1), 64);
        assert_eq!(prefill_rows_per_tile(PrefillKernel::TensorCore, 3), 21);
        assert_eq!(prefill_rows_per_tile(PrefillKernel::TensorCore, 16), 4);
        let t = prefill_tiles(&seqs, 4);
        assert_eq!(t, vec![0, 0, 11, 5, 2, 11, 1, 0, 3, 12, 5, 100]);
    }

    #[test]
    fn shared_memory_fits_the_static_limit() {
        for d in HEAD_DIMS {
            for g in 1..=DECODE_MAX_GROUP {
                assert!(decode_smem_bytes(d, g) <= STATIC_SMEM_LIMIT, "decode d{d} g{g}");
            }
            assert!(prefill_smem_bytes(d) <= STATIC_SMEM_LIMIT, "prefill d{d}: {}", prefill_smem_bytes(d));
            assert!(decode_tc_dynamic_smem_bytes(d) <= DYNAMIC_SMEM_LIMIT, "decode tc d{d}");
            // The merge reuses the staging for 16 rows of f32 output, and one stage holds the Q rows.
            assert!(decode_tc_dynamic_smem_bytes(d) >= 16 * d * 4);
            assert!(2 * DECODE_TC_TILE * (d + 8) * 2 >= DECODE_TC_MAX_GROUP * d * 4);
        }
    }

    #[test]
    fn unsupported_shapes_are_named() {
        assert!(attention_shape_problem(9, 3, 64).is_none());
        assert!(attention_shape_problem(32, 8, 128).is_none());
        assert!(attention_shape_problem(9, 2, 64).unwrap().contains("multiple"));
        assert!(attention_shape_problem(8, 8, 96).unwrap().contains("head_dim"));
        assert!(attention_shape_problem(64, 4, 64).is_none(), "16 per KV head: the tensor-core kernel");
        assert!(attention_shape_problem(68, 4, 64).unwrap().contains("exceed"));
    }

    #[test]
    fn elementwise_grid_is_bounded() {
        assert_eq!(elementwise_blocks(0, 256), 1);
        assert_eq!(elementwise_blocks(257, 256), 2);
        assert_eq!(elementwise_blocks(usize::MAX / 2, 256), 65_535);
    }
}
