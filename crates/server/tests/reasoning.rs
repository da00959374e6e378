//! Thinking models: the `<think>` span is answered apart from the answer, as `reasoning_content`
//! (chat, streamed as its own deltas), `thinking` blocks (Anthropic) and `reasoning` items
//! (Responses), never in `content`. The default model with two thinking templates written by the
//! test: Qwen3's shape (the model opens its thinking; `enable_thinking: false` closes it in the
//! prompt) and DeepSeek R1's (the prompt opens it). A grammar makes the small model write a thinking
//! span, so the split is checked both ways.

mod common;

use std::path::PathBuf;

use common::{chat, Worker};
use serde_json::{json, Value};

/// The default model's folder with `template` as its chat template.
fn thinking_model(name: &str, template: &str) -> PathBuf {
    let src = common::default_model();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"] {
        let (from, to) = (src.join(f), dir.join(f));
        if from.exists() && !to.exists() {
            std::os::unix::fs::symlink(&from, &to).unwrap();
        }
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer_config.json")).unwrap()).unwrap();
    config["chat_template"] = json!(template);
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

const QWEN3: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n\
    {%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}\
    {{ m.content }}<|im_end|>\n{%- endfor %}\
    {%- if add_generation_prompt %}<|im_start|>assistant\n\
    {%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}";

const R1: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}\
    {%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}";

/// The thinking and the answer the grammar makes the model write.
const GRAMMAR: &str = r#"start: "<think>\n" THOUGHT "\n</think>\n\n" ANSWER
THOUGHT: /[a-z][a-z ]{4,30}/
ANSWER: /[A-Z][a-z ]{3,30}/
"#;

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_owned()
}

#[test]
fn thinking_is_answered_apart_in_every_dialect() {
    let w = Worker::start(&["--model", thinking_model("qwen3-think", QWEN3).to_str().unwrap()]);
    let (_, models) = w.json("GET", "/v1/models", "");
    assert_eq!(models["data"][0]["reasoning_parser"], "think", "{models}");
    let body = chat(
        "Say hello.",
        &format!(r#","max_tokens":60,"temperature":0,"guided_grammar":{}"#, json!(GRAMMAR)),
    );
    let (s, v) = w.json("POST", "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{v}");
    let thought = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or("").to_owned();
    let answer = content(&v);
    assert!(thought.trim().len() >= 5 && !thought.contains("think>"), "{v}");
    assert!(
        answer.len() >= 4 && !answer.contains("think") && answer.starts_with(|c: char| c.is_uppercase()),
        "{v}"
    );
    // Streamed: the thinking as its own deltas, the same split.
    let body = body.replacen('{', r#"{"stream":true,"#, 1);
    let (s, events) = w.stream("/v1/chat/completions", &body);
    assert_eq!(s, 200);
    let (mut r, mut c) = (String::new(), String::new());
    for e in events.iter().filter(|e| e.starts_with('{')) {
        let d: Value = serde_json::from_str(e).unwrap();
        let delta = &d["choices"][0]["delta"];
        r.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(delta["content"].as_str().unwrap_or(""));
    }
    assert_eq!((r.as_str(), c.as_str()), (thought.as_str(), answer.as_str()));
    // The thinking goes back in the conversation where the template has a place for it, and
    // `chat_template_kwargs` reaches the template (Qwen3's switch closes the thinking in the prompt).
    let tokens = |extra: &str| {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"Hi"}},{{"role":"assistant","content":"Hello","reasoning_content":"{}"}},{{"role":"user","content":"Again"}}]{extra}}}"#,
            "a greeting, then a long thought ".repeat(3)
        );
        let (s, v) = w.json("POST", "/tokenize", &body);
        assert_eq!(s, 200, "{v}");
        v["count"].as_u64().unwrap()
    };
    let (plain, off) = (tokens(""), tokens(r#","chat_template_kwargs":{"enable_thinking":false}"#));
    let (s, v) = w.json("POST", "/tokenize", r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"Again"}]}"#);
    assert_eq!(s, 200);
    assert!(plain > v["count"].as_u64().unwrap() + 15, "the thinking reached the prompt: {plain} vs {v}");
    assert!(
        off > plain,
        "enable_thinking: false writes the closed thinking into the prompt: {off} vs {plain}"
    );
}

#[test]
fn a_prompt_that_opens_the_thinking_makes_the_answer_start_there() {
    let w = Worker::start(&["--model", thinking_model("r1-think", R1).to_str().unwrap()]);
    let ask = r#"[{"role":"user","content":"What is two plus two?"}]"#;
    // Cut before the model closes its thinking: all of it is thinking.
    let (s, v) = w.json(
        "POST",
        "/v1/chat/completions",
        &format!(r#"{{"messages":{ask},"max_tokens":8,"temperature":0}}"#),
    );
    assert_eq!(s, 200, "{v}");
    let thought = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or("").to_owned();
    assert!(!thought.is_empty() && content(&v).is_empty(), "{v}");
    // Anthropic: a thinking block (and its stream's thinking deltas), no text.
    let body = format!(r#"{{"messages":{ask},"max_tokens":8,"temperature":0}}"#);
    let (s, m) = w.json("POST", "/v1/messages", &body);
    assert_eq!(s, 200, "{m}");
    assert_eq!(
        (m["content"][0]["type"].as_str(), m["content"][0]["thinking"].as_str()),
        (Some("thinking"), Some(thought.as_str())),
        "{m}"
    );
    assert_eq!(m["content"].as_array().map(Vec::len), Some(1), "{m}");
    let (_, events) = w.stream("/v1/messages", &body.replacen('{', r#"{"stream":true,"#, 1));
    let streamed: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|e| e["delta"]["type"] == "thinking_delta")
        .map(|e| e["delta"]["thinking"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(streamed, thought);
    // Responses: a reasoning item, and its reasoning_text deltas.
    let body = r#"{"input":"What is two plus two?","max_output_tokens":8,"temperature":0}"#.to_string();
    let (s, r) = w.json("POST", "/v1/responses", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        (r["output"][0]["type"].as_str(), r["output"][0]["content"][0]["text"].as_str()),
        (Some("reasoning"), Some(thought.as_str())),
        "{r}"
    );
    let (_, events) = w.stream("/v1/responses", &body.replacen('{', r#"{"stream":true,"#, 1));
    let streamed: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(streamed, thought);
}

#[test]
fn a_model_that_does_not_think_refuses_thinking_rather_than_drop_it() {
    let w = Worker::start(&[]);
    let (s, v) = w.json(
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello","reasoning_content":"greeting"},{"role":"user","content":"Again"}],"max_tokens":2}"#,
    );
    assert_eq!((s, v["error"]["type"].as_str()), (400, Some("invalid_request")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("reasoning_content"), "{v}");
    let (s, v) = w.json(
        "POST",
        "/v1/messages",
        r#"{"max_tokens":2,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"Hi"}]}"#,
    );
    assert_eq!((s, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    // An audio answer cannot be replayed to a text model.
    let (s, _) = w.json(
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"audio":{"id":"a1"}},{"role":"user","content":"Again"}],"max_tokens":2}"#,
    );
    assert_eq!(s, 400);
}
