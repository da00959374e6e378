//! DeepSeek V4's compact KV layout: paged blocks hold only the compressed rows (each compressed
//! layer's rows and each indexer's keys, `block_tokens / ratio` of each per block), and a state slot
//! per request holds what a request reads of its last positions only: each layer's window of K=V rows
//! and each compressor's (value, gate) pairs of its current and previous group, in rings indexed by
//! position.
//!
//! Rings indexed by position keep `slack` positions more than the model reads, so a state saved a
//! few positions past a block boundary still holds everything a request resumed at that boundary
//! reads (a restore point), and a request cut back over rejected draft tokens reads what it would
//! have: a position's ring entry is only ever overwritten by a later position's.
//!
//! A fresh state needs no clearing: a request reads only positions it wrote (or a restored state
//! holds).

use pdserve_kvcache::BlockId;

use super::layer::{Group, Memory, Place, Pool, INDEX_RATIO};
use crate::backend::KvDtype;
use crate::config::{V4Config, V4Layer};
use crate::cpu::KvMemory;
use crate::ModelError;

/// Where one compressor keeps things: its rows in a block, its (value, gate) pairs in the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Compressor {
    ratio: usize,
    /// Values of one value (and of one gate): twice the row at ratio 4, whose groups overlap.
    width: usize,
    row: usize,
    /// Its rows' first value in a block.
    block_at: usize,
    /// Its ring's first value in a state slot, and the ring's length in positions.
    state_at: usize,
    ring: usize,
}

/// One layer's places: its window ring's in the state, and its compressors'.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayerPlaces {
    window_at: usize,
    pools: [Option<Compressor>; 2],
}

/// The compact layout's geometry (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct V4Compact {
    pub block_tokens: usize,
    /// Values of one block's compressed rows, rounded up to a whole number per token.
    pub block_values: usize,
    /// Values of one request's state.
    pub state_values: usize,
    /// Positions the window ring keeps.
    window_ring: usize,
    head_dim: usize,
    layers: Vec<LayerPlaces>,
}

impl V4Compact {
    /// The layout of `c`'s main layers and, with `draft`, its first MTP layer, with blocks of
    /// `block_tokens` (a multiple of every compression ratio) and rings `slack` positions longer
    /// than the model reads (at least the tokens a request may be cut back, plus its chained draft
    /// guesses).
    pub fn new(
        c: &V4Config,
        draft: bool,
        block_tokens: usize,
        slack: usize,
    ) -> Result<V4Compact, ModelError> {
        let kinds = &c.kinds[..c.layers + usize::from(draft && c.mtp_layers > 0)];
        let ratios = kinds.iter().map(|k| k.ratio()).filter(|&r| r > 0);
        if let Some(r) =
            ratios.chain([INDEX_RATIO]).find(|&r| block_tokens == 0 || !block_tokens.is_multiple_of(r))
        {
            return Err(ModelError::Unsupported {
                field: "block size".into(),
                value: format!(
                    "{block_tokens} tokens (DeepSeek V4's compact KV needs a multiple of every compression ratio, {r} here)"
                ),
            });
        }
        let window_ring = c.window + slack;
        let (mut block_at, mut state_at) = (0, 0);
        let mut layers = Vec::with_capacity(kinds.len());
        for &kind in kinds {
            let window_at = state_at;
            state_at += window_ring * c.head_dim;
            let mut pool = |ratio: usize, row: usize| {
                let width = if ratio == INDEX_RATIO { 2 * row } else { row };
                let ring = ratio * if ratio == INDEX_RATIO { 2 } else { 1 } + slack;
                let p = Compressor { ratio, width, row, block_at, state_at, ring };
                block_at += block_tokens / ratio * row;
                state_at += ring * 2 * width;
                p
            };
            let kv = (kind.ratio() > 0).then(|| pool(kind.ratio(), c.head_dim));
            let index = (kind == V4Layer::CompressedSparse).then(|| pool(INDEX_RATIO, c.index_dim));
            layers.push(LayerPlaces { window_at, pools: [kv, index] });
        }
        Ok(V4Compact {
            block_tokens,
            block_values: block_at.div_ceil(block_tokens).max(1) * block_tokens,
            state_values: state_at,
            window_ring,
            head_dim: c.head_dim,
            layers,
        })
    }

    /// Blocks (of `block_values` each) one state slot takes.
    pub fn state_blocks(&self) -> usize {
        self.state_values.div_ceil(self.block_values)
    }

    /// Bytes per token of each kind of row a block holds, by name: the compressed sparse layers'
    /// rows ("c4"), their indexers' keys ("c4-index"), the heavily compressed layers' rows
    /// ("c{ratio}"), over every layer.
    pub fn bytes_per_token(&self, dtype: KvDtype) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for l in &self.layers {
            for (i, p) in l.pools.iter().enumerate() {
                let Some(p) = p else { continue };
                let name = if i == 1 { "c4-index".to_owned() } else { format!("c{}", p.ratio) };
                let bytes = (p.row * dtype.bytes()) as f64 / p.ratio as f64;
                match out.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, b)) => *b += bytes,
                    None => out.push((name, bytes)),
                }
            }
        }
        out
    }
}

/// A step's requests' memory in the compact layout: each one's block table and state slot.
pub(super) struct Compact<'a> {
    pub kv: &'a mut KvMemory,
    pub dtype: KvDtype,
    pub geometry: &'a V4Compact,
    pub tables: Vec<&'a [BlockId]>,
    /// Each request's state slot's first value.
    pub states: Vec<usize>,
}

impl Compact<'_> {
    fn read(&self, at: usize, n: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        self.kv.values(self.dtype).read_into(at, &mut v);
        v
    }

    fn pool(&self, (_, layer): Place, pool: Pool) -> Compressor {
        self.geometry.layers[layer].pools[pool as usize].expect("a place for each compressor the layer has")
    }

    /// The value index of ring entry `pos` of compressor `p` of request `seq` (its value; the gate
    /// follows it).
    fn pair_at(&self, seq: usize, p: &Compressor, pos: usize) -> usize {
        self.states[seq] + p.state_at + pos % p.ring * 2 * p.width
    }

    /// The value index of the compressed row of compressor `p` made at group `group`.
    fn row_at(&self, seq: usize, p: &Compressor, group: usize) -> usize {
        let g = self.geometry;
        let pos = group * p.ratio;
        let block = self.tables[seq][pos / g.block_tokens].0 as usize;
        block * g.block_values + p.block_at + (pos % g.block_tokens) / p.ratio * p.row
    }
}

impl Memory for Compact<'_> {
    fn window(&mut self, (seq, layer): Place, pos: usize, window: usize, row: Vec<f32>) -> Vec<Vec<f32>> {
        let (g, base) = (self.geometry, self.states[seq] + self.geometry.layers[layer].window_at);
        let at = |p: usize| base + p % g.window_ring * g.head_dim;
        self.kv.store(self.dtype, at(pos), &row);
        let first = (pos + 1).saturating_sub(window);
        (first..=pos).map(|p| self.read(at(p), row.len())).collect()
    }

    fn feed(
        &mut self,
        place: Place,
        pool: Pool,
        pos: usize,
        (ratio, overlap): (usize, bool),
        a: Vec<f32>,
        s: Vec<f32>,
    ) -> Option<(Group, Group)> {
        let p = self.pool(place, pool);
        let at = self.pair_at(place.0, &p, pos);
        self.kv.store(self.dtype, at, &a);
        self.kv.store(self.dtype, at + p.width, &s);
        if !(pos + 1).is_multiple_of(ratio) {
            return None;
        }
        let pair = |q: usize| {
            let at = self.pair_at(place.0, &p, q);
            (self.read(at, p.width), self.read(at + p.width, p.width))
        };
        let start = pos + 1 - ratio;
        let previous =
            if overlap && start >= ratio { (start - ratio..start).map(pair).collect() } else { Vec::new() };
        Some((previous, (start..=pos).map(pair).collect()))
    }

    fn push_row(&mut self, place: Place, pool: Pool, pos: usize, row: Vec<f32>) {
        let p = self.pool(place, pool);
        let at = self.row_at(place.0, &p, pos / p.ratio);
        self.kv.store(self.dtype, at, &row);
    }

    fn rows(&self, place: Place, pool: Pool, pos: usize, ratio: usize) -> Vec<Vec<f32>> {
        let p = self.pool(place, pool);
        (0..(pos + 1) / ratio).map(|g| self.read(self.row_at(place.0, &p, g), p.row)).collect()
    }
}
