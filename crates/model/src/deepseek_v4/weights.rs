//! DeepSeek V4's tensors under the names its checkpoints ship (`embed.weight`, `layers.L.attn.wq_a.weight`,
//! `layers.L.ffn.experts.E.w1.weight`, `layers.L.hc_attn_fn`, ...): the projections held as shipped
//! (FP8 blocks, MXFP4 experts, bf16), everything else in f32.

use std::ops::Range;
use std::path::Path;

use crate::config::{V4Config, V4Layer};
use crate::quant::QuantMatrix;
use crate::shards::{CheckpointDtype, Shards};
use crate::{Fp4Matrix, Fp8Matrix, ModelError, Plain};

/// Products of at least this many weights run on the thread pool.
const PARALLEL_VALUES: usize = 1 << 16;

/// A projection `[rows, cols]` held as the checkpoint ships it: FP8 codes with their block scales,
/// FP4 codes (MXFP4, NVFP4) with their group scales, or plain values (bf16 where every value is
/// one), each row's product widened inside the dot kernels.
#[derive(Debug)]
pub(crate) enum Mat {
    Plain { values: Plain, cols: usize },
    Fp8(Fp8Matrix),
    Fp4(Fp4Matrix),
}

impl Mat {
    pub(crate) fn rows(&self) -> usize {
        match self {
            Mat::Plain { values: Plain::F32(v), cols } => v.len() / cols,
            Mat::Plain { values: Plain::Bf16(v), cols } => v.len() / cols,
            Mat::Fp8(m) => m.rows,
            Mat::Fp4(m) => m.rows,
        }
    }

    /// The matrix times `x`.
    pub(crate) fn times(&self, x: &[f32]) -> Vec<f32> {
        self.rows_times(0..self.rows(), x)
    }

    /// Rows `rows` of the matrix times `x`.
    pub(crate) fn rows_times(&self, rows: Range<usize>, x: &[f32]) -> Vec<f32> {
        // Each row's dot is the same arithmetic on any thread: large products split over the pool.
        if rows.len() * x.len() < PARALLEL_VALUES {
            return rows.map(|r| self.dot(r, x)).collect();
        }
        use rayon::prelude::*;
        rows.into_par_iter().with_min_len(64).map(|r| self.dot(r, x)).collect()
    }

    /// The matrix times each of `xs`: each product exactly [`times`](Self::times)'s (the same dot
    /// per row and input), each row read once for all of them.
    pub(crate) fn times_many(&self, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        self.rows_times_many(0..self.rows(), xs)
    }

    /// Rows `rows` of the matrix times each of `xs` (see [`times_many`](Self::times_many)).
    pub(crate) fn rows_times_many(&self, rows: Range<usize>, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        if xs.len() == 1 {
            return vec![self.rows_times(rows, &xs[0])];
        }
        let n = rows.len();
        let by_row = |r: usize| -> Vec<f32> { xs.iter().map(|x| self.dot(r, x)).collect() };
        let work = n * xs.first().map_or(0, Vec::len) * xs.len();
        let columns: Vec<Vec<f32>> = if work < PARALLEL_VALUES {
            rows.map(by_row).collect()
        } else {
            use rayon::prelude::*;
            rows.into_par_iter().with_min_len(16).map(by_row).collect()
        };
        (0..xs.len()).map(|t| columns.iter().map(|c| c[t]).collect()).collect()
    }

    /// `x` . row `r`.
    fn dot(&self, r: usize, x: &[f32]) -> f32 {
        match self {
            Mat::Plain { values: Plain::F32(v), cols } => crate::sys::dot(x, &v[r * cols..(r + 1) * cols]),
            Mat::Plain { values: Plain::Bf16(v), cols } => {
                crate::sys::dot_bf16(x, &v[r * cols..(r + 1) * cols])
            }
            Mat::Fp8(m) => m.dot_row(r, x, &[]),
            Mat::Fp4(m) => m.dot_row(r, x, &[]),
        }
    }

    /// Row `r` of a plain matrix (an embedding's), as f32.
    pub(crate) fn row(&self, r: usize) -> Vec<f32> {
        match self {
            Mat::Plain { values: Plain::F32(v), cols } => v[r * cols..(r + 1) * cols].to_vec(),
            Mat::Plain { values: Plain::Bf16(v), cols } => {
                v[r * cols..(r + 1) * cols].iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect()
            }
            Mat::Fp8(m) => m.dequantize_row(r),
            Mat::Fp4(m) => m.dequantize_row(r),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Mat::Plain { values, .. } => values.bytes(),
            Mat::Fp8(m) => m.bytes(),
            Mat::Fp4(m) => m.bytes(),
        }
    }

    /// Tensor `name` of `[rows, cols]` from `s`, as shipped.
    fn read(s: &Shards, name: &str, [rows, cols]: [usize; 2]) -> Result<Mat, ModelError> {
        let v = s.get(name, &[rows, cols])?;
        let (fp4, fp8) = (s.fp4(name), s.fp8_block.is_some() && s.dtype(name) == CheckpointDtype::Fp8);
        let shipped = match (fp4, fp8) {
            (false, false) => None,
            _ => {
                let scales = s.block_scales(name, &[rows, cols])?;
                match fp4 {
                    true => Fp4Matrix::from_groups(&v, &scales, rows, cols).map(Mat::Fp4),
                    false => Fp8Matrix::from_blocks(&v, &scales, rows, cols).map(Mat::Fp8),
                }
            }
        };
        Ok(shipped.unwrap_or_else(|| Mat::Plain { values: Plain::of(&v), cols }))
    }
}

/// A compressor: per token a value `wkv h` and a gate `wgate h + ape[pos % ratio]` of `width`
/// (2 x the row for the overlapping ratio-4 compressor, 1 x otherwise), softmax-pooled into rows.
#[derive(Debug)]
pub(crate) struct Compressor {
    pub wkv: Mat,
    pub wgate: Mat,
    /// `[ratio, width]`
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub width: usize,
}

/// The lightning indexer of a compressed sparse layer.
#[derive(Debug)]
pub(crate) struct Indexer {
    pub wq_b: Mat,
    pub weights_proj: Mat,
    pub compressor: Compressor,
}

/// The mixing weights of one manifold-constrained hyper-connection (`hc_{attn,ffn,head}_*`).
#[derive(Debug)]
pub(crate) struct HyperConnection {
    /// `[rows, hc_mult * hidden]`
    pub func: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

/// A SwiGLU expert: `w2(silu(w1 x) * w3 x)`.
#[derive(Debug)]
pub(crate) struct Expert {
    pub w1: Mat,
    pub w2: Mat,
    pub w3: Mat,
}

#[derive(Debug)]
pub(crate) enum Routing {
    /// `tid2eid`: each token id's experts.
    Hash(Vec<usize>),
    /// The top-k of the scores plus this bias (which chooses only).
    Scored(Option<Vec<f32>>),
}

#[derive(Debug)]
pub(crate) struct V4LayerWeights {
    pub kind: V4Layer,
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HyperConnection,
    pub hc_ffn: HyperConnection,
    pub wq_a: Mat,
    pub q_norm: Vec<f32>,
    pub wq_b: Mat,
    pub wkv: Mat,
    pub kv_norm: Vec<f32>,
    pub wo_a: Mat,
    pub wo_b: Mat,
    pub sink: Vec<f32>,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
    pub gate: Mat,
    pub routing: Routing,
    pub experts: Vec<Expert>,
    pub shared: Expert,
}

/// A multi-token prediction layer (`mtp.I.`): the next token's embedding and the main model's
/// streams projected into its own streams, a decoder layer, its own hyper-connection head and norm.
#[derive(Debug)]
pub(crate) struct V4Draft {
    pub e_proj: Mat,
    pub h_proj: Mat,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub norm: Vec<f32>,
    pub hc_head: HyperConnection,
    pub layer: V4LayerWeights,
}

#[derive(Debug)]
pub(crate) struct V4Weights {
    /// `[vocab, hidden]`, a `Plain` matrix (bf16 where exact).
    pub embed: Mat,
    pub head: Mat,
    pub norm: Vec<f32>,
    pub hc_head: HyperConnection,
    pub layers: Vec<V4LayerWeights>,
    pub draft: Option<V4Draft>,
    /// Bytes of the values held.
    pub bytes: usize,
}

impl V4Weights {
    pub(crate) fn load(dir: &Path, c: &V4Config) -> Result<V4Weights, ModelError> {
        let mut s = Shards::open(dir)?;
        // Dense projections in FP8 with a scale per block; experts in FP4 are told by their tensors.
        s.fp8_block = c.fp8_block;
        let s = s;
        // Every tensor read, counted: the bytes held.
        let held = std::cell::Cell::new(0usize);
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
            let v = s.get(name, shape)?;
            held.set(held.get() + 4 * v.len());
            Ok(v)
        };
        let mat = |name: &str, shape: [usize; 2]| -> Result<Mat, ModelError> {
            let m = Mat::read(&s, name, shape)?;
            held.set(held.get() + m.bytes());
            Ok(m)
        };
        let (d, v, n) = (c.hidden, c.vocab, c.hc_mult);
        let mix = (2 + n) * n;
        let hc = |p: &str, rows: usize, scales: usize| -> Result<HyperConnection, ModelError> {
            Ok(HyperConnection {
                func: get(&format!("{p}fn"), &[rows, n * d])?,
                base: get(&format!("{p}base"), &[rows])?,
                scale: get(&format!("{p}scale"), &[scales])?,
            })
        };
        let compressor = |p: &str, ratio: usize, row: usize| -> Result<Compressor, ModelError> {
            let width = if ratio == 4 { 2 * row } else { row };
            Ok(Compressor {
                wkv: mat(&format!("{p}wkv.weight"), [width, d])?,
                wgate: mat(&format!("{p}wgate.weight"), [width, d])?,
                ape: get(&format!("{p}ape"), &[ratio, width])?,
                norm: get(&format!("{p}norm.weight"), &[row])?,
                width,
            })
        };
        let expert = |p: &str, inter: usize| -> Result<Expert, ModelError> {
            Ok(Expert {
                w1: mat(&format!("{p}w1.weight"), [inter, d])?,
                w2: mat(&format!("{p}w2.weight"), [d, inter])?,
                w3: mat(&format!("{p}w3.weight"), [inter, d])?,
            })
        };
        let (h, hd, ql) = (c.heads, c.head_dim, c.q_lora);
        let mut layers = Vec::with_capacity(c.layers + c.mtp_layers.min(1));
        // The main layers, then the first MTP layer's decoder layer (never hash-routed).
        for l in 0..c.layers + c.mtp_layers.min(1) {
            let p = if l < c.layers { format!("layers.{l}.") } else { format!("mtp.{}.", l - c.layers) };
            let a = format!("{p}attn.");
            let kind = c.kinds[l];
            let routing = if l < c.hash_layers.min(c.layers) {
                let (ids, shape) = s.get_ints(&format!("{p}ffn.gate.tid2eid"))?;
                if shape != [v, c.top_k] || ids.iter().any(|&e| e < 0 || e as usize >= c.experts) {
                    return Err(ModelError::format(
                        dir,
                        format!("{p}ffn.gate.tid2eid: shape {shape:?} or experts out of range"),
                    ));
                }
                Routing::Hash(ids.into_iter().map(|e| e as usize).collect())
            } else {
                let bias = format!("{p}ffn.gate.bias");
                Routing::Scored(if s.has(&bias) { Some(get(&bias, &[c.experts])?) } else { None })
            };
            layers.push(V4LayerWeights {
                kind,
                attn_norm: get(&format!("{p}attn_norm.weight"), &[d])?,
                ffn_norm: get(&format!("{p}ffn_norm.weight"), &[d])?,
                hc_attn: hc(&format!("{p}hc_attn_"), mix, 3)?,
                hc_ffn: hc(&format!("{p}hc_ffn_"), mix, 3)?,
                wq_a: mat(&format!("{a}wq_a.weight"), [ql, d])?,
                q_norm: get(&format!("{a}q_norm.weight"), &[ql])?,
                wq_b: mat(&format!("{a}wq_b.weight"), [h * hd, ql])?,
                wkv: mat(&format!("{a}wkv.weight"), [hd, d])?,
                kv_norm: get(&format!("{a}kv_norm.weight"), &[hd])?,
                wo_a: mat(&format!("{a}wo_a.weight"), [c.o_groups * c.o_lora, h * hd / c.o_groups])?,
                wo_b: mat(&format!("{a}wo_b.weight"), [d, c.o_groups * c.o_lora])?,
                sink: get(&format!("{a}attn_sink"), &[h])?,
                compressor: match kind.ratio() {
                    0 => None,
                    r => Some(compressor(&format!("{a}compressor."), r, hd)?),
                },
                indexer: match kind {
                    V4Layer::CompressedSparse => Some(Indexer {
                        wq_b: mat(&format!("{a}indexer.wq_b.weight"), [c.index_heads * c.index_dim, ql])?,
                        weights_proj: mat(&format!("{a}indexer.weights_proj.weight"), [c.index_heads, d])?,
                        compressor: compressor(&format!("{a}indexer.compressor."), 4, c.index_dim)?,
                    }),
                    _ => None,
                },
                gate: mat(&format!("{p}ffn.gate.weight"), [c.experts, d])?,
                routing,
                experts: (0..c.experts)
                    .map(|e| expert(&format!("{p}ffn.experts.{e}."), c.moe_intermediate))
                    .collect::<Result<_, _>>()?,
                shared: expert(
                    &format!("{p}ffn.shared_experts."),
                    c.moe_intermediate * c.shared_experts.max(1),
                )?,
            });
        }
        let draft = match c.mtp_layers {
            0 => None,
            _ => Some(V4Draft {
                e_proj: mat("mtp.0.e_proj.weight", [d, d])?,
                h_proj: mat("mtp.0.h_proj.weight", [d, d])?,
                enorm: get("mtp.0.enorm.weight", &[d])?,
                hnorm: get("mtp.0.hnorm.weight", &[d])?,
                norm: get("mtp.0.norm.weight", &[d])?,
                hc_head: hc("mtp.0.hc_head_", n, 1)?,
                layer: layers.pop().expect("the MTP layer, read last"),
            }),
        };
        Ok(V4Weights {
            embed: {
                let m = Mat::Plain { values: Plain::of(&s.get("embed.weight", &[v, d])?), cols: d };
                held.set(held.get() + m.bytes());
                m
            },
            head: mat("head.weight", [v, d])?,
            norm: get("norm.weight", &[d])?,
            hc_head: hc("hc_head_", n, 1)?,
            layers,
            draft,
            bytes: held.get(),
        })
    }
}
