//! The official `openai` Python client (PyPI `openai`) against a real worker: chat streaming and not,
//! completions, stop sequences, seeded sampling, typed errors. `.ci/run` installs the package.

mod common;

use std::process::Command;

#[test]
fn the_official_openai_client_works() {
    let w = common::Worker::start(&[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .arg(script)
        .arg(format!("http://{}", w.addr))
        .output()
        .expect("python3 is needed for this test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "openai client check failed (install it with `pip install openai`):\n{stdout}\n{stderr}"
    );
}
