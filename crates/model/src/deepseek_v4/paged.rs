//! DeepSeek V4 served: the engine's batch steps over paged KV blocks.
//!
//! Each block holds, per layer and position, one row of [`V4Row::width`] values: the position's
//! K=V row (what the window reads), each compressor's value and gate at the position (what its group
//! pools once complete), and at a group's last position the row the group made (the compressed
//! rows, and the indexer's keys). Everything a request's later tokens read is then a function of its
//! prefix, stored at positions like any model's KV: the prefix cache, copy-on-write, preemption, the
//! PD transfer and migration move V4 requests with no code of their own, and a request resumed from
//! any of them computes what a cold one does, to the bit. The cost is bytes: every position keeps
//! its compressor inputs and the window rows of positions long past the window (the compact layout,
//! [`compact`](super::compact), holds only the compressed rows in blocks and the rest in a state slot
//! per request).

use std::sync::Arc;

use pdserve_kvcache::{BlockCopy, BlockId};

use super::compact::{Compact, V4Compact};
use super::layer::{Group, Memory, Place, Pool};
use super::DeepseekV4;
use crate::backend::{check_steps, Backend, DraftStep, KvDtype, KvLayout, KvState, KvStore, SeqStep};
use crate::config::{RowPart, V4Row};
use crate::cpu::KvMemory;
use crate::{ModelConfig, ModelError};

/// How the KV memory is laid out.
#[derive(Debug)]
enum Geometry {
    /// A row per position and layer (see the module documentation).
    Positional(V4Row),
    /// Compressed rows in blocks, the rest in per-request state slots.
    Compact(V4Compact, KvState),
}

/// Runs a DeepSeek V4 checkpoint's batch steps on the CPU over paged KV blocks (see the module
/// documentation). Its KV layout is a latent one: one row per position and layer, or (compact) a
/// block's compressed rows as one latent row per position, rounded up.
#[derive(Debug)]
pub struct V4Backend {
    model: Arc<DeepseekV4>,
    cfg: ModelConfig,
    geometry: Geometry,
    layout: KvLayout,
    kv: KvMemory,
    /// Whether the first MTP layer drafts (its rows are the layout's last layer).
    drafts: bool,
    /// The last forward pass, for the draft pass after it: each step's first position, state slot,
    /// and its positions' final streams.
    last: Vec<(usize, Option<u32>, Vec<Vec<f32>>)>,
}

impl V4Backend {
    /// `model` over `num_blocks` blocks of `block_size` positions of `dtype` values. `cfg` is the
    /// checkpoint's `ModelConfig` (its `v4` the model's shape).
    pub fn new(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        (num_blocks, block_size): (usize, usize),
        dtype: KvDtype,
    ) -> Result<V4Backend, ModelError> {
        let layout = KvLayout::for_model(&cfg, num_blocks, block_size, dtype);
        let kv = KvMemory::heap(layout.block_bytes() * num_blocks);
        let row = Geometry::Positional(model.cfg.kv_row(cfg.draft_layers > 0));
        V4Backend::with_memory(model, cfg, (layout, row), kv)
    }

    /// [`new`](Self::new), with the KV memory in `store` (at least the pool's bytes, 4-byte aligned).
    pub fn with_kv_store(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        (num_blocks, block_size): (usize, usize),
        dtype: KvDtype,
        store: Box<dyn KvStore>,
    ) -> Result<V4Backend, ModelError> {
        let layout = KvLayout::for_model(&cfg, num_blocks, block_size, dtype);
        let kv = KvMemory::from_store(store, &layout)?;
        let row = Geometry::Positional(model.cfg.kv_row(cfg.draft_layers > 0));
        V4Backend::with_memory(model, cfg, (layout, row), kv)
    }

    /// The compact layout's KV memory for `num_blocks` blocks of `block_size` positions (a multiple
    /// of every compression ratio) and `slots` state slots whose requests may be cut back
    /// `rewind_tokens` positions (see [`compact`](super::compact)): its layout (`num_blocks` the
    /// blocks and the slots' blocks) and its state's place.
    pub fn compact_layout(
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
        let g = V4Compact::new(v4, cfg.draft_layers > 0, block_size, 2 * rewind_tokens + 2)?;
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

    /// `model` in the compact layout ([`compact_layout`](Self::compact_layout)), its KV memory on the
    /// heap or in `store`.
    pub fn compact(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        pool: (usize, usize),
        dtype: KvDtype,
        states: (usize, usize),
        store: Option<Box<dyn KvStore>>,
    ) -> Result<V4Backend, ModelError> {
        let (layout, state) = V4Backend::compact_layout(&cfg, pool, dtype, states)?;
        let kv = match store {
            Some(store) => KvMemory::from_store(store, &layout)?,
            None => KvMemory::heap(layout.block_bytes() * layout.num_blocks),
        };
        let g = V4Compact::new(&model.cfg, cfg.draft_layers > 0, pool.1, 2 * states.1 + 2)?;
        V4Backend::with_memory(model, cfg, (layout, Geometry::Compact(g, state)), kv)
    }

    fn with_memory(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        (layout, geometry): (KvLayout, Geometry),
        kv: KvMemory,
    ) -> Result<V4Backend, ModelError> {
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
        Ok(V4Backend { model, cfg, geometry, layout, kv, drafts, last: Vec::new() })
    }

    /// Bytes per token of each kind of row the compact layout's blocks hold (see
    /// [`V4Compact::bytes_per_token`]); empty for the positional layout.
    pub fn group_bytes_per_token(&self) -> Vec<(String, f64)> {
        match &self.geometry {
            Geometry::Compact(g, _) => g.bytes_per_token(self.layout.dtype),
            Geometry::Positional(_) => Vec::new(),
        }
    }

    /// Checks each step's state slot and blocks against the compact layout's.
    fn check_states<'s>(
        &self,
        steps: impl Iterator<Item = (Option<u32>, &'s [BlockId])>,
    ) -> Result<(), ModelError> {
        let Geometry::Compact(_, state) = &self.geometry else { return Ok(()) };
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
        let dtype = self.layout.dtype;
        match &self.geometry {
            Geometry::Positional(row) => {
                Box::new(Paged { kv: &mut self.kv, dtype, tables, row, block_size: self.layout.block_size })
            }
            Geometry::Compact(geometry, state) => {
                let slot_values = state.blocks * geometry.block_values;
                let first = state.first * geometry.block_values;
                let states = states.iter().map(|s| first + s.unwrap_or(0) as usize * slot_values).collect();
                Box::new(Compact { kv: &mut self.kv, dtype, geometry, tables, states })
            }
        }
    }

    /// Bytes of the weights held (see [`DeepseekV4::weight_bytes`]).
    pub fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
}

impl Backend for V4Backend {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn kv_state(&self) -> Option<KvState> {
        match &self.geometry {
            Geometry::Compact(_, state) => Some(*state),
            Geometry::Positional(_) => None,
        }
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

/// A step's sequences' rows in the paged KV memory, each through its block table.
struct Paged<'a> {
    kv: &'a mut KvMemory,
    dtype: KvDtype,
    tables: Vec<&'a [BlockId]>,
    row: &'a V4Row,
    block_size: usize,
}

impl Paged<'_> {
    /// The value index of `offset` in sequence `seq`'s layer `layer` row at position `pos`.
    fn at(&self, (seq, layer): Place, pos: usize, offset: usize) -> usize {
        let block = self.tables[seq][pos / self.block_size].0 as usize;
        ((block * self.row.parts.len() + layer) * self.block_size + pos % self.block_size) * self.row.width
            + offset
    }

    fn read(&self, at: Place, pos: usize, offset: usize, n: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        self.kv.values(self.dtype).read_into(self.at(at, pos, offset), &mut v);
        v
    }

    fn write(&mut self, at: Place, pos: usize, offset: usize, values: &[f32]) {
        let i = self.at(at, pos, offset);
        self.kv.store(self.dtype, i, values);
    }

    fn part(&self, (_, layer): Place, pool: Pool) -> RowPart {
        self.row.parts[layer][pool as usize].expect("a row part for each compressor the layer has")
    }
}

impl Memory for Paged<'_> {
    fn window(&mut self, at: Place, pos: usize, window: usize, row: Vec<f32>) -> Vec<Vec<f32>> {
        self.write(at, pos, 0, &row);
        let first = (pos + 1).saturating_sub(window);
        (first..=pos).map(|p| self.read(at, p, 0, row.len())).collect()
    }

    fn feed(
        &mut self,
        at: Place,
        pool: Pool,
        pos: usize,
        (ratio, overlap): (usize, bool),
        a: Vec<f32>,
        s: Vec<f32>,
    ) -> Option<(Group, Group)> {
        let p = self.part(at, pool);
        self.write(at, pos, p.at, &a);
        self.write(at, pos, p.at + p.width, &s);
        if !(pos + 1).is_multiple_of(ratio) {
            return None;
        }
        let pair = |q: usize| (self.read(at, q, p.at, p.width), self.read(at, q, p.at + p.width, p.width));
        let start = pos + 1 - ratio;
        let previous =
            if overlap && start >= ratio { (start - ratio..start).map(pair).collect() } else { Vec::new() };
        Some((previous, (start..=pos).map(pair).collect()))
    }

    fn push_row(&mut self, at: Place, pool: Pool, pos: usize, row: Vec<f32>) {
        let p = self.part(at, pool);
        self.write(at, pos, p.at + 2 * p.width, &row);
    }

    fn rows(&self, at: Place, pool: Pool, pos: usize, ratio: usize) -> Vec<Vec<f32>> {
        let p = self.part(at, pool);
        (0..(pos + 1) / ratio)
            .map(|g| self.read(at, g * ratio + ratio - 1, p.at + 2 * p.width, p.row))
            .collect()
    }
}
