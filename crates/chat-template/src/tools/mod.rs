//! The formats models write tool calls in (Hermes/Qwen `<tool_call>` blocks, Llama 3 JSON, Mistral
//! `[TOOL_CALLS]`, DeepSeek's markers and its DSML), how an earlier call reads in each, the grammar that forces a call when a request
//! requires one, and the streaming parser that lifts calls out of a model's text (broken ones come
//! back as text).

use pdserve_api::tools::Tool;
use serde_json::{json, Value};

mod dsml;
mod grammar;
mod parse;
pub(crate) use dsml::{render_invoke as render_dsml_invoke, tools_text as dsml_tools_text};
pub use parse::{Piece, ToolCallParser};

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
    /// DeepSeek V3.2's DSML: `<｜DSML｜function_calls>`, per call `<｜DSML｜invoke name="...">` and
    /// one `<｜DSML｜parameter name="..." string="true|false">value</｜DSML｜parameter>` per argument.
    DeepSeekV32,
    /// DeepSeek V4's DSML: the same calls in a `<｜DSML｜tool_calls>` block.
    DeepSeekV4,
}

/// DeepSeek's tool-call markers.
const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const CALL_SEP: &str = "<｜tool▁sep｜>";

impl ToolFormat {
    pub const NAMES: &'static str =
        "hermes, llama3, mistral, deepseek_v3, deepseek_v31, deepseek_v32, deepseek_v4";

    pub fn from_name(s: &str) -> Option<ToolFormat> {
        match s {
            "hermes" | "qwen" => Some(ToolFormat::Hermes),
            "llama3" | "llama3_json" => Some(ToolFormat::Llama3),
            "mistral" => Some(ToolFormat::Mistral),
            "deepseek_v3" | "deepseek_r1" => Some(ToolFormat::DeepSeekV3),
            "deepseek_v31" => Some(ToolFormat::DeepSeekV31),
            "deepseek_v32" | "dsml_v32" => Some(ToolFormat::DeepSeekV32),
            "deepseek_v4" | "dsml" => Some(ToolFormat::DeepSeekV4),
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
            ToolFormat::DeepSeekV32 => "deepseek_v32",
            ToolFormat::DeepSeekV4 => "deepseek_v4",
        }
    }

    /// A DSML format's block tags (start, end).
    fn dsml_block(self) -> Option<(&'static str, &'static str)> {
        match self {
            ToolFormat::DeepSeekV32 => Some((dsml::BLOCK_V32, dsml::BLOCK_END_V32)),
            ToolFormat::DeepSeekV4 => Some((dsml::BLOCK_V4, dsml::BLOCK_END_V4)),
            _ => None,
        }
    }

    /// The format of a DeepSeek checkpoint that ships no chat template (its prompts come from
    /// DeepSeek's own encoder), by `config.json`'s `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<ToolFormat> {
        match model_type {
            "deepseek_v32" => Some(ToolFormat::DeepSeekV32),
            "deepseek_v4" => Some(ToolFormat::DeepSeekV4),
            _ => None,
        }
    }

    fn deepseek(self) -> bool {
        matches!(self, ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31)
    }

    /// The format a chat template writes calls in; a template without one of its own gets
    /// [`ToolFormat::Hermes`] (the engine then describes the tools itself, in that format).
    pub fn from_template(template: &str) -> ToolFormat {
        if template.contains("｜DSML｜") {
            if template.contains("function_calls") {
                ToolFormat::DeepSeekV32
            } else {
                ToolFormat::DeepSeekV4
            }
        } else if template.contains(CALLS_BEGIN) {
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
            ToolFormat::DeepSeekV32 | ToolFormat::DeepSeekV4 => {
                let (begin, end) = self.dsml_block().expect("a DSML format");
                let entries: Vec<(String, Value)> = arguments
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                format!("{begin}\n{}\n{end}", dsml::render_invoke(name, &entries))
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

    /// How a tool's result reads to a model whose template has no place for it.
    pub fn render_result(self, content: &str) -> String {
        match self {
            ToolFormat::DeepSeekV32 => {
                format!("<function_results>\n<result>{content}</result>\n</function_results>")
            }
            ToolFormat::DeepSeekV4 => format!("<tool_result>{content}</tool_result>"),
            _ => format!("<tool_response>\n{content}\n</tool_response>"),
        }
    }

    /// The system text that offers `tools` to a model whose template does not: in DSML for the DSML
    /// formats, in the Hermes format for every other.
    pub fn system_prompt(self, tools: &[Tool]) -> String {
        if self.dsml_block().is_some() {
            return dsml::system_prompt(self, tools);
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_api::tools::ToolCall;

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
                Piece::CallBegin { .. } | Piece::CallArguments(_) => panic!("{format:?} streams no calls"),
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

    /// A DSML answer fed in `pieces`: its text, its calls, and per call the arguments as streamed
    /// (the `CallArguments` after its `CallBegin`, joined).
    fn run_dsml(format: ToolFormat, pieces: &[&str], cut: bool) -> (String, Vec<ToolCall>, Vec<String>) {
        let mut p = ToolCallParser::new(format, &tools(), "x");
        let mut out: Vec<Piece> = pieces.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish(cut));
        let (mut text, mut calls, mut streamed) = (String::new(), Vec::new(), Vec::<String>::new());
        let mut open: Option<String> = None;
        for o in out {
            match o {
                Piece::Text(t) => {
                    assert!(open.is_none(), "text inside a call");
                    text.push_str(&t);
                }
                Piece::CallBegin { id, .. } => {
                    assert!(open.is_none(), "a call began inside another");
                    open = Some(id);
                    streamed.push(String::new());
                }
                Piece::CallArguments(a) => {
                    assert!(open.is_some(), "arguments outside a call");
                    streamed.last_mut().unwrap().push_str(&a);
                }
                Piece::Call(c) => {
                    if open.take().is_some_and(|id| id == c.id) {
                        assert_eq!(
                            streamed.last().unwrap(),
                            &c.arguments,
                            "the streamed arguments are the call's"
                        );
                    } else {
                        streamed.push(c.arguments.clone());
                    }
                    calls.push(c);
                }
            }
        }
        assert_eq!(p.calls(), calls.len());
        (text, calls, streamed)
    }

    /// Every split of `full` (characters, runs of 5, whole) gives the same text and calls.
    fn dsml_every_split(format: ToolFormat, full: &str, cut: bool) -> (String, Vec<ToolCall>) {
        let (text, calls, _) = run_dsml(format, &[full], cut);
        let chars: Vec<String> = full.chars().map(String::from).collect();
        for pieces in [
            chars.clone(),
            chars.chunks(5).map(|c| c.concat()).collect(),
            chars.chunks(17).map(|c| c.concat()).collect(),
        ] {
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (t, c, _) = run_dsml(format, &refs, cut);
            assert_eq!((&t, &c), (&text, &calls), "{full}");
        }
        (text, calls)
    }

    fn args(c: &ToolCall) -> Value {
        serde_json::from_str(&c.arguments).unwrap_or_else(|e| panic!("{}: {e}", c.arguments))
    }

    const DSML_V4: &str = "I will look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">dir/\"a\" <｜DSML｜invoke name=\"x\"> </｜DSML｜invoke> </｜DSML｜para.txt</｜DSML｜parameter>\n<｜DSML｜parameter name=\"lines\" string=\"false\">[1, 20]</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"list_dir\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

    /// With no tools offered (none known), a whole, well-formed DSML block is the model's text: no
    /// call, no call piece (the peers' phantom calls from requests without tools).
    #[test]
    fn dsml_without_tools_makes_no_calls() {
        for f in [ToolFormat::DeepSeekV32, ToolFormat::DeepSeekV4] {
            let mut p = ToolCallParser::new(f, &[], "x");
            let mut out: Vec<Piece> = DSML_V4.split_inclusive('>').flat_map(|s| p.push(s)).collect();
            out.extend(p.finish(false));
            assert!(out.iter().all(|o| matches!(o, Piece::Text(_))), "{f:?}: {out:?}");
            let text: String =
                out.iter().map(|o| if let Piece::Text(t) = o { t.as_str() } else { "" }).collect();
            assert!(text.contains("invoke name=\"read_file\""), "{f:?}: the block is kept as text: {text}");
            assert_eq!(p.calls(), 0);
        }
    }

    #[test]
    fn dsml_calls_stream_their_arguments_and_agree_in_every_split() {
        let (text, calls) = dsml_every_split(ToolFormat::DeepSeekV4, DSML_V4, false);
        assert_eq!(text, "I will look.", "no markup and no whitespace before the block in the text");
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].name.as_str(), calls[0].id.as_str()), ("read_file", "call_x_0"));
        assert_eq!(
            args(&calls[0]),
            json!({"path": "dir/\"a\" <｜DSML｜invoke name=\"x\"> </｜DSML｜invoke> </｜DSML｜para.txt", "lines": [1, 20]}),
            "quoted markup inside a value is the value's"
        );
        assert_eq!((calls[1].name.as_str(), calls[1].arguments.as_str()), ("list_dir", "{}"));
        // Streamed one character at a time, the string arrives in many fragments, before the call
        // ends, and never with a close tag's start in it.
        let chars: Vec<String> = DSML_V4.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let mut p = ToolCallParser::new(ToolFormat::DeepSeekV4, &tools(), "x");
        let mut fragments = Vec::new();
        for (i, r) in refs.iter().enumerate() {
            for piece in p.push(r) {
                if let Piece::CallArguments(a) = piece {
                    assert!(!a.contains("</｜DSML｜parameter"), "{a}");
                    fragments.push((i, a));
                }
            }
        }
        let path_end = DSML_V4.find("</｜DSML｜parameter>").unwrap();
        let before_end = fragments.iter().filter(|(i, _)| chars[..*i].concat().len() < path_end).count();
        assert!(before_end > 20, "the path's characters go out as they arrive ({before_end} fragments)");
        // V3.2's block name reads in either format.
        let v32 = DSML_V4.replace("tool_calls>", "function_calls>");
        for f in [ToolFormat::DeepSeekV32, ToolFormat::DeepSeekV4] {
            assert_eq!(dsml_every_split(f, &v32, false), (text.clone(), calls.clone()), "{f:?}");
        }
    }

    #[test]
    fn dsml_parameters_are_typed_as_the_model_and_the_schema_say() {
        let call = |params: &str| {
            format!("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n{params}\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
        };
        for (params, want) in [
            // `string="true"`: the raw text, also when it reads as a number.
            ("<｜DSML｜parameter name=\"path\" string=\"true\">42</｜DSML｜parameter>", json!({"path": "42"})),
            ("<｜DSML｜parameter name=\"n\" string=\"false\">42</｜DSML｜parameter>", json!({"n": 42})),
            ("<｜DSML｜parameter name=\"o\" string=\"false\">{\"a\": [true, null]}</｜DSML｜parameter>", json!({"o": {"a": [true, null]}})),
            // Not JSON though said so: kept as a string.
            ("<｜DSML｜parameter name=\"n\" string=\"false\">about 3</｜DSML｜parameter>", json!({"n": "about 3"})),
            // No `string` attribute: the schema says (`path` is a string), else JSON.
            ("<｜DSML｜parameter name=\"path\">7</｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\">7</｜DSML｜parameter>", json!({"path": "7", "n": 7})),
            // A spurious `arguments` wrapper (the function declares none) is unwrapped.
            ("<｜DSML｜parameter name=\"arguments\" string=\"false\">{\"path\": \"a.txt\"}</｜DSML｜parameter>", json!({"path": "a.txt"})),
            ("<｜DSML｜parameter name=\"arguments\" string=\"true\">{}</｜DSML｜parameter>\n<｜DSML｜parameter name=\"path\" string=\"true\">b</｜DSML｜parameter>", json!({"path": "b"})),
            ("<｜DSML｜parameter name=\"arguments\" string=\"true\">plain</｜DSML｜parameter>", json!({"arguments": "plain"})),
            // Only the first thing in a call is taken for a wrapper (a second is a repeated name).
            ("<｜DSML｜parameter name=\"arguments\" string=\"false\">{}</｜DSML｜parameter><｜DSML｜parameter name=\"arguments\" string=\"false\">{\"path\": \"x\"}</｜DSML｜parameter>", json!({})),
            // A second value of a name, and a parameter without one, are dropped.
            ("<｜DSML｜parameter name=\"path\" string=\"true\">a</｜DSML｜parameter><｜DSML｜parameter name=\"path\" string=\"true\">b</｜DSML｜parameter><｜DSML｜parameter string=\"true\">c</｜DSML｜parameter>", json!({"path": "a"})),
        ] {
            let (text, calls) = dsml_every_split(ToolFormat::DeepSeekV4, &call(params), false);
            assert_eq!((text.as_str(), calls.len()), ("", 1), "{params}");
            assert_eq!(args(&calls[0]), want, "{params}");
        }
        // A function that declares `arguments` keeps it.
        let mut t = tools();
        t[1].parameters = json!({"type": "object", "properties": {"arguments": {"type": "object"}}});
        let mut p = ToolCallParser::new(ToolFormat::DeepSeekV4, &t, "x");
        let mut out = p.push("<｜DSML｜invoke name=\"list_dir\">\n<｜DSML｜parameter name=\"arguments\" string=\"false\">{\"a\": 1}</｜DSML｜parameter>\n</｜DSML｜invoke>");
        out.extend(p.finish(false));
        let Some(Piece::Call(c)) = out.last() else { panic!("{out:?}") };
        assert_eq!(args(c), json!({"arguments": {"a": 1}}));
    }

    #[test]
    fn dsml_prose_unknown_functions_and_missing_tags() {
        // The block's start tag missing (as at long context): still calls; the end tag too.
        let (text, calls) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "Sure.\n<｜DSML｜invoke name=\"list_dir\">\n<｜DSML｜parameter name=\"d\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>",
            false,
        );
        assert_eq!((text.as_str(), calls.len(), calls[0].arguments.as_str()), ("Sure.", 1, r#"{"d":"x"}"#));
        // Stopped between parameters (end of sequence): the call as written, closed; stopped inside a
        // value (a stop string, say): its arguments as far as written, not closed (a client must
        // not take a cut value for a whole one).
        let head = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a.t";
        let (_, calls) =
            dsml_every_split(ToolFormat::DeepSeekV4, &format!("{head}</｜DSML｜parameter>\n"), false);
        assert_eq!(calls[0].arguments, r#"{"path":"a.t"}"#);
        let (_, calls) = dsml_every_split(ToolFormat::DeepSeekV4, head, false);
        assert_eq!(calls[0].arguments, r#"{"path":"a.t"#);
        // A known function's head at the very end of prose is prose.
        let prose = "To read it, write <｜DSML｜invoke name=\"read_file\">";
        assert_eq!(dsml_every_split(ToolFormat::DeepSeekV4, prose, false), (prose.to_owned(), vec![]));
        // An unknown call after a known one is text, whole, without the whitespace between them.
        let (text, calls) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "<｜DSML｜invoke name=\"list_dir\">\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"zz\"> y",
            false,
        );
        assert_eq!((text.as_str(), calls.len()), ("<｜DSML｜invoke name=\"zz\"> y", 1));
        // Prose that looks like a call, unknown functions and a block with no call stay text, whole.
        for prose in [
            "Write <｜DSML｜invoke name=\"read_file\"> to read a file.",
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"rm_rf\">\n<｜DSML｜parameter name=\"p\" string=\"true\">/</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "The tag <｜DSML｜tool_calls> opens calls.",
            "a < b, and <｜DSML｜invoked",
            "</｜DSML｜tool_calls> out of place",
        ] {
            let (text, calls) = dsml_every_split(ToolFormat::DeepSeekV4, prose, false);
            assert_eq!((text.as_str(), calls.len()), (prose, 0), "{prose}");
        }
        // Text after the calls is text; whitespace between and after them is not.
        let (text, calls) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"list_dir\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nDone.",
            false,
        );
        assert_eq!((text.as_str(), calls.len()), ("Done.", 1));
        let (text, _) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "<｜DSML｜invoke name=\"list_dir\">\n</｜DSML｜invoke>\n Done. And  more\n\n<｜DSML｜invoke name=\"list_dir\">\n</｜DSML｜invoke>",
            false,
        );
        assert_eq!(text, "Done. And  more");
        // A plain answer keeps its whitespace.
        assert_eq!(dsml_every_split(ToolFormat::DeepSeekV4, "Hi!\n\n", false).0, "Hi!\n\n");
    }

    #[test]
    fn dsml_cut_by_max_tokens() {
        // Cut inside a value: the call with its arguments as far as written (not closed: a client
        // cannot take cut arguments for whole ones); cut before a name is whole: no call, no markup.
        let (text, calls) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "Sure.<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a.t</｜DSML｜para",
            true,
        );
        assert_eq!(
            (text.as_str(), calls.len(), calls[0].arguments.as_str()),
            ("Sure.", 1, r#"{"path":"a.t"#)
        );
        for cut in ["Sure.<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_", "Sure.<｜DSML｜too"] {
            let (text, calls) = dsml_every_split(ToolFormat::DeepSeekV4, cut, true);
            assert_eq!((text.as_str(), calls.len()), ("Sure.", 0), "{cut}");
        }
        let (_, calls) = dsml_every_split(
            ToolFormat::DeepSeekV4,
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"list_dir\">",
            true,
        );
        assert_eq!((calls.len(), calls[0].arguments.as_str()), (1, ""));
    }

    #[test]
    fn dsml_calls_render_and_read_back() {
        for f in [ToolFormat::DeepSeekV32, ToolFormat::DeepSeekV4] {
            let a = json!({"path": "a \"b\"\n<c>", "n": 3, "o": {"k": [1]}});
            let rendered = f.render_call("read_file", &a);
            let (text, calls) = dsml_every_split(f, &rendered, false);
            assert_eq!((text.as_str(), calls.len()), ("", 1), "{rendered}");
            assert_eq!(args(&calls[0]), a);
            let empty = f.render_call("list_dir", &json!({}));
            assert!(empty.contains("\">\n\n</｜DSML｜invoke>"), "{empty}");
            assert_eq!(dsml_every_split(f, &empty, false).1[0].arguments, "{}");
        }
        assert!(ToolFormat::DeepSeekV32
            .render_call("list_dir", &json!({}))
            .starts_with("<｜DSML｜function_calls>\n"));
        assert_eq!(ToolFormat::from_template("x<｜DSML｜function_calls>"), ToolFormat::DeepSeekV32);
        assert_eq!(ToolFormat::from_template("{{ '<｜DSML｜tool_calls>' }}"), ToolFormat::DeepSeekV4);
        assert_eq!(ToolFormat::from_model_type("deepseek_v4"), Some(ToolFormat::DeepSeekV4));
        assert_eq!(ToolFormat::from_name("deepseek_v32"), Some(ToolFormat::DeepSeekV32));
        let g = ToolFormat::DeepSeekV4.forced_call_grammar(&tools(), Some("read_file"), 1);
        assert!(
            g.starts_with(
                "start: \"\\n\\n\"? \"<｜DSML｜tool_calls>\" rest\nrest: \"\\n\" call \"\\n</｜DSML｜tool_calls>\"\n"
            ) && g
                .contains("p0_0: \"<｜DSML｜parameter name=\\\"path\\\" string=\\\"true\\\">\" sval \"\\n\"")
                && g.contains("c0: \"<｜DSML｜invoke name=\\\"read_file\\\">\\n\" p0_0")
                && !g.contains("list_dir"),
            "{g}"
        );
        let g = ToolFormat::DeepSeekV32.forced_call_grammar(&tools(), None, 3);
        assert!(g.contains("(\"\\n\" call){0,2}") && g.contains("gp*") && g.contains("GNAME"), "{g}");
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
