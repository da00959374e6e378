//! The engine's model layer: what turns token ids into logits, for Llama-family models from a Hugging
//! Face folder.
//!
//! - [`ModelFiles::load`] reads `config.json` ([`ModelConfig`]), the safetensors weights ([`Weights`],
//!   f32/bf16/f16 through memmap2) and the tokenizer and chat template ([`TextCodec`]).
//! - [`Backend`] runs a batch step (any mix of prefill chunks and decode tokens) over paged KV indexed
//!   by kvcache block ids; [`CpuBackend`] is the CPU implementation.
//! - [`Sampler`] picks tokens; [`IncrementalDecoder`] streams text without splitting a character.
//! - Getting a GGUF (the default model's) into such a folder is `pdserve-import`'s job, not this crate's.
//!
//! ```no_run
//! use std::sync::Arc;
//! use pdserve_kvcache::{KvCache, KvConfig, SeqId};
//! use pdserve_model::{Backend, CpuBackend, ModelFiles, Sampler, SamplingParams, SeqStep};
//!
//! let m = ModelFiles::load(std::path::Path::new("/path/to/SmolLM2-135M-Instruct")).unwrap();
//! let mut kv = KvCache::new(KvConfig { num_blocks: 64, block_size: 16 }).unwrap();
//! let mut cpu = CpuBackend::new(m.config.clone(), Arc::new(m.weights), 64, 16);
//! let prompt = m.text.encode("The capital of France is").unwrap();
//! kv.add_sequence(SeqId(1), &prompt).unwrap();
//! kv.reserve(SeqId(1), prompt.len()).unwrap();
//! let table = kv.block_table(SeqId(1)).unwrap().to_vec();
//! let logits = cpu.forward(&[SeqStep { tokens: &prompt, start_pos: 0, block_table: &table, logits: 1, state: None }]).unwrap();
//! let next = Sampler::new(SamplingParams::greedy(), 0).sample(&logits[0], &prompt, &[]).token;
//! println!("{}", m.text.decode(&[next], true).unwrap());
//! ```

mod backend;
mod bits16;
mod config;
mod cpu;
mod deepseek_v4;
mod error;
mod fp4;
mod fp8;
mod generation;
#[cfg(feature = "cuda")]
mod gpu;
mod prepare;
pub mod quant;
mod sampling;
mod shards;
mod sys;
mod text;
mod weights;

use std::path::Path;

pub use backend::{Backend, DraftStep, KvDtype, KvLayout, KvState, KvStore, SeqStep};
pub use config::{ExpertGroups, GroupScore, Indexer, Mla, ModelConfig, Moe, MoeNames, RopeScaling, Scoring};
pub use config::{V4Config, V4Layer};
pub use cpu::CpuBackend;
pub use deepseek_v4::{DeepseekV4, V4Backend, V4State};
pub use error::ModelError;
pub use fp4::{Fp4Matrix, Plain};
pub use fp8::Fp8Matrix;
pub use generation::GenerationConfig;
#[cfg(feature = "cuda")]
pub use gpu::{GpuBackend, StepTimes, RANDOM_WEIGHT_SCALE};
pub use prepare::PreparedWeights;
pub use quant::WeightFormat;
pub use sampling::{greedy_pick, Sampled, Sampler, SamplingParams};
/// The machine-peak kernels `cargo xtask bench peak` runs (FMA, bf16 dot, memory read).
pub use sys::peak;
pub use sys::{cpu_kernels, set_cpu_kernels, CpuKernels};
pub use text::{tool_call, ChatMessage, IncrementalDecoder, TextCodec};
pub use weights::{
    CheckpointDtype, DraftWeights, Expert, IndexerWeights, LayerWeights, MlaWeights, MoeWeights, ReadScales,
    Weights,
};

/// Deterministic values in -1..1 for the unit tests' matrices and activations.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Everything read from a model folder.
#[derive(Debug)]
pub struct ModelFiles {
    /// `config.json`, its EOS ids joined by `generation_config.json`'s.
    pub config: ModelConfig,
    pub weights: Weights,
    pub text: TextCodec,
    pub generation: GenerationConfig,
    /// What the checkpoint stores its projections in (`--weights auto` serves bf16 ones in bf16).
    pub checkpoint_dtype: CheckpointDtype,
    /// From [`load_for`](Self::load_for): every layer's projections in the served format (then
    /// `weights` holds no f32 copy of those no step reads).
    pub prepared: Option<PreparedWeights>,
    /// A DeepSeek V4 checkpoint (`config.v4`), loaded whole for [`V4Backend`]; `weights` is then
    /// empty.
    pub v4: Option<std::sync::Arc<DeepseekV4>>,
}

impl ModelFiles {
    /// Loads `config.json`, the weights and the tokenizer from `dir`. Errors name the file and the problem.
    pub fn load(dir: &Path) -> Result<ModelFiles, ModelError> {
        let (config, generation, text) = ModelFiles::metadata(dir)?;
        if config.v4.is_some() {
            return ModelFiles::v4(dir, config, generation, text);
        }
        let (weights, checkpoint_dtype) = Weights::load_with_dtype(dir, &config)?;
        Ok(ModelFiles { config, weights, text, generation, checkpoint_dtype, prepared: None, v4: None })
    }

    /// [`load`](Self::load) for the CPU backend serving `format` (`Auto`: the checkpoint's own
    /// precision, see `WeightFormat::resolve`): each layer is converted as it is read and its f32
    /// projections dropped where no step will read them, so the load's peak is the served form, the
    /// f32 embedding and one layer in f32, not the whole model in f32. `CpuBackend::with_prepared`
    /// takes the result.
    pub fn load_for(dir: &Path, format: WeightFormat) -> Result<ModelFiles, ModelError> {
        ModelFiles::load_with(dir, format, true)
    }

    /// [`load_for`](Self::load_for), with the checkpoint's draft layer (DeepSeek's multi-token
    /// prediction layer, `ModelConfig::draft_layers`) left out unless `draft_layer`.
    pub fn load_with(dir: &Path, format: WeightFormat, draft_layer: bool) -> Result<ModelFiles, ModelError> {
        let (mut config, generation, text) = ModelFiles::metadata(dir)?;
        if !draft_layer {
            config.draft_layers = 0;
        }
        if config.v4.is_some() {
            // Its projections held as shipped (`DeepseekV4::load`).
            return ModelFiles::v4(dir, config, generation, text);
        }
        let mut prepared: Option<PreparedWeights> = None;
        let (weights, checkpoint_dtype) = Weights::load_each(dir, &config, &mut |dtype, layer, scales| {
            let p = match &mut prepared {
                Some(p) => p,
                None => prepared.insert(
                    PreparedWeights::new(format.resolve(dtype, &config), &config)?.from_checkpoint(dtype),
                ),
            };
            p.push_and_free(layer, scales, &config)
        })?;
        let prepared = match prepared {
            Some(p) => p,
            None => PreparedWeights::new(format.resolve(checkpoint_dtype, &config), &config)?
                .from_checkpoint(checkpoint_dtype),
        };
        Ok(ModelFiles {
            config,
            weights,
            text,
            generation,
            checkpoint_dtype,
            prepared: Some(prepared),
            v4: None,
        })
    }

    fn v4(
        dir: &Path,
        config: ModelConfig,
        generation: GenerationConfig,
        text: TextCodec,
    ) -> Result<ModelFiles, ModelError> {
        let model = DeepseekV4::load(dir)?;
        let weights = Weights {
            embed: Vec::new(),
            layers: Vec::new(),
            final_norm: Vec::new(),
            lm_head: None,
            draft: None,
        };
        let v4 = Some(std::sync::Arc::new(model));
        Ok(ModelFiles {
            config,
            weights,
            text,
            generation,
            checkpoint_dtype: CheckpointDtype::F32,
            prepared: None,
            v4,
        })
    }

    /// `config.json` (its EOS ids joined by `generation_config.json`'s), `generation_config.json`
    /// and the tokenizer.
    fn metadata(dir: &Path) -> Result<(ModelConfig, GenerationConfig, TextCodec), ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::format(dir, "not a directory"));
        }
        let mut config = ModelConfig::from_file(&dir.join("config.json"))?;
        let generation = GenerationConfig::load(dir)?;
        for &id in &generation.eos_token_ids {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
        Ok((config, generation, TextCodec::load(dir)?))
    }
}

/// The README's examples, compiled as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
