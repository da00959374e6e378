//! `pdserve-kernels`: the crate's checks as a program.
//!
//! - `compile [ARCH...]`: NVRTC-compiles every kernel for sm_90, sm_120 and sm_120a (or the given
//!   architectures) and prints registers, shared memory, stack and spills per kernel. Fails on a
//!   compile error, a spill, or shared memory that differs from the launch module's budget. Needs
//!   only libnvrtc, no GPU.
//! - `check`: every kernel on the GPU against its CPU reference (random inputs, odd sizes, 1-token
//!   and 131,072-token contexts). Fails with a clear message when there is no GPU.
//! - `bench`: achieved memory bandwidth of decode attention and RMSNorm.

use std::process::ExitCode;

use pdserve_kernels_sm120::compile::{self, CHECKED_ARCHS};
use pdserve_kernels_sm120::{bench, checks, launch, sources};

/// The shared memory launch.rs expects of an attention kernel, from its name.
fn smem_budget(kernel: &str) -> Option<usize> {
    if kernel.starts_with("decode_attn_tc_d") {
        return Some(launch::DECODE_TC_STATIC_SMEM);
    }
    if let Some(rest) = kernel.strip_prefix("decode_attn_d") {
        let (d, g) = rest.split_once("_g")?;
        return Some(launch::decode_smem_bytes(d.parse().ok()?, g.parse().ok()?));
    }
    if let Some(d) = kernel.strip_prefix("prefill_attn_tc_d") {
        return Some(launch::prefill_tc_smem_bytes(d.parse().ok()?));
    }
    let d = kernel.strip_prefix("prefill_attn_d")?;
    Some(launch::prefill_smem_bytes(d.parse().ok()?))
}

fn compile_all(archs: &[String]) -> bool {
    match compile::nvrtc_version() {
        Ok((a, b)) => println!("NVRTC {a}.{b}"),
        Err(e) => {
            eprintln!("error: {e}");
            return false;
        }
    }
    let mut ok = true;
    println!(
        "{:<8} {:<16} {:<20} {:>5} {:>10} {:>7} {:>7} {:>7}",
        "arch", "file", "kernel", "regs", "smem B", "stack", "spill-s", "spill-l"
    );
    for arch in archs {
        for src in sources::ALL {
            match compile::compile(&src, arch) {
                Ok(c) => {
                    for k in src.kernels {
                        if !c.stats.iter().any(|s| s.kernel == *k) {
                            eprintln!(
                                "error: {arch} {}: kernel {k} is missing from ptxas's report",
                                src.file
                            );
                            ok = false;
                        }
                    }
                    for s in &c.stats {
                        let mut notes = Vec::new();
                        if s.spill_stores > 0 || s.spill_loads > 0 {
                            notes.push("SPILLS".to_string());
                            ok = false;
                        }
                        let budget = smem_budget(&s.kernel);
                        if let Some(b) = budget {
                            if b != s.smem_bytes as usize {
                                notes.push(format!("smem differs from launch.rs budget {b}"));
                                ok = false;
                            }
                        }
                        println!(
                            "{:<8} {:<16} {:<20} {:>5} {:>10} {:>7} {:>7} {:>7} {}",
                            arch,
                            src.file,
                            s.kernel,
                            s.registers,
                            s.smem_bytes,
                            s.stack_bytes,
                            s.spill_stores,
                            s.spill_loads,
                            notes.join("; ")
                        );
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ok = false;
                }
            }
        }
    }
    ok
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ok = match args.first().map(String::as_str) {
        Some("compile") => {
            let archs: Vec<String> = if args.len() > 1 {
                args[1..].to_vec()
            } else {
                CHECKED_ARCHS.iter().map(|s| s.to_string()).collect()
            };
            compile_all(&archs)
        }
        Some("check") => checks::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        _ => {
            eprintln!("usage: pdserve-kernels compile [ARCH...] | check [--quick] | bench");
            false
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
