//! The full invariant check, recomputed from scratch. Tests and fuzz targets run it after every step.

use std::collections::HashSet;

use crate::cache::KvCache;
use crate::{BlockId, OwnerKind};

impl KvCache {
    /// Recomputes every reference and owner count from the sequences, leases and prefix tree, and
    /// compares with the incremental bookkeeping. `Err` names the first violation found:
    /// no block owned twice over or leaked, `free + owned == total`, the free list exactly the unowned
    /// blocks, the tree's links and LRU set consistent, each sequence's blocks covering its KV.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.blocks.len();
        let mut seq_refs = vec![0u32; n];
        let mut lease_refs = vec![0u32; n];
        for (id, s) in &self.seqs {
            if s.computed > s.tokens.len() {
                return Err(format!("{id}: {} computed of {} tokens", s.computed, s.tokens.len()));
            }
            if s.blocks.len() < self.blocks_for(s.computed) {
                return Err(format!("{id}: {} blocks for {} computed tokens", s.blocks.len(), s.computed));
            }
            let mut seen = HashSet::new();
            for (i, b) in s.blocks.iter().enumerate() {
                if b.is_released() {
                    if i >= s.release_from {
                        return Err(format!("{id}: block {i} released past the release cursor"));
                    }
                    continue;
                }
                if !seen.insert(*b) {
                    return Err(format!("{id} holds {b} twice"));
                }
                seq_refs[b.0 as usize] += 1;
            }
        }
        for (t, l) in &self.leases {
            if l.blocks.len() != l.epochs.len() {
                return Err(format!("{t}: blocks and epochs differ in length"));
            }
            if l.reused > l.blocks.len() {
                return Err(format!("{t}: {} reused of {} blocks", l.reused, l.blocks.len()));
            }
            if let Some(b) = l.blocks[..l.reused].iter().find(|b| self.blocks[b.0 as usize].node.is_none()) {
                return Err(format!("{t}: reused {b} is not in the prefix cache"));
            }
            for b in &l.blocks {
                lease_refs[b.0 as usize] += 1;
            }
        }
        let mut owned = [0usize; 3];
        for (i, m) in self.blocks.iter().enumerate() {
            let b = BlockId(i as u32);
            if m.seq_refs != seq_refs[i] || m.lease_refs != lease_refs[i] {
                return Err(format!(
                    "{b}: refs seq {}/{} lease {}/{} (stored/recounted)",
                    m.seq_refs, seq_refs[i], m.lease_refs, lease_refs[i]
                ));
            }
            if let Some(k) = m.owner() {
                owned[k.index()] += 1;
            }
            if let Some(node) = m.node {
                let nd = self.tree.node(node);
                if !nd.live || nd.block != b {
                    return Err(format!("{b} points at a tree node that does not hold it"));
                }
                if nd.unreferenced != (m.seq_refs == 0 && m.lease_refs == 0) {
                    return Err(format!("{b}: tree node's referenced flag is stale"));
                }
            }
        }
        if owned != self.owned {
            return Err(format!("owner counts {:?}, recounted {owned:?}", self.owned));
        }
        let free: HashSet<BlockId> = self.free.iter().copied().collect();
        if free.len() != self.free.len() {
            return Err("a block is on the free list twice".into());
        }
        for b in &self.free {
            if self.blocks[b.0 as usize].owner().is_some() {
                return Err(format!("{b} is on the free list but owned"));
            }
        }
        let total_owned: usize = owned.iter().sum();
        if free.len() + total_owned != n {
            return Err(format!("conservation: {} free + {total_owned} owned != {n}", free.len()));
        }
        let mut evictable = 0;
        let mut children = vec![0u32; self.tree.nodes.len()];
        for (id, nd) in self.tree.live_nodes() {
            if self.blocks[nd.block.0 as usize].node != Some(id) {
                return Err(format!("tree node {} holds {} which does not point back", id.0, nd.block));
            }
            if self.tree.edges.get(&nd.chain) != Some(&(id, nd.parent)) {
                return Err(format!("tree node {} is not reachable from its parent", id.0));
            }
            children[nd.parent.0 as usize] += 1;
            let should = nd.unreferenced && nd.children == 0;
            if should != nd.in_lru || nd.in_lru != self.tree.lru.contains(&(nd.last_use, id)) {
                return Err(format!("tree node {} LRU membership is wrong", id.0));
            }
            evictable += usize::from(should);
        }
        for (id, nd) in self.tree.live_nodes() {
            if children[id.0 as usize] != nd.children {
                return Err(format!(
                    "tree node {} counts {} children, has {}",
                    id.0, nd.children, children[id.0 as usize]
                ));
            }
        }
        if self.tree.edges.len() != self.tree.len() || self.tree.lru.len() != evictable {
            return Err("tree edge map or LRU set has stray entries".into());
        }
        if self.owned[OwnerKind::Cache.index()] > self.tree.len() {
            return Err("more cache-owned blocks than tree nodes".into());
        }
        if let Some(t) = self.tier.as_ref() {
            t.check()?;
        }
        Ok(())
    }
}

impl crate::KvGroups {
    /// Every group's own invariants, the groups in step (the same sequences with the same tokens and
    /// computed length, the same leases with the same expiry), and the state ledger: each slot free
    /// or held by exactly one live sequence, lease or restore point, as its owner records.
    pub fn check_invariants(&self) -> Result<(), String> {
        use crate::groups::StateOwner;
        for (i, g) in self.groups.iter().enumerate() {
            g.check_invariants().map_err(|e| format!("group {i}: {e}"))?;
        }
        let first = &self.groups[0];
        for (i, g) in self.groups.iter().enumerate().skip(1) {
            if g.seqs.len() != first.seqs.len() || g.leases.len() != first.leases.len() {
                return Err(format!("group {i} holds other sequences or leases than group 0"));
            }
            for (id, s) in &g.seqs {
                let f = first.seqs.get(id).ok_or_else(|| format!("group {i} holds {id}, group 0 not"))?;
                if f.blocks.len() != s.blocks.len() {
                    return Err(format!(
                        "{id}: {} blocks in group {i}, {} in group 0",
                        s.blocks.len(),
                        f.blocks.len()
                    ));
                }
                if (f.computed, &f.tokens) != (s.computed, &s.tokens) {
                    return Err(format!(
                        "{id}: group {i} is at {} tokens, group 0 at {}",
                        s.computed, f.computed
                    ));
                }
            }
            for (t, l) in &g.leases {
                let f = first.leases.get(t).ok_or_else(|| format!("group {i} holds {t}, group 0 not"))?;
                if (f.expires_at, f.tokens, f.blocks.len()) != (l.expires_at, l.tokens, l.blocks.len()) {
                    return Err(format!("{t}: group {i}'s lease differs from group 0's"));
                }
            }
        }
        if self.states.len() != first.seqs.len() || self.lease_states.len() != first.leases.len() {
            return Err("a sequence or lease without its state slot".into());
        }
        let mut held = vec![0u32; self.owners.len()];
        let stateless = self.config.state_bytes == 0;
        let mut hold = |s: crate::StateId, owner: StateOwner| -> Result<(), String> {
            if stateless {
                return match s {
                    crate::StateId::NONE => Ok(()),
                    _ => Err(format!("{s:?} held by {owner:?} for a stateless model")),
                };
            }
            held[s.0 as usize] += 1;
            match self.owners[s.0 as usize] {
                Some(o) if o == owner => Ok(()),
                o => Err(format!("{s:?} is held by {owner:?} but records {o:?}")),
            }
        };
        for (&seq, &s) in &self.states {
            if !first.seqs.contains_key(&seq) {
                return Err(format!("{seq} has a state slot but no blocks"));
            }
            hold(s, StateOwner::Sequence(seq))?;
        }
        for (&t, &s) in &self.lease_states {
            if !first.leases.contains_key(&t) {
                return Err(format!("{t} has a state slot but no blocks"));
            }
            hold(s, StateOwner::Lease(t))?;
        }
        for r in self.restore.values() {
            hold(r.state, StateOwner::Restore)?;
        }
        for &s in self.free_states.iter().chain(&self.parked) {
            if self.owners[s.0 as usize].is_some() {
                return Err(format!("{s:?} is on the free list but owned"));
            }
            held[s.0 as usize] += 1;
        }
        if let Some(i) = held.iter().position(|&n| n != 1) {
            return Err(format!("state slot {i} is held {} times (free counts once)", held[i]));
        }
        if !self.stateful_ok() {
            return Err("restore points kept for a stateless model".into());
        }
        Ok(())
    }
}
