//! `cargo xtask bench llamacpp`: this project's unified worker against llama.cpp's server, per
//! instruction set, through HTTP, alternating run by run (A B A B), every point's prompts unique to
//! it. One row per figure the CPU goals name (a single stream, 32 streams, a 1,000-token prefill,
//! decode after a 4,000-token prompt), then each server's peak resident memory; the raw JSON of
//! every row under `target/bench/`, and a markdown table of medians and pair ratios beside it.
//! Everything it starts it stops.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::peer::{Isa, LlamaServer};
use crate::serve::{start_stack, stop_all, Spec};

const USAGE: &str =
    "cargo xtask bench llamacpp [--isa native|avx512|avx2|both] [--repeat K] [--rows LIST] [--weights FMT]
    [--activations f32|q8]

Per instruction set: one unified worker of ours on port 8121 (--weights q4, --speculative off, and
--cpu-kernels avx2 or avx512 for those sets) and llama.cpp's llama-server built for the same set by `cargo xtask peer
llamacpp --isa ISA` (-t 2, -c 16384) on 8189, in its fastest setting for each row: -np 32 -kvu (one
KV pool any of the 32 slots may fill) for 32 streams, -np 1 (all the context to one slot) for the
others. The load generator runs every row against both, alternating, K pairs (default 3):
  single     1 stream, ~100-token prompts, 64 output tokens     output tokens/s
  streams32  32 streams, the same requests                      output tokens/s
  prefill    1 stream, ~1,000-token prompts, 1 output token     time to first token (p50)
  long       1 stream, ~4,000-token prompts, 64 output tokens   time per output token (mean)
Then the peak resident memory (VmHWM) of both processes. Raw JSON: target/bench/vs-llamacpp-ISA-ROW.json;
the table: target/bench/vs-llamacpp.md (printed too; each set's rows also in vs-llamacpp-ISA.md).
--activations q8 runs ours with int8 inputs to the quantized weights' products, as llama.cpp
computes them. Defaults: --isa both, --repeat 3, every row, --weights q4, --activations f32.";

/// One row: its name, the load generator's options, what is read from each run and whether more
/// is better.
pub(crate) struct Row {
    pub name: &'static str,
    pub what: &'static str,
    pub args: &'static [&'static str],
    metric: fn(&Value) -> Option<f64>,
    unit: &'static str,
    higher_is_better: bool,
    /// llama.cpp's slots for the row, its fastest setting for the load: one for one stream (all
    /// 16,384 tokens of context to it), 32 sharing one pool (`-kvu`) for 32 streams.
    pub peer_slots: usize,
}

pub(crate) const ROWS: &[Row] = &[
    Row {
        name: "single",
        what: "1 stream, 64 output tokens",
        args: &["--concurrency", "1", "--requests-per-client", "8", "--max-tokens", "64"],
        metric: |p| p["output_tokens_per_s"].as_f64(),
        unit: "tok/s",
        higher_is_better: true,
        peer_slots: 1,
    },
    Row {
        name: "streams32",
        what: "32 streams, 64 output tokens each",
        args: &["--concurrency", "32", "--requests-per-client", "1", "--max-tokens", "64"],
        metric: |p| p["output_tokens_per_s"].as_f64(),
        unit: "tok/s",
        higher_is_better: true,
        peer_slots: 32,
    },
    Row {
        name: "prefill",
        what: "a 1,000-token prompt, time to first token",
        args: &[
            "--concurrency",
            "1",
            "--requests-per-client",
            "8",
            "--max-tokens",
            "1",
            "--prompt-words",
            // 1,001-1,003 prompt tokens with the chat template and the run's prefix (750 words made
            // 796-798: the row measured a fifth fewer tokens than its name says until 2026-12-04).
            "955",
        ],
        metric: |p| p["ttft"]["p50_ms"].as_f64(),
        unit: "ms",
        higher_is_better: false,
        peer_slots: 1,
    },
    Row {
        name: "long",
        what: "decode after a 4,000-token prompt, time per output token",
        args: &[
            "--concurrency",
            "1",
            "--requests-per-client",
            "8",
            "--max-tokens",
            "64",
            "--prompt-words",
            // 3,997 prompt tokens (3,000 words made 3,048).
            "3950",
        ],
        // Per token, not per event: a server may put several tokens in one event (ours did, in about
        // a fifth of this row's events), which makes the gaps between events fewer and longer.
        metric: |p| p["tpot"]["mean_ms"].as_f64(),
        unit: "ms",
        higher_is_better: false,
        peer_slots: 1,
    },
];

/// `row`'s load against two targets alternating (`pdserve-bench --target A --target B`), `repeat`
/// pairs, written to `out` (`.json`, `.svg`); the JSON read back.
pub(crate) fn bench_pair(row: &Row, (a, b): (&str, &str), repeat: usize, out: &Path) -> Result<Value> {
    let mut args: Vec<String> =
        ["run", "--release", "-q", "-p", "pdserve-loadgen", "--bin", "pdserve-bench", "--"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
    args.extend(["--target".into(), a.to_owned(), "--target".into(), b.to_owned()]);
    args.extend(row.args.iter().map(|s| (*s).to_owned()));
    args.extend(["--repeat".into(), repeat.to_string(), "--out".into(), out.display().to_string()]);
    crate::cargo(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    Ok(serde_json::from_slice(&std::fs::read(out.with_extension("json"))?)?)
}

/// A bench that takes only `--repeat K` and `--rows LIST`: both, from `args` over the defaults;
/// `None` after printing `usage` for `--help`.
pub(crate) fn repeat_and_rows(
    args: &[String],
    (mut repeat, mut rows): (usize, Vec<&'static Row>),
    usage: &str,
) -> Result<Option<(usize, Vec<&'static Row>)>> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--repeat" => repeat = v()?.parse()?,
            "--rows" => rows = pick_rows(&v()?)?,
            "-h" | "--help" => {
                println!("{usage}");
                return Ok(None);
            }
            other => bail!("unknown option {other}\n{usage}"),
        }
    }
    Ok(Some((repeat, rows)))
}

/// The rows a `--rows` list names (comma-separated).
pub(crate) fn pick_rows(names: &str) -> Result<Vec<&'static Row>> {
    names
        .split(',')
        .map(|n| ROWS.iter().find(|r| r.name == n).with_context(|| format!("no row {n:?}")))
        .collect()
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut isas, mut repeat, mut weights) = (vec![Isa::Native, Isa::Avx2], 3usize, "q4".to_owned());
    let mut activations = "f32".to_owned();
    let mut rows: Vec<&Row> = ROWS.iter().collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--isa" => {
                let name = v()?;
                isas = match name.as_str() {
                    "both" => vec![Isa::Native, Isa::Avx2],
                    one => vec![Isa::parse(one).with_context(|| format!("--isa: {}, or both", Isa::NAMES))?],
                }
            }
            "--repeat" => repeat = v()?.parse()?,
            "--weights" => weights = v()?,
            "--activations" => activations = v()?,
            "--rows" => rows = pick_rows(&v()?)?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    let model = crate::fetch_model(&[])?;
    crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-loadgen"])?;
    let gguf = crate::peer::default_gguf()?;
    let peers: Vec<_> =
        isas.iter().map(|&isa| crate::peer::llamacpp_for(isa).map(|b| b.0)).collect::<Result<_>>()?;
    crate::sys::install_stop_handler();
    let root = crate::workspace_root();
    let mut table = format!(
        "| ISA | figure | ours ({weights}, {activations} activations), median (min-max) | llama.cpp, median (min-max) | ours vs llama.cpp, median of {repeat} pairs (min-max) |\n|---|---|---|---|---|\n"
    );
    let mut memory = String::new();
    for (&isa, server) in isas.iter().zip(&peers) {
        let logs = root.join(format!("target/bench/vs-llamacpp-logs/{}", isa.name()));
        let mut extra = vec!["--weights".to_owned(), weights.clone(), "--speculative".into(), "off".into()];
        extra.extend(["--activations".into(), activations.clone()]);
        // The same instruction set on both sides: AVX2 alone, or AVX-512 without AMX tiles.
        if isa != Isa::Native {
            extra.extend(["--cpu-kernels".into(), isa.name().into()]);
        }
        let ours_logs = logs.join("ours");
        let spec = Spec::unified_worker(8121, &model, &extra, &ours_logs);
        let mut ours = start_stack(&spec)?;
        let result = (|| -> Result<()> {
            let mut peers = PeerPerRow::new(server, &gguf, &logs);
            for row in &rows {
                let peer = peers.for_row(row)?;
                let out = root.join(format!("target/bench/vs-llamacpp-{}-{}", isa.name(), row.name));
                println!("\n== {} {}: {} ours, {} llama.cpp", isa.name(), row.what, ours.url, peer.url);
                let json = bench_pair(row, (&ours.url, &peer.url), repeat, &out)?;
                table.push_str(&table_row(isa, row, &json, &ours.url, &peer.url)?);
            }
            let ours_pid = ours.procs.first().context("no worker")?.child.id();
            let (slots, rss) = peers.peak_rss_mb()?;
            let line = format!(
                "{}: ours {} MB, llama.cpp {rss} MB (-np {slots}; peak resident, VmHWM)\n",
                isa.name(),
                peak_rss_mb(ours_pid)?,
            );
            memory.push_str(&line);
            // Each instruction set's rows on their own too, so a run cut short keeps what it measured.
            let own: String = table
                .lines()
                .filter(|l| l.starts_with(&format!("| {} |", isa.name())))
                .collect::<Vec<_>>()
                .join("\n");
            std::fs::write(
                root.join(format!("target/bench/vs-llamacpp-{}.md", isa.name())),
                format!("{own}\n\n{line}"),
            )?;
            Ok(())
        })();
        stop_all(&mut ours.procs, Duration::from_secs(20));
        result?;
    }
    table.push('\n');
    table.push_str(&memory);
    let path = root.join("target/bench/vs-llamacpp.md");
    std::fs::write(&path, &table)?;
    println!("\n{table}\nwritten to {}", path.display());
    Ok(())
}

/// The row's line of the table: each side's median and range, and the median of the pairs' ratios
/// (ours over llama.cpp for rates, llama.cpp over ours for times: above 1 is ours ahead).
pub(crate) fn table_row(isa: Isa, row: &Row, json: &Value, ours: &str, peer: &str) -> Result<String> {
    let values = |target: &str| -> Vec<f64> {
        json["points"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["target"] == target)
            .filter_map(row.metric)
            .collect()
    };
    let (a, b) = (values(ours), values(peer));
    if a.is_empty() || a.len() != b.len() {
        bail!("{}: {} runs of ours against {} of llama.cpp", row.name, a.len(), b.len());
    }
    let ratios: Vec<f64> =
        a.iter().zip(&b).map(|(x, y)| if row.higher_is_better { x / y } else { y / x }).collect();
    let cell = |v: &[f64], unit: &str| {
        let (m, lo, hi) = summary(v);
        format!("{m:.1} {unit} ({lo:.1}-{hi:.1})")
    };
    let (m, lo, hi) = summary(&ratios);
    Ok(format!(
        "| {} | {} | {} | {} | **{m:.2}x** ({lo:.2}-{hi:.2}) |\n",
        isa.name(),
        row.what,
        cell(&a, row.unit),
        cell(&b, row.unit)
    ))
}

/// Median, min and max.
fn summary(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    (median, s[0], s[n - 1])
}

/// A process's peak resident set (`VmHWM` in `/proc/PID/status`), in MB.
/// llama-server in each row's fastest setting (`Row::peer_slots`): started for the first row, and
/// again when a row wants other slots than the one before (`-kvu` where it has more than one).
pub(crate) struct PeerPerRow<'a> {
    server: &'a Path,
    gguf: &'a Path,
    logs: &'a Path,
    running: Option<(usize, LlamaServer)>,
    /// The peak resident memory (slots, MB) of the servers stopped so far: the most slots'.
    stopped_rss: Option<(usize, u64)>,
}

impl<'a> PeerPerRow<'a> {
    pub(crate) fn new(server: &'a Path, gguf: &'a Path, logs: &'a Path) -> Self {
        PeerPerRow { server, gguf, logs, running: None, stopped_rss: None }
    }

    /// The server for `row`, started (and the one before stopped) where its slots differ.
    pub(crate) fn for_row(&mut self, row: &Row) -> Result<&LlamaServer> {
        if self.running.as_ref().is_none_or(|(slots, _)| *slots != row.peer_slots) {
            if let Some((slots, old)) = self.running.take() {
                let now = (slots, peak_rss_mb(old.pid())?);
                self.stopped_rss = Some(self.stopped_rss.filter(|(s, _)| *s > slots).unwrap_or(now));
            }
            let extra: &[&str] = if row.peer_slots > 1 { &["-kvu"] } else { &[] };
            let peer = LlamaServer::start(self.server, self.gguf, (16384, row.peer_slots), extra, self.logs)?;
            self.running = Some((row.peer_slots, peer));
        }
        Ok(&self.running.as_ref().context("started above")?.1)
    }

    /// (slots, MB): the peak resident memory (VmHWM) of the server that ran with the most slots.
    pub(crate) fn peak_rss_mb(&self) -> Result<(usize, u64)> {
        let mut best = self.stopped_rss;
        if let Some((slots, p)) = &self.running {
            let now = (*slots, peak_rss_mb(p.pid())?);
            best = Some(best.filter(|(s, _)| *s > now.0).unwrap_or(now));
        }
        best.context("no llama.cpp server ran")
    }
}

pub(crate) fn peak_rss_mb(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM")?;
    Ok(kb / 1000)
}
