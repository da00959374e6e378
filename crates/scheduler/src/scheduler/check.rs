//! The scheduler's invariants, checked by tests and fuzzing after every operation.

use std::collections::HashSet;

use super::{Scheduler, State};

impl Scheduler {
    /// Checks that every live request is in exactly one place matching its state, that the KV cache
    /// holds exactly the running requests' sequences and the outstanding leases, and the cache's own
    /// invariants. For tests and fuzzing.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = HashSet::new();
        for (list, name) in [
            (self.queued.iter().collect::<Vec<_>>(), "queued"),
            (self.running.iter().collect(), "running"),
            (self.awaiting.iter().collect(), "awaiting"),
        ] {
            for id in list {
                if !seen.insert(*id) {
                    return Err(format!("{id} is in two places (again in {name})"));
                }
                let r = self.reqs.get(id).ok_or_else(|| format!("{id} in {name} is not live"))?;
                let ok = matches!(
                    (name, r.state),
                    ("queued", State::Queued)
                        | ("running", State::Running { .. })
                        | ("awaiting", State::AwaitingKv { .. })
                );
                if !ok {
                    return Err(format!("{id} is in {name} but its state is {:?}", r.state));
                }
            }
        }
        if self.deadlines.len() != self.reqs.len() {
            return Err(format!(
                "{} deadline entries for {} requests",
                self.deadlines.len(),
                self.reqs.len()
            ));
        }
        let waiting_with_deadline = self.reqs.values().filter(|r| r.wait_until.is_some()).count();
        if self.waits.len() != waiting_with_deadline {
            return Err(format!("{} wait entries for {waiting_with_deadline} waits", self.waits.len()));
        }
        if seen.len() != self.reqs.len() {
            return Err(format!("{} live requests, {} placed", self.reqs.len(), seen.len()));
        }
        let kv = self.kv.stats();
        if kv.sequences != self.running.len() {
            return Err(format!("{} KV sequences for {} running requests", kv.sequences, self.running.len()));
        }
        for id in &self.running {
            let r = &self.reqs[id];
            let computed = self.kv.computed_tokens(r.seq).map_err(|e| e.to_string())?;
            if computed > r.tokens.len() {
                return Err(format!("{id}: {computed} computed of {} tokens", r.tokens.len()));
            }
            // Between steps the sequence holds the request's tokens exactly: no draft outlives its step.
            let held = self.kv.tokens(r.seq).map_err(|e| e.to_string())?;
            if self.in_flight.is_empty() && held != r.tokens.as_slice() {
                return Err(format!(
                    "{id}: the KV sequence holds {} tokens, the request {}",
                    held.len(),
                    r.tokens.len()
                ));
            }
        }
        if kv.leases != self.awaiting.len() + self.leases_out.len() {
            return Err(format!(
                "{} leases, {} awaiting + {} out",
                kv.leases,
                self.awaiting.len(),
                self.leases_out.len()
            ));
        }
        if self.running.len() > self.config.running_requests_max {
            return Err(format!(
                "{} running over the cap {}",
                self.running.len(),
                self.config.running_requests_max
            ));
        }
        self.kv.check_invariants()
    }
}
