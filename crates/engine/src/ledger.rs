//! A backend's per-request state in the KV ledger: as a transfer endpoint asks it, and in the metrics.

use pdserve_kvcache::{BlockId, KvGroups, StateId, TransferId};
use pdserve_model::KvState;
use pdserve_pd_transfer::Ledger;

/// The KV ledger as the transfer endpoint asks it: group 0's blocks, and a per-request state's
/// blocks (after the pool's) as the lease's state slot, written under the slot's epoch.
pub(crate) struct StateLedger<'a>(pub &'a KvGroups, pub Option<KvState>);

impl StateLedger<'_> {
    /// The state slot `block` belongs to, if it is a state's.
    fn slot(&self, block: BlockId) -> Option<StateId> {
        let st = self.1?;
        let i = (block.0 as usize).checked_sub(st.first)?;
        Some(StateId((i / st.blocks.max(1)) as u32))
    }
}

impl Ledger for StateLedger<'_> {
    fn leased(&self, transfer: TransferId) -> bool {
        self.0.lease(transfer).is_ok()
    }
    fn holds(&self, transfer: TransferId, block: BlockId) -> bool {
        match (self.slot(block), self.0.lease(transfer)) {
            (_, Err(_)) => false,
            (Some(slot), Ok(l)) => l.state == slot,
            (None, Ok(l)) => l.groups[0].blocks.contains(&block),
        }
    }
    fn may_write(&self, transfer: TransferId, block: BlockId, epoch: u32) -> bool {
        match self.slot(block) {
            Some(slot) => self.0.check_state_write(transfer, slot, epoch).is_ok(),
            None => self.0.group(0).may_write(transfer, block, epoch),
        }
    }
}

/// The state slots' gauges and restore counter (nothing for a model without state).
pub(crate) fn publish_states(kv: &KvGroups, metrics: &crate::metrics::Metrics) {
    let s = kv.state_stats();
    if s.slots == 0 {
        return;
    }
    for (state, v) in
        [("total", s.slots), ("free", s.free), ("parked", s.parked), ("restore_points", s.restore_points)]
    {
        if let Ok(g) = metrics.state_slots.with(&[state]) {
            g.set(v as f64);
        }
    }
    metrics.state_restores.add(s.restore_hits_total.saturating_sub(metrics.state_restores.get()));
}
