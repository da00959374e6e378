//! The product of quantized weights on CPUs with AVX-512 BF16, one arithmetic for every step size:
//! `x` rounded to bf16, each weight widened to `bf16(min + q * scale)` (Q4) or `bf16(q * scale)`
//! (Q8), and each output the sum of 16 lanes, lane `l` a `vdpbf16ps` chain over the pairs
//! `(32 s + 2 l, 32 s + 2 l + 1)` for s = 0, 1, ..., then [`sum4`]'s tree. That is what
//! [`tile_dot`] computes over weight rows widened into memory; the decode tiles here widen them in
//! registers instead and give the same sums bit for bit, so a row's values never depend on how many
//! rows its step has (batch invariance): a one-token decode, a verify step with drafts, a batch of 32
//! decodes and a 1,000-token prefill all compute every row the same way.

#![allow(unsafe_code)]

use super::gemm::{split_columns, ROWS_TILE};
#[cfg(target_arch = "x86_64")]
use super::qdot::f16_splat;
use crate::bits16::bf16_value;
#[cfg(target_arch = "x86_64")]
use crate::bits16::f16_value;

/// A quantized matrix the product reads: its rows widened to bf16, into memory or in registers.
pub(crate) trait Bf16Rows: Sync {
    /// Rows `r0..r0 + 4`, every column, as bf16 row-major into `dst` (4 x k).
    fn widen(&self, r0: usize, dst: &mut [u16]);

    /// `out[r * ldo + c] = x[r] . row (r0 + c)` for `R` rows of x and 4 weight rows, widened in
    /// registers: the values [`tile_dot`] gives for the rows [`widen`](Self::widen) writes.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW and AVX-512 BF16; `px` R x k values; rows `r0..r0 + 4` exist; `po` R rows
    /// (`ldo` apart) of 4 writable f32.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile<const R: usize>(&self, px: *const u16, k: usize, r0: usize, po: *mut f32, ldo: usize);
}

/// A Q4 matrix's parts (see `quant::Q4Matrix`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q4Rows<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u16],
    pub mins: &'a [u16],
    pub cols: usize,
}

/// A Q8 matrix's parts (see `quant::Q8Matrix`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q8Rows<'a> {
    pub values: &'a [i8],
    pub scales: &'a [u16],
    pub cols: usize,
}

impl Bf16Rows for Q4Rows<'_> {
    fn widen(&self, r0: usize, dst: &mut [u16]) {
        super::q4_bf16_rows(self.packed, self.scales, self.mins, self.cols, r0, ROWS_TILE, dst);
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tile<const R: usize>(&self, px: *const u16, k: usize, r0: usize, po: *mut f32, ldo: usize) {
        q4_tile::<R>(*self, px, k, r0, po, ldo)
    }
}

impl Bf16Rows for Q8Rows<'_> {
    fn widen(&self, r0: usize, dst: &mut [u16]) {
        super::q8_bf16_rows(self.values, self.scales, self.cols, r0, ROWS_TILE, dst);
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tile<const R: usize>(&self, px: *const u16, k: usize, r0: usize, po: *mut f32, ldo: usize) {
        q8_tile::<R>(*self, px, k, r0, po, ldo)
    }
}

/// How many tiles of four weight rows ahead the decode tiles prefetch their weights.
const PREFETCH_TILES: usize = 4;

/// Whether this CPU runs the product's kernels (AVX-512F, BW and BF16).
pub(crate) fn has_rows_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::has_bf16_gemm() && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Groups of four weight rows a long step widens into memory at a time: their bf16 rows (up to
/// 64 x 1,536 values, 192 KiB) stay in L2 while every tile of x passes over them, so x is read once
/// per block, not once per four weight rows.
const BLOCK_GROUPS: usize = 16;

/// `out[t x n] = x[t x k] . W^T` for a quantized `w` (see the module docs): `k` and `n` multiples of
/// 32. Steps of up to four rows widen each weight group in registers; longer ones widen blocks of
/// weight rows into L2 and pass every tile of four x rows over them. Spread over the thread pool by
/// output columns.
pub(crate) fn gemm_rows_bf16<W: Bf16Rows>(xb: &[u16], t: usize, k: usize, n: usize, w: &W, out: &mut [f32]) {
    assert!(k.is_multiple_of(32) && k > 0 && n.is_multiple_of(32), "k and n must be multiples of 32");
    assert!(xb.len() >= t * k && out.len() >= t * n);
    let groups = n / ROWS_TILE;
    if !has_rows_bf16() {
        // The same sums in the same order, without the instructions (tests on other CPUs).
        let mut wb = vec![0u16; ROWS_TILE * k];
        for g in 0..groups {
            w.widen(g * ROWS_TILE, &mut wb);
            for r in 0..t {
                let x = &xb[r * k..(r + 1) * k];
                for (c, wr) in wb.chunks_exact(k).enumerate() {
                    out[r * n + g * ROWS_TILE + c] = dot_in_lanes(x, wr);
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    split_columns(groups, out, |g0, g1, dst| {
        if t <= 4 {
            for g in g0..g1 {
                // SAFETY: the CPU has AVX-512F, BW and BF16 (checked above); x holds t rows of k;
                // this task alone writes columns g*4..g*4+4 of each row.
                unsafe {
                    let po = dst.add(g * ROWS_TILE);
                    match t {
                        4 => w.tile::<4>(xb.as_ptr(), k, g * ROWS_TILE, po, n),
                        3 => w.tile::<3>(xb.as_ptr(), k, g * ROWS_TILE, po, n),
                        2 => w.tile::<2>(xb.as_ptr(), k, g * ROWS_TILE, po, n),
                        _ => w.tile::<1>(xb.as_ptr(), k, g * ROWS_TILE, po, n),
                    }
                }
            }
            return;
        }
        let mut wb = vec![0u16; BLOCK_GROUPS * ROWS_TILE * k];
        let mut b0 = g0;
        while b0 < g1 {
            let b1 = (b0 + BLOCK_GROUPS).min(g1);
            for g in b0..b1 {
                w.widen(g * ROWS_TILE, &mut wb[(g - b0) * ROWS_TILE * k..][..ROWS_TILE * k]);
            }
            let mut r = 0;
            while r < t {
                let tile = (t - r).min(4);
                for g in b0..b1 {
                    // SAFETY: as above; `wb` holds this block's rows, 4 x k per group.
                    unsafe {
                        let (px, pw) = (xb.as_ptr().add(r * k), wb.as_ptr().add((g - b0) * ROWS_TILE * k));
                        let po = dst.add(r * n + g * ROWS_TILE);
                        match tile {
                            4 => super::gemm::tile_dot::<4>(px, k, pw, po, n),
                            3 => super::gemm::tile_dot::<3>(px, k, pw, po, n),
                            2 => super::gemm::tile_dot::<2>(px, k, pw, po, n),
                            _ => super::gemm::tile_dot::<1>(px, k, pw, po, n),
                        }
                    }
                }
                r += tile;
            }
            b0 = b1;
        }
    });
}

/// One output as [`tile_dot`] sums it, in scalar code: 16 lanes of pair sums (each product of two
/// bf16 values exact in f32, each pair added to its lane in the order `vdpbf16ps` adds it), then
/// [`sum4`]'s tree over the lanes. (The instruction also flushes subnormal inputs and results to
/// zero; x here is rounded by `to_bf16`, which flushes its subnormals, and products of the model's
/// values are far from f32's subnormals.)
fn dot_in_lanes(x: &[u16], w: &[u16]) -> f32 {
    let mut lanes = [0f32; 16];
    for (xs, ws) in x.chunks_exact(32).zip(w.chunks_exact(32)) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let (a0, a1) = (bf16_value(xs[2 * l]), bf16_value(xs[2 * l + 1]));
            let (b0, b1) = (bf16_value(ws[2 * l]), bf16_value(ws[2 * l + 1]));
            // The odd element's product first, as Intel's definition of the instruction adds them
            // (and as the test below finds the hardware does).
            *lane = a0.mul_add(b0, a1.mul_add(b1, *lane));
        }
    }
    // sum4: within each 128-bit lane, (l0 + l2) + (l1 + l3); then the four 128-bit lanes, (q0 + q2)
    // + (q1 + q3).
    let q: [f32; 4] = std::array::from_fn(|i| {
        let v = &lanes[4 * i..4 * i + 4];
        (v[0] + v[2]) + (v[1] + v[3])
    });
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Q4 decode tile (see [`Bf16Rows::tile`]): per group of 32, each weight row's 16 possible values
/// `min + i * scale` made once in f32 and looked up by nibble (`vpermps` reads an index's low four
/// bits: the low nibble, then the high one shifted down), then rounded to bf16 together, which is
/// `q4_bf16_rows`'s value for every weight. The scales and minimums of the tile's rows are widened
/// to f32 once, up front.
///
/// # Safety
/// See [`Bf16Rows::tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn q4_tile<const R: usize>(
    w: Q4Rows<'_>,
    px: *const u16,
    k: usize,
    r0: usize,
    po: *mut f32,
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let groups = k / 32;
    let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    // Every group's scale and minimum of the tile's four rows, in f32 (at most 4 x 64 groups per
    // call: k up to 2,048; longer rows go round in slices of 64 groups).
    const SLICE: usize = 64;
    let mut sf = std::mem::MaybeUninit::<[f32; ROWS_TILE * SLICE]>::uninit();
    let mut mf = std::mem::MaybeUninit::<[f32; ROWS_TILE * SLICE]>::uninit();
    // SAFETY: only the elements written below (each slice's groups of each row) are ever read.
    let (sf, mf) = (&mut *sf.as_mut_ptr(), &mut *mf.as_mut_ptr());
    let mut acc = [[_mm512_setzero_ps(); ROWS_TILE]; R];
    let mut g0 = 0;
    while g0 < groups {
        let gn = (groups - g0).min(SLICE);
        for c in 0..ROWS_TILE {
            let at = (r0 + c) * groups + g0;
            widen_f16s(&w.scales[at..at + gn], &mut sf[c * SLICE..c * SLICE + gn]);
            widen_f16s(&w.mins[at..at + gn], &mut mf[c * SLICE..c * SLICE + gn]);
        }
        for gi in 0..gn {
            let gk = g0 + gi;
            // A tile's weight rows are a few cache lines each, too short a run for the hardware
            // prefetcher: each group's step asks for one line of the tile `PREFETCH_TILES` ahead (its
            // four rows are 64 bytes a group), past the matrix's end harmlessly.
            let ahead =
                w.packed.as_ptr().wrapping_add(((r0 + ROWS_TILE * PREFETCH_TILES) * groups + gk * 4) * 16);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            // (A loop, not `array::from_fn`: that closure is not inlined into this function's target
            // features, and a call per row and group halves the speed.)
            let mut ws = [_mm512_setzero_si512(); ROWS_TILE];
            for (c, wc) in ws.iter_mut().enumerate() {
                let g = (r0 + c) * groups + gk;
                let s = _mm512_set1_ps(*sf.get_unchecked(c * SLICE + gi));
                let m = _mm512_set1_ps(*mf.get_unchecked(c * SLICE + gi));
                let table = _mm512_add_ps(_mm512_mul_ps(iota, s), m);
                let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.packed.as_ptr().add(g * 16).cast()));
                let lo = _mm512_permutexvar_ps(bytes, table);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table);
                *wc = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
            }
            tile_group(&mut acc, &ws, px.add(gk * 32), k);
        }
        g0 += gn;
    }
    store_tile(&acc, po, ldo);
}

/// One group step of a decode tile: the `R` activation rows' 32 bf16 values from `x` (rows `k`
/// apart) times each of the tile's four weight rows' 32 (`ws`, bf16 pairs), added into `acc`.
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `x + r * k .. + 32` readable for every row r < R.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn tile_group<const R: usize>(
    acc: &mut [[std::arch::x86_64::__m512; ROWS_TILE]; R],
    ws: &[std::arch::x86_64::__m512i; ROWS_TILE],
    x: *const u16,
    k: usize,
) {
    use std::arch::x86_64::*;
    let ws: &[__m512bh; ROWS_TILE] = std::mem::transmute(ws);
    for (r, a) in acc.iter_mut().enumerate() {
        let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(r * k).cast()));
        for (ac, wc) in a.iter_mut().zip(ws) {
            *ac = _mm512_dpbf16_ps(*ac, xv, *wc);
        }
    }
}

/// A decode tile's sums out: row r's four outputs at `po + r * ldo`.
///
/// # Safety
/// AVX-512F; `po + r * ldo .. + 4` writable for every row r < R.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile<const R: usize>(
    acc: &[[std::arch::x86_64::__m512; ROWS_TILE]; R],
    po: *mut f32,
    ldo: usize,
) {
    for (r, a) in acc.iter().enumerate() {
        std::arch::x86_64::_mm_storeu_ps(po.add(r * ldo), super::gemm::sum4(a));
    }
}

/// f16 bits as f32, sixteen at a time.
///
/// # Safety
/// AVX-512F; `dst` as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_f16s(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 16 <= src.len() {
        let v = _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(i).cast()));
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), v);
        i += 16;
    }
    for j in i..src.len() {
        dst[j] = f16_value(src[j]);
    }
}

/// Q8 decode tile (see [`Bf16Rows::tile`]): each group of 32 widened as `q8_bf16_rows` widens it.
///
/// # Safety
/// See [`Bf16Rows::tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn q8_tile<const R: usize>(
    w: Q8Rows<'_>,
    px: *const u16,
    k: usize,
    r0: usize,
    po: *mut f32,
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let groups = k / 32;
    let mut acc = [[_mm512_setzero_ps(); ROWS_TILE]; R];
    for gk in 0..groups {
        // The tile `PREFETCH_TILES` ahead, two lines a group step (see `q4_tile`).
        let ahead =
            w.values.as_ptr().wrapping_add(((r0 + ROWS_TILE * PREFETCH_TILES) * groups + gk * 4) * 32);
        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
        // (A loop, not `array::from_fn`: see `q4_tile`.)
        let mut ws = [_mm512_setzero_si512(); ROWS_TILE];
        for (c, wc) in ws.iter_mut().enumerate() {
            let g = (r0 + c) * groups + gk;
            let s = f16_splat(*w.scales.get_unchecked(g));
            let pq = w.values.as_ptr().add(g * 32);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.cast())));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(16).cast())));
            let v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
            *wc = std::mem::transmute::<__m512bh, __m512i>(v);
        }
        tile_group(&mut acc, &ws, px.add(gk * 32), k);
    }
    store_tile(&acc, po, ldo);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bits16::bf16_bits;
    use crate::test_values as values;

    /// Every row of every step size gives the bits of that row alone, and of the scalar definition.
    #[test]
    fn every_step_size_gives_each_row_the_same_bits() {
        use crate::quant::{Q4Matrix, Q8Matrix, QuantMatrix};
        let (n, k) = (96, 320);
        let w = values(n * k, 5);
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let q8 = Q8Matrix::quantize(&w, n, k).unwrap();
        let q4r = Q4Rows { packed: &q4.packed, scales: &q4.scales, mins: &q4.mins, cols: k };
        let q8r = Q8Rows { values: &q8.values, scales: &q8.scales, cols: k };
        let x: Vec<u16> = values(70 * k, 9).iter().map(|&v| bf16_bits(v)).collect();
        fn check<W: Bf16Rows>(name: &str, w: &W, x: &[u16], n: usize, k: usize) {
            let mut one = vec![0f32; n];
            let mut rows_alone = Vec::new();
            for r in 0..70 {
                gemm_rows_bf16(&x[r * k..(r + 1) * k], 1, k, n, w, &mut one);
                rows_alone.push(one.clone());
            }
            let mut wb = vec![0u16; 4 * k];
            for g in 0..n / 4 {
                w.widen(g * 4, &mut wb);
                for r in [0, 69] {
                    for c in 0..4 {
                        let want = dot_in_lanes(&x[r * k..(r + 1) * k], &wb[c * k..(c + 1) * k]);
                        let got = rows_alone[r][g * 4 + c];
                        assert_eq!(got.to_bits(), want.to_bits(), "{name} row {r} column {}", g * 4 + c);
                    }
                }
            }
            for t in [2, 3, 4, 5, 9, 17, 64, 70] {
                let mut out = vec![0f32; t * n];
                gemm_rows_bf16(&x[..t * k], t, k, n, w, &mut out);
                for r in 0..t {
                    for j in 0..n {
                        let (a, b) = (out[r * n + j], rows_alone[r][j]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{name} t={t} row {r} column {j}: {a} against {b}"
                        );
                    }
                }
            }
        }
        check("q4", &q4r, &x, n, k);
        check("q8", &q8r, &x, n, k);
    }
}
