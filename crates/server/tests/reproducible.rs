//! The same request gives the same answer: a seeded sampled request (temperature 1) and a greedy one,
//! each sent cold, again (its prompt now a prefix-cache hit), and again while four other clients send
//! prompts of 5 to 400 words, to a unified worker and through the router to a prefill and a decode
//! worker: the same text every time, on both.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::router::RouterThread;
use common::{chat, Worker};
use pdserve_http::{ClientConfig, Header, HttpClient, Request};
use pdserve_router::Role;

/// Where requests go.
enum Target<'a> {
    Unified(&'a Worker),
    Router(&'a RouterThread),
}

impl Target<'_> {
    fn text(&self, body: &str) -> String {
        let (s, v) = match self {
            Target::Unified(w) => w.json("POST", "/v1/chat/completions", body),
            Target::Router(r) => r.json("POST", "/v1/chat/completions", body),
        };
        assert_eq!(s, 200, "{v}");
        v["choices"][0]["message"]["content"].as_str().expect("content").to_owned()
    }
}

/// A prompt of `words` words, different for each `seed`.
fn words(words: usize, seed: usize) -> String {
    const W: [&str; 12] = [
        "river", "stone", "market", "winter", "lantern", "copper", "garden", "signal", "harbour", "orbit",
        "meadow", "engine",
    ];
    (0..words).map(|i| W[(i * 7 + seed * 5 + i / 3) % W.len()]).collect::<Vec<_>>().join(" ")
}

/// Four clients sending prompts of 5 to 400 words to `addr` until `stop`.
fn load(addr: SocketAddr, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..4)
        .map(|c| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let client = HttpClient::new(ClientConfig::default());
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let n = [5, 40, 120, 400, 17, 250][(c + i) % 6];
                    let mut r = Request::new("POST", "/v1/chat/completions");
                    r.body =
                        chat(&words(n, c * 100 + i), r#","temperature":0.7,"max_tokens":6"#).into_bytes();
                    r.headers
                        .push(Header { name: "content-type".into(), value: b"application/json".to_vec() });
                    if let Ok(resp) = client.send(addr, &r, Instant::now() + Duration::from_secs(120)) {
                        let _ = resp.read_to_end();
                    }
                    i += 1;
                }
            })
        })
        .collect()
}

#[test]
fn the_same_request_gives_the_same_text_cold_warm_under_load_unified_and_pd() {
    let q4 = ["--weights", "q4"];
    let unified = Worker::start(&q4);
    let prefill = Worker::start(&["--weights", "q4", "--role", "prefill", "--kv-shm"]);
    let decode = Worker::start(&["--weights", "q4", "--role", "decode"]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    let question = format!(
        "Here are some notes: {}. Write a short story that uses three of these words, and give it a title.",
        words(40, 1)
    );
    let requests = [
        chat(&question, r#","temperature":1,"seed":4242,"max_tokens":64"#),
        chat(
            "Explain, step by step, how a bicycle stays upright while it moves, for a child of ten.",
            r#","temperature":0,"max_tokens":64"#,
        ),
    ];
    let mut answers: Vec<Vec<(String, String)>> = vec![Vec::new(); requests.len()];
    for (name, target, addr) in
        [("unified", Target::Unified(&unified), unified.addr), ("pd", Target::Router(&router), router.addr)]
    {
        for (i, body) in requests.iter().enumerate() {
            answers[i].push((format!("{name} cold"), target.text(body)));
            answers[i].push((format!("{name} warm"), target.text(body)));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let clients = load(addr, Arc::clone(&stop));
        std::thread::sleep(Duration::from_millis(300));
        for (i, body) in requests.iter().enumerate() {
            answers[i].push((format!("{name} under load"), target.text(body)));
        }
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.join().expect("a load client");
        }
    }
    for (body, seen) in requests.iter().zip(&answers) {
        let (first, want) = &seen[0];
        // (Long enough to tell answers apart: at temperature 1 the small model may write words of
        // many languages, so count characters, not words.)
        assert!(want.chars().count() >= 100, "{first}: a short answer: {want:?}");
        for (when, got) in &seen[1..] {
            assert_eq!(got, want, "{body}: {when} differs from {first}");
        }
    }
}
