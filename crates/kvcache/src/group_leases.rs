//! Leases of a grouped request: it moves between workers as each group's blocks plus its state slot
//! ([`GroupLease`]), the same transfer id in every group.

use crate::groups::{GroupLease, StateOwner};
use crate::{KvError, KvGroups, SeqId, StateId, TransferId};

impl KvGroups {
    fn lease_view(&self, transfer: TransferId) -> Result<GroupLease<'_>, KvError> {
        let state = *self.lease_states.get(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        let groups = self.groups.iter().map(|g| g.lease(transfer)).collect::<Result<_, _>>()?;
        Ok(GroupLease { groups, state, state_epoch: self.epochs.get(state.0 as usize).copied().unwrap_or(0) })
    }

    /// A lease's blocks in every group and its state slot.
    pub fn lease(&self, transfer: TransferId) -> Result<GroupLease<'_>, KvError> {
        self.lease_view(transfer)
    }

    /// Moves `seq`'s computed blocks in every group, and its state, under a lease for `transfer` until
    /// `expires_at`, ending the sequence (a prefill worker keeping a request for its decode peer).
    /// Refused, changing nothing, when a sliding group released part of the prompt.
    pub fn lease_sequence(
        &mut self,
        seq: SeqId,
        transfer: TransferId,
        expires_at: u64,
    ) -> Result<GroupLease<'_>, KvError> {
        let state = self.known(seq)?;
        if self.lease_states.contains_key(&transfer) {
            return Err(KvError::DuplicateTransfer { transfer });
        }
        for g in &self.groups {
            if let Some(i) = g.block_table(seq)?.iter().position(|b| b.is_released()) {
                return Err(KvError::Released { seq, block_index: i });
            }
        }
        for g in &mut self.groups {
            g.lease_sequence(seq, transfer, expires_at).expect("checked in every group");
        }
        self.states.remove(&seq);
        if let Some(o) = self.owners.get_mut(state.0 as usize) {
            *o = Some(StateOwner::Lease(transfer));
        }
        self.lease_states.insert(transfer, state);
        self.lease_view(transfer)
    }

    /// A decode worker's destination for a grouped request of `tokens`: in each group the blocks
    /// `tokens` need, the leading ones its prefix cache holds already reused (each group's own
    /// `reused`: a transfer fills `blocks[reused..]` of each), and a state slot the transfer fills.
    /// All or nothing.
    pub fn allocate_lease_reusing(
        &mut self,
        transfer: TransferId,
        tokens: &[u32],
        expires_at: u64,
    ) -> Result<GroupLease<'_>, KvError> {
        if self.lease_states.contains_key(&transfer) {
            return Err(KvError::DuplicateTransfer { transfer });
        }
        let n = tokens.len().div_ceil(self.config.block_tokens as usize);
        if let Some(g) = self.plain_mut() {
            // One group: its own all-or-nothing allocation.
            g.allocate_lease_reusing(transfer, tokens, n, expires_at)?;
            self.lease_states.insert(transfer, StateId::NONE);
            return self.lease_view(transfer);
        }
        for g in &self.groups {
            let reusable = g.tree.longest_match(tokens, (tokens.len() / g.block_size()).min(n));
            // The reused blocks are pinned by the lease: no longer room eviction can make.
            let need = n - reusable.len();
            if !g.can_free(need, &reusable) {
                return Err(KvError::OutOfBlocks { needed_blocks: need, free_blocks: g.blocks_free() });
            }
        }
        let state = self.take_state(StateOwner::Lease(transfer), None)?;
        for g in &mut self.groups {
            g.allocate_lease_reusing(transfer, tokens, n, expires_at).expect("checked: room in every group");
        }
        self.lease_states.insert(transfer, state);
        self.lease_view(transfer)
    }

    /// Moves a lease's expiry in every group.
    pub fn renew_lease(&mut self, transfer: TransferId, expires_at: u64) -> Result<(), KvError> {
        self.lease_view(transfer)?;
        for g in &mut self.groups {
            g.renew_lease(transfer, expires_at)?;
        }
        Ok(())
    }

    /// Ends a lease in every group and frees its state slot.
    pub fn release_lease(&mut self, transfer: TransferId) -> Result<(), KvError> {
        let state = self.lease_states.remove(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        for g in &mut self.groups {
            g.release_lease(transfer)?;
        }
        self.give_state(state);
        Ok(())
    }

    /// Ends every lease whose expiry is at or before `now` (the same in every group).
    pub fn expire_leases(&mut self, now: u64) -> Vec<TransferId> {
        let mut expired: Vec<TransferId> = self
            .lease_states
            .keys()
            .copied()
            .filter(|t| self.groups[0].lease(*t).is_ok_and(|l| l.expires_at <= now))
            .collect();
        expired.sort();
        for g in &mut self.groups {
            g.expire_leases(now);
        }
        for t in &expired {
            let state = self.lease_states.remove(t).expect("listed");
            self.give_state(state);
        }
        expired
    }

    /// Turns a filled destination lease into sequence `seq` whose KV covers `tokens` in every group,
    /// its state slot the sequence's.
    pub fn adopt_lease(&mut self, transfer: TransferId, seq: SeqId, tokens: &[u32]) -> Result<(), KvError> {
        let state = *self.lease_states.get(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        if self.states.contains_key(&seq) {
            return Err(KvError::DuplicateSequence { seq });
        }
        let needed = tokens.len().div_ceil(self.config.block_tokens as usize);
        for g in &self.groups {
            let blocks = g.lease(transfer)?.blocks.len();
            if blocks < needed {
                return Err(KvError::LeaseTooSmall { transfer, blocks, needed_blocks: needed });
            }
        }
        for g in &mut self.groups {
            g.adopt_lease(transfer, seq, tokens).expect("checked in every group");
        }
        self.lease_states.remove(&transfer);
        if let Some(o) = self.owners.get_mut(state.0 as usize) {
            *o = Some(StateOwner::Sequence(seq));
        }
        self.states.insert(seq, state);
        Ok(())
    }
}
