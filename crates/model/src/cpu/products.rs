//! The weight products of a step, each computing every row the same way whatever the step's row
//! count (batch invariance): dot products (each row's value that of a one-row step, the weight rows
//! read once for all the step's rows), the bf16 rows product for quantized weights on CPUs with
//! AVX-512 BF16, and for bf16 weights the bf16 GEMM (AVX-512 BF16) or their rows widened exactly as
//! they are read (elsewhere).

use rayon::prelude::*;

use super::QRef;
use crate::fp4::Plain;
use crate::quant::{Bf16Layout, Bf16Matrix, QuantMatrix, GROUP};
use crate::sys::{
    dot, dot_bf16, gemm_bf16_par, gemm_rows_bf16, gemm_rows_f32, to_bf16, Bf16RowMajor, CpuKernels,
    F16Weights, F32Weights, Fp4Weights, Fp8Weights, Int8Row, Int8Rows, Q4Rows, Q8Rows, WIDE_ROWS,
};

/// `x[t×k] · w[n×k]^T` with quantized weights by dot products (decode steps, with or without drafts):
/// every row of `x` against blocks of weight rows, spread over the thread pool by output columns.
pub(super) fn matvec_quant<M: QuantMatrix>(x: &[f32], t: usize, k: usize, w: &M, out: &mut [f32]) {
    let n = w.rows();
    assert_eq!((x.len(), out.len(), w.cols()), (t * k, t * n, k));
    let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
    let sums = group_sums(x, k);
    let xsums: Vec<&[f32]> = sums.iter().map(Vec::as_slice).collect();
    by_weight_rows(t, k, n, out, |j0, cols, rows, o| {
        w.dot_block(j0, cols, &xs[rows.clone()], &xsums[rows], o)
    });
}

/// Each input row's sums per group of 32 (what the Q4 kernels weigh the minimums by).
fn group_sums(x: &[f32], k: usize) -> Vec<Vec<f32>> {
    x.chunks_exact(k).map(|xr| xr.chunks_exact(GROUP).map(|g| g.iter().sum()).collect()).collect()
}

/// A long step's product with quantized or f16 weights on the AVX2 arithmetic (`sys::gemm_rows_f32`:
/// blocks of weight rows widened into L2 once, every row the bits `matvec_quant` gives it): steps of
/// `WIDE_ROWS` rows and more where the dot kernels are the AVX2 ones (Q4 and Q8 on the AVX2 family,
/// f16 on both x86 families). False, touching nothing, elsewhere.
pub(super) fn matvec_wide(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) -> bool {
    let family = crate::sys::cpu_kernels();
    let fits = t >= WIDE_ROWS && k.is_multiple_of(16) && crate::sys::avx2();
    match m {
        QRef::Q4(m) if fits && family == CpuKernels::Avx2 => {
            let w = Q4Rows { packed: &m.packed, scales: &m.scales, mins: &m.mins, cols: k };
            gemm_rows_f32(x, t, k, m.rows, &w, out);
        }
        QRef::Q8(m) if fits && family == CpuKernels::Avx2 => {
            let w = Q8Rows { values: &m.values, scales: &m.scales, cols: k };
            gemm_rows_f32(x, t, k, m.rows, &w, out);
        }
        QRef::F16(m) if fits => {
            gemm_rows_f32(x, t, k, m.rows, &F16Weights { values: &m.values, cols: k }, out)
        }
        QRef::Fp8(m) if fits => {
            let w = Fp8Weights { codes: &m.codes, scales: &m.scales, group: m.group, cols: k };
            gemm_rows_f32(x, t, k, m.rows, &w, out)
        }
        QRef::Fp4(m) if fits => match &m.plain {
            Some(Plain::F32(p)) => gemm_rows_f32(x, t, k, m.rows, &F32Weights(p), out),
            Some(Plain::Bf16(p)) => gemm_rows_f32(x, t, k, m.rows, &Bf16RowMajor { values: p, cols: k }, out),
            None => {
                let w = Fp4Weights { packed: &m.packed, scales: &m.scales, group: m.group, cols: k };
                gemm_rows_f32(x, t, k, m.rows, &w, out)
            }
        },
        _ => return false,
    }
    true
}

/// `x[t×k] · w[n×k]^T` with `x` rounded to int8 in groups of 32 (`--activations q8`: integer
/// products, as llama.cpp computes its quantized weights' products), one weight row for all `t` rows
/// at a time, spread over the thread pool by weight rows. False, touching nothing, for f16 weights,
/// which have no int8 product.
pub(super) fn matvec_int8(x: &[f32], t: usize, k: usize, m: QRef<'_>, out: &mut [f32]) -> bool {
    let n = match m {
        QRef::Q4(m) => m.rows,
        QRef::Q8(m) => m.rows,
        QRef::F16(_) | QRef::Fp8(_) | QRef::Fp4(_) => return false,
    };
    assert_eq!((x.len(), out.len()), (t * k, t * n));
    let rows = Int8Rows::quantize(x, k);
    let xs: Vec<Int8Row<'_>> = (0..t).map(|r| rows.row(r, k)).collect();
    match m {
        QRef::Q4(m) => by_weight_rows(t, k, n, out, |j0, _, rows, o| {
            let xs = &xs[rows];
            o.chunks_exact_mut(xs.len()).enumerate().for_each(|(j, col)| m.dot_rows_int8(j0 + j, xs, col))
        }),
        QRef::Q8(m) => by_weight_rows(t, k, n, out, |j0, _, rows, o| {
            let xs = &xs[rows];
            o.chunks_exact_mut(xs.len()).enumerate().for_each(|(j, col)| m.dot_rows_int8(j0 + j, xs, col))
        }),
        QRef::F16(_) | QRef::Fp8(_) | QRef::Fp4(_) => unreachable!("returned above"),
    }
    true
}

/// `out[t×n]` with `f(j0, cols, rows, part)` filling columns `j0..j0 + cols` for input rows `rows`
/// (those rows against weight rows `j0..`, as `part[j * rows.len() + r]`), spread over the thread
/// pool by blocks of weight rows. Each value is the very dot product a one-row step computes, so a
/// row's result does not depend on the rows beside it (draft verification gives what decoding token
/// by token gives). A long step's rows go by blocks of about 128 KiB (`k` values each), so a block
/// stays in L2 while every weight row of the task passes over it, instead of each weight row
/// streaming the whole step from memory.
pub(super) fn by_weight_rows(
    t: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    f: impl Fn(usize, usize, std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    let threads = rayon::current_num_threads().max(1);
    // Two tasks per thread: enough to balance, few enough that dispatch stays cheap; a multiple of
    // four rows (the kernels' widest tile).
    let chunk = n.div_ceil(threads * 2).max(16).next_multiple_of(4);
    if t == 0 || n == 0 {
        return;
    }
    if t == 1 {
        out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| f(c * chunk, o.len(), 0..1, o));
        return;
    }
    // Input rows per block: a multiple of four (the kernels' tiles of rows), about 128 KiB of f32.
    let block = (32 * 1024 / k.max(1)).max(4) / 4 * 4;
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let (j0, cols) = (c * chunk, chunk.min(n - c * chunk));
            // Column-major within the part: one weight row's `t` values side by side.
            let mut part = vec![0.0; t * cols];
            if t <= block {
                f(j0, cols, 0..t, &mut part);
            } else {
                let mut piece = Vec::new();
                for r0 in (0..t).step_by(block) {
                    let rows = r0..(r0 + block).min(t);
                    piece.resize(rows.len() * cols, 0.0);
                    f(j0, cols, rows.clone(), &mut piece);
                    for (j, col) in piece.chunks_exact(rows.len()).enumerate() {
                        part[j * t + rows.start..j * t + rows.end].copy_from_slice(col);
                    }
                }
            }
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

/// `out = x[t×k] · w^T` with bf16 weights. Panels (AVX-512 BF16): x is rounded to bf16 once (into
/// `xb`), then the weight's 32-row panels are split evenly over the thread pool. Rows: x stays f32
/// and each weight is widened exactly as it is read, by the dot kernel (`sys::dot_bf16`) for short
/// steps and by `sys::gemm_rows_f32`'s widened tiles for long ones on the AVX2 arithmetic (the
/// same bits): every row's value that of a one-row step.
pub(super) fn matmul_bf16(x: &[f32], t: usize, k: usize, w: &Bf16Matrix, xb: &mut Vec<u16>, out: &mut [f32]) {
    assert_eq!((x.len(), w.cols), (t * k, k));
    let n = w.rows;
    match w.layout {
        Bf16Layout::Panels => {
            xb.resize(t * k, 0);
            to_bf16(x, &mut xb[..t * k]);
            gemm_bf16_par(&xb[..t * k], t, k, &w.values, n, out);
        }
        Bf16Layout::Rows if t >= WIDE_ROWS && k.is_multiple_of(16) && crate::sys::avx2() => {
            gemm_rows_f32(x, t, k, n, &Bf16RowMajor { values: &w.values, cols: k }, out)
        }
        Bf16Layout::Rows => by_weight_rows(t, k, n, &mut out[..t * n], |j0, cols, rows, o| {
            let len = rows.len();
            for (j, col) in o.chunks_exact_mut(len).take(cols).enumerate() {
                let wr = &w.values[(j0 + j) * k..(j0 + j + 1) * k];
                for (o, r) in col.iter_mut().zip(rows.clone()) {
                    *o = dot_bf16(&x[r * k..(r + 1) * k], wr);
                }
            }
        }),
    }
}

/// `out = x[t×k] · w^T` with Q4 or Q8 weights on CPUs with AVX-512 BF16: x rounded to bf16 once
/// (into `xb`), then one arithmetic for every step size (`sys::gemm_rows_bf16`), so a row's values
/// are the same whatever else its step holds.
pub(super) fn matmul_quant_rows(
    x: &[f32],
    t: usize,
    k: usize,
    m: QRef<'_>,
    xb: &mut Vec<u16>,
    out: &mut [f32],
) {
    xb.resize(t * k, 0);
    to_bf16(x, &mut xb[..t * k]);
    let xb = &xb[..t * k];
    match m {
        QRef::Q8(m) => {
            let w = Q8Rows { values: &m.values, scales: &m.scales, cols: k };
            gemm_rows_bf16(xb, t, k, m.rows, &w, out)
        }
        QRef::Q4(m) => {
            let w = Q4Rows { packed: &m.packed, scales: &m.scales, mins: &m.mins, cols: k };
            gemm_rows_bf16(xb, t, k, m.rows, &w, out)
        }
        QRef::F16(_) | QRef::Fp8(_) | QRef::Fp4(_) => unreachable!("f16, fp8 and fp4 widen to f32"),
    }
}

/// `x[t×k] · w[n×k]^T` for f32 weights: every value one dot product (`sys::dot`), spread over the
/// thread pool by blocks of weight rows, each weight row read once for all `t` rows.
pub(crate) fn matmul(x: &[f32], t: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * k);
    assert_eq!(w.len(), n * k);
    let mut out = vec![0.0; t * n];
    if crate::sys::avx2() && k.is_multiple_of(16) {
        // The very sums `dot` gives each row, weight rows read once for every pair of input rows.
        gemm_rows_f32(x, t, k, n, &F32Weights(w), &mut out);
        return out;
    }
    let wrow = |j: usize| &w[j * k..(j + 1) * k];
    by_weight_rows(t, k, n, &mut out, |j0, _, rows, o| {
        for (j, col) in o.chunks_exact_mut(rows.len()).enumerate() {
            for (r, v) in rows.clone().zip(col.iter_mut()) {
                *v = dot(&x[r * k..(r + 1) * k], wrow(j0 + j));
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{F16Matrix, Q4Matrix, Q8Matrix};
    use crate::test_values as values;

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

    /// The bf16 rows product of quantized weights is the weights' own product within bf16 rounding of
    /// x, and gives every row, bit for bit, what that row alone gives (CPUs with AVX-512 BF16 run
    /// its kernels; others its scalar definition).
    #[test]
    fn the_bf16_rows_product_is_the_weights_product_and_the_same_for_every_step_size() {
        let (n, k) = (96, 256);
        let w = values(n * k, 1);
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let q8 = Q8Matrix::quantize(&w, n, k).unwrap();
        for t in [1, 3, 17, 64, 70] {
            let x = values(t * k, 2 + t as u64);
            for (name, m, want) in [
                ("q4", QRef::Q4(&q4), reference(&x, t, k, &q4)),
                ("q8", QRef::Q8(&q8), reference(&x, t, k, &q8)),
            ] {
                let mut out = vec![0.0; t * n];
                matmul_quant_rows(&x, t, k, m, &mut Vec::new(), &mut out);
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 0.1, "{name} t={t} value {i}: {a} against {b}");
                }
                for r in 0..t {
                    let mut one = vec![0.0; n];
                    matmul_quant_rows(&x[r * k..(r + 1) * k], 1, k, m, &mut Vec::new(), &mut one);
                    for j in 0..n {
                        assert_eq!(
                            out[r * n + j].to_bits(),
                            one[j].to_bits(),
                            "{name} t={t} row {r} column {j}"
                        );
                    }
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
