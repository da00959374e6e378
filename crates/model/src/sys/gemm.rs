//! Matrix products: the f32 GEMMs (matrixmultiply for small batches, an AVX-512 kernel for 64+ rows,
//! strided), the f32 -> bf16 rounding of activations, and the bf16 GEMM over pre-packed 32-row panels
//! (AVX-512 BF16), each with the portable loop it is tested against.

use crate::bits16::{bf16_bits, bf16_value};

/// `c[m×n] = a[m×k] · b[k×n]` with explicit row and column strides (in elements), through
/// matrixmultiply's runtime-dispatched SIMD kernels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    c: &mut [f32],
    (rsc, csc): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    if k > 0 {
        assert!(last(m, k, rsa, csa) < a.len(), "a is too short for its shape");
        assert!(last(k, n, rsb, csb) < b.len(), "b is too short for its shape");
    }
    assert!(last(m, n, rsc, csc) < c.len(), "c is too short for its shape");
    // Distinct elements of c must not alias, or the kernel's writes would race with each other.
    assert!(csc >= 1 && rsc > (n - 1) * csc || rsc >= 1 && csc > (m - 1) * rsc, "c's strides alias");
    // SAFETY: the assertions above keep every index the kernel computes for a, b and c inside the
    // slices, and c's elements are distinct. `c` is borrowed mutably, so nothing else reads or writes
    // it during the call; a and b are only read.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            0.0,
            c.as_mut_ptr(),
            rsc as isize,
            csc as isize,
        );
    }
}

/// `part[t x cols] = x[t x k] . w[cols x k]^T` (row-major, `w` holding `cols` rows of `k`) with an
/// AVX-512 kernel: B is packed into 32-column panels, a 6 x 32 register tile runs the k loop. Returns
/// false, touching nothing, where the CPU lacks AVX-512F or `cols` is not a multiple of 32.
pub(crate) fn sgemm_xwt_avx512(
    x: &[f32],
    t: usize,
    k: usize,
    w: &[f32],
    cols: usize,
    part: &mut [f32],
) -> bool {
    sgemm_xwt_avx512_strided((x, k), t, k, (w, k), cols, part)
}

/// [`sgemm_xwt_avx512`] over the first `k` values of rows that are `ldx` (x) and `ldw` (w) apart.
pub(crate) fn sgemm_xwt_avx512_strided(
    (x, ldx): (&[f32], usize),
    t: usize,
    k: usize,
    (w, ldw): (&[f32], usize),
    cols: usize,
    part: &mut [f32],
) -> bool {
    assert!(ldx >= k && ldw >= k && part.len() >= t * cols);
    assert!(t == 0 || x.len() >= (t - 1) * ldx + k);
    assert!(cols == 0 || w.len() >= (cols - 1) * ldw + k);
    #[cfg(target_arch = "x86_64")]
    {
        if cols.is_multiple_of(32) && k > 0 && super::avx512() {
            // SAFETY: the CPU supports AVX-512F (checked) and the lengths were asserted above.
            unsafe { sgemm_xwt_avx512_impl((x, ldx), t, k, (w, ldw), cols, part) };
            return true;
        }
    }
    false
}

/// # Safety
/// AVX-512F; lengths as [`sgemm_xwt_avx512_strided`] asserts, `cols % 32 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sgemm_xwt_avx512_impl(
    (x, ldx): (&[f32], usize),
    t: usize,
    k: usize,
    (w, ldw): (&[f32], usize),
    cols: usize,
    part: &mut [f32],
) {
    // K is cut into blocks whose 32-column panel (KC x 32 floats, 32 KiB) stays in L1 while every row
    // tile of x streams past it; the tile's sums carry over from block to block through `part`.
    const KC: usize = 256;
    let mut packed = vec![0f32; KC.min(k) * 32];
    for p in 0..cols / 32 {
        let mut k0 = 0;
        while k0 < k {
            let kc = KC.min(k - k0);
            for c in 0..32 {
                let row = &w[(p * 32 + c) * ldw + k0..(p * 32 + c) * ldw + k0 + kc];
                for (kk, &v) in row.iter().enumerate() {
                    packed[kk * 32 + c] = v;
                }
            }
            let (first, pb, po) = (k0 == 0, packed.as_ptr(), part.as_mut_ptr());
            row_tiles!(t, |i| tile(
                x.as_ptr().add(i * ldx + k0),
                ldx,
                kc,
                pb,
                po.add(i * cols + p * 32),
                cols,
                first
            ));
            k0 += kc;
        }
    }
}

/// One R x 32 tile over `kc` values of k: `out[r][0..32] (+)= sum_kk x[r][kk] * packed[kk][0..32]`,
/// x rows `ldx` apart, out rows `ldo` apart; `first` starts from zero instead of `out`.
///
/// # Safety
/// AVX-512F; `px` holds R rows (ldx apart) of at least `kc` values, `pb` kc x 32 values, `po` R rows
/// of 32 writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize>(
    px: *const f32,
    ldx: usize,
    kc: usize,
    pb: *const f32,
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
    for kk in 0..kc {
        let b0 = _mm512_loadu_ps(pb.add(kk * 32));
        let b1 = _mm512_loadu_ps(pb.add(kk * 32 + 16));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*px.add(r * ldx + kk));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(po.add(r * ldo), a[0]);
        _mm512_storeu_ps(po.add(r * ldo + 16), a[1]);
    }
}

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
/// Runs the AVX-512 BF16 kernel where [`has_bf16_gemm`], else a scalar loop (which callers avoid:
/// without the instructions they keep f32 weights).
pub(crate) fn gemm_bf16_par(xb: &[u16], t: usize, k: usize, panels: &[u16], n: usize, out: &mut [f32]) {
    assert!(k.is_multiple_of(2) && k > 0 && n.is_multiple_of(32), "k must be even and n a multiple of 32");
    assert!(xb.len() >= t * k && panels.len() >= n * k && out.len() >= t * n);
    let np = n / 32;
    if !has_bf16_gemm() {
        gemm_bf16_portable(xb, t, k, panels, n, out);
        return;
    }
    split_columns(np, out, |p0, p1, dst| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above); the lengths were asserted;
        // this task writes columns p0*32..p1*32 of each of the t rows (n apart) and no other task does.
        unsafe {
            gemm_bf16_avx512(xb, t, k, panels, p0, p1 - p0, dst.add(p0 * 32), n)
        };
    });
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

/// [`gemm_bf16_par`] for a matrix held in another form (quantized): `fill(r0, (k0, kc), dst)` writes its
/// rows `r0..r0 + 32`, columns `k0..k0 + kc`, as bf16 in the panel order of [`pack_bf16_panels`] (pair
/// j, row c, element e at `(j * 32 + c) * 2 + e`) just before the row tiles read them. Each block is
/// made once per product, in L1, and read by every row, so no bf16 copy of the matrix is ever held.
/// `k` must be a multiple of 32 (blocks start at multiples of [`BF16_KC`] and end at `k`).
pub(crate) fn gemm_bf16_fill_par<F>(xb: &[u16], t: usize, k: usize, n: usize, fill: F, out: &mut [f32])
where
    F: Fn(usize, (usize, usize), &mut [u16]) + Sync,
{
    assert!(k.is_multiple_of(32) && k > 0 && n.is_multiple_of(32), "k and n must be multiples of 32");
    assert!(xb.len() >= t * k && out.len() >= t * n);
    let np = n / 32;
    if !has_bf16_gemm() {
        let mut block = vec![0u16; BF16_KC * 32];
        for p in 0..np {
            let mut k0 = 0;
            while k0 < k {
                let kc = BF16_KC.min(k - k0);
                fill(p * 32, (k0, kc), &mut block);
                for r in 0..t {
                    for c in 0..32 {
                        let x = &xb[r * k + k0..];
                        let sum: f32 = (0..kc)
                            .map(|kk| bf16_value(x[kk]) * bf16_value(block[(kk / 2 * 32 + c) * 2 + kk % 2]))
                            .sum();
                        let o = &mut out[r * n + p * 32 + c];
                        *o = if k0 == 0 { sum } else { *o + sum };
                    }
                }
                k0 += kc;
            }
        }
        return;
    }
    split_columns(np, out, |p0, p1, dst| {
        let mut block = vec![0u16; BF16_KC * 32];
        for p in p0..p1 {
            let mut k0 = 0;
            while k0 < k {
                let kc = BF16_KC.min(k - k0);
                fill(p * 32, (k0, kc), &mut block);
                let (first, pb) = (k0 == 0, block.as_ptr());
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above); `block` holds kc x 32
                // values; rows of xb hold k values from k0 on; this task writes columns p*32..p*32+32 of
                // each of the t rows (n apart) and no other task does.
                unsafe {
                    let po = dst.add(p * 32);
                    row_tiles!(t, |i| tile_bf16(
                        xb.as_ptr().add(i * k + k0),
                        k,
                        kc / 2,
                        pb,
                        po.add(i * n),
                        n,
                        first
                    ));
                }
                k0 += kc;
            }
        }
    });
}

/// Weight rows a task of [`gemm_bf16_rows_par`] widens at a time (one register tile's columns).
pub(super) const ROWS_TILE: usize = 4;

/// `out[t x n] = x[t x k] . W^T` for a matrix held in another form (quantized), for steps of a few
/// rows: `rows(r0, dst)` writes its rows `r0..r0 + 4`, every column, as bf16 row-major into `dst`
/// (4 x k, in L1), and every row of x is dotted with them there (products of bf16 values summed in
/// f32), so the weights are read once and never held in bf16 whole. Unlike [`gemm_bf16_fill_par`]
/// nothing is transposed, which is what dominates when x has only a few rows. `k` and `n` must be
/// multiples of 32.
pub(crate) fn gemm_bf16_rows_par<F>(xb: &[u16], t: usize, k: usize, n: usize, rows: F, out: &mut [f32])
where
    F: Fn(usize, &mut [u16]) + Sync,
{
    assert!(k.is_multiple_of(32) && k > 0 && n.is_multiple_of(32), "k and n must be multiples of 32");
    assert!(xb.len() >= t * k && out.len() >= t * n);
    let groups = n / ROWS_TILE;
    if !has_bf16_gemm() {
        let mut w = vec![0u16; ROWS_TILE * k];
        for g in 0..groups {
            rows(g * ROWS_TILE, &mut w);
            for r in 0..t {
                for (c, wr) in w.chunks_exact(k).enumerate() {
                    let x = &xb[r * k..(r + 1) * k];
                    out[r * n + g * ROWS_TILE + c] =
                        x.iter().zip(wr).map(|(&a, &b)| bf16_value(a) * bf16_value(b)).sum();
                }
            }
        }
        return;
    }
    split_columns(groups, out, |g0, g1, dst| {
        let mut w = vec![0u16; ROWS_TILE * k];
        for g in g0..g1 {
            rows(g * ROWS_TILE, &mut w);
            let mut r = 0;
            while r < t {
                let tile = (t - r).min(4);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above); x rows r..r+tile hold k
                // values each, `w` 4 rows of k; this task alone writes columns g*4..g*4+4 of each row.
                unsafe {
                    let (px, po) = (xb.as_ptr().add(r * k), dst.add(r * n + g * ROWS_TILE));
                    match tile {
                        4 => tile_dot::<4>(px, k, w.as_ptr(), po, n),
                        3 => tile_dot::<3>(px, k, w.as_ptr(), po, n),
                        2 => tile_dot::<2>(px, k, w.as_ptr(), po, n),
                        _ => tile_dot::<1>(px, k, w.as_ptr(), po, n),
                    }
                }
                r += tile;
            }
        }
    });
}

/// R rows of x (bf16, `k` each, contiguous) dotted with four weight rows (bf16, `k` each, contiguous):
/// `out[r * ldo + c] = x[r] . w[c]`, 32 values of k per step, one 16-lane f32 sum per (r, c).
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `k` a multiple of 32; `px` R x k values, `pw` 4 x k, `po` R rows (`ldo`
/// apart) of 4 writable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_dot<const R: usize>(px: *const u16, k: usize, pw: *const u16, po: *mut f32, ldo: usize) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); ROWS_TILE]; R];
    let mut kk = 0;
    while kk < k {
        let w: [__m512bh; ROWS_TILE] =
            std::array::from_fn(|c| std::mem::transmute(_mm512_loadu_si512(pw.add(c * k + kk).cast())));
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
unsafe fn sum4(a: &[std::arch::x86_64::__m512; ROWS_TILE]) -> std::arch::x86_64::__m128 {
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

    #[test]
    fn avx512_gemm_matches_a_naive_product() {
        for (t, k, cols) in [(3, 40, 32), (7, 33, 64), (13, 576, 96), (6, 1, 32), (5, 1537, 32)] {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..cols * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut part = vec![f32::NAN; t * cols];
            if !super::sgemm_xwt_avx512(&x, t, k, &w, cols, &mut part) {
                // No AVX-512 here: the product the caller falls back to must be right instead.
                super::sgemm(t, k, cols, &x, (k, 1), &w, (1, k), &mut part, (cols, 1));
            }
            for r in 0..t {
                for c in 0..cols {
                    let want: f64 =
                        (0..k).map(|kk| f64::from(x[r * k + kk]) * f64::from(w[c * k + kk])).sum();
                    assert!((f64::from(part[r * cols + c]) - want).abs() < 1e-3, "t {t} k {k} r {r} c {c}");
                }
            }
        }
        assert!(
            !super::sgemm_xwt_avx512(&[0.0; 4], 1, 4, &[0.0; 64], 16, &mut [0.0; 16]),
            "16 columns: not taken"
        );
    }

    #[test]
    fn bf16_gemm_matches_a_product_of_the_rounded_values() {
        // Panel counts of 1 to 5: more than one per pool task, and fewer panels than tasks.
        for (t, k, rows) in [(1, 2, 32), (7, 40, 64), (13, 576, 96), (6, 1538, 64), (3, 64, 160)] {
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

    #[test]
    fn strided_gemm_reads_only_the_first_k_of_each_row() {
        let (t, k, cols, ldx, ldw) = (5, 40, 32, 48, 45);
        let x: Vec<f32> =
            (0..t * ldx).map(|i| if i % ldx < k { (i as f32 * 0.37).sin() } else { f32::NAN }).collect();
        let w: Vec<f32> =
            (0..cols * ldw).map(|i| if i % ldw < k { (i as f32 * 0.11).cos() } else { f32::NAN }).collect();
        let mut part = vec![f32::NAN; t * cols];
        if !super::sgemm_xwt_avx512_strided((&x, ldx), t, k, (&w, ldw), cols, &mut part) {
            super::sgemm(t, k, cols, &x, (ldx, 1), &w, (1, ldw), &mut part, (cols, 1));
        }
        for r in 0..t {
            for c in 0..cols {
                let want: f64 =
                    (0..k).map(|kk| f64::from(x[r * ldx + kk]) * f64::from(w[c * ldw + kk])).sum();
                assert!((f64::from(part[r * cols + c]) - want).abs() < 1e-3, "r {r} c {c}");
            }
        }
    }

    #[test]
    fn sgemm_with_transposed_b() {
        // c[2x3] = a[2x4] · w^T where w is [3x4] row-major.
        let a = [1.0, 2.0, 3.0, 4.0, 0.5, 0.0, -1.0, 2.0];
        let w = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut c = [0.0; 6];
        super::sgemm(2, 4, 3, &a, (4, 1), &w, (1, 4), &mut c, (3, 1));
        assert_eq!(c, [1.0, 2.0, 10.0, 0.5, 0.0, 1.5]);
    }
}
