//! DeepSeek's own prompt encoders, for the checkpoints that ship no Jinja template (V3.2 and V4 build
//! their prompts with a Python encoder instead). Written from the format those encoders produce:
//!
//! - V3.2: `<｜begin▁of▁sentence｜>` system text (and the tools), then per user turn
//!   `<｜User｜>...<｜Assistant｜>` followed by `<think>` (the last turn, in thinking mode) or `</think>`;
//!   an assistant turn is its thinking (after the last user turn, in thinking mode) and `</think>`,
//!   its text, its calls in a `<｜DSML｜function_calls>` block, `<｜end▁of▁sentence｜>`; tool results
//!   follow as `<function_results>` with one `<result>` each.
//! - V4: the same turns, with the calls in a `<｜DSML｜tool_calls>` block; tool results become the
//!   next user turn's `<tool_result>` blocks (in the order of the calls they answer); the
//!   `<｜Assistant｜>` and thinking tag go only where an assistant turn follows (or the prompt ends);
//!   with tools offered, earlier turns keep their thinking; `reasoning_effort: "max"` puts an
//!   instruction to think exhaustively first.
//!
//! Thinking mode is on with `chat_template_kwargs` `thinking` or `enable_thinking` true (or
//! `thinking_mode: "thinking"`), or a `reasoning_effort` other than `none`. Earlier turns' thinking
//! is dropped (V4: `drop_thinking: false` keeps it; V3.2's encoder writes none before the last user
//! turn either way). The instructions around the tools and the
//! maximal-effort instruction are this project's wording; the markup is DeepSeek's.

use serde_json::{Map, Value};

use crate::tools::{dsml_tools_text, render_dsml_invoke, ToolFormat};
use crate::{ChatMessage, TemplateError};

pub(crate) const BOS: &str = "<｜begin▁of▁sentence｜>";
pub(crate) const EOS: &str = "<｜end▁of▁sentence｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";
const THINK: &str = "<think>";
const THINK_END: &str = "</think>";

/// The instruction `reasoning_effort: "max"` puts first (V4).
const EFFORT_MAX: &str = "Reasoning effort: maximum. Think the problem through completely before \
    answering: break it into parts, check each step and every edge case, weigh the alternatives you \
    reject, and write all of that reasoning out.\n\n";

/// Which of DeepSeek's encoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeepSeekEncoder {
    V32,
    V4,
}

/// A message as the encoder reads it: V4 merges tool results into user turns.
struct Turn<'a> {
    role: &'a str,
    content: String,
    calls: &'a [Value],
    /// The calls' arguments as sent (JSON text), where known.
    texts: &'a [String],
    reasoning: Option<&'a str>,
}

impl DeepSeekEncoder {
    /// The encoder of a checkpoint's `model_type` (for one that ships no chat template).
    pub fn from_model_type(model_type: &str) -> Option<DeepSeekEncoder> {
        match model_type {
            "deepseek_v32" => Some(DeepSeekEncoder::V32),
            "deepseek_v4" => Some(DeepSeekEncoder::V4),
            _ => None,
        }
    }

    /// What stands for the template's source: it names what the encoder handles (tools,
    /// `tool_calls`, `'tool'` results, thinking, its call block), so that what is read from a
    /// template's source (the call format, the thinking, what it renders itself) reads the same.
    pub(crate) fn source(self) -> &'static str {
        match self {
            DeepSeekEncoder::V32 => {
                "DeepSeek V3.2's prompt encoder (built in, not Jinja): tools, tool_calls in \
                 <｜DSML｜function_calls> blocks, 'tool' results, <think> thinking </think>"
            }
            DeepSeekEncoder::V4 => {
                "DeepSeek V4's prompt encoder (built in, not Jinja): tools, tool_calls in \
                 <｜DSML｜tool_calls> blocks, 'tool' results, <think> thinking </think>, reasoning_effort"
            }
        }
    }

    fn format(self) -> ToolFormat {
        match self {
            DeepSeekEncoder::V32 => ToolFormat::DeepSeekV32,
            DeepSeekEncoder::V4 => ToolFormat::DeepSeekV4,
        }
    }

    /// The prompt of `messages` with `tools` (OpenAI `tools` entries).
    pub fn encode(
        self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, TemplateError> {
        let effort = kwargs.get("reasoning_effort").and_then(Value::as_str);
        let flag = |k: &str| kwargs.get(k).and_then(Value::as_bool);
        let thinking = flag("thinking")
            .or(flag("enable_thinking"))
            .or(kwargs.get("thinking_mode").and_then(Value::as_str).map(|m| m == "thinking"))
            .unwrap_or(effort.is_some_and(|e| e != "none"));
        // V4 keeps earlier thinking when tools are offered (its encoder does).
        let drop = (self != DeepSeekEncoder::V4 || tools.is_empty()) && flag("drop_thinking").unwrap_or(true);
        let mut turns = self.turns(messages)?;
        if !tools.is_empty() {
            let functions: Vec<Value> =
                tools.iter().map(|t| t.get("function").unwrap_or(t).clone()).collect();
            let text = dsml_tools_text(self.format(), &functions);
            match turns.first_mut().filter(|t| t.role == "system") {
                Some(sys) => sys.content = format!("{}\n\n{text}", sys.content),
                None => turns.insert(
                    0,
                    Turn { role: "system", content: text, calls: &[], texts: &[], reasoning: None },
                ),
            }
        }
        let last_user = turns.iter().rposition(|t| t.role == "user");
        let after_last_user = |i: usize| last_user.is_none_or(|u| i > u);
        let mut out = String::from(BOS);
        if self == DeepSeekEncoder::V4 && thinking && matches!(effort, Some("max" | "xhigh")) {
            out.push_str(EFFORT_MAX);
        }
        for (i, t) in turns.iter().enumerate() {
            let next = turns.get(i + 1).map(|t| t.role);
            match t.role {
                "system" => out.push_str(&t.content),
                "user" if self == DeepSeekEncoder::V32 => {
                    let open = thinking && Some(i) == last_user;
                    out.push_str(&format!(
                        "{USER}{}{ASSISTANT}{}",
                        t.content,
                        if open { THINK } else { THINK_END }
                    ));
                }
                "user" => {
                    out.push_str(USER);
                    out.push_str(&t.content);
                    let last = next.is_none();
                    if (last && add_generation_prompt) || next == Some("assistant") {
                        let open = thinking && (!drop || last_user.is_none_or(|u| i >= u));
                        out.push_str(ASSISTANT);
                        out.push_str(if open { THINK } else { THINK_END });
                    }
                }
                "tool" => {
                    // (V3.2 only: V4's results are user turns by now.)
                    let first = i == 0 || turns[i - 1].role != "tool";
                    if first {
                        out.push_str("\n\n<function_results>");
                    }
                    out.push_str(&format!("\n<result>{}</result>", t.content));
                    if next != Some("tool") {
                        let open = thinking && last_user.is_none_or(|u| i >= u);
                        out.push_str("\n</function_results>\n\n");
                        out.push_str(if open { THINK } else { THINK_END });
                    }
                }
                _ => {
                    let keeps = match self {
                        DeepSeekEncoder::V32 => thinking && after_last_user(i),
                        DeepSeekEncoder::V4 => thinking && (!drop || after_last_user(i)),
                    };
                    if keeps {
                        out.push_str(t.reasoning.unwrap_or(""));
                        out.push_str(THINK_END);
                    }
                    out.push_str(&t.content);
                    if !t.calls.is_empty() {
                        let (begin, end) = match self {
                            DeepSeekEncoder::V32 => ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
                            DeepSeekEncoder::V4 => ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
                        };
                        let invokes: Vec<String> = t
                            .calls
                            .iter()
                            .enumerate()
                            .map(|(j, c)| call_invoke(c, t.texts.get(j).map(String::as_str)))
                            .collect::<Result<_, _>>()?;
                        out.push_str(&format!("\n\n{begin}\n{}\n{end}", invokes.join("\n")));
                    }
                    out.push_str(EOS);
                }
            }
        }
        Ok(out)
    }

    /// The messages as turns: roles checked; for V4, tool results merged into the user turn that
    /// follows the calls, ordered as the calls were.
    fn turns<'a>(self, messages: &'a [ChatMessage]) -> Result<Vec<Turn<'a>>, TemplateError> {
        let mut turns: Vec<Turn<'a>> = Vec::with_capacity(messages.len());
        // V4: the merged user turn being built: its blocks (text, or a result with the position of
        // the call it answers), and the ids of the calls the last assistant turn made.
        let mut blocks: Vec<(Option<usize>, String)> = Vec::new();
        let mut calls_ids: Vec<&str> = Vec::new();
        let flush = |turns: &mut Vec<Turn<'a>>, blocks: &mut Vec<(Option<usize>, String)>| {
            if blocks.is_empty() {
                return;
            }
            // The results in the order of their calls (stable: unknown ids last), each in a place a
            // result held.
            let mut results: Vec<(usize, String)> =
                blocks.iter().filter_map(|(at, s)| at.map(|a| (a, s.clone()))).collect();
            results.sort_by_key(|(a, _)| *a);
            let mut results = results.into_iter().map(|(_, s)| s);
            let parts: Vec<String> = blocks
                .drain(..)
                .map(|(at, s)| if at.is_some() { results.next().unwrap_or(s) } else { s })
                .collect();
            turns.push(Turn {
                role: "user",
                content: parts.join("\n\n"),
                calls: &[],
                texts: &[],
                reasoning: None,
            });
        };
        for (i, m) in messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "developer" => "system",
                r @ ("system" | "user" | "assistant" | "tool") => r,
                other => {
                    return Err(TemplateError(format!(
                        "messages[{i}]: the role {other:?} has no place in DeepSeek's prompts"
                    )))
                }
            };
            if self == DeepSeekEncoder::V4 {
                match role {
                    "tool" => {
                        let at =
                            m.tool_call_id.as_deref().and_then(|id| calls_ids.iter().position(|c| *c == id));
                        blocks.push((
                            Some(at.unwrap_or(usize::MAX)),
                            format!("<tool_result>{}</tool_result>", m.content),
                        ));
                        continue;
                    }
                    "user" if !blocks.is_empty() => {
                        blocks.push((None, m.content.clone()));
                        continue;
                    }
                    _ => flush(&mut turns, &mut blocks),
                }
            }
            if role == "assistant" {
                calls_ids = m.tool_calls.iter().filter_map(|c| c.get("id").and_then(Value::as_str)).collect();
            }
            turns.push(Turn {
                role,
                content: m.content.clone(),
                calls: &m.tool_calls,
                texts: &m.arguments_text,
                reasoning: m.reasoning_content.as_deref(),
            });
        }
        flush(&mut turns, &mut blocks);
        Ok(turns)
    }
}

/// An earlier call (`{"function": {"name", "arguments"}}`, the arguments an object or its JSON
/// text) as DSML: its arguments in the order `text` (as the client sent them) writes them, else as
/// the object holds them.
fn call_invoke(call: &Value, text: Option<&str>) -> Result<String, TemplateError> {
    let f = call.get("function").unwrap_or(call);
    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
    if let Some(entries) = text.and_then(ordered_object) {
        return Ok(render_dsml_invoke(name, &entries));
    }
    let args = match f.get("arguments") {
        // (A call cut before its arguments began has none: `{}`.)
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(v) => v.clone(),
        None => Value::Object(Map::new()),
    };
    let args = match args {
        o @ Value::Object(_) => o,
        other => {
            return Err(TemplateError(format!(
                "the arguments of a call to {name:?} are not an object: {other}"
            )));
        }
    };
    let entries: Vec<(String, Value)> =
        args.as_object().into_iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect();
    Ok(render_dsml_invoke(name, &entries))
}

/// The entries of the JSON object `text`, in the order written; `None` if it is not one.
fn ordered_object(text: &str) -> Option<Vec<(String, Value)>> {
    struct Entries(Vec<(String, Value)>);
    impl<'de> serde::Deserialize<'de> for Entries {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Entries;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
                    let mut out = Vec::new();
                    while let Some(e) = m.next_entry::<String, Value>()? {
                        out.push(e);
                    }
                    Ok(Entries(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    let text = if text.trim().is_empty() { "{}" } else { text };
    serde_json::from_str::<Entries>(text).ok().map(|e| e.0)
}
