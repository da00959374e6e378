//! Scheduling overhead: one `poll_batch` + `handle_step_result` with 256 running and 1,000 waiting
//! requests, and a 10,000-request simulated trace end to end (the model is free, so this is all
//! scheduler and KV bookkeeping). Run: `cargo bench -p pdserve-scheduler`. Writes
//! `target/bench/scheduler.json`.

use std::time::{Duration, Instant};

use pdserve_kvcache::{KvConfig, KvGroups, LayerKind};
use pdserve_scheduler::*;

fn request(id: u64, t0: Instant, prompt_len: u32, max_tokens: usize) -> NewRequest {
    let far = t0 + Duration::from_secs(3600);
    NewRequest {
        id: RequestId(id),
        prompt: (0..prompt_len).map(|j| (id as u32).wrapping_mul(31).wrapping_add(j)).collect(),
        max_tokens,
        queue_deadline: far,
        deadline: far,
        kv: KvSource::Compute,
        priority: 0,
    }
}

fn step(s: &mut Scheduler, now: Instant) -> usize {
    let batch = s.poll_batch(now);
    let sampled: Vec<Sampled> = batch
        .iter()
        .filter(|i| i.sample)
        .map(|i| Sampled { id: i.id, token: 7, stop: false, drafts_accepted: 0 })
        .collect();
    s.handle_step_result(&sampled, now);
    while s.poll_event().is_some() {}
    batch.len()
}

fn main() {
    let t0 = Instant::now();
    // Steady state: 256 decoding, 1,000 waiting (the running cap holds them back).
    let config = SchedulerConfig {
        queued_requests_max: 2000,
        running_requests_max: 256,
        batch_tokens_max: 4096,
        prefill_chunk_tokens_max: 512,
        context_tokens_max: 1 << 20,
        ..SchedulerConfig::default()
    };
    let kv = KvGroups::single(KvConfig { num_blocks: 200_000, block_size: 16 }, LayerKind::Full).expect("kv");
    let mut s = Scheduler::new(config, kv, t0);
    for i in 0..1256 {
        s.handle_request(request(i, t0, 64, 1_000_000), t0).expect("admit");
    }
    while s.stats().running < 256 || s.kv().stats().sequences < 256 {
        step(&mut s, t0);
    }
    // Let every running request finish its prefill.
    for _ in 0..4 {
        step(&mut s, t0);
    }
    assert_eq!(s.stats().queued, 1000);
    let iters = 2000;
    let start = Instant::now();
    let mut items = 0;
    for _ in 0..iters {
        items += step(&mut s, t0);
    }
    let per_step_us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
    assert_eq!(items / iters, 256);

    // 10,000 requests end to end.
    let config = SchedulerConfig {
        queued_requests_max: 10_000,
        running_requests_max: 128,
        batch_tokens_max: 2048,
        ..SchedulerConfig::default()
    };
    let kv = KvGroups::single(KvConfig { num_blocks: 20_000, block_size: 16 }, LayerKind::Full).expect("kv");
    let mut s = Scheduler::new(config, kv, t0);
    for i in 0..10_000 {
        s.handle_request(request(i, t0, 32 + (i % 200) as u32, 16 + (i % 64) as usize), t0).expect("admit");
    }
    let start = Instant::now();
    let mut steps = 0u64;
    while !s.is_empty() {
        step(&mut s, t0);
        steps += 1;
    }
    let trace_s = start.elapsed().as_secs_f64();
    println!("step with 256 running + 1000 queued: {per_step_us:>8.2} us/step   (target well under 50)");
    println!(
        "10,000-request trace:                 {trace_s:>8.3} s ({steps} steps, {:.1} us/step)",
        trace_s * 1e6 / steps as f64
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join("scheduler.json"),
        format!("{{\"step_256_running_1000_waiting_us\":{per_step_us:.3},\"trace_10000_seconds\":{trace_s:.4},\"trace_steps\":{steps}}}\n"),
    );
}
