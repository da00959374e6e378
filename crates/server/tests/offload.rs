//! The KV offload tier on real workers: a conversation pushed out of a small pool by others comes back
//! from host memory, or from the tier's file, instead of being computed again, with the same greedy
//! text as when it was computed (the KV that came back is the KV that left), also through a prefill
//! worker whose blocks are then pulled.

mod common;

use common::{metric, Worker};

const MOVED: &str = "kv_offload_blocks_moved_total{move=";

fn moved(w: &Worker, what: &str) -> f64 {
    metric(w, &format!("{MOVED}\"{what}\"}}"))
}

/// A prompt of about 150 tokens (ten blocks), its own from the first word.
fn body(topic: &str) -> String {
    // The topic in every sentence: no two prompts share more than the chat template's opening.
    let text = format!("{topic}: ")
        + &format!("describe the {topic} files, the {topic} build and the {topic} tests in order. ")
            .repeat(10);
    serde_json::json!({
        "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 12,
    })
    .to_string()
}

fn answer(v: &serde_json::Value) -> (String, f64) {
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
    (text, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap_or(-1.0))
}

/// Three conversations through a 24-block pool: the first is evicted by the other two, then asked
/// again. Returns the first answer and the repeat's (text, cached tokens).
fn evict_and_return(w: &Worker) -> ((String, f64), (String, f64)) {
    let (s, first) = w.json("POST", "/v1/chat/completions", &body("alpha"));
    assert_eq!(s, 200, "{first}");
    for t in ["beta", "gamma", "delta"] {
        assert_eq!(w.json("POST", "/v1/chat/completions", &body(t)).0, 200);
    }
    let (s, again) = w.json("POST", "/v1/chat/completions", &body("alpha"));
    assert_eq!(s, 200, "{again}");
    (answer(&first), answer(&again))
}

#[test]
fn an_evicted_conversation_comes_back_from_host_memory_or_disk_with_the_same_text() {
    // Without a tier: evicted, computed again.
    let plain = Worker::start(&["--kv-blocks", "24"]);
    let (first, again) = evict_and_return(&plain);
    // (The chat template's opening block, shared by every prompt, stays in the pool.)
    assert!(again.1 <= 16.0, "no tier: the pool lost it, {} tokens cached", again.1);
    assert_eq!(again.0, first.0);

    // Host memory: 24 MiB, about 64 blocks of this model's f16 KV.
    let host = Worker::start(&["--kv-blocks", "24", "--kv-offloading-size", "0.0234375"]);
    let (h_first, h_again) = evict_and_return(&host);
    assert_eq!(h_first.0, first.0);
    assert!(h_again.1 >= 128.0, "{} tokens came back", h_again.1);
    assert_eq!(h_again.0, first.0, "the KV that came back is the KV that left");
    assert!(moved(&host, "offloaded") >= 8.0 && moved(&host, "restored") >= 8.0);

    // Two blocks of host memory, then a file: blocks move down, and come back from disk.
    let dir = std::env::temp_dir().join(format!("pdserve-offload-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let disk = Worker::start(&[
        "--kv-blocks",
        "24",
        "--kv-offloading-size",
        "0.0007",
        "--kv-offload-disk-gib",
        "0.0234375",
        "--kv-offload-dir",
        d,
    ]);
    // The tier's file is nameless from the start: nothing is left behind, even by a killed worker.
    let files = || std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files(), 0);
    let (d_first, d_again) = evict_and_return(&disk);
    assert_eq!(d_first.0, first.0);
    assert!(d_again.1 >= 128.0, "{} tokens came back", d_again.1);
    assert_eq!(d_again.0, first.0);
    assert!(moved(&disk, "demoted") >= 8.0, "blocks moved down to the file");
    let used = metric(&disk, "kv_offload_blocks{medium=\"disk\",state=\"used\"}");
    assert!(used > 0.0, "{used}");
    drop(disk);
    assert_eq!(files(), 0);
    let _ = std::fs::remove_dir(&dir);

    // A decode worker refuses a tier, with the reason.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-server"))
        .args([
            "--role",
            "decode",
            "--kv-offloading-size",
            "1",
            "--port",
            "0",
            "--exit-on-stdin-eof",
            "--model",
        ])
        .arg(common::default_model())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("kv_offload"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_prefill_worker_offers_blocks_that_came_back_from_its_tier() {
    let unified = Worker::start(&[]);
    let prefill =
        Worker::start(&["--role", "prefill", "--kv-blocks", "24", "--kv-offloading-size", "0.0234375"]);
    let decode = Worker::start(&["--role", "decode"]);
    let (s, want) = unified.json("POST", "/v1/chat/completions", &body("alpha"));
    assert_eq!(s, 200);
    let through = |b: &str| {
        let (s, handle) = prefill.json("POST", "/v1/chat/completions", b);
        assert_eq!(s, 200, "{handle}");
        let mut v: serde_json::Value = serde_json::from_str(b).unwrap();
        v["pd_transfer"] = handle["pd_transfer"].clone();
        let (s, out) = decode.json("POST", "/v1/chat/completions", &v.to_string());
        assert_eq!(s, 200, "{out}");
        answer(&out)
    };
    through(&body("alpha"));
    for t in ["beta", "gamma", "delta"] {
        through(&body(t));
    }
    let restored = moved(&prefill, "restored");
    let (text, cached) = through(&body("alpha"));
    assert!(moved(&prefill, "restored") >= restored + 8.0, "the prefill worker restored the blocks");
    assert!(cached >= 128.0, "{cached}");
    assert_eq!(text, answer(&want).0, "the decode worker pulled the restored KV");
}
