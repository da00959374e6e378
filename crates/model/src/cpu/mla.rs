//! Multi-head latent attention (DeepSeek V2/V3) around the shared attention path: each new token's
//! latent `[RMSNorm(c_kv) | rope(k_rope)]` is stored in the cache (one row per position and layer,
//! `kv_lora_rank + qk_rope_head_dim` values), each head's query is absorbed into the latent's space
//! (`W_UK^T q_nope`, then its rotated `q_rope`) so attention scores and sums the cached rows
//! directly, and each head's latent output is taken back out by `W_UV`. Every step size takes this
//! one path (prefill included), so a row's values never depend on what else its step holds.

use pdserve_kvcache::BlockId;

use super::rows::{rms_norm_in_place, rms_norm_rows, rope_rows};
use super::{matmul, sized, CpuBackend, Mats, Proj};
use crate::backend::SeqStep;
use crate::sys::dot;
use crate::weights::{IndexerWeights, MlaWeights};
use crate::Mla;
use rayon::prelude::*;

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
    /// rows' latents (and V3.2's indexer keys) stored in the cache on the way. `q` gets, per row and
    /// head, the absorbed query `[W_UK^T q_nope | q_rope]` (`kv_lora_rank + qk_rope_head_dim`
    /// values). Returns, with V3.2's sparse attention, each row's selected positions (`None`: every
    /// position it sees).
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
    ) -> Vec<Option<Vec<bool>>> {
        let m: &Mla = self.cfg.mla.as_ref().expect("a latent attention model");
        let (t, hsz, nh, eps) = (rows.len(), self.cfg.hidden_size, self.cfg.num_heads, LORA_NORM_EPS);
        let (nope, rd, lora) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank);
        let (qk, width) = (nope + rd, m.latent_width());
        // Queries, per head `[nope | rope]`.
        let mut full = vec![0.0; t * nh * qk];
        // The query LoRA's normed output (V3.2's indexer reads it too).
        let mut q_lora = Vec::new();
        match &w.q_a {
            Some((a, norm)) => {
                let r = norm.len();
                let mut qa = vec![0.0; t * r];
                mats.product((li, Proj::QA), a, h, (t, hsz, r), xb, &mut qa);
                q_lora = vec![0.0; t * r];
                rms_norm_rows(&qa, norm, eps, &mut q_lora);
                mats.product((li, Proj::QB), &w.q_b, &q_lora, (t, r, nh * qk), xb, &mut full);
            }
            None => mats.product((li, Proj::QB), &w.q_b, h, (t, hsz, nh * qk), xb, &mut full),
        }
        // Each row's latent: normed, its rope key rotated, stored at its position (with the
        // indexer's key after it).
        let mut kv = vec![0.0; t * width];
        mats.product((li, Proj::KvA), &w.kv_a, h, (t, hsz, width), xb, &mut kv);
        let index_keys = w.indexer.as_ref().map(|ix| index_keys(ix, h, t, hsz, rope, rd));
        let half = rd / 2;
        let mut stored = Vec::with_capacity(m.row_width());
        for (r, (row, &(si, pos))) in kv.chunks_exact_mut(width).zip(rows).enumerate() {
            let (c, k_rope) = row.split_at_mut(lora);
            rms_norm_in_place(c, &w.kv_a_norm, eps);
            let angles = &rope[r * rd..(r + 1) * rd];
            rope_rows(k_rope, rd, &angles[..half], &angles[half..]);
            stored.clear();
            stored.extend_from_slice(row);
            if let Some(k) = &index_keys {
                let n = k.len() / t;
                stored.extend_from_slice(&k[r * n..(r + 1) * n]);
            }
            let block: BlockId = steps[si].block_table[pos / self.layout.block_size];
            let at = self.kv_at(block, li, 0, pos % self.layout.block_size);
            self.kv.store(self.layout.dtype, at, &stored);
        }
        let selected = match &w.indexer {
            Some(ix) => self.index_select(steps, rows, li, ix, (&q_lora, h), rope),
            None => Vec::new(),
        };
        // Absorbed queries: per head, `W_UK^T q_nope` for every row at once, then the rotated rope.
        // The heads' products run side by side: each is small, so one fork per head rather than a
        // fork inside each (every row's values are the same either way).
        let lats: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|head| {
                let (mut part, mut lat, mut xb) =
                    (Vec::with_capacity(t * nope), vec![0.0; t * lora], Vec::new());
                gather(&full, nh * qk, head * qk, nope, &mut part);
                let k_up = w.k_up_t.get(head * lora * nope..(head + 1) * lora * nope).unwrap_or(&[]);
                mats.product((li, Proj::KUp(head)), k_up, &part, (t, nope, lora), &mut xb, &mut lat);
                lat
            })
            .collect();
        let q = sized(q, t * nh * width);
        for (head, lat) in lats.iter().enumerate() {
            for r in 0..t {
                let out = &mut q[(r * nh + head) * width..][..width];
                out[..lora].copy_from_slice(&lat[r * lora..(r + 1) * lora]);
                out[lora..].copy_from_slice(&full[r * nh * qk + head * qk + nope..][..rd]);
                let angles = &rope[r * rd..(r + 1) * rd];
                rope_rows(&mut out[lora..], rd, &angles[..half], &angles[half..]);
            }
        }
        selected
    }

    /// V3.2's lightning indexer: for each row that sees more than `topk` positions, the `topk` it
    /// attends to (scores `Σ_h w_h relu(q_h . k_p)` over the cached keys, the best first, ties to the
    /// earlier position); `None` for a row that sees no more than that. Each row on its own, in
    /// position order: the same selection whatever else the step holds.
    fn index_select(
        &self,
        steps: &[SeqStep<'_>],
        rows: &[(usize, usize)],
        li: usize,
        w: &IndexerWeights,
        (q_lora, h): (&[f32], &[f32]),
        rope: &[f32],
    ) -> Vec<Option<Vec<bool>>> {
        let m = self.cfg.mla.as_ref().expect("a latent attention model");
        let ix = m.indexer.expect("an indexer");
        let (t, rd, hsz, bs) = (rows.len(), m.qk_rope_head_dim, self.cfg.hidden_size, self.layout.block_size);
        let (heads, hd) = (ix.heads, ix.head_dim);
        let r = q_lora.len() / t.max(1);
        let mut q = matmul(q_lora, t, r, &w.wq_b, heads * hd);
        for (row, angles) in q.chunks_exact_mut(heads * hd).zip(rope.chunks_exact(rd)) {
            for head in row.chunks_exact_mut(hd) {
                rope_rows(&mut head[..rd], rd, &angles[..rd / 2], &angles[rd / 2..]);
            }
        }
        let scale = 1.0 / ((heads * hd) as f32).sqrt();
        let weights: Vec<f32> = matmul(h, t, hsz, &w.weights_proj, heads).iter().map(|v| v * scale).collect();
        let kv = self.kv.values(self.layout.dtype);
        let latent = m.latent_width();
        (0..t)
            .into_par_iter()
            .map(|row| {
                let (si, pos) = rows[row];
                let seen = pos + 1;
                if seen <= ix.topk {
                    return None;
                }
                let table = steps[si].block_table;
                let (qs, ws) =
                    (&q[row * heads * hd..(row + 1) * heads * hd], &weights[row * heads..(row + 1) * heads]);
                let mut key = vec![0.0; hd];
                let scores: Vec<f32> = (0..seen)
                    .map(|p| {
                        kv.read_into(self.kv_at(table[p / bs], li, 0, p % bs) + latent, &mut key);
                        qs.chunks_exact(hd).zip(ws).map(|(qh, wh)| wh * dot(qh, &key).max(0.0)).sum()
                    })
                    .collect();
                let mut order: Vec<usize> = (0..seen).collect();
                let best = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
                order.select_nth_unstable_by(ix.topk - 1, best);
                let mut keep = vec![false; seen];
                for &p in &order[..ix.topk] {
                    keep[p] = true;
                }
                Some(keep)
            })
            .collect()
    }

    /// Each head's latent attention output (`lat`: `t` rows of `heads x kv_lora_rank`) taken out by
    /// `W_UV` into `out` (`t` rows of `heads x v_head_dim`), the output projection's input.
    pub(super) fn mla_values(
        &self,
        (li, mats): (usize, &Mats),
        w: &MlaWeights,
        lat: &[f32],
        t: usize,
        out: &mut [f32],
    ) {
        let m = self.cfg.mla.as_ref().expect("a latent attention model");
        let (nh, lora, vd) = (self.cfg.num_heads, m.kv_lora_rank, m.v_head_dim);
        let outs: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|head| {
                let (mut part, mut v, mut xb) = (Vec::with_capacity(t * lora), vec![0.0; t * vd], Vec::new());
                gather(lat, nh * lora, head * lora, lora, &mut part);
                let v_up = w.v_up.get(head * vd * lora..(head + 1) * vd * lora).unwrap_or(&[]);
                mats.product((li, Proj::VUp(head)), v_up, &part, (t, lora, vd), &mut xb, &mut v);
                v
            })
            .collect();
        for (head, v) in outs.iter().enumerate() {
            for r in 0..t {
                out[r * nh * vd + head * vd..][..vd].copy_from_slice(&v[r * vd..(r + 1) * vd]);
            }
        }
    }
}

/// The indexer's key of each row: `wk` of the hidden row, LayerNorm-ed (eps 1e-6, weight and bias),
/// its first `rd` values rotated (half-split, the rope's own convention and angles).
fn index_keys(w: &IndexerWeights, h: &[f32], t: usize, hsz: usize, rope: &[f32], rd: usize) -> Vec<f32> {
    let hd = w.k_norm.0.len();
    let mut k = matmul(h, t, hsz, &w.wk, hd);
    for (row, angles) in k.chunks_exact_mut(hd).zip(rope.chunks_exact(rd)) {
        let mean = row.iter().sum::<f32>() / hd as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / hd as f32;
        let inv = 1.0 / (var + LORA_NORM_EPS).sqrt();
        for ((v, g), b) in row.iter_mut().zip(&w.k_norm.0).zip(&w.k_norm.1) {
            *v = (*v - mean) * inv * g + b;
        }
        rope_rows(&mut row[..rd], rd, &angles[..rd / 2], &angles[rd / 2..]);
    }
    k
}
