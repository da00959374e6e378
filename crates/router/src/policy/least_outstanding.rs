use super::{Candidate, Policy};

/// The worker with the fewest requests in flight (the first such one on a tie).
#[derive(Debug, Default)]
pub struct LeastOutstanding;

impl Policy for LeastOutstanding {
    fn pick(&mut self, candidates: &[Candidate], _prompt: &str) -> usize {
        candidates.iter().enumerate().min_by_key(|(_, c)| c.outstanding).map_or(0, |(i, _)| i)
    }
}
