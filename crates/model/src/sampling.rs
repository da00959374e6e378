//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, a seeded RNG per
//! request, and log-probabilities.

/// Per-request sampling settings, in OpenAI / vLLM terms.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables. Applies to prompt and output tokens.
    pub repetition_penalty: f32,
    /// Applies to output tokens: subtracts `count * frequency_penalty`.
    pub frequency_penalty: f32,
    /// Applies to output tokens: subtracts `presence_penalty` once per distinct token.
    pub presence_penalty: f32,
    /// Top log-probabilities to return per token (0: only the chosen token's).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }
}

/// The chosen token with its log-probability under the model (before penalties and temperature), and
/// the `top_logprobs` most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// xorshift64*: small, fast, and reproducible from a seed.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // splitmix64 of the seed, so nearby seeds give unrelated streams and 0 is fine.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// Uniform in [0, 1).
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// One request's sampler: its settings and its own RNG stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

thread_local! {
    /// A row's exponentials, reused by each thread that samples (a vocabulary's worth of floats).
    static EXPS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest value (NaN ignored; -inf for none).
fn max_of(v: &[f32]) -> f32 {
    // Eight running maxima, so the loop vectorizes.
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    m.iter().fold(tail, |a, &x| a.max(x))
}

/// `e^((v[i] - max) * scale)` of every value into the thread's buffer, handed to `f` with their sum:
/// the difference taken first, exactly as the scalar formula does, so a small temperature's large
/// `scale` multiplies no rounding error of `v[i] * scale` (the CPU kernels' exponential: vectorized
/// with AVX2 or AVX-512; below -87, -inf and NaN give 0 there).
fn with_exps<R>(v: &[f32], max: f32, scale: f32, f: impl FnOnce(&[f32], f32) -> R) -> R {
    EXPS.with_borrow_mut(|buf| {
        buf.clear();
        buf.extend(v.iter().map(|&x| x - max));
        let sum = crate::sys::exp_scaled(buf, scale, 0.0);
        f(buf, sum)
    })
}

/// The log of the softmax's denominator: `ln(sum_i e^(v[i]))`, taken around the maximum.
fn log_sum_exp(v: &[f32]) -> f32 {
    let max = max_of(v);
    max + with_exps(v, max, 1.0, |_, sum| sum).ln()
}

/// The index at which the running sum of `w` first exceeds `r`. Sums blocks first, so only one
/// block is walked value by value; where rounding leaves `r` unreached in the block its sum said
/// holds it, that block's last token with weight, and past every block, the largest weight.
fn pick(w: &[f32], mut r: f32) -> usize {
    const BLOCK: usize = 512;
    for (b, block) in w.chunks(BLOCK).enumerate() {
        let mut lanes = [0f32; 8];
        let chunks = block.chunks_exact(8);
        let tail: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += x;
            }
        }
        let sum = lanes.iter().sum::<f32>() + tail;
        if r < sum {
            for (i, &q) in block.iter().enumerate() {
                r -= q;
                if r < 0.0 {
                    return b * BLOCK + i;
                }
            }
            // Rounding within the block: its last token with weight.
            if let Some(i) = block.iter().rposition(|&q| q > 0.0) {
                return b * BLOCK + i;
            }
        }
        r -= sum;
    }
    argmax(w)
}

/// A row's greedy pick (the lowest id of the largest logit, NaN ignored) and its log-probability
/// under the model: exactly what [`Sampler::sample`] returns for a greedy request without penalties.
pub fn greedy_pick(l: &[f32]) -> (u32, f32) {
    let t = argmax(l);
    (t as u32, l[t] - log_sum_exp(l))
}

fn argmax(v: &[f32]) -> usize {
    // From the first value that is not NaN, so a NaN is never picked (as on the GPU).
    let mut best = v.iter().position(|x| !x.is_nan()).unwrap_or(0);
    for (i, &x) in v.iter().enumerate().skip(best) {
        if x > v[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Sampler { params, rng: Rng::new(seed) }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Moves the RNG stream past `n` samples (drawn elsewhere: by the prefill worker of a pair, or
    /// by a worker the request moved away from), so a seeded request goes on with the same sequence.
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature > 1e-5 {
            for _ in 0..n {
                self.rng.next_f32();
            }
        }
    }

    /// Picks the next token. `prompt` and `output` are the request's tokens so far (for penalties).
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Sampled {
        let p = self.params.clone();
        // Log-probabilities are of the model's own distribution: before penalties and temperature.
        let lse = log_sum_exp(logits);
        let mut l = std::borrow::Cow::Borrowed(logits);
        if p.repetition_penalty != 1.0 {
            let l = l.to_mut();
            let mut seen = vec![false; l.len()];
            for &t in prompt.iter().chain(output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (x, s) in l.iter_mut().zip(seen) {
                if s {
                    *x = if *x > 0.0 { *x / p.repetition_penalty } else { *x * p.repetition_penalty };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let l = l.to_mut();
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &t in output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= c as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        let token = if p.temperature <= 1e-5 { argmax(&l) } else { self.draw(&l) };
        let mut top = Vec::new();
        if p.top_logprobs > 0 {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            let k = p.top_logprobs.min(idx.len());
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            top = idx.into_iter().map(|i| (i as u32, logits[i] - lse)).collect();
        }
        Sampled { token: token as u32, logprob: logits[token] - lse, top }
    }

    /// Samples from `l / temperature` restricted by top-k, min-p and top-p.
    fn draw(&mut self, l: &[f32]) -> usize {
        let p = self.params.clone();
        let max = max_of(l);
        let scale = 1.0 / p.temperature;
        with_exps(l, max, scale, |probs, sum| {
            if p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0 {
                self.draw_filtered(&p, probs)
            } else {
                pick(probs, self.rng.next_f32() * sum)
            }
        })
    }

    /// [`draw`](Self::draw) among the tokens top-k, min-p and top-p keep, `probs` the weights of all.
    fn draw_filtered(&mut self, p: &SamplingParams, probs: &[f32]) -> usize {
        let mut idx: Vec<usize> = (0..probs.len()).collect();
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, |&a, &b| probs[b].total_cmp(&probs[a]));
            idx.truncate(p.top_k);
        }
        idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let total: f32 = idx.iter().map(|&i| probs[i]).sum();
        let top = probs[idx[0]];
        let mut keep = idx.len();
        let mut cum = 0.0;
        for (n, &i) in idx.iter().enumerate() {
            if p.min_p > 0.0 && probs[i] < p.min_p * top {
                keep = n;
                break;
            }
            cum += probs[i] / total;
            if cum >= p.top_p {
                keep = n + 1;
                break;
            }
        }
        idx.truncate(keep.max(1));
        let sum: f32 = idx.iter().map(|&i| probs[i]).sum();
        let mut r = self.rng.next_f32() * sum;
        for &i in &idx {
            r -= probs[i];
            if r < 0.0 {
                return i;
            }
        }
        idx[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_pick_is_the_greedy_samplers_token_and_logprob() {
        let mut rng = Rng::new(5);
        for n in [1usize, 7, 300, 49_152] {
            let mut l: Vec<f32> = (0..n).map(|_| rng.next_f32() * 20.0 - 10.0).collect();
            if n > 7 {
                // A tie at the top, and NaNs (one first): the lowest id wins, the NaNs are ignored.
                let m = l.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
                (l[n - 1], l[3], l[5], l[0]) = (m, m, f32::NAN, f32::NAN);
            }
            let s = Sampler::new(SamplingParams::greedy(), 1).sample(&l, &[], &[]);
            let (token, logprob) = greedy_pick(&l);
            assert_eq!(token, s.token, "n = {n}");
            // The same arithmetic: equal, or NaN both (the portable exponentials keep a NaN).
            assert!(
                logprob.to_bits() == s.logprob.to_bits() || (logprob.is_nan() && s.logprob.is_nan()),
                "n = {n}"
            );
            if n > 7 {
                assert_eq!(s.token, 3);
            }
        }
    }

    fn counts(params: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(params, 7);
        let mut c = vec![0; logits.len()];
        for _ in 0..n {
            c[s.sample(logits, &[], &[]).token as usize] += 1;
        }
        c
    }

    #[test]
    fn skipping_continues_the_seeded_stream() {
        let logits = [1.0, 1.2, 0.8, 1.1, 0.9];
        let mut one = Sampler::new(SamplingParams::default(), 42);
        let whole: Vec<u32> = (0..12).map(|_| one.sample(&logits, &[], &[]).token).collect();
        let mut other = Sampler::new(SamplingParams::default(), 42);
        other.skip(5);
        let rest: Vec<u32> = (0..7).map(|_| other.sample(&logits, &[], &[]).token).collect();
        assert_eq!(rest, whole[5..]);
    }

    #[test]
    fn greedy_and_filters() {
        let logits = [1.0, 3.0, 2.0, 0.0];
        assert_eq!(counts(SamplingParams::greedy(), &logits, 10), [0, 10, 0, 0]);
        let c = counts(SamplingParams { top_k: 2, ..Default::default() }, &logits, 2000);
        assert_eq!((c[0], c[3]), (0, 0), "top-k 2 keeps tokens 1 and 2: {c:?}");
        // Probabilities e^3 : e^2 : e^1 : 1 normalised ~ 0.64 0.24 0.09 0.03; top-p 0.8 keeps two.
        let c = counts(SamplingParams { top_p: 0.8, ..Default::default() }, &logits, 2000);
        assert_eq!((c[0], c[3]), (0, 0), "{c:?}");
        let c = counts(SamplingParams { min_p: 0.2, ..Default::default() }, &logits, 2000);
        assert_eq!((c[0], c[3]), (0, 0), "min-p 0.2 of 0.64 drops below 0.128: {c:?}");
        let c = counts(SamplingParams::default(), &logits, 4000);
        assert!(c.iter().all(|&x| x > 0), "plain temperature sampling reaches every token: {c:?}");
        assert!(c[1] > c[2] && c[2] > c[0] && c[0] > c[3], "{c:?}");
    }

    #[test]
    fn seeds_reproduce() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.3).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams::default(), seed);
            (0..20).map(|_| s.sample(&logits, &[], &[]).token).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn penalties_and_logprobs() {
        let logits = [2.0, 1.9, -1.0];
        let greedy = SamplingParams { top_logprobs: 2, ..SamplingParams::greedy() };
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.5, ..greedy.clone() }, 0);
        assert_eq!(s.sample(&logits, &[0], &[]).token, 1, "2.0/1.5 < 1.9");
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..greedy.clone() }, 0);
        assert_eq!(s.sample(&logits, &[], &[0]).token, 1);
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.05, ..greedy.clone() }, 0);
        assert_eq!(s.sample(&logits, &[], &[0]).token, 0, "one use costs 0.05 only");
        let out = Sampler::new(greedy, 0).sample(&logits, &[], &[]);
        let lse = log_sum_exp(&logits);
        let total: f32 = logits.iter().map(|l| (l - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(out.logprob, out.top[0].1);
    }

    /// A vocabulary's worth of logits (the vectorized exponentials, blocks of the walk): the chosen
    /// token's log-probability is the softmax's, computed here in f64, and draws land on the three
    /// likely tokens, spread over several blocks, in their proportions.
    #[test]
    fn large_vocabularies_sample_in_proportion() {
        let mut logits = vec![-30.0f32; 49_152];
        for (i, l) in logits.iter_mut().enumerate() {
            *l += (i as f32 * 0.37).sin();
        }
        let likely = [(10, 1.0f32), (700, 0.0), (49_000, -1.0)];
        for &(i, l) in &likely {
            logits[i] = l;
        }
        let lse = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let mut s = Sampler::new(SamplingParams::default(), 3);
        let mut seen = std::collections::HashMap::<u32, usize>::new();
        for _ in 0..6000 {
            let out = s.sample(&logits, &[], &[]);
            let want = f64::from(logits[out.token as usize]) - lse;
            assert!((f64::from(out.logprob) - want).abs() < 1e-4, "{} against {want}", out.logprob);
            *seen.entry(out.token).or_default() += 1;
        }
        let weight: f64 = likely.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        for &(i, l) in &likely {
            let share = seen.get(&(i as u32)).copied().unwrap_or(0) as f64 / 6000.0;
            let want = f64::from(l).exp() / weight;
            assert!((share - want).abs() < 0.03, "token {i}: {share:.3} of draws against {want:.3}");
        }
    }

    /// The walk over block sums lands where walking value by value does: weights of sixteenths, so
    /// every sum is exact and the two must agree; a length that leaves a partial last block and a
    /// tail of fewer than eight in it, and a draw past the total (the largest weight).
    #[test]
    fn picking_by_blocks_equals_walking_every_value() {
        let w: Vec<f32> =
            (0..2003).map(|i| if i % 7 == 0 { 0.0 } else { ((i * 31) % 17) as f32 / 16.0 }).collect();
        let walk = |mut r: f32| {
            for (i, &q) in w.iter().enumerate() {
                r -= q;
                if r < 0.0 {
                    return i;
                }
            }
            argmax(&w)
        };
        let total: f32 = w.iter().sum();
        for k in 0..997 {
            let r = total * k as f32 / 997.0;
            assert_eq!(pick(&w, r), walk(r), "r = {r}");
        }
        assert_eq!(pick(&w, total), argmax(&w));
    }

    /// Temperature divides the logits before the softmax (checked against f64 at the load
    /// generator's 0.7 and at 0.05 with logits around 30, where a rounding error of `x / T` would
    /// show), and the filtered path keeps its proportions over a large vocabulary.
    #[test]
    fn temperatures_sample_the_scaled_softmax() {
        let mut logits = vec![f32::NEG_INFINITY; 30_000];
        let likely = [(3, 30.0f32), (9_000, 29.9), (29_999, 29.85), (600, 29.7)];
        for &(i, l) in &likely {
            logits[i] = l;
        }
        for (t, top_k) in [(0.7f32, 0), (0.05, 0), (0.7, 3)] {
            let kept = if top_k > 0 { &likely[..top_k] } else { &likely[..] };
            let weight: f64 = kept.iter().map(|&(_, l)| (f64::from(l) / f64::from(t)).exp()).sum();
            let params = SamplingParams { temperature: t, top_k, ..Default::default() };
            let mut s = Sampler::new(params, 11);
            let mut seen = std::collections::HashMap::<u32, usize>::new();
            for _ in 0..8000 {
                *seen.entry(s.sample(&logits, &[], &[]).token).or_default() += 1;
            }
            for &(i, l) in &likely {
                let share = seen.get(&(i as u32)).copied().unwrap_or(0) as f64 / 8000.0;
                let in_top = kept.iter().any(|&(j, _)| j == i);
                let want = if in_top { (f64::from(l) / f64::from(t)).exp() / weight } else { 0.0 };
                assert!(
                    (share - want).abs() < 0.025,
                    "T {t} top-k {top_k}, token {i}: {share:.3} against {want:.3}"
                );
            }
            assert_eq!(seen.values().sum::<usize>(), 8000, "only the likely tokens: {seen:?}");
        }
    }
}
