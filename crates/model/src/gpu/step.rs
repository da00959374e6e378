//! One step on the device: the host's step description copied into device buffers kept across
//! steps, the launches of the whole model, and CUDA graphs of decode steps.
//!
//! A step of single-token decodes that each want their logits is padded to a batch bucket (dummy
//! rows: token 0 at position 0, no KV write, one position of context) and its decode attention is
//! planned for a context bucket (the next power of two, at least 256), so that every step of one
//! (batch bucket, context bucket, table width) launches the same kernels on the same buffers. The
//! first such step runs as usual, the second is captured into a graph, later ones replay it: one
//! launch instead of ~13 per layer. A buffer that grows (a longer step, a wider plan) makes every
//! graph stale, and they are dropped; at most [`MAX_GRAPHS`] are kept. `PDSERVE_CUDA_GRAPHS=0` (or
//! [`GpuBackend::set_cuda_graphs`]) turns graphs off; a capture that fails turns them off for the
//! backend's life, with one line on stderr, and the step runs without.

use std::collections::{HashMap, HashSet};

use pdserve_kernels_sm120::launch::{prefill_tiles, PrefillSeq};
use pdserve_kernels_sm120::{
    CudaSlice, CudaView, CudaViewMut, DecodeAttention, DeviceRepr, Gpu, KernelError, PrefillAttention,
    StepGraph, ValidAsZeroBits,
};
use pdserve_kvcache::BlockId;

use super::GpuBackend;
use crate::backend::SeqStep;

/// Graphs kept at once (each a few hundred launches); more clears them all.
pub(super) const MAX_GRAPHS: usize = 64;

/// A device buffer kept across steps: grows (to a power of two) when a step needs more, so steady
/// steps allocate nothing; `len` is the current step's length.
pub(super) struct DevVec<T> {
    buf: Option<CudaSlice<T>>,
    len: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits> DevVec<T> {
    const fn new() -> DevVec<T> {
        DevVec { buf: None, len: 0 }
    }

    /// Makes room for `len` values (contents undefined) and sets the length; true when it had to
    /// allocate.
    fn reserve(&mut self, gpu: &Gpu, len: usize) -> Result<bool, KernelError> {
        let grow = self.buf.as_ref().is_none_or(|b| b.len() < len);
        if grow {
            self.buf = Some(gpu.zeros::<T>(len.next_power_of_two().max(16))?);
        }
        self.len = len;
        Ok(grow)
    }

    /// Copies `data` in (growing first if needed); true when it had to allocate.
    fn put(&mut self, gpu: &Gpu, data: &[T]) -> Result<bool, KernelError> {
        let grew = self.reserve(gpu, data.len())?;
        if let (Some(b), false) = (self.buf.as_mut(), data.is_empty()) {
            gpu.write(data, &mut b.slice_mut(0..data.len()))?;
        }
        Ok(grew)
    }

    /// The first `n` values (at most the current length).
    fn first(&self, n: usize) -> CudaView<'_, T> {
        self.buf.as_ref().expect("DevVec used before reserve").slice(0..n.min(self.len))
    }

    fn view(&self) -> CudaView<'_, T> {
        self.first(self.len)
    }

    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        let len = self.len;
        self.buf.as_mut().expect("DevVec used before reserve").slice_mut(0..len)
    }
}

/// The per-step inputs and the logits stage, on the device, reused across steps.
pub(super) struct StepInputs {
    ids: DevVec<u32>,
    pos: DevVec<i32>,
    slots: DevVec<i64>,
    d_rows: DevVec<i32>,
    d_ctx: DevVec<i32>,
    d_tables: DevVec<i32>,
    p_tables: DevVec<i32>,
    tiles: DevVec<i32>,
    logit_rows: DevVec<i32>,
    picked: DevVec<u16>,
    logits: DevVec<f32>,
    ids_out: DevVec<i32>,
    lp_out: DevVec<f32>,
}

impl StepInputs {
    pub(super) const fn new() -> StepInputs {
        StepInputs {
            ids: DevVec::new(),
            pos: DevVec::new(),
            slots: DevVec::new(),
            d_rows: DevVec::new(),
            d_ctx: DevVec::new(),
            d_tables: DevVec::new(),
            p_tables: DevVec::new(),
            tiles: DevVec::new(),
            logit_rows: DevVec::new(),
            picked: DevVec::new(),
            logits: DevVec::new(),
            ids_out: DevVec::new(),
            lp_out: DevVec::new(),
        }
    }
}

/// Activations for up to `rows` tokens, reused across steps.
pub(super) struct StepBuffers {
    rows: usize,
    x: CudaSlice<f32>,
    h: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_bf: CudaSlice<u16>,
    o: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
}

/// What a step returns: every wanted row's logits, or only each row's greedy pick.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Output {
    Logits,
    Greedy,
}

/// A step's result, by [`Output`].
pub(super) enum StepOut {
    Logits(Vec<Vec<f32>>),
    /// (token, log-probability) per wanted row.
    Greedy(Vec<(u32, f32)>),
}

/// A step's shape as launched (padded rows included).
struct Plan {
    rows: usize,
    decode: usize,
    max_ctx: usize,
    d_stride: usize,
    p_stride: usize,
    n_tiles: usize,
    prefill: bool,
    /// Rows of logits computed.
    logits: usize,
    /// Of those, the ones the caller asked for (the first ones).
    wanted: usize,
}

/// (decode rows, context bucket, block-table width).
type Key = (usize, usize, usize);

/// The decode-step graphs of one backend, and where its steps' time went.
pub(super) struct Graphs {
    on: bool,
    captured: HashMap<Key, StepGraph>,
    seen: HashSet<Key>,
    captures: u64,
    replays: u64,
    times: StepTimes,
}

/// Wall-clock seconds a backend's steps spent, summed since the last
/// [`GpuBackend::take_step_times`]: describing the step and copying it to the device, queueing its
/// launches (or its graph), and waiting for the device and copying the result back.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    pub steps: u64,
    pub prepare_s: f64,
    pub launch_s: f64,
    pub finish_s: f64,
}

impl Graphs {
    pub(super) fn new() -> Graphs {
        let on = std::env::var("PDSERVE_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let times = StepTimes::default();
        Graphs { on, captured: HashMap::new(), seen: HashSet::new(), captures: 0, replays: 0, times }
    }
}

/// Decode batches are padded up to: 1, 2, 4, 8, then multiples of 8 to 64, then of 32.
fn batch_bucket(n: usize) -> usize {
    match n {
        0..=8 => n.next_power_of_two(),
        9..=64 => n.div_ceil(8) * 8,
        _ => n.div_ceil(32) * 32,
    }
}

/// Decode attention is planned for the next power of two of the longest context, at least 256.
fn ctx_bucket(ctx: usize) -> usize {
    ctx.next_power_of_two().max(256)
}

/// Block tables as one `[tables x stride]` matrix (zeros past each table's end).
fn flat_tables(tables: &[&[BlockId]], min_stride: usize) -> (Vec<i32>, usize) {
    let stride = tables.iter().map(|b| b.len()).max().unwrap_or(1).max(min_stride).max(1);
    let mut out = vec![0i32; tables.len() * stride];
    for (i, tb) in tables.iter().enumerate() {
        for (j, b) in tb.iter().enumerate() {
            out[i * stride + j] = b.0 as i32;
        }
    }
    (out, stride)
}

impl GpuBackend {
    /// Turns CUDA graphs of decode steps on or off (on unless `PDSERVE_CUDA_GRAPHS=0`); graphs
    /// already captured stay for when they are turned on again.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs.on = on;
    }

    /// Whether products of short steps take the skinny kernel (on by default) or cuBLAS; graphs
    /// captured with the other choice are dropped.
    pub fn set_skinny_products(&mut self, on: bool) {
        self.gpu.set_skinny_products(on);
        self.graphs.captured.clear();
    }

    /// Where the steps' time went since the last call (and starts counting again).
    pub fn take_step_times(&mut self) -> StepTimes {
        std::mem::take(&mut self.graphs.times)
    }

    /// (graphs captured, steps replayed from a graph) so far.
    pub fn cuda_graph_stats(&self) -> (u64, u64) {
        (self.graphs.captures, self.graphs.replays)
    }

    /// Activations for `rows` rows; true when they had to be allocated.
    fn buffers(&mut self, rows: usize) -> Result<bool, KernelError> {
        if self.bufs.as_ref().is_some_and(|b| b.rows >= rows) {
            return Ok(false);
        }
        let n = rows.next_power_of_two().max(16);
        let c = &self.cfg;
        let (h, q, inter) = (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size);
        let qkv = q + 2 * c.num_kv_heads * c.head_dim;
        let g = &self.gpu;
        self.bufs = Some(StepBuffers {
            rows: n,
            x: g.zeros(n * h)?,
            h: g.zeros(n * h)?,
            qkv: g.zeros(n * qkv)?,
            attn: g.zeros(n * q)?,
            attn_bf: g.zeros(n * q)?,
            o: g.zeros(n * h)?,
            gu: g.zeros(n * 2 * inter)?,
            act: g.zeros(n * inter)?,
        });
        Ok(true)
    }

    /// Describes the step on the host and copies it into the device buffers: the plan, the graph key
    /// when the step can replay one, and whether any buffer had to be allocated.
    fn prepare(&mut self, steps: &[SeqStep<'_>]) -> Result<(Plan, Option<Key>, bool), KernelError> {
        let bs = self.layout.block_size;
        let graphable =
            self.graphs.on && !steps.is_empty() && steps.iter().all(|s| s.tokens.len() == 1 && s.logits == 1);
        let (mut ids, mut pos, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let (mut d_rows, mut d_ctx, mut d_tables) = (Vec::new(), Vec::new(), Vec::<&[BlockId]>::new());
        let (mut p_seqs, mut p_tables) = (Vec::new(), Vec::<&[BlockId]>::new());
        let mut logit_rows = Vec::new();
        let mut row = 0usize;
        for s in steps {
            for (j, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + j;
                ids.push(t);
                pos.push(p as i32);
                slots.push(s.block_table[p / bs].0 as i64 * bs as i64 + (p % bs) as i64);
            }
            let n = s.tokens.len();
            if n == 1 {
                d_rows.push(row as i32);
                d_ctx.push((s.start_pos + 1) as i32);
                d_tables.push(s.block_table);
            } else {
                p_seqs.push(PrefillSeq {
                    seq: p_tables.len(),
                    first_row: row,
                    rows: n,
                    first_pos: s.start_pos,
                });
                p_tables.push(s.block_table);
            }
            logit_rows.extend((row + n - s.logits..row + n).map(|r| r as i32));
            row += n;
        }
        let wanted = logit_rows.len();
        let mut max_ctx = d_ctx.iter().copied().max().unwrap_or(0) as usize;
        let (d_bt, d_stride, key) = if graphable {
            // Dummy rows up to the bucket: token 0 at position 0, no KV write, one position of
            // context in block 0 (finite values; their outputs are dropped).
            let padded = batch_bucket(steps.len());
            for r in steps.len()..padded {
                ids.push(0);
                pos.push(0);
                slots.push(-1);
                d_rows.push(r as i32);
                d_ctx.push(1);
                d_tables.push(&[]);
                logit_rows.push(r as i32);
            }
            max_ctx = ctx_bucket(max_ctx);
            let (t, stride) = flat_tables(&d_tables, max_ctx.div_ceil(bs));
            (t, stride, Some((padded, max_ctx, stride)))
        } else {
            let (t, stride) = flat_tables(&d_tables, 1);
            (t, stride, None)
        };
        let (p_bt, p_stride) = flat_tables(&p_tables, 1);
        let c = &self.cfg;
        let tiles = prefill_tiles(&p_seqs, c.num_heads / c.num_kv_heads);
        let (hsz, vocab) = (c.hidden_size, c.vocab_size);
        let plan = Plan {
            rows: ids.len(),
            decode: d_rows.len(),
            max_ctx,
            d_stride,
            p_stride,
            n_tiles: tiles.len() / 4,
            prefill: !p_seqs.is_empty(),
            logits: logit_rows.len(),
            wanted,
        };
        let mut grew = self.buffers(plan.rows)?;
        let (g, inp) = (&self.gpu, &mut self.inputs);
        grew |= inp.ids.put(g, &ids)?;
        grew |= inp.pos.put(g, &pos)?;
        grew |= inp.slots.put(g, &slots)?;
        grew |= inp.d_rows.put(g, &d_rows)?;
        grew |= inp.d_ctx.put(g, &d_ctx)?;
        grew |= inp.d_tables.put(g, &d_bt)?;
        grew |= inp.p_tables.put(g, &p_bt)?;
        grew |= inp.tiles.put(g, &tiles)?;
        grew |= inp.logit_rows.put(g, &logit_rows)?;
        grew |= inp.picked.reserve(g, plan.logits * hsz)?;
        grew |= inp.logits.reserve(g, plan.logits * vocab)?;
        Ok((plan, key, grew))
    }

    /// Queues every launch of the step (up to the LM head's logits on the device).
    fn launch_step(&mut self, plan: &Plan) -> Result<(), KernelError> {
        let c = &self.cfg;
        let (hsz, hd, nq, nkv, inter, vocab) =
            (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size);
        let (q_dim, kv_dim) = (nq * hd, nkv * hd);
        let qkv_w = q_dim + 2 * kv_dim;
        let bs = self.layout.block_size;
        let num_slots = self.layout.num_blocks * bs;
        let (eps, scale, t) = (c.rms_norm_eps, 1.0 / (hd as f32).sqrt(), plan.rows);
        let (g, inp) = (&self.gpu, &self.inputs);
        let b = self.bufs.as_mut().expect("buffers allocated by prepare");

        g.embed_gather(&self.embed.as_view(), vocab, hsz, &inp.ids.view(), &mut b.x.as_view_mut())?;
        for (l, lw) in self.layers.iter().enumerate() {
            let ov = b.o.as_view();
            let (x, h) = (&mut b.x.as_view_mut(), &mut b.h.as_view_mut());
            g.rmsnorm_residual(x, (l > 0).then_some(&ov), &lw.input_norm.as_view(), h, t, hsz, eps)?;
            g.gemm_bf16(&b.h.as_view(), &lw.qkv.as_view(), &mut b.qkv.as_view_mut(), t, hsz, qkv_w)?;
            if let Some(bias) = &lw.qkv_bias {
                g.add_bias_rows(&mut b.qkv.as_view_mut(), &bias.as_view(), t)?;
            }
            if let Some((wq, wk)) = &lw.qk_norm {
                let w = (&wq.as_view(), &wk.as_view());
                g.head_rmsnorm(&mut b.qkv.as_view_mut(), t, qkv_w, (nq, nkv), hd, w, eps)?;
            }
            let (pos, inv) = (inp.pos.view(), self.inv_freq.as_view());
            g.rope_qk(&mut b.qkv.as_view_mut(), &pos, &inv, qkv_w, nq + nkv, hd, self.rope_factor)?;
            let (kc, vc) = (&mut self.k[l].as_view_mut(), &mut self.v[l].as_view_mut());
            let offsets = (q_dim, q_dim + kv_dim, kv_dim);
            g.kv_write(&b.qkv.as_view(), qkv_w, offsets, &inp.slots.view(), kc, vc, num_slots)?;
            let (qv, kc, vc) = (b.qkv.as_view(), self.k[l].as_view(), self.v[l].as_view());
            if plan.decode > 0 {
                let (rv, cv, tv) = (inp.d_rows.view(), inp.d_ctx.view(), inp.d_tables.view());
                let a = DecodeAttention {
                    q: &qv,
                    q_row_stride: qkv_w,
                    rows: &rv,
                    k_cache: &kc,
                    v_cache: &vc,
                    block_tables: &tv,
                    bt_stride: plan.d_stride,
                    ctx_lens: &cv,
                    max_ctx: plan.max_ctx,
                    batch: plan.decode,
                    q_heads: nq,
                    kv_heads: nkv,
                    head_dim: hd,
                    block_size: bs,
                    num_slots,
                    scale,
                };
                g.decode_attention(&a, &mut self.scratch, &mut b.attn.as_view_mut(), q_dim)?;
            }
            if plan.prefill {
                let (tv, tl) = (inp.p_tables.view(), inp.tiles.view());
                let a = PrefillAttention {
                    q: &qv,
                    q_row_stride: qkv_w,
                    k_cache: &kc,
                    v_cache: &vc,
                    block_tables: &tv,
                    bt_stride: plan.p_stride,
                    tiles: &tl,
                    n_tiles: plan.n_tiles,
                    q_heads: nq,
                    kv_heads: nkv,
                    head_dim: hd,
                    block_size: bs,
                    scale,
                };
                g.prefill_attention(&a, &mut b.attn.as_view_mut(), q_dim)?;
            }
            g.cast_bf16(&b.attn.as_view(), &mut b.attn_bf.as_view_mut(), t * q_dim)?;
            g.gemm_bf16(&b.attn_bf.as_view(), &lw.o.as_view(), &mut b.o.as_view_mut(), t, q_dim, hsz)?;
            if let Some(bias) = &lw.o_bias {
                g.add_bias_rows(&mut b.o.as_view_mut(), &bias.as_view(), t)?;
            }
            let ov = b.o.as_view();
            let (x, h) = (&mut b.x.as_view_mut(), &mut b.h.as_view_mut());
            g.rmsnorm_residual(x, Some(&ov), &lw.post_norm.as_view(), h, t, hsz, eps)?;
            g.gemm_bf16(&b.h.as_view(), &lw.gate_up.as_view(), &mut b.gu.as_view_mut(), t, hsz, 2 * inter)?;
            g.swiglu(&b.gu.as_view(), &mut b.act.as_view_mut(), t, inter)?;
            g.gemm_bf16(&b.act.as_view(), &lw.down.as_view(), &mut b.o.as_view_mut(), t, inter, hsz)?;
        }
        if plan.logits == 0 {
            return Ok(());
        }
        let ov = b.o.as_view();
        let (x, h) = (&mut b.x.as_view_mut(), &mut b.h.as_view_mut());
        g.rmsnorm_residual(x, Some(&ov), &self.final_norm.as_view(), h, t, hsz, eps)?;
        let inp = &mut self.inputs;
        g.gather_rows_bf16(&b.h.as_view(), t, &inp.logit_rows.view(), &mut inp.picked.view_mut(), hsz)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        g.gemm_bf16(&inp.picked.view(), &head.as_view(), &mut inp.logits.view_mut(), plan.logits, hsz, vocab)
    }

    /// Captures the step's launches into a graph (the launches are recorded, not run).
    fn capture(&mut self, plan: &Plan) -> Result<StepGraph, KernelError> {
        self.gpu.begin_capture()?;
        let launched = self.launch_step(plan);
        let graph = self.gpu.end_capture();
        launched?;
        graph
    }

    /// Runs one step: eagerly, or by replaying (or first capturing) its graph. A step that fails may
    /// have replaced a buffer before failing (a later allocation ran out of memory), so every graph
    /// is dropped then: none may replay with a freed pointer.
    pub(super) fn run(&mut self, steps: &[SeqStep<'_>], output: Output) -> Result<StepOut, KernelError> {
        let out = self.run_step(steps, output);
        if out.is_err() {
            self.graphs.captured.clear();
        }
        out
    }

    fn run_step(&mut self, steps: &[SeqStep<'_>], output: Output) -> Result<StepOut, KernelError> {
        let t0 = std::time::Instant::now();
        let (plan, key, grew) = self.prepare(steps)?;
        let t1 = std::time::Instant::now();
        if grew {
            self.graphs.captured.clear();
        }
        let scratch = self.scratch.capacity();
        match key {
            Some(k) if self.graphs.captured.contains_key(&k) => {
                self.graphs.captured[&k].launch()?;
                self.graphs.replays += 1;
            }
            Some(k) if self.graphs.seen.contains(&k) => match self.capture(&plan) {
                Ok(graph) => {
                    if self.graphs.captured.len() >= MAX_GRAPHS {
                        self.graphs.captured.clear();
                    }
                    graph.launch()?;
                    self.graphs.captured.insert(k, graph);
                    self.graphs.captures += 1;
                }
                Err(e) => {
                    eprintln!("pdserve: CUDA graph capture failed ({e}); decode steps run without graphs");
                    self.set_cuda_graphs(false);
                    self.graphs.captured.clear();
                    self.launch_step(&plan)?;
                }
            },
            Some(k) => {
                self.launch_step(&plan)?;
                if self.graphs.seen.len() >= 4 * MAX_GRAPHS {
                    self.graphs.seen.clear();
                }
                self.graphs.seen.insert(k);
            }
            None => self.launch_step(&plan)?,
        }
        if self.scratch.capacity() != scratch {
            self.graphs.captured.clear();
        }
        let t2 = std::time::Instant::now();
        let out = self.finish(&plan, output);
        let times = &mut self.graphs.times;
        times.steps += 1;
        times.prepare_s += (t1 - t0).as_secs_f64();
        times.launch_s += (t2 - t1).as_secs_f64();
        times.finish_s += t2.elapsed().as_secs_f64();
        out
    }

    /// Waits for the step and brings back what `output` asks for.
    fn finish(&mut self, plan: &Plan, output: Output) -> Result<StepOut, KernelError> {
        let g = &self.gpu;
        if plan.logits == 0 {
            g.synchronize()?;
            return Ok(match output {
                Output::Logits => StepOut::Logits(Vec::new()),
                Output::Greedy => StepOut::Greedy(Vec::new()),
            });
        }
        let vocab = self.cfg.vocab_size;
        let inp = &mut self.inputs;
        Ok(match output {
            Output::Logits => {
                let host = g.download(&inp.logits.first(plan.wanted * vocab))?;
                StepOut::Logits(host.chunks(vocab).map(<[f32]>::to_vec).collect())
            }
            Output::Greedy => {
                inp.ids_out.reserve(g, plan.logits)?;
                inp.lp_out.reserve(g, plan.logits)?;
                let (ids, lps) = (&mut inp.ids_out.view_mut(), &mut inp.lp_out.view_mut());
                g.argmax_with_logprobs(&inp.logits.view(), plan.logits, vocab, ids, Some(lps))?;
                let ids = g.download(&inp.ids_out.first(plan.wanted))?;
                let lps = g.download(&inp.lp_out.first(plan.wanted))?;
                StepOut::Greedy(ids.into_iter().map(|i| i as u32).zip(lps).collect())
            }
        })
    }
}
