//! The OTLP collector script (`otlp_collector.py`: the official opentelemetry-proto definitions)
//! driven from a test: its JSON lines, one per span. Shared with the worker's tests
//! (`crates/server/tests/traces.rs`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

pub struct Collector {
    child: Child,
    pub port: u16,
    pub spans: mpsc::Receiver<Value>,
}

impl Collector {
    pub fn start() -> Collector {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../trace/tests/otlp_collector.py");
        let mut child = Command::new(python)
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with opentelemetry-proto (cargo xtask test's venv has it)");
        let (tx, spans) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(serde_json::from_str(&l).unwrap_or(Value::String(l)));
            }
        });
        let first = spans.recv_timeout(Duration::from_secs(30)).expect("the collector starts");
        let port = first["port"].as_u64().expect("its port") as u16;
        Collector { child, port, spans }
    }
}

impl Collector {
    /// Stops the collector (its port then refuses connections).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
