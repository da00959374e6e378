//! A device with the crate's kernels loaded, and a checked wrapper per kernel.
//!
//! Buffers are cudarc's [`CudaSlice`]s; wrappers take views (`slice.as_view()`, `slice.slice(a..b)`)
//! so that callers can point at a layer inside a larger allocation. Every wrapper checks lengths
//! against the shape it is given before launching; bf16 values are `u16` bits.
#![allow(clippy::too_many_arguments)]

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::launch::{self, DecodePlan};
use crate::sys::StepGraph;
use crate::{compile, sources, sys, KernelError};

/// One GPU: context, stream, cuBLAS handle and every kernel compiled for its architecture.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace (declared after `blas`, so it is freed after the handle).
    _blas_workspace: CudaSlice<u8>,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    arch: String,
    sms: usize,
    /// Blocks of each decode attention kernel one SM holds at once (from the occupancy calculator).
    decode_occupancy: HashMap<String, usize>,
    /// A one-element buffer passed where a kernel's optional input is absent.
    dummy: CudaSlice<f32>,
    /// Short products take the skinny kernel (see [`Gpu::gemm_bf16`]).
    skinny: bool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("sms", &self.sms)
            .finish()
    }
}

fn decode_kernel(kind: DecodeKernel, head_dim: usize, group: usize) -> String {
    match kind {
        DecodeKernel::TensorCore => format!("decode_attn_tc_d{head_dim}"),
        DecodeKernel::CudaCore => launch::decode_kernel_name(head_dim, group),
    }
}

/// `src` compiled for `arch`, once per process (a second `Gpu` of the same architecture, or a second
/// model on one, loads the cubins the first compiled).
fn cubin(src: &sources::Source, arch: &str) -> Result<Vec<u8>, KernelError> {
    static CUBINS: std::sync::Mutex<Vec<(&'static str, String, Vec<u8>)>> = std::sync::Mutex::new(Vec::new());
    let cached = |c: &Vec<(&'static str, String, Vec<u8>)>| {
        c.iter().find(|(f, a, _)| *f == src.file && a == arch).map(|(_, _, b)| b.clone())
    };
    if let Some(b) = cached(&CUBINS.lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(b);
    }
    let c = compile::compile(src, arch)?;
    CUBINS.lock().unwrap_or_else(|p| p.into_inner()).push((src.file, arch.to_string(), c.cubin.clone()));
    Ok(c.cubin)
}

/// cuBLAS's workspace: 32 MiB, what NVIDIA advises for Hopper.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

fn check_len(what: &str, have: usize, need: usize) -> Result<(), KernelError> {
    if have < need {
        return Err(KernelError::shape(format!("{what} holds {have} values, the shape needs {need}")));
    }
    Ok(())
}

fn fits_i32(what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::shape(format!("{what} = {v} does not fit the kernel's int")))
}

fn rows_cfg(rows: usize, threads: u32) -> Result<LaunchConfig, KernelError> {
    let rows = u32::try_from(rows).map_err(|_| KernelError::shape("too many rows for one launch"))?;
    Ok(LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

/// Inputs of [`Gpu::decode_attention`]: one query row per sequence.
#[derive(Debug)]
pub struct DecodeAttention<'a> {
    /// Query rows (the Q heads at the start of each row, f32).
    pub q: &'a CudaView<'a, f32>,
    pub q_row_stride: usize,
    /// Row of `q` (and of `out`) for each sequence.
    pub rows: &'a CudaView<'a, i32>,
    /// One layer's K and V cache, `[slot][kv head][head dim]` bf16.
    pub k_cache: &'a CudaView<'a, u16>,
    pub v_cache: &'a CudaView<'a, u16>,
    /// `batch x bt_stride` block ids.
    pub block_tables: &'a CudaView<'a, i32>,
    pub bt_stride: usize,
    /// Context length (positions 0..len attended) per sequence.
    pub ctx_lens: &'a CudaView<'a, i32>,
    /// The longest context in `ctx_lens` (sizes the split).
    pub max_ctx: usize,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Slots the cache holds (bounds-checks the block tables' reach).
    pub num_slots: usize,
    pub scale: f32,
}

/// Which decode attention kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `decode_attn_tc_d*`: QK and PV on the tensor cores (Q and P rounded to bf16), up to 16 query
    /// heads per KV head, 64-token tiles; block sizes must be powers of two. The default.
    TensorCore,
    /// `decode_attn_d*_g*`: CUDA cores, f32 throughout, up to 8 query heads per KV head.
    CudaCore,
}

/// How [`Gpu::decode_attention_with`] runs: which kernel, and optionally a fixed split count instead of
/// the one [`launch::decode_splits`] derives (for measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    pub kernel: DecodeKernel,
    pub splits: Option<usize>,
}

impl DecodeOptions {
    pub fn kernel(kernel: DecodeKernel) -> DecodeOptions {
        DecodeOptions { kernel, splits: None }
    }
}

/// Partial results of decode attention, grown as needed and reused across calls.
#[derive(Debug, Default)]
pub struct DecodeScratch {
    out: Option<CudaSlice<f32>>,
    ml: Option<CudaSlice<f32>>,
}

impl DecodeScratch {
    /// Values held (partial outputs, partial max/sum): a caller that captured launches using this
    /// scratch knows its graphs are stale when this grows.
    pub fn capacity(&self) -> (usize, usize) {
        (self.out.as_ref().map_or(0, |b| b.len()), self.ml.as_ref().map_or(0, |b| b.len()))
    }
}

/// Inputs of [`Gpu::prefill_attention`].
#[derive(Debug)]
pub struct PrefillAttention<'a> {
    pub q: &'a CudaView<'a, f32>,
    pub q_row_stride: usize,
    pub k_cache: &'a CudaView<'a, u16>,
    pub v_cache: &'a CudaView<'a, u16>,
    pub block_tables: &'a CudaView<'a, i32>,
    pub bt_stride: usize,
    /// From [`launch::prefill_tiles`], on the device.
    pub tiles: &'a CudaView<'a, i32>,
    pub n_tiles: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
}

/// Per-row sampling settings of [`Gpu::sample`], on the device.
#[derive(Debug)]
pub struct SampleParams<'a> {
    pub temperature: &'a CudaView<'a, f32>,
    pub top_k: &'a CudaView<'a, i32>,
    pub top_p: &'a CudaView<'a, f32>,
    pub seed: &'a CudaView<'a, u64>,
    pub step: &'a CudaView<'a, u64>,
}

impl Gpu {
    /// Opens device `ordinal`, compiles every kernel for its architecture with NVRTC and creates a
    /// stream and a cuBLAS handle. Fails with [`KernelError::NoDevice`] when the driver, NVRTC or
    /// cuBLAS cannot be loaded or there is no such device.
    pub fn new(ordinal: usize) -> Result<Gpu, KernelError> {
        let (driver, nvrtc, cublas) = sys::cuda_libraries_present();
        let missing: Vec<&str> =
            [(driver, "libcuda (the NVIDIA driver)"), (nvrtc, "libnvrtc"), (cublas, "libcublas")]
                .iter()
                .filter(|(ok, _)| !ok)
                .map(|(_, n)| *n)
                .collect();
        if !missing.is_empty() {
            return Err(KernelError::NoDevice(format!("cannot load {}", missing.join(", "))));
        }
        let count = CudaContext::device_count().map_err(|e| KernelError::NoDevice(format!("{e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::NoDevice(format!("device {ordinal} asked for, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| KernelError::NoDevice(format!("{e:?}")))?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name()?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        // A stream of its own (the legacy default stream cannot be captured into a CUDA graph).
        sys::single_stream(&ctx);
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        sys::set_blas_workspace(&blas, &stream, &mut blas_workspace)?;
        let mut funcs = HashMap::new();
        for src in sources::ALL {
            let module = ctx.load_module(Ptx::from_binary(cubin(&src, &arch)?))?;
            for k in src.kernels {
                funcs.insert(*k, module.load_function(k)?);
            }
        }
        let dummy = stream.alloc_zeros::<f32>(1)?;
        let mut decode_occupancy = HashMap::new();
        for (name, f) in &funcs {
            if name.starts_with("decode_attn_") && *name != "decode_attn_reduce" {
                let dynamic = match name.strip_prefix("decode_attn_tc_d") {
                    Some(d) => {
                        let bytes = launch::decode_tc_dynamic_smem_bytes(d.parse().unwrap_or(128));
                        f.set_attribute(
                            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            bytes as i32,
                        )?;
                        bytes
                    }
                    None => 0,
                };
                let n =
                    f.occupancy_max_active_blocks_per_multiprocessor(launch::DECODE_THREADS, dynamic, None)?;
                decode_occupancy.insert(name.to_string(), n.max(1) as usize);
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            funcs,
            name,
            arch,
            sms,
            decode_occupancy,
            dummy,
            skinny: true,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels were compiled for, e.g. "sm_90".
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn num_sms(&self) -> usize {
        self.sms
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, KernelError> {
        Ok(self.stream.clone_htod(data)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, KernelError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// Copies `src` to the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaView<'_, T>,
    ) -> Result<Vec<T>, KernelError> {
        let mut out = vec![T::default(); src.len()];
        self.stream.memcpy_dtoh(src, &mut out)?;
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Copies host data into a device view of the same length.
    pub fn write<T: DeviceRepr>(&self, src: &[T], dst: &mut CudaViewMut<'_, T>) -> Result<(), KernelError> {
        check_len("destination", dst.len(), src.len())?;
        self.stream.memcpy_htod(src, dst)?;
        Ok(())
    }

    /// Device-to-device copy of `src` into `dst` (same length).
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<(), KernelError> {
        check_len("destination", dst.len(), src.len())?;
        self.stream.memcpy_dtod(src, dst)?;
        Ok(())
    }

    /// Milliseconds per call of `f`, measured with device events over `iters` calls after one warm-up.
    pub fn time_ms(
        &self,
        iters: usize,
        mut f: impl FnMut() -> Result<(), KernelError>,
    ) -> Result<f32, KernelError> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        f()?;
        self.synchronize()?;
        let start = self.stream.record_event(Some(CU_EVENT_DEFAULT))?;
        for _ in 0..iters.max(1) {
            f()?;
        }
        let end = self.stream.record_event(Some(CU_EVENT_DEFAULT))?;
        Ok(start.elapsed_ms(&end)? / iters.max(1) as f32)
    }

    /// Starts capturing this GPU's launches into a graph instead of running them (until
    /// [`end_capture`](Self::end_capture)). Nothing may allocate or copy to the host meanwhile.
    pub fn begin_capture(&self) -> Result<(), KernelError> {
        use cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        Ok(())
    }

    /// Ends a capture; the launches since [`begin_capture`](Self::begin_capture), ready to replay.
    pub fn end_capture(&self) -> Result<StepGraph, KernelError> {
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        match self.stream.end_capture(flags)? {
            Some(g) => Ok(StepGraph::new(g)),
            None => Err(KernelError::shape("the capture recorded no launches")),
        }
    }

    /// Waits for all queued work; reports asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        Ok(self.stream.synchronize()?)
    }

    /// `out[r] = table[ids[r]]`: bf16 embedding rows to f32.
    pub fn embed_gather(
        &self,
        table: &CudaView<'_, u16>,
        vocab: usize,
        dim: usize,
        ids: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KernelError> {
        let rows = ids.len();
        check_len("embedding table", table.len(), vocab * dim)?;
        check_len("output", out.len(), rows * dim)?;
        let (dim_i, vocab_u) = (fits_i32("dim", dim)?, vocab as u32);
        let mut b = self.stream.launch_builder(self.func("embed_gather"));
        b.arg(table).arg(ids).arg(out).arg(&dim_i).arg(&vocab_u);
        sys::launch(b, rows_cfg(rows, launch::ROW_THREADS)?)
    }

    /// RMSNorm fused with the residual add: `x += add` (when given), `out = bf16(x / rms(x) * w)`.
    pub fn rmsnorm_residual(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        add: Option<&CudaView<'_, f32>>,
        w: &CudaView<'_, u16>,
        out: &mut CudaViewMut<'_, u16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        check_len("x", x.len(), rows * dim)?;
        check_len("weight", w.len(), dim)?;
        check_len("output", out.len(), rows * dim)?;
        if let Some(a) = add {
            check_len("residual input", a.len(), rows * dim)?;
        }
        let dummy = self.dummy.as_view();
        let (add_v, has_add) = match add {
            Some(a) => (a, 1i32),
            None => (&dummy, 0i32),
        };
        let dim_i = fits_i32("dim", dim)?;
        let mut b = self.stream.launch_builder(self.func("rmsnorm_residual"));
        b.arg(x).arg(add_v).arg(&has_add).arg(w).arg(out).arg(&dim_i).arg(&eps);
        sys::launch(b, rows_cfg(rows, launch::ROW_THREADS)?)
    }

    /// Rotate-half RoPE on the first `n_heads` heads of each row, in place, position `pos[r]`; cos and
    /// sin times `attn_factor` (YaRN's attention factor; 1.0 otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        qkv: &mut CudaViewMut<'_, f32>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaView<'_, f32>,
        row_stride: usize,
        n_heads: usize,
        head_dim: usize,
        attn_factor: f32,
    ) -> Result<(), KernelError> {
        let rows = pos.len();
        if !head_dim.is_multiple_of(2) || n_heads * head_dim > row_stride {
            return Err(KernelError::shape(format!("{n_heads} heads of {head_dim} in rows of {row_stride}")));
        }
        check_len("qkv", qkv.len(), rows * row_stride)?;
        check_len("inv_freq", inv_freq.len(), head_dim / 2)?;
        let (rs, nh, hd) = (fits_i32("row_stride", row_stride)?, n_heads as i32, head_dim as i32);
        let mut b = self.stream.launch_builder(self.func("rope_qk"));
        b.arg(qkv).arg(pos).arg(inv_freq).arg(&rs).arg(&nh).arg(&hd).arg(&attn_factor);
        sys::launch(b, rows_cfg(rows, launch::ROW_THREADS)?)
    }

    /// Per-head RMSNorm in place on `rows` rows of a fused QKV matrix (Qwen3's q/k norms): the first
    /// `heads.0` heads of each row with `wq`, the next `heads.1` with `wk` (f32, `head_dim` each).
    #[allow(clippy::too_many_arguments)]
    pub fn head_rmsnorm(
        &self,
        qkv: &mut CudaViewMut<'_, f32>,
        rows: usize,
        row_stride: usize,
        heads: (usize, usize),
        head_dim: usize,
        w: (&CudaView<'_, f32>, &CudaView<'_, f32>),
        eps: f32,
    ) -> Result<(), KernelError> {
        let (q_heads, k_heads) = heads;
        if (q_heads + k_heads) * head_dim > row_stride {
            return Err(KernelError::shape(format!(
                "{} heads of {head_dim} in rows of {row_stride}",
                q_heads + k_heads
            )));
        }
        check_len("qkv", qkv.len(), rows * row_stride)?;
        check_len("q norm weight", w.0.len(), head_dim)?;
        check_len("k norm weight", w.1.len(), head_dim)?;
        let total = (rows * (q_heads + k_heads)) as i64;
        if total == 0 {
            return Ok(());
        }
        let (rs, qh, kh, hd) = (
            fits_i32("row_stride", row_stride)?,
            fits_i32("q_heads", q_heads)?,
            fits_i32("k_heads", k_heads)?,
            fits_i32("head_dim", head_dim)?,
        );
        const WARPS: i64 = 8;
        let blocks =
            u32::try_from((total + WARPS - 1) / WARPS).map_err(|_| KernelError::shape("too many heads"))?;
        let mut b = self.stream.launch_builder(self.func("head_rmsnorm"));
        b.arg(qkv).arg(&rs).arg(&qh).arg(&kh).arg(&hd).arg(w.0).arg(w.1).arg(&eps).arg(&total);
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (32 * WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `x[r][j] += bias[j]` for `rows` rows of `bias.len()` f32 values.
    pub fn add_bias_rows(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        bias: &CudaView<'_, f32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        let n = bias.len();
        check_len("x", x.len(), rows * n)?;
        if rows * n == 0 {
            return Ok(());
        }
        let (n_i, total) = (fits_i32("bias length", n)?, (rows * n) as i64);
        let mut b = self.stream.launch_builder(self.func("add_bias_rows"));
        b.arg(x).arg(bias).arg(&n_i).arg(&total);
        self.launch_elementwise(b, rows * n)
    }

    /// Fills `out` with seeded random bf16 values, `scale * u` for `u` uniform in [-1, 1)
    /// ([`crate::reference::random_bf16`] gives the same bits): random-weight models made on the
    /// device, without a host copy.
    pub fn fill_random_bf16(
        &self,
        out: &mut CudaViewMut<'_, u16>,
        seed: u64,
        scale: f32,
    ) -> Result<(), KernelError> {
        let n = out.len() as i64;
        let mut b = self.stream.launch_builder(self.func("fill_random_bf16"));
        b.arg(out).arg(&n).arg(&seed).arg(&scale);
        self.launch_elementwise(b, n as usize)
    }

    fn launch_elementwise(&self, b: cudarc::driver::LaunchArgs<'_>, n: usize) -> Result<(), KernelError> {
        let blocks = launch::elementwise_blocks(n, launch::ROW_THREADS);
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (launch::ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `out = bf16(silu(gate) * up)` for rows of `[gate | up]` (`2 * inter` wide).
    pub fn swiglu(
        &self,
        gu: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
        rows: usize,
        inter: usize,
    ) -> Result<(), KernelError> {
        check_len("gate/up", gu.len(), rows * 2 * inter)?;
        check_len("output", out.len(), rows * inter)?;
        let n = (rows * inter) as i64;
        let inter_i = fits_i32("inter", inter)?;
        let mut b = self.stream.launch_builder(self.func("swiglu"));
        b.arg(gu).arg(out).arg(&inter_i).arg(&n);
        let blocks = launch::elementwise_blocks(rows * inter, launch::ROW_THREADS);
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (launch::ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `out = bf16(x)` for the first `n` values.
    pub fn cast_bf16(
        &self,
        x: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        check_len("input", x.len(), n)?;
        check_len("output", out.len(), n)?;
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(self.func("cast_bf16"));
        b.arg(x).arg(out).arg(&n_i);
        let blocks = launch::elementwise_blocks(n, launch::ROW_THREADS);
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (launch::ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `out[i] = x[rows[i]]` for bf16 rows of `dim`; `src_rows` bounds the indices (checked on the host
    /// by the caller that built `rows`).
    pub fn gather_rows_bf16(
        &self,
        x: &CudaView<'_, u16>,
        src_rows: usize,
        rows: &CudaView<'_, i32>,
        out: &mut CudaViewMut<'_, u16>,
        dim: usize,
    ) -> Result<(), KernelError> {
        let n = rows.len();
        check_len("input", x.len(), src_rows * dim)?;
        check_len("output", out.len(), n * dim)?;
        let dim_i = fits_i32("dim", dim)?;
        let mut b = self.stream.launch_builder(self.func("gather_rows_bf16"));
        b.arg(x).arg(rows).arg(out).arg(&dim_i);
        sys::launch(b, rows_cfg(n, launch::ROW_THREADS)?)
    }

    /// Stores each row's K (`k_off..k_off+kv_dim`) and V (`v_off..`) into one layer's cache at
    /// `slots[r]` (negative: skipped). `num_slots` is the cache's capacity.
    pub fn kv_write(
        &self,
        qkv: &CudaView<'_, f32>,
        row_stride: usize,
        (k_off, v_off, kv_dim): (usize, usize, usize),
        slots: &CudaView<'_, i64>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        num_slots: usize,
    ) -> Result<(), KernelError> {
        let rows = slots.len();
        if k_off + kv_dim > row_stride || v_off + kv_dim > row_stride {
            return Err(KernelError::shape("K or V range outside the row"));
        }
        check_len("qkv", qkv.len(), rows * row_stride)?;
        check_len("K cache", k_cache.len(), num_slots * kv_dim)?;
        check_len("V cache", v_cache.len(), num_slots * kv_dim)?;
        let (rs, ko, vo, kd) =
            (fits_i32("row_stride", row_stride)?, k_off as i32, v_off as i32, kv_dim as i32);
        let mut b = self.stream.launch_builder(self.func("kv_write"));
        b.arg(qkv).arg(k_cache).arg(v_cache).arg(slots).arg(&rs).arg(&ko).arg(&vo).arg(&kd);
        sys::launch(b, rows_cfg(rows, launch::ROW_THREADS)?)
    }

    /// The split plan [`decode_attention`](Self::decode_attention) will use on this device.
    pub fn decode_plan(
        &self,
        kind: DecodeKernel,
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        max_ctx: usize,
    ) -> DecodePlan {
        let group = q_heads / kv_heads.max(1);
        let per_sm = self.decode_occupancy.get(&decode_kernel(kind, head_dim, group)).copied().unwrap_or(1);
        launch::decode_plan(batch, kv_heads, group, head_dim, max_ctx, per_sm * self.sms)
    }

    /// Paged decode attention with the kernel that measured faster for the step's size: the CUDA-core
    /// kernel for steps reading little KV ([`launch::cuda_core_decode_pays`]) and for block sizes
    /// that are not powers of two, the tensor-core kernel otherwise.
    pub fn decode_attention(
        &self,
        a: &DecodeAttention<'_>,
        scratch: &mut DecodeScratch,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<DecodePlan, KernelError> {
        let group = a.q_heads / a.kv_heads.max(1);
        let small = launch::cuda_core_decode_pays(a.batch, a.max_ctx, a.kv_heads, a.head_dim, group);
        let kind = if a.block_size.is_power_of_two() && !small {
            DecodeKernel::TensorCore
        } else {
            DecodeKernel::CudaCore
        };
        self.decode_attention_with(DecodeOptions::kernel(kind), a, scratch, out, out_row_stride)
    }

    /// Paged decode attention (flash-decoding): `out[rows[b]]` (the Q-head part, `q_heads * head_dim`
    /// values at the start of the row, `out_row_stride` apart) for each sequence. Returns the plan used.
    pub fn decode_attention_with(
        &self,
        opts: DecodeOptions,
        a: &DecodeAttention<'_>,
        scratch: &mut DecodeScratch,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<DecodePlan, KernelError> {
        if let Some(p) = launch::attention_shape_problem(a.q_heads, a.kv_heads, a.head_dim) {
            return Err(KernelError::shape(p));
        }
        let kind = opts.kernel;
        let group = a.q_heads / a.kv_heads;
        if kind != DecodeKernel::CudaCore && !a.block_size.is_power_of_two() {
            return Err(KernelError::shape("the tensor-core kernels need a power-of-two block size"));
        }
        if kind == DecodeKernel::CudaCore && group > launch::DECODE_MAX_GROUP {
            return Err(KernelError::shape(format!(
                "the CUDA-core kernel takes at most {} query heads per KV head",
                launch::DECODE_MAX_GROUP
            )));
        }
        if a.batch == 0 {
            return Ok(self.decode_plan(kind, 0, a.q_heads, a.kv_heads, a.head_dim, 0));
        }
        if a.max_ctx == 0 || a.max_ctx > a.bt_stride * a.block_size {
            return Err(KernelError::shape(format!(
                "max context {} with block tables of {} x {} slots",
                a.max_ctx, a.bt_stride, a.block_size
            )));
        }
        let kv_dim = a.kv_heads * a.head_dim;
        check_len("rows", a.rows.len(), a.batch)?;
        check_len("ctx_lens", a.ctx_lens.len(), a.batch)?;
        check_len("block tables", a.block_tables.len(), a.batch * a.bt_stride)?;
        check_len("K cache", a.k_cache.len(), a.num_slots * kv_dim)?;
        check_len("V cache", a.v_cache.len(), a.num_slots * kv_dim)?;
        if a.q_row_stride < a.q_heads * a.head_dim || out_row_stride < a.q_heads * a.head_dim {
            return Err(KernelError::shape("row stride shorter than the query heads"));
        }
        let plan = match opts.splits {
            Some(n) => launch::decode_plan_with_splits(a.batch, a.kv_heads, group, a.head_dim, n),
            None => self.decode_plan(kind, a.batch, a.q_heads, a.kv_heads, a.head_dim, a.max_ctx),
        };
        for (buf, need) in [(&mut scratch.out, plan.partial_out), (&mut scratch.ml, plan.partial_ml)] {
            if buf.as_ref().is_none_or(|b| b.len() < need) {
                *buf = Some(self.zeros::<f32>(need)?);
            }
        }
        let (part_o, part_ml) = (scratch.out.as_mut().unwrap(), scratch.ml.as_mut().unwrap());
        let (qs, bts, nkv, bs) = (
            fits_i32("q_row_stride", a.q_row_stride)?,
            fits_i32("bt_stride", a.bt_stride)?,
            a.kv_heads as i32,
            fits_i32("block_size", a.block_size)?,
        );
        let splits = plan.splits as i32;
        let name = decode_kernel(kind, a.head_dim, group);
        let group_i = group as i32;
        let mut b = self.stream.launch_builder(self.func(&name));
        b.arg(a.q).arg(&qs).arg(a.rows).arg(a.k_cache).arg(a.v_cache).arg(a.block_tables).arg(&bts);
        b.arg(a.ctx_lens).arg(&nkv);
        let shift = a.block_size.trailing_zeros() as i32;
        if kind == DecodeKernel::CudaCore {
            b.arg(&bs);
        } else {
            b.arg(&group_i).arg(&shift);
        }
        b.arg(&a.scale).arg(&splits);
        b.arg(&mut *part_o).arg(&mut *part_ml);
        let shared_mem_bytes = match kind {
            DecodeKernel::TensorCore => launch::decode_tc_dynamic_smem_bytes(a.head_dim) as u32,
            DecodeKernel::CudaCore => 0,
        };
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (plan.grid_x, plan.splits as u32, 1),
                block_dim: (launch::DECODE_THREADS, 1, 1),
                shared_mem_bytes,
            },
        )?;
        let (nq, hd, ors) =
            (a.q_heads as i32, a.head_dim as i32, fits_i32("out_row_stride", out_row_stride)?);
        let mut r = self.stream.launch_builder(self.func("decode_attn_reduce"));
        r.arg(&*part_o).arg(&*part_ml).arg(a.rows).arg(out).arg(&ors).arg(&nq).arg(&hd).arg(&splits);
        sys::launch(r, rows_cfg(a.batch * a.q_heads, a.head_dim as u32)?)?;
        Ok(plan)
    }

    /// Causal prefill attention over paged KV on the tensor cores, for the tiles of
    /// [`launch::prefill_tiles`].
    pub fn prefill_attention(
        &self,
        a: &PrefillAttention<'_>,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<(), KernelError> {
        self.prefill_attention_with(launch::PrefillKernel::TensorCore, a, out, out_row_stride)
    }

    /// [`prefill_attention`](Self::prefill_attention) with a chosen kernel; `a.tiles` from
    /// [`launch::prefill_tiles_for`] with the same kernel.
    pub fn prefill_attention_with(
        &self,
        kernel: launch::PrefillKernel,
        a: &PrefillAttention<'_>,
        out: &mut CudaViewMut<'_, f32>,
        out_row_stride: usize,
    ) -> Result<(), KernelError> {
        if let Some(p) = launch::attention_shape_problem(a.q_heads, a.kv_heads, a.head_dim) {
            return Err(KernelError::shape(p));
        }
        if a.n_tiles == 0 {
            return Ok(());
        }
        check_len("tiles", a.tiles.len(), a.n_tiles * 4)?;
        if a.q_row_stride < a.q_heads * a.head_dim || out_row_stride < a.q_heads * a.head_dim {
            return Err(KernelError::shape("row stride shorter than the query heads"));
        }
        let group = (a.q_heads / a.kv_heads) as i32;
        let (qs, bts, nkv, bs, ors) = (
            fits_i32("q_row_stride", a.q_row_stride)?,
            fits_i32("bt_stride", a.bt_stride)?,
            a.kv_heads as i32,
            fits_i32("block_size", a.block_size)?,
            fits_i32("out_row_stride", out_row_stride)?,
        );
        let name = match (kernel, a.head_dim) {
            (launch::PrefillKernel::TensorCore, 64) => "prefill_attn_tc_d64",
            (launch::PrefillKernel::TensorCore, _) => "prefill_attn_tc_d128",
            (launch::PrefillKernel::CudaCore, 64) => "prefill_attn_d64",
            (launch::PrefillKernel::CudaCore, _) => "prefill_attn_d128",
        };
        let threads = match kernel {
            launch::PrefillKernel::TensorCore => launch::PREFILL_TC_THREADS,
            launch::PrefillKernel::CudaCore => launch::PREFILL_THREADS,
        };
        let mut b = self.stream.launch_builder(self.func(name));
        b.arg(a.q).arg(&qs).arg(a.k_cache).arg(a.v_cache).arg(a.block_tables).arg(&bts).arg(a.tiles);
        b.arg(&nkv).arg(&group).arg(&bs).arg(&a.scale).arg(out).arg(&ors);
        let tiles = u32::try_from(a.n_tiles).map_err(|_| KernelError::shape("too many tiles"))?;
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (tiles, a.kv_heads as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `y[t x n] = x[t x k] . w[n x k]^T`: bf16 inputs, f32 accumulation and output. Steps of up to
    /// [`launch::GEMV_MAX_ROWS`] rows with a weight matrix of at most [`launch::GEMV_MAX_WEIGHTS`]
    /// values take the skinny product ([`gemv_bf16`](Self::gemv_bf16)) when `k` is a multiple of 8
    /// and both inputs start 16-byte aligned; the rest go through cuBLAS.
    pub fn gemm_bf16(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        t: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        if self.skinny
            && t <= launch::GEMV_MAX_ROWS
            && n * k <= launch::GEMV_MAX_WEIGHTS
            && k.is_multiple_of(8)
            && sys::aligned16(&self.stream, x, w)
        {
            self.gemv_bf16(x, w, y, t, k, n)
        } else {
            self.gemm_bf16_cublas(x, w, y, t, k, n)
        }
    }

    /// Whether [`gemm_bf16`](Self::gemm_bf16) takes the skinny product for short steps (on by
    /// default); off sends every product to cuBLAS, for comparisons.
    pub fn set_skinny_products(&mut self, on: bool) {
        self.skinny = on;
    }

    /// The skinny product: `y[t x n] = x[t x k] . w[n x k]^T` for `t <=`
    /// [`launch::GEMV_MAX_ROWS`], one warp per output column; `k` a multiple of 8, inputs 16-byte
    /// aligned.
    pub fn gemv_bf16(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        t: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        check_len("x", x.len(), t * k)?;
        check_len("w", w.len(), n * k)?;
        check_len("y", y.len(), t * n)?;
        if t > launch::GEMV_MAX_ROWS || !k.is_multiple_of(8) || !sys::aligned16(&self.stream, x, w) {
            return Err(KernelError::shape(format!(
                "the skinny product takes up to {} rows, k a multiple of 8 and 16-byte aligned inputs (t {t}, k {k})",
                launch::GEMV_MAX_ROWS
            )));
        }
        if t == 0 || n == 0 {
            return Ok(());
        }
        let (t_i, k_i, n_i) = (t as i32, fits_i32("k", k)?, fits_i32("n", n)?);
        let blocks = u32::try_from(n.div_ceil(launch::GEMV_WARPS as usize))
            .map_err(|_| KernelError::shape("n too large"))?;
        let mut b = self.stream.launch_builder(self.func("gemv_bf16"));
        b.arg(x).arg(w).arg(y).arg(&t_i).arg(&k_i).arg(&n_i);
        sys::launch(
            b,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (32 * launch::GEMV_WARPS, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    }

    /// `y[t x n] = x[t x k] . w[n x k]^T` through cuBLAS: bf16 inputs, f32 accumulation and output.
    pub fn gemm_bf16_cublas(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        t: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        check_len("x", x.len(), t * k)?;
        check_len("w", w.len(), n * k)?;
        check_len("y", y.len(), t * n)?;
        for (what, v) in [("t", t), ("k", k), ("n", n)] {
            fits_i32(what, v)?;
        }
        if t == 0 {
            return Ok(());
        }
        sys::gemm_bf16(&self.blas, &self.stream, x, w, y, (t, k, n))
    }

    /// Greedy pick per row of `logits` (`rows x vocab`): lowest id of the largest value.
    pub fn argmax(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), KernelError> {
        self.argmax_with_logprobs(logits, rows, vocab, out, None)
    }

    /// [`argmax`](Self::argmax), and with `logprobs` each pick's log-probability (its logit minus the
    /// row's log-sum-exp).
    pub fn argmax_with_logprobs(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaViewMut<'_, i32>,
        logprobs: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<(), KernelError> {
        check_len("logits", logits.len(), rows * vocab)?;
        check_len("output", out.len(), rows)?;
        if let Some(lp) = &logprobs {
            check_len("logprobs", lp.len(), rows)?;
        }
        let v = fits_i32("vocab", vocab)?;
        let dummy = self.dummy.as_view();
        let mut b = self.stream.launch_builder(self.func("argmax_rows"));
        b.arg(logits).arg(&v).arg(out);
        let (yes, no) = (1i32, 0i32);
        match logprobs {
            Some(lp) => b.arg(&yes).arg(lp),
            None => b.arg(&no).arg(&dummy),
        };
        sys::launch(b, rows_cfg(rows, launch::SAMPLE_THREADS)?)
    }

    /// Temperature / top-k / top-p sampling per row with a per-row seed and step.
    pub fn sample(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        p: &SampleParams<'_>,
        out: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), KernelError> {
        check_len("logits", logits.len(), rows * vocab)?;
        check_len("output", out.len(), rows)?;
        for (what, len) in
            [("temperature", p.temperature.len()), ("top_k", p.top_k.len()), ("top_p", p.top_p.len())]
        {
            check_len(what, len, rows)?;
        }
        check_len("seed", p.seed.len(), rows)?;
        check_len("step", p.step.len(), rows)?;
        let v = fits_i32("vocab", vocab)?;
        let mut b = self.stream.launch_builder(self.func("sample_rows"));
        b.arg(logits).arg(&v).arg(p.temperature).arg(p.top_k).arg(p.top_p).arg(p.seed).arg(p.step).arg(out);
        sys::launch(b, rows_cfg(rows, launch::SAMPLE_THREADS)?)
    }
}
