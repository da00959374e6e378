use super::{Candidate, Policy};

/// Each worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn pick(&mut self, candidates: &[Candidate], _prompt: &str) -> usize {
        let i = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        i
    }
}
