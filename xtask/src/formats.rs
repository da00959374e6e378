//! `cargo xtask bench formats`: one model served in two weight formats by two unified workers of
//! this checkout, through HTTP, on `cargo xtask bench llamacpp`'s rows, alternating run by run (A B
//! A B), every point's prompts unique to it: what a format costs or gains in speed, beside the bytes
//! each holds (from `/v1/models`). The model is `cargo xtask bench deepseek`'s random DeepSeek-V3
//! shape (bf16 on disk; `--weights fp4` holds it in 4 bits as an NVFP4 checkpoint is held; `mxfp4`
//! serves its twin with the experts shipped in MXFP4, as DeepSeek V4 ships them) or the default
//! model. Everything it starts it stops.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::peer::Isa;
use crate::serve::{start_stack, stop_all, Spec};
use crate::vs_llamacpp::{bench_pair, pick_rows, table_row, Row};

const USAGE: &str = "cargo xtask bench formats [--formats A,B] [--model deepseek|default] [--repeat K]
    [--rows LIST]

Serves the model twice, --weights A on port 8141 and --weights B on 8142 (unified workers,
--speculative off), and runs `cargo xtask bench llamacpp`'s rows against both, alternating, K pairs
(default 3). Defaults: --formats fp4,bf16, --model deepseek (the random DeepSeek-V3 shape of `cargo
xtask bench deepseek`, written once), --rows single,streams32. Format mxfp4 serves the same random
values with the experts shipped in MXFP4 (DeepSeek V4's layout, written once), --weights fp4. The table (A against B: above 1 is A
ahead) and each worker's weight bytes are printed and written to target/bench/formats.md.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut formats, mut model, mut repeat) = ("fp4,bf16".to_owned(), "deepseek".to_owned(), 3usize);
    let mut rows: Vec<&Row> = pick_rows("single,streams32")?;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--formats" => formats = v()?,
            "--model" => model = v()?,
            "--repeat" => repeat = v()?.parse()?,
            "--rows" => rows = pick_rows(&v()?)?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let Some((a, b)) = formats.split_once(',') else { bail!("--formats takes two formats, A,B\n{USAGE}") };
    let root = crate::workspace_root();
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    let default = crate::fetch_model(&[])?;
    let dir = match model.as_str() {
        "deepseek" => crate::deepseek::model(&default)?,
        "default" => default.clone(),
        other => bail!("--model {other}: deepseek or default"),
    };
    // `mxfp4`: the same random values with their experts shipped in MXFP4 (DeepSeek V4's layout),
    // served as shipped (`--weights fp4`).
    let served = |format: &str| -> Result<(std::path::PathBuf, String)> {
        match format {
            "mxfp4" if model == "deepseek" => Ok((crate::deepseek::model_mxfp4(&default)?, "fp4".into())),
            "mxfp4" => bail!("--formats mxfp4 takes --model deepseek (the default model has no experts)"),
            f => Ok((dir.clone(), f.to_owned())),
        }
    };
    let ((dir_a, weights_a), (dir_b, weights_b)) = (served(a)?, served(b)?);
    crate::sys::install_stop_handler();
    let bench = root.join("target/bench/formats");
    let extra =
        |format: &str| ["--weights".to_owned(), format.to_owned(), "--speculative".into(), "off".into()];
    let (extra_a, extra_b) = (extra(&weights_a), extra(&weights_b));
    let (logs_a, logs_b) = (bench.join("logs-a"), bench.join("logs-b"));
    let mut first = start_stack(&Spec::unified_worker(8141, &dir_a, &extra_a, &logs_a))?;
    let mut second = match start_stack(&Spec::unified_worker(8142, &dir_b, &extra_b, &logs_b)) {
        Ok(s) => s,
        Err(e) => {
            stop_all(&mut first.procs, Duration::from_secs(20));
            return Err(e);
        }
    };
    let isa = Isa::Native;
    let mut table = format!(
        "| ISA | figure | {a}, median (min-max) | {b}, median (min-max) | {a} vs {b}, median of {repeat} pairs (min-max) |\n|---|---|---|---|---|\n"
    );
    let result = (|| -> Result<()> {
        for (url, format) in [(&first.url, a), (&second.url, b)] {
            let (_, body) = crate::where_::get(url, "/v1/models")?;
            let models: serde_json::Value = serde_json::from_slice(&body).context("/v1/models")?;
            let m = &models["data"][0];
            table.push_str(&format!(
                "| | weights held ({format}: `{}`) | {:.0} MB | | |\n",
                m["weights"].as_str().unwrap_or("?"),
                m["weight_bytes"].as_f64().unwrap_or(0.0) / 1e6
            ));
        }
        for row in &rows {
            let out = root.join(format!("target/bench/formats-{}", row.name));
            println!("\n== {}: {} {a}, {} {b}", row.what, first.url, second.url);
            let json = bench_pair(row, (&first.url, &second.url), repeat, &out)?;
            table.push_str(&table_row(isa, row, &json, &first.url, &second.url)?);
        }
        Ok(())
    })();
    stop_all(&mut first.procs, Duration::from_secs(20));
    stop_all(&mut second.procs, Duration::from_secs(20));
    result?;
    let path = root.join("target/bench/formats.md");
    std::fs::write(&path, &table)?;
    println!("\n{table}\nwritten to {}", path.display());
    Ok(())
}
