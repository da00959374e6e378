//! NVRTC: CUDA C++ to cubin for a named architecture, with ptxas's resource report per kernel.
//! Needs only `libnvrtc` (found through the loader's search path), not a GPU or a driver.

use crate::sources::Source;
use crate::{sys, KernelError};

/// Architectures every build is checked for.
pub const CHECKED_ARCHS: [&str; 3] = ["sm_90", "sm_120", "sm_120a"];

/// Options every compile uses: full-precision math (RoPE angles and softmax need it), line info for
/// profilers, ptxas's resource report.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--generate-line-info".into(),
        "--ptxas-options=-v".into(),
    ]
}

/// Resources of one kernel as ptxas reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelStats {
    pub kernel: String,
    pub registers: u32,
    pub smem_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// A compiled source: the cubin and the per-kernel report.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub stats: Vec<KernelStats>,
    pub log: String,
}

/// Compiles `src` to a cubin for `arch` (e.g. "sm_120a").
pub fn compile(src: &Source, arch: &str) -> Result<Compiled, KernelError> {
    if !sys::nvrtc_present() {
        return Err(KernelError::NoDevice(
            "libnvrtc not found on the library search path (LD_LIBRARY_PATH); `cargo xtask check-kernels` \
             fetches it from PyPI (nvidia-cuda-nvrtc-cu12)"
                .into(),
        ));
    }
    let (cubin, log) = sys::nvrtc_cubin(&src.full_text(), src.file, &options(arch))
        .map_err(|log| KernelError::Compile { source: src.file.into(), arch: arch.into(), log })?;
    let stats = parse_ptxas_log(&log);
    Ok(Compiled { cubin, stats, log })
}

/// The NVRTC version, e.g. (12, 9).
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    if !sys::nvrtc_present() {
        return Err(KernelError::NoDevice("libnvrtc not found".into()));
    }
    sys::nvrtc_version().map_err(KernelError::Cuda)
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let i = line.find(unit)?;
    line[..i].split_whitespace().last()?.parse().ok()
}

/// Reads ptxas's `-v` report: one entry per "Compiling entry function", filled from the lines that
/// follow it ("N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers,
/// ... N bytes smem").
pub fn parse_ptxas_log(log: &str) -> Vec<KernelStats> {
    let mut out: Vec<KernelStats> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelStats { kernel: name, ..Default::default() });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.smem_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'decode_attn_d64' for 'sm_120a'
ptxas info    : Function properties for decode_attn_d64
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers, 10336 bytes smem
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, 400 bytes cmem[0]
ptxas info    : Compile time = 2.358 ms
";

    #[test]
    fn ptxas_report_is_read_per_kernel() {
        let s = parse_ptxas_log(LOG);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s[0],
            KernelStats {
                kernel: "decode_attn_d64".into(),
                registers: 90,
                smem_bytes: 10336,
                stack_bytes: 0,
                spill_stores: 0,
                spill_loads: 0
            }
        );
        assert_eq!((s[1].registers, s[1].smem_bytes, s[1].stack_bytes), (255, 0, 16));
        assert_eq!((s[1].spill_stores, s[1].spill_loads), (8, 4));
    }

    #[test]
    fn empty_or_foreign_logs_give_nothing() {
        assert!(parse_ptxas_log("").is_empty());
        assert!(parse_ptxas_log("Used 3 registers\nwarning: something").is_empty());
    }
}
