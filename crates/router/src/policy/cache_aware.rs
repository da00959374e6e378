use std::collections::HashMap;

use super::{Candidate, Policy};

/// Knobs of [`CacheAware`], after the SGLang router's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Route by cache only when the best match covers at least this share of the prompt.
    pub cache_threshold: f64,
    /// The load counts as imbalanced when the busiest worker has this many more requests than the
    /// idlest ...
    pub balance_abs_threshold: u32,
    /// ... and more than this many times as many.
    pub balance_rel_threshold: f64,
    /// Prompt chunks remembered per worker; past it the worker's tree starts over.
    pub nodes_per_worker_max: usize,
    /// Bytes per chunk: the tree matches prefixes at this granularity.
    pub chunk_bytes: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.5,
            nodes_per_worker_max: 1 << 16,
            chunk_bytes: 16,
        }
    }
}

/// An approximate prefix tree of the prompts routed to one worker: chunks of `chunk_bytes` bytes,
/// each node keyed by (parent, hash of its chunk).
#[derive(Debug, Default)]
struct Tree {
    edges: HashMap<(u32, u64), u32>,
    nodes: u32,
}

fn chunk_hash(chunk: &[u8]) -> u64 {
    chunk.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl Tree {
    /// Bytes of `prompt` matched by the tree (whole chunks).
    fn matched(&self, prompt: &[u8], chunk: usize) -> usize {
        let mut node = 0u32;
        let mut n = 0;
        for c in prompt.chunks(chunk) {
            match self.edges.get(&(node, chunk_hash(c))) {
                Some(&next) => {
                    node = next;
                    n += c.len();
                }
                None => break,
            }
        }
        n
    }

    fn insert(&mut self, prompt: &[u8], chunk: usize, max: usize) {
        if self.nodes as usize + prompt.len().div_ceil(chunk) > max {
            // Bounded memory: a full tree starts over (the worker's own cache evicts too).
            *self = Tree::default();
        }
        let mut node = 0u32;
        for c in prompt.chunks(chunk) {
            let key = (node, chunk_hash(c));
            node = match self.edges.get(&key) {
                Some(&next) => next,
                None => {
                    self.nodes += 1;
                    self.edges.insert(key, self.nodes);
                    self.nodes
                }
            };
        }
    }
}

/// Sends a request where its prompt's prefix was sent before (that worker likely holds the KV), unless
/// the load is imbalanced, when the least loaded worker wins; with no good match, the worker that has
/// cached the least.
#[derive(Debug, Default)]
pub struct CacheAware {
    config: CacheAwareConfig,
    trees: HashMap<u32, Tree>,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware { config, trees: HashMap::new() }
    }
}

impl Policy for CacheAware {
    fn pick(&mut self, candidates: &[Candidate], prompt: &str) -> usize {
        let c = &self.config;
        let least = candidates.iter().enumerate().min_by_key(|(_, w)| w.outstanding).map_or(0, |(i, _)| i);
        let (min, max) =
            (candidates[least].outstanding, candidates.iter().map(|w| w.outstanding).max().unwrap_or(0));
        if max - min > c.balance_abs_threshold && f64::from(max) > f64::from(min) * c.balance_rel_threshold {
            return least;
        }
        let bytes = prompt.as_bytes();
        let (best, matched) = candidates
            .iter()
            .enumerate()
            .map(|(i, w)| (i, self.trees.get(&w.worker).map_or(0, |t| t.matched(bytes, c.chunk_bytes))))
            .max_by_key(|&(i, m)| (m, std::cmp::Reverse(candidates[i].outstanding)))
            .unwrap_or((least, 0));
        if !bytes.is_empty() && matched as f64 / bytes.len() as f64 >= c.cache_threshold {
            return best;
        }
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| (self.trees.get(&w.worker).map_or(0, |t| t.nodes), w.outstanding))
            .map_or(least, |(i, _)| i)
    }

    fn routed(&mut self, worker: u32, prompt: &str) {
        let (chunk, max) = (self.config.chunk_bytes.max(1), self.config.nodes_per_worker_max);
        self.trees.entry(worker).or_default().insert(prompt.as_bytes(), chunk, max);
    }

    fn forget(&mut self, worker: u32) {
        self.trees.remove(&worker);
    }
}
