//! KV groups: a model whose layers keep different things per token (full attention, a sliding
//! window, rows compressed every `ratio` tokens, an indexer's keys) holds one block pool per kind of
//! layer, each with its own geometry, plus a fixed-size state per request outside any block (a
//! window's ring, compressors' partial groups, draft layers' state).
//!
//! Every group's blocks cover the same `block_tokens` tokens, so the groups' block boundaries agree
//! and one prefix of the prompt is cached, leased, adopted or freed in all of them together; a
//! compressed group's block holds `block_tokens / ratio` rows. A prefix hit resumes a stateful model
//! only where a *restore point* (the request's state saved at that block boundary) is kept: the hit is
//! the longest prefix every group holds *and* a restore point covers. Single-group models (Llama,
//! Qwen, Mistral, DeepSeek V3's latent cache) are the case of one group and no state.
//!
//! Like [`KvCache`], sans-IO and ids only: the backend owns the bytes, indexed by `(group, block)` and
//! by [`StateId`], and performs the [`StateCopy`]s it is handed before the next step.

use crate::cache::KvCache;
use crate::{BlockId, IdMap, KvConfig, KvError, KvStats, LeaseView, NodeId, SeqId, Slot, TransferId};

impl KvCache {
    /// Blocks eviction could free now or after evicting others: cached blocks nobody references with
    /// no referenced block below them in the prefix tree (a cached block whose descendant a sequence
    /// holds stays until that one goes), `pinned` nodes counted as referenced. `blocks_available`
    /// counts every cache-owned block; this is exact, and walks the tree: call it only when the free
    /// list falls short.
    pub(crate) fn evictable_blocks(&self, pinned: &[NodeId]) -> usize {
        let mut blocked = vec![false; self.tree.nodes.len()];
        let held = self
            .tree
            .live_nodes()
            .filter(|(_, node)| self.blocks[node.block.0 as usize].owner() != Some(crate::OwnerKind::Cache));
        for n in held.map(|(n, _)| n).chain(pinned.iter().copied()) {
            // Referenced: it and every ancestor stay.
            let mut at = n;
            while at != crate::prefix::ROOT && !blocked[at.0 as usize] {
                blocked[at.0 as usize] = true;
                at = self.tree.node(at).parent;
            }
        }
        self.tree
            .live_nodes()
            .filter(|(n, node)| {
                !blocked[n.0 as usize]
                    && self.blocks[node.block.0 as usize].owner() == Some(crate::OwnerKind::Cache)
            })
            .count()
    }

    /// Whether `need` blocks can be made free (the free list, then exact eviction), the blocks of
    /// `pinned` (and so their ancestors) kept.
    pub(crate) fn can_free(&self, need: usize, pinned: &[NodeId]) -> bool {
        need <= self.free.len() || need <= self.free.len() + self.evictable_blocks(pinned)
    }
}

/// What a group's layers keep per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// A row per token, every one attended to.
    Full,
    /// A row per token; a query sees the last `window` positions, so blocks wholly before them go
    /// back to the pool ([`KvGroups::release_outside_windows`]).
    Sliding { window: u32 },
    /// A row per `ratio` tokens, made once all of them are seen (DeepSeek V4's compressed sparse
    /// layers and their indexer's keys at 4, its heavily compressed layers at 128).
    Compressed { ratio: u32 },
}

impl LayerKind {
    /// Tokens per row.
    pub fn ratio(self) -> u32 {
        match self {
            LayerKind::Compressed { ratio } => ratio,
            _ => 1,
        }
    }
}

/// One group: the layers of one kind, their row size and their pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// For metrics and `/v1/models` ("window", "c4", "c4-index", "c128", ...).
    pub name: String,
    pub kind: LayerKind,
    /// Layers in the group.
    pub layers: u32,
    /// Bytes of one layer's row.
    pub row_bytes: u32,
    /// Blocks in the group's pool.
    pub num_blocks: u32,
}

impl GroupSpec {
    /// KV bytes a token adds to the group (all its layers), averaged over a compressed row's tokens.
    pub fn bytes_per_token(&self) -> f64 {
        f64::from(self.layers) * f64::from(self.row_bytes) / f64::from(self.kind.ratio())
    }
}

/// The groups, their shared block length, and the per-request state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupsConfig {
    /// Tokens a block covers in every group: a multiple of every ratio, so no compressed row
    /// straddles a block boundary.
    pub block_tokens: u32,
    pub groups: Vec<GroupSpec>,
    /// Bytes of one request's state outside the blocks; 0 for a stateless model (no restore points
    /// are needed then, and none are kept).
    pub state_bytes: u32,
    /// State slots: one per live request (sequence or lease) plus the restore points kept. A
    /// stateless model takes none (any number, 0 included, is accepted and unused).
    pub state_slots: u32,
    /// Positions a stateful model's state can go back: a state that keeps its last positions'
    /// effects apart (rings indexed by position, as DeepSeek V4's window and compressor buffers can
    /// be) lets a request be cut back this far below what it computed (rejected draft tokens);
    /// further is [`KvError::StateRewind`]. 0: never.
    pub state_rewind_tokens: u32,
}

/// A request's state slot (the backend's memory of `state_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateId(pub u32);

impl StateId {
    /// A stateless model's requests' "slot": none is taken ([`GroupsConfig::state_bytes`] 0).
    pub const NONE: StateId = StateId(u32::MAX);
}

/// A state copy the backend performs before the next step (a restore, a saved restore point, a fork).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateCopy {
    pub from: StateId,
    pub to: StateId,
}

/// What [`KvGroups::add_sequence`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupHit {
    /// Leading prompt tokens every group holds and the state resumes from; compute from here.
    pub cached_tokens: usize,
    /// The sequence's state slot.
    pub state: StateId,
    /// The restore point to copy into `state` first (`None`: a fresh state, zeroed by the backend).
    pub restore: Option<StateCopy>,
}

/// A grouped request under a transfer lease: each group's blocks, and its state slot.
#[derive(Debug, Clone)]
pub struct GroupLease<'a> {
    pub groups: Vec<LeaseView<'a>>,
    pub state: StateId,
    /// The state slot's epoch when the lease took it: a transfer's write of the state carries it
    /// ([`KvGroups::check_state_write`]).
    pub state_epoch: u32,
}

/// Who holds a state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateOwner {
    Sequence(SeqId),
    Lease(TransferId),
    Restore,
}

/// A restore point: the state at the end of cached node `node` of group 0's prefix tree, valid while
/// that node still holds `block` at `epoch` (a node id or block reused for another prefix is told
/// apart by the block's epoch, bumped whenever it leaves the free list).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RestorePoint {
    pub(crate) block: BlockId,
    pub(crate) epoch: u32,
    pub(crate) state: StateId,
    pub(crate) last_used: u64,
}

/// Counts for metrics. Slots add up: `free + parked + sequences + leases + restore_points == slots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateStats {
    pub slots: usize,
    pub free: usize,
    /// Given back while a copy not yet made touches them (free once it is).
    pub parked: usize,
    pub restore_points: usize,
    pub restore_hits_total: u64,
    pub restore_points_evicted_total: u64,
}

/// Paged KV bookkeeping over several block pools (one per kind of layer) and per-request state
/// slots, kept in step: the same sequences, tokens and leases in every group.
#[derive(Debug)]
pub struct KvGroups {
    pub(crate) config: GroupsConfig,
    pub(crate) groups: Vec<KvCache>,
    pub(crate) owners: Vec<Option<StateOwner>>,
    /// Each slot's epoch, moved on each time it is taken (a late write for an earlier owner is seen).
    pub(crate) epochs: Vec<u32>,
    pub(crate) free_states: Vec<StateId>,
    /// Slots given back while a copy not yet made touches them: free once it is
    /// ([`copies_done`](Self::copies_done)).
    pub(crate) parked: Vec<StateId>,
    /// State copies handed out and not yet taken by [`take_state_copies`](Self::take_state_copies),
    /// each marked when it is a restore (counted as a hit when taken).
    pending: Vec<(StateCopy, bool)>,
    /// Copies taken and not yet reported made ([`copies_done`](Self::copies_done) or
    /// [`copies_failed`](Self::copies_failed)).
    in_flight: Vec<StateCopy>,
    pub(crate) states: IdMap<SeqId, StateId>,
    pub(crate) lease_states: IdMap<TransferId, StateId>,
    pub(crate) restore: IdMap<NodeId, RestorePoint>,
    clock: u64,
    stats: StateStats,
}

impl KvGroups {
    /// Every group's pool and every state slot, allocated now.
    pub fn new(config: GroupsConfig) -> Result<KvGroups, KvError> {
        let bt = config.block_tokens;
        let invalid = |num_blocks| Err(KvError::InvalidConfig { num_blocks, block_size: bt });
        let no_slots = config.state_bytes > 0 && config.state_slots == 0;
        if config.groups.is_empty() || no_slots || config.state_slots == u32::MAX {
            return invalid(0);
        }
        let mut groups = Vec::with_capacity(config.groups.len());
        for g in &config.groups {
            let ratio = g.kind.ratio();
            if ratio == 0 || !bt.is_multiple_of(ratio) || g.layers == 0 {
                return invalid(g.num_blocks);
            }
            groups.push(KvCache::new(KvConfig { num_blocks: g.num_blocks, block_size: bt })?);
        }
        let n = config.state_slots;
        Ok(KvGroups {
            groups,
            owners: vec![None; n as usize],
            epochs: vec![0; n as usize],
            free_states: (0..n).rev().map(StateId).collect(),
            parked: Vec::new(),
            pending: Vec::new(),
            in_flight: Vec::new(),
            states: IdMap::default(),
            lease_states: IdMap::default(),
            restore: IdMap::default(),
            clock: 0,
            stats: StateStats { slots: n as usize, ..StateStats::default() },
            config,
        })
    }

    pub fn config(&self) -> &GroupsConfig {
        &self.config
    }

    /// Group `g`'s own cache (its stats, block tables, leases).
    pub fn group(&self, g: usize) -> &KvCache {
        &self.groups[g]
    }

    pub fn group_stats(&self) -> Vec<KvStats> {
        self.groups.iter().map(KvCache::stats).collect()
    }

    pub fn state_stats(&self) -> StateStats {
        StateStats {
            free: self.free_states.len(),
            parked: self.parked.len(),
            restore_points: self.restore.len(),
            ..self.stats
        }
    }

    /// KV bytes a token adds, over every group (the fixed per-request state is `state_bytes`).
    pub fn bytes_per_token(&self) -> f64 {
        self.config.groups.iter().map(GroupSpec::bytes_per_token).sum()
    }

    fn stateful(&self) -> bool {
        self.config.state_bytes > 0
    }

    /// A stateless model keeps no restore points.
    pub(crate) fn stateful_ok(&self) -> bool {
        self.stateful() || self.restore.is_empty()
    }

    /// Takes a free state slot for `owner`, evicting the least recently used restore point if none is
    /// free.
    pub(crate) fn take_state(&mut self, owner: StateOwner, keep: Option<NodeId>) -> Result<StateId, KvError> {
        if !self.stateful() {
            return Ok(StateId::NONE);
        }
        if self.free_states.is_empty() {
            self.evict_points(1, keep);
        }
        let s = self.free_states.pop().ok_or(KvError::OutOfStates { slots: self.owners.len() })?;
        self.owners[s.0 as usize] = Some(owner);
        self.epochs[s.0 as usize] = self.epochs[s.0 as usize].wrapping_add(1);
        Ok(s)
    }

    pub(crate) fn give_state(&mut self, s: StateId) {
        if s == StateId::NONE {
            return;
        }
        self.owners[s.0 as usize] = None;
        // A copy not taken yet into the slot is moot now (a request refused admission right after
        // its restore was handed out, say); one out of it, or one taken, still keeps it.
        self.pending.retain(|(c, _)| c.to != s);
        if self.touched(s) {
            self.parked.push(s);
        } else {
            self.free_states.push(s);
        }
    }

    /// Whether a copy not yet made reads or writes slot `s`.
    fn touched(&self, s: StateId) -> bool {
        let hits = |c: &StateCopy| c.from == s || c.to == s;
        self.pending.iter().any(|(c, _)| hits(c)) || self.in_flight.iter().any(hits)
    }

    /// Hands out a copy (queued for [`take_state_copies`](Self::take_state_copies)); its slots are
    /// kept until it is made.
    fn hand_out(&mut self, c: StateCopy, restore: bool) -> StateCopy {
        self.pending.push((c, restore));
        c
    }

    /// The state copies handed out since the last call (restores, saved restore points, forks), in
    /// order: the backend performs them before the next step, then calls
    /// [`copies_done`](Self::copies_done) (or [`copies_failed`](Self::copies_failed)). (Each is also
    /// returned where it is made.)
    pub fn take_state_copies(&mut self) -> Vec<StateCopy> {
        let taken: Vec<StateCopy> = self
            .pending
            .drain(..)
            .map(|(c, restore)| {
                self.stats.restore_hits_total += u64::from(restore);
                c
            })
            .collect();
        self.in_flight.extend(&taken);
        taken
    }

    /// Drops up to `n` restore points, least recently used first; returns how many.
    pub fn evict_restore_points(&mut self, n: usize) -> usize {
        self.evict_points(n, None)
    }

    /// [`evict_restore_points`](Self::evict_restore_points) but the one at `keep`.
    fn evict_points(&mut self, n: usize, keep: Option<NodeId>) -> usize {
        // Stale points (their node's block since reused) first, then the least recently used; never
        // one a handed-out copy still reads or writes.
        let mut by_age: Vec<(bool, u64, NodeId)> = self
            .restore
            .iter()
            .filter(|(&k, r)| Some(k) != keep && !self.touched(r.state))
            .map(|(&k, r)| (self.anchor_valid(k, r), r.last_used, k))
            .collect();
        by_age.sort_unstable();
        let mut dropped = 0;
        for (_, _, node) in by_age.into_iter().take(n) {
            if let Some(r) = self.restore.remove(&node) {
                self.give_state(r.state);
                self.stats.restore_points_evicted_total += 1;
                dropped += 1;
            }
        }
        dropped
    }

    /// Whether restore point `r` at `node` still ends the prefix it was saved for.
    fn anchor_valid(&self, node: NodeId, r: &RestorePoint) -> bool {
        let g = &self.groups[0];
        g.tree.nodes.get(node.0 as usize).is_some_and(|n| n.live && n.block == r.block)
            && g.blocks[r.block.0 as usize].epoch == r.epoch
    }

    /// Says the backend has made every [`StateCopy`] taken so far
    /// ([`take_state_copies`](Self::take_state_copies)): the slots they read or wrote may be evicted
    /// or reused again (those of copies handed out and not taken yet stay kept).
    pub fn copies_done(&mut self) {
        self.in_flight.clear();
        let parked = std::mem::take(&mut self.parked);
        for s in parked {
            if self.touched(s) {
                self.parked.push(s);
            } else {
                self.free_states.push(s);
            }
        }
    }

    /// Says the copies taken so far may not have been made (the step that was to make them failed):
    /// the restore points they were to fill are dropped, then as [`copies_done`](Self::copies_done).
    pub fn copies_failed(&mut self) {
        let targets: Vec<StateId> = self.in_flight.iter().map(|c| c.to).collect();
        let unfilled: Vec<NodeId> =
            self.restore.iter().filter(|(_, r)| targets.contains(&r.state)).map(|(&n, _)| n).collect();
        self.in_flight.clear();
        for node in unfilled {
            if let Some(r) = self.restore.remove(&node) {
                self.give_state(r.state);
            }
        }
        self.copies_done();
    }

    /// Checks that a transfer's write of its lease's state at `epoch` still targets the slot the lease
    /// took: a late write for an ended lease, or into a slot since taken by another, is refused.
    pub fn check_state_write(&self, transfer: TransferId, state: StateId, epoch: u32) -> Result<(), KvError> {
        let held = self.lease_states.get(&transfer) == Some(&state);
        if held && self.epochs.get(state.0 as usize) == Some(&epoch) {
            Ok(())
        } else {
            Err(KvError::StaleStateWrite { transfer, state: state.0, epoch })
        }
    }

    /// Group 0's cached path for `tokens`' first `blocks` blocks, each node with its block and epoch.
    fn anchor_path(&self, tokens: &[u32], blocks: usize) -> Vec<(NodeId, BlockId, u32)> {
        let g = &self.groups[0];
        let path = g.tree.longest_match(tokens, blocks);
        path.into_iter()
            .map(|n| {
                let b = g.tree.node(n).block;
                (n, b, g.blocks[b.0 as usize].epoch)
            })
            .collect()
    }

    /// The restore point at the end of `node` if it still belongs to that node's prefix.
    fn restore_at(&self, (node, block, epoch): (NodeId, BlockId, u32)) -> Option<RestorePoint> {
        self.restore.get(&node).copied().filter(|r| r.block == block && r.epoch == epoch)
    }

    /// Leading cached tokens of `tokens` a new sequence would reuse: the longest block prefix every
    /// group holds, cut back (stateful models) to the last block boundary with a restore point. At
    /// least one token is always left to compute.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> usize {
        if let Some(g) = self.plain() {
            // Its offload tier's blocks count too.
            return g.lookup_prefix(tokens);
        }
        self.hit_blocks(tokens).0 * self.config.block_tokens as usize
    }

    /// Leading tokens of `tokens` every group holds in whole cached blocks, restore point or not (at
    /// least one token is left): where a stateful model's request could save a restore point that
    /// later prompts sharing the prefix resume from.
    pub fn cached_block_tokens(&self, tokens: &[u32]) -> usize {
        let bt = self.config.block_tokens as usize;
        let full = tokens.len().saturating_sub(1) / bt;
        let common = self.groups.iter().map(|g| g.tree.longest_match(tokens, full).len()).min().unwrap_or(0);
        common * bt
    }

    fn hit_blocks(&self, tokens: &[u32]) -> (usize, Option<(NodeId, RestorePoint)>) {
        let bt = self.config.block_tokens as usize;
        let full = tokens.len().saturating_sub(1) / bt;
        let common = self.groups.iter().map(|g| g.tree.longest_match(tokens, full).len()).min().unwrap_or(0);
        if !self.stateful() {
            return (common, None);
        }
        let path = self.anchor_path(tokens, common);
        match (0..path.len()).rev().find_map(|i| self.restore_at(path[i]).map(|r| (i + 1, path[i].0, r))) {
            Some((k, node, r)) => (k, Some((node, r))),
            None => (0, None),
        }
    }

    /// Registers `seq` with its prompt in every group, reusing the prefix [`lookup_prefix`]
    /// (Self::lookup_prefix) finds, and gives it a state slot (restored from the restore point there,
    /// or fresh). All or nothing.
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<GroupHit, KvError> {
        if self.states.contains_key(&seq) {
            return Err(KvError::DuplicateSequence { seq });
        }
        if let Some(g) = self.plain_mut() {
            // As the plain cache adds it (its offload tier's blocks copied back).
            let hit = g.add_sequence(seq, prompt)?;
            self.states.insert(seq, StateId::NONE);
            return Ok(GroupHit { cached_tokens: hit.cached_tokens, state: StateId::NONE, restore: None });
        }
        let (blocks, point) = self.hit_blocks(prompt);
        // (The restore point the copy below reads is not evicted to make room for the slot.)
        let state = self.take_state(StateOwner::Sequence(seq), point.map(|(n, _)| n))?;
        for g in &mut self.groups {
            let hit = g.add_sequence_within(seq, prompt, blocks).expect("checked: a new sequence");
            debug_assert_eq!(hit.cached_blocks, blocks);
        }
        self.states.insert(seq, state);
        self.clock += 1;
        let mut restore = None;
        if let Some((node, r)) = point {
            restore = Some(self.hand_out(StateCopy { from: r.state, to: state }, true));
            if let Some(p) = self.restore.get_mut(&node) {
                p.last_used = self.clock;
            }
        }
        Ok(GroupHit { cached_tokens: blocks * self.config.block_tokens as usize, state, restore })
    }

    pub(crate) fn known(&self, seq: SeqId) -> Result<StateId, KvError> {
        self.states.get(&seq).copied().ok_or(KvError::UnknownSequence { seq })
    }

    /// The sequence's state slot.
    pub fn state(&self, seq: SeqId) -> Result<StateId, KvError> {
        self.known(seq)
    }

    /// Appends known (sampled) tokens to `seq` in every group.
    pub fn append_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), KvError> {
        self.known(seq)?;
        for g in &mut self.groups {
            g.append_tokens(seq, tokens)?;
        }
        Ok(())
    }

    /// Makes room in every group for the next `n` tokens' KV. All or nothing: on `OutOfBlocks` no
    /// group changed.
    pub fn reserve(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        self.known(seq)?;
        if let Some(g) = self.plain_mut() {
            // One group: its own all-or-nothing reserve (no walk of the tree to count room first).
            return g.reserve(seq, n);
        }
        for g in &self.groups {
            let need = g.reserve_need(seq, n)?;
            if !g.can_free(need, &[]) {
                return Err(KvError::OutOfBlocks { needed_blocks: need, free_blocks: g.blocks_free() });
            }
        }
        for g in &mut self.groups {
            g.reserve(seq, n).expect("checked: room in every group");
        }
        Ok(())
    }

    /// Copy-on-write block copies of every group since the last call: `(group, copy)`.
    pub fn take_copies(&mut self) -> Vec<(usize, crate::BlockCopy)> {
        let mut out = Vec::new();
        for (i, g) in self.groups.iter_mut().enumerate() {
            out.extend(g.take_copies().into_iter().map(|c| (i, c)));
        }
        out
    }

    /// Records that the next `n` tokens' KV (and the state past them) is written in every group.
    pub fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        self.known(seq)?;
        for g in &self.groups {
            g.commit_check(seq, n)?;
        }
        for g in &mut self.groups {
            g.commit(seq, n).expect("checked in every group");
        }
        Ok(())
    }

    pub fn computed_tokens(&self, seq: SeqId) -> Result<usize, KvError> {
        self.groups[0].computed_tokens(seq)
    }

    pub fn tokens(&self, seq: SeqId) -> Result<&[u32], KvError> {
        self.groups[0].tokens(seq)
    }

    pub fn block_table(&self, seq: SeqId, group: usize) -> Result<&[BlockId], KvError> {
        self.groups[group].block_table(seq)
    }

    /// Where rows `rows` of `seq` live in `group` (a compressed group's row `w` covers tokens
    /// `w * ratio ..`; its block holds `block_tokens / ratio` rows).
    pub fn row_slots(
        &self,
        seq: SeqId,
        group: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<Slot>, KvError> {
        let ratio = self.config.groups[group].kind.ratio() as usize;
        if ratio == 1 {
            return self.groups[group].slot_mapping(seq, rows);
        }
        let per_block = self.config.block_tokens as usize / ratio;
        let table = self.groups[group].block_table(seq)?;
        if rows.end > table.len() * per_block {
            return Err(KvError::OutOfRange {
                seq,
                requested: rows.end * ratio,
                limit: table.len() * per_block * ratio,
            });
        }
        Ok(rows.map(|w| Slot { block: table[w / per_block], offset: (w % per_block) as u32 }).collect())
    }

    /// Saves `seq`'s state as the restore point at the last block boundary at or below its computed
    /// length, at most [`GroupsConfig::state_rewind_tokens`] below it (a state goes back that far:
    /// it holds the boundary's state too): every group's full blocks are cached first (the point is
    /// kept while group 0 caches the block it ends, and stays cached when no slot is free for the
    /// point: `KvError::OutOfStates`). Returns the copy the backend makes (`None`: no boundary in
    /// reach, one is kept there already, or the model is stateless).
    pub fn save_restore_point(&mut self, seq: SeqId) -> Result<Option<StateCopy>, KvError> {
        let state = self.known(seq)?;
        let (computed, bt) = (self.computed_tokens(seq)?, self.config.block_tokens as usize);
        let boundary = computed - computed % bt;
        let reach = self.config.state_rewind_tokens as usize;
        if !self.stateful() || boundary == 0 || computed - boundary > reach {
            return Ok(None);
        }
        for g in &mut self.groups {
            g.cache_prefix(seq)?;
        }
        let tokens = self.tokens(seq)?[..boundary].to_vec();
        let path = self.anchor_path(&tokens, boundary / bt);
        let Some(&end) = path.last().filter(|_| path.len() == boundary / bt) else { return Ok(None) };
        if self.restore_at(end).is_some() {
            return Ok(None);
        }
        // A stale point on the node (its block since reused) makes room for this one.
        if let Some(old) = self.restore.remove(&end.0) {
            self.give_state(old.state);
        }
        let to = self.take_state(StateOwner::Restore, Some(end.0))?;
        self.clock += 1;
        self.restore
            .insert(end.0, RestorePoint { block: end.1, epoch: end.2, state: to, last_used: self.clock });
        Ok(Some(self.hand_out(StateCopy { from: state, to }, false)))
    }

    /// Inserts `seq`'s full computed blocks into every group's prefix cache.
    pub fn cache_prefix(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.known(seq)?;
        for g in &mut self.groups {
            g.cache_prefix(seq)?;
        }
        Ok(())
    }

    /// Gives back, in each sliding group, the blocks no later query of `seq` attends to. Returns how
    /// many were released over all groups.
    pub fn release_outside_windows(&mut self, seq: SeqId) -> Result<usize, KvError> {
        self.known(seq)?;
        let mut released = 0;
        for (g, spec) in self.groups.iter_mut().zip(&self.config.groups) {
            if let LayerKind::Sliding { window } = spec.kind {
                released += g.release_outside_window(seq, window as usize)?;
            }
        }
        Ok(released)
    }

    /// Ends `seq` in every group (caching its full blocks first with `cache`) and frees its state.
    pub fn free_sequence(&mut self, seq: SeqId, cache: bool) -> Result<(), KvError> {
        let state = self.known(seq)?;
        for g in &mut self.groups {
            g.free_sequence(seq, cache)?;
        }
        self.states.remove(&seq);
        self.give_state(state);
        Ok(())
    }

    /// Starts `child` sharing `parent`'s blocks in every group, with a copy of its state.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<StateCopy, KvError> {
        let from = self.known(parent)?;
        if self.states.contains_key(&child) {
            return Err(KvError::DuplicateSequence { seq: child });
        }
        let to = self.take_state(StateOwner::Sequence(child), None)?;
        for g in &mut self.groups {
            g.fork(parent, child).expect("checked: a known parent and a new child");
        }
        self.states.insert(child, to);
        if to == StateId::NONE {
            return Ok(StateCopy { from, to });
        }
        Ok(self.hand_out(StateCopy { from, to }, false))
    }

    /// Cuts `seq` back to `n` tokens. A stateful model's state goes back at most
    /// [`GroupsConfig::state_rewind_tokens`] below the computed length; further is refused
    /// ([`KvError::StateRewind`]).
    pub fn truncate(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        self.known(seq)?;
        let rewind = self.config.state_rewind_tokens as usize;
        if self.stateful() && n + rewind < self.computed_tokens(seq)? {
            return Err(KvError::StateRewind { seq, computed: self.computed_tokens(seq)?, requested: n });
        }
        for g in &self.groups {
            g.truncate_check(seq, n)?;
        }
        for g in &mut self.groups {
            g.truncate(seq, n).expect("checked in every group");
        }
        Ok(())
    }

    /// Drops up to `n` evictable cached blocks from each group.
    pub fn evict(&mut self, n: usize) -> usize {
        self.groups.iter_mut().map(|g| g.evict(n)).sum()
    }
}
