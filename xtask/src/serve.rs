//! `cargo xtask serve`: the stack in one command. Today that is one unified worker (the router and the
//! prefill/decode split arrive with their issues); `--unified` is accepted and is the default.

use std::io::{BufRead, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut port = 8000u16;
    let mut model: Option<PathBuf> = None;
    let mut extra: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--unified" => {}
            "--port" => port = it.next().context("--port needs a value")?.parse()?,
            "--model" => model = Some(PathBuf::from(it.next().context("--model needs a value")?)),
            "--prefill" | "--decode" => bail!("{a}: the prefill/decode split needs the router and the KV transfer, which are not built yet; use --unified"),
            other => extra.push(other.to_owned()),
        }
    }
    let model = match model {
        Some(m) => m,
        None => crate::fetch_model(&[])?,
    };
    crate::cargo(&["build", "--release", "-p", "pdserve-server"])?;
    let root = crate::workspace_root();
    let logs = root.join("target/serve");
    std::fs::create_dir_all(&logs)?;
    let log_path = logs.join("worker.log");
    let log = std::fs::File::create(&log_path)?;
    let mut child = Command::new(root.join("target/release/pdserve-server"))
        .args(["--port", &port.to_string(), "--model"])
        .arg(&model)
        .arg("--exit-on-stdin-eof")
        .args(&extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .context("starting pdserve-server")?;
    // Held open for the worker's life: if this process dies, the worker sees end of file and drains.
    let _stdin = child.stdin.take();
    let stdout = child.stdout.take().context("worker stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let started = Instant::now();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(a) = line.strip_prefix("listening on ") {
                    break a.to_owned();
                }
            }
            _ => {
                let status = child.wait()?;
                let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                bail!(
                    "the worker exited with {status} before it was ready; last lines of {}:\n{}",
                    log_path.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            bail!("the worker did not become ready in 300 s");
        }
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "pdserve is serving {} at {addr}", model.display())?;
    writeln!(out, "logs: {}", log_path.display())?;
    writeln!(out, "try:\n  curl -s {addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"max_tokens\":32}}'")?;
    writeln!(out, "Ctrl-C stops it.")?;
    drop(out);
    let status = child.wait()?;
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        bail!(
            "the worker exited with {status}; last lines of its log:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}
