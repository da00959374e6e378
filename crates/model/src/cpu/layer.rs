//! One decoder layer over a step's rows, shared by the forward pass and the draft layer's pass.

use std::sync::Arc;

use rayon::prelude::*;

use super::products::matmul;
use super::rows::{add_bias, add_into, add_rows, rms_norm_in_place, rms_norm_rows, rope_rows, PAR_ROWS};
use super::{moe, sized, CpuBackend, Mats, Proj, Scratch};
use crate::backend::SeqStep;
use crate::sys::silu_mul;

impl CpuBackend {
    /// Decoder layer `li` over the step's rows (`sc.x` in and out, the rope table in `sc.rope`). With
    /// `cut`, only those rows (increasing) go on past attention (their K and V, and every other
    /// row's, are in the cache by then): the rest of the layer matters only for rows whose logits are
    /// wanted, so a prompt's other rows stop there (a 30-layer model's prefill does 2.8% fewer
    /// products). False when the cut leaves no row.
    pub(super) fn layer(
        &mut self,
        li: usize,
        steps: &[SeqStep<'_>],
        rows: &[(usize, usize)],
        cut: Option<&[usize]>,
        mats: &Mats,
        sc: &mut Scratch,
    ) -> bool {
        let w = Arc::clone(&self.w);
        let lw = &w.layers[li];
        let cfg = &self.cfg;
        let (hsz, hd, nh, nkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let (q_dim, kv_dim, inter) = (nh * hd, nkv * hd, cfg.intermediate_size);
        let (eps, half) = (cfg.rms_norm_eps, hd / 2);
        let qkv_w = q_dim + 2 * kv_dim;
        let mla = cfg.mla.clone();
        let t = rows.len();
        // The attention output's width (the output projection's input).
        let attn_dim = mla.as_ref().map_or(q_dim, |m| nh * m.v_head_dim);
        rms_norm_rows(&sc.x, &lw.input_norm, eps, sized(&mut sc.h, t * hsz));
        if let (Some(m), Some(mw)) = (&mla, &lw.mla) {
            // Latent attention: queries absorbed into the latent's space, the latents stored,
            // attention over the cached latents, each head's output taken back out.
            let select =
                self.mla_queries(steps, rows, (li, mats, &mut sc.xb), mw, &sc.h, &sc.rope, &mut sc.qkv);
            let lat = sized(&mut sc.gate_up, t * nh * m.kv_lora_rank);
            self.attention(steps, rows, li, (&sc.qkv, nh * m.latent_width()), &select, lat);
            self.mla_values((li, mats), mw, lat, t, sized(&mut sc.attn, t * attn_dim));
        } else {
            // Q, K and V, one row per token.
            if !mats.layer(li, Proj::Qkv, &sc.h, t, hsz, &mut sc.xb, sized(&mut sc.qkv, t * qkv_w)) {
                let parts = [(&lw.q, q_dim), (&lw.k, kv_dim), (&lw.v, kv_dim)]
                    .map(|(m, n)| matmul(&sc.h, t, hsz, m, n));
                for (r, row) in sc.qkv.chunks_exact_mut(qkv_w).enumerate() {
                    let mut at = 0;
                    for (part, n) in parts.iter().zip([q_dim, kv_dim, kv_dim]) {
                        row[at..at + n].copy_from_slice(&part[r * n..(r + 1) * n]);
                        at += n;
                    }
                }
            }
            let rope = &sc.rope;
            let qkv_row = |(row, rope): (&mut [f32], &[f32])| {
                let mut at = 0;
                for (bias, n) in [(&lw.q_bias, q_dim), (&lw.k_bias, kv_dim), (&lw.v_bias, kv_dim)] {
                    if let Some(b) = bias {
                        add_into(&mut row[at..at + n], b);
                    }
                    at += n;
                }
                if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                    // Qwen3: each head's Q and K normalized on their own, before rope.
                    let (q, rest) = row.split_at_mut(q_dim);
                    for (heads, weight) in [(q, qn), (&mut rest[..kv_dim], kn)] {
                        for head in heads.chunks_exact_mut(hd) {
                            rms_norm_in_place(head, weight, eps);
                        }
                    }
                }
                let (cos, sin) = rope.split_at(half);
                rope_rows(&mut row[..q_dim + kv_dim], hd, cos, sin);
            };
            if t >= PAR_ROWS {
                sc.qkv
                    .par_chunks_exact_mut(qkv_w)
                    .zip(rope.par_chunks_exact(hd))
                    .with_min_len(16)
                    .for_each(qkv_row);
            } else {
                sc.qkv.chunks_exact_mut(qkv_w).zip(rope.chunks_exact(hd)).for_each(qkv_row);
            }
            // Write this step's K and V into the cache, then attend over the cache.
            for (r, &(si, pos)) in rows.iter().enumerate() {
                let block = steps[si].block_table[pos / self.layout.block_size];
                let off = pos % self.layout.block_size;
                let ki = self.kv_at(block, li, 0, off);
                let vi = self.kv_at(block, li, 1, off);
                let row = &sc.qkv[r * qkv_w..(r + 1) * qkv_w];
                let dtype = self.layout.dtype;
                self.kv.store(dtype, ki, &row[q_dim..q_dim + kv_dim]);
                self.kv.store(dtype, vi, &row[q_dim + kv_dim..]);
            }
            let attn = sized(&mut sc.attn, t * q_dim);
            // Every row attends over the cache the same way, whatever else the step holds (see
            // `attention`).
            self.attention(steps, rows, li, (&sc.qkv, qkv_w), &[], attn);
        }
        // The last main layer's K and V are in the cache: the rest of it (the output projection and
        // the MLP) matters only for the rows whose logits are wanted, so a prompt's other rows
        // stop here (a 30-layer model's prefill does 2.8% fewer products; a prefill chunk that
        // wants no logits skips the rest outright). Every product computes each row as it would
        // in any other step, so a kept row's values are those of the same row anywhere else.
        let t = match cut.filter(|kept| kept.len() < t) {
            Some(kept) => {
                keep_rows(kept, attn_dim, &mut sc.attn);
                keep_rows(kept, hsz, &mut sc.x);
                if kept.is_empty() {
                    return false;
                }
                kept.len()
            }
            None => t,
        };
        let o = sized(&mut sc.proj, t * hsz);
        if !mats.layer(li, Proj::O, &sc.attn, t, attn_dim, &mut sc.xb, o) {
            o.copy_from_slice(&matmul(&sc.attn, t, attn_dim, &lw.o, hsz));
        }
        if let Some(b) = &lw.o_bias {
            add_bias(o, b);
        }
        add_rows(&mut sc.x, o, hsz);
        rms_norm_rows(&sc.x, &lw.post_norm, eps, sized(&mut sc.h, t * hsz));
        if let (Some(moe), Some(mw)) = (&self.cfg.moe, &lw.moe) {
            let out = sized(&mut sc.proj, t * hsz);
            moe::moe_ffn((li, mats, &mut sc.xb), (&sc.h, t, hsz), moe, mw, out);
            add_into(&mut sc.x, out);
            return true;
        }
        let gu = sized(&mut sc.gate_up, t * 2 * inter);
        if !mats.layer(li, Proj::GateUp, &sc.h, t, hsz, &mut sc.xb, gu) {
            let (g, u) = (matmul(&sc.h, t, hsz, &lw.gate, inter), matmul(&sc.h, t, hsz, &lw.up, inter));
            for (r, row) in gu.chunks_exact_mut(2 * inter).enumerate() {
                row[..inter].copy_from_slice(&g[r * inter..(r + 1) * inter]);
                row[inter..].copy_from_slice(&u[r * inter..(r + 1) * inter]);
            }
        }
        let act = sized(&mut sc.act, t * inter);
        let swiglu = |(row, a): (&[f32], &mut [f32])| {
            let (g, u) = row.split_at(inter);
            silu_mul(g, u, a);
        };
        if t >= PAR_ROWS {
            gu.par_chunks_exact(2 * inter)
                .zip(act.par_chunks_exact_mut(inter))
                .with_min_len(16)
                .for_each(swiglu);
        } else {
            gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)).for_each(swiglu);
        }
        let down = sized(&mut sc.proj, t * hsz);
        if !mats.layer(li, Proj::Down, &sc.act, t, inter, &mut sc.xb, down) {
            down.copy_from_slice(&matmul(&sc.act, t, inter, &lw.down, hsz));
        }
        add_rows(&mut sc.x, down, hsz);
        true
    }
}

/// One row per new token of `steps`: (step index, absolute position).
pub(super) fn step_rows(steps: &[SeqStep<'_>]) -> Vec<(usize, usize)> {
    steps
        .iter()
        .enumerate()
        .flat_map(|(i, s)| (0..s.tokens.len()).map(move |j| (i, s.start_pos + j)))
        .collect()
}

/// The rows whose logits are wanted: the last `logits` of each step, in order.
pub(super) fn kept_rows(steps: &[SeqStep<'_>]) -> Vec<usize> {
    let (mut kept, mut end) = (Vec::new(), 0);
    for s in steps {
        end += s.tokens.len();
        kept.extend(end - s.logits..end);
    }
    kept
}

/// Rows `kept` (increasing) of `m` (rows of `width`) moved to its front, in order, and `m` cut to them.
pub(super) fn keep_rows(kept: &[usize], width: usize, m: &mut Vec<f32>) {
    for (to, &from) in kept.iter().enumerate() {
        if to != from {
            m.copy_within(from * width..(from + 1) * width, to * width);
        }
    }
    m.truncate(kept.len() * width);
}
