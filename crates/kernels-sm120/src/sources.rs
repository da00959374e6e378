//! The CUDA sources and the kernels each defines. Every file is compiled as `COMMON` + the file.

/// Helpers shared by every file (bf16 conversion, warp and block reductions).
pub const COMMON: &str = include_str!("cuda/common.cuh");

/// Tensor-core helpers (mma.sync, ldmatrix, cp.async), for the files that use them.
pub const MMA: &str = include_str!("cuda/mma.cuh");

/// One CUDA source file and its entry points.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub file: &'static str,
    pub code: &'static str,
    pub kernels: &'static [&'static str],
    /// Text between `COMMON` and the file (the tensor-core helpers, for the files that use them).
    pub prelude: &'static str,
}

impl Source {
    /// The text NVRTC compiles.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n{}\n// ---- {} ----\n{}", self.prelude, self.file, self.code)
    }
}

pub const NORM: Source = Source {
    file: "norm.cu",
    code: include_str!("cuda/norm.cu"),
    kernels: &["rmsnorm_residual", "head_rmsnorm"],
    prelude: "",
};
pub const ROPE: Source =
    Source { file: "rope.cu", code: include_str!("cuda/rope.cu"), kernels: &["rope_qk"], prelude: "" };
pub const ELEMENTWISE: Source = Source {
    file: "elementwise.cu",
    code: include_str!("cuda/elementwise.cu"),
    kernels: &[
        "embed_gather",
        "swiglu",
        "cast_bf16",
        "gather_rows_bf16",
        "add_bias_rows",
        "fill_random_bf16",
    ],
    prelude: "",
};
pub const KV: Source =
    Source { file: "kv.cu", code: include_str!("cuda/kv.cu"), kernels: &["kv_write"], prelude: "" };
pub const DECODE_ATTN: Source = Source {
    file: "decode_attn.cu",
    code: include_str!("cuda/decode_attn.cu"),
    kernels: &[
        "decode_attn_d64_g1",
        "decode_attn_d64_g2",
        "decode_attn_d64_g3",
        "decode_attn_d64_g4",
        "decode_attn_d64_g5",
        "decode_attn_d64_g6",
        "decode_attn_d64_g7",
        "decode_attn_d64_g8",
        "decode_attn_d128_g1",
        "decode_attn_d128_g2",
        "decode_attn_d128_g3",
        "decode_attn_d128_g4",
        "decode_attn_d128_g5",
        "decode_attn_d128_g6",
        "decode_attn_d128_g7",
        "decode_attn_d128_g8",
        "decode_attn_reduce",
    ],
    prelude: "",
};
pub const DECODE_ATTN_TC: Source = Source {
    file: "decode_attn_tc.cu",
    code: include_str!("cuda/decode_attn_tc.cu"),
    kernels: &["decode_attn_tc_d64", "decode_attn_tc_d128"],
    prelude: MMA,
};
pub const PREFILL_ATTN_TC: Source = Source {
    file: "prefill_attn_tc.cu",
    code: include_str!("cuda/prefill_attn_tc.cu"),
    kernels: &["prefill_attn_tc_d64", "prefill_attn_tc_d128"],
    prelude: MMA,
};
pub const PREFILL_ATTN: Source = Source {
    file: "prefill_attn.cu",
    code: include_str!("cuda/prefill_attn.cu"),
    kernels: &["prefill_attn_d64", "prefill_attn_d128"],
    prelude: "",
};
pub const SAMPLE: Source = Source {
    file: "sample.cu",
    code: include_str!("cuda/sample.cu"),
    kernels: &["argmax_rows", "sample_rows"],
    prelude: "",
};

pub const GEMV: Source =
    Source { file: "gemv.cu", code: include_str!("cuda/gemv.cu"), kernels: &["gemv_bf16"], prelude: "" };

/// Every source of the crate.
pub const ALL: [Source; 10] =
    [NORM, ROPE, ELEMENTWISE, KV, DECODE_ATTN, DECODE_ATTN_TC, PREFILL_ATTN, PREFILL_ATTN_TC, SAMPLE, GEMV];
