//! `cargo xtask bench spec`: what prompt-lookup speculative decoding gives and costs (or, with
//! `--model deepseek-mtp`, drafts from a DeepSeek MTP layer). Two unified workers of the same build
//! and model, one plain and one with `--speculative prompt-lookup` (`mtp`), loaded
//! alternately (A B A B) by the load generator: the copy-heavy agent workload (where drafts pay) and
//! the plain one (where they mostly do not), each prompt unique to its point. Afterwards it prints the
//! speculative worker's acceptance rate from its metrics. Everything it starts it stops.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::serve::{start_stack, stop_all, Spec, Stack};

const USAGE: &str = "cargo xtask bench spec [--concurrency LIST] [--max-tokens M] [--repeat K] [--draft-tokens N] [--weights FMT] [--workloads LIST] [--model deepseek-mtp]

Starts two unified workers (--speculative off on port 8111, prompt-lookup, the default, on 8112) and runs
`pdserve-bench` against both, alternating, per workload: `copy` (an agent writing a file a tool read
back out, greedy: what drafts from the prompt are for) and `sweep` (continue a list of random words at
temperature 0.7: drafts rarely match). Prints tok/s medians with their spread and the ratio per
point, then the acceptance rate. Raw JSON in target/bench/spec-<workload>.json.
Defaults: --concurrency 1,4, --max-tokens 160, --repeat 3, --draft-tokens 8, --weights q4,
--workloads copy,sweep. --model deepseek-mtp: the random DeepSeek-V3 shape of `bench deepseek` with an
MTP layer (written once under the cache folder), the second worker --speculative mtp: with random
weights its guesses are refused, so this measures what the draft layer costs, not what it gains.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut concurrency, mut max_tokens, mut repeat) = ("1,4".to_owned(), 160usize, 3usize);
    let (mut draft, mut weights, mut workloads) = (8usize, "q4".to_owned(), "copy,sweep".to_owned());
    let mut mtp = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--concurrency" => concurrency = v()?,
            "--max-tokens" => max_tokens = v()?.parse()?,
            "--repeat" => repeat = v()?.parse()?,
            "--draft-tokens" => draft = v()?.parse()?,
            "--weights" => weights = v()?,
            "--workloads" => workloads = v()?,
            "--model" => match v()?.as_str() {
                "deepseek-mtp" => mtp = true,
                other => bail!("--model {other}: deepseek-mtp (or leave it out for the default model)"),
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let mut model = crate::fetch_model(&[])?;
    if mtp {
        model = crate::deepseek::model_with_mtp(&model)?;
    }
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    crate::sys::install_stop_handler();
    let root = crate::workspace_root();
    let logs = root.join("target/bench/spec-logs");
    std::fs::create_dir_all(&logs)?;
    let start = |port: u16, extra: &[String]| -> Result<Stack> {
        let spec = Spec {
            port,
            model: &model,
            native_q4: false,
            unified: true,
            prefills: 0,
            decodes: 0,
            extra,
            logs: &logs.join(port.to_string()),
            secret: false,
            server_bin: None,
            bin_dir: None,
            router_extra: &[],
            divide_cores: None,
        };
        start_stack(&spec)
    };
    let mut plain_args = vec!["--weights".to_owned(), weights.clone()];
    let mut spec_args = plain_args.clone();
    plain_args.extend(["--speculative".into(), "off".into()]);
    spec_args.extend([
        "--speculative".into(),
        if mtp { "mtp" } else { "prompt-lookup" }.into(),
        "--draft-tokens".into(),
        draft.to_string(),
    ]);
    let mut plain = start(8111, &plain_args)?;
    let mut spec = match start(8112, &spec_args) {
        Ok(s) => s,
        Err(e) => {
            stop_all(&mut plain.procs, Duration::from_secs(20));
            return Err(e);
        }
    };
    // The speculative worker's counters: draft tokens verified, accepted, tokens generated.
    let counters = |url: &str| -> Result<[f64; 3]> {
        let (_, body) = crate::where_::get(url, "/metrics")?;
        let metrics = String::from_utf8_lossy(&body);
        let value = |name: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Ok(["spec_draft_tokens_total", "spec_accepted_tokens_total", "tokens_generated_total"].map(value))
    };
    let result = (|| -> Result<()> {
        let mut summary = Vec::new();
        for workload in workloads.split(',') {
            let before = counters(&spec.url)?;
            let out = root.join(format!("target/bench/spec-{workload}"));
            let mut a: Vec<String> =
                ["run", "--release", "-q", "-p", "pdserve-loadgen", "--bin", "pdserve-bench", "--"]
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect();
            a.extend([
                "--target".into(),
                plain.url.clone(),
                "--target".into(),
                spec.url.clone(),
                "--workload".into(),
                workload.to_owned(),
                "--concurrency".into(),
                concurrency.clone(),
                "--max-tokens".into(),
                max_tokens.to_string(),
                "--prompt-words".into(),
                "120".into(),
                "--repeat".into(),
                repeat.to_string(),
                "--out".into(),
                out.display().to_string(),
            ]);
            println!("\n== workload {workload}: {} plain, {} speculative", plain.url, spec.url);
            crate::cargo(&a.iter().map(String::as_str).collect::<Vec<_>>())?;
            let after = counters(&spec.url)?;
            let [drafted, accepted, generated] = [0, 1, 2].map(|i| after[i] - before[i]);
            summary.push(format!(
                "{workload}: {drafted} draft tokens verified, {accepted} accepted ({:.0}%), {generated} tokens generated",
                100.0 * accepted / drafted.max(1.0)
            ));
        }
        println!("\nspeculative worker:");
        for line in summary {
            println!("  {line}");
        }
        Ok(())
    })();
    stop_all(&mut plain.procs, Duration::from_secs(20));
    stop_all(&mut spec.procs, Duration::from_secs(20));
    result
}
