//! Transfer leases: a prefill worker's KV kept for its decode peer, a decode worker's destination
//! blocks, each with an expiry the lease scan enforces.

use crate::cache::{KvCache, Lease, LeaseView, Sequence};
use crate::{BlockId, KvError, SeqId, TransferId};

impl KvCache {
    /// Moves `seq`'s computed blocks under a lease held by `transfer` until `expires_at`, and ends the
    /// sequence (a prefill worker keeping KV for its decode peer). Reserved, unwritten blocks are freed.
    pub fn lease_sequence(
        &mut self,
        seq: SeqId,
        transfer: TransferId,
        expires_at: u64,
    ) -> Result<LeaseView<'_>, KvError> {
        if self.leases.contains_key(&transfer) {
            return Err(KvError::DuplicateTransfer { transfer });
        }
        let s = self.seq(seq)?;
        if let Some(i) = s.blocks.iter().position(|b| b.is_released()) {
            // A lease hands over the whole prompt's KV.
            return Err(KvError::Released { seq, block_index: i });
        }
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSequence { seq })?;
        let keep = self.blocks_for(s.computed);
        let mut lease = Lease {
            blocks: Vec::with_capacity(keep),
            epochs: Vec::new(),
            expires_at,
            tokens: s.computed,
            reused: 0,
        };
        for (i, b) in s.blocks.into_iter().enumerate() {
            if i < keep {
                self.retag(b, |m| {
                    m.seq_refs -= 1;
                    m.lease_refs += 1;
                });
                lease.epochs.push(self.blocks[b.0 as usize].epoch);
                lease.blocks.push(b);
            } else {
                self.retag(b, |m| m.seq_refs -= 1);
            }
        }
        self.leases.insert(transfer, lease);
        self.lease(transfer)
    }

    /// Allocates `n` fresh blocks under a lease for `transfer` (a decode worker receiving KV). All or
    /// nothing.
    pub fn allocate_lease(
        &mut self,
        transfer: TransferId,
        n: usize,
        expires_at: u64,
    ) -> Result<LeaseView<'_>, KvError> {
        self.allocate_lease_reusing(transfer, &[], n, expires_at)
    }

    /// A destination lease of `n` blocks for the KV of `tokens` (a decode worker receiving a prompt's
    /// KV) whose leading blocks are taken from the prefix cache where it holds `tokens`' full blocks
    /// already: only `blocks[reused..]` are fresh and need the transfer. The reused blocks are
    /// referenced at once, so they cannot be evicted before the lease ends or is adopted. All or
    /// nothing.
    pub fn allocate_lease_reusing(
        &mut self,
        transfer: TransferId,
        tokens: &[u32],
        n: usize,
        expires_at: u64,
    ) -> Result<LeaseView<'_>, KvError> {
        if self.leases.contains_key(&transfer) {
            return Err(KvError::DuplicateTransfer { transfer });
        }
        let path = self.tree.longest_match(tokens, (tokens.len() / self.block_size()).min(n));
        let reused: Vec<BlockId> = path.iter().map(|&nd| self.tree.node(nd).block).collect();
        // Referenced before making room, so making room cannot evict them.
        for &b in &reused {
            self.retag(b, |m| m.lease_refs += 1);
        }
        if let Err(e) = self.ensure_free(n - reused.len()) {
            for &b in &reused {
                self.retag(b, |m| m.lease_refs -= 1);
            }
            return Err(e);
        }
        let mut lease = Lease {
            epochs: reused.iter().map(|b| self.blocks[b.0 as usize].epoch).collect(),
            reused: reused.len(),
            blocks: reused,
            expires_at,
            tokens: 0,
        };
        self.stats.lease_reused_blocks_total += lease.reused as u64;
        for _ in lease.reused..n {
            let b = self.alloc_for_lease();
            lease.epochs.push(self.blocks[b.0 as usize].epoch);
            lease.blocks.push(b);
        }
        self.leases.insert(transfer, lease);
        self.lease(transfer)
    }

    pub fn lease(&self, transfer: TransferId) -> Result<LeaseView<'_>, KvError> {
        let l = self.leases.get(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        Ok(LeaseView {
            blocks: &l.blocks,
            epochs: &l.epochs,
            expires_at: l.expires_at,
            tokens: l.tokens,
            reused: l.reused,
        })
    }

    /// Moves a lease's expiry.
    pub fn renew_lease(&mut self, transfer: TransferId, expires_at: u64) -> Result<(), KvError> {
        self.leases.get_mut(&transfer).ok_or(KvError::UnknownTransfer { transfer })?.expires_at = expires_at;
        Ok(())
    }

    /// Checks that a write for `transfer` into `block` at `epoch` still targets the block the lease took;
    /// a late message for an ended transfer, or for a block since freed and reused, is refused.
    pub fn check_write(&self, transfer: TransferId, block: BlockId, epoch: u32) -> Result<(), KvError> {
        let stale = KvError::StaleWrite { transfer, block, epoch };
        let lease = self.leases.get(&transfer).ok_or(stale.clone())?;
        // Blocks reused from the prefix cache hold KV already: never a destination.
        let mut fresh = lease.blocks.iter().zip(&lease.epochs).skip(lease.reused);
        let held = fresh.any(|(&b, &e)| b == block && e == epoch);
        let current = self.blocks.get(block.0 as usize).is_some_and(|m| m.epoch == epoch);
        if held && current {
            Ok(())
        } else {
            Err(stale)
        }
    }

    /// The current epoch of `block`.
    pub fn block_epoch(&self, block: BlockId) -> Option<u32> {
        self.blocks.get(block.0 as usize).map(|m| m.epoch)
    }

    /// Ends a lease (transfer done or aborted). Blocks nobody else holds are freed.
    pub fn release_lease(&mut self, transfer: TransferId) -> Result<(), KvError> {
        let lease = self.leases.remove(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        for b in lease.blocks {
            self.retag(b, |m| m.lease_refs -= 1);
        }
        Ok(())
    }

    /// The lease scan: ends every lease whose expiry is at or before `now` and returns their ids, so a
    /// prefill worker whose decode peer vanished gets its blocks back.
    pub fn expire_leases(&mut self, now: u64) -> Vec<TransferId> {
        let mut expired: Vec<TransferId> =
            self.leases.iter().filter(|(_, l)| l.expires_at <= now).map(|(&t, _)| t).collect();
        expired.sort();
        for &t in &expired {
            let blocks = self.leases.get(&t).map_or(0, |l| l.blocks.len());
            self.stats.leases_expired_total += 1;
            self.stats.leased_blocks_expired_total += blocks as u64;
            let _ = self.release_lease(t);
        }
        expired
    }

    /// Turns a filled destination lease into sequence `seq` whose KV covers `tokens` (a decode worker
    /// starting a request whose prompt KV arrived). Blocks beyond what `tokens` needs are freed.
    pub fn adopt_lease(&mut self, transfer: TransferId, seq: SeqId, tokens: &[u32]) -> Result<(), KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence { seq });
        }
        let needed = self.blocks_for(tokens.len());
        let lease = self.leases.get(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        if lease.blocks.len() < needed {
            return Err(KvError::LeaseTooSmall {
                transfer,
                blocks: lease.blocks.len(),
                needed_blocks: needed,
            });
        }
        let lease = self.leases.remove(&transfer).ok_or(KvError::UnknownTransfer { transfer })?;
        let mut blocks = Vec::with_capacity(needed);
        for (i, b) in lease.blocks.into_iter().enumerate() {
            if i < needed {
                self.retag(b, |m| {
                    m.lease_refs -= 1;
                    m.seq_refs += 1;
                });
                blocks.push(b);
            } else {
                self.retag(b, |m| m.lease_refs -= 1);
            }
        }
        self.seqs.insert(
            seq,
            Sequence { blocks, tokens: tokens.to_vec(), computed: tokens.len(), release_from: 0 },
        );
        Ok(())
    }
}
