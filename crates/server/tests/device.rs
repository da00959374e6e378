//! `--device` and `--weights`: what runs the model is chosen at start. Without a GPU the worker refuses
//! to start with a clear message (never a worker that accepts requests it cannot run); with one it
//! serves. `--weights q4` serves from 4-bit decode weights and says so in `/v1/models`.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> std::path::PathBuf {
    pdserve_import::fetch::ensure_default_model(
        &pdserve_import::fetch::models_dir(),
        &mut pdserve_import::Silent,
        false,
    )
    .expect("default model")
}

/// Runs the worker with `args` on the default model until it exits: (exit code, standard error).
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--port", "0"])
        .args(args)
        .arg("--model")
        .arg(model())
        .output()
        .expect("run pdserve-server");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn unknown_device_is_a_usage_error() {
    let (code, err) = refused(&["--device", "tpu"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown device \"tpu\": cpu, cuda or cuda:N"), "{err}");
}

#[test]
fn cuda_device_serves_or_refuses_to_start_with_the_reason() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args(["--port", "0", "--kv-blocks", "64", "--device", "cuda", "--exit-on-stdin-eof", "--model"])
        .arg(model())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pdserve-server");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let started = Instant::now();
    let _ = stdout.read_line(&mut line);
    if let Some(addr) = line.trim().strip_prefix("listening on http://") {
        // A GPU is present: the worker must serve a completion on it.
        let body = r#"{"model":"m","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":8,"temperature":0}"#;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        use std::io::Write;
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut resp = String::new();
        let _ = s.read_to_string(&mut resp);
        drop(child.stdin.take());
        let _ = child.wait();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("Paris"), "{resp}");
        return;
    }
    let status = child.wait().expect("wait");
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success(), "without a GPU the worker must not start");
    assert!(err.contains("no usable CUDA device"), "the reason is given: {err}");
    assert!(started.elapsed() < Duration::from_secs(120));
}

#[test]
fn q4_weights_serve_the_same_greedy_answer_and_are_reported() {
    let w = common::Worker::start(&["--weights", "q4"]);
    let (status, models) = w.json("GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["weights"], "q4");
    assert_eq!(models["data"][0]["activations"], "f32");
    assert_eq!(models["data"][0]["device"], "cpu");
    // Every step, the prompt's prefill too, reads the Q4 weights, and no other copy of them is held.
    assert_eq!(models["data"][0]["multi_row_weights"], "q4");
    let (status, body) = w.json(
        "POST",
        "/v1/chat/completions",
        &common::chat("What is the capital of France?", r#","max_tokens":12,"temperature":0"#),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "The capital of France is Paris.");
}

#[test]
fn unknown_weight_format_and_quantized_weights_on_the_gpu_are_refused() {
    let (code, err) = refused(&["--weights", "q2"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown weight format \"q2\": f32, bf16, q8 or q4"), "{err}");
    let (code, err) = refused(&["--weights", "q4", "--device", "cuda"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("weights q4 are a CPU format"), "{err}");
}

/// `--activations q8` (int8 inputs to the quantized weights' products, in every step: the prompt's
/// too) is reported and answers, the same text each time; it needs quantized weights, and a value
/// that is neither f32 nor q8 is refused.
#[test]
fn int8_activations_serve_and_are_refused_without_quantized_weights() {
    let w = common::Worker::start(&["--weights", "q4", "--activations", "q8"]);
    let (_, models) = w.json("GET", "/v1/models", "");
    assert_eq!(models["data"][0]["activations"], "q8");
    let ask = || {
        let body = common::chat("What is the capital of France?", r#","max_tokens":12,"temperature":0"#);
        let (status, body) = w.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned()
    };
    let content = ask();
    assert!(content.split_whitespace().count() >= 3, "{content:?}");
    assert_eq!(ask(), content, "the same text again (a prefix hit now)");
    let (code, err) = refused(&["--activations", "q8", "--weights", "f32"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("int8 activations need q8 or q4 weights, not f32"), "{err}");
    let (code, err) = refused(&["--weights", "q4", "--activations", "q8", "--device", "cuda"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("activations q8 on a GPU"), "{err}");
    let (code, err) = refused(&["--activations", "q4"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--activations q4: f32 or q8"), "{err}");
}

/// Every CPU kernel family this machine has (AMX tiles, AVX-512, AVX2, the portable loops), forced
/// in turn, serves the default model's greedy answer (in q4, and in bf16 where the family has a bf16
/// GEMM: AMX's tiles, AVX-512 BF16); the choice is reported, and a name that is none is refused.
#[test]
fn every_cpu_kernel_path_serves_the_same_greedy_answer() {
    for k in pdserve_engine::CpuKernels::available() {
        let bf16_gemm =
            k.name() == "amx" || k.name() == "avx512" && std::arch::is_x86_feature_detected!("avx512bf16");
        for weights in if bf16_gemm { &["q4", "bf16"][..] } else { &["q4"][..] } {
            let w = common::Worker::start(&["--weights", weights, "--cpu-kernels", k.name()]);
            let (_, models) = w.json("GET", "/v1/models", "");
            assert_eq!(models["data"][0]["cpu_kernels"], k.name());
            let (status, body) = w.json(
                "POST",
                "/v1/chat/completions",
                &common::chat("What is the capital of France?", r#","max_tokens":12,"temperature":0"#),
            );
            assert_eq!(status, 200, "{body}");
            let answer = &body["choices"][0]["message"]["content"];
            assert_eq!(answer, "The capital of France is Paris.", "{k:?} {weights}");
        }
    }
    let (code, err) = refused(&["--cpu-kernels", "sse9"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("amx, avx512, avx2 or portable"), "{err}");
}
