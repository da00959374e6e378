//! Element-wise kernels: SwiGLU (`silu(g) * u`) and the f32 dot product.

#[cfg(target_arch = "x86_64")]
use super::attention::exp_avx512;

/// `out[i] = silu(g[i]) * u[i]` (SwiGLU), vectorized where the CPU has AVX-512F.
pub(crate) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_with(super::cpu_kernels(), g, u, out)
}

/// [`silu_mul`] with the kernels `k` (at most what the CPU has).
pub(crate) fn silu_mul_with(k: super::CpuKernels, g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == out.len());
    assert!(k <= super::CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has); the lengths are equal (asserted).
        #[cfg(target_arch = "x86_64")]
        super::CpuKernels::Amx | super::CpuKernels::Avx512 => unsafe { silu_mul_avx512(g, u, out) },
        // SAFETY: the CPU has AVX2 and FMA (as above); the lengths are equal (asserted).
        #[cfg(target_arch = "x86_64")]
        super::CpuKernels::Avx2 => unsafe { silu_mul_avx2(g, u, out) },
        _ => silu_mul_tail(g, u, out, 0),
    }
}

/// # Safety
/// AVX2 and FMA; `g`, `u` and `out` of equal length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut done = 0;
    while done + 8 <= g.len() {
        // SAFETY (of the loads and the store): done + 8 <= len for all three slices.
        let gv = _mm256_loadu_ps(g.as_ptr().add(done));
        let e = super::attention::exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        let s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_storeu_ps(out.as_mut_ptr().add(done), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(done))));
        done += 8;
    }
    silu_mul_tail(g, u, out, done);
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

/// Dot product, with an AVX2+FMA kernel where the CPU has one.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), and the lengths are equal.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

pub(super) fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
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
    // (What `rows_f32`'s tiles compute for every output: the same chains, the same reduction.)
    let sum = super::hsum256(_mm256_add_ps(acc0, acc1));
    if i == n {
        return sum;
    }
    sum + a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum::<f32>()
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
    fn silu_mul_matches_the_formula() {
        // Far past both ends of exp's range too (-200: e^200 overflows f32).
        let mut g: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.7).collect();
        g.extend([-200.0, -90.0, 90.0, 200.0, -0.0, 0.0, 1e-30, -1e30]);
        let u: Vec<f32> = (0..g.len()).map(|i| (i as f32 * 0.3).cos()).collect();
        for k in super::super::CpuKernels::available() {
            let mut out = vec![f32::NAN; g.len()];
            super::silu_mul_with(k, &g, &u, &mut out);
            for i in 0..g.len() {
                let want = f64::from(g[i]) / (1.0 + (-f64::from(g[i])).exp()) * f64::from(u[i]);
                let want = if want.is_nan() { 0.0 } else { want };
                assert!(
                    (f64::from(out[i]) - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{k:?} {i} (g {}): {} vs {want}",
                    g[i],
                    out[i]
                );
            }
        }
    }
}
