use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// Hashes the tree's keys, which are already hashes (plus a node number): one multiply-rotate per
/// word instead of SipHash's rounds. The router's own table; nothing an outsider sends can pick its
/// buckets beyond slowing its own routing decision.
#[derive(Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// An approximate prefix tree of the prompts routed to one worker: chunks of `chunk_bytes` bytes,
/// each node keyed by (parent, hash of its chunk).
#[derive(Debug, Default)]
struct Tree {
    edges: HashMap<(u32, u64), u32, BuildHasherDefault<MixHasher>>,
    nodes: u32,
}

/// The hash of each `chunk`-byte piece of `prompt` (the last may be shorter), eight bytes at a time.
fn chunk_hashes(prompt: &[u8], chunk: usize, out: &mut Vec<u64>) {
    out.clear();
    out.extend(prompt.chunks(chunk).map(|c| {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ c.len() as u64;
        for w in c.chunks(8) {
            let mut word = [0u8; 8];
            word[..w.len()].copy_from_slice(w);
            h = (h ^ u64::from_le_bytes(word)).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        }
        h
    }));
}

impl Tree {
    /// Chunks of the prompt (given by their hashes) matched by the tree, from the start.
    fn matched(&self, hashes: &[u64]) -> usize {
        let mut node = 0u32;
        let mut n = 0;
        for &h in hashes {
            match self.edges.get(&(node, h)) {
                Some(&next) => {
                    node = next;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    fn insert(&mut self, hashes: &[u64], max: usize) {
        if self.nodes as usize + hashes.len() > max {
            // Bounded memory: a full tree starts over (the worker's own cache evicts too).
            *self = Tree::default();
        }
        let mut node = 0u32;
        for &h in hashes {
            let key = (node, h);
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
    /// The current prompt's chunk hashes (reused from request to request).
    hashes: Vec<u64>,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware { config, trees: HashMap::new(), hashes: Vec::new() }
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
        let (bytes, chunk) = (prompt.as_bytes(), c.chunk_bytes.max(1));
        chunk_hashes(bytes, chunk, &mut self.hashes);
        let (best, matched) = candidates
            .iter()
            .enumerate()
            .map(|(i, w)| (i, self.trees.get(&w.worker).map_or(0, |t| t.matched(&self.hashes))))
            .max_by_key(|&(i, m)| (m, std::cmp::Reverse(candidates[i].outstanding)))
            .unwrap_or((least, 0));
        // Matched bytes: whole chunks, the last of which may be short.
        let matched_bytes = if matched == self.hashes.len() { bytes.len() } else { matched * chunk };
        if !bytes.is_empty() && matched_bytes as f64 / bytes.len() as f64 >= c.cache_threshold {
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
        chunk_hashes(prompt.as_bytes(), chunk, &mut self.hashes);
        self.trees.entry(worker).or_default().insert(&self.hashes, max);
    }

    fn forget(&mut self, worker: u32) {
        self.trees.remove(&worker);
    }
}
