//! The OpenAI-compatible API against a real worker process: answers, streams, stop sequences, seeds,
//! logprobs, models, health, metrics and introspection.

mod common;

use std::sync::OnceLock;

use common::{chat, Worker};

fn worker() -> &'static Worker {
    static W: OnceLock<Worker> = OnceLock::new();
    W.get_or_init(|| Worker::start(&[]))
}

#[test]
fn chat_answers_the_capital_question() {
    let (status, v) = worker().json(
        "POST",
        "/v1/chat/completions",
        &chat("What is the capital of France?", r#","temperature":0,"max_tokens":20"#),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "The capital of France is Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let u = &v["usage"];
    assert_eq!(
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap()
    );
}

#[test]
fn streaming_chat_with_usage() {
    let (status, events) = worker().stream(
        "/v1/chat/completions",
        &chat(
            "What is the capital of France?",
            r#","temperature":0,"max_tokens":20,"stream":true,"stream_options":{"include_usage":true}"#,
        ),
    );
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "The capital of France is Paris.");
    let finish: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["stop"]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() >= 8);
}

#[test]
fn completions_with_stop_sequences_length_and_token_prompts() {
    let w = worker();
    let (s, v) = w.json(
        "POST",
        "/v1/completions",
        r#"{"prompt":"The capital of France is","max_tokens":12,"temperature":0,"stop":[" Paris"]}"#,
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!v["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{v}");
    let (s, v) = w.json(
        "POST",
        "/v1/completions",
        r#"{"prompt":[504, 3575, 282],"max_tokens":3,"temperature":0,"ignore_eos":true}"#,
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    // Streaming completions end with a stop too, and nothing past the stop string leaks out.
    let (s, events) = w.stream(
        "/v1/completions",
        r#"{"prompt":"1, 2, 3, 4,","max_tokens":20,"temperature":0,"stop":["7"],"stream":true}"#,
    );
    assert_eq!(s, 200);
    let text: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect();
    assert!(!text.contains('7') && text.contains('5'), "{text:?}");
}

#[test]
fn seeded_sampling_repeats_and_logprobs_are_reported() {
    let w = worker();
    let body = chat(
        "Write a short poem about the sea.",
        r#","temperature":0.9,"top_p":0.95,"seed":1234,"max_tokens":24,"logprobs":true,"top_logprobs":2"#,
    );
    let (s1, a) = w.json("POST", "/v1/chat/completions", &body);
    let (s2, b) = w.json("POST", "/v1/chat/completions", &body);
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
    let lp = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!lp.is_empty());
    for t in lp {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
    }
}

#[test]
fn models_health_metrics_and_debug() {
    let w = worker();
    let (s, v) = w.json("GET", "/v1/models", "");
    assert_eq!((s, v["data"][0]["id"].as_str()), (200, Some("SmolLM2-135M-Instruct")));
    // One KV group: all 30 layers' K and V, a row per token, no per-request state.
    let m = &v["data"][0];
    assert_eq!(
        (m["kv_groups"][0]["name"].as_str(), m["kv_groups"][0]["layers"].as_u64()),
        (Some("full"), Some(30))
    );
    assert_eq!(m["kv_groups"][0]["bytes_per_token"].as_f64(), m["kv_bytes_per_token"].as_f64(), "{m}");
    assert_eq!(m["kv_state_bytes_per_request"], 0);
    assert_eq!(w.json("GET", "/health/live", "").0, 200);
    let (s, v) = w.json("GET", "/health/ready", "");
    assert_eq!((s, v["status"].as_str()), (200, Some("ready")));
    assert_eq!(w.json("GET", "/health", "").1["status"], "ready", "/health is ready, not live");
    let (s, v) = w.json("GET", "/health/generate", "");
    assert_eq!((s, v["status"].as_str()), (200, Some("ok")), "{v}");
    let metrics = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    for name in [
        "requests_finished_total",
        "requests_waiting",
        "requests_running",
        "kv_blocks{owner=\"free\"}",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds",
        "request_latency_seconds",
        "queue_wait_seconds",
        "tokens_generated_total",
        "tokens_prompt_total",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    let (s, v) = w.json("GET", "/debug/requests", "");
    assert_eq!(s, 200);
    assert!(v["requests"].is_array() && v["now_ms"].as_u64().unwrap() > 0);
    let (s, v) = w.json("POST", "/abort/nope", "");
    assert_eq!((s, v["error"]["type"].as_str()), (404, Some("not_found")));
    // The request id is taken from the client and echoed.
    let r = w.request(
        "POST",
        "/v1/chat/completions",
        &chat("Hi", r#","max_tokens":2"#),
        &[("x-request-id", "my-id-7")],
    );
    assert_eq!(r.head().header_str("x-request-id"), Some("my-id-7"));
    let v: serde_json::Value = serde_json::from_slice(&r.read_to_end().unwrap()).unwrap();
    assert_eq!(v["id"], "chatcmpl-my-id-7");
}

/// The option names SGLang and vLLM users type work beside the project's own; an unknown option is
/// refused at once, before the default model would be fetched.
#[test]
fn sglang_and_vllm_option_names_work_and_an_unknown_one_is_refused_first() {
    let w = Worker::start(&[
        "--served-model-name",
        "smol",
        "--max-model-len",
        "512",
        "--max-running-requests",
        "8",
    ]);
    let (s, v) = w.json("GET", "/v1/models", "");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["data"][0]["id"].as_str(), v["data"][0]["max_model_len"].as_u64()),
        (Some("smol"), Some(512)),
        "{v}"
    );
    // A home with no model cache: had the option been read after the fetch, this would download.
    let home = std::env::temp_dir().join(format!("pdserve-empty-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--port", "0", "--max-num-seqs-typo", "4"])
        .env("HOME", &home)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown option --max-num-seqs-typo"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "refused only after {:?}",
        started.elapsed()
    );
    assert!(std::fs::read_dir(&home).unwrap().next().is_none(), "something was written under HOME");
    std::fs::remove_dir_all(&home).unwrap();
}

/// `--cpu-cores` pins the worker: every thread on those cores, its compute pool one thread per
/// core, both reported by `/v1/models`; a core list it cannot take is refused with its reason.
#[test]
fn cpu_cores_pin_the_worker_and_bad_lists_are_refused() {
    let w = Worker::start(&["--cpu-cores", "0"]);
    let (s, v) = w.json("GET", "/v1/models", "");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (&v["data"][0]["cpu_cores"], &v["data"][0]["compute_threads"]),
        (&serde_json::json!([0]), &serde_json::json!(1)),
        "{v}"
    );
    let (s, v) = w.json("POST", "/v1/completions", r#"{"prompt":"Hello","max_tokens":4}"#);
    assert_eq!(s, 200, "{v}");
    // Every thread of the process, the compute pool's included, may run on core 0 only.
    let tasks = std::fs::read_dir(format!("/proc/{}/task", w.child.id())).unwrap();
    for t in tasks {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap();
        let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
        assert_eq!(allowed.trim(), "0", "{status}");
    }
    for (list, why) in
        [("3-1", "a range runs upwards"), ("0,x", "invalid digit"), ("100000", "past the largest")]
    {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
            .args(["--port", "0", "--cpu-cores", list])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{list}: {err}");
    }
}

/// The names endpoint pickers scrape (vLLM's) on a worker's `/metrics`, equal to the engine's own
/// series after a prefix-cache hit, with vLLM's labels; Prometheus's own checker finds nothing in the
/// whole exposition but the colon every vLLM name has.
#[test]
fn vllm_metric_names_for_endpoint_pickers() {
    let w = Worker::start(&["--served-model-name", "smol"]);
    let prompt = format!("Summarize: {}", "the quick brown fox jumps over the lazy dog ".repeat(12));
    for _ in 0..2 {
        let (s, v) = w.json("POST", "/v1/chat/completions", &chat(&prompt, r#","max_tokens":2"#));
        assert_eq!(s, 200, "{v}");
    }
    let text = String::from_utf8(w.request("GET", "/metrics", "", &[]).read_to_end().unwrap()).unwrap();
    let value = |series: &str| -> f64 {
        let line =
            text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series}:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let labels = r#"{model_name="smol",engine="0"}"#;
    let (hit, miss) = (
        value(r#"prefix_cache_tokens_total{result="hit"}"#),
        value(r#"prefix_cache_tokens_total{result="miss"}"#),
    );
    assert!(hit >= 64.0, "the second request reused the first's prompt: {hit} tokens");
    assert_eq!(value(&format!("vllm:prefix_cache_hits_total{labels}")), hit);
    assert_eq!(value(&format!("vllm:prefix_cache_queries_total{labels}")), hit + miss);
    assert_eq!(value(&format!("vllm:num_requests_running{labels}")), value("requests_running "));
    assert_eq!(value(&format!("vllm:num_requests_waiting{labels}")), value("requests_waiting "));
    assert_eq!(value(&format!("vllm:kv_cache_usage_perc{labels}")), value("kv_cache_usage_ratio "));
    assert!(
        value(r#"vllm:lora_requests_info{max_lora="0",waiting_lora_adapters="",running_lora_adapters=""}"#)
            > 1.7e9
    );
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (cargo xtask setup installs it)");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let found = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let beyond: Vec<&str> = found
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(l.starts_with("vllm:") && l.ends_with("metric names should not contain ':'")))
        .collect();
    assert!(beyond.is_empty(), "promtool: {beyond:?}");
    assert!(found.contains("vllm:num_requests_waiting"), "promtool read the aliases: {found}");
}
