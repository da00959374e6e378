//! Weights from safetensors (one file or an index of shards) through memmap2, converted to f32.

use std::path::Path;

use crate::config::MoeNames;
pub use crate::shards::CheckpointDtype;
use crate::shards::Shards;

use crate::{ModelConfig, ModelError};

/// One transformer layer's weights, row-major `[out, in]` matrices.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub o: Vec<f32>,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    /// Qwen3's per-head RMSNorm weights of Q and K (`head_dim` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_norm: Vec<f32>,
    /// The dense FFN (empty in a layer of experts).
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    /// The layer's experts, in a mixture-of-experts layer.
    pub moe: Option<MoeWeights>,
    /// Latent attention's projections (DeepSeek), in place of `q`, `k` and `v`.
    pub mla: Option<MlaWeights>,
}

/// One layer's multi-head latent attention (DeepSeek), row-major `[out, in]` matrices. Each rope
/// part's rows are put in rotate-half order as they are loaded (`[0, 2, 4, .., 1, 3, 5, ..]` of the
/// checkpoint's interleaved pairs): the same rotation, and the one rope convention the engine runs.
#[derive(Debug, Clone)]
pub struct MlaWeights {
    /// `q_a_proj` `[q_lora, hidden]` and `q_a_layernorm` `[q_lora]`; `None` where `q_proj` reads
    /// the hidden state itself.
    pub q_a: Option<(Vec<f32>, Vec<f32>)>,
    /// `q_b_proj` `[heads x (nope + rope), q_lora]`, or `q_proj` `[heads x (nope + rope), hidden]`.
    pub q_b: Vec<f32>,
    /// `kv_a_proj_with_mqa` `[kv_lora + rope, hidden]`: the latent, then the shared rope key.
    pub kv_a: Vec<f32>,
    /// `kv_a_layernorm` `[kv_lora]`.
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj`'s key rows, per head and transposed: `[heads][kv_lora][nope]`, so a head's query
    /// is taken into the latent's space (absorbed) by one product.
    pub k_up_t: Vec<f32>,
    /// `kv_b_proj`'s value rows, per head: `[heads][v_head_dim][kv_lora]`.
    pub v_up: Vec<f32>,
    /// V3.2's lightning indexer (kept in f32 whatever the served format).
    pub indexer: Option<IndexerWeights>,
}

/// V3.2's lightning indexer: `self_attn.indexer.*`.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// `wq_b` `[heads x head_dim, q_lora]`, reading the query LoRA's normed output.
    pub wq_b: Vec<f32>,
    /// `wk` `[head_dim, hidden]`.
    pub wk: Vec<f32>,
    /// `k_norm`: a LayerNorm's weight and bias `[head_dim]`.
    pub k_norm: (Vec<f32>, Vec<f32>),
    /// `weights_proj` `[heads, hidden]`: each head's weight per token.
    pub weights_proj: Vec<f32>,
}

impl MlaWeights {
    fn values(&self) -> usize {
        let q_a = self.q_a.as_ref().map_or(0, |(m, n)| m.len() + n.len());
        let indexer = self.indexer.as_ref().map_or(0, |i| {
            i.wq_b.len() + i.wk.len() + i.k_norm.0.len() + i.k_norm.1.len() + i.weights_proj.len()
        });
        q_a + self.q_b.len()
            + self.kv_a.len()
            + self.kv_a_norm.len()
            + self.k_up_t.len()
            + self.v_up.len()
            + indexer
    }
}

impl LayerWeights {
    /// Frees the f32 projection matrices, the experts' and latent attention's included (norms,
    /// biases and the experts' router stay).
    pub(crate) fn release_projections(&mut self) {
        for m in
            [&mut self.q, &mut self.k, &mut self.v, &mut self.o, &mut self.gate, &mut self.up, &mut self.down]
        {
            *m = Vec::new();
        }
        if let Some(moe) = &mut self.moe {
            for e in moe.experts.iter_mut().chain(&mut moe.shared) {
                *e = Expert { gate: Vec::new(), up: Vec::new(), down: Vec::new() };
            }
        }
        if let Some(m) = &mut self.mla {
            m.q_a = m.q_a.take().map(|(_, norm)| (Vec::new(), norm));
            for v in [&mut m.q_b, &mut m.kv_a, &mut m.k_up_t, &mut m.v_up] {
                *v = Vec::new();
            }
        }
    }
}

/// A mixture-of-experts layer's router and experts.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[experts, hidden]`
    pub router: Vec<f32>,
    /// `e_score_correction_bias` `[experts]` (DeepSeek V3): added to the scores to choose only.
    pub bias: Option<Vec<f32>>,
    pub experts: Vec<Expert>,
    /// The shared experts, stacked into one (DeepSeek): every token runs it.
    pub shared: Option<Expert>,
}

impl Expert {
    fn values(&self) -> usize {
        self.gate.len() + self.up.len() + self.down.len()
    }
}

/// One SwiGLU expert: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
pub struct Expert {
    /// `[intermediate, hidden]`
    pub gate: Vec<f32>,
    /// `[intermediate, hidden]`
    pub up: Vec<f32>,
    /// `[hidden, intermediate]`
    pub down: Vec<f32>,
}

/// All weights of a model, in f32.
#[derive(Debug, Clone)]
pub struct Weights {
    /// `[vocab, hidden]`
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Vec<f32>>,
    /// The draft layer's own weights (`ModelConfig::draft_layers`); its decoder layer is the last of
    /// `layers`.
    pub draft: Option<DraftWeights>,
}

/// DeepSeek's multi-token prediction layer, less its decoder layer: row `j`'s input is
/// `eh_proj([enorm(embed(t_{j+1})) | hnorm(h_j)])`, `h_j` the main model's final (normed) hidden
/// state at `j`; its decoder layer's output, normed by `head_norm`, goes through the model's LM head.
/// The layer's own copies of the embedding and the LM head (`embed_tokens`, `shared_head.head`) are
/// those of the model (DeepSeek-V3 shares them) and are not read.
#[derive(Debug, Clone)]
pub struct DraftWeights {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[hidden, 2 x hidden]`
    pub eh_proj: Vec<f32>,
    /// `shared_head.norm`
    pub head_norm: Vec<f32>,
}

impl Weights {
    /// Weights of `config`'s dense shape (no experts, no norms on Q and K, the head tied to the
    /// embedding, every norm 1), each matrix (and, with `biases`, the Q, K and V biases) the values
    /// `fill` gives for its length. `fill` is called in one fixed order: per layer Q, K, V, O, then
    /// the biases, gate, up and down; the embedding last. For tests and benchmarks without a
    /// checkpoint.
    pub fn filled(config: &ModelConfig, biases: bool, fill: &mut dyn FnMut(usize) -> Vec<f32>) -> Weights {
        let c = config;
        let (h, i, q, kv) =
            (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let layers = (0..c.num_layers)
            .map(|_| LayerWeights {
                input_norm: vec![1.0; h],
                q: fill(q * h),
                k: fill(kv * h),
                v: fill(kv * h),
                o: fill(h * q),
                q_bias: biases.then(|| fill(q)),
                k_bias: biases.then(|| fill(kv)),
                v_bias: biases.then(|| fill(kv)),
                o_bias: None,
                q_norm: None,
                k_norm: None,
                post_norm: vec![1.0; h],
                gate: fill(i * h),
                up: fill(i * h),
                down: fill(h * i),
                moe: None,
                mla: None,
            })
            .collect();
        Weights {
            embed: fill(c.vocab_size * h),
            layers,
            final_norm: vec![1.0; h],
            lm_head: None,
            draft: None,
        }
    }

    /// [`filled`](Self::filled) with values uniform in `-scale / 2..scale / 2`, drawn by a xorshift
    /// generator from `seed` (not zero): the same seed, the same weights.
    pub fn random(config: &ModelConfig, biases: bool, seed: u64, scale: f32) -> Weights {
        let mut s = seed.max(1);
        Weights::filled(config, biases, &mut |n| {
            (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
                })
                .collect()
        })
    }

    /// Loads every weight `config` calls for from the safetensors in `dir`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Weights, ModelError> {
        Weights::load_with_dtype(dir, config).map(|(w, _)| w)
    }

    /// [`load`](Self::load), also saying what precision the checkpoint stores its projections in (its
    /// first layer's Q projection's).
    pub fn load_with_dtype(
        dir: &Path,
        config: &ModelConfig,
    ) -> Result<(Weights, CheckpointDtype), ModelError> {
        Weights::load_each(dir, config, &mut |_, _, _| Ok(()))
    }

    /// [`load_with_dtype`](Self::load_with_dtype), handing each layer to `each` (with the checkpoint's
    /// precision) as soon as it is read, before the next is: a caller converting layers as they come
    /// and dropping their f32 projections never holds the whole model in f32. `each`'s third argument
    /// reads the layer's FP8 block scales on demand: a layer of the same shape whose every value is
    /// the scale of the block the loaded value came from (0 where it is not FP8), moved as the values
    /// were (stacked, split per head, transposed).
    pub fn load_each(
        dir: &Path,
        config: &ModelConfig,
        each: &mut dyn FnMut(CheckpointDtype, &mut LayerWeights, &ReadScales<'_>) -> Result<(), ModelError>,
    ) -> Result<(Weights, CheckpointDtype), ModelError> {
        let mut s = Shards::open(dir)?;
        s.fp8_block = config.fp8_block;
        let s = s;
        let first = match &config.mla {
            None => "q_proj",
            Some(m) if m.q_lora_rank.is_some() => "q_a_proj",
            Some(_) => "q_proj",
        };
        let dtype = match s.dtype(&format!("model.layers.0.self_attn.{first}.weight")) {
            // Experts shipped in FP4 (MXFP4, as DeepSeek V4's are) make it an FP4 checkpoint: they
            // are most of its bytes, and served in FP4 they stay as shipped. (One tensor, the same
            // every load: the first by name; checking every expert would read a shard's header per
            // tensor, tens of thousands of times on a large model.)
            d if d != CheckpointDtype::Fp4
                && s.index
                    .keys()
                    .filter(|n| n.contains(".experts.") && n.ends_with(".weight"))
                    .min()
                    .is_some_and(|n| s.fp4(n)) =>
            {
                CheckpointDtype::Fp4
            }
            d => d,
        };
        let (h, v) = (config.hidden_size, config.vocab_size);
        let mut layers = Vec::with_capacity(config.num_layers + config.draft_layers);
        for l in 0..config.num_layers + config.draft_layers {
            let mut layer = read_layer(&|n, shape| s.get(n, shape), config, l)?;
            each(dtype, &mut layer, &|| read_layer(&|n, shape| s.block_scales(n, shape), config, l))?;
            layers.push(layer);
        }
        let lm_head = if config.tie_word_embeddings && !s.has("lm_head.weight") {
            None
        } else {
            Some(s.get("lm_head.weight", &[v, h])?)
        };
        let draft = match config.draft_layers {
            0 => None,
            _ => {
                let p = format!("model.layers.{}.", config.num_layers);
                Some(DraftWeights {
                    enorm: s.get(&format!("{p}enorm.weight"), &[h])?,
                    hnorm: s.get(&format!("{p}hnorm.weight"), &[h])?,
                    eh_proj: s.get(&format!("{p}eh_proj.weight"), &[h, 2 * h])?,
                    head_norm: s.get(&format!("{p}shared_head.norm.weight"), &[h])?,
                })
            }
        };
        let w = Weights {
            embed: s.get("model.embed_tokens.weight", &[v, h])?,
            layers,
            final_norm: s.get("model.norm.weight", &[h])?,
            lm_head,
            draft,
        };
        Ok((w, dtype))
    }

    /// Frees the f32 projection matrices (and, with `lm_head`, an untied LM head) once every product
    /// reads other copies of them (quantized for decode, bf16 for longer steps). Norms, biases, the
    /// embedding (looked up by row) and the experts stay.
    pub(crate) fn release_projections(&mut self, lm_head: bool) {
        for l in &mut self.layers {
            l.release_projections();
        }
        if lm_head && self.lm_head.is_some() {
            self.lm_head = Some(Vec::new());
        }
    }

    /// Bytes of the f32 values held.
    pub fn bytes(&self) -> usize {
        let layer = |l: &LayerWeights| {
            let opt = [&l.q_bias, &l.k_bias, &l.v_bias, &l.o_bias, &l.q_norm, &l.k_norm];
            let experts = l.moe.as_ref().map_or(0, |m| {
                m.router.len()
                    + m.bias.as_ref().map_or(0, Vec::len)
                    + m.experts.iter().map(Expert::values).sum::<usize>()
                    + m.shared.as_ref().map_or(0, Expert::values)
            });
            let experts = experts + l.mla.as_ref().map_or(0, MlaWeights::values);
            [&l.input_norm, &l.q, &l.k, &l.v, &l.o, &l.post_norm, &l.gate, &l.up, &l.down]
                .iter()
                .map(|m| m.len())
                .sum::<usize>()
                + opt.iter().map(|m| m.as_ref().map_or(0, Vec::len)).sum::<usize>()
                + experts
        };
        let draft = self
            .draft
            .as_ref()
            .map_or(0, |d| d.enorm.len() + d.hnorm.len() + d.eh_proj.len() + d.head_norm.len());
        let n = self.embed.len()
            + draft
            + self.final_norm.len()
            + self.lm_head.as_ref().map_or(0, Vec::len)
            + self.layers.iter().map(layer).sum::<usize>();
        n * 4
    }

    /// The output projection `[vocab, hidden]`.
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

/// Reads the FP8 block scales of the layer just loaded (see `Weights::load_each`).
pub type ReadScales<'a> = dyn Fn() -> Result<LayerWeights, ModelError> + 'a;

/// How a layer's tensors are read: by name and shape, as f32 values (or, for the FP8 block scales,
/// one scale per value).
type Get<'a> = dyn Fn(&str, &[usize]) -> Result<Vec<f32>, ModelError> + 'a;

/// Layer `l` of a model shaped by `config`, each tensor read by `get`.
fn read_layer(get: &Get<'_>, config: &ModelConfig, l: usize) -> Result<LayerWeights, ModelError> {
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let (q_out, kv_out) = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim);
    let p = format!("model.layers.{l}.");
    let bias = |name: &str, n: usize, on: bool| -> Result<Option<Vec<f32>>, ModelError> {
        if on {
            get(&format!("{p}{name}"), &[n]).map(Some)
        } else {
            Ok(None)
        }
    };
    let sparse = config.moe.as_ref().filter(|m| m.is_sparse(l));
    let moe = match sparse {
        None => None,
        Some(m) => {
            let (pre, [g, u, d]) = match m.names {
                MoeNames::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                MoeNames::Qwen => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
            };
            let ei = m.intermediate_size;
            let experts = (0..m.experts)
                .map(|e| {
                    let t =
                        |n: &str, shape: &[usize]| get(&format!("{p}{pre}.experts.{e}.{n}.weight"), shape);
                    Ok(Expert { gate: t(g, &[ei, h])?, up: t(u, &[ei, h])?, down: t(d, &[h, ei])? })
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            let shared = match m.shared_intermediate {
                None => None,
                Some(si) => {
                    let t =
                        |n: &str, shape: &[usize]| get(&format!("{p}{pre}.shared_experts.{n}.weight"), shape);
                    Some(Expert { gate: t(g, &[si, h])?, up: t(u, &[si, h])?, down: t(d, &[h, si])? })
                }
            };
            let bias = m
                .correction_bias
                .then(|| get(&format!("{p}{pre}.gate.e_score_correction_bias"), &[m.experts]));
            Some(MoeWeights {
                router: get(&format!("{p}{pre}.gate.weight"), &[m.experts, h])?,
                bias: bias.transpose()?,
                experts,
                shared,
            })
        }
    };
    let dense = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
        if moe.is_some() {
            Ok(Vec::new())
        } else {
            get(&format!("{p}mlp.{name}.weight"), shape)
        }
    };
    let mla = match &config.mla {
        None => None,
        Some(m) => Some(load_mla(get, &p, config, m)?),
    };
    let attn = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
        if mla.is_some() {
            Ok(Vec::new())
        } else {
            get(&format!("{p}self_attn.{name}.weight"), shape)
        }
    };
    let o_in = config.mla.as_ref().map_or(q_out, |m| config.num_heads * m.v_head_dim);
    Ok(LayerWeights {
        input_norm: get(&format!("{p}input_layernorm.weight"), &[h])?,
        q: attn("q_proj", &[q_out, h])?,
        k: attn("k_proj", &[kv_out, h])?,
        v: attn("v_proj", &[kv_out, h])?,
        o: get(&format!("{p}self_attn.o_proj.weight"), &[h, o_in])?,
        q_bias: bias("self_attn.q_proj.bias", q_out, config.qkv_bias)?,
        k_bias: bias("self_attn.k_proj.bias", kv_out, config.qkv_bias)?,
        v_bias: bias("self_attn.v_proj.bias", kv_out, config.qkv_bias)?,
        o_bias: bias("self_attn.o_proj.bias", h, config.o_bias)?,
        q_norm: bias("self_attn.q_norm.weight", config.head_dim, config.qk_norm)?,
        k_norm: bias("self_attn.k_norm.weight", config.head_dim, config.qk_norm)?,
        post_norm: get(&format!("{p}post_attention_layernorm.weight"), &[h])?,
        gate: dense("gate_proj", &[i, h])?,
        up: dense("up_proj", &[i, h])?,
        down: dense("down_proj", &[h, i])?,
        moe,
        mla,
    })
}

/// A DeepSeek layer's latent attention weights, the rope rows put in rotate-half order and
/// `kv_b_proj` split per head into its key part (transposed) and its value part.
fn load_mla(get: &Get<'_>, p: &str, c: &ModelConfig, m: &crate::Mla) -> Result<MlaWeights, ModelError> {
    let (h, nh) = (c.hidden_size, c.num_heads);
    let (nope, rope, vd, lora) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
    let get = |name: &str, shape: &[usize]| get(&format!("{p}self_attn.{name}"), shape);
    let q_a = match m.q_lora_rank {
        None => None,
        Some(r) => Some((get("q_a_proj.weight", &[r, h])?, get("q_a_layernorm.weight", &[r])?)),
    };
    let (q_name, q_in) = match m.q_lora_rank {
        None => ("q_proj.weight", h),
        Some(r) => ("q_b_proj.weight", r),
    };
    let mut q_b = get(q_name, &[nh * (nope + rope), q_in])?;
    for head in 0..nh {
        deinterleave_rows(&mut q_b, head * (nope + rope) + nope, rope, q_in);
    }
    let mut kv_a = get("kv_a_proj_with_mqa.weight", &[lora + rope, h])?;
    deinterleave_rows(&mut kv_a, lora, rope, h);
    let kv_b = get("kv_b_proj.weight", &[nh * (nope + vd), lora])?;
    let (mut k_up_t, mut v_up) = (vec![0.0; nh * lora * nope], Vec::with_capacity(nh * vd * lora));
    for head in 0..nh {
        let rows = &kv_b[head * (nope + vd) * lora..(head + 1) * (nope + vd) * lora];
        for i in 0..nope {
            for (col, &v) in rows[i * lora..(i + 1) * lora].iter().enumerate() {
                k_up_t[(head * lora + col) * nope + i] = v;
            }
        }
        v_up.extend_from_slice(&rows[nope * lora..]);
    }
    let indexer = match (m.indexer, m.q_lora_rank) {
        (Some(ix), Some(r)) => Some(IndexerWeights {
            wq_b: get("indexer.wq_b.weight", &[ix.heads * ix.head_dim, r])?,
            wk: get("indexer.wk.weight", &[ix.head_dim, h])?,
            k_norm: (
                get("indexer.k_norm.weight", &[ix.head_dim])?,
                get("indexer.k_norm.bias", &[ix.head_dim])?,
            ),
            weights_proj: get("indexer.weights_proj.weight", &[ix.heads, h])?,
        }),
        _ => None,
    };
    Ok(MlaWeights {
        q_a,
        q_b,
        kv_a,
        kv_a_norm: get("kv_a_layernorm.weight", &[lora])?,
        k_up_t,
        v_up,
        indexer,
    })
}

/// Rows `first..first + n` of a `[rows, cols]` matrix reordered from interleaved rope pairs
/// (`x0 y0 x1 y1 ..`) to rotate-half order (`x0 x1 .. y0 y1 ..`): new row `j` is old row `2j` for
/// the first half and `2(j - n/2) + 1` for the second, as transformers' interleaved rope permutes
/// them before rotating halves.
fn deinterleave_rows(m: &mut [f32], first: usize, n: usize, cols: usize) {
    let old = m[first * cols..(first + n) * cols].to_vec();
    for j in 0..n {
        let from = if j < n / 2 { 2 * j } else { 2 * (j - n / 2) + 1 };
        m[(first + j) * cols..(first + j + 1) * cols].copy_from_slice(&old[from * cols..(from + 1) * cols]);
    }
}
