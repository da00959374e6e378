//! AVX-512 kernels of decode attention: the scores over f16 keys and the value sums over f32 or f16
//! rows, widened in registers as they are read (see `decode_avx2` for the AVX2 ones), and the
//! transposing reduction the AVX-512 score kernels share.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `group_scores_avx512` over f16 keys: each position's sum the same chain of FMAs over the same
/// (exactly widened) values, reduced by the same [`reduce16`], so every score is the f32 kernel's
/// over the rows widened first. Up to three query heads of one KV head at a time, eight positions
/// per pass, so each key chunk is loaded and widened once for the heads that read it (widening
/// each block to f32 first, then reading it once per head, took 29% of a native decode step after
/// 4,000 tokens).
///
/// # Safety
/// AVX-512F; `hd` a multiple of 16; lengths as `sys::group_scores` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn group_scores_f16(
    q: &[f32],
    (hd, group): (usize, usize),
    (k, ldk): (&[u16], usize),
    n: usize,
    (out, ldo): (&mut [f32], usize),
) {
    for (kh, first, g) in super::decode_avx2::head_runs(q.len() / hd, group) {
        let mut i0 = 0;
        while i0 < n {
            let cnt = (n - i0).min(16);
            let at = (hd, kh, first);
            match g {
                3 => scores16_f16::<3>(q, at, (k, ldk), (i0, cnt), (out, ldo)),
                2 => scores16_f16::<2>(q, at, (k, ldk), (i0, cnt), (out, ldo)),
                _ => scores16_f16::<1>(q, at, (k, ldk), (i0, cnt), (out, ldo)),
            }
            i0 += cnt;
        }
    }
}

/// Heads `first..first + G` against positions `i0..i0 + cnt` (`cnt <= 16`) of f16 keys.
///
/// # Safety
/// As [`group_scores_f16`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores16_f16<const G: usize>(
    q: &[f32],
    (hd, kh, first): (usize, usize, usize),
    (k, ldk): (&[u16], usize),
    (i0, cnt): (usize, usize),
    (out, ldo): (&mut [f32], usize),
) {
    // Each head's two halves reduced as `reduce16` reduces them (`reduce8`, `join8`).
    let mut halves = [[_mm512_setzero_ps(); 2]; G];
    for half in 0..cnt.div_ceil(8) {
        let mut acc = [[_mm512_setzero_ps(); 8]; G];
        // SAFETY (of the loads): positions below n, columns below hd of KV head kh, heads below
        // q's. Missing positions of a partial pass read the last one again; their lanes are not
        // stored (each lane of `reduce16` comes from its own vector alone).
        let rows: [*const u16; 8] =
            std::array::from_fn(|i| k.as_ptr().add((i0 + (half * 8 + i).min(cnt - 1)) * ldk + kh * hd));
        for c in (0..hd).step_by(16) {
            for (i, row) in rows.iter().enumerate() {
                let key = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c).cast()));
                for (g, acc) in acc.iter_mut().enumerate() {
                    let qv = _mm512_loadu_ps(q.as_ptr().add((first + g) * hd + c));
                    acc[i] = _mm512_fmadd_ps(qv, key, acc[i]);
                }
            }
        }
        for (h, acc) in halves.iter_mut().zip(&acc) {
            h[half] = reduce8(acc);
        }
    }
    let m: __mmask16 = if cnt == 16 { 0xffff } else { (1u16 << cnt) - 1 };
    for (g, h) in halves.iter().enumerate() {
        // SAFETY: out holds every head's row of at least n values, `ldo` apart (the caller).
        _mm512_mask_storeu_ps(out.as_mut_ptr().add((first + g) * ldo + i0), m, join8(h[0], h[1]));
    }
}

/// `r[i]` = the sum of `v[i]`'s sixteen lanes, for sixteen vectors at once (a transposing reduction:
/// 45 operations instead of sixteen separate horizontal sums).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn reduce16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    let (lo, hi) = v.split_at(8);
    // SAFETY: AVX-512F (the contract); eight vectors each.
    join8(reduce8(lo.try_into().unwrap()), reduce8(hi.try_into().unwrap()))
}

/// [`reduce16`]'s work on eight of its vectors: each 128-bit lane of the result holds a partial sum
/// of each of four vectors (lanes 0 and 1: vectors 0-3, over their 128-bit lanes 0 and 2, then 1
/// and 3; lanes 2 and 3: vectors 4-7 likewise).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn reduce8(v: &[std::arch::x86_64::__m512; 8]) -> std::arch::x86_64::__m512 {
    // Per 128-bit lane: [sum of a's 4, b's 4, c's 4, d's 4] for four vectors a, b, c, d.
    let four = |a: __m512, b: __m512, c: __m512, d: __m512| {
        let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(ab, cd), _mm512_shuffle_ps::<0xEE>(ab, cd))
    };
    let t0 = four(v[0], v[1], v[2], v[3]);
    let t1 = four(v[4], v[5], v[6], v[7]);
    // Add 128-bit lanes 0+2 and 1+3 of the two.
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(t0, t1), _mm512_shuffle_f32x4::<0xEE>(t0, t1))
}

/// [`reduce16`] from the [`reduce8`]s of its two halves: lanes 0-7 come from `lo` alone, 8-15 from
/// `hi`.
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn join8(lo: std::arch::x86_64::__m512, hi: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(lo, hi), _mm512_shuffle_f32x4::<0xDD>(lo, hi))
}

/// A V-row element the value sums read sixteen at a time as f32 lanes.
#[cfg(target_arch = "x86_64")]
pub(super) trait Lanes16: Copy {
    /// # Safety
    /// AVX-512F; `p..p + 16` readable.
    unsafe fn load16(p: *const Self) -> __m512;
}

#[cfg(target_arch = "x86_64")]
impl Lanes16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        _mm512_loadu_ps(p)
    }
}

/// f16 bits, widened exactly as they are read.
#[cfg(target_arch = "x86_64")]
impl Lanes16 for u16 {
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> __m512 {
        // SAFETY: the caller's contract (16 values, 32 bytes).
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

/// `sys::group_weighted_sum` over V rows of f32 or f16 bits with `hd` a multiple of 64: each query
/// head's accumulators stay in registers over every position (one fused multiply-add per value, in
/// position order: f16 rows give the sums of the rows widened first, bit for bit), four heads of
/// one KV head at a time so each V row is loaded (and widened) once for them.
///
/// # Safety
/// AVX-512F; `hd` a multiple of 64; lengths as `sys::group_weighted_sum` asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn group_weighted_sum<T: Lanes16>(
    (p, ldp): (&[f32], usize),
    (hd, group): (usize, usize),
    (v, ldv): (&[T], usize),
    n: usize,
    acc: &mut [f32],
) {
    let heads = acc.len() / hd;
    for kh in 0..heads / group {
        let mut h0 = 0;
        while h0 < group {
            let hn = (group - h0).min(4);
            let first = kh * group + h0;
            match hn {
                4 => weighted_heads::<T, 4>(p, ldp, (hd, kh, first), (v, ldv), n, acc),
                3 => weighted_heads::<T, 3>(p, ldp, (hd, kh, first), (v, ldv), n, acc),
                2 => weighted_heads::<T, 2>(p, ldp, (hd, kh, first), (v, ldv), n, acc),
                _ => weighted_heads::<T, 1>(p, ldp, (hd, kh, first), (v, ldv), n, acc),
            }
            h0 += hn;
        }
    }
}

/// Query heads `first..first + G` (all reading KV head `kh`) of [`group_weighted_sum`], 64 columns
/// at a time: 4 x G accumulators stay in registers over every position.
///
/// # Safety
/// As [`group_weighted_sum`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_heads<T: Lanes16, const G: usize>(
    p: &[f32],
    ldp: usize,
    (hd, kh, first): (usize, usize, usize),
    (v, ldv): (&[T], usize),
    n: usize,
    acc: &mut [f32],
) {
    let base = acc.as_mut_ptr();
    for c0 in (0..hd).step_by(64) {
        // SAFETY (of the loads and stores): head first + g < heads, column c0 + 16c + 15 < hd.
        let mut a = [[_mm512_setzero_ps(); 4]; G];
        for (g, a) in a.iter_mut().enumerate() {
            for (c, a) in a.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(base.add((first + g) * hd + c0 + c * 16));
            }
        }
        for i in 0..n {
            // SAFETY: position i < n, whose row holds KV head kh's hd values.
            let row = v.as_ptr().add(i * ldv + kh * hd + c0);
            // (A loop, not `array::from_fn`: its closure would be a call per position, not inlined
            // into this function's target features.)
            let mut x = [_mm512_setzero_ps(); 4];
            for (c, x) in x.iter_mut().enumerate() {
                *x = T::load16(row.add(c * 16));
            }
            for (g, a) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.get_unchecked((first + g) * ldp + i));
                for (a, &x) in a.iter_mut().zip(&x) {
                    *a = _mm512_fmadd_ps(w, x, *a);
                }
            }
        }
        for (g, a) in a.iter().enumerate() {
            for (c, &a) in a.iter().enumerate() {
                _mm512_storeu_ps(base.add((first + g) * hd + c0 + c * 16), a);
            }
        }
    }
}
