//! The seam between the engine and whatever runs the model (this crate's CPU backend, or a GPU one).

use pdserve_kvcache::{BlockCopy, BlockId};

use crate::ModelError;

/// One sequence's share of a batch step: new tokens at consecutive positions from `start_pos`, with a
/// block table covering every position up to the last new one. Earlier positions' KV must already be
/// in the cache (computed by earlier steps, reused from the prefix cache, or received from a peer).
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [BlockId],
    /// How many of the last new tokens return logits: 0 for none, 1 for the next token's, more to
    /// verify draft tokens (speculative decoding: row `i` scores the token after `tokens[len - n + i]`).
    pub logits: usize,
    /// The sequence's state slot, for a backend that keeps per-request state ([`Backend::kv_state`]);
    /// `None` otherwise.
    pub state: Option<u32>,
}

/// One sequence's share of a draft pass (DeepSeek's multi-token prediction layer), run right after
/// the forward pass it reads: the draft layer's rows at the first `next.len()` positions of the
/// forward pass's `step`-th sequence, row `j` reading the main model's final hidden state there and
/// the token that follows it (`next[j]`). Its KV is stored as the cache's last layer. With `guesses`
/// `n > 0`, the last row's logits (the guess at the token after `next`'s last) come back, then the
/// layer runs `n - 1` more rows after it, each at the next position, reading the previous row's
/// output (its shared-head norm's, as SGLang chains its draft steps) and the previous guess (the
/// greedy pick of its logits): `n` chained guesses, as far as the block table reaches.
#[derive(Debug, Clone, Copy)]
pub struct DraftStep<'a> {
    /// The sequence's index in the last forward pass's steps.
    pub step: usize,
    /// The token after each row's position, from that step's `start_pos` on (at most its row count).
    pub next: &'a [u32],
    /// Covers every position up to the last row's (the forward pass's table, or a longer one).
    pub block_table: &'a [BlockId],
    pub guesses: usize,
}

/// The element type KV memory holds. The 16-bit types halve the bytes decode attention reads, the pool
/// holds and a PD transfer moves; values are computed in f32 and rounded (to nearest even) when stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// The reference: K and V exactly as computed.
    F32,
    /// IEEE half: 11 significant bits, up to 65,504 (llama.cpp's default KV type).
    F16,
    /// bfloat16: f32's range, 8 significant bits.
    Bf16,
}

impl KvDtype {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The name `--kv-dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::Bf16),
            _ => Err(ModelError::Unsupported {
                field: "KV dtype".into(),
                value: format!("{s} (f32, f16 or bf16)"),
            }),
        }
    }
}

/// Shape of the KV memory a backend owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
    /// Each position holds one latent per layer (multi-head latent attention: `num_kv_heads` 1,
    /// `head_dim` the latent's width, no separate V) instead of K and V.
    pub latent: bool,
}

impl KvLayout {
    /// The layout of `num_blocks` blocks of `block_size` tokens of `dtype` values for a model (not
    /// DeepSeek V4, whose layers keep different rows: `V4Backend::layout`).
    pub fn for_model(
        cfg: &crate::ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> KvLayout {
        let (head_dim, latent) = match &cfg.mla {
            Some(m) => (m.row_width(), true),
            None => (cfg.head_dim, false),
        };
        KvLayout {
            num_blocks,
            block_size,
            // The draft layer's KV is one more layer's.
            num_layers: cfg.num_layers + cfg.draft_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim,
            dtype,
            latent,
        }
    }

    /// Rows per position and layer: K and V, or one latent.
    pub fn parts(&self) -> usize {
        if self.latent {
            1
        } else {
            2
        }
    }

    /// Values in one block (K and V, or the latent, of every layer).
    pub fn block_values(&self) -> usize {
        self.num_layers * self.parts() * self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Bytes of KV one token holds over every layer.
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * self.parts() * self.num_kv_heads * self.head_dim * self.dtype.bytes()
    }

    /// Bytes of one block as [`Backend::read_block`] gives it.
    pub fn block_bytes(&self) -> usize {
        self.block_values() * self.dtype.bytes()
    }
}

/// Per-request state a backend keeps outside the paged blocks (DeepSeek V4's window rings and its
/// compressors' partial groups), as whole blocks after the pool's: slot `s` is the `blocks` blocks
/// from `first + s * blocks`. They are read, written and copied as blocks ([`Backend::read_block`],
/// [`Backend::write_block`], [`Backend::copy_blocks`]), so a state moves between workers and into
/// restore points as blocks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvState {
    pub slots: usize,
    /// Blocks each slot takes.
    pub blocks: usize,
    /// The first slot's first block: the number of paged blocks.
    pub first: usize,
    /// Bytes of one state (its slot's blocks hold them, rounded up).
    pub bytes: usize,
    /// Positions a request may be cut back below what it computed (rejected draft tokens) with its
    /// state still exact.
    pub rewind_tokens: usize,
}

impl KvState {
    /// Slot `slot`'s blocks, in order.
    pub fn slot_blocks(&self, slot: u32) -> impl Iterator<Item = BlockId> {
        let first = self.first + slot as usize * self.blocks;
        (first..first + self.blocks).map(|b| BlockId(b as u32))
    }
}

/// KV memory a backend is given instead of allocating its own (shared memory that a same-host peer
/// reads, say): bytes the backend views as values of its layout's dtype.
pub trait KvStore: Send + Sync + std::fmt::Debug {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// Runs batch steps over paged KV memory the backend owns, indexed by kvcache [`BlockId`]s.
pub trait Backend: Send {
    fn kv_layout(&self) -> KvLayout;

    /// Runs one step for every sequence in `steps` and returns, in order, the logits of each row a step
    /// asked for (`vocab_size` values each; a step's rows in position order).
    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError>;

    /// Runs one step like [`forward`](Self::forward), but returns each wanted row's greedy pick (the
    /// lowest id of the largest logit) and its log-probability under the model (the logit minus the
    /// row's log-sum-exp) instead of its logits. The default picks on the host from `forward`'s
    /// logits, exactly as [`Sampler`](crate::Sampler) picks for a greedy request; the GPU backend
    /// picks on the device, so only these pairs leave it.
    fn forward_greedy(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<(u32, f32)>, ModelError> {
        Ok(self.forward(steps)?.iter().map(|l| crate::sampling::greedy_pick(l)).collect())
    }

    /// Performs copy-on-write copies from the KV cache's `take_copies` (whole blocks). An error means
    /// the copies may be partly done: the step that needed them must not run.
    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), ModelError>;

    /// Copies one block's KV into `out`: `kv_layout().block_bytes()` bytes, little-endian values of the layout's dtype in
    /// the layout `[layer][k|v][position][kv head][head dim]` (a latent layout: `[layer][position][latent]`),
    /// for sending to a peer.
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), ModelError>;

    /// Stores one block's KV received from a peer (same layout as [`read_block`](Self::read_block)).
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), ModelError>;

    /// One block's KV where it lies in host memory (what [`read_block`](Self::read_block) would copy),
    /// for a backend whose KV is there (the transfer's checksum reads it in place); `None` otherwise.
    fn block_bytes(&self, block: BlockId) -> Option<&[u8]> {
        let _ = block;
        None
    }

    /// [`block_bytes`](Self::block_bytes), to store a block received from a peer in place (the
    /// transfer copies and checksums it in one pass).
    fn block_bytes_mut(&mut self, block: BlockId) -> Option<&mut [u8]> {
        let _ = block;
        None
    }

    /// The per-request state this backend keeps, if any: then every step names its sequence's slot
    /// ([`SeqStep::state`]), and [`kv_layout`](Self::kv_layout)'s `num_blocks` counts the state's
    /// blocks too.
    fn kv_state(&self) -> Option<KvState> {
        None
    }

    /// Draft layers this backend runs in [`draft`](Self::draft) (0: none; DeepSeek's multi-token
    /// prediction layer: 1).
    fn draft_layers(&self) -> usize {
        0
    }

    /// Runs the draft layer over rows of the last [`forward`](Self::forward) (or
    /// [`forward_greedy`](Self::forward_greedy)) pass, which it must directly follow, and returns the
    /// logits of each guess of each step that asks for them, in order (fewer than `guesses` for a step
    /// whose block table ends first). Errors where the backend has no draft
    /// layer or a step does not match the last pass.
    fn draft(&mut self, steps: &[DraftStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let _ = steps;
        Err(ModelError::Unsupported { field: "draft layer".into(), value: "this backend".into() })
    }

    /// The row count a step verifying drafts is cheapest in multiples of: its weight products work
    /// on tiles of this many rows, so a step one row past a multiple pays for a whole tile's weight
    /// unpacking more (a drafter sizes its drafts to fill the tiles). 1: no such steps.
    fn verify_rows_multiple(&self) -> usize {
        1
    }
}

/// Checks a block id and a buffer length in bytes against a layout.
pub(crate) fn check_block(layout: &KvLayout, block: BlockId, len: usize) -> Result<(), ModelError> {
    if block.0 as usize >= layout.num_blocks || len != layout.block_bytes() {
        return Err(ModelError::InvalidInput {
            problem: format!(
                "{block} with {len} bytes; the pool has {} blocks of {} bytes",
                layout.num_blocks,
                layout.block_bytes()
            ),
        });
    }
    Ok(())
}

/// Checks a batch step against a model's vocabulary and context and the KV pool: every problem that
/// would make a backend read out of bounds is an error naming it.
pub(crate) fn check_steps(
    cfg: &crate::ModelConfig,
    layout: &KvLayout,
    steps: &[SeqStep<'_>],
) -> Result<(), ModelError> {
    let (vocab_size, max_positions) = (cfg.vocab_size, cfg.max_position_embeddings);
    let bad = |problem: String| Err(ModelError::InvalidInput { problem });
    for (i, s) in steps.iter().enumerate() {
        let end = s.start_pos + s.tokens.len();
        if s.tokens.is_empty() {
            return bad(format!("step {i} has no tokens"));
        }
        if s.logits > s.tokens.len() {
            return bad(format!(
                "step {i} asks for {} rows of logits from {} tokens",
                s.logits,
                s.tokens.len()
            ));
        }
        if end > max_positions {
            return bad(format!("positions up to {end} exceed the context of {max_positions}"));
        }
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return bad(format!("token id {t} is outside the vocabulary of {vocab_size}"));
        }
        if s.block_table.len() * layout.block_size < end {
            return bad(format!("block table of {} blocks cannot hold {end} positions", s.block_table.len()));
        }
        // With a sliding window, blocks before the first position the step sees may have been given
        // back (`BlockId::RELEASED`); every other block must be in the pool.
        let seen = cfg.sliding_window.map_or(0, |w| (s.start_pos + 1).saturating_sub(w) / layout.block_size);
        let outside =
            |(i, b): &(usize, &BlockId)| !(b.is_released() && *i < seen) && b.0 as usize >= layout.num_blocks;
        if let Some((_, b)) = s.block_table.iter().enumerate().find(outside) {
            return bad(format!("{b} is outside the pool of {}", layout.num_blocks));
        }
    }
    Ok(())
}
