//! DeepSeek's multi-token prediction layer as a draft layer (`Backend::draft`): the layer over rows
//! of the forward pass just done, each reading the main model's final hidden state there and the
//! token after it, and its chained guesses.

use std::sync::Arc;

use super::layer::{kept_rows, step_rows};
use super::products::matmul;
use super::rows::rms_norm;
use super::{CpuBackend, Scratch};
use crate::backend::{check_steps, DraftStep, SeqStep};
use crate::ModelError;

/// The last forward pass as the draft pass after it reads it.
#[derive(Debug, Default)]
pub(super) struct LastPass {
    /// Each step's first position and row count (empty: no pass to draft from).
    pub(super) steps: Vec<(usize, usize)>,
    /// Every row's final hidden state (normed), rows in step order.
    pub(super) hidden: Vec<f32>,
}

impl CpuBackend {
    /// `Backend::draft`: the draft layer over rows of the last forward pass (see `DraftStep`).
    pub(super) fn draft_pass(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        if self.w.draft.is_none() {
            return Err(ModelError::Unsupported { field: "draft layer".into(), value: "none loaded".into() });
        }
        let mut seq = Vec::with_capacity(steps.len());
        let mut hidden_at = Vec::with_capacity(steps.len());
        for (i, d) in steps.iter().enumerate() {
            let from = self.last.steps.get(..d.step).map(|before| before.iter().map(|s| s.1).sum::<usize>());
            match (self.last.steps.get(d.step), from) {
                (Some(&(start_pos, n)), Some(from)) if !d.next.is_empty() && d.next.len() <= n => {
                    hidden_at.push(from);
                    seq.push(SeqStep {
                        tokens: d.next,
                        start_pos,
                        block_table: d.block_table,
                        logits: usize::from(d.guesses > 0),
                        state: None,
                    });
                }
                _ => {
                    return Err(ModelError::InvalidInput {
                        problem: format!(
                        "draft step {i} reads {} rows of step {} of the last forward pass, which had {:?}",
                        d.next.len(),
                        d.step,
                        self.last.steps.get(d.step).map(|s| s.1)
                    ),
                    })
                }
            }
        }
        check_steps(&self.cfg, &self.layout, &seq)?;
        let mut sc = std::mem::take(&mut self.scratch);
        let this = &mut *self;
        let guesses: Vec<usize> = steps.iter().map(|d| d.guesses).collect();
        let out = rayon::scope(|_| this.draft_with(&seq, &hidden_at, &guesses, &mut sc));
        self.scratch = sc;
        Ok(out)
    }

    /// The draft layer over `steps` (each step's tokens: the tokens after its rows; `hidden_at`: its
    /// first row's index in the last pass's hidden states): row `j`'s input is
    /// `eh_proj([enorm(embed(next_j)) | hnorm(h_j)])`, the embedding zero at position 0 (as vLLM's
    /// multi-token predictor has it); the layer's output, normed by the shared head's norm, goes
    /// through the LM head where a step asks for logits, and each of `guesses` more is chained on
    /// (see `DraftStep`).
    fn draft_with(
        &mut self,
        steps: &[SeqStep<'_>],
        hidden_at: &[usize],
        guesses: &[usize],
        sc: &mut Scratch,
    ) -> Vec<Vec<f32>> {
        let hsz = self.cfg.hidden_size;
        let row_of: Vec<usize> = steps
            .iter()
            .zip(hidden_at)
            .flat_map(|(s, &from)| (0..s.tokens.len()).map(move |j| from + j))
            .collect();
        let hidden = std::mem::take(&mut self.last.hidden);
        let normed = self.draft_rows(steps, &hidden, &row_of, sc);
        self.last.hidden = hidden;
        let mats = self.mats();
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); steps.len()];
        // The guessing steps, in order, and the last output row of each.
        let guessing: Vec<usize> = (0..steps.len()).filter(|&i| steps[i].logits > 0).collect();
        for (&i, l) in guessing.iter().zip(self.head_logits(&normed, &mats, &mut sc.xb)) {
            out[i].push(l);
        }
        let (mut prev, mut prev_of) = (normed, guessing.clone());
        for round in 1..guesses.iter().copied().max().unwrap_or(0) {
            // One more row per step still guessing, at the next position, within its block table.
            let bs = self.layout.block_size;
            let live: Vec<(usize, usize)> = prev_of
                .iter()
                .enumerate()
                .filter(|&(_, &i)| {
                    let pos = steps[i].start_pos + steps[i].tokens.len() - 1 + round;
                    guesses[i] > round
                        && out[i].len() == round
                        && pos < steps[i].block_table.len() * bs
                        && pos < self.cfg.max_position_embeddings
                })
                .map(|(k, &i)| (k, i))
                .collect();
            if live.is_empty() {
                break;
            }
            let tokens: Vec<u32> =
                live.iter().map(|&(_, i)| crate::greedy_pick(&out[i][round - 1]).0).collect();
            let chain: Vec<SeqStep<'_>> = live
                .iter()
                .zip(&tokens)
                .map(|(&(_, i), t)| SeqStep {
                    tokens: std::slice::from_ref(t),
                    start_pos: steps[i].start_pos + steps[i].tokens.len() - 1 + round,
                    block_table: steps[i].block_table,
                    logits: 1,
                    state: None,
                })
                .collect();
            let rows_of: Vec<usize> = live.iter().map(|&(k, _)| k).collect();
            let normed = self.draft_rows(&chain, &prev, &rows_of, sc);
            for (&(_, i), l) in live.iter().zip(self.head_logits(&normed, &mats, &mut sc.xb)) {
                out[i].push(l);
            }
            prev = normed;
            prev_of = live.iter().map(|&(_, i)| i).collect();
            assert_eq!(prev.len(), prev_of.len() * hsz);
        }
        out.into_iter().flatten().collect()
    }

    /// The draft layer's rows for `steps`, row `r` reading hidden state `hidden[row_of[r]]`: the
    /// shared head's norm of the output of each row a step asks logits for.
    fn draft_rows(
        &mut self,
        steps: &[SeqStep<'_>],
        hidden: &[f32],
        row_of: &[usize],
        sc: &mut Scratch,
    ) -> Vec<f32> {
        let w = Arc::clone(&self.w);
        let d = w.draft.as_ref().expect("checked: a draft layer");
        let mats = self.mats();
        let (hsz, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        let rows = step_rows(steps);
        let kept = kept_rows(steps);
        let t = rows.len();
        sc.h.clear();
        self.embed_rows(steps.iter().flat_map(|s| s.tokens.iter().copied()), &mats, &mut sc.h);
        let mut cat = vec![0.0; t * 2 * hsz];
        for (r, &(_, pos)) in rows.iter().enumerate() {
            let (e, h) = cat[r * 2 * hsz..][..2 * hsz].split_at_mut(hsz);
            if pos > 0 {
                rms_norm(&sc.h[r * hsz..][..hsz], &d.enorm, eps, e);
            }
            rms_norm(&hidden[row_of[r] * hsz..][..hsz], &d.hnorm, eps, h);
        }
        sc.x = matmul(&cat, t, 2 * hsz, &d.eh_proj, hsz);
        self.rope_table(&rows, &mut sc.rope);
        if !self.layer(self.cfg.num_layers, steps, &rows, Some(&kept), &mats, sc) {
            return Vec::new();
        }
        let mut normed = vec![0.0; kept.len() * hsz];
        rms_norm(&sc.x[..kept.len() * hsz], &d.head_norm, eps, &mut normed);
        normed
    }
}
