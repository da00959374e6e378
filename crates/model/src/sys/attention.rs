//! Attention kernels: the scaled exponentials a row's attention sums, its grouped scores and
//! weighted value sums over a run of paged positions. AVX-512, AVX2 (+FMA, and F16C for the grouped
//! kernels in `decode_avx2.rs`) and portable, chosen by `cpu_kernels()`.

use super::CpuKernels;

/// `e^x` for 8 lanes, as [`exp_avx512`]: x below -87 gives 0; above 88 it stays finite (~1.7e38).
///
/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(88.0));
    // x = n ln2 + r with |r| <= ln2 / 2; e^x = 2^n e^r, 2^n built in the exponent bits (n in -126..=127).
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    let e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
    // Lanes clamped at -87: exactly zero, like e^-inf.
    _mm256_and_ps(e, _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(-87.0)))
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_scaled_avx2(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (p, n) = (row.as_mut_ptr(), row.len());
    let (vscale, vshift) = (_mm256_set1_ps(scale), _mm256_set1_ps(shift));
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY (of the load and the store): i + 8 <= n.
        let e = exp_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(p.add(i)), vscale, vshift));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(p.add(i), e);
        i += 8;
    }
    super::qdot::hsum256(sum) + exp_scaled_portable(&mut row[i..], scale, shift)
}

/// `e^x` for 16 lanes; x below -87 gives 0 (as far as f32 softmax is concerned).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
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

/// `row[i] = e^(row[i] * scale - shift)` in place; returns their sum. Vectorized with AVX-512F or
/// AVX2 (there, below -87, -inf and NaN give 0).
pub(crate) fn exp_scaled(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    exp_scaled_with(super::cpu_kernels(), row, scale, shift)
}

/// [`exp_scaled`] with the kernels `k` (at most what the CPU has).
pub(crate) fn exp_scaled_with(k: CpuKernels, row: &mut [f32], scale: f32, shift: f32) -> f32 {
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted).
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => unsafe { exp_scaled_avx512(row, scale, shift) },
        // SAFETY: the CPU has AVX2 and FMA (as above).
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe { exp_scaled_avx2(row, scale, shift) },
        _ => exp_scaled_portable(row, scale, shift),
    }
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
    match super::cpu_kernels() {
        // SAFETY: AVX-512F (`cpu_kernels()` is at most what the CPU has).
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => unsafe {
            group_scores_avx512(q, (hd, group), (k, ldk), n, (out, ldo))
        },
        // SAFETY: AVX2, FMA and F16C (as above: the family's features); a head size of whole chunks.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 if super::decode_avx2::scores_fit(hd) => unsafe {
            super::decode_avx2::group_scores(q, (hd, group), (k, ldk), n, (out, ldo))
        },
        // SAFETY: AVX2 and FMA (as above); the same safe code, compiled for them.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe { group_scores_avx2(q, (hd, group), (k, ldk), n, (out, ldo)) },
        _ => group_scores_body(q, (hd, group), (k, ldk), n, (out, ldo)),
    }
}

/// Whether [`group_scores_f16`] runs for heads of `hd` values on the kernels in use.
pub(crate) fn group_scores_f16_fits(hd: usize) -> bool {
    match super::cpu_kernels() {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => hd.is_multiple_of(16),
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => super::decode_avx2::scores_fit(hd),
        _ => false,
    }
}

/// Whether [`group_weighted_sum_f16`] runs for heads of `hd` values on the kernels in use.
pub(crate) fn group_weighted_sum_f16_fits(hd: usize) -> bool {
    match super::cpu_kernels() {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => super::decode_avx2::sums_fit(hd),
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => hd.is_multiple_of(64),
        _ => false,
    }
}

/// [`group_scores`] over K rows of f16 bits, widened in registers as they are read: every score the
/// very value `group_scores` gives over the rows widened first. With AVX-512 and head sizes of whole
/// 16-lane chunks, or AVX2 and whole 8-lane ones; false, touching nothing, elsewhere (the caller
/// widens the rows instead).
pub(crate) fn group_scores_f16(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[u16], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) -> bool {
    let heads = q.len() / hd;
    assert!(hd > 0 && group > 0 && q.len() == heads * hd && heads.is_multiple_of(group));
    assert!(n == 0 || k.len() >= (n - 1) * ldk + heads / group * hd);
    assert!(heads == 0 || n == 0 || out.len() >= (heads - 1) * ldo + n);
    match super::cpu_kernels() {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 if hd.is_multiple_of(16) => {
            // SAFETY: AVX-512F (`cpu_kernels()` is at most what the CPU has); lengths as asserted.
            unsafe { super::decode_avx512::group_scores_f16(q, (hd, group), (k, ldk), n, (out, ldo)) };
            true
        }
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 if super::decode_avx2::scores_fit(hd) => {
            // SAFETY: AVX2, FMA and F16C (the family's features, which the CPU has); lengths as asserted.
            unsafe { super::decode_avx2::group_scores(q, (hd, group), (k, ldk), n, (out, ldo)) };
            true
        }
        _ => false,
    }
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_scores_avx2(
    q: &[f32],
    shape: (usize, usize),
    k: (&[f32], usize),
    n: usize,
    out: (&mut [f32], usize),
) {
    group_scores_body(q, shape, k, n, out);
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
            let sums = super::decode_avx512::reduce16(&v);
            let m: __mmask16 = if cnt == 16 { 0xffff } else { (1u16 << cnt) - 1 };
            // SAFETY: out holds heads rows of at least n values, `ldo` apart (asserted by the caller).
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(h * ldo + i0), m, sums);
            i0 += cnt;
        }
    }
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
    match super::cpu_kernels() {
        // SAFETY: AVX-512F (`cpu_kernels()` is at most what the CPU has); whole 64-column blocks.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 if hd.is_multiple_of(64) => unsafe {
            super::decode_avx512::group_weighted_sum((p, ldp), (hd, group), (v, ldv), n, acc)
        },
        // SAFETY: AVX-512F (as above); the same safe code.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => unsafe {
            group_weighted_sum_avx512((p, ldp), (hd, group), (v, ldv), n, acc)
        },
        // SAFETY: AVX2, FMA and F16C (as above: the family's features); whole 32-column blocks.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 if super::decode_avx2::sums_fit(hd) => unsafe {
            super::decode_avx2::group_weighted_sum((p, ldp), (hd, group), (v, ldv), n, acc)
        },
        // SAFETY: AVX2 and FMA (as above); the same safe code, compiled for them.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe { group_weighted_sum_avx2((p, ldp), (hd, group), (v, ldv), n, acc) },
        _ => group_weighted_sum_body((p, ldp), (hd, group), (v, ldv), n, acc),
    }
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_weighted_sum_avx2(
    p: (&[f32], usize),
    shape: (usize, usize),
    v: (&[f32], usize),
    n: usize,
    acc: &mut [f32],
) {
    group_weighted_sum_body(p, shape, v, n, acc);
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

/// [`group_weighted_sum`] over V rows of f16 bits, widened in registers as they are read (no f32
/// copy of the rows): every element the very value `group_weighted_sum` gives over the rows widened
/// first (the same products, added in the same order). With AVX-512 and head sizes that are a
/// multiple of 64, or AVX2 and multiples of 32; false, touching nothing, elsewhere (the caller widens
/// the rows instead).
pub(crate) fn group_weighted_sum_f16(
    (p, ldp): (&[f32], usize),
    (hd, group): (usize, usize),
    (v, ldv): (&[u16], usize),
    n: usize,
    acc: &mut [f32],
) -> bool {
    let heads = acc.len() / hd;
    assert!(hd > 0 && group > 0 && acc.len() == heads * hd && heads.is_multiple_of(group));
    assert!(n == 0 || v.len() >= (n - 1) * ldv + heads / group * hd);
    assert!(heads == 0 || n == 0 || p.len() >= (heads - 1) * ldp + n);
    if super::cpu_kernels() == CpuKernels::Avx2 && super::decode_avx2::sums_fit(hd) {
        // SAFETY: AVX2, FMA and F16C (the family's features, which the CPU has); lengths as asserted.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            super::decode_avx2::group_weighted_sum((p, ldp), (hd, group), (v, ldv), n, acc)
        };
        return cfg!(target_arch = "x86_64");
    }
    if super::cpu_kernels() < CpuKernels::Avx512 || !hd.is_multiple_of(64) {
        return false;
    }
    // SAFETY: AVX-512F (checked above: `cpu_kernels()` is at most what the CPU has); whole 64-column
    // blocks; every length as asserted above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        super::decode_avx512::group_weighted_sum((p, ldp), (hd, group), (v, ldv), n, acc)
    };
    cfg!(target_arch = "x86_64")
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

#[cfg(test)]
mod tests {
    use super::CpuKernels;

    #[test]
    fn grouped_decode_attention_kernels_match_a_naive_loop() {
        // Query heads over KV heads (group 2: 4 over 2), positions whose rows (every KV head) sit
        // `ld` floats apart: head size 20 (the portable loop), 64 with 5 and 37 positions (AVX-512's
        // sixteen-at-a-time scores, a partial last group; AVX2's four-at-a-time, a partial last
        // tile), groups of 3 (AVX2's three heads at once) and 5 (three, then two), head size 32.
        for (hd, n, group) in [(20, 5, 2), (64, 5, 2), (64, 37, 2), (64, 7, 3), (32, 9, 5), (64, 1, 1)] {
            grouped_case(hd, n, group);
        }
    }

    fn grouped_case(hd: usize, n: usize, group: usize) {
        // (Through `cpu_kernels()`: the family this test process runs; `cargo xtask test` runs the
        // model's tests once per family the CPU has.)
        let (heads, ld) = (2 * group, 2 * hd + 4);
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

    /// Decode's value sums straight from f16 rows equal, bit for bit, the sums over the rows widened
    /// to f32 first (where the f16 kernels run: AVX-512, head sizes a multiple of 64; AVX2, 32).
    #[test]
    fn weighted_sums_of_f16_rows_equal_those_of_the_widened_rows() {
        use crate::bits16::{f16_bits, f16_value};
        // Latent attention's sixteen heads of 512 values, eleven heads of a KV head.
        let shapes =
            [(64, 3, 3, 37), (128, 5, 2, 20), (64, 1, 2, 1), (64, 6, 1, 9), (512, 16, 1, 21), (64, 11, 2, 3)];
        for (hd, group, kv_heads, n) in shapes {
            let heads = group * kv_heads;
            let (ld, ldp) = (kv_heads * hd + 8, n + 3);
            let v: Vec<u16> = (0..n * ld).map(|i| f16_bits((i as f32 * 0.11).cos())).collect();
            let p: Vec<f32> = (0..heads * ldp).map(|i| (i as f32 * 0.37).sin().abs()).collect();
            let start: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.05).sin()).collect();
            let (mut direct, mut widened) = (start.clone(), start.clone());
            let ran = super::group_weighted_sum_f16((&p, ldp), (hd, group), (&v, ld), n, &mut direct);
            let wide: Vec<f32> = v.iter().map(|&b| f16_value(b)).collect();
            super::group_weighted_sum((&p, ldp), (hd, group), (&wide, ld), n, &mut widened);
            if ran {
                let same = direct.iter().zip(&widened).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "hd {hd} group {group} n {n}");
            } else {
                assert_eq!(direct, start, "not run: untouched");
                assert!(super::super::cpu_kernels() < CpuKernels::Avx2);
            }
        }
    }

    /// Decode's scores straight from f16 keys equal, bit for bit, the scores of the keys widened to
    /// f32 first (where the f16 kernels run: AVX-512 and AVX2), for partial passes of positions too.
    #[test]
    fn scores_of_f16_keys_equal_those_of_the_widened_keys() {
        use crate::bits16::{f16_bits, f16_value};
        // Latent attention's sixteen heads of one 576-value row, eleven heads of a KV head, odd
        // position counts.
        let shapes = [
            (64, 3, 3, 37),
            (128, 5, 2, 6),
            (64, 1, 2, 1),
            (32, 4, 1, 9),
            (64, 3, 3, 16),
            (64, 2, 1, 24),
            (576, 16, 1, 37),
            (64, 11, 2, 5),
            (64, 8, 1, 1),
        ];
        for (hd, group, kv_heads, n) in shapes {
            let heads = group * kv_heads;
            let (ld, ldo) = (kv_heads * hd + 8, n + 3);
            let k: Vec<u16> = (0..n * ld).map(|i| f16_bits((i as f32 * 0.13).sin())).collect();
            let q: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.29).cos()).collect();
            let (mut direct, mut widened) = (vec![-7.0; heads * ldo], vec![-7.0; heads * ldo]);
            let ran = super::group_scores_f16(&q, (hd, group), (&k, ld), n, (&mut direct, ldo));
            let wide: Vec<f32> = k.iter().map(|&b| f16_value(b)).collect();
            super::group_scores(&q, (hd, group), (&wide, ld), n, (&mut widened, ldo));
            if ran {
                let same = direct.iter().zip(&widened).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "hd {hd} group {group} n {n}");
            } else {
                assert!(direct.iter().all(|&v| v == -7.0), "not run: untouched");
                assert!(super::super::cpu_kernels() < CpuKernels::Avx2);
            }
        }
    }

    #[test]
    fn exp_scaled_sums_its_exps() {
        let base: Vec<f32> = (0..37).map(|i| (i as f32 * 0.77).sin() * 30.0).collect();
        for k in CpuKernels::available() {
            let mut row = base.clone();
            let sum = super::exp_scaled_with(k, &mut row, 0.5, 3.0);
            let want: Vec<f64> = base.iter().map(|&v| (f64::from(v) * 0.5 - 3.0).exp()).collect();
            for (a, b) in row.iter().zip(&want) {
                assert!((f64::from(*a) - b).abs() <= 1e-6 * b + 1e-12, "{k:?}: {a} vs {b}");
            }
            assert!((f64::from(sum) - want.iter().sum::<f64>()).abs() < 1e-4 * want.iter().sum::<f64>());
        }
    }
}
