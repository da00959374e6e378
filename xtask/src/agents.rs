//! `cargo xtask bench agents`: the agent workload (growing multi-round conversations) against the PD
//! stack, a unified worker and llama.cpp's server, all three up at once on this machine, the targets
//! alternating run by run. Everything it starts it stops.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::peer::LlamaServer;
use crate::serve::{start_stack, stop_all, Spec, Stack};

const USAGE: &str = "cargo xtask bench agents [--agents N] [--rounds R] [--prompt-words P] [--tool-words W]
                         [--max-tokens M] [--repeat K] [--kv-blocks B] [--no-llamacpp] [--divided-cores]
                         [--through-prefill] [--offload] [--out PATH]

Starts the PD stack (router, one prefill and one decode worker, KV through shared memory) on port
8100, one unified worker on 8101 and llama.cpp's llama-server (built by `cargo xtask peer llamacpp`,
one slot per agent) on 8189, then runs `pdserve-bench --workload agents` against the three, K times
alternating. Defaults: 32 agents x 10 rounds; each conversation opens with a task of 750 words (about
1,000 tokens) and every round adds the answer (64 tokens) and 110 words (about 150 tokens) of tool
output; K = 2; 6,400 KV blocks of 16 tokens per worker (each holds every conversation); out
target/bench/agents. The PD stack's cores follow `cargo xtask serve`'s rule (shared below 4 cores
per worker); --divided-cores adds a second PD stack on 8102 whose workers are each pinned to their own
share of the cores (a same-run comparison); --through-prefill adds a PD stack on 8103 whose router
sends every round through the prefill worker (`--max-local-prefill-bytes 0`: no conditional
disaggregation, the stack as it was before it).

--offload runs another comparison instead: two unified workers whose pools hold a quarter of the
agents' working set (1,600 blocks unless --kv-blocks says otherwise), on 8101 without and on 8104 with
a KV offload tier of 4 GiB of host memory (`--kv-offloading-size 4`), alternating.";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let (mut agents, mut rounds, mut tool_words, mut max_tokens, mut repeat) =
        (32usize, 10usize, 110usize, 64usize, 2usize);
    let mut kv_blocks = 6400usize;
    // The task that opens each conversation (the files it concerns): about 1,000 tokens.
    let mut prompt_words = 750usize;
    let mut llamacpp = true;
    let mut divided_cores = false;
    let mut through_prefill = false;
    let mut offload = false;
    let mut kv_blocks_set = None;
    let mut out = "target/bench/agents".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut n = || -> Result<usize> { Ok(it.next().context("a number")?.parse()?) };
        match a.as_str() {
            "--agents" => agents = n()?,
            "--rounds" => rounds = n()?,
            "--tool-words" => tool_words = n()?,
            "--max-tokens" => max_tokens = n()?,
            "--repeat" => repeat = n()?,
            "--kv-blocks" => kv_blocks_set = Some(n()?),
            "--prompt-words" => prompt_words = n()?,
            "--no-llamacpp" => llamacpp = false,
            "--divided-cores" => divided_cores = true,
            "--through-prefill" => through_prefill = true,
            "--offload" => offload = true,
            "--out" => out = it.next().context("--out needs a path")?.clone(),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    if let Some(b) = kv_blocks_set {
        kv_blocks = b;
    } else if offload {
        kv_blocks /= 4;
    }
    let model = crate::fetch_model(&[])?;
    crate::serve::build_stack()?;
    let llamacpp = llamacpp && !offload;
    let peer_bins =
        if llamacpp { Some((crate::peer::llamacpp()?.0, crate::peer::default_gguf()?)) } else { None };
    crate::sys::install_stop_handler();
    let logs = crate::workspace_root().join("target/bench/agents-logs");
    std::fs::create_dir_all(&logs)?;
    let extra = vec!["--kv-blocks".to_owned(), kv_blocks.to_string()];
    let (pd_logs, unified_logs, divided_logs, through_logs) =
        (logs.join("pd"), logs.join("unified"), logs.join("pd-divided"), logs.join("pd-through-prefill"));
    let no_local = vec!["--max-local-prefill-bytes".to_owned(), "0".to_owned()];
    let mut tiered = extra.clone();
    tiered.extend(["--kv-offloading-size".to_owned(), "4".to_owned()]);
    let tiered_logs = logs.join("unified-offload");
    let spec = |port, unified, logs| Spec {
        port,
        model: &model,
        native_q4: true,
        unified,
        prefills: 1,
        decodes: 1,
        extra: &extra,
        logs,
        secret: true,
        server_bin: None,
        bin_dir: None,
        router_extra: &[],
        divide_cores: None,
    };
    let mut stacks: Vec<Stack> = Vec::new();
    let result = (|| -> Result<()> {
        if offload {
            stacks.push(start_stack(&spec(8101, true, &unified_logs))?);
            stacks.push(start_stack(&Spec { extra: &tiered, ..spec(8104, true, &tiered_logs) })?);
        } else {
            stacks.push(start_stack(&spec(8100, false, &pd_logs))?);
            stacks.push(start_stack(&spec(8101, true, &unified_logs))?);
        }
        if divided_cores {
            stacks.push(start_stack(&Spec { divide_cores: Some(true), ..spec(8102, false, &divided_logs) })?);
        }
        if through_prefill {
            stacks.push(start_stack(&Spec { router_extra: &no_local, ..spec(8103, false, &through_logs) })?);
        }
        let _peer = match &peer_bins {
            // One slot per agent, each holding a whole conversation (about 3,100 tokens at round 10
            // of the defaults), so every slot keeps its conversation's prompt cache.
            Some((server, gguf)) => {
                Some(LlamaServer::start(server, gguf, (agents * 4096, agents), &[], &logs)?)
            }
            None => None,
        };
        let mut bench: Vec<String> =
            ["run", "--release", "-q", "-p", "pdserve-loadgen", "--bin", "pdserve-bench", "--"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
        let mut targets = if offload {
            vec!["http://127.0.0.1:8101", "http://127.0.0.1:8104"]
        } else {
            vec!["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
        };
        if divided_cores {
            targets.push("http://127.0.0.1:8102");
        }
        if through_prefill {
            targets.push("http://127.0.0.1:8103");
        }
        if peer_bins.is_some() {
            targets.push("http://127.0.0.1:8189");
        }
        for t in targets {
            bench.extend(["--target".to_owned(), t.to_owned()]);
        }
        for (k, v) in [
            ("--workload", "agents".to_owned()),
            ("--agents", agents.to_string()),
            ("--rounds", rounds.to_string()),
            ("--tool-words", tool_words.to_string()),
            ("--prompt-words", prompt_words.to_string()),
            ("--max-tokens", max_tokens.to_string()),
            ("--repeat", repeat.to_string()),
            ("--timeout-s", "600".to_owned()),
            ("--out", out.clone()),
        ] {
            bench.extend([k.to_owned(), v]);
        }
        if offload {
            println!("agents bench: unified workers of {kv_blocks} KV blocks, at :8101 without and at :8104 with a 4 GiB offload tier");
        } else {
            println!(
                "agents bench: PD stack at :8100, unified worker at :8101{}",
                if peer_bins.is_some() { ", llama.cpp at :8189" } else { "" }
            );
        }
        crate::cargo(&bench.iter().map(String::as_str).collect::<Vec<_>>())
    })();
    for s in &mut stacks {
        stop_all(&mut s.procs, Duration::from_secs(20));
    }
    result
}
