//! Workers from DNS: `--discover [ROLE=]dns:NAME:PORT` names a DNS name whose A/AAAA records are the
//! workers of one role (a Kubernetes headless Service, a Consul or Nomad service name). A thread of its
//! own asks the DNS server every few seconds, each query with a deadline, and hands the router every
//! answer; the router adds new addresses and drains vanished ones (`Router::apply_discovery`).
//!
//! The resolver is our own (UDP, TCP when an answer is truncated): the C library's `getaddrinfo` has
//! no deadline, caches as it likes, and cannot be pointed at another server for a test.

pub mod dns;

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dns::{Answer, Qtype};
use pdserve_api::Role;

/// One `--discover` source: the workers of `role` are `NAME`'s addresses, at `port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoverSpec {
    pub role: Role,
    pub name: String,
    pub port: u16,
}

impl DiscoverSpec {
    /// Parses `[ROLE=]dns:NAME:PORT` (role unified when not named).
    pub fn parse(s: &str) -> Result<DiscoverSpec, String> {
        let (role, rest) = match s.split_once('=') {
            Some((r, rest)) => (
                Role::parse(r).ok_or_else(|| format!("unknown role {r:?} (unified, prefill, decode)"))?,
                rest,
            ),
            None => (Role::Unified, s),
        };
        let form =
            || format!("{s:?}: expected [ROLE=]dns:NAME:PORT, e.g. decode=dns:decode.pdserve.svc:8000");
        let rest = rest.strip_prefix("dns:").ok_or_else(form)?;
        let (name, port) = rest.rsplit_once(':').ok_or_else(form)?;
        let port = port.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(form)?;
        dns::encode_query(0, name, Qtype::A).map_err(|e| format!("{s:?}: {e}"))?;
        Ok(DiscoverSpec { role, name: name.to_owned(), port })
    }

    /// The worker URL of one address.
    pub fn url(&self, ip: IpAddr) -> String {
        format!("http://{}", SocketAddr::new(ip, self.port))
    }
}

/// Where and how names are looked up: `/etc/resolv.conf`'s servers, search list and `ndots`, or one
/// server named by `--dns-server`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverConf {
    pub servers: Vec<SocketAddr>,
    pub search: Vec<String>,
    pub ndots: usize,
    /// Deadline of one query to one server.
    pub timeout: Duration,
}

impl ResolverConf {
    /// `/etc/resolv.conf` (a server at 127.0.0.1:53 when it names none, as the C library does).
    pub fn system() -> ResolverConf {
        let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
        ResolverConf::parse(&text)
    }

    pub fn parse(text: &str) -> ResolverConf {
        let mut c = ResolverConf {
            servers: Vec::new(),
            search: Vec::new(),
            ndots: 1,
            timeout: Duration::from_secs(2),
        };
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) {
                        c.servers.push(SocketAddr::new(ip, 53));
                    }
                }
                Some("search" | "domain") => c.search = words.map(str::to_owned).collect(),
                Some("options") => {
                    for o in words {
                        if let Some(n) = o.strip_prefix("ndots:").and_then(|n| n.parse().ok()) {
                            c.ndots = usize::min(n, 15);
                        }
                    }
                }
                _ => {}
            }
        }
        if c.servers.is_empty() {
            c.servers.push(SocketAddr::from(([127, 0, 0, 1], 53)));
        }
        c
    }

    /// One server only (`--dns-server IP[:PORT]`), no search list.
    pub fn server(addr: SocketAddr) -> ResolverConf {
        ResolverConf { servers: vec![addr], search: Vec::new(), ndots: 1, timeout: Duration::from_secs(2) }
    }

    /// The names to try for `name`, in order, as the C library orders them.
    pub fn candidates(&self, name: &str) -> Vec<String> {
        if name.ends_with('.') || self.search.is_empty() {
            return vec![name.to_owned()];
        }
        let searched = self.search.iter().map(|d| format!("{name}.{d}"));
        if name.matches('.').count() >= self.ndots {
            std::iter::once(name.to_owned()).chain(searched).collect()
        } else {
            searched.chain(std::iter::once(name.to_owned())).collect()
        }
    }

    /// `name`'s addresses (A and AAAA; empty when the name does not exist), or why they are unknown.
    /// Each query has [`timeout`](Self::timeout); a server that fails is followed by the next.
    pub fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, String> {
        for candidate in self.candidates(name) {
            let mut all = match self.ask(&candidate, Qtype::A)? {
                Answer::Addresses(a) => a,
                Answer::NoSuchName | Answer::Truncated => continue,
            };
            // An IPv4 answer stands when the AAAA query fails (dnsmasq without upstream servers
            // refuses AAAA queries for names it holds only A records of).
            match self.ask(&candidate, Qtype::Aaaa) {
                Ok(Answer::Addresses(a)) => all.extend(a),
                Ok(_) => {}
                Err(e) if all.is_empty() => return Err(e),
                Err(_) => {}
            }
            if !all.is_empty() {
                all.sort();
                all.dedup();
                return Ok(all);
            }
        }
        Ok(Vec::new())
    }

    fn ask(&self, name: &str, qtype: Qtype) -> Result<Answer, String> {
        let mut last = String::from("no DNS server");
        for &server in &self.servers {
            match query(server, name, qtype, self.timeout) {
                Ok(a) => return Ok(a),
                Err(e) => last = format!("{name} at {server}: {e}"),
            }
        }
        Err(last)
    }
}

fn query_id() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish() as u16
}

/// One query over UDP (over TCP when the answer was truncated), within `timeout`.
fn query(server: SocketAddr, name: &str, qtype: Qtype, timeout: Duration) -> Result<Answer, String> {
    let q = dns::encode_query(query_id(), name, qtype).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    let local: SocketAddr =
        if server.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(local).map_err(|e| e.to_string())?;
    sock.connect(server).map_err(|e| e.to_string())?;
    sock.send(&q).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; usize::from(dns::UDP_PAYLOAD_MAX)];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no answer within {} ms", timeout.as_millis()));
        }
        sock.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                continue
            }
            Err(e) => return Err(e.to_string()),
        };
        match dns::parse_answer(&q, &buf[..n]) {
            Ok(Answer::Truncated) => return query_tcp(server, &q, deadline),
            Ok(a) => return Ok(a),
            Err(dns::DnsError::NotOurs) => continue, // a stray datagram: keep waiting for ours
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn query_tcp(server: SocketAddr, q: &[u8], deadline: Instant) -> Result<Answer, String> {
    let left = || {
        let d = deadline.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err("no answer over TCP before the deadline".to_owned())
        } else {
            Ok(d)
        }
    };
    let mut s = TcpStream::connect_timeout(&server, left()?).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(left()?)).map_err(|e| e.to_string())?;
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(q);
    s.write_all(&framed).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(left()?)).map_err(|e| e.to_string())?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len).map_err(|e| e.to_string())?;
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut msg).map_err(|e| e.to_string())?;
    match dns::parse_answer(q, &msg).map_err(|e| e.to_string())? {
        Answer::Truncated => Err("the answer is truncated over TCP too".to_owned()),
        a => Ok(a),
    }
}

/// One lookup's result for source `source` (an index into the router's `--discover` list).
#[derive(Debug)]
pub struct Resolved {
    pub source: usize,
    pub result: Result<Vec<IpAddr>, String>,
}

/// The lookup thread: resolves every source at once and then every `interval`, until the stop flag
/// is set. Answers wait in a channel of a few per source; a router that does not take them makes the
/// thread wait, never pile up.
pub fn spawn(
    specs: Vec<DiscoverSpec>,
    conf: ResolverConf,
    interval: Duration,
    stop: Arc<AtomicBool>,
) -> std::io::Result<Receiver<Resolved>> {
    let (tx, rx) = sync_channel(specs.len() * 2);
    std::thread::Builder::new()
        .name("router-discovery".into())
        .spawn(move || lookups(&specs, &conf, interval, &stop, &tx))?;
    Ok(rx)
}

fn lookups(
    specs: &[DiscoverSpec],
    conf: &ResolverConf,
    interval: Duration,
    stop: &AtomicBool,
    tx: &SyncSender<Resolved>,
) {
    while !stop.load(Ordering::Relaxed) {
        let round = Instant::now();
        for (source, spec) in specs.iter().enumerate() {
            let mut msg = Resolved { source, result: conf.lookup(&spec.name) };
            loop {
                match tx.try_send(msg) {
                    Ok(()) => break,
                    Err(TrySendError::Disconnected(_)) => return,
                    Err(TrySendError::Full(m)) if !stop.load(Ordering::Relaxed) => {
                        msg = m;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(TrySendError::Full(_)) => return,
                }
            }
        }
        while round.elapsed() < interval && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20).min(interval));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let s = DiscoverSpec::parse("decode=dns:decode.pdserve.svc.cluster.local:8000").unwrap();
        assert_eq!(
            (s.role, s.name.as_str(), s.port),
            (Role::Decode, "decode.pdserve.svc.cluster.local", 8000)
        );
        assert_eq!(DiscoverSpec::parse("dns:workers:80").unwrap().role, Role::Unified);
        assert_eq!(s.url("10.1.2.3".parse().unwrap()), "http://10.1.2.3:8000");
        assert_eq!(s.url("fd00::1".parse().unwrap()), "http://[fd00::1]:8000");
        for bad in ["decode=dns:x", "dns:x:0", "srv:x:80", "cook=dns:x:80", "dns::80", "dns:a..b:80"] {
            assert!(DiscoverSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn resolv_conf_and_the_search_order() {
        let c = ResolverConf::parse(
            "# kubelet\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\nsearch pdserve.svc.cluster.local svc.cluster.local\noptions ndots:5 timeout:1\n",
        );
        assert_eq!(c.servers, vec![SocketAddr::from(([10, 96, 0, 10], 53))]);
        assert_eq!(c.ndots, 5);
        // Fewer dots than ndots: the search list first, as the C library does.
        assert_eq!(
            c.candidates("decode"),
            ["decode.pdserve.svc.cluster.local", "decode.svc.cluster.local", "decode"]
        );
        assert_eq!(c.candidates("decode.pdserve.svc.cluster.local."), ["decode.pdserve.svc.cluster.local."]);
        let plain = ResolverConf::parse("");
        assert_eq!(plain.servers, vec![SocketAddr::from(([127, 0, 0, 1], 53))]);
        assert_eq!(plain.candidates("a.b"), ["a.b"]);
    }

    #[test]
    fn a_silent_server_fails_at_the_deadline() {
        // A bound socket that never answers.
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut c = ResolverConf::server(silent.local_addr().unwrap());
        c.timeout = Duration::from_millis(200);
        let t = Instant::now();
        let e = c.lookup("decode.test").unwrap_err();
        assert!(e.contains("no answer within 200 ms"), "{e}");
        assert!(t.elapsed() < Duration::from_millis(600), "{:?}", t.elapsed());
    }
}
