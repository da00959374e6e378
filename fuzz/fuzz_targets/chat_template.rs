//! Arbitrary chat requests never panic the chat-template rendering: bytes are parsed as a chat
//! completions or Messages body (the server's parser), and what parses is rendered, with its tools,
//! through two tool-using templates (calls written with `tojson`, Python string methods, the
//! template's own `raise_exception`). A render may fail, with an error; it may not panic or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_chat_template::{tool_call, ChatMessage, ChatTemplate};
use pdserve_codec::{parse_generate, Endpoint, Prompt};
use serde_json::Value;

/// A tools block, calls, tool results as their own role, string methods, an error for unknown roles.
const TOOL_ROLES: &str = r#"{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif -%}
{%- for m in messages -%}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('role ' ~ m.role) }}{% endif -%}
<|{{ m.role }}|>{{ m.content.strip() }}{% if m.name %} ({{ m.name.lower() }}){% endif %}
{%- for c in m.tool_calls or [] %}<call id="{{ c.id }}">{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}
{%- if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"#;

/// Headers per turn, the system message first, content split and joined, a loop over tools' fields.
const HEADERS: &str = r#"{{ bos_token }}{%- set sys = messages | selectattr('role', 'equalto', 'system') | list -%}
{%- if sys %}[SYS]{{ sys[0].content.replace('\n', ' ') }}{% endif -%}
{%- for t in tools or [] %}[TOOL {{ loop.index }}]{% for k, v in t.function | dictsort if t.function is mapping %}{{ k }}={{ v | tojson }};{% endfor %}{% endfor -%}
{%- for m in messages if m.role != 'system' -%}
[{{ m.role.upper() }}]{{ m.content.split(' ') | join('_') }}{% if m.content.endswith('?') %}?{% endif %}{{ eos_token }}
{%- endfor -%}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"#;

fuzz_target!(|data: &[u8]| {
    let Some((&head, body)) = data.split_first() else { return };
    let endpoint = if head & 1 == 0 { Endpoint::Chat } else { Endpoint::Messages };
    let Ok(request) = parse_generate(endpoint, body) else { return };
    let Prompt::Messages(messages) = &request.prompt else { return };
    // As the server hands them to the template: call arguments as objects where they parse.
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut c = ChatMessage::new(&m.role, &m.content);
            c.tool_calls = m.tool_calls.iter().map(|t| tool_call(&t.id, &t.name, &t.arguments)).collect();
            c.tool_call_id = m.tool_call_id.clone();
            c.name = m.name.clone();
            c
        })
        .collect();
    let tools: Vec<Value> = request.tools.iter().map(|t| t.to_json()).collect();
    let source = if head & 2 == 0 { TOOL_ROLES } else { HEADERS };
    let template = ChatTemplate::new(source, "<s>", "</s>").expect("the fuzz target's templates compile");
    let _ = template.render(&messages, &tools, head & 4 == 0);
});
