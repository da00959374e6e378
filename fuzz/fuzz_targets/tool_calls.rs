//! The tool-call parsers agree with themselves whatever the chunking, and DSML answers come back as
//! written. Two modes, by the second byte:
//! - any text, in any format: fed whole and fed in chunks (lengths from the input), the text and
//!   calls are the same, and a call whose arguments streamed has them joined as its `arguments`;
//! - a DSML answer built from the input (prose, then calls whose string values hold quoted markup,
//!   typed values, the block's start tag sometimes left out): the calls parsed are the calls written,
//!   the text is the prose, and no markup reaches the text, in every chunking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_api::tools::{Tool, ToolCall};
use pdserve_chat_template::{Piece, ToolCallParser, ToolFormat};
use serde_json::{json, Value};

const FORMATS: [&str; 7] =
    ["hermes", "llama3", "mistral", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4"];

/// Pieces a string value is made of: plain text, JSON's special characters, and DSML markup (all
/// but the parameter's own close tag, which a raw value cannot hold).
const VALUE_PARTS: [&str; 12] = [
    "a",
    "b c",
    "\"",
    "\\",
    "\n",
    "ü",
    "<",
    ">",
    "<｜DSML｜invoke name=\"list_dir\">",
    "</｜DSML｜invoke>",
    "</｜DSML｜para",
    "<｜DSML｜parameter name=\"x\" string=\"true\">",
];
const PROSE: &[u8] = b"abc xyz.,\n<>\"/{}[]";

fn tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "read_file".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}),
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

/// `text` through a parser in chunks of `sizes` characters (cycled; none: whole): the text, the
/// calls, and whether any text piece held DSML markup.
fn run(format: ToolFormat, text: &str, sizes: &[u8], cut: bool) -> (String, Vec<ToolCall>, bool) {
    let mut p = ToolCallParser::new(format, &tools(), "f");
    let chars: Vec<char> = text.chars().collect();
    let mut pieces = Vec::new();
    let (mut at, mut i) = (0, 0);
    while at < chars.len() {
        let n = if sizes.is_empty() { chars.len() } else { usize::from(sizes[i % sizes.len()] % 16) + 1 };
        let chunk: String = chars[at..(at + n).min(chars.len())].iter().collect();
        pieces.extend(p.push(&chunk));
        at += n;
        i += 1;
    }
    pieces.extend(p.finish(cut));
    let (mut out, mut calls, mut markup) = (String::new(), Vec::new(), false);
    let mut streamed: Option<(String, String)> = None;
    for piece in pieces {
        match piece {
            Piece::Text(t) => {
                assert!(streamed.is_none(), "text inside a streaming call");
                markup |= t.contains("｜DSML｜");
                out.push_str(&t);
            }
            Piece::CallBegin { id, .. } => {
                assert!(streamed.is_none(), "a call began inside another");
                streamed = Some((id, String::new()));
            }
            Piece::CallArguments(a) => streamed.as_mut().expect("arguments outside a call").1.push_str(&a),
            Piece::Call(c) => {
                if let Some((id, args)) = streamed.take() {
                    assert_eq!((&id, &args), (&c.id, &c.arguments), "the streamed arguments are the call's");
                }
                calls.push(c);
            }
        }
    }
    assert!(streamed.is_none(), "a call began and never ended");
    assert_eq!(p.calls(), calls.len());
    (out, calls, markup)
}

/// A DSML answer from `data`: its text, and the prose and calls it holds.
fn dsml_answer(format: ToolFormat, data: &[u8]) -> (String, String, Vec<(String, Value)>) {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next().unwrap_or(0);
    let prose: String = (0..next() % 24).map(|_| PROSE[usize::from(next()) % PROSE.len()] as char).collect();
    let (block, end) = match format {
        ToolFormat::DeepSeekV32 => ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
        _ => ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
    };
    let flags = next();
    let mut calls = Vec::new();
    let mut invokes = Vec::new();
    for _ in 0..next() % 3 + 1 {
        if next() % 2 == 0 {
            invokes.push("<｜DSML｜invoke name=\"list_dir\">\n\n</｜DSML｜invoke>".to_owned());
            calls.push(("list_dir".to_owned(), json!({})));
            continue;
        }
        let path: String =
            (0..next() % 6).map(|_| VALUE_PARTS[usize::from(next()) % VALUE_PARTS.len()]).collect();
        let n = i64::from(next()) - 100;
        let mut params =
            vec![format!("<｜DSML｜parameter name=\"path\" string=\"true\">{path}</｜DSML｜parameter>")];
        let mut args = json!({"path": path});
        if next() % 2 == 0 {
            params.push(format!("<｜DSML｜parameter name=\"n\" string=\"false\">{n}</｜DSML｜parameter>"));
            args["n"] = json!(n);
        }
        invokes
            .push(format!("<｜DSML｜invoke name=\"read_file\">\n{}\n</｜DSML｜invoke>", params.join("\n")));
        calls.push(("read_file".to_owned(), args));
    }
    let start = if flags & 1 == 0 { format!("{block}\n") } else { String::new() };
    let text = format!("{prose}\n\n{start}{}\n{end}", invokes.join("\n"));
    (text, prose.trim_end().to_owned(), calls)
}

fuzz_target!(|data: &[u8]| {
    let [head, mode, rest @ ..] = data else { return };
    let format = ToolFormat::from_name(FORMATS[usize::from(*head) % FORMATS.len()]).expect("a format");
    let cut = head & 0x80 != 0;
    let (sizes, body) = rest.split_at(rest.len().min(8));
    if mode & 1 == 0 {
        let text = String::from_utf8_lossy(body);
        let whole = run(format, &text, &[], cut);
        let chunked = run(format, &text, sizes, cut);
        assert_eq!((&whole.0, &whole.1), (&chunked.0, &chunked.1), "{format:?} {text:?}");
        return;
    }
    let format = if head & 1 == 0 { ToolFormat::DeepSeekV4 } else { ToolFormat::DeepSeekV32 };
    let (text, prose, want) = dsml_answer(format, body);
    for s in [&[][..], sizes] {
        let (out, calls, markup) = run(format, &text, s, false);
        assert!(!markup, "markup in the text: {out:?} of {text:?}");
        assert_eq!(out, prose, "{text:?}");
        let got: Vec<(String, Value)> = calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).expect("whole arguments are JSON")))
            .collect();
        assert_eq!(got, want, "{text:?}");
    }
});
