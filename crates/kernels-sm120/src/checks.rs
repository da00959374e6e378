//! The GPU self-checks (`pdserve-kernels check`, `cargo xtask test-gpu`): every kernel on the GPU
//! against [`reference`](crate::reference), on fresh random inputs (the seed is printed). Outputs are
//! poisoned (NaN) before each launch and every element is checked to be written.

use crate::reference::{self as r, bf16_to_f32, f32_to_bf16, PagedKv};
use crate::CudaSlice;
use crate::{
    launch, DecodeAttention, DecodeKernel, DecodeOptions, DecodeScratch, Gpu, KernelError, PrefillAttention,
    SampleParams,
};

/// xorshift64*: reproducible inputs from a printed seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / 8_388_608.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    pub fn bf16(&mut self, n: usize, scale: f32) -> Vec<u16> {
        (0..n).map(|_| f32_to_bf16(self.f() * scale)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// ||a - b|| / ||b||; NaN anywhere in `a` gives infinity.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

struct Report {
    failures: usize,
}

impl Report {
    fn check(&mut self, name: &str, err: f64, tol: f64) {
        let ok = err <= tol;
        println!("{:<58} err {:>10.3e}  tol {:>8.1e}  {}", name, err, tol, if ok { "ok" } else { "FAIL" });
        if !ok {
            self.failures += 1;
        }
    }
    fn exact(&mut self, name: &str, ok: bool, detail: &str) {
        println!("{:<58} {:>32}  {}", name, detail, if ok { "ok" } else { "FAIL" });
        if !ok {
            self.failures += 1;
        }
    }
}

const NAN_BF16: u16 = 0x7fc0;

fn b2f(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&x| bf16_to_f32(x)).collect()
}

fn check_rows(g: &Gpu, rep: &mut Report, rng: &mut Rng) -> Result<(), KernelError> {
    // RMSNorm + residual, with and without the add, model and odd widths.
    for (rows, dim, with_add) in [(7, 576, true), (5, 1001, false), (3, 4096, true)] {
        let x = rng.vec(rows * dim, 3.0);
        let add = rng.vec(rows * dim, 1.0);
        let w: Vec<u16> = rng.bf16(dim, 2.0);
        let mut xd = g.upload(&x)?;
        let ad = g.upload(&add)?;
        let wd = g.upload(&w)?;
        let mut out = g.upload(&vec![NAN_BF16; rows * dim])?;
        let av = ad.as_view();
        g.rmsnorm_residual(
            &mut xd.as_view_mut(),
            with_add.then_some(&av),
            &wd.as_view(),
            &mut out.as_view_mut(),
            rows,
            dim,
            1e-5,
        )?;
        let mut xr = x.clone();
        let want = r::rmsnorm_residual(&mut xr, with_add.then_some(&add[..]), &b2f(&w), dim, 1e-5);
        let got = b2f(&g.download(&out.as_view())?);
        rep.check(
            &format!("rmsnorm_residual rows={rows} dim={dim} add={with_add}"),
            rel_err(&got, &want),
            6e-3,
        );
        rep.check(
            &format!("rmsnorm_residual residual stream dim={dim}"),
            rel_err(&g.download(&xd.as_view())?, &xr),
            1e-7,
        );
    }
    // RoPE at positions up to the longest context, 64- and 128-wide heads, with and without an
    // attention factor (YaRN).
    for (head_dim, n_heads, extra, factor) in [(64, 12, 3 * 64, 1.0f32), (128, 40, 8 * 128, 1.2f32)] {
        let pos: Vec<i32> = vec![0, 1, 17, 8191, 131_071];
        let stride = n_heads * head_dim + extra;
        let x = rng.vec(pos.len() * stride, 2.0);
        let inv = r::inv_freq(100_000.0, head_dim);
        let mut xd = g.upload(&x)?;
        let (pd, id) = (g.upload(&pos)?, g.upload(&inv)?);
        g.rope_qk(&mut xd.as_view_mut(), &pd.as_view(), &id.as_view(), stride, n_heads, head_dim, factor)?;
        let mut want = x.clone();
        for (i, row) in want.chunks_exact_mut(stride).enumerate() {
            r::rope_row(row, pos[i] as usize, &inv, n_heads, head_dim, factor);
        }
        rep.check(
            &format!("rope_qk head_dim={head_dim} factor={factor} positions 0..131071"),
            rel_err(&g.download(&xd.as_view())?, &want),
            2e-6,
        );
    }
    // Per-head RMSNorm of Q and K heads (V heads untouched), and the bias add, on fused QKV rows.
    for (rows, head_dim, qh, kh, vh) in [(5, 128, 16, 8, 8), (3, 64, 9, 3, 3)] {
        let stride = (qh + kh + vh) * head_dim;
        let x = rng.vec(rows * stride, 3.0);
        let (wq, wk) = (rng.vec(head_dim, 2.0), rng.vec(head_dim, 2.0));
        let bias = rng.vec(stride, 1.0);
        let mut xd = g.upload(&x)?;
        let (wqd, wkd, bd) = (g.upload(&wq)?, g.upload(&wk)?, g.upload(&bias)?);
        g.head_rmsnorm(
            &mut xd.as_view_mut(),
            rows,
            stride,
            (qh, kh),
            head_dim,
            (&wqd.as_view(), &wkd.as_view()),
            1e-6,
        )?;
        let mut want = x.clone();
        r::head_rmsnorm(&mut want, stride, (qh, kh, head_dim), &wq, &wk, 1e-6);
        let got = g.download(&xd.as_view())?;
        rep.check(
            &format!("head_rmsnorm rows={rows} heads={qh}+{kh} dim={head_dim}"),
            rel_err(&got, &want),
            1e-6,
        );
        let v_off = (qh + kh) * head_dim;
        let v_same = (0..rows)
            .all(|r| got[r * stride + v_off..(r + 1) * stride] == x[r * stride + v_off..(r + 1) * stride]);
        rep.exact("head_rmsnorm leaves V heads untouched", v_same, "");
        g.add_bias_rows(&mut xd.as_view_mut(), &bd.as_view(), rows)?;
        for (i, v) in want.iter_mut().enumerate() {
            *v += bias[i % stride];
        }
        rep.check(
            &format!("add_bias_rows rows={rows} n={stride}"),
            rel_err(&g.download(&xd.as_view())?, &want),
            1e-6,
        );
    }
    // Seeded random fill: the same bits as the host's function, and a spread that fits its scale.
    let n = 1_000_003;
    let mut fd = g.upload(&vec![NAN_BF16; n])?;
    g.fill_random_bf16(&mut fd.as_view_mut(), 42, 0.05)?;
    let got = g.download(&fd.as_view())?;
    let same = got.iter().enumerate().all(|(i, &v)| v == r::random_bf16(42, i as u64, 0.05));
    let mean_abs = b2f(&got).iter().map(|v| v.abs() as f64).sum::<f64>() / n as f64;
    rep.exact(
        "fill_random_bf16 n=1000003 (bit-exact, mean |x| near scale/2)",
        same && (mean_abs - 0.025).abs() < 0.001,
        &format!("mean |x| {mean_abs:.5}"),
    );
    // SwiGLU, cast, embedding gather, row gather.
    let (rows, inter) = (3, 1537);
    let gu = rng.vec(rows * 2 * inter, 4.0);
    let gud = g.upload(&gu)?;
    let mut out = g.upload(&vec![NAN_BF16; rows * inter])?;
    g.swiglu(&gud.as_view(), &mut out.as_view_mut(), rows, inter)?;
    rep.check(
        "swiglu rows=3 inter=1537",
        rel_err(&b2f(&g.download(&out.as_view())?), &r::swiglu(&gu, inter)),
        6e-3,
    );
    let n = 100_003;
    let x = rng.vec(n, 100.0);
    let xd = g.upload(&x)?;
    let mut out = g.upload(&vec![NAN_BF16; n])?;
    g.cast_bf16(&xd.as_view(), &mut out.as_view_mut(), n)?;
    let want: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
    rep.exact("cast_bf16 n=100003 (bit-exact)", g.download(&out.as_view())? == want, "");
    let (vocab, dim) = (1000, 576);
    let table = rng.bf16(vocab * dim, 1.0);
    let ids: Vec<u32> = vec![0, 999, 17, 17, 500];
    let (td, idd) = (g.upload(&table)?, g.upload(&ids)?);
    let mut out = g.upload(&vec![f32::NAN; ids.len() * dim])?;
    g.embed_gather(&td.as_view(), vocab, dim, &idd.as_view(), &mut out.as_view_mut())?;
    let want: Vec<f32> = ids.iter().flat_map(|&i| b2f(&table[i as usize * dim..][..dim])).collect();
    rep.exact("embed_gather (exact)", g.download(&out.as_view())? == want, "");
    let src_rows = 9;
    let x = rng.bf16(src_rows * dim, 1.0);
    let pick: Vec<i32> = vec![8, 0, 3];
    let (xd, pd) = (g.upload(&x)?, g.upload(&pick)?);
    let mut out = g.upload(&vec![NAN_BF16; pick.len() * dim])?;
    g.gather_rows_bf16(&xd.as_view(), src_rows, &pd.as_view(), &mut out.as_view_mut(), dim)?;
    let want: Vec<u16> = pick.iter().flat_map(|&i| x[i as usize * dim..][..dim].to_vec()).collect();
    rep.exact("gather_rows_bf16 (exact)", g.download(&out.as_view())? == want, "");
    // KV write into slots, one skipped.
    let (kv_dim, stride, num_slots) = (192, 960, 64);
    let qkv = rng.vec(4 * stride, 2.0);
    let slots: Vec<i64> = vec![5, 63, -1, 0];
    let (qd, sd) = (g.upload(&qkv)?, g.upload(&slots)?);
    let mut kc = g.upload(&vec![NAN_BF16; num_slots * kv_dim])?;
    let mut vc = g.upload(&vec![NAN_BF16; num_slots * kv_dim])?;
    g.kv_write(
        &qd.as_view(),
        stride,
        (576, 768, kv_dim),
        &sd.as_view(),
        &mut kc.as_view_mut(),
        &mut vc.as_view_mut(),
        num_slots,
    )?;
    let (k, v) = (g.download(&kc.as_view())?, g.download(&vc.as_view())?);
    let mut ok = true;
    for (row, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let s = slot as usize * kv_dim;
        for j in 0..kv_dim {
            ok &= k[s + j] == f32_to_bf16(qkv[row * stride + 576 + j]);
            ok &= v[s + j] == f32_to_bf16(qkv[row * stride + 768 + j]);
        }
    }
    let untouched = (1..5).all(|sl| k[sl * kv_dim] == NAN_BF16)
        && k[2 * kv_dim..3 * kv_dim].iter().all(|&x| x == NAN_BF16);
    rep.exact("kv_write (exact, skipped slot untouched)", ok && untouched, "");
    Ok(())
}

fn check_gemm(g: &Gpu, rep: &mut Report, rng: &mut Rng) -> Result<(), KernelError> {
    // cuBLAS for every shape; the skinny product for steps of up to 8 rows (k a multiple of 8),
    // with lengths that leave partial unrolled runs and a partial last block of columns.
    let cases = [
        (1, 576, 1536, false),
        (7, 576, 960, false),
        (64, 1536, 576, false),
        (33, 577, 1001, false),
        (1, 576, 1536, true),
        (1, 14336, 4099, true),
        (3, 4096, 77, true),
        (8, 1000, 129, true),
        (5, 8, 33, true),
    ];
    for (t, k, n, skinny) in cases {
        let x = rng.bf16(t * k, 1.0);
        let w = rng.bf16(n * k, 0.1);
        let (xd, wd) = (g.upload(&x)?, g.upload(&w)?);
        let mut y = g.upload(&vec![f32::NAN; t * n])?;
        if skinny {
            g.gemv_bf16(&xd.as_view(), &wd.as_view(), &mut y.as_view_mut(), t, k, n)?;
        } else {
            g.gemm_bf16_cublas(&xd.as_view(), &wd.as_view(), &mut y.as_view_mut(), t, k, n)?;
        }
        let (xf, wf) = (b2f(&x), b2f(&w));
        let want: Vec<f32> = (0..t * n)
            .map(|i| {
                let (row, col) = (i / n, i % n);
                (0..k).map(|j| xf[row * k + j] as f64 * wf[col * k + j] as f64).sum::<f64>() as f32
            })
            .collect();
        rep.check(
            &format!("gemm_bf16 ({}) t={t} k={k} n={n}", if skinny { "skinny" } else { "cuBLAS" }),
            rel_err(&g.download(&y.as_view())?, &want),
            1e-5,
        );
    }
    Ok(())
}

/// A paged cache with randomly placed blocks for sequences of the given lengths.
pub(crate) struct Paged {
    pub(crate) k: Vec<u16>,
    pub(crate) v: Vec<u16>,
    pub(crate) tables: Vec<i32>,
    pub(crate) bt_stride: usize,
}

pub(crate) fn paged(
    rng: &mut Rng,
    lens: &[usize],
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    k_scale: f32,
) -> Paged {
    let bt_stride = lens.iter().map(|l| l.div_ceil(block_size)).max().unwrap_or(1).max(1);
    let total_blocks: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum::<usize>() + 3;
    let mut order: Vec<i32> = (0..total_blocks as i32).collect();
    rng.shuffle(&mut order);
    let mut tables = vec![0i32; lens.len() * bt_stride];
    let mut next = 0;
    for (s, l) in lens.iter().enumerate() {
        for b in 0..l.div_ceil(block_size) {
            tables[s * bt_stride + b] = order[next];
            next += 1;
        }
    }
    let num_slots = total_blocks * block_size;
    let n = num_slots * kv_heads * head_dim;
    Paged { k: rng.bf16(n, k_scale), v: rng.bf16(n, 1.0), tables, bt_stride }
}

/// A decode attention problem's inputs on the host.
pub(crate) struct HostDecode<'a> {
    pub q: &'a [f32],
    pub rows: &'a [i32],
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub tables: &'a [i32],
    pub lens: &'a [i32],
}

/// A decode attention problem uploaded to the device (shared by the checks and the benchmark).
pub(crate) struct DecodeCase {
    q: CudaSlice<f32>,
    rows: CudaSlice<i32>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    tables: CudaSlice<i32>,
    lens: CudaSlice<i32>,
    /// q heads, kv heads, head dim, block size, block-table stride, slots in the cache.
    shape: (usize, usize, usize, usize, usize, usize),
    max_ctx: usize,
}

impl DecodeCase {
    /// Uploads one problem: `q` rows of `(q_heads + 2 kv_heads) * head_dim`, `rows[b]` the row of
    /// sequence b, `lens[b]` its context, `tables` `lens.len() x bt_stride` block ids.
    pub(crate) fn upload(
        g: &Gpu,
        h: HostDecode<'_>,
        (q_heads, kv_heads, head_dim, block_size, bt_stride): (usize, usize, usize, usize, usize),
    ) -> Result<DecodeCase, KernelError> {
        let HostDecode { q, rows, k, v, tables, lens } = h;
        let num_slots = k.len() / (kv_heads * head_dim);
        Ok(DecodeCase {
            q: g.upload(q)?,
            rows: g.upload(rows)?,
            k: g.upload(k)?,
            v: g.upload(v)?,
            tables: g.upload(tables)?,
            lens: g.upload(lens)?,
            shape: (q_heads, kv_heads, head_dim, block_size, bt_stride, num_slots),
            max_ctx: lens.iter().copied().max().unwrap_or(0) as usize,
        })
    }

    /// Calls `f` with the kernel's arguments for this problem.
    pub(crate) fn with_args<R>(&self, f: impl FnOnce(&DecodeAttention<'_>) -> R) -> R {
        let (q_heads, kv_heads, head_dim, block_size, bt_stride, num_slots) = self.shape;
        let (q, rows, k, v) = (self.q.as_view(), self.rows.as_view(), self.k.as_view(), self.v.as_view());
        let (tables, lens) = (self.tables.as_view(), self.lens.as_view());
        f(&DecodeAttention {
            q: &q,
            q_row_stride: (q_heads + 2 * kv_heads) * head_dim,
            rows: &rows,
            k_cache: &k,
            v_cache: &v,
            block_tables: &tables,
            bt_stride,
            ctx_lens: &lens,
            max_ctx: self.max_ctx,
            batch: self.lens.len(),
            q_heads,
            kv_heads,
            head_dim,
            block_size,
            num_slots,
            scale: 1.0 / (head_dim as f32).sqrt(),
        })
    }
}

fn check_decode(g: &Gpu, rep: &mut Report, rng: &mut Rng, quick: bool) -> Result<(), KernelError> {
    let mut cases: Vec<(Vec<usize>, usize, usize, usize, f32)> = vec![
        (vec![1, 17, 300], 9, 3, 64, 1.0),
        (vec![1, 4096, 4097, 33], 32, 8, 128, 1.0),
        (vec![2000, 1, 1, 65], 9, 3, 64, 6.0), // peaky softmax
        (vec![7; 40], 8, 1, 128, 1.0),
    ];
    // Every instantiated group size, both head sizes.
    for g in 1..=launch::DECODE_MAX_GROUP {
        for d in launch::HEAD_DIMS {
            cases.push((vec![1, 33, 700], 2 * g, 2, d, 2.0));
        }
    }
    // Groups only the tensor-core kernel takes.
    cases.push((vec![5, 300], 32, 2, 128, 1.0));
    cases.push((vec![64, 1000, 3], 12, 1, 64, 1.0));
    if !quick {
        cases.push((vec![131_072], 9, 3, 64, 1.0));
        cases.push((vec![131_072, 5], 32, 8, 128, 3.0));
    }
    for (lens, q_heads, kv_heads, head_dim, k_scale) in cases {
        let block_size = 16;
        let p = paged(rng, &lens, kv_heads, head_dim, block_size, k_scale);
        let batch = lens.len();
        let stride = (q_heads + 2 * kv_heads) * head_dim;
        // Rows in a shuffled order, to check the row mapping.
        let mut rows: Vec<i32> = (0..batch as i32).collect();
        rng.shuffle(&mut rows);
        let q = rng.vec(batch * stride, 1.0);
        let ctx: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let case = DecodeCase::upload(
            g,
            HostDecode { q: &q, rows: &rows, k: &p.k, v: &p.v, tables: &p.tables, lens: &ctx },
            (q_heads, kv_heads, head_dim, block_size, p.bt_stride),
        )?;
        let out_stride = q_heads * head_dim + 5;
        let mut out = g.upload(&vec![f32::NAN; batch * out_stride])?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let group = q_heads / kv_heads;
        for kind in [DecodeKernel::TensorCore, DecodeKernel::CudaCore] {
            if kind == DecodeKernel::CudaCore && group > launch::DECODE_MAX_GROUP {
                continue;
            }
            let mut scratch = DecodeScratch::default();
            let mut outv = out.as_view_mut();
            g.write(&vec![f32::NAN; batch * out_stride], &mut outv)?;
            let plan = case.with_args(|a| {
                g.decode_attention_with(DecodeOptions::kernel(kind), a, &mut scratch, &mut outv, out_stride)
            })?;
            let got = g.download(&out.as_view())?;
            let cache = PagedKv { k: &p.k, v: &p.v, kv_heads, head_dim, block_size };
            let (mut gv, mut wv) = (Vec::new(), Vec::new());
            for b in 0..batch {
                let row = rows[b] as usize;
                let table = &p.tables[b * p.bt_stride..(b + 1) * p.bt_stride];
                for h in 0..q_heads {
                    let qh = &q[row * stride + h * head_dim..][..head_dim];
                    // The tensor cores take q (scaled) in bf16: so does the reference for them.
                    let want = if kind != DecodeKernel::CudaCore {
                        let qs = r::round_bf16(&qh.iter().map(|v| v * scale).collect::<Vec<_>>());
                        r::attention(&qs, &cache, table, lens[b], h / group, 1.0)
                    } else {
                        r::attention(qh, &cache, table, lens[b], h / group, scale)
                    };
                    wv.extend(want);
                    gv.extend_from_slice(&got[row * out_stride + h * head_dim..][..head_dim]);
                }
            }
            let maxlen = lens.iter().max().unwrap();
            let (label, tol) = match kind {
                DecodeKernel::TensorCore => ("tc", 5e-3),
                DecodeKernel::CudaCore => ("cc", 2e-4),
            };
            let name = format!(
                "decode_attn/{label} d{head_dim} q{q_heads}/kv{kv_heads} batch {batch} ctx<={maxlen} splits {}",
                plan.splits
            );
            rep.check(&name, rel_err(&gv, &wv), tol);
        }
    }
    Ok(())
}

fn check_prefill(g: &Gpu, rep: &mut Report, rng: &mut Rng) -> Result<(), KernelError> {
    // (cached prefix, new rows) per sequence; both kernels (the tensor cores take Q and P in bf16).
    let cases = [
        (vec![(0usize, 37usize), (100, 20), (5, 1), (0, 1)], 9, 3, 64),
        (vec![(0, 70), (33, 9)], 32, 8, 128),
        (vec![(500, 130)], 16, 16, 64),
        (vec![(0, 300), (1000, 77)], 32, 8, 128),
    ];
    let kernels = [
        (launch::PrefillKernel::TensorCore, "tc", 5e-3),
        (launch::PrefillKernel::CudaCore, "cuda-core", 2e-4),
    ];
    for ((seqs, q_heads, kv_heads, head_dim), (kernel, label, tol)) in
        cases.iter().flat_map(|c| kernels.iter().map(move |k| (c.clone(), *k)))
    {
        let block_size = 16;
        let lens: Vec<usize> = seqs.iter().map(|&(c, n)| c + n).collect();
        let p = paged(rng, &lens, kv_heads, head_dim, block_size, 1.0);
        let stride = (q_heads + 2 * kv_heads) * head_dim;
        let total_rows: usize = seqs.iter().map(|s| s.1).sum();
        let q = rng.vec(total_rows * stride, 1.0);
        let group = q_heads / kv_heads;
        let mut ps = Vec::new();
        let mut row = 0;
        for (i, &(cached, n)) in seqs.iter().enumerate() {
            ps.push(launch::PrefillSeq { seq: i, first_row: row, rows: n, first_pos: cached });
            row += n;
        }
        let tiles = launch::prefill_tiles_for(kernel, &ps, group);
        let (qd, kd, vd, td, tl) =
            (g.upload(&q)?, g.upload(&p.k)?, g.upload(&p.v)?, g.upload(&p.tables)?, g.upload(&tiles)?);
        let out_stride = q_heads * head_dim;
        let mut out = g.upload(&vec![f32::NAN; total_rows * out_stride])?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (qv, kv, vv, tv, tlv) = (qd.as_view(), kd.as_view(), vd.as_view(), td.as_view(), tl.as_view());
        let a = PrefillAttention {
            q: &qv,
            q_row_stride: stride,
            k_cache: &kv,
            v_cache: &vv,
            block_tables: &tv,
            bt_stride: p.bt_stride,
            tiles: &tlv,
            n_tiles: tiles.len() / 4,
            q_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
        };
        g.prefill_attention_with(kernel, &a, &mut out.as_view_mut(), out_stride)?;
        let got = g.download(&out.as_view())?;
        let cache = PagedKv { k: &p.k, v: &p.v, kv_heads, head_dim, block_size };
        let mut want = Vec::new();
        for s in &ps {
            let table = &p.tables[s.seq * p.bt_stride..(s.seq + 1) * p.bt_stride];
            for r in 0..s.rows {
                let row = s.first_row + r;
                for h in 0..q_heads {
                    let qh = &q[row * stride + h * head_dim..][..head_dim];
                    want.extend(r::attention(qh, &cache, table, s.first_pos + r + 1, h / group, scale));
                }
            }
        }
        let name = format!("prefill_attn/{label} d{head_dim} q{q_heads}/kv{kv_heads} seqs {seqs:?}");
        rep.check(&name, rel_err(&got, &want), tol);
    }
    Ok(())
}

fn check_sampling(g: &Gpu, rep: &mut Report, rng: &mut Rng) -> Result<(), KernelError> {
    let vocab = 49_152;
    let rows = 64;
    let mut logits = rng.vec(rows * vocab, 8.0);
    // Ties at the maximum in row 0: the lowest id must win.
    let m = logits[..vocab].iter().cloned().fold(f32::MIN, f32::max) + 1.0;
    logits[700] = m;
    logits[90] = m;
    let ld = g.upload(&logits)?;
    // For the greedy picks, also a NaN first in row 1: never picked, left out of the log-sum-exp
    // (the sampling rows below take the logits without it).
    let mut with_nan = logits.clone();
    with_nan[vocab] = f32::NAN;
    let nd = g.upload(&with_nan)?;
    let mut out = g.upload(&vec![-1i32; rows])?;
    g.argmax(&nd.as_view(), rows, vocab, &mut out.as_view_mut())?;
    let got = g.download(&out.as_view())?;
    let want: Vec<i32> = with_nan.chunks(vocab).map(|l| r::argmax(l) as i32).collect();
    rep.exact("argmax_rows 64 x 49152 (lowest id on ties, NaN never)", got == want && got[0] == 90, "");
    let mut lp = g.upload(&vec![f32::NAN; rows])?;
    g.argmax_with_logprobs(&nd.as_view(), rows, vocab, &mut out.as_view_mut(), Some(&mut lp.as_view_mut()))?;
    let want_lp: Vec<f32> = with_nan
        .chunks(vocab)
        .map(|l| {
            let m = l.iter().cloned().fold(f32::MIN, f32::max) as f64;
            (-(l.iter().filter(|x| !x.is_nan()).map(|&x| (x as f64 - m).exp()).sum::<f64>()).ln()) as f32
        })
        .collect();
    let same_ids = g.download(&out.as_view())? == want;
    rep.exact("argmax_rows with log-probabilities: same picks", same_ids, "");
    rep.check(
        "argmax_rows log-probability of the pick",
        rel_err(&g.download(&lp.as_view())?, &want_lp),
        1e-5,
    );

    // Mixed settings, one row each; compare with the exact reference draw.
    let temps: Vec<f32> = (0..rows).map(|i| [0.0, 0.7, 1.0, 1.3][i % 4]).collect();
    let top_k: Vec<i32> = (0..rows).map(|i| [0, 1, 50, 1000][(i / 4) % 4]).collect();
    let top_p: Vec<f32> = (0..rows).map(|i| [1.0, 0.9, 0.5, 0.99][(i / 16) % 4]).collect();
    let seeds: Vec<u64> = (0..rows as u64).map(|i| i * 7919 + 1).collect();
    let steps: Vec<u64> = (0..rows as u64).map(|i| i % 5).collect();
    let (td, kd, pd, sd, std_) =
        (g.upload(&temps)?, g.upload(&top_k)?, g.upload(&top_p)?, g.upload(&seeds)?, g.upload(&steps)?);
    let (tv, kv, pv, sv, stv) = (td.as_view(), kd.as_view(), pd.as_view(), sd.as_view(), std_.as_view());
    let params = SampleParams { temperature: &tv, top_k: &kv, top_p: &pv, seed: &sv, step: &stv };
    g.sample(&ld.as_view(), rows, vocab, &params, &mut out.as_view_mut())?;
    let got = g.download(&out.as_view())?;
    let again = {
        g.sample(&ld.as_view(), rows, vocab, &params, &mut out.as_view_mut())?;
        g.download(&out.as_view())?
    };
    let (mut inside, mut same) = (0, 0);
    for i in 0..rows {
        let l = &logits[i * vocab..(i + 1) * vocab];
        let want = if temps[i] <= 0.0 {
            r::argmax(l)
        } else {
            let a = r::allowed(l, temps[i], top_k[i] as usize, top_p[i]);
            if a.iter().any(|x| x.0 == got[i] as usize) {
                inside += 1;
            }
            r::draw(&a, r::uniform(seeds[i], steps[i]))
        };
        if temps[i] <= 0.0 {
            inside += (got[i] as usize == want) as usize;
        }
        same += (got[i] as usize == want) as usize;
    }
    rep.exact(
        "sample_rows: every draw inside its top-k/top-p set",
        inside == rows,
        &format!("{inside}/{rows}"),
    );
    rep.exact("sample_rows: same draw as the reference", same + 1 >= rows, &format!("{same}/{rows}"));
    rep.exact("sample_rows: same seed and step, same tokens", got == again, "");

    // Distribution: 8 tokens, 8192 rows with different seeds.
    let probe = [2.0f32, 1.0, 0.5, 0.0, -1.0, 1.0, 3.0, -5.0];
    let n = 8192;
    let l: Vec<f32> = (0..n).flat_map(|_| probe).collect();
    let ld = g.upload(&l)?;
    let (td, kd, pd) = (g.upload(&vec![0.8f32; n])?, g.upload(&vec![0i32; n])?, g.upload(&vec![1.0f32; n])?);
    let (sd, std_) = (g.upload(&(0..n as u64).collect::<Vec<_>>())?, g.upload(&vec![3u64; n])?);
    let (tv, kv, pv, sv, stv) = (td.as_view(), kd.as_view(), pd.as_view(), sd.as_view(), std_.as_view());
    let mut out = g.upload(&vec![-1i32; n])?;
    g.sample(
        &ld.as_view(),
        n,
        8,
        &SampleParams { temperature: &tv, top_k: &kv, top_p: &pv, seed: &sv, step: &stv },
        &mut out.as_view_mut(),
    )?;
    let got = g.download(&out.as_view())?;
    let probs = r::allowed(&probe, 0.8, 0, 1.0);
    let mut worst: f64 = 0.0;
    for (id, p) in probs {
        let f = got.iter().filter(|&&t| t as usize == id).count() as f64 / n as f64;
        worst = worst.max((f - p).abs());
    }
    rep.check("sample_rows: frequencies over 8192 seeds vs probabilities", worst, 0.02);
    Ok(())
}

type CheckFn<'a> = dyn Fn(&Gpu, &mut Report, &mut Rng) -> Result<(), KernelError> + 'a;

/// Runs every check on GPU 0 and prints one line per check; `--quick` skips the 131,072-token
/// contexts. Returns whether all passed (false, with a message, when there is no GPU).
pub fn run(args: &[String]) -> bool {
    let quick = args.iter().any(|a| a == "--quick");
    let g = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: the GPU checks need an NVIDIA GPU: {e}");
            return false;
        }
    };
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.num_sms());
    let seed = std::env::var("PDSERVE_CHECK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("seed: {seed} (PDSERVE_CHECK_SEED to repeat)");
    let mut rng = Rng::new(seed);
    let mut rep = Report { failures: 0 };
    let steps: [(&str, &CheckFn<'_>); 5] = [
        ("row kernels", &check_rows),
        ("gemm", &check_gemm),
        ("decode attention", &|g, rep, rng| check_decode(g, rep, rng, quick)),
        ("prefill attention", &check_prefill),
        ("sampling", &check_sampling),
    ];
    for (name, f) in steps {
        if let Err(e) = f(&g, &mut rep, &mut rng).and_then(|()| g.synchronize()) {
            println!("{name}: error: {e}");
            rep.failures += 1;
        }
    }
    println!("{} failure(s)", rep.failures);
    rep.failures == 0
}
