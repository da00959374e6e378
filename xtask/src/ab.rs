//! `cargo xtask bench ab --base REV`: this checkout's unified worker against the same worker built
//! from an earlier revision, through HTTP, on `cargo xtask bench llamacpp`'s rows, alternating run by
//! run (A B A B), every point's prompts unique to it: what a change costs or gains, measured on the
//! path users run. The base is built in a git worktree of its own (`target/bench/ab/base`, its own
//! target folder beside it), so the checkout is never touched. Everything it starts it stops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::peer::Isa;
use crate::serve::{start_stack, stop_all, Spec};
use crate::vs_llamacpp::{bench_pair, pick_rows, table_row, Row, ROWS};

const USAGE: &str = "cargo xtask bench ab --base REV [--isa native|avx2] [--repeat K] [--rows LIST]
    [--weights FMT]

Builds the worker at git revision REV (a worktree in target/bench/ab/base) and at this checkout, runs
both as unified workers (--weights q4, --speculative off, and --cpu-kernels avx2 for avx2) on ports
8131 (this checkout) and 8132 (REV), and runs `cargo xtask bench llamacpp`'s rows against both,
alternating, K pairs (default 3): single, streams32, prefill, long (see `cargo xtask bench llamacpp
--help`). The table (this checkout against REV: above 1 is this checkout ahead) is printed and written
to target/bench/ab.md; raw JSON to target/bench/ab-ROW.json. Defaults: --isa native, --repeat 3,
every row, --weights q4.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut base, mut isa, mut repeat, mut weights) = (None, Isa::Native, 3usize, "q4".to_owned());
    let mut rows: Vec<&Row> = ROWS.iter().collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--base" => base = Some(v()?),
            "--isa" => isa = Isa::parse(&v()?).with_context(|| format!("--isa: {}", Isa::NAMES))?,
            "--repeat" => repeat = v()?.parse()?,
            "--weights" => weights = v()?,
            "--rows" => rows = pick_rows(&v()?)?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let base = base.with_context(|| format!("--base is required\n{USAGE}"))?;
    let root = crate::workspace_root();
    let bench = root.join("target/bench/ab");
    let base_bin = build_base(&root, &bench, &base)?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    let model = crate::fetch_model(&[])?;
    crate::sys::install_stop_handler();
    let mut extra = vec!["--weights".to_owned(), weights.clone(), "--speculative".into(), "off".into()];
    if isa == Isa::Avx2 {
        extra.extend(["--cpu-kernels".into(), "avx2".into()]);
    }
    let (head_logs, base_logs) = (bench.join("logs-head"), bench.join("logs-base"));
    let spec =
        |port, server_bin, logs| Spec { server_bin, ..Spec::unified_worker(port, &model, &extra, logs) };
    let mut ours = start_stack(&spec(8131, None, &head_logs))?;
    let mut theirs = match start_stack(&spec(8132, Some(base_bin.as_path()), &base_logs)) {
        Ok(s) => s,
        Err(e) => {
            stop_all(&mut ours.procs, Duration::from_secs(20));
            return Err(e);
        }
    };
    let mut table = format!(
        "| ISA | figure | this checkout ({weights}), median (min-max) | {base}, median (min-max) | this checkout vs {base}, median of {repeat} pairs (min-max) |\n|---|---|---|---|---|\n"
    );
    let result = (|| -> Result<()> {
        for row in &rows {
            let out = root.join(format!("target/bench/ab-{}", row.name));
            println!("\n== {}: {} this checkout, {} {base}", row.what, ours.url, theirs.url);
            let json = bench_pair(row, (&ours.url, &theirs.url), repeat, &out)?;
            table.push_str(&table_row(isa, row, &json, &ours.url, &theirs.url)?);
        }
        Ok(())
    })();
    stop_all(&mut ours.procs, Duration::from_secs(20));
    stop_all(&mut theirs.procs, Duration::from_secs(20));
    result?;
    let path = root.join("target/bench/ab.md");
    std::fs::write(&path, &table)?;
    println!("\n{table}\nwritten to {}", path.display());
    Ok(())
}

/// The worker binary of revision `rev`, built in a worktree of its own under `dir`.
fn build_base(root: &Path, dir: &Path, rev: &str) -> Result<PathBuf> {
    let tree = dir.join("base");
    std::fs::create_dir_all(dir)?;
    // A fresh worktree at `rev` (one left by an earlier run is replaced).
    let _ = Command::new("git").current_dir(root).args(["worktree", "remove", "--force"]).arg(&tree).status();
    crate::run(
        Command::new("git")
            .current_dir(root)
            .args(["worktree", "add", "--force", "--detach"])
            .arg(&tree)
            .arg(rev),
    )?;
    let target = dir.join("target");
    crate::run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&tree)
            .env("CARGO_TARGET_DIR", &target)
            .args(["build", "--release", "-p", "pdserve-server"]),
    )?;
    Ok(target.join("release/pdserve-server"))
}
