//! The GPU benchmark (`pdserve-kernels bench`, `cargo xtask bench-gpu`, `cargo bench`): achieved memory bandwidth of decode attention and RMSNorm, as a fraction
//! of the device's copy bandwidth measured in the same run (a device-to-device copy, bytes read +
//! written). Timed with device events, median of 5 runs of 20 launches each.

use crate::checks::{DecodeCase, HostDecode, Rng};
use crate::{DecodeKernel, DecodeOptions, DecodeScratch, Gpu, KernelError};

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn timed(g: &Gpu, mut f: impl FnMut() -> Result<(), KernelError>) -> Result<f32, KernelError> {
    let mut runs = Vec::new();
    for _ in 0..5 {
        runs.push(g.time_ms(20, &mut f)?);
    }
    Ok(median(runs))
}

fn copy_bandwidth(g: &Gpu) -> Result<f64, KernelError> {
    let n = 512 << 20; // 1 GiB of u16 each way
    let a = g.zeros::<u16>(n)?;
    let mut b = g.zeros::<u16>(n)?;
    let ms = timed(g, || g.copy(&a.as_view(), &mut b.as_view_mut()))?;
    Ok(2.0 * 2.0 * n as f64 / (ms as f64 * 1e-3))
}

fn bench(g: &Gpu, sweep_splits: bool) -> Result<(), KernelError> {
    let peak = copy_bandwidth(g)?;
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.num_sms());
    println!("copy bandwidth (read + write): {:.0} GB/s  <- the peak below", peak / 1e9);
    println!("{:<48} {:>9} {:>10} {:>8} {:>7}", "case", "ms", "GB/s", "of peak", "splits");
    let mut rng = Rng::new(42);
    let block_size = 16;
    for (q_heads, kv_heads, head_dim, label) in [(32, 8, 128, "Llama-8B shape"), (9, 3, 64, "SmolLM2 shape")]
    {
        // One sequence (a single stream's step), 64 short ones, then batch 32 at long contexts.
        for (batch, ctx) in [
            (1usize, 512usize),
            (1, 4096),
            (64, 512),
            (64, 1024),
            (32, 4096),
            (32, 8192),
            (32, 16_384),
            (32, 32_768),
        ] {
            let blocks_per_seq = ctx / block_size;
            let num_slots = batch * ctx;
            let kv_dim = kv_heads * head_dim;
            // Random bf16 in the cache (not zeros: zeros can run faster than real data).
            let words = num_slots * kv_dim;
            let pattern = rng.bf16(1 << 20, 1.0);
            let fill: Vec<u16> =
                (0..words).map(|i| pattern[i & ((1 << 20) - 1)] ^ (i as u16 & 0x7)).collect();
            let mut order: Vec<i32> = (0..(batch * blocks_per_seq) as i32).collect();
            rng.shuffle(&mut order);
            let stride = (q_heads + 2 * kv_heads) * head_dim;
            let rows: Vec<i32> = (0..batch as i32).collect();
            let case = DecodeCase::upload(
                g,
                HostDecode {
                    q: &rng.vec(batch * stride, 1.0),
                    rows: &rows,
                    k: &fill,
                    v: &fill,
                    tables: &order,
                    lens: &vec![ctx as i32; batch],
                },
                (q_heads, kv_heads, head_dim, block_size, blocks_per_seq),
            )?;
            drop(fill);
            let mut out = g.zeros::<f32>(batch * q_heads * head_dim)?;
            let auto =
                g.decode_plan(DecodeKernel::TensorCore, batch, q_heads, kv_heads, head_dim, ctx).splits;
            let mut variants = vec![
                ("tc".to_string(), DecodeOptions::kernel(DecodeKernel::TensorCore)),
                ("cc".to_string(), DecodeOptions::kernel(DecodeKernel::CudaCore)),
            ];
            if sweep_splits {
                for k in [2, 4] {
                    let n = auto * k;
                    variants.push((
                        format!("tc s={n}"),
                        DecodeOptions { kernel: DecodeKernel::TensorCore, splits: Some(n) },
                    ));
                }
            }
            for (kname, opts) in variants {
                let mut scratch = DecodeScratch::default();
                let mut splits = 0;
                let ms = timed(g, || {
                    let stride = q_heads * head_dim;
                    splits = case
                        .with_args(|a| {
                            g.decode_attention_with(opts, a, &mut scratch, &mut out.as_view_mut(), stride)
                        })?
                        .splits;
                    Ok(())
                })?;
                let bytes = (2 * batch * ctx * kv_dim * 2) as f64;
                let bw = bytes / (ms as f64 * 1e-3);
                println!(
                    "{:<48} {:>9.4} {:>10.0} {:>8.2} {:>7}",
                    format!("decode_attn/{kname} {label} batch {batch} ctx {ctx}"),
                    ms,
                    bw / 1e9,
                    bw / peak,
                    splits
                );
            }
        }
    }
    prefill(g, &mut rng)?;
    small_kernels(g, &mut rng)?;
    for (rows, dim, with_add) in
        [(16_384usize, 4096usize, true), (16_384, 4096, false), (65_536, 576, true), (1, 4096, true)]
    {
        let mut x = g.upload(&rng.vec(rows * dim, 1.0))?;
        let add = g.upload(&rng.vec(rows * dim, 1.0))?;
        let w = g.upload(&rng.bf16(dim, 1.0))?;
        let mut out = g.zeros::<u16>(rows * dim)?;
        let av = add.as_view();
        let ms = timed(g, || {
            g.rmsnorm_residual(
                &mut x.as_view_mut(),
                with_add.then_some(&av),
                &w.as_view(),
                &mut out.as_view_mut(),
                rows,
                dim,
                1e-5,
            )
        })?;
        // x read (+ add read + x written) + bf16 out written.
        let per = if with_add { 4 + 4 + 4 + 2 } else { 4 + 2 };
        let bw = (rows * dim * per) as f64 / (ms as f64 * 1e-3);
        println!(
            "{:<48} {:>9.4} {:>10.0} {:>8.2} {:>7}",
            format!("rmsnorm rows {rows} dim {dim} add={with_add}"),
            ms,
            bw / 1e9,
            bw / peak,
            "-"
        );
    }
    Ok(())
}

/// The per-layer row-wise kernels of a decode step (8B shape) at 1 and 64 rows: what each costs
/// beside the products and the attention.
fn small_kernels(g: &Gpu, rng: &mut Rng) -> Result<(), KernelError> {
    let (h, nq, nkv, hd, inter) = (4096usize, 32usize, 8usize, 128usize, 14_336usize);
    let qkv_w = (nq + 2 * nkv) * hd;
    for t in [1usize, 64] {
        let mut x = g.upload(&rng.vec(t * h, 1.0))?;
        let add = g.upload(&rng.vec(t * h, 1.0))?;
        let w = g.upload(&rng.bf16(h, 1.0))?;
        let mut hb = g.zeros::<u16>(t * h)?;
        let mut qkv = g.upload(&rng.vec(t * qkv_w, 1.0))?;
        let pos = g.upload(&(0..t as i32).collect::<Vec<_>>())?;
        let inv = g.upload(&crate::reference::inv_freq(500_000.0, hd))?;
        let slots = g.upload(&(0..t as i64).collect::<Vec<_>>())?;
        let (mut kc, mut vc) = (g.zeros::<u16>(t * nkv * hd)?, g.zeros::<u16>(t * nkv * hd)?);
        let gu = g.upload(&rng.vec(t * 2 * inter, 1.0))?;
        let mut act = g.zeros::<u16>(t * inter)?;
        let attn = g.upload(&rng.vec(t * nq * hd, 1.0))?;
        let mut attn_bf = g.zeros::<u16>(t * nq * hd)?;
        let av = add.as_view();
        let line = |name: &str, ms: f32| {
            println!(
                "{:<48} {:>9.4} {:>10} {:>8} {:>7}",
                format!("{name} 8B shape, {t} rows"),
                ms,
                "-",
                "-",
                "-"
            )
        };
        let ms = timed(g, || {
            g.rmsnorm_residual(
                &mut x.as_view_mut(),
                Some(&av),
                &w.as_view(),
                &mut hb.as_view_mut(),
                t,
                h,
                1e-5,
            )
        })?;
        line("rmsnorm_residual", ms);
        let ms = timed(g, || {
            g.rope_qk(&mut qkv.as_view_mut(), &pos.as_view(), &inv.as_view(), qkv_w, nq + nkv, hd, 1.0)
        })?;
        line("rope_qk", ms);
        let offsets = (nq * hd, (nq + nkv) * hd, nkv * hd);
        let ms = timed(g, || {
            let (k, v) = (&mut kc.as_view_mut(), &mut vc.as_view_mut());
            g.kv_write(&qkv.as_view(), qkv_w, offsets, &slots.as_view(), k, v, t)
        })?;
        line("kv_write", ms);
        let ms = timed(g, || g.cast_bf16(&attn.as_view(), &mut attn_bf.as_view_mut(), t * nq * hd))?;
        line("cast_bf16", ms);
        let ms = timed(g, || g.swiglu(&gu.as_view(), &mut act.as_view_mut(), t, inter))?;
        line("swiglu", ms);
    }
    Ok(())
}

/// Prefill attention of one 2,048-token prompt (no cached prefix), both kernels: causal FLOP rate.
fn prefill(g: &Gpu, rng: &mut Rng) -> Result<(), KernelError> {
    use crate::launch::{prefill_tiles_for, PrefillKernel, PrefillSeq};
    use crate::PrefillAttention;
    let (len, block_size) = (2048usize, 16usize);
    for (q_heads, kv_heads, head_dim, label) in [(32, 8, 128, "Llama-8B shape"), (9, 3, 64, "SmolLM2 shape")]
    {
        let p = crate::checks::paged(rng, &[len], kv_heads, head_dim, block_size, 1.0);
        let stride = (q_heads + 2 * kv_heads) * head_dim;
        let (qd, kd, vd, td) =
            (g.upload(&rng.vec(len * stride, 1.0))?, g.upload(&p.k)?, g.upload(&p.v)?, g.upload(&p.tables)?);
        let mut out = g.zeros::<f32>(len * q_heads * head_dim)?;
        let seqs = [PrefillSeq { seq: 0, first_row: 0, rows: len, first_pos: 0 }];
        for (kernel, name) in [(PrefillKernel::TensorCore, "tc"), (PrefillKernel::CudaCore, "cc")] {
            let tiles = prefill_tiles_for(kernel, &seqs, q_heads / kv_heads);
            let tl = g.upload(&tiles)?;
            let (qv, kv, vv, tv, tlv) =
                (qd.as_view(), kd.as_view(), vd.as_view(), td.as_view(), tl.as_view());
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
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let ms = timed(g, || {
                g.prefill_attention_with(kernel, &a, &mut out.as_view_mut(), q_heads * head_dim)
            })?;
            // QK^T and PV over the causal half: 2 x 2 x len^2 / 2 x head_dim per query head.
            let flops = 2.0 * (len * len) as f64 * head_dim as f64 * q_heads as f64;
            println!(
                "{:<48} {:>9.4} {:>10} {:>8} {:>7}",
                format!("prefill_attn/{name} {label} {len} tokens"),
                ms,
                format!("{:.1} TF/s", flops / (ms as f64 * 1e-3) / 1e12),
                "-",
                "-"
            );
        }
    }
    Ok(())
}

/// Runs the benchmark on GPU 0 and prints a table (`--sweep-splits`: the tensor-core kernel also at 2x
/// and 4x the derived split count). Returns false (with a message) without a GPU.
pub fn run(args: &[String]) -> bool {
    let sweep_splits = args.iter().any(|a| a == "--sweep-splits");
    let g = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: the GPU benchmark needs an NVIDIA GPU: {e}");
            return false;
        }
    };
    match bench(&g, sweep_splits) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("error: {e}");
            false
        }
    }
}
