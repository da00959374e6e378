//! Continuous batching as a sans-IO state machine: no threads, no clock, no channels. The engine loop
//! feeds it requests, step results and `now`, and polls it for the next batch and for events.
//!
//! Its one promise: every request it accepts ends exactly once ([`Event::Finished`] with an
//! [`Exit`]: completed, cancelled, timed out or failed, with the stage), and the KV it held is
//! returned. Requests it does not accept get a [`Rejection`] at once, with a `retry_after` derived from
//! the recent drain rate when the queue is full.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use pdserve_kvcache::{KvConfig, KvGroups, LayerKind};
//! use pdserve_scheduler::*;
//!
//! let now = Instant::now();
//! let kv = KvGroups::single(KvConfig { num_blocks: 64, block_size: 16 }, LayerKind::Full).unwrap();
//! let mut s = Scheduler::new(SchedulerConfig::default(), kv, now);
//! let far = now + Duration::from_secs(30);
//! s.handle_request(NewRequest { id: RequestId(1), prompt: vec![1, 2, 3], max_tokens: 2,
//!     queue_deadline: far, deadline: far, kv: KvSource::Compute, priority: 0 }, now).unwrap();
//! for token in [7, 8] {
//!     let batch = s.poll_batch(now);                  // the engine runs these items ...
//!     let sampled: Vec<Sampled> = batch.iter().filter(|i| i.sample)
//!         .map(|i| Sampled { id: i.id, token, stop: false, drafts_accepted: 0 }).collect();
//!     s.handle_step_result(&sampled, now);            // ... and reports the tokens it drew
//! }
//! assert!(matches!(s.poll_event(), Some(Event::Finished { outcome: Exit::Completed(FinishReason::Length), .. })));
//! assert_eq!(s.kv().stats().sequences, 0);
//! ```
#![forbid(unsafe_code)]

mod scheduler;
mod types;

pub use scheduler::Scheduler;
pub use types::*;

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
