//! Simulation harness: request traces driven through the scheduler on a virtual clock with a fake model
//! whose step cost grows with the tokens in the step. After every step: invariants hold, the budget is
//! respected. At the end: every admitted request reached exactly one terminal state, within its
//! deadline plus one step, and all KV is back.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdserve_kvcache::{KvConfig, KvGroups, LayerKind};
use pdserve_scheduler::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Debug, Clone)]
struct Arrival {
    at_ms: u64,
    req: NewRequest,
    abort_at_ms: Option<u64>,
}

/// Trace shapes.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// Everything at once.
    Burst,
    /// Steady arrivals, mixed sizes.
    Steady,
    /// Long prompts (chunked prefill) and long generations.
    Long,
    /// Tight deadlines for most requests.
    DeadlineStorm,
    /// Many aborts.
    Aborts,
}

fn trace(shape: Shape, n: u64, seed: u64, t0: Instant) -> Vec<Arrival> {
    let mut rng = Rng(seed | 1);
    (0..n)
        .map(|i| {
            let at_ms = match shape {
                Shape::Burst => 0,
                _ => i * rng.range(1, 20),
            };
            let (prompt_len, max_tokens) = match shape {
                Shape::Long => (rng.range(200, 1500), rng.range(50, 400)),
                _ => (rng.range(1, 200), rng.range(1, 120)),
            };
            let deadline_ms = match shape {
                Shape::DeadlineStorm => rng.range(5, 200),
                _ => rng.range(500, 20_000),
            };
            let queue_ms = rng.range(deadline_ms / 4, deadline_ms);
            let abort_pct = if matches!(shape, Shape::Aborts) { 40 } else { 5 };
            let abort_at_ms = rng.chance(abort_pct).then(|| at_ms + rng.range(0, 300));
            // Prompts of a few families share prefixes, so the prefix cache is exercised.
            let family = rng.range(0, 3) as u32;
            let prompt: Vec<u32> = (0..prompt_len as u32)
                .map(|j| if j < 64 { family * 100 + j } else { 10_000 + (i as u32) * 7 + j })
                .collect();
            let start = t0 + Duration::from_millis(at_ms);
            Arrival {
                at_ms,
                req: NewRequest {
                    id: RequestId(i),
                    prompt,
                    max_tokens: max_tokens as usize,
                    queue_deadline: start + Duration::from_millis(queue_ms),
                    deadline: start + Duration::from_millis(deadline_ms),
                    kv: KvSource::Compute,
                    priority: 0,
                },
                abort_at_ms,
            }
        })
        .collect()
}

struct Report {
    admitted: usize,
    rejected: usize,
    outcomes: HashMap<&'static str, usize>,
    preemptions: u64,
    steps: u64,
}

fn run(shape: Shape, n: u64, seed: u64, config: SchedulerConfig, blocks: u32) -> Report {
    let t0 = Instant::now();
    let kv = KvGroups::single(KvConfig { num_blocks: blocks, block_size: 16 }, LayerKind::Full).unwrap();
    let mut s = Scheduler::new(config.clone(), kv, t0);
    let mut arrivals = trace(shape, n, seed, t0);
    arrivals.sort_by_key(|a| a.at_ms);
    let deadlines: HashMap<RequestId, Instant> =
        arrivals.iter().map(|a| (a.req.id, a.req.deadline)).collect();
    let mut aborts: Vec<(u64, RequestId)> =
        arrivals.iter().filter_map(|a| a.abort_at_ms.map(|t| (t, a.req.id))).collect();
    aborts.sort();
    let mut rng = Rng(seed.wrapping_mul(31) | 1);
    let mut now_ms = 0u64;
    let mut next_arrival = 0;
    let mut admitted: HashMap<RequestId, Option<Exit>> = HashMap::new();
    let mut rejected = 0;
    let max_step_ms = 5 + config.batch_tokens_max as u64 / 50;
    let mut steps = 0u64;
    for _ in 0..200_000 {
        let now = t0 + Duration::from_millis(now_ms);
        while next_arrival < arrivals.len() && arrivals[next_arrival].at_ms <= now_ms {
            let a = arrivals[next_arrival].clone();
            next_arrival += 1;
            match s.handle_request(a.req.clone(), now) {
                Ok(()) => {
                    admitted.insert(a.req.id, None);
                }
                Err(_) => rejected += 1,
            }
        }
        while aborts.first().is_some_and(|(t, _)| *t <= now_ms) {
            let (_, id) = aborts.remove(0);
            s.handle_abort(id, now);
        }
        // Some decodes get drafts (speculative decoding), of which the fake model accepts a random prefix.
        let mut draft_rng = Rng(rng.next() | 1);
        let batch = s.poll_batch_drafting(now, config.batch_tokens_max, &mut |_, tokens, room| {
            let n = if draft_rng.chance(50) { draft_rng.range(1, 6) as usize } else { 0 };
            tokens.iter().rev().take(n.min(room)).copied().collect()
        });
        record(&mut s, &mut admitted, &deadlines, now, max_step_ms);
        let tokens: usize = batch.iter().map(|i| i.num_tokens).sum();
        assert!(tokens <= config.batch_tokens_max, "budget {} exceeded: {tokens}", config.batch_tokens_max);
        let mut ids: Vec<RequestId> = batch.iter().map(|i| i.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), batch.len(), "a request twice in one step");
        // The fake model: 5 ms plus 1 ms per 50 tokens; sometimes it stops a generation early.
        let cost = if batch.is_empty() { 1 } else { 5 + tokens as u64 / 50 };
        let sampled: Vec<Sampled> = batch
            .iter()
            .filter(|i| i.sample)
            .map(|i| Sampled {
                id: i.id,
                token: rng.range(100, 40_000) as u32,
                stop: rng.chance(2),
                drafts_accepted: rng.range(0, i.draft as u64) as usize,
            })
            .collect();
        now_ms += cost;
        let now = t0 + Duration::from_millis(now_ms);
        s.handle_step_result(&sampled, now);
        s.check_invariants().unwrap_or_else(|e| panic!("{shape:?} seed {seed} at {now_ms} ms: {e}"));
        steps += 1;
        record(&mut s, &mut admitted, &deadlines, now, max_step_ms);
        if next_arrival == arrivals.len() && s.is_empty() {
            break;
        }
    }
    assert!(s.is_empty(), "{shape:?}: work left after the step bound: {:?}", s.stats());
    let kv = s.kv().stats();
    assert_eq!(kv.sequences + kv.leases, 0);
    assert_eq!(kv.blocks_free + kv.owned(pdserve_kvcache::OwnerKind::Cache), kv.blocks_total, "KV leaked");
    let mut outcomes = HashMap::new();
    for (id, o) in &admitted {
        let o = o.as_ref().unwrap_or_else(|| panic!("{id} never finished"));
        let word = match o {
            Exit::Completed(_) | Exit::PrefillDone { .. } => "completed",
            Exit::Cancelled => "cancelled",
            Exit::TimedOut { .. } => "timed_out",
            Exit::Failed { .. } => "failed",
        };
        *outcomes.entry(word).or_insert(0) += 1;
    }
    Report { admitted: admitted.len(), rejected, outcomes, preemptions: s.stats().preemptions_total, steps }
}

/// Takes the scheduler's events at `now`: each admitted request ends once, at most one step late.
fn record(
    s: &mut Scheduler,
    admitted: &mut HashMap<RequestId, Option<Exit>>,
    deadlines: &HashMap<RequestId, Instant>,
    now: Instant,
    max_step_ms: u64,
) {
    while let Some(e) = s.poll_event() {
        if let Event::Finished { id, outcome, .. } = e {
            let slot = admitted.get_mut(&id).unwrap_or_else(|| panic!("event for unknown {id}"));
            assert!(slot.is_none(), "{id} finished twice");
            let late = now.saturating_duration_since(deadlines[&id]);
            assert!(
                late <= Duration::from_millis(max_step_ms),
                "{id} ended {late:?} after its deadline ({outcome:?})"
            );
            *slot = Some(outcome);
        }
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        queued_requests_max: 64,
        running_requests_max: 16,
        batch_tokens_max: 512,
        prefill_chunk_tokens_max: 128,
        context_tokens_max: 4096,
        attention_cost_positions: Some(1000),
        ..SchedulerConfig::default()
    }
}

#[test]
fn burst() {
    let r = run(Shape::Burst, 300, 1, config(), 256);
    assert!(r.rejected > 0, "a burst of 300 over a queue of 64 must see 429s");
    assert_eq!(r.admitted + r.rejected, 300);
    assert!(r.outcomes["completed"] > 0);
}

#[test]
fn steady_mixed() {
    for seed in 1..=5 {
        let r = run(Shape::Steady, 400, seed, config(), 256);
        assert!(
            r.outcomes.get("completed").copied().unwrap_or(0) > r.admitted / 2,
            "seed {seed}: {:?}",
            r.outcomes
        );
    }
}

#[test]
fn long_prompts_and_generations_under_kv_pressure() {
    let r = run(Shape::Long, 60, 7, config(), 160);
    assert!(r.preemptions > 0, "expected KV pressure");
    assert!(r.outcomes.get("completed").copied().unwrap_or(0) > 0, "{:?}", r.outcomes);
    assert!(r.steps > 100);
}

#[test]
fn deadline_storm() {
    let r = run(Shape::DeadlineStorm, 300, 3, config(), 256);
    assert!(r.outcomes.get("timed_out").copied().unwrap_or(0) > 0, "{:?}", r.outcomes);
}

#[test]
fn aborts_everywhere() {
    let r = run(Shape::Aborts, 300, 11, config(), 256);
    assert!(r.outcomes.get("cancelled").copied().unwrap_or(0) > 20, "{:?}", r.outcomes);
}

#[test]
fn randomized_configurations() {
    let mut rng = Rng(0xfeed);
    for seed in 0..12 {
        let c = SchedulerConfig {
            queued_requests_max: rng.range(1, 40) as usize,
            running_requests_max: rng.range(1, 24) as usize,
            batch_tokens_max: rng.range(16, 600) as usize,
            prefill_chunk_tokens_max: rng.range(1, 256) as usize,
            context_tokens_max: 2048,
            admission_watermark_blocks: rng.range(0, 4) as usize,
            // A third of them with a sliding window, giving back blocks as they go.
            sliding_window: (seed % 3 == 0).then(|| rng.range(1, 64) as usize),
            ..SchedulerConfig::default()
        };
        let shape = [Shape::Burst, Shape::Steady, Shape::DeadlineStorm, Shape::Aborts][seed as usize % 4];
        run(shape, 150, seed + 100, c, rng.range(130, 300) as u32);
    }
}
