//! Which vector kernels the CPU code runs: the best this CPU has, or a lower one chosen by the
//! process (`PDSERVE_CPU_KERNELS=amx|avx512|avx2|portable`, or `set_cpu_kernels` before the first step),
//! so every path can be run and tested on a machine that has them all. Never more than the CPU has:
//! each kernel's safety rests on that.

use std::sync::OnceLock;

/// A family of kernels, ordered: each machine runs the highest it has unless told lower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuKernels {
    /// Plain loops (what the compiler makes of them for the baseline target).
    Portable,
    /// AVX2 with FMA and F16C: most x86-64 CPUs since 2013 (Haswell, Zen).
    Avx2,
    /// AVX-512F (and AVX-512 BF16 where the CPU has it, for the bf16 GEMM), with AVX2, FMA and F16C.
    Avx512,
    /// The AVX-512 family with AVX-512 BF16 and AMX tiles (AMX-TILE, AMX-BF16: Sapphire Rapids and
    /// later, where Linux grants the tile state): the bf16 GEMM on tiles (`amx.rs`).
    Amx,
}

impl CpuKernels {
    pub const NAMES: &'static str = "amx, avx512, avx2 or portable";

    /// Every family, lowest first.
    const ALL: [CpuKernels; 4] =
        [CpuKernels::Portable, CpuKernels::Avx2, CpuKernels::Avx512, CpuKernels::Amx];

    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Portable => "portable",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Avx512 => "avx512",
            CpuKernels::Amx => "amx",
        }
    }

    pub fn parse(name: &str) -> Option<CpuKernels> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The best this CPU has (detected once: every kernel call checks its family against it).
    pub fn detected() -> CpuKernels {
        static DETECTED: OnceLock<CpuKernels> = OnceLock::new();
        *DETECTED.get_or_init(Self::detect)
    }

    fn detect() -> CpuKernels {
        #[cfg(target_arch = "x86_64")]
        {
            // The AVX-512 family also runs AVX2 kernels (and every real AVX-512 CPU has AVX2, FMA and
            // F16C; a virtual CPU may claim less, and then gets a lower family).
            let avx2 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c");
            if avx2 && std::is_x86_feature_detected!("avx512f") {
                // AMX only with AVX-512 BF16 (the GEMM's tail of k runs on it) and the tile state
                // granted (asked here, once, before any tile instruction can run).
                if std::is_x86_feature_detected!("avx512bf16") && super::amx::request_tiles() {
                    return CpuKernels::Amx;
                }
                return CpuKernels::Avx512;
            }
            if avx2 {
                return CpuKernels::Avx2;
            }
        }
        CpuKernels::Portable
    }

    /// Every family this CPU can run, lowest first.
    pub fn available() -> Vec<CpuKernels> {
        Self::ALL.into_iter().filter(|&k| k <= CpuKernels::detected()).collect()
    }
}

static CHOSEN: OnceLock<CpuKernels> = OnceLock::new();

/// The kernels this process runs (fixed at the first call).
pub fn cpu_kernels() -> CpuKernels {
    *CHOSEN.get_or_init(|| {
        let asked = std::env::var("PDSERVE_CPU_KERNELS").ok().and_then(|v| CpuKernels::parse(&v));
        asked.map_or(CpuKernels::detected(), |k| k.min(CpuKernels::detected()))
    })
}

/// Chooses the kernels this process runs; an error if the CPU lacks them or another choice was
/// made (or a kernel already ran).
pub fn set_cpu_kernels(k: CpuKernels) -> Result<(), String> {
    if k > CpuKernels::detected() {
        return Err(format!(
            "this CPU has no {} kernels (it has {})",
            k.name(),
            CpuKernels::detected().name()
        ));
    }
    let _ = CHOSEN.set(k);
    match cpu_kernels() {
        got if got == k => Ok(()),
        got => Err(format!("the CPU kernels were already chosen: {}", got.name())),
    }
}

/// Whether the AVX-512 kernels run: only where the CPU has AVX-512F (the choice never exceeds it).
pub(crate) fn avx512() -> bool {
    cpu_kernels() >= CpuKernels::Avx512
}

/// Whether the bf16 GEMM runs on AMX tiles: only where the CPU has them and Linux granted the state.
pub(crate) fn amx() -> bool {
    cpu_kernels() >= CpuKernels::Amx
}

/// Whether the AVX2 kernels (or better) run: only where the CPU has AVX2, FMA and F16C.
pub(crate) fn avx2() -> bool {
    cpu_kernels() >= CpuKernels::Avx2
}

#[cfg(test)]
mod tests {
    use super::CpuKernels;

    /// On a CPU whose family is known to the caller (`cargo xtask test` runs the kernel tests under
    /// `qemu-x86_64 -cpu Haswell`, an AVX2 CPU without AVX-512, with
    /// `PDSERVE_EXPECT_CPU_KERNELS=avx2`), the dispatcher picks that family, so the other tests there
    /// ran its kernels.
    #[test]
    fn the_dispatcher_picks_the_cpus_family() {
        if let Ok(want) = std::env::var("PDSERVE_EXPECT_CPU_KERNELS") {
            assert_eq!(CpuKernels::detected().name(), want);
            assert_eq!(super::cpu_kernels().name(), want);
        }
    }
}
