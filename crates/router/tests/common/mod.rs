//! Test fixtures: the router on a thread of the test process, and mock workers that misbehave on cue.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdserve_http::{
    ClientConfig, ClientResponse, Header, HttpClient, Limits, Request, RequestDecoder, SseDecoder, Status,
};
use pdserve_router::{Router, RouterConfig};

pub struct RouterHandle {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    drain: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub client: HttpClient,
}

impl RouterHandle {
    pub fn start(mut cfg: RouterConfig) -> RouterHandle {
        cfg.listen = "127.0.0.1:0".parse().unwrap();
        let mut router = Router::bind(cfg).expect("router binds");
        let addr = router.local_addr().unwrap();
        let (stop, drain) = (router.stop_flag(), router.drain_flag());
        let thread = std::thread::spawn(move || router.run().expect("router loop"));
        let client = HttpClient::new(ClientConfig::default());
        RouterHandle { addr, stop, drain, thread: Some(thread), client }
    }

    /// Starts a drain (what SIGTERM does to the binary).
    pub fn drain(&self) {
        self.drain.store(true, Ordering::Relaxed);
    }

    /// Whether the router's loop has returned.
    pub fn exited(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    pub fn request(&self, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> ClientResponse {
        let mut r = Request::new(method, path);
        r.body = body.as_bytes().to_vec();
        r.headers.push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
        for (k, v) in headers {
            r.headers.push(Header { name: (*k).into(), value: v.as_bytes().to_vec() });
        }
        self.client.send(self.addr, &r, Instant::now() + Duration::from_secs(30)).expect("request")
    }

    /// Status, a header, and the parsed JSON body.
    pub fn json(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let r = self.request(method, path, body, &[]);
        let status = r.status();
        let bytes = r.read_to_end().expect("body");
        (status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
    }

    pub fn stream(&self, body: &str) -> (u16, Vec<String>) {
        let mut r = self.request("POST", "/v1/chat/completions", body, &[]);
        let status = r.status();
        let mut sse = SseDecoder::new(1 << 20);
        let mut events = Vec::new();
        while let Some(chunk) = r.next_chunk().expect("stream") {
            sse.push(&chunk);
            while let Some(e) = sse.next_event().expect("sse") {
                events.push(e.data);
            }
        }
        (status, events)
    }

    pub fn ready(&self) -> bool {
        self.json("GET", "/health/ready", "").0 == 200
    }

    /// The value of an unlabelled metric on `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let text =
            String::from_utf8(self.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
        let prefix = format!("{name} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in {text}"))
    }

    /// Waits until `n` workers have answered a probe successfully.
    pub fn wait_probed(&self, n: usize, within: Duration) {
        let until = Instant::now() + within;
        loop {
            let (_, list) = self.json("GET", "/workers", "");
            let probed = list["workers"]
                .as_array()
                .map_or(0, |ws| ws.iter().filter(|w| !w["last_probe_ok_ago_ms"].is_null()).count());
            if probed >= n {
                return;
            }
            assert!(Instant::now() < until, "{probed} of {n} workers probed within {within:?}: {list}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn wait_ready(&self, within: Duration) {
        let until = Instant::now() + within;
        while !self.ready() {
            assert!(Instant::now() < until, "router not ready within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a mock worker does with completion requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Answers (streams 5 chunks 20 ms apart when asked to stream).
    Ok = 0,
    /// Answers health and debug, never answers completions.
    HangPost = 1,
    /// Accepts connections, reads, never answers anything.
    Hang = 2,
    /// Streams two chunks, then resets the connection.
    DieMidStream = 3,
    /// Answers the first request on each connection; a later one on the same connection is closed
    /// unanswered, as by a worker that closed an idle connection just as the router reused it.
    DropReused = 4,
    /// Answers completions 503 `not_ready`, as a worker draining after SIGTERM does.
    Draining = 5,
    /// (Decode) answers a prompt sent without a handle 429 `queue_full`: no room to compute it here.
    BusyLocal = 6,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MockRole {
    Unified,
    Prefill,
    Decode,
}

#[derive(Default)]
pub struct Seen {
    /// (path, x-request-id, x-request-deadline-ms, body) of every POST.
    pub posts: Vec<(String, String, Option<u64>, String)>,
    /// Request ids whose connection closed before the answer, with when.
    pub disconnects: Vec<(String, Instant)>,
    pub aborts: Vec<String>,
    /// Request ids currently being handled (for /debug/requests).
    pub live: Vec<String>,
    /// Requests closed unanswered in `Mode::DropReused`.
    pub dropped: usize,
}

pub struct MockWorker {
    pub addr: SocketAddr,
    pub url: String,
    mode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    pub seen: Arc<Mutex<Seen>>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

/// A loopback address of its own for each mock worker of this test process (all of 127/8 is
/// loopback on Linux): a port a killed mock let go can never be taken by another test's mock, and
/// nothing else listens there, so a killed or never-started worker's address refuses connections.
fn own_loopback_ip() -> std::net::Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::net::Ipv4Addr::new(127, 0, 1 + (n / 250) as u8, 1 + (n % 250) as u8)
}

impl MockWorker {
    pub fn start(role: MockRole, mode: Mode) -> MockWorker {
        MockWorker::start_at_port(0, role, mode)
    }

    /// A mock on a loopback address of its own at `port` (0: any), as workers found through DNS
    /// share one port.
    pub fn start_at_port(port: u16, role: MockRole, mode: Mode) -> MockWorker {
        let listener = TcpListener::bind((own_loopback_ip(), port)).unwrap();
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(mode as u8));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (m, s, sn, cs) = (Arc::clone(&mode), Arc::clone(&stop), Arc::clone(&seen), Arc::clone(&conns));
        let acceptor = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                if let Ok(c) = stream.try_clone() {
                    cs.lock().unwrap().push(c);
                }
                let (m, sn) = (Arc::clone(&m), Arc::clone(&sn));
                std::thread::spawn(move || serve(stream, role, &m, &sn));
            }
        });
        MockWorker {
            addr,
            url: format!("http://{addr}"),
            mode,
            stop,
            seen,
            conns,
            acceptor: Mutex::new(Some(acceptor)),
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Stops listening and resets every connection: the worker is gone. When this returns, the
    /// listener is closed (connects are refused) and every connection it accepted is shut down.
    pub fn kill(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(acceptor) = self.acceptor.lock().unwrap().take() {
            // Wakes the accept loop, which sees the stop flag and drops the listener.
            let _ = TcpStream::connect(self.addr);
            let _ = acceptor.join();
        }
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for MockWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn mode_of(m: &AtomicU8) -> Mode {
    match m.load(Ordering::Relaxed) {
        1 => Mode::HangPost,
        2 => Mode::Hang,
        3 => Mode::DieMidStream,
        4 => Mode::DropReused,
        5 => Mode::Draining,
        6 => Mode::BusyLocal,
        _ => Mode::Ok,
    }
}

fn respond(s: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    write!(
        s,
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn serve(mut s: TcpStream, role: MockRole, mode: &AtomicU8, seen: &Mutex<Seen>) {
    let mut dec = RequestDecoder::new(Limits::default());
    let mut buf = [0u8; 16384];
    let mut served = 0;
    loop {
        let req = loop {
            match dec.decode() {
                Ok(Status::Complete(r)) => break r,
                Ok(Status::Partial) => {}
                Err(_) => return,
            }
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => dec.push(&buf[..n]),
            }
        };
        let mode = mode_of(mode);
        served += 1;
        if mode == Mode::DropReused && served > 1 {
            seen.lock().unwrap().dropped += 1;
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        if mode == Mode::Hang {
            // Read until the peer leaves; never answer.
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
            return;
        }
        let rid = req.header_str("x-request-id").unwrap_or("").to_owned();
        let path = req.path().to_owned();
        let ok = match (req.method.as_str(), path.as_str()) {
            ("GET", "/health/generate" | "/health/ready" | "/health/live") => {
                respond(&mut s, 200, r#"{"status":"ok"}"#)
            }
            ("GET", "/debug/requests") => {
                let live = seen.lock().unwrap().live.clone();
                let reqs: Vec<_> = live
                    .iter()
                    .map(|id| serde_json::json!({"id": id, "stage": "decoding", "stage_age_ms": 1, "age_ms": 1}))
                    .collect();
                respond(
                    &mut s,
                    200,
                    &serde_json::json!({"process": "mock", "now_ms": 0, "requests": reqs}).to_string(),
                )
            }
            ("POST", p) if p.starts_with("/abort/") => {
                seen.lock().unwrap().aborts.push(p["/abort/".len()..].to_owned());
                respond(&mut s, 200, "{}")
            }
            ("POST", "/v1/chat/completions" | "/v1/completions") => {
                let body = String::from_utf8_lossy(&req.body).into_owned();
                let deadline = req.header_str("x-request-deadline-ms").and_then(|v| v.parse().ok());
                {
                    let mut g = seen.lock().unwrap();
                    g.posts.push((path.clone(), rid.clone(), deadline, body.clone()));
                    g.live.push(rid.clone());
                }
                let r = completion(&mut s, role, mode, &body, &mut buf);
                let mut g = seen.lock().unwrap();
                g.live.retain(|x| x != &rid);
                if r.is_err() {
                    g.disconnects.push((rid.clone(), Instant::now()));
                }
                r
            }
            _ => respond(&mut s, 404, r#"{"error":{"type":"not_found","message":"mock","code":404}}"#),
        };
        if ok.is_err() {
            return;
        }
    }
}

/// Answers one completion; `Err` when the client went away first.
fn completion(
    s: &mut TcpStream,
    role: MockRole,
    mode: Mode,
    body: &str,
    buf: &mut [u8],
) -> std::io::Result<()> {
    if mode == Mode::Draining {
        let e = r#"{"error":{"type":"not_ready","message":"the worker is draining and takes no new requests","code":503}}"#;
        return respond(s, 503, e);
    }
    if mode == Mode::HangPost {
        loop {
            match s.read(buf) {
                Ok(0) => return Err(std::io::ErrorKind::ConnectionAborted.into()),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    if mode == Mode::BusyLocal && role == MockRole::Decode && v.get("pd_transfer").is_none() {
        let e = r#"{"error":{"type":"queue_full","message":"the queue is full","code":429}}"#;
        return respond(s, 429, e);
    }
    if role == MockRole::Prefill {
        return respond(
            s,
            200,
            r#"{"pd_transfer":{"transfer":7,"epoch":1,"addr":"127.0.0.1:1","first_token":42,"prompt_tokens":[1,2,3],"blocks":1,"shm":null},"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#,
        );
    }
    // (A decode worker sent no handle computes the prompt itself: answered as a unified one.)
    let handled =
        if role == MockRole::Decode { v["pd_transfer"]["transfer"].as_u64().unwrap_or(0) } else { 0 };
    if v["stream"].as_bool() != Some(true) {
        let answer = serde_json::json!({"id":"m","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":format!("mock answer (transfer {handled})")},"finish_reason":"stop"}]});
        return respond(s, 200, &answer.to_string());
    }
    write!(s, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")?;
    s.set_nonblocking(true)?;
    let chunks = v["max_tokens"].as_u64().unwrap_or(5);
    for i in 0..chunks {
        if mode == Mode::DieMidStream && i == 2 {
            let _ = s.shutdown(Shutdown::Both);
            return Ok(());
        }
        let ev = format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}},\"finish_reason\":null}}]}}\n\n");
        write!(s, "{:x}\r\n{ev}\r\n", ev.len())?;
        std::thread::sleep(Duration::from_millis(20));
        // A closed peer shows as a read of 0 bytes.
        match s.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::ConnectionAborted.into()),
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return Err(e),
            _ => {}
        }
    }
    let last =
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
    write!(s, "{:x}\r\n{last}\r\n0\r\n\r\n", last.len())?;
    s.set_nonblocking(false)?;
    Ok(())
}

/// An address nothing listens on (a loopback address no mock of this process uses).
pub fn dead_url() -> String {
    format!("http://{}:9", own_loopback_ip())
}

pub fn config(workers: &[(&str, pdserve_router::Role)]) -> RouterConfig {
    RouterConfig {
        workers: workers
            .iter()
            .map(|(u, r)| pdserve_router::WorkerSpec { url: (*u).to_owned(), role: *r })
            .collect(),
        probe_interval: Duration::from_millis(100),
        probe_timeout: Duration::from_millis(300),
        ..RouterConfig::default()
    }
}

pub const CHAT: &str = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":5}"#;
pub const CHAT_STREAM: &str =
    r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":5,"stream":true}"#;
