//! The request ledger: where every live request is, since when, and until when it may stay.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdserve_api::Stage;

use crate::TelemetryError;

/// One live request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    pub id: String,
    pub stage: Stage,
    pub stage_since: Instant,
    pub admitted_at: Instant,
    pub deadline: Instant,
    /// Who holds it now: a worker URL, a connection, a transfer peer.
    pub owner: String,
    pub tokens_in: u32,
    pub tokens_out: u32,
    pub kv_blocks: u32,
    /// Its trace's id (hex), where it is traced (`--otlp-traces-endpoint`).
    pub trace_id: Option<String>,
    /// What it waits for at its stage, where it is not being computed: `kv_blocks`, `running_slot`,
    /// `step_budget` (a queue), `decode_pull` (prefill KV held for the decode worker), `kv_pull`
    /// (a decode worker receiving it).
    pub waiting_for: Option<&'static str>,
}

/// An entry the watchdog found past its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overdue {
    pub id: String,
    pub stage: Stage,
    pub overdue_by: Duration,
}

/// Every live request of one process. Sans-IO: `now` comes in as an argument; the caller owns
/// synchronization (one lock around it, or one thread).
#[derive(Debug)]
pub struct RequestLedger {
    process: String,
    capacity: usize,
    entries: HashMap<String, LedgerEntry>,
}

impl RequestLedger {
    /// `process` names this process in `/debug/requests` (`"decode-0"`); `capacity` bounds the entries.
    pub fn new(process: &str, capacity: usize) -> Self {
        RequestLedger { process: process.to_owned(), capacity, entries: HashMap::new() }
    }

    pub fn process(&self) -> &str {
        &self.process
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records a new live request.
    pub fn admit(
        &mut self,
        id: &str,
        stage: Stage,
        now: Instant,
        deadline: Instant,
        owner: &str,
    ) -> Result<(), TelemetryError> {
        if self.entries.contains_key(id) {
            return Err(TelemetryError::DuplicateRequest { id: id.to_owned() });
        }
        if self.entries.len() >= self.capacity {
            return Err(TelemetryError::LedgerFull { capacity: self.capacity });
        }
        self.entries.insert(
            id.to_owned(),
            LedgerEntry {
                id: id.to_owned(),
                stage,
                stage_since: now,
                admitted_at: now,
                deadline,
                owner: owner.to_owned(),
                trace_id: None,
                waiting_for: None,
                tokens_in: 0,
                tokens_out: 0,
                kv_blocks: 0,
            },
        );
        Ok(())
    }

    fn entry(&mut self, id: &str) -> Result<&mut LedgerEntry, TelemetryError> {
        self.entries.get_mut(id).ok_or_else(|| TelemetryError::UnknownRequest { id: id.to_owned() })
    }

    /// Moves a request to `stage` (the stage clock restarts only when the stage changes).
    pub fn set_stage(&mut self, id: &str, stage: Stage, now: Instant) -> Result<(), TelemetryError> {
        let e = self.entry(id)?;
        if e.stage != stage {
            e.stage = stage;
            e.stage_since = now;
        }
        Ok(())
    }

    pub fn set_owner(&mut self, id: &str, owner: &str) -> Result<(), TelemetryError> {
        self.entry(id)?.owner = owner.to_owned();
        Ok(())
    }

    /// The id of the trace `id` belongs to, shown beside it.
    pub fn set_trace(&mut self, id: &str, trace_id: &str) -> Result<(), TelemetryError> {
        self.entry(id)?.trace_id = Some(trace_id.to_owned());
        Ok(())
    }

    /// What `id` waits for now (`None`: it is being computed).
    pub fn set_waiting(&mut self, id: &str, waiting_for: Option<&'static str>) -> Result<(), TelemetryError> {
        self.entry(id)?.waiting_for = waiting_for;
        Ok(())
    }

    pub fn set_counts(
        &mut self,
        id: &str,
        tokens_in: u32,
        tokens_out: u32,
        kv_blocks: u32,
    ) -> Result<(), TelemetryError> {
        let e = self.entry(id)?;
        (e.tokens_in, e.tokens_out, e.kv_blocks) = (tokens_in, tokens_out, kv_blocks);
        Ok(())
    }

    pub fn get(&self, id: &str) -> Option<&LedgerEntry> {
        self.entries.get(id)
    }

    /// Removes a request that reached its terminal state, returning its last entry.
    pub fn finish(&mut self, id: &str) -> Option<LedgerEntry> {
        self.entries.remove(id)
    }

    /// The watchdog scan: every entry whose deadline has passed, most overdue first. The caller ends
    /// each one (`timed_out` at its stage) and frees what it held; the ledger only reports.
    pub fn overdue(&self, now: Instant) -> Vec<Overdue> {
        let mut v: Vec<Overdue> = self
            .entries
            .values()
            .filter(|e| e.deadline <= now)
            .map(|e| Overdue { id: e.id.clone(), stage: e.stage, overdue_by: now.duration_since(e.deadline) })
            .collect();
        v.sort_by(|a, b| b.overdue_by.cmp(&a.overdue_by).then_with(|| a.id.cmp(&b.id)));
        v
    }

    /// Entries at least `older_than` old, oldest first.
    pub fn snapshot(&self, now: Instant, older_than: Duration) -> Vec<&LedgerEntry> {
        let mut v: Vec<&LedgerEntry> = self
            .entries
            .values()
            .filter(|e| now.saturating_duration_since(e.admitted_at) >= older_than)
            .collect();
        v.sort_by(|a, b| a.admitted_at.cmp(&b.admitted_at).then_with(|| a.id.cmp(&b.id)));
        v
    }

    /// The `/debug/requests` body of `api.md`: `{"process","now_ms","requests":[...]}`. `now_unix_ms` is
    /// the wall clock for `now_ms`; ages and the remaining `deadline_ms` (negative once passed) come
    /// from the monotonic `now`.
    pub fn debug_json(&self, now: Instant, now_unix_ms: u64, older_than: Duration) -> serde_json::Value {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let requests: Vec<serde_json::Value> = self
            .snapshot(now, older_than)
            .into_iter()
            .map(|e| {
                let remaining_ms = if e.deadline >= now {
                    ms(e.deadline - now) as i64
                } else {
                    -(ms(now - e.deadline) as i64)
                };
                let mut v = serde_json::json!({
                    "id": e.id,
                    "stage": e.stage.as_str(),
                    "stage_age_ms": ms(now.saturating_duration_since(e.stage_since)),
                    "age_ms": ms(now.saturating_duration_since(e.admitted_at)),
                    "deadline_ms": remaining_ms,
                    "worker": e.owner,
                    "tokens_in": e.tokens_in,
                    "tokens_out": e.tokens_out,
                    "kv_blocks": e.kv_blocks,
                });
                if let Some(t) = &e.trace_id {
                    v["trace_id"] = serde_json::Value::String(t.clone());
                }
                if let Some(w) = e.waiting_for {
                    v["waiting_for"] = serde_json::Value::String(w.to_owned());
                }
                v
            })
            .collect();
        // Per stage, every live request (whatever `older_than`): how many, how long the oldest has
        // been there and what it waits for, so a stalled queue shows at a glance.
        let mut stages = serde_json::Map::new();
        for stage in Stage::ALL {
            let at: Vec<&LedgerEntry> = self.entries.values().filter(|e| e.stage == stage).collect();
            let Some(oldest) =
                at.iter().min_by(|a, b| a.stage_since.cmp(&b.stage_since).then(a.id.cmp(&b.id)))
            else {
                continue;
            };
            let mut s = serde_json::json!({
                "requests": at.len(),
                "oldest_ms": ms(now.saturating_duration_since(oldest.stage_since)),
                "oldest_id": oldest.id,
            });
            if let Some(w) = oldest.waiting_for {
                s["waiting_for"] = serde_json::Value::String(w.to_owned());
            }
            stages.insert(stage.as_str().to_owned(), s);
        }
        serde_json::json!({ "process": self.process, "now_ms": now_unix_ms, "stages": stages, "requests": requests })
    }
}
