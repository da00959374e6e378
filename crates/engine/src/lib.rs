//! The pdserve engine, for programs that want generation without HTTP: a model from a Hugging Face
//! folder, continuous batching over a paged KV cache, and (for prefill and decode workers) the KV
//! transfer between them.
//!
//! - [`Engine`]: the handle. [`Engine::start`] loads the model and starts the text thread and the
//!   engine thread; [`Engine::submit`] hands a [`Request`] to the text thread, which tokenizes it and
//!   passes it on; [`Engine::poll`] returns [`Output`]s (admitted, text with stop strings applied,
//!   finished), the text decoded on the text thread. Requests left past their deadline are ended by
//!   the handle itself.
//! - The engine thread owns the scheduler (`pdserve-scheduler`), the KV cache (`pdserve-kvcache`),
//!   the model backend (`pdserve-model`) and the transfer endpoint (`pdserve-pd-transfer`); it sees
//!   token ids only and talks to the text thread only through two bounded channels.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use pdserve_engine::{Engine, EngineConfig, Input, Output, Request};
//! use pdserve_model::ChatMessage;
//!
//! let mut engine = Engine::start(EngineConfig::new("/path/to/SmolLM2-135M-Instruct".into()), Arc::new(|| {})).unwrap();
//! let deadline = Instant::now() + Duration::from_secs(60);
//! let msgs = vec![ChatMessage::new("user", "What is the capital of France?")];
//! let mut req = Request::new("req-1", Input::Chat(msgs), deadline);
//! req.max_tokens = Some(16);
//! engine.submit(req).unwrap();
//! let mut out = Vec::new();
//! 'wait: loop {
//!     engine.poll_timeout(Duration::from_secs(1), &mut out);
//!     for o in out.drain(..) {
//!         match o {
//!             Output::Text { text, .. } => print!("{text}"),
//!             Output::Finished { finish, .. } => { println!(" ({finish:?})"); break 'wait; }
//!             Output::Rejected { error, .. } => panic!("{error}"),
//!             _ => {}
//!         }
//!     }
//! }
//! ```

mod chat;
mod config;
pub mod core;
mod draft;
mod error;
mod grammar;
mod handle;
mod info;
mod ledger;
mod load;
mod metrics;
mod offload;
mod request;
mod shell;
mod sys;
mod text;
mod text_thread;

pub use config::{Device, EngineConfig};
pub use draft::{DraftSource, Speculative, MODEL_DRAFT_RUNNING_MAX, MODEL_DRAFT_TOKENS};
pub use error::{EngineError, KvTransferProblem};
pub use handle::{Aborted, Engine, Health};
pub use info::EngineInfo;
pub use load::{default_transport, TransportSpec};
pub use offload::OffloadConfig;
pub use pdserve_chat_template::{Piece, ReasoningFormat, ReasoningParser, ToolCallParser, ToolFormat};
pub use pdserve_kv_events::KvEventsConfig;
pub use pdserve_kvcache::{GroupSpec as KvGroupSpec, LayerKind as KvLayerKind};
pub use pdserve_pd_transfer::transport::shm::valid_scope as valid_shm_scope;
pub use pdserve_scheduler::{AdmissionOrder, SchedulerConfig};
pub use request::{Finish, Id, Input, Output, PanicSite, Request, Timings};

// What the engine's API takes and gives, from the crates below it, so a program embedding the engine
// (the server, say) needs no other.
pub use pdserve_api::generation::{Constraint, TokenLogprob, Usage};
pub use pdserve_api::tools::{Tool, ToolCall, ToolChoice};
pub use pdserve_model::{
    cpu_kernels, set_cpu_kernels, tool_call as chat_tool_call, ChatMessage, CpuKernels, KvDtype, ModelError,
    SamplingParams, WeightFormat,
};
pub use shell::Worker;

/// The README's examples, compiled as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
