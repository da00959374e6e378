//! Arbitrary bytes decoded as scheduler inputs (requests, aborts, steps with arbitrary stops, time
//! jumps): invariants hold after every step, and once time passes every deadline, nothing is left.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use pdserve_kvcache::{KvConfig, KvGroups, LayerKind};
use pdserve_scheduler::*;

fuzz_target!(|data: &[u8]| {
    let t0 = Instant::now();
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next();
    let Some(shape) = next() else { return };
    let config = SchedulerConfig {
        queued_requests_max: 1 + usize::from(shape % 8),
        running_requests_max: 1 + usize::from(shape / 8 % 8),
        batch_tokens_max: 8 + usize::from(shape % 64),
        prefill_chunk_tokens_max: 1 + usize::from(shape % 32),
        context_tokens_max: 512,
        attention_cost_positions: (shape & 0x40 != 0).then_some(16 + usize::from(shape % 50)),
        ..SchedulerConfig::default()
    };
    let blocks = KvConfig { num_blocks: 16 + u32::from(shape % 48), block_size: 4 };
    let kv = KvGroups::single(blocks, LayerKind::Full).unwrap();
    let mut s = Scheduler::new(config, kv, t0);
    let mut now_ms = 0u64;
    let mut id = 0u64;
    let mut live = std::collections::HashSet::new();
    while let Some(op) = next() {
        let now = t0 + Duration::from_millis(now_ms);
        match op % 4 {
            0 => {
                let (Some(len), Some(max), Some(dl)) = (next(), next(), next()) else { break };
                id += 1;
                let deadline = now + Duration::from_millis(u64::from(dl) * 4);
                let req = NewRequest {
                    id: RequestId(id),
                    prompt: (0..u32::from(len)).map(|j| j % 7).collect(),
                    max_tokens: usize::from(max),
                    queue_deadline: deadline,
                    deadline,
                    kv: KvSource::Compute,
                    // Priorities -1..2: admission by priority class keeps every invariant too.
                    priority: i32::from(len % 4) - 1,
                };
                if s.handle_request(req, now).is_ok() {
                    live.insert(id);
                }
            }
            1 => {
                let Some(which) = next() else { break };
                s.handle_abort(RequestId(u64::from(which) % (id + 1)), now);
            }
            2 => {
                let Some(stops) = next() else { break };
                // Drafts (speculative decoding): the byte's low bits say how many, the engine accepts
                // a prefix of them chosen by the same byte.
                let draft = usize::from(next().unwrap_or(0));
                let batch = s.poll_batch_drafting(now, usize::MAX, &mut |_, tokens, _| {
                    tokens.iter().rev().take(draft % 5).copied().collect()
                });
                let sampled: Vec<Sampled> = batch
                    .iter()
                    .enumerate()
                    .filter(|(_, i)| i.sample)
                    .map(|(k, i)| Sampled {
                        id: i.id,
                        token: k as u32,
                        stop: stops >> (k % 8) & 1 == 1,
                        drafts_accepted: (draft >> 3) % (i.draft + 1),
                    })
                    .collect();
                s.handle_step_result(&sampled, now);
            }
            _ => now_ms += u64::from(next().unwrap_or(1)),
        }
        s.check_invariants().unwrap();
        while let Some(e) = s.poll_event() {
            if let Event::Finished { id, .. } = e {
                assert!(live.remove(&id.0), "{id} finished twice or was never admitted");
            }
        }
    }
    // Past every deadline, one poll ends everything.
    s.poll_batch(t0 + Duration::from_millis(now_ms + 2000));
    s.handle_step_result(&[], t0);
    while let Some(e) = s.poll_event() {
        if let Event::Finished { id, .. } = e {
            assert!(live.remove(&id.0));
        }
    }
    assert!(live.is_empty() && s.is_empty());
    s.check_invariants().unwrap();
});
