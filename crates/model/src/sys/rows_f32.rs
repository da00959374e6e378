//! The products with f32 inputs on the AVX2 kernels, one arithmetic for every step size. Each
//! output is what the AVX2 dot kernels compute for one row (`dot_avx2` for f32 weights,
//! `dot_f16_avx2`, `dot_bf16_avx2`, the Q8 and Q4 tiles of `qrows`): two 8-lane FMA chains, the
//! first over the values `16 s .. 16 s + 8`, the second over `16 s + 8 .. 16 s + 16` for s = 0, 1,
//! ..., then `hsum256` of their sum, each weight the f32 value those kernels multiply (f16 and bf16
//! widened, Q8 `q * scale`, Q4 `min + q * scale` in one rounding).
//!
//! Steps of a few rows keep those kernels (they read the packed weights once per few rows); longer
//! ones widen blocks of weight rows into L2 once and pass 3 x 2 register tiles over them (f32
//! weights are read as they are), so a long step reads each weight row from memory once and its
//! values from L2 for every pair of input rows, and a row's values never depend on how many rows
//! its step has (batch invariance).

#![allow(unsafe_code)]

use super::gemm::split_columns;
use crate::bits16::f16_value;

/// Steps of at least this many rows take the widened tiles for quantized and f16 weights (fewer
/// read the packed weights in the dot kernels' tiles, which unpack them once per few rows).
pub(crate) const WIDE_ROWS: usize = 8;

/// A matrix the product reads, as the f32 values the AVX2 dot kernels multiply.
pub(crate) trait F32Rows: Sync {
    /// Rows `r0..r0 + cnt`, every column, into `dst` row-major (`cnt` x k).
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]);

    /// The rows as they are, where they are f32 already (nothing to widen).
    fn direct(&self) -> Option<&[f32]> {
        None
    }
}

/// f32 weights, row-major.
pub(crate) struct F32Weights<'a>(pub &'a [f32]);

impl F32Rows for F32Weights<'_> {
    fn widen(&self, _r0: usize, _cnt: usize, _dst: &mut [f32]) {
        unreachable!("f32 rows are read where they are")
    }

    fn direct(&self) -> Option<&[f32]> {
        Some(self.0)
    }
}

/// f16 weights (bits), row-major, `cols` wide.
pub(crate) struct F16Weights<'a> {
    pub values: &'a [u16],
    pub cols: usize,
}

impl F32Rows for F16Weights<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        super::widen_f16(&self.values[r0 * self.cols..(r0 + cnt) * self.cols], &mut dst[..cnt * self.cols]);
    }
}

/// bf16 weights (bits), row-major, `cols` wide: widened exactly (each value the f32 it stands for).
pub(crate) struct Bf16RowMajor<'a> {
    pub values: &'a [u16],
    pub cols: usize,
}

impl F32Rows for Bf16RowMajor<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        super::widen_bf16(&self.values[r0 * self.cols..(r0 + cnt) * self.cols], &mut dst[..cnt * self.cols]);
    }
}

/// FP8 weights' parts (see `fp8::Fp8Matrix`): e4m3 codes row-major, `cols` wide, and a scale per
/// row and group of `group` columns.
pub(crate) struct Fp8Weights<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub group: usize,
    pub cols: usize,
}

impl F32Rows for Fp8Weights<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        let (k, g) = (self.cols, self.cols.div_ceil(self.group));
        for (r, d) in dst[..cnt * k].chunks_exact_mut(k).enumerate() {
            let row = r0 + r;
            let (codes, scales) = (&self.codes[row * k..(row + 1) * k], &self.scales[row * g..(row + 1) * g]);
            super::widen_fp8_row(codes, scales, self.group, d);
        }
    }
}

/// FP4 weights' parts (see `fp4::Fp4Matrix`): e2m1 codes two a byte, row-major, `cols` wide, and a
/// scale per row and group of `group` columns.
pub(crate) struct Fp4Weights<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [f32],
    pub group: usize,
    pub cols: usize,
}

impl F32Rows for Fp4Weights<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        let (k, g) = (self.cols, self.cols / self.group);
        for (r, d) in dst[..cnt * k].chunks_exact_mut(k).enumerate() {
            let row = r0 + r;
            let (packed, scales) =
                (&self.packed[row * k / 2..(row + 1) * k / 2], &self.scales[row * g..(row + 1) * g]);
            super::widen_fp4_row(packed, scales, self.group, d);
        }
    }
}

impl F32Rows for super::Q8Rows<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        let (k, groups) = (self.cols, self.cols / 32);
        let q = &self.values[r0 * k..(r0 + cnt) * k];
        let scales = &self.scales[r0 * groups..(r0 + cnt) * groups];
        for ((d, q), &s) in dst[..cnt * k].chunks_exact_mut(32).zip(q.chunks_exact(32)).zip(scales) {
            let s = f16_value(s);
            // Exact: an 8-bit integer times an f16 value needs 19 bits.
            for (d, &q) in d.iter_mut().zip(q) {
                *d = q as f32 * s;
            }
        }
    }
}

impl F32Rows for super::Q4Rows<'_> {
    fn widen(&self, r0: usize, cnt: usize, dst: &mut [f32]) {
        let (k, groups) = (self.cols, self.cols / 32);
        let packed = &self.packed[r0 * k / 2..(r0 + cnt) * k / 2];
        let g = r0 * groups..(r0 + cnt) * groups;
        assert!(dst.len() >= cnt * k && super::avx2());
        // SAFETY: AVX2, FMA and F16C (asserted: the product runs only where they are); every length
        // matches.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            widen_q4_avx2(packed, &self.scales[g.clone()], &self.mins[g], &mut dst[..cnt * k])
        };
    }
}

/// Q4 groups widened as the AVX2 tile widens them: `min + q * scale` in one rounding (an FMA).
///
/// # Safety
/// AVX2, FMA and F16C; `packed` 16 bytes, `dst` 32 values per group of `scales` and `mins`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_q4_avx2(packed: &[u8], scales: &[u16], mins: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(
        packed.len() == scales.len() * 16 && mins.len() == scales.len() && dst.len() == scales.len() * 32
    );
    let low = _mm_set1_epi8(15);
    for (g, (&s, &m)) in scales.iter().zip(mins).enumerate() {
        // SAFETY (of the loads and stores): group g's 16 bytes and 32 values, as asserted.
        let bytes = _mm_loadu_si128(packed.as_ptr().add(g * 16).cast());
        let (sv, mv) = (super::f16_splat256(s), super::f16_splat256(m));
        let d = dst.as_mut_ptr().add(g * 32);
        for (nib, at) in [(_mm_and_si128(bytes, low), 0), (_mm_and_si128(_mm_srli_epi16(bytes, 4), low), 16)]
        {
            let w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), sv, mv);
            let w1 =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8))), sv, mv);
            _mm256_storeu_ps(d.add(at), w0);
            _mm256_storeu_ps(d.add(at + 8), w1);
        }
    }
}

thread_local! {
    /// A task's widened block of weight rows.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Weight rows a task widens at a time: about 192 KiB of f32, so the block stays in L2 while every
/// tile of the step's rows passes over it.
fn block_rows(k: usize) -> usize {
    (48 * 1024 / k).max(2) / 2 * 2
}

/// Input rows a block of tiles takes at a time: about 64 KiB (a multiple of the tile's three), in
/// L2 beside the weights.
fn input_rows(k: usize) -> usize {
    (16 * 1024 / k).max(3) / 3 * 3
}

/// `out[t x n] = x[t x k] . W^T` for `w` (see the module docs): `k` a multiple of 16. Spread over
/// the thread pool by output columns. Needs AVX2, FMA and F16C (`super::avx2()`).
pub(crate) fn gemm_rows_f32<W: F32Rows>(x: &[f32], t: usize, k: usize, n: usize, w: &W, out: &mut [f32]) {
    assert!(k.is_multiple_of(16) && k > 0, "k must be a multiple of 16");
    assert!(x.len() >= t * k && out.len() >= t * n);
    assert!(super::avx2(), "the AVX2 kernels");
    if let Some(d) = w.direct() {
        assert!(d.len() >= n * k);
    }
    if t == 0 || n == 0 {
        return;
    }
    // Pairs of weight rows (the tile's columns).
    split_columns(n.div_ceil(2), out, |u0, u1, dst| {
        let (j0, j1) = (u0 * 2, (u1 * 2).min(n));
        WIDE.with_borrow_mut(|buf| {
            let mut b0 = j0;
            while b0 < j1 {
                let b1 = (b0 + block_rows(k)).min(j1);
                let block: &[f32] = match w.direct() {
                    Some(d) => &d[b0 * k..b1 * k],
                    None => {
                        buf.resize((b1 - b0) * k, 0.0);
                        w.widen(b0, b1 - b0, buf);
                        &buf[..(b1 - b0) * k]
                    }
                };
                for r0 in (0..t).step_by(input_rows(k)) {
                    let r1 = (r0 + input_rows(k)).min(t);
                    let mut j = b0;
                    while j < b1 {
                        let c = (b1 - j).min(2);
                        let pw = block[(j - b0) * k..].as_ptr();
                        let mut r = r0;
                        while r < r1 {
                            let rows = (r1 - r).min(3);
                            let mut sums = [[0f32; 2]; 3];
                            let px = x[r * k..].as_ptr();
                            // SAFETY: AVX2 and FMA (asserted above); x holds `rows` rows of k from
                            // row r, the block `c` rows of k from row j.
                            #[cfg(target_arch = "x86_64")]
                            unsafe {
                                match (rows, c) {
                                    (3, 2) => tile::<3, 2>(px, pw, k, &mut sums),
                                    (3, _) => tile::<3, 1>(px, pw, k, &mut sums),
                                    (2, 2) => tile::<2, 2>(px, pw, k, &mut sums),
                                    (2, _) => tile::<2, 1>(px, pw, k, &mut sums),
                                    (_, 2) => tile::<1, 2>(px, pw, k, &mut sums),
                                    _ => tile::<1, 1>(px, pw, k, &mut sums),
                                }
                            }
                            for (a, row) in sums.iter().enumerate().take(rows) {
                                for (b, &v) in row.iter().enumerate().take(c) {
                                    // SAFETY: row r + a < t, column j + b of this task's share
                                    // (no other task writes it).
                                    unsafe { *dst.add((r + a) * n + j + b) = v };
                                }
                            }
                            r += rows;
                        }
                        j += c;
                    }
                }
                b0 = b1;
            }
        });
    });
}

/// `R` input rows (`k` apart from `px`) against `C` weight rows (`k` apart from `pw`): each
/// output's two FMA chains and `hsum256`, into `sums[r][c]`. At 3 x 2, twelve accumulators, two
/// weight vectors and an input vector fill the sixteen registers: ten loads per twelve FMAs.
///
/// # Safety
/// AVX2 and FMA; `k` a multiple of 16; R x k values readable from `px`, C x k from `pw`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const C: usize>(
    px: *const f32,
    pw: *const f32,
    k: usize,
    sums: &mut [[f32; 2]; 3],
) {
    use std::arch::x86_64::*;
    let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
    let mut i = 0;
    while i < k {
        // Each half of the 16 values: C weight vectors in registers, one input vector at a time.
        // (Loops, not `array::from_fn`: its closures are not inlined into this function's target
        // features.)
        for h in 0..2 {
            let mut w = [_mm256_setzero_ps(); C];
            for (c, w) in w.iter_mut().enumerate() {
                *w = _mm256_loadu_ps(pw.add(c * k + i + 8 * h));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(px.add(r * k + i + 8 * h));
                for (a, &w) in acc.iter_mut().zip(&w) {
                    a[h] = _mm256_fmadd_ps(w, x, a[h]);
                }
            }
        }
        i += 16;
    }
    for (s, acc) in sums.iter_mut().zip(&acc) {
        for (s, a) in s.iter_mut().zip(acc) {
            *s = super::hsum256(_mm256_add_ps(a[0], a[1]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{F16Matrix, Q4Matrix, Q8Matrix, QuantMatrix};
    use crate::sys::{CpuKernels, Q4Rows, Q8Rows};
    use crate::test_values as values;

    /// Every row of every step size, widened tiles or not, gives the bits the one-row AVX2 kernel
    /// gives it.
    #[test]
    fn long_steps_give_each_row_the_bits_of_the_one_row_kernels() {
        if !crate::sys::avx2() {
            return;
        }
        let (n, k) = (70, 320);
        let w = values(n * k, 3);
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let q8 = Q8Matrix::quantize(&w, n, k).unwrap();
        let f16 = F16Matrix::quantize(&w, n, k).unwrap();
        let bf16: Vec<u16> = w.iter().map(|&v| crate::bits16::bf16_bits(v)).collect();
        for t in [1, 2, 3, 8, 9, 61, 130] {
            let x = values(t * k, t as u64);
            let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
            let sums: Vec<Vec<f32>> =
                xs.iter().map(|xr| xr.chunks_exact(32).map(|g| g.iter().sum()).collect()).collect();
            let xsums: Vec<&[f32]> = sums.iter().map(Vec::as_slice).collect();
            let check = |name: &str, got: &[f32], one: &dyn Fn(usize, usize) -> f32| {
                for r in 0..t {
                    for j in 0..n {
                        let want = one(r, j);
                        assert_eq!(got[r * n + j].to_bits(), want.to_bits(), "{name} t {t} row {r} col {j}");
                    }
                }
            };
            let mut out = vec![0f32; t * n];
            gemm_rows_f32(&x, t, k, n, &F32Weights(&w), &mut out);
            check("f32", &out, &|r, j| crate::sys::dot(xs[r], &w[j * k..(j + 1) * k]));
            gemm_rows_f32(&x, t, k, n, &F16Weights { values: &f16.values, cols: k }, &mut out);
            check("f16", &out, &|r, j| {
                crate::sys::dot_f16_with(CpuKernels::Avx2, xs[r], &f16.values[j * k..(j + 1) * k])
            });
            gemm_rows_f32(&x, t, k, n, &Bf16RowMajor { values: &bf16, cols: k }, &mut out);
            check("bf16", &out, &|r, j| {
                crate::sys::dot_bf16_with(CpuKernels::Avx2, xs[r], &bf16[j * k..(j + 1) * k])
            });
            // A bf16 matrix's products are its f32 copy's, bit for bit (the widening is exact).
            let wide: Vec<f32> = bf16.iter().map(|&b| crate::bits16::bf16_value(b)).collect();
            check("bf16 as f32", &out, &|r, j| crate::sys::dot(xs[r], &wide[j * k..(j + 1) * k]));
            let q8r = Q8Rows { values: &q8.values, scales: &q8.scales, cols: k };
            gemm_rows_f32(&x, t, k, n, &q8r, &mut out);
            check("q8", &out, &|r, j| {
                let mut one = [0f32];
                let g = k / 32;
                let (q, s) = (&q8.values[j * k..(j + 1) * k], &q8.scales[j * g..(j + 1) * g]);
                crate::sys::dot_q8_rows_with(CpuKernels::Avx2, &xs[r..r + 1], q, s, &mut one);
                one[0]
            });
            let q4r = Q4Rows { packed: &q4.packed, scales: &q4.scales, mins: &q4.mins, cols: k };
            gemm_rows_f32(&x, t, k, n, &q4r, &mut out);
            check("q4", &out, &|r, j| {
                let mut one = [0f32];
                let g = k / 32;
                let (p, s, m) = (
                    &q4.packed[j * k / 2..(j + 1) * k / 2],
                    &q4.scales[j * g..(j + 1) * g],
                    &q4.mins[j * g..(j + 1) * g],
                );
                crate::sys::dot_q4_rows_with(
                    CpuKernels::Avx2,
                    &xs[r..r + 1],
                    p,
                    s,
                    m,
                    &xsums[r..r + 1],
                    &mut one,
                );
                one[0]
            });
        }
    }
}
