//! `cargo xtask serve`: the stack in one command. By default the router in front of one prefill and one
//! decode worker (KV through shared memory); `--unified` runs one unified worker without a router.
//! Every child is supervised: one that dies is reported with its exit status and the last lines of its
//! log (kept as `NAME.N.log`) and started again on the same address, after a backoff that doubles
//! with each quick death (1 s to 30 s); the others keep serving and the router's probes take the
//! restarted one back. Only Ctrl-C or SIGTERM stops the stack, workers draining first. A PD stack
//! shares a cluster secret (`target/serve/cluster-secret`): its workers take requests from the router
//! only.

use std::fs::File;
use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const USAGE: &str =
    "cargo xtask serve [--unified | --prefill N --decode M] [--port N] [--model DIR] [--debug] \
                     [--divide-cores | --share-cores] [--kv-events] [--otlp-traces-endpoint URL] [-- WORKER OPTIONS]\n  --debug: the debug build (quicker to build; what the tests run)\n  \
                     --kv-events: every worker publishes its KV events (vLLM's format) and the router routes on them \
                     (precise prefix routing)\n  \
                     --divide-cores: pin each worker of a PD stack to its own share of the cores (the default from 4 cores per \
                     worker); --share-cores: every worker on every core (the default below)";

pub(crate) struct Proc {
    pub name: String,
    pub child: Child,
    /// Closing it asks the child to stop (every child runs with `--exit-on-stdin-eof`).
    pub stdin: Option<ChildStdin>,
    pub log: PathBuf,
    pub url: String,
    /// What started it, to start it again.
    pub bin: PathBuf,
    pub args: Vec<String>,
}

impl Proc {
    /// Starts `bin` and waits (up to 300 s, or until Ctrl-C) until it says where it listens.
    pub(crate) fn start(name: &str, bin: &Path, args: &[String], logs: &Path) -> Result<Proc> {
        let mut starting = Proc::spawn(name, bin, args, logs)?;
        loop {
            match starting.poll()? {
                Some(p) => return Ok(p),
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Starts `bin` without waiting for it: [`Starting::poll`] says when it listens.
    pub(crate) fn spawn(name: &str, bin: &Path, args: &[String], logs: &Path) -> Result<Starting> {
        let log = logs.join(format!("{name}.log"));
        // Its own process group: Ctrl-C reaches only this supervisor, which stops the children in order.
        let mut child = Command::new(bin)
            .process_group(0)
            .args(args)
            .arg("--exit-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {name} ({})", bin.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let (false, Some(a)) = (sent, line.strip_prefix("listening on ")) {
                    let _ = tx.send(a.to_owned());
                    sent = true;
                }
            }
        });
        let proc = Proc {
            name: name.to_owned(),
            child,
            stdin,
            log,
            url: String::new(),
            bin: bin.to_owned(),
            args: args.to_vec(),
        };
        Ok(Starting { proc: Some(proc), listening: rx, since: Instant::now() })
    }

    /// Starts this process again with the same options on the address it had; its old log is kept as
    /// `NAME.N.log` (`n`: which restart this is).
    pub(crate) fn restart(&self, n: u32) -> Result<Proc> {
        let mut starting = self.respawn(n)?;
        loop {
            match starting.poll()? {
                Some(p) => return Ok(p),
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// [`restart`](Self::restart) without waiting for it to listen.
    pub(crate) fn respawn(&self, n: u32) -> Result<Starting> {
        let logs = self.log.parent().context("log folder")?;
        let _ = std::fs::rename(&self.log, logs.join(format!("{}.{n}.log", self.name)));
        let port = self.url.rsplit(':').next().unwrap_or("0").trim_end_matches('/').to_owned();
        let mut args = self.args.clone();
        if let Some(i) = args.iter().position(|a| a == "--port") {
            args[i + 1] = port;
        }
        Proc::spawn(&self.name, &self.bin, &args, logs)
    }

    pub(crate) fn death_report(&self, status: ExitStatus) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        format!(
            "{} exited with {status}; last lines of {}:\n{}",
            self.name,
            self.log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }
}

/// A process started but not yet listening.
pub(crate) struct Starting {
    proc: Option<Proc>,
    listening: mpsc::Receiver<String>,
    since: Instant,
}

impl Starting {
    /// The process once it listens (`Some`), `None` while it starts; an error if it exited, took over
    /// 300 s, or Ctrl-C came (then it is killed).
    pub(crate) fn poll(&mut self) -> Result<Option<Proc>> {
        let Some(p) = self.proc.as_mut() else { bail!("already started") };
        if let Ok(url) = self.listening.try_recv() {
            p.url = url;
            return Ok(self.proc.take());
        }
        if let Some(status) = p.child.try_wait()? {
            bail!("{}", p.death_report(status));
        }
        if self.since.elapsed() > Duration::from_secs(300) || crate::sys::stop_requested() {
            let _ = p.child.kill();
            let _ = p.child.wait();
            bail!("{} did not start within 300 s; see {}", p.name, p.log.display());
        }
        Ok(None)
    }

    /// The process it is starting (to stop it with the others).
    pub(crate) fn proc_mut(&mut self) -> Option<&mut Proc> {
        self.proc.as_mut()
    }
}

/// Asks every child to stop (stdin closed: workers drain), waits up to `grace`, then kills what is left.
pub(crate) fn stop_all(procs: &mut [Proc], grace: Duration) {
    // The router first: it drains what it has in flight through workers that still serve (a
    // draining worker refuses new legs, also those of requests the router already holds); then the
    // workers, each phase within `grace`.
    for router in [true, false] {
        let phase = |p: &&mut Proc| (p.name == "router") == router;
        for p in procs.iter_mut().filter(phase) {
            p.stdin = None;
        }
        let until = Instant::now() + grace;
        for p in procs.iter_mut().filter(phase) {
            while Instant::now() < until {
                if let Ok(Some(_)) = p.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Ok(None) = p.child.try_wait() {
                eprintln!("{} did not stop within {grace:?}; killing it", p.name);
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// `GET path` on `base` (`http://host:port`), returning the status code.
pub(crate) fn http_status(base: &str, path: &str) -> Option<u16> {
    crate::where_::get(base, path).ok().map(|(status, _)| status)
}

/// One stack to start: a unified worker, or the router in front of prefill and decode workers.
pub(crate) struct Spec<'a> {
    pub port: u16,
    pub model: &'a Path,
    /// Serve the default model from its own Q4 blocks (`--weights q4`).
    pub native_q4: bool,
    pub unified: bool,
    pub prefills: usize,
    pub decodes: usize,
    /// Passed to every worker.
    pub extra: &'a [String],
    pub logs: &'a Path,
    /// A PD stack: give the router and the workers a fresh cluster secret (a file in `logs`), so the
    /// workers serve the router only.
    pub secret: bool,
    /// The worker binary to run (default: `pdserve-server` in `bin_dir`).
    pub server_bin: Option<&'a Path>,
    /// Where the binaries are (default: this checkout's `target/release`).
    pub bin_dir: Option<&'a Path>,
    /// Passed to the router.
    pub router_extra: &'a [String],
    /// A PD stack's cores (`None`: [`core_plan`]'s rule; `Some(true)`: each worker its own share;
    /// `Some(false)`: every worker on every core).
    pub divide_cores: Option<bool>,
}

impl<'a> Spec<'a> {
    /// One unified worker of `model` on `port` (this checkout's binary), `extra` passed to it.
    pub(crate) fn unified_worker(
        port: u16,
        model: &'a Path,
        extra: &'a [String],
        logs: &'a Path,
    ) -> Spec<'a> {
        Spec {
            port,
            model,
            native_q4: false,
            unified: true,
            prefills: 0,
            decodes: 0,
            extra,
            logs,
            secret: false,
            server_bin: None,
            bin_dir: None,
            router_extra: &[],
            divide_cores: None,
        }
    }
}

/// A started stack: its processes and the URL clients use.
pub(crate) struct Stack {
    pub procs: Vec<Proc>,
    pub url: String,
}

/// `n` random bytes from the kernel, in hex.
fn random_hex(n: usize) -> Result<String> {
    use std::io::Read as _;
    let mut bytes = vec![0u8; n];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A new random cluster secret in `dir/cluster-secret.PID`, readable by this user only.
fn write_secret(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let hex = random_hex(32)?;
    // One file per stack (its supervisor's pid): a second stack sharing the folder never changes the
    // secret a restarted process of this one reads.
    let path = dir.join(format!("cluster-secret.{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
    f.write_all(hex.as_bytes())?;
    Ok(path)
}

/// Starts the processes of `spec` from the release binaries and waits until the stack is ready (for a
/// router: a request went through the whole path). On any failure, what was started is stopped.
/// Cores per worker from which a PD stack's workers get cores of their own by default. Below it they
/// share every core: on 2 cores, one core each (prefill and decode pinned) gave 0.82x the requests/s
/// of sharing in the agents benchmark (`cargo xtask bench agents --divided-cores`), since a prompt's
/// prefill then cannot use the core an idle decode worker leaves; with 4 or more each, a worker's
/// share is a machine of its own and two pools no longer oversubscribe the same cores.
pub(crate) const DIVIDE_FROM_CORES_PER_WORKER: usize = 4;

/// The default plan of a PD stack's cores: [`divide_cores`] where every worker gets at least
/// [`DIVIDE_FROM_CORES_PER_WORKER`] cores, else `None` (they share).
pub(crate) fn core_plan(cores: &[usize], prefills: usize, decodes: usize) -> Option<Vec<Vec<usize>>> {
    (cores.len() >= DIVIDE_FROM_CORES_PER_WORKER * (prefills + decodes))
        .then(|| divide_cores(cores, prefills, decodes))
        .flatten()
}

/// The cores each worker of a PD stack on one host runs on (`--cpu-cores`), prefill workers first,
/// so that no two workers' compute pools fight over a core (each sizes its pool to its share).
/// With at least one core per worker, each gets `n / workers` contiguous cores and the prefill
/// workers the remainder (prompts are compute-bound; decode steps read weights). With fewer, the
/// prefill workers share the first half (rounded up) and the decode workers the rest. `None` on one
/// core, or where the mask cannot be read: the workers share what there is.
pub(crate) fn divide_cores(cores: &[usize], prefills: usize, decodes: usize) -> Option<Vec<Vec<usize>>> {
    let (n, workers) = (cores.len(), prefills + decodes);
    if n < 2 || workers == 0 {
        return None;
    }
    if n < workers {
        let split = n.div_ceil(2).min(n - 1);
        let (p, d) = cores.split_at(split);
        return Some((0..workers).map(|w| if w < prefills { p.to_vec() } else { d.to_vec() }).collect());
    }
    let (base, extra) = (n / workers, n % workers);
    // The remainder to prefill workers, one each (round-robin while it lasts).
    let mut shares: Vec<usize> = (0..workers).map(|_| base).collect();
    for i in 0..extra {
        shares[i % prefills.max(1)] += 1;
    }
    let mut at = 0;
    Some(
        shares
            .into_iter()
            .map(|k| {
                at += k;
                cores[at - k..at].to_vec()
            })
            .collect(),
    )
}

/// `taskset`'s form of a core list: `0-3,8`.
pub(crate) fn core_list(cores: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cores[i].to_string() } else { format!("{}-{}", cores[i], cores[j]) });
        i = j + 1;
    }
    out.join(",")
}

/// Builds what a benchmark of stacks runs (release): the worker, the router and the load generator.
pub(crate) fn build_stack() -> Result<()> {
    crate::cargo(&[
        "build",
        "--release",
        "-p",
        "pdserve-server",
        "-p",
        "pdserve-router",
        "-p",
        "pdserve-loadgen",
    ])
}

pub(crate) fn start_stack(spec: &Spec<'_>) -> Result<Stack> {
    std::fs::create_dir_all(spec.logs)?;
    let secret = if spec.secret && !spec.unified { Some(write_secret(spec.logs)?) } else { None };
    // The stack's own name for its shared KV files: no other stack's decode worker maps them.
    let scope = format!("s{:08x}{}", std::process::id(), random_hex(4)?);
    let bins = spec.bin_dir.map_or_else(|| crate::workspace_root().join("target/release"), Path::to_path_buf);
    let server_bin = spec.server_bin.map_or_else(|| bins.join("pdserve-server"), Path::to_path_buf);
    let router_bin = bins.join("pdserve-router");
    let worker_args = |name: &str, role: &str, port: u16| -> Vec<String> {
        let mut a: Vec<String> = ["--port", &port.to_string(), "--name", name, "--role", role, "--model"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        a.push(spec.model.display().to_string());
        if role == "prefill" {
            a.push("--kv-shm".into());
        }
        if role != "unified" {
            a.extend(["--shm-scope".to_owned(), scope.clone()]);
        }
        if spec.native_q4 {
            a.extend(["--weights".to_owned(), "q4".to_owned()]);
        }
        if let Some(s) = &secret {
            a.extend(["--cluster-secret-file".to_owned(), s.display().to_string()]);
        }
        a.extend(spec.extra.iter().cloned());
        a
    };
    let logs = spec.logs;
    let mut procs: Vec<Proc> = Vec::new();
    let result = (|| -> Result<String> {
        if spec.unified {
            let args = worker_args("worker", "unified", spec.port);
            procs.push(Proc::start("worker", &server_bin, &args, logs)?);
            return Ok(procs[0].url.clone());
        }
        let mut router_args = vec!["--port".to_owned(), spec.port.to_string()];
        router_args.extend(spec.router_extra.iter().cloned());
        if let Some(s) = &secret {
            router_args.extend(["--cluster-secret-file".to_owned(), s.display().to_string()]);
        }
        // Each worker its own cores, unless the caller pins them itself.
        let cores = crate::sys::allowed_cores();
        let plan = match (spec.extra.iter().any(|a| a == "--cpu-cores"), spec.divide_cores) {
            (true, _) | (false, Some(false)) => None,
            (false, Some(true)) => divide_cores(&cores, spec.prefills, spec.decodes),
            (false, None) => core_plan(&cores, spec.prefills, spec.decodes),
        };
        let mut worker = 0;
        for (role, n) in [("prefill", spec.prefills), ("decode", spec.decodes)] {
            for i in 0..n {
                let name = format!("{role}-{i}");
                let mut args = worker_args(&name, role, 0);
                if let Some(cores) = plan.as_ref().map(|p| &p[worker]) {
                    args.extend(["--cpu-cores".to_owned(), core_list(cores)]);
                }
                worker += 1;
                let p = Proc::start(&name, &server_bin, &args, logs)?;
                router_args.push(format!("--{role}"));
                router_args.push(p.url.clone());
                procs.push(p);
            }
        }
        let router = Proc::start("router", &router_bin, &router_args, logs)?;
        let url = router.url.clone();
        procs.push(router);
        Ok(url)
    })();
    let url = match result {
        Ok(u) => u,
        Err(e) => {
            stop_all(&mut procs, Duration::from_secs(10));
            return Err(e);
        }
    };
    let started = Instant::now();
    while http_status(&url, "/health/ready") != Some(200) {
        if started.elapsed() > Duration::from_secs(120) || crate::sys::stop_requested() {
            stop_all(&mut procs, Duration::from_secs(10));
            bail!("{url} did not become ready within 120 s; logs are in {}", logs.display());
        }
        for i in 0..procs.len() {
            if let Some(status) = procs[i].child.try_wait()? {
                let report = procs[i].death_report(status);
                stop_all(&mut procs, Duration::from_secs(10));
                bail!("{report}");
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Stack { procs, url })
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut port = 8000u16;
    let mut model: Option<PathBuf> = None;
    let mut unified = false;
    let mut debug = false;
    let mut divide_cores = None;
    let mut otlp: Option<String> = None;
    let mut kv_events = false;
    let (mut prefills, mut decodes) = (1usize, 1usize);
    let mut extra: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--unified" => unified = true,
            "--debug" => debug = true,
            "--divide-cores" => divide_cores = Some(true),
            "--share-cores" => divide_cores = Some(false),
            "--kv-events" => kv_events = true,
            "--otlp-traces-endpoint" => {
                let url = it.next().context("--otlp-traces-endpoint needs a URL")?;
                otlp = Some(url.clone());
            }
            "--port" => port = it.next().context("--port needs a value")?.parse()?,
            "--model" => model = Some(PathBuf::from(it.next().context("--model needs a value")?)),
            "--prefill" => prefills = it.next().context("--prefill needs a count")?.parse()?,
            "--decode" => decodes = it.next().context("--decode needs a count")?.parse()?,
            "--" => extra.extend(it.by_ref().cloned()),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    if !unified && (prefills == 0 || decodes == 0) {
        bail!("PD mode needs at least one prefill and one decode worker (or --unified)");
    }
    // The default model ships as Q4_1 (projections) and Q8_0 (embedding): its Q4 decode weights are
    // exactly those values, so it is served from them unless the options say otherwise.
    let native_q4 = model.is_none() && !extra.iter().any(|a| a == "--weights" || a == "--device");
    let model = match model {
        Some(m) => m,
        None => crate::fetch_model(&[])?,
    };
    let profile = if debug { "debug" } else { "release" };
    eprintln!("serve: building pdserve-server and pdserve-router ({profile}; a fresh clone's first build takes a few minutes)");
    if debug {
        crate::cargo(&["build", "-p", "pdserve-server", "-p", "pdserve-router"])?;
    } else {
        crate::cargo(&["build", "--release", "-p", "pdserve-server", "-p", "pdserve-router"])?;
    }
    let bin_dir = crate::workspace_root().join("target").join(profile);
    // Every process exports its spans to the same collector.
    let otlp_args: Vec<String> =
        otlp.iter().flat_map(|u| ["--otlp-traces-endpoint".to_owned(), u.clone()]).collect();
    extra.extend(otlp_args.iter().cloned());
    let mut router_extra = otlp_args.clone();
    if kv_events {
        // Each worker publishes on ports of its own (its card names them); the router follows them
        // all, tokenizing prompts with the model's tokenizer.
        extra.extend([
            "--kv-events-config".to_owned(),
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#
                .to_owned(),
        ]);
        router_extra.extend(["--tokenizer".to_owned(), model.display().to_string()]);
    }
    crate::sys::install_stop_handler();
    let logs = crate::workspace_root().join("target/serve");
    let spec = Spec {
        port,
        model: &model,
        native_q4,
        unified,
        prefills,
        decodes,
        extra: &extra,
        logs: &logs,
        secret: true,
        server_bin: None,
        bin_dir: Some(&bin_dir),
        router_extra: &router_extra,
        divide_cores,
    };
    let Stack { mut procs, url } = start_stack(&spec)?;
    let mut out = std::io::stdout().lock();
    let shape = if unified {
        "one unified worker".to_owned()
    } else {
        format!("the router, {prefills} prefill and {decodes} decode workers (KV through shared memory)")
    };
    writeln!(out, "pdserve is serving {} at {url} ({shape})", model.display())?;
    for p in &procs {
        let cores = p.args.iter().position(|a| a == "--cpu-cores").and_then(|i| p.args.get(i + 1));
        let cores = cores.map_or_else(String::new, |c| format!("cores {c:<8}"));
        writeln!(out, "  {:<10} {:<28} {cores} log: {}", p.name, p.url, p.log.display())?;
    }
    if !unified {
        let n = crate::sys::allowed_cores().len();
        let workers = prefills + decodes;
        if procs.iter().any(|p| p.args.iter().any(|a| a == "--cpu-cores")) {
            writeln!(out, "the {n} cores are divided between the workers, each pinned to its own (--share-cores: all share)")?;
        } else {
            writeln!(
                out,
                "the workers share this host's {n} core(s): fewer than {DIVIDE_FROM_CORES_PER_WORKER} per worker for {workers} (--divide-cores pins each to its own)"
            )?;
        }
    }
    writeln!(out, "try:\n  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"max_tokens\":32,\"temperature\":0}}'")?;
    if !unified {
        writeln!(out, "where is every request:  cargo xtask where --url {url}")?;
    }
    writeln!(out, "A process that dies is started again; Ctrl-C stops everything.")?;
    drop(out);
    supervise(&mut procs)
}

/// Restarts of one process: how many, when the current one started, when the next is due, and the one
/// starting now.
struct Restarts {
    count: u32,
    started: Instant,
    backoff: Duration,
    due: Option<Instant>,
    starting: Option<Starting>,
}

/// Watches `procs` until Ctrl-C or SIGTERM (then stops them all, workers draining first): a process
/// that exits is reported and started again on its address after its backoff (1 s, doubled after
/// each death within a minute of its start, at most 30 s). A restart is never waited on: the others
/// are watched (and may be restarted) while it loads.
fn supervise(procs: &mut [Proc]) -> Result<()> {
    let now = Instant::now();
    let mut state: Vec<Restarts> = procs
        .iter()
        .map(|_| Restarts {
            count: 0,
            started: now,
            backoff: Duration::from_secs(1),
            due: None,
            starting: None,
        })
        .collect();
    loop {
        if crate::sys::stop_requested() {
            eprintln!("stopping: workers drain their requests first");
            for r in &mut state {
                if let Some(p) = r.starting.as_mut().and_then(Starting::proc_mut) {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                }
            }
            stop_all(procs, Duration::from_secs(40));
            return Ok(());
        }
        for (p, r) in procs.iter_mut().zip(state.iter_mut()) {
            let now = Instant::now();
            if let Some(starting) = r.starting.as_mut() {
                match starting.poll() {
                    Ok(None) => {}
                    Ok(Some(new)) => {
                        eprintln!("{} is back at {} (restart {})", new.name, new.url, r.count);
                        *p = new;
                        r.starting = None;
                        r.started = now;
                    }
                    Err(e) => {
                        eprintln!("restarting {} failed: {e:#}; trying again in {:?}", p.name, r.backoff);
                        r.starting = None;
                        r.due = Some(now + r.backoff);
                        r.backoff = (r.backoff * 2).min(Duration::from_secs(30));
                    }
                }
                continue;
            }
            if r.due.is_none() {
                if let Some(status) = p.child.try_wait()? {
                    if now.duration_since(r.started) > Duration::from_secs(60) {
                        r.backoff = Duration::from_secs(1);
                    }
                    eprintln!("{}\nrestarting {} in {:?}", p.death_report(status), p.name, r.backoff);
                    r.due = Some(now + r.backoff);
                    r.backoff = (r.backoff * 2).min(Duration::from_secs(30));
                }
                continue;
            }
            if r.due.is_some_and(|d| now >= d) {
                r.count += 1;
                r.due = None;
                match p.respawn(r.count) {
                    Ok(s) => r.starting = Some(s),
                    Err(e) => {
                        eprintln!("restarting {} failed: {e:#}; trying again in {:?}", p.name, r.backoff);
                        r.due = Some(now + r.backoff);
                        r.backoff = (r.backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_are_divided_without_overlap_prefill_first() {
        let c = |n: usize| (0..n).collect::<Vec<_>>();
        assert_eq!(divide_cores(&c(2), 1, 1), Some(vec![vec![0], vec![1]]));
        assert_eq!(divide_cores(&c(16), 1, 1), Some(vec![c(8), (8..16).collect()]));
        // The remainder goes to the prefill workers.
        assert_eq!(divide_cores(&c(7), 1, 2), Some(vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]]));
        assert_eq!(divide_cores(&c(8), 2, 1), Some(vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]));
        // Fewer cores than workers: the prefill workers share the first half, the decode workers the rest.
        assert_eq!(divide_cores(&c(2), 1, 2), Some(vec![vec![0], vec![1], vec![1]]));
        assert_eq!(divide_cores(&c(3), 2, 2), Some(vec![vec![0, 1], vec![0, 1], vec![2], vec![2]]));
        assert_eq!(divide_cores(&c(1), 1, 1), None);
        // The mask's own numbers, not 0..n.
        assert_eq!(divide_cores(&[2, 3, 6, 7], 1, 1), Some(vec![vec![2, 3], vec![6, 7]]));
        assert_eq!(core_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(core_list(&[5]), "5");
        // The default: divided only from 4 cores per worker.
        assert_eq!(core_plan(&c(2), 1, 1), None);
        assert_eq!(core_plan(&c(7), 1, 1), None);
        assert_eq!(core_plan(&c(8), 1, 1), Some(vec![c(4), (4..8).collect()]));
    }
}
