//! The network-partition scenario: the roles in network namespaces of their own, joined by veth pairs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use crate::serve::Proc;

use super::*;

/// Network namespaces for the partition scenario, deleted when dropped.
pub(super) struct Netns {
    pub(super) names: Vec<String>,
}

impl Netns {
    pub(super) fn ip(args: &[&str]) -> Result<()> {
        let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
        ensure!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// Prefill and decode workers on two "hosts" (network namespaces), KV over TCP across a veth link
/// between them, each reachable from the router (in the root namespace) over a veth link of its own.
/// The prefill-decode link is cut while requests move KV across it, then restored.
pub(super) fn netns_partition(bins: &(PathBuf, PathBuf), model: &Path, short: bool) -> Result<Row> {
    let tag = std::process::id() % 10000;
    let (np, nd) = (format!("pdp{tag}"), format!("pdd{tag}"));
    let ns = Netns { names: vec![np.clone(), nd.clone()] };
    let (rp, ep, rd, ed, xp, xd) = (
        format!("rp{tag}"),
        format!("ep{tag}"),
        format!("rd{tag}"),
        format!("ed{tag}"),
        format!("xp{tag}"),
        format!("xd{tag}"),
    );
    for n in &ns.names {
        Netns::ip(&["netns", "add", n])?;
        Netns::ip(&["-n", n, "link", "set", "lo", "up"])?;
    }
    // router <-> prefill host, router <-> decode host, prefill host <-> decode host.
    let links = [
        (&rp, None, "10.78.1.1/24", &ep, &np, "10.78.1.2/24"),
        (&rd, None, "10.78.2.1/24", &ed, &nd, "10.78.2.2/24"),
        (&xp, Some(&np), "10.77.0.1/24", &xd, &nd, "10.77.0.2/24"),
    ];
    let mut root_links = Vec::new();
    for (a, a_ns, a_ip, b, b_ns, b_ip) in links {
        Netns::ip(&["link", "add", a, "type", "veth", "peer", "name", b])?;
        Netns::ip(&["link", "set", b, "netns", b_ns])?;
        Netns::ip(&["-n", b_ns, "addr", "add", b_ip, "dev", b])?;
        Netns::ip(&["-n", b_ns, "link", "set", b, "up"])?;
        match a_ns {
            Some(n) => {
                Netns::ip(&["link", "set", a, "netns", n])?;
                Netns::ip(&["-n", n, "addr", "add", a_ip, "dev", a])?;
                Netns::ip(&["-n", n, "link", "set", a, "up"])?;
            }
            None => {
                Netns::ip(&["addr", "add", a_ip, "dev", a])?;
                Netns::ip(&["link", "set", a, "up"])?;
                root_links.push(a.clone());
            }
        }
    }
    let logs = crate::workspace_root().join("target/chaos/netns_partition");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;
    let worker = |name: &str, netns: &str, role: &str, extra: &[&str], host_ip: &str| -> Result<Proc> {
        let mut args: Vec<String> = ["netns", "exec", netns].iter().map(|s| (*s).to_owned()).collect();
        args.push(bins.0.display().to_string());
        args.extend(worker_args(name, role, model));
        // Open on the namespaces' private links, as on a trusted network.
        args.extend(["--host", "0.0.0.0", "--allow-unauthenticated"].map(str::to_owned));
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut p = Proc::start(name, Path::new("ip"), &args, &logs)?;
        p.url = p.url.replace("0.0.0.0", host_ip);
        Ok(p)
    };
    let p = worker("prefill-0", &np, "prefill", &["--transfer-addr", "10.77.0.1:0"], "10.78.1.2")?;
    let d = worker("decode-0", &nd, "decode", &[], "10.78.2.2")?;
    let router_args: Vec<String> = [
        "--port",
        "0",
        "--probe-interval-s",
        "0.5",
        "--probe-timeout-s",
        "2",
        "--pair-probe-interval-s",
        "1",
        "--prefill",
        &p.url,
        "--decode",
        &d.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let r = Proc::start("router", &bins.1, &router_args, &logs)?;
    let mut s = Stack {
        router: r.url.clone(),
        procs: vec![p, d, r],
        logs,
        bins: bins.clone(),
        model: model.to_owned(),
        worker_extra: Vec::new(),
        decode_extra: Vec::new(),
    };
    s.wait_ready(true, Duration::from_secs(60))?;
    let n = if short { 4 } else { 12 };
    let cut_for = Duration::from_secs(if short { 4 } else { 8 });
    let mut not_ready_after = Duration::MAX;
    let router = s.router.clone();
    let mut late = None;
    let mut outcomes = streams(&s.router.clone(), n, 32, 15.0, || {
        std::thread::sleep(Duration::from_millis(600));
        let cut = Instant::now();
        let _ = Netns::ip(&["-n", &np, "link", "set", &xp, "down"]);
        // A second wave arrives during the cut, so its KV transfers meet the partition however fast
        // the first wave finished.
        late = Some(std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            streams(&router, n, 32, 15.0, || {})
        }));
        while cut.elapsed() < cut_for {
            if !s.ready() && not_ready_after == Duration::MAX {
                not_ready_after = cut.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Netns::ip(&["-n", &np, "link", "set", &xp, "up"]);
    });
    if let Some(h) = late {
        outcomes.extend(h.join().map_err(|_| anyhow::anyhow!("client thread panicked"))?);
    }
    let mut row = tally(&outcomes);
    ensure!(row.hung == 0, "{} requests without a terminal outcome", row.hung);
    ensure!(
        not_ready_after < cut_for,
        "the router stayed ready while prefill and decode could not reach each other"
    );
    let back = s.wait_ready(true, Duration::from_secs(30))?;
    s.recovered(&[])?;
    drop(s);
    for l in root_links {
        let _ = Command::new("ip").args(["link", "del", &l]).output();
    }
    drop(ns);
    row.note = format!(
        "prefill and decode in separate network namespaces, KV over TCP on a veth link cut for {} s under {n} streams and {n} more sent during the cut: \
         not ready {} ms after the cut, ready {} ms after the link came back",
        cut_for.as_secs(),
        not_ready_after.as_millis(),
        back.as_millis()
    );
    Ok(row)
}
