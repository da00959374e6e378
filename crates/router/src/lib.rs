//! The front door of a pdserve deployment. This first part holds the worker selection policies
//! ([`Policy`]: [`RoundRobin`], [`LeastOutstanding`], [`PowerOfTwo`], [`CacheAware`]), as plain data
//! structures the router's event loop will call; the mio proxy, the PD orchestration and admission are
//! still to come (issue #8).
//!
//! ```
//! use pdserve_router::{CacheAware, Candidate, Policy};
//! let mut p = CacheAware::default();
//! let workers = [Candidate { worker: 0, outstanding: 0 }, Candidate { worker: 1, outstanding: 0 }];
//! let prompt = "You are a helpful assistant. Summarise the following article about tides.";
//! let first = p.pick(&workers, prompt);
//! p.routed(workers[first].worker, prompt);
//! // The same system prompt again goes where its prefix is likely cached.
//! assert_eq!(p.pick(&workers, "You are a helpful assistant. Summarise the following article about the moon."), first);
//! ```
#![forbid(unsafe_code)]

mod policy;

pub use policy::{CacheAware, CacheAwareConfig, Candidate, LeastOutstanding, Policy, PowerOfTwo, RoundRobin};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
