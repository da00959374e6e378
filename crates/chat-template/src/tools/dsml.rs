//! DeepSeek's DSML tool calls (V3.2 writes them in a `function_calls` block, V4 in a `tool_calls`
//! one):
//!
//! ```text
//! <｜DSML｜tool_calls>
//! <｜DSML｜invoke name="read_file">
//! <｜DSML｜parameter name="path" string="true">a.txt</｜DSML｜parameter>
//! <｜DSML｜parameter name="lines" string="false">[1, 20]</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! A parameter's value is raw text when `string="true"`, JSON otherwise. The parser streams: a call
//! goes out as [`Piece::CallBegin`] once its head names an offered function and a parameter (or the
//! call's end) follows, then its arguments as [`Piece::CallArguments`] as they arrive (a string
//! value character by character, JSON-escaped; a typed value when it closes), then [`Piece::Call`]
//! whole. The fragments joined are the call's arguments. What peers got wrong in 2026 is handled
//! here: markup never reaches the text (an opener cut short is held; whitespace before a block is
//! not text), a missing block start tag is tolerated, a close tag split across chunks never leaks
//! into a value, a parameter named `arguments` that wraps the real ones (the function declares no
//! such parameter) is unwrapped, prose that looks like a call stays text until a parameter or the
//! call's end follows a known function's name, and there are no calls without tools (no parser).

use pdserve_api::tools::{Tool, ToolCall};
use serde_json::Value;

use super::parse::partial_suffix;
use super::Piece;

pub(super) const BLOCK_V4: &str = "<｜DSML｜tool_calls>";
pub(super) const BLOCK_V32: &str = "<｜DSML｜function_calls>";
pub(super) const BLOCK_END_V4: &str = "</｜DSML｜tool_calls>";
pub(super) const BLOCK_END_V32: &str = "</｜DSML｜function_calls>";
pub(super) const INVOKE: &str = "<｜DSML｜invoke";
pub(super) const INVOKE_END: &str = "</｜DSML｜invoke>";
pub(super) const PARAM: &str = "<｜DSML｜parameter";
pub(super) const PARAM_END: &str = "</｜DSML｜parameter>";

/// The longest function or parameter name read from a tag (longer: not a call).
const NAME_BYTES_MAX: usize = 256;

/// How a parameter's value is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Raw text, sent as a JSON string as it arrives.
    Str,
    /// JSON, sent when it closes (a value that is not JSON goes as a string).
    Json,
    /// Held whole: a first parameter named `arguments` the function does not declare, unwrapped
    /// when it holds an object.
    Wrapper,
    /// Dropped: a parameter with no name, or a second one of a name.
    Skip,
}

#[derive(Debug)]
struct Param {
    key: String,
    kind: Kind,
    /// A `Json` or `Wrapper` value so far.
    value: String,
    /// Whether the `string` attribute said `true` (how a `Wrapper` that holds no object is sent).
    string: bool,
}

#[derive(Debug)]
struct OpenCall {
    id: String,
    name: String,
    /// The arguments sent so far.
    args: String,
    /// Entries in the arguments object (the next one is preceded by a comma).
    entries: usize,
    keys: Vec<String>,
    param: Option<Param>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Answer text, or between calls.
    Prose,
    /// From an opener on, not yet known to be a call.
    Head,
    /// In a call, between parameters.
    Body,
    /// In a parameter's value.
    Value,
}

/// What the text from an opener on is.
enum Head {
    /// Could still become a call.
    Need,
    /// A call to `name`; its parameters (or end) start at byte `at`.
    Call { name: String, at: usize },
    /// Not a call.
    Not,
}

/// The streaming DSML parser behind [`super::ToolCallParser`] for the DSML formats.
#[derive(Debug)]
pub(super) struct Dsml {
    /// Each offered function: its name and its parameters' schemas (`properties`).
    tools: Vec<(String, Value)>,
    held: String,
    state: State,
    /// Whitespace dropped before the opener now held (given back if it is no call).
    before: String,
    call: Option<OpenCall>,
    calls: usize,
    /// No text went out since the last call (whitespace here is not text).
    after_call: bool,
}

impl Dsml {
    pub(super) fn new(tools: &[Tool]) -> Self {
        Dsml {
            tools: tools
                .iter()
                .map(|t| (t.name.clone(), t.parameters.get("properties").cloned().unwrap_or(Value::Null)))
                .collect(),
            held: String::new(),
            state: State::Prose,
            before: String::new(),
            call: None,
            calls: 0,
            after_call: false,
        }
    }

    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds text; `id` names call `n`.
    pub(super) fn push(&mut self, text: &str, id: &dyn Fn(usize) -> String) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, id) {}
        out
    }

    /// The end of the answer (`cut`: by `max_tokens`).
    pub(super) fn finish(&mut self, cut: bool, id: &dyn Fn(usize) -> String) -> Vec<Piece> {
        let mut out = Vec::new();
        while self.step(&mut out, id) {}
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Prose => {
                let keep = if cut {
                    openers(self.calls).iter().map(|o| partial_suffix(&held, o)).max()
                } else {
                    None
                };
                let held = &held[..held.len() - keep.unwrap_or(0)];
                if self.calls == 0 || !held.trim().is_empty() {
                    text(&mut out, held);
                }
            }
            // A head whose name is whole, in a block: a call with no arguments (cut: none written).
            // (Without the block's tag, prose that ends in a head stays prose.)
            State::Head => match named(&held)
                .filter(|n| self.known(n) && [BLOCK_V4, BLOCK_V32].iter().any(|b| held.starts_with(b)))
            {
                Some(name) => {
                    let args = if cut { "" } else { "{}" };
                    let call = ToolCall { id: id(self.calls), name, arguments: args.to_owned() };
                    self.calls += 1;
                    out.push(Piece::Call(call));
                }
                None if cut => {}
                None => {
                    text(&mut out, &std::mem::take(&mut self.before));
                    text(&mut out, &held);
                }
            },
            State::Body | State::Value => {
                // Ended inside a value (a stop string cut it, or the model stopped mid-argument): the
                // arguments as far as written, never closed, so no client takes them for whole ones.
                let cut = cut || self.state == State::Value;
                let mut call = self.call.take().expect("a call is open in its body");
                if let Some(p) = call.param.take() {
                    if cut {
                        // As far as written (a close tag cut short is markup).
                        let value =
                            format!("{}{}", p.value, &held[..held.len() - partial_suffix(&held, PARAM_END)]);
                        let frag = match p.kind {
                            Kind::Str => escape(&value),
                            Kind::Skip => String::new(),
                            _ => format!("{}{value}", entry_head(&call, &p.key)),
                        };
                        add(&mut out, &mut call, frag);
                    } else {
                        let mut p = p;
                        p.value.push_str(&held[..held.len() - partial_suffix(&held, PARAM_END)]);
                        if p.kind == Kind::Str {
                            add(&mut out, &mut call, escape(&p.value));
                        }
                        close_param(&mut out, &mut call, p);
                    }
                }
                if !cut {
                    close_call(&mut out, &mut call);
                }
                self.calls += 1;
                out.push(Piece::Call(ToolCall { id: call.id, name: call.name, arguments: call.args }));
            }
        }
        self.state = State::Prose;
        out
    }

    fn known(&self, name: &str) -> bool {
        self.tools.iter().any(|(n, _)| n == name)
    }

    /// One step of the machine on the held text; whether it moved.
    fn step(&mut self, out: &mut Vec<Piece>, id: &dyn Fn(usize) -> String) -> bool {
        match self.state {
            State::Prose => {
                let openers = openers(self.calls);
                let found = openers.iter().filter_map(|o| self.held.find(o).map(|at| (at, *o))).min();
                match found {
                    Some((at, o)) if o == BLOCK_END_V4 || o == BLOCK_END_V32 => {
                        // The block's end after calls: markup, not text (nor the whitespace before).
                        let before = self.held[..at].trim_end().len();
                        self.emit(out, before);
                        self.held.drain(..at - before + o.len());
                        true
                    }
                    Some((at, _)) => {
                        let ws = self.held[..at].trim_end().len();
                        self.emit(out, ws);
                        self.before = self.held.drain(..at - ws).collect();
                        self.state = State::Head;
                        true
                    }
                    None => {
                        // Hold a tail that could grow into an opener, and the whitespace before it
                        // (and after calls, before any text).
                        let keep = openers.iter().map(|o| partial_suffix(&self.held, o)).max().unwrap_or(0);
                        let head = self.held[..self.held.len() - keep].trim_end().len();
                        self.emit(out, head);
                        false
                    }
                }
            }
            State::Head => match self.head() {
                Head::Need => false,
                Head::Not => {
                    // The opener is text; what follows it is read again as prose.
                    let n = openers(self.calls)
                        .iter()
                        .find(|o| self.held.starts_with(**o))
                        .map_or_else(|| self.held.chars().next().map_or(0, char::len_utf8), |o| o.len());
                    // (Whitespace between calls is not text.)
                    let before = std::mem::take(&mut self.before);
                    if !self.after_call {
                        text(out, &before);
                    }
                    let t: String = self.held.drain(..n).collect();
                    text(out, &t);
                    self.after_call = false;
                    self.state = State::Prose;
                    true
                }
                Head::Call { name, at } => {
                    self.held.drain(..at);
                    self.before.clear();
                    let call = OpenCall {
                        id: id(self.calls),
                        name: name.clone(),
                        args: String::new(),
                        entries: 0,
                        keys: Vec::new(),
                        param: None,
                    };
                    out.push(Piece::CallBegin { id: call.id.clone(), name });
                    self.call = Some(call);
                    self.state = State::Body;
                    true
                }
            },
            State::Body => self.body(out),
            State::Value => self.value(out),
        }
    }

    /// Gives out the held text's first `n` bytes as text (after a call, not its leading whitespace).
    fn emit(&mut self, out: &mut Vec<Piece>, n: usize) {
        let mut n = n;
        if self.after_call && n > 0 {
            let ws = self.held.len() - self.held.trim_start().len();
            self.held.drain(..ws.min(n));
            n -= ws.min(n);
        }
        let t: String = self.held.drain(..n).collect();
        self.after_call &= t.is_empty();
        text(out, &t);
    }

    /// The text from an opener on (the block's start tag, optional, then a call's head).
    fn head(&self) -> Head {
        let mut rest = self.held.as_str();
        for b in [BLOCK_V4, BLOCK_V32] {
            rest = rest.strip_prefix(b).unwrap_or(rest);
        }
        let rest = rest.trim_start();
        let need_or_not = |r: &str, pats: &[&str]| {
            if pats.iter().any(|p| p.starts_with(r)) {
                Head::Need
            } else {
                Head::Not
            }
        };
        let Some(r) = rest.strip_prefix(INVOKE) else { return need_or_not(rest, &[INVOKE]) };
        let r2 = r.trim_start();
        if r2.is_empty() {
            return Head::Need;
        }
        if r2.len() == r.len() {
            return Head::Not; // `<｜DSML｜invoked...`
        }
        let Some(r3) = r2.strip_prefix("name=\"") else { return need_or_not(r2, &["name=\""]) };
        let Some(q) = r3.find('"') else {
            let bad = r3.len() > NAME_BYTES_MAX || r3.contains(['>', '\n', '<']);
            return if bad { Head::Not } else { Head::Need };
        };
        let name = &r3[..q];
        if !self.known(name) {
            return Head::Not;
        }
        let r4 = r3[q + 1..].trim_start();
        let Some(r5) = r4.strip_prefix('>') else { return need_or_not(r4, &[">"]) };
        let r6 = r5.trim_start();
        if r6.starts_with(PARAM) || r6.starts_with(INVOKE_END) {
            Head::Call { name: name.to_owned(), at: self.held.len() - r6.len() }
        } else {
            need_or_not(r6, &[PARAM, INVOKE_END])
        }
    }

    /// In a call, between parameters: the next parameter's head, the call's end, or markup the
    /// model left out (a block's end or the next call's head end this call too).
    fn body(&mut self, out: &mut Vec<Piece>) -> bool {
        let ws = self.held.len() - self.held.trim_start().len();
        self.held.drain(..ws);
        let h = self.held.as_str();
        if h.starts_with(PARAM) {
            // (The end is looked for only as far as a head may reach, whatever has arrived.)
            let reach = PARAM.len() + 2 * NAME_BYTES_MAX;
            let Some(gt) =
                h.char_indices().take_while(|&(i, _)| i <= reach).find(|&(_, c)| c == '>').map(|(i, _)| i)
            else {
                if h.len() > reach {
                    self.held.drain(..PARAM.len()); // a head with no end: dropped
                    return true;
                }
                return false;
            };
            let attrs = &h[PARAM.len()..gt];
            let call = self.call.as_mut().expect("a call is open in its body");
            let (key, string) = (attr(attrs, "name"), attr(attrs, "string"));
            self.held.drain(..gt + 1);
            let Some(key) = key.filter(|k| !k.is_empty() && !call.keys.contains(k)) else {
                let skip =
                    Param { key: String::new(), kind: Kind::Skip, value: String::new(), string: false };
                call.param = Some(skip);
                self.state = State::Value;
                return true;
            };
            let declared = self.tools.iter().find(|(n, _)| *n == call.name).and_then(|(_, p)| p.get(&key));
            let kind = match string.as_deref() {
                _ if key == "arguments" && call.args.is_empty() && declared.is_none() => Kind::Wrapper,
                Some("true") => Kind::Str,
                Some(_) => Kind::Json,
                None if declared.and_then(|s| s.get("type")).and_then(Value::as_str) == Some("string") => {
                    Kind::Str
                }
                None => Kind::Json,
            };
            if kind == Kind::Str {
                let frag = format!("{}\"", entry_head(call, &key));
                add(out, call, frag);
            }
            call.keys.push(key.clone());
            call.param =
                Some(Param { key, kind, value: String::new(), string: string.as_deref() == Some("true") });
            self.state = State::Value;
            return true;
        }
        let ends = [INVOKE_END, BLOCK_END_V4, BLOCK_END_V32, INVOKE];
        if let Some(e) = ends.iter().find(|e| h.starts_with(**e)) {
            if *e == INVOKE_END {
                self.held.drain(..e.len());
            }
            let mut call = self.call.take().expect("a call is open in its body");
            close_call(out, &mut call);
            self.calls += 1;
            out.push(Piece::Call(ToolCall { id: call.id, name: call.name, arguments: call.args }));
            self.state = State::Prose;
            self.after_call = true;
            return true;
        }
        if h.is_empty() || [PARAM].iter().chain(&ends).any(|p| p.starts_with(h)) {
            return false;
        }
        // Anything else in a call is dropped up to the next tag.
        let n = h.char_indices().skip(1).find(|(_, c)| *c == '<').map_or(h.len(), |(i, _)| i);
        self.held.drain(..n);
        true
    }

    /// In a parameter's value: a string goes out as it arrives (a close tag cut short is held).
    fn value(&mut self, out: &mut Vec<Piece>) -> bool {
        let call = self.call.as_mut().expect("a call is open in its value");
        let p = call.param.as_mut().expect("a parameter is open");
        match self.held.find(PARAM_END) {
            Some(e) => {
                let v: String = self.held.drain(..e).collect();
                self.held.drain(..PARAM_END.len());
                let mut p = call.param.take().expect("a parameter is open");
                if p.kind == Kind::Str {
                    add(out, call, escape(&v));
                } else {
                    p.value.push_str(&v);
                }
                close_param(out, call, p);
                self.state = State::Body;
                true
            }
            None => {
                let n = self.held.len() - partial_suffix(&self.held, PARAM_END);
                let v: String = self.held.drain(..n).collect();
                match p.kind {
                    Kind::Str if !v.is_empty() => add(out, call, escape(&v)),
                    Kind::Str | Kind::Skip => {}
                    Kind::Json | Kind::Wrapper => p.value.push_str(&v),
                }
                false
            }
        }
    }
}

/// The texts that open a call where the parser stands (a block's start tag, or a call's head when
/// the model left the block's out), and after calls the block's end tag (dropped).
fn openers(calls: usize) -> &'static [&'static str] {
    if calls > 0 {
        &[BLOCK_V4, BLOCK_V32, INVOKE, BLOCK_END_V4, BLOCK_END_V32]
    } else {
        &[BLOCK_V4, BLOCK_V32, INVOKE]
    }
}

/// The function a head cut short names, once its name is whole.
fn named(held: &str) -> Option<String> {
    let at = held.find(INVOKE)?;
    let r = held[at + INVOKE.len()..].trim_start().strip_prefix("name=\"")?;
    Some(r[..r.find('"')?].to_owned())
}

/// Attribute `key`'s value in a tag's attributes (`name="path" string="true"`).
fn attr(attrs: &str, key: &str) -> Option<String> {
    let mut rest = attrs;
    loop {
        let at = rest.find(key)?;
        let before_ok = at == 0 || rest[..at].ends_with(char::is_whitespace);
        let after = rest[at + key.len()..].trim_start();
        if let Some(v) = after.strip_prefix('=').map(str::trim_start).and_then(|v| v.strip_prefix('"')) {
            if before_ok {
                return v.find('"').map(|e| v[..e].to_owned());
            }
        }
        rest = &rest[at + key.len()..];
    }
}

/// The text before an entry's value: `{"key":` for the first, `,"key":` after.
fn entry_head(call: &OpenCall, key: &str) -> String {
    let key = Value::String(key.to_owned()).to_string();
    match (call.args.is_empty(), call.entries) {
        (true, _) => format!("{{{key}:"),
        // (After an `arguments` wrapper that held no entries.)
        (false, 0) => format!("{key}:"),
        _ => format!(",{key}:"),
    }
}

/// A closed parameter: a typed value goes out now; an `arguments` wrapper holding an object opens
/// the arguments with that object's entries.
fn close_param(out: &mut Vec<Piece>, call: &mut OpenCall, p: Param) {
    let frag = match p.kind {
        Kind::Skip => return,
        Kind::Str => "\"".to_owned(),
        Kind::Wrapper => match serde_json::from_str::<Value>(p.value.trim()) {
            Ok(Value::Object(o)) => {
                let whole = Value::Object(o.clone()).to_string();
                call.keys.extend(o.keys().cloned());
                call.entries = o.len();
                let frag = whole[..whole.len() - 1].to_owned();
                add(out, call, frag);
                return;
            }
            _ if p.string => format!("{}{}", entry_head(call, &p.key), Value::String(p.value)),
            _ => format!("{}{}", entry_head(call, &p.key), json_or_string(&p.value)),
        },
        Kind::Json => format!("{}{}", entry_head(call, &p.key), json_or_string(&p.value)),
    };
    add(out, call, frag);
    call.entries += 1;
}

/// The end of a call's arguments.
fn close_call(out: &mut Vec<Piece>, call: &mut OpenCall) {
    let end = if call.args.is_empty() { "{}" } else { "}" };
    add(out, call, end.to_owned());
}

/// A typed value as JSON, or as a string where it is not JSON.
fn json_or_string(v: &str) -> String {
    serde_json::from_str::<Value>(v.trim()).unwrap_or_else(|_| Value::String(v.to_owned())).to_string()
}

/// `s` escaped as inside a JSON string.
fn escape(s: &str) -> String {
    let q = Value::String(s.to_owned()).to_string();
    q[1..q.len() - 1].to_owned()
}

/// Sends `frag` as more of the open call's arguments.
fn add(out: &mut Vec<Piece>, call: &mut OpenCall, frag: String) {
    if frag.is_empty() {
        return;
    }
    call.args.push_str(&frag);
    match out.last_mut() {
        Some(Piece::CallArguments(a)) => a.push_str(&frag),
        _ => out.push(Piece::CallArguments(frag)),
    }
}

/// Sends `t` as text (joined to text just sent).
fn text(out: &mut Vec<Piece>, t: &str) {
    if t.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Piece::Text(s)) => s.push_str(t),
        _ => out.push(Piece::Text(t.to_owned())),
    }
}

/// How a call's arguments read in DSML: one parameter per entry, strings raw, other values JSON.
pub(crate) fn render_invoke(name: &str, arguments: &[(String, Value)]) -> String {
    let params: Vec<String> = arguments
        .iter()
        .map(|(k, v)| {
            let (string, value) = match v {
                Value::String(t) => ("true", t.clone()),
                v => ("false", v.to_string()),
            };
            format!("{PARAM} name=\"{k}\" string=\"{string}\">{value}{PARAM_END}")
        })
        .collect();
    format!("{INVOKE} name=\"{name}\">\n{}\n{INVOKE_END}", params.join("\n"))
}

/// The system text that offers `tools` in DSML (for a model whose prompt has no place for them).
pub(super) fn system_prompt(format: super::ToolFormat, tools: &[Tool]) -> String {
    let functions: Vec<Value> = tools.iter().map(|t| t.to_json()["function"].clone()).collect();
    tools_text(format, &functions)
}

/// The `## Tools` section that offers `functions` (each `{"name", "description", "parameters"}`)
/// and says how to call them in `format`'s DSML.
pub(crate) fn tools_text(format: super::ToolFormat, functions: &[Value]) -> String {
    let (begin, end) = format.dsml_block().expect("a DSML format");
    let mut s = format!(
        "## Tools\n\nYou can call the functions below. To call them, write a {begin} block: one \
         {INVOKE} name=\"FUNCTION\"> ... {INVOKE_END} per call, and in it one \
         {PARAM} name=\"NAME\" string=\"true|false\">VALUE{PARAM_END} per argument. A string is written \
         as it is, with string=\"true\"; numbers, booleans, arrays and objects as JSON, with \
         string=\"false\". For example:\n\n{begin}\n{INVOKE} name=\"get_weather\">\n\
         {PARAM} name=\"city\" string=\"true\">Paris{PARAM_END}\n{PARAM} name=\"days\" string=\"false\">3{PARAM_END}\n\
         {INVOKE_END}\n{end}\n\nIf you think before answering, finish thinking before any call. The \
         functions, in JSON Schema:\n\n"
    );
    for f in functions {
        s.push_str(&f.to_string());
        s.push('\n');
    }
    s
}
