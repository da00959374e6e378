//! Requests per second of a minimal keep-alive server built on this crate, beside nginx serving the same
//! small body, both measured by `wrk` in the same run (A B A B ...), so the ratio holds on a noisy machine.
//!
//! Needs `wrk` and `nginx` on PATH (`apt-get install nginx wrk`). Run with
//! `cargo xtask bench http [--seconds N] [--rounds N] [--connections N]`.
//! Writes `target/bench/http-keepalive.json`.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::Duration;

use pdserve_http::{Event, Response, Server, ServerConfig};

const BODY: &str = "hello, world\n";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

fn start_ours() -> u16 {
    let mut server =
        Server::bind("127.0.0.1:0".parse().expect("addr"), ServerConfig::default()).expect("bind");
    let port = server.local_addr().expect("addr").port();
    thread::spawn(move || {
        let mut events = Vec::new();
        let response = Response::text(200, BODY);
        loop {
            if server.poll(&mut events, None).is_err() {
                return;
            }
            for ev in events.drain(..) {
                if let Event::Request { conn, .. } = ev {
                    let _ = server.respond(conn, &response);
                }
            }
        }
    });
    port
}

struct Nginx(Child, std::path::PathBuf);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its workers; SIGKILL would orphan them.
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn start_nginx() -> (u16, Nginx) {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("pdserve-bench-nginx-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("logs")).expect("tmp dir");
    // One worker process, like our one loop thread; no logging, keep-alive without a request cap.
    let conf = format!(
        "worker_processes 1;\ndaemon off;\npid {dir}/nginx.pid;\nerror_log {dir}/logs/error.log;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n  client_body_temp_path {dir}/body;\n\
           proxy_temp_path {dir}/proxy;\n  fastcgi_temp_path {dir}/fcgi;\n  uwsgi_temp_path {dir}/uwsgi;\n\
           scgi_temp_path {dir}/scgi;\n\
           server {{ listen 127.0.0.1:{port}; location / {{ default_type text/plain; return 200 \"{body}\"; }} }}\n}}\n",
        dir = dir.display(),
        body = BODY.escape_default(),
    );
    std::fs::write(dir.join("nginx.conf"), conf).expect("write conf");
    let nginx = Nginx(
        Command::new("nginx")
            .args(["-p", &dir.to_string_lossy(), "-c", &dir.join("nginx.conf").to_string_lossy()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx on PATH (apt-get install nginx)"),
        dir,
    );
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (port, nginx);
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("nginx did not start on port {port}");
}

/// Runs wrk; returns (requests per second, p99 latency in ms).
fn wrk(port: u16, seconds: u32, connections: u32) -> (f64, f64) {
    let out = Command::new("wrk")
        .args([
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{seconds}s"),
            "--latency",
            &format!("http://127.0.0.1:{port}/"),
        ])
        .output()
        .expect("wrk on PATH (apt-get install wrk)");
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Requests/sec in wrk output:\n{text}"));
    assert!(!text.contains("Non-2xx"), "non-2xx answers:\n{text}");
    let p99 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("99%"))
        .map(|v| parse_wrk_duration_ms(v.trim()))
        .unwrap_or(f64::NAN);
    (rps, p99)
}

fn parse_wrk_duration_ms(v: &str) -> f64 {
    let (num, unit) = v.split_at(v.find(|c: char| c.is_alphabetic()).unwrap_or(v.len()));
    let n: f64 = num.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => n / 1000.0,
        "ms" => n,
        "s" => n * 1000.0,
        "m" => n * 60_000.0,
        _ => f64::NAN,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut seconds = 5;
    let mut rounds = 3;
    let mut connections = 64;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().and_then(|v| v.parse().ok()).expect("a number after the flag");
        match a.as_str() {
            "--seconds" => seconds = val(),
            "--rounds" => rounds = val(),
            "--connections" => connections = val(),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let ours = start_ours();
    let (theirs, _nginx) = start_nginx();
    // Warm both up.
    wrk(ours, 1, connections);
    wrk(theirs, 1, connections);
    let (mut ours_rps, mut nginx_rps, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    println!("round  pdserve-http req/s (p99 ms)   nginx req/s (p99 ms)   ratio");
    for round in 0..rounds {
        let (a, a99) = wrk(ours, seconds, connections);
        let (b, b99) = wrk(theirs, seconds, connections);
        println!("{round:>5}  {a:>12.0} ({a99:>6.2})          {b:>12.0} ({b99:>6.2})     {:.3}", a / b);
        ours_rps.push(a);
        nginx_rps.push(b);
        ratios.push(a / b);
    }
    let (a, b, r) = (median(&mut ours_rps), median(&mut nginx_rps), median(&mut ratios));
    println!("median: pdserve-http {a:.0} req/s, nginx {b:.0} req/s, ratio {r:.3} (wrk -t1 -c{connections} -d{seconds}s, {rounds} rounds)");
    let json = format!(
        "{{\"bench\":\"http_keepalive\",\"connections\":{connections},\"seconds\":{seconds},\"rounds\":{rounds},\
         \"pdserve_http_requests_per_second\":{a:.1},\"nginx_requests_per_second\":{b:.1},\"ratio\":{r:.4}}}\n"
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("http-keepalive.json"), json);
}
