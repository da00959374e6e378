//! The supervisor of `cargo xtask serve`, tested as users run it: the command itself (its debug
//! build), a worker killed under load and a SIGTERM with answers in flight.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use super::{streams, tally, Row};
use crate::where_::get;

/// The pids of `parent`'s children whose command line holds `--name NAME` (every worker and the
/// router of a stack), by name.
fn children(parent: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // `pid (comm) state ppid ...`: the fields after the last ')'.
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> =
            cmd.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let name = args.iter().position(|a| a == "--name").and_then(|i| args.get(i + 1).cloned());
        let router = args.first().is_some_and(|a| a.ends_with("pdserve-router"));
        match (name, router) {
            (Some(n), _) => out.push((n, pid)),
            (None, true) => out.push(("router".to_owned(), pid)),
            _ => {}
        }
    }
    out
}

/// The router's view of the worker at `url`: its state (`up`, `down`, ...) and whether a request
/// went through it since it was last counted up.
fn worker_state(router: &str, url: &str) -> Result<(String, bool)> {
    let (_, body) = get(router, "/workers")?;
    let list: serde_json::Value = serde_json::from_slice(&body)?;
    let w = list["workers"].as_array().into_iter().flatten().find(|w| w["url"] == url);
    let w = w.with_context(|| format!("the router does not list {url}"))?;
    let proven =
        w["last_path_ok_ago_ms"].as_u64().zip(w["state_age_ms"].as_u64()).is_some_and(|(p, s)| p <= s);
    Ok((w["state"].as_str().unwrap_or_default().to_owned(), proven))
}

/// Waits up to `within` for `f` to hold, polling every 100 ms.
fn wait_for(within: Duration, what: &str, mut f: impl FnMut() -> Result<bool>) -> Result<Duration> {
    let t = Instant::now();
    loop {
        if f().unwrap_or(false) {
            return Ok(t.elapsed());
        }
        ensure!(t.elapsed() < within, "{what} did not happen within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `cargo xtask serve --debug --prefill 1 --decode 2` (this very binary's `serve`), then: `decode-0`
/// killed (SIGKILL) while clients keep sending: the supervisor reports its death and starts it again
/// on its address, the router counts it down and then up again and sends it requests, and no client
/// request fails meanwhile (the router moves what `decode-0` held to `decode-1`). Then SIGTERM with
/// streams in flight: they all complete (the workers drain), the command exits 0 within 60 s and none
/// of its processes is left.
pub(super) fn supervisor(short: bool) -> Result<Row> {
    let logs = crate::workspace_root().join("target/chaos/supervisor");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    // This very command's binary, by path: the one running may have been replaced since it started
    // (`cargo xtask test` builds the workspace's tests first), leaving its own path dangling.
    crate::cargo(&["build", "-p", "xtask"])?;
    let exe = crate::workspace_root().join("target/debug/xtask");
    let err = std::fs::File::create(logs.join("serve.stderr"))?;
    let mut serve = Command::new(&exe)
        .args(["serve", "--debug", "--prefill", "1", "--decode", "2", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn()
        .context("starting cargo xtask serve")?;
    let result = (|| -> Result<Row> {
        let stdout = serve.stdout.take().context("serve's stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let router = format!("http://127.0.0.1:{port}");
        let stderr = || std::fs::read_to_string(logs.join("serve.stderr")).unwrap_or_default();
        // Serving: the banner printed in whole (the stack is ready before it is).
        let mut banner: Vec<String> = Vec::new();
        wait_for(Duration::from_secs(300), "the stack serving", || {
            if let Some(status) = serve.try_wait()? {
                bail!("cargo xtask serve exited with {status}:\n{}", stderr());
            }
            banner.extend(rx.try_iter());
            Ok(banner.iter().any(|l| l.starts_with("A process that dies")))
        })?;
        ensure!(crate::serve::http_status(&router, "/health/ready") == Some(200), "serving but not ready");
        let procs = children(serve.id());
        let pid_of = |name: &str| procs.iter().find(|(n, _)| n == name).map(|&(_, p)| p);
        let victim = pid_of("decode-0").context("no decode-0 among serve's children")?;
        ensure!(procs.len() == 4, "serve runs {procs:?}, wanted a router, a prefill and two decode workers");
        let (_, body) = get(&router, "/workers")?;
        let list: serde_json::Value = serde_json::from_slice(&body)?;
        let decode_urls: Vec<String> = list["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["role"] == "decode")
            .filter_map(|w| w["url"].as_str().map(str::to_owned))
            .collect();
        ensure!(decode_urls.len() == 2, "the router lists decode workers {decode_urls:?}");
        // Both decode workers proven before one dies (else the router may rest on decode-0 alone).
        wait_for(Duration::from_secs(60), "both decode workers proven", || {
            let mut all = true;
            for u in &decode_urls {
                all &= worker_state(&router, u)?.1;
                if !all {
                    streams(&router, 2, 2, 30.0, || {});
                }
            }
            Ok(all)
        })?;
        // The banner names each process's address.
        ensure!(
            banner.iter().any(|l| l.starts_with("pdserve is serving")),
            "no banner on stdout: {banner:?}"
        );
        let victim_url = banner
            .iter()
            .find_map(|l| {
                l.trim_start().strip_prefix("decode-0")?.split_whitespace().next().map(str::to_owned)
            })
            .context("the banner names no decode-0")?;
        ensure!(
            decode_urls.contains(&victim_url),
            "the banner's decode-0 {victim_url} is not among {decode_urls:?}"
        );
        // Clients keep sending while decode-0 dies and comes back.
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let (stop, router) = (Arc::clone(&stop), router.clone());
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        seen.extend(streams(&router, 1, 24, 60.0, || {}));
                    }
                    seen
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        ensure!(Command::new("kill").args(["-KILL", &victim.to_string()]).status()?.success(), "kill failed");
        let down = wait_for(Duration::from_secs(30), "the router counting decode-0 down", || {
            Ok(worker_state(&router, &victim_url)?.0 != "up")
        })?;
        let reported =
            wait_for(Duration::from_secs(30), "the supervisor reporting decode-0's death", || {
                Ok(stderr().contains("decode-0 exited with"))
            })?;
        let back = wait_for(Duration::from_secs(180), "decode-0 restarted", || {
            Ok(stderr().contains("decode-0 is back at"))
        })?;
        let new_pid = children(serve.id()).into_iter().find(|(n, _)| n == "decode-0").map(|(_, p)| p);
        ensure!(
            new_pid.is_some_and(|p| p != victim),
            "no new decode-0 process (was {victim}, now {new_pid:?})"
        );
        let line =
            stderr().lines().find(|l| l.contains("decode-0 is back at")).unwrap_or_default().to_owned();
        let url = line.split_whitespace().nth(4).unwrap_or_default().to_owned();
        ensure!(url == victim_url, "decode-0 was at {victim_url} and came back at {url}");
        // The router counts it down and then up again, and sends it requests.
        let up = wait_for(Duration::from_secs(60), "the router taking decode-0 back", || {
            let (state, proven) = worker_state(&router, &url)?;
            Ok(state == "up" && proven)
        })?;
        stop.store(true, Ordering::Relaxed);
        let during: Vec<_> = clients.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect();
        let mut row = tally(&during);
        ensure!(
            row.completed == row.sent,
            "{} of {} requests failed while decode-0 died and came back ({} hung)",
            row.sent - row.completed,
            row.sent,
            row.hung
        );
        // SIGTERM with streams in flight: they complete, everything stops.
        let n = if short { 4 } else { 8 };
        let serve_pid = serve.id();
        let before = children(serve_pid);
        let last = streams(&router, n, 48, 60.0, || {
            std::thread::sleep(Duration::from_millis(300));
            let _ = Command::new("kill").args(["-TERM", &serve_pid.to_string()]).status();
        });
        let drained = tally(&last);
        ensure!(
            drained.completed == n,
            "{} of {n} streams in flight at SIGTERM did not complete: {:?}",
            n - drained.completed,
            last.iter().filter(|o| !o.ok()).map(|o| (o.status, o.error.clone())).collect::<Vec<_>>()
        );
        let exit = wait_for(Duration::from_secs(60), "cargo xtask serve exiting after SIGTERM", || {
            Ok(serve.try_wait()?.is_some())
        })?;
        let status = serve.wait()?;
        ensure!(status.success(), "cargo xtask serve exited with {status} after SIGTERM");
        let left: Vec<_> =
            before.iter().filter(|(_, p)| std::path::Path::new(&format!("/proc/{p}")).exists()).collect();
        ensure!(left.is_empty(), "processes left after SIGTERM: {left:?}");
        row.sent += n;
        row.completed += drained.completed;
        row.note = format!(
            "decode-0 killed under 4 clients: the router counted it down after {:.1} s, death reported after {:.1} s, \
             back on its address after {:.1} s, the router up on it {:.1} s later, {} requests meanwhile all \
             completed; SIGTERM with {n} streams in flight: all completed, serve exited 0 after {:.1} s, no \
             process left",
            down.as_secs_f64(),
            reported.as_secs_f64(),
            back.as_secs_f64() + reported.as_secs_f64(),
            up.as_secs_f64(),
            during.len(),
            exit.as_secs_f64()
        );
        Ok(row)
    })();
    if serve.try_wait().ok().flatten().is_none() {
        let _ = Command::new("kill").args(["-TERM", &serve.id().to_string()]).status();
        let t = Instant::now();
        while serve.try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = serve.kill();
        let _ = serve.wait();
    }
    result
}
