//! Chat messages to prompt text: the model's template with the request's tools. A template written for
//! tool use gets `tools`, the assistant messages' `tool_calls` and the `tool` messages as Hugging
//! Face's conventions give them. A template that has no place for them (the default model's) still
//! sees all of it: the tools are described in the system message, earlier calls are written into the
//! assistant's text in the model's call format, and tool results become user turns wrapped in
//! `<tool_response>`. Nothing the client sent is dropped on the way to the model.

use pdserve_api::tools::Tool;

use pdserve_chat_template::{ReasoningFormat, ToolFormat};
use pdserve_model::{ChatMessage, ModelError, TextCodec};
use serde_json::{Map, Value};

use crate::info::EngineInfo;
use crate::{EngineError, Input};

/// The token ids of `input` (a remote prompt has none here), checked against the vocabulary.
pub(crate) fn tokens(
    codec: &TextCodec,
    info: &EngineInfo,
    input: &Input,
    tools: &[Tool],
    kwargs: &Map<String, Value>,
) -> Result<Vec<u32>, EngineError> {
    let invalid = |e: ModelError| EngineError::InvalidInput { problem: e.to_string() };
    Ok(match input {
        Input::Chat(msgs) => {
            if info.reasoning_format == ReasoningFormat::None
                && msgs.iter().any(|m| m.reasoning_content.is_some())
            {
                // A model that does not think never wrote any: nowhere to put it.
                return Err(EngineError::InvalidInput {
                    problem: "`reasoning_content` in the conversation, but the served model does not think (its chat template has no thinking)".into(),
                });
            }
            let text = render(codec, msgs, tools, info.tool_format, kwargs).map_err(invalid)?;
            codec.encode(&text).map_err(invalid)?
        }
        Input::Text(t) => codec.encode_prompt(t).map_err(invalid)?,
        Input::Tokens(t) => match t.iter().find(|&&x| x as usize >= info.vocab_size) {
            Some(bad) => {
                return Err(EngineError::InvalidInput {
                    problem: format!("token id {bad} is outside the vocabulary of {}", info.vocab_size),
                })
            }
            None => t.clone(),
        },
        Input::Remote(_) => Vec::new(),
    })
}

/// What a template handles itself.
struct Support {
    tools: bool,
    calls: bool,
    tool_role: bool,
}

impl Support {
    fn of(template: &str) -> Support {
        Support {
            tools: template.contains("tools"),
            calls: template.contains("tool_calls"),
            tool_role: template.contains("'tool'") || template.contains("\"tool\""),
        }
    }
}

/// A call's name and arguments, from its template shape.
fn call_parts(call: &Value) -> (&str, Value) {
    let f = call.get("function").unwrap_or(call);
    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
    let args = f.get("arguments").cloned().unwrap_or(Value::Object(Default::default()));
    (name, args)
}

/// The prompt text of `messages` with `tools` offered (none: the plain template).
pub(crate) fn render(
    codec: &TextCodec,
    messages: &[ChatMessage],
    tools: &[Tool],
    format: ToolFormat,
    kwargs: &Map<String, Value>,
) -> Result<String, ModelError> {
    let uses_tools =
        !tools.is_empty() || messages.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool");
    if !uses_tools {
        return codec.apply_chat_template_with(messages, &[], true, kwargs);
    }
    let support = Support::of(codec.chat_template().unwrap_or(""));
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let mut m = m.clone();
        if !support.calls && !m.tool_calls.is_empty() {
            for call in std::mem::take(&mut m.tool_calls) {
                let (name, args) = call_parts(&call);
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&format.render_call(name, &args));
            }
        }
        if m.role == "tool" && !support.tool_role {
            m = ChatMessage::new("user", &format!("<tool_response>\n{}\n</tool_response>", m.content));
        }
        out.push(m);
    }
    let mut listed: Vec<Value> = Vec::new();
    if !tools.is_empty() {
        if support.tools {
            listed = tools.iter().map(Tool::to_json).collect();
        } else {
            let offer = ToolFormat::system_prompt(tools);
            match out.first_mut().filter(|m| m.role == "system") {
                Some(sys) => sys.content = format!("{}\n\n{offer}", sys.content),
                None => out.insert(0, ChatMessage::new("system", &offer)),
            }
        }
    }
    codec.apply_chat_template_with(&out, &listed, true, kwargs)
}

/// Whether an answer under this template and `kwargs` starts inside the model's thinking (the
/// prompt opens it: DeepSeek R1's templates), read from a one-message render.
pub(crate) fn opens_thinking(
    codec: &TextCodec,
    format: ReasoningFormat,
    kwargs: &Map<String, Value>,
) -> bool {
    let probe = [ChatMessage::new("user", "Hi")];
    format != ReasoningFormat::None
        && codec
            .apply_chat_template_with(&probe, &[], true, kwargs)
            .is_ok_and(|p| format.prompt_opens_thinking(&p))
}
