//! `generation_config.json`: the end-of-sequence ids a model may end on beyond `config.json`'s, and
//! the sampling settings its authors recommend, used where a request gives none (as vLLM's
//! `--generation-config auto` does).

use std::path::Path;

use serde::Deserialize;

use crate::{ModelError, SamplingParams};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Ids {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Default, Deserialize)]
struct Raw {
    eos_token_id: Option<Ids>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
}

/// What a model folder's `generation_config.json` says (everything empty when it has none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a folder without one gives the empty config, a malformed
    /// one an error naming it.
    pub fn load(dir: &Path) -> Result<GenerationConfig, ModelError> {
        let path = dir.join("generation_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json(&text).map_err(|problem| ModelError::format(&path, problem)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(GenerationConfig::default()),
            Err(e) => Err(ModelError::io(&path, e)),
        }
    }

    pub fn from_json(text: &str) -> Result<GenerationConfig, String> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Ok(GenerationConfig {
            eos_token_ids: match raw.eos_token_id {
                Some(Ids::One(id)) => vec![id],
                Some(Ids::Many(ids)) => ids,
                None => Vec::new(),
            },
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k.map(|k| usize::try_from(k).unwrap_or(0)),
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
        })
    }

    /// The sampling settings a request without its own starts from: the model's, over the defaults.
    pub fn sampling_defaults(&self) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            ..d
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eos_lists_and_sampling_defaults() {
        let g = GenerationConfig::from_json(
            r#"{"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": true,
                "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"}"#,
        )
        .unwrap();
        assert_eq!(g.eos_token_ids, [128001, 128008, 128009]);
        let s = g.sampling_defaults();
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.6, 0.9, 0, 0.0));
        let one = GenerationConfig::from_json(r#"{"eos_token_id": 2, "top_k": 20}"#).unwrap();
        assert_eq!((one.eos_token_ids.clone(), one.sampling_defaults().top_k), (vec![2], 20));
        assert_eq!(GenerationConfig::from_json("{}").unwrap().sampling_defaults(), SamplingParams::default());
        assert!(GenerationConfig::from_json(r#"{"temperature": "warm"}"#).is_err());
    }
}
