//! The generator against small servers on loopback: it measures a stream, counts refusals by type, and
//! never waits past a request's deadline plus grace on a server that goes silent.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use pdserve_loadgen::{run_point, Load, Progress, Shape, Slo, Target};

/// A server answering every request with `answer(n)`, where n counts requests.
fn server(answer: fn(usize, &mut std::net::TcpStream)) -> Target {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut n = 0;
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let _ = s.set_nodelay(true);
            n += 1;
            let k = n;
            std::thread::spawn(move || loop {
                // Read one request (head + content-length body).
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                let need = loop {
                    let Ok(r) = s.read(&mut chunk) else { return };
                    if r == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..r]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len: usize = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap())
                            })
                            .unwrap_or(0);
                        break end + 4 + len;
                    }
                };
                while buf.len() < need {
                    let Ok(r) = s.read(&mut chunk) else { return };
                    if r == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..r]);
                }
                answer(k, &mut s);
            });
        }
    });
    Target::parse(&format!("http://{addr}")).unwrap()
}

fn stream_three(_: usize, s: &mut std::net::TcpStream) {
    let _ =
        write!(s, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
    for t in ["a", "b", "c"] {
        let ev = format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}},\"finish_reason\":null}}]}}\n\n");
        let _ = write!(s, "{:x}\r\n{ev}\r\n", ev.len());
        std::thread::sleep(Duration::from_millis(10));
    }
    let last = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"timings\":{\"queue_ms\":1.5,\"prefill_ms\":4}}\n\ndata: [DONE]\n\n";
    let _ = write!(s, "{:x}\r\n{last}\r\n0\r\n\r\n", last.len());
}

#[test]
fn measures_a_stream() {
    let t = server(stream_three);
    let r = run_point(
        &t,
        &Load::Closed { concurrency: 2, requests: 6 },
        &Shape::default(),
        &Slo::default(),
        &Progress::quiet(),
    );
    assert_eq!((r.sent, r.ok, r.hung), (6, 6, 0), "{:?}", r.errors);
    assert_eq!(r.output_tokens, 18);
    assert!(r.ttft.p50_ms() < 100.0 && r.itl.p50_ms() >= 9.0, "{:?} {:?}", r.ttft, r.itl);
    assert_eq!(r.good, 6);
    assert_eq!(r.stages.get("queue_ms").map(|s| s.0), Some(1.5));
}

#[test]
fn counts_refusals_by_type() {
    let t = server(|n, s| {
        if n % 2 == 0 {
            let body = r#"{"error":{"type":"queue_full","message":"full","code":429}}"#;
            let _ = write!(
                s,
                "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
        } else {
            stream_three(n, s);
        }
    });
    // One connection per client: odd connections stream, even ones refuse.
    let r = run_point(
        &t,
        &Load::Closed { concurrency: 4, requests: 8 },
        &Shape::default(),
        &Slo::default(),
        &Progress::quiet(),
    );
    assert_eq!(r.sent, 8);
    assert_eq!(r.ok + r.errors.get("429 queue_full").copied().unwrap_or(0), 8, "{:?}", r.errors);
    assert!(r.errors.contains_key("429 queue_full"), "{:?}", r.errors);
}

#[test]
fn a_silent_server_is_counted_hung_not_waited_on() {
    let t = server(|_, s| {
        let _ = write!(
            s,
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        std::thread::sleep(Duration::from_secs(30));
    });
    let shape =
        Shape { timeout: Duration::from_millis(300), grace: Duration::from_millis(200), ..Shape::default() };
    let started = Instant::now();
    let r = run_point(
        &t,
        &Load::Closed { concurrency: 3, requests: 3 },
        &shape,
        &Slo::default(),
        &Progress::quiet(),
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert_eq!(r.hung, 3);
    assert_eq!(r.ok, 0);
}

#[test]
fn a_stale_kept_alive_connection_is_not_an_error() {
    // Every connection is closed by the server after its first answer, without saying so.
    let t = server(|_, s| {
        stream_three(0, s);
        let _ = s.shutdown(std::net::Shutdown::Both);
    });
    let r = run_point(
        &t,
        &Load::Closed { concurrency: 1, requests: 4 },
        &Shape::default(),
        &Slo::default(),
        &Progress::quiet(),
    );
    assert_eq!((r.sent, r.ok), (4, 4), "{:?}", r.errors);
}
