//! Admission edge cases and the roles, as tables and short scripts on a virtual clock.

use std::time::{Duration, Instant};

use pdserve_kvcache::{KvConfig, KvGroups, LayerKind, OwnerKind, TransferId};
use pdserve_scheduler::*;

fn sched(config: SchedulerConfig, blocks: u32) -> (Scheduler, Instant) {
    let t0 = Instant::now();
    let kv = KvGroups::single(KvConfig { num_blocks: blocks, block_size: 4 }, LayerKind::Full).unwrap();
    (Scheduler::new(config, kv, t0), t0)
}

fn req(id: u64, prompt_len: usize, max_tokens: usize, t0: Instant) -> NewRequest {
    let far = t0 + Duration::from_secs(60);
    NewRequest {
        id: RequestId(id),
        prompt: (0..prompt_len as u32).map(|i| i + id as u32 * 1000).collect(),
        max_tokens,
        queue_deadline: far,
        deadline: far,
        kv: KvSource::Compute,
        priority: 0,
    }
}

/// Runs steps with a fake engine that samples token 9 and never stops, until no work is left.
fn drain(s: &mut Scheduler, mut now: Instant) -> Vec<Event> {
    let mut events = Vec::new();
    for _ in 0..10_000 {
        let batch = s.poll_batch(now);
        let sampled: Vec<Sampled> = batch
            .iter()
            .filter(|i| i.sample)
            .map(|i| Sampled { id: i.id, token: 9, stop: false, drafts_accepted: 0 })
            .collect();
        s.handle_step_result(&sampled, now);
        s.check_invariants().unwrap();
        while let Some(e) = s.poll_event() {
            events.push(e);
        }
        if s.is_empty() {
            return events;
        }
        now += Duration::from_millis(10);
    }
    panic!("work never drained: {:?}", s.stats());
}

/// `Ok(())` to admit, or a check on the rejection.
type Want = Result<(), fn(&Rejection) -> bool>;

#[test]
fn admission_table() {
    let config =
        SchedulerConfig { queued_requests_max: 2, context_tokens_max: 32, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    let cases: Vec<(NewRequest, Want)> = vec![
        (req(1, 10, 22, t0), Ok(())), // exactly the context
        (
            req(2, 10, 23, t0),
            Err(|r| {
                matches!(
                    r,
                    Rejection::ContextLengthExceeded {
                        prompt_tokens: 10,
                        max_tokens: 23,
                        context_tokens: 32
                    }
                )
            }),
        ),
        (req(3, 10, 0, t0), Err(|r| matches!(r, Rejection::InvalidRequest { .. }))),
        (req(4, 0, 5, t0), Err(|r| matches!(r, Rejection::InvalidRequest { .. }))),
        (req(1, 3, 3, t0), Err(|r| matches!(r, Rejection::DuplicateId))),
        (req(5, 3, 3, t0), Ok(())), // the queue is now exactly full
        (req(6, 3, 3, t0), Err(|r| matches!(r, Rejection::QueueFull { queued: 2, limit: 2, .. }))),
    ];
    for (r, want) in cases {
        let id = r.id;
        match (s.handle_request(r, t0), want) {
            (Ok(()), Ok(())) => {}
            (Err(got), Err(check)) => assert!(check(&got), "{id}: {got:?}"),
            (got, _) => panic!("{id}: {got:?}"),
        }
    }
    assert_eq!(s.stats().rejected_total, 5);
    let rejected = s.handle_request(req(7, 3, 3, t0), t0).unwrap_err();
    let Rejection::QueueFull { retry_after, .. } = rejected else { panic!() };
    assert!(retry_after >= Duration::from_secs(1));
}

#[test]
fn a_request_larger_than_the_pool_is_rejected_not_queued_forever() {
    let (mut s, t0) = sched(SchedulerConfig::default(), 4); // 16 tokens of KV
    assert!(matches!(
        s.handle_request(req(1, 10, 7, t0), t0),
        Err(Rejection::KvCapacityExceeded { needed_blocks: 5, total_blocks: 4 })
    ));
    s.handle_request(req(2, 10, 6, t0), t0).unwrap();
    let events = drain(&mut s, t0);
    assert!(matches!(
        events[..],
        [Event::Finished { outcome: Exit::Completed(FinishReason::Length), output_tokens: 6, .. }]
    ));
}

#[test]
fn retry_after_follows_the_drain_rate() {
    let config =
        SchedulerConfig { queued_requests_max: 4, running_requests_max: 1, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    for i in 0..4 {
        s.handle_request(req(i, 4, 1, t0), t0).unwrap();
    }
    // One request finishes per 10 ms step: about 100 per second.
    let mut now = t0;
    for _ in 0..3 {
        let batch = s.poll_batch(now);
        let sampled: Vec<Sampled> =
            batch.iter().map(|i| Sampled { id: i.id, token: 1, stop: false, drafts_accepted: 0 }).collect();
        s.handle_step_result(&sampled, now);
        now += Duration::from_millis(10);
    }
    for i in 10..13 {
        s.handle_request(req(i, 4, 1, now), now).unwrap();
    }
    let Err(Rejection::QueueFull { retry_after, .. }) = s.handle_request(req(20, 4, 1, now), now) else {
        panic!()
    };
    assert_eq!(retry_after, Duration::from_secs(1), "a fast drain gives the floor of 1 s");

    // A slow drain: one request ends every 2 s, so 4 queued requests need about 8 s.
    let config =
        SchedulerConfig { queued_requests_max: 4, running_requests_max: 1, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    let mut now = t0;
    for i in 0..3 {
        s.handle_request(req(i, 4, 1, now), now).unwrap();
        let batch = s.poll_batch(now);
        let sampled: Vec<Sampled> =
            batch.iter().map(|i| Sampled { id: i.id, token: 1, stop: false, drafts_accepted: 0 }).collect();
        s.handle_step_result(&sampled, now);
        now += Duration::from_secs(2);
    }
    for i in 10..14 {
        s.handle_request(req(i, 4, 1, now), now).unwrap();
    }
    let Err(Rejection::QueueFull { retry_after, .. }) = s.handle_request(req(20, 4, 1, now), now) else {
        panic!()
    };
    // 3 finishes over 6 s (the last one 2 s ago): 0.5 per second, 4 waiting -> 8 s.
    assert_eq!(retry_after, Duration::from_secs(8));
}

#[test]
fn aborts_are_idempotent_at_every_stage() {
    let config = SchedulerConfig {
        running_requests_max: 1,
        prefill_chunk_tokens_max: 4,
        ..SchedulerConfig::default()
    };
    let (mut s, t0) = sched(config, 64);
    s.handle_request(req(1, 12, 5, t0), t0).unwrap();
    s.handle_request(req(2, 12, 5, t0), t0).unwrap();
    let batch = s.poll_batch(t0); // 1 prefilling, 2 waiting
    assert_eq!(batch.len(), 1);
    assert!(s.handle_abort(RequestId(2), t0), "abort while queued");
    assert!(s.handle_abort(RequestId(1), t0), "abort while its step is in flight");
    assert!(!s.handle_abort(RequestId(1), t0), "second abort is a no-op");
    s.handle_step_result(&[], t0);
    s.check_invariants().unwrap();
    let outcomes: Vec<Exit> = std::iter::from_fn(|| s.poll_event())
        .map(|e| match e {
            Event::Finished { outcome, .. } => outcome,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(outcomes, [Exit::Cancelled, Exit::Cancelled]);
    assert_eq!(s.kv().stats().blocks_owned[OwnerKind::Sequence as usize], 0);
}

#[test]
fn deadlines_time_out_with_the_stage() {
    let config = SchedulerConfig { running_requests_max: 1, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    let mut a = req(1, 4, 100, t0);
    a.deadline = t0 + Duration::from_millis(50);
    let mut b = req(2, 4, 100, t0);
    b.queue_deadline = t0 + Duration::from_millis(20);
    s.handle_request(a, t0).unwrap();
    s.handle_request(b, t0).unwrap();
    let mut now = t0;
    let mut ended = Vec::new();
    while ended.len() < 2 {
        let batch = s.poll_batch(now);
        let sampled: Vec<Sampled> = batch
            .iter()
            .filter(|i| i.sample)
            .map(|i| Sampled { id: i.id, token: 3, stop: false, drafts_accepted: 0 })
            .collect();
        s.handle_step_result(&sampled, now);
        while let Some(Event::Finished { id, outcome, .. }) = s.poll_event() {
            ended.push((id, outcome, now - t0));
        }
        now += Duration::from_millis(10);
        assert!(now < t0 + Duration::from_secs(1));
    }
    assert_eq!(ended[0].0, RequestId(2));
    assert_eq!(ended[0].1, Exit::TimedOut { stage: Stage::Queued });
    assert_eq!(
        ended[1],
        (RequestId(1), Exit::TimedOut { stage: Stage::Decoding }, Duration::from_millis(50))
    );
    s.check_invariants().unwrap();
    assert_eq!(s.kv().stats().sequences, 0);
}

#[test]
fn prefill_role_leases_the_kv_and_gets_it_back() {
    let config = SchedulerConfig {
        role: Role::Prefill,
        kv_lease: Duration::from_millis(100),
        ..SchedulerConfig::default()
    };
    let (mut s, t0) = sched(config, 64);
    s.handle_request(req(1, 10, 50, t0), t0).unwrap();
    s.handle_request(req(2, 10, 50, t0), t0).unwrap();
    let batch = s.poll_batch(t0);
    assert!(batch.iter().all(|i| i.sample && i.num_tokens == 10));
    s.handle_step_result(
        &[
            Sampled { id: RequestId(1), token: 42, stop: false, drafts_accepted: 0 },
            Sampled { id: RequestId(2), token: 43, stop: false, drafts_accepted: 0 },
        ],
        t0,
    );
    let mut transfers = Vec::new();
    while let Some(Event::Finished {
        outcome: Exit::PrefillDone { first_token, transfer, blocks },
        output_tokens,
        ..
    }) = s.poll_event()
    {
        assert_eq!((blocks.len(), output_tokens), (3, 1));
        assert!(first_token == 42 || first_token == 43);
        transfers.push(transfer);
    }
    assert_eq!(transfers.len(), 2);
    assert_eq!(s.kv().stats().owned(OwnerKind::Transfer), 6);
    assert!(s.handle_transfer_done(transfers[0]));
    assert!(!s.handle_transfer_done(transfers[0]));
    // The other decode peer never comes: the lease expires and the blocks come back.
    s.poll_batch(t0 + Duration::from_millis(100));
    s.handle_step_result(&[], t0);
    assert_eq!(s.poll_event(), Some(Event::LeaseExpired { transfer: transfers[1] }));
    assert_eq!(s.kv().stats().owned(OwnerKind::Transfer), 0);
    s.check_invariants().unwrap();
}

#[test]
fn decode_role_waits_for_kv_with_a_deadline() {
    let config = SchedulerConfig {
        role: Role::Decode,
        kv_transfer_timeout: Duration::from_millis(30),
        ..SchedulerConfig::default()
    };
    let (mut s, t0) = sched(config, 64);
    let remote = |id: u64| NewRequest {
        kv: KvSource::Remote { transfer: TransferId(id), first_token: 77 },
        ..req(id, 10, 4, t0)
    };
    s.handle_request(remote(1), t0).unwrap();
    s.handle_request(remote(2), t0).unwrap();
    assert_eq!(s.stage_of(RequestId(1)), Some((Stage::KvTransfer, 0)));
    assert!(s.poll_batch(t0).is_empty(), "nothing runs before the KV arrives");
    s.handle_step_result(&[], t0);
    assert!(s.handle_kv_arrived(RequestId(1), false, t0));
    assert_eq!(s.stage_of(RequestId(1)), Some((Stage::Decoding, 1)));
    let batch = s.poll_batch(t0 + Duration::from_millis(40));
    // Request 2's KV never came: timed out in kv_transfer, its lease freed.
    assert_eq!(batch.len(), 1);
    assert_eq!(batch[0].start_pos, 10, "decode starts with the first token's KV");
    let e = s.poll_event().unwrap();
    assert!(
        matches!(
            e,
            Event::Finished { id: RequestId(2), outcome: Exit::TimedOut { stage: Stage::KvTransfer }, .. }
        ),
        "{e:?}"
    );
    s.handle_step_result(&[Sampled { id: RequestId(1), token: 5, stop: true, drafts_accepted: 0 }], t0);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Finished {
            id: RequestId(1),
            outcome: Exit::Completed(FinishReason::Stop),
            output_tokens: 2,
            ..
        })
    ));
    s.check_invariants().unwrap();
    assert_eq!(s.kv().stats().leases, 0);
}

#[test]
fn kv_pressure_preempts_the_newest_and_everything_still_finishes() {
    // 12 blocks of 4 tokens; three requests that each grow to 16 tokens (4 blocks) plus headroom.
    let config = SchedulerConfig { admission_watermark_blocks: 0, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 10);
    for i in 1..=3 {
        s.handle_request(req(i, 4, 12, t0), t0).unwrap();
    }
    let events = drain(&mut s, t0);
    assert!(s.stats().preemptions_total > 0, "the pool was meant to run short");
    assert_eq!(events.len(), 3);
    for e in events {
        assert!(
            matches!(
                e,
                Event::Finished { outcome: Exit::Completed(FinishReason::Length), output_tokens: 12, .. }
            ),
            "{e:?}"
        );
    }
    assert_eq!(s.kv().stats().sequences, 0);
}

#[test]
fn a_failed_step_fails_its_requests_and_frees_their_kv() {
    let (mut s, t0) = sched(SchedulerConfig::default(), 64);
    s.handle_request(req(1, 8, 4, t0), t0).unwrap();
    s.poll_batch(t0);
    s.handle_step_failed("model error: boom", t0);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Finished { outcome: Exit::Failed { stage: Stage::Prefilling, .. }, .. })
    ));
    s.check_invariants().unwrap();
    assert_eq!(s.kv().stats().blocks_free + s.kv().stats().owned(OwnerKind::Cache), 64);
}

/// A request sharing another's prompt prefix computes only its suffix, even while the first still runs
/// (its prompt's blocks entered the prefix cache as soon as they were written).
#[test]
fn a_shared_prefix_is_computed_once_even_while_its_first_request_runs() {
    let (mut s, t0) = sched(SchedulerConfig::default(), 64);
    let a = req(1, 20, 8, t0);
    let mut b = req(2, 26, 4, t0);
    b.prompt[..20].copy_from_slice(&a.prompt);
    s.handle_request(a, t0).unwrap();
    let batch = s.poll_batch(t0);
    assert_eq!((batch[0].start_pos, batch[0].num_tokens), (0, 20));
    s.handle_step_result(&[Sampled { id: RequestId(1), token: 9, stop: false, drafts_accepted: 0 }], t0);
    assert_eq!(s.stage_of(RequestId(1)), Some((Stage::Decoding, 1)), "the first request is still running");
    s.handle_request(b, t0).unwrap();
    let batch = s.poll_batch(t0);
    let item = batch.iter().find(|i| i.id == RequestId(2)).unwrap();
    assert_eq!((item.start_pos, item.num_tokens), (20, 6), "only the suffix is computed");
    s.handle_step_result(&[], t0);
    let events = drain(&mut s, t0);
    let cached: Vec<(u64, usize)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Finished { id, cached_tokens, .. } => Some((id.0, *cached_tokens)),
            _ => None,
        })
        .collect();
    assert!(cached.contains(&(1, 0)) && cached.contains(&(2, 20)), "{cached:?}");
    let st = s.stats();
    assert_eq!((st.prefix_hit_tokens_total, st.prefix_miss_tokens_total), (20, 26));
    // Nothing leaked: every block is free or cached (and evictable).
    let kv = s.kv().stats();
    assert_eq!(kv.blocks_free + kv.owned(OwnerKind::Cache), 64);
}

/// Prefill role: the prompt's blocks are cached when the prefill ends and only referenced by the
/// transfer lease; after the transfer (done, aborted or expired) they stay cached, and the next
/// request with the same prefix prefills only its suffix.
#[test]
fn a_prefill_worker_keeps_transferred_prompts_cached() {
    let config = SchedulerConfig {
        role: Role::Prefill,
        kv_lease: Duration::from_millis(50),
        ..SchedulerConfig::default()
    };
    let (mut s, t0) = sched(config, 64);
    let first = req(1, 18, 4, t0);
    let mut second = req(2, 30, 4, t0);
    second.prompt[..18].copy_from_slice(&first.prompt);
    s.handle_request(first, t0).unwrap();
    let events = drain(&mut s, t0);
    let Some(Event::Finished { outcome: Exit::PrefillDone { transfer, blocks, .. }, .. }) = events.first()
    else {
        panic!("{events:?}")
    };
    assert_eq!(blocks.len(), 5);
    let kv = s.kv().stats();
    assert_eq!((kv.owned(OwnerKind::Transfer), kv.owned(OwnerKind::Cache)), (5, 0), "leased, and cached");
    assert!(s.handle_transfer_done(*transfer));
    let kv = s.kv().stats();
    assert_eq!((kv.owned(OwnerKind::Transfer), kv.owned(OwnerKind::Cache)), (0, 4), "the full blocks stay");
    s.handle_request(second, t0).unwrap();
    let batch = s.poll_batch(t0);
    assert_eq!((batch[0].start_pos, batch[0].num_tokens), (16, 14));
    s.handle_step_result(&[Sampled { id: RequestId(2), token: 9, stop: false, drafts_accepted: 0 }], t0);
    // Its lease expires unclaimed: the blocks go back to the cache, none leak.
    let later = t0 + Duration::from_millis(100);
    s.poll_batch(later);
    s.handle_step_result(&[], later);
    let mut expired = false;
    while let Some(e) = s.poll_event() {
        expired |= matches!(e, Event::LeaseExpired { .. });
    }
    assert!(expired);
    s.check_invariants().unwrap();
    let kv = s.kv().stats();
    assert_eq!((kv.leases, kv.sequences), (0, 0));
    assert_eq!(kv.blocks_free + kv.owned(OwnerKind::Cache), 64);
    assert_eq!(kv.owned(OwnerKind::Cache), 7, "both prompts' full blocks, shared ones once");
}

/// A pulled request `id` for `prompt` (its first token, 9, sampled by the prefill worker).
fn pulled(id: u64, prompt: Vec<u32>, t0: Instant) -> NewRequest {
    NewRequest {
        prompt,
        kv: KvSource::Remote { transfer: TransferId(id), first_token: 9 },
        ..req(id, 1, 4, t0)
    }
}

/// A decode worker that pulled round 1 of a conversation (10 prompt tokens) and generated its answer
/// (four 9s): the worker, its clock, round 1.
fn decode_after_round1() -> (Scheduler, Instant, Vec<u32>) {
    let config = SchedulerConfig { role: Role::Decode, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    let round1: Vec<u32> = (100..110).collect();
    s.handle_request(pulled(1, round1.clone(), t0), t0).unwrap();
    assert_eq!(s.kv().lease(TransferId(1)).unwrap().groups[0].reused, 0);
    assert!(s.handle_kv_arrived(RequestId(1), false, t0));
    let events = drain(&mut s, t0);
    assert!(matches!(events[..], [Event::Finished { output_tokens: 4, cached_tokens: 0, .. }]));
    (s, t0, round1)
}

/// Decode role: a pulled prompt whose leading blocks this worker cached from an earlier round of the
/// conversation reuses them; only the rest is a destination for the transfer.
#[test]
fn a_decode_worker_reuses_the_previous_rounds_blocks() {
    let (mut s, t0, round1) = decode_after_round1();
    // Round 2 resends round 1, its answer (9 9 9 9 as sampled here) and a new message.
    let mut round2 = round1.clone();
    round2.extend([9, 9, 9, 9, 50, 51, 52, 53, 54, 55]);
    s.handle_request(pulled(2, round2, t0), t0).unwrap();
    let lease = s.kv().lease(TransferId(2)).unwrap();
    assert_eq!(
        (lease.groups[0].reused, lease.groups[0].blocks.len()),
        (3, 5),
        "12 tokens of round 1 are held here"
    );
    assert!(s.handle_kv_arrived(RequestId(2), false, t0));
    let events = drain(&mut s, t0);
    assert!(matches!(events[..], [Event::Finished { cached_tokens: 12, .. }]), "{events:?}");
    s.check_invariants().unwrap();
}

/// Conditional disaggregation: the next round's short tail is computed on the decode worker that holds
/// the history (pulled and generated there), beside requests whose KV is still arriving.
#[test]
fn a_decode_worker_computes_a_short_tail_over_the_history_it_holds() {
    let (mut s, t0, round1) = decode_after_round1();
    let mut round2 = round1.clone();
    round2.extend([9, 9, 9, 9, 50, 51, 52, 53, 54, 55]);
    // Computed here: no lease, no transfer; another request's pull waits beside it.
    s.handle_request(NewRequest { prompt: round2, ..req(2, 1, 4, t0) }, t0).unwrap();
    s.handle_request(pulled(3, (300..310).collect(), t0), t0).unwrap();
    assert_eq!(s.stage_of(RequestId(2)).map(|s| s.0), Some(Stage::Queued));
    assert!(s.kv().lease(TransferId(2)).is_err());
    let first = s.poll_batch(t0);
    let tail: Vec<_> = first.iter().filter(|i| i.id == RequestId(2)).collect();
    assert_eq!(tail.len(), 1, "{first:?}");
    assert_eq!(tail[0].start_pos, 12, "the 12 tokens held here are not computed again");
    let sampled: Vec<Sampled> = first
        .iter()
        .filter(|i| i.sample)
        .map(|i| Sampled { id: i.id, token: 9, stop: false, drafts_accepted: 0 })
        .collect();
    s.handle_step_result(&sampled, t0);
    assert!(s.handle_kv_arrived(RequestId(3), false, t0));
    let mut events = drain(&mut s, t0);
    events.sort_by_key(|e| format!("{e:?}"));
    let cached: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            Event::Finished { cached_tokens, output_tokens: 4, .. } => Some(*cached_tokens),
            _ => None,
        })
        .collect();
    assert_eq!(cached.len(), 2, "both end with their 4 tokens: {events:?}");
    assert!(cached.contains(&12), "{events:?}");
    s.check_invariants().unwrap();
}

/// A decode worker's running slots are shared by pulls on their way and prompts it computes: a local
/// prompt never takes the slot a pull holds, so the cap holds when the pull's KV lands. (Unified and
/// prefill workers take no pulls at all.)
#[test]
fn local_prompts_on_a_decode_worker_leave_pulls_their_slots() {
    let config =
        SchedulerConfig { role: Role::Decode, running_requests_max: 2, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    let remote =
        NewRequest { kv: KvSource::Remote { transfer: TransferId(1), first_token: 9 }, ..req(1, 8, 4, t0) };
    s.handle_request(remote.clone(), t0).unwrap();
    s.handle_request(req(2, 8, 4, t0), t0).unwrap();
    s.handle_request(req(3, 8, 4, t0), t0).unwrap();
    let batch = s.poll_batch(t0);
    let ids: Vec<u64> = batch.iter().map(|i| i.id.0).collect();
    assert_eq!(ids, [2], "one local prompt beside the pull: {ids:?}");
    assert_eq!(s.stats().queue_wait, Some(QueueWait::Slot));
    let sampled: Vec<Sampled> = batch
        .iter()
        .filter(|i| i.sample)
        .map(|i| Sampled { id: i.id, token: 9, stop: false, drafts_accepted: 0 })
        .collect();
    s.handle_step_result(&sampled, t0);
    assert!(s.handle_kv_arrived(RequestId(1), false, t0));
    assert_eq!(s.stats().running, 2, "the cap holds once the KV lands");
    s.check_invariants().unwrap();
    drain(&mut s, t0);
    // Pulls are the decode role's alone.
    let (mut u, t0) = sched(SchedulerConfig::default(), 64);
    assert!(matches!(u.handle_request(remote, t0), Err(Rejection::WrongRole { .. })));
}

/// The next round of a conversation (mostly cached) overtakes cold prompts that came before it, yet
/// a cold prompt that waited long enough goes first: aged, nothing starves. `Fifo` keeps arrival order.
#[test]
fn least_work_first_lets_cached_rounds_overtake_cold_prompts_with_aging() {
    let config = |order| SchedulerConfig {
        running_requests_max: 1,
        admission_order: order,
        ..SchedulerConfig::default()
    };
    let lwf = AdmissionOrder::LeastWorkFirst {
        aging_after: Duration::from_secs(1),
        aging_tokens_per_s: 100,
        window: 8,
    };
    for (order, want) in [(lwf, vec![1, 3, 2]), (AdmissionOrder::Fifo, vec![1, 2, 3])] {
        let (mut s, t0) = sched(config(order), 256);
        // Round 1 of a conversation, finished: its 200 tokens stay cached.
        s.handle_request(req(1, 200, 1, t0), t0).unwrap();
        let first = drain(&mut s, t0);
        assert_eq!(first.len(), 1);
        let mut order_seen = vec![1];
        // A cold 300-token prompt, then round 2 of the conversation (220 tokens, 200 cached).
        let mut round2 = req(3, 220, 1, t0);
        round2.prompt[..200].copy_from_slice(&req(1, 200, 1, t0).prompt);
        let t1 = t0 + Duration::from_millis(100);
        s.handle_request(req(2, 300, 1, t1), t1).unwrap();
        s.handle_request(round2, t1).unwrap();
        for e in drain(&mut s, t1) {
            if let Event::Finished { id, .. } = e {
                order_seen.push(id.0);
            }
        }
        assert_eq!(order_seen, want, "{order:?}");
    }
    // Aged: the cold prompt has waited 5 s (4 s past the grace: 400 tokens' worth), the cached round
    // just arrived.
    let (mut s, t0) = sched(config(lwf), 256);
    s.handle_request(req(1, 200, 1, t0), t0).unwrap();
    drain(&mut s, t0);
    s.handle_request(req(2, 300, 1, t0), t0).unwrap();
    let mut round2 = req(3, 220, 1, t0);
    round2.prompt[..200].copy_from_slice(&req(1, 200, 1, t0).prompt);
    let t5 = t0 + Duration::from_secs(5);
    s.handle_request(round2, t5).unwrap();
    let batch = s.poll_batch(t5);
    assert_eq!(batch[0].id, RequestId(2), "the aged cold prompt goes first");
}

#[test]
fn a_decode_worker_under_kv_pressure_finishes_every_request() {
    // Eight pulled prompts of 10 tokens that each grow by 40: twice the pool of 64 blocks of 4 tokens.
    let config = SchedulerConfig { role: Role::Decode, ..SchedulerConfig::default() };
    let (mut s, t0) = sched(config, 64);
    for id in 1..=8 {
        let r = NewRequest {
            kv: KvSource::Remote { transfer: TransferId(id), first_token: 77 },
            ..req(id, 10, 40, t0)
        };
        s.handle_request(r, t0).unwrap();
        assert!(s.handle_kv_arrived(RequestId(id), false, t0));
    }
    let events = drain(&mut s, t0);
    assert!(s.stats().preemptions_total > 0, "the pool was meant to run short");
    assert_eq!(events.len(), 8, "{events:?}");
    for e in events {
        assert!(matches!(e, Event::Finished { outcome: Exit::Completed(FinishReason::Length), .. }), "{e:?}");
    }
}

/// With a sliding window, a request far longer than the pool runs to the end: each step gives back
/// the blocks no later position attends to, so it never holds more than its window and a chunk.
#[test]
fn a_sliding_window_runs_a_request_longer_than_the_pool() {
    let config = SchedulerConfig {
        sliding_window: Some(8),
        prefill_chunk_tokens_max: 4,
        context_tokens_max: 1024,
        ..SchedulerConfig::default()
    };
    // 10 blocks of 4 tokens: 40 positions, for a request of 30 + 200.
    let (mut s, t0) = sched(config.clone(), 10);
    s.handle_request(req(1, 30, 200, t0), t0).unwrap();
    let mut now = t0;
    let mut most = 0;
    let mut done = None;
    while done.is_none() {
        let batch = s.poll_batch(now);
        let sampled: Vec<Sampled> = batch
            .iter()
            .filter(|i| i.sample)
            .map(|i| Sampled { id: i.id, token: 9, stop: false, drafts_accepted: 0 })
            .collect();
        s.handle_step_result(&sampled, now);
        s.check_invariants().unwrap();
        most = most.max(s.kv().stats().owned(OwnerKind::Sequence));
        while let Some(e) = s.poll_event() {
            if let Event::Finished { outcome, .. } = e {
                done = Some(outcome);
            }
        }
        now += Duration::from_millis(10);
        assert!(now < t0 + Duration::from_secs(60), "never finished");
    }
    assert_eq!(done, Some(Exit::Completed(FinishReason::Length)));
    // The window (8) and a chunk (4) span at most 4 blocks, plus the one being filled.
    assert!(most <= 5, "held up to {most} blocks");
    assert_eq!(s.kv().stats().blocks_free, 10, "everything given back");
    // Without the window the same request is refused: it could never fit.
    let (mut s, t0) = sched(SchedulerConfig { sliding_window: None, ..config }, 10);
    assert!(matches!(s.handle_request(req(1, 30, 200, t0), t0), Err(Rejection::KvCapacityExceeded { .. })));
}

#[test]
fn late_chunks_of_a_long_prompt_shrink_and_a_short_request_waits_one_short_step() {
    // The defaults: 2,048 tokens a step, 512 a chunk; attending to 1,000 positions costs a token.
    let config = SchedulerConfig {
        context_tokens_max: 9000,
        attention_cost_positions: Some(1000),
        ..SchedulerConfig::default()
    };
    let (mut s, t0) = sched(config.clone(), 2500);
    s.handle_request(req(1, 8000, 4, t0), t0).unwrap();
    let mut now = t0;
    let mut chunks = Vec::new();
    let mut short_joined = None;
    for step in 0..1000 {
        let batch = s.poll_batch(now);
        let cost: usize = batch.iter().map(|i| config.chunk_cost(i.start_pos, i.num_tokens)).sum();
        assert!(cost <= 2048 + 8, "step {step} costs {cost}: {batch:?}");
        let long = batch.iter().find(|i| i.id == RequestId(1) && !i.sample);
        if let Some(short) = batch.iter().find(|i| i.id == RequestId(2) && i.start_pos == 0) {
            // The short request came while the long prompt was past 6,000 and got its whole prompt
            // into the very next step, beside a chunk of the long one no costlier than a first one.
            assert_eq!(short_joined, Some(step), "{batch:?}");
            assert!(short.sample && short.num_tokens == 10, "{batch:?}");
            let long = long.unwrap();
            assert!(config.chunk_cost(long.start_pos, long.num_tokens) <= 512 + 8, "{batch:?}");
        }
        if let Some(long) = long {
            chunks.push((long.start_pos, long.num_tokens));
        }
        let sampled: Vec<Sampled> = batch
            .iter()
            .filter(|i| i.sample)
            .map(|i| Sampled { id: i.id, token: 9, stop: false, drafts_accepted: 0 })
            .collect();
        s.handle_step_result(&sampled, now);
        s.check_invariants().unwrap();
        if short_joined.is_none() && chunks.last().is_some_and(|&(p, _)| p >= 6000) {
            s.handle_request(req(2, 10, 2, t0), now).unwrap();
            short_joined = Some(step + 1);
        }
        while s.poll_event().is_some() {}
        if s.is_empty() {
            break;
        }
        now += Duration::from_millis(10);
    }
    assert!(s.is_empty() && short_joined.is_some());
    // Alone: whole chunks while they cost at most the step's budget (to position 3,000), then about
    // 2,048,000 / (1,000 + p) tokens: 239 at 7,562. Short ones only while the short request ran.
    assert_eq!(&chunks[..6], &[(0, 512), (512, 512), (1024, 512), (1536, 512), (2048, 512), (2560, 512)]);
    let &(p, n) = chunks.last().unwrap();
    assert!(p > 7500 && (220..=250).contains(&n), "{chunks:?}");
    let small = chunks.iter().filter(|c| c.1 < 100).count();
    assert!((1..=3).contains(&small), "{chunks:?}");
    // Without the cost, chunks stay at 512: a step at 7,500 costs about eight of the first ones.
    let plain = SchedulerConfig { attention_cost_positions: None, ..config.clone() };
    assert_eq!(plain.chunk_len(7500, 500, 2048, true), 500);
    assert_eq!(config.chunk_len(7500, 500, 2048, true), 60);
    assert_eq!(config.chunk_len(7500, 500, 2048, false), 240);
    assert_eq!(config.chunk_len(7500, 500, 0, false), 0);
}

#[test]
fn a_sliding_window_caps_what_a_chunk_counts() {
    let config = SchedulerConfig {
        attention_cost_positions: Some(1000),
        sliding_window: Some(4096),
        ..SchedulerConfig::default()
    };
    // Past the window a chunk attends to 4,096 positions wherever it starts.
    assert_eq!(config.chunk_cost(30_000, 100), config.chunk_cost(4096, 100));
    assert_eq!(config.chunk_len(30_000, 5000, 2048, false), 2048 * 1000 / 5096);
    assert_eq!(config.chunk_len(30_000, 5000, 2048, false), config.chunk_len(4096, 5000, 2048, false));
}

/// Speculative decoding: a decode's drafts ride in its item within the room the request has left; the
/// step keeps the drafts the engine accepted (as output, with their KV) and gives back the rest.
#[test]
fn drafts_keep_what_the_engine_accepted_and_give_back_the_rest() {
    let (mut s, t0) = sched(SchedulerConfig::default(), 64);
    s.handle_request(req(1, 6, 10, t0), t0).unwrap();
    let id = RequestId(1);
    let sampled = |token, drafts_accepted| [Sampled { id, token, stop: false, drafts_accepted }];
    assert_eq!(s.poll_batch(t0)[0].num_tokens, 6);
    s.handle_step_result(&sampled(7, 0), t0);

    let batch = s.poll_batch_drafting(t0, 512, &mut |_, tokens, room| {
        assert_eq!((tokens.len(), tokens[6], room), (7, 7, 8), "room: 10 tokens, 1 out, 1 sampled");
        vec![20, 21, 22, 23, 24]
    });
    let item = batch[0];
    assert_eq!((item.start_pos, item.num_tokens, item.draft), (6, 6, 5));
    assert_eq!(s.kv().block_table(item.seq, 0).unwrap().len(), 3, "KV reserved for every draft");
    s.handle_step_result(&sampled(30, 2), t0);
    s.check_invariants().unwrap();
    let prompt: Vec<u32> = (1000..1006).collect();
    let want: Vec<u32> = prompt.iter().copied().chain([7, 20, 21, 30]).collect();
    assert_eq!(s.kv().tokens(item.seq).unwrap(), want.as_slice());
    assert_eq!(s.kv().computed_tokens(item.seq).unwrap(), 9, "the accepted drafts' KV is kept");

    // Four tokens out of ten: room for five drafts, whatever the drafter offers.
    let batch = s.poll_batch_drafting(t0, 512, &mut |_, _, room| {
        assert_eq!(room, 5);
        vec![1; 9]
    });
    assert_eq!(batch[0].draft, 5);
    s.handle_step_result(&sampled(2, 5), t0);
    let done = std::iter::from_fn(|| s.poll_event()).find_map(|e| match e {
        Event::Finished { outcome, .. } => Some(outcome),
        _ => None,
    });
    assert!(matches!(done, Some(Exit::Completed(FinishReason::Length))), "{done:?}");
    assert_eq!(s.kv().stats().sequences, 0);

    // A step budget of one token leaves no room for drafts.
    s.handle_request(req(2, 3, 10, t0), t0).unwrap();
    s.poll_batch(t0);
    s.handle_step_result(&[Sampled { id: RequestId(2), token: 5, stop: false, drafts_accepted: 0 }], t0);
    let batch = s.poll_batch_drafting(t0, 1, &mut |_, _, _| panic!("asked for drafts without room"));
    assert_eq!((batch[0].num_tokens, batch[0].draft), (1, 0));
}

/// Requests recomputing after preemption must not hold the pool between them so that none can
/// grow: the oldest that cannot reserve its chunk takes the blocks of newer ones not in the step
/// (found by the engine's simulation: three decode-worker requests, each holding a third of the pool
/// and waiting for a block, stalled until their deadlines).
#[test]
fn requests_recomputing_after_preemption_never_stall_each_other() {
    for (blocks, n, prompt, grow) in [(40, 6, 30, 120), (40, 8, 10, 150), (24, 5, 20, 70), (64, 12, 40, 200)]
    {
        let config = SchedulerConfig {
            role: Role::Decode,
            running_requests_max: 8,
            batch_tokens_max: 48,
            prefill_chunk_tokens_max: 16,
            context_tokens_max: 400,
            ..SchedulerConfig::default()
        };
        let (mut s, t0) = sched(config, blocks);
        // As many as the pool takes pulled prompts for (the rest are refused, 429).
        let mut taken = 0;
        for id in 1..=n {
            let r = NewRequest {
                kv: KvSource::Remote { transfer: TransferId(id), first_token: 77 },
                ..req(id, prompt, grow, t0)
            };
            if s.handle_request(r, t0).is_ok() {
                assert!(s.handle_kv_arrived(RequestId(id), false, t0));
                taken += 1;
            }
        }
        let events = drain(&mut s, t0);
        assert!(s.stats().preemptions_total > 0, "the pool was meant to run short");
        assert_eq!(events.len(), taken, "{blocks} blocks, {taken} requests: {events:?}");
    }
    // Prompts sharing prefixes, arriving while others run, on a pool a fifth of their demand.
    for seed in 1..200u64 {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let config = SchedulerConfig {
            role: Role::Decode,
            running_requests_max: 8,
            batch_tokens_max: 48,
            prefill_chunk_tokens_max: 16,
            context_tokens_max: 160,
            ..SchedulerConfig::default()
        };
        let (mut s, t0) = sched(config, 40);
        let mut now = t0;
        let (mut taken, mut events) = (0, Vec::new());
        for step in 0..20_000u64 {
            if step < 400 && rand(3) == 0 {
                let system = rand(4);
                let mut prompt: Vec<u32> = if system < 3 {
                    (0..12).map(|i| 1 + (i * 7 + system as u32 * 13) % 40).collect()
                } else {
                    Vec::new()
                };
                prompt.extend((0..1 + rand(40)).map(|_| 1 + rand(47) as u32));
                let grow = if rand(10) == 0 { 160 - prompt.len() } else { 1 + rand(24) as usize };
                let id = 1000 + step;
                let r = NewRequest {
                    kv: KvSource::Remote { transfer: TransferId(id), first_token: 77 },
                    max_tokens: grow,
                    prompt,
                    ..req(id, 1, 1, t0)
                };
                if s.handle_request(r, now).is_ok() {
                    assert!(s.handle_kv_arrived(RequestId(id), false, now));
                    taken += 1;
                }
            }
            let batch = s.poll_batch(now);
            let sampled: Vec<Sampled> = batch
                .iter()
                .filter(|i| i.sample)
                .map(|i| Sampled { id: i.id, token: 1 + rand(47) as u32, stop: false, drafts_accepted: 0 })
                .collect();
            s.handle_step_result(&sampled, now);
            s.check_invariants().unwrap();
            while let Some(e) = s.poll_event() {
                events.push(e);
            }
            if step >= 400 && s.is_empty() {
                break;
            }
            now += Duration::from_millis(1);
        }
        assert_eq!(events.len(), taken, "seed {seed}: {:?}", s.stats());
    }
}

/// vLLM's `priority`: a waiting request of a lower value is admitted before every waiting one of a
/// higher value, whatever their arrival or their work, under either admission order; among equals
/// the order applies (least work first: the smaller prompt of the two urgent ones first).
#[test]
fn a_lower_priority_value_is_admitted_first() {
    let lwf = SchedulerConfig::default().admission_order;
    assert!(matches!(lwf, AdmissionOrder::LeastWorkFirst { .. }));
    for order in [lwf, AdmissionOrder::Fifo] {
        let config =
            SchedulerConfig { running_requests_max: 1, admission_order: order, ..SchedulerConfig::default() };
        let (mut s, t0) = sched(config, 256);
        // Waiting, in arrival order: a default one, two background jobs, two urgent ones.
        let with = |id, len, priority| NewRequest { priority, ..req(id, len, 1, t0) };
        for r in [with(1, 8, 0), with(2, 8, 5), with(3, 8, 5), with(4, 40, -1), with(5, 20, -1)] {
            s.handle_request(r, t0).unwrap();
        }
        let mut seen = Vec::new();
        for e in drain(&mut s, t0) {
            if let Event::Finished { id, .. } = e {
                seen.push(id.0);
            }
        }
        let want = match order {
            AdmissionOrder::Fifo => vec![4, 5, 1, 2, 3],
            _ => vec![5, 4, 1, 2, 3],
        };
        assert_eq!(seen, want, "{order:?}");
    }
}
