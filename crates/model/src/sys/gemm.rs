//! The bf16 products: the f32 -> bf16 rounding of activations, the bf16 GEMM over pre-packed 32-row
//! panels (`--weights bf16`; on AMX tiles in the `amx` family, `amx.rs`), and the register tile the
//! bf16 rows product of quantized weights runs (`rows_bf16.rs`), each with the portable loop it is
//! tested against.

use crate::bits16::{bf16_bits, bf16_value};

/// Whether [`gemm_bf16_par`]'s kernel runs on this CPU (AVX-512F and AVX-512 BF16).
pub(crate) fn has_bf16_gemm() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx512() && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i] = bf16(x[i])`, rounding to nearest even (the AVX-512 BF16 conversion where the CPU has
/// it, which also flushes subnormals to zero).
pub(crate) fn to_bf16(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if has_bf16_gemm() {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked); the lengths are equal.
            unsafe { to_bf16_avx512(x, out) };
            return;
        }
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16_bits(v);
    }
}

/// # Safety
/// AVX-512F and AVX-512 BF16; `x.len() == out.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn to_bf16_avx512(x: &[f32], out: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY (of the load and store): i + 16 <= n for both slices.
        let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(x.as_ptr().add(i))));
        _mm256_storeu_si256(out.as_mut_ptr().add(i) as *mut __m256i, v);
        i += 16;
    }
    for j in i..n {
        out[j] = bf16_bits(x[j]);
    }
}

/// Values of k per block of the bf16 GEMM: a panel's block (256 x 32 bf16, 16 KiB) stays in L1 while
/// every row tile streams past it.
const BF16_KC: usize = 256;

/// `out[t x n] = x[t x k] . W^T` for a whole matrix packed by [`pack_bf16_panels`] (`n` rows, a
/// multiple of 32; `k` even): `xb` holds x in bf16, products of bf16 values are summed in f32. The
/// panels are split evenly over rayon's pool, each part written straight into its columns of `out`.
/// Runs the AMX kernel in the `amx` family, the AVX-512 BF16 kernel elsewhere where
/// [`has_bf16_gemm`], else a scalar loop (which callers avoid: without the instructions they keep
/// f32 weights).
pub(crate) fn gemm_bf16_par(xb: &[u16], t: usize, k: usize, panels: &[u16], n: usize, out: &mut [f32]) {
    assert!(k.is_multiple_of(2) && k > 0 && n.is_multiple_of(32), "k must be even and n a multiple of 32");
    assert!(xb.len() >= t * k && panels.len() >= n * k && out.len() >= t * n);
    let np = n / 32;
    if !has_bf16_gemm() {
        gemm_bf16_portable(xb, t, k, panels, n, out);
        return;
    }
    let amx = super::amx();
    split_columns(np, out, |p0, p1, dst| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above), and AMX with the tile state
        // where `amx` (the family is chosen only then); the lengths were asserted; this task writes
        // columns p0*32..p1*32 of each of the t rows (n apart) and no other task does.
        unsafe {
            if amx {
                super::amx::gemm_bf16_amx(xb, t, k, panels, p0, p1 - p0, dst.add(p0 * 32), n)
            } else {
                gemm_bf16_avx512(xb, t, k, panels, p0, p1 - p0, dst.add(p0 * 32), n)
            }
        };
    });
}

/// Adds pairs `k0 / 2..k / 2` of each of the t rows of x to one panel's sums (`out`: t rows `ldo`
/// apart of 32 f32; set rather than added when `k0` is 0): the AMX kernel's tail of k.
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `xb` t rows of `k` values, `pan` the panel (`32 k` values), `out` as
/// above.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tail_bf16(
    xb: &[u16],
    t: usize,
    k: usize,
    k0: usize,
    pan: *const u16,
    out: *mut f32,
    ldo: usize,
) {
    row_tiles!(t, |i| tile_bf16(
        xb.as_ptr().add(i * k + k0),
        k,
        (k - k0) / 2,
        pan.add(k0 * 32),
        out.add(i * ldo),
        ldo,
        k0 == 0
    ));
}

/// Splits `units` (panels or groups of output columns) into even shares over rayon's pool (two per
/// thread) and runs `task(u0, u1, out)` for each share `u0..u1`, handing every task `out`'s address:
/// each task must write only its own share's columns, so no two write the same element.
pub(super) fn split_columns(units: usize, out: &mut [f32], task: impl Fn(usize, usize, *mut f32) + Sync) {
    split_columns_by(units, 2, out, task);
}

/// [`split_columns`] in `per_thread` shares per thread: more where a share's cost does not grow with
/// their number, so that a thread slowed by its core's other work (a sibling hyperthread, another
/// process) leaves a smaller tail to the rest.
pub(super) fn split_columns_by(
    units: usize,
    per_thread: usize,
    out: &mut [f32],
    task: impl Fn(usize, usize, *mut f32) + Sync,
) {
    let chunks = (rayon::current_num_threads().max(1) * per_thread).min(units);
    /// `out`'s address, shared by tasks that write disjoint columns.
    struct Out(*mut f32);
    // SAFETY: tasks write only their own columns of `out` (the contract above), so no two write the
    // same element.
    unsafe impl Sync for Out {}
    let dst = Out(out.as_mut_ptr());
    let dst = &dst;
    use rayon::prelude::*;
    (0..chunks).into_par_iter().for_each(|c| task(c * units / chunks, (c + 1) * units / chunks, dst.0));
}

/// Weight rows the bf16 rows product (`rows_bf16.rs`) widens and dots at a time (one register
/// tile's columns).
pub(super) const ROWS_TILE: usize = 4;

/// R rows of x (bf16, `k` each, contiguous) dotted with four weight rows (bf16, `k` each, contiguous):
/// `out[r * ldo + c] = x[r] . w[c]`, 32 values of k per step, one 16-lane f32 sum per (r, c).
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `k` a multiple of 32; `px` R x k values, `pw` 4 x k, `po` R rows (`ldo`
/// apart) of 4 writable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tile_dot<const R: usize>(
    px: *const u16,
    k: usize,
    pw: *const u16,
    po: *mut f32,
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); ROWS_TILE]; R];
    let mut kk = 0;
    while kk < k {
        // (A loop, not `array::from_fn`: its closure is not inlined into this function's target
        // features, which costs a call per weight row and step.)
        let mut w = [_mm512_setzero_si512(); ROWS_TILE];
        for (c, w) in w.iter_mut().enumerate() {
            *w = _mm512_loadu_si512(pw.add(c * k + kk).cast());
        }
        let w: [__m512bh; ROWS_TILE] = std::mem::transmute(w);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(px.add(r * k + kk).cast()));
            for (ac, wc) in a.iter_mut().zip(&w) {
                *ac = _mm512_dpbf16_ps(*ac, xv, *wc);
            }
        }
        kk += 32;
    }
    for (r, a) in acc.iter().enumerate() {
        _mm_storeu_ps(po.add(r * ldo), sum4(a));
    }
}

/// The sums of four 16-lane vectors, as one 4-lane vector: pairs interleaved and added within each
/// 128-bit lane twice (each lane then holds four partial sums, one per input), then the four lanes
/// added together. About a third of the instructions of four separate reductions.
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sum4(a: &[std::arch::x86_64::__m512; ROWS_TILE]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // Per 128-bit lane: [a0.0+a0.2, a1.0+a1.2, a0.1+a0.3, a1.1+a1.3], and likewise for a2, a3.
    let s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    let s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    // Per 128-bit lane: [a0, a1, a2, a3], each the sum of that lane's four values.
    let (d01, d23) = (_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    let t = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)),
    );
    // The four lanes together.
    let u = _mm512_add_ps(t, _mm512_shuffle_f32x4::<0b01_00_11_10>(t, t));
    let v = _mm512_add_ps(u, _mm512_shuffle_f32x4::<0b10_11_00_01>(u, u));
    _mm512_castps512_ps128(v)
}

/// Packs row-major `w[rows x cols]` (`rows` a multiple of 32, `cols` even) into bf16 panels of 32
/// rows: panel p, pair j of columns, row c, element e at `((p * cols/2 + j) * 32 + c) * 2 + e`, so a
/// 64-byte load gives 16 rows' pair j, which one `vdpbf16ps` multiplies by a broadcast pair of x.
pub(crate) fn pack_bf16_panels(w: &[f32], rows: usize, cols: usize) -> Vec<u16> {
    assert!(rows.is_multiple_of(32) && cols.is_multiple_of(2) && w.len() == rows * cols);
    let mut out = vec![0u16; rows * cols];
    for (r, row) in w.chunks_exact(cols).enumerate() {
        let (p, c) = (r / 32, r % 32);
        for (j, pair) in row.chunks_exact(2).enumerate() {
            let at = ((p * cols / 2 + j) * 32 + c) * 2;
            out[at] = bf16_bits(pair[0]);
            out[at + 1] = bf16_bits(pair[1]);
        }
    }
    out
}

fn gemm_bf16_portable(xb: &[u16], t: usize, k: usize, panels: &[u16], n: usize, out: &mut [f32]) {
    for r in 0..t {
        for row in 0..n {
            let (p, c) = (row / 32, row % 32);
            let mut acc = 0f32;
            for j in 0..k / 2 {
                let at = ((p * k / 2 + j) * 32 + c) * 2;
                acc += bf16_value(xb[r * k + 2 * j]) * bf16_value(panels[at])
                    + bf16_value(xb[r * k + 2 * j + 1]) * bf16_value(panels[at + 1]);
            }
            out[r * n + row] = acc;
        }
    }
}

/// # Safety
/// AVX-512F and AVX-512 BF16; `xb` and `panels` as [`gemm_bf16`] asserts; `out` has t rows, `ldo`
/// apart, of `np * 32` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_bf16_avx512(
    xb: &[u16],
    t: usize,
    k: usize,
    panels: &[u16],
    p0: usize,
    np: usize,
    out: *mut f32,
    ldo: usize,
) {
    for p in 0..np {
        let pan = panels.as_ptr().add((p0 + p) * 32 * k);
        let mut k0 = 0;
        while k0 < k {
            let kc = BF16_KC.min(k - k0);
            let (first, pb) = (k0 == 0, pan.add(k0 * 32));
            row_tiles!(t, |i| tile_bf16(
                xb.as_ptr().add(i * k + k0),
                k,
                kc / 2,
                pb,
                out.add(i * ldo + p * 32),
                ldo,
                first
            ));
            k0 += kc;
        }
    }
}

/// One R x 32 tile over `pairs` pairs of k: `out[r][0..32] (+)= sum_j x[r][2j..2j+2] . pb[j][0..32]`.
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `px` holds R rows (`ldx` apart) of `2 * pairs` bf16 values, `pb`
/// `pairs * 64` values, `po` R rows (`ldo` apart) of 32 writable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_bf16<const R: usize>(
    px: *const u16,
    ldx: usize,
    pairs: usize,
    pb: *const u16,
    po: *mut f32,
    ldo: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if !first {
        for (r, a) in acc.iter_mut().enumerate() {
            a[0] = _mm512_loadu_ps(po.add(r * ldo));
            a[1] = _mm512_loadu_ps(po.add(r * ldo + 16));
        }
    }
    for j in 0..pairs {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_ps(pb.add(j * 64) as *const f32));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_ps(pb.add(j * 64 + 32) as *const f32));
        for (r, a) in acc.iter_mut().enumerate() {
            let pair = std::ptr::read_unaligned(px.add(r * ldx + 2 * j) as *const i32);
            let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
            a[0] = _mm512_dpbf16_ps(a[0], xv, b0);
            a[1] = _mm512_dpbf16_ps(a[1], xv, b1);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(po.add(r * ldo), a[0]);
        _mm512_storeu_ps(po.add(r * ldo + 16), a[1]);
    }
}

#[cfg(test)]
mod tests {
    use crate::bits16::{bf16_bits, bf16_value};

    /// Batch invariance of the bf16 GEMM on this process's kernels (AMX tiles, AVX-512 BF16): every
    /// row of a product of many rows is, bit for bit, that row's product alone, whatever its place
    /// among 16-row groups and with a tail of k after the tile steps.
    #[test]
    fn every_row_of_a_bf16_product_is_that_row_alone_exactly() {
        for (t, k, rows) in [(50, 600, 64), (33, 1088, 32), (16, 64, 96), (5, 1538, 32)] {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.731).sin() * (1.0 + (i % 7) as f32)).collect();
            let w: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.173).cos()).collect();
            let panels = super::pack_bf16_panels(&w, rows, k);
            let mut xb = vec![0u16; t * k];
            super::to_bf16(&x, &mut xb);
            let mut all = vec![f32::NAN; t * rows];
            super::gemm_bf16_par(&xb, t, k, &panels, rows, &mut all);
            for r in 0..t {
                let mut one = vec![f32::NAN; rows];
                super::gemm_bf16_par(&xb[r * k..(r + 1) * k], 1, k, &panels, rows, &mut one);
                let many: Vec<u32> = all[r * rows..(r + 1) * rows].iter().map(|v| v.to_bits()).collect();
                let alone: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                assert_eq!(many, alone, "t {t} k {k}: row {r} differs from the row alone");
            }
        }
    }

    #[test]
    fn bf16_gemm_matches_a_product_of_the_rounded_values() {
        // Panel counts of 1 to 5: more than one per pool task, and fewer panels than tasks.
        // On AMX tiles also: one and two 16-row groups with a remainder (17, 40, 48), blocks of k
        // past the first (1,088 values) and a tail of k after whole tile steps (600, 1,538).
        for (t, k, rows) in [
            (1, 2, 32),
            (7, 40, 64),
            (13, 576, 96),
            (6, 1538, 64),
            (3, 64, 160),
            (17, 600, 32),
            (40, 1088, 64),
            (48, 64, 32),
        ] {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let panels = super::pack_bf16_panels(&w, rows, k);
            let mut xb = vec![0u16; t * k];
            super::to_bf16(&x, &mut xb);
            for (a, &v) in xb.iter().zip(&x) {
                assert_eq!(*a, bf16_bits(v), "the vector conversion rounds like the scalar one");
            }
            // The parallel product (each task writing its panels' columns in place) and the scalar loop.
            let mut fast = vec![f32::NAN; t * rows];
            let mut slow = vec![f32::NAN; t * rows];
            super::gemm_bf16_par(&xb, t, k, &panels, rows, &mut fast);
            super::gemm_bf16_portable(&xb, t, k, &panels, rows, &mut slow);
            for r in 0..t {
                for row in 0..rows {
                    let rounded: f64 = (0..k)
                        .map(|kk| {
                            f64::from(bf16_value(xb[r * k + kk]))
                                * f64::from(bf16_value(bf16_bits(w[row * k + kk])))
                        })
                        .sum();
                    let exact: f64 =
                        (0..k).map(|kk| f64::from(x[r * k + kk]) * f64::from(w[row * k + kk])).sum();
                    let (f, s) = (f64::from(fast[r * rows + row]), f64::from(slow[r * rows + row]));
                    assert!(
                        (f - rounded).abs() < 1e-3 && (s - rounded).abs() < 1e-3,
                        "t {t} k {k} r {r} row {row}"
                    );
                    // bf16 keeps 8 significant bits: each rounded factor is within 2^-9 relative, so
                    // each product within about 2^-8 of its magnitude.
                    let scale: f64 = (0..k)
                        .map(|kk| f64::from(x[r * k + kk]).abs() * f64::from(w[row * k + kk]).abs())
                        .sum();
                    assert!((f - exact).abs() <= scale / 256.0 + 1e-4, "t {t} k {k}: {f} vs {exact}");
                }
            }
        }
    }
}
