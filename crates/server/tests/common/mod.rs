//! A worker process for tests: started on a free port, killed when dropped.
#![allow(dead_code)]

pub mod fixtures;
pub mod migrate;
pub mod router;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pdserve_http::{ClientConfig, ClientResponse, Header, HttpClient, Request, SseDecoder};

pub struct Worker {
    pub addr: SocketAddr,
    pub child: Child,
    /// Held open: when the test process exits, the worker sees end of file and stops.
    _stdin: Option<std::process::ChildStdin>,
    pub client: HttpClient,
}

/// The default model's folder, fetched and imported on first use.
pub fn default_model() -> std::path::PathBuf {
    pdserve_import::fetch::ensure_default_model(
        &pdserve_import::fetch::models_dir(),
        &mut pdserve_import::Silent,
        false,
    )
    .expect("default model")
}

impl Worker {
    /// Starts `pdserve-server` with `args` (the default model, fetched if needed).
    pub fn start(args: &[&str]) -> Worker {
        Worker::start_in(None, &[], args)
    }

    /// Like [`start`](Self::start), inside network namespace `netns` (`ip netns exec`) if given,
    /// with `env` set; the address it reports is rewritten to `host` when it binds 0.0.0.0.
    pub fn start_in(netns: Option<(&str, &str)>, env: &[(&str, &str)], args: &[&str]) -> Worker {
        let model = default_model();
        let bin = env!("CARGO_BIN_EXE_pdserve-server");
        let mut cmd = match netns {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
            None => Command::new(bin),
        };
        let mut child = cmd
            .envs(env.iter().copied())
            .args(["--port", "0", "--kv-blocks", "256", "--exit-on-stdin-eof", "--model"])
            .arg(model)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn pdserve-server");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(a.parse::<SocketAddr>().expect("address"));
                }
            }
        });
        let mut addr = rx.recv_timeout(Duration::from_secs(120)).expect("the worker did not start");
        if let Some((_, host)) = netns {
            addr.set_ip(host.parse().expect("host address"));
        }
        Worker { addr, child, _stdin: stdin, client: HttpClient::new(ClientConfig::default()) }
    }

    pub fn request(&self, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> ClientResponse {
        let mut r = Request::new(method, path);
        r.body = body.as_bytes().to_vec();
        r.headers.push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
        for (k, v) in headers {
            r.headers.push(Header { name: (*k).into(), value: v.as_bytes().to_vec() });
        }
        self.client.send(self.addr, &r, Instant::now() + Duration::from_secs(120)).expect("request")
    }

    /// Status and parsed JSON body.
    pub fn json(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let r = self.request(method, path, body, &[]);
        let status = r.status();
        let bytes = r.read_to_end().expect("body");
        (status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
    }

    /// Status, headers and SSE `data` payloads of a streaming request.
    pub fn stream(&self, path: &str, body: &str) -> (u16, Vec<String>) {
        let mut r = self.request("POST", path, body, &[]);
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

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill").args([sig, &self.child.id().to_string()]).status();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn chat(content: &str, extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":{}}}]{extra}}}"#,
        serde_json::Value::String(content.into())
    )
}

/// A counter or gauge of `w`'s `/metrics` (0 when absent).
pub fn metric(w: &Worker, series: &str) -> f64 {
    let m = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Runs `script` (in tests/) with the base URL and `args`; its last word must be OK.
pub fn run_python(script: &str, base: &str, args: &[&str]) {
    let path = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .arg(&path)
        .arg(base)
        .args(args)
        .output()
        .expect("python3 is needed for this test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{script} failed (the clients install with `pip install openai anthropic`):\n{stdout}\n{stderr}"
    );
}

/// Starts the server with `args` and waits for it to stop (it must, within a minute): its exit
/// success and standard error.
pub fn failed_start(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server started with {args:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.success(), err)
}
