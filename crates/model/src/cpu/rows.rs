//! Row-wise work of a step: RoPE, RMS norms, residual adds, over the thread pool for long steps.
//! Each row's arithmetic is the same whatever step it is in.

use rayon::prelude::*;

/// Rotate-half RoPE on every head of `row` (heads of `hd` values) with the position's `cos` and
/// `sin` (`hd / 2` each).
pub(super) fn rope_rows(row: &mut [f32], hd: usize, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    for v in row.chunks_exact_mut(hd) {
        let (a, b) = v.split_at_mut(half);
        for i in 0..half {
            let (x, y) = (a[i], b[i]);
            a[i] = x * cos[i] - y * sin[i];
            b[i] = y * cos[i] + x * sin[i];
        }
    }
}

/// `sum x[i]^2`, in sixteen lanes (lane l sums elements l, l + 16, ... in order), then the lanes and
/// the tail in order: a loop the compiler vectorizes without reordering any sum, so the value is the
/// same on every CPU. (One sum in order, a chain of dependent additions, took about 1.6% of a native
/// warm prefill's samples in the forward bench; in lanes about 0.4%.)
fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `out[r] = x[r] / rms(x[r]) * weight` for each row of `x`.
pub(super) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ms = sum_squares(row) / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Steps of at least this many rows spread their row-wise work (norms, rope, SwiGLU, residual adds)
/// over the thread pool, 16 rows a task: a 1,000-token prefill spent 6% of its time there on one
/// thread while the other waited. Shorter steps (decode) keep it on the calling thread, where a
/// dispatch would cost more than the work. Each row's arithmetic is the same either way.
pub(super) const PAR_ROWS: usize = 64;

/// [`rms_norm`], over the thread pool for [`PAR_ROWS`] rows and more.
pub(super) fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    if x.len() < PAR_ROWS * n {
        return rms_norm(x, weight, eps, out);
    }
    x.par_chunks(16 * n).zip(out.par_chunks_mut(16 * n)).for_each(|(x, o)| rms_norm(x, weight, eps, o));
}

/// `x += y` for rows of `width`, over the thread pool for [`PAR_ROWS`] rows and more.
pub(super) fn add_rows(x: &mut [f32], y: &[f32], width: usize) {
    if x.len() < PAR_ROWS * width {
        return add_into(x, y);
    }
    x.par_chunks_mut(16 * width).zip(y.par_chunks(16 * width)).for_each(|(a, b)| add_into(a, b));
}

/// `x = x / rms(x) * weight` for one vector.
pub(super) fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let ms = sum_squares(x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = w * (*v * inv);
    }
}

pub(super) fn add_bias(m: &mut [f32], bias: &[f32]) {
    for row in m.chunks_exact_mut(bias.len()) {
        add_into(row, bias);
    }
}

pub(super) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
