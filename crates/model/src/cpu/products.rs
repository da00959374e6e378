//! The weight products of a step: matrix-vector dot products for decode-sized steps (every row's value
//! that of a one-row step), the bf16 GEMM over packed or quantized weights for longer ones, and the
//! f32 GEMMs.

use rayon::prelude::*;

use super::QRef;
use crate::quant::{Bf16Matrix, F16Matrix, QuantMatrix, GROUP};
use crate::sys::{
    dot, gemm_bf16_fill_par, gemm_bf16_par, gemm_bf16_rows_par, gemm_f32_widened_par, gemm_int16_par,
    gemm_q4_int8_par, has_bf16_gemm, q4_int16_rows, q8_int16_rows, sgemm, sgemm_xwt_avx512,
    sgemm_xwt_avx512_strided, to_bf16, CpuKernels, Int16Rows, Int8Blocks, Int8Row, Int8Rows, Q4Parts,
    PANEL_MIN_ROWS,
};

/// `x[t×k] · w[n×k]^T` with quantized weights by dot products (decode steps, with or without drafts):
/// every row of `x` against blocks of weight rows, spread over the thread pool by output columns.
pub(super) fn matvec_quant<M: QuantMatrix>(x: &[f32], t: usize, k: usize, w: &M, out: &mut [f32]) {
    let n = w.rows();
    debug_assert_eq!((x.len(), out.len(), w.cols()), (t * k, t * n, k));
    let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
    let sums: Vec<Vec<f32>> =
        xs.iter().map(|xr| xr.chunks_exact(GROUP).map(|g| g.iter().sum()).collect()).collect();
    let xsums: Vec<&[f32]> = sums.iter().map(Vec::as_slice).collect();
    by_weight_rows(t, n, out, |j0, rows, o| w.dot_block(j0, rows, &xs, &xsums, o));
}

/// `x[t×k] · w[n×k]^T` with `x` rounded to int8 in groups of 32 (`--activations q8`: integer
/// products, as llama.cpp computes its quantized weights' products), one weight row for all `t` rows
/// at a time, spread over the thread pool by weight rows. False, touching nothing, for f16 weights,
/// which have no int8 product.
pub(super) fn matvec_int8(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) -> bool {
    let n = match m {
        QRef::Q4(m) => m.rows,
        QRef::Q8(m) => m.rows,
        QRef::F16(_) => return false,
    };
    debug_assert_eq!((x.len(), out.len()), (t * k, t * n));
    let rows = Int8Rows::quantize(x, k);
    let xs: Vec<Int8Row<'_>> = (0..t).map(|r| rows.row(r, k)).collect();
    match m {
        QRef::Q4(m) => by_weight_rows(t, n, out, |j0, _, o| {
            o.chunks_exact_mut(t).enumerate().for_each(|(j, col)| m.dot_rows_int8(j0 + j, &xs, col))
        }),
        QRef::Q8(m) => by_weight_rows(t, n, out, |j0, _, o| {
            o.chunks_exact_mut(t).enumerate().for_each(|(j, col)| m.dot_rows_int8(j0 + j, &xs, col))
        }),
        QRef::F16(_) => unreachable!("returned above"),
    }
    true
}

/// `x[t×k] · w[n×k]^T` for a step of more than `INT8_MAX_ROWS` rows with int8 activations: x
/// rounded to int8 once per block of 256 values, the products with Q4 weights as integer sums (two
/// multiplies per 32 products, `sys::gemm_q4_int8_par`). False, touching nothing, for other weights
/// and where AVX2 is not the widest kernel family running: the bf16 and AVX-512 f32 GEMMs are faster
/// there.
pub(super) fn matmul_int8(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) -> bool {
    let QRef::Q4(m) = m else { return false };
    if crate::sys::cpu_kernels() != CpuKernels::Avx2 || !m.rows.is_multiple_of(2) {
        return false;
    }
    debug_assert_eq!((x.len(), out.len(), m.cols), (t * k, t * m.rows, k));
    let w = Q4Parts { packed: &m.packed, scales: &m.scales, mins: &m.mins };
    thread_local! {
        /// The calling thread's rounded inputs, kept from its last long step.
        static INPUTS: std::cell::RefCell<Option<Int8Blocks>> = const { std::cell::RefCell::new(None) };
    }
    INPUTS.with(|kept| {
        // Busy only if this thread, waiting on the pool inside the product below, was handed
        // another forward's product: that one takes buffers of its own.
        let Ok(mut kept) = kept.try_borrow_mut() else {
            return gemm_q4_int8_par(CpuKernels::Avx2, &Int8Blocks::quantize(x, k), w, m.rows, out);
        };
        let xb = match kept.as_mut() {
            Some(xb) => {
                xb.requantize(x, k);
                xb
            }
            None => kept.insert(Int8Blocks::quantize(x, k)),
        };
        gemm_q4_int8_par(CpuKernels::Avx2, xb, w, m.rows, out)
    })
}

/// `x[t×k] · w[n×k]^T` for a long step with Q4 or Q8 weights where AVX2 is the widest kernel family
/// running: x rounded to 16-bit integers per group of 32 values, the products on the integer units
/// (`sys::gemm_int16_par`). False, touching nothing, for other weights, kernels or shapes.
fn matmul_int16(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) -> bool {
    let n = match m {
        QRef::Q4(m) => m.rows,
        QRef::Q8(m) => m.rows,
        QRef::F16(_) => return false,
    };
    if crate::sys::cpu_kernels() != CpuKernels::Avx2 || !k.is_multiple_of(GROUP) || !n.is_multiple_of(16) {
        return false;
    }
    debug_assert_eq!((x.len(), out.len()), (t * k, t * n));
    let run = |xq: &Int16Rows, out: &mut [f32]| match m {
        QRef::Q4(m) => {
            gemm_int16_par(xq, n, |r0, q, s| q4_int16_rows((&m.packed, &m.scales, &m.mins), k, r0, q, s), out)
        }
        QRef::Q8(m) => {
            gemm_int16_par(xq, n, |r0, q, s| q8_int16_rows((&m.values, &m.scales), k, r0, q, s), out)
        }
        QRef::F16(_) => false,
    };
    thread_local! {
        /// The calling thread's rounded inputs, kept from its last long step.
        static INPUTS: std::cell::RefCell<Int16Rows> = std::cell::RefCell::new(Int16Rows::default());
    }
    INPUTS.with(|kept| {
        // Busy only if this thread, waiting on the pool inside the product below, was handed
        // another forward's product: that one takes buffers of its own.
        let (mut own, mut kept) = (Int16Rows::default(), kept.try_borrow_mut());
        let xq = match kept.as_deref_mut() {
            Ok(xq) => xq,
            Err(_) => &mut own,
        };
        xq.requantize(x, k);
        run(xq, out)
    })
}

/// `out[t×n]` with `f(j0, cols, part)` filling columns `j0..j0 + cols` (the `t` input rows against
/// weight rows `j0..`, as `part[j * t + r]`), spread over the thread pool by blocks of weight rows:
/// each weight row is read from memory once for all `t` rows, and each value is the very dot product
/// a one-row step computes, so a row's result does not depend on the rows beside it (draft
/// verification gives what decoding token by token gives).
pub(super) fn by_weight_rows(
    t: usize,
    n: usize,
    out: &mut [f32],
    f: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    let threads = rayon::current_num_threads().max(1);
    // Two tasks per thread: enough to balance, few enough that dispatch stays cheap; a multiple of
    // four rows (the kernels' widest tile).
    let chunk = n.div_ceil(threads * 2).max(16).next_multiple_of(4);
    if t == 0 || n == 0 {
        return;
    }
    if t == 1 {
        out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| f(c * chunk, o.len(), o));
        return;
    }
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let (j0, cols) = (c * chunk, chunk.min(n - c * chunk));
            // Column-major within the part: one weight row's `t` values side by side.
            let mut part = vec![0.0; t * cols];
            f(j0, cols, &mut part);
            (j0, part)
        })
        .collect();
    for (j0, part) in parts {
        for (j, col) in part.chunks_exact(t).enumerate() {
            for (r, v) in col.iter().enumerate() {
                out[r * n + j0 + j] = *v;
            }
        }
    }
}

/// `out = x[t×k] · w^T` with bf16 weights: x is rounded to bf16 once (into `xb`), then the weight's
/// 32-row panels are split evenly over the thread pool.
pub(super) fn matmul_bf16(x: &[f32], t: usize, k: usize, w: &Bf16Matrix, xb: &mut Vec<u16>, out: &mut [f32]) {
    debug_assert_eq!((x.len(), w.cols), (t * k, k));
    xb.resize(t * k, 0);
    to_bf16(x, &mut xb[..t * k]);
    gemm_bf16_par(&xb[..t * k], t, k, &w.panels, w.rows, out);
}

/// `out = x[t×k] · w^T` with quantized weights for a multi-row step: x is rounded to bf16 once (into
/// `xb`), the weights are widened to bf16 one 32-row panel block at a time, in L1, as the bf16 GEMM
/// reads them.
///
/// Without the bf16 GEMM, steps of fewer than `DEQUANT_GEMM_MIN_ROWS` rows take the multi-row dot
/// tiles (each weight row unpacked once per tile of input rows) and longer ones widen blocks of weight rows
/// to f32 and dot every row with them on AVX2-only CPUs (from `PANEL_MIN_ROWS` rows on, x rounded
/// to 16-bit integers multiplies the weights' integers: `matmul_int16`), or take the f32 GEMM over
/// widened chunks
/// (AVX-512 without BF16, the portable kernels, a matrix whose rows are not a multiple of 4): the
/// quantized matrices are all a step reads either way.
pub(super) fn matmul_quant(x: &[f32], t: usize, k: usize, m: QRef<'_>, xb: &mut Vec<u16>, out: &mut [f32]) {
    if let QRef::F16(m) = m {
        return matmul_widened(x, t, k, m, out);
    }
    if !has_bf16_gemm() {
        if t >= PANEL_MIN_ROWS && matmul_int16(x, t, k, m, out) {
            return;
        }
        fn widened<M: QuantMatrix>(x: &[f32], t: usize, k: usize, m: &M, out: &mut [f32]) {
            let fill = |r0: usize, dst: &mut [f32]| {
                for (c, row) in dst.chunks_exact_mut(k).enumerate() {
                    m.f32_row(r0 + c, row);
                }
            };
            if crate::sys::avx512() || !gemm_f32_widened_par(x, t, k, m.rows(), fill, out) {
                matmul_dequantized(x, t, k, m, out);
            }
        }
        return match (m, t < DEQUANT_GEMM_MIN_ROWS) {
            (QRef::Q8(m), true) => matvec_quant(x, t, k, m, out),
            (QRef::Q4(m), true) => matvec_quant(x, t, k, m, out),
            (QRef::Q8(m), false) => widened(x, t, k, m, out),
            (QRef::Q4(m), false) => widened(x, t, k, m, out),
            (QRef::F16(_), _) => unreachable!("f16 widens to f32, above"),
        };
    }
    xb.resize(t * k, 0);
    to_bf16(x, &mut xb[..t * k]);
    let xb = &xb[..t * k];
    fn run<M: QuantMatrix>(xb: &[u16], t: usize, k: usize, m: &M, out: &mut [f32]) {
        if t < QUANT_PANEL_MIN_ROWS {
            gemm_bf16_rows_par(xb, t, k, m.rows(), |r0, dst| m.bf16_rows(r0, 4, dst), out);
        } else {
            gemm_bf16_fill_par(xb, t, k, m.rows(), |r0, kk, dst| m.bf16_panel(r0, kk, dst), out);
        }
    }
    match m {
        QRef::Q8(m) => run(xb, t, k, m, out),
        QRef::Q4(m) => run(xb, t, k, m, out),
        QRef::F16(_) => unreachable!("f16 widens to f32, above"),
    }
}

/// `out = x[t×k] · w^T` for f16 weights, exactly: weight rows widened to f32 a chunk at a time and
/// multiplied by every row of x (the AVX2 dot tiles, or the f32 GEMM), spread over the thread pool.
pub(super) fn matmul_widened(x: &[f32], t: usize, k: usize, m: &F16Matrix, out: &mut [f32]) {
    let widen = |r0: usize, w: &mut [f32]| crate::sys::widen_f16(&m.values[r0 * k..][..w.len()], w);
    // With AVX2 alone, the widened rows' product without GEMM packing (as for Q4/Q8 above).
    if crate::sys::avx512() || !gemm_f32_widened_par(x, t, k, m.rows, widen, out) {
        widened_gemm(x, t, k, m.rows, out, widen)
    }
}

/// `out = x[t×k] · w^T` for quantized weights on the f32 GEMM: 32 weight rows at a time dequantized
/// exactly to f32 (the values `dot_row` multiplies by), the chunks spread over the thread pool.
fn matmul_dequantized<M: QuantMatrix>(x: &[f32], t: usize, k: usize, m: &M, out: &mut [f32]) {
    widened_gemm(x, t, k, m.rows(), out, |r0, w| {
        for (r, row) in w.chunks_exact_mut(k).enumerate() {
            m.f32_row(r0 + r, row);
        }
    })
}

/// `out = x[t×k] · w^T` where `widen(r0, w)` writes weight rows `r0..` (as many as `w` holds) in f32:
/// 32 rows at a time, each chunk's product on the f32 GEMM, the chunks spread over the thread pool.
fn widened_gemm(
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    widen: impl Fn(usize, &mut [f32]) + Sync,
) {
    // Each chunk's GEMM packs all of x again: long steps take bigger chunks.
    let chunk = if t >= 128 { 96 } else { 32 };
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let (r0, rows) = (c * chunk, chunk.min(n - c * chunk));
            let mut w = vec![0f32; rows * k];
            widen(r0, &mut w);
            let mut part = vec![0f32; t * rows];
            gemm_xwt((x, k), t, k, (&w, k), rows, &mut part);
            (r0, part)
        })
        .collect();
    for (r0, part) in parts {
        let rows = part.len() / t;
        for (r, src) in part.chunks_exact(rows).enumerate() {
            out[r * n + r0..r * n + r0 + rows].copy_from_slice(src);
        }
    }
}

/// Multi-row steps with fewer rows than this dot each row with the widened weight rows; longer ones
/// transpose the weights into panels for the register-tiled GEMM (the transposition pays off only
/// when many rows share it).
const QUANT_PANEL_MIN_ROWS: usize = 64;

/// Without the bf16 GEMM, steps with fewer rows than this take the multi-row dot tiles over quantized
/// weights; longer ones dot every row with weight rows widened to f32 a block at a time
/// (`gemm_f32_rows_par`, on CPUs with AVX2 but not AVX-512) or the f32 GEMM over widened chunks.
/// Measured under `--cpu-kernels avx2` (forward bench, Q4, alternating binaries, 2026-12-03): 4 rows:
/// tiles 260-330 tokens/s against the widened-row product's 157-181, 8 rows 296-325 against 260-296;
/// against matrixmultiply before it, 16 rows 355-402 against 262-266 and 32 rows 502-507 against
/// 324-335 (the tiles gave 228-283 at 16 rows).
const DEQUANT_GEMM_MIN_ROWS: usize = 16;

/// Steps that verify drafts (a `SeqStep` asking for the logits of more than one row) take dot products
/// up to this many rows, so every row's values are those of a one-row step; other steps take them up
/// to `DOT_ROWS` rows (decode of one or two sequences) and GEMMs beyond, which are faster for batches.
pub(super) const DOT_MAX_ROWS: usize = 16;

/// With int8 activations, steps of up to this many rows take the int8 dot tiles; longer ones the
/// int8 GEMM with Q4 weights where AVX2 is the widest family running (`matmul_int8`), else the
/// GEMMs as without. Measured under `--cpu-kernels avx2` (one thread, a 3072 x 576 Q4 matrix, int8
/// tiles against the f32 dot tiles): 1 row 1.66x, 4 rows 1.25x, 8 rows 1.2x, 16 rows 1.36x; forward
/// bench, 32 rows: 218-222 tokens/s against the f32 GEMM's 323-327.
pub(super) const INT8_MAX_ROWS: usize = 16;

/// Rows up to which steps that verify nothing take dot products.
pub(super) const DOT_ROWS: usize = 2;

/// ... and up to which they take them from f32 weights: dots read each weight row once for every
/// row, where matrixmultiply first copies the whole matrix into its panels. Measured through HTTP
/// (alternating, one unified worker each): 3 streams 1.47x, 8 streams 1.19x, 16 streams 0.86x the
/// output tokens/s of the GEMM.
pub(super) const F32_DOT_ROWS: usize = 8;

/// Steps with fewer rows than this run the weight GEMMs on matrixmultiply.
const AVX512_GEMM_MIN_ROWS: usize = 64;

/// `out[t×n] = x[t×k] · w[n×k]^T` on the calling thread over the first `k` values of rows `ldx` (x)
/// and `ldw` (w) apart: the AVX-512 kernel where it applies, else matrixmultiply.
pub(super) fn gemm_xwt(
    (x, ldx): (&[f32], usize),
    t: usize,
    k: usize,
    (w, ldw): (&[f32], usize),
    n: usize,
    out: &mut [f32],
) {
    if !sgemm_xwt_avx512_strided((x, ldx), t, k, (w, ldw), n, out) {
        sgemm(t, k, n, x, (ldx, 1), w, (1, ldw), out, (n, 1));
    }
}

/// `x[t×k] · w[n×k]^T`, spread over the thread pool by output columns (dot products up to `DOT_ROWS`
/// rows).
pub(crate) fn matmul(x: &[f32], t: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    matmul_dots_up_to(x, t, k, w, n, DOT_ROWS)
}

/// [`matmul`] taking dot products up to `dot_rows` rows.
pub(super) fn matmul_dots_up_to(
    x: &[f32],
    t: usize,
    k: usize,
    w: &[f32],
    n: usize,
    dot_rows: usize,
) -> Vec<f32> {
    debug_assert_eq!(x.len(), t * k);
    debug_assert_eq!(w.len(), n * k);
    let threads = rayon::current_num_threads().max(1);
    if t <= dot_rows {
        // Decode and draft verification: one dot per weight row and input row, weights read once.
        let mut out = vec![0.0; t * n];
        let wrow = |j: usize| &w[j * k..(j + 1) * k];
        by_weight_rows(t, n, &mut out, |j0, _, o| {
            for (j, col) in o.chunks_exact_mut(t).enumerate() {
                for (r, v) in col.iter_mut().enumerate() {
                    *v = dot(&x[r * k..(r + 1) * k], wrow(j0 + j));
                }
            }
        });
        return out;
    }
    // Column chunks in multiples of 32, so the AVX-512 kernel takes every chunk when n allows.
    let chunk = n.div_ceil(threads * 2).max(64).next_multiple_of(32);
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let j0 = c * chunk;
            let cols = chunk.min(n - j0);
            let mut part = vec![0.0; t * cols];
            // The AVX-512 kernel packs every weight panel: worth it for prefill-sized steps, not for a
            // batch of a few dozen decode rows (matrixmultiply measured faster there).
            if t < AVX512_GEMM_MIN_ROWS
                || !sgemm_xwt_avx512(x, t, k, &w[j0 * k..(j0 + cols) * k], cols, &mut part)
            {
                sgemm(t, k, cols, x, (k, 1), &w[j0 * k..], (1, k), &mut part, (cols, 1));
            }
            (j0, part)
        })
        .collect();
    let mut out = vec![0.0; t * n];
    for (j0, part) in parts {
        let cols = part.len() / t;
        for (r, src) in part.chunks_exact(cols).enumerate() {
            out[r * n + j0..r * n + j0 + cols].copy_from_slice(src);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Q4Matrix, Q8Matrix};

    /// Deterministic values in -1..1.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// `x · w^T` against the dequantized rows, summed in f64.
    fn reference<M: QuantMatrix>(x: &[f32], t: usize, k: usize, m: &M) -> Vec<f32> {
        let rows: Vec<Vec<f32>> = (0..m.rows()).map(|j| m.dequantize_row(j)).collect();
        let mut out = Vec::with_capacity(t * m.rows());
        for xr in x.chunks_exact(k) {
            out.extend(
                rows.iter().map(|w| xr.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32),
            );
        }
        out
    }

    /// A multi-row step's product over quantized or f16 weights (the bf16 GEMM on CPUs that have it;
    /// the dot tiles below 16 rows and the widened-row product or the f32 GEMM from 16 on the others)
    /// is the product of the weights' own values: within bf16 rounding of x where the bf16 GEMM runs,
    /// else within f32 rounding.
    #[test]
    fn multi_row_products_of_quantized_weights_are_the_weights_products() {
        let (n, k) = (96, 256);
        let w = values(n * k, 1);
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let q8 = Q8Matrix::quantize(&w, n, k).unwrap();
        let f16 = F16Matrix::quantize(&w, n, k).unwrap();
        for t in [3, 17, 64, 70] {
            let x = values(t * k, 2 + t as u64);
            for (name, m, want) in [
                ("q4", QRef::Q4(&q4), reference(&x, t, k, &q4)),
                ("q8", QRef::Q8(&q8), reference(&x, t, k, &q8)),
                ("f16", QRef::F16(&f16), reference(&x, t, k, &f16)),
            ] {
                // The bf16 GEMM rounds x to bf16; f16 weights are widened to f32 on every CPU.
                let tolerance = if has_bf16_gemm() && name != "f16" { 0.1 } else { 1e-3 };
                let mut out = vec![0.0; t * n];
                matmul_quant(&x, t, k, m, &mut Vec::new(), &mut out);
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= tolerance, "{name} t={t} value {i}: {a} against {b}");
                }
            }
        }
    }

    /// A decode step's products with drafts (`matvec_quant`, blocks of weight rows over the thread
    /// pool) give every row, bit for bit, what that row alone gives, and near the weights' own
    /// product: weight rows not a multiple of the tiles' four, over several blocks.
    #[test]
    fn every_row_of_a_verify_step_is_that_row_alone_exactly() {
        let (n, k) = (70, 96);
        let w = values(n * k, 3);
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let q8 = Q8Matrix::quantize(&w, n, k).unwrap();
        let f16 = F16Matrix::quantize(&w, n, k).unwrap();
        fn check<M: QuantMatrix>(name: &str, m: &M, t: usize, x: &[f32], n: usize, k: usize) {
            let mut out = vec![0.0; t * n];
            matvec_quant(x, t, k, m, &mut out);
            let want = reference(x, t, k, m);
            for r in 0..t {
                let mut one = vec![0.0; n];
                matvec_quant(&x[r * k..(r + 1) * k], 1, k, m, &mut one);
                for j in 0..n {
                    let (a, b) = (out[r * n + j], one[j]);
                    assert_eq!(a.to_bits(), b.to_bits(), "{name} t={t} row {r} column {j}: {a} against {b}");
                    assert!((a - want[r * n + j]).abs() <= 1e-3, "{name} t={t} row {r} column {j}");
                }
            }
        }
        for t in 1..=16 {
            let x = values(t * k, 10 + t as u64);
            check("q4", &q4, t, &x, n, k);
            check("q8", &q8, t, &x, n, k);
            check("f16", &f16, t, &x, n, k);
        }
    }
}
