//! Worker selection policies, one file each. A policy sees the candidate workers' current load and
//! (for cache-aware routing) the request's prompt text; it returns the index of the chosen worker.

mod cache_aware;
mod least_outstanding;
mod power_of_two;
mod round_robin;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use least_outstanding::LeastOutstanding;
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

/// What a policy knows about one candidate worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Candidate {
    /// Stable id of the worker (the router's registry index).
    pub worker: u32,
    /// Requests the router has in flight to it.
    pub outstanding: u32,
    /// From the worker's KV events, where it publishes them: of the prompt's tokens, how many its
    /// cache holds from the start, and how many there are. `None`: unknown (cache-aware policies
    /// then go by the prompts they routed there).
    pub cached_tokens: Option<(u32, u32)>,
}

impl Candidate {
    /// A worker with `outstanding` requests and no published cache.
    pub fn new(worker: u32, outstanding: u32) -> Candidate {
        Candidate { worker, outstanding, cached_tokens: None }
    }
}

/// Why a policy picked a worker, for `/debug/requests`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub worker: u32,
    /// What decided: `cache_match` (the longest cached prefix), `load_imbalance` (the idlest, the
    /// load being too uneven to follow the cache), `least_cached` (no prefix matched well enough).
    pub rule: &'static str,
    pub prompt_bytes: usize,
    /// Per candidate worker, the bytes of the prompt's prefix its tree matched (or, for a worker
    /// whose events say what it holds, that share of the prompt's bytes).
    pub matched: Vec<(u32, usize)>,
    /// Some candidate's match came from its KV events (`kv_events`), or none's (`routed_prompts`).
    pub source: &'static str,
}

/// Picks a worker for a request. `candidates` holds only healthy workers of the right role and is
/// never empty when called; `prompt` is the request's prompt text (for cache-aware policies).
pub trait Policy: std::fmt::Debug + Send {
    fn pick(&mut self, candidates: &[Candidate], prompt: &str) -> usize;

    /// The request routed to `worker` with `prompt` was accepted there (cache-aware policies learn
    /// from it). The default does nothing.
    fn routed(&mut self, _worker: u32, _prompt: &str) {}

    /// `worker` left the pool; forget what is known about it. The default does nothing.
    fn forget(&mut self, _worker: u32) {}

    /// Why the last `pick` chose as it did, for policies that weigh more than load.
    fn last_choice(&self) -> Option<&Choice> {
        None
    }

    /// For policies that follow the workers' caches: the worker `pick` would choose because its cache
    /// holds the prompt's prefix (the `cache_match` rule), and how many bytes of the prompt it holds.
    /// `None` where the policy knows no cache or would choose by another rule. Changes nothing a
    /// later `pick` sees.
    fn holder(&mut self, _candidates: &[Candidate], _prompt: &str) -> Option<(u32, usize)> {
        None
    }
}
