//! Multi-head latent attention (DeepSeek V2/V3) around the shared attention path: each new token's
//! latent `[RMSNorm(c_kv) | rope(k_rope)]` is stored in the cache (one row per position and layer,
//! `kv_lora_rank + qk_rope_head_dim` values), each head's query is absorbed into the latent's space
//! (`W_UK^T q_nope`, then its rotated `q_rope`) so attention scores and sums the cached rows
//! directly, and each head's latent output is taken back out by `W_UV`. Every step size takes this
//! one path (prefill included), so a row's values never depend on what else its step holds.

use pdserve_kvcache::BlockId;

use super::rows::{rms_norm_in_place, rms_norm_rows, rope_rows};
use super::{sized, CpuBackend, Mats, Proj};
use crate::backend::SeqStep;
use crate::weights::MlaWeights;
use crate::Mla;

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers and DeepSeek's reference
/// build both without one, so they take the norm's default whatever `rms_norm_eps` says.
const LORA_NORM_EPS: f32 = 1e-6;

/// Writes the head's `cols` columns of each row of `src` (`t` rows of `width`, the head's columns
/// from `at`) into `dst` (`t` rows of `cols`).
fn gather(src: &[f32], width: usize, at: usize, cols: usize, dst: &mut Vec<f32>) {
    dst.clear();
    for row in src.chunks_exact(width) {
        dst.extend_from_slice(&row[at..at + cols]);
    }
}

impl CpuBackend {
    /// Layer `li`'s latent attention queries for the step's rows (`h`: the normed hidden rows), the
    /// rows' latents stored in the cache on the way. `q` gets, per row and head, the absorbed query
    /// `[W_UK^T q_nope | q_rope]` (`kv_lora_rank + qk_rope_head_dim` values).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_queries(
        &mut self,
        steps: &[SeqStep<'_>],
        rows: &[(usize, usize)],
        (li, mats, xb): (usize, &Mats, &mut Vec<u16>),
        w: &MlaWeights,
        h: &[f32],
        rope: &[f32],
        q: &mut Vec<f32>,
    ) {
        let m: &Mla = self.cfg.mla.as_ref().expect("a latent attention model");
        let (t, hsz, nh, eps) = (rows.len(), self.cfg.hidden_size, self.cfg.num_heads, LORA_NORM_EPS);
        let (nope, rd, lora) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank);
        let (qk, width) = (nope + rd, m.latent_width());
        // Queries, per head `[nope | rope]`.
        let mut full = vec![0.0; t * nh * qk];
        match &w.q_a {
            Some((a, norm)) => {
                let r = norm.len();
                let mut qa = vec![0.0; t * r];
                mats.product((li, Proj::QA), a, h, (t, hsz, r), xb, &mut qa);
                let mut normed = vec![0.0; t * r];
                rms_norm_rows(&qa, norm, eps, &mut normed);
                mats.product((li, Proj::QB), &w.q_b, &normed, (t, r, nh * qk), xb, &mut full);
            }
            None => mats.product((li, Proj::QB), &w.q_b, h, (t, hsz, nh * qk), xb, &mut full),
        }
        // Each row's latent: normed, its rope key rotated, stored at its position.
        let mut kv = vec![0.0; t * width];
        mats.product((li, Proj::KvA), &w.kv_a, h, (t, hsz, width), xb, &mut kv);
        let half = rd / 2;
        for (r, (row, &(si, pos))) in kv.chunks_exact_mut(width).zip(rows).enumerate() {
            let (c, k_rope) = row.split_at_mut(lora);
            rms_norm_in_place(c, &w.kv_a_norm, eps);
            let angles = &rope[r * rd..(r + 1) * rd];
            rope_rows(k_rope, rd, &angles[..half], &angles[half..]);
            let block: BlockId = steps[si].block_table[pos / self.layout.block_size];
            let at = self.kv_at(block, li, 0, pos % self.layout.block_size);
            self.kv.store(self.layout.dtype, at, row);
        }
        // Absorbed queries: per head, `W_UK^T q_nope` for every row at once, then the rotated rope.
        let q = sized(q, t * nh * width);
        let (mut part, mut lat) = (Vec::with_capacity(t * nope), vec![0.0; t * lora]);
        for head in 0..nh {
            gather(&full, nh * qk, head * qk, nope, &mut part);
            let k_up = w.k_up_t.get(head * lora * nope..(head + 1) * lora * nope).unwrap_or(&[]);
            mats.product((li, Proj::KUp(head)), k_up, &part, (t, nope, lora), xb, &mut lat);
            for r in 0..t {
                let out = &mut q[(r * nh + head) * width..][..width];
                out[..lora].copy_from_slice(&lat[r * lora..(r + 1) * lora]);
                out[lora..].copy_from_slice(&full[r * nh * qk + head * qk + nope..][..rd]);
                let angles = &rope[r * rd..(r + 1) * rd];
                rope_rows(&mut out[lora..], rd, &angles[..half], &angles[half..]);
            }
        }
    }

    /// Each head's latent attention output (`lat`: `t` rows of `heads x kv_lora_rank`) taken out by
    /// `W_UV` into `out` (`t` rows of `heads x v_head_dim`), the output projection's input.
    pub(super) fn mla_values(
        &self,
        (li, mats, xb): (usize, &Mats, &mut Vec<u16>),
        w: &MlaWeights,
        lat: &[f32],
        t: usize,
        out: &mut [f32],
    ) {
        let m = self.cfg.mla.as_ref().expect("a latent attention model");
        let (nh, lora, vd) = (self.cfg.num_heads, m.kv_lora_rank, m.v_head_dim);
        let (mut part, mut v) = (Vec::with_capacity(t * lora), vec![0.0; t * vd]);
        for head in 0..nh {
            gather(lat, nh * lora, head * lora, lora, &mut part);
            let v_up = w.v_up.get(head * vd * lora..(head + 1) * vd * lora).unwrap_or(&[]);
            mats.product((li, Proj::VUp(head)), v_up, &part, (t, lora, vd), xb, &mut v);
            for r in 0..t {
                out[r * nh * vd + head * vd..][..vd].copy_from_slice(&v[r * vd..(r + 1) * vd]);
            }
        }
    }
}
