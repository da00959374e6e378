//! `k8s_topology`: the Kubernetes deployment (`deploy/k8s/pdserve.yaml`) run for real, with network
//! namespaces as nodes. Every pod's command line is the manifest's (the downward API's `$(POD_IP)`
//! and `$(POD_NAME)`, the image's model folder and the mounted Secret replaced by their local
//! counterparts), so an option that does not exist fails here; each pod gets its own namespace and
//! address on a bridge, and a DNS server (dnsmasq) plays the cluster DNS: the headless Services'
//! names resolve to the pods that passed their readiness probe, through each node's own
//! `resolv.conf` (kubelet's search list and `ndots:5`). Checked: every probe path of every
//! container answers 200 on its named port; the router finds both pools through DNS and serves; a
//! decode pod terminated as Kubernetes does it (its record leaves DNS, the preStop pause, SIGTERM)
//! while streams run loses none of them and exits within its grace period; the router, terminated
//! the same way with streams in flight, finishes them and exits.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::deploy::manifests::{self, Params};
use crate::serve::Proc;

use super::netns::Netns;
use super::*;

const SUBNET: &str = "10.79.0";

/// One pod: its node (network namespace), address, component and process.
struct Pod {
    name: String,
    component: &'static str,
    ip: String,
}

pub(super) fn k8s_topology(bins: &(PathBuf, PathBuf), model: &Path, short: bool) -> Result<Row> {
    let p = Params { routers: 1, prefill: 1, decode: 2, ..Params::default() };
    let objects = manifests::objects(&p);
    let tag = std::process::id() % 10000;
    let pods: Vec<Pod> =
        [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"), ("router-0", "router")]
            .iter()
            .enumerate()
            .map(|(i, (name, component))| Pod {
                name: (*name).into(),
                component,
                ip: format!("{SUBNET}.{}", 10 + i),
            })
            .collect();
    let logs = crate::workspace_root().join("target/chaos/k8s_topology");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;

    // The nodes: a bridge in the root namespace (the host reaches every pod), one namespace per pod.
    let net = Network::create(tag, &pods, &p)?;
    let mut dns = ClusterDns::start(&logs)?;
    let secret = logs.join("cluster-secret");
    std::fs::write(&secret, format!("k8s-topology-{tag}-{:?}", Instant::now()))?;

    let start = |pod: &Pod| -> Result<Proc> {
        let cmd = manifests::command(&p, pod.component);
        let bin = if pod.component == "router" { &bins.1 } else { &bins.0 };
        let mut args = vec!["netns".to_owned(), "exec".to_owned(), net.ns(pod), bin.display().to_string()];
        args.extend(cmd[1..].iter().map(|a| {
            a.replace("$(POD_IP)", &pod.ip)
                .replace("$(POD_NAME)", &pod.name)
                .replace(manifests::MODEL_DIR, &model.display().to_string())
                .replace(manifests::SECRET_FILE, &secret.display().to_string())
        }));
        let mut proc = Proc::start(&pod.name, Path::new("ip"), &args, &logs)?;
        proc.url = format!("http://{}:{}", pod.ip, manifests::HTTP_PORT);
        Ok(proc)
    };
    let mut s = Stack {
        procs: Vec::new(),
        router: String::new(),
        logs: logs.clone(),
        bins: bins.clone(),
        model: model.to_owned(),
        worker_extra: Vec::new(),
        decode_extra: Vec::new(),
    };
    for pod in &pods {
        s.procs.push(start(pod)?);
    }
    s.router = s.url_of("router-0");

    // The kubelet's probes; a worker that passes readiness joins its Service's DNS records.
    let mut probed = 0;
    for pod in &pods {
        let c = container(&objects, pod.component)?;
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            if c[probe].is_null() {
                continue;
            }
            let port = named_port(c, c[probe]["httpGet"]["port"].as_str().unwrap_or_default())?;
            let url = format!("http://{}:{port}", pod.ip);
            let path = c[probe]["httpGet"]["path"].as_str().context("probe path")?;
            wait_status(&url, path, 200, Duration::from_secs(90))
                .with_context(|| format!("{} {probe} {path}", pod.name))?;
            probed += 1;
        }
        if pod.component != "router" {
            dns.add(&manifests::pool_dns(&p, pod.component), &pod.ip)?;
        }
    }
    let took_ready = s.wait_ready(true, Duration::from_secs(60))?;
    let (_, body) = crate::where_::get(&s.router, "/workers")?;
    let listed: Value = serde_json::from_slice(&body)?;
    let found = listed["workers"].as_array().map_or(0, Vec::len);
    ensure!(found == 3, "the router found {found} workers through DNS, not 3: {listed}");

    // A decode pod terminated the Kubernetes way while streams run. The streams must still run when
    // SIGTERM comes (after the preStop pause) and end within the drain: their length follows this
    // machine's speed, measured with the same number of streams first.
    let n = if short { 6 } else { 16 };
    let max_tokens = stream_tokens(&s.router, n)?;
    let decode0 = pods.iter().find(|p| p.name == "decode-0").context("decode-0")?;
    let pool = manifests::pool_dns(&p, "decode");
    let mut term_error = None;
    let mut running_at_term = 0.0;
    let mut outcomes = streams(&s.router.clone(), n, max_tokens, 120.0, || {
        std::thread::sleep(Duration::from_millis(1500));
        let result = dns.remove(&pool, &decode0.ip).and_then(|()| {
            std::thread::sleep(Duration::from_secs(u64::from(manifests::PRESTOP_SLEEP_S)));
            running_at_term = stack::Metrics::read(&s.url_of("decode-0"))?.value("requests_running")?;
            s.signal("decode-0", "-TERM")
        });
        term_error = result.err();
    });
    if let Some(e) = term_error {
        return Err(e);
    }
    ensure!(running_at_term > 0.0, "decode-0 had no stream left when SIGTERM came: nothing was drained");
    let exited = wait_exit(&mut s, "decode-0", Duration::from_secs(u64::from(manifests::GRACE_S)))?;
    ensure!(exited.success(), "decode-0 exited with {exited} after SIGTERM");
    let row = tally(&outcomes);
    ensure!(
        row.completed == row.sent,
        "{} of {} streams failed across the decode pod's termination: {}",
        row.sent - row.completed,
        row.sent,
        failures(&outcomes)
    );
    wait_for_workers(&s.router, 2)?;
    s.procs.retain(|p| p.name != "decode-0");
    after_recovery(&s.router)?;

    // The router terminated the same way with streams in flight: they finish, then it exits.
    let mut router_error = None;
    outcomes.extend(streams(&s.router.clone(), 4, 32, 60.0, || {
        std::thread::sleep(Duration::from_millis(800));
        router_error = s.signal("router-0", "-TERM").err();
    }));
    if let Some(e) = router_error {
        return Err(e);
    }
    let exited = wait_exit(&mut s, "router-0", Duration::from_secs(u64::from(manifests::GRACE_S)))?;
    ensure!(exited.success(), "the router exited with {exited} after SIGTERM");
    let mut row = tally(&outcomes);
    ensure!(
        row.hung == 0 && row.completed == row.sent,
        "{} of {} streams did not complete: {}",
        row.sent - row.completed,
        row.sent,
        failures(&outcomes)
    );
    s.procs.retain(|p| p.name != "router-0");
    drop(s);
    drop(dns);
    drop(net);
    row.note = format!(
        "the manifests' command lines on 4 network-namespace nodes with cluster DNS: {probed} probes answered, \
         the router ready {} ms after the pods, {n} streams of {max_tokens} tokens across a decode pod's SIGTERM ({running_at_term} running on it then) and 4 across the router's all complete, both exited by themselves",
        took_ready.as_millis()
    );
    Ok(row)
}

/// Output tokens for `n` streams to last about as long as the pause before SIGTERM plus half the
/// drain, at the per-stream decode rate `n` short streams get through the router now (the machine's
/// speed varies several-fold: fixed-length streams either ended before SIGTERM or outlived the drain).
fn stream_tokens(router: &str, n: usize) -> Result<u64> {
    let outcomes = streams(router, n, 24, 60.0, || {});
    let mut rates: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.ok())
        .filter_map(|o| o.tpot())
        .filter(|t| !t.is_zero())
        .map(|t| 1.0 / t.as_secs_f64())
        .collect();
    ensure!(!rates.is_empty(), "no calibration stream completed: {}", failures(&outcomes));
    rates.sort_by(f64::total_cmp);
    let rate = rates[rates.len() / 2];
    let last_s = 1.5 + f64::from(manifests::PRESTOP_SLEEP_S) + f64::from(manifests::DRAIN_S) / 2.0;
    Ok(((rate * last_s) as u64).clamp(16, 2000))
}

/// What the failed streams got: status, error type, tokens before it and when it ended.
fn failures(outcomes: &[pdserve_loadgen::Observation]) -> String {
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.ok())
        .map(|o| {
            format!(
                "{} {} after {} tokens at {:.1} s",
                o.status,
                o.error.as_deref().unwrap_or("no error"),
                o.output_tokens,
                o.e2e.as_secs_f64()
            )
        })
        .collect();
    failed.join("; ")
}

fn container<'a>(objects: &'a [Value], component: &str) -> Result<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == format!("pdserve-{component}"))
        .map(|d| &d["spec"]["template"]["spec"]["containers"][0])
        .with_context(|| format!("no Deployment for {component}"))
}

/// The number of a container's port by name.
fn named_port(c: &Value, name: &str) -> Result<u64> {
    c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .with_context(|| format!("no container port named {name:?}"))
}

fn wait_status(url: &str, path: &str, want: u16, within: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        match crate::where_::get(url, path) {
            Ok((s, _)) if s == want => return Ok(()),
            other => {
                if t.elapsed() > within {
                    let got = other.map(|(s, b)| format!("{s} {}", String::from_utf8_lossy(&b)));
                    bail!("{url}{path} did not answer {want} within {within:?}: {got:?}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_exit(s: &mut Stack, name: &str, within: Duration) -> Result<std::process::ExitStatus> {
    let p = s.procs.iter_mut().find(|p| p.name == name).context("no such process")?;
    let t = Instant::now();
    loop {
        if let Some(status) = p.child.try_wait()? {
            return Ok(status);
        }
        ensure!(t.elapsed() < within, "{name} still runs {within:?} after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_for_workers(router: &str, n: usize) -> Result<()> {
    let t = Instant::now();
    loop {
        let (_, body) = crate::where_::get(router, "/workers")?;
        let v: Value = serde_json::from_slice(&body)?;
        let have = v["workers"].as_array().map_or(0, Vec::len);
        if have == n {
            return Ok(());
        }
        ensure!(t.elapsed() < Duration::from_secs(15), "the router lists {have} workers, not {n}: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The bridge, the nodes' namespaces and their `resolv.conf` files; all removed when dropped.
struct Network {
    bridge: String,
    namespaces: Netns,
    tag: u32,
}

impl Network {
    fn ns(&self, pod: &Pod) -> String {
        format!("pk{}{}", self.tag, pod.name.replace('-', ""))
    }

    fn create(tag: u32, pods: &[Pod], p: &Params) -> Result<Network> {
        let bridge = format!("pkbr{tag}");
        let mut net = Network { bridge: bridge.clone(), namespaces: Netns { names: Vec::new() }, tag };
        Netns::ip(&["link", "add", &bridge, "type", "bridge"])?;
        Netns::ip(&["addr", "add", &format!("{SUBNET}.1/24"), "dev", &bridge])?;
        Netns::ip(&["link", "set", &bridge, "up"])?;
        for (i, pod) in pods.iter().enumerate() {
            let ns = net.ns(pod);
            Netns::ip(&["netns", "add", &ns])?;
            net.namespaces.names.push(ns.clone());
            let (host, node) = (format!("pkh{tag}{i}"), format!("pkn{tag}{i}"));
            Netns::ip(&["link", "add", &host, "type", "veth", "peer", "name", &node])?;
            Netns::ip(&["link", "set", &node, "netns", &ns])?;
            Netns::ip(&["link", "set", &host, "master", &bridge])?;
            Netns::ip(&["link", "set", &host, "up"])?;
            Netns::ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            Netns::ip(&["-n", &ns, "addr", "add", &format!("{}/24", pod.ip), "dev", &node])?;
            Netns::ip(&["-n", &ns, "link", "set", &node, "up"])?;
            Netns::ip(&["-n", &ns, "route", "add", "default", "via", &format!("{SUBNET}.1")])?;
            // What kubelet writes into a pod: the cluster DNS, the namespace's search list, ndots:5.
            // `ip netns exec` mounts /etc/netns/NS/resolv.conf over /etc/resolv.conf.
            let dir = PathBuf::from("/etc/netns").join(&ns);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(
                dir.join("resolv.conf"),
                format!(
                    "nameserver {SUBNET}.1\nsearch {0}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n",
                    p.namespace
                ),
            )?;
        }
        Ok(net)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in &self.namespaces.names {
            let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(ns));
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).output();
        // The namespaces (and the veth pairs in them) go with `self.namespaces`.
    }
}

/// dnsmasq on the bridge's address, port 53: the cluster DNS. Records live in a hosts file it reads
/// again on SIGHUP.
struct ClusterDns {
    child: Child,
    hosts: PathBuf,
    records: Vec<(String, String)>,
}

impl ClusterDns {
    fn start(logs: &Path) -> Result<ClusterDns> {
        let hosts = logs.join("dns-hosts");
        std::fs::write(&hosts, "")?;
        let bin = ["dnsmasq", "/usr/sbin/dnsmasq"]
            .into_iter()
            .find(|b| Command::new(b).arg("--version").output().is_ok())
            .context("dnsmasq is needed (Debian: apt-get install dnsmasq-base; .ci/run installs it)")?;
        let child = Command::new(bin)
            .args(["--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts"])
            .args(["--bind-interfaces", "--pid-file=", "--user=root", "--port=53"])
            .arg(format!("--listen-address={SUBNET}.1"))
            .arg(format!("--addn-hosts={}", hosts.display()))
            // The cluster's zone is ours: names not in it are NXDOMAIN, and AAAA queries of IPv4-only
            // names are answered empty, as CoreDNS does.
            .arg("--local=/cluster.local/")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(logs.join("dnsmasq.log"))?)
            .spawn()
            .context("starting dnsmasq")?;
        Ok(ClusterDns { child, hosts, records: Vec::new() })
    }

    fn write(&mut self) -> Result<()> {
        let text: String =
            self.records.iter().map(|(name, ip)| format!("{ip} {}\n", name.trim_end_matches('.'))).collect();
        std::fs::write(&self.hosts, text)?;
        let ok = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status()?.success();
        ensure!(ok, "dnsmasq is not running");
        Ok(())
    }

    fn add(&mut self, name: &str, ip: &str) -> Result<()> {
        self.records.push((name.to_owned(), ip.to_owned()));
        self.write()
    }

    fn remove(&mut self, name: &str, ip: &str) -> Result<()> {
        self.records.retain(|(n, i)| !(n == name && i == ip));
        self.write()
    }
}

impl Drop for ClusterDns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
