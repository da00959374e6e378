//! DeepSeek V3.2's and V4's prompts as their encoders build them: turns, thinking kept or dropped,
//! calls in DSML, tool results, and what the engine reads from the encoder's stand-in source.

use pdserve_chat_template::{ChatMessage, ChatTemplate, DeepSeekEncoder, ReasoningFormat, ToolFormat};
use serde_json::{json, Map, Value};

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";

fn kwargs(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn assistant(content: &str, reasoning: Option<&str>, calls: Vec<Value>) -> ChatMessage {
    ChatMessage {
        reasoning_content: reasoning.map(str::to_owned),
        tool_calls: calls,
        ..ChatMessage::new("assistant", content)
    }
}

fn tool(id: &str, content: &str) -> ChatMessage {
    ChatMessage { tool_call_id: Some(id.into()), ..ChatMessage::new("tool", content) }
}

fn call(id: &str, name: &str, args: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
}

fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {"name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}})]
}

#[test]
fn v32_turns_with_thinking_dropped_before_the_last_user_turn() {
    let t = ChatTemplate::deepseek(DeepSeekEncoder::V32);
    let messages = [
        ChatMessage::new("user", "hello"),
        assistant("Hello! I am DeepSeek.", Some("thinking..."), vec![]),
        ChatMessage::new("user", "1+1=?"),
    ];
    let thinking = t.render_with(&messages, &[], true, &kwargs(json!({"thinking": true}))).unwrap();
    assert_eq!(
        thinking,
        format!("{BOS}<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek.{EOS}<｜User｜>1+1=?<｜Assistant｜><think>")
    );
    let chat = t.render(&messages, &[], true).unwrap();
    assert!(chat.ends_with("<｜User｜>1+1=?<｜Assistant｜></think>"), "{chat}");
    // The turn after the last user turn keeps its thinking.
    let answered = [ChatMessage::new("user", "q"), assistant("a", Some("r"), vec![])];
    let text = t.render_with(&answered, &[], false, &kwargs(json!({"thinking": true}))).unwrap();
    assert_eq!(text, format!("{BOS}<｜User｜>q<｜Assistant｜><think>r</think>a{EOS}"));
}

#[test]
fn v32_calls_and_results() {
    let t = ChatTemplate::deepseek(DeepSeekEncoder::V32);
    let messages = [
        ChatMessage::new("system", "S"),
        ChatMessage::new("user", "read a"),
        assistant("", None, vec![call("c1", "read_file", json!({"n": 2, "path": "a"}))]),
        tool("c1", "R1"),
    ];
    let text = t.render(&messages, &tools(), true).unwrap();
    let (head, rest) = text.split_once("<｜User｜>").unwrap();
    assert!(
        head.starts_with(&format!("{BOS}S\n\n## Tools\n\n")) && head.contains("<｜DSML｜function_calls>"),
        "{head}"
    );
    // (The schema's keys in the order the JSON maps keep.)
    assert!(
        head.contains(r#""name":"read_file""#) && head.contains(r#""description":"Read a file""#),
        "{head}"
    );
    assert_eq!(
        rest,
        format!(
            "read a<｜Assistant｜></think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"read_file\">\n\
             <｜DSML｜parameter name=\"n\" string=\"false\">2</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"path\" string=\"true\">a</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
             </｜DSML｜function_calls>{EOS}\n\n<function_results>\n<result>R1</result>\n</function_results>\n\n</think>"
        )
    );
}

/// A call as the client sent it (`push_call`: its JSON text) keeps its arguments' order, so the
/// prompt holds what the model wrote (and the prefix cache finds it); a cut call's empty arguments
/// read as none.
#[test]
fn earlier_calls_keep_the_order_their_arguments_were_written_in() {
    let t = ChatTemplate::deepseek(DeepSeekEncoder::V4);
    let mut a = ChatMessage::new("assistant", "");
    a.push_call("c1", "read_file", r#"{"path": "a", "n": 2}"#);
    a.push_call("c2", "list_dir", "");
    let text = t.render(&[ChatMessage::new("user", "go"), a], &[], false).unwrap();
    let (path, n) = (text.find("name=\"path\"").unwrap(), text.find("name=\"n\"").unwrap());
    assert!(path < n, "{text}");
    assert!(text.contains("<｜DSML｜invoke name=\"list_dir\">\n\n</｜DSML｜invoke>"), "{text}");
}

#[test]
fn v4_merges_results_in_call_order_and_keeps_thinking_with_tools() {
    let t = ChatTemplate::deepseek(DeepSeekEncoder::V4);
    let messages = [
        ChatMessage::new("user", "read both"),
        assistant(
            "",
            Some("two files"),
            vec![
                call("c1", "read_file", json!({"path": "a"})),
                call("c2", "read_file", json!({"path": "b"})),
            ],
        ),
        tool("c2", "B"),
        tool("c1", "A"),
        ChatMessage::new("user", "and then?"),
    ];
    let text = t.render_with(&messages, &tools(), true, &kwargs(json!({"thinking": true}))).unwrap();
    let user = text.find("<｜User｜>").unwrap();
    assert!(text[..user].contains("<｜DSML｜tool_calls>") && !text[..user].contains("function_calls"));
    assert_eq!(
        &text[user..],
        "<｜User｜>read both<｜Assistant｜><think>two files</think>\n\n<｜DSML｜tool_calls>\n\
         <｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
         <｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">b</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
         </｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n\
         and then?<｜Assistant｜><think>"
    );
}

#[test]
fn v4_thinking_modes_and_effort() {
    let t = ChatTemplate::deepseek(DeepSeekEncoder::V4);
    let messages =
        [ChatMessage::new("user", "U1"), assistant("A1", Some("r1"), vec![]), ChatMessage::new("user", "U2")];
    // Thinking, no tools: earlier thinking dropped, the last turn opens it.
    let text = t.render_with(&messages, &[], true, &kwargs(json!({"enable_thinking": true}))).unwrap();
    assert_eq!(
        text,
        format!("{BOS}<｜User｜>U1<｜Assistant｜></think>A1{EOS}<｜User｜>U2<｜Assistant｜><think>")
    );
    // Kept when asked.
    let kept = t
        .render_with(&messages, &[], true, &kwargs(json!({"thinking": true, "drop_thinking": false})))
        .unwrap();
    assert!(kept.contains("<｜User｜>U1<｜Assistant｜><think>r1</think>A1"), "{kept}");
    // Chat mode: no thinking anywhere; no generation prompt: no assistant opening at the end.
    let chat = t.render(&messages, &[], true).unwrap();
    assert_eq!(
        chat,
        format!("{BOS}<｜User｜>U1<｜Assistant｜></think>A1{EOS}<｜User｜>U2<｜Assistant｜></think>")
    );
    assert!(t.render(&messages, &[], false).unwrap().ends_with("<｜User｜>U2"));
    // Maximal effort: its instruction first, and thinking on.
    let max = t.render_with(&messages[..1], &[], true, &kwargs(json!({"reasoning_effort": "max"}))).unwrap();
    assert!(
        max.starts_with(&format!("{BOS}Reasoning effort: maximum.")) && max.ends_with("<think>"),
        "{max}"
    );
    let high =
        t.render_with(&messages[..1], &[], true, &kwargs(json!({"reasoning_effort": "high"}))).unwrap();
    assert_eq!(high, format!("{BOS}<｜User｜>U1<｜Assistant｜><think>"));
    // Roles it has no place for are an error.
    assert!(t.render(&[ChatMessage::new("narrator", "x")], &[], true).is_err());
}

#[test]
fn the_encoders_read_as_their_formats() {
    for (enc, format) in
        [(DeepSeekEncoder::V32, ToolFormat::DeepSeekV32), (DeepSeekEncoder::V4, ToolFormat::DeepSeekV4)]
    {
        let t = ChatTemplate::deepseek(enc);
        assert_eq!(ToolFormat::from_template(t.source()), format);
        assert_eq!(ReasoningFormat::from_template(t.source()), ReasoningFormat::Think);
        // A prompt in thinking mode opens the thinking.
        let p = t
            .render_with(&[ChatMessage::new("user", "x")], &[], true, &kwargs(json!({"thinking": true})))
            .unwrap();
        assert!(ReasoningFormat::Think.prompt_opens_thinking(&p), "{p}");
        // A call rendered by the encoder reads back through the format's parser.
        let p = t
            .render(&[assistant("", None, vec![call("c", "read_file", json!({"path": "x"}))])], &[], false)
            .unwrap();
        let block = &p[p.find("<｜DSML｜").unwrap()..p.find(EOS).unwrap()];
        let tools = [pdserve_api::tools::Tool {
            name: "read_file".into(),
            description: None,
            parameters: json!({}),
            strict: false,
        }];
        let mut parser = pdserve_chat_template::ToolCallParser::new(format, &tools, "t");
        let mut out = parser.push(block);
        out.extend(parser.finish(false));
        assert!(
            matches!(out.last(), Some(pdserve_chat_template::Piece::Call(c)) if c.arguments == r#"{"path":"x"}"#),
            "{out:?}"
        );
    }
    assert_eq!(DeepSeekEncoder::from_model_type("deepseek_v4"), Some(DeepSeekEncoder::V4));
    assert_eq!(DeepSeekEncoder::from_model_type("deepseek_v3"), None);
}
