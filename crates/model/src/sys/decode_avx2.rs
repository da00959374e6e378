//! AVX2 (+FMA, F16C) kernels of decode attention over a run of paged positions: the grouped scores
//! and the weighted value sums, reading K and V rows of f32 or of f16 bits (widened in registers as
//! they are read, no f32 copy of the rows). Within each kernel the f16 rows give, bit for bit, what
//! the same rows widened to f32 first give (the conversion is exact and the operations are the same).
//!
//! Scores: four positions by up to three query heads of one KV head at a time, so each key chunk is
//! loaded (and widened) once for the heads that read it; one FMA per (position, head, 8 columns) and a
//! transposing reduction per four positions. Value sums: each head's accumulators stay in registers
//! over every position (32 columns at a time), one fused multiply-add per element, in position order
//! (the portable loop's order; fused, so not its bits: each family is batch-invariant on its own).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A row element the kernels read eight at a time as f32 lanes.
#[cfg(target_arch = "x86_64")]
pub(super) trait Lanes: Copy {
    /// # Safety
    /// AVX2, FMA and F16C; `p..p + 8` readable.
    unsafe fn load8(p: *const Self) -> __m256;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        _mm256_loadu_ps(p)
    }
}

/// f16 bits.
#[cfg(target_arch = "x86_64")]
impl Lanes for u16 {
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: the caller's contract (8 values, 16 bytes).
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

/// Whether the kernels here take a head size: whole 8-lane chunks for the scores, whole 32-column
/// blocks for the value sums.
pub(super) fn scores_fit(hd: usize) -> bool {
    hd.is_multiple_of(8)
}

pub(super) fn sums_fit(hd: usize) -> bool {
    hd.is_multiple_of(32)
}

/// `out[h * ldo + i] = q_h . k_i[(h / group) * hd..][..hd]` for every query head h and position
/// `i < n` (see [`group_scores`](super::group_scores)).
///
/// # Safety
/// AVX2, FMA and F16C; `hd` a multiple of 8; lengths as `group_scores` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_scores<T: Lanes>(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[T], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) {
    for (kh, first, g) in head_runs(q.len() / hd, group) {
        let mut i0 = 0;
        while i0 < n {
            let cnt = (n - i0).min(4);
            // SAFETY: heads first..first + g read KV head kh; positions i0..i0 + cnt, with
            // i0 + cnt <= n; the lengths as asserted by the caller.
            match g {
                3 => scores_tile::<T, 3>(q, (hd, kh, first), (k, ldk), (i0, cnt), (out, ldo)),
                2 => scores_tile::<T, 2>(q, (hd, kh, first), (k, ldk), (i0, cnt), (out, ldo)),
                _ => scores_tile::<T, 1>(q, (hd, kh, first), (k, ldk), (i0, cnt), (out, ldo)),
            }
            i0 += cnt;
        }
    }
}

/// (KV head, first query head, heads): the query heads of each KV head in runs of at most three,
/// the most a kernel here (or the AVX-512 f16 scores) works on at once.
pub(super) fn head_runs(heads: usize, group: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..heads / group)
        .flat_map(move |kh| (0..group).step_by(3).map(move |h0| (kh, kh * group + h0, (group - h0).min(3))))
}

/// Heads `first..first + G` against positions `i0..i0 + cnt` (`cnt <= 4`).
///
/// # Safety
/// As [`group_scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_tile<T: Lanes, const G: usize>(
    q: &[f32],
    (hd, kh, first): (usize, usize, usize),
    (k, ldk): (&[T], usize),
    (i0, cnt): (usize, usize),
    (out, ldo): (&mut [f32], usize),
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; G];
    // SAFETY (of the loads and stores below): rows of positions below n, columns below hd, heads
    // below heads; `out` holds every head's row of at least n values `ldo` apart (the caller).
    // Missing positions of a last partial tile read its last position again; their sums are not stored.
    let rows: [*const T; 4] = std::array::from_fn(|i| k.as_ptr().add((i0 + i.min(cnt - 1)) * ldk + kh * hd));
    for c in (0..hd).step_by(8) {
        let keys: [__m256; 4] = std::array::from_fn(|i| T::load8(rows[i].add(c)));
        for (g, acc) in acc.iter_mut().enumerate() {
            let qv = _mm256_loadu_ps(q.as_ptr().add((first + g) * hd + c));
            for (a, &key) in acc.iter_mut().zip(&keys) {
                *a = _mm256_fmadd_ps(qv, key, *a);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        // Lane i of the result: the eight lanes of a[i] summed.
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
        let dst = out.as_mut_ptr().add((first + g) * ldo + i0);
        if cnt == 4 {
            _mm_storeu_ps(dst, sums);
        } else {
            let mut lanes = [0f32; 4];
            _mm_storeu_ps(lanes.as_mut_ptr(), sums);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, cnt);
        }
    }
}

/// `acc[h * hd..][..hd] += sum_i p[h * ldp + i] * v_i[(h / group) * hd..][..hd]` for every query head
/// h (see [`group_weighted_sum`](super::group_weighted_sum)).
///
/// # Safety
/// AVX2, FMA and F16C; `hd` a multiple of 32; lengths as `group_weighted_sum` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_weighted_sum<T: Lanes>(
    (p, ldp): (&[f32], usize),
    (hd, group): (usize, usize),
    (v, ldv): (&[T], usize),
    n: usize,
    acc: &mut [f32],
) {
    for (kh, first, g) in head_runs(acc.len() / hd, group) {
        // SAFETY: heads first..first + g read KV head kh; lengths as asserted by the caller.
        match g {
            3 => weighted_heads::<T, 3>((p, ldp), (hd, kh, first), (v, ldv), n, acc),
            2 => weighted_heads::<T, 2>((p, ldp), (hd, kh, first), (v, ldv), n, acc),
            _ => weighted_heads::<T, 1>((p, ldp), (hd, kh, first), (v, ldv), n, acc),
        }
    }
}

/// Heads `first..first + G` of [`group_weighted_sum`], 32 columns at a time: 4 x G accumulators in
/// registers over every position.
///
/// # Safety
/// As [`group_weighted_sum`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_heads<T: Lanes, const G: usize>(
    (p, ldp): (&[f32], usize),
    (hd, kh, first): (usize, usize, usize),
    (v, ldv): (&[T], usize),
    n: usize,
    acc: &mut [f32],
) {
    let base = acc.as_mut_ptr();
    for c0 in (0..hd).step_by(32) {
        let out = |g: usize, c: usize| base.add((first + g) * hd + c0 + c * 8);
        let mut a: [[__m256; 4]; G] =
            std::array::from_fn(|g| std::array::from_fn(|c| _mm256_loadu_ps(out(g, c))));
        for i in 0..n {
            // SAFETY: position i < n, whose row holds KV head kh's hd values; heads below heads.
            let row = v.as_ptr().add(i * ldv + kh * hd + c0);
            let w: [__m256; G] =
                std::array::from_fn(|g| _mm256_set1_ps(*p.get_unchecked((first + g) * ldp + i)));
            for c in 0..4 {
                let x = T::load8(row.add(c * 8));
                for (a, &w) in a.iter_mut().zip(&w) {
                    a[c] = _mm256_fmadd_ps(w, x, a[c]);
                }
            }
        }
        for (g, a) in a.iter().enumerate() {
            for (c, &a) in a.iter().enumerate() {
                _mm256_storeu_ps(out(g, c), a);
            }
        }
    }
}
