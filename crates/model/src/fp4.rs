//! FP4 e2m1 weights held as 4 bits a weight and a scale per row and group of 16 columns (NVFP4, as
//! NVIDIA's ModelOpt writes it: an e4m3 scale per 16 values times one f32 scale per tensor) or 32
//! (MXFP4: a power of two per 32). The loader widens a checkpoint's codes to `e2m1 x scale` in f32;
//! this format takes those values back to their codes and scales exactly, and the kernels widen
//! them by table as they read them, to the very values the loader computed: a quarter of bf16's
//! bytes, the f32 copy's products.

use crate::quant::QuantMatrix;
use crate::sys::E2M1;

/// The largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The e2m1 code nearest `v` (ties to the even code; past 6 clamps): exact for every e2m1 value.
pub(crate) fn e2m1_code(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0;
    }
    let mut best = 0u8;
    for c in 1..8u8 {
        let (d, db) = ((E2M1[usize::from(c)] - a).abs(), (E2M1[usize::from(best)] - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best
}

/// A row-major `[rows, cols]` matrix of e2m1 codes, two a byte (the even column in the low nibble),
/// with a scale per row and group of `group` columns: weight `(r, c)` is
/// `e2m1(code) * scales[r * cols / group + c / group]`. `cols` is a multiple of `group` (16 or 32).
/// A projection an FP4 checkpoint ships unquantized (its attention, say) is held `plain`: in bf16
/// where every value is one (a bf16 checkpoint's), else in f32,
/// exactly, rather than rounded to 4 bits.
#[derive(Debug, Clone)]
pub struct Fp4Matrix {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
    pub plain: Option<Plain>,
}

/// An unquantized matrix's values, exactly.
#[derive(Debug, Clone)]
pub enum Plain {
    F32(Vec<f32>),
    /// bf16 bits: every value had no more than bf16's 8 significant bits.
    Bf16(Vec<u16>),
}

impl Plain {
    /// `w` in bf16 where that is exact, else as it is.
    pub(crate) fn of(w: &[f32]) -> Plain {
        if w.iter().all(|v| v.to_bits() & 0xFFFF == 0) {
            Plain::Bf16(w.iter().map(|v| (v.to_bits() >> 16) as u16).collect())
        } else {
            Plain::F32(w.to_vec())
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Plain::F32(v) => 4 * v.len(),
            Plain::Bf16(v) => 2 * v.len(),
        }
    }
}

impl Fp4Matrix {
    /// The matrix `w` as an FP4 checkpoint ships it: `scale[i]` is the scale of the group weight
    /// `i` came from (`w[i]` = its code's value times it, as the loader computed), or 0 where `w` did
    /// not come from FP4 (a matrix with any such value is held plain). The widest group (32 or 16)
    /// over which every row's scales are constant is taken; where neither is, or the values are not
    /// codes times their scales (another format's), the matrix is held plain. `None` when the
    /// lengths do not fit.
    pub fn from_groups(w: &[f32], scale: &[f32], rows: usize, cols: usize) -> Option<Fp4Matrix> {
        if w.len() != rows * cols || scale.len() != w.len() {
            return None;
        }
        if scale.contains(&0.0) {
            let plain = Some(Plain::of(w));
            return Some(Fp4Matrix { rows, cols, group: 16, packed: Vec::new(), scales: Vec::new(), plain });
        }
        let constant = |g: usize| {
            cols.is_multiple_of(g)
                && scale.chunks(g).all(|s| s.iter().all(|&v| v.to_bits() == s[0].to_bits()))
        };
        // Only values that are e2m1 codes times a scale per 16 or 32 columns (not another format's,
        // an FP8 block's beside FP4 experts, whose scales may change anywhere): else held plain,
        // exactly.
        let group = [32, 16].into_iter().find(|&g| constant(g));
        let exact = || {
            w.iter()
                .zip(scale)
                .all(|(&v, &s)| (crate::sys::e2m1_value(e2m1_code(v / s)) * s).to_bits() == v.to_bits())
        };
        let Some(group) = group.filter(|_| exact()) else {
            let plain = Some(Plain::of(w));
            return Some(Fp4Matrix { rows, cols, group: 16, packed: Vec::new(), scales: Vec::new(), plain });
        };
        Some(Fp4Matrix::encode(w, rows, cols, group, |i| scale[i]))
    }

    /// `w` quantized to e2m1 with a scale per row and group of 16 columns, `max |w| / 6`
    /// (`--weights fp4` of a checkpoint that is not FP4: coarse, 8 magnitudes a group).
    pub fn dynamic(w: &[f32], rows: usize, cols: usize) -> Option<Fp4Matrix> {
        (w.len() == rows * cols && cols.is_multiple_of(16))
            .then(|| Fp4Matrix::encode(w, rows, cols, 16, |_| 0.0))
    }

    /// Codes of `w` for each group's scale (`given(index of its first value)`), a zero one replaced
    /// by the group's own (`max |w| / 6`, or 1 for a group of zeros).
    fn encode(w: &[f32], rows: usize, cols: usize, group: usize, given: impl Fn(usize) -> f32) -> Fp4Matrix {
        let mut m =
            Fp4Matrix { rows, cols, group, packed: vec![0; w.len() / 2], scales: Vec::new(), plain: None };
        for (g, vals) in w.chunks_exact(group).enumerate() {
            let mut s = given(g * group);
            if s == 0.0 || !s.is_finite() {
                let max = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
                s = if max > 0.0 { max / E2M1_MAX } else { 1.0 };
            }
            m.scales.push(s);
            for (j, &v) in vals.iter().enumerate() {
                let i = g * group + j;
                m.packed[i / 2] |= e2m1_code(v / s) << (4 * (i % 2));
            }
        }
        m
    }

    /// Row `r`'s codes and scales.
    pub(crate) fn row(&self, r: usize) -> (&[u8], &[f32]) {
        let g = self.cols / self.group;
        (&self.packed[r * self.cols / 2..(r + 1) * self.cols / 2], &self.scales[r * g..(r + 1) * g])
    }
}

impl QuantMatrix for Fp4Matrix {
    /// [`dynamic`](Fp4Matrix::dynamic).
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Fp4Matrix> {
        Fp4Matrix::dynamic(w, rows, cols)
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.packed.len() + 4 * self.scales.len() + self.plain.as_ref().map_or(0, Plain::bytes)
    }

    fn dequantize_row(&self, r: usize) -> Vec<f32> {
        match &self.plain {
            Some(Plain::F32(p)) => return p[r * self.cols..(r + 1) * self.cols].to_vec(),
            Some(Plain::Bf16(p)) => {
                return p[r * self.cols..(r + 1) * self.cols]
                    .iter()
                    .map(|&b| f32::from_bits(u32::from(b) << 16))
                    .collect()
            }
            None => {}
        }
        let (packed, scales) = self.row(r);
        let mut out = vec![0.0; self.cols];
        crate::sys::widen_fp4_row(packed, scales, self.group, &mut out);
        out
    }

    fn dot_row(&self, r: usize, x: &[f32], _xsum: &[f32]) -> f32 {
        match &self.plain {
            Some(Plain::F32(p)) => return crate::sys::dot(x, &p[r * self.cols..(r + 1) * self.cols]),
            Some(Plain::Bf16(p)) => return crate::sys::dot_bf16(x, &p[r * self.cols..(r + 1) * self.cols]),
            None => {}
        }
        let (packed, scales) = self.row(r);
        crate::sys::dot_fp4(x, packed, scales, self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::e2m1_value;

    #[test]
    fn codes_come_back_from_their_values() {
        for c in 0..16u8 {
            let want = if c == 8 { 8 } else { c };
            assert_eq!(e2m1_code(e2m1_value(c)), want, "{c}");
        }
        assert_eq!((e2m1_code(1.25), e2m1_code(1.3), e2m1_code(2.5), e2m1_code(100.0)), (2, 3, 4, 7));
    }

    /// Weights the loader widened from codes and per-16 scales that round (as NVFP4's e4m3 times
    /// f32 do) come back as the same codes and widen to the loader's values bit for bit; groups of
    /// 32 are found where the scales allow.
    #[test]
    fn grouped_weights_come_back_exactly() {
        let (rows, cols) = (3, 64);
        for group in [16, 32] {
            let scale = |r: usize, c: usize| 0.0131 * (1.0 + (r * 7 + c / group) as f32 * 0.377);
            let (mut w, mut s) = (Vec::new(), Vec::new());
            for r in 0..rows {
                for c in 0..cols {
                    w.push(e2m1_value(((r * cols + c) * 5 % 16) as u8) * scale(r, c));
                    s.push(scale(r, c));
                }
            }
            let m = Fp4Matrix::from_groups(&w, &s, rows, cols).unwrap();
            assert_eq!((m.group, m.bytes()), (group, rows * cols / 2 + 4 * rows * cols / group));
            for r in 0..rows {
                let back = m.dequantize_row(r);
                for c in 0..cols {
                    assert_eq!(back[c].to_bits(), w[r * cols + c].to_bits(), "{group}: ({r}, {c})");
                }
            }
        }
        let ragged: Vec<f32> = (0..rows * cols).map(|i| 1.0 + (i % 8) as f32).collect();
        // Scales that change within 16 columns are no FP4 groups: held plain.
        assert!(Fp4Matrix::from_groups(&ragged, &ragged, rows, cols).unwrap().plain.is_some());
        assert!(Fp4Matrix::from_groups(&ragged, &ragged, rows, cols - 1).is_none());
        // Shipped unquantized: held as it is, in bf16 where that is exact (these small integers).
        let m = Fp4Matrix::from_groups(&ragged, &vec![0.0; rows * cols], rows, cols).unwrap();
        assert_eq!((m.dequantize_row(1), m.bytes()), (ragged[cols..2 * cols].to_vec(), 2 * rows * cols));
        let x: Vec<f32> = (0..cols).map(|i| 0.1 * i as f32 - 1.0).collect();
        assert_eq!(m.dot_row(2, &x, &[]).to_bits(), crate::sys::dot(&x, &ragged[2 * cols..]).to_bits());
        let fine: Vec<f32> = ragged.iter().map(|v| v + 1e-3).collect();
        let m = Fp4Matrix::from_groups(&fine, &vec![0.0; rows * cols], rows, cols).unwrap();
        assert_eq!((m.dequantize_row(0), m.bytes()), (fine[..cols].to_vec(), 4 * rows * cols));
        // Another format's block scales (FP8 beside FP4 experts): its values are not e2m1 codes
        // times them, so the matrix is held plain, not rounded to 4 bits.
        let fp8: Vec<f32> = (0..rows * cols).map(|i| 1.125 * (1 + i % 3) as f32).collect();
        let m = Fp4Matrix::from_groups(&fp8, &vec![0.5; rows * cols], rows, cols).unwrap();
        assert_eq!(m.dequantize_row(2), fp8[2 * cols..].to_vec());
        assert!(m.plain.is_some());
    }
}
