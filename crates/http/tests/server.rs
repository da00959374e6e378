//! The mio server loop and the client pool against real sockets on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use pdserve_http::{
    ClientConfig, Event, HttpClient, HttpError, Limits, PoolConfig, Request, Response, Server, ServerConfig,
};

/// A test server on its own thread: `/echo` answers the body, `/stream` sends three chunks, `/hold`
/// never answers. Disconnects are reported on `disconnects`.
struct TestServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    waker: Arc<mio::Waker>,
    disconnects: mpsc::Receiver<String>,
    thread: Option<thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(config: ServerConfig) -> TestServer {
        let mut server = Server::bind("127.0.0.1:0".parse().unwrap(), config).unwrap();
        let addr = server.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let waker = server.waker();
        let (tx, disconnects) = mpsc::channel();
        let stop2 = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut events = Vec::new();
            while !stop2.load(Ordering::Relaxed) {
                server.poll(&mut events, Some(Duration::from_millis(50))).unwrap();
                for ev in events.drain(..) {
                    match ev {
                        Event::Request { conn, request } => match request.path() {
                            "/echo" => {
                                let r = Response::text(200, request.body.clone())
                                    .header("x-method", &request.method);
                                server.respond(conn, &r).unwrap();
                            }
                            "/stream" => {
                                server
                                    .start_stream(conn, 200, &[("content-type", "text/event-stream")])
                                    .unwrap();
                                for i in 0..3 {
                                    server.send_chunk(conn, format!("data: {i}\n\n").as_bytes()).unwrap();
                                }
                                server.end_stream(conn).unwrap();
                            }
                            "/hold" => {}
                            _ => server.respond(conn, &Response::new(404)).unwrap(),
                        },
                        Event::Disconnected { conn, .. } => {
                            let _ = tx.send(conn.to_string());
                        }
                        Event::Io { .. } => {}
                    }
                }
            }
        });
        TestServer { addr, stop, waker, disconnects, thread: Some(thread) }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Reads until the server closes the connection (bounded by the read timeout).
fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads until `n` complete responses with content-length bodies have arrived.
fn read_responses(s: &mut TcpStream, n: usize) -> Vec<String> {
    let mut buf = Vec::new();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while got.len() < n {
        let k = s.read(&mut chunk).unwrap();
        assert!(k > 0, "closed early after {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..k]);
        loop {
            let text = String::from_utf8_lossy(&buf).into_owned();
            let Some(head_end) = text.find("\r\n\r\n") else { break };
            let len: usize = text[..head_end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.parse().unwrap())
                })
                .unwrap_or(0);
            if buf.len() < head_end + 4 + len {
                break;
            }
            got.push(String::from_utf8_lossy(&buf[..head_end + 4 + len]).into_owned());
            buf.drain(..head_end + 4 + len);
        }
    }
    got
}

fn fast_config() -> ServerConfig {
    ServerConfig {
        limits: Limits { body_bytes_max: 1024, ..Limits::default() },
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(300),
        linger_timeout: Duration::from_millis(100),
        ..ServerConfig::default()
    }
}

#[test]
fn keep_alive_and_pipelining_answer_in_order() {
    let srv = TestServer::start(fast_config());
    let mut s = connect(srv.addr);
    s.write_all(b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\none").unwrap();
    let first = read_responses(&mut s, 1);
    assert!(first[0].starts_with("HTTP/1.1 200 OK\r\n") && first[0].ends_with("one"), "{first:?}");
    // Three requests in one write, one of them chunked, one with a 404.
    s.write_all(
        b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\ntwoPOST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nthree\r\n0\r\n\r\nGET /nope HTTP/1.1\r\n\r\n",
    )
    .unwrap();
    let rest = read_responses(&mut s, 3);
    assert!(rest[0].ends_with("two"), "{rest:?}");
    assert!(rest[1].ends_with("three"), "{rest:?}");
    assert!(rest[2].starts_with("HTTP/1.1 404"), "{rest:?}");
}

#[test]
fn limit_violations_get_their_status_and_a_clean_close() {
    let srv = TestServer::start(fast_config());
    let long_line = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(9000));
    let many_headers =
        format!("GET / HTTP/1.1\r\n{}\r\n", (0..100).map(|i| format!("h{i}: v\r\n")).collect::<String>());
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"POST /echo HTTP/1.1\r\nContent-Length: 5000\r\n\r\n".to_vec(), 413, "body_too_large"),
        (long_line.into_bytes(), 414, "uri_too_long"),
        (many_headers.into_bytes(), 431, "headers_too_large"),
        (b"GARBAGE\r\n\r\n".to_vec(), 400, "invalid_request"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(), 400, "invalid_request"),
    ];
    for (input, status, error_type) in cases {
        let mut s = connect(srv.addr);
        s.write_all(&input).unwrap();
        let reply = read_to_close(&mut s);
        assert!(reply.starts_with(&format!("HTTP/1.1 {status} ")), "{reply}");
        assert!(reply.contains("connection: close"), "{reply}");
        let body = &reply[reply.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], error_type);
        assert_eq!(v["error"]["code"], status);
    }
    // The server is undisturbed.
    let mut s = connect(srv.addr);
    s.write_all(b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nok").unwrap();
    assert!(read_responses(&mut s, 1)[0].ends_with("ok"));
}

#[test]
fn slowloris_is_cut_off_with_408() {
    let srv = TestServer::start(fast_config());
    let mut s = connect(srv.addr);
    let start = Instant::now();
    s.write_all(b"GET / HTTP/1.1\r\nX-Slow: ").unwrap();
    for _ in 0..3 {
        thread::sleep(Duration::from_millis(60));
        let _ = s.write_all(b"a");
    }
    let reply = read_to_close(&mut s);
    assert!(reply.starts_with("HTTP/1.1 408 "), "{reply}");
    assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());
}

#[test]
fn idle_keep_alive_connection_is_closed() {
    let srv = TestServer::start(fast_config());
    let mut s = connect(srv.addr);
    s.write_all(b"GET /echo HTTP/1.1\r\n\r\n").unwrap();
    read_responses(&mut s, 1);
    let start = Instant::now();
    assert_eq!(read_to_close(&mut s), "");
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn connections_over_the_maximum_get_503_with_retry_after() {
    let srv = TestServer::start(ServerConfig { connections_max: 2, ..fast_config() });
    let mut held: Vec<TcpStream> = (0..2).map(|_| connect(srv.addr)).collect();
    // Make sure both are accepted before the third arrives.
    for s in &mut held {
        s.write_all(b"GET /echo HTTP/1.1\r\n\r\n").unwrap();
        read_responses(s, 1);
    }
    let mut third = connect(srv.addr);
    let reply = read_to_close(&mut third);
    assert!(reply.starts_with("HTTP/1.1 503 "), "{reply}");
    assert!(reply.contains("retry-after: 1\r\n"), "{reply}");
    assert!(reply.contains("\"no_capacity\""), "{reply}");
}

#[test]
fn client_leaving_mid_request_is_reported() {
    let srv = TestServer::start(fast_config());
    let mut s = connect(srv.addr);
    s.write_all(b"GET /hold HTTP/1.1\r\n\r\n").unwrap();
    thread::sleep(Duration::from_millis(50));
    drop(s);
    let conn = srv.disconnects.recv_timeout(Duration::from_secs(2)).expect("a Disconnected event");
    assert!(conn.starts_with("conn-"));
}

#[test]
fn expect_continue_gets_100_then_the_answer() {
    let srv = TestServer::start(fast_config());
    let mut s = connect(srv.addr);
    s.write_all(b"POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n").unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(b"body").unwrap();
    assert!(read_responses(&mut s, 1)[0].ends_with("body"));
}

#[test]
fn client_reuses_connections_and_closes_undrained_ones() {
    let srv = TestServer::start(ServerConfig { idle_timeout: Duration::from_secs(10), ..fast_config() });
    let client = HttpClient::new(ClientConfig::default());
    let key = srv.addr.to_string();
    let deadline = || Instant::now() + Duration::from_secs(5);
    for i in 0..3 {
        let mut req = Request::new("POST", "/echo");
        req.body = format!("n{i}").into_bytes();
        let resp = client.send(srv.addr, &req, deadline()).unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.read_to_end().unwrap(), format!("n{i}").into_bytes());
        let stats = client.pool().stats(&key);
        assert_eq!((stats.idle, stats.busy), (1, 0), "one connection, reused");
    }
    // A streamed body read to the end goes back to the pool, chunk by chunk.
    let mut resp = client.send(srv.addr, &Request::new("GET", "/stream"), deadline()).unwrap();
    let mut body = Vec::new();
    while let Some(piece) = resp.next_chunk().unwrap() {
        body.extend(piece);
    }
    assert_eq!(body, b"data: 0\n\ndata: 1\n\ndata: 2\n\n");
    assert_eq!(client.pool().stats(&key).idle, 1);
    // Dropped after the head only: closed, never reused.
    let resp = client.send(srv.addr, &Request::new("GET", "/stream"), deadline()).unwrap();
    assert_eq!(client.pool().stats(&key).busy, 1);
    drop(resp);
    let stats = client.pool().stats(&key);
    assert_eq!((stats.idle, stats.busy), (0, 0));
}

#[test]
fn acquire_waits_only_until_its_deadline() {
    let srv = TestServer::start(fast_config());
    let client = HttpClient::new(ClientConfig {
        pool: PoolConfig { connections_per_upstream_max: 1, ..PoolConfig::default() },
        ..ClientConfig::default()
    });
    let held = client
        .send(srv.addr, &Request::new("GET", "/stream"), Instant::now() + Duration::from_secs(5))
        .unwrap();
    let start = Instant::now();
    let err =
        client.send(srv.addr, &Request::new("GET", "/echo"), start + Duration::from_millis(200)).unwrap_err();
    let waited = start.elapsed();
    assert!(matches!(err, HttpError::AcquireTimeout { busy: 1, .. }), "{err:?}");
    assert!(waited >= Duration::from_millis(190) && waited < Duration::from_secs(2), "{waited:?}");
    drop(held);
    let ok = client
        .send(srv.addr, &Request::new("GET", "/echo"), Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[test]
fn a_server_that_never_answers_hits_the_deadline() {
    let srv = TestServer::start(fast_config());
    let client = HttpClient::new(ClientConfig::default());
    let start = Instant::now();
    let err =
        client.send(srv.addr, &Request::new("GET", "/hold"), start + Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, HttpError::DeadlineExceeded), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    // The server learns the client left.
    assert!(srv.disconnects.recv_timeout(Duration::from_secs(2)).is_ok());
}
