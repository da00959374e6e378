//! The front door of a pdserve deployment: a single-threaded mio proxy in front of unified workers, or
//! of pools of prefill and decode workers.
//!
//! - [`Router`]: the mio shell. Client connections and every upstream connection live in one
//!   `mio::Poll`; the shell owns sockets, connection slots, timers and the clock.
//! - [`Flight`]: one request's decisions as a sans-IO state machine (legs, PD orchestration, retries,
//!   streaming, deadline, cancellation, aborts at workers): events in, [`Action`]s out.
//! - Selection policies behind [`Policy`]: [`RoundRobin`], [`LeastOutstanding`], [`PowerOfTwo`] and
//!   [`CacheAware`], plain data structures usable on their own.
//! - [`Admission`] (bounded in-flight count, bounded queue with a deadline, `Retry-After` from the drain
//!   rate) and [`Breaker`] (per-worker circuit breaker), both sans-IO.
//!
//! ```
//! use pdserve_router::{CacheAware, Candidate, Policy};
//! let mut p = CacheAware::default();
//! let workers = [Candidate::new(0, 0), Candidate::new(1, 0)];
//! let prompt = "You are a helpful assistant. Summarise the following article about tides.";
//! let first = p.pick(&workers, prompt);
//! p.routed(workers[first].worker, prompt);
//! // The same system prompt again goes where its prefix is likely cached.
//! assert_eq!(p.pick(&workers, "You are a helpful assistant. Summarise the following article about the moon."), first);
//! ```
#![forbid(unsafe_code)]

mod admin;
mod admission;
mod config;
mod debug;
pub mod discovery;
mod error;
pub mod flight;
mod flights;
mod health;
pub mod kv_index;
mod kv_listen;
mod metrics;
mod peek;
mod policy;
mod probes;
mod responses;
mod router;
mod trace;
mod upstream;
mod workers;

pub use admission::{Admission, AdmissionConfig, Admit};
pub use config::{PolicyKind, Role, RouterConfig, WorkerSpec};
pub use discovery::{DiscoverSpec, ResolverConf};
pub use error::{RouterError, UrlProblem};
pub use flight::{Action, Flight, FlightSpec, LegFailure, LegId, LegKind, Plan, Purpose};
pub use health::{Breaker, BreakerConfig, BreakerState};
pub use peek::{peek, Peek};
pub use policy::{
    CacheAware, CacheAwareConfig, Candidate, Choice, LeastOutstanding, Policy, PowerOfTwo, RoundRobin,
};
pub use router::Router;

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
