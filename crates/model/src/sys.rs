//! The crate's one unsafe operation: mapping a file into memory.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

pub(crate) use memmap2::Mmap;

/// Maps `file` read-only.
pub(crate) fn map_file(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only and private to this process. Model files are written once (by
    // import, to a temporary name renamed into place) and never modified while a process maps them;
    // a file truncated underneath us would fault, which is the documented hazard of memory mapping and
    // is outside what safe code can rule out.
    unsafe { Mmap::map(file) }
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
    assert!(x.len() >= t * k && w.len() >= cols * k && part.len() >= t * cols);
    #[cfg(target_arch = "x86_64")]
    {
        if cols.is_multiple_of(32) && k > 0 && std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked) and the lengths were asserted above.
            unsafe { sgemm_xwt_avx512_impl(x, t, k, w, cols, part) };
            return true;
        }
    }
    false
}

/// # Safety
/// AVX-512F; `x.len() >= t*k`, `w.len() >= cols*k`, `part.len() >= t*cols`, `cols % 32 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sgemm_xwt_avx512_impl(x: &[f32], t: usize, k: usize, w: &[f32], cols: usize, part: &mut [f32]) {
    // K is cut into blocks whose 32-column panel (KC x 32 floats, 32 KiB) stays in L1 while every row
    // tile of x streams past it; the tile's sums carry over from block to block through `part`.
    const KC: usize = 256;
    let mut packed = vec![0f32; KC.min(k) * 32];
    for p in 0..cols / 32 {
        let mut k0 = 0;
        while k0 < k {
            let kc = KC.min(k - k0);
            for c in 0..32 {
                let row = &w[(p * 32 + c) * k + k0..(p * 32 + c) * k + k0 + kc];
                for (kk, &v) in row.iter().enumerate() {
                    packed[kk * 32 + c] = v;
                }
            }
            let first = k0 == 0;
            let mut i = 0;
            while i < t {
                let r = (t - i).min(6);
                let (px, po) = (x.as_ptr().add(i * k + k0), part.as_mut_ptr().add(i * cols + p * 32));
                let pb = packed.as_ptr();
                match r {
                    6 => tile::<6>(px, k, kc, pb, po, cols, first),
                    5 => tile::<5>(px, k, kc, pb, po, cols, first),
                    4 => tile::<4>(px, k, kc, pb, po, cols, first),
                    3 => tile::<3>(px, k, kc, pb, po, cols, first),
                    2 => tile::<2>(px, k, kc, pb, po, cols, first),
                    _ => tile::<1>(px, k, kc, pb, po, cols, first),
                }
                i += r;
            }
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

/// `sum_i x[i] * q[i] * scales[i / 32]`: a dot product against one Q8 row, with an AVX-512 kernel
/// where the CPU has one.
pub(crate) fn dot_q8(x: &[f32], q: &[i8], scales: &[f32]) -> f32 {
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

fn dot_q8_portable(x: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let mut sum = 0f32;
    for ((xg, qg), s) in x.chunks_exact(32).zip(q.chunks_exact(32)).zip(scales) {
        let mut acc = [0f32; 8];
        for (xs, qs) in xg.chunks_exact(8).zip(qg.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += xs[l] * qs[l] as f32;
            }
        }
        sum += acc.iter().sum::<f32>() * s;
    }
    sum
}

/// # Safety
/// The CPU must support AVX-512F, `x.len() == q.len() == 32 * scales.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q8_avx512(x: &[f32], q: &[i8], scales: &[f32]) -> f32 {
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
            *acc = _mm512_fmadd_ps(p, _mm512_set1_ps(*scales.get_unchecked(g + j)), *acc);
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

/// `sum_g scales[g] * (q_g . x_g) + mins[g] * xsum[g]` for one Q4 row (see `quant::Q4Matrix`), with
/// an AVX-512 kernel where the CPU has one.
pub(crate) fn dot_q4(x: &[f32], packed: &[u8], scales: &[f32], mins: &[f32], xsum: &[f32]) -> f32 {
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

fn dot_q4_portable(x: &[f32], packed: &[u8], scales: &[f32], mins: &[f32], xsum: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (g, (xg, pg)) in x.chunks_exact(32).zip(packed.chunks_exact(16)).enumerate() {
        let mut acc = 0f32;
        for (j, b) in pg.iter().enumerate() {
            acc += xg[j] * (b & 15) as f32 + xg[j + 16] * (b >> 4) as f32;
        }
        sum += acc * scales[g] + mins[g] * xsum[g];
    }
    sum
}

/// # Safety
/// The CPU must support AVX-512F; lengths as `dot_q4` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q4_avx512(x: &[f32], packed: &[u8], scales: &[f32], mins: &[f32], xsum: &[f32]) -> f32 {
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
            *acc = _mm512_fmadd_ps(p, _mm512_set1_ps(*scales.get_unchecked(g + j)), *acc);
        }
        g += 2;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    if g < groups {
        sum += dot_q4_portable(&x[g * 32..], &packed[g * 16..], &scales[g..], &[0.0], &[0.0]);
    }
    // The minimums' share: one dot product over groups.
    sum + mins.iter().zip(xsum).map(|(m, s)| m * s).sum::<f32>()
}

/// A writable shared mapping of a new file of `floats` f32 values (zeroed), for KV memory other
/// processes on the host can read.
pub(crate) fn create_shared_f32(path: &std::path::Path, floats: usize) -> io::Result<memmap2::MmapMut> {
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
    file.set_len((floats * 4) as u64)?;
    // SAFETY: the file was just created by this process (`create_new`) and is only resized here; other
    // processes map it read-only and never truncate it. The mapping lives as long as the returned value.
    unsafe { memmap2::MmapMut::map_mut(&file) }
}

/// Views bytes as f32 values. Panics unless the bytes are 4-aligned and a whole number of values
/// (a page-aligned mapping always is).
pub(crate) fn as_f32(bytes: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid f32; `align_to` never returns misaligned middles, and the
    // assertion makes sure no byte is left out.
    let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV mapping is not f32-aligned");
    mid
}

/// Mutable form of [`as_f32`].
pub(crate) fn as_f32_mut(bytes: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `as_f32`; the borrow is unique.
    let (head, mid, tail) = unsafe { bytes.align_to_mut::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV mapping is not f32-aligned");
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
        let n = 32 * 7;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let q: Vec<i8> = (0..n).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let s: Vec<f32> = (0..7).map(|g| 0.01 + g as f32 * 0.003).collect();
        let exact: f64 = (0..n).map(|i| f64::from(x[i]) * f64::from(q[i]) * f64::from(s[i / 32])).sum();
        assert!((f64::from(super::dot_q8(&x, &q, &s)) - exact).abs() < 1e-3);
        assert!((f64::from(super::dot_q8_portable(&x, &q, &s)) - exact).abs() < 1e-3);
    }

    #[test]
    fn q4_dot_kernels_agree() {
        let groups = 7;
        let x: Vec<f32> = (0..groups * 32).map(|i| (i as f32 * 0.37).sin()).collect();
        let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 73 % 256) as u8).collect();
        let s: Vec<f32> = (0..groups).map(|g| 0.01 + g as f32 * 0.003).collect();
        let m: Vec<f32> = (0..groups).map(|g| -0.1 + g as f32 * 0.02).collect();
        let xsum: Vec<f32> = x.chunks(32).map(|c| c.iter().sum()).collect();
        let mut exact = 0f64;
        for g in 0..groups {
            for j in 0..16 {
                let b = packed[g * 16 + j];
                let (lo, hi) = (f64::from(b & 15), f64::from(b >> 4));
                exact += f64::from(x[g * 32 + j]) * (f64::from(m[g]) + lo * f64::from(s[g]));
                exact += f64::from(x[g * 32 + j + 16]) * (f64::from(m[g]) + hi * f64::from(s[g]));
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
    fn sgemm_with_transposed_b() {
        // c[2x3] = a[2x4] · w^T where w is [3x4] row-major.
        let a = [1.0, 2.0, 3.0, 4.0, 0.5, 0.0, -1.0, 2.0];
        let w = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut c = [0.0; 6];
        super::sgemm(2, 4, 3, &a, (4, 1), &w, (1, 4), &mut c, (3, 1));
        assert_eq!(c, [1.0, 2.0, 10.0, 0.5, 0.0, 1.5]);
    }
}
