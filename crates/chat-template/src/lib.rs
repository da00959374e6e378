//! Chat messages to prompt text through a model's chat template: the Jinja source Hugging Face ships in
//! `tokenizer_config.json`, rendered with minijinja under Hugging Face's conventions (`messages`,
//! `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `tojson`, and
//! Python's string methods such as `.strip()` and `.startswith()`).
//!
//! ```
//! use pdserve_chat_template::{ChatMessage, ChatTemplate};
//!
//! let source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
//!               {% if add_generation_prompt %}<|assistant|>{% endif %}";
//! let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
//! let text = template.render(&[ChatMessage::new("user", " Hi ")], &[], true).unwrap();
//! assert_eq!(text, "<|user|>Hi\n<|assistant|>");
//! ```
//!
//! And the other way, for tool calls: the formats model families write calls in ([`ToolFormat`]:
//! Hermes/Qwen, Llama 3, Mistral), how an earlier call reads in each, the grammar that forces a call,
//! and [`ToolCallParser`], which lifts calls out of a model's streamed text; and for thinking models,
//! [`ReasoningParser`], which splits the `<think>` span from the answer.
#![forbid(unsafe_code)]

use std::fmt;

mod deepseek;
mod reasoning;
mod tools;
pub use deepseek::DeepSeekEncoder;
pub use reasoning::{ReasoningFormat, ReasoningParser, Split};
pub use tools::{Piece, ToolCallParser, ToolFormat};

use serde::Serialize;

/// One chat message as the template sees it (Hugging Face's conventions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's calls, each `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with the arguments as a JSON object (templates write them with `tojson`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A `tool` message: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's thinking, for templates that render it (Qwen3's, for the turns after
    /// the last user message).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Each call's arguments as the client sent them (JSON text), where known: their keys in the
    /// order written (`tool_calls` holds them as objects, whose keys come out sorted), for
    /// encoders that write each argument apart (DeepSeek's DSML). Not seen by templates.
    #[serde(skip)]
    pub arguments_text: Vec<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.to_owned(), content: content.to_owned(), ..ChatMessage::default() }
    }

    /// Adds a call (`arguments`: the JSON text a client sends) in the shape templates read.
    pub fn push_call(&mut self, id: &str, name: &str, arguments: &str) {
        self.tool_calls.push(tool_call(id, name, arguments));
        self.arguments_text.push(arguments.to_owned());
    }
}

/// A call as templates expect it in `tool_calls`: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, with `arguments` (a JSON text, as OpenAI clients send it) as the value it holds,
/// or as the text itself where it is not JSON.
pub fn tool_call(id: &str, name: &str, arguments: &str) -> serde_json::Value {
    let args = serde_json::from_str(arguments).unwrap_or_else(|_| serde_json::Value::from(arguments));
    serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
}

/// Why a template could not be compiled or rendered (minijinja's message, or the template's own
/// `raise_exception`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateError(pub String);

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateError {}

/// A model's chat template with its special tokens, checked to compile; or, for a checkpoint that
/// ships none and builds its prompts in code (DeepSeek V3.2 and V4), that encoder.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    encoder: Option<DeepSeekEncoder>,
}

/// Nesting deeper than this in a message's tool calls or in the tools is refused before rendering
/// (a recursive `tojson` of adversarial input must not exhaust the stack).
const MAX_DEPTH: usize = 64;

/// Whether `v` nests more than `limit` arrays or objects deep (looking no deeper than that).
fn deeper_than(v: &serde_json::Value, limit: usize) -> bool {
    let mut inner = match v {
        serde_json::Value::Array(a) => Box::new(a.iter()) as Box<dyn Iterator<Item = &serde_json::Value>>,
        serde_json::Value::Object(o) => Box::new(o.values()),
        _ => return false,
    };
    limit == 0 || inner.any(|x| deeper_than(x, limit - 1))
}

impl ChatTemplate {
    /// Compiles `source` once to check it; `Err` says what is wrong with it.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, TemplateError> {
        let t = ChatTemplate {
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            encoder: None,
        };
        t.environment()?;
        Ok(t)
    }

    /// DeepSeek's own prompt encoder (V3.2 or V4), for a checkpoint that ships no template.
    pub fn deepseek(encoder: DeepSeekEncoder) -> ChatTemplate {
        ChatTemplate {
            source: encoder.source().to_owned(),
            bos_token: deepseek::BOS.to_owned(),
            eos_token: deepseek::EOS.to_owned(),
            encoder: Some(encoder),
        }
    }

    /// The Jinja source (for a built-in encoder, a line naming what it renders: the call format,
    /// tools, `'tool'` results and thinking, as a template's source would show them).
    pub fn source(&self) -> &str {
        &self.source
    }

    fn environment(&self) -> Result<minijinja::Environment<'_>, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| TemplateError(e.to_string()))?;
        Ok(env)
    }

    /// Renders `messages` with `tools` (OpenAI `tools` entries; none leaves `tools` undefined, as
    /// Hugging Face does) and, if `add_generation_prompt`, the opening of the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`render`](Self::render) with `kwargs` beside the standard variables (a request's
    /// `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); they never replace `messages`,
    /// `tools` or the others.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TemplateError> {
        if kwargs.values().any(|v| deeper_than(v, MAX_DEPTH)) {
            return Err(TemplateError(format!("chat_template_kwargs nested deeper than {MAX_DEPTH} levels")));
        }
        let deep =
            messages.iter().flat_map(|m| &m.tool_calls).chain(tools).any(|v| deeper_than(v, MAX_DEPTH));
        if deep {
            return Err(TemplateError(format!("tools or tool calls nested deeper than {MAX_DEPTH} levels")));
        }
        if let Some(encoder) = self.encoder {
            return encoder.encode(messages, tools, add_generation_prompt, kwargs);
        }
        let env = self.environment()?;
        let tmpl = env.get_template("chat").map_err(|e| TemplateError(e.to_string()))?;
        let tools = (!tools.is_empty()).then_some(tools);
        let standard = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        tmpl.render(minijinja::context! { ..standard, ..minijinja::Value::from_serialize(kwargs) })
            .map_err(|e| TemplateError(format!("chat template: {e}")))
    }
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
