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

mod attention;

pub use attention::{DecodeAttention, DecodeKernel, DecodeOptions, DecodeScratch, PrefillAttention};

use crate::launch;
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

/// The operands of `y[t x n] = x[t x k] . w[n x k]^T` hold their shapes.
fn check_product(
    x: &CudaView<'_, u16>,
    w: &CudaView<'_, u16>,
    y: &CudaViewMut<'_, f32>,
    (t, k, n): (usize, usize, usize),
) -> Result<(), KernelError> {
    check_len("x", x.len(), t * k)?;
    check_len("w", w.len(), n * k)?;
    check_len("y", y.len(), t * n)
}

fn fits_i32(what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::shape(format!("{what} = {v} does not fit the kernel's int")))
}

fn rows_cfg(rows: usize, threads: u32) -> Result<LaunchConfig, KernelError> {
    let rows = u32::try_from(rows).map_err(|_| KernelError::shape("too many rows for one launch"))?;
    Ok(LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
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

    /// Launches an element-wise kernel over `n` values (grid-stride loop, `ROW_THREADS` a block).
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
        self.launch_elementwise(b, rows * inter)
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
        self.launch_elementwise(b, n)
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
        check_product(x, w, y, (t, k, n))?;
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
        check_product(x, w, y, (t, k, n))?;
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
