//! The crate's one set of 16-bit float conversions, for values stored as their bits (`u16`): f16 (GGUF
//! scales, safetensors f16) and bf16 (safetensors bf16, the bf16 GEMM's operands), all through the
//! `half` crate, which rounds to nearest even and keeps NaN a NaN.

/// f16 bits to f32, exactly.
pub(crate) fn f16_value(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, rounding to nearest even (past f16's range: infinity).
pub(crate) fn f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// bf16 bits to f32, exactly: the top half of its bits (NaN payloads kept, as the vector kernels
/// keep them).
pub(crate) fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bf16 bits (the top 16 bits), rounding to nearest even.
pub(crate) fn bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_exactly_and_rounds_to_even() {
        for h in 0..=u16::MAX {
            let v = f16_value(h);
            if v.is_nan() {
                assert!(f16_value(f16_bits(v)).is_nan());
            } else {
                assert_eq!(f16_bits(v), h, "{h:#06x} -> {v}");
            }
        }
        assert_eq!(f16_value(0x3c00), 1.0);
        assert_eq!(f16_value(0x0001), 2f32.powi(-24));
        assert_eq!(f16_bits(1.0 + 2f32.powi(-11)), 0x3c00, "a tie rounds to even");
        assert_eq!(f16_bits(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02, "a tie rounds to even");
        assert_eq!(f16_bits(65520.0), 0x7c00);
        assert_eq!(f16_bits(65519.0), 0x7bff);
    }

    #[test]
    fn bf16_rounds_to_even_and_keeps_nan() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80, "a tie rounds to even");
        assert_eq!(bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82, "a tie rounds to even");
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
        for b in (0..=u16::MAX).step_by(7) {
            let v = bf16_value(b);
            if !v.is_nan() {
                assert_eq!(bf16_bits(v), b, "{b:#06x}");
            }
        }
    }
}
