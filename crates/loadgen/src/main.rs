//! `pdserve-bench`: load against one or more OpenAI-compatible endpoints, point by point, targets
//! alternating, with a table on the terminal, a JSON file and an SVG chart. `cargo xtask bench` runs it.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdserve_loadgen::{progress_bar, run_point, Load, PointResult, Progress, Shape, Slo, Target};

mod svg;

const USAGE: &str = "\
pdserve-bench --target URL [--target URL ...] [options]

workloads (one per run):
  --workload sweep             closed loop at each --concurrency (default 1,4,16,32,64)
      --requests-per-client N  requests per point = concurrency x N, at least 8 (default 4)
  --workload poisson           open loop at each --rate (requests/s) for --duration-s (default 30)
      --connections N          most requests in flight (default 64)
  --workload copy              as sweep, with copy-heavy agent prompts: a tool's output of --prompt-words
                               words as code lines, to be written out again, answered greedily (what
                               speculative decoding from the prompt is for)
  --workload agents            --agents N (default 32) conversations of --rounds R (default 5), each round
      --tool-words N           appending the answer and a tool result of N words (default 40)
  --target URL --body NAME=JSON  also load URL as a second target, `URL+NAME`, whose requests carry
                               the JSON object's fields (the same server with and without a feature)
request shape:
  --prompt-words N (default 75, about 100 tokens)   --max-tokens N (default 64)   --no-ignore-eos
  --model NAME   --timeout-s S (default 120)   --grace-s S (hung after deadline + grace; default 5)
  --api-key KEY
goodput SLOs:  --slo-ttft-ms MS (default 5000)   --slo-tpot-ms MS (default 500)
output:        --out PATH (default target/bench/loadgen: writes PATH.json and PATH.svg)
repeats:       --repeat N      run every point N times, the targets alternating (A B A B), and print
                               each target's median with its range (default 1)
";

fn list<T: std::str::FromStr>(v: &str) -> Result<Vec<T>, String> {
    v.split(',').map(|x| x.trim().parse::<T>().map_err(|_| format!("bad list item {x:?}"))).collect()
}

struct Args {
    targets: Vec<Target>,
    loads: Vec<Load>,
    shape: Shape,
    slo: Slo,
    out: PathBuf,
    x_label: &'static str,
    repeat: usize,
}

fn parse(args: Vec<String>) -> Result<Option<Args>, String> {
    let mut targets = Vec::new();
    let mut workload = "sweep".to_owned();
    let mut concurrency: Vec<usize> = vec![1, 4, 16, 32, 64];
    let mut per_client = 4usize;
    let mut rates: Vec<f64> = vec![1.0, 2.0, 4.0];
    let mut duration = 30.0f64;
    let mut connections = 64usize;
    let (mut agents, mut rounds, mut tool_words) = (32usize, 5usize, 40usize);
    let mut shape = Shape::default();
    let mut slo = Slo::default();
    let mut out = PathBuf::from("target/bench/loadgen");
    let mut repeat = 1usize;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            return Ok(None);
        }
        if a == "--no-ignore-eos" {
            shape.ignore_eos = false;
            continue;
        }
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{a} {v}: {e}"));
        let int = |v: &str| v.parse::<usize>().map_err(|e| format!("{a} {v}: {e}"));
        match a.as_str() {
            "--target" => targets.push(Target::parse(&v).map_err(|e| e.to_string())?),
            "--body" => {
                let t = targets.pop().ok_or("--body follows the --target it applies to")?;
                let (name, json) = v.split_once('=').ok_or("--body takes NAME=JSON")?;
                let fields = match serde_json::from_str(json) {
                    Ok(serde_json::Value::Object(m)) => m,
                    _ => return Err(format!("--body {name}: not a JSON object: {json}")),
                };
                targets.push(t.clone().with_body(name, fields));
                // The plain target stays, ahead of its variant: the two alternate.
                targets.insert(targets.len() - 1, t);
            }
            "--workload" => workload = v,
            "--concurrency" => concurrency = list(&v)?,
            "--requests-per-client" => per_client = int(&v)?,
            "--rate" => rates = list(&v)?,
            "--duration-s" => duration = num(&v)?,
            "--connections" => connections = int(&v)?,
            "--agents" => agents = int(&v)?,
            "--rounds" => rounds = int(&v)?,
            "--tool-words" => tool_words = int(&v)?,
            "--prompt-words" => shape.prompt_words = int(&v)?,
            "--max-tokens" => shape.max_tokens = int(&v)? as u64,
            "--model" => shape.model = Some(v),
            "--timeout-s" => shape.timeout = Duration::from_secs_f64(num(&v)?),
            "--grace-s" => shape.grace = Duration::from_secs_f64(num(&v)?),
            "--api-key" => shape.api_key = Some(v),
            "--slo-ttft-ms" => slo.ttft = Duration::from_secs_f64(num(&v)? / 1000.0),
            "--slo-tpot-ms" => slo.tpot = Duration::from_secs_f64(num(&v)? / 1000.0),
            "--out" => out = PathBuf::from(v),
            "--repeat" => repeat = int(&v)?.max(1),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if targets.is_empty() {
        return Err("at least one --target URL".into());
    }
    let (loads, x_label) = match workload.as_str() {
        "sweep" => (
            concurrency
                .iter()
                .map(|&c| Load::Closed { concurrency: c, requests: (c * per_client).max(8) })
                .collect(),
            "concurrent clients",
        ),
        "poisson" => (
            rates
                .iter()
                .map(|&r| Load::Poisson { rate: r, duration: Duration::from_secs_f64(duration), connections })
                .collect(),
            "offered requests/s",
        ),
        "agents" => (vec![Load::Agents { agents, rounds, tool_words }], "agents"),
        "copy" => {
            shape.copy = true;
            (
                concurrency
                    .iter()
                    .map(|&c| Load::Closed { concurrency: c, requests: (c * per_client).max(8) })
                    .collect(),
                "concurrent clients",
            )
        }
        w => return Err(format!("unknown workload {w} (sweep, copy, poisson, agents)")),
    };
    Ok(Some(Args { targets, loads, shape, slo, out, x_label, repeat }))
}

fn row(r: &PointResult) -> String {
    let errors: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    format!(
        "{:<26} {:<18} {:>6.2} {:>8.1} {:>7.2} {:>8.0} {:>8.0} {:>7.0} {:>7.0} {:>8.0} {:>8.0} {:>5} {:>5.2}  {}",
        r.target,
        r.load,
        r.requests_per_s(),
        r.tokens_per_s(),
        r.goodput_per_s(),
        r.ttft.p50_ms(),
        r.ttft.p99_ms(),
        r.itl.p50_ms(),
        r.itl.p99_ms(),
        r.e2e.p50_ms(),
        r.e2e.p99_ms(),
        r.hung,
        r.cpu_cores(),
        if errors.is_empty() { "-".to_owned() } else { errors.join(" ") }
    )
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1).collect()) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("pdserve-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{:<26} {:<18} {:>6} {:>8} {:>7} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8} {:>5} {:>5}  errors",
        "target",
        "load",
        "req/s",
        "tok/s",
        "good/s",
        "ttft50",
        "ttft99",
        "itl50",
        "itl99",
        "e2e50",
        "e2e99",
        "hung",
        "cpu"
    );
    println!(
        "{:<26} {:<18} {:>6} {:>8} {:>7} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8} {:>5} {:>5}",
        "", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "", "cores"
    );
    let mut results = Vec::new();
    for rep in 0..args.repeat {
        for load in &args.loads {
            for t in &args.targets {
                let progress = Arc::new(Progress::default());
                let stop = Arc::new(AtomicBool::new(false));
                let bar = progress_bar(
                    format!("{} {}", t.url, load.label()),
                    Arc::clone(&progress),
                    Arc::clone(&stop),
                );
                let r = run_point(t, load, &args.shape, &args.slo, &progress);
                stop.store(true, Ordering::Relaxed);
                let _ = bar.join();
                println!("{}", row(&r));
                if !r.stages.is_empty() {
                    let stages: Vec<String> =
                        r.stages.iter().map(|(k, (m, _))| format!("{k} {m:.0}")).collect();
                    println!("{:<26} stages (mean ms): {}", "", stages.join(", "));
                }
                if !r.rounds.is_empty() {
                    print!("{}", rounds_table(&r));
                }
                let _ = std::io::stdout().flush();
                results.push((rep, r));
            }
        }
    }
    if args.repeat > 1 {
        print!("{}", summary(&results, &args.targets, &args.loads));
    }
    let results: Vec<PointResult> = results.into_iter().map(|(_, r)| r).collect();
    let hung: u64 = results.iter().map(|r| r.hung).sum();
    if let Some(dir) = args.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let json = serde_json::json!({
        "shape": {"prompt_words": args.shape.prompt_words, "max_tokens": args.shape.max_tokens, "ignore_eos": args.shape.ignore_eos,
                  "timeout_s": args.shape.timeout.as_secs_f64(), "grace_s": args.shape.grace.as_secs_f64()},
        "slo": {"ttft_ms": args.slo.ttft.as_secs_f64() * 1000.0, "tpot_ms": args.slo.tpot.as_secs_f64() * 1000.0},
        "points": results.iter().map(PointResult::to_json).collect::<Vec<_>>(),
    });
    let json_path = args.out.with_extension("json");
    let svg_path = args.out.with_extension("svg");
    let wrote = std::fs::write(&json_path, serde_json::to_string_pretty(&json).unwrap_or_default())
        .and_then(|()| std::fs::write(&svg_path, svg::chart(&results, args.x_label)));
    match wrote {
        Ok(()) => println!("wrote {} and {}", json_path.display(), svg_path.display()),
        Err(e) => eprintln!("pdserve-bench: writing results: {e}"),
    }
    println!("hung requests: {hung}");
    if hung > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The agents workload's figures round by round: TTFT, prompt tokens computed against those new in
/// the round and those found cached, and KV bytes moved between PD workers.
fn rounds_table(r: &PointResult) -> String {
    let mut out = format!(
        "{:<26} {:>5} {:>4} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9}\n",
        "", "round", "ok", "ttft50", "ttft99", "ttft50/r1", "new", "computed", "comp/new", "cached", "kv MB"
    );
    let first = r.rounds.first().map_or(0.0, |r0| r0.ttft.p50_ms());
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    for x in &r.rounds {
        out += &format!(
            "{:<26} {:>5} {:>4} {:>8.0} {:>8.0} {:>9.2} {:>8} {:>9} {:>9} {:>8} {:>9}\n",
            "",
            x.round + 1,
            x.ok,
            x.ttft.p50_ms(),
            x.ttft.p99_ms(),
            x.ttft.p50_ms() / first.max(1e-9),
            x.new_tokens,
            opt(x.computed_tokens()),
            x.computed_per_new().map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
            opt(x.cached_tokens),
            x.kv_pulled_bytes.map_or_else(|| "-".to_owned(), |b| format!("{:.1}", b as f64 / 1e6)),
        );
    }
    out
}

/// Medians over the repeats, with their range, per target and load; and each target's ratio to the
/// last target (the peer) per repeat.
fn summary(results: &[(usize, PointResult)], targets: &[Target], loads: &[Load]) -> String {
    let median = |mut v: Vec<f64>| -> (f64, f64, f64) {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let m = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        (m, v[0], v[n - 1])
    };
    let mut out = String::from("\nmedians over the repeats (min-max):\n");
    for load in loads {
        let label = load.label();
        let of = |t: &Target| -> Vec<&(usize, PointResult)> {
            results.iter().filter(|(_, r)| r.target == t.url && r.load == label).collect()
        };
        let peer = targets.last().map(&of).unwrap_or_default();
        for t in targets {
            let rs = of(t);
            let rps = median(rs.iter().map(|(_, r)| r.requests_per_s()).collect());
            let tps = median(rs.iter().map(|(_, r)| r.tokens_per_s()).collect());
            let ttft = median(rs.iter().map(|(_, r)| r.ttft.p50_ms()).collect());
            let hung: u64 = rs.iter().map(|(_, r)| r.hung).sum();
            out += &format!(
                "{:<26} {:<18} req/s {:.3} ({:.3}-{:.3})  tok/s {:.1} ({:.1}-{:.1})  ttft50 ms {:.0} ({:.0}-{:.0})  hung {hung}",
                t.url, label, rps.0, rps.1, rps.2, tps.0, tps.1, tps.2, ttft.0, ttft.1, ttft.2
            );
            if !peer.is_empty() && t.url != peer[0].1.target {
                // Each repeat against the peer's point of the same repeat (they ran next to each other).
                let ratio = |f: &dyn Fn(&PointResult) -> f64| -> Option<(f64, f64, f64)> {
                    let v: Vec<f64> = rs
                        .iter()
                        .filter_map(|(rep, r)| {
                            let p = peer.iter().find(|(pr, _)| pr == rep)?;
                            Some(f(r) / f(&p.1).max(1e-9))
                        })
                        .collect();
                    (!v.is_empty()).then(|| median(v))
                };
                let peer_name = &peer[0].1.target;
                if let Some(q) = ratio(&PointResult::requests_per_s) {
                    out += &format!("  req/s vs {peer_name}: {:.2}x ({:.2}-{:.2})", q.0, q.1, q.2);
                }
                if let Some(q) = ratio(&PointResult::tokens_per_s) {
                    out += &format!("  tok/s vs {peer_name}: {:.2}x ({:.2}-{:.2})", q.0, q.1, q.2);
                }
            }
            out += "\n";
            if rs.iter().any(|(_, r)| !r.rounds.is_empty()) {
                let rounds = rs.iter().map(|(_, r)| r.rounds.len()).max().unwrap_or(0);
                for i in 0..rounds {
                    let at = |f: &dyn Fn(&pdserve_loadgen::RoundResult) -> Option<f64>| -> Option<(f64, f64, f64)> {
                        let v: Vec<f64> = rs.iter().filter_map(|(_, r)| r.rounds.get(i).and_then(f)).collect();
                        (!v.is_empty()).then(|| median(v))
                    };
                    let show = |m: Option<(f64, f64, f64)>, p: usize| {
                        m.map_or_else(|| "-".to_owned(), |m| format!("{:.p$} ({:.p$}-{:.p$})", m.0, m.1, m.2))
                    };
                    out += &format!(
                        "{:<26}   round {:>2}: ttft50 ms {}  ttft99 ms {}  computed/new {}  kv MB {}\n",
                        "",
                        i + 1,
                        show(at(&|x| Some(x.ttft.p50_ms())), 0),
                        show(at(&|x| Some(x.ttft.p99_ms())), 0),
                        show(at(&|x| x.computed_per_new()), 2),
                        show(at(&|x| x.kv_pulled_bytes.map(|b| b as f64 / 1e6)), 1),
                    );
                }
            }
        }
    }
    out
}
