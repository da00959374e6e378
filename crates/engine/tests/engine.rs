//! The engine embedded without HTTP, on the default model: a chat answer; stop strings; a prefill
//! engine and a decode engine in one process giving the unified engine's text; aborts and deadlines
//! ending requests exactly once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_api::Role;
use pdserve_engine::{Engine, EngineConfig, Finish, Id, Input, Output, Request};
use pdserve_model::ChatMessage;

fn model() -> std::path::PathBuf {
    pdserve_import::fetch::ensure_default_model(
        &pdserve_import::fetch::models_dir(),
        &mut pdserve_import::Silent,
        false,
    )
    .expect("default model")
}

fn engine(role: Role) -> Engine {
    let mut c = EngineConfig::new(model());
    c.role = role;
    c.kv_blocks = 256;
    Engine::start(c, Arc::new(|| {})).expect("engine starts")
}

fn chat(q: &str) -> Input {
    Input::Chat(vec![ChatMessage::new("user", q)])
}

/// Runs the engine until `id` ends: its text, and every output it got in order.
fn run_to_end(e: &mut Engine, id: Id) -> (String, Vec<Output>) {
    let mut text = String::new();
    let mut seen = Vec::new();
    let until = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    loop {
        e.poll_timeout(Duration::from_millis(200), &mut out);
        for o in out.drain(..) {
            if o.id() != id {
                continue;
            }
            if let Output::Text { text: t, .. } = &o {
                text.push_str(t);
            }
            let end =
                matches!(o, Output::Finished { .. } | Output::Rejected { .. } | Output::Prefilled { .. });
            seen.push(o);
            if end {
                return (text, seen);
            }
        }
        assert!(Instant::now() < until, "no end within 60 s: {seen:?}");
    }
}

fn request(id: &str, input: Input, max_tokens: usize) -> Request {
    let mut r = Request::new(id, input, Instant::now() + Duration::from_secs(60));
    r.max_tokens = Some(max_tokens);
    r
}

#[test]
fn a_chat_answer_and_stop_strings() {
    let mut e = engine(Role::Unified);
    let id = e.submit(request("q1", chat("What is the capital of France?"), 16)).unwrap();
    let (text, seen) = run_to_end(&mut e, id);
    assert_eq!(text, "The capital of France is Paris.");
    assert!(matches!(seen[0], Output::Admitted { .. }), "{seen:?}");
    let Some(Output::Finished { finish, usage, .. }) = seen.last() else { panic!("{seen:?}") };
    assert_eq!(*finish, Finish::Stop);
    assert!(usage.prompt_tokens > 5 && usage.completion_tokens >= 7, "{usage:?}");
    // A stop string ends generation before it; the stop string is not shown.
    let mut r = request("q2", chat("What is the capital of France?"), 16);
    r.stop = vec!["France".into()];
    let id = e.submit(r).unwrap();
    let (text, seen) = run_to_end(&mut e, id);
    assert_eq!(text, "The capital of ");
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Stop, .. })), "{seen:?}");
    assert!(e.is_empty());
}

#[test]
fn prefill_and_decode_engines_give_the_unified_text() {
    let mut unified = engine(Role::Unified);
    let mut prefill = engine(Role::Prefill);
    let mut decode = engine(Role::Decode);
    for (i, q) in ["What is the capital of France?", "Write one sentence about the sea."].iter().enumerate() {
        let id = unified.submit(request(&format!("u{i}"), chat(q), 20)).unwrap();
        let (want, seen) = run_to_end(&mut unified, id);
        let Some(Output::Finished { finish: want_finish, .. }) = seen.last() else { panic!("{seen:?}") };
        let id = prefill.submit(request(&format!("p{i}"), chat(q), 20)).unwrap();
        let (_, seen) = run_to_end(&mut prefill, id);
        let Some(Output::Prefilled { handle, usage, .. }) = seen.last() else { panic!("{seen:?}") };
        assert_eq!(usage.completion_tokens, 1);
        let id = decode.submit(request(&format!("d{i}"), Input::Remote(handle.clone()), 20)).unwrap();
        // The prefill engine must keep pumping its transfers while the decode engine pulls.
        let until = Instant::now() + Duration::from_secs(60);
        let mut text = String::new();
        let mut out = Vec::new();
        'pulled: loop {
            prefill.poll(Instant::now(), &mut out);
            out.clear();
            decode.poll_timeout(Duration::from_millis(20), &mut out);
            for o in out.drain(..) {
                match o {
                    Output::Text { text: t, .. } => text.push_str(&t),
                    Output::Finished { id: done, finish, usage, .. } if done == id => {
                        assert_eq!(&finish, want_finish);
                        assert!(usage.prompt_tokens > 5, "the prompt's length came with the KV: {usage:?}");
                        break 'pulled;
                    }
                    Output::Rejected { error, .. } => panic!("{error}"),
                    _ => {}
                }
            }
            assert!(Instant::now() < until);
        }
        assert_eq!(text, want, "prompt {q:?}");
    }
    // A decode engine takes only remote prompts; the others take none.
    assert!(decode.submit(request("x", chat("Hi"), 2)).is_err());
}

#[test]
fn aborts_and_deadlines_end_requests_once() {
    let mut e = engine(Role::Unified);
    let mut r = request("long", Input::Text("Count from one to a thousand:".into()), 400);
    r.ignore_eos = true;
    let id = e.submit(r).unwrap();
    assert!(
        e.submit(request("long", Input::Text("again".into()), 2)).is_err(),
        "ids are unique among live requests"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(e.abort(id));
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Cancelled, .. })), "{seen:?}");
    // A deadline that passes mid-generation ends the request as timed out, while decoding.
    let mut r = request("late", Input::Text("Count from one to a thousand:".into()), 400);
    r.ignore_eos = true;
    r.deadline = Instant::now() + Duration::from_millis(300);
    let id = e.submit(r).unwrap();
    let (_, seen) = run_to_end(&mut e, id);
    let Some(Output::Finished { finish: Finish::TimedOut { stage }, .. }) = seen.last() else {
        panic!("{seen:?}")
    };
    assert!(matches!(stage, pdserve_api::Stage::Decoding | pdserve_api::Stage::Prefilling), "{stage}");
    assert!(e.is_empty());
    assert!(!e.abort(id), "an ended request is not live");
}
