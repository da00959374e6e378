//! Weight formats for the CPU backend's decode path: f32 as loaded, or Q8 (int8 values in groups of
//! 32 with one f32 scale per group, 1.125 bytes per weight instead of 4). Decode steps are bound by
//! reading the weights once per token, so Q8 cuts the bytes a token costs by 3.6x; prefill (a GEMM that
//! reuses every weight across the prompt's tokens) keeps the f32 weights.

use crate::weights::Weights;

/// Values per Q8 group (one scale each).
pub const Q8_GROUP: usize = 32;

/// How the CPU backend stores the weights its decode steps read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The loaded f32 weights.
    #[default]
    F32,
    /// Symmetric int8 in groups of 32 with an f32 scale (like GGUF's Q8_0), for decode steps.
    Q8,
}

impl WeightFormat {
    /// The name used in flags and metadata: "f32" or "q8".
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<WeightFormat, String> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "q8" => Ok(WeightFormat::Q8),
            _ => Err(format!("unknown weight format {s:?}: f32 or q8")),
        }
    }
}

/// A row-major `[rows, cols]` matrix in Q8; `cols` is a multiple of [`Q8_GROUP`].
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<i8>,
    /// One per group of 32 values, row-major.
    pub scales: Vec<f32>,
}

impl Q8Matrix {
    /// Quantizes `w` (`rows x cols`, row-major): per group, scale = max |w| / 127, value =
    /// round(w / scale). `None` when `cols` is not a multiple of 32.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Q8Matrix> {
        if !cols.is_multiple_of(Q8_GROUP) || w.len() != rows * cols {
            return None;
        }
        let groups = w.len() / Q8_GROUP;
        let mut values = Vec::with_capacity(w.len());
        let mut scales = Vec::with_capacity(groups);
        for g in w.chunks_exact(Q8_GROUP) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            scales.push(scale);
            values.extend(g.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8));
        }
        Some(Q8Matrix { rows, cols, values, scales })
    }

    /// Row `r` as f32 (for tests and references).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let v = &self.values[r * self.cols..(r + 1) * self.cols];
        let s = &self.scales[r * self.cols / Q8_GROUP..(r + 1) * self.cols / Q8_GROUP];
        v.iter().enumerate().map(|(i, &q)| q as f32 * s[i / Q8_GROUP]).collect()
    }

    /// Bytes the matrix occupies.
    pub fn bytes(&self) -> usize {
        self.values.len() + 4 * self.scales.len()
    }
}

/// One layer's projection matrices in Q8.
#[derive(Debug, Clone)]
pub struct Q8Layer {
    pub q: Q8Matrix,
    pub k: Q8Matrix,
    pub v: Q8Matrix,
    pub o: Q8Matrix,
    pub gate: Q8Matrix,
    pub up: Q8Matrix,
    pub down: Q8Matrix,
}

/// Every matrix a decode step reads, in Q8.
#[derive(Debug, Clone)]
pub struct Q8Weights {
    pub layers: Vec<Q8Layer>,
    pub lm_head: Q8Matrix,
}

impl Q8Weights {
    /// Quantizes the projections and the LM head; `None` if a width is not a multiple of 32.
    pub fn quantize(
        w: &Weights,
        hidden: usize,
        inter: usize,
        q_dim: usize,
        kv_dim: usize,
        vocab: usize,
    ) -> Option<Q8Weights> {
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(Q8Layer {
                q: Q8Matrix::quantize(&l.q, q_dim, hidden)?,
                k: Q8Matrix::quantize(&l.k, kv_dim, hidden)?,
                v: Q8Matrix::quantize(&l.v, kv_dim, hidden)?,
                o: Q8Matrix::quantize(&l.o, hidden, q_dim)?,
                gate: Q8Matrix::quantize(&l.gate, inter, hidden)?,
                up: Q8Matrix::quantize(&l.up, inter, hidden)?,
                down: Q8Matrix::quantize(&l.down, hidden, inter)?,
            });
        }
        Some(Q8Weights { layers, lm_head: Q8Matrix::quantize(w.lm_head(), vocab, hidden)? })
    }

    /// Bytes of every Q8 matrix (what one decode step reads).
    pub fn bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                l.q.bytes()
                    + l.k.bytes()
                    + l.v.bytes()
                    + l.o.bytes()
                    + l.gate.bytes()
                    + l.up.bytes()
                    + l.down.bytes()
            })
            .sum();
        l + self.lm_head.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_error_is_bounded_by_half_a_step() {
        let w: Vec<f32> = (0..4 * 64).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let m = Q8Matrix::quantize(&w, 4, 64).unwrap();
        for r in 0..4 {
            let back = m.dequantize_row(r);
            for (i, (a, b)) in back.iter().zip(&w[r * 64..(r + 1) * 64]).enumerate() {
                let step = m.scales[(r * 64 + i) / 32];
                assert!((a - b).abs() <= step / 2.0 + 1e-7, "row {r} col {i}: {a} vs {b}");
            }
        }
        assert_eq!(m.bytes(), 4 * 64 + 4 * 8);
    }

    #[test]
    fn zero_groups_and_bad_widths() {
        let m = Q8Matrix::quantize(&[0.0; 32], 1, 32).unwrap();
        assert_eq!(m.scales, vec![0.0]);
        assert!(m.values.iter().all(|&v| v == 0));
        assert!(Q8Matrix::quantize(&[0.0; 30], 1, 30).is_none());
        assert_eq!("q8".parse::<WeightFormat>(), Ok(WeightFormat::Q8));
        assert!("q4".parse::<WeightFormat>().is_err());
    }
}
