//! An operation-sequence driver for tests and fuzzing: decodes operations from bytes, applies them to a
//! [`KvCache`], and checks every invariant after each one. Not part of the stable API.

use crate::{KvCache, KvConfig, KvError, SeqId, TransferId};

/// The sliding window [`Op::ReleaseWindow`] applies, in positions (not a multiple of a block).
pub const WINDOW: usize = 13;

/// One operation on the cache, with small ids so random input hits existing sequences and leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Add a sequence whose prompt shares a prefix with others of the same `family`.
    Add {
        seq: u8,
        family: u8,
        len: u16,
    },
    /// Reserve and commit `n` tokens (appending sampled tokens first if the prompt is used up).
    Step {
        seq: u8,
        n: u8,
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
    Lease {
        seq: u8,
        transfer: u8,
        ttl: u8,
    },
    AllocLease {
        transfer: u8,
        n: u8,
        ttl: u8,
    },
    /// A destination lease for a `family` prompt of `len` tokens, reusing what the prefix cache holds.
    AllocLeaseReusing {
        transfer: u8,
        family: u8,
        seq: u8,
        len: u16,
        ttl: u8,
    },
    Release {
        transfer: u8,
    },
    /// Advance the clock and run the lease scan.
    Tick {
        by: u8,
    },
    Adopt {
        transfer: u8,
        seq: u8,
        len: u16,
    },
    Evict {
        n: u8,
    },
    /// Give back the blocks outside a sliding window of [`WINDOW`] positions (a model's window is the
    /// same for every sequence).
    ReleaseWindow {
        seq: u8,
    },
    /// A transfer write into lease block `index`, with a correct or a stale epoch.
    Write {
        transfer: u8,
        index: u8,
        stale: bool,
    },
}

impl Op {
    /// Reads one operation from `bytes`; `None` when they run out.
    pub fn decode(bytes: &mut impl Iterator<Item = u8>) -> Option<Op> {
        let mut next = || bytes.next();
        let small = |b: u8| b % 8;
        Some(match next()? % 15 {
            0 => Op::Add { seq: small(next()?), family: next()? % 4, len: u16::from(next()?) + 1 },
            1 => Op::Step { seq: small(next()?), n: next()? % 40 },
            2 => Op::Fork { parent: small(next()?), child: small(next()?) },
            3 => Op::Free { seq: small(next()?), cache: next()? % 2 == 0 },
            4 => Op::Truncate { seq: small(next()?), keep: u16::from(next()?) },
            5 => Op::Cache { seq: small(next()?) },
            6 => Op::Lease { seq: small(next()?), transfer: small(next()?), ttl: next()? },
            7 => Op::AllocLease { transfer: small(next()?), n: next()? % 16, ttl: next()? },
            8 => Op::Release { transfer: small(next()?) },
            9 => Op::Tick { by: next()? },
            10 => Op::Adopt { transfer: small(next()?), seq: small(next()?), len: u16::from(next()?) },
            11 => Op::Evict { n: next()? % 8 },
            12 => Op::AllocLeaseReusing {
                transfer: small(next()?),
                family: next()? % 4,
                seq: small(next()?),
                len: u16::from(next()?) + 1,
                ttl: next()?,
            },
            13 => Op::Write { transfer: small(next()?), index: next()?, stale: next()? % 2 == 0 },
            _ => Op::ReleaseWindow { seq: small(next()?) },
        })
    }
}

/// A cache plus a clock, applying [`Op`]s and checking invariants after each.
#[derive(Debug)]
pub struct Driver {
    pub kv: KvCache,
    pub now: u64,
    next_token: u32,
}

fn prompt(family: u8, seq: u8, len: u16) -> Vec<u32> {
    // The first 40 tokens are the family's; the rest differ per sequence.
    (0..u32::from(len))
        .map(|i| if i < 40 { u32::from(family) * 1000 + i } else { u32::from(seq) * 100_000 + i })
        .collect()
}

impl Driver {
    pub fn new(config: KvConfig) -> Result<Driver, KvError> {
        Ok(Driver { kv: KvCache::new(config)?, now: 0, next_token: 5_000_000 })
    }

    /// With an offload tier of `tier`'s size (its copies are taken and dropped: no memory is modelled
    /// here; `tests/tier.rs` does that).
    pub fn with_tier(mut self, tier: crate::TierConfig) -> Driver {
        self.kv.enable_tier(tier);
        self
    }

    /// Applies `op`; refusals the API defines (unknown ids, out of blocks, ...) are fine, but they must
    /// leave the cache unchanged, and every invariant must hold afterwards.
    pub fn apply(&mut self, op: Op) {
        let before = self.kv.stats();
        let result = self.apply_inner(op);
        if let Err(KvError::OutOfBlocks { needed_blocks, free_blocks }) = &result {
            assert!(free_blocks < needed_blocks, "{op:?}: refused with enough free blocks");
            let after = self.kv.stats();
            assert!(
                after.owned(crate::OwnerKind::Sequence) <= before.owned(crate::OwnerKind::Sequence),
                "{op:?}: partial allocation"
            );
            assert_eq!(after.blocks_owned[2], before.blocks_owned[2], "{op:?}: partial lease allocation");
        }
        if let Err(e) = self.kv.check_invariants() {
            panic!("after {op:?} ({result:?}): {e}");
        }
    }

    fn apply_inner(&mut self, op: Op) -> Result<(), KvError> {
        let kv = &mut self.kv;
        match op {
            Op::Add { seq, family, len } => {
                kv.add_sequence(SeqId(seq.into()), &prompt(family, seq, len)).map(drop)
            }
            Op::Step { seq, n } => {
                let id = SeqId(seq.into());
                let missing = (kv.computed_tokens(id)? + usize::from(n)).saturating_sub(kv.tokens(id)?.len());
                let sampled: Vec<u32> = (0..missing as u32).map(|i| self.next_token + i).collect();
                self.next_token += missing as u32;
                kv.append_tokens(id, &sampled)?;
                kv.reserve(id, n.into())?;
                // The backend would run these copies now.
                kv.take_tier_copies();
                let copies = kv.take_copies();
                for c in &copies {
                    assert!(c.tokens > 0 && c.tokens < kv.block_size() && c.src != c.dst);
                }
                let slots =
                    kv.slot_mapping(id, kv.computed_tokens(id)?..kv.computed_tokens(id)? + usize::from(n))?;
                for s in &slots {
                    let m = &kv.blocks[s.block.0 as usize];
                    assert!(
                        m.seq_refs == 1 && m.lease_refs == 0 && m.node.is_none(),
                        "writing into a shared block"
                    );
                }
                kv.commit(id, n.into())
            }
            Op::Fork { parent, child } => kv.fork(SeqId(parent.into()), SeqId(child.into())),
            Op::Free { seq, cache } => kv.free_sequence(SeqId(seq.into()), cache),
            Op::Truncate { seq, keep } => kv.truncate(SeqId(seq.into()), keep.into()),
            Op::Cache { seq } => kv.cache_prefix(SeqId(seq.into())).map(drop),
            Op::Lease { seq, transfer, ttl } => kv
                .lease_sequence(SeqId(seq.into()), TransferId(transfer.into()), self.now + u64::from(ttl))
                .map(drop),
            Op::AllocLease { transfer, n, ttl } => {
                kv.allocate_lease(TransferId(transfer.into()), n.into(), self.now + u64::from(ttl)).map(drop)
            }
            Op::AllocLeaseReusing { transfer, family, seq, len, ttl } => {
                let tokens = prompt(family, seq, len);
                let n = kv.blocks_for(tokens.len());
                let t = TransferId(transfer.into());
                let (cached, bs, tiered) = (kv.lookup_prefix(&tokens), kv.block_size(), kv.tier.is_some());
                let lease = kv.allocate_lease_reusing(t, &tokens, n, self.now + u64::from(ttl))?;
                assert_eq!(lease.blocks.len(), n);
                // (The tier's blocks count as cached but a lease takes only the pool's.)
                assert!(tiered || lease.reused * bs >= cached, "reused less than the cache holds");
                Ok(())
            }
            Op::Release { transfer } => kv.release_lease(TransferId(transfer.into())),
            Op::Tick { by } => {
                self.now += u64::from(by);
                for t in kv.expire_leases(self.now) {
                    assert!(kv.lease(t).is_err(), "{t} expired but still held");
                }
                Ok(())
            }
            Op::Adopt { transfer, seq, len } => {
                let tokens: Vec<u32> = (0..u32::from(len)).collect();
                kv.adopt_lease(TransferId(transfer.into()), SeqId(seq.into()), &tokens)
            }
            Op::Evict { n } => {
                kv.evict(n.into());
                Ok(())
            }
            Op::ReleaseWindow { seq } => {
                let id = SeqId(seq.into());
                let computed = kv.computed_tokens(id)?;
                kv.release_outside_window(id, WINDOW)?;
                // Every position the next query sees is still held.
                let first = (computed + 1).saturating_sub(WINDOW);
                assert!(kv.block_table(id)?[first / kv.block_size()..].iter().all(|b| !b.is_released()));
                Ok(())
            }
            Op::Write { transfer, index, stale } => {
                let t = TransferId(transfer.into());
                let lease = kv.lease(t)?;
                let Some(i) = (!lease.blocks.is_empty()).then(|| usize::from(index) % lease.blocks.len())
                else {
                    return Ok(());
                };
                let (block, epoch) = (lease.blocks[i], lease.epochs[i]);
                let epoch = if stale { epoch.wrapping_sub(1) } else { epoch };
                let r = kv.check_write(t, block, epoch);
                let fresh = i >= lease.reused;
                assert_eq!(r.is_ok(), !stale && fresh, "write check for {block} epoch {epoch}");
                Ok(())
            }
        }
    }

    /// Ends everything (sequences, leases, cache) and checks that every block came back to the free list.
    pub fn drain(&mut self) {
        let seqs: Vec<SeqId> = self.kv.seqs.keys().copied().collect();
        for s in seqs {
            let _ = self.kv.free_sequence(s, false);
        }
        self.kv.expire_leases(u64::MAX);
        self.kv.evict(usize::MAX);
        self.kv.check_invariants().unwrap_or_else(|e| panic!("after drain: {e}"));
        let stats = self.kv.stats();
        assert_eq!(stats.blocks_free, stats.blocks_total, "blocks not reachable again: {stats:?}");
    }
}
