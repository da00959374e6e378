//! The router on a thread of the test, in front of real worker processes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_http::{ClientConfig, Header, HttpClient, Request, SseDecoder};
use pdserve_router::{Role, Router, RouterConfig, WorkerSpec};

use super::Worker;

pub struct RouterThread {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub client: HttpClient,
}

impl RouterThread {
    pub fn start(workers: &[(&Worker, Role)]) -> RouterThread {
        RouterThread::start_with(workers, |_| {})
    }

    /// Like [`start`](Self::start), with `edit` applied to the configuration first.
    pub fn start_with(workers: &[(&Worker, Role)], edit: impl FnOnce(&mut RouterConfig)) -> RouterThread {
        let mut cfg = RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            workers: workers
                .iter()
                .map(|(w, r)| WorkerSpec { url: format!("http://{}", w.addr), role: *r })
                .collect(),
            probe_interval: Duration::from_millis(200),
            probe_timeout: Duration::from_secs(5),
            ..RouterConfig::default()
        };
        edit(&mut cfg);
        let mut router = Router::bind(cfg).unwrap();
        let addr = router.local_addr().unwrap();
        let stop = router.stop_flag();
        let thread = std::thread::spawn(move || router.run().unwrap());
        let r = RouterThread {
            addr,
            stop,
            thread: Some(thread),
            client: HttpClient::new(ClientConfig::default()),
        };
        let until = Instant::now() + Duration::from_secs(60);
        while r.json("GET", "/health/ready", "").0 != 200 {
            assert!(Instant::now() < until, "router never ready: {}", r.json("GET", "/health/ready", "").1);
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    pub fn send(&self, method: &str, path: &str, body: &str) -> pdserve_http::ClientResponse {
        let mut req = Request::new(method, path);
        req.body = body.as_bytes().to_vec();
        req.headers.push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
        self.client.send(self.addr, &req, Instant::now() + Duration::from_secs(120)).unwrap()
    }

    pub fn json(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let r = self.send(method, path, body);
        let s = r.status();
        (s, serde_json::from_slice(&r.read_to_end().unwrap()).unwrap_or_default())
    }

    pub fn stream(&self, body: &str) -> (u16, Vec<String>) {
        let mut r = self.send("POST", "/v1/chat/completions", body);
        let s = r.status();
        let mut sse = SseDecoder::new(1 << 20);
        let mut events = Vec::new();
        while let Ok(Some(chunk)) = r.next_chunk() {
            sse.push(&chunk);
            while let Ok(Some(e)) = sse.next_event() {
                events.push(e.data);
            }
        }
        (s, events)
    }
}

impl Drop for RouterThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
