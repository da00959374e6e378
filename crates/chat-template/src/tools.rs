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
}

impl ToolFormat {
    pub const NAMES: &'static str = "hermes, llama3, mistral";

    pub fn from_name(s: &str) -> Option<ToolFormat> {
        match s {
            "hermes" | "qwen" => Some(ToolFormat::Hermes),
            "llama3" | "llama3_json" => Some(ToolFormat::Llama3),
            "mistral" => Some(ToolFormat::Mistral),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
        }
    }

    /// The format a chat template writes calls in; a template without one of its own gets
    /// [`ToolFormat::Hermes`] (the engine then describes the tools itself, in that format).
    pub fn from_template(template: &str) -> ToolFormat {
        if template.contains("[TOOL_CALLS]") {
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
        }
    }
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
            let openers: &[&str] =
                if self.format == ToolFormat::Llama3 { &[opener, PYTHON_TAG] } else { &[opener] };
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

    #[test]
    fn forced_call_grammars_name_the_functions() {
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
