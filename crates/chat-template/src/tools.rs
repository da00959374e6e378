//! The formats models write tool calls in (Hermes/Qwen `<tool_call>` blocks, Llama 3 JSON, Mistral
//! `[TOOL_CALLS]`), how an earlier call reads in each, the grammar that forces a call when a request
//! requires one, and the streaming parser that lifts calls out of a model's text (broken ones come
//! back as text).

use pdserve_api::tools::{Tool, ToolCall};
use serde_json::{json, Value};

/// What Llama 3.1+ writes before a call.
const PYTHON_TAG: &str = "<|python_tag|>";

/// The text format a model family writes its calls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call (Hermes,
    /// Qwen2.5/Qwen3, and every model whose template does not define a format of its own).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`
    /// (Llama 3.1+).
    Llama3,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral).
    Mistral,
    /// DeepSeek V3 / R1: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>`
    /// name, the arguments in a `json` code fence, `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>`.
    DeepSeekV3,
    /// DeepSeek V3.1: per call `<｜tool▁call▁begin｜>` name `<｜tool▁sep｜>` arguments
    /// `<｜tool▁call▁end｜>`, inside the same outer tags.
    DeepSeekV31,
}

/// DeepSeek's tool-call markers.
const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const CALL_SEP: &str = "<｜tool▁sep｜>";

impl ToolFormat {
    pub const NAMES: &'static str = "hermes, llama3, mistral, deepseek_v3, deepseek_v31";

    pub fn from_name(s: &str) -> Option<ToolFormat> {
        match s {
            "hermes" | "qwen" => Some(ToolFormat::Hermes),
            "llama3" | "llama3_json" => Some(ToolFormat::Llama3),
            "mistral" => Some(ToolFormat::Mistral),
            "deepseek_v3" | "deepseek_r1" => Some(ToolFormat::DeepSeekV3),
            "deepseek_v31" => Some(ToolFormat::DeepSeekV31),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::DeepSeekV3 => "deepseek_v3",
            ToolFormat::DeepSeekV31 => "deepseek_v31",
        }
    }

    fn deepseek(self) -> bool {
        matches!(self, ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31)
    }

    /// The format a chat template writes calls in; a template without one of its own gets
    /// [`ToolFormat::Hermes`] (the engine then describes the tools itself, in that format).
    pub fn from_template(template: &str) -> ToolFormat {
        if template.contains(CALLS_BEGIN) {
            // V3's template writes each call's arguments in a code fence; V3.1's does not.
            if template.contains("```json") {
                ToolFormat::DeepSeekV3
            } else {
                ToolFormat::DeepSeekV31
            }
        } else if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// Where a call starts in this format's text.
    fn opener(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Llama3 => "{\"name\"",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => CALLS_BEGIN,
        }
    }

    /// The key the arguments go under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// How an earlier call of the conversation reads in this format (for templates that do not render
    /// `tool_calls` themselves).
    pub fn render_call(self, name: &str, arguments: &Value) -> String {
        let obj = json!({"name": name, self.arguments_key(): arguments});
        match self {
            ToolFormat::Hermes => format!("<tool_call>\n{obj}\n</tool_call>"),
            ToolFormat::Llama3 => obj.to_string(),
            ToolFormat::Mistral => format!("[TOOL_CALLS][{obj}]"),
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                format!("{CALLS_BEGIN}{}{CALLS_END}", self.deepseek_call(name, &arguments.to_string()))
            }
        }
    }

    /// One DeepSeek call: name and arguments (JSON text) between its markers.
    fn deepseek_call(self, name: &str, arguments: &str) -> String {
        match self {
            ToolFormat::DeepSeekV31 => format!("{CALL_BEGIN}{name}{CALL_SEP}{arguments}{CALL_END}"),
            _ => format!("{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n{arguments}\n```{CALL_END}"),
        }
    }

    /// The system text that offers `tools` to a model whose template does not (Hermes format).
    pub fn system_prompt(tools: &[Tool]) -> String {
        let mut s = String::from(
            "You may call functions to help with the user's request. The functions are listed in \
             <tools></tools>, one JSON object per line:\n<tools>\n",
        );
        for t in tools {
            s.push_str(&t.to_json().to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nTo call a function, answer with one block per call:\n<tool_call>\n\
             {\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>",
        );
        s
    }

    /// The llguidance Lark grammar that makes the model call one of `tools` (or `only`), in this
    /// format: one call, or with `parallel` one or more. Each call's arguments fit its schema.
    pub fn forced_call_grammar(self, tools: &[Tool], only: Option<&str>, parallel: bool) -> String {
        let key = self.arguments_key();
        let schemas: Vec<Value> = tools
            .iter()
            .filter(|t| only.is_none_or(|n| n == t.name))
            .map(|t| {
                json!({"type": "object",
                       "properties": {"name": {"const": t.name}, key: t.parameters},
                       "required": ["name", key], "additionalProperties": false})
            })
            .collect();
        let mut call = if schemas.len() == 1 { schemas[0].clone() } else { json!({"anyOf": schemas}) };
        // Compact, single-line JSON: a small model left free to add whitespace may never stop.
        call["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match self {
            ToolFormat::Hermes => {
                let more = if parallel { " (\"\\n\" call)*" } else { "" };
                format!("start: call{more}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {call}\n")
            }
            ToolFormat::Llama3 => format!("start: %json {call}\n"),
            ToolFormat::Mistral => {
                let mut list = json!({"type": "array", "items": call, "minItems": 1});
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                list["x-guidance"] = call["x-guidance"].clone();
                format!("start: \"[TOOL_CALLS]\" body\nbody: %json {list}\n")
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                // One rule per function: its name is text between the markers, its arguments JSON.
                let lit = |s: &str| serde_json::to_string(s).expect("a string");
                let mut g = format!(
                    "start: {} call{} {}\ncall: {}\n",
                    lit(CALLS_BEGIN),
                    if parallel { "+" } else { "" },
                    lit(CALLS_END),
                    (0..schemas.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(" | ")
                );
                for (i, t) in tools.iter().filter(|t| only.is_none_or(|n| n == t.name)).enumerate() {
                    let mut args = t.parameters.clone();
                    if !args.is_object() {
                        args = json!({"type": "object"});
                    }
                    args["x-guidance"] = call["x-guidance"].clone();
                    let (head, tail) = match self {
                        ToolFormat::DeepSeekV31 => {
                            (format!("{CALL_BEGIN}{}{CALL_SEP}", t.name), CALL_END.to_owned())
                        }
                        _ => (
                            format!("{CALL_BEGIN}function{CALL_SEP}{}\n```json\n", t.name),
                            format!("\n```{CALL_END}"),
                        ),
                    };
                    g.push_str(&format!("c{i}: {} a{i} {}\na{i}: %json {args}\n", lit(&head), lit(&tail)));
                }
                g
            }
        }
    }
}

/// DeepSeek's calls in `text` (from an opener on): name and arguments of each, `None` unless the text
/// is entirely calls. With `at_end`, an unclosed last call (cut by a stop) still counts, and a missing
/// outer start tag is tolerated (models drop it at long context).
fn parse_deepseek(text: &str, at_end: bool) -> Option<Vec<Value>> {
    let mut rest = text.trim_start();
    rest = rest.strip_prefix(CALLS_BEGIN).unwrap_or(rest).trim_start();
    let mut out = Vec::new();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix(CALLS_END) {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let body = rest.strip_prefix(CALL_BEGIN)?;
        let (inner, after) = match body.find(CALL_END) {
            Some(e) => (&body[..e], &body[e + CALL_END.len()..]),
            None if at_end => (body, ""),
            None => return None,
        };
        let (left, right) = inner.split_once(CALL_SEP)?;
        let (name, args) = if left.trim() == "function" {
            // V3: the name, a newline, the arguments in a `json` code fence.
            let (name, fenced) = right.split_once('\n')?;
            let fenced = fenced.trim();
            let args = fenced.strip_prefix("```json").or_else(|| fenced.strip_prefix("```"))?;
            (name, args.trim_end().strip_suffix("```").unwrap_or(args))
        } else {
            (left, right)
        };
        let args: Value = serde_json::from_str(args.trim()).ok()?;
        out.push(json!({"name": name.trim(), "arguments": args}));
        rest = after.trim_start();
    }
    Some(out)
}

/// What the parser lifted out of the model's text so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Plain answer text.
    Text(String),
    /// A complete call.
    Call(ToolCall),
}

/// Lifts tool calls out of a model's streamed text. Text that cannot start a call goes out at once;
/// text that might is held until it is known to be one; a call goes out once complete. A call that
/// does not parse (unbalanced, not JSON, an unknown function) comes back as plain text at the end, never
/// as an error.
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    names: Vec<String>,
    /// Text not yet given out.
    held: String,
    /// A call's opener was seen: everything from there is held until the end.
    in_call: bool,
    /// Whether any text other than whitespace was given out (Llama 3 calls open the answer).
    said_text: bool,
    calls: usize,
    id_prefix: String,
}

impl ToolCallParser {
    /// `id_prefix` makes the calls' ids (`call_<prefix>_<n>`), unique per response.
    pub fn new(format: ToolFormat, tools: &[Tool], id_prefix: &str) -> Self {
        ToolCallParser {
            format,
            names: tools.iter().map(|t| t.name.clone()).collect(),
            held: String::new(),
            in_call: false,
            said_text: false,
            calls: 0,
            id_prefix: id_prefix.to_owned(),
        }
    }

    /// Calls given out so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds a piece of text; returns what can be given out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                match self.take_complete_call() {
                    Some(pieces) => out.extend(pieces),
                    None => break,
                }
                continue;
            }
            let opener = self.format.opener();
            if self.format == ToolFormat::Llama3 && self.said_text {
                // A Llama 3 call is the whole answer: once prose began, nothing is a call.
                self.emit_text(&mut out, usize::MAX);
                break;
            }
            // DeepSeek: the outer start tag, or a call's own (models drop the outer one), and once a
            // call went out, the outer end tag (lifted out, not text).
            let openers: &[&str] = match self.format {
                ToolFormat::Llama3 => &[opener, PYTHON_TAG],
                f if f.deepseek() && self.calls > 0 => &[opener, CALL_BEGIN, CALLS_END],
                f if f.deepseek() => &[opener, CALL_BEGIN],
                _ => &[opener],
            };
            match openers.iter().filter_map(|o| self.held.find(o)).min() {
                Some(at) if self.format == ToolFormat::Llama3 && !self.held[..at].trim().is_empty() => {
                    // Prose before the JSON: not a call.
                    self.emit_text(&mut out, usize::MAX);
                    break;
                }
                Some(at) => {
                    if self.calls > 0 && self.held[..at].trim().is_empty() {
                        // Whitespace between calls is not text.
                        self.held.drain(..at);
                    } else {
                        self.emit_text(&mut out, at);
                    }
                    self.in_call = true;
                }
                None => {
                    // Hold only a tail that could still grow into an opener, and after a call the
                    // whitespace that may separate it from the next.
                    let mut keep = openers.iter().map(|o| partial_suffix(&self.held, o)).max().unwrap_or(0);
                    if self.calls > 0 {
                        let head = &self.held[..self.held.len() - keep];
                        keep += head.len() - head.trim_end().len();
                    }
                    let cut = self.held.len() - keep;
                    self.emit_text(&mut out, cut);
                    break;
                }
            }
        }
        out
    }

    /// The end of the text: whatever is held, as calls if it parses and as text if not.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.in_call && self.format.deepseek() && self.calls > 0 && self.held.trim() == CALLS_END {
            self.held.clear();
            self.in_call = false;
        }
        if self.in_call {
            let held = std::mem::take(&mut self.held);
            match self.parse_calls(&held, true) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => out.push(Piece::Text(held)),
            }
            self.in_call = false;
        } else if !self.held.is_empty() {
            let held = std::mem::take(&mut self.held);
            // Whitespace after the last call is not an answer.
            if self.calls == 0 || !held.trim().is_empty() {
                out.push(Piece::Text(held));
            }
        }
        out
    }

    fn emit_text(&mut self, out: &mut Vec<Piece>, upto: usize) {
        let upto = upto.min(self.held.len());
        if upto == 0 {
            return;
        }
        let text: String = self.held.drain(..upto).collect();
        if !text.trim().is_empty() {
            self.said_text = true;
        }
        out.push(Piece::Text(text));
    }

    /// In a call: a complete Hermes block goes out as soon as it closes (the other formats end with the
    /// answer).
    fn take_complete_call(&mut self) -> Option<Vec<Piece>> {
        if self.format.deepseek() {
            // A DeepSeek call goes out when it closes; the outer end tag after calls is dropped.
            if self.calls > 0 && self.held.starts_with(CALLS_END) {
                self.held.drain(..CALLS_END.len());
                self.in_call = false;
                return Some(Vec::new());
            }
            let end = self.held.find(CALL_END)? + CALL_END.len();
            let block: String = self.held.drain(..end).collect();
            self.in_call = false;
            return Some(match self.parse_calls(&block, false) {
                Some(calls) => calls.into_iter().map(Piece::Call).collect(),
                None => vec![Piece::Text(block)],
            });
        }
        if self.format != ToolFormat::Hermes {
            return None;
        }
        let end = self.held.find("</tool_call>")? + "</tool_call>".len();
        let block: String = self.held.drain(..end).collect();
        self.in_call = false;
        Some(match self.parse_calls(&block, false) {
            Some(calls) => calls.into_iter().map(Piece::Call).collect(),
            None => vec![Piece::Text(block)],
        })
    }

    /// The calls in `text` (which starts at an opener), or `None` if it is not entirely calls.
    fn parse_calls(&mut self, text: &str, at_end: bool) -> Option<Vec<ToolCall>> {
        let objects: Vec<Value> = match self.format {
            ToolFormat::Hermes => {
                let mut objs = Vec::new();
                let mut rest = text.trim();
                while !rest.is_empty() {
                    let body = rest.strip_prefix("<tool_call>")?;
                    let (inner, after) = match body.find("</tool_call>") {
                        Some(e) => (&body[..e], &body[e + "</tool_call>".len()..]),
                        // An unclosed last block at the end of the answer (cut by a stop) still counts.
                        None if at_end => (body, ""),
                        None => return None,
                    };
                    objs.push(serde_json::from_str(inner.trim()).ok()?);
                    rest = after.trim();
                }
                objs
            }
            ToolFormat::Llama3 => {
                let body = text.trim().trim_start_matches(PYTHON_TAG).trim();
                // One call, or several separated by `;`.
                let mut objs = Vec::new();
                for part in split_top_level(body, ';') {
                    objs.push(serde_json::from_str(part.trim()).ok()?);
                }
                objs
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => parse_deepseek(text, at_end)?,
            ToolFormat::Mistral => {
                let body = text.trim().strip_prefix("[TOOL_CALLS]")?.trim();
                match serde_json::from_str(body).ok()? {
                    Value::Array(a) => a,
                    o @ Value::Object(_) => vec![o],
                    _ => return None,
                }
            }
        };
        if objects.is_empty() {
            return None;
        }
        let mut calls = Vec::with_capacity(objects.len());
        for o in objects {
            let name = o.get("name")?.as_str()?;
            if !self.names.iter().any(|n| n == name) {
                return None;
            }
            let args = o.get("arguments").or_else(|| o.get("parameters")).cloned().unwrap_or(json!({}));
            let arguments = match args {
                // Some models write the arguments as a JSON string already.
                Value::String(s) if serde_json::from_str::<Value>(&s).is_ok_and(|v| v.is_object()) => s,
                v @ Value::Object(_) => v.to_string(),
                _ => return None,
            };
            calls.push(ToolCall {
                id: format!("call_{}_{}", self.id_prefix, self.calls + calls.len()),
                name: name.to_owned(),
                arguments,
            });
        }
        self.calls += calls.len();
        Some(calls)
    }
}

/// The longest suffix of `text` that is a proper prefix of `pat`.
fn partial_suffix(text: &str, pat: &str) -> usize {
    (1..pat.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && pat.is_char_boundary(k) && text.ends_with(&pat[..k])
        })
        .unwrap_or(0)
}

/// Splits `s` at `sep` outside JSON strings, brackets and braces.
fn split_top_level(s: &str, sep: char) -> Vec<&str> {
    let (mut depth, mut in_str, mut esc, mut start) = (0i32, false, false, 0);
    let mut parts = Vec::new();
    for (i, c) in s.char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        vec![
            Tool {
                name: "read_file".into(),
                description: Some("Reads a file".into()),
                parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
            },
            Tool { name: "list_dir".into(), description: None, parameters: json!({"type": "object"}) },
        ]
    }

    fn run(format: ToolFormat, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut p = ToolCallParser::new(format, &tools(), "x");
        let mut out: Vec<Piece> = pieces.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish());
        let mut text = String::new();
        let mut calls = Vec::new();
        for o in out {
            match o {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => calls.push(c),
            }
        }
        (text, calls)
    }

    #[test]
    fn hermes_calls_are_lifted_out_of_streamed_text_in_any_split() {
        let full = "Let me look.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.txt\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>";
        for split in [1, 2, 3, 7, 64, full.len()] {
            let pieces: Vec<String> =
                full.as_bytes().chunks(split).map(|c| String::from_utf8_lossy(c).into_owned()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (text, calls) = run(ToolFormat::Hermes, &refs);
            assert_eq!(text, "Let me look.\n", "split {split}");
            assert_eq!(calls.len(), 2);
            assert_eq!(
                (calls[0].name.as_str(), calls[0].arguments.as_str()),
                ("read_file", r#"{"path":"a.txt"}"#)
            );
            assert_eq!((calls[1].id.as_str(), calls[1].arguments.as_str()), ("call_x_1", "{}"));
        }
    }

    #[test]
    fn broken_calls_come_back_as_text() {
        for bad in [
            "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": }\n</tool_call>",
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n[1, 2]\n</tool_call>",
            "<tool_call> never closed and not JSON",
            "<tool_c",
        ] {
            let (text, calls) = run(ToolFormat::Hermes, &[bad]);
            assert_eq!((text.as_str(), calls.len()), (bad, 0), "{bad}");
        }
        // Text that only looks like the start of an opener is given back whole.
        let (text, calls) = run(ToolFormat::Hermes, &["a < b and <tool", "box>"]);
        assert_eq!((text.as_str(), calls.len()), ("a < b and <toolbox>", 0));
    }

    #[test]
    fn an_unclosed_last_call_at_the_end_still_counts() {
        let (text, calls) =
            run(ToolFormat::Hermes, &["<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {\"d\": 1}}"]);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].arguments, r#"{"d":1}"#);
    }

    #[test]
    fn llama3_and_mistral_formats() {
        let (text, calls) = run(
            ToolFormat::Llama3,
            &[
                "<|python_tag|>{\"name\": \"read_file\", \"parameters\": {\"path\": \"b\"}}; ",
                "{\"name\": \"list_dir\", \"parameters\": {}}",
            ],
        );
        assert_eq!((text.as_str(), calls.len()), ("", 2));
        assert_eq!(calls[0].arguments, r#"{"path":"b"}"#);
        // Prose first: a Llama 3 answer is then prose throughout.
        let (text, calls) = run(ToolFormat::Llama3, &["Sure: {\"name\": \"list_dir\", \"parameters\": {}}"]);
        assert_eq!((text.as_str(), calls.len()), ("Sure: {\"name\": \"list_dir\", \"parameters\": {}}", 0));
        let (text, calls) = run(
            ToolFormat::Mistral,
            &["[TOOL_", "CALLS][{\"name\": \"read_file\", \"arguments\": \"{\\\"path\\\": \\\"c\\\"}\"}]"],
        );
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].arguments, r#"{"path": "c"}"#);
    }

    /// Every split of `full` gives the same text and calls.
    fn every_split(format: ToolFormat, full: &str) -> (String, Vec<ToolCall>) {
        let whole = run(format, &[full]);
        let chars: Vec<String> = full.chars().map(String::from).collect();
        for pieces in [chars.clone(), chars.chunks(5).map(|c| c.concat()).collect()] {
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(run(format, &refs), whole, "{full}");
        }
        whole
    }

    #[test]
    fn deepseek_calls_in_both_generations_of_the_format() {
        let v3 = "I will read it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{\"path\": \"a.txt\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>list_dir\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = every_split(ToolFormat::DeepSeekV3, v3);
        assert_eq!(text, "I will read it.");
        let got: Vec<(&str, &str)> = calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect();
        assert_eq!(got, [("read_file", r#"{"path":"a.txt"}"#), ("list_dir", "{}")]);
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{\"path\": \"b\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = every_split(ToolFormat::DeepSeekV31, v31);
        assert_eq!((text.as_str(), calls.len(), calls[0].arguments.as_str()), ("", 1, r#"{"path":"b"}"#));
        // Rendering a call gives text the parser reads back.
        for f in [ToolFormat::DeepSeekV3, ToolFormat::DeepSeekV31] {
            let (text, calls) = every_split(f, &f.render_call("read_file", &json!({"path": "c"})));
            assert_eq!((text.as_str(), calls.len(), calls[0].arguments.as_str()), ("", 1, r#"{"path":"c"}"#));
        }
        // The outer start tag missing (as models drop it at long context): still a call.
        let (text, calls) = every_split(
            ToolFormat::DeepSeekV31,
            "<｜tool▁call▁begin｜>list_dir<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        );
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        // A call cut by max_tokens at the end still counts once its arguments parse.
        let (_, calls) = every_split(
            ToolFormat::DeepSeekV31,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>list_dir<｜tool▁sep｜>{\"d\": 1}",
        );
        assert_eq!(calls.len(), 1);
        // Broken calls, unknown functions and prose about the tags come back as text, whole.
        for bad in [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n{\"path\"<｜tool▁call▁end｜>",
            "The tag <｜tool▁calls▁begin｜> opens calls",
            "<｜tool▁calls▁end｜> out of place",
        ] {
            for f in [ToolFormat::DeepSeekV3, ToolFormat::DeepSeekV31] {
                let (text, calls) = every_split(f, bad);
                assert_eq!((text.as_str(), calls.len()), (bad, 0), "{f:?}: {bad}");
            }
        }
        assert_eq!(
            ToolFormat::from_template("{{'<｜tool▁calls▁begin｜>'}}...```json"),
            ToolFormat::DeepSeekV3
        );
        assert_eq!(ToolFormat::from_template("{{'<｜tool▁calls▁begin｜>'}}"), ToolFormat::DeepSeekV31);
    }

    #[test]
    fn forced_call_grammars_name_the_functions() {
        let g = ToolFormat::DeepSeekV3.forced_call_grammar(&tools(), Some("read_file"), false);
        assert!(g.contains("start: \"<｜tool▁calls▁begin｜>\" call \"<｜tool▁calls▁end｜>\""), "{g}");
        assert!(g.contains("function<｜tool▁sep｜>read_file\\n```json\\n") && !g.contains("list_dir"), "{g}");
        let g = ToolFormat::DeepSeekV31.forced_call_grammar(&tools(), None, true);
        assert!(g.contains("call+") && g.contains("call: c0 | c1"), "{g}");
        let g = ToolFormat::Hermes.forced_call_grammar(&tools(), Some("read_file"), false);
        assert!(
            g.starts_with("start: call\n")
                && g.contains("\"const\":\"read_file\"")
                && !g.contains("list_dir")
        );
        let g = ToolFormat::Hermes.forced_call_grammar(&tools(), None, true);
        assert!(g.contains("(\"\\n\" call)*") && g.contains("anyOf"));
        let g = ToolFormat::Mistral.forced_call_grammar(&tools(), None, false);
        assert!(g.contains("\"maxItems\":1"));
    }
}
