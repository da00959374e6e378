//! The prefix cache's radix tree: one node per full block of tokens, in an arena addressed by `NodeId`.
//!
//! Edges live in one hash map keyed by the node's *chain hash* (a hash of every token from the root to
//! the end of its block), with the node and its parent as the value. The chain hashes of a prompt can all
//! be computed before any lookup, so the probes of one match do not wait on each other and the CPU
//! overlaps their cache misses; each hit is then verified (parent is the previous match, tokens equal),
//! so a hash collision is a miss, never a wrong match. Only leaves whose block nobody references are
//! evictable; they sit in an LRU set ordered by last use.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::{BlockId, NodeId};

pub(crate) const ROOT: NodeId = NodeId(0);

/// A small, fast hasher for integer ids and keys that are already well mixed (one multiply per word).
/// Not for keys an attacker chooses.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// A `HashMap` keyed by integer ids, with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Hash of one block's tokens. Two tokens per multiply in two independent lanes keeps the dependency
/// chain short; a hash only picks the bucket, tokens are always compared.
pub(crate) fn hash_tokens(tokens: &[u32]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let (mut a, mut b) = (0xcbf2_9ce4_8422_2325u64, 0x9e37_79b9_7f4a_7c15u64);
    let mut quads = tokens.chunks_exact(4);
    for q in &mut quads {
        a = (a ^ (u64::from(q[0]) | u64::from(q[1]) << 32)).wrapping_mul(K).rotate_left(29);
        b = (b ^ (u64::from(q[2]) | u64::from(q[3]) << 32)).wrapping_mul(K).rotate_left(29);
    }
    for &t in quads.remainder() {
        a = (a ^ u64::from(t)).wrapping_mul(K).rotate_left(29);
    }
    let h = (a ^ b.rotate_left(17)).wrapping_mul(K);
    h ^ (h >> 31)
}

/// Token equality without early exit: branch-free and vectorized, faster than `==` on short blocks.
pub(crate) fn same_tokens(a: &[u32], b: &[u32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u32, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The chain hash of a child block: its parent's chain hash combined with its own tokens' hash.
pub(crate) fn chain_hash(parent_chain: u64, block_hash: u64) -> u64 {
    let h = (parent_chain.rotate_left(23) ^ block_hash).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ (h >> 29)
}

pub(crate) const ROOT_CHAIN: u64 = 0x2545_f491_4f6c_dd1d;

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) parent: NodeId,
    pub(crate) block: BlockId,
    pub(crate) chain: u64,
    pub(crate) children: u32,
    pub(crate) last_use: u64,
    /// Mirrors "no sequence or lease references this node's block".
    pub(crate) unreferenced: bool,
    pub(crate) in_lru: bool,
    pub(crate) live: bool,
}

#[derive(Debug)]
pub(crate) struct PrefixTree {
    block_size: usize,
    pub(crate) nodes: Vec<Node>,
    /// Node `n`'s tokens are `tokens[n * block_size..][..block_size]`: one flat arena, so a match
    /// touches the edge map and the tokens, never the node structs.
    tokens: Vec<u32>,
    free_nodes: Vec<NodeId>,
    /// chain hash -> (node, parent)
    pub(crate) edges: IdMap<u64, (NodeId, NodeId)>,
    pub(crate) lru: BTreeSet<(u64, NodeId)>,
    tick: u64,
}

impl PrefixTree {
    pub(crate) fn new(block_size: usize) -> Self {
        let root = Node {
            parent: ROOT,
            block: BlockId(u32::MAX),
            chain: ROOT_CHAIN,
            children: 0,
            last_use: 0,
            unreferenced: false,
            in_lru: false,
            live: true,
        };
        PrefixTree {
            block_size,
            nodes: vec![root],
            tokens: vec![0; block_size],
            free_nodes: Vec::new(),
            edges: IdMap::default(),
            lru: BTreeSet::new(),
            tick: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.nodes.len() - 1 - self.free_nodes.len()
    }

    pub(crate) fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.0 as usize]
    }

    fn node_mut(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n.0 as usize]
    }

    pub(crate) fn node_tokens(&self, n: NodeId) -> &[u32] {
        &self.tokens[n.0 as usize * self.block_size..][..self.block_size]
    }

    /// The child of `parent` (whose chain hash is `chain`) holding exactly `tokens`, if cached.
    #[inline(always)]
    fn child_by_chain(&self, parent: NodeId, chain: u64, tokens: &[u32]) -> Option<NodeId> {
        let &(n, p) = self.edges.get(&chain)?;
        (p == parent && same_tokens(self.node_tokens(n), tokens)).then_some(n)
    }

    /// The child of `parent` holding exactly `tokens`, if cached.
    pub(crate) fn child(&self, parent: NodeId, tokens: &[u32]) -> Option<NodeId> {
        let chain = chain_hash(self.node(parent).chain, hash_tokens(tokens));
        self.child_by_chain(parent, chain, tokens)
    }

    /// The longest chain of cached full blocks that prefixes `tokens`, at most `max_blocks` long.
    pub(crate) fn longest_match(&self, tokens: &[u32], max_blocks: usize) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut cur = ROOT;
        let mut chain = ROOT_CHAIN;
        for block in tokens.chunks_exact(self.block_size).take(max_blocks) {
            // The next chain hash depends only on the tokens, not on the lookup, so successive probes
            // overlap in the CPU.
            chain = chain_hash(chain, hash_tokens(block));
            match self.child_by_chain(cur, chain, block) {
                Some(n) => {
                    path.push(n);
                    cur = n;
                }
                None => break,
            }
        }
        path
    }

    /// Adds a child of `parent` for `tokens` held in `block`. `None` if another entry has the same chain
    /// hash (a collision): that block is simply not cached.
    pub(crate) fn insert(&mut self, parent: NodeId, tokens: &[u32], block: BlockId) -> Option<NodeId> {
        debug_assert_eq!(tokens.len(), self.block_size);
        let chain = chain_hash(self.node(parent).chain, hash_tokens(tokens));
        if self.edges.contains_key(&chain) {
            return None;
        }
        self.tick += 1;
        let node = Node {
            parent,
            block,
            chain,
            children: 0,
            last_use: self.tick,
            unreferenced: false,
            in_lru: false,
            live: true,
        };
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id.0 as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.tokens.resize(self.tokens.len() + self.block_size, 0);
                NodeId((self.nodes.len() - 1) as u32)
            }
        };
        self.tokens[id.0 as usize * self.block_size..][..self.block_size].copy_from_slice(tokens);
        self.edges.insert(chain, (id, parent));
        self.node_mut(parent).children += 1;
        self.refresh(parent);
        Some(id)
    }

    /// Records whether anyone references `n`'s block; a node that becomes unreferenced counts as used now.
    pub(crate) fn set_unreferenced(&mut self, n: NodeId, unreferenced: bool) {
        if self.node(n).unreferenced == unreferenced {
            return;
        }
        if unreferenced {
            self.tick += 1;
            let t = self.tick;
            self.remove_from_lru(n);
            self.node_mut(n).last_use = t;
        }
        self.node_mut(n).unreferenced = unreferenced;
        self.refresh(n);
    }

    /// The least recently used evictable node.
    pub(crate) fn lru_victim(&self) -> Option<NodeId> {
        self.lru.first().map(|&(_, n)| n)
    }

    /// Unlinks evictable leaf `n` and returns its block.
    pub(crate) fn remove(&mut self, n: NodeId) -> BlockId {
        let node = self.node(n).clone();
        assert!(node.live && node.children == 0 && node.unreferenced, "removing a node in use");
        self.remove_from_lru(n);
        self.edges.remove(&node.chain);
        self.node_mut(n).live = false;
        self.free_nodes.push(n);
        self.node_mut(node.parent).children -= 1;
        self.refresh(node.parent);
        node.block
    }

    fn remove_from_lru(&mut self, n: NodeId) {
        let node = self.node_mut(n);
        if node.in_lru {
            node.in_lru = false;
            let key = (node.last_use, n);
            self.lru.remove(&key);
        }
    }

    /// Puts `n` in or out of the LRU set to match "unreferenced leaf".
    fn refresh(&mut self, n: NodeId) {
        if n == ROOT {
            return;
        }
        let node = self.node(n);
        let evictable = node.live && node.unreferenced && node.children == 0;
        if evictable && !node.in_lru {
            let key = (node.last_use, n);
            self.node_mut(n).in_lru = true;
            self.lru.insert(key);
        } else if !evictable && node.in_lru {
            self.remove_from_lru(n);
        }
    }

    /// Live nodes, for invariant checks.
    pub(crate) fn live_nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.nodes.iter().enumerate().skip(1).filter(|(_, n)| n.live).map(|(i, n)| (NodeId(i as u32), n))
    }
}
