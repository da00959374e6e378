//! DeepSeek V4 served: the engine's batch steps over paged KV blocks in the compact layout
//! ([`compact`](super::compact)): the blocks hold the compressed rows (and the indexer's keys), and
//! each request's state slot (whole blocks after the pool's, [`KvState`]) holds its windows and its
//! compressors' partial groups. The engine moves, copies and restores a state as it does blocks, so
//! the prefix cache (from restore points), copy-on-write, preemption, the PD transfer and migration
//! carry V4 requests, and a request resumed from any of them computes what a cold one does, to the
//! bit.

use std::sync::Arc;

use pdserve_kvcache::{BlockCopy, BlockId};

use super::compact::{Compact, V4Compact};
use super::layer::Memory;
use super::DeepseekV4;
use crate::backend::{check_steps, Backend, DraftStep, KvDtype, KvLayout, KvState, KvStore, SeqStep};
use crate::cpu::KvMemory;
use crate::{ModelConfig, ModelError};

/// Runs a DeepSeek V4 checkpoint's batch steps on the CPU over paged KV blocks (see the module
/// documentation). Its KV layout is a latent one: a block's compressed rows as one latent row per
/// position (rounded up), then the state slots' blocks.
#[derive(Debug)]
pub struct V4Backend {
    model: Arc<DeepseekV4>,
    cfg: ModelConfig,
    geometry: V4Compact,
    state: KvState,
    layout: KvLayout,
    kv: KvMemory,
    /// Whether the first MTP layer drafts (its rows are the layout's last layer).
    drafts: bool,
    /// The last forward pass, for the draft pass after it: each step's first position, state slot,
    /// and its positions' final streams.
    last: Vec<(usize, Option<u32>, Vec<Vec<f32>>)>,
}

impl V4Backend {
    /// The KV memory for `num_blocks` blocks of `block_size` positions (a multiple of every
    /// compression ratio: [`V4Config::block_multiple`](crate::V4Config::block_multiple)) and `slots`
    /// state slots whose requests may be cut back `rewind_tokens` positions (see
    /// [`compact`](super::compact)): its layout (`num_blocks` the blocks and the slots' blocks) and
    /// its state's place.
    pub fn layout(
        cfg: &ModelConfig,
        (num_blocks, block_size): (usize, usize),
        dtype: KvDtype,
        (slots, rewind_tokens): (usize, usize),
    ) -> Result<(KvLayout, KvState), ModelError> {
        let Some(v4) = &cfg.v4 else {
            return Err(ModelError::InvalidInput {
                problem: "a model configuration that is not V4's".into(),
            });
        };
        // The MTP layer's window is in every state of a checkpoint that ships it, whether this worker
        // drafts or not: two workers of one checkpoint agree on the state's layout.
        let g = V4Compact::new(v4, v4.mtp_layers > 0, block_size, 2 * rewind_tokens + 2)?;
        let state = KvState {
            slots,
            blocks: g.state_blocks(),
            first: num_blocks,
            bytes: g.state_values * dtype.bytes(),
            rewind_tokens,
        };
        let layout = KvLayout {
            num_blocks: num_blocks + slots * state.blocks,
            block_size,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: g.block_values / block_size,
            dtype,
            latent: true,
        };
        Ok((layout, state))
    }

    /// `model` (`cfg` is the checkpoint's `ModelConfig`, its `v4` the model's shape) over the KV
    /// memory [`layout`](Self::layout) describes, on the heap or in `store` (at least the layout's
    /// bytes, 4-byte aligned).
    pub fn new(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        pool: (usize, usize),
        dtype: KvDtype,
        states: (usize, usize),
        store: Option<Box<dyn KvStore>>,
    ) -> Result<V4Backend, ModelError> {
        let (layout, state) = V4Backend::layout(&cfg, pool, dtype, states)?;
        let kv = match store {
            Some(store) => KvMemory::from_store(store, &layout)?,
            None => KvMemory::heap(layout.block_bytes() * layout.num_blocks),
        };
        let geometry = V4Compact::new(&model.cfg, model.cfg.mtp_layers > 0, pool.1, 2 * states.1 + 2)?;
        match &cfg.v4 {
            Some(v4) if **v4 == model.cfg => {}
            _ => {
                return Err(ModelError::InvalidInput {
                    problem: "a model configuration that is not the V4 checkpoint's".into(),
                })
            }
        }
        let drafts = cfg.draft_layers > 0;
        if drafts && !model.has_draft() {
            return Err(ModelError::InvalidInput {
                problem: "a draft layer the checkpoint does not have".into(),
            });
        }
        Ok(V4Backend { model, cfg, geometry, state, layout, kv, drafts, last: Vec::new() })
    }

    /// Bytes of the weights held (see [`DeepseekV4::weight_bytes`]).
    pub fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    /// Bytes per token of each kind of row the blocks hold (see [`V4Compact::bytes_per_token`]).
    pub fn group_bytes_per_token(&self) -> Vec<(String, f64)> {
        self.geometry.bytes_per_token(self.layout.dtype)
    }

    /// Checks each step's state slot and blocks against the layout's.
    fn check_states<'s>(
        &self,
        steps: impl Iterator<Item = (Option<u32>, &'s [BlockId])>,
    ) -> Result<(), ModelError> {
        let state = &self.state;
        for (i, (slot, table)) in steps.enumerate() {
            let bad_slot = slot.is_none_or(|s| s as usize >= state.slots);
            if bad_slot || table.iter().any(|b| b.0 as usize >= state.first) {
                return Err(ModelError::InvalidInput {
                    problem: format!(
                        "step {i}: state slot {slot:?} or a block outside the pool of {} blocks and {} slots",
                        state.first, state.slots
                    ),
                });
            }
        }
        Ok(())
    }

    /// The memory of a step's requests: their block tables and state slots.
    fn memory<'a>(&'a mut self, tables: Vec<&'a [BlockId]>, states: &[Option<u32>]) -> Box<dyn Memory + 'a> {
        let (geometry, state) = (&self.geometry, &self.state);
        let first = state.first * geometry.block_values;
        let slot_values = state.blocks * geometry.block_values;
        let states = states.iter().map(|s| first + s.unwrap_or(0) as usize * slot_values).collect();
        Box::new(Compact { kv: &mut self.kv, dtype: self.layout.dtype, geometry, tables, states })
    }
}

impl Backend for V4Backend {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn kv_state(&self) -> Option<KvState> {
        Some(self.state)
    }

    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.last.clear();
        check_steps(&self.cfg, &self.layout, steps)?;
        self.check_states(steps.iter().map(|s| (s.state, s.block_table)))?;
        // On one of the pool's threads: the large products' splits are forks from a running worker,
        // not jobs handed across from this thread.
        let this = &mut *self;
        Ok(rayon::scope(|_| this.forward_on_pool(steps)))
    }

    fn draft_layers(&self) -> usize {
        usize::from(self.drafts)
    }

    fn draft(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let this = &mut *self;
        rayon::scope(|_| this.draft_on_pool(steps))
    }
    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), ModelError> {
        self.kv.copy_blocks(&self.layout, copies)
    }

    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), ModelError> {
        self.kv.read_block(&self.layout, block, out)
    }

    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), ModelError> {
        self.kv.write_block(&self.layout, block, data)
    }

    fn block_bytes(&self, block: BlockId) -> Option<&[u8]> {
        self.kv.block(&self.layout, block)
    }

    fn block_bytes_mut(&mut self, block: BlockId) -> Option<&mut [u8]> {
        self.kv.block_mut(&self.layout, block)
    }
}

impl V4Backend {
    fn forward_on_pool(&mut self, steps: &[SeqStep<'_>]) -> Vec<Vec<f32>> {
        // Every step's tokens together, layer by layer: each weight read once for the batch.
        let toks: Vec<(usize, usize, u32)> = steps
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.tokens.iter().enumerate().map(move |(j, &t)| (i, s.start_pos + j, t)))
            .collect();
        let states: Vec<Option<u32>> = steps.iter().map(|s| s.state).collect();
        let model = Arc::clone(&self.model);
        let mut mem = self.memory(steps.iter().map(|s| s.block_table).collect(), &states);
        let mut streams = model.run_tokens(mem.as_mut(), &toks).into_iter();
        drop(mem);
        let mut out = Vec::with_capacity(steps.iter().map(|s| s.logits).sum());
        for s in steps {
            let mine: Vec<Vec<f32>> = streams.by_ref().take(s.tokens.len()).collect();
            let wanted = s.tokens.len() - s.logits;
            out.extend(mine[wanted..].iter().map(|s| self.model.head_logits(s)));
            self.last.push((s.start_pos, s.state, if self.drafts { mine } else { Vec::new() }));
        }
        out
    }

    fn draft_on_pool(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let model = Arc::clone(&self.model);
        let dw = match (&model.w.draft, self.drafts) {
            (Some(dw), true) => dw,
            _ => {
                return Err(ModelError::Unsupported {
                    field: "draft layer".into(),
                    value: "none loaded".into(),
                })
            }
        };
        // Every step checked first: a refused pass changes nothing.
        let mut rows = Vec::with_capacity(steps.len());
        for (i, d) in steps.iter().enumerate() {
            match self.last.get(d.step) {
                Some((start_pos, state, streams)) if !d.next.is_empty() && d.next.len() <= streams.len() => {
                    rows.push(SeqStep {
                        tokens: d.next,
                        start_pos: *start_pos,
                        block_table: d.block_table,
                        logits: 0,
                        state: *state,
                    })
                }
                last => {
                    return Err(ModelError::InvalidInput {
                        problem: format!(
                        "draft step {i} reads {} rows of step {} of the last forward pass, which had {:?}",
                        d.next.len(),
                        d.step,
                        last.map(|l| l.2.len())
                    ),
                    })
                }
            }
        }
        check_steps(&self.cfg, &self.layout, &rows)?;
        self.check_states(rows.iter().map(|s| (s.state, s.block_table)))?;
        let (layer, bs, max_positions) =
            (model.cfg.layers, self.layout.block_size, self.cfg.max_position_embeddings);
        // Every step's rows together, then each guessing step's chained guesses.
        let last = std::mem::take(&mut self.last);
        let mut toks = Vec::new();
        let mut main: Vec<&[f32]> = Vec::new();
        for (i, (d, s)) in steps.iter().zip(&rows).enumerate() {
            toks.extend(d.next.iter().enumerate().map(|(j, &t)| (i, s.start_pos + j, t)));
            main.extend(last[d.step].2[..d.next.len()].iter().map(Vec::as_slice));
        }
        let states: Vec<Option<u32>> = rows.iter().map(|s| s.state).collect();
        let mut mem = self.memory(steps.iter().map(|d| d.block_table).collect(), &states);
        let mut drafted = model.draft_rows(dw, mem.as_mut(), layer, &toks, &main).into_iter();
        let mut out = Vec::new();
        for (i, (d, s)) in steps.iter().zip(&rows).enumerate() {
            let Some(mut row) = drafted.by_ref().take(d.next.len()).last() else { continue };
            if d.guesses == 0 {
                continue;
            }
            out.push(model.draft_logits(dw, &row));
            // Chained guesses, a position on each, as far as the block table and the context reach;
            // their rows are overwritten when the real tokens' draft rows run there.
            for pos in s.start_pos + d.next.len()..s.start_pos + d.next.len() + d.guesses - 1 {
                if pos >= d.block_table.len() * bs || pos >= max_positions {
                    break;
                }
                let guess = crate::greedy_pick(out.last().expect("a guess")).0;
                let next = model.draft_rows(dw, mem.as_mut(), layer, &[(i, pos, guess)], &[&row]);
                row = next.into_iter().next().expect("a row");
                out.push(model.draft_logits(dw, &row));
            }
        }
        drop(mem);
        self.last = last;
        Ok(out)
    }
}
