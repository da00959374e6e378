//! `pdserve-router`: the front door in front of unified workers or prefill + decode pools.

use std::io::{Read as _, Write as _};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;

mod sys;

use pdserve_router::{DiscoverSpec, PolicyKind, ResolverConf, Role, Router, RouterConfig, WorkerSpec};

const USAGE: &str = "\
pdserve-router [options]

  --host ADDR                   bind address (default 127.0.0.1)
  --port N                      port (default 8000; 0 picks a free one)
  --worker URL                  a unified worker (repeatable)
  --prefill URL                 a prefill worker (repeatable)
  --decode URL                  a decode worker (repeatable)
  --discover [ROLE=]dns:NAME:PORT
                                workers of ROLE (unified when not named) are NAME's DNS addresses
                                (A/AAAA) at PORT, e.g. a Kubernetes headless Service; re-read every
                                --discover-interval-s: new addresses join, vanished ones drain (repeatable)
  --discover-interval-s S       how often --discover names are looked up again (default 5)
  --dns-server IP[:PORT]        where --discover names are looked up (default: /etc/resolv.conf's)
  --policy NAME                 round_robin, least_outstanding, power_of_two, cache_aware (default)
  --max-in-flight N             requests dispatched to workers at once (default 1024)
  --max-queued N                requests waiting for a slot; more get 429 (default 1024)
  --queue-timeout-s S           longest wait in the queue (default 10)
  --request-timeout-s S         deadline when the client sets no `timeout`, and its maximum (default 600)
  --connect-timeout-s S         bound on connecting to a worker (default 1)
  --connections-per-worker N    pooled connections per worker; beyond it 503 (default 512)
  --retries N                   connect-refused retries on other workers (default 2)
  --migrations N                moves of a request to another worker when its worker dies, stalls
                                or loses the KV mid-request (default 2; 0 turns migration off)
  --stall-timeout-s S           a stream with no token for S seconds (after its first) has stalled
                                and moves on (default 30; 0: never)
  --max-local-prefill-bytes N   PD pools: a conversation's next round goes to the decode worker holding
                                its history alone, which computes the new tail itself, when that tail is
                                at most N bytes of prompt text (default 4096, about 1,000 tokens; 0: every
                                request goes through a prefill worker). Needs --policy cache_aware
  --tokenizer DIR               precise prefix routing (--policy cache_aware): the served model's folder
                                (tokenizer.json, tokenizer_config.json); the router subscribes to the
                                KV events of workers that publish them (--kv-events-config there) and
                                routes on what their caches hold, tokenizing each prompt as they do;
                                workers that publish none are routed by the prompts sent there
  --otlp-traces-endpoint URL    export each request's spans (queue, legs, migrations, retries) over
                                OTLP/HTTP to URL (http://HOST:PORT[/PATH], /v1/traces if no path),
                                under the client's traceparent; each leg passes its span on
  --probe-interval-s S          active health probe interval (default 1)
  --probe-timeout-s S           deadline of one probe (default 3)
  --pair-probe-interval-s S     prefill + decode pair probe interval (default 5; real traffic counts too);
                                each one's deadline is this or --probe-timeout-s, the longer
  --responses-max N             answered /v1/responses kept for previous_response_id and GET
                                /v1/responses/{id} (default 4096; the oldest go first; 0 keeps none)
  --responses-max-mib N         ... together at most N MiB (default 256; each keeps its whole conversation)
  --responses-max-age-s S       ... and none kept longer than this (default 3600)
  --failures-to-open N          consecutive request failures that take a worker out (default 3)
  --api-key KEY                 bearer key for /v1/* (or PDSERVE_API_KEY)
  --admin-key KEY               bearer key for /workers and /debug/* (or PDSERVE_ADMIN_KEY)
  --cluster-secret-file PATH    the stack's secret, sent on every request to a worker (or
                                PDSERVE_CLUSTER_SECRET); workers started with it refuse requests without it
  --name NAME                   this process's name in /debug/requests (default router)
  --log-requests                one line per failed or finished request on stderr
  --drain-timeout-s S           after SIGTERM/SIGINT: new requests get 503, /health/ready turns 503, and
                                requests in flight get S seconds to finish (default 30); those left
                                then end with an explicit 503 error
  --exit-on-stdin-eof           drain (as on SIGTERM) when standard input closes (for supervisors and
                                tests)
";

fn main() -> ExitCode {
    let (cfg, exit_on_eof) = match parse(std::env::args().skip(1).collect()) {
        Ok(Some(c)) => c,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("pdserve-router: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut router = match Router::bind(cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pdserve-router: {e}");
            return ExitCode::FAILURE;
        }
    };
    sys::install_termination_handler();
    let drain = router.drain_flag();
    std::thread::spawn(move || {
        while !sys::terminate_requested() {
            std::thread::sleep(Duration::from_millis(20));
        }
        drain.store(true, Ordering::Relaxed);
    });
    if exit_on_eof {
        let drain = router.drain_flag();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            drain.store(true, Ordering::Relaxed);
        });
    }
    match router.local_addr() {
        Ok(addr) => {
            println!("listening on http://{addr}");
            let _ = std::io::stdout().flush();
        }
        Err(e) => eprintln!("pdserve-router: {e}"),
    }
    match router.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pdserve-router: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse(args: Vec<String>) -> Result<Option<(RouterConfig, bool)>, String> {
    let mut c = RouterConfig::default();
    let mut host = "127.0.0.1".to_owned();
    let mut port = 8000u16;
    let mut exit_on_eof = false;
    let mut secret_file = None;
    c.api_key = std::env::var("PDSERVE_API_KEY").ok().filter(|k| !k.is_empty());
    c.admin_key = std::env::var("PDSERVE_ADMIN_KEY").ok().filter(|k| !k.is_empty());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--exit-on-stdin-eof" => {
                exit_on_eof = true;
                continue;
            }
            "--log-requests" => {
                c.log_requests = true;
                continue;
            }
            _ => {}
        }
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        let n = || v.parse::<usize>().map_err(|e| format!("{a} {v}: {e}"));
        let secs = || {
            v.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| format!("{a} {v}: a positive number of seconds"))
        };
        match a.as_str() {
            "--host" => host = v.clone(),
            "--port" => port = v.parse().map_err(|e| format!("--port: {e}"))?,
            "--worker" => c.workers.push(WorkerSpec { url: v.clone(), role: Role::Unified }),
            "--prefill" => c.workers.push(WorkerSpec { url: v.clone(), role: Role::Prefill }),
            "--decode" => c.workers.push(WorkerSpec { url: v.clone(), role: Role::Decode }),
            "--discover" => c.discover.push(DiscoverSpec::parse(&v).map_err(|e| format!("--discover {e}"))?),
            "--discover-interval-s" => c.discover_interval = secs()?,
            "--dns-server" => {
                let addr = v
                    .parse::<std::net::SocketAddr>()
                    .or_else(|_| v.parse::<std::net::IpAddr>().map(|ip| (ip, 53).into()))
                    .map_err(|_| format!("--dns-server {v}: expected IP or IP:PORT"))?;
                c.resolver = Some(ResolverConf::server(addr));
            }
            "--policy" => c.policy = PolicyKind::parse(&v).ok_or_else(|| format!("--policy {v}: unknown"))?,
            "--max-in-flight" => c.admission.in_flight_max = n()?,
            "--max-queued" => c.admission.queued_max = n()?,
            "--queue-timeout-s" => c.admission.queue_timeout = secs()?,
            "--request-timeout-s" => c.request_timeout_max = secs()?,
            "--connect-timeout-s" => c.connect_timeout = secs()?,
            "--connections-per-worker" => c.connections_per_worker_max = n()?.max(1),
            "--retries" => c.retries_max = n()? as u32,
            "--migrations" => c.migrations_max = n()? as u32,
            "--max-local-prefill-bytes" => c.max_local_prefill_bytes = n()?,
            "--tokenizer" => c.tokenizer = Some(std::path::PathBuf::from(&v)),
            "--otlp-traces-endpoint" => c.otlp_traces_endpoint = Some(pdserve_trace::Endpoint::parse(&v)?),
            "--stall-timeout-s" => {
                c.stall_timeout = match v.parse::<f64>() {
                    Ok(0.0) => None,
                    _ => Some(secs()?),
                }
            }
            "--probe-interval-s" => c.probe_interval = secs()?,
            "--probe-timeout-s" => c.probe_timeout = secs()?,
            "--pair-probe-interval-s" => c.pair_probe_interval = secs()?,
            "--responses-max" => c.responses_max = n()?,
            "--responses-max-mib" => c.responses_max_bytes = n()? << 20,
            "--responses-max-age-s" => c.responses_max_age = secs()?,
            "--failures-to-open" => c.breaker.failures_to_open = n()?.max(1) as u32,
            "--api-key" => c.api_key = Some(v.clone()),
            "--admin-key" => c.admin_key = Some(v.clone()),
            "--cluster-secret-file" => secret_file = Some(std::path::PathBuf::from(&v)),
            "--name" => c.process_name = v.clone(),
            "--drain-timeout-s" => c.drain_timeout = secs()?,
            other => return Err(format!("unknown option {other}")),
        }
    }
    c.cluster_secret = pdserve_api::header::cluster_secret(secret_file.as_deref())?;
    c.listen = format!("{host}:{port}").parse().map_err(|e| format!("--host/--port: {e}"))?;
    Ok(Some((c, exit_on_eof)))
}
