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
    /// Return logits for the last new token.
    pub logits: bool,
}

/// Shape of the KV memory a backend owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 values in one block (K and V, every layer).
    pub fn block_floats(&self) -> usize {
        self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// Runs batch steps over paged KV memory the backend owns, indexed by kvcache [`BlockId`]s.
pub trait Backend: Send {
    fn kv_layout(&self) -> KvLayout;

    /// Runs one step for every sequence in `steps` and returns, in order, the logits of each step that
    /// asked for them.
    fn forward(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError>;

    /// Performs copy-on-write copies from the KV cache's `take_copies` (whole blocks).
    fn copy_blocks(&mut self, copies: &[BlockCopy]);

    /// One block's KV, for sending to a peer.
    fn block_data(&self, block: BlockId) -> &[f32];

    /// One block's KV, for receiving from a peer.
    fn block_data_mut(&mut self, block: BlockId) -> &mut [f32];
}
