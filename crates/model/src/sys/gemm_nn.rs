//! Prefill attention's products on the AVX2 and AVX-512 paths: an unpacked GEMM of row-major operands
//! read where they lie (a block of queries times the keys gathered transposed, then probabilities
//! times the values).

/// `$tile::<R>(args)` for the tile's row count `$rows`, one of the literals listed (each its own
/// monomorphized register tile).
macro_rules! tile_rows {
    ($rows:expr; $($r:literal)+; $tile:ident $args:tt) => {
        match $rows {
            $($r => $tile::<$r> $args,)+
            rows => unreachable!("no {rows}-row tile"),
        }
    };
}

/// `c[m×n] = a[m×k] · b[k×n]`, all row-major (`a`'s rows `lda` apart, `b`'s `ldb`, `c`'s `n`), with
/// a kernel that reads both where they lie, no packing: a register tile of up to six rows by 16
/// columns (AVX2: twelve 8-lane sums) or up to eight rows by 32 (AVX-512: sixteen 16-lane sums)
/// takes, per step of k, two vectors of b's row and a broadcast of a's column per row, so its FMAs
/// bound it. Each sum runs over k in order, one FMA a step, from zero, so every kernel family gives
/// the same values. Returns false, touching nothing, unless the kernels running have AVX2 and `n` is
/// a multiple of 16 (AVX-512 takes multiples of 32). For attention's products (scores from a block of
/// queries and the keys transposed, then probabilities times the values), where the products are too
/// small for packing to pay.
pub(crate) fn sgemm_nn(
    (a, lda): (&[f32], usize),
    m: usize,
    k: usize,
    (b, ldb): (&[f32], usize),
    n: usize,
    c: &mut [f32],
) -> bool {
    assert!(lda >= k && ldb >= n && c.len() >= m * n);
    assert!(m == 0 || k == 0 || a.len() >= (m - 1) * lda + k);
    assert!(k == 0 || n == 0 || b.len() >= (k - 1) * ldb + n);
    #[cfg(target_arch = "x86_64")]
    if super::avx512() && n.is_multiple_of(32) && k > 0 {
        for_tiles(m, n, (8, 32), |i, j, rows| {
            let (ap, bp, cp) = (a[i * lda..].as_ptr(), b[j..].as_ptr(), c[i * n + j..].as_mut_ptr());
            // SAFETY: the kernels running have AVX-512F (so the CPU has); rows i..i + rows of a hold
            // k values each, rows 0..k of b hold columns j..j + 32 (n is a multiple of 32), and rows
            // i..i + rows of c columns j..j + 32 (asserted above).
            unsafe { tile_rows!(rows; 8 7 6 5 4 3 2 1; nn_tile_avx512(ap, lda, k, bp, ldb, cp, n)) }
        });
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if super::avx2() && n.is_multiple_of(16) && k > 0 {
        for_tiles(m, n, (6, 16), |i, j, rows| {
            let (ap, bp, cp) = (a[i * lda..].as_ptr(), b[j..].as_ptr(), c[i * n + j..].as_mut_ptr());
            // SAFETY: the kernels running have AVX2 and FMA (so the CPU has); rows i..i + rows of a
            // hold k values each, rows 0..k of b hold columns j..j + 16 (n is a multiple of 16), and
            // rows i..i + rows of c columns j..j + 16 (asserted above).
            unsafe { tile_rows!(rows; 6 5 4 3 2 1; nn_tile_avx2(ap, lda, k, bp, ldb, cp, n, false)) }
        });
        return true;
    }
    false
}

/// `tile(i, j, rows)` for each register tile of an `m x n` product, `width` columns by at most
/// `most` rows: column blocks in order, each down all the rows.
#[cfg(target_arch = "x86_64")]
fn for_tiles(m: usize, n: usize, (most, width): (usize, usize), mut tile: impl FnMut(usize, usize, usize)) {
    for j in (0..n).step_by(width) {
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(most);
            tile(i, j, rows);
            i += rows;
        }
    }
}

/// `R` rows of `a` (`lda` apart, `k` values) times 16 columns of `b` (rows `ldb` apart) into `R` rows
/// of 16 of `c` (`ldc` apart): each sum from zero, or with `add` from `c`'s value (the sum carried on
/// over more of k, exactly as if it had not stopped).
///
/// # Safety
/// AVX2 and FMA; the rows and columns named lie within their slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn nn_tile_avx2<const R: usize>(
    a: *const f32,
    lda: usize,
    k: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    if add {
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = [_mm256_loadu_ps(c.add(r * ldc)), _mm256_loadu_ps(c.add(r * ldc + 8))];
        }
    }
    for p in 0..k {
        let (b0, b1) = (_mm256_loadu_ps(b.add(p * ldb)), _mm256_loadu_ps(b.add(p * ldb + 8)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*a.add(r * lda + p));
            acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
            acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(c.add(r * ldc), acc[0]);
        _mm256_storeu_ps(c.add(r * ldc + 8), acc[1]);
    }
}

/// `R` rows of `a` (`lda` apart, `k` values) times 32 columns of `b` (rows `ldb` apart) into `R` rows
/// of 32 of `c` (`ldc` apart): [`nn_tile_avx2`]'s sums, 16 lanes at a time.
///
/// # Safety
/// AVX-512F; the rows and columns named lie within their slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nn_tile_avx512<const R: usize>(
    a: *const f32,
    lda: usize,
    k: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in 0..k {
        let (b0, b1) = (_mm512_loadu_ps(b.add(p * ldb)), _mm512_loadu_ps(b.add(p * ldb + 16)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(r * lda + p));
            acc[0] = _mm512_fmadd_ps(av, b0, acc[0]);
            acc[1] = _mm512_fmadd_ps(av, b1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(c.add(r * ldc), acc[0]);
        _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn nn_gemm_sums_each_product_in_order_on_strided_operands() {
        // Every remainder of the 6-row tile, one and many steps of k, rows of a and b wider than used.
        for (m, k, n) in [
            (1, 1, 16),
            (5, 64, 16),
            (6, 64, 48),
            (13, 333, 32),
            (64, 1000, 64),
            (11, 7, 16),
            (9, 40, 96),
            (17, 64, 32),
        ] {
            let (lda, ldb) = (k + 3, n + 16);
            let a: Vec<f32> = (0..m * lda).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * ldb).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut c = vec![f32::NAN; m * n];
            if !super::sgemm_nn((&a, lda), m, k, (&b, ldb), n, &mut c) {
                assert!(!super::super::avx2(), "AVX2 and AVX-512 kernels take every shape here");
                assert!(c.iter().all(|v| v.is_nan()), "not taken: nothing written");
                continue;
            }
            for r in 0..m {
                for j in 0..n {
                    // One FMA a step, in order, from zero: the same value on every kernel family.
                    let want = (0..k).fold(0f32, |s, p| a[r * lda + p].mul_add(b[p * ldb + j], s));
                    assert_eq!(c[r * n + j].to_bits(), want.to_bits(), "{m}x{k}x{n} at {r},{j}");
                }
            }
        }
        assert!(
            !super::sgemm_nn((&[0.0; 8], 1), 8, 1, (&[0.0; 8], 8), 8, &mut [0.0; 64]),
            "8 columns: not taken"
        );
    }
}
