//! FP8 e4m3 weights held as they ship: one byte per weight and an f32 scale per row and group of
//! columns (DeepSeek's checkpoints scale 128 x 128 blocks; a block's scale is every one of its rows'
//! scale for its columns, so slicing, stacking and transposing whole blocks keeps one scale per row
//! group). The kernels widen each byte to `e4m3 value x scale` as they read it: the very f32 value the
//! f32 loader computes, so serving the FP8 bytes gives the f32 path's weights at a quarter of the
//! bytes.

use crate::quant::QuantMatrix;

/// The largest finite e4m3 magnitude (`S.1111.110`).
pub const E4M3_MAX: f32 = 448.0;

pub(crate) use crate::sys::e4m3_value;

/// The e4m3 code nearest `v` (ties to the even code; magnitudes past 448 clamp to 448): exact for
/// every e4m3 value, so `w / scale` of a weight the loader made from a code and its scale gives the
/// code back (the quotient is within two f32 roundings of it, far inside half a step).
pub(crate) fn e4m3_code(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0;
    }
    // Codes 0..=0x7E are the finite magnitudes, increasing.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    if a >= E4M3_MAX {
        return sign | hi;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_value(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_value(lo), e4m3_value(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi };
    sign | code
}

/// Column groups the kernels take (each a multiple of their 16 lanes), widest first.
const GROUPS: [usize; 4] = [128, 64, 32, 16];

/// A row-major `[rows, cols]` matrix of e4m3 codes with a scale per row and group of `group`
/// columns (the last group of a row may be narrower): weight `(r, c)` is
/// `e4m3(codes[r * cols + c]) * scales[r * groups + c / group]`, `groups = cols.div_ceil(group)`.
#[derive(Debug, Clone)]
pub struct Fp8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Columns per scale: 128, 64, 32 or 16.
    pub group: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Fp8Matrix {
    /// Scale groups per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group)
    }

    /// The matrix `w` as a block-scaled FP8 checkpoint ships it: `scale[i]` is the scale of the
    /// block weight `i` came from (`w[i]` = its code's value times it, as the loader computed), or 0
    /// where `w` did not come from FP8 (such a group gets its own scale, `max |w| / 448`). The
    /// widest group over which every row's scales are constant is taken; `None` when no group of 16
    /// columns or more is (blocks narrower than the kernels' lanes) or the lengths do not match.
    pub fn from_blocks(w: &[f32], scale: &[f32], rows: usize, cols: usize) -> Option<Fp8Matrix> {
        if w.len() != rows * cols || scale.len() != w.len() {
            return None;
        }
        let constant = |g: usize| {
            scale
                .chunks(cols.max(1))
                .all(|row| row.chunks(g).all(|s| s.iter().all(|&v| v.to_bits() == s[0].to_bits())))
        };
        let group = GROUPS.into_iter().find(|&g| constant(g))?;
        Some(Fp8Matrix::encode(w, rows, cols, group, |r, g| scale[r * cols + g * group]))
    }

    /// `w` quantized to e4m3 with a scale per row and group of 128 columns, `max |w| / 448`
    /// (`--weights fp8` of a checkpoint that is not FP8).
    pub fn dynamic(w: &[f32], rows: usize, cols: usize) -> Option<Fp8Matrix> {
        (w.len() == rows * cols).then(|| Fp8Matrix::encode(w, rows, cols, GROUPS[0], |_, _| 0.0))
    }

    /// Codes of `w` for each group's scale `given(row, group)`, a zero one replaced by the group's
    /// own (`max |w| / 448`, or 1 for a group of zeros).
    fn encode(
        w: &[f32],
        rows: usize,
        cols: usize,
        group: usize,
        given: impl Fn(usize, usize) -> f32,
    ) -> Fp8Matrix {
        let groups = cols.div_ceil(group);
        let mut m =
            Fp8Matrix { rows, cols, group, codes: vec![0; rows * cols], scales: vec![0.0; rows * groups] };
        for r in 0..rows {
            for g in 0..groups {
                let cs = r * cols + g * group..r * cols + ((g + 1) * group).min(cols);
                let mut s = given(r, g);
                if s == 0.0 || !s.is_finite() {
                    let max = w[cs.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                    s = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
                }
                m.scales[r * groups + g] = s;
                for i in cs {
                    m.codes[i] = e4m3_code(w[i] / s);
                }
            }
        }
        m
    }

    /// Row `r`'s codes and scales.
    pub(crate) fn row(&self, r: usize) -> (&[u8], &[f32]) {
        let g = self.groups();
        (&self.codes[r * self.cols..(r + 1) * self.cols], &self.scales[r * g..(r + 1) * g])
    }
}

impl QuantMatrix for Fp8Matrix {
    /// [`dynamic`](Fp8Matrix::dynamic).
    fn quantize(w: &[f32], rows: usize, cols: usize) -> Option<Fp8Matrix> {
        Fp8Matrix::dynamic(w, rows, cols)
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }

    fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let (codes, scales) = self.row(r);
        let mut out = vec![0.0; self.cols];
        crate::sys::widen_fp8_row(codes, scales, self.group, &mut out);
        out
    }

    fn dot_row(&self, r: usize, x: &[f32], _xsum: &[f32]) -> f32 {
        let (codes, scales) = self.row(r);
        crate::sys::dot_fp8(x, codes, scales, self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_e4m3_value_is_the_format_s() {
        assert_eq!((e4m3_value(0x00), e4m3_value(0x80)), (0.0, -0.0));
        // The largest normal (S.1111.110 = 448), the smallest normal (2^-6) and subnormal (2^-9).
        assert_eq!(
            (e4m3_value(0x7E), e4m3_value(0x08), e4m3_value(0x01)),
            (448.0, 2f32.powi(-6), 2f32.powi(-9))
        );
        assert_eq!((e4m3_value(0x38), e4m3_value(0xBC)), (1.0, -1.5));
        assert!(e4m3_value(0x7F).is_nan() && e4m3_value(0xFF).is_nan());
        // Monotonic over the positive codes.
        assert!((0..0x7Eu8).all(|b| e4m3_value(b) < e4m3_value(b + 1)));
    }

    #[test]
    fn codes_come_back_from_their_values_and_round_to_nearest() {
        for b in (0..=0xFEu8).filter(|b| b & 0x7F != 0x7F) {
            let want = if b == 0x80 { 0x80 } else { b };
            assert_eq!(e4m3_code(e4m3_value(b)), want, "{b:#04x}");
        }
        // Between 1 (0x38) and 1.125 (0x39): nearest, and the tie to the even code.
        assert_eq!((e4m3_code(1.05), e4m3_code(1.07), e4m3_code(1.0625)), (0x38, 0x39, 0x38));
        assert_eq!((e4m3_code(1e9), e4m3_code(-1e9)), (0x7E, 0xFE));
    }

    /// A matrix the loader widened from codes and 32 x 16 block scales (DeepSeek's layout, ragged at
    /// the edges) comes back as the same codes, its groups as wide as the blocks, and widens to the
    /// loader's values bit for bit.
    #[test]
    fn block_scaled_weights_come_back_exactly() {
        let (rows, cols) = (40, 40);
        // Both signs, every magnitude but NaN's.
        let code = |i: usize| match (i * 37 % 256) as u8 {
            c if c & 0x7F == 0x7F => c ^ 1,
            c => c,
        };
        let block = |r: usize, c: usize| 0.013 * (1.0 + (r / 32 * 3 + c / 16) as f32 * 0.37);
        let (mut w, mut s) = (Vec::new(), Vec::new());
        for r in 0..rows {
            for c in 0..cols {
                w.push(e4m3_value(code(r * cols + c)) * block(r, c));
                s.push(block(r, c));
            }
        }
        let m = Fp8Matrix::from_blocks(&w, &s, rows, cols).unwrap();
        assert_eq!(m.group, 16);
        for r in 0..rows {
            let back = m.dequantize_row(r);
            for c in 0..cols {
                assert_eq!(back[c].to_bits(), w[r * cols + c].to_bits(), "({r}, {c})");
            }
        }
        assert_eq!(m.bytes(), rows * cols + 4 * rows * 3);
        // Blocks narrower than 16 columns: refused.
        let narrow: Vec<f32> = (0..rows * cols).map(|i| 1.0 + (i % cols / 8) as f32).collect();
        assert!(Fp8Matrix::from_blocks(&w, &narrow, rows, cols).is_none());
    }

    /// Quantizing weights of no FP8 origin: within half an e4m3 step of each value, and the dot
    /// products those values give.
    #[test]
    fn dynamic_quantization_is_within_half_a_step() {
        let (rows, cols) = (3, 200);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let m = Fp8Matrix::dynamic(&w, rows, cols).unwrap();
        assert_eq!((m.group, m.groups()), (128, 2));
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.3).cos()).collect();
        for r in 0..rows {
            let back = m.dequantize_row(r);
            for (a, b) in back.iter().zip(&w[r * cols..]) {
                assert!((a - b).abs() <= b.abs() / 16.0 + 1e-6, "{a} vs {b}");
            }
            let want: f64 = back.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            assert!((f64::from(m.dot_row(r, &x, &[])) - want).abs() < 1e-4);
        }
    }
}
