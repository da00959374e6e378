//! The one HTTP exchange an exporter makes: a POST of a protobuf body, its answer's status read,
//! every step within one deadline. (No TLS, no keep-alive: a batch a second at most.)

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::Endpoint;

#[derive(Debug)]
pub(crate) enum Failure {
    /// The collector asks to be tried again after this long (429, 502, 503, 504).
    Retryable(Duration),
    /// Anything else: a refusal, no connection, a timeout.
    Final(String),
}

pub(crate) fn post(e: &Endpoint, body: &[u8], timeout: Duration) -> Result<(), Failure> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let fail = |what: &str, err: std::io::Error| Failure::Final(format!("{what}: {err}"));
    let addr = (e.host.as_str(), e.port)
        .to_socket_addrs()
        .map_err(|err| fail("resolving", err))?
        .next()
        .ok_or_else(|| Failure::Final("no address".into()))?;
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
