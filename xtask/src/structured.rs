//! `cargo xtask bench structured`: what constrained decoding costs. One unified worker, loaded with the
//! same chat requests with and without a `json_schema` response format, the two alternating point by
//! point, at 1 and 32 concurrent streams. Everything it starts it stops.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::serve::{start_stack, stop_all, Spec};

const USAGE: &str =
    "cargo xtask bench structured [--concurrency LIST] [--max-tokens M] [--repeat K] [--out PATH]

Starts one unified worker on port 8102 and runs `pdserve-bench --workload sweep` against it twice per
point: plain, and as `+json_schema` with a strict schema (an object holding a list of at least 40
strings, so no answer ends before --max-tokens and both carry the same number of tokens). Reports
tokens/s and inter-token latency, and the plain target's tok/s over the constrained one's per repeat.
Defaults: --concurrency 1,32, --max-tokens 64, --repeat 3, out target/bench/structured.";

/// The schema every constrained request carries.
pub(crate) fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": 40},
            "items": {"type": "array", "items": {"type": "string"}, "minItems": 40}
        },
        "required": ["topic", "items"],
        "additionalProperties": false
    })
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut concurrency, mut max_tokens, mut repeat) = ("1,32".to_owned(), 64usize, 3usize);
    let mut out = "target/bench/structured".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--concurrency" => concurrency = v()?,
            "--max-tokens" => max_tokens = v()?.parse()?,
            "--repeat" => repeat = v()?.parse()?,
            "--out" => out = v()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let model = crate::fetch_model(&[])?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    crate::sys::install_stop_handler();
    let logs = crate::workspace_root().join("target/bench/structured-logs");
    std::fs::create_dir_all(&logs)?;
    let extra: Vec<String> = Vec::new();
    let spec = Spec {
        port: 8102,
        model: &model,
        native_q4: true,
        unified: true,
        prefills: 1,
        decodes: 1,
        extra: &extra,
        logs: &logs,
        secret: false,
        server_bin: None,
        bin_dir: None,
        router_extra: &[],
        divide_cores: None,
    };
    let mut stack = start_stack(&spec)?;
    let format = serde_json::json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "list", "schema": schema(), "strict": true}}});
    let bench: Vec<String> = [
        "run",
        "--release",
        "-q",
        "-p",
        "pdserve-loadgen",
        "--bin",
        "pdserve-bench",
        "--",
        "--target",
        "http://127.0.0.1:8102",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        "--body".to_owned(),
        format!("json_schema={format}"),
        "--workload".to_owned(),
        "sweep".to_owned(),
        "--concurrency".to_owned(),
        concurrency,
        "--max-tokens".to_owned(),
        max_tokens.to_string(),
        "--repeat".to_owned(),
        repeat.to_string(),
        "--out".to_owned(),
        out,
    ])
    .collect();
    let result = crate::cargo(&bench.iter().map(String::as_str).collect::<Vec<_>>());
    stop_all(&mut stack.procs, Duration::from_secs(20));
    result
}
