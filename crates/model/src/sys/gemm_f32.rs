//! Multi-row steps' products with weights held in another form (quantized, f16) on the f32 FMA units,
//! for CPUs whose widest kernel family is AVX2 (no bf16 products): the weights are widened to f32 as
//! the product reads them, never held in f32 whole. Steps of a few rows dot each row with blocks of
//! widened weight rows ([`gemm_f32_rows_par`]); long ones (a prompt's prefill) widen sixteen rows at
//! a time into a panel transposed so that each step of k reads them in two vectors, and multiply
//! every row of x by it in register tiles of up to six rows by sixteen columns ([`gemm_f32_panels_par`],
//! `gemm_nn`'s tile: a broadcast of x and two FMAs a row and step of k).

use super::gemm::{split_columns_by, ROWS_TILE};

/// `out[t x n] = x[t x k] . W^T` for a matrix held in another form: `rows(r0, dst)` writes its rows
/// from `r0` on (as many as `dst` holds, `k` values each) in f32 row-major. Steps of
/// [`PANEL_MIN_ROWS`] rows or more take the panels where `n` is a multiple of 16, others the dot
/// tiles. Returns false, touching nothing, unless the kernels running have AVX2, `n` is a multiple
/// of 4 and `k` of 8 (and not 0).
pub(crate) fn gemm_f32_widened_par<F>(
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
    rows: F,
    out: &mut [f32],
) -> bool
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if !super::avx2() || !k.is_multiple_of(8) || k == 0 || !n.is_multiple_of(ROWS_TILE) {
        return false;
    }
    if t < PANEL_MIN_ROWS || !gemm_f32_panels_par(x, t, k, n, &rows, out) {
        gemm_f32_rows_par(x, t, k, n, rows, out);
    }
    true
}

/// Steps of at least this many rows take the panels. Measured (scratch timing of each product alone
/// under `--cpu-kernels avx2`, Q4 weights, two threads, GFLOP/s dot tiles against panels, Zen 4):
/// 32 rows 177/154 (576 x 1,536), 157/151 (1,536 x 576); 64 rows 181-187/185-189, 169-171/181-188;
/// 128 rows 202/204, 160-173/202-204; 512 rows 194-201/203-215, 163-178/214-218, 167-176/175-210
/// (192 x 576).
pub(crate) const PANEL_MIN_ROWS: usize = 64;

/// Weight rows (columns of the product) in a panel.
pub(super) const PANEL: usize = 16;

/// Values of k per block: at most a 6 x 2,048 tile of x (48 KiB) is read while a block of panels
/// (128 KiB each) streams from L2 past it; the models here have k of 576 to 1,536, so one block.
const KC: usize = 2048;

/// Panels multiplied together: each tile of x meets both before the next tile is read, which halves
/// the reads of x (beyond L2 at 512 rows of 576).
const GROUP: usize = 2;

/// `out[t x n] = x[t x k] . W^T` on the f32 FMA units (AVX2) for a matrix held in another form:
/// `rows(r0, dst)` writes its rows from `r0` on (as many as `dst` holds, `k` values each) in f32
/// row-major. Each panel of sixteen rows is widened once per product and transposed, then multiplied
/// by every row of x. Each value is a sum over k in order, one FMA a step, from zero (the value of
/// `x[r].iter().zip(w[c]).fold(0, |s, (a, b)| a.mul_add(b, s))`). Returns false, touching nothing,
/// unless the kernels running have AVX2, `n` is a multiple of 16 and `k` of 8 (and not 0).
fn gemm_f32_panels_par<F>(x: &[f32], t: usize, k: usize, n: usize, rows: F, out: &mut [f32]) -> bool
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    assert!(x.len() >= t * k && out.len() >= t * n);
    #[cfg(target_arch = "x86_64")]
    if super::avx2() && n.is_multiple_of(PANEL) && k.is_multiple_of(8) && k > 0 {
        let np = n / PANEL;
        split_columns_by(np, 4, out, |p0, p1, dst| {
            let mut wide = vec![0f32; PANEL * k];
            let mut panels = vec![0f32; GROUP.min(p1 - p0) * PANEL * k];
            let mut g0 = p0;
            while g0 < p1 {
                let g1 = (g0 + GROUP).min(p1);
                for p in g0..g1 {
                    rows(p * PANEL, &mut wide);
                    // SAFETY: the CPU has AVX2 (checked above); both hold 16 x k values, k a multiple of 8.
                    unsafe {
                        transpose16(
                            wide.as_ptr(),
                            k,
                            panels[(p - g0) * PANEL * k..][..PANEL * k].as_mut_ptr(),
                        )
                    };
                }
                let mut k0 = 0;
                while k0 < k {
                    let kc = KC.min(k - k0);
                    let mut i = 0;
                    while i < t {
                        let r = (t - i).min(6);
                        for p in g0..g1 {
                            // SAFETY: the CPU has AVX2 and FMA (checked above); rows i..i + r of x hold k
                            // values (asserted), of which k0..k0 + kc are read; panel p holds rows
                            // k0..k0 + kc of 16 values; this task alone writes columns p*16..p*16 + 16 of
                            // rows i..i + r of `out` (n apart).
                            unsafe {
                                let a = x.as_ptr().add(i * k + k0);
                                let b = panels.as_ptr().add((p - g0) * PANEL * k + k0 * PANEL);
                                let c = dst.add(i * n + p * PANEL);
                                let add = k0 > 0;
                                use super::gemm_nn::nn_tile_avx2 as tile;
                                match r {
                                    6 => tile::<6>(a, k, kc, b, PANEL, c, n, add),
                                    5 => tile::<5>(a, k, kc, b, PANEL, c, n, add),
                                    4 => tile::<4>(a, k, kc, b, PANEL, c, n, add),
                                    3 => tile::<3>(a, k, kc, b, PANEL, c, n, add),
                                    2 => tile::<2>(a, k, kc, b, PANEL, c, n, add),
                                    _ => tile::<1>(a, k, kc, b, PANEL, c, n, add),
                                }
                            }
                        }
                        i += r;
                    }
                    k0 += kc;
                }
                g0 = g1;
            }
        });
        return true;
    }
    let _ = rows;
    false
}

/// `out[t x n] = x[t x k] . W^T` on the f32 FMA units (AVX2) for a matrix held in another form
/// (quantized): `rows(r0, dst)` writes its rows `r0..r0 + 4`, every column, in f32 row-major into
/// `dst` (4 x k), a block of such groups at a time (in L2), and every row of x is dotted with them
/// there, three rows at a time, so the weights are widened once per product, never held in f32
/// whole, and nothing is copied into a GEMM's panels (what matrixmultiply spent a fifth of an AVX2
/// 32-row step on). `n` must be a multiple of 4, `k` of 8 (and not 0).
/// Portable dot products without AVX2 (callers take the f32 GEMM there).
fn gemm_f32_rows_par<F>(x: &[f32], t: usize, k: usize, n: usize, rows: F, out: &mut [f32])
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    assert!(k.is_multiple_of(8) && k > 0 && n.is_multiple_of(ROWS_TILE), "n: multiple of 4, k: of 8");
    assert!(x.len() >= t * k && out.len() >= t * n);
    let groups = n / ROWS_TILE;
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // Groups widened together (about 128 KiB of f32, in L2): each tile of three x rows, in L1, is
        // dotted with all of them before the next tile is read.
        let block = (32 * 1024 / (ROWS_TILE * k)).max(1);
        // Eight shares per thread, as the int8 GEMM: a share widens only its own groups.
        split_columns_by(groups, 8, out, |g0, g1, dst| {
            let mut w = vec![0f32; block.min(g1 - g0) * ROWS_TILE * k];
            let mut b0 = g0;
            while b0 < g1 {
                let b1 = (b0 + block).min(g1);
                for g in b0..b1 {
                    rows(g * ROWS_TILE, &mut w[(g - b0) * ROWS_TILE * k..][..ROWS_TILE * k]);
                }
                let mut r = 0;
                while r < t {
                    let tile = (t - r).min(3);
                    for g in b0..b1 {
                        // SAFETY: the CPU has AVX2 and FMA (checked above); x rows r..r+tile hold k
                        // values each, `w` holds group g's 4 rows of k at its offset; this task alone
                        // writes columns g*4..g*4+4 of each row.
                        unsafe {
                            let pw = w.as_ptr().add((g - b0) * ROWS_TILE * k);
                            let (px, po) = (x.as_ptr().add(r * k), dst.add(r * n + g * ROWS_TILE));
                            match tile {
                                3 => tile_dot_f32::<3>(px, k, pw, po, n),
                                2 => tile_dot_f32::<2>(px, k, pw, po, n),
                                _ => tile_dot_f32::<1>(px, k, pw, po, n),
                            }
                        }
                    }
                    r += tile;
                }
                b0 = b1;
            }
        });
        return;
    }
    let mut w = vec![0f32; ROWS_TILE * k];
    for g in 0..groups {
        rows(g * ROWS_TILE, &mut w);
        for r in 0..t {
            for (c, wr) in w.chunks_exact(k).enumerate() {
                out[r * n + g * ROWS_TILE + c] =
                    x[r * k..(r + 1) * k].iter().zip(wr).map(|(a, b)| a * b).sum();
            }
        }
    }
}

/// R rows of x (f32, `k` each, contiguous) dotted with four weight rows (f32, `k` each, contiguous):
/// `out[r * ldo + c] = x[r] . w[c]`, 8 values of k per step, one 8-lane sum per (r, c): 3 x 4 of them
/// and three rows of x fill the sixteen registers, the weights coming straight from L1.
///
/// # Safety
/// AVX2 and FMA; `k` a multiple of 8; `px` R x k values, `pw` 4 x k, `po` R rows (`ldo` apart) of 4
/// writable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_dot_f32<const R: usize>(px: *const f32, k: usize, pw: *const f32, po: *mut f32, ldo: usize) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); ROWS_TILE]; R];
    let mut kk = 0;
    while kk < k {
        let xv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(px.add(r * k + kk)));
        for c in 0..ROWS_TILE {
            let wc = _mm256_loadu_ps(pw.add(c * k + kk));
            for (a, x) in acc.iter_mut().zip(&xv) {
                a[c] = _mm256_fmadd_ps(*x, wc, a[c]);
            }
        }
        kk += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        // Pairs added (a0 a1 | a0 a1 ...), twice, then the two 128-bit halves: [a0, a1, a2, a3].
        let s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_storeu_ps(po.add(r * ldo), _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s)));
    }
}

/// `panel[kk * 16 + c] = rows[c * k + kk]`: sixteen rows of k 32-bit values (f32, or pairs of 16-bit
/// integers) turned into k rows of sixteen, eight by eight in registers; the bits move unchanged.
///
/// # Safety
/// AVX2; `rows` and `panel` point to 16 x k values, `k` a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose16(rows: *const f32, k: usize, panel: *mut f32) {
    use std::arch::x86_64::*;
    debug_assert!(k.is_multiple_of(8));
    for c0 in [0, 8] {
        for k0 in (0..k).step_by(8) {
            let v: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(rows.add((c0 + c) * k + k0)));
            // Pairs of rows interleaved, then pairs of pairs: each 128-bit half holds a 4 x 4 block
            // transposed; the halves are then exchanged between the two 4-row groups.
            let t0 = _mm256_unpacklo_ps(v[0], v[1]);
            let t1 = _mm256_unpackhi_ps(v[0], v[1]);
            let t2 = _mm256_unpacklo_ps(v[2], v[3]);
            let t3 = _mm256_unpackhi_ps(v[2], v[3]);
            let t4 = _mm256_unpacklo_ps(v[4], v[5]);
            let t5 = _mm256_unpackhi_ps(v[4], v[5]);
            let t6 = _mm256_unpacklo_ps(v[6], v[7]);
            let t7 = _mm256_unpackhi_ps(v[6], v[7]);
            let s0 = _mm256_shuffle_ps::<0b01_00_01_00>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0b11_10_11_10>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0b01_00_01_00>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0b11_10_11_10>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0b01_00_01_00>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0b11_10_11_10>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0b01_00_01_00>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0b11_10_11_10>(t5, t7);
            let out = [
                _mm256_permute2f128_ps::<0x20>(s0, s4),
                _mm256_permute2f128_ps::<0x20>(s1, s5),
                _mm256_permute2f128_ps::<0x20>(s2, s6),
                _mm256_permute2f128_ps::<0x20>(s3, s7),
                _mm256_permute2f128_ps::<0x31>(s0, s4),
                _mm256_permute2f128_ps::<0x31>(s1, s5),
                _mm256_permute2f128_ps::<0x31>(s2, s6),
                _mm256_permute2f128_ps::<0x31>(s3, s7),
            ];
            for (j, o) in out.iter().enumerate() {
                _mm256_storeu_ps(panel.add((k0 + j) * PANEL + c0), *o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn f32_row_gemm_matches_a_naive_product() {
        // Row counts around the 3-row tile, and fewer weight groups than pool tasks.
        // 4,096 and 8,192 values a row: blocks of two groups and of one, several a task.
        let shapes = [(1, 8, 4), (2, 40, 8), (3, 576, 12), (7, 64, 96), (32, 576, 192), (5, 1536, 4)];
        for (t, k, n) in shapes.into_iter().chain([(4, 4096, 64), (5, 8192, 40)]) {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut out = vec![f32::NAN; t * n];
            super::gemm_f32_rows_par(
                &x,
                t,
                k,
                n,
                |r0, dst| dst.copy_from_slice(&w[r0 * k..(r0 + 4) * k]),
                &mut out,
            );
            for r in 0..t {
                for c in 0..n {
                    let want: f64 =
                        (0..k).map(|kk| f64::from(x[r * k + kk]) * f64::from(w[c * k + kk])).sum();
                    assert!((f64::from(out[r * n + c]) - want).abs() < 1e-3, "t {t} k {k} r {r} c {c}");
                }
            }
        }
    }

    #[test]
    fn panel_gemm_sums_each_product_in_order() {
        // Row counts around the 6-row tile, k over several blocks and not a multiple of them.
        for (t, k, n) in [(1, 8, 16), (6, 40, 32), (7, 576, 48), (13, 264, 16), (64, 1536, 32), (5, 520, 192)]
        {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut out = vec![f32::NAN; t * n];
            let fill = |r0: usize, dst: &mut [f32]| dst.copy_from_slice(&w[r0 * k..][..dst.len()]);
            if !super::gemm_f32_panels_par(&x, t, k, n, fill, &mut out) {
                assert!(!crate::sys::avx2(), "AVX2 takes every shape here");
                continue;
            }
            for r in 0..t {
                for c in 0..n {
                    let want = (0..k).fold(0f32, |s, kk| x[r * k + kk].mul_add(w[c * k + kk], s));
                    assert_eq!(out[r * n + c].to_bits(), want.to_bits(), "{t}x{k}x{n} at {r},{c}");
                }
            }
        }
    }
}
