//! CUDA kernels for Llama-family inference on Blackwell (sm_120) and Hopper (sm_90) GPUs.
//!
//! The kernels are CUDA C++ sources in this crate ([`sources`]), compiled at run time by NVRTC for the
//! device's architecture and launched through cudarc. Storage is bf16, arithmetic f32.
//!
//! - [`launch`]: launch-configuration logic (grids, split counts, shared-memory budgets), pure Rust.
//! - [`compile`]: NVRTC to cubin for any architecture, with ptxas's register / shared memory / spill
//!   report per kernel; works on a machine without a GPU (it needs only `libnvrtc`).
//! - [`Gpu`]: a device, its compiled kernels, a stream and a cuBLAS handle, with checked wrappers for
//!   every kernel (shapes, lengths, alignment, supported head sizes) and bf16 GEMMs through cuBLAS.
//! - [`reference`]: the CPU definition of every kernel, which the GPU checks compare against.
//! - [`checks`] and [`bench`]: the GPU self-checks and the bandwidth benchmark (need a GPU).
//!
//! Nothing here needs CUDA to build: cudarc loads `libcuda`, `libnvrtc` and `libcublas` when first
//! used, and [`Gpu::new`] reports a missing driver or device as an error, not a crash.
//!
//! ```no_run
//! use pdserve_kernels_sm120::{Gpu, reference::f32_to_bf16};
//! let gpu = Gpu::new(0).unwrap();
//! let (rows, dim) = (4, 576);
//! let mut x = gpu.upload(&vec![0.5f32; rows * dim]).unwrap();
//! let w = gpu.upload(&vec![f32_to_bf16(1.0); dim]).unwrap();
//! let mut out = gpu.zeros::<u16>(rows * dim).unwrap();
//! gpu.rmsnorm_residual(&mut x.as_view_mut(), None, &w.as_view(), &mut out.as_view_mut(), rows, dim, 1e-5).unwrap();
//! let normed = gpu.download(&out.as_view()).unwrap();
//! assert_eq!(normed.len(), rows * dim);
//! ```

pub mod bench;
pub mod checks;
pub mod compile;
mod error;
mod gpu;
pub mod launch;
pub mod reference;
pub mod sources;
mod sys;

pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
pub use error::KernelError;
pub use gpu::{
    DecodeAttention, DecodeKernel, DecodeOptions, DecodeScratch, Gpu, PrefillAttention, SampleParams,
};
pub use sys::{cuda_libraries_present, StepGraph};

/// The README's examples, compiled as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
