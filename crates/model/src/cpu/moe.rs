//! Mixture-of-experts FFNs (Mixtral, Qwen3-MoE, DeepSeekMoE): each row's router picks its top-k experts,
//! and each expert then runs once for every row routed to it (each weight row read once for all of
//! them; every row's value that of the row alone, as every product computes it).

use super::{matmul, Mats, Proj};
use crate::config::{GroupScore, Scoring};
use crate::sys::silu_mul;
use crate::{Expert, Moe, MoeWeights};

/// `out[r]` = the sum, over the experts row `r` of `x` (`t` rows of `hidden`) is routed to, of the
/// router's weight times the expert's output (plus the shared experts' output, where the layer has
/// them).
pub(super) fn moe_ffn(
    (li, mats, xb): (usize, &Mats, &mut Vec<u16>),
    (x, t, hidden): (&[f32], usize, usize),
    moe: &Moe,
    w: &MoeWeights,
    out: &mut [f32],
) {
    let (experts, ei) = (moe.experts, moe.intermediate_size);
    let logits = matmul(x, t, hidden, &w.router, experts);
    // Per expert: (row, weight) of the rows routed to it.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    for (r, l) in logits.chunks_exact(experts).enumerate() {
        for (e, weight) in route(l, moe, w.bias.as_deref()) {
            routed[e].push((r, weight));
        }
    }
    out[..t * hidden].fill(0.0);
    let mut xe = Vec::new();
    for (e, (rows, ex)) in routed.iter().zip(&w.experts).enumerate() {
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        xe.clear();
        for &(r, _) in rows {
            xe.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let y =
            swiglu((li, mats, xb), [Proj::ExpertGateUp(e), Proj::ExpertDown(e)], (&xe, n, hidden), ex, ei);
        for (&(r, weight), yr) in rows.iter().zip(y.chunks_exact(hidden)) {
            for (o, v) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(yr) {
                *o += weight * v;
            }
        }
    }
    if let (Some(ex), Some(si)) = (&w.shared, moe.shared_intermediate) {
        let y = swiglu((li, mats, xb), [Proj::SharedGateUp, Proj::SharedDown], (x, t, hidden), ex, si);
        for (o, v) in out[..t * hidden].iter_mut().zip(&y) {
            *o += v;
        }
    }
}

/// One expert's `down(silu(gate x) * up x)` for `n` rows of `x`, its products `[gate_up, down]` in
/// the served format (`ex`'s f32 matrices where the step reads f32).
fn swiglu(
    (li, mats, xb): (usize, &Mats, &mut Vec<u16>),
    [gate_up, down]: [Proj; 2],
    (x, n, hidden): (&[f32], usize, usize),
    ex: &Expert,
    inter: usize,
) -> Vec<f32> {
    let mut gu = vec![0.0; n * 2 * inter];
    if !mats.layer(li, gate_up, x, n, hidden, xb, &mut gu) {
        let (g, u) = (matmul(x, n, hidden, &ex.gate, inter), matmul(x, n, hidden, &ex.up, inter));
        for (r, row) in gu.chunks_exact_mut(2 * inter).enumerate() {
            row[..inter].copy_from_slice(&g[r * inter..(r + 1) * inter]);
            row[inter..].copy_from_slice(&u[r * inter..(r + 1) * inter]);
        }
    }
    let mut act = vec![0.0; n * inter];
    for (row, a) in gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)) {
        let (g, u) = row.split_at(inter);
        silu_mul(g, u, a);
    }
    let mut y = vec![0.0; n * hidden];
    mats.product((li, down), &ex.down, &act, (n, inter, hidden), xb, &mut y);
    y
}

/// The experts one row's router `logits` choose, with their weights: scores (softmax or sigmoid),
/// the `bias` added to choose only, DeepSeek's groups (only experts of the best `topk_groups` groups
/// are candidates: the others are out, as DeepSeek's reference masks them with -inf, where
/// transformers' 0.0 could still pick them when every biased score is negative), the `top_k` best
/// candidates (ties to the lower index), weighted by their unbiased scores, normalized with
/// `norm_topk_prob`, times `routed_scaling_factor`.
pub(super) fn route(logits: &[f32], moe: &Moe, bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let n = logits.len();
    let scores: Vec<f32> = match moe.scoring {
        Scoring::Softmax => {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let exps: Vec<f32> = logits.iter().map(|v| (v - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            exps.iter().map(|e| e / sum).collect()
        }
        Scoring::Sigmoid => logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
    };
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    let best_first = |v: &[f32], order: &mut Vec<usize>| {
        order.clear();
        order.extend(0..v.len());
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    };
    let mut order = Vec::with_capacity(n);
    if let Some(g) = moe.groups.filter(|g| g.topk_groups < g.groups) {
        let size = n / g.groups;
        let group_scores: Vec<f32> = choice
            .chunks_exact(size)
            .map(|grp| match g.score {
                GroupScore::Max => grp.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)),
                GroupScore::TopTwoSum => {
                    best_first(grp, &mut order);
                    order.iter().take(2).map(|&i| grp[i]).sum()
                }
            })
            .collect();
        best_first(&group_scores, &mut order);
        let kept = &order[..g.topk_groups];
        for (gi, grp) in choice.chunks_exact_mut(size).enumerate() {
            if !kept.contains(&gi) {
                grp.fill(f32::NEG_INFINITY);
            }
        }
    }
    best_first(&choice, &mut order);
    let chosen = &order[..moe.top_k];
    let total = match (moe.norm_topk_prob, moe.scoring) {
        (true, Scoring::Sigmoid) => chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20,
        (true, Scoring::Softmax) => chosen.iter().map(|&e| scores[e]).sum::<f32>(),
        (false, _) => 1.0,
    };
    chosen.iter().map(|&e| (e, scores[e] / total * moe.routed_scaling_factor)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExpertGroups;

    fn deepseek_v3_router(experts: usize, top_k: usize, groups: usize, topk_groups: usize) -> Moe {
        Moe {
            experts,
            top_k,
            norm_topk_prob: true,
            intermediate_size: 8,
            dense_layers: Vec::new(),
            names: crate::MoeNames::Qwen,
            scoring: Scoring::Sigmoid,
            groups: Some(ExpertGroups { groups, topk_groups, score: GroupScore::TopTwoSum }),
            correction_bias: true,
            routed_scaling_factor: 2.5,
            shared_intermediate: None,
        }
    }

    #[test]
    fn excluded_groups_are_out_even_when_every_kept_score_is_negative() {
        // Four groups of two; the bias makes every biased score negative. Group sums: g0 -1.3,
        // g1 -1.7, g2 -0.9, g3 -1.5: g2 and g0 are kept. DeepSeek's reference masks g1 and g3 with
        // -inf, so the top 3 come from experts 0, 1, 4, 5; transformers' 0.0 mask would rank the
        // excluded experts (0.0) above every kept one and choose from them.
        let moe = deepseek_v3_router(8, 3, 4, 2);
        let logits = [0.0f32; 8];
        let bias = [-1.0, -0.8, -1.0, -1.2, -0.6, -0.8, -1.1, -0.9];
        let mut chosen: Vec<usize> = route(&logits, &moe, Some(&bias)).iter().map(|c| c.0).collect();
        // Biased scores (sigmoid(0) = 0.5): 4 -> -0.1, 1 and 5 -> -0.3 (tie: the lower index first).
        assert_eq!(chosen, [4, 1, 5]);
        chosen.sort();
        assert!(chosen.iter().all(|e| [0, 1, 4, 5].contains(e)));
        // The weights are the unbiased scores (all 0.5), normalized, times the scaling factor.
        for (_, w) in route(&logits, &moe, Some(&bias)) {
            assert!((w - 2.5 / 3.0).abs() < 1e-6, "{w}");
        }
    }

    #[test]
    fn softmax_routing_without_groups_is_mixtral_s() {
        let moe = Moe {
            scoring: Scoring::Softmax,
            groups: None,
            correction_bias: false,
            routed_scaling_factor: 1.0,
            ..deepseek_v3_router(4, 2, 1, 1)
        };
        let picks = route(&[1.0, 3.0, 2.0, 3.0], &moe, None);
        // Ties to the lower index; the two chosen renormalized.
        assert_eq!(picks.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 3]);
        assert!(picks.iter().all(|p| (p.1 - 0.5).abs() < 1e-6));
    }
}
