//! What templates in the wild rely on, and what arbitrary input must not do to them.

use pdserve_chat_template::{ChatMessage, ChatTemplate};
use serde_json::json;

/// A template in the style tool-using models ship: a tools block, calls written with `tojson`, tool
/// results in their own role, Python string methods, and an error for roles it does not know.
const TOOLS: &str = r#"{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif -%}
{%- for m in messages -%}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] -%}{{ raise_exception('unknown role ' ~ m.role) }}{%- endif -%}
[{{ m.role.upper() }}]{{ m.content.strip() }}
{%- for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}
{%- if m.content.strip().startswith('#') %}(heading){% endif %}
{% endfor -%}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"#;

#[test]
fn tools_calls_string_methods_and_special_tokens() {
    let t = ChatTemplate::new(TOOLS, "<s>", "</s>").unwrap();
    let call = json!({"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"dir": "/"}}});
    let messages = [
        ChatMessage::new("user", "  # list it  "),
        ChatMessage { tool_calls: vec![call], ..ChatMessage::new("assistant", "") },
        ChatMessage { tool_call_id: Some("c1".into()), ..ChatMessage::new("tool", "a b") },
    ];
    let tools = [json!({"type": "function", "function": {"name": "ls"}})];
    let text = t.render(&messages, &tools, true).unwrap();
    assert!(
        text.starts_with("<tools>{\"function\":{\"name\":\"ls\"},\"type\":\"function\"}</tools>"),
        "{text}"
    );
    assert!(text.contains("[USER]# list it(heading)"), "{text}");
    assert!(text.contains(r#"<call>{"arguments":{"dir":"/"},"name":"ls"}</call>"#), "{text}");
    assert!(text.contains("[TOOL]a b") && text.ends_with("[ASSISTANT]"), "{text}");
    // No tools: the block is left out (`tools` is undefined, not an empty list).
    assert!(!t.render(&messages[..1], &[], false).unwrap().contains("<tools>"));
    let bos =
        ChatTemplate::new("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", "<s>", "</s>").unwrap();
    assert_eq!(bos.render(&messages[..1], &[], false).unwrap(), "<s>  # list it  </s>");
}

#[test]
fn errors_are_values_not_panics() {
    let t = ChatTemplate::new(TOOLS, "", "").unwrap();
    let e = t.render(&[ChatMessage::new("robot", "hi")], &[], true).unwrap_err();
    assert!(e.to_string().contains("unknown role robot"), "{e}");
    assert!(ChatTemplate::new("{% for %}", "", "").is_err(), "a template that does not compile");
    // Nesting deep enough to exhaust the stack in a recursive `tojson` is refused up front.
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!([deep]);
    }
    let e = t.render(&[ChatMessage::new("user", "x")], &[deep], true).unwrap_err();
    assert!(e.to_string().contains("nested deeper"), "{e}");
    // Content that looks like template syntax is only text.
    let text = t.render(&[ChatMessage::new("user", "{{ 7 * 7 }}{% if %}")], &[], false).unwrap();
    assert!(text.contains("{{ 7 * 7 }}{% if %}"), "{text}");
}

#[test]
fn chat_template_kwargs_reach_the_template_and_never_replace_its_variables() {
    use pdserve_chat_template::{ChatMessage, ChatTemplate};
    // Qwen3's switch, as its template reads it.
    let source = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:\
                  {% if enable_thinking is defined and enable_thinking is false %} <think>\n\n</think>\n\n{% endif %}{% endif %}";
    let t = ChatTemplate::new(source, "", "").unwrap();
    let msgs = [ChatMessage::new("user", "Hi")];
    let off: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"enable_thinking": false, "messages": []}"#).unwrap();
    assert_eq!(
        t.render_with(&msgs, &[], true, &off).unwrap(),
        "user: Hi\nassistant: <think>\n\n</think>\n\n"
    );
    assert_eq!(t.render(&msgs, &[], true).unwrap(), "user: Hi\nassistant:");
}
