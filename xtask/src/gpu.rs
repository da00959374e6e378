//! The GPU checks of crates/kernels-sm120: `check-kernels` (NVRTC only, runs anywhere and in CI),
//! `test-gpu` and `bench-gpu` (need an NVIDIA GPU; without one they fail with a clear message).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{cargo, run};

/// The NVRTC wheel `check-kernels` fetches when the machine has no libnvrtc (12.8 or newer compiles
/// for sm_120 and sm_120a).
const NVRTC_PACKAGE: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";

/// `~/.cache/pdserve/nvrtc/<version>` (outside `target/`, so `cargo clean` keeps it).
fn nvrtc_dir() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| std::env::temp_dir().join("pdserve-cache"));
    cache.join("pdserve").join("nvrtc").join(NVRTC_PACKAGE.rsplit('=').next().unwrap_or("any"))
}

/// A folder holding libnvrtc.so.12, fetched from PyPI into the cache on first use.
fn ensure_nvrtc() -> Result<PathBuf> {
    let dir = nvrtc_dir();
    let lib = dir.join("nvidia/cuda_nvrtc/lib");
    if lib.join("libnvrtc.so.12").is_file() {
        return Ok(lib);
    }
    let work = dir.with_extension(format!("fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"])
        .args(["--timeout", "60", "--retries", "3", "--only-binary=:all:"])
        .args(["--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"])
        .args(["--platform", "manylinux_2_12_x86_64", "-d"])
        .arg(&work)
        .arg(NVRTC_PACKAGE))
    .context("fetching NVRTC from PyPI")?;
    let wheel = std::fs::read_dir(&work)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip left no wheel")?;
    let unpacked = work.join("unpacked");
    run(Command::new(&python).args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&unpacked))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.parent().context("cache path")?)?;
    std::fs::rename(&unpacked, &dir)?;
    let _ = std::fs::remove_dir_all(&work);
    if !lib.join("libnvrtc.so.12").is_file() {
        bail!("the NVRTC wheel holds no nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
    }
    Ok(lib)
}

fn with_lib_path(cmd: &mut Command, lib: &std::path::Path) {
    let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let path = if old.is_empty() { lib.display().to_string() } else { format!("{}:{old}", lib.display()) };
    cmd.env("LD_LIBRARY_PATH", path);
}

/// `cargo xtask check-kernels [ARCH...]`: compiles every kernel for sm_90, sm_120 and sm_120a with
/// NVRTC (no GPU needed) and prints registers, shared memory and spills; fails on any spill.
pub fn check_kernels(args: &[String]) -> Result<()> {
    let lib = ensure_nvrtc()?;
    cargo(&["build", "--release", "-p", "pdserve-kernels-sm120", "--bin", "pdserve-kernels"])?;
    let mut cmd = Command::new("target/release/pdserve-kernels");
    cmd.arg("compile").args(args);
    with_lib_path(&mut cmd, &lib);
    run(&mut cmd).context("kernel compile check failed (see the table above)")
}

fn no_gpu_hint() -> &'static str {
    "this needs an NVIDIA GPU with its driver (libcuda), NVRTC and cuBLAS on the library path \
     (for example a CUDA toolkit's lib64 in LD_LIBRARY_PATH)"
}

/// `pdserve-kernels`, `pdserve-gpu-vs-cpu` and `pdserve-gpu-models`, release builds.
fn build_gpu_programs() -> Result<()> {
    cargo(&["build", "--release", "-p", "pdserve-kernels-sm120", "--bin", "pdserve-kernels"])?;
    let bins = ["--bin", "pdserve-gpu-vs-cpu", "--bin", "pdserve-gpu-models"];
    cargo(&[&["build", "--release", "-p", "pdserve-model", "--features", "cuda"][..], &bins].concat())
}

/// `cargo xtask test-gpu`: every kernel against its CPU reference on the GPU, then the GPU backend's
/// greedy output against the CPU backend's on the fixture prompts, on a tiny random checkpoint of
/// each architecture (`pdserve-gpu-models arch`, needs python3 with numpy) and its logits on a
/// random-weight 1B shape (`logits`).
pub fn test_gpu(args: &[String]) -> Result<()> {
    build_gpu_programs()?;
    run(Command::new("target/release/pdserve-kernels").arg("check").args(args)).with_context(no_gpu_hint)?;
    let model = crate::fetch_model(&[])?;
    run(Command::new("target/release/pdserve-gpu-vs-cpu").arg("--model").arg(model))
        .with_context(no_gpu_hint)?;
    let script = "crates/model/tests/fixtures/tiny_reference.py";
    run(Command::new("target/release/pdserve-gpu-models").args(["arch", script]))
        .with_context(no_gpu_hint)?;
    run(Command::new("target/release/pdserve-gpu-models").arg("logits")).with_context(no_gpu_hint)
}

/// `cargo xtask bench-gpu`: decode attention and RMSNorm bandwidth as a fraction of the copy peak,
/// prefill attention's FLOP rate, then the model on random-weight Llama-3-8B and default-model
/// shapes (`pdserve-gpu-models speed`: decode at batch 1 and 64 against the bandwidth bound, a
/// 2,048-token prefill against the GEMM rate).
pub fn bench_gpu(args: &[String]) -> Result<()> {
    build_gpu_programs()?;
    run(Command::new("target/release/pdserve-kernels").arg("bench").args(args)).with_context(no_gpu_hint)?;
    run(Command::new("target/release/pdserve-gpu-models").arg("speed")).with_context(no_gpu_hint)
}
