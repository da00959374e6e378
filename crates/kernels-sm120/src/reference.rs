//! The CPU definition of every kernel: what the GPU must compute (up to rounding), used by the GPU
//! checks and usable on its own. Attention accumulates in f64.

/// bf16 bits to f32 (the workspace's one conversion, the `half` crate's).
pub fn bf16_to_f32(v: u16) -> f32 {
    half::bf16::from_bits(v).to_f32()
}

/// f32 to bf16 bits, round to nearest even (NaN stays NaN), as the kernels' `f2bf` does.
pub fn f32_to_bf16(f: f32) -> u16 {
    half::bf16::from_f32(f).to_bits()
}

/// Rounds every value through bf16.
pub fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect()
}

/// `rmsnorm_residual`: `x += add` (if any), returns `x / rms(x) * w` per row (before the bf16 store).
pub fn rmsnorm_residual(x: &mut [f32], add: Option<&[f32]>, w: &[f32], dim: usize, eps: f32) -> Vec<f32> {
    if let Some(a) = add {
        for (v, a) in x.iter_mut().zip(a) {
            *v += a;
        }
    }
    let mut out = vec![0.0; x.len()];
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
            *o = (v as f64 * inv * w as f64) as f32;
        }
    }
    out
}

/// `rope_qk` on one row: the first `n_heads` heads of `row` rotated for position `pos`, cos and sin
/// times `attn_factor`.
pub fn rope_row(
    row: &mut [f32],
    pos: usize,
    inv_freq: &[f32],
    n_heads: usize,
    head_dim: usize,
    attn_factor: f32,
) {
    let half = head_dim / 2;
    for h in 0..n_heads {
        let v = &mut row[h * head_dim..(h + 1) * head_dim];
        for i in 0..half {
            let angle = (pos as f32 * inv_freq[i]) as f64;
            let (s, c) = angle.sin_cos();
            let (s, c) = (s * attn_factor as f64, c * attn_factor as f64);
            let (a, b) = (v[i] as f64, v[i + half] as f64);
            v[i] = (a * c - b * s) as f32;
            v[i + half] = (b * c + a * s) as f32;
        }
    }
}

/// The inverse frequencies the model uses: `theta^(-2i/head_dim)` in f32.
pub fn inv_freq(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
}

/// `head_rmsnorm`: per-head RMSNorm of the first `q_heads + k_heads` heads of each row of `qkv`
/// (`row_stride` apart), Q heads with `wq`, K heads with `wk`, in place.
pub fn head_rmsnorm(
    qkv: &mut [f32],
    row_stride: usize,
    (q_heads, k_heads, head_dim): (usize, usize, usize),
    wq: &[f32],
    wk: &[f32],
    eps: f32,
) {
    for row in qkv.chunks_exact_mut(row_stride) {
        for h in 0..q_heads + k_heads {
            let v = &mut row[h * head_dim..(h + 1) * head_dim];
            let w = if h < q_heads { wq } else { wk };
            let ms = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / head_dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for (x, &w) in v.iter_mut().zip(w) {
                *x = (*x as f64 * inv * w as f64) as f32;
            }
        }
    }
}

/// `fill_random_bf16`'s value at index `i`: `bf16(scale * u)`, `u` uniform in [-1, 1) from a
/// splitmix64 finalizer of `seed + i * golden`.
pub fn random_bf16(seed: u64, i: u64, scale: f32) -> u16 {
    let mut x = seed.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    let u = (x >> 40) as f32 * (1.0 / 8_388_608.0) - 1.0;
    f32_to_bf16(u * scale)
}

/// `swiglu`: rows of `[gate | up]` to `silu(gate) * up`.
pub fn swiglu(gu: &[f32], inter: usize) -> Vec<f32> {
    gu.chunks_exact(2 * inter)
        .flat_map(|r| {
            let (g, u) = r.split_at(inter);
            g.iter().zip(u).map(|(&g, &u)| (g as f64 / (1.0 + (-g as f64).exp()) * u as f64) as f32)
        })
        .collect()
}

/// A paged KV cache of one layer as the kernels see it: `[slot][kv head][head dim]` bf16 values, with
/// `slot = block * block_size + position in block`.
#[derive(Debug, Clone)]
pub struct PagedKv<'a> {
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl PagedKv<'_> {
    fn at(&self, table: &[i32], pos: usize, kvh: usize) -> usize {
        let slot = table[pos / self.block_size] as usize * self.block_size + pos % self.block_size;
        (slot * self.kv_heads + kvh) * self.head_dim
    }
}

/// Attention of one query vector over positions `0..ctx` of a sequence whose blocks are `table`.
pub fn attention(q: &[f32], kv: &PagedKv<'_>, table: &[i32], ctx: usize, kvh: usize, scale: f32) -> Vec<f32> {
    let d = kv.head_dim;
    let scores: Vec<f64> = (0..ctx)
        .map(|p| {
            let k = &kv.k[kv.at(table, p, kvh)..][..d];
            q.iter().zip(k).map(|(&a, &b)| a as f64 * bf16_to_f32(b) as f64).sum::<f64>() * scale as f64
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut out = vec![0f64; d];
    for (p, w) in e.iter().enumerate() {
        let v = &kv.v[kv.at(table, p, kvh)..][..d];
        for (o, &vv) in out.iter_mut().zip(v) {
            *o += w / z * bf16_to_f32(vv) as f64;
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// The order-preserving integer key of a float (the sampling kernel's thresholds are over these).
pub fn order_key(f: f32) -> u32 {
    let u = f.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The kernel's uniform draw in [0, 1) for (seed, step).
pub fn uniform(seed: u64, step: u64) -> f32 {
    (splitmix64(seed ^ splitmix64(step)) >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// The ids `sample_rows` may return for these logits and settings (temperature > 0), with each one's
/// probability: top-k by logit (ties at the k-th kept), then the top-p nucleus by logit.
pub fn allowed(logits: &[f32], temp: f32, top_k: usize, top_p: f32) -> Vec<(usize, f64)> {
    let mut keys: Vec<u32> = logits.iter().map(|&x| order_key(x)).collect();
    keys.sort_unstable_by_key(|&k| std::cmp::Reverse(k));
    let kmin = if top_k > 0 && top_k < logits.len() { keys[top_k - 1] } else { 0 };
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w = |x: f32| ((x as f64 - m) / temp as f64).exp();
    let total: f64 = logits.iter().filter(|&&x| order_key(x) >= kmin).map(|&x| w(x)).sum();
    let mut kfinal = kmin;
    if top_p < 1.0 {
        // Largest key whose kept mass reaches p * total: walk distinct keys from the top.
        let mut mass = 0.0;
        let mut by_key: Vec<(u32, f64)> = Vec::new();
        for &x in logits.iter().filter(|&&x| order_key(x) >= kmin) {
            by_key.push((order_key(x), w(x)));
        }
        by_key.sort_unstable_by_key(|k| std::cmp::Reverse(k.0));
        let mut i = 0;
        while i < by_key.len() {
            let k = by_key[i].0;
            while i < by_key.len() && by_key[i].0 == k {
                mass += by_key[i].1;
                i += 1;
            }
            if mass >= top_p as f64 * total {
                kfinal = k;
                break;
            }
        }
    }
    let kept: Vec<(usize, f64)> =
        logits.iter().enumerate().filter(|(_, &x)| order_key(x) >= kfinal).map(|(i, &x)| (i, w(x))).collect();
    let z: f64 = kept.iter().map(|k| k.1).sum();
    kept.into_iter().map(|(i, p)| (i, p / z)).collect()
}

/// The id `sample_rows` draws for `u`, given the allowed set in id order (exact arithmetic; the
/// kernel's float sums may differ at a boundary).
pub fn draw(allowed: &[(usize, f64)], u: f32) -> usize {
    let mut run = 0.0;
    for &(i, p) in allowed {
        run += p;
        if (u as f64) < run {
            return i;
        }
    }
    allowed.last().map(|a| a.0).unwrap_or(0)
}

/// The lowest id holding the largest logit.
pub fn argmax(logits: &[f32]) -> usize {
    // From the first value that is not NaN: a NaN is never the pick.
    let mut best = logits.iter().position(|x| !x.is_nan()).unwrap_or(0);
    for (i, &v) in logits.iter().enumerate().skip(best) {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::INFINITY)), f32::INFINITY);
    }

    #[test]
    fn attention_of_equal_keys_is_the_mean_of_values() {
        let (d, bs) = (8, 4);
        let k = vec![f32_to_bf16(0.5); 8 * d];
        let v: Vec<u16> = (0..8 * d).map(|i| f32_to_bf16((i / d) as f32)).collect();
        let kv = PagedKv { k: &k, v: &v, kv_heads: 1, head_dim: d, block_size: bs };
        // Blocks 1 then 0: positions 0..4 are slots 4..8 (values 4..7), 4..6 slots 0..2 (values 0, 1).
        let out = attention(&[1.0; 8], &kv, &[1, 0], 6, 0, 0.3);
        let want = (4.0 + 5.0 + 6.0 + 7.0 + 0.0 + 1.0) / 6.0;
        assert!(out.iter().all(|&o| (o - want).abs() < 1e-6), "{out:?}");
    }

    #[test]
    fn sampling_sets_follow_top_k_and_top_p() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0];
        assert_eq!(argmax(&logits), 1);
        let ids = |a: Vec<(usize, f64)>| a.into_iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(ids(allowed(&logits, 1.0, 1, 1.0)), vec![1, 3], "ties at the k-th are kept");
        assert_eq!(ids(allowed(&logits, 1.0, 3, 1.0)), vec![1, 2, 3]);
        assert_eq!(ids(allowed(&logits, 1.0, 0, 1.0)).len(), 5);
        assert_eq!(ids(allowed(&logits, 1.0, 0, 0.5)), vec![1, 3]);
        let a = allowed(&logits, 1.0, 0, 1.0);
        assert!((a.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(draw(&a, 0.0), 0);
        assert_eq!(draw(&a, 0.999_999), 4);
        let u: Vec<f32> = (0..1000).map(|s| uniform(s, 7)).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().sum::<f32>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
    }

    #[test]
    fn order_key_preserves_order() {
        let v = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in v.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{w:?}");
        }
    }
}
