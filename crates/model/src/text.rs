//! Text in and out: `tokenizer.json` through the `tokenizers` crate, the chat template through
//! `pdserve-chat-template` (minijinja with Hugging Face's conventions), and incremental detokenization.

use std::path::Path;

use crate::ModelError;

use pdserve_api::tools::Tool;
pub use pdserve_chat_template::{tool_call, ChatMessage};
use pdserve_chat_template::{ChatTemplate, DeepSeekEncoder, ToolFormat};
use serde_json::{Map, Value};

/// Tokenizer plus chat template of one model folder.
#[derive(Debug)]
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    bos_token: String,
    /// `tokenizer_config.json`'s `add_bos_token`; `None` leaves it to `tokenizer.json`'s post-processor.
    add_bos: Option<bool>,
}

fn token_field(v: &serde_json::Value) -> Option<String> {
    // Either a plain string or an AddedToken object with "content".
    v.as_str().map(str::to_owned).or_else(|| v.get("content").and_then(|c| c.as_str()).map(str::to_owned))
}

impl TextCodec {
    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json` (chat template, special tokens).
    pub fn load(dir: &Path) -> Result<TextCodec, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::format(&path, "missing (the model folder needs a tokenizer.json)"));
        }
        let tokenizer =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::format(&path, e.to_string()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| ModelError::format(&cfg_path, e.to_string()))?
            }
            Err(_) => serde_json::Value::Null,
        };
        let token = |name: &str| cfg.get(name).and_then(token_field).unwrap_or_default();
        let template = match cfg.get("chat_template").and_then(|t| t.as_str()) {
            Some(source) => Some(
                ChatTemplate::new(source, &token("bos_token"), &token("eos_token"))
                    .map_err(|e| ModelError::format(&cfg_path, format!("chat_template: {e}")))?,
            ),
            // No template: DeepSeek V3.2 and V4 build their prompts in code (their encoders are built
            // in); `config.json`'s `model_type` says which.
            None => std::fs::read_to_string(dir.join("config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|c| {
                    c.get("model_type").and_then(|m| m.as_str()).and_then(DeepSeekEncoder::from_model_type)
                })
                .map(ChatTemplate::deepseek),
        };
        Ok(TextCodec {
            tokenizer,
            template,
            bos_token: token("bos_token"),
            add_bos: cfg.get("add_bos_token").and_then(|v| v.as_bool()),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc =
            self.tokenizer.encode(text, false).map_err(|e| ModelError::Text { problem: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a raw prompt (a completion's, not a chat template's output): with the BOS token
    /// first where the model expects it (Llama, Mistral), as Hugging Face's tokenizer gives them:
    /// `add_bos_token` in `tokenizer_config.json` decides, and without it `tokenizer.json`'s own
    /// post-processor.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let text_err = |e: tokenizers::Error| ModelError::Text { problem: e.to_string() };
        match self.add_bos {
            None => Ok(self.tokenizer.encode(text, true).map_err(text_err)?.get_ids().to_vec()),
            Some(false) => self.encode(text),
            Some(true) => {
                let mut ids = self.encode(text)?;
                if let Some(bos) = self.token_id(&self.bos_token) {
                    if ids.first() != Some(&bos) {
                        ids.insert(0, bos);
                    }
                }
                Ok(ids)
            }
        }
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ModelError> {
        self.tokenizer.decode(ids, skip_special).map_err(|e| ModelError::Text { problem: e.to_string() })
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.template.as_ref().map(ChatTemplate::source)
    }

    /// The text of the whole vocabulary's `tokenizer.json` (what a grammar engine needs to map token
    /// ids to bytes).
    pub fn tokenizer_json(&self) -> Result<String, ModelError> {
        self.tokenizer.to_string(false).map_err(|e| ModelError::Text { problem: e.to_string() })
    }

    /// Renders `messages` through the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.apply_chat_template_with_tools(messages, &[], add_generation_prompt)
    }

    /// Renders `messages` through the model's chat template, with `tools` (OpenAI `tools` entries) in
    /// its context as Hugging Face templates expect them. Templates may call Python's string methods
    /// (`.strip()`, `.startswith()`, ...) and `tojson`.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.apply_chat_template_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`apply_chat_template_with_tools`](Self::apply_chat_template_with_tools) with a request's
    /// `chat_template_kwargs` in the template's context (Qwen3's `enable_thinking`, say).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ModelError> {
        let template = self.template.as_ref().ok_or_else(|| ModelError::Text {
            problem: "this model has no chat template (tokenizer_config.json has no chat_template)".into(),
        })?;
        template
            .render_with(messages, tools, add_generation_prompt, kwargs)
            .map_err(|e| ModelError::Text { problem: e.0 })
    }

    /// A chat request's prompt text: `messages` with `tools` offered through the template, calls
    /// and results written in `format` where the template has no place for them.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        format: ToolFormat,
        kwargs: &Map<String, Value>,
    ) -> Result<String, ModelError> {
        render_chat(self, messages, tools, format, kwargs)
    }
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

/// The prompt text of `messages` with `tools` offered (none: the plain template). A template
/// written for tool use gets `tools`, the assistant messages' `tool_calls` and the `tool` messages
/// as Hugging Face's conventions give them. A template that has no place for them (the default
/// model's) still sees all of it: the tools are described in the system message, earlier calls are
/// written into the assistant's text in the model's call `format`, and tool results become user
/// turns wrapped in `<tool_response>`. Nothing the client sent is dropped on the way to the model.
pub(crate) fn render_chat(
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
            m = ChatMessage::new("user", &format.render_result(&m.content));
        }
        out.push(m);
    }
    let mut listed: Vec<Value> = Vec::new();
    if !tools.is_empty() {
        if support.tools {
            listed = tools.iter().map(Tool::to_json).collect();
        } else {
            let offer = format.system_prompt(tools);
            match out.first_mut().filter(|m| m.role == "system") {
                Some(sys) => sys.content = format!("{}\n\n{offer}", sys.content),
                None => out.insert(0, ChatMessage::new("system", &offer)),
            }
        }
    }
    codec.apply_chat_template_with(&out, &listed, true, kwargs)
}

/// Turns a stream of token ids into a stream of text pieces, never splitting a UTF-8 character: a
/// token that ends inside a multi-byte character yields nothing until the character completes.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        IncrementalDecoder::default()
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String, ModelError> {
        self.ids.push(id);
        let prefix = codec.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = codec.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// Whatever is still held back (an incomplete character at the very end), as replacement text.
    pub fn finish(&mut self, codec: &TextCodec) -> Result<String, ModelError> {
        let prefix = codec.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = codec.decode(&self.ids[self.prefix_offset..], true)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_owned())
    }
}
