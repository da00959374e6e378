//! Weight formats for the CPU backend: f32 as loaded, Q8 (int8 in groups of 32 with an f16 scale:
//! 1.0625 bytes per weight, like GGUF's Q8_0), Q4 (4-bit in groups of 32 with an f16 scale and
//! minimum: 0.625 bytes, like GGUF's Q4_1), f16 and bf16 (see [`Bf16Matrix`]). Decode steps are bound
//! by reading the weights once per token, so the bytes a weight costs set the speed; every step,
//! whatever its row count, reads the same matrices.

use crate::bits16::{bf16_bits, f16_bits, f16_value};
use crate::ModelConfig;

/// Values per quantization group (one scale, and for Q4 one minimum, each).
pub const GROUP: usize = 32;

/// `v` stored as f16 and read back; `None` if it does not fit (overflow to infinity).
fn through_f16(v: f32) -> Option<(u16, f32)> {
    let h = f16_bits(v);
    let back = f16_value(h);
    back.is_finite().then_some((h, back))
}

/// How the CPU backend stores the weights its decode steps read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The loaded f32 weights.
    #[default]
    F32,
    /// Symmetric int8 in groups of 32 with an f32 scale (like GGUF's Q8_0): 1.125 bytes per weight.
    Q8,
    /// Unsigned 4-bit in groups of 32 with an f32 scale and minimum (like GGUF's Q4_1, which the
    /// default model's projections ship in, so they come back exactly): 0.75 bytes per weight; the
    /// LM head stays Q8.
    Q4,
    /// Every projection and the LM head in bf16 (as bf16 checkpoints ship them): 2 bytes per weight,
    /// the f32 copies freed after load; AVX-512 BF16 dot products where the CPU has them.
    Bf16,
    /// Every projection in f16, as f16 checkpoints ship them (exact for those, 2 bytes per weight),
    /// widened to f32 as steps read them; the embedding and LM head stay f32.
    F16,
    /// Every projection in FP8 e4m3 with an f32 scale per row and group of up to 128 columns (see
    /// `fp8::Fp8Matrix`): a block-scaled FP8 checkpoint's bytes and scales as shipped
    /// (about 1.03 bytes per weight), widened as steps read them to the very values the f32 loader
    /// computes; any other checkpoint's projections quantized with a scale per group (`max |w| /
    /// 448`; so too a projection an FP8 checkpoint ships in another dtype, which then loses
    /// precision). The LM head and embedding stay f32.
    Fp8,
    /// Every projection in FP4 e2m1, 4 bits a weight, with an f32 scale per row and group of 16 or
    /// 32 columns (see `fp4::Fp4Matrix`): an NVFP4 or MXFP4 checkpoint's codes and scales as
    /// shipped (about 0.75 bytes per weight), widened by table as steps read them to the values the
    /// f32 loader computes; any other checkpoint's projections quantized with a scale per 16
    /// (`max |w| / 6`: coarse). The LM head and embedding stay f32.
    Fp4,
    /// The checkpoint's own precision: FP8 for a block-scaled FP8 checkpoint, bf16 for a bf16 one
    /// (panels for the bf16 GEMM where the CPU has it and the shapes fill them, rows on the AVX2
    /// kernels), f16 for an f16 one, f32 otherwise (experts and latent attention alike).
    /// See [`resolve`](Self::resolve); a backend given `Auto` itself runs f32.
    Auto,
}

impl WeightFormat {
    /// The name used in flags and metadata: "f32", "q8", "q4" or "bf16".
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Q8 => "q8",
            WeightFormat::Q4 => "q4",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F16 => "f16",
            WeightFormat::Fp8 => "fp8",
            WeightFormat::Fp4 => "fp4",
            WeightFormat::Auto => "auto",
        }
    }

    /// `Auto` made concrete for a checkpoint stored as `dtype` of a model shaped by `c`; any other
    /// format as it is. A bf16 checkpoint is served in bf16: in the bf16 GEMM's panels where the CPU
    /// has AVX-512 BF16 (and the shapes fill them), row-major where it has only the AVX2 kernels
    /// (widened exactly as they are read, every product the bits of the f32 copy's at half its
    /// bytes), else widened to f32; a block-scaled FP8 one as FP8 (its bytes and scales as shipped,
    /// widened by the kernels: a quarter of f32's bytes), or, with blocks the FP8 kernels cannot
    /// take, as a bf16 one where the bf16 GEMM runs and in f32 elsewhere.
    pub fn resolve(self, dtype: crate::CheckpointDtype, c: &ModelConfig) -> WeightFormat {
        // Every stacked projection's rows fill 32-row panels and its columns pair up.
        let packs = matrix_shapes(c).iter().all(|&(r, k)| r % 32 == 0 && k % 2 == 0);
        match self {
            // (Blocks narrower than the kernels' 16 lanes, whose scales no group of 16 columns
            // shares, once transposed too: served like a bf16 checkpoint.)
            WeightFormat::Auto
                if dtype == crate::CheckpointDtype::Fp8
                    && c.fp8_block.is_none_or(|b| b.iter().all(|n| n.is_multiple_of(16))) =>
            {
                WeightFormat::Fp8
            }
            WeightFormat::Auto
                if matches!(dtype, crate::CheckpointDtype::Bf16 | crate::CheckpointDtype::Fp8)
                    && packs
                    && crate::sys::has_bf16_gemm() =>
            {
                WeightFormat::Bf16
            }
            // A bf16 checkpoint in rows where the AVX2 kernels run without the bf16 GEMM: exactly the
            // f32 copy's bits, at half the bytes. (An FP8 one whose blocks the FP8 kernels cannot
            // take stays f32 there: its values are not all bf16 values.)
            WeightFormat::Auto
                if dtype == crate::CheckpointDtype::Bf16
                    && !crate::sys::has_bf16_gemm()
                    && crate::sys::avx2() =>
            {
                WeightFormat::Bf16
            }
            WeightFormat::Auto if dtype == crate::CheckpointDtype::F16 => WeightFormat::F16,
            WeightFormat::Auto if dtype == crate::CheckpointDtype::Fp4 => WeightFormat::Fp4,
            WeightFormat::Auto => WeightFormat::F32,
            other => other,
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = crate::ModelError;

    fn from_str(s: &str) -> Result<WeightFormat, crate::ModelError> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "q8" => Ok(WeightFormat::Q8),
            "q4" => Ok(WeightFormat::Q4),
            "bf16" => Ok(WeightFormat::Bf16),
            "f16" => Ok(WeightFormat::F16),
            "fp8" => Ok(WeightFormat::Fp8),
            "fp4" => Ok(WeightFormat::Fp4),
            "auto" => Ok(WeightFormat::Auto),
            _ => Err(crate::ModelError::UnknownWeightFormat { value: s.to_owned() }),
        }
    }
}

/// A row-major `[rows, cols]` matrix in a group-quantized format; `cols` is a multiple of [`GROUP`].
pub trait QuantMatrix: Sized + Send + Sync + std::fmt::Debug {
    /// `None` when `cols` is not a multiple of [`GROUP`], the length does not match or a scale does
    /// not fit f16.
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Self>;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Bytes the matrix occupies.
    fn bytes(&self) -> usize;
    /// Row `r` as f32 (for tests and references).
    fn dequantize_row(&self, r: usize) -> Vec<f32>;
    /// `x . row r`, given `xsum[g]` = the sum of `x` over group g.
    fn dot_row(&self, r: usize, x: &[f32], xsum: &[f32]) -> f32;
    /// `out[i] = xs[i] . row r` for several inputs, each value exactly [`dot_row`](Self::dot_row)'s.
    fn dot_rows(&self, r: usize, xs: &[&[f32]], xsums: &[&[f32]], out: &mut [f32]) {
        for ((x, xsum), o) in xs.iter().zip(xsums).zip(out) {
            *o = self.dot_row(r, x, xsum);
        }
    }
    /// `out[w * t + i] = xs[i] . row (r0 + w)` for `rows` rows from `r0` (`t = xs.len()`), each value
    /// exactly [`dot_row`](Self::dot_row)'s.
    fn dot_block(&self, r0: usize, rows: usize, xs: &[&[f32]], xsums: &[&[f32]], out: &mut [f32]) {
        for (w, o) in out.chunks_exact_mut(xs.len().max(1)).take(rows).enumerate() {
            self.dot_rows(r0 + w, xs, xsums, o);
        }
    }
}

/// Symmetric int8: value = q * scale, scale = max |w| / 127 per group, stored as f16.
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<i8>,
    /// One per group of 32 values, row-major, as f16 bits.
    pub scales: Vec<u16>,
}

impl Q8Matrix {
    /// `out[i] = xs[i] . row r` for input rows rounded to int8 (`--activations q8`).
    pub(crate) fn dot_rows_int8(&self, r: usize, xs: &[crate::sys::Int8Row<'_>], out: &mut [f32]) {
        let g = self.cols / GROUP;
        let q = &self.values[r * self.cols..(r + 1) * self.cols];
        crate::sys::dot_q8_int8_rows(xs, q, &self.scales[r * g..(r + 1) * g], out)
    }
}

impl QuantMatrix for Q8Matrix {
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Q8Matrix> {
        if !cols.is_multiple_of(GROUP) || w.len() != rows * cols {
            return None;
        }
        let mut values = Vec::with_capacity(w.len());
        let mut scales = Vec::with_capacity(w.len() / GROUP);
        for g in w.chunks_exact(GROUP) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (bits, scale) = through_f16(amax / 127.0)?;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            scales.push(bits);
            values.extend(g.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8));
        }
        Some(Q8Matrix { rows, cols, values, scales })
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.values.len() + 2 * self.scales.len()
    }

    fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        let v = &self.values[r * self.cols..(r + 1) * self.cols];
        crate::sys::widen_q8_row(
            v,
            &self.scales[r * self.cols / GROUP..(r + 1) * self.cols / GROUP],
            &mut out,
        );
        out
    }

    fn dot_row(&self, r: usize, x: &[f32], _xsum: &[f32]) -> f32 {
        let g = self.cols / GROUP;
        crate::sys::dot_q8(
            x,
            &self.values[r * self.cols..(r + 1) * self.cols],
            &self.scales[r * g..(r + 1) * g],
        )
    }

    fn dot_rows(&self, r: usize, xs: &[&[f32]], xsums: &[&[f32]], out: &mut [f32]) {
        self.dot_block(r, 1, xs, xsums, out)
    }

    fn dot_block(&self, r0: usize, rows: usize, xs: &[&[f32]], _xsums: &[&[f32]], out: &mut [f32]) {
        let g = self.cols / GROUP;
        crate::sys::dot_q8_rows(
            xs,
            &self.values[r0 * self.cols..(r0 + rows) * self.cols],
            &self.scales[r0 * g..(r0 + rows) * g],
            out,
        )
    }
}

/// Unsigned 4-bit with a minimum: value = min + q * scale, q in 0..=15, per group scale = (max - min)
/// / 15, scale and minimum stored as f16. Byte j of a group holds value j (low nibble) and value
/// j + 16 (high nibble).
#[derive(Debug, Clone)]
pub struct Q4Matrix {
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u8>,
    /// f16 bits, one per group.
    pub scales: Vec<u16>,
    /// f16 bits, one per group.
    pub mins: Vec<u16>,
}

impl Q4Matrix {
    /// `out[i] = xs[i] . row r` for input rows rounded to int8 (`--activations q8`).
    pub(crate) fn dot_rows_int8(&self, r: usize, xs: &[crate::sys::Int8Row<'_>], out: &mut [f32]) {
        let g = self.cols / GROUP;
        let (packed, rows) = (&self.packed[r * self.cols / 2..(r + 1) * self.cols / 2], r * g..(r + 1) * g);
        crate::sys::dot_q4_int8_rows(xs, packed, &self.scales[rows.clone()], &self.mins[rows], out)
    }
}

impl QuantMatrix for Q4Matrix {
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Q4Matrix> {
        if !cols.is_multiple_of(GROUP) || w.len() != rows * cols {
            return None;
        }
        let groups = w.len() / GROUP;
        let (mut packed, mut scales, mut mins) =
            (Vec::with_capacity(w.len() / 2), Vec::with_capacity(groups), Vec::with_capacity(groups));
        for g in w.chunks_exact(GROUP) {
            let min = g.iter().fold(f32::INFINITY, |m, &v| m.min(v));
            let max = g.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let (min_bits, min) = through_f16(min)?;
            let (scale_bits, scale) = through_f16((max - min) / 15.0)?;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let q = |v: f32| ((v - min) * inv).round().clamp(0.0, 15.0) as u8;
            scales.push(scale_bits);
            mins.push(min_bits);
            packed.extend((0..GROUP / 2).map(|j| q(g[j]) | (q(g[j + GROUP / 2]) << 4)));
        }
        Some(Q4Matrix { rows, cols, packed, scales, mins })
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.packed.len() + 2 * (self.scales.len() + self.mins.len())
    }

    fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        let (g0, g1) = (r * self.cols / GROUP, (r + 1) * self.cols / GROUP);
        let packed = &self.packed[g0 * GROUP / 2..g1 * GROUP / 2];
        crate::sys::widen_q4_row(packed, &self.scales[g0..g1], &self.mins[g0..g1], &mut out);
        out
    }

    fn dot_row(&self, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
        let g = self.cols / GROUP;
        let rows = r * g..(r + 1) * g;
        crate::sys::dot_q4(
            x,
            &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2],
            &self.scales[rows.clone()],
            &self.mins[rows],
            xsum,
        )
    }

    fn dot_rows(&self, r: usize, xs: &[&[f32]], xsums: &[&[f32]], out: &mut [f32]) {
        self.dot_block(r, 1, xs, xsums, out)
    }

    fn dot_block(&self, r0: usize, rows: usize, xs: &[&[f32]], xsums: &[&[f32]], out: &mut [f32]) {
        let g = self.cols / GROUP;
        let groups = r0 * g..(r0 + rows) * g;
        crate::sys::dot_q4_rows(
            xs,
            &self.packed[r0 * self.cols / 2..(r0 + rows) * self.cols / 2],
            &self.scales[groups.clone()],
            &self.mins[groups],
            xsums,
            out,
        )
    }
}

/// An f16 checkpoint's matrix as it ships (f16 bits, row-major): served exactly, at 2 bytes per
/// weight, every step widening it to f32 as it reads it.
#[derive(Debug, Clone)]
pub struct F16Matrix {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<u16>,
}

impl QuantMatrix for F16Matrix {
    /// `None` if the length does not match or a value does not fit f16.
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<F16Matrix> {
        if w.len() != rows * cols {
            return None;
        }
        let values = w.iter().map(|&v| through_f16(v).map(|(b, _)| b)).collect::<Option<Vec<u16>>>()?;
        Some(F16Matrix { rows, cols, values })
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        2 * self.values.len()
    }

    fn dequantize_row(&self, r: usize) -> Vec<f32> {
        self.values[r * self.cols..(r + 1) * self.cols].iter().map(|&b| f16_value(b)).collect()
    }

    fn dot_row(&self, r: usize, x: &[f32], _xsum: &[f32]) -> f32 {
        crate::sys::dot_f16(x, &self.values[r * self.cols..(r + 1) * self.cols])
    }
}

/// One layer's projection matrices, quantized.
#[derive(Debug, Clone)]
pub struct QuantLayer<M> {
    /// Q, K and V rows stacked: one matrix-vector product per decode step instead of three (no rows
    /// in a latent-attention layer, whose projections are `mla`'s).
    pub qkv: M,
    pub o: M,
    /// Gate and up rows stacked (no rows in a mixture-of-experts layer).
    pub gate_up: M,
    pub down: M,
    /// A mixture-of-experts layer's experts, each one's gate and up stacked.
    pub experts: Vec<ExpertMats<M>>,
    /// Its shared experts (DeepSeek), stacked into one.
    pub shared: Option<ExpertMats<M>>,
    /// Latent attention's projections (DeepSeek).
    pub mla: Option<MlaMats<M>>,
}

/// One SwiGLU expert's matrices: gate and up rows stacked, and down.
#[derive(Debug, Clone)]
pub struct ExpertMats<M> {
    pub gate_up: M,
    pub down: M,
}

/// A latent-attention layer's matrices (see `weights::MlaWeights`): the per-head absorbed key and
/// value matrices one each.
#[derive(Debug, Clone)]
pub struct MlaMats<M> {
    pub q_a: Option<M>,
    pub q_b: M,
    pub kv_a: M,
    /// Per head: `[kv_lora, nope]`.
    pub k_up_t: Vec<M>,
    /// Per head: `[v_head_dim, kv_lora]`.
    pub v_up: Vec<M>,
}

impl<M> QuantLayer<M> {
    /// Every matrix of the layer, once.
    pub fn matrices(&self) -> impl Iterator<Item = &M> {
        let experts = self.experts.iter().chain(&self.shared).flat_map(|e| [&e.gate_up, &e.down]);
        let mla = self
            .mla
            .iter()
            .flat_map(|m| m.q_a.iter().chain([&m.q_b, &m.kv_a]).chain(&m.k_up_t).chain(&m.v_up));
        [&self.qkv, &self.o, &self.gate_up, &self.down].into_iter().chain(experts).chain(mla)
    }

    /// Each matrix joined with `other`'s in the same place by `f`; `None` if `f` refuses one or the
    /// layers hold different matrices.
    pub(crate) fn zip<N, R>(
        self,
        other: QuantLayer<N>,
        f: &impl Fn(M, N) -> Option<R>,
    ) -> Option<QuantLayer<R>> {
        fn all<M, N, R>(a: Vec<M>, b: Vec<N>, f: impl Fn(M, N) -> Option<R>) -> Option<Vec<R>> {
            (a.len() == b.len()).then_some(())?;
            a.into_iter().zip(b).map(|(a, b)| f(a, b)).collect()
        }
        fn opt<M, N, R>(a: Option<M>, b: Option<N>, f: impl Fn(M, N) -> Option<R>) -> Option<Option<R>> {
            match (a, b) {
                (Some(a), Some(b)) => f(a, b).map(Some),
                (None, None) => Some(None),
                _ => None,
            }
        }
        let expert = |a: ExpertMats<M>, b: ExpertMats<N>| {
            Some(ExpertMats { gate_up: f(a.gate_up, b.gate_up)?, down: f(a.down, b.down)? })
        };
        let mla = |a: MlaMats<M>, b: MlaMats<N>| {
            Some(MlaMats {
                q_a: opt(a.q_a, b.q_a, f)?,
                q_b: f(a.q_b, b.q_b)?,
                kv_a: f(a.kv_a, b.kv_a)?,
                k_up_t: all(a.k_up_t, b.k_up_t, f)?,
                v_up: all(a.v_up, b.v_up, f)?,
            })
        };
        Some(QuantLayer {
            qkv: f(self.qkv, other.qkv)?,
            o: f(self.o, other.o)?,
            gate_up: f(self.gate_up, other.gate_up)?,
            down: f(self.down, other.down)?,
            experts: all(self.experts, other.experts, expert)?,
            shared: opt(self.shared, other.shared, expert)?,
            mla: opt(self.mla, other.mla, mla)?,
        })
    }
}

/// The shape `(rows, cols)` of every matrix a layer of a model shaped by `c` stacks (the served
/// formats' constraints are checked against these).
pub(crate) fn matrix_shapes(c: &ModelConfig) -> Vec<(usize, usize)> {
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut shapes = match &c.mla {
        None => vec![(q_dim + 2 * kv_dim, h), (h, q_dim)],
        Some(m) => {
            let q_in = m.q_lora_rank.unwrap_or(h);
            let mut v = vec![(c.num_heads * m.qk_head_dim(), q_in), (m.latent_width(), h)];
            v.extend(m.q_lora_rank.map(|r| (r, h)));
            v.extend([(m.kv_lora_rank, m.qk_nope_head_dim), (m.v_head_dim, m.kv_lora_rank)]);
            v.push((h, c.num_heads * m.v_head_dim));
            v
        }
    };
    if c.moe.as_ref().is_none_or(|m| !m.dense_layers.is_empty()) {
        shapes.extend([(2 * inter, h), (h, inter)]);
    }
    if let Some(m) = &c.moe {
        for ei in std::iter::once(m.intermediate_size).chain(m.shared_intermediate) {
            shapes.extend([(2 * ei, h), (h, ei)]);
        }
    }
    shapes
}

/// Every matrix a decode step reads, quantized. The LM head (often the embedding, tied) is Q8 in
/// every format: 4 bits are too coarse for it (GGUF files keep it at Q8_0 or better too).
#[derive(Debug, Clone)]
pub struct QuantWeights<M> {
    pub layers: Vec<QuantLayer<M>>,
    pub lm_head: Q8Matrix,
}

/// Q8 decode weights.
pub type Q8Weights = QuantWeights<Q8Matrix>;
/// Q4 decode weights.
pub type Q4Weights = QuantWeights<Q4Matrix>;

/// One layer's matrices made with `make(w, rows, cols)`, Q, K and V stacked and gate and up stacked;
/// `None` if `make` refuses one.
pub(crate) fn stack_layer<M>(
    l: &crate::weights::LayerWeights,
    c: &ModelConfig,
    make: impl Fn(&[f32], usize, usize) -> Option<M>,
) -> Option<QuantLayer<M>> {
    let (hidden, inter) = (c.hidden_size, c.intermediate_size);
    let q_dim = c.num_heads * c.head_dim;
    let qkv: Vec<f32> = [&l.q[..], &l.k[..], &l.v[..]].concat();
    let gate_up: Vec<f32> = [&l.gate[..], &l.up[..]].concat();
    // A latent-attention layer has no Q, K and V, a layer of experts no dense FFN: no rows.
    let expert = |e: &crate::Expert| -> Option<ExpertMats<M>> {
        let ei = e.down.len() / hidden;
        let gate_up: Vec<f32> = [&e.gate[..], &e.up[..]].concat();
        Some(ExpertMats { gate_up: make(&gate_up, 2 * ei, hidden)?, down: make(&e.down, hidden, ei)? })
    };
    let (experts, shared) = match &l.moe {
        None => (Vec::new(), None),
        Some(m) => (
            m.experts.iter().map(expert).collect::<Option<Vec<_>>>()?,
            match &m.shared {
                Some(e) => Some(expert(e)?),
                None => None,
            },
        ),
    };
    let mla = match (&l.mla, &c.mla) {
        (Some(w), Some(m)) => {
            let (nope, lora, vd) = (m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim);
            let q_a = match (&w.q_a, m.q_lora_rank) {
                (Some((a, _)), Some(r)) => Some(make(a, r, hidden)?),
                _ => None,
            };
            Some(MlaMats {
                q_a,
                q_b: make(&w.q_b, c.num_heads * m.qk_head_dim(), m.q_lora_rank.unwrap_or(hidden))?,
                kv_a: make(&w.kv_a, m.latent_width(), hidden)?,
                k_up_t: w
                    .k_up_t
                    .chunks_exact(lora * nope)
                    .map(|h| make(h, lora, nope))
                    .collect::<Option<_>>()?,
                v_up: w.v_up.chunks_exact(vd * lora).map(|h| make(h, vd, lora)).collect::<Option<_>>()?,
            })
        }
        _ => None,
    };
    let o_in = c.mla.as_ref().map_or(q_dim, |m| c.num_heads * m.v_head_dim);
    Some(QuantLayer {
        qkv: make(&qkv, qkv.len() / hidden, hidden)?,
        o: make(&l.o, hidden, o_in)?,
        gate_up: make(&gate_up, gate_up.len() / hidden, hidden)?,
        down: match l.down.len() {
            // A layer of experts has no dense FFN: an empty matrix as wide as the hidden state.
            0 => make(&[], 0, hidden)?,
            _ => make(&l.down, hidden, inter)?,
        },
        experts,
        shared,
        mla,
    })
}

impl<M: QuantMatrix> QuantWeights<M> {
    /// Quantizes the projections and the LM head of a model shaped by `c`; `None` if a width is not
    /// a multiple of 32.
    pub fn quantize(w: &crate::Weights, c: &ModelConfig) -> Option<Self> {
        let layers = w.layers.iter().map(|l| stack_layer(l, c, M::quantize)).collect::<Option<Vec<_>>>()?;
        Self::from_layers(layers, w.lm_head(), c)
    }

    /// Layers quantized already, with the LM head `head` (`[vocab, hidden]`) quantized to Q8.
    pub fn from_layers(layers: Vec<QuantLayer<M>>, head: &[f32], c: &ModelConfig) -> Option<Self> {
        Some(QuantWeights { layers, lm_head: Q8Matrix::quantize(head, c.vocab_size, c.hidden_size)? })
    }

    /// Bytes of every quantized matrix (what one decode step reads).
    pub fn bytes(&self) -> usize {
        let l: usize = self.layers.iter().flat_map(QuantLayer::matrices).map(M::bytes).sum();
        l + self.lm_head.bytes()
    }
}

/// A `[rows, cols]` matrix in bf16 (8 significant bits, f32's range): packed into panels of 32 rows
/// for the bf16 GEMM kernel where the CPU has AVX-512 BF16 (32 multiply-adds per instruction, twice
/// f32 FMA's rate), row-major elsewhere (half the bytes of f32 for every step to read).
#[derive(Debug, Clone)]
pub struct Bf16Matrix {
    pub rows: usize,
    pub cols: usize,
    /// The values in `layout`'s order.
    pub values: Vec<u16>,
    pub layout: Bf16Layout,
}

/// How a [`Bf16Matrix`]'s values lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Layout {
    /// 32-row panels for the AVX-512 BF16 GEMM (see `sys::pack_bf16_panels` for the order).
    Panels,
    /// Row-major, as a checkpoint ships them: CPUs without AVX-512 BF16 widen them to f32 as they
    /// read them (exactly), the AVX2 dot kernels for short steps and widened tiles for long ones.
    Rows,
}

impl Bf16Matrix {
    /// Element (`row`, `col`) as bf16 bits.
    pub fn at(&self, row: usize, col: usize) -> u16 {
        match self.layout {
            Bf16Layout::Panels => {
                let (p, c, j) = (row / 32, row % 32, col / 2);
                self.values[((p * self.cols / 2 + j) * 32 + c) * 2 + col % 2]
            }
            Bf16Layout::Rows => self.values[row * self.cols + col],
        }
    }

    /// `w` (`rows` x `cols`, row-major) rounded to bf16 in the layout this CPU's products read:
    /// panels where it has AVX-512 BF16 (`None` unless `rows` is a multiple of 32 and `cols` even),
    /// else rows. `None` if the length does not match.
    pub fn pack(w: &[f32], rows: usize, cols: usize) -> Option<Bf16Matrix> {
        if cols == 0 || w.len() != rows * cols {
            return None;
        }
        if crate::sys::has_bf16_gemm() {
            if !rows.is_multiple_of(32) || !cols.is_multiple_of(2) {
                return None;
            }
            let values = crate::sys::pack_bf16_panels(w, rows, cols);
            return Some(Bf16Matrix { rows, cols, values, layout: Bf16Layout::Panels });
        }
        let values = w.iter().map(|&v| bf16_bits(v)).collect();
        Some(Bf16Matrix { rows, cols, values, layout: Bf16Layout::Rows })
    }
}

/// Every matrix a multi-row step reads, in bf16: the projections (stacked like the quantized ones)
/// and the LM head (in panels only where its rows, the vocabulary, are a multiple of 32; else the f32
/// one serves).
#[derive(Debug, Clone)]
pub struct Bf16Weights {
    pub layers: Vec<QuantLayer<Bf16Matrix>>,
    pub lm_head: Option<Bf16Matrix>,
}

impl Bf16Weights {
    /// Layers packed already, with the LM head `head` (`[vocab, hidden]`) packed where its rows allow.
    pub fn from_layers(layers: Vec<QuantLayer<Bf16Matrix>>, head: &[f32], c: &ModelConfig) -> Self {
        Bf16Weights { layers, lm_head: Bf16Matrix::pack(head, c.vocab_size, c.hidden_size) }
    }

    /// Bytes of every packed matrix.
    pub fn bytes(&self) -> usize {
        let panels = |m: &Bf16Matrix| m.values.len() * 2;
        let l: usize = self.layers.iter().flat_map(QuantLayer::matrices).map(panels).sum();
        l + self.lm_head.as_ref().map_or(0, panels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_error_is_bounded_by_half_a_step() {
        let w: Vec<f32> = (0..4 * 64).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let m = <Q8Matrix as QuantMatrix>::quantize(&w, 4, 64).unwrap();
        for r in 0..4 {
            let back = m.dequantize_row(r);
            for (i, (a, b)) in back.iter().zip(&w[r * 64..(r + 1) * 64]).enumerate() {
                let step = f16_value(m.scales[(r * 64 + i) / 32]);
                assert!((a - b).abs() <= step / 2.0 + 1e-7, "row {r} col {i}: {a} vs {b}");
            }
        }
        assert_eq!(m.bytes(), 4 * 64 + 2 * 8);
    }

    #[test]
    fn q4_gives_back_q4_1_values_exactly_and_dots_agree() {
        // Values on a 4-bit grid per group (as a Q4_1 model's are), each group using levels 0 and 15.
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (g, j) = (i / 32, i % 32);
                let q = if j == 0 {
                    0
                } else if j == 1 {
                    15
                } else {
                    (j * 7 + g) % 16
                };
                // Q4_1 keeps its scale and minimum in f16.
                let f16 = |v: f32| f16_value(f16_bits(v));
                f16(-0.25 + g as f32 * 0.01) + q as f32 * f16(0.03 + g as f32 * 0.001)
            })
            .collect();
        let m = <Q4Matrix as QuantMatrix>::quantize(&w, rows, cols).unwrap();
        for r in 0..rows {
            let back = m.dequantize_row(r);
            for (a, b) in back.iter().zip(&w[r * cols..(r + 1) * cols]) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.3).cos()).collect();
            let xsum: Vec<f32> = x.chunks(32).map(|c| c.iter().sum()).collect();
            let want: f32 = back.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!((m.dot_row(r, &x, &xsum) - want).abs() < 1e-4);
        }
        assert_eq!(m.bytes(), rows * cols / 2 + 4 * rows * cols / 32);
    }

    /// A quantized matrix widened to bf16 rows (how the bf16 rows product reads it) holds its own
    /// dequantized values, rounded.
    #[test]
    fn bf16_rows_are_the_dequantized_values_rounded() {
        let (rows, cols) = (8, 320);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 + 0.001).collect();
        let q8 = <Q8Matrix as QuantMatrix>::quantize(&w, rows, cols).unwrap();
        let q4 = <Q4Matrix as QuantMatrix>::quantize(&w, rows, cols).unwrap();
        for r0 in [0, 4] {
            let mut a = vec![0u16; 4 * cols];
            crate::sys::q8_bf16_rows(&q8.values, &q8.scales, cols, r0, 4, &mut a);
            let mut b = vec![0u16; 4 * cols];
            crate::sys::q4_bf16_rows(&q4.packed, &q4.scales, &q4.mins, cols, r0, 4, &mut b);
            for r in 0..4 {
                let (d8, d4) = (q8.dequantize_row(r0 + r), q4.dequantize_row(r0 + r));
                for c in 0..cols {
                    assert_eq!(
                        a[r * cols + c],
                        crate::bits16::bf16_bits(d8[c]),
                        "q8 row {} column {c}",
                        r0 + r
                    );
                    assert_eq!(
                        b[r * cols + c],
                        crate::bits16::bf16_bits(d4[c]),
                        "q4 row {} column {c}",
                        r0 + r
                    );
                }
            }
        }
    }

    #[test]
    fn f16_matrices_hold_f16_values_exactly() {
        let (rows, cols) = (3, 40);
        let w: Vec<f32> =
            (0..rows * cols).map(|i| f16_value(f16_bits((i as f32 * 0.731).sin() * 3.0))).collect();
        let m = <F16Matrix as QuantMatrix>::quantize(&w, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.3).cos()).collect();
        for r in 0..rows {
            assert_eq!(m.dequantize_row(r), w[r * cols..(r + 1) * cols]);
            let want: f64 = (0..cols).map(|i| f64::from(x[i]) * f64::from(w[r * cols + i])).sum();
            assert!((f64::from(m.dot_row(r, &x, &[])) - want).abs() < 1e-4);
        }
        assert_eq!(m.bytes(), 2 * rows * cols);
        assert!(<F16Matrix as QuantMatrix>::quantize(&[1e6], 1, 1).is_none(), "past f16's range");
        assert_eq!("f16".parse::<WeightFormat>().unwrap(), WeightFormat::F16);
    }

    #[test]
    fn a_scale_past_f16s_range_is_refused() {
        assert!(<Q8Matrix as QuantMatrix>::quantize(&[1e7; 32], 1, 32).is_none());
    }

    #[test]
    fn zero_groups_and_bad_widths() {
        let m = <Q8Matrix as QuantMatrix>::quantize(&[0.0; 32], 1, 32).unwrap();
        assert_eq!(m.scales, vec![0]);
        assert!(m.values.iter().all(|&v| v == 0));
        assert!(<Q8Matrix as QuantMatrix>::quantize(&[0.0; 30], 1, 30).is_none());
        let z = <Q4Matrix as QuantMatrix>::quantize(&[0.5; 32], 1, 32).unwrap();
        assert_eq!(z.dequantize_row(0), vec![0.5; 32]);
        assert!(<Q4Matrix as QuantMatrix>::quantize(&[0.0; 30], 1, 30).is_none());
        assert_eq!("q8".parse::<WeightFormat>().unwrap(), WeightFormat::Q8);
        assert_eq!("q4".parse::<WeightFormat>().unwrap(), WeightFormat::Q4);
        assert!("q2".parse::<WeightFormat>().is_err());
    }
}
