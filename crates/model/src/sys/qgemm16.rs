//! Long steps' products with Q4 and Q8 weights where AVX2 is the widest kernel family running, on the
//! integer units: each input row is rounded to 16-bit integers per group of 32 values (a scale
//! `max |x| / 32767` each, so every value keeps 15 bits against its group's largest, where the bf16
//! rounding of the AVX-512 path keeps 8 of its own), the weights' 4- or 8-bit integers are multiplied
//! by them exactly, and each group's integer sum is scaled once in f32.
//!
//! The arithmetic, per input row r, weight row c and group g: `s = sum(xq * wq)` over the group's 32
//! values in 32-bit lanes (exact: at most 32 * 32767 * 127 in magnitude), then
//! `acc = fma(f32(s), wscale[c,g] * xscale[r,g], acc)` and, for Q4's minimums,
//! `acc = fma(xsum[r,g], wmin[c,g], acc)` with `xsum` the group's sum of the unrounded inputs; `acc`
//! starts from zero and runs over the groups in order. Every kernel family gives these same values
//! (the test's reference computes them one by one).
//!
//! The kernel: sixteen weight rows at a time are widened to 16-bit integers and transposed into a
//! panel whose every 64 bytes hold one pair of consecutive values of k for each of the sixteen rows,
//! so that `vpmaddwd` of a broadcast pair of an input row and the panel's two vectors gives sixteen
//! rows' sums of two products; a register tile of up to six input rows keeps twelve such 8-lane sums
//! and folds them into its f32 outputs once per group; its inputs are stored interleaved by pairs,
//! so a tile reads them as one stream. Per sixteen products that is a `vpmaddwd` and a `vpaddd`,
//! spread over more ports than the f32 path's two FMAs: on a Zen 4, 1.3x the f32 tile's products in
//! L1 and 1.1-1.2x the f32 panel GEMM's in place, the rounding of the inputs included.

use rayon::prelude::*;

use super::gemm::split_columns_by;
use super::gemm_f32::PANEL;
use crate::bits16::f16_value;

/// Values per group: the weights' scales and minimums and the inputs' scales are per group of 32.
const G: usize = 32;

/// Input rows per register tile.
const TILE: usize = 6;

/// The largest magnitude of a rounded input.
const QMAX: f32 = 32767.0;

/// Input rows rounded to 16-bit integers per group of 32 values (value ≈ `q * scale`), with each
/// group's sum of the unrounded values, as [`gemm_int16_par`] reads them.
#[derive(Debug, Default)]
pub(crate) struct Int16Rows {
    k: usize,
    /// The values, tile by tile of [`TILE`] rows (the last may have fewer), each tile's rows
    /// interleaved by pairs of values.
    q: Vec<i16>,
    /// Row `r`'s group scales at `scale[r * k / 32..]`.
    scale: Vec<f32>,
    /// Row `r`'s group sums at `sum[r * k / 32..]`.
    sum: Vec<f32>,
}

impl Int16Rows {
    /// `x` (rows of `k`, a nonzero multiple of 32) rounded as the module states, into these buffers
    /// (kept from an earlier step: a long step's inputs are hundreds of KiB, freshly faulted in when
    /// allocated anew); the rows over the thread pool. Values round to nearest, ties to even; a group
    /// of zeros (or too small for `32767 / max` to be finite) has scale 0; one holding a NaN or an
    /// infinity has a NaN or infinite sum, which the products carry.
    pub(crate) fn requantize(&mut self, x: &[f32], k: usize) {
        assert!(k.is_multiple_of(G) && k > 0 && x.len().is_multiple_of(k));
        let (t, groups) = (x.len() / k, k / G);
        self.k = k;
        // (Every value is written below.)
        self.q.resize(t * k, 0);
        self.scale.resize(t * groups, 0.0);
        self.sum.resize(t * groups, 0.0);
        // A tile's rows interleaved by pairs: pair j of its row i at `(j * rows + i) * 2`, so that the
        // kernel reads each tile as one stream.
        let tiles = self.q.par_chunks_mut(TILE * k).zip(self.scale.par_chunks_mut(TILE * groups));
        tiles.zip(self.sum.par_chunks_mut(TILE * groups)).zip(x.par_chunks(TILE * k)).for_each(
            |(((q, scale), sum), x)| {
                let rows = x.len() / k;
                let mut group = [0i16; G];
                for (i, x) in x.chunks_exact(k).enumerate() {
                    for (g, x) in x.chunks_exact(G).enumerate() {
                        (scale[i * groups + g], sum[i * groups + g]) = round_group(x, &mut group);
                        for (j, pair) in group.chunks_exact(2).enumerate() {
                            let at = ((g * G / 2 + j) * rows + i) * 2;
                            q[at..at + 2].copy_from_slice(pair);
                        }
                    }
                }
            },
        );
    }

    /// Row `r`'s value `kk` (rounded).
    #[cfg(test)]
    fn value(&self, r: usize, kk: usize) -> i16 {
        let (tile, i) = (r / TILE, r % TILE);
        let rows = TILE.min(self.rows() - tile * TILE);
        self.q[tile * TILE * self.k + ((kk / 2) * rows + i) * 2 + kk % 2]
    }

    fn rows(&self) -> usize {
        self.q.len() / self.k.max(1)
    }
}

/// One group of 32 inputs rounded into `q`: returns its scale and its sum (summed in eight lanes,
/// `x[l] + x[l + 8] + x[l + 16] + x[l + 24]`, then across them).
fn round_group(x: &[f32], q: &mut [i16]) -> (f32, f32) {
    assert!(x.len() == G && q.len() == G);
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: the CPU has AVX2 (checked); both hold 32 values (asserted).
        return unsafe { round_group_avx2(x.as_ptr(), q.as_mut_ptr()) };
    }
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = inverse_scale(max);
    for (q, &v) in q.iter_mut().zip(x) {
        *q = super::qint8::round_ties_even(v * inv).clamp(-QMAX, QMAX) as i16;
    }
    let lanes: [f32; 8] = std::array::from_fn(|l| x[l] + x[l + 8] + x[l + 16] + x[l + 24]);
    (max / QMAX, sum8(lanes))
}

/// `32767 / max`, or 0 where that is not finite (a group of zeros or of subnormals).
fn inverse_scale(max: f32) -> f32 {
    let inv = QMAX / max;
    if max > 0.0 && inv.is_finite() {
        inv
    } else {
        0.0
    }
}

/// Eight lanes' sum, pairs four apart first: `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
fn sum8(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// # Safety
/// AVX2; `x` and `q` point to 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_group_avx2(x: *const f32, q: *mut i16) -> (f32, f32) {
    use std::arch::x86_64::*;
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.add(8 * i)));
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(abs, v[0]), _mm256_and_ps(abs, v[1])),
        _mm256_max_ps(_mm256_and_ps(abs, v[2]), _mm256_and_ps(abs, v[3])),
    );
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let max = lanes.iter().fold(0f32, |a, &b| a.max(b));
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]));
    let inv = _mm256_set1_ps(inverse_scale(max));
    // Rounded to nearest, ties to even (the default rounding mode), then packed to 16 bits with
    // saturation; the packing interleaves 128-bit lanes, which the permutation undoes.
    let r: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
    let lo = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(r[0], r[1]));
    let hi = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(q.cast(), lo);
    _mm256_storeu_si256(q.add(16).cast(), hi);
    (max / QMAX, sum8(lanes))
}

/// Rows `r0..` of a Q4 matrix (`cols` values each, as many rows as `q` holds) as integers 0..=15,
/// with each group's scale and minimum (`value = min + q * scale`) in f32, row-major.
pub(crate) fn q4_int16_rows(
    (packed, scales, mins): (&[u8], &[u16], &[u16]),
    cols: usize,
    r0: usize,
    q: &mut [i16],
    (wscale, wmin): (&mut [f32], &mut [f32]),
) {
    let groups = q.len() / G;
    let g0 = r0 * cols / G;
    assert!(wscale.len() == groups && wmin.len() == groups && packed.len() >= (g0 + groups) * G / 2);
    for (i, q) in q.chunks_exact_mut(G).enumerate() {
        let b = &packed[(g0 + i) * G / 2..][..G / 2];
        #[cfg(target_arch = "x86_64")]
        if super::avx2() {
            // SAFETY: the CPU has AVX2 (checked); `b` holds 16 bytes and `q` 32 values.
            unsafe { nibbles_avx2(b.as_ptr(), q.as_mut_ptr()) };
            continue;
        }
        for (j, &b) in b.iter().enumerate() {
            (q[j], q[j + G / 2]) = (i16::from(b & 15), i16::from(b >> 4));
        }
    }
    for (i, (s, m)) in wscale.iter_mut().zip(wmin).enumerate() {
        (*s, *m) = (f16_value(scales[g0 + i]), f16_value(mins[g0 + i]));
    }
}

/// Rows `r0..` of a Q8 matrix as integers -127..=127 with each group's scale (minimums zero).
pub(crate) fn q8_int16_rows(
    (values, scales): (&[i8], &[u16]),
    cols: usize,
    r0: usize,
    q: &mut [i16],
    (wscale, wmin): (&mut [f32], &mut [f32]),
) {
    let groups = q.len() / G;
    let g0 = r0 * cols / G;
    assert!(wscale.len() == groups && wmin.len() == groups);
    for (q, &v) in q.iter_mut().zip(&values[r0 * cols..][..groups * G]) {
        *q = i16::from(v);
    }
    for (i, (s, m)) in wscale.iter_mut().zip(wmin).enumerate() {
        (*s, *m) = (f16_value(scales[g0 + i]), 0.0);
    }
}

/// A group's 16 bytes as its 32 values: the low nibbles (values 0..16), then the high ones.
///
/// # Safety
/// AVX2; `b` points to 16 bytes, `q` to 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nibbles_avx2(b: *const u8, q: *mut i16) {
    use std::arch::x86_64::*;
    let v = _mm_loadu_si128(b.cast());
    let low = _mm_set1_epi8(15);
    _mm256_storeu_si256(q.cast(), _mm256_cvtepu8_epi16(_mm_and_si128(v, low)));
    _mm256_storeu_si256(q.add(16).cast(), _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), low)));
}

/// `out[t x n] = x . W^T` for `x` rounded by [`Int16Rows`] (`t` rows of `k`) and a weight matrix of
/// `n` rows whose `rows(r0, q, (scale, min))` writes rows `r0..r0 + 16` as integers (row-major, `k`
/// each) with their group scales and minimums (row-major, `k / 32` each). Returns false, touching
/// nothing, unless the kernels running have AVX2 and `n` is a multiple of 16.
pub(crate) fn gemm_int16_par<F>(x: &Int16Rows, n: usize, rows: F, out: &mut [f32]) -> bool
where
    F: Fn(usize, &mut [i16], (&mut [f32], &mut [f32])) + Sync,
{
    let (t, k) = (x.rows(), x.k);
    assert!(out.len() >= t * n);
    #[cfg(target_arch = "x86_64")]
    if super::avx2() && n.is_multiple_of(PANEL) && k > 0 {
        let groups = k / G;
        split_columns_by(n / PANEL, 4, out, |p0, p1, dst| {
            let mut wq = vec![0i16; PANEL * k];
            let (mut ws, mut wm) = (vec![0f32; PANEL * groups], vec![0f32; PANEL * groups]);
            // The panel's integers (pair j of k, row c, element e at `(j * 16 + c) * 2 + e`: 18 KiB
            // at k = 576, in L1 beside a tile of x), its scales and minimums group by group
            // (`[g * 16 + c]`).
            let mut panel = vec![0i16; PANEL * k];
            let (mut scales, mut mins) = (vec![0f32; PANEL * groups], vec![0f32; PANEL * groups]);
            for p in p0..p1 {
                rows(p * PANEL, &mut wq, (&mut ws, &mut wm));
                // SAFETY: the CPU has AVX2 (checked above); `wq` and `panel` hold 16 rows of k/2 pairs
                // of 16-bit values (k a multiple of 32).
                unsafe { super::gemm_f32::transpose16(wq.as_ptr().cast(), k / 2, panel.as_mut_ptr().cast()) };
                for c in 0..PANEL {
                    for g in 0..groups {
                        scales[g * PANEL + c] = ws[c * groups + g];
                        mins[g * PANEL + c] = wm[c * groups + g];
                    }
                }
                let w = (panel.as_ptr(), scales.as_ptr(), mins.as_ptr());
                let mut r = 0;
                while r < t {
                    let tile = (t - r).min(TILE);
                    let xs = XTile {
                        q: x.q[r * k..].as_ptr(),
                        scale: x.scale[r * groups..].as_ptr(),
                        sum: x.sum[r * groups..].as_ptr(),
                    };
                    // SAFETY: the CPU has AVX2 and FMA (checked above); the tile of x from row r holds
                    // `tile` rows of k values (interleaved) and k/32 scales and sums; the panel 16 x k
                    // values and 16 x k/32 scales and minimums; this task alone writes columns
                    // p*16..p*16 + 16 of rows r..r + tile of `out` (n apart).
                    unsafe {
                        let c = dst.add(r * n + p * PANEL);
                        match tile {
                            6 => tile_int16::<6>(xs, k, w, c, n),
                            5 => tile_int16::<5>(xs, k, w, c, n),
                            4 => tile_int16::<4>(xs, k, w, c, n),
                            3 => tile_int16::<3>(xs, k, w, c, n),
                            2 => tile_int16::<2>(xs, k, w, c, n),
                            _ => tile_int16::<1>(xs, k, w, c, n),
                        }
                    }
                    r += tile;
                }
            }
        });
        return true;
    }
    let _ = rows;
    false
}

/// A register tile's input rows: their integers (interleaved by pairs), group scales and sums (`k / 32`
/// apart).
#[derive(Clone, Copy)]
struct XTile {
    q: *const i16,
    scale: *const f32,
    sum: *const f32,
}

/// `R` input rows times one panel of sixteen weight rows into `R` rows of 16 of `c` (`ldc` apart), as
/// the module's arithmetic states.
///
/// # Safety
/// AVX2 and FMA; `x` as [`XTile`] says for `R` rows of `k` (a multiple of 32); `panel` 16 x k values
/// in the panel order, `scales` and `mins` 16 x k/32 in theirs; `c` R rows of 16 writable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_int16<const R: usize>(
    x: XTile,
    k: usize,
    (panel, scales, mins): (*const i16, *const f32, *const f32),
    c: *mut f32,
    ldc: usize,
) {
    use std::arch::x86_64::*;
    let groups = k / G;
    for g in 0..groups {
        let mut acc = [[_mm256_setzero_si256(); 2]; R];
        for j in 0..G / 2 {
            let p = panel.add((g * G / 2 + j) * 2 * PANEL);
            let (w0, w1) = (_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(PANEL).cast()));
            for (r, a) in acc.iter_mut().enumerate() {
                // The pair (x[2j], x[2j + 1]) of row r's group g in every 32-bit lane.
                let pair = _mm256_castps_si256(_mm256_broadcast_ss(
                    &*x.q.add(((g * G / 2 + j) * R + r) * 2).cast::<f32>(),
                ));
                a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(pair, w0));
                a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(pair, w1));
            }
        }
        let s = [_mm256_loadu_ps(scales.add(g * PANEL)), _mm256_loadu_ps(scales.add(g * PANEL + 8))];
        let m = [_mm256_loadu_ps(mins.add(g * PANEL)), _mm256_loadu_ps(mins.add(g * PANEL + 8))];
        for (r, a) in acc.iter().enumerate() {
            let xs = _mm256_set1_ps(*x.scale.add(r * groups + g));
            let xsum = _mm256_set1_ps(*x.sum.add(r * groups + g));
            for (v, a) in a.iter().enumerate() {
                let o = c.add(r * ldc + v * 8);
                let before = if g == 0 { _mm256_setzero_ps() } else { _mm256_loadu_ps(o) };
                let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*a), _mm256_mul_ps(s[v], xs), before);
                _mm256_storeu_ps(o, _mm256_fmadd_ps(xsum, m[v], f));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t` rows of inputs with an outlier channel, as the model's activations have.
    fn inputs(t: usize, k: usize) -> Vec<f32> {
        (0..t * k).map(|i| (i as f32 * 0.37).sin() * if i % k == 7 { 20.0 } else { 1.0 }).collect()
    }

    #[test]
    fn inputs_round_to_sixteen_bits_per_group() {
        let k = 96;
        let mut x = inputs(3, k);
        x[32..96].fill(0.0);
        x[64] = 1e-42;
        let mut rows = Int16Rows::default();
        rows.requantize(&x, k);
        for (gi, grp) in x.chunks_exact(G).enumerate() {
            let max = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(rows.scale[gi], max / QMAX, "group {gi}");
            let inv = inverse_scale(max);
            let (r, k0) = (gi * G / k, gi * G % k);
            for (kk, &v) in grp.iter().enumerate() {
                let q = rows.value(r, k0 + kk);
                assert_eq!(q, (v * inv).round_ties_even() as i16, "group {gi}");
                if max > 1e-30 {
                    assert!(
                        (f32::from(q) * rows.scale[gi] - v).abs() <= rows.scale[gi] * 0.5001,
                        "group {gi}"
                    );
                }
            }
            let want: f64 = grp.iter().map(|&v| f64::from(v)).sum();
            assert!((f64::from(rows.sum[gi]) - want).abs() < 1e-5, "group {gi}");
        }
        assert_eq!(
            (rows.scale[1], rows.scale[2] < 1e-40),
            (0.0, true),
            "zeros and a subnormal: scale 0 or tiny"
        );
        assert!((32..96).all(|kk| rows.value(0, kk) == 0));
    }

    /// A Q4 or Q8 matrix of `n` rows as the kernel reads it: integers, scales and minimums.
    struct Weights {
        q: Vec<i16>,
        scale: Vec<f32>,
        min: Vec<f32>,
    }

    fn weights(n: usize, k: usize, q4: bool) -> Weights {
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos() * 0.1).collect();
        let groups = n * k / G;
        let mut out = Weights { q: vec![0; n * k], scale: vec![0.0; groups], min: vec![0.0; groups] };
        if q4 {
            use crate::quant::QuantMatrix;
            let m = crate::quant::Q4Matrix::quantize(&w, n, k).unwrap();
            q4_int16_rows((&m.packed, &m.scales, &m.mins), k, 0, &mut out.q, (&mut out.scale, &mut out.min));
            for r in 0..n {
                // Each row's values as the matrix's own widening gives them.
                let want = m.dequantize_row(r);
                for (kk, &v) in want.iter().enumerate() {
                    let g = (r * k + kk) / G;
                    assert_eq!(
                        out.min[g] + f32::from(out.q[r * k + kk]) * out.scale[g],
                        v,
                        "row {r} at {kk}"
                    );
                }
            }
        } else {
            use crate::quant::QuantMatrix;
            let m = crate::quant::Q8Matrix::quantize(&w, n, k).unwrap();
            q8_int16_rows((&m.values, &m.scales), k, 0, &mut out.q, (&mut out.scale, &mut out.min));
            for r in 0..n {
                let want = m.dequantize_row(r);
                for (kk, &v) in want.iter().enumerate() {
                    let g = (r * k + kk) / G;
                    assert_eq!(f32::from(out.q[r * k + kk]) * out.scale[g], v, "row {r} at {kk}");
                }
            }
        }
        out
    }

    #[test]
    fn int16_gemm_gives_the_stated_sums_exactly() {
        // Row counts around the 6-row tile, one panel and several, one group and many.
        for (t, k, n, q4) in [(1, 32, 16, true), (7, 64, 32, false), (13, 576, 48, true), (64, 96, 192, true)]
        {
            let x = inputs(t, k);
            let mut rows = Int16Rows::default();
            rows.requantize(&x, k);
            let w = weights(n, k, q4);
            let groups = k / G;
            let mut out = vec![f32::NAN; t * n];
            let fill = |r0: usize, q: &mut [i16], (s, m): (&mut [f32], &mut [f32])| {
                q.copy_from_slice(&w.q[r0 * k..][..q.len()]);
                s.copy_from_slice(&w.scale[r0 * groups..][..s.len()]);
                m.copy_from_slice(&w.min[r0 * groups..][..m.len()]);
            };
            if !gemm_int16_par(&rows, n, fill, &mut out) {
                assert!(!crate::sys::avx2(), "AVX2 takes every shape here");
                continue;
            }
            for r in 0..t {
                for c in 0..n {
                    let mut want = 0f32;
                    for g in 0..groups {
                        let s: i32 = (g * G..(g + 1) * G)
                            .map(|kk| i32::from(rows.value(r, kk)) * i32::from(w.q[c * k + kk]))
                            .sum();
                        let (xg, wg) = (r * groups + g, c * groups + g);
                        want = (s as f32).mul_add(w.scale[wg] * rows.scale[xg], want);
                        want = rows.sum[xg].mul_add(w.min[wg], want);
                    }
                    assert_eq!(out[r * n + c].to_bits(), want.to_bits(), "{t}x{k}x{n} at {r},{c}");
                    // And close to the product of the unrounded inputs and the weights' values.
                    let exact: f64 = (0..k)
                        .map(|kk| {
                            let g = (c * k + kk) / G;
                            f64::from(x[r * k + kk])
                                * f64::from(w.min[g] + f32::from(w.q[c * k + kk]) * w.scale[g])
                        })
                        .sum();
                    assert!(
                        (f64::from(want) - exact).abs() < 2e-4 * (1.0 + exact.abs()),
                        "{r},{c}: {want} against {exact}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_nan_input_reaches_the_outputs_of_its_row_only() {
        let (t, k, n) = (8, 64, 16);
        let mut x = inputs(t, k);
        x[3 * k + 40] = f32::NAN;
        let mut rows = Int16Rows::default();
        rows.requantize(&x, k);
        let w = weights(n, k, true);
        let groups = k / G;
        let mut out = vec![0f32; t * n];
        let fill = |r0: usize, q: &mut [i16], (s, m): (&mut [f32], &mut [f32])| {
            q.copy_from_slice(&w.q[r0 * k..][..q.len()]);
            s.copy_from_slice(&w.scale[r0 * groups..][..s.len()]);
            m.copy_from_slice(&w.min[r0 * groups..][..m.len()]);
        };
        if gemm_int16_par(&rows, n, fill, &mut out) {
            for (r, row) in out.chunks_exact(n).enumerate() {
                assert_eq!(row.iter().all(|v| v.is_nan()), r == 3, "row {r}");
                assert!(r == 3 || row.iter().all(|v| v.is_finite()), "row {r}");
            }
        }
    }
}
