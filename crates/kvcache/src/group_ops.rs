//! What a scheduler asks of its KV ledger, over every group: sizes and room, the cache's events and
//! offload tier (group 0's: a tier serves single-group models), and the plain cache as the case of one
//! group ([`KvGroups::single`]).

use crate::groups::{GroupSpec, GroupsConfig, KvGroups, LayerKind};
use crate::{CacheEvent, KvCache, KvConfig, KvError, KvStats, SeqId, TierConfig, TierCopy, TierStats};

impl KvGroups {
    /// The plain cache as one group of `kind` and no state: what every model but DeepSeek V4 runs on.
    pub fn single(config: KvConfig, kind: LayerKind) -> Result<KvGroups, KvError> {
        KvGroups::new(GroupsConfig {
            block_tokens: config.block_size,
            groups: vec![GroupSpec {
                name: "kv".into(),
                kind,
                layers: 1,
                row_bytes: 0,
                num_blocks: config.num_blocks,
            }],
            state_bytes: 0,
            state_slots: 0,
            state_rewind_tokens: 0,
        })
    }

    /// The one group of a single-group, stateless ledger: it answers as the plain cache does (its
    /// offload tier included).
    pub(crate) fn plain(&self) -> Option<&KvCache> {
        (self.groups.len() == 1 && self.config.state_bytes == 0).then(|| &self.groups[0])
    }

    pub(crate) fn plain_mut(&mut self) -> Option<&mut KvCache> {
        (self.groups.len() == 1 && self.config.state_bytes == 0).then(|| &mut self.groups[0])
    }

    /// Tokens a block covers (in every group).
    pub fn block_size(&self) -> usize {
        self.config.block_tokens as usize
    }

    /// Blocks `tokens` tokens need in each group.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size())
    }

    /// Group 0's counts (each group's: [`group_stats`](Self::group_stats)).
    pub fn stats(&self) -> KvStats {
        self.groups[0].stats()
    }

    /// Blocks a request could still take in every group (the fewest any group has).
    pub fn blocks_available(&self) -> usize {
        self.groups.iter().map(KvCache::blocks_available).min().unwrap_or(0)
    }

    /// Records group 0's prefix-cache events, at most `max` untaken (see [`KvCache::record_events`]);
    /// every group caches the same prefixes.
    pub fn record_events(&mut self, max: usize) {
        self.groups[0].record_events(max);
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.groups[0].take_events()
    }

    pub fn events_dropped(&self) -> u64 {
        self.groups[0].events_dropped()
    }

    /// Turns on the offload tier (see [`KvCache::enable_tier`]): a single-group, stateless ledger's
    /// only; refused (`InvalidConfig`) for others.
    pub fn enable_tier(&mut self, config: TierConfig) -> Result<(), KvError> {
        let (num_blocks, block_size) = (self.groups[0].config().num_blocks, self.config.block_tokens);
        let g = self.plain_mut().ok_or(KvError::InvalidConfig { num_blocks, block_size })?;
        g.enable_tier(config);
        Ok(())
    }

    pub fn drop_tier(&mut self) {
        self.groups[0].drop_tier();
    }

    pub fn take_tier_copies(&mut self) -> Vec<TierCopy> {
        self.groups[0].take_tier_copies()
    }

    pub fn tier_stats(&self) -> TierStats {
        self.groups[0].tier_stats()
    }

    /// Gives back `seq`'s blocks wholly before its last `window` positions in every group that is
    /// not compressed (a single-group model with a sliding window; [`release_outside_windows`]
    /// (Self::release_outside_windows) reads each group's own window).
    pub fn release_outside_window(&mut self, seq: SeqId, window: usize) -> Result<usize, KvError> {
        self.state(seq)?;
        let mut released = 0;
        for (g, spec) in self.groups.iter_mut().zip(&self.config.groups) {
            if !matches!(spec.kind, LayerKind::Compressed { .. }) {
                released += g.release_outside_window(seq, window)?;
            }
        }
        Ok(released)
    }
}
