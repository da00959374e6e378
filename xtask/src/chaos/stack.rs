//! One stack per scenario: the router and its workers as supervised processes, stopped on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::serve::{stop_all, Proc};
use crate::where_::{call, get};

use super::*;

pub(super) struct Stack {
    pub(super) procs: Vec<Proc>,
    pub(super) router: String,
    pub(super) logs: PathBuf,
    pub(super) bins: (PathBuf, PathBuf),
    pub(super) model: PathBuf,
    /// Options every worker of the scenario gets besides `worker_args`, and those its decode
    /// workers get besides.
    pub(super) worker_extra: Vec<String>,
    pub(super) decode_extra: Vec<String>,
}

impl Stack {
    pub(super) fn start(
        name: &str,
        (router_extra, worker_extra, decode_extra): (&[&str], &[&str], &[&str]),
        bins: &(PathBuf, PathBuf),
        model: &Path,
    ) -> Result<Stack> {
        let logs = crate::workspace_root().join("target/chaos").join(name);
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs)?;
        let mut s = Stack {
            procs: Vec::new(),
            router: String::new(),
            logs,
            bins: bins.clone(),
            model: model.to_owned(),
            worker_extra: worker_extra.iter().map(|a| (*a).to_owned()).collect(),
            decode_extra: decode_extra.iter().map(|a| (*a).to_owned()).collect(),
        };
        let p = s.worker("prefill-0", "prefill")?;
        s.procs.push(p);
        let d = s.worker("decode-0", "decode")?;
        s.procs.push(d);
        let mut args: Vec<String> = vec![
            "--port".into(),
            "0".into(),
            "--probe-interval-s".into(),
            "0.5".into(),
            "--probe-timeout-s".into(),
            "2".into(),
            "--prefill".into(),
            s.procs[0].url.clone(),
            "--decode".into(),
            s.procs[1].url.clone(),
        ];
        args.extend(router_extra.iter().map(|a| (*a).to_owned()));
        let r = Proc::start("router", &s.bins.1, &args, &s.logs)?;
        s.router = r.url.clone();
        s.procs.push(r);
        s.wait_ready(true, Duration::from_secs(60))?;
        Ok(s)
    }

    pub(super) fn worker(&self, name: &str, role: &str) -> Result<Proc> {
        let mut args = worker_args(name, role, &self.model);
        if role == "prefill" {
            args.push("--kv-shm".into());
        }
        args.extend(self.worker_extra.iter().cloned());
        if role == "decode" {
            args.extend(self.decode_extra.iter().cloned());
        }
        Proc::start(name, &self.bins.0, &args, &self.logs)
    }

    pub(super) fn url_of(&self, name: &str) -> String {
        self.procs.iter().find(|p| p.name == name).map(|p| p.url.clone()).unwrap_or_default()
    }

    pub(super) fn signal(&self, name: &str, sig: &str) -> Result<()> {
        let p = self.procs.iter().find(|p| p.name == name).context("no such process")?;
        let ok = Command::new("kill").args([sig, &p.child.id().to_string()]).status()?.success();
        ensure!(ok, "kill {sig} {name} failed");
        Ok(())
    }

    pub(super) fn ready(&self) -> bool {
        crate::serve::http_status(&self.router, "/health/ready") == Some(200)
    }

    pub(super) fn wait_ready(&self, want: bool, within: Duration) -> Result<Duration> {
        let t = Instant::now();
        while self.ready() != want {
            ensure!(t.elapsed() < within, "router ready stayed {} for {within:?}", !want);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(t.elapsed())
    }

    /// Every process except `killed` still runs.
    pub(super) fn all_alive_but(&mut self, killed: &[&str]) -> Result<()> {
        for p in self.procs.iter_mut() {
            if killed.contains(&p.name.as_str()) {
                continue;
            }
            if let Some(status) = p.child.try_wait()? {
                bail!("{}", p.death_report(status));
            }
        }
        Ok(())
    }

    /// Ledgers, KV blocks, transfers and the router's upstream connections back to their baseline
    /// everywhere, within 15 s.
    /// After a fault: requests succeed again, no process but `dead` exited, and every ledger and KV
    /// gauge is back to zero.
    pub(super) fn recovered(&mut self, dead: &[&str]) -> Result<()> {
        after_recovery(&self.router)?;
        self.all_alive_but(dead)?;
        self.baseline(dead)
    }

    pub(super) fn baseline(&self, skip: &[&str]) -> Result<()> {
        let t = Instant::now();
        loop {
            let mut left = Vec::new();
            let (_, body) = get(&self.router, "/debug/requests")?;
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            let n = v["requests"].as_array().map_or(0, Vec::len);
            if n > 0 {
                left.push(format!("router: {n} live requests"));
            }
            // Every upstream connection the router holds is back in its pool (none left busy).
            let (_, body) = get(&self.router, "/workers")?;
            let w: serde_json::Value = serde_json::from_slice(&body)?;
            for w in w["workers"].as_array().into_iter().flatten() {
                let busy = w["connections"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(w["idle_connections"].as_u64().unwrap_or(0));
                let in_flight = w["in_flight"].as_u64().unwrap_or(0);
                if busy > 0 || in_flight > 0 {
                    left.push(format!(
                        "router -> {}: {busy} busy connections, {in_flight} in flight",
                        w["url"]
                    ));
                }
            }
            for p in self.procs.iter().filter(|p| p.name != "router" && !skip.contains(&p.name.as_str())) {
                let m = Metrics::read(&p.url)?;
                let gauge = |key: &str| m.value(key).with_context(|| p.name.clone());
                for key in [
                    "kv_blocks{owner=\"sequence\"}",
                    "kv_blocks{owner=\"transfer\"}",
                    "kv_transfers_in_flight",
                    "requests_running",
                    "requests_waiting",
                ] {
                    let val = gauge(key)?;
                    if val != 0.0 {
                        left.push(format!("{}: {key} = {val}", p.name));
                    }
                }
                // What is not held is free or cached (evictable): no block is lost.
                let (free, cached) =
                    (gauge("kv_blocks{owner=\"free\"}")?, gauge("kv_blocks{owner=\"cache\"}")?);
                if free + cached != KV_BLOCKS as f64 {
                    left.push(format!("{}: {free} free + {cached} cached blocks of {KV_BLOCKS}", p.name));
                }
            }
            if left.is_empty() {
                return Ok(());
            }
            ensure!(
                t.elapsed() < Duration::from_secs(15),
                "not back to baseline after 15 s: {}",
                left.join("; ")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(super) fn add_worker(&self, url: &str, role: &str) -> Result<()> {
        let body = format!(r#"{{"url":"{url}","role":"{role}"}}"#);
        let (s, b) = call("POST", &self.router, "/workers", body.as_bytes())?;
        ensure!(s == 201, "POST /workers answered {s}: {}", String::from_utf8_lossy(&b));
        Ok(())
    }

    /// Waits until the router has proven the worker at `url` (a pair probe or a request through it
    /// for a prefill or decode worker, its probe for a unified one): until then the router's
    /// readiness may rest on the other workers alone.
    pub(super) fn wait_proven(&self, url: &str, within: Duration) -> Result<Duration> {
        let t = Instant::now();
        loop {
            let (_, body) = get(&self.router, "/workers")?;
            let list: serde_json::Value = serde_json::from_slice(&body)?;
            let w = list["workers"].as_array().into_iter().flatten().find(|w| w["url"] == url);
            let proof = match w {
                Some(w) if w["role"] == "unified" => &w["last_probe_ok_ago_ms"],
                Some(w) => &w["last_path_ok_ago_ms"],
                None => &serde_json::Value::Null,
            };
            if !proof.is_null() {
                return Ok(t.elapsed());
            }
            ensure!(t.elapsed() < within, "the router did not prove {url} within {within:?}: {w:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `new` in `role`, adds it to the router and removes `old` (dead or alive).
    pub(super) fn replace_worker(&mut self, old: &str, new: &str, role: &str) -> Result<()> {
        let p = self.worker(new, role)?;
        let url = p.url.clone();
        self.procs.push(p);
        self.add_worker(&url, role)?;
        self.remove_worker(&self.url_of(old))
    }

    pub(super) fn remove_worker(&self, url: &str) -> Result<()> {
        let (s, b) = call("DELETE", &self.router, &format!("/workers?url={url}"), b"")?;
        ensure!(s == 200, "DELETE /workers answered {s}: {}", String::from_utf8_lossy(&b));
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        stop_all(&mut self.procs, Duration::from_secs(10));
    }
}

/// One process's `/metrics` answer.
pub(super) struct Metrics(String);

impl Metrics {
    pub(super) fn read(url: &str) -> Result<Metrics> {
        let (_, m) = get(url, "/metrics")?;
        Ok(Metrics(String::from_utf8_lossy(&m).into_owned()))
    }

    /// The value of the series `key` (name and labels as printed); a series that is not there is
    /// an error, never read as zero.
    pub(super) fn value(&self, key: &str) -> Result<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(key).filter(|v| v.starts_with(' ')).map(str::trim))
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("{key} is missing from /metrics"))
    }
}

/// KV blocks of every worker in the scenarios: small, so eviction and pressure happen.
const KV_BLOCKS: usize = 512;

/// A worker's arguments in every scenario: the served configuration (`cargo xtask serve`: Q4 decode
/// weights, bf16 multi-row steps) with a small KV cache.
pub(super) fn worker_args(name: &str, role: &str, model: &Path) -> Vec<String> {
    let blocks = KV_BLOCKS.to_string();
    let mut args: Vec<String> =
        ["--port", "0", "--name", name, "--role", role, "--kv-blocks", &blocks, "--weights", "q4", "--model"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
    args.push(model.display().to_string());
    args
}

/// `/health/ready` on the router, sampled every 100 ms on a thread of its own while a scenario runs.
pub(super) struct Readiness {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, usize, Vec<u128>)>,
}

impl Readiness {
    pub(super) fn start(router: &str) -> Readiness {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, router) = (std::sync::Arc::clone(&stop), router.to_owned());
        let thread = std::thread::spawn(move || {
            let (mut ready, mut total, mut down) = (0, 0, Vec::new());
            let t0 = Instant::now();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                total += 1;
                match crate::where_::get(&router, "/health/ready") {
                    Ok((200, _)) => ready += 1,
                    other => {
                        if std::env::var_os("CHAOS_READY_DEBUG").is_some() {
                            let why = other.map(|(s, b)| format!("{s} {}", String::from_utf8_lossy(&b)));
                            eprintln!("not ready at {} ms: {why:?}", t0.elapsed().as_millis());
                        }
                        down.push(t0.elapsed().as_millis());
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (ready, total, down)
        });
        Readiness { stop, thread }
    }

    /// Samples that were ready, of all taken, and when (ms after the start) the others were taken.
    pub(super) fn stop(self) -> (usize, usize, Vec<u128>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or((0, 0, Vec::new()))
    }
}
