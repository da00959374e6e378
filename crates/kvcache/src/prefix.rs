//! The prefix cache's radix tree: one node per full block of tokens, in an arena addressed by `NodeId`.
//!
//! Edges live in one hash map keyed by (parent, hash of the child's tokens), so a lookup costs one hash
//! of `block_size` tokens and one probe per block; the tokens are compared on every hit, so a hash
//! collision is a miss, never a wrong match. Only leaves whose block nobody references are evictable;
//! they sit in an LRU set ordered by last use.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::{BlockId, NodeId};

pub(crate) const ROOT: NodeId = NodeId(0);

/// A small, fast hasher for keys that are already well mixed (u32 parents and u64 token hashes).
#[derive(Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
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

pub(crate) type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Hash of one block's tokens.
pub(crate) fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in tokens {
        h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    h ^ (h >> 29)
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) parent: NodeId,
    pub(crate) block: BlockId,
    pub(crate) hash: u64,
    pub(crate) tokens: Box<[u32]>,
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
    free_nodes: Vec<NodeId>,
    pub(crate) edges: MixMap<(u32, u64), NodeId>,
    pub(crate) lru: BTreeSet<(u64, NodeId)>,
    tick: u64,
}

impl PrefixTree {
    pub(crate) fn new(block_size: usize) -> Self {
        let root = Node {
            parent: ROOT,
            block: BlockId(u32::MAX),
            hash: 0,
            tokens: Box::new([]),
            children: 0,
            last_use: 0,
            unreferenced: false,
            in_lru: false,
            live: true,
        };
        PrefixTree {
            block_size,
            nodes: vec![root],
            free_nodes: Vec::new(),
            edges: MixMap::default(),
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

    /// The child of `parent` holding exactly `tokens`, if cached.
    pub(crate) fn child(&self, parent: NodeId, tokens: &[u32]) -> Option<NodeId> {
        let n = *self.edges.get(&(parent.0, hash_tokens(tokens)))?;
        (*self.node(n).tokens == *tokens).then_some(n)
    }

    /// The longest chain of cached full blocks that prefixes `tokens`, at most `max_blocks` long.
    pub(crate) fn longest_match(&self, tokens: &[u32], max_blocks: usize) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut cur = ROOT;
        for block in tokens.chunks_exact(self.block_size).take(max_blocks) {
            match self.child(cur, block) {
                Some(n) => {
                    path.push(n);
                    cur = n;
                }
                None => break,
            }
        }
        path
    }

    /// Adds a child of `parent` for `tokens` held in `block`. `None` if an entry with the same hash but
    /// other tokens sits there (a hash collision): that block is simply not cached.
    pub(crate) fn insert(&mut self, parent: NodeId, tokens: &[u32], block: BlockId) -> Option<NodeId> {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = hash_tokens(tokens);
        if self.edges.contains_key(&(parent.0, hash)) {
            return None;
        }
        self.tick += 1;
        let node = Node {
            parent,
            block,
            hash,
            tokens: tokens.into(),
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
                NodeId((self.nodes.len() - 1) as u32)
            }
        };
        self.edges.insert((parent.0, hash), id);
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
        self.edges.remove(&(node.parent.0, node.hash));
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
