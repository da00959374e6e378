//! Speculative decoding's drafts, from one of two sources. Prompt lookup: draft tokens from the
//! request's own context. Agents copy file names, code and tool output back; where the last few
//! tokens occurred before, the tokens that followed them then are a cheap guess at what follows now.
//! The model's draft layer (DeepSeek's multi-token prediction layer): after each step, one more
//! layer over the rows just computed guesses the token after the one just chosen
//! (`core/draft_pass.rs`). Either way the engine verifies a guess in one multi-row step and keeps the
//! drafts its own samples confirm (`core/step.rs`), so the output is the one decoding token by token
//! gives, for greedy and sampled requests alike.

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The model's draft layer where the checkpoint ships one, prompt lookup otherwise (resolved
    /// when the engine starts).
    Auto,
    /// Tokens that followed the latest earlier occurrence of the context's suffix.
    PromptLookup,
    /// The model's draft layer (DeepSeek's multi-token prediction layer): one guess per step.
    Model,
}

/// How a worker drafts. `max_draft == 0` turns speculative decoding off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculative {
    pub source: DraftSource,
    /// Draft tokens per step at most.
    pub max_draft: usize,
    /// The longest and shortest suffix looked up, in tokens (the longest that occurred before wins).
    pub max_ngram: usize,
    pub min_ngram: usize,
    /// Drafts only while at most this many requests run: each draft is a row of the step, and where
    /// the batch already fills the CPU, rows refused cost more than rows accepted save.
    pub max_running: usize,
    /// Plain steps after a refused draft, doubling with each refusal in a row up to this many (2:
    /// always 2).
    pub pause_max: usize,
}

impl Speculative {
    pub const OFF: Speculative = Speculative {
        source: DraftSource::PromptLookup,
        max_draft: 0,
        max_ngram: 0,
        min_ngram: 0,
        max_running: 0,
        pause_max: 2,
    };

    /// Prompt lookup with up to `max_draft` tokens per step, matching suffixes of 4 down to 2 tokens,
    /// while one request runs (measured with `cargo xtask bench spec`: one stream gains where the
    /// output copies its input and loses nothing where it does not; at four streams drafts that miss
    /// cost more than those that hit save).
    pub fn prompt_lookup(max_draft: usize) -> Speculative {
        Speculative {
            source: DraftSource::PromptLookup,
            max_draft,
            max_ngram: 4,
            min_ngram: 2,
            max_running: 1,
            pause_max: 2,
        }
    }

    /// The model's draft layer: up to `max_draft` chained guesses per step (the layer run again on
    /// its own output, as SGLang's `--speculative-num-steps`), while at most `max_running` requests
    /// run (each guess is a row of the step; the draft layer's pass runs whatever the count, so that
    /// its KV covers every position). Refusals in a row pause a request's guesses for 2, 4, .. up to
    /// 32 steps: a draft layer that guesses wrong (a random model's, or text it was not trained for)
    /// then costs its pass's KV rows, not guess rows and LM head products every step.
    pub fn model(max_draft: usize, max_running: usize) -> Speculative {
        Speculative {
            source: DraftSource::Model,
            max_draft: max_draft.max(1),
            max_ngram: 0,
            min_ngram: 0,
            max_running,
            pause_max: 32,
        }
    }

    /// The default: the model's draft layer where the checkpoint ships one, else
    /// [`prompt_lookup`](Self::prompt_lookup) with `max_draft`.
    pub fn auto(max_draft: usize) -> Speculative {
        Speculative { source: DraftSource::Auto, ..Speculative::prompt_lookup(max_draft) }
    }

    /// `Auto` resolved for a model with `draft_layers` draft layers; an error where the model's
    /// draft layer is asked for and it has none.
    pub fn resolve(self, draft_layers: usize) -> Result<Speculative, String> {
        match (self.source, draft_layers > 0) {
            (DraftSource::Auto, true) => Ok(Speculative::model(MODEL_DRAFT_TOKENS, MODEL_DRAFT_RUNNING_MAX)),
            (DraftSource::Auto, false) => Ok(Speculative { source: DraftSource::PromptLookup, ..self }),
            (DraftSource::Model, false) => Err(
                "mtp: the model has no draft layer (DeepSeek's num_nextn_predict_layers with its weights)"
                    .into(),
            ),
            _ => Ok(self),
        }
    }

    /// Whether the model's draft layer is to be loaded (and run after every step).
    pub fn wants_draft_layer(&self) -> bool {
        self.is_on() && matches!(self.source, DraftSource::Auto | DraftSource::Model)
    }

    /// What `/v1/models` says of it: "mtp", "prompt-lookup", "auto" (unresolved) or "off".
    pub fn name(&self) -> &'static str {
        match (self.is_on(), self.source) {
            (false, _) => "off",
            (true, DraftSource::Model) => "mtp",
            (true, DraftSource::PromptLookup) => "prompt-lookup",
            (true, DraftSource::Auto) => "auto",
        }
    }

    /// Whether drafts come from the model's draft layer.
    pub fn from_model(&self) -> bool {
        self.is_on() && self.source == DraftSource::Model
    }

    pub fn is_on(&self) -> bool {
        self.max_draft > 0
    }

    /// Up to `room` tokens that followed the latest earlier occurrence of the longest suffix of
    /// `tokens` (between `max_ngram` and `min_ngram` tokens long); empty when none occurred.
    pub fn propose(&self, tokens: &[u32], room: usize) -> Vec<u32> {
        let room = room.min(self.max_draft);
        if room == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let tail = &tokens[len - n..];
            // The latest occurrence that has at least one token after it (not the suffix itself).
            if let Some(at) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == tail) {
                let from = at + n;
                return tokens[from..(from + room).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

/// Requests running at most, for the model's draft layer to draft by default: a guess is one more
/// row per request, cheap beside a step's weight reads while few requests run.
pub const MODEL_DRAFT_RUNNING_MAX: usize = 4;

/// Chained guesses per step from the model's draft layer by default (SGLang's recommended
/// `--speculative-num-steps 3` for DeepSeek's MTP layer).
pub const MODEL_DRAFT_TOKENS: usize = 3;

/// Trims `drafts` so the step verifying them (the drafts and the row before them) ends on a
/// multiple of `rows` (the backend's `verify_rows_multiple`): a row past a multiple costs a whole
/// tile's weight unpacking more, about what a one-row step's products cost, for one more guess. A
/// step within the first tile is kept as it is.
pub(crate) fn fit_to_rows(drafts: &mut Vec<u32>, rows: usize) {
    let n = drafts.len() + 1;
    if rows > 1 && n > rows {
        drafts.truncate(n / rows * rows - 1);
    }
}

/// One request's drafting: how many drafts its next step gets, shrinking where its drafts are
/// refused (each refused draft is a row of the step computed for nothing) and growing back where
/// they are taken.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DraftState {
    /// Draft tokens the next step may carry (0: not set yet, the worker's maximum).
    pub next: usize,
    /// Steps left before drafting again after a refusal.
    pub pause: usize,
    /// Refusals in a row.
    pub misses: u32,
}

impl DraftState {
    /// The room to offer for the next step, at most `max`.
    pub fn room(&mut self, max: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        if self.next == 0 {
            self.next = max;
        }
        self.next.min(max)
    }

    /// Whether the next step may draft (no pause left to sit out).
    pub fn may_draft(&self) -> bool {
        self.pause == 0
    }

    /// After a step that carried `drafted` drafts of which the first `accepted` were taken; a
    /// refusal pauses drafting for 2 steps, doubled for each refusal in a row before it, at most
    /// `pause_max`.
    pub fn record(&mut self, drafted: usize, accepted: usize, max: usize, pause_max: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.pause = (2usize << self.misses.min(16)).min(pause_max.max(2));
            self.misses += 1;
        } else {
            self.misses = 0;
        }
        if accepted == drafted {
            self.next = (self.next * 2).clamp(1, max);
        } else if accepted == 0 {
            // A guess from the wrong place: draft again only after a few plain steps.
            self.next = (self.next / 2).max(2);
        } else {
            self.next = (accepted + 1).clamp(2, max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_the_latest_longest_match() {
        let s = Speculative::prompt_lookup(3);
        // ... 5 6 7 8 ... 5 6 7 9 ... 6 7 | suffix "6 7": the latest earlier "6 7" is followed by 9.
        let t = [1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 3, 6, 7];
        assert_eq!(s.propose(&t, 8), vec![9, 3, 6]);
        // The longer suffix "5 6 7" wins over the later "6 7".
        let t = [5, 6, 7, 8, 4, 6, 7, 1, 5, 6, 7];
        assert_eq!(s.propose(&t, 8), vec![8, 4, 6]);
        // Room bounds it; no match gives nothing; a suffix alone is no match.
        assert_eq!(s.propose(&t, 1), vec![8]);
        assert!(s.propose(&[1, 2, 3, 4], 8).is_empty());
        assert!(s.propose(&[1, 2], 8).is_empty());
        // A repeat runs into the suffix itself: the draft stops at the end of the tokens.
        assert_eq!(s.propose(&[4, 4, 4], 8), vec![4]);
        assert!(Speculative::OFF.propose(&t, 8).is_empty());
    }

    #[test]
    fn drafts_fill_whole_tiles() {
        let fit = |n: usize, rows: usize| {
            let mut d: Vec<u32> = (0..n as u32).collect();
            fit_to_rows(&mut d, rows);
            d.len()
        };
        // Tiles of 4 rows: 1 + 8 rows would start a third tile for one row; 1 + 4 a second.
        assert_eq!([1, 2, 3, 4, 5, 6, 7, 8, 12].map(|n| fit(n, 4)), [1, 2, 3, 3, 3, 3, 7, 7, 11]);
        // Tiles of 6; no tiles.
        assert_eq!([5, 6, 8, 11].map(|n| fit(n, 6)), [5, 5, 5, 11]);
        assert_eq!(fit(8, 1), 8);
        assert_eq!(fit(0, 4), 0);
    }

    #[test]
    fn refused_drafts_shrink_and_pause_taken_ones_grow() {
        let mut d = DraftState::default();
        assert_eq!(d.room(8), 8);
        d.record(8, 3, 8, 2);
        assert_eq!(d.room(8), 4);
        d.record(4, 4, 8, 2);
        assert_eq!(d.room(8), 8);
        d.record(8, 0, 8, 2);
        assert_eq!((d.room(8), d.room(8), d.room(8)), (0, 0, 4));
        // Prompt lookup's pause stays 2 however many refusals come in a row.
        d.record(4, 0, 8, 2);
        assert_eq!((d.room(8), d.room(8), d.room(8)), (0, 0, 2));
    }

    #[test]
    fn refusals_in_a_row_pause_longer_up_to_the_maximum() {
        let mut d = DraftState::default();
        let mut pauses = Vec::new();
        for _ in 0..6 {
            assert_eq!(d.room(1), 1);
            d.record(1, 0, 1, 32);
            let mut n = 0;
            while !d.may_draft() {
                assert_eq!(d.room(1), 0);
                n += 1;
            }
            pauses.push(n);
        }
        assert_eq!(pauses, [2, 4, 8, 16, 32, 32]);
        // A taken guess ends the run of refusals.
        d.record(1, 1, 1, 32);
        d.record(1, 0, 1, 32);
        assert_eq!(d.pause, 2);
    }
}
