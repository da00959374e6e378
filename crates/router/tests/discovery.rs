//! Workers found through DNS (`--discover`), against a real DNS server (dnsmasq, Debian's
//! `dnsmasq-base`, on a loopback port) whose records change while clients stream through the router.

mod common;

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use pdserve_router::{DiscoverSpec, ResolverConf};

const NAME: &str = "workers.pdserve.test";

/// dnsmasq answering from a hosts file of its own (name and address pairs), re-read on SIGHUP.
struct Dns {
    child: Child,
    addr: SocketAddr,
    hosts: PathBuf,
}

impl Dns {
    fn start(records: &[(&str, IpAddr)]) -> Dns {
        let dir =
            std::env::temp_dir().join(format!("pdserve-dns-{}-{:?}", std::process::id(), Instant::now()));
        let hosts = dir.join("hosts");
        // dnsmasq listens on TCP as well as UDP: a port free for UDP may be taken for TCP (another
        // test's connection), and then dnsmasq exits at once; another port is tried (five at most).
        let mut tries = 0;
        loop {
            // (A failed try's drop removed the directory.)
            std::fs::create_dir_all(&dir).unwrap();
            let port = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let child = Dns::spawn(port, &hosts, records);
            let mut d = Dns { child, addr: ([127, 0, 0, 1], port).into(), hosts: hosts.clone() };
            match d.answers(records) {
                Ok(()) => {
                    d.child.stderr.take();
                    return d;
                }
                Err(e) if tries < 4 => {
                    eprintln!("dnsmasq on port {port} exited ({e}); another port");
                    tries += 1;
                }
                Err(e) => panic!("dnsmasq exited on five ports: {e}"),
            }
        }
    }

    fn spawn(port: u16, hosts: &std::path::Path, records: &[(&str, IpAddr)]) -> Child {
        Dns::write_hosts(hosts, records);
        let bin = ["dnsmasq", "/usr/sbin/dnsmasq"]
            .into_iter()
            .find(|b| Command::new(b).arg("--version").output().is_ok())
            .expect("dnsmasq is needed for this test: apt-get install dnsmasq-base (.ci/run installs it)");
        Command::new(bin)
            .args(["--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts"])
            .args(["--listen-address=127.0.0.1", "--bind-interfaces", "--pid-file=", "--user=root"])
            .arg(format!("--port={port}"))
            .arg(format!("--addn-hosts={}", hosts.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dnsmasq starts")
    }

    fn write_hosts(path: &std::path::Path, records: &[(&str, IpAddr)]) {
        let mut f = std::fs::File::create(path).unwrap();
        for (name, ip) in records {
            writeln!(f, "{ip} {name}").unwrap();
        }
    }

    /// Changes the records: rewrites the hosts file and tells dnsmasq to read it again.
    fn set(&mut self, records: &[(&str, IpAddr)]) {
        Dns::write_hosts(&self.hosts, records);
        let ok = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status().unwrap();
        assert!(ok.success());
        self.wait_answers(records);
    }

    /// Waits until the server answers every name with its records (it has started, or re-read its
    /// file).
    fn wait_answers(&mut self, records: &[(&str, IpAddr)]) {
        if let Err(e) = self.answers(records) {
            panic!("dnsmasq exited: {e}");
        }
    }

    /// [`wait_answers`](Self::wait_answers), or why the server exited instead.
    fn answers(&mut self, records: &[(&str, IpAddr)]) -> Result<(), String> {
        let mut conf = ResolverConf::server(self.addr);
        conf.timeout = Duration::from_millis(200);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let answers: Vec<_> = records.iter().map(|(name, _)| conf.lookup(name)).collect();
            let right = records.iter().zip(&answers).all(|((name, _), got)| {
                let mut want: Vec<IpAddr> = records.iter().filter(|r| r.0 == *name).map(|r| r.1).collect();
                want.sort();
                got.as_ref().is_ok_and(|g| *g == want)
            });
            if right {
                return Ok(());
            }
            assert!(Instant::now() < until, "dnsmasq does not answer {records:?}: {answers:?}");
            if let Ok(Some(status)) = self.child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return Err(format!("{status}: {err}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = self.hosts.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn ip(w: &MockWorker) -> IpAddr {
    w.addr.ip()
}

fn posts(w: &MockWorker) -> usize {
    w.seen.lock().unwrap().posts.len()
}

/// The router's workers: (url, state) of each.
fn listed(r: &RouterHandle) -> Vec<(String, String)> {
    let (_, list) = r.json("GET", "/workers", "");
    let mut v: Vec<_> = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["url"].as_str().unwrap().to_owned(), w["state"].as_str().unwrap().to_owned()))
        .collect();
    v.sort();
    v
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < until, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn workers_follow_dns_records_that_change_under_load() {
    let a = MockWorker::start(MockRole::Unified, Mode::Ok);
    let port = a.addr.port();
    let b = MockWorker::start_at_port(port, MockRole::Unified, Mode::Ok);
    let mut dns = Dns::start(&[(NAME, ip(&a))]);

    let mut cfg = config(&[]);
    cfg.discover = vec![DiscoverSpec::parse(&format!("dns:{NAME}:{port}")).unwrap()];
    cfg.discover_interval = Duration::from_millis(100);
    let mut resolver = ResolverConf::server(dns.addr);
    resolver.timeout = Duration::from_millis(300);
    cfg.resolver = Some(resolver);
    cfg.policy = pdserve_router::PolicyKind::RoundRobin;
    let r = Arc::new(RouterHandle::start(cfg));
    r.wait_ready(Duration::from_secs(5));
    assert_eq!(listed(&r), vec![(a.url.clone(), "up".to_owned())]);

    // Four clients stream through the router the whole time; every stream must end complete.
    let stop = Arc::new(AtomicBool::new(false));
    let results = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (r, stop, results) = (Arc::clone(&r), Arc::clone(&stop), Arc::clone(&results));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let (status, events) = r.stream(CHAT_STREAM);
                    let complete = events.last().map(String::as_str) == Some("[DONE]") && events.len() == 7;
                    results.lock().unwrap().push((status, complete, events.len()));
                }
            })
        })
        .collect();
    wait_for("requests flow", Duration::from_secs(5), || results.lock().unwrap().len() >= 8);

    // A second address appears: it joins and takes requests.
    dns.set(&[(NAME, ip(&a)), (NAME, ip(&b))]);
    wait_for("b joins", Duration::from_secs(5), || listed(&r).len() == 2);
    wait_for("b serves", Duration::from_secs(5), || posts(&b) >= 4);
    let (_, list) = r.json("GET", "/workers", "");
    let want = format!("dns:{NAME}:{port}");
    assert!(
        list["workers"].as_array().unwrap().iter().all(|w| w["discovered_by"] == want.as_str()),
        "{list}"
    );

    // The first one's record goes: it drains (its streams finish) and leaves; nothing new reaches it.
    dns.set(&[(NAME, ip(&b))]);
    wait_for("a leaves", Duration::from_secs(5), || listed(&r) == vec![(b.url.clone(), "up".to_owned())]);
    let a_final = posts(&a);
    let b_before = posts(&b);
    wait_for("b takes all", Duration::from_secs(5), || posts(&b) >= b_before + 8);
    assert_eq!(posts(&a), a_final, "a worker whose record is gone got new requests");

    // The DNS server goes away: lookups fail, the workers stay, requests still flow.
    dns.stop();
    let failed = || {
        let text = String::from_utf8(r.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
        let line =
            text.lines().find(|l| l.starts_with("router_discovery_lookups_total") && l.contains("failed"));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    wait_for("lookups fail", Duration::from_secs(5), || failed() >= 2.0);
    let b_during = posts(&b);
    wait_for("requests flow without DNS", Duration::from_secs(5), || posts(&b) >= b_during + 8);
    assert_eq!(listed(&r), vec![(b.url.clone(), "up".to_owned())], "a DNS outage emptied the pool");
    assert!(r.ready());

    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let results = results.lock().unwrap();
    let bad: Vec<_> = results.iter().filter(|(s, complete, _)| *s != 200 || !complete).collect();
    println!("{} streams, {} to a, {} to b", results.len(), posts(&a), posts(&b));
    assert!(bad.is_empty(), "{} of {} streams failed or were cut: {bad:?}", bad.len(), results.len());
    assert!(a_final >= 4 && results.len() >= 40, "{a_final} to a, {} in all", results.len());
}

#[test]
fn a_prefill_and_a_decode_pool_are_each_found_by_name() {
    let p = MockWorker::start(MockRole::Prefill, Mode::Ok);
    let d = MockWorker::start(MockRole::Decode, Mode::Ok);
    let dns = Dns::start(&[("prefill.pdserve.test", ip(&p)), ("decode.pdserve.test", ip(&d))]);
    let mut cfg = config(&[]);
    cfg.discover = vec![
        DiscoverSpec::parse(&format!("prefill=dns:prefill.pdserve.test:{}", p.addr.port())).unwrap(),
        DiscoverSpec::parse(&format!("decode=dns:decode.pdserve.test:{}", d.addr.port())).unwrap(),
    ];
    cfg.resolver = Some(ResolverConf::server(dns.addr));
    cfg.pair_probe_interval = Duration::from_millis(200);
    let r = RouterHandle::start(cfg);
    // Ready means a pair probe went through the prefill and the decode worker found.
    r.wait_ready(Duration::from_secs(10));
    let (status, body) = r.json("POST", "/v1/chat/completions", CHAT);
    assert_eq!(status, 200, "{body}");
    let (_, list) = r.json("GET", "/workers", "");
    let mut roles: Vec<_> = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["role"].as_str().unwrap().to_owned(), w["url"].as_str().unwrap().to_owned()))
        .collect();
    roles.sort();
    assert_eq!(roles, vec![("decode".to_owned(), d.url.clone()), ("prefill".to_owned(), p.url.clone())]);
    assert!(d.seen.lock().unwrap().posts.iter().any(|p| p.3.contains("pd_transfer")), "no decode leg");
}
