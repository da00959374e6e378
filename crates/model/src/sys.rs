//! The crate's unsafe code, each use with its reasoning: mapping files into memory, and the SIMD
//! kernels (AVX-512 / AVX-512 BF16 / AVX2, chosen at run time) with the portable loops they fall back
//! to and are tested against.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

use crate::quant::f16_to_f32;

pub(crate) use memmap2::Mmap;

/// Maps `file` read-only.
pub(crate) fn map_file(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only and private to this process. Model files are written once (by
    // import, to a temporary name renamed into place) and never modified while a process maps them;
    // a file truncated underneath us would fault, which is the documented hazard of memory mapping and
    // is outside what safe code can rule out.
    unsafe { Mmap::map(file) }
}

/// For row tiles of up to six rows over `t` rows, with `$i` bound to each tile's first row, runs
/// `$tile::<R>(args)` for the tile's row count R (a const generic, so each tile size gets its own fully
/// unrolled register tile).
macro_rules! row_tiles {
    ($t:expr, |$i:ident| $tile:ident($($arg:expr),* $(,)?)) => {{
        let mut $i = 0;
        while $i < $t {
            let r = ($t - $i).min(6);
            match r {
                6 => $tile::<6>($($arg),*),
                5 => $tile::<5>($($arg),*),
                4 => $tile::<4>($($arg),*),
                3 => $tile::<3>($($arg),*),
                2 => $tile::<2>($($arg),*),
                _ => $tile::<1>($($arg),*),
            }
            $i += r;
        }
    }};
}

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
        if cols.is_multiple_of(32) && k > 0 && std::is_x86_feature_detected!("avx512f") {
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

/// f32 to bf16 (the top 16 bits), rounding to nearest even; NaN stays NaN.
pub(crate) fn bf16_from_f32(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 to f32 (exact).
pub(crate) fn f32_from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Whether [`gemm_bf16`]'s kernel runs on this CPU (AVX-512F and AVX-512 BF16).
pub(crate) fn has_bf16_gemm() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
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
        *o = bf16_from_f32(v);
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
        out[j] = bf16_from_f32(x[j]);
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
    let chunks = (rayon::current_num_threads().max(1) * 2).min(np);
    if !has_bf16_gemm() {
        gemm_bf16_portable(xb, t, k, panels, n, out);
        return;
    }
    /// `out`'s address, shared by tasks that write disjoint columns.
    struct Out(*mut f32);
    // SAFETY: tasks write only their own columns of `out` (below), so no two write the same element.
    unsafe impl Sync for Out {}
    let dst = Out(out.as_mut_ptr());
    let dst = &dst;
    use rayon::prelude::*;
    (0..chunks).into_par_iter().for_each(|c| {
        let (p0, p1) = (c * np / chunks, (c + 1) * np / chunks);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above); the lengths were asserted;
        // this task writes columns p0*32..p1*32 of each of the t rows (n apart) and no other task does.
        unsafe {
            gemm_bf16_avx512(xb, t, k, panels, p0, p1 - p0, dst.0.add(p0 * 32), n)
        };
    });
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
            out[at] = bf16_from_f32(pair[0]);
            out[at + 1] = bf16_from_f32(pair[1]);
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
                acc += f32_from_bf16(xb[r * k + 2 * j]) * f32_from_bf16(panels[at])
                    + f32_from_bf16(xb[r * k + 2 * j + 1]) * f32_from_bf16(panels[at + 1]);
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

/// Softmax of `row[..visible] * scale` in place, with `row[visible..]` set to zero (the causal
/// mask and padding). Vectorized (AVX-512 exp by range reduction and a degree-6 polynomial, within
/// 2 ulp) where the CPU has AVX-512F.
pub(crate) fn softmax_masked(row: &mut [f32], visible: usize, scale: f32) {
    assert!(visible >= 1 && visible <= row.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked); `visible <= row.len()` (asserted).
            unsafe { softmax_masked_avx512(row, visible, scale) };
            return;
        }
    }
    softmax_masked_portable(row, visible, scale);
}

fn softmax_masked_portable(row: &mut [f32], visible: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(visible);
    let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
    let sum = exp_scaled_portable(live, scale, max);
    for v in live.iter_mut() {
        *v /= sum;
    }
    masked.fill(0.0);
}

/// `e^x` for 16 lanes; x below -87 gives 0 (as far as f32 softmax is concerned).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
    // x = n ln2 + r with |r| <= ln2 / 2; e^x = 2^n e^r.
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_scalef_ps(p, n);
    // Lanes clamped at -87 would give ~1.6e-38: make them exactly zero, like e^-inf.
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(-87.0)), e)
}

/// # Safety
/// AVX-512F; `1 <= visible <= row.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_masked_avx512(row: &mut [f32], visible: usize, scale: f32) {
    use std::arch::x86_64::*;
    let p = row.as_mut_ptr();
    let lanes = |i: usize| -> __mmask16 {
        let left = visible - i;
        if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        }
    };
    let vs = _mm512_set1_ps(scale);
    let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < visible {
        // SAFETY (of every masked load and store here): lanes at or past `visible` are masked off.
        let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(i), p.add(i)), vs);
        vmax = _mm512_mask_max_ps(vmax, lanes(i), vmax, v);
        i += 16;
    }
    let sum = exp_scaled_avx512(&mut row[..visible], scale, _mm512_reduce_max_ps(vmax));
    let inv = _mm512_set1_ps(1.0 / sum);
    i = 0;
    while i < visible {
        let m = lanes(i);
        _mm512_mask_storeu_ps(p.add(i), m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.add(i)), inv));
        i += 16;
    }
    row[visible..].fill(0.0);
}

/// `out[i] = silu(g[i]) * u[i]` (SwiGLU), vectorized where the CPU has AVX-512F.
pub(crate) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked); the lengths are equal (asserted).
            unsafe { silu_mul_avx512(g, u, out) };
            return;
        }
    }
    silu_mul_tail(g, u, out, 0);
}

fn silu_mul_tail(g: &[f32], u: &[f32], out: &mut [f32], from: usize) {
    for i in from..g.len() {
        out[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
    }
}

/// # Safety
/// AVX-512F; `g`, `u` and `out` of equal length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut done = 0;
    while done + 16 <= g.len() {
        // SAFETY (of the loads and the store): done + 16 <= len for all three slices.
        let gv = _mm512_loadu_ps(g.as_ptr().add(done));
        let e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        let s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
        _mm512_storeu_ps(out.as_mut_ptr().add(done), _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(done))));
        done += 16;
    }
    silu_mul_tail(g, u, out, done);
}

/// `row[i] = e^(row[i] * scale - shift)` in place; returns their sum. Vectorized where the CPU has
/// AVX-512F.
pub(crate) fn exp_scaled(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked).
            return unsafe { exp_scaled_avx512(row, scale, shift) };
        }
    }
    exp_scaled_portable(row, scale, shift)
}

fn exp_scaled_portable(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v * scale - shift).exp();
        sum += *v;
    }
    sum
}

/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_scaled_avx512(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (p, n) = (row.as_mut_ptr(), row.len());
    let (vscale, vshift) = (_mm512_set1_ps(scale), _mm512_set1_ps(shift));
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
        // SAFETY (of the masked load and store): lanes at or past n are masked off.
        let v = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.add(i)), vscale), vshift);
        let e = _mm512_maskz_mov_ps(m, exp_avx512(v));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(p.add(i), m, e);
        i += 16;
    }
    _mm512_reduce_add_ps(sum)
}

/// Scores of every query head against `n` positions' keys: `q` holds the heads (`hd` values each),
/// head h reading KV head `h / group`; position i's K row (every KV head) starts `ldk` floats after
/// position i - 1's in `k`. `out[h * ldo + i] = q_h . k_i[(h / group) * hd..][..hd]`.
pub(crate) fn group_scores(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[f32], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) {
    let heads = q.len() / hd;
    assert!(hd > 0 && group > 0 && q.len() == heads * hd && heads.is_multiple_of(group));
    assert!(n == 0 || k.len() >= (n - 1) * ldk + heads / group * hd);
    assert!(heads == 0 || n == 0 || out.len() >= (heads - 1) * ldo + n);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F (checked); the same safe code, compiled for it.
            unsafe { group_scores_avx512(q, (hd, group), (k, ldk), n, (out, ldo)) };
            return;
        }
    }
    group_scores_body(q, (hd, group), (k, ldk), n, (out, ldo));
}

/// # Safety
/// AVX-512F; lengths as [`group_scores`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_scores_avx512(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[f32], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) {
    use std::arch::x86_64::*;
    if !hd.is_multiple_of(16) {
        return group_scores_body(q, (hd, group), (k, ldk), n, (out, ldo));
    }
    let chunks = hd / 16;
    for (h, qh) in q.chunks_exact(hd).enumerate() {
        let off = (h / group) * hd;
        let mut i0 = 0;
        // Sixteen positions at a time: sixteen vectors of partial sums, then one transposing
        // reduction gives their sixteen dot products in one vector.
        while i0 < n {
            let cnt = (n - i0).min(16);
            let mut v = [_mm512_setzero_ps(); 16];
            for (i, vi) in v.iter_mut().enumerate().take(cnt) {
                // SAFETY (of the loads): position i0 + i < n, whose row holds `off + hd` floats.
                let key = k.as_ptr().add((i0 + i) * ldk + off);
                for c in 0..chunks {
                    *vi = _mm512_fmadd_ps(
                        _mm512_loadu_ps(qh.as_ptr().add(c * 16)),
                        _mm512_loadu_ps(key.add(c * 16)),
                        *vi,
                    );
                }
            }
            let sums = reduce16(&v);
            let m: __mmask16 = if cnt == 16 { 0xffff } else { (1u16 << cnt) - 1 };
            // SAFETY: out holds heads rows of at least n values, `ldo` apart (asserted by the caller).
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(h * ldo + i0), m, sums);
            i0 += cnt;
        }
    }
}

/// `r[i]` = the sum of `v[i]`'s sixteen lanes, for sixteen vectors at once (a transposing reduction:
/// 45 operations instead of sixteen separate horizontal sums).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Per 128-bit lane: [sum of a's 4, b's 4, c's 4, d's 4] for four vectors a, b, c, d.
    let four = |a: __m512, b: __m512, c: __m512, d: __m512| {
        let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(ab, cd), _mm512_shuffle_ps::<0xEE>(ab, cd))
    };
    let t0 = four(v[0], v[1], v[2], v[3]);
    let t1 = four(v[4], v[5], v[6], v[7]);
    let t2 = four(v[8], v[9], v[10], v[11]);
    let t3 = four(v[12], v[13], v[14], v[15]);
    // Add 128-bit lanes 0+2 and 1+3 of two such vectors, then the remaining pairs.
    let w01 = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(t0, t1), _mm512_shuffle_f32x4::<0xEE>(t0, t1));
    let w23 = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(t2, t3), _mm512_shuffle_f32x4::<0xEE>(t2, t3));
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(w01, w23), _mm512_shuffle_f32x4::<0xDD>(w01, w23))
}

#[inline(always)]
fn group_scores_body(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[f32], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) {
    for i in 0..n {
        let row = &k[i * ldk..];
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            let key = &row[(h / group) * hd..][..hd];
            // Sixteen lanes summed separately, so the loop vectorizes without reordering a sum.
            let mut lanes = [0f32; 16];
            let (qc, kc) = (qh.chunks_exact(16), key.chunks_exact(16));
            let tail: f32 = qc.remainder().iter().zip(kc.remainder()).map(|(a, b)| a * b).sum();
            for (a, b) in qc.zip(kc) {
                for l in 0..16 {
                    lanes[l] += a[l] * b[l];
                }
            }
            out[h * ldo + i] = lanes.iter().sum::<f32>() + tail;
        }
    }
}

/// `acc[h * hd..][..hd] += sum_i p[h * ldp + i] * v_i[(h / group) * hd..][..hd]` for every query head
/// h, over `n` positions whose V rows (every KV head) are `ldv` floats apart in `v`.
pub(crate) fn group_weighted_sum(
    (p, ldp): (&[f32], usize),
    (hd, group): (usize, usize),
    (v, ldv): (&[f32], usize),
    n: usize,
    acc: &mut [f32],
) {
    let heads = acc.len() / hd;
    assert!(hd > 0 && group > 0 && acc.len() == heads * hd && heads.is_multiple_of(group));
    assert!(n == 0 || v.len() >= (n - 1) * ldv + heads / group * hd);
    assert!(heads == 0 || n == 0 || p.len() >= (heads - 1) * ldp + n);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F (checked); the same safe code, compiled for it.
            unsafe { group_weighted_sum_avx512((p, ldp), (hd, group), (v, ldv), n, acc) };
            return;
        }
    }
    group_weighted_sum_body((p, ldp), (hd, group), (v, ldv), n, acc);
}

/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_weighted_sum_avx512(
    p: (&[f32], usize),
    shape: (usize, usize),
    v: (&[f32], usize),
    n: usize,
    acc: &mut [f32],
) {
    group_weighted_sum_body(p, shape, v, n, acc);
}

#[inline(always)]
fn group_weighted_sum_body(
    (p, ldp): (&[f32], usize),
    (hd, group): (usize, usize),
    (v, ldv): (&[f32], usize),
    n: usize,
    acc: &mut [f32],
) {
    for i in 0..n {
        let row = &v[i * ldv..];
        for (h, a) in acc.chunks_exact_mut(hd).enumerate() {
            let w = p[h * ldp + i];
            for (a, x) in a.iter_mut().zip(&row[(h / group) * hd..][..hd]) {
                *a += w * x;
            }
        }
    }
}

/// Dot product, with an AVX2+FMA kernel where the CPU has one.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), and the lengths are equal.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// # Safety
/// The CPU must support AVX2 and FMA, and `a.len() == b.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY (of the loads): i + 16 <= n, so both 8-lane loads at i and i + 8 are in bounds.
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
        i += 16;
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    let mut sum: f32 = lanes.iter().sum();
    while i < n {
        sum += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    sum
}

/// `sum_i x[i] * q[i] * scales[i / 32]`: a dot product against one Q8 row (`scales` as f16 bits),
/// with an AVX-512 kernel where the CPU has one.
pub(crate) fn dot_q8(x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    assert_eq!(x.len(), q.len());
    assert_eq!(q.len(), scales.len() * 32);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above) and the lengths match.
            return unsafe { dot_q8_avx512(x, q, scales) };
        }
    }
    dot_q8_portable(x, q, scales)
}

fn dot_q8_portable(x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    let mut sum = 0f32;
    for ((xg, qg), &s) in x.chunks_exact(32).zip(q.chunks_exact(32)).zip(scales) {
        let mut acc = [0f32; 8];
        for (xs, qs) in xg.chunks_exact(8).zip(qg.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += xs[l] * qs[l] as f32;
            }
        }
        sum += acc.iter().sum::<f32>() * f16_to_f32(s);
    }
    sum
}

/// f16 bits `h` as f32, broadcast to 16 lanes.
///
/// # Safety
/// AVX-512F (the 512-bit `vcvtph2ps` is part of it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f16_splat(h: u16) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_cvtph_ps(_mm256_set1_epi16(h as i16))
}

/// # Safety
/// The CPU must support AVX-512F, `x.len() == q.len() == 32 * scales.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q8_avx512(x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let (px, pq) = (x.as_ptr(), q.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let groups = scales.len();
    let mut g = 0;
    // Two groups per iteration into two accumulators: independent FMA chains.
    while g + 2 <= groups {
        for (j, acc) in [(0usize, &mut acc0), (1, &mut acc1)] {
            let o = (g + j) * 32;
            // SAFETY (of the loads): o + 32 <= x.len() == q.len().
            let w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(o) as *const __m128i)));
            let w1 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(o + 16) as *const __m128i)));
            let p = _mm512_fmadd_ps(
                w1,
                _mm512_loadu_ps(px.add(o + 16)),
                _mm512_mul_ps(w0, _mm512_loadu_ps(px.add(o))),
            );
            *acc = _mm512_fmadd_ps(p, f16_splat(*scales.get_unchecked(g + j)), *acc);
        }
        g += 2;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while g < groups {
        let o = g * 32;
        sum += dot_q8_portable(&x[o..o + 32], &q[o..o + 32], &scales[g..g + 1]);
        g += 1;
    }
    sum
}

/// `sum_g scales[g] * (q_g . x_g) + mins[g] * xsum[g]` for one Q4 row (see `quant::Q4Matrix`; scales
/// and minimums as f16 bits), with an AVX-512 kernel where the CPU has one.
pub(crate) fn dot_q4(x: &[f32], packed: &[u8], scales: &[u16], mins: &[u16], xsum: &[f32]) -> f32 {
    assert_eq!(x.len(), packed.len() * 2);
    assert!(scales.len() == mins.len() && mins.len() == xsum.len() && x.len() == scales.len() * 32);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above) and the lengths match.
            return unsafe { dot_q4_avx512(x, packed, scales, mins, xsum) };
        }
    }
    dot_q4_portable(x, packed, scales, mins, xsum)
}

fn dot_q4_portable(x: &[f32], packed: &[u8], scales: &[u16], mins: &[u16], xsum: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (g, (xg, pg)) in x.chunks_exact(32).zip(packed.chunks_exact(16)).enumerate() {
        let mut acc = 0f32;
        for (j, b) in pg.iter().enumerate() {
            acc += xg[j] * (b & 15) as f32 + xg[j + 16] * (b >> 4) as f32;
        }
        sum += acc * f16_to_f32(scales[g]) + f16_to_f32(mins[g]) * xsum[g];
    }
    sum
}

/// # Safety
/// The CPU must support AVX-512F; lengths as `dot_q4` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q4_avx512(x: &[f32], packed: &[u8], scales: &[u16], mins: &[u16], xsum: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (px, pq) = (x.as_ptr(), packed.as_ptr());
    let low = _mm_set1_epi8(15);
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let groups = scales.len();
    let mut g = 0;
    while g + 2 <= groups {
        for (j, acc) in [(0usize, &mut acc0), (1, &mut acc1)] {
            let (o, b) = ((g + j) * 32, (g + j) * 16);
            // SAFETY (of the loads): b + 16 <= packed.len() and o + 32 <= x.len().
            let bytes = _mm_loadu_si128(pq.add(b) as *const __m128i);
            let lo = _mm_and_si128(bytes, low);
            let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
            let w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            let w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            let p = _mm512_fmadd_ps(
                w1,
                _mm512_loadu_ps(px.add(o + 16)),
                _mm512_mul_ps(w0, _mm512_loadu_ps(px.add(o))),
            );
            *acc = _mm512_fmadd_ps(p, f16_splat(*scales.get_unchecked(g + j)), *acc);
        }
        g += 2;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    if g < groups {
        sum += dot_q4_portable(&x[g * 32..], &packed[g * 16..], &scales[g..], &[0], &[0.0]);
    }
    // The minimums' share: sixteen groups at a time.
    let mut macc = _mm512_setzero_ps();
    let mut g = 0;
    while g + 16 <= groups {
        // SAFETY (of the loads): g + 16 <= groups == mins.len() == xsum.len().
        let m = _mm512_cvtph_ps(_mm256_loadu_si256(mins.as_ptr().add(g) as *const __m256i));
        macc = _mm512_fmadd_ps(m, _mm512_loadu_ps(xsum.as_ptr().add(g)), macc);
        g += 16;
    }
    sum + _mm512_reduce_add_ps(macc)
        + mins[g..].iter().zip(&xsum[g..]).map(|(&m, s)| f16_to_f32(m) * s).sum::<f32>()
}

/// The bytes of f32 values (native, little-endian on every supported target).
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte of it is initialized; u8 has alignment 1; the length
    // covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Mutable form of [`f32_bytes`].
pub(crate) fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`, and every byte pattern written through it is a valid f32; the
    // borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Views bytes as f32 values. Panics unless the bytes are 4-aligned and a whole number of values
/// (a page-aligned mapping always is).
pub(crate) fn as_f32(bytes: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid f32; `align_to` never returns misaligned middles, and the
    // assertion makes sure no byte is left out.
    let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not f32-aligned");
    mid
}

/// Mutable form of [`as_f32`].
pub(crate) fn as_f32_mut(bytes: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `as_f32`; the borrow is unique.
    let (head, mid, tail) = unsafe { bytes.align_to_mut::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not f32-aligned");
    mid
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_kernels_agree() {
        let a: Vec<f32> = (0..77).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..77).map(|i| (i as f32 * 0.11).cos()).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert!((f64::from(super::dot(&a, &b)) - exact).abs() < 1e-4);
        assert!((f64::from(super::dot_portable(&a, &b)) - exact).abs() < 1e-4);
    }

    #[test]
    fn q8_dot_kernels_agree() {
        let n = 32 * 37; // two blocks of 16 groups and a partial one
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let q: Vec<i8> = (0..n).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let s: Vec<u16> = (0..37).map(|g| crate::quant::f32_to_f16(0.01 + g as f32 * 0.003)).collect();
        let sf = |g: usize| f64::from(super::f16_to_f32(s[g]));
        let exact: f64 = (0..n).map(|i| f64::from(x[i]) * f64::from(q[i]) * sf(i / 32)).sum();
        assert!((f64::from(super::dot_q8(&x, &q, &s)) - exact).abs() < 1e-3);
        assert!((f64::from(super::dot_q8_portable(&x, &q, &s)) - exact).abs() < 1e-3);
    }

    #[test]
    fn q4_dot_kernels_agree() {
        let groups = 37;
        let x: Vec<f32> = (0..groups * 32).map(|i| (i as f32 * 0.37).sin()).collect();
        let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 73 % 256) as u8).collect();
        let s: Vec<u16> = (0..groups).map(|g| crate::quant::f32_to_f16(0.01 + g as f32 * 0.003)).collect();
        let m: Vec<u16> = (0..groups).map(|g| crate::quant::f32_to_f16(-0.1 + g as f32 * 0.02)).collect();
        let (sf, mf) =
            (|g: usize| f64::from(super::f16_to_f32(s[g])), |g: usize| f64::from(super::f16_to_f32(m[g])));
        let xsum: Vec<f32> = x.chunks(32).map(|c| c.iter().sum()).collect();
        let mut exact = 0f64;
        for g in 0..groups {
            for j in 0..16 {
                let b = packed[g * 16 + j];
                let (lo, hi) = (f64::from(b & 15), f64::from(b >> 4));
                exact += f64::from(x[g * 32 + j]) * (mf(g) + lo * sf(g));
                exact += f64::from(x[g * 32 + j + 16]) * (mf(g) + hi * sf(g));
            }
        }
        assert!((f64::from(super::dot_q4(&x, &packed, &s, &m, &xsum)) - exact).abs() < 1e-3);
        assert!((f64::from(super::dot_q4_portable(&x, &packed, &s, &m, &xsum)) - exact).abs() < 1e-3);
    }

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
        use super::{bf16_from_f32, f32_from_bf16};
        assert_eq!(bf16_from_f32(1.0), 0x3f80);
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f80_8000)), 0x3f80, "a tie rounds to even");
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f81_8000)), 0x3f82, "a tie rounds to even");
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(f32_from_bf16(bf16_from_f32(f32::NAN)).is_nan());
        // Panel counts of 1 to 5: more than one per pool task, and fewer panels than tasks.
        for (t, k, rows) in [(1, 2, 32), (7, 40, 64), (13, 576, 96), (6, 1538, 64), (3, 64, 160)] {
            let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let panels = super::pack_bf16_panels(&w, rows, k);
            let mut xb = vec![0u16; t * k];
            super::to_bf16(&x, &mut xb);
            for (a, &v) in xb.iter().zip(&x) {
                assert_eq!(*a, bf16_from_f32(v), "the vector conversion rounds like the scalar one");
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
                            f64::from(f32_from_bf16(xb[r * k + kk]))
                                * f64::from(f32_from_bf16(bf16_from_f32(w[row * k + kk])))
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
    fn softmax_kernels_agree_with_f64() {
        for (len, visible) in [(1, 1), (17, 5), (64, 64), (100, 33), (1024, 1000)] {
            let base: Vec<f32> = (0..len).map(|i| (i as f32 * 0.731).sin() * 40.0 - 3.0).collect();
            let mut fast = base.clone();
            let mut slow = base.clone();
            super::softmax_masked(&mut fast, visible, 0.125);
            super::softmax_masked_portable(&mut slow, visible, 0.125);
            let max = base[..visible].iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v) * 0.125));
            let sum: f64 = base[..visible].iter().map(|&v| (f64::from(v) * 0.125 - max).exp()).sum();
            for i in 0..len {
                let want = if i < visible { (f64::from(base[i]) * 0.125 - max).exp() / sum } else { 0.0 };
                for got in [fast[i], slow[i]] {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-6 * want + 1e-12,
                        "len {len} i {i}: {got} vs {want}"
                    );
                }
            }
        }
        // Scores far below the maximum underflow to exactly zero, as exp does.
        let mut row = vec![0.0, -2000.0, 5.0, -1e30];
        super::softmax_masked(&mut row, 4, 1.0);
        assert_eq!((row[1], row[3]), (0.0, 0.0));
        assert!((row[0] + row[2] - 1.0).abs() < 1e-6);
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
    fn grouped_decode_attention_kernels_match_a_naive_loop() {
        // 4 query heads over 2 KV heads (group 2), positions whose rows (both KV heads) sit `ld`
        // floats apart: head size 20 (the portable loop), 64 with 5 and 37 positions (AVX-512's
        // sixteen-at-a-time scores, a partial last group).
        for (hd, n) in [(20, 5), (64, 5), (64, 37)] {
            grouped_case(hd, n);
        }
    }

    fn grouped_case(hd: usize, n: usize) {
        let (group, heads, ld) = (2, 4, 2 * hd + 4);
        let q: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let kv: Vec<f32> = (0..n * ld).map(|i| (i as f32 * 0.11).cos()).collect();
        let ldo = n + 2;
        let mut scores = vec![f32::NAN; heads * ldo];
        super::group_scores(&q, (hd, group), (&kv, ld), n, (&mut scores, ldo));
        let mut acc = vec![0.5; heads * hd];
        super::group_weighted_sum((&scores, ldo), (hd, group), (&kv, ld), n, &mut acc);
        for h in 0..heads {
            let kvh = h / group;
            for i in 0..n {
                let want: f32 = (0..hd).map(|d| q[h * hd + d] * kv[i * ld + kvh * hd + d]).sum();
                assert!((scores[h * ldo + i] - want).abs() < 1e-4, "hd {hd} n {n}: score h {h} i {i}");
            }
            for d in 0..hd {
                let want: f32 =
                    0.5 + (0..n).map(|i| scores[h * ldo + i] * kv[i * ld + kvh * hd + d]).sum::<f32>();
                assert!((acc[h * hd + d] - want).abs() < 1e-3, "hd {hd} n {n}: acc h {h} d {d}");
            }
        }
    }

    #[test]
    fn silu_mul_matches_the_formula() {
        let g: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.7).collect();
        let u: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut out = vec![f32::NAN; 37];
        super::silu_mul(&g, &u, &mut out);
        for i in 0..37 {
            let want = f64::from(g[i]) / (1.0 + (-f64::from(g[i])).exp()) * f64::from(u[i]);
            assert!(
                (f64::from(out[i]) - want).abs() < 1e-5 * (1.0 + want.abs()),
                "{i}: {} vs {want}",
                out[i]
            );
        }
    }

    #[test]
    fn exp_scaled_sums_its_exps() {
        let mut row = vec![2.0, 4.0, 6.0, 1.0];
        let sum = super::exp_scaled(&mut row, 0.5, 3.0);
        let want = [(-2f32).exp(), (-1f32).exp(), 1.0, (-2.5f32).exp()];
        for (a, b) in row.iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-6);
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
