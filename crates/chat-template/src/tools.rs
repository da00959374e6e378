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
    /// format: one call to at most `calls_max`, then the end (where the format separates calls with a
    /// newline, one newline may follow the last; the model then chooses between another call and the
    /// end, never forced into a second). Each call's arguments fit its schema.
    pub fn forced_call_grammar(self, tools: &[Tool], only: Option<&str>, calls_max: usize) -> String {
        match self.call_rules(tools, only, calls_max) {
            Some((opener, rules)) => format!("start: {} rest\n{rules}", lit(opener)),
            // A Llama 3 call is the whole answer, with no marker.
            None => format!("start: %json {}\n", call_schema(self, tools, only)),
        }
    }

    /// Under `tool_choice: auto` with `strict` tools: the model answers freely, or writes text and
    /// then calls; once it writes the format's opener, the calls (at most `calls_max`) must fit
    /// their schemas. `None` for a format without an opener (Llama 3's call is a bare JSON answer).
    pub fn auto_call_grammar(self, tools: &[Tool], calls_max: usize) -> Option<String> {
        let (opener, rules) = self.call_rules(tools, None, calls_max)?;
        let escaped: String = opener
            .chars()
            .map(|c| if "\\.^$|?*+()[]{}/".contains(c) { format!("\\{c}") } else { c.to_string() })
            .collect();
        Some(format!(
            "start: FREE | prefix rest\nFREE: /(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/\nprefix[stop={}]: /(.|\\n)*/\n{rules}",
            lit(opener)
        ))
    }

    /// The format's opener and the rules of what follows it (`rest`: the calls, then the end).
    fn call_rules(
        self,
        tools: &[Tool],
        only: Option<&str>,
        calls_max: usize,
    ) -> Option<(&'static str, String)> {
        let calls_max = calls_max.max(1);
        let call = call_schema(self, tools, only);
        match self {
            ToolFormat::Hermes => {
                let more = match calls_max {
                    1 => String::new(),
                    n => format!(" (\"\\n\" call){{0,{}}}", n - 1),
                };
                let rules = format!(
                    "rest: \"\\n\" body \"\\n</tool_call>\"{more} \"\\n\"?\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {call}\n"
                );
                Some(("<tool_call>", rules))
            }
            ToolFormat::Llama3 => None,
            ToolFormat::Mistral => {
                let mut list = json!({"type": "array", "items": call, "minItems": 1, "maxItems": calls_max});
                list["x-guidance"] = call["x-guidance"].clone();
                Some(("[TOOL_CALLS]", format!("rest: body\nbody: %json {list}\n")))
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                // One rule per function: its name is text between the markers, its arguments JSON.
                let offered: Vec<&Tool> = tools.iter().filter(|t| only.is_none_or(|n| n == t.name)).collect();
                let mut g = format!(
                    "rest: call{} {}\ncall: {}\n",
                    if calls_max > 1 { format!("{{1,{calls_max}}}") } else { String::new() },
                    lit(CALLS_END),
                    (0..offered.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(" | ")
                );
                for (i, t) in offered.iter().enumerate() {
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
                Some((CALLS_BEGIN, g))
            }
        }
    }
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string")
}

/// The schema of one call object (`name` and the arguments) to one of `tools` (or `only`), written
/// compact.
fn call_schema(format: ToolFormat, tools: &[Tool], only: Option<&str>) -> Value {
    let key = format.arguments_key();
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
    call["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    call
}

/// How far the text being parsed goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// More text may follow: only closed calls count.
    Open,
    /// The answer ended (end of sequence or a stop string): an unclosed last call still counts once
    /// its arguments parse.
    Stopped,
    /// The answer was cut by `max_tokens`: the call the cut fell in counts with its arguments as far
    /// as they were written (OpenAI's behaviour), and markup cut before a call's name is whole is
    /// dropped, never returned as text.
    Cut,
}

/// The calls in a text from an opener on.
#[derive(Debug, Default)]
struct Calls {
    /// The whole calls' objects (`name`, and `arguments` or `parameters`).
    whole: Vec<Value>,
    /// With [`End::Cut`]: the call the cut fell in, its name and its arguments' text so far.
    cut: Option<(String, String)>,
}

/// A call object cut by `max_tokens` (`{"name": "f", "arguments": {"a": ...`): `Some(Some(..))` with
/// its name and arguments' text once the name is whole, `Some(None)` for markup cut before that (or
/// nothing at all), `None` for text that is no call object.
fn cut_object(text: &str) -> Option<Option<(String, String)>> {
    let t = text.trim_start();
    if t.is_empty() {
        return Some(None);
    }
    let inner = t.strip_prefix('{')?.trim_start();
    let named = inner
        .strip_prefix("\"name\"")
        .and_then(|r| r.trim_start().strip_prefix(':'))
        .and_then(|r| r.trim_start().strip_prefix('"'))
        .and_then(|r| r.find('"').map(|e| (&r[..e], &r[e + 1..])));
    let Some((name, rest)) = named else { return Some(None) };
    let args = match rest.trim_start().strip_prefix(',') {
        None => "",
        Some(r) => ["\"arguments\"", "\"parameters\""]
            .iter()
            .find_map(|k| r.trim_start().strip_prefix(k))
            .and_then(|r| r.trim_start().strip_prefix(':'))
            .unwrap_or(""),
    };
    Some(Some((name.to_owned(), args.trim().to_owned())))
}

/// The length of the JSON object or array `s` starts with, if it closes in `s`.
fn json_value_len(s: &str) -> Option<usize> {
    let (mut depth, mut in_str, mut esc) = (0i32, false, false);
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
            '}' | ']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

/// `text` without a tail that is the start of `pat` (a closing tag cut short).
fn without_partial<'a>(text: &'a str, pat: &str) -> &'a str {
    &text[..text.len() - partial_suffix(text, pat)]
}

/// DeepSeek's calls in `text` (from an opener on): name and arguments of each, `None` unless the text
/// is entirely calls. A missing outer start tag is tolerated (models drop it at long context).
fn parse_deepseek(text: &str, end: End) -> Option<Calls> {
    let mut rest = text.trim_start();
    rest = rest.strip_prefix(CALLS_BEGIN).unwrap_or(rest).trim_start();
    let mut out = Calls::default();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix(CALLS_END) {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let Some(body) = rest.strip_prefix(CALL_BEGIN) else {
            // Cut inside the next marker.
            if end == End::Cut && (CALL_BEGIN.starts_with(rest) || CALLS_END.starts_with(rest)) {
                break;
            }
            return None;
        };
        let (inner, after, closed) = match body.find(CALL_END) {
            Some(e) => (&body[..e], &body[e + CALL_END.len()..], true),
            None if end != End::Open => (without_partial(body, CALL_END), "", false),
            None => return None,
        };
        let Some((left, right)) = inner.split_once(CALL_SEP) else {
            // Cut before the name.
            return (end == End::Cut && !closed).then_some(out);
        };
        let named = if left.trim() == "function" {
            // V3: the name, a newline, the arguments in a `json` code fence.
            right.split_once('\n').map(|(name, fenced)| {
                let fenced = fenced.trim();
                let args = match fenced.strip_prefix("```json").or_else(|| fenced.strip_prefix("```")) {
                    _ if "```json".starts_with(fenced) => "", // cut inside the fence
                    Some(args) => args.trim_end(),
                    None => fenced,
                };
                (name, args.strip_suffix("```").unwrap_or_else(|| without_partial(args, "```")))
            })
        } else {
            Some((left, right))
        };
        let Some((name, args)) = named else {
            return (end == End::Cut && !closed).then_some(out);
        };
        match serde_json::from_str::<Value>(args.trim()) {
            Ok(args) => out.whole.push(json!({"name": name.trim(), "arguments": args})),
            Err(_) if end == End::Cut && !closed => {
                out.cut = Some((name.trim().to_owned(), args.trim().to_owned()));
                break;
            }
            Err(_) => return None,
        }
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
            if self.format == ToolFormat::Llama3 && self.said_text {
                // A Llama 3 call is the whole answer: once prose began, nothing is a call.
                self.emit_text(&mut out, usize::MAX);
                break;
            }
            let openers = self.openers();
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

    /// The end of the text: whatever is held, as calls if it parses and as text if not. `cut`: the
    /// answer was cut by `max_tokens`, and the call it fell in is returned with its arguments as far
    /// as they were written; markup cut before a call's name is whole is dropped.
    pub fn finish(&mut self, cut: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.in_call && self.format.deepseek() && self.calls > 0 && self.held.trim() == CALLS_END {
            self.held.clear();
            self.in_call = false;
        }
        let end = if cut { End::Cut } else { End::Stopped };
        if self.in_call {
            let held = std::mem::take(&mut self.held);
            match self.parse_calls(&held, end) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => out.push(Piece::Text(held)),
            }
            self.in_call = false;
        } else if !self.held.is_empty() {
            let mut held = std::mem::take(&mut self.held);
            // (Once a Llama 3 answer began as prose, nothing in it opens a call.)
            if cut && !(self.format == ToolFormat::Llama3 && self.said_text) {
                // An opener cut short is markup, not an answer.
                let keep = self.openers().iter().map(|o| partial_suffix(&held, o)).max().unwrap_or(0);
                held.truncate(held.len() - keep);
            }
            // Whitespace after the last call is not an answer.
            if !held.is_empty() && (self.calls == 0 || !held.trim().is_empty()) {
                out.push(Piece::Text(held));
            }
        }
        out
    }

    /// The texts that open a call where the parser stands: DeepSeek's outer start tag or a call's
    /// own (models drop the outer one), and once a call went out, the outer end tag (lifted out, not
    /// text).
    fn openers(&self) -> &'static [&'static str] {
        match self.format {
            ToolFormat::Llama3 => &["{\"name\"", PYTHON_TAG],
            f if f.deepseek() && self.calls > 0 => &[CALLS_BEGIN, CALL_BEGIN, CALLS_END],
            f if f.deepseek() => &[CALLS_BEGIN, CALL_BEGIN],
            ToolFormat::Mistral => &["[TOOL_CALLS]"],
            _ => &["<tool_call>"],
        }
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
            return Some(match self.parse_calls(&block, End::Open) {
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
        Some(match self.parse_calls(&block, End::Open) {
            Some(calls) => calls.into_iter().map(Piece::Call).collect(),
            None => vec![Piece::Text(block)],
        })
    }

    /// The calls in `text` (which starts at an opener), or `None` if it is not entirely calls.
    fn parse_calls(&mut self, text: &str, end: End) -> Option<Vec<ToolCall>> {
        let cut = end == End::Cut;
        let mut found = Calls::default();
        match self.format {
            ToolFormat::Hermes => {
                let mut rest = text.trim();
                while !rest.is_empty() {
                    let Some(body) = rest.strip_prefix("<tool_call>") else {
                        if cut && "<tool_call>".starts_with(rest) {
                            break; // cut inside the next opener
                        }
                        return None;
                    };
                    match body.find("</tool_call>") {
                        Some(e) => {
                            found.whole.push(serde_json::from_str(body[..e].trim()).ok()?);
                            rest = body[e + "</tool_call>".len()..].trim();
                        }
                        None if end == End::Open => return None,
                        None => {
                            // An unclosed last block at the end of the answer still counts.
                            let body = without_partial(body.trim(), "</tool_call>").trim();
                            match serde_json::from_str(body) {
                                Ok(v) => found.whole.push(v),
                                Err(_) if cut => found.cut = cut_object(body)?,
                                Err(_) => return None,
                            }
                            break;
                        }
                    }
                }
            }
            ToolFormat::Llama3 => {
                let body = text.trim().trim_start_matches(PYTHON_TAG).trim();
                // One call, or several separated by `;`.
                let parts = split_top_level(body, ';');
                for (i, part) in parts.iter().enumerate() {
                    match serde_json::from_str(part.trim()) {
                        Ok(v) => found.whole.push(v),
                        Err(_) if cut && i + 1 == parts.len() => found.cut = cut_object(part)?,
                        Err(_) => return None,
                    }
                }
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => found = parse_deepseek(text, end)?,
            ToolFormat::Mistral => {
                let body = text.trim().strip_prefix("[TOOL_CALLS]")?.trim();
                match serde_json::from_str(body) {
                    Ok(Value::Array(a)) => found.whole = a,
                    Ok(o @ Value::Object(_)) => found.whole = vec![o],
                    Ok(_) => return None,
                    Err(_) if cut => {
                        // The list's whole elements, then the one the cut fell in.
                        let mut rest = match body.strip_prefix('[') {
                            Some(r) => r,
                            None if body.is_empty() => "",
                            None => return None,
                        };
                        loop {
                            rest = rest.trim_start();
                            match json_value_len(rest) {
                                Some(n) => {
                                    found.whole.push(serde_json::from_str(&rest[..n]).ok()?);
                                    rest = rest[n..].trim_start();
                                    rest = rest.strip_prefix(',').unwrap_or(rest);
                                }
                                None => {
                                    found.cut = cut_object(rest)?;
                                    break;
                                }
                            }
                        }
                    }
                    Err(_) => return None,
                }
            }
        }
        if found.whole.is_empty() && !cut {
            return None;
        }
        let mut calls = Vec::with_capacity(found.whole.len() + 1);
        for o in found.whole {
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
            calls.push((name.to_owned(), arguments));
        }
        if let Some((name, arguments)) = found.cut {
            if !self.names.contains(&name) {
                return None;
            }
            calls.push((name, arguments));
        }
        let calls: Vec<ToolCall> = calls
            .into_iter()
            .enumerate()
            .map(|(i, (name, arguments))| ToolCall { id: self.call_id(self.calls + i), name, arguments })
            .collect();
        self.calls += calls.len();
        Some(calls)
    }

    /// Call `n`'s id: `call_<prefix>_<n>`, or for Mistral the 9 letters and digits its template
    /// requires (derived from the same two, so unique per response as well).
    fn call_id(&self, n: usize) -> String {
        if self.format != ToolFormat::Mistral {
            return format!("call_{}_{n}", self.id_prefix);
        }
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.id_prefix, n).hash(&mut h);
        let mut x = h.finish();
        const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        (0..9)
            .map(|_| {
                let c = ALNUM[(x % ALNUM.len() as u64) as usize] as char;
                x /= ALNUM.len() as u64;
                c
            })
            .collect()
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
                strict: false,
            },
            Tool {
                name: "list_dir".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: false,
            },
        ]
    }

    fn run(format: ToolFormat, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut p = ToolCallParser::new(format, &tools(), "x");
        let mut out: Vec<Piece> = pieces.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish(false));
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

    /// `full` cut by `max_tokens` at every character: the whole calls before the cut, then the cut
    /// one with its arguments as far as written; never markup in the text.
    #[test]
    fn calls_cut_by_max_tokens_are_calls_with_partial_arguments() {
        let cases = [
            (ToolFormat::Hermes, "Sure.\n<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.txt\"}}\n</tool_call>"),
            (ToolFormat::Mistral, "Sure.[TOOL_CALLS][{\"name\": \"list_dir\", \"arguments\": {}}, {\"name\": \"read_file\", \"arguments\": {\"path\": \"a.txt\"}}]"),
            (ToolFormat::Llama3, "{\"name\": \"list_dir\", \"parameters\": {}}; {\"name\": \"read_file\", \"parameters\": {\"path\": \"a.txt\"}}"),
            (ToolFormat::DeepSeekV3, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>list_dir\n```json\n{}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{\"path\": \"a.txt\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            (ToolFormat::DeepSeekV31, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>list_dir<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{\"path\": \"a.txt\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ];
        for (format, full) in cases {
            let prose = if format == ToolFormat::Llama3 { "" } else { "Sure." };
            let second = full.rfind("read_file").unwrap();
            let args_at = full.rfind("{\"path").unwrap();
            for (at, _) in full.char_indices().skip(prose.chars().count()) {
                let mut p = ToolCallParser::new(format, &tools(), "x");
                let mut out = p.push(&full[..at]);
                out.extend(p.finish(true));
                let text: String = out
                    .iter()
                    .filter_map(|o| match o {
                        Piece::Text(t) => Some(t.as_str()),
                        _ => None,
                    })
                    .collect();
                let calls: Vec<&ToolCall> = out
                    .iter()
                    .filter_map(|o| match o {
                        Piece::Call(c) => Some(c),
                        _ => None,
                    })
                    .collect();
                assert_eq!(text.trim_end(), prose, "{format:?} cut at {at}: {:?}", &full[..at]);
                // The first call is whole once its arguments close; the second is named once its
                // name is whole.
                let after_name = if format == ToolFormat::DeepSeekV31 { CALL_SEP.len() } else { 1 };
                let named_second = at >= second + "read_file".len() + after_name;
                if named_second {
                    assert_eq!(calls.len(), 2, "{format:?} cut at {at}: {:?}", &full[..at]);
                    assert_eq!(calls[0].name, "list_dir");
                    assert_eq!((calls[1].name.as_str(), !calls[1].id.is_empty()), ("read_file", true));
                    let args = &calls[1].arguments;
                    let written = &full[args_at..at.max(args_at)];
                    assert!(
                        args == r#"{"path":"a.txt"}"#
                            || (written.starts_with(args.as_str())
                                && args.len() + 4
                                    >= written
                                        .trim_end_matches(|c| "}]\n`<｜tool▁call▁end｜>calls/_".contains(c))
                                        .len()),
                        "{format:?} cut at {at}: arguments {args:?} of {written:?}"
                    );
                }
                assert!(
                    calls.len() <= 2
                        && calls.iter().all(|c| c.name != "list_dir" || "{}".starts_with(&c.arguments)),
                    "{format:?} cut at {at}: {calls:?}"
                );
            }
        }
        // Not a call at all: text, also when cut.
        let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools(), "x");
        let mut out = p.push("<tool_call> never closed and not JSON");
        out.extend(p.finish(true));
        assert_eq!(out, [Piece::Text("<tool_call> never closed and not JSON".into())]);
        // Mistral's ids are nine letters and digits, unique per call.
        let (_, calls) = run(ToolFormat::Mistral, &[cases[1].1]);
        assert!(calls.iter().all(|c| c.id.len() == 9 && c.id.chars().all(|c| c.is_ascii_alphanumeric())));
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn forced_call_grammars_name_the_functions() {
        let g = ToolFormat::DeepSeekV3.forced_call_grammar(&tools(), Some("read_file"), 1);
        assert!(
            g.contains("start: \"<｜tool▁calls▁begin｜>\" rest\nrest: call \"<｜tool▁calls▁end｜>\""),
            "{g}"
        );
        assert!(g.contains("function<｜tool▁sep｜>read_file\\n```json\\n") && !g.contains("list_dir"), "{g}");
        let g = ToolFormat::DeepSeekV31.forced_call_grammar(&tools(), None, 8);
        assert!(g.contains("call{1,8}") && g.contains("call: c0 | c1"), "{g}");
        let g = ToolFormat::Hermes.forced_call_grammar(&tools(), Some("read_file"), 1);
        assert!(
            g.starts_with("start: \"<tool_call>\" rest\nrest: \"\\n\" body \"\\n</tool_call>\" \"\\n\"?\n")
                && g.contains("\"const\":\"read_file\"")
                && !g.contains("list_dir"),
            "{g}"
        );
        let g = ToolFormat::Hermes.forced_call_grammar(&tools(), None, 8);
        assert!(g.contains("(\"\\n\" call){0,7} \"\\n\"?") && g.contains("anyOf"), "{g}");
        let g = ToolFormat::Mistral.forced_call_grammar(&tools(), None, 1);
        assert!(g.contains("\"maxItems\":1"));
        // Under auto: free text, or text and then the calls; Llama 3 has no opener to start at.
        let g = ToolFormat::Mistral.auto_call_grammar(&tools(), 8).unwrap();
        assert!(g.starts_with("start: FREE | prefix rest\n") && g.contains("\\[TOOL_CALLS\\]"), "{g}");
        assert!(ToolFormat::Llama3.auto_call_grammar(&tools(), 8).is_none());
    }
}
