use super::{Candidate, Policy};

/// Two workers drawn at random, the less loaded of them: near least-outstanding balance without every
/// router converging on the same worker.
#[derive(Debug)]
pub struct PowerOfTwo {
    state: u64,
}

impl PowerOfTwo {
    /// `seed` makes the draws reproducible.
    pub fn new(seed: u64) -> Self {
        PowerOfTwo { state: seed | 1 }
    }

    fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }
}

impl Policy for PowerOfTwo {
    fn pick(&mut self, candidates: &[Candidate], _prompt: &str) -> usize {
        let n = candidates.len() as u64;
        if n == 1 {
            return 0;
        }
        let a = (self.next() % n) as usize;
        let mut b = (self.next() % (n - 1)) as usize;
        if b >= a {
            b += 1;
        }
        if candidates[b].outstanding < candidates[a].outstanding {
            b
        } else {
            a
        }
    }
}
