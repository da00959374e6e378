//! Mixture-of-experts FFNs (Mixtral, Qwen3-MoE): each row's router softmax picks its top-k experts,
//! and each expert then runs once for every row routed to it (each weight row read once for all of
//! them; every row's value that of the row alone, as every product computes it).

use super::matmul;
use crate::sys::silu_mul;
use crate::{Moe, MoeWeights};

/// `out[r]` = the sum, over the experts row `r` of `x` (`t` rows of `hidden`) is routed to, of the
/// router's weight times the expert's output.
pub(super) fn moe_ffn(x: &[f32], t: usize, hidden: usize, moe: &Moe, w: &MoeWeights, out: &mut [f32]) {
    let (experts, ei) = (moe.experts, moe.intermediate_size);
    let logits = matmul(x, t, hidden, &w.router, experts);
    // Per expert: (row, weight) of the rows routed to it.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (r, l) in logits.chunks_exact(experts).enumerate() {
        let max = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let exps: Vec<f32> = l.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        order.clear();
        order.extend(0..experts);
        // Highest probability first; ties to the lower index.
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
        let chosen = &order[..moe.top_k];
        let total = if moe.norm_topk_prob { chosen.iter().map(|&e| exps[e]).sum::<f32>() } else { sum };
        for &e in chosen {
            routed[e].push((r, exps[e] / total));
        }
    }
    out[..t * hidden].fill(0.0);
    let mut xe = Vec::new();
    for (rows, ex) in routed.iter().zip(&w.experts) {
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        xe.clear();
        for &(r, _) in rows {
            xe.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let (g, u) = (matmul(&xe, n, hidden, &ex.gate, ei), matmul(&xe, n, hidden, &ex.up, ei));
        let mut act = vec![0.0; n * ei];
        for ((g, u), a) in g.chunks_exact(ei).zip(u.chunks_exact(ei)).zip(act.chunks_exact_mut(ei)) {
            silu_mul(g, u, a);
        }
        let y = matmul(&act, n, ei, &ex.down, hidden);
        for (&(r, weight), yr) in rows.iter().zip(y.chunks_exact(hidden)) {
            for (o, v) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(yr) {
                *o += weight * v;
            }
        }
    }
}
