//! The Python subscriber (`vllm_subscriber.py`: pyzmq, msgspec in vLLM's schema) driven from a test:
//! its JSON lines in, its commands out. Shared with the worker's tests (`crates/server/tests`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The subscriber script, talking JSON lines.
pub struct Subscriber {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<Value>,
}

impl Subscriber {
    pub fn start(pub_addr: &str, replay_addr: &str, prefix: &str) -> Subscriber {
        Subscriber::spawn(pub_addr, replay_addr, prefix).0
    }

    /// A subscriber whose SUB socket binds (a publisher configured to connect comes to it), and the
    /// address it bound.
    pub fn bound(prefix: &str) -> (Subscriber, String) {
        let (s, first) = Subscriber::spawn("bind", "-", prefix);
        let addr = first["bound"].as_str().expect("the address the subscriber bound").to_owned();
        (s, addr)
    }

    fn spawn(pub_addr: &str, replay_addr: &str, prefix: &str) -> (Subscriber, Value) {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../kv-events/tests/vllm_subscriber.py");
        let mut child = Command::new(python)
            .args([script, pub_addr, replay_addr, prefix])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with pyzmq and msgspec (cargo xtask test's venv has them)");
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(serde_json::from_str(&l).unwrap_or(Value::String(l)));
            }
        });
        let s = Subscriber { child, stdin, lines };
        let first = s.next(Duration::from_secs(30));
        assert_eq!(first["subscribed"], true, "the subscriber did not start");
        (s, first)
    }

    pub fn next(&self, within: Duration) -> Value {
        self.lines.recv_timeout(within).expect("a line from the subscriber")
    }

    /// The next line, if one comes within `within`.
    pub fn try_next(&self, within: Duration) -> Option<Value> {
        self.lines.recv_timeout(within).ok()
    }

    pub fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}
