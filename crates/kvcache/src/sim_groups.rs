//! An operation-sequence driver for [`KvGroups`] (tests and fuzzing): decodes operations from bytes,
//! applies them, checks every invariant after each, and models what the bytes would hold, so that a
//! prefix hit, a restore point and a transfer are proven to resume exactly: each full block's content
//! is the hash of the tokens up to its end, each state slot's the hash of the tokens its request
//! computed. Not part of the stable API.

use std::collections::HashMap;

use crate::{
    BlockId, GroupSpec, GroupsConfig, KvError, KvGroups, LayerKind, SeqId, StateCopy, StateId, TransferId,
};

/// Tokens per block in [`config`]'s groups.
pub const BLOCK_TOKENS: u32 = 8;

/// Three groups as DeepSeek V4 has them, small: a sliding window of 13 (paged), rows compressed by 4
/// and by 8; `state_bytes` 0 makes the model stateless (no restore points).
pub fn config(blocks: [u32; 3], state_bytes: u32, state_slots: u32) -> GroupsConfig {
    let group = |name: &str, kind, num_blocks| GroupSpec {
        name: name.into(),
        kind,
        layers: 2,
        row_bytes: 64,
        num_blocks,
    };
    GroupsConfig {
        block_tokens: BLOCK_TOKENS,
        groups: vec![
            group("window", LayerKind::Sliding { window: 13 }, blocks[0]),
            group("c4", LayerKind::Compressed { ratio: 4 }, blocks[1]),
            group("c8", LayerKind::Compressed { ratio: 8 }, blocks[2]),
        ],
        state_bytes,
        state_slots,
        state_rewind_tokens: REWIND,
    }
}

/// Positions the modelled state goes back (`GroupsConfig::state_rewind_tokens`).
pub const REWIND: u32 = 3;

/// One operation, with small ids so random input hits existing sequences and leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupOp {
    Add {
        seq: u8,
        family: u8,
        len: u16,
    },
    Step {
        seq: u8,
        n: u8,
    },
    /// Steps to the next block boundary and saves a restore point there.
    Save {
        seq: u8,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    Free {
        seq: u8,
        cache: bool,
    },
    Truncate {
        seq: u8,
        keep: u16,
    },
    Cache {
        seq: u8,
    },
    ReleaseWindows {
        seq: u8,
    },
    Lease {
        seq: u8,
        transfer: u8,
        ttl: u8,
    },
    /// A destination for a `family` prompt, filled at once (the transfer modelled).
    AllocLease {
        transfer: u8,
        family: u8,
        seq: u8,
        len: u16,
        ttl: u8,
    },
    Adopt {
        transfer: u8,
        seq: u8,
    },
    Release {
        transfer: u8,
    },
    Tick {
        by: u8,
    },
    Evict {
        n: u8,
    },
    EvictRestore {
        n: u8,
    },
}

impl GroupOp {
    /// Reads one operation from `bytes`; `None` when they run out.
    pub fn decode(bytes: &mut impl Iterator<Item = u8>) -> Option<GroupOp> {
        let mut next = || bytes.next();
        let small = |b: u8| b % 8;
        Some(match next()? % 15 {
            0 => GroupOp::Add { seq: small(next()?), family: next()? % 4, len: u16::from(next()?) + 1 },
            1 => GroupOp::Step { seq: small(next()?), n: next()? % 40 },
            2 => GroupOp::Save { seq: small(next()?) },
            3 => GroupOp::Fork { parent: small(next()?), child: small(next()?) },
            4 => GroupOp::Free { seq: small(next()?), cache: next()? % 2 == 0 },
            5 => GroupOp::Truncate { seq: small(next()?), keep: u16::from(next()?) },
            6 => GroupOp::Cache { seq: small(next()?) },
            7 => GroupOp::ReleaseWindows { seq: small(next()?) },
            8 => GroupOp::Lease { seq: small(next()?), transfer: small(next()?), ttl: next()? },
            9 => GroupOp::AllocLease {
                transfer: small(next()?),
                family: next()? % 4,
                seq: small(next()?),
                len: u16::from(next()?) + 1,
                ttl: next()?,
            },
            10 => GroupOp::Adopt { transfer: small(next()?), seq: small(next()?) },
            11 => GroupOp::Release { transfer: small(next()?) },
            12 => GroupOp::Tick { by: next()? },
            13 => GroupOp::Evict { n: next()? % 8 },
            _ => GroupOp::EvictRestore { n: next()? % 4 },
        })
    }
}

fn prompt(family: u8, seq: u8, len: u16) -> Vec<u32> {
    // The first 40 tokens are the family's; the rest differ per sequence.
    (0..u32::from(len))
        .map(|i| if i < 40 { u32::from(family) * 1000 + i } else { u32::from(seq) * 100_000 + i })
        .collect()
}

/// What the bytes of a block or state computed from `tokens` hold, in the model.
fn content(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3))
}

/// [`KvGroups`] plus a clock and the modelled contents of blocks and states.
#[derive(Debug)]
pub struct GroupDriver {
    pub kv: KvGroups,
    pub now: u64,
    next_token: u32,
    blocks: HashMap<(usize, BlockId), u64>,
    states: HashMap<StateId, u64>,
    /// Each destination lease's tokens (what its adoption covers) and its state slot and epoch.
    incoming: HashMap<TransferId, (Vec<u32>, StateId, u32)>,
    /// State copies handed out and not performed yet, each with what its source must hold then (a
    /// restore's prefix) and what its destination holds after (a restore point saved past its block
    /// boundary holds the boundary's state: the state goes back that far), in order: the backend
    /// performs them before the next step.
    pending: Vec<(StateCopy, Option<u64>, Option<u64>)>,
    pub restores: u64,
}

impl GroupDriver {
    pub fn new(config: GroupsConfig) -> Result<GroupDriver, KvError> {
        Ok(GroupDriver {
            kv: KvGroups::new(config)?,
            now: 0,
            next_token: 5_000_000,
            blocks: HashMap::new(),
            states: HashMap::new(),
            incoming: HashMap::new(),
            pending: Vec::new(),
            restores: 0,
        })
    }

    /// Applies `op`; refusals the API defines are fine, but every invariant must hold afterwards.
    pub fn apply(&mut self, op: GroupOp) {
        let before: Vec<_> = self.kv.group_stats();
        let result = self.apply_inner(op);
        if let Err(KvError::OutOfBlocks { .. } | KvError::OutOfStates { .. }) = &result {
            for (b, a) in before.iter().zip(self.kv.group_stats()) {
                assert!(
                    a.owned(crate::OwnerKind::Sequence) <= b.owned(crate::OwnerKind::Sequence),
                    "{op:?}: partial"
                );
                assert_eq!(a.sequences, b.sequences, "{op:?}: refused, yet a group changed");
                assert_eq!(a.leases, b.leases, "{op:?}: refused, yet a group changed");
            }
        }
        if let Err(e) = self.kv.check_invariants() {
            panic!("after {op:?} ({result:?}): {e}");
        }
    }

    /// Performs the state copies handed out so far, in order, checking each restore's source still
    /// holds its prefix's state (no pending copy's restore point was evicted and its slot reused).
    fn flush(&mut self) {
        // The cache's own queue of them is the same, in the same order.
        let queued = self.kv.take_state_copies();
        let handed: Vec<StateCopy> =
            self.pending.iter().map(|p| p.0).filter(|c| c.to != StateId::NONE).collect();
        assert_eq!(queued, handed, "the state copies queued are not those handed out");
        for (c, want, holds) in std::mem::take(&mut self.pending) {
            let v = self.states[&c.from];
            if let Some(w) = want {
                assert_eq!(v, w, "a restore point changed before its copy was performed");
            }
            self.states.insert(c.to, holds.unwrap_or(v));
        }
        self.kv.copies_done();
    }

    /// Full blocks of `seq` between `from` and `to` tokens now hold their prefix's content.
    fn fill(&mut self, seq: SeqId, from: usize, to: usize) -> Result<(), KvError> {
        let bt = BLOCK_TOKENS as usize;
        let tokens = self.kv.tokens(seq)?.to_vec();
        for g in 0..self.kv.config().groups.len() {
            let table = self.kv.block_table(seq, g)?;
            for i in from / bt..to / bt {
                if !table[i].is_released() {
                    self.blocks.insert((g, table[i]), content(&tokens[..(i + 1) * bt]));
                }
            }
        }
        Ok(())
    }

    fn step(&mut self, id: SeqId, n: usize) -> Result<(), KvError> {
        self.flush();
        let kv = &mut self.kv;
        let computed = kv.computed_tokens(id)?;
        let missing = (computed + n).saturating_sub(kv.tokens(id)?.len());
        let sampled: Vec<u32> = (0..missing as u32).map(|i| self.next_token + i).collect();
        self.next_token += missing as u32;
        kv.append_tokens(id, &sampled)?;
        kv.reserve(id, n)?;
        for (g, c) in kv.take_copies() {
            let v = self.blocks.get(&(g, c.src)).copied();
            if let Some(v) = v {
                self.blocks.insert((g, c.dst), v);
            }
        }
        kv.commit(id, n)?;
        let state = kv.state(id)?;
        self.states.insert(state, content(&kv.tokens(id)?[..computed + n]));
        self.fill(id, computed, computed + n)
    }

    fn apply_inner(&mut self, op: GroupOp) -> Result<(), KvError> {
        let bt = BLOCK_TOKENS as usize;
        // Copies wait while more requests are admitted, forked or saved (their restore points must
        // survive that); anything else runs after the backend performed them.
        let defer = matches!(
            op,
            GroupOp::Add { .. } | GroupOp::Fork { .. } | GroupOp::EvictRestore { .. } | GroupOp::Tick { .. }
        );
        if !defer {
            self.flush();
        }
        match op {
            GroupOp::Add { seq, family, len } => {
                let (id, p) = (SeqId(seq.into()), prompt(family, seq, len));
                let hit = self.kv.add_sequence(id, &p)?;
                let k = hit.cached_tokens;
                assert!(k < p.len() && k.is_multiple_of(bt));
                for g in 0..self.kv.config().groups.len() {
                    for (i, b) in self.kv.block_table(id, g)?[..k / bt].iter().enumerate() {
                        let want = content(&p[..(i + 1) * bt]);
                        assert_eq!(self.blocks.get(&(g, *b)), Some(&want), "group {g} block {i} of a hit");
                    }
                }
                match hit.restore {
                    Some(c) => {
                        assert_eq!(c.to, hit.state);
                        self.restores += 1;
                        self.pending.push((c, Some(content(&p[..k])), None));
                    }
                    None => {
                        assert!(
                            k == 0 || self.kv.config().state_bytes == 0,
                            "a stateful hit without a restore"
                        );
                        self.states.insert(hit.state, content(&p[..k]));
                    }
                }
                Ok(())
            }
            GroupOp::Step { seq, n } => self.step(SeqId(seq.into()), n.into()),
            GroupOp::Save { seq } => {
                let id = SeqId(seq.into());
                let computed = self.kv.computed_tokens(id)?;
                // To the next block boundary, and at times a few positions past it (a state saved
                // there holds the boundary's: it goes back `REWIND` positions).
                let past = (computed / bt) % (REWIND as usize + 1);
                self.step(id, (bt - computed % bt) % bt + past)?;
                let at = self.kv.computed_tokens(id)?;
                let boundary = content(&self.kv.tokens(id)?[..at - at % bt]);
                // (The step may have run: no free slot for the point is no refusal of it.)
                match self.kv.save_restore_point(id) {
                    Ok(Some(c)) => self.pending.push((c, None, Some(boundary))),
                    Ok(None) | Err(KvError::OutOfStates { .. }) => {}
                    Err(e) => return Err(e),
                }
                Ok(())
            }
            GroupOp::Fork { parent, child } => {
                let c = self.kv.fork(SeqId(parent.into()), SeqId(child.into()))?;
                self.pending.push((c, None, None));
                Ok(())
            }
            GroupOp::Free { seq, cache } => self.kv.free_sequence(SeqId(seq.into()), cache),
            GroupOp::Truncate { seq, keep } => {
                let id = SeqId(seq.into());
                self.kv.truncate(id, keep.into())?;
                // A state cut back holds what its request computed up to where it now stands.
                if self.kv.config().state_bytes > 0 {
                    let computed = self.kv.computed_tokens(id)?;
                    let state = self.kv.state(id)?;
                    self.states.insert(state, content(&self.kv.tokens(id)?[..computed]));
                }
                Ok(())
            }
            GroupOp::Cache { seq } => self.kv.cache_prefix(SeqId(seq.into())),
            GroupOp::ReleaseWindows { seq } => self.kv.release_outside_windows(SeqId(seq.into())).map(drop),
            GroupOp::Lease { seq, transfer, ttl } => {
                let t = TransferId(transfer.into());
                self.kv.lease_sequence(SeqId(seq.into()), t, self.now + u64::from(ttl)).map(drop)
            }
            GroupOp::AllocLease { transfer, family, seq, len, ttl } => {
                let (t, p) = (TransferId(transfer.into()), prompt(family, seq, len));
                let lease = self.kv.allocate_lease_reusing(t, &p, self.now + u64::from(ttl))?;
                let mut filled = Vec::new();
                for (g, l) in lease.groups.iter().enumerate() {
                    assert_eq!(l.blocks.len(), p.len().div_ceil(bt));
                    for (i, &b) in l.blocks.iter().enumerate() {
                        let full = (i + 1) * bt <= p.len();
                        if i < l.reused {
                            let want = content(&p[..(i + 1) * bt]);
                            assert_eq!(self.blocks.get(&(g, b)), Some(&want), "group {g}: reused block {i}");
                        } else if full {
                            filled.push(((g, b), content(&p[..(i + 1) * bt])));
                        }
                    }
                }
                // The transfer writes the fresh blocks and the state (a stateful model's: a stateless
                // one's requests hold no slot), at the epoch the lease took.
                let (state, epoch) = (lease.state, lease.state_epoch);
                if self.kv.config().state_bytes > 0 {
                    self.kv.check_state_write(t, state, epoch).expect("the lease's own slot");
                    assert!(self.kv.check_state_write(t, state, epoch.wrapping_sub(1)).is_err());
                } else {
                    assert_eq!(state, crate::StateId::NONE);
                }
                self.blocks.extend(filled);
                self.states.insert(state, content(&p));
                self.incoming.insert(t, (p, state, epoch));
                Ok(())
            }
            GroupOp::Adopt { transfer, seq } => {
                let t = TransferId(transfer.into());
                let Some((p, _, _)) = self.incoming.get(&t).cloned() else { return Ok(()) };
                self.kv.adopt_lease(t, SeqId(seq.into()), &p)?;
                self.incoming.remove(&t);
                Ok(())
            }
            GroupOp::Release { transfer } => {
                let t = TransferId(transfer.into());
                self.kv.release_lease(t)?;
                // A late write of the ended lease's state is refused.
                if let Some((_, state, epoch)) = self.incoming.remove(&t) {
                    assert!(
                        self.kv.check_state_write(t, state, epoch).is_err(),
                        "a late state write accepted"
                    );
                }
                Ok(())
            }
            GroupOp::Tick { by } => {
                self.now += u64::from(by);
                for t in self.kv.expire_leases(self.now) {
                    assert!(self.kv.lease(t).is_err(), "{t} expired but still held");
                    self.incoming.remove(&t);
                }
                Ok(())
            }
            GroupOp::Evict { n } => {
                self.kv.evict(n.into());
                Ok(())
            }
            GroupOp::EvictRestore { n } => {
                self.kv.evict_restore_points(n.into());
                Ok(())
            }
        }
    }

    /// Ends everything and checks that every block and state slot is free again.
    pub fn drain(&mut self) {
        self.flush();
        let seqs: Vec<SeqId> = self.kv.states.keys().copied().collect();
        for s in seqs {
            self.kv.free_sequence(s, false).expect("a live sequence");
        }
        self.kv.expire_leases(u64::MAX);
        self.kv.evict(usize::MAX);
        self.kv.evict_restore_points(usize::MAX);
        self.kv.check_invariants().unwrap_or_else(|e| panic!("after drain: {e}"));
        for s in self.kv.group_stats() {
            assert_eq!(s.blocks_free, s.blocks_total, "blocks not reachable again: {s:?}");
        }
        let st = self.kv.state_stats();
        assert_eq!(st.free, st.slots, "state slots not reachable again: {st:?}");
    }
}
