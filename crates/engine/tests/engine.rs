//! The engine embedded without HTTP, on a small model of random weights written by the test (no
//! network, no fetched model): chat answers and stop strings; a prefill engine and a decode engine in
//! one process giving the unified engine's text, over the default transports and over one given at
//! start; prompts tokenized off the caller's thread; aborts and deadlines ending requests exactly
//! once, an abort even during a long step; drafts and greedy picks changing nothing of the text.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use pdserve_api::Role;
use pdserve_engine::{Engine, EngineConfig, Finish, Id, Input, Output, Request, TransportSpec};
use pdserve_import::RandomModel;
use pdserve_model::ChatMessage;
use pdserve_pd_transfer::{TcpTransport, Transport};

/// The small model's folder, written once per test process.
fn model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-small-{}", std::process::id()));
        RandomModel::default().write(&dir).expect("write the model");
        dir
    })
    .clone()
}

/// A larger random model, whose 1,500-token prefill takes a noticeable step.
fn slow_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-slow-{}", std::process::id()));
        let shape = RandomModel {
            hidden: 256,
            intermediate: 1024,
            layers: 8,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ..RandomModel::default()
        };
        shape.write(&dir).expect("write the model");
        dir
    })
    .clone()
}

fn config(role: Role) -> EngineConfig {
    let mut c = EngineConfig::new(model());
    c.role = role;
    c.kv_blocks = 256;
    c
}

fn engine(role: Role) -> Engine {
    Engine::start(config(role), Arc::new(|| {})).expect("engine starts")
}

/// Prefills `q` on `prefill`, then decodes it on `decode` from the handle: the decode engine's text,
/// once the prefill engine has also said its offer was served.
fn disaggregated(prefill: &mut Engine, decode: &mut Engine, name: &str, q: &str) -> (String, Finish) {
    let prefill_id = prefill.submit(request(&format!("p-{name}"), chat(q), 20)).unwrap();
    let (_, seen) = run_to_end(prefill, prefill_id);
    let Some(Output::Prefilled { handle, usage, .. }) = seen.last() else { panic!("{seen:?}") };
    assert_eq!(usage.completion_tokens, 1);
    let id = decode.submit(request(&format!("d-{name}"), Input::Remote(handle.clone()), 20)).unwrap();
    // The prefill engine must keep pumping its transfers while the decode engine pulls.
    let until = Instant::now() + Duration::from_secs(60);
    let mut text = String::new();
    let mut out = Vec::new();
    let mut ended = None;
    // The prefill engine says when its offer was served: the pull completed.
    let mut served = None;
    loop {
        prefill.poll(Instant::now(), &mut out);
        for o in out.drain(..) {
            if let Output::Served { id: s, outcome } = o {
                assert_eq!(s, prefill_id);
                served = Some(outcome);
            }
        }
        decode.poll_timeout(Duration::from_millis(20), &mut out);
        for o in out.drain(..) {
            match o {
                Output::Text { text: t, .. } => text.push_str(&t),
                Output::Finished { id: done, finish, usage, .. } if done == id => {
                    assert!(usage.prompt_tokens > 5, "the prompt's length came with the KV: {usage:?}");
                    ended = Some(finish);
                }
                Output::Rejected { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        if let (Some(finish), Some(outcome)) = (&ended, &served) {
            assert_eq!(outcome, "completed");
            return (text, finish.clone());
        }
        assert!(Instant::now() < until, "ended {ended:?}, served {served:?}");
    }
}

/// The engine's counter of KV bytes moved `how` (`sent`, `received` or `shared`).
fn transfer_bytes(e: &Engine, how: &str) -> f64 {
    let text = e.registry().render();
    let line = format!("kv_transfer_bytes_total{{direction=\"{how}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(line.as_str())).map_or(0.0, |v| v.parse().unwrap())
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
    let ask = |e: &mut Engine, name: &str, stop: Vec<String>| {
        let mut r = request(name, chat("What is the capital of France?"), 24);
        (r.ignore_eos, r.stop) = (true, stop);
        let id = e.submit(r).unwrap();
        run_to_end(e, id)
    };
    let (text, seen) = ask(&mut e, "q1", Vec::new());
    assert!(matches!(seen[0], Output::Admitted { .. }), "{seen:?}");
    let Some(Output::Finished { finish, usage, .. }) = seen.last() else { panic!("{seen:?}") };
    assert_eq!(*finish, Finish::Length);
    assert_eq!(usage.completion_tokens, 24, "{usage:?}");
    assert!(usage.prompt_tokens > 30, "the chat template's tokens and the question's: {usage:?}");
    // A stop string ends generation before it; the stop string is not shown.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "{text:?}");
    let stop: String = chars[3..5].iter().collect();
    let before = &text[..text.find(&stop).expect("in the text")];
    let (stopped, seen) = ask(&mut e, "q2", vec![stop.clone()]);
    assert_eq!(stopped, before);
    assert!(
        matches!(seen.last(), Some(Output::Finished { finish: Finish::StopString(s), .. }) if *s == stop),
        "{seen:?}"
    );
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
        let (text, finish) = disaggregated(&mut prefill, &mut decode, &i.to_string(), q);
        assert_eq!((text.as_str(), &finish), (want.as_str(), want_finish), "prompt {q:?}");
        // A decode engine also computes a prompt itself (the router's choice when it holds the
        // history): the same text, its sampler not skipping a draw made elsewhere.
        let id = decode.submit(request(&format!("local{i}"), chat(q), 20)).unwrap();
        let (local, seen) = run_to_end(&mut decode, id);
        let Some(Output::Finished { finish, .. }) = seen.last() else { panic!("{seen:?}") };
        assert_eq!((local.as_str(), finish), (want.as_str(), want_finish), "prompt {q:?} computed on decode");
    }
    // Sampled with a seed: the same draws on both (a decode engine's sampler skips the prefill
    // worker's draw only for a prompt it pulled).
    let sampled = |id: &str| {
        let mut r = request(id, chat("Tell me a story about a lighthouse."), 24);
        r.sampling.temperature = 1.0;
        r.seed = Some(42);
        r
    };
    let id = unified.submit(sampled("su")).unwrap();
    let (want, _) = run_to_end(&mut unified, id);
    let id = decode.submit(sampled("sd")).unwrap();
    let (local, _) = run_to_end(&mut decode, id);
    assert_eq!(local, want, "seeded sampling computed on decode");
}

#[test]
fn the_kv_moves_over_any_transport_the_decode_engine_is_given() {
    // A prefill engine with its KV in shared memory. The default decode transport reads the blocks
    // out of that memory; a decode engine started with plain TCP gets them inline; same text.
    let mut c = config(Role::Prefill);
    c.kv_shm = true;
    let mut prefill = Engine::start(c, Arc::new(|| {})).expect("prefill engine");
    let mut shm_decode = engine(Role::Decode);
    let mut tcp_decode =
        Engine::start_with_transport(config(Role::Decode), Arc::new(|| {}), |spec: &TransportSpec| {
            assert_eq!((spec.role, spec.listen), (Role::Decode, None));
            Ok(Box::new(TcpTransport::bind(spec.listen)?) as Box<dyn Transport>)
        })
        .expect("decode engine over TCP");
    let q = "What is the capital of France?";
    let mut unified = engine(Role::Unified);
    let id = unified.submit(request("u", chat(q), 20)).unwrap();
    let (want, _) = run_to_end(&mut unified, id);
    let (shared, _) = disaggregated(&mut prefill, &mut shm_decode, "shm", q);
    let (inline, _) = disaggregated(&mut prefill, &mut tcp_decode, "tcp", q);
    assert_eq!(shared, want);
    assert_eq!(inline, shared);
    assert!(transfer_bytes(&shm_decode, "shared") > 0.0 && transfer_bytes(&shm_decode, "received") == 0.0);
    assert!(transfer_bytes(&tcp_decode, "received") > 0.0 && transfer_bytes(&tcp_decode, "shared") == 0.0);
    // A prefill engine whose transport listens nowhere could offer its KV to no one: refused at start.
    let nowhere =
        Engine::start_with_transport(config(Role::Prefill), Arc::new(|| {}), |_: &TransportSpec| {
            Ok(Box::new(TcpTransport::bind(None)?) as Box<dyn Transport>)
        });
    assert!(matches!(nowhere, Err(pdserve_engine::EngineError::Config { .. })), "{nowhere:?}");
}

#[test]
fn prompts_are_tokenized_off_the_callers_thread() {
    let mut e = engine(Role::Unified);
    // Far past the context: `submit` takes it without tokenizing it; the text thread finds it too
    // long and the rejection comes through `poll`, with the counts.
    let long = "All work and no play makes Jack a dull boy. ".repeat(4_000);
    let id = e.submit(request("long", Input::Text(long), 8)).expect("submit does not tokenize");
    let (_, seen) = run_to_end(&mut e, id);
    let Some(Output::Rejected { error, .. }) = seen.last() else { panic!("{seen:?}") };
    assert!(
        matches!(error, pdserve_engine::EngineError::ContextLengthExceeded { prompt_tokens, context_tokens }
            if prompt_tokens > context_tokens),
        "{error}"
    );
    assert_eq!(error.kind(), pdserve_api::ErrorKind::ContextLengthExceeded);
    // Out of the table at once: the same id can be used again.
    let id = e.submit(request("long", chat("Hi"), 2)).unwrap();
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { .. })), "{seen:?}");
    assert!(e.is_empty());
}

#[test]
fn aborts_and_deadlines_end_requests_once() {
    let mut e = engine(Role::Unified);
    let mut r = request("long", Input::Text("Count from one to a thousand:".into()), 3000);
    r.ignore_eos = true;
    let id = e.submit(r).unwrap();
    assert!(
        e.submit(request("long", Input::Text("again".into()), 2)).is_err(),
        "ids are unique among live requests"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert!(e.abort(id));
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Cancelled, .. })), "{seen:?}");
    // A deadline that passes mid-generation ends the request as timed out, while decoding.
    let mut r = request("late", Input::Text("Count from one to a thousand:".into()), 3000);
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

/// The engine's count of finished steps.
fn steps_done(e: &Engine) -> f64 {
    let text = e.registry().render();
    text.lines()
        .find_map(|l| l.strip_prefix("engine_step_seconds_count "))
        .map_or(0.0, |v| v.parse().unwrap())
}

#[test]
fn an_abort_takes_effect_while_the_step_it_is_in_still_runs() {
    // One step prefills a whole 1,500-token prompt (a larger random model: a noticeable step): the
    // abort that comes meanwhile ends the request and frees its blocks before that step returns.
    let mut c = config(Role::Unified);
    c.model_dir = slow_model();
    c.scheduler.batch_tokens_max = 4096;
    c.scheduler.prefill_chunk_tokens_max = 4096;
    let mut e = Engine::start(c, Arc::new(|| {})).expect("engine starts");
    // (The byte-level tokenizer: one token a byte.)
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(33);
    let id = e.submit(request("big", Input::Text(prompt), 4)).unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    let stage = |e: &Engine| {
        let v = e.debug_requests(Instant::now(), 0, Duration::ZERO);
        v["requests"].as_array().and_then(|r| r.first()).map(|r| r["stage"].as_str().unwrap_or("").to_owned())
    };
    while stage(&e).as_deref() != Some("prefilling") {
        assert!(Instant::now() < until, "never prefilling: {:?}", stage(&e));
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = steps_done(&e);
    assert!(e.abort(id));
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Cancelled, .. })), "{seen:?}");
    assert_eq!(steps_done(&e), before, "the request ended only after its step");
    assert_eq!(stage(&e), None, "still listed after its end");
    // The step's work for it is dropped; the engine goes on serving.
    let mut r = request("after", chat("What is the capital of France?"), 8);
    r.ignore_eos = true;
    let id = e.submit(r).unwrap();
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Length, .. })), "{seen:?}");
    assert!(steps_done(&e) > before);
}

/// Prompt-lookup speculative decoding changes how fast, not what: greedy and seeded sampled answers to
/// a copy-heavy prompt are those of an engine without it (f32 weights and Q4, whose multi-row dot
/// products must equal one-row ones), drafts were verified and some accepted, and the metrics and the
/// request's timings count them.
#[test]
fn speculative_decoding_gives_the_same_text_and_takes_drafts() {
    use pdserve_engine::Speculative;
    use pdserve_model::WeightFormat;
    let q =
        "Copy this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, kiwi, lemon.";
    for weights in [WeightFormat::Auto, WeightFormat::Q4] {
        let start = |speculative| {
            let mut c = config(Role::Unified);
            (c.weights, c.speculative) = (weights, speculative);
            Engine::start(c, Arc::new(|| {})).expect("engine starts")
        };
        let (mut off, mut on) = (start(Speculative::OFF), start(Speculative::prompt_lookup(8)));
        let mut drafted = 0.0;
        for (i, temperature) in [0.0f32, 0.7].into_iter().enumerate() {
            let ask = |e: &mut Engine| {
                let mut r = request(&format!("s{i}"), chat(q), 60);
                (r.sampling.temperature, r.seed) = (temperature, Some(7));
                let id = e.submit(r).unwrap();
                let (text, seen) = run_to_end(e, id);
                let Some(Output::Finished { timings, .. }) = seen.last() else { panic!("{seen:?}") };
                let get = |k: &str| timings.0.iter().find(|(n, _)| *n == k).map_or(0.0, |(_, v)| *v);
                (text, get("draft_tokens"), get("draft_accepted_tokens"))
            };
            let (want, none, _) = ask(&mut off);
            let (got, tokens, accepted) = ask(&mut on);
            assert_eq!(got, want, "{weights:?} at temperature {temperature}");
            assert_eq!(none, 0.0, "no drafts without speculative decoding");
            assert!(tokens >= accepted, "{tokens} drafted, {accepted} accepted");
            if temperature == 0.0 {
                assert!(accepted > 0.0, "{weights:?}: a list copied twice takes drafts ({tokens} drafted)");
            }
            drafted += tokens;
        }
        let metric = |name: &str| {
            let text = on.registry().render();
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        assert_eq!(metric("spec_draft_tokens_total"), drafted);
        assert!(metric("spec_accepted_tokens_total") > 0.0);
    }
}

/// A constrained request drafts too, only what its constraint allows, each draft row sampled under
/// the mask after the drafts before it: the same text as without drafts, greedy and seeded.
#[test]
fn constrained_requests_take_drafts_with_the_same_text() {
    use pdserve_api::generation::Constraint;
    use pdserve_engine::Speculative;
    let start = |speculative| {
        let mut c = config(Role::Unified);
        c.speculative = speculative;
        Engine::start(c, Arc::new(|| {})).expect("engine starts")
    };
    let (mut off, mut on) = (start(Speculative::OFF), start(Speculative::prompt_lookup(8)));
    let grammar = "start: ITEM+\nITEM: \"apple, \" | \"banana, \" | \"cherry, \" | \"date, \"\n";
    for (i, temperature) in [0.0f32, 0.7].into_iter().enumerate() {
        let ask = |e: &mut Engine| {
            let mut r = request(
                &format!("c{i}"),
                chat("List fruit: apple, banana, cherry, date, apple, banana."),
                60,
            );
            (r.sampling.temperature, r.seed) = (temperature, Some(11));
            r.constraint = Some(Constraint::Lark(grammar.into()));
            let id = e.submit(r).unwrap();
            let (text, seen) = run_to_end(e, id);
            let Some(Output::Finished { timings, .. }) = seen.last() else { panic!("{seen:?}") };
            let get = |k: &str| timings.0.iter().find(|(n, _)| *n == k).map_or(0.0, |(_, v)| *v);
            (text, get("draft_accepted_tokens"))
        };
        let (want, _) = ask(&mut off);
        let (got, accepted) = ask(&mut on);
        assert_eq!(got, want, "temperature {temperature}");
        let words: Vec<&str> = want.split(", ").collect();
        let whole = &words[..words.len() - 1]; // (the last may be cut by max_tokens)
        assert!(
            whole.len() > 3 && whole.iter().all(|w| ["apple", "banana", "cherry", "date"].contains(w)),
            "{want}"
        );
        if temperature == 0.0 {
            assert!(accepted > 0.0, "a constrained list took no drafts: {want}");
        }
    }
}

/// A step whose sampling requests are all plain greedy asks the backend for its picks only (on a GPU
/// the logits stay on the device): the same text and log-probabilities as sampling the full logits
/// (a request asking for top alternatives takes that path), and the steps are counted.
#[test]
fn plain_greedy_steps_take_picks_only_with_the_same_tokens_and_logprobs() {
    let picked = |e: &Engine| {
        let text = e.registry().render();
        text.lines()
            .find_map(|l| l.strip_prefix("engine_greedy_pick_steps_total ")?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let ask = |e: &mut Engine, name: &str, top: usize, temperature: f32| {
        let mut r = request(name, chat("Name three rivers of Europe."), 24);
        (r.logprobs, r.sampling.top_logprobs, r.sampling.temperature, r.seed, r.ignore_eos) =
            (true, top, temperature, Some(3), true);
        let id = e.submit(r).unwrap();
        let (text, seen) = run_to_end(e, id);
        let lps: Vec<f32> = seen
            .iter()
            .filter_map(|o| match o {
                Output::Text { logprob: Some(l), .. } => Some(l.logprob),
                _ => None,
            })
            .collect();
        (text, lps)
    };
    // Each on an engine of its own, so both compute the same steps (no cached prefix for the second),
    // without drafts (a step verifying drafts samples its rows).
    let plain_engine = || {
        let mut c = config(Role::Unified);
        c.speculative = pdserve_engine::Speculative::OFF;
        Engine::start(c, Arc::new(|| {})).expect("engine starts")
    };
    let mut e = plain_engine();
    let (plain, plain_lp) = ask(&mut e, "plain", 0, 0.0);
    let steps = picked(&e);
    assert!(steps >= 20.0, "every decode step of a plain greedy request: {steps}");
    let mut e = plain_engine();
    let (full, full_lp) = ask(&mut e, "top", 2, 0.0);
    assert_eq!(picked(&e), 0.0, "a request asking for alternatives needs the logits");
    ask(&mut e, "sampled", 0, 0.8);
    assert_eq!(picked(&e), 0.0, "a sampled request needs the logits");
    assert_eq!(plain, full);
    assert_eq!(plain_lp, full_lp, "the same log-probabilities");
}

/// The calls of a run's outputs, and its end.
fn calls_and_end(outs: &[Output]) -> (Vec<pdserve_api::tools::ToolCall>, Option<Finish>) {
    let mut calls = Vec::new();
    let mut end = None;
    for o in outs {
        match o {
            Output::Text { calls: c, .. } => calls.extend(c.iter().filter_map(|p| match p {
                pdserve_engine::Piece::Call(c) => Some(c.clone()),
                _ => None,
            })),
            Output::Finished { finish, .. } => end = Some(finish.clone()),
            _ => {}
        }
    }
    (calls, end)
}

/// Calls the model writes under `auto` (here made to write two by an output grammar): all of them
/// with parallel calls, only the first without (the answer ends with it), and a call cut by
/// `max_tokens` comes back as a call with the arguments written so far, the answer's end `tool_calls`.
#[test]
fn parallel_tool_calls_false_holds_under_auto_and_cut_calls_are_calls() {
    use pdserve_api::generation::Constraint;
    use pdserve_api::tools::Tool;
    let mut e = engine(Role::Unified);
    let tool = |name: &str| Tool {
        name: name.into(),
        description: None,
        parameters: serde_json::json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        strict: false,
    };
    let two = "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.txt\"}}\n</tool_call>\n\
               <tool_call>\n{\"name\": \"ls\", \"arguments\": {\"path\": \"src\"}}\n</tool_call>";
    let grammar = format!("start: {}\n", serde_json::to_string(two).unwrap());
    let run = |e: &mut Engine, id: &str, parallel: bool, max_tokens: usize| {
        let mut r = request(id, chat("Read a.txt and list src."), max_tokens);
        r.tools = vec![tool("read_file"), tool("ls")];
        r.parallel_tool_calls = parallel;
        r.constraint = Some(Constraint::Lark(grammar.clone()));
        let id = e.submit(r).expect("submitted");
        let (text, outs) = run_to_end(e, id);
        let (calls, end) = calls_and_end(&outs);
        (text, calls, end)
    };
    let (text, calls, end) = run(&mut e, "both", true, 200);
    assert_eq!((text.trim(), calls.len(), end), ("", 2, Some(Finish::ToolCalls)));
    assert_eq!((calls[1].name.as_str(), calls[1].arguments.as_str()), ("ls", r#"{"path":"src"}"#));
    let (text, calls, end) = run(&mut e, "one", false, 200);
    assert_eq!((text.trim(), calls.len(), end), ("", 1, Some(Finish::ToolCalls)));
    assert_eq!(calls[0].name, "read_file");
    // Cut inside the second call's arguments: both calls, the second's arguments as far as written,
    // and the end `Length` (each dialect reports it: chat as `tool_calls`).
    let mut cut_at = None;
    for max_tokens in 20..200 {
        let (text, calls, end) = run(&mut e, &format!("cut{max_tokens}"), true, max_tokens);
        assert!(!text.contains("<tool_call>") && !text.contains("</tool"), "markup as text: {text:?}");
        if calls.len() == 2 && calls[1].arguments != r#"{"path":"src"}"# && !calls[1].arguments.is_empty() {
            assert_eq!(end, Some(Finish::Length));
            assert!(r#"{"path": "src"}"#.starts_with(&calls[1].arguments), "{:?}", calls[1]);
            cut_at = Some(max_tokens);
            break;
        }
    }
    assert!(cut_at.is_some(), "no max_tokens cut the second call's arguments");
    // A format whose calls come out only at the end (Mistral's list) is held to the limit too.
    let mut c = config(Role::Unified);
    c.tool_format = Some(pdserve_engine::ToolFormat::Mistral);
    let mut mistral = Engine::start(c, Arc::new(|| {})).expect("engine starts");
    let list = r#"[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.txt"}}, {"name": "ls", "arguments": {"path": "src"}}]"#;
    for (parallel, want) in [(true, 2), (false, 1)] {
        let mut r = request(&format!("m{parallel}"), chat("Read a.txt and list src."), 200);
        r.tools = vec![tool("read_file"), tool("ls")];
        r.parallel_tool_calls = parallel;
        r.constraint = Some(Constraint::Lark(format!("start: {}\n", serde_json::to_string(list).unwrap())));
        let id = mistral.submit(r).expect("submitted");
        let (text, outs) = run_to_end(&mut mistral, id);
        let (calls, end) = calls_and_end(&outs);
        assert_eq!(
            (text.trim(), calls.len(), end),
            ("", want, Some(Finish::ToolCalls)),
            "parallel {parallel}"
        );
    }
}

/// A schema about 5 s in the compiling (16,000 required patterned properties, 1.1 MB).
fn heavy_schema() -> serde_json::Value {
    let n = 16_000;
    let props: serde_json::Map<String, serde_json::Value> = (0..n)
        .map(|i| (format!("p{i}"), serde_json::json!({"type": "string", "pattern": "[a-z]{1,40}(x|y){3,9}"})))
        .collect();
    let required: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    serde_json::json!({"type": "object", "properties": props, "required": required})
}

/// Constraints compile beside the text thread: a request with a schema that compiles for seconds
/// holds up no other (a plain request sent after it ends first), one past the compile bound ends as
/// a 400 naming the bound, and one aborted while it compiles ends as cancelled.
#[test]
fn slow_constraints_compile_aside_and_end_at_their_bound() {
    use pdserve_api::generation::Constraint;
    let mut c = config(Role::Unified);
    c.grammar_compile_timeout = Duration::from_millis(1500);
    let mut e = Engine::start(c, Arc::new(|| {})).expect("engine starts");
    let mut heavy = request("heavy", chat("Fill the form."), 8);
    heavy.constraint = Some(Constraint::JsonSchema(heavy_schema()));
    let heavy = e.submit(heavy).unwrap();
    let plain = e.submit(request("plain", chat("Hi"), 4)).unwrap();
    let mut ends = Vec::new();
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(60);
    while ends.len() < 2 {
        e.poll_timeout(Duration::from_millis(100), &mut out);
        for o in out.drain(..) {
            if matches!(o, Output::Finished { .. } | Output::Rejected { .. }) {
                ends.push(o);
            }
        }
        assert!(Instant::now() < until, "no ends within 60 s: {ends:?}");
    }
    assert!(matches!(&ends[0], Output::Finished { id, .. } if *id == plain), "{ends:?}");
    let Output::Rejected { id, error } = &ends[1] else { panic!("{ends:?}") };
    assert_eq!(*id, heavy);
    assert_eq!(error.kind(), pdserve_api::ErrorKind::InvalidRequest, "{error}");
    assert!(error.to_string().contains("did not compile within 1.5 s"), "{error}");
    // Aborted while compiling: cancelled at once, not when the compile ends.
    let mut r = request("aborted", chat("Fill the form."), 8);
    r.constraint = Some(Constraint::JsonSchema(heavy_schema()));
    let id = e.submit(r).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let aborted = Instant::now();
    assert!(e.abort(id));
    let (_, seen) = run_to_end(&mut e, id);
    assert!(matches!(seen.last(), Some(Output::Finished { finish: Finish::Cancelled, .. })), "{seen:?}");
    assert!(
        aborted.elapsed() < Duration::from_secs(1),
        "cancelled after {:?}, not at once",
        aborted.elapsed()
    );
    // While both compiling threads finish the heavy compiles (the timed-out one and the aborted one,
    // which had begun), a small schema waits at most the bound and is refused as busy (a 429), never
    // held: retried, it is answered once a thread is free.
    let until = Instant::now() + Duration::from_secs(30);
    let (text, seen) = loop {
        let mut r = request("small", chat("Give a number."), 8);
        r.constraint = Some(Constraint::JsonSchema(serde_json::json!({"type": "integer"})));
        let asked = Instant::now();
        let id = e.submit(r).unwrap();
        let (text, seen) = run_to_end(&mut e, id);
        match seen.last() {
            Some(Output::Rejected { error: pdserve_engine::EngineError::Busy { .. }, .. }) => {
                assert!(asked.elapsed() < Duration::from_secs(3), "refused after {:?}", asked.elapsed());
                assert!(Instant::now() < until, "still busy after 30 s");
                std::thread::sleep(Duration::from_millis(500));
            }
            _ => break (text, seen),
        }
    };
    assert!(matches!(seen.last(), Some(Output::Finished { .. })), "{seen:?}");
    assert!(!text.is_empty() && text.chars().all(|c| c == '-' || c.is_ascii_digit()), "{text:?}");
    assert!(e.is_empty());
}
