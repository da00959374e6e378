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
//! `pdserve_kvcache::KvGroups` with per-request state slots, is the next step).

use std::sync::Arc;

use pdserve_kvcache::{BlockCopy, BlockId};

use super::layer::{Group, Memory, Place, Pool};
use super::DeepseekV4;
use crate::backend::{check_steps, Backend, DraftStep, KvDtype, KvLayout, KvStore, SeqStep};
use crate::config::{RowPart, V4Row};
use crate::cpu::KvMemory;
use crate::{ModelConfig, ModelError};

/// Runs a DeepSeek V4 checkpoint's batch steps on the CPU over paged KV blocks (see the module
/// documentation). Its KV layout is a latent one: one row per position and layer.
#[derive(Debug)]
pub struct V4Backend {
    model: Arc<DeepseekV4>,
    cfg: ModelConfig,
    row: V4Row,
    layout: KvLayout,
    kv: KvMemory,
    /// Whether the first MTP layer drafts (its rows are the layout's last layer).
    drafts: bool,
    /// The last forward pass, for the draft pass after it: each step's first position and its
    /// positions' final streams.
    last: Vec<(usize, Vec<Vec<f32>>)>,
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
        V4Backend::with_memory(model, cfg, layout, kv)
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
        V4Backend::with_memory(model, cfg, layout, kv)
    }

    fn with_memory(
        model: Arc<DeepseekV4>,
        cfg: ModelConfig,
        layout: KvLayout,
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
        let row = model.cfg.kv_row(drafts);
        Ok(V4Backend { model, cfg, row, layout, kv, drafts, last: Vec::new() })
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

    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.last.clear();
        check_steps(&self.cfg, &self.layout, steps)?;
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
        let mut mem = Paged {
            kv: &mut self.kv,
            dtype: self.layout.dtype,
            tables: steps.iter().map(|s| s.block_table).collect(),
            row: &self.row,
            block_size: self.layout.block_size,
        };
        let mut streams = self.model.run_tokens(&mut mem, &toks).into_iter();
        let mut out = Vec::with_capacity(steps.iter().map(|s| s.logits).sum());
        for s in steps {
            let mine: Vec<Vec<f32>> = streams.by_ref().take(s.tokens.len()).collect();
            let wanted = s.tokens.len() - s.logits;
            out.extend(mine[wanted..].iter().map(|s| self.model.head_logits(s)));
            self.last.push((s.start_pos, if self.drafts { mine } else { Vec::new() }));
        }
        out
    }

    fn draft_on_pool(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let dw = match (&self.model.w.draft, self.drafts) {
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
                Some((start_pos, streams)) if !d.next.is_empty() && d.next.len() <= streams.len() => rows
                    .push(SeqStep {
                        tokens: d.next,
                        start_pos: *start_pos,
                        block_table: d.block_table,
                        logits: 0,
                    }),
                last => {
                    return Err(ModelError::InvalidInput {
                        problem: format!(
                        "draft step {i} reads {} rows of step {} of the last forward pass, which had {:?}",
                        d.next.len(),
                        d.step,
                        last.map(|l| l.1.len())
                    ),
                    })
                }
            }
        }
        check_steps(&self.cfg, &self.layout, &rows)?;
        let (layer, bs) = (self.row.parts.len() - 1, self.layout.block_size);
        let mut mem = Paged {
            kv: &mut self.kv,
            dtype: self.layout.dtype,
            tables: steps.iter().map(|d| d.block_table).collect(),
            row: &self.row,
            block_size: bs,
        };
        // Every step's rows together, then each guessing step's chained guesses.
        let mut toks = Vec::new();
        let mut main: Vec<&[f32]> = Vec::new();
        for (i, (d, s)) in steps.iter().zip(&rows).enumerate() {
            toks.extend(d.next.iter().enumerate().map(|(j, &t)| (i, s.start_pos + j, t)));
            main.extend(self.last[d.step].1[..d.next.len()].iter().map(Vec::as_slice));
        }
        let mut drafted = self.model.draft_rows(dw, &mut mem, layer, &toks, &main).into_iter();
        let mut out = Vec::new();
        for (i, (d, s)) in steps.iter().zip(&rows).enumerate() {
            let Some(mut last) = drafted.by_ref().take(d.next.len()).last() else { continue };
            if d.guesses == 0 {
                continue;
            }
            out.push(self.model.draft_logits(dw, &last));
            // Chained guesses, a position on each, as far as the block table and the context reach;
            // their rows are overwritten when the real tokens' draft rows run there.
            for pos in s.start_pos + d.next.len()..s.start_pos + d.next.len() + d.guesses - 1 {
                if pos >= d.block_table.len() * bs || pos >= self.cfg.max_position_embeddings {
                    break;
                }
                let guess = crate::greedy_pick(out.last().expect("a guess")).0;
                let row = self.model.draft_rows(dw, &mut mem, layer, &[(i, pos, guess)], &[&last]);
                last = row.into_iter().next().expect("a row");
                out.push(self.model.draft_logits(dw, &last));
            }
        }
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
