use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::{Candidate, Choice, Policy};

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
    /// Prompt chunks remembered per worker; past it the least recently used branches are forgotten.
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

/// A node of a worker's tree: one chunk, under its parent.
#[derive(Debug, Clone, Copy)]
struct Node {
    parent: u32,
    hash: u64,
    /// The last time (insert counter) a prompt through this node was routed here.
    last_use: u64,
    children: u32,
    live: bool,
}

const ROOT: Node = Node { parent: 0, hash: 0, last_use: u64::MAX, children: 0, live: true };

/// An approximate prefix tree of the prompts routed to one worker: chunks of `chunk_bytes` bytes,
/// each node keyed by (parent, hash of its chunk). Bounded: past its size, the least recently used
/// branches are cut back, leaf by leaf, as the worker's own cache evicts; a prefix in use stays.
#[derive(Debug)]
struct Tree {
    edges: HashMap<(u32, u64), u32, BuildHasherDefault<MixHasher>>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    tick: u64,
}

impl Default for Tree {
    fn default() -> Self {
        Tree { edges: HashMap::default(), nodes: vec![ROOT], free: Vec::new(), tick: 0 }
    }
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
    /// Chunks remembered.
    fn len(&self) -> usize {
        self.nodes.len() - 1 - self.free.len()
    }

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

    /// Remembers a prompt routed here (at most `max` chunks of it), then cuts the least recently used
    /// branches back to 7/8 of `max` if the tree outgrew it.
    fn insert(&mut self, hashes: &[u64], max: usize) {
        self.tick += 1;
        let mut node = 0u32;
        for &h in &hashes[..hashes.len().min(max)] {
            let key = (node, h);
            node = match self.edges.get(&key) {
                Some(&next) => next,
                None => {
                    let n = Node { parent: node, hash: h, last_use: 0, children: 0, live: true };
                    let id = match self.free.pop() {
                        Some(id) => {
                            self.nodes[id as usize] = n;
                            id
                        }
                        None => {
                            self.nodes.push(n);
                            (self.nodes.len() - 1) as u32
                        }
                    };
                    self.nodes[node as usize].children += 1;
                    self.edges.insert(key, id);
                    id
                }
            };
            self.nodes[node as usize].last_use = self.tick;
        }
        if self.len() > max {
            self.evict(max - max / 8);
        }
    }

    /// Removes least recently used leaves until at most `keep` chunks remain; a parent left without
    /// children becomes a leaf in its turn. A parent is used at least as recently as its children, so
    /// whole old branches go, deepest first, before any part of a more recent one.
    fn evict(&mut self, keep: usize) {
        let mut leaves: BinaryHeap<Reverse<(u64, u32)>> = (1..self.nodes.len() as u32)
            .filter(|&i| self.nodes[i as usize].live && self.nodes[i as usize].children == 0)
            .map(|i| Reverse((self.nodes[i as usize].last_use, i)))
            .collect();
        while self.len() > keep {
            let Some(Reverse((_, i))) = leaves.pop() else { break };
            let n = self.nodes[i as usize];
            self.edges.remove(&(n.parent, n.hash));
            self.nodes[i as usize].live = false;
            self.free.push(i);
            let p = &mut self.nodes[n.parent as usize];
            p.children -= 1;
            if n.parent != 0 && p.children == 0 {
                leaves.push(Reverse((p.last_use, n.parent)));
            }
        }
    }
}

/// Sends a request where its prompt's prefix was sent before (that worker likely holds the KV), unless
/// the load is imbalanced, when the least loaded worker wins; with no good match, the worker that has
/// cached the least. Each worker's tree is bounded and forgets its least recently used branches first.
#[derive(Debug, Default)]
pub struct CacheAware {
    config: CacheAwareConfig,
    trees: HashMap<u32, Tree>,
    /// The current prompt's chunk hashes (reused from request to request).
    hashes: Vec<u64>,
    last: Option<Choice>,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware { config, trees: HashMap::new(), hashes: Vec::new(), last: None }
    }

    /// Prompt chunks remembered for `worker`.
    pub fn remembered(&self, worker: u32) -> usize {
        self.trees.get(&worker).map_or(0, Tree::len)
    }
}

impl Policy for CacheAware {
    fn pick(&mut self, candidates: &[Candidate], prompt: &str) -> usize {
        let c = &self.config;
        let (bytes, chunk) = (prompt.as_bytes(), c.chunk_bytes.max(1));
        chunk_hashes(bytes, chunk, &mut self.hashes);
        // Matched bytes per candidate: whole chunks, the last of which may be short.
        // A worker whose events say what it holds: that share of the prompt; otherwise its tree.
        let matched: Vec<(u32, usize)> = candidates
            .iter()
            .map(|w| match w.cached_tokens {
                Some((held, total)) if held >= total => (w.worker, bytes.len()),
                Some((held, total)) => {
                    (w.worker, (bytes.len() as u64 * u64::from(held) / u64::from(total.max(1))) as usize)
                }
                None => {
                    let m = self.trees.get(&w.worker).map_or(0, |t| t.matched(&self.hashes));
                    (w.worker, if m == self.hashes.len() { bytes.len() } else { m * chunk })
                }
            })
            .collect();
        let source =
            if candidates.iter().any(|w| w.cached_tokens.is_some()) { "kv_events" } else { "routed_prompts" };
        let least = candidates.iter().enumerate().min_by_key(|(_, w)| w.outstanding).map_or(0, |(i, _)| i);
        let (min, max) =
            (candidates[least].outstanding, candidates.iter().map(|w| w.outstanding).max().unwrap_or(0));
        let imbalanced =
            max - min > c.balance_abs_threshold && f64::from(max) > f64::from(min) * c.balance_rel_threshold;
        let best = (0..candidates.len())
            .max_by_key(|&i| (matched[i].1, std::cmp::Reverse(candidates[i].outstanding)))
            .unwrap_or(least);
        let (index, rule) = if imbalanced {
            (least, "load_imbalance")
        } else if !bytes.is_empty() && matched[best].1 as f64 / bytes.len() as f64 >= c.cache_threshold {
            (best, "cache_match")
        } else {
            let fewest = candidates
                .iter()
                .enumerate()
                .min_by_key(|(_, w)| (self.trees.get(&w.worker).map_or(0, Tree::len), w.outstanding))
                .map_or(least, |(i, _)| i);
            (fewest, "least_cached")
        };
        self.last = Some(Choice {
            worker: candidates[index].worker,
            rule,
            prompt_bytes: bytes.len(),
            matched,
            source,
        });
        index
    }

    fn routed(&mut self, worker: u32, prompt: &str) {
        let (chunk, max) = (self.config.chunk_bytes.max(1), self.config.nodes_per_worker_max.max(1));
        chunk_hashes(prompt.as_bytes(), chunk, &mut self.hashes);
        self.trees.entry(worker).or_default().insert(&self.hashes, max);
    }

    fn forget(&mut self, worker: u32) {
        self.trees.remove(&worker);
    }

    fn last_choice(&self) -> Option<&Choice> {
        self.last.as_ref()
    }

    fn holder(&mut self, candidates: &[Candidate], prompt: &str) -> Option<(u32, usize)> {
        if candidates.is_empty() {
            return None;
        }
        let last = self.last.take();
        let i = self.pick(candidates, prompt);
        let choice = std::mem::replace(&mut self.last, last)?;
        let held = choice.matched.get(i).map_or(0, |m| m.1);
        (choice.rule == "cache_match").then_some((choice.worker, held))
    }
}
