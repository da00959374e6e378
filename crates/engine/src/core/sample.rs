//! Sampling a step's logits for one request, and verifying its draft tokens (speculative decoding):
//! row `i` of an item with drafts scores the token after its `i`-th draft. Each row is sampled exactly
//! as a plain decode step would be (penalties, bias, masks, the request's own random stream), and a
//! draft is kept only where the sample equals it; the first sample that differs (or the one after
//! the last draft) is the step's new token. The output is therefore the one decoding token by token
//! gives: a draft is a point guess, so "sample, then compare" accepts it with its own probability and
//! otherwise draws from the rest of the distribution, which is exact speculative sampling.

use std::panic::{catch_unwind, AssertUnwindSafe};

use llguidance::toktrie::SimpleVob;
use pdserve_scheduler::{BatchItem, Sampled};

use super::{panic_text, Active, EngineCore, Reply};
use crate::grammar::apply_mask;

/// What a step gave for one sampling item: its rows of logits, or the backend's greedy pick.
pub(super) enum Rows<'a> {
    Logits(&'a [Vec<f32>]),
    Picked(pdserve_model::Sampled),
}

impl EngineCore {
    /// Whether every sampling request of `batch` would pick exactly the backend's greedy pick: greedy,
    /// no penalties, no top log-probabilities, no logit bias, no constraint, no drafts, past
    /// `min_tokens`. Then the step asks the backend for picks only ([`Backend::forward_greedy`]:
    /// on a GPU the logits never leave the device), with the same tokens and log-probabilities.
    ///
    /// [`Backend::forward_greedy`]: pdserve_model::Backend::forward_greedy
    pub(super) fn picks_only(&self, batch: &[BatchItem]) -> bool {
        let kv = self.sched.kv();
        let mut any = false;
        for item in batch.iter().filter(|i| i.sample) {
            let Some(lv) = self.active.get(&item.id.0) else { return false };
            let p = lv.sampler.params();
            let output = kv.tokens(item.seq).map_or(0, |t| t.len()).saturating_sub(lv.prompt_len);
            let plain = p.temperature <= 1e-5
                && p.repetition_penalty == 1.0
                && p.frequency_penalty == 0.0
                && p.presence_penalty == 0.0
                && p.top_logprobs == 0
                && lv.logit_bias.is_empty()
                && lv.guide.is_none()
                && item.draft == 0
                && output >= lv.min_tokens
                && !lv.panic_in_sampling;
            if !plain {
                return false;
            }
            any = true;
        }
        any
    }

    /// Samples `rows` (the item's last `draft + 1` rows of logits) for `item`'s request, sends each
    /// token it keeps, and returns what the scheduler is told; `None` for a request no longer live,
    /// `Err` with the reason the request fails.
    pub(super) fn verify(
        &mut self,
        item: &BatchItem,
        rows: Rows<'_>,
        masks: Option<&[Result<SimpleVob, String>]>,
    ) -> Result<Option<Sampled>, String> {
        let Some(lv) = self.active.get_mut(&item.id.0) else { return Ok(None) };
        let all = self.sched.kv().tokens(item.seq).unwrap_or(&[]);
        let base = all.len().saturating_sub(item.draft);
        // Row i's mask: the constraint after the drafts before it.
        let mask = |i: usize| match masks.map(|m| m.get(i)) {
            None => Ok(None),
            Some(Some(Ok(m))) => Ok(Some(m)),
            Some(Some(Err(e))) => Err(format!("constrained decoding failed: {e}")),
            Some(None) => Err("constrained decoding failed: no mask for a draft row".to_owned()),
        };
        let (rows, mut picked) = match rows {
            Rows::Logits(r) => (r, None),
            Rows::Picked(s) => (&[][..], Some(s)),
        };
        let n = if picked.is_some() { 1 } else { rows.len() };
        let mut outbox = Vec::with_capacity(n);
        let mut result = Err("the engine reported no logits for a sampling step".to_owned());
        for i in 0..n {
            let (prompt, output) = all[..base + i].split_at(lv.prompt_len.min(base + i));
            let s = match picked.take() {
                Some(s) => s,
                None => sample_row(lv, &rows[i], prompt, output, mask(i)?, &self.config.eos_ids)?,
            };
            let eos = self.config.eos_ids.contains(&s.token);
            let mut stop = lv.stop_ids.contains(&s.token) || (!lv.ignore_eos && eos);
            if let Some(g) = lv.guide.as_mut() {
                // The constraint decides: its end is the end, and an end-of-sequence token before it
                // cannot have been sampled (the mask allows it only once the output is complete).
                if eos && g.is_accepting() {
                    stop = true;
                } else if let Err(e) = g.accept(s.token) {
                    return Err(format!("constrained decoding failed: {e}"));
                }
            }
            let token = s.token;
            if self.config.role == pdserve_api::Role::Prefill {
                // The first token goes to the decode worker with the KV, not to the caller.
                lv.first = Some(s);
            } else {
                outbox.push(Reply::Token { id: item.id.0, token, logprob: s.logprob, top: s.top, stop });
            }
            let confirmed = i < item.draft && all.get(base + i) == Some(&token) && !stop;
            if !confirmed {
                result = Ok(Some(Sampled { id: item.id, token, stop, drafts_accepted: i }));
                break;
            }
        }
        if item.draft > 0 {
            let accepted = result.as_ref().map_or(0, |s| s.as_ref().map_or(0, |s| s.drafts_accepted));
            let spec = self.config.speculative;
            lv.drafting.record(item.draft, accepted, spec.max_draft, spec.pause_max);
            lv.times.drafted += item.draft as u32;
            lv.times.accepted += accepted as u32;
            self.stats.draft_tokens_total += item.draft as u64;
            self.stats.draft_accepted_total += accepted as u64;
        }
        self.replies.extend(outbox);
        result
    }
}

/// One row's sample with the request's adjustments: logit bias, the constraint's mask (or, before
/// `min_tokens`, no stop token), then the sampler. A panic in any of it fails the request only.
fn sample_row(
    lv: &mut Active,
    l: &[f32],
    prompt: &[u32],
    output: &[u32],
    mask: Option<&SimpleVob>,
    eos_ids: &[u32],
) -> Result<pdserve_model::Sampled, String> {
    let early = output.len() < lv.min_tokens;
    catch_unwind(AssertUnwindSafe(|| {
        assert!(!lv.panic_in_sampling, "test panic while sampling");
        if mask.is_none() && !early && lv.logit_bias.is_empty() {
            return lv.sampler.sample(l, prompt, output);
        }
        let mut adjusted = l.to_vec();
        for &(t, b) in &lv.logit_bias {
            if let Some(x) = adjusted.get_mut(t as usize) {
                *x += b;
            }
        }
        match mask {
            Some(m) => apply_mask(&mut adjusted, m),
            None if early => {
                for &t in lv.stop_ids.iter().chain(eos_ids) {
                    if let Some(x) = adjusted.get_mut(t as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            None => {}
        }
        let mut s = lv.sampler.sample(&adjusted, prompt, output);
        // A blocked token is no alternative: `top_logprobs` lists only tokens that could be sampled.
        s.top.retain(|&(_, p)| p.is_finite());
        s
    }))
    .map_err(|p| format!("internal error while sampling: {}", panic_text(&p)))
}
