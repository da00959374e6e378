//! `pdserve-server`: one worker serving a model over the OpenAI-compatible API.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use pdserve_engine::EngineConfig;
use pdserve_server::{run, WorkerConfig};

const USAGE: &str = "\
pdserve-server [options]

  --host ADDR              bind address (default 127.0.0.1)
  --port N                 port (default 8000; 0 picks a free one)
  --model DIR              Hugging Face model folder (default: the default model, fetched if missing)
  --model-name NAME        name clients use in `model` (default: the folder name; also --served-model-name)
  --name NAME              this process's name in /debug/requests (default worker)
  --role ROLE              unified (default), prefill or decode
  --transfer-addr ADDR     prefill role: where decode workers pull KV from (default 127.0.0.1:0)
  --kv-shm                 prefill role: KV memory in /dev/shm, so same-host decode workers copy it directly
  --kv-transport T         how KV moves to decode workers: tcp (prefill: blocks inline; the default), shm
                           (prefill: as --kv-shm) or ucx (builds with --features ucx, on both roles: the
                           prefill worker exports its KV region, decode workers read it with UCX one-sided
                           gets over RDMA, shared memory or TCP, whichever UCX finds; UCX_* variables apply).
                           Without ucx, a decode worker reads a same-host prefill worker's shm region whenever
                           it can
  --shm-scope NAME         the stack's name for its shared KV files (a-z, 0-9; default local): a decode worker
                           maps only its own stack's; give every stack on a host its own
  --device DEV             cpu (default), cuda or cuda:N: the GPU backend (bf16 weights and KV) on an NVIDIA GPU
  --weights FMT            auto (default: the checkpoint's own precision: f16 as it ships, FP8 (block-scaled
                           e4m3) and NVFP4 (e2m1, 4 bits a weight) as they ship, bf16 as it ships where the CPU
                           has AVX2 (with AVX-512 BF16: where the shapes fill its 32-row panels), else f32),
                           f32, bf16, f16, fp8, fp4, q8 or q4: bf16, f16, fp8 or fp4 for every step (fp8 of
                           another checkpoint: a scale per 128 columns; fp4: per 16), or quantized weights (groups of 32) for every step, long ones widening blocks of
                           them as they go (to bf16 where the CPU has AVX-512 BF16, else to f32); every step
                           size computes a row the same way; copies nothing reads are freed
  --activations A          f32 (default) or q8: with --weights q8 or q4, round the inputs of every step to
                           int8 in groups of 32 and sum integer products, as llama.cpp does (a row's product
                           up to 1.7x faster on CPUs without AVX-512); logits move, so greedy text may differ
  --cpu-cores LIST         run on these CPU cores only (e.g. 0-3,8; taskset's form), the compute pool one
                           thread per core: workers sharing a host never fight over cores (cargo xtask
                           serve gives each worker of a PD stack its own; /v1/models reports cpu_cores)
  --cpu-kernels NAME       the CPU kernels to run: amx, avx512, avx2 or portable (default: the best this CPU has;
                           a lower one to compare or test it; also PDSERVE_CPU_KERNELS)
  --speculative MODE       auto (default), mtp, prompt-lookup or off. mtp: the checkpoint's draft layer
                           (DeepSeek's multi-token prediction layer) guesses one token per step while up to 4
                           requests run; prompt-lookup: draft tokens from the request's own context (the last
                           2-4 tokens' latest earlier occurrence and what followed it) while one request runs;
                           auto: mtp where the checkpoint ships the layer, else prompt-lookup. Drafts are
                           verified in one multi-row step; the output is what plain decoding gives. A PD pair
                           must agree on mtp (the layer's KV travels with the prompt's). Also
                           --speculative-algorithm ngram|nextn|eagle
  --draft-tokens N         draft tokens per step at most (prompt-lookup: default 8; mtp: chained guesses,
                           default 3; also --speculative-num-draft-tokens, --speculative-num-steps)
  --kv-dtype TYPE          CPU KV cache values: f16 (default), bf16 or f32 (the reference; twice the bytes)
  --max-queued N           admission queue bound (default 256; also --max-queued-requests)
  --max-running N          running batch bound (default 64; also --max-running-requests)
  --max-batch-tokens N     tokens per engine step (default 2048; also --max-num-batched-tokens)
  --transfer-step-tokens N prefill role: tokens per step while KV transfers are live (default 256; late
                           chunks count their context's cost, see --attention-cost)
  --tool-parser FORMAT     the format tool calls are written and read in: hermes, llama3, mistral,
                           deepseek_v3, deepseek_v31, deepseek_v32 or deepseek_v4 (DSML; calls' arguments
                           stream as they arrive) (default: the chat template's; hermes for a template
                           without one)
  --responses-max N        answered /v1/responses kept for previous_response_id and GET /v1/responses/{id}
                           (default 4096; the oldest go first; 0 keeps none)
  --responses-max-mib N    ... together at most N MiB (default 256; each keeps its whole conversation)
  --responses-max-age-s S  ... and none kept longer than this (default 3600)
  --reasoning-parser NAME  how the model marks its thinking: deepseek_r1, qwen3 (both: <think> ... </think>)
                           or none (default: the chat template's: <think> spans where it writes them); the
                           thinking is answered apart (reasoning_content, thinking blocks, reasoning items)
  --max-tool-calls N       the most tool calls one answer makes with parallel calls allowed (default 8): a
                           forced call's grammar ends there, and under auto the call reaching it ends the answer
  --admission ORDER        least-work (default: the fewest uncached prompt tokens first, a request
                           overtaken for at most 60 s plus its tokens / 100 per s) or fifo
  --prefill-chunk N        prefill chunk per request per step (default 512; also --chunked-prefill-size)
  --attention-cost N       chunks shrink with their context: attending to N earlier positions counts as
                           one more token (default 1000, measured on the CPU backend; 0: tokens alone)
  --max-context N          context cap in tokens (default: the model's maximum, or what the KV pool holds if
                           less; also --context-length, --max-model-len)
  --kv-blocks N            KV cache blocks (default 1024)
  --block-size N           tokens per KV block (default 16)
  --timeout-s S            default request deadline in seconds (default 600)
  --drain-timeout-s S      how long a SIGTERM drain may take (default 30)
  --keep-alive-timeout-s S how long an idle client connection stays open (default 60)
  --kv-transfer-timeout-s S decode role: how long a request's KV may take to arrive once pulled (default
                           120); past it the request ends as timed out in kv_transfer, both sides freed
  --kv-events-config JSON  vLLM's KV events, e.g. {\"enable_kv_cache_events\": true, \"publisher\": \"zmq\",
                           \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\"}
                           (ZMQ PUB and replay sockets, msgpack in vLLM's schema)
  --kv-offloading-size GIB KV offload tier (unified and prefill roles; vLLM's flag): blocks the prefix
                           cache evicts are kept in GIB of host memory beyond the pool and copied back on
                           a prefix match instead of computed again (default 0: off; fractions allowed)
  --kv-offload-disk-gib GIB past host memory, blocks move down to a file of at most GIB (default 0)
  --kv-offload-dir DIR     where that file is made (default: the system's temporary folder)
  --otlp-traces-endpoint URL export each request's spans (the request, its queue, prefill, KV transfer,
                           decode) over OTLP/HTTP to URL (http://HOST:PORT[/PATH], /v1/traces if no
                           path), under the caller's traceparent
  --grammar-compile-timeout-s S how long a request's schema, regex or grammar may take to compile (default
                           10); past it the request is a 400 (compiles never hold up other requests)
  --exit-on-stdin-eof      stop gracefully when standard input closes (for supervisors and tests)
  --cluster-secret-file P  the stack's secret (or PDSERVE_CLUSTER_SECRET): requests without it
                           (x-pdserve-cluster-secret, which the router sends) get a 401, and a KV
                           handle (pd_transfer) is taken only with it
  --open-probes            with a secret: /health/* and /metrics answer without it
  --api-key KEY            clients call /v1/* with this key (with a secret: directly, beside the router)
  --allow-unauthenticated  serve on a non-loopback --host with neither an API key nor a cluster secret
                           (refused otherwise: anyone reaching it could use it and hand it KV handles)
";

fn main() -> ExitCode {
    match parse(std::env::args().skip(1).collect()) {
        Ok(Some(config)) => {
            let result = run(config, |addr| {
                // The line tests and `cargo xtask serve` wait for.
                println!("listening on http://{addr}");
                let _ = std::io::stdout().flush();
            });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pdserve-server: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Ok(None) => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pdserve-server: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// A core list as `taskset` and `/sys/devices/system/cpu/online` write it: `0-3,8,10-11`.
fn parse_cores(s: &str) -> Result<Vec<usize>, String> {
    let mut cores = Vec::new();
    for part in s.split(',') {
        let n = |t: &str| t.trim().parse::<usize>().map_err(|e| format!("{t:?}: {e}"));
        match part.split_once('-') {
            Some((a, b)) if n(a)? <= n(b)? => cores.extend(n(a)?..=n(b)?),
            Some(_) => return Err(format!("{part}: a range runs upwards")),
            None => cores.push(n(part)?),
        }
    }
    cores.sort_unstable();
    cores.dedup();
    if cores.len() > 4096 {
        return Err("more than 4,096 cores".into());
    }
    Ok(cores)
}

/// The options that take a value, besides `--host`, `--port`, `--model` and `--role`.
const VALUED: &[&str] = &[
    "--model-name",
    "--name",
    "--max-queued",
    "--max-running",
    "--max-batch-tokens",
    "--transfer-step-tokens",
    "--admission",
    "--tool-parser",
    "--max-tool-calls",
    "--reasoning-parser",
    "--responses-max",
    "--responses-max-mib",
    "--responses-max-age-s",
    "--prefill-chunk",
    "--attention-cost",
    "--cpu-kernels",
    "--shm-scope",
    "--max-context",
    "--kv-blocks",
    "--block-size",
    "--timeout-s",
    "--drain-timeout-s",
    "--keep-alive-timeout-s",
    "--test-panic-on",
    "--test-corrupt-kv",
    "--test-stall-transfer",
    "--test-drop-done",
    "--kv-transfer-timeout-s",
    "--grammar-compile-timeout-s",
    "--kv-events-config",
    "--kv-offloading-size",
    "--kv-offloading-backend",
    "--kv-offload-disk-gib",
    "--kv-offload-dir",
    "--otlp-traces-endpoint",
    "--api-key",
    "--cluster-secret-file",
    "--device",
    "--kv-dtype",
    "--weights",
    "--activations",
    "--transfer-addr",
    "--kv-transport",
    "--speculative",
    "--draft-tokens",
    "--cpu-cores",
];

fn parse(args: Vec<String>) -> Result<Option<WorkerConfig>, String> {
    let mut host = "127.0.0.1".to_owned();
    let mut port = 8000u16;
    let mut model: Option<PathBuf> = None;
    let mut sets: Vec<(String, String)> = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            return Ok(None);
        }
        if a == "--kv-shm" {
            sets.push((a, String::new()));
            continue;
        }
        if a == "--exit-on-stdin-eof" || a == "--open-probes" || a == "--allow-unauthenticated" {
            sets.push((a, String::new()));
            continue;
        }
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--host" => host = val()?,
            "--port" => port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--model" => model = Some(PathBuf::from(val()?)),
            "--role" => {
                let r = val()?;
                if !matches!(r.as_str(), "unified" | "prefill" | "decode") {
                    return Err(format!("--role {r}: one of unified, prefill, decode"));
                }
                sets.push(("--role".into(), r));
            }
            other => {
                // SGLang's and vLLM's names for the same settings.
                let name = match other {
                    "--max-running-requests" => "--max-running",
                    "--max-queued-requests" => "--max-queued",
                    "--context-length" | "--max-model-len" => "--max-context",
                    "--chunked-prefill-size" => "--prefill-chunk",
                    "--max-num-batched-tokens" => "--max-batch-tokens",
                    "--served-model-name" => "--model-name",
                    "--speculative-algorithm" => "--speculative",
                    "--speculative-num-draft-tokens" | "--speculative-num-steps" => "--draft-tokens",
                    n => n,
                };
                // Refused here, before the default model is fetched.
                if !VALUED.contains(&name) {
                    return Err(format!("unknown option {other}"));
                }
                let v = val()?;
                sets.push((name.to_owned(), v));
            }
        }
    }
    let addr = format!("{host}:{port}").parse().map_err(|e| format!("--host/--port: {e}"))?;
    let model_dir = match model {
        Some(m) => m,
        None => pdserve_import::fetch::ensure_default_model(
            &pdserve_import::fetch::models_dir(),
            &mut pdserve_import::StderrBar::default(),
            true,
        )
        .map_err(|e| format!("fetching the default model: {e}"))?,
    };
    let mut c = WorkerConfig::new(addr, EngineConfig::new(model_dir));
    let mut secret_file = None;
    let (mut speculative, mut draft_tokens) = (Some(pdserve_engine::DraftSource::Auto), None);
    for (k, v) in sets {
        let n = || v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
        let secs = || v.parse::<f64>().map(Duration::from_secs_f64).map_err(|e| format!("{k}: {e}"));
        let gib = || match v.parse::<f64>() {
            Ok(g) if g.is_finite() && g >= 0.0 => Ok((g * f64::from(1u32 << 30)) as usize),
            _ => Err(format!("{k} {v}: a size in GiB (0 or more)")),
        };
        let e = &mut c.engine;
        match k.as_str() {
            "--model-name" => c.model_name = v.clone(),
            "--name" => e.process_name = v.clone(),
            "--max-queued" => e.scheduler.queued_requests_max = n()?,
            "--max-running" => e.scheduler.running_requests_max = n()?,
            "--max-batch-tokens" => e.scheduler.batch_tokens_max = n()?,
            "--transfer-step-tokens" => e.transfer_step_tokens = n()?,
            "--admission" => {
                e.scheduler.admission_order = match v.as_str() {
                    "fifo" => pdserve_engine::AdmissionOrder::Fifo,
                    "least-work" => pdserve_engine::SchedulerConfig::default().admission_order,
                    other => return Err(format!("--admission {other}: fifo or least-work")),
                }
            }
            "--tool-parser" => {
                e.tool_format = Some(pdserve_engine::ToolFormat::from_name(&v).ok_or_else(|| {
                    format!("--tool-parser {v}: one of {}", pdserve_engine::ToolFormat::NAMES)
                })?)
            }
            "--max-tool-calls" => e.tool_calls_max = n()?.max(1),
            "--reasoning-parser" => {
                e.reasoning_format = Some(pdserve_engine::ReasoningFormat::from_name(&v).ok_or_else(|| {
                    format!("--reasoning-parser {v}: one of {}", pdserve_engine::ReasoningFormat::NAMES)
                })?)
            }
            "--responses-max" => c.responses_max = n()?,
            "--responses-max-mib" => c.responses_max_bytes = n()? << 20,
            "--responses-max-age-s" => c.responses_max_age = secs()?,
            "--prefill-chunk" => e.scheduler.prefill_chunk_tokens_max = n()?,
            "--attention-cost" => e.scheduler.attention_cost_positions = Some(n()?).filter(|&n| n > 0),
            "--max-context" => e.scheduler.context_tokens_max = n()?,
            "--kv-blocks" => e.kv_blocks = n()?,
            "--block-size" => e.block_size = n()?,
            "--timeout-s" => c.default_timeout = secs()?,
            "--drain-timeout-s" => c.drain_timeout = secs()?,
            "--keep-alive-timeout-s" => c.http.idle_timeout = secs()?,
            "--test-panic-on" => c.panic_trigger = Some(v.clone()),
            "--grammar-compile-timeout-s" => e.grammar_compile_timeout = secs()?,
            "--kv-events-config" => e.kv_events = pdserve_engine::KvEventsConfig::parse(&v)?,
            "--kv-offloading-size" => e.kv_offload.host_bytes = gib()?,
            "--kv-offload-disk-gib" => e.kv_offload.disk_bytes = gib()?,
            "--kv-offload-dir" => e.kv_offload.disk_dir = Some(PathBuf::from(&v)),
            // vLLM's second offloading flag: its native CPU tier is this one.
            "--kv-offloading-backend" if v == "native" => {}
            "--kv-offloading-backend" => return Err(format!("--kv-offloading-backend {v}: only `native` (the worker's own tier)")),
            "--otlp-traces-endpoint" => c.otlp_traces_endpoint = Some(pdserve_trace::Endpoint::parse(&v)?),
            "--test-corrupt-kv" => e.test_corrupt_kv_pull = n()? as u32,
            "--test-stall-transfer" => e.test_transfer_faults.stall_from = Some(n()?),
            "--test-drop-done" => e.test_transfer_faults.drop_done_from = Some(n()?),
            "--kv-transfer-timeout-s" => e.scheduler.kv_transfer_timeout = secs()?,
            "--exit-on-stdin-eof" => c.exit_on_stdin_eof = true,
            "--open-probes" => c.open_probes = true,
            "--allow-unauthenticated" => c.allow_unauthenticated = true,
            "--api-key" => c.api_key = Some(v.clone()),
            "--cluster-secret-file" => secret_file = Some(PathBuf::from(&v)),
            "--kv-shm" => e.kv_shm = true,
            "--device" => e.device = v.parse().map_err(|err: pdserve_engine::EngineError| err.to_string())?,
            "--kv-dtype" => {
                e.kv_dtype = Some(v.parse().map_err(|err: pdserve_engine::ModelError| err.to_string())?)
            }
            "--weights" => e.weights = v.parse().map_err(|err: pdserve_engine::ModelError| err.to_string())?,
            "--activations" => {
                e.int8_activations = match v.as_str() {
                    "q8" => true,
                    "f32" => false,
                    _ => return Err(format!("--activations {v}: f32 or q8")),
                }
            }
            "--shm-scope" if pdserve_engine::valid_shm_scope(&v) => e.shm_scope = v.clone(),
            "--shm-scope" => return Err(format!("--shm-scope {v}: 1 to 32 of a-z and 0-9")),
            "--cpu-kernels" => {
                let k = pdserve_engine::CpuKernels::parse(&v)
                    .ok_or_else(|| format!("--cpu-kernels {v}: {}", pdserve_engine::CpuKernels::NAMES))?;
                pdserve_engine::set_cpu_kernels(k).map_err(|err| format!("--cpu-kernels {v}: {err}"))?;
            }
            "--role" => {
                e.role = pdserve_api::Role::parse(&v).ok_or_else(|| format!("--role {v}: unknown"))?
            }
            "--transfer-addr" => e.transfer_addr = v.parse().map_err(|err| format!("{k}: {err}"))?,
            "--kv-transport" => match v.as_str() {
                "tcp" => (e.kv_shm, e.kv_ucx) = (false, false),
                "shm" => (e.kv_shm, e.kv_ucx) = (true, false),
                "ucx" if cfg!(feature = "ucx") => (e.kv_shm, e.kv_ucx) = (false, true),
                "ucx" => return Err("--kv-transport ucx: this build has no UCX (cargo build --features ucx; needs libucx-dev)".into()),
                _ => return Err(format!("--kv-transport {v}: tcp, shm or ucx")),
            },
            "--speculative" => {
                use pdserve_engine::DraftSource;
                speculative = match v.to_ascii_lowercase().as_str() {
                    "off" | "none" => None,
                    "auto" => Some(DraftSource::Auto),
                    "prompt-lookup" | "ngram" => Some(DraftSource::PromptLookup),
                    // SGLang's names for DeepSeek's MTP layer, vLLM's method name.
                    "mtp" | "nextn" | "eagle" | "deepseek_mtp" => Some(DraftSource::Model),
                    _ => return Err(format!("--speculative {v}: auto, mtp, prompt-lookup or off")),
                }
            }
            "--draft-tokens" => draft_tokens = Some(n()?.clamp(1, 64)),
            "--cpu-cores" => c.cpu_cores = Some(parse_cores(&v).map_err(|e| format!("--cpu-cores {v}: {e}"))?),
            other => return Err(format!("unknown option {other}")),
        }
    }
    c.engine.speculative = match speculative {
        Some(pdserve_engine::DraftSource::Auto) => {
            pdserve_engine::Speculative::auto(draft_tokens.unwrap_or(8))
        }
        Some(pdserve_engine::DraftSource::PromptLookup) => {
            pdserve_engine::Speculative::prompt_lookup(draft_tokens.unwrap_or(8))
        }
        Some(pdserve_engine::DraftSource::Model) => pdserve_engine::Speculative::model(
            draft_tokens.unwrap_or(pdserve_engine::MODEL_DRAFT_TOKENS),
            pdserve_engine::MODEL_DRAFT_RUNNING_MAX,
        ),
        None => pdserve_engine::Speculative::OFF,
    };
    c.cluster_secret = pdserve_api::header::cluster_secret(secret_file.as_deref())?;
    Ok(Some(c))
}
