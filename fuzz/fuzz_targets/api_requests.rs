//! Arbitrary bytes never panic the request parsers (chat, completions, Messages, Responses, tokenize,
//! detokenize), and the tool-call parser gives the same calls and text however the model's text is
//! split: with no call found, the text comes back byte for byte (a broken call is text, never lost);
//! cut by `max_tokens`, at most markup at its end is dropped.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_chat_template::{Piece, ToolCallParser, ToolFormat};
use pdserve_codec::openai::{parse_detokenize, parse_tokenize, parse_tools};
use pdserve_codec::{parse_generate, Endpoint};
use serde_json::json;

fn run(format: ToolFormat, pieces: &[&str], cut: bool) -> (String, Vec<(String, String)>) {
    let tools = parse_tools(Some(&json!([
        {"type": "function", "function": {"name": "read_file"}},
        {"type": "function", "function": {"name": "ls"}}
    ])))
    .unwrap();
    let mut p = ToolCallParser::new(format, &tools, "f");
    let mut out: Vec<Piece> = pieces.iter().flat_map(|s| p.push(s)).collect();
    out.extend(p.finish(cut));
    let (mut text, mut calls) = (String::new(), Vec::new());
    for piece in out {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            Piece::Call(c) => calls.push((c.name, c.arguments)),
            // (A streamed call's head and pieces; the whole call follows.)
            Piece::CallBegin { .. } | Piece::CallArguments(_) => {}
        }
    }
    (text, calls)
}

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else { return };
    let _ = parse_generate(Endpoint::Chat, rest);
    let _ = parse_generate(Endpoint::Completion, rest);
    let _ = parse_generate(Endpoint::Messages, rest);
    let _ = parse_generate(Endpoint::Responses, rest);
    let previous = |_: &str| Some(vec![json!({"role": "user", "content": "earlier"})]);
    let _ = pdserve_codec::responses::read(rest, &previous, true);
    let _ = parse_tokenize(rest);
    let _ = parse_detokenize(rest);

    let Ok(text) = std::str::from_utf8(rest) else { return };
    let formats = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::DeepSeekV3,
        ToolFormat::DeepSeekV31,
    ];
    let format = formats[usize::from(head) % formats.len()];
    let mut cut = (usize::from(head) / formats.len()).min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    for max_tokens_cut in [false, true] {
        let whole = run(format, &[text], max_tokens_cut);
        let split = run(format, &[&text[..cut], &text[cut..]], max_tokens_cut);
        let one_by_one = run(format, &chars.iter().map(String::as_str).collect::<Vec<_>>(), max_tokens_cut);
        assert_eq!(whole, split, "split at {cut}");
        assert_eq!(whole, one_by_one, "fed one character at a time");
        if max_tokens_cut {
            // Cut: the text is the answer's start (markup cut at its end is dropped), and the
            // call the cut fell in may have partial arguments.
            if whole.1.is_empty() {
                assert!(text.starts_with(&whole.0), "cut: {:?} is not the start of the text", whole.0);
            }
            continue;
        }
        if whole.1.is_empty() {
            assert_eq!(whole.0, text, "with no call, the text comes back whole");
        }
        for (_, arguments) in &whole.1 {
            assert!(serde_json::from_str::<serde_json::Value>(arguments).is_ok_and(|v| v.is_object()));
        }
    }
});
