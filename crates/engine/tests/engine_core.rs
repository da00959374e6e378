//! `EngineCore` alone: no threads, no model, no sockets; steps answered with made-up logits and
//! transfer calls with the endpoint's possible answers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdserve_api::Role;
use pdserve_kvcache::{KvConfig, KvGroups, LayerKind, OwnerKind, TransferId};
use pdserve_pd_transfer::{EndpointEvent, PromptMeta, Side, Source, TransferKey, TransferOutcome};
use pdserve_scheduler::{Exit, FinishReason, Scheduler, SchedulerConfig};

use pdserve_engine::core::*;

const VOCAB: usize = 16;
const EOS: u32 = 0;

fn core(role: Role) -> (EngineCore, Instant) {
    let now = Instant::now();
    let kv = KvGroups::single(KvConfig { num_blocks: 32, block_size: 4 }, LayerKind::Full).unwrap();
    let role_s = match role {
        Role::Unified => pdserve_scheduler::Role::Unified,
        Role::Prefill => pdserve_scheduler::Role::Prefill,
        Role::Decode => pdserve_scheduler::Role::Decode,
    };
    let sched = Scheduler::new(
        SchedulerConfig { role: role_s, context_tokens_max: 64, ..Default::default() },
        kv,
        now,
    );
    let config = CoreConfig {
        role,
        eos_ids: vec![EOS],
        context_tokens: 64,
        vocab_size: VOCAB,
        transfer_step_tokens: 64,
        speculative: pdserve_engine::Speculative::OFF,
        verify_rows: 1,
        block_bytes: 128,
        block_size: 16,
        kv_state: None,
    };
    (EngineCore::new(config, sched), now)
}

/// Logits whose greedy pick is `token`.
fn pick(token: u32) -> Vec<f32> {
    (0..VOCAB as u32).map(|t| if t == token { 5.0 } else { 0.0 }).collect()
}

fn replies(c: &mut EngineCore) -> Vec<Reply> {
    std::iter::from_fn(|| c.poll_reply()).collect()
}

/// Runs the planned step with every sampling row picking `token`.
fn step(c: &mut EngineCore, now: Instant, token: u32) -> bool {
    let Some(plan) = c.poll_step(now, false) else { return false };
    let rows: usize = plan.rows.iter().map(|r| r.logits).sum();
    let output = StepOutput::Logits((0..rows).map(|_| pick(token)).collect());
    c.handle_step_done(now, StepDone::new(Ok(output), plan.guides));
    true
}

fn sequence_blocks(c: &EngineCore) -> usize {
    let s = c.kv().stats();
    s.owned(OwnerKind::Sequence) + s.owned(OwnerKind::Transfer)
}

#[test]
fn a_unified_request_is_admitted_generates_and_ends_once() {
    let (mut c, now) = core(Role::Unified);
    let mut s = Submission::new(7, "r", vec![3, 4, 5], now + Duration::from_secs(5));
    s.max_tokens = Some(3);
    c.handle_submit(now, Box::new(s));
    assert!(matches!(replies(&mut c)[..], [Reply::Admitted { id: 7, prompt_tokens: 3 }]));
    let mut tokens = Vec::new();
    let mut ends = 0;
    for _ in 0..10 {
        step(&mut c, now, 9);
        for r in replies(&mut c) {
            match r {
                Reply::Token { token, .. } => tokens.push(token),
                Reply::Finished { outcome, .. } => {
                    ends += 1;
                    assert_eq!(outcome, Exit::Completed(FinishReason::Length));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!((tokens, ends), (vec![9, 9, 9], 1));
    assert!(c.is_empty() && c.is_idle());
    assert_eq!(sequence_blocks(&c), 0);
}

#[test]
fn an_abort_ends_a_request_at_once_even_while_its_step_runs_and_other_inputs_wait() {
    let (mut c, now) = core(Role::Unified);
    let deadline = now + Duration::from_secs(5);
    c.handle_submit(now, Box::new(Submission::new(1, "a", vec![3, 4], deadline)));
    replies(&mut c);
    let plan = c.poll_step(now, false).expect("a step");
    // In flight: an abort ends request 1 now; a new submission waits for the step's end.
    c.handle_abort(now, 1);
    c.handle_submit(now, Box::new(Submission::new(2, "b", vec![5], deadline)));
    let got = replies(&mut c);
    assert!(matches!(got[..], [Reply::Finished { id: 1, outcome: Exit::Cancelled, .. }]), "{got:?}");
    assert_eq!(sequence_blocks(&c), 0, "the aborted request's blocks are free");
    let output = StepOutput::Logits(vec![pick(9)]);
    c.handle_step_done(now, StepDone::new(Ok(output), plan.guides));
    // No token for the aborted request; the waiting submission is admitted now.
    let got = replies(&mut c);
    assert!(matches!(got[..], [Reply::Admitted { id: 2, .. }]), "{got:?}");
}

#[test]
fn an_abort_of_a_submission_waiting_for_the_step_comes_after_it() {
    let (mut c, now) = core(Role::Unified);
    let deadline = now + Duration::from_secs(5);
    c.handle_submit(now, Box::new(Submission::new(1, "a", vec![3, 4], deadline)));
    let plan = c.poll_step(now, false).expect("a step");
    c.handle_submit(now, Box::new(Submission::new(2, "b", vec![5], deadline)));
    c.handle_abort(now, 2);
    replies(&mut c);
    c.handle_step_done(now, StepDone::new(Ok(StepOutput::Logits(vec![pick(9)])), plan.guides));
    let ends: Vec<(u64, bool)> = replies(&mut c).iter().map(|r| (r.id(), r.is_end())).collect();
    assert_eq!(ends, vec![(1, false), (2, false), (2, true)], "token of 1, then 2 admitted and cancelled");
}

#[test]
fn a_failed_step_fails_its_requests_and_frees_their_blocks() {
    let (mut c, now) = core(Role::Unified);
    c.handle_submit(now, Box::new(Submission::new(1, "a", vec![3, 4], now + Duration::from_secs(5))));
    replies(&mut c);
    let plan = c.poll_step(now, false).expect("a step");
    c.handle_step_done(now, StepDone::new(Err(StepFailure::Panicked), plan.guides));
    let got = replies(&mut c);
    assert!(matches!(got[..], [Reply::Finished { outcome: Exit::Failed { .. }, .. }]), "{got:?}");
    assert_eq!(sequence_blocks(&c), 0);
}

#[test]
fn a_request_past_its_deadline_times_out_at_the_next_step() {
    let (mut c, now) = core(Role::Unified);
    c.handle_submit(now, Box::new(Submission::new(1, "a", vec![3, 4], now + Duration::from_millis(10))));
    replies(&mut c);
    assert!(!step(&mut c, now + Duration::from_millis(11), 9));
    let got = replies(&mut c);
    assert!(matches!(got[..], [Reply::Finished { outcome: Exit::TimedOut { .. }, .. }]), "{got:?}");
}

#[test]
fn a_prefill_offers_its_kv_and_ends_prefilled_or_failed_by_the_endpoints_answer() {
    for accepted in [true, false] {
        let (mut c, now) = core(Role::Prefill);
        c.handle_submit(
            now,
            Box::new(Submission::new(5, "p", vec![3, 4, 6, 7, 8], now + Duration::from_secs(5))),
        );
        replies(&mut c);
        step(&mut c, now, 9);
        let Some(TransferCall::Offer { transfer, blocks, meta, .. }) = c.poll_transfer() else {
            panic!("an offer")
        };
        assert_eq!((transfer, blocks.len(), meta.prompt.len(), meta.first_token), (TransferId(5), 2, 5, 9));
        let key = TransferKey { transfer: 5, epoch: 1 };
        let answer = if accepted { Ok(key) } else { Err(pdserve_pd_transfer::TransferError::Duplicate) };
        c.handle_offered(now, 5, answer);
        let got = replies(&mut c);
        if accepted {
            assert!(matches!(got[..], [Reply::Prefilled { id: 5, .. }]), "{got:?}");
            // The lease holds the blocks until the decode worker's pull ends.
            assert_eq!(c.kv().stats().owned(OwnerKind::Transfer), 2);
            let ended = EndpointEvent::Ended {
                side: Side::Sending,
                transfer: 5,
                outcome: TransferOutcome::Completed,
                took_ms: 1,
            };
            c.handle_transfer_event(now, ended);
        } else {
            assert!(matches!(got[..], [Reply::Finished { outcome: Exit::Failed { .. }, .. }]), "{got:?}");
        }
        assert_eq!(sequence_blocks(&c), 0);
    }
}

fn remote(transfer: u64) -> Source {
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    Source { addr, key: TransferKey { transfer, epoch: 1 }, region: None }
}

fn meta(prompt: Vec<u32>, first_token: u32) -> PromptMeta {
    PromptMeta {
        prompt,
        first_token,
        first_logprob: -0.5,
        first_top: Vec::new(),
        queue_us: 0,
        prefill_us: 0,
        cached_tokens: 0,
    }
}

#[test]
fn a_decode_pulls_is_admitted_when_described_and_starts_with_the_prefill_workers_token() {
    let (mut c, now) = core(Role::Decode);
    let mut s = Submission::new(8, "d", Vec::new(), now + Duration::from_secs(5));
    s.remote = Some(remote(77));
    s.max_tokens = Some(2);
    c.handle_submit(now, Box::new(s));
    assert!(matches!(c.poll_transfer(), Some(TransferCall::Pull { .. })));
    c.handle_pull_started(now, 77, Ok(()));
    assert_eq!((c.len(), c.queued()), (1, 1));
    c.handle_transfer_event(
        now,
        EndpointEvent::Described { transfer: 77, blocks: 2, meta: meta(vec![1, 2, 3, 4, 5], 6) },
    );
    let Some(TransferCall::SetDestination { transfer: 77, from: 0, dest }) = c.poll_transfer() else {
        panic!("a destination")
    };
    assert_eq!(dest.len(), 2);
    c.handle_destination_set(now, 77, Ok(()));
    let ended = EndpointEvent::Ended {
        side: Side::Receiving,
        transfer: 77,
        outcome: TransferOutcome::Completed,
        took_ms: 1,
    };
    c.handle_transfer_event(now, ended);
    step(&mut c, now, 9);
    let got = replies(&mut c);
    let tokens: Vec<u32> = got
        .iter()
        .filter_map(|r| if let Reply::Token { token, .. } = r { Some(*token) } else { None })
        .collect();
    assert_eq!(tokens, vec![6, 9], "{got:?}");
    assert!(matches!(
        got.last(),
        Some(Reply::Finished { outcome: Exit::Completed(FinishReason::Length), .. })
    ));
    assert_eq!(sequence_blocks(&c), 0);
}

#[test]
fn a_pull_that_cannot_start_or_ends_undescribed_is_refused_once() {
    let (mut c, now) = core(Role::Decode);
    for (t, how) in [(1, "no start"), (2, "ended")] {
        let mut s = Submission::new(t, "d", Vec::new(), now + Duration::from_secs(5));
        s.remote = Some(remote(t));
        c.handle_submit(now, Box::new(s));
        assert!(matches!(c.poll_transfer(), Some(TransferCall::Pull { .. })));
        if how == "no start" {
            c.handle_pull_started(now, t, Err(pdserve_pd_transfer::TransferError::TooMany { limit: 0 }));
        } else {
            c.handle_pull_started(now, t, Ok(()));
            let failed = TransferOutcome::Failed(pdserve_pd_transfer::FailReason::Aborted);
            c.handle_transfer_event(
                now,
                EndpointEvent::Ended { side: Side::Receiving, transfer: t, outcome: failed, took_ms: 1 },
            );
        }
        let got = replies(&mut c);
        assert!(matches!(got[..], [Reply::Rejected { id, .. }] if id == t), "{how}: {got:?}");
    }
    assert!(c.is_empty());
}

#[test]
fn the_context_rule() {
    // (prompt with resumed, resumed, max_tokens, context) -> budget or refusal.
    let check = |p, r, m, ctx, want: Option<usize>| {
        assert_eq!(output_budget(p, r, m, ctx).ok(), want, "prompt {p} resumed {r} max {m:?} context {ctx}")
    };
    check(10, 0, None, 64, Some(54));
    check(10, 0, Some(5), 64, Some(5));
    check(10, 4, Some(5), 64, Some(1));
    check(10, 4, Some(9), 64, Some(5));
    check(64, 0, None, 64, None);
    check(63, 0, None, 64, Some(1));
    // Resumed output that filled the context: not refused (it ends with `length` unsubmitted).
    check(64, 4, None, 64, Some(0));
    assert!(resumed_is_complete(64, 4, None, 64, false));
    assert!(resumed_is_complete(20, 4, Some(4), 64, false));
    assert!(!resumed_is_complete(20, 4, Some(5), 64, false));
    assert!(!resumed_is_complete(20, 0, Some(0), 64, false));
}
