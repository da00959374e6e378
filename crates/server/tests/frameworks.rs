//! Seven agent frameworks, unchanged, against a unified worker and through the PD stack (router,
//! prefill and decode workers): the openai SDK, openai-agents, pydantic-ai, langchain-openai,
//! instructor, the anthropic SDK and litellm, each running `tests/frameworks/frameworks.py`'s
//! scenario (an agent loop with a function tool and its result, streaming, structured output, the
//! Responses API where the framework uses it). The pinned versions (`xtask/test-requirements.txt`)
//! live in a virtual environment of the project's own, which `cargo xtask test` makes.

mod common;

use std::path::PathBuf;

use common::router::RouterThread;
use common::Worker;
use pdserve_api::Role;

const FRAMEWORKS: [&str; 7] =
    ["openai", "openai-agents", "pydantic-ai", "langchain", "instructor", "anthropic", "litellm"];

/// The frameworks' Python: `PDSERVE_AGENTS_PYTHON`, or the environment `cargo xtask test` makes.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("PDSERVE_AGENTS_PYTHON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let venv =
        pdserve_import::fetch::models_dir().parent().map(|c| c.join("test-venv")).expect("cache folder");
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "the agent frameworks are not installed at {}: `cargo xtask test` installs them (or: python3 -m venv {0} && \
         {0}/bin/pip install -r xtask/test-requirements.txt)",
        venv.display()
    );
    python
}

fn run_all(base: &str, target: &str) {
    let script = format!("{}/tests/frameworks/frameworks.py", env!("CARGO_MANIFEST_DIR"));
    let python = python();
    let mut failed = Vec::new();
    for f in FRAMEWORKS {
        let out = std::process::Command::new(&python).arg(&script).arg(base).arg(f).output().expect("python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !(out.status.success() && stdout.contains("OK")) {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr
                .lines()
                .rev()
                .take(12)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            failed.push(format!("{f} ({target}):\n{stdout}\n{tail}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} frameworks failed:\n\n{}",
        failed.len(),
        FRAMEWORKS.len(),
        failed.join("\n\n")
    );
}

#[test]
fn every_framework_against_a_unified_worker() {
    let w = Worker::start(&[]);
    run_all(&format!("http://{}", w.addr), "unified worker");
}

#[test]
fn every_framework_through_prefill_and_decode() {
    let prefill = Worker::start(&["--role", "prefill", "--kv-shm"]);
    let decode = Worker::start(&["--role", "decode"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    run_all(&format!("http://{}", router.addr), "PD stack");
}
