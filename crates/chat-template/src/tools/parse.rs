//! Lifting calls out of a model's streamed text: the parser, and how a text from a call's opener on
//! reads as calls (whole, stopped, or cut by `max_tokens`).

use pdserve_api::tools::{Tool, ToolCall};
use serde_json::{json, Value};

use super::{ToolFormat, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP, PYTHON_TAG};

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

/// The characters of `s` outside JSON strings, each with the bracket depth before it.
fn outside_strings(s: &str) -> impl Iterator<Item = (usize, char, i32)> + '_ {
    let (mut depth, mut in_str, mut esc) = (0i32, false, false);
    s.char_indices().filter_map(move |(i, c)| {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            return None;
        }
        let before = depth;
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            _ => {}
        }
        Some((i, c, before))
    })
}

/// The length of the JSON object or array `s` starts with, if it closes in `s`.
fn json_value_len(s: &str) -> Option<usize> {
    for (i, c, before) in outside_strings(s) {
        match c {
            '}' | ']' if before == 1 => return Some(i + 1),
            '{' | '[' => {}
            _ if before == 0 => return None,
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
    /// A call begins (formats that stream their calls' arguments: DSML): its id and function;
    /// its arguments follow as [`Piece::CallArguments`], then the call whole as [`Piece::Call`].
    CallBegin { id: String, name: String },
    /// More of the open call's arguments (JSON text; the fragments joined are the call's
    /// `arguments`).
    CallArguments(String),
    /// A complete call (after its `CallBegin` and `CallArguments` where the format streams them).
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
    /// The DSML formats' own streaming parser.
    dsml: Option<super::dsml::Dsml>,
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
            dsml: format.dsml_block().map(|_| super::dsml::Dsml::new(tools)),
        }
    }

    /// Calls given out (whole) so far.
    pub fn calls(&self) -> usize {
        match &self.dsml {
            Some(d) => d.calls(),
            None => self.calls,
        }
    }

    /// Feeds a piece of text; returns what can be given out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(d) = self.dsml.as_mut() {
            let prefix = &self.id_prefix;
            return d.push(text, &|n| format!("call_{prefix}_{n}"));
        }
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
        if let Some(d) = self.dsml.as_mut() {
            let prefix = &self.id_prefix;
            return d.finish(cut, &|n| format!("call_{prefix}_{n}"));
        }
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
            // (DSML has a parser of its own.)
            ToolFormat::DeepSeekV32 | ToolFormat::DeepSeekV4 => return None,
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
pub(super) fn partial_suffix(text: &str, pat: &str) -> usize {
    (1..pat.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && pat.is_char_boundary(k) && text.ends_with(&pat[..k])
        })
        .unwrap_or(0)
}

/// Splits `s` at `sep` outside JSON strings, brackets and braces.
fn split_top_level(s: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, c, depth) in outside_strings(s) {
        if c == sep && depth == 0 {
            parts.push(&s[start..i]);
            start = i + c.len_utf8();
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}
