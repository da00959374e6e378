//! The one HTTP exchange an exporter makes: a POST of a protobuf body, its answer's status read,
//! every step within one deadline, the collector's name lookup included. (No TLS, no keep-alive: a batch a second at most.)

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::Endpoint;

#[derive(Debug)]
pub(crate) enum Failure {
    /// The collector asks to be tried again after this long (429, 502, 503, 504).
    Retryable(Duration),
    /// Anything else: a refusal, no connection, a timeout.
    Final(String),
}

/// A lookup thread is out (one at a time: a resolver that hangs holds one thread, not one per batch).
static LOOKING_UP: AtomicBool = AtomicBool::new(false);

/// `host`'s first address, within `timeout`. An IP needs no lookup; a name is looked up on a thread
/// of its own (the system's resolver has no deadline of its own), abandoned past `timeout`.
fn resolve(host: &str, port: u16, timeout: Duration) -> Result<SocketAddr, String> {
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    if LOOKING_UP.swap(true, Ordering::AcqRel) {
        return Err(format!("resolving {host}: an earlier lookup has not come back"));
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let name = host.to_owned();
    let spawned = std::thread::Builder::new().name("otlp-resolve".into()).spawn(move || {
        let found = (name.as_str(), port).to_socket_addrs().map(|mut a| a.next());
        LOOKING_UP.store(false, Ordering::Release);
        let _ = tx.send(found);
    });
    if let Err(err) = spawned {
        LOOKING_UP.store(false, Ordering::Release);
        return Err(format!("resolving {host}: {err}"));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(Some(a))) => Ok(a),
        Ok(Ok(None)) => Err(format!("resolving {host}: no address")),
        Ok(Err(err)) => Err(format!("resolving {host}: {err}")),
        Err(_) => Err(format!("resolving {host}: no answer within {} ms", timeout.as_millis())),
    }
}

pub(crate) fn post(e: &Endpoint, body: &[u8], timeout: Duration) -> Result<(), Failure> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let fail = |what: &str, err: std::io::Error| Failure::Final(format!("{what}: {err}"));
    let addr = resolve(&e.host, e.port, left()).map_err(Failure::Final)?;
    let mut s = TcpStream::connect_timeout(&addr, left()).map_err(|err| fail("connecting", err))?;
    s.set_write_timeout(Some(left())).map_err(|err| fail("socket", err))?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        e.path,
        e.host,
        e.port,
        body.len()
    );
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).map_err(|err| fail("sending", err))?;
    // The status line and headers: 16 KiB at most.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.len() < 16 * 1024 {
        s.set_read_timeout(Some(left())).map_err(|err| fail("socket", err))?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(err) => return Err(fail("reading the answer", err)),
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status: u16 = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    match status {
        200..=299 => Ok(()),
        429 | 502 | 503 | 504 => {
            let after = text
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("retry-after")
                        .then(|| v.trim().parse::<u64>().ok())
                        .flatten()
                })
                .map_or(Duration::from_secs(1), Duration::from_secs);
            Err(Failure::Retryable(after))
        }
        0 => Err(Failure::Final("no HTTP answer".into())),
        other => Err(Failure::Final(format!("status {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_need_no_lookup_and_names_resolve_within_the_deadline() {
        assert_eq!(resolve("10.0.0.7", 4318, Duration::ZERO), Ok("10.0.0.7:4318".parse().unwrap()));
        assert_eq!(resolve("[::1]", 4318, Duration::ZERO), Ok("[::1]:4318".parse().unwrap()));
        let local = resolve("localhost", 4318, Duration::from_secs(10)).unwrap();
        assert!(local.ip().is_loopback() && local.port() == 4318, "{local}");
        // The lookup thread is free again for the next one.
        assert!(!LOOKING_UP.load(Ordering::Acquire));
        assert!(resolve("name.invalid", 1, Duration::from_secs(10)).is_err());
    }
}
