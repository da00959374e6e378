//! The machine's peaks, on 1 thread and on every thread: f32 FMA throughput (AVX-512 and AVX2, where
//! the CPU has them, chosen at run time), bf16 dot throughput (AVX-512 BF16 `vdpbf16ps`) and AMX tile throughput (`tdpbf16ps`), the rate at
//! which a buffer far larger than the caches is read with the widest loads, and memcpy (bytes copied
//! per second; the memory traffic is twice that, three times with write-allocate). Each figure is the
//! best of a few trials of about `--ms` each. The kernels are `pdserve_model::peak` (its `sys` module).
//!
//! Run: `cargo xtask bench peak` (= `cargo bench -p pdserve-model --bench peak --
//! [--ms 300] [--trials 5] [--mib 1024] [--threads N]`). Writes `target/bench/peak.json`.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use pdserve_model::{peak, CpuKernels};

struct Options {
    ms: u64,
    trials: u32,
    mib: usize,
    threads: usize,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str| args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse::<u64>().ok());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Options {
        ms: get("--ms").unwrap_or(300).max(10),
        trials: get("--trials").unwrap_or(5).max(1) as u32,
        mib: get("--mib").unwrap_or(1024).max(64) as usize,
        threads: get("--threads").map_or(cores, |t| t.max(1) as usize),
    }
}

/// Runs `work(thread index)` on `threads` threads started together; the work done by all of them
/// (each returns its own count) and the wall time from the first start to the last finish.
fn on_threads(threads: usize, work: &(dyn Fn(usize) -> u64 + Sync)) -> (u64, Duration) {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let done = work(i);
                    (start, Instant::now(), done)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a benchmark thread panicked")).collect()
    });
    let first = spans.iter().map(|s| s.0).min().expect("one thread at least");
    let last = spans.iter().map(|s| s.1).max().expect("one thread at least");
    (spans.iter().map(|s| s.2).sum(), last - first)
}

/// The best rate (work per second, over `trials` trials) of a kernel whose work grows with `n`: `n`
/// is first grown until one call on one thread takes about `ms`.
fn best_rate(o: &Options, threads: usize, work: &(dyn Fn(usize, u64) -> u64 + Sync)) -> f64 {
    let mut n = 1u64;
    loop {
        let t = Instant::now();
        work(0, n);
        let took = t.elapsed();
        if took >= Duration::from_millis(o.ms / 4) {
            n = (n as f64 * o.ms as f64 / (took.as_secs_f64() * 1e3)).ceil() as u64;
            break;
        }
        n *= 4;
    }
    (0..o.trials)
        .map(|_| {
            let (done, wall) = on_threads(threads, &|i| work(i, n));
            done as f64 / wall.as_secs_f64()
        })
        .fold(0.0, f64::max)
}

struct Row {
    threads: usize,
    fma_avx512_gflops: Option<f64>,
    fma_avx2_gflops: Option<f64>,
    dot_bf16_gflops: Option<f64>,
    tile_bf16_gflops: Option<f64>,
    read_gbps: f64,
    read_kernels: &'static str,
    memcpy_gbps: f64,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let o = options();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    println!("{cpu}; {} threads; best of {} trials of ~{} ms", o.threads, o.trials, o.ms);

    // The buffers are touched (written) before any timing, so page faults stay out of the figures.
    let bytes = o.mib << 20;
    let read_buf: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let src: Vec<u8> = (0..bytes / 2).map(|i| (i % 241) as u8).collect();
    let mut dst = vec![1u8; bytes / 2];
    let read_kernels = [CpuKernels::Avx512, CpuKernels::Avx2, CpuKernels::Portable]
        .into_iter()
        .find(|&k| peak::read(k, &read_buf[..64]).is_some())
        .unwrap_or(CpuKernels::Portable);

    let mut counts = vec![1];
    if o.threads > 1 {
        counts.push(o.threads);
    }
    let mut rows = Vec::new();
    for &threads in &counts {
        let fma = |k: CpuKernels| {
            peak::fma_f32(k, 1)
                .map(|_| best_rate(&o, threads, &|_, n| peak::fma_f32(k, n).expect("checked above")) / 1e9)
        };
        let dot_bf16_gflops = peak::dot_bf16(1)
            .map(|_| best_rate(&o, threads, &|_, n| peak::dot_bf16(n).expect("checked above")) / 1e9);
        let tile_bf16_gflops = peak::tile_bf16(1)
            .map(|_| best_rate(&o, threads, &|_, n| peak::tile_bf16(n).expect("checked above")) / 1e9);
        // Each thread reads its own share of the buffer, `n` times over.
        let share = read_buf.len() / threads;
        let read_gbps = best_rate(&o, threads, &|i, n| {
            let part = &read_buf[i * share..(i + 1) * share];
            let mut fold = 0u64;
            for _ in 0..n {
                fold ^= peak::read(read_kernels, part).expect("checked above");
            }
            std::hint::black_box(fold);
            n * part.len() as u64
        }) / 1e9;
        // memcpy: each thread copies its own share of `src` into its share of `dst`, `n` times over.
        let copy_share = src.len() / threads;
        let dst_parts: Vec<std::sync::Mutex<&mut [u8]>> =
            dst.chunks_mut(copy_share).take(threads).map(std::sync::Mutex::new).collect();
        let memcpy_gbps = best_rate(&o, threads, &|i, n| {
            let mut out = dst_parts[i].lock().expect("one thread per share");
            let from = &src[i * copy_share..(i + 1) * copy_share];
            for _ in 0..n {
                out.copy_from_slice(std::hint::black_box(from));
                std::hint::black_box(&mut *out);
            }
            n * from.len() as u64
        }) / 1e9;
        drop(dst_parts);
        rows.push(Row {
            threads,
            fma_avx512_gflops: fma(CpuKernels::Avx512),
            fma_avx2_gflops: fma(CpuKernels::Avx2),
            dot_bf16_gflops,
            tile_bf16_gflops,
            read_gbps,
            read_kernels: read_kernels.name(),
            memcpy_gbps,
        });
    }

    let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    println!(
        "{:>7} {:>22} {:>20} {:>23} {:>21} {:>20} {:>13}",
        "threads",
        "FMA f32 avx512 GFLOP/s",
        "FMA f32 avx2 GFLOP/s",
        "dot bf16 avx512 GFLOP/s",
        "tile bf16 amx GFLOP/s",
        format!("read {} GB/s", read_kernels.name()),
        "memcpy GB/s"
    );
    for r in &rows {
        println!(
            "{:>7} {:>22} {:>20} {:>23} {:>21} {:>20.1} {:>13.1}",
            r.threads,
            cell(r.fma_avx512_gflops),
            cell(r.fma_avx2_gflops),
            cell(r.dot_bf16_gflops),
            cell(r.tile_bf16_gflops),
            r.read_gbps,
            r.memcpy_gbps
        );
    }

    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "threads": r.threads,
                "fma_f32_avx512_gflops": r.fma_avx512_gflops,
                "fma_f32_avx2_gflops": r.fma_avx2_gflops,
                "dot_bf16_avx512_gflops": r.dot_bf16_gflops,
                "tile_bf16_amx_gflops": r.tile_bf16_gflops,
                "read_gb_per_s": r.read_gbps,
                "read_kernels": r.read_kernels,
                "memcpy_gb_per_s": r.memcpy_gbps,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "cpu": cpu, "trials": o.trials, "ms": o.ms, "buffer_mib": o.mib, "rows": json,
    });
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&out);
    let _ = std::fs::write(out.join("peak.json"), serde_json::to_string_pretty(&doc).unwrap_or_default());
}
