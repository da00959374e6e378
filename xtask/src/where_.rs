//! `cargo xtask where [REQUEST_ID]`: asks the router's `/debug/requests` and prints, oldest first, where
//! each live request is: its stage on the router and on every worker it reached, and for how long.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pdserve_http::{ClientConfig, Header, HttpClient, Request};
use serde_json::Value;

const USAGE: &str = "cargo xtask where [REQUEST_ID] [--url URL] [--older-than 5s] [--json]";

/// `5s`, `500ms`, `2m`, or a bare number of seconds.
fn parse_duration(s: &str) -> Result<Duration> {
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().with_context(|| format!("not a duration: {s:?} (try 5s, 500ms, 2m)"))?;
    if !(v.is_finite() && v >= 0.0) {
        bail!("not a duration: {s:?}");
    }
    Ok(Duration::from_secs_f64(v * scale))
}

pub(crate) fn get(url: &str, path: &str) -> Result<(u16, Vec<u8>)> {
    call("GET", url, path, b"")
}

/// The workspace's HTTP client, one for the whole process (its pool is kept between calls).
fn client() -> &'static HttpClient {
    static CLIENT: OnceLock<HttpClient> = OnceLock::new();
    CLIENT.get_or_init(|| {
        HttpClient::new(ClientConfig { connect_timeout: Duration::from_secs(3), ..ClientConfig::default() })
    })
}

/// One request to `url` (`http://host:port`), its answer read to the end, 10 s at most.
pub(crate) fn call(method: &str, url: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
    call_within(method, url, path, body, Duration::from_secs(10))
}

/// Like [`call`], within `limit`.
pub(crate) fn call_within(
    method: &str,
    url: &str,
    path: &str,
    body: &[u8],
    limit: Duration,
) -> Result<(u16, Vec<u8>)> {
    let authority =
        url.strip_prefix("http://").context("--url must be http://host:port")?.trim_end_matches('/');
    let addr = std::net::ToSocketAddrs::to_socket_addrs(authority)?.next().context("address")?;
    let mut req = Request::new(method, path);
    let mut header = |name: &str, value: &str| {
        req.headers.push(Header { name: name.into(), value: value.as_bytes().to_vec() })
    };
    header("host", authority);
    header("content-type", "application/json");
    if let Some(key) = std::env::var("PDSERVE_ADMIN_KEY").ok().filter(|k| !k.is_empty()) {
        header(pdserve_api::header::AUTHORIZATION, &format!("Bearer {key}"));
    }
    req.body = body.to_vec();
    client().call(addr, &req, Instant::now() + limit).with_context(|| format!("{method} {url}{path}"))
}

fn secs(ms: &Value) -> String {
    match ms.as_i64() {
        Some(v) if v.abs() >= 1000 => format!("{:.1}s", v as f64 / 1000.0),
        Some(v) => format!("{v}ms"),
        None => "-".into(),
    }
}

/// One line per request (and one per hop), oldest first.
pub(crate) fn render(answer: &Value, only: Option<&str>) -> String {
    let mut out = String::new();
    let reqs = answer["requests"].as_array().cloned().unwrap_or_default();
    let reqs: Vec<&Value> =
        reqs.iter().filter(|r| only.is_none_or(|id| r["id"].as_str() == Some(id))).collect();
    if reqs.is_empty() {
        match only {
            Some(id) => out.push_str(&format!(
                "{id}: not live on {} (finished, or never seen)\n",
                answer["process"].as_str().unwrap_or("?")
            )),
            None => out.push_str("no live requests\n"),
        }
    }
    for r in &reqs {
        out.push_str(&format!(
            "{:<28} age {:>7}  {}: {} for {}  (deadline in {})\n",
            r["id"].as_str().unwrap_or("?"),
            secs(&r["age_ms"]),
            answer["process"].as_str().unwrap_or("router"),
            r["stage"].as_str().unwrap_or("?"),
            secs(&r["stage_age_ms"]),
            secs(&r["deadline_ms"]),
        ));
        let worker = r["worker"].as_str().unwrap_or("");
        let hops = r["hops"].as_array().cloned().unwrap_or_default();
        if hops.is_empty() && !worker.is_empty() {
            out.push_str(&format!(
                "    -> {worker}: not listed by the worker (answered, or not yet admitted)\n"
            ));
        }
        for h in hops {
            out.push_str(&format!(
                "    -> {} {}: {} for {}{}, tokens in/out {}/{}, kv blocks {}\n",
                h["process"].as_str().unwrap_or("?"),
                h["worker"].as_str().unwrap_or("?"),
                h["stage"].as_str().unwrap_or("?"),
                secs(&h["stage_age_ms"]),
                waiting(&h),
                h["tokens_in"],
                h["tokens_out"],
                h["kv_blocks"],
            ));
        }
    }
    for w in answer["workers"].as_array().into_iter().flatten() {
        if let Some(e) = w["error"].as_str() {
            out.push_str(&format!("(worker {} did not answer: {e})\n", w["url"].as_str().unwrap_or("?")));
        }
        // Each worker's stages: how many requests, the oldest's wait and what it waits for.
        let stages = w["stages"].as_object().into_iter().flatten();
        let line: Vec<String> = stages
            .map(|(stage, s)| {
                format!("{stage} {} (oldest {}{})", s["requests"], secs(&s["oldest_ms"]), waiting(s))
            })
            .collect();
        if !line.is_empty() {
            let name = w["process"].as_str().or(w["url"].as_str()).unwrap_or("?");
            out.push_str(&format!("{name}: {}\n", line.join(", ")));
        }
    }
    out
}

/// ", waiting for X" where an entry says what it waits for.
fn waiting(v: &Value) -> String {
    v["waiting_for"].as_str().map_or_else(String::new, |w| format!(", waiting for {w}"))
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut url = "http://127.0.0.1:8000".to_owned();
    let mut older = Duration::ZERO;
    let mut id: Option<String> = None;
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--url" => url = it.next().context("--url needs a value")?.clone(),
            "--older-than" => older = parse_duration(it.next().context("--older-than needs a value")?)?,
            "--json" => json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            s if s.starts_with('-') => bail!("unknown option {s}\n{USAGE}"),
            s => id = Some(s.to_owned()),
        }
    }
    let (status, body) = get(&url, &format!("/debug/requests?older_than_ms={}", older.as_millis()))?;
    if status != 200 {
        bail!("{url}/debug/requests answered {status}: {}", String::from_utf8_lossy(&body));
    }
    let v: Value = serde_json::from_slice(&body).context("the answer is not JSON")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", render(&v, id.as_deref()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn renders_hops_oldest_first() {
        let v = serde_json::json!({"process": "router", "requests": [
            {"id": "req-a", "stage": "decoding", "stage_age_ms": 1200, "age_ms": 5300, "deadline_ms": 2000,
             "worker": "http://d", "hops": [{"process": "decode-0", "worker": "http://d", "stage": "decode_queued",
             "stage_age_ms": 1100, "tokens_in": 12, "tokens_out": 40, "kv_blocks": 4, "waiting_for": "running_slot"}]},
            {"id": "req-b", "stage": "router_queued", "stage_age_ms": 10, "age_ms": 10, "deadline_ms": 900, "worker": "", "hops": []}],
            "workers": [{"url": "http://p", "error": "timed out"},
                {"url": "http://d", "process": "decode-0", "stages": {"decode_queued": {"requests": 3,
                 "oldest_ms": 12100, "oldest_id": "req-a", "waiting_for": "running_slot"}}}]});
        let text = render(&v, None);
        let a = text.find("req-a").unwrap();
        let b = text.find("req-b").unwrap();
        assert!(a < b, "{text}");
        assert!(text.contains("age    5.3s  router: decoding for 1.2s"), "{text}");
        assert!(
            text.contains(
                "-> decode-0 http://d: decode_queued for 1.1s, waiting for running_slot, tokens in/out 12/40"
            ),
            "{text}"
        );
        assert!(
            text.contains("decode-0: decode_queued 3 (oldest 12.1s, waiting for running_slot)"),
            "{text}"
        );
        assert!(text.contains("worker http://p did not answer"), "{text}");
        assert!(render(&v, Some("req-z")).contains("req-z: not live on router"));
    }
}
