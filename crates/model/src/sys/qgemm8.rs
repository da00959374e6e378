//! Long steps' products of int8 inputs with Q4 weights on AVX2 (`--activations q8`, steps of more
//! than 16 rows, where no AVX-512 runs): a GEMM whose inner loop is two integer multiplies per 32
//! products, where the f32 path takes four FMAs and `qint8`'s tiles a conversion and an FMA on top.
//!
//! The arithmetic. Each input row gets one f32 scale per block of 256 values (`max |x| / 127`, as
//! llama.cpp's K-quant inputs), refined per group of 32 by a power of two shared by the four rows of
//! a register tile: group g is rounded to int8 at `scale / 2^e_g`, `e_g` (0..=4) the most halvings
//! under which the tile's values in the group still fit in -127..=127. Activations carry outliers in
//! the same channels from token to token, so the other groups keep most of the bits a scale of their
//! own gives: on the default model's test prompts (`int8_activations_keep_decode_logits_close` under
//! `PDSERVE_CPU_KERNELS=avx2`) logits move by up to 2.24 against f32's, where a scale per group gives
//! 2.05, the block scale alone 5.8 and powers of two shared by the whole step 3.09. Those are single
//! draws: adding a tile's eight lanes in another order moved the 37-token prompt's step from 2.12 to
//! 5.03, and 10-bit weight scales with up to 5 halvings gave 4.1-4.5, so they rank the designs only
//! roughly; the error comes from the blocks that hold an outlier channel. Each weight row's
//! group scales are written as integers `k_g` (0..=2047, the f16 scales' 11 bits) times one f32 scale
//! per row, and the tile shifts them to `k_g * 2^(4 - e_g)` (at most 32752; one shift per weight group
//! for the tile's rows, which costs the GEMM about a tenth). A block's product is then an exact
//! integer sum: per group, `vpmaddubsw` multiplies the 32 nibbles (0..=15) by the 32 int8 inputs and
//! adds pairs into 16-bit lanes (at most 2 * 15 * 127, no saturation), `vpmaddwd` multiplies those by
//! the group's integer and adds pairs into 32-bit lanes, and a block's eight groups stay below 2^31
//! (8 * 2 * 3810 * 32752). Each block's sum is converted once and scaled by the input row's block
//! scale, the weight row's at the end, and Q4's minimums add `sum_g min_g * sum(x_g)` over the inputs'
//! exact f32 group sums.

use rayon::prelude::*;

use super::qint8::round_ties_even;
use super::CpuKernels;
use crate::bits16::f16_value;

/// Groups of 32 values under one input scale (a block of 256 values).
const BLOCK_GROUPS: usize = 8;
/// Input rows and weight rows per register tile: 4 x 2 sums of 32-bit lanes, two weight groups and
/// their scale vectors, one input group (14 of the 16 registers).
const TILE_X: usize = 4;
const TILE_W: usize = 2;
/// The largest weight group scale as an integer (11 bits), and the most halvings of a block's scale
/// a group takes (so `K_MAX << MAX_SHIFT` fits in 16 bits).
const K_MAX: f32 = 2047.0;
const MAX_SHIFT: u8 = 4;

/// Input rows rounded to int8 per block of 256 values, as [`gemm_q4_int8_par`] reads them.
#[derive(Debug)]
pub(crate) struct Int8Blocks {
    k: usize,
    /// Row `r`'s values at `q[r * k..]`, each in -127..=127.
    q: Vec<i8>,
    /// Row `r`'s block scales at `d[r * blocks(k)..]`, over `2^MAX_SHIFT`: group g's values are
    /// `q * d * 2^(MAX_SHIFT - e)`, `e` its halvings.
    d: Vec<f32>,
    /// Each group's halvings of its block's scale, shared by the rows of a tile: row `r`'s at
    /// `shift[r / TILE_X * groups..]`.
    shift: Vec<u8>,
    /// Row `r`'s group sums (exact f32) at `sum[r * padded_groups(k)..]`, zero past its groups.
    sum: Vec<f32>,
}

fn blocks(k: usize) -> usize {
    (k / 32).div_ceil(BLOCK_GROUPS)
}

/// Groups of a row, rounded up to whole 8-lane vectors (the minimums' share is summed 8 at a time).
fn padded_groups(k: usize) -> usize {
    (k / 32).next_multiple_of(8)
}

impl Int8Blocks {
    /// `x` (rows of `k`, `k` a nonzero multiple of 32) rounded to int8 as the module states: per
    /// block of 256 values (the last may be shorter) a scale `max |x| / 127` (NaN where the block holds
    /// one, so products carry it), per group the shared halvings, values rounded to nearest, ties to
    /// even; the rows over the thread pool.
    pub(crate) fn quantize(x: &[f32], k: usize) -> Int8Blocks {
        let mut rows = Int8Blocks { k, q: Vec::new(), d: Vec::new(), shift: Vec::new(), sum: Vec::new() };
        rows.requantize(x, k);
        rows
    }

    /// [`quantize`](Self::quantize) into these buffers, kept from an earlier step (a long step's
    /// inputs are hundreds of KiB, freshly faulted in when allocated anew).
    pub(crate) fn requantize(&mut self, x: &[f32], k: usize) {
        assert!(k.is_multiple_of(32) && k > 0 && x.len().is_multiple_of(k));
        let (t, g, nb, gp) = (x.len() / k, k / 32, blocks(k), padded_groups(k));
        // Row by row: each block's largest |x| (NaN for a block holding one) and the halvings each
        // group's values fit under; then each group's fewest over the rows.
        let (mut bmax, mut fits) = (vec![0f32; t * nb], vec![0u8; t * g]);
        bmax.par_chunks_mut(nb).zip(fits.par_chunks_mut(g)).zip(x.par_chunks(k)).for_each(
            |((bm, e), row)| {
                for ((bm, e), xb) in
                    bm.iter_mut().zip(e.chunks_mut(BLOCK_GROUPS)).zip(row.chunks(BLOCK_GROUPS * 32))
                {
                    let mut gmax = [0f32; BLOCK_GROUPS];
                    for (m, grp) in gmax.iter_mut().zip(xb.chunks_exact(32)) {
                        *m = group_max(grp);
                    }
                    let gmax = &gmax[..e.len()];
                    *bm = gmax
                        .iter()
                        .fold(0f32, |a, &m| if a.is_nan() || m.is_nan() { f32::NAN } else { a.max(m) });
                    for (e, &m) in e.iter_mut().zip(gmax) {
                        *e = (0..=MAX_SHIFT).rev().find(|&s| m * f32::from(1u8 << s) <= *bm).unwrap_or(0);
                    }
                }
            },
        );
        // Shared by the rows of each tile (the tiles' rows share the weights' scale vectors).
        let mut shift = vec![MAX_SHIFT; t.div_ceil(TILE_X) * g];
        for (r, e) in fits.chunks_exact(g).enumerate() {
            for (s, &e) in shift[r / TILE_X * g..][..g].iter_mut().zip(e) {
                *s = (*s).min(e);
            }
        }
        // (Every value of `q` is written below; the sums' padding must be zero.)
        self.k = k;
        self.q.resize(x.len(), 0);
        (self.d, self.shift) = (bmax, shift);
        self.sum.clear();
        self.sum.resize(t * gp, 0.0);
        let shift = &self.shift;
        self.q
            .par_chunks_mut(k)
            .zip(self.d.par_chunks_mut(nb))
            .zip(self.sum.par_chunks_mut(gp))
            .zip(x.par_chunks(k))
            .enumerate()
            .for_each(|(r, (((q, d), sum), x))| {
                let shift = &shift[r / TILE_X * g..][..g];
                for (b, d) in d.iter_mut().enumerate() {
                    let bmax = *d;
                    let inv = if bmax > 0.0 && (127.0 / bmax).is_finite() { 127.0 / bmax } else { 0.0 };
                    for gi in b * BLOCK_GROUPS..((b + 1) * BLOCK_GROUPS).min(g) {
                        let inv = inv * f32::from(1u8 << shift[gi]);
                        sum[gi] = round_group(&x[gi * 32..][..32], inv, &mut q[gi * 32..][..32]);
                    }
                    *d = bmax / (127.0 * f32::from(1u8 << MAX_SHIFT));
                }
            });
    }

    fn rows(&self) -> usize {
        self.q.len() / self.k
    }
}

/// A block of Q4 weight rows laid out for the tiles: each group's 32 values as bytes in order, its
/// scale as an integer in all 16 lanes of a vector, the minimums in f32 (padded like the inputs'
/// sums) and each row's scale `D`.
#[derive(Debug, Default)]
struct WideQ4 {
    vals: Vec<u8>,
    kv: Vec<i16>,
    mins: Vec<f32>,
    dw: Vec<f32>,
}

/// A Q4 matrix's parts (see `quant::Q4Matrix`): 16 bytes of nibbles per group (byte j holds value j
/// in its low nibble and value j + 16 in its high one), f16 scales and minimums, one per group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q4Parts<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u16],
    pub mins: &'a [u16],
}

impl WideQ4 {
    /// Rows `r0..r1` of `w` (rows of `k`).
    fn fill(&mut self, w: Q4Parts<'_>, k: usize, r0: usize, r1: usize) {
        let (g, gp, n) = (k / 32, padded_groups(k), r1 - r0);
        self.vals.resize(n * k, 0);
        self.kv.resize(n * g * 16, 0);
        self.mins.clear();
        self.mins.resize(n * gp, 0.0);
        self.dw.resize(n, 0.0);
        for i in 0..n {
            let r = r0 + i;
            let (scales, mins) = (&w.scales[r * g..][..g], &w.mins[r * g..][..g]);
            let (kv, m) = (&mut self.kv[i * g * 16..][..g * 16], &mut self.mins[i * gp..][..g]);
            let (src, dst) = (&w.packed[r * k / 2..][..k / 2], &mut self.vals[i * k..][..k]);
            #[cfg(target_arch = "x86_64")]
            if super::avx2() {
                // SAFETY: the kernels running have AVX2 and F16C; `kv` holds 16 values per scale,
                // `m` one per minimum, `dst` twice `src`'s bytes.
                unsafe {
                    self.dw[i] = row_scales_avx2(scales, mins, kv, m);
                    unpack_nibbles_avx2(src, dst);
                }
                continue;
            }
            self.dw[i] = row_scales(scales, mins, kv, m);
            for (b, v) in src.chunks_exact(16).zip(dst.chunks_exact_mut(32)) {
                for (j, &byte) in b.iter().enumerate() {
                    (v[j], v[j + 16]) = (byte & 15, byte >> 4);
                }
            }
        }
    }
}

/// One weight row's group scales as integers in 16 lanes each (`kv`), its minimums in f32 (`m`), and
/// the row's scale `D` (returned): `k_g = round(scale_g * K_MAX / max |scale|)`, ties to even (0 for
/// a NaN), `D = max |scale| / K_MAX`.
fn row_scales(scales: &[u16], mins: &[u16], kv: &mut [i16], m: &mut [f32]) -> f32 {
    let smax = scales.iter().fold(0f32, |m, &s| m.max(f16_value(s).abs()));
    let (dw, inv) = if smax > 0.0 { (smax / K_MAX, K_MAX / smax) } else { (0.0, 0.0) };
    for (kv, &s) in kv.chunks_exact_mut(16).zip(scales) {
        kv.fill(round_ties_even(f16_value(s) * inv).clamp(-K_MAX, K_MAX) as i16);
    }
    for (m, &h) in m.iter_mut().zip(mins) {
        *m = f16_value(h);
    }
    dw
}

/// [`row_scales`] on AVX2 with F16C, eight groups at a time (the same values: the conversions are
/// exact and `vroundps` rounds ties to even as `round_ties_even` does).
///
/// # Safety
/// AVX2 and F16C; `kv` holds 16 values per scale, `m` one per minimum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_scales_avx2(scales: &[u16], mins: &[u16], kv: &mut [i16], m: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(kv.len() == 16 * scales.len() && m.len() == mins.len());
    let g = scales.len();
    let v8 = g / 8 * 8;
    // SAFETY (of the loads and stores below): eight values from j < v8 <= g, or 16 lanes of group j.
    let wide = |j: usize, h: &[u16]| _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(j).cast()));
    let sign = _mm256_set1_ps(-0.0);
    // `max_ps(v, acc)` keeps `acc` where `v` is NaN, as `f32::max` does.
    let mut vmax = _mm256_setzero_ps();
    for j in (0..v8).step_by(8) {
        vmax = _mm256_max_ps(_mm256_andnot_ps(sign, wide(j, scales)), vmax);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let smax = scales[v8..]
        .iter()
        .fold(lanes.iter().fold(0f32, |a, &b| a.max(b)), |m, &s| m.max(f16_value(s).abs()));
    let (dw, inv) = if smax > 0.0 { (smax / K_MAX, K_MAX / smax) } else { (0.0, 0.0) };
    let (vinv, lim) = (_mm256_set1_ps(inv), _mm256_set1_ps(K_MAX));
    let mut ints = [0i32; 8];
    for j in (0..v8).step_by(8) {
        let p = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            wide(j, scales),
            vinv,
        ));
        // NaN lanes give 0, as `as i16` of a NaN does.
        let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(p, p);
        let p = _mm256_and_ps(
            _mm256_min_ps(_mm256_max_ps(p, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim),
            ordered,
        );
        _mm256_storeu_si256(ints.as_mut_ptr().cast(), _mm256_cvtps_epi32(p));
        for (l, &v) in ints.iter().enumerate() {
            _mm256_storeu_si256(kv.as_mut_ptr().add((j + l) * 16).cast(), _mm256_set1_epi16(v as i16));
        }
        _mm256_storeu_ps(m.as_mut_ptr().add(j), wide(j, mins));
    }
    for j in v8..g {
        kv[j * 16..][..16].fill(round_ties_even(f16_value(scales[j]) * inv).clamp(-K_MAX, K_MAX) as i16);
        m[j] = f16_value(mins[j]);
    }
    dw
}

/// Each group's 16 bytes of nibbles in `src` as 32 values in order in `dst`: the low nibbles, then
/// the high ones.
///
/// # Safety
/// AVX2; `dst.len() == 2 * src.len()`, a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn unpack_nibbles_avx2(src: &[u8], dst: &mut [u8]) {
    use std::arch::x86_64::*;
    debug_assert!(dst.len() == 2 * src.len() && src.len().is_multiple_of(16));
    let low = _mm256_set1_epi8(15);
    for (b, v) in src.chunks_exact(16).zip(dst.chunks_exact_mut(32)) {
        // SAFETY (of the load and store): 16 bytes read from `b`, 32 written to `v`.
        let bytes = _mm_loadu_si128(b.as_ptr().cast());
        let vals = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
        _mm256_storeu_si256(v.as_mut_ptr().cast(), vals);
    }
}

/// The largest |v| of a group of 32 values; NaN if one is.
fn group_max(g: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: the kernels running have AVX2 (so the CPU has).
        return unsafe { group_max_avx2(g) };
    }
    g.iter().fold(0f32, |m, &v| if v.is_nan() || m.is_nan() { f32::NAN } else { m.max(v.abs()) })
}

/// A group of 32 values times `inv`, rounded to the nearest integer (ties to even) into `q` (the
/// caller's `inv` keeps them within +-127); the group's sum.
fn round_group(x: &[f32], inv: f32, q: &mut [i8]) -> f32 {
    assert!(x.len() == 32 && q.len() == 32);
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: the kernels running have AVX2; 32 values each (asserted above).
        return unsafe { round_group_avx2(x, inv, q) };
    }
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_ties_even(v * inv).clamp(-127.0, 127.0) as i8;
    }
    x.iter().sum()
}

/// [`group_max`] on AVX2.
///
/// # Safety
/// AVX2; `g` holds 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn group_max_avx2(g: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(g.len(), 32);
    // SAFETY (of the loads): 32 values.
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(g.as_ptr().add(8 * i)));
    let sign = _mm256_set1_ps(-0.0);
    let abs: [__m256; 4] = std::array::from_fn(|i| _mm256_andnot_ps(sign, v[i]));
    let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let nan = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[0]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[1], v[1])),
        _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[2]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[3], v[3])),
    );
    if _mm256_movemask_ps(nan) != 0 {
        return f32::NAN;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    lanes.iter().fold(0f32, |a, &b| a.max(b))
}

/// [`round_group`] on AVX2 (`vcvtps2dq` rounds to nearest, ties to even, in the default mode; the
/// packs interleave 128-bit lanes, which the permutation undoes).
///
/// # Safety
/// AVX2; `x` and `q` hold 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_group_avx2(x: &[f32], inv: f32, q: &mut [i8]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY (of the loads and the store): 32 values each.
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
    let inv = _mm256_set1_ps(inv);
    let n: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(q.as_mut_ptr().cast(), _mm256_permutevar8x32_epi32(packed, order));
    super::hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])))
}

/// `out[t×n] = x · w^T` for int8 rows `x` and the `n` rows of the Q4 matrix `w` (see the module's
/// arithmetic), spread over the thread pool by blocks of weight rows; true where it ran: the kernel
/// family `kern` (at most what the CPU has) has AVX2 and `n` is even. Each input row's values are
/// the same whichever rows share its step.
pub(crate) fn gemm_q4_int8_par(
    kern: CpuKernels,
    x: &Int8Blocks,
    w: Q4Parts<'_>,
    n: usize,
    out: &mut [f32],
) -> bool {
    let (t, k) = (x.rows(), x.k);
    assert!(kern <= CpuKernels::detected());
    assert!(w.packed.len() == n * k / 2 && w.scales.len() == n * k / 32 && w.mins.len() == w.scales.len());
    assert!(out.len() >= t * n);
    if kern < CpuKernels::Avx2 || !n.is_multiple_of(TILE_W) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Weight rows widened together: about 128 KiB (each row's bytes and scale vectors, 2k), in L2;
        // every tile of input rows (in L1) is dotted with all of them before the next is read.
        let block = (64 * 1024 / k).max(TILE_W) / TILE_W * TILE_W;
        // Eight shares per thread: a share's weight rows are widened once whatever its size, and
        // every share reads the inputs once per few weight rows anyway.
        super::gemm::split_columns_by(n / TILE_W, 8, out, |u0, u1, dst| {
            // The pool thread's buffers, kept from its last share (no rayon call runs while they
            // are borrowed, so no stolen task can ask for them).
            // SAFETY: the CPU has AVX2 and FMA (`kern` is AVX2 or above and at most what it has);
            // `out` holds t rows of n (asserted above), of which this task alone writes these
            // columns.
            WIDE.with_borrow_mut(|wide| unsafe { share(x, w, n, block, (u0, u1), wide, dst) });
        });
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

thread_local! {
    static WIDE: std::cell::RefCell<WideQ4> = std::cell::RefCell::new(WideQ4::default());
}

/// Columns `u0 * TILE_W..u1 * TILE_W` of [`gemm_q4_int8_par`]'s product into `out` (rows of `n`),
/// `block` weight rows widened at a time into `wide`.
///
/// # Safety
/// AVX2 and FMA; `out` holds `x.rows()` rows of `n` values, of which no other task writes these
/// columns.
#[cfg(target_arch = "x86_64")]
unsafe fn share(
    x: &Int8Blocks,
    w: Q4Parts<'_>,
    n: usize,
    block: usize,
    (u0, u1): (usize, usize),
    wide: &mut WideQ4,
    out: *mut f32,
) {
    let (t, k) = (x.rows(), x.k);
    let mut b0 = u0 * TILE_W;
    while b0 < u1 * TILE_W {
        let b1 = (b0 + block).min(u1 * TILE_W);
        wide.fill(w, k, b0, b1);
        // Some weight rows at a time (24 KiB of their values, as much again of scale vectors)
        // against every tile of input rows: each tile, read once from L2, serves all of them. A
        // third as many rows (8 KiB, within L1) measured slower: a warm 1,000-token prefill 5-34%
        // in four alternating pairs, the products with k = 1,536 3-8% alone, where the inputs
        // were read from L2 once per two column pairs.
        let sub = (24 * 1024 / k).clamp(TILE_W, b1 - b0) / TILE_W * TILE_W;
        for s0 in (0..b1 - b0).step_by(sub) {
            let s1 = (s0 + sub).min(b1 - b0);
            let mut r = 0;
            while r < t {
                let rows = (t - r).min(TILE_X);
                for c in (s0..s1).step_by(TILE_W) {
                    // SAFETY: AVX2 and FMA (the contract); rows r..r + rows of x exist, `wide`
                    // holds rows c..c + 2 of its block, and columns b0 + c.. of `out` are this
                    // task's.
                    unsafe {
                        let o = out.add(r * n + b0 + c);
                        match rows {
                            4 => tile_avx2::<4>(x, r, wide, c, o, n),
                            3 => tile_avx2::<3>(x, r, wide, c, o, n),
                            2 => tile_avx2::<2>(x, r, wide, c, o, n),
                            _ => tile_avx2::<1>(x, r, wide, c, o, n),
                        }
                    }
                }
                r += rows;
            }
        }
        b0 = b1;
    }
}

/// Input rows `r0..r0 + R` against rows `c0, c0 + 1` of `w`'s block: `out[r * ldo + c]`.
///
/// # Safety
/// AVX2 and FMA; rows `r0..r0 + R` exist in `x`, rows `c0..c0 + 2` in `w` (filled for `x.k`), and
/// `out` has R rows (`ldo` apart) of two writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(
    x: &Int8Blocks,
    r0: usize,
    w: &WideQ4,
    c0: usize,
    out: *mut f32,
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let k = x.k;
    let (g, nb, gp) = (k / 32, blocks(k), padded_groups(k));
    let xq = x.q.as_ptr().add(r0 * k);
    let (wv, kv) = (w.vals.as_ptr().add(c0 * k), w.kv.as_ptr().add(c0 * g * 16));
    let shift = &x.shift[r0 / TILE_X * g..][..g];
    let mut facc = [[_mm256_setzero_ps(); TILE_W]; R];
    for b in 0..nb {
        let mut iacc = [[_mm256_setzero_si256(); TILE_W]; R];
        for gi in b * BLOCK_GROUPS..((b + 1) * BLOCK_GROUPS).min(g) {
            // SAFETY (of the loads): group gi < g lies within every row of x and of the block.
            let wc: [__m256i; TILE_W] =
                std::array::from_fn(|c| _mm256_loadu_si256(wv.add(c * k + gi * 32).cast()));
            // The weights' group scales times the tile's power of two for the group.
            let up = _mm_cvtsi32_si128(i32::from(MAX_SHIFT - *shift.get_unchecked(gi)));
            let kc: [__m256i; TILE_W] = std::array::from_fn(|c| {
                _mm256_sll_epi16(_mm256_loadu_si256(kv.add((c * g + gi) * 16).cast()), up)
            });
            for (r, acc) in iacc.iter_mut().enumerate() {
                let xv = _mm256_loadu_si256(xq.add(r * k + gi * 32).cast());
                for c in 0..TILE_W {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wc[c], xv), kc[c]);
                    acc[c] = _mm256_add_epi32(acc[c], p);
                }
            }
        }
        for (r, (f, i)) in facc.iter_mut().zip(&iacc).enumerate() {
            let d = _mm256_set1_ps(*x.d.get_unchecked((r0 + r) * nb + b));
            for c in 0..TILE_W {
                f[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[c]), d, f[c]);
            }
        }
    }
    for c in 0..TILE_W {
        let dw = _mm256_set1_ps(*w.dw.get_unchecked(c0 + c));
        for f in facc.iter_mut() {
            f[c] = _mm256_mul_ps(f[c], dw);
        }
    }
    let (mins, sums) = (w.mins.as_ptr().add(c0 * gp), x.sum.as_ptr().add(r0 * gp));
    for j in (0..gp).step_by(8) {
        for c in 0..TILE_W {
            let m = _mm256_loadu_ps(mins.add(c * gp + j));
            for (r, f) in facc.iter_mut().enumerate() {
                f[c] = _mm256_fmadd_ps(_mm256_loadu_ps(sums.add(r * gp + j)), m, f[c]);
            }
        }
    }
    for (r, f) in facc.iter().enumerate() {
        for (c, &v) in f.iter().enumerate() {
            *out.add(r * ldo + c) = super::hsum256(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Q4Matrix, QuantMatrix};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn parts(m: &Q4Matrix) -> Q4Parts<'_> {
        Q4Parts { packed: &m.packed, scales: &m.scales, mins: &m.mins }
    }

    /// The GEMM gives the module's arithmetic (its integer sums, block and row scales, minimums;
    /// checked in f64) for every tile shape, a last block shorter than 256 values and groups not a
    /// multiple of 8, and stays near the f32 product of the weights' own values: an outlier channel
    /// costs the other groups no precision.
    #[test]
    fn long_int8_products_are_the_blocks_integer_sums() {
        for groups in [19usize, 8, 48] {
            let (n, k) = (10, groups * 32);
            let mut wv = values(n * k, groups as u64);
            // One row with groups of very different ranges: small scales keep their precision.
            for (j, v) in wv[k..2 * k].iter_mut().enumerate() {
                *v *= if (j / 32) % 3 == 0 { 0.01 } else { 1.0 };
            }
            let m = Q4Matrix::quantize(&wv, n, k).unwrap();
            let dequantized: Vec<Vec<f32>> = (0..n).map(|c| m.dequantize_row(c)).collect();
            for t in 1..=9 {
                let mut x: Vec<f32> = values(t * k, 100 + t as u64).iter().map(|v| v * 3.0).collect();
                // An outlier channel, 20 times the others (as the model's activations have).
                for row in x.chunks_exact_mut(k) {
                    row[5] = 60.0;
                }
                let xb = Int8Blocks::quantize(&x, k);
                // The outlier's group takes its block's scale, the rest of its block 16 times finer.
                assert_eq!(xb.shift[..8], [0, 4, 4, 4, 4, 4, 4, 4]);
                let mut wide = WideQ4::default();
                wide.fill(parts(&m), k, 0, n);
                for kern in CpuKernels::available() {
                    let mut out = vec![f32::NAN; t * n];
                    if !gemm_q4_int8_par(kern, &xb, parts(&m), n, &mut out) {
                        assert_eq!(kern, CpuKernels::Portable, "AVX2 and above run it");
                        continue;
                    }
                    for r in 0..t {
                        for c in 0..n {
                            let want = reference(&xb, &wide, r, c);
                            let got = f64::from(out[r * n + c]);
                            assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "{kern:?} {r},{c}");
                            let exact: f64 =
                                (0..k).map(|j| f64::from(x[r * k + j]) * f64::from(dequantized[c][j])).sum();
                            // Five times the spread of the inputs' rounding (uniform within half
                            // a step: the outlier's group at 60 / 127, the rest of its block 16
                            // times finer), weighed by the weights' nibbles; the group scales' rounding
                            // (half a step of the largest / 2047) is far below it.
                            let var: f64 = (0..k)
                                .map(|j| {
                                    let g = j / 32;
                                    let step = f64::from(xb.d[r * blocks(k) + g / BLOCK_GROUPS])
                                        * f64::from(1u8 << (MAX_SHIFT - xb.shift[r / TILE_X * groups + g]));
                                    // (What multiplies the rounded input: the weight above its
                                    // group's minimum, which takes the exact sums.)
                                    let above = dequantized[c][j] - f16_value(m.mins[c * k / 32 + g]);
                                    step * step / 12.0 * f64::from(above).powi(2)
                                })
                                .sum();
                            let bound = 5.0 * var.sqrt() + 1e-3;
                            assert!((got - exact).abs() < bound, "{kern:?} {r},{c}: {got} against {exact}");
                        }
                    }
                }
            }
        }
    }

    /// The AVX2 widening of a row's scales and minimums gives the portable one's values, for any
    /// group count, with zeros, infinities and NaNs among the scales.
    #[test]
    fn row_scales_are_the_same_on_every_kernel_family() {
        #[cfg(target_arch = "x86_64")]
        if super::super::avx2() {
            let f16 = |v: f32| crate::bits16::f16_bits(v);
            for g in [1usize, 7, 8, 9, 18, 48, 61] {
                for special in [None, Some(0.0), Some(f32::NAN), Some(f32::INFINITY), Some(-65504.0)] {
                    let mut scales: Vec<u16> = values(g, g as u64).iter().map(|v| f16(v * 0.02)).collect();
                    let mins: Vec<u16> = values(g, 7 + g as u64).iter().map(|v| f16(v * 0.3)).collect();
                    if let Some(v) = special {
                        scales[g / 2] = f16(v);
                    }
                    let (mut kv, mut m) = (vec![0i16; 16 * g], vec![0f32; g]);
                    let dw = row_scales(&scales, &mins, &mut kv, &mut m);
                    let (mut kv2, mut m2) = (vec![1i16; 16 * g], vec![1f32; g]);
                    // SAFETY: the CPU has AVX2 and F16C (the kernels running have them); sizes as required.
                    let dw2 = unsafe { row_scales_avx2(&scales, &mins, &mut kv2, &mut m2) };
                    assert_eq!(
                        (dw.to_bits(), &kv, &m),
                        (dw2.to_bits(), &kv2, &m2),
                        "{g} groups, {special:?}"
                    );
                }
            }
        }
        // All-zero scales: a zero row scale and zero integers.
        let (mut kv, mut m) = (vec![5i16; 32], vec![0f32; 2]);
        assert_eq!(row_scales(&[0, 0], &[0, 0], &mut kv, &mut m), 0.0);
        assert!(kv.iter().all(|&v| v == 0));
    }

    fn reference(x: &Int8Blocks, w: &WideQ4, r: usize, c: usize) -> f64 {
        let k = x.k;
        let (g, gp) = (k / 32, padded_groups(k));
        let mut sum = 0f64;
        for gi in 0..g {
            let isum: i64 = (0..32)
                .map(|j| i64::from(w.vals[c * k + gi * 32 + j]) * i64::from(x.q[r * k + gi * 32 + j]))
                .sum();
            let up = MAX_SHIFT - x.shift[r / TILE_X * g + gi];
            let kg = f64::from(w.kv[(c * g + gi) * 16]) * f64::from(1u8 << up);
            sum += isum as f64 * kg * f64::from(x.d[r * blocks(k) + gi / BLOCK_GROUPS]);
        }
        let mins: f64 = (0..g).map(|gi| f64::from(w.mins[c * gp + gi]) * f64::from(x.sum[r * gp + gi])).sum();
        sum * f64::from(w.dw[c]) + mins
    }
}
