//! A stack with a cluster secret lets no one in: its workers answer only requests that carry the secret
//! (the router's), the probes where they are opened, and `/v1/*` with their own API key; a KV handle
//! (`pd_transfer`) that would make a decode worker connect somewhere is taken only from the router,
//! and the router refuses one from a client before any worker hears of it.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use common::router::RouterThread;
use common::Worker;
use pdserve_api::header::CLUSTER_SECRET;
use pdserve_router::Role;
use serde_json::json;

/// A secret in a file of its own: (the file, the secret).
fn secret_file(name: &str) -> (PathBuf, String) {
    let secret = format!("secret-{}-{name}-0123456789abcdef", std::process::id());
    let path = std::env::temp_dir().join(format!("pdserve-secret-{}-{name}", std::process::id()));
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    (path, secret)
}

#[test]
fn workers_with_a_secret_serve_their_stack_only() {
    let (file, secret) = secret_file("closed");
    let w = Worker::start(&["--cluster-secret-file", file.to_str().unwrap()]);
    let completion = r#"{"prompt":"Hi","max_tokens":2}"#;
    let routes = [
        ("POST", "/v1/completions", completion),
        ("POST", "/tokenize", r#"{"prompt":"Hi"}"#),
        ("GET", "/v1/models", ""),
        ("GET", "/debug/requests", ""),
        ("GET", "/metrics", ""),
        ("GET", "/health/live", ""),
    ];
    for (method, path, body) in routes {
        for wrong in [None, Some("wrong"), Some(&secret[..secret.len() - 1])] {
            let headers: Vec<(&str, &str)> = wrong.map(|s| (CLUSTER_SECRET, s)).into_iter().collect();
            let r = w.request(method, path, body, &headers);
            assert_eq!(r.status(), 401, "{method} {path} with {wrong:?}");
            let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
            assert!(v["error"]["message"].as_str().unwrap().contains(CLUSTER_SECRET), "{v}");
        }
        let r = w.request(method, path, body, &[(CLUSTER_SECRET, &secret)]);
        assert_eq!(r.status(), 200, "{method} {path} with the secret");
    }
    drop(w);

    // Probes opened for an orchestrator, and clients with the worker's own API key on /v1/* only.
    let w =
        Worker::start(&["--cluster-secret-file", file.to_str().unwrap(), "--open-probes", "--api-key", "k1"]);
    for path in ["/health/live", "/health/ready", "/metrics"] {
        assert_eq!(w.request("GET", path, "", &[]).status(), 200, "{path}");
    }
    for (headers, want) in [
        (vec![("authorization", "Bearer k1")], 200),
        (vec![("x-api-key", "k1")], 200),
        (vec![("authorization", "Bearer k2")], 401),
        (vec![], 401),
    ] {
        assert_eq!(w.request("POST", "/v1/completions", completion, &headers).status(), want, "{headers:?}");
    }
    let key = [("authorization", "Bearer k1")];
    assert_eq!(w.request("POST", "/tokenize", r#"{"prompt":"Hi"}"#, &key).status(), 401);
    assert_eq!(w.request("GET", "/debug/requests", "", &key).status(), 401);
    drop(w);
    // An API key alone (no secret) still guards /v1/*.
    let w = Worker::start(&["--api-key", "k1"]);
    assert_eq!(w.request("POST", "/v1/completions", completion, &[]).status(), 401);
    assert_eq!(w.request("POST", "/v1/completions", completion, &key).status(), 200);
    std::fs::remove_file(file).unwrap();
}

#[test]
fn kv_handles_are_taken_from_the_router_only() {
    let (file, secret) = secret_file("pd");
    let file = file.to_str().unwrap().to_owned();
    // Where a forged handle points: nothing may ever connect here.
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let handle =
        json!({"addr": trap.local_addr().unwrap().to_string(), "transfer": 1, "epoch": 1, "shm": null});
    let forged = json!({"prompt": "Hi", "max_tokens": 2, "pd_transfer": handle}).to_string();

    let decode = Worker::start(&["--role", "decode", "--cluster-secret-file", &file, "--api-key", "k1"]);
    for headers in [vec![("authorization", "Bearer k1")], vec![]] {
        let r = decode.request("POST", "/v1/completions", &forged, &headers);
        assert_eq!(r.status(), 401, "{headers:?}");
        let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        // With the worker's API key: the handle is refused; with nothing: the key is.
        let want = if headers.is_empty() { "API key" } else { "pd_transfer" };
        assert!(msg.contains(want), "{msg}");
    }

    let prefill = Worker::start(&["--role", "prefill", "--cluster-secret-file", &file]);
    let router = RouterThread::start_with(&[(&prefill, Role::Prefill), (&decode, Role::Decode)], |c| {
        c.cluster_secret = Some(secret.clone())
    });
    let (s, v) = router.json("POST", "/v1/completions", &forged);
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("pd_transfer"), "{v}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(trap.accept().is_err(), "a forged handle made a worker connect to its address");

    // The stack itself works: the router's legs carry the secret, the decode leg its handle.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).to_string();
    let (s, v) = router.json("POST", "/v1/completions", &body);
    assert_eq!(s, 200, "{v}");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty(), "{v}");

    // Even sent with the secret, a handle is taken only with the tag its prefill worker made: a
    // real one pointed elsewhere, or a forged one with no tag, is refused before any connection.
    let inside = [(CLUSTER_SECRET, secret.as_str())];
    let r = prefill.request("POST", "/v1/completions", &body, &inside);
    let real: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
    let real = real["pd_transfer"].clone();
    assert_eq!(real["tag"].as_str().map(str::len), Some(64), "{real}");
    let mut moved = real.clone();
    moved["addr"] = json!(trap.local_addr().unwrap().to_string());
    for h in [moved, handle.clone()] {
        let forged = json!({"prompt": "Hi", "max_tokens": 2, "pd_transfer": h}).to_string();
        let r = decode.request("POST", "/v1/completions", &forged, &inside);
        assert_eq!(r.status(), 401, "{h}");
        let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("does not verify"), "{v}");
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(trap.accept().is_err(), "a handle that does not verify made a worker connect to its address");
    let taken =
        json!({"prompt": "The capital of France is", "max_tokens": 4, "pd_transfer": real}).to_string();
    let r = decode.request("POST", "/v1/completions", &taken, &inside);
    assert_eq!(r.status(), 200, "the real handle, as its prefill worker tagged it");
    std::fs::remove_file(file).unwrap();
}

/// A stack's shared KV files are named in its scope (`--shm-scope`): a decode worker of another stack
/// on the same host, even handed a real handle, maps none of them; it takes the blocks inline over the
/// transfer connection instead. Its own stack's decode worker reads them in place.
#[test]
fn shared_kv_files_are_read_by_their_own_stack_only() {
    let (file, secret) = secret_file("shm");
    let file = file.to_str().unwrap().to_owned();
    let scope = format!("a{}", std::process::id());
    let other = format!("b{}", std::process::id());
    let stack = |role: &str, scope: &str| {
        Worker::start(&["--role", role, "--kv-shm", "--shm-scope", scope, "--cluster-secret-file", &file])
    };
    let (prefill, ours, theirs) =
        (stack("prefill", &scope), stack("decode", &scope), stack("decode", &other));
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let post = |w: &Worker, body: &serde_json::Value| -> serde_json::Value {
        let r = w.request("POST", "/v1/completions", &body.to_string(), &[(CLUSTER_SECRET, &secret)]);
        assert_eq!(r.status(), 200);
        serde_json::from_slice(&r.read_to_end().unwrap()).unwrap()
    };
    let bytes = |w: &Worker, how: &str| -> f64 {
        let r = w.request("GET", "/metrics", "", &[(CLUSTER_SECRET, &secret)]);
        let text = String::from_utf8(r.read_to_end().unwrap()).unwrap();
        let key = format!("kv_transfer_bytes_total{{direction=\"{how}\"}} ");
        // (A direction never used has no series yet.)
        text.lines().find_map(|l| l.strip_prefix(key.as_str())).map_or(0.0, |v| v.parse().unwrap())
    };
    let mut texts = Vec::new();
    for decode in [&theirs, &ours] {
        let handle = post(&prefill, &body);
        let shm = handle["pd_transfer"]["shm"].as_str().unwrap().to_owned();
        assert!(shm.starts_with(&format!("/dev/shm/pdserve-kv-{scope}-")), "{shm}");
        assert!(!shm.contains(&secret));
        let mut b = body.clone();
        b["pd_transfer"] = handle["pd_transfer"].clone();
        texts.push(post(decode, &b)["choices"][0]["text"].as_str().unwrap().to_owned());
    }
    assert_eq!(bytes(&theirs, "shared"), 0.0, "another stack's decode worker read the file");
    assert!(bytes(&theirs, "received") > 0.0, "it took the blocks inline");
    assert!(bytes(&ours, "shared") > 0.0, "the stack's own decode worker reads in place");
    assert_eq!(texts[0], texts[1]);
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--shm-scope", "../x"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    std::fs::remove_file(file).unwrap();
}

/// A worker reachable from other hosts with neither an API key nor a cluster secret refuses to
/// start, saying why and what to give it; `--allow-unauthenticated` serves it open and `/v1/models`
/// says so; a key, a secret or a loopback address need nothing more.
#[test]
fn an_open_worker_beyond_loopback_is_refused_unless_allowed() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent-model-dir"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started open on 0.0.0.0: {err}");
    for want in ["--api-key", "--cluster-secret-file", "--allow-unauthenticated", "127.0.0.1"] {
        assert!(err.contains(want), "the refusal names {want}: {err}");
    }
    let open = Worker::start(&["--host", "0.0.0.0", "--allow-unauthenticated"]);
    let (status, v) = open.json("GET", "/v1/models", "");
    assert_eq!((status, &v["data"][0]["unauthenticated"]), (200, &json!(true)), "{v}");
    drop(open);
    let keyed = Worker::start(&["--host", "0.0.0.0", "--api-key", "k1"]);
    let r = keyed.request("GET", "/v1/models", "", &[("authorization", "Bearer k1")]);
    let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
    assert_eq!(v["data"][0]["unauthenticated"], json!(false), "{v}");
    drop(keyed);
    let local = Worker::start(&[]);
    assert_eq!(local.json("GET", "/v1/models", "").1["data"][0]["unauthenticated"], json!(false));
}
