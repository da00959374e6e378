//! The crate's only unsafe code: raw NVRTC calls (cubin and log), kernel launches and cuBLAS GEMMs.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    LaunchArgs, LaunchConfig,
};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::KernelError;

/// Whether libnvrtc can be loaded.
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Which of (driver, NVRTC, cuBLAS) can be loaded, for clear errors before cudarc would panic.
pub fn cuda_libraries_present() -> (bool, bool, bool) {
    // SAFETY: as above, dlopen attempts only.
    unsafe {
        (cudarc::driver::sys::is_culib_present(), nvrtc_sys::is_culib_present(), blas_sys::is_culib_present())
    }
}

pub(crate) fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| format!("{e:?}"))?;
    Ok((major, minor))
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `src` with `opts`; returns the cubin and the program log, or the log on failure.
pub(crate) fn nvrtc_cubin(src: &str, name: &str, opts: &[String]) -> Result<(Vec<u8>, String), String> {
    let csrc = CString::new(src).map_err(|_| "source holds a NUL byte".to_string())?;
    let cname = CString::new(name).map_err(|_| "name holds a NUL byte".to_string())?;
    let prog =
        nvrtc::create_program(&csrc, Some(&cname)).map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program; `csrc`/`cname` outlive it; it is destroyed on every path below.
    unsafe {
        let compiled = nvrtc::compile_program(prog, opts);
        let log = nvrtc::get_program_log(prog).map(|l| c_chars_to_string(&l)).unwrap_or_default();
        if let Err(e) = compiled {
            let _ = nvrtc::destroy_program(prog);
            return Err(format!("{e:?}\n{log}"));
        }
        let mut size = 0usize;
        let got = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result();
        let mut cubin = vec![0u8; size];
        let got =
            got.and_then(|()| nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result());
        let _ = nvrtc::destroy_program(prog);
        got.map_err(|e| format!("nvrtcGetCUBIN: {e:?}\n{log}"))?;
        Ok((cubin, log))
    }
}

/// Launches a kernel whose arguments are already pushed. The wrappers in `gpu.rs` check every
/// argument against the kernel's contract before they get here.
pub(crate) fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), KernelError> {
    // SAFETY: the caller pushed arguments matching the kernel's signature, with buffers large enough
    // for the grid (checked by the wrapper).
    unsafe { args.launch(cfg) }?;
    Ok(())
}

/// Whether both views start on a 16-byte boundary (the skinny product loads 16 bytes at a time).
pub(crate) fn aligned16(stream: &Arc<CudaStream>, x: &CudaView<'_, u16>, w: &CudaView<'_, u16>) -> bool {
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    xp % 16 == 0 && wp % 16 == 0
}

/// `y[t x n] (f32) = x[t x k] (bf16) . w[n x k]^T (bf16)`, f32 accumulation, all row-major.
pub(crate) fn gemm_bf16(
    blas_handle: &CudaBlas,
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, u16>,
    w: &CudaView<'_, u16>,
    y: &mut CudaViewMut<'_, f32>,
    (t, k, n): (usize, usize, usize),
) -> Result<(), KernelError> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    // Column-major view: Y^T [n x t] = W [n x k] (stored as k x n, transposed) . X^T [k x t].
    // SAFETY: the caller checked x.len() >= t*k, w.len() >= n*k, y.len() >= t*n; pointers stay
    // valid while the guards live (to the end of this function).
    unsafe {
        blas::gemm_ex(
            *blas_handle.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            n as c_int,
            t as c_int,
            k as c_int,
            &alpha as *const f32 as *const c_void,
            wp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            k as c_int,
            xp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            k as c_int,
            &beta as *const f32 as *const c_void,
            yp as *mut c_void,
            blas_sys::cudaDataType::CUDA_R_32F,
            n as c_int,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// The crate's GPUs use one stream each, so cudarc's cross-stream event tracking (an event recorded
/// per buffer use) is turned off: it costs a driver call per argument, and an event recorded outside
/// a stream capture cannot be waited on inside one.
pub(crate) fn single_stream(ctx: &Arc<CudaContext>) {
    // SAFETY: every buffer of this context is used from one stream only (the Gpu's), so no ordering
    // between streams has to be tracked.
    unsafe { ctx.disable_event_tracking() }
}

/// Gives cuBLAS a workspace of its own (needed for GEMMs inside a captured CUDA graph: cuBLAS must
/// not allocate while a stream is captured). `ws` must outlive the handle's use.
pub(crate) fn set_blas_workspace(
    blas_handle: &CudaBlas,
    stream: &Arc<CudaStream>,
    ws: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    let bytes = ws.len();
    let (p, _g) = ws.device_ptr_mut(stream);
    // SAFETY: a live handle and a device allocation of `bytes` bytes kept by the Gpu as long as the
    // handle.
    unsafe { blas_sys::cublasSetWorkspace_v2(*blas_handle.handle(), p as *mut c_void, bytes) }.result()?;
    Ok(())
}

/// A captured sequence of launches (a CUDA graph), replayed with [`StepGraph::launch`] on the
/// stream it was captured from.
pub struct StepGraph(CudaGraph);

// SAFETY: a graph is not thread-safe to use concurrently, and it is not `Sync`; moving it to another
// thread with the `Gpu` that owns its stream is fine (the engine builds a backend, then moves it).
unsafe impl Send for StepGraph {}

impl StepGraph {
    pub(crate) fn new(g: CudaGraph) -> StepGraph {
        StepGraph(g)
    }

    /// Queues the graph's launches on its stream.
    pub fn launch(&self) -> Result<(), KernelError> {
        self.0.launch()?;
        Ok(())
    }
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}
