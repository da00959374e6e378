//! Reasoning models' thinking: the `<think>` ... `</think>` span a thinking model writes before its
//! answer (Qwen3, QwQ, DeepSeek R1 and V3.1's thinking mode), split from the answer as the text
//! streams, so thinking never reaches the answer's `content` or its tool-call parsing.

/// How a model marks its thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// No thinking: every word is the answer.
    None,
    /// `<think>` ... `</think>` before the answer. The open tag may be the prompt's (DeepSeek R1's
    /// templates end the prompt with it) or the model's own (Qwen3).
    Think,
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

impl ReasoningFormat {
    /// The names `--reasoning-parser` takes (vLLM's, and `none`).
    pub const NAMES: &'static str = "deepseek_r1, qwen3, deepseek_v3, none";

    pub fn from_name(s: &str) -> Option<ReasoningFormat> {
        match s {
            "deepseek_r1" | "qwen3" | "deepseek_v3" | "think" => Some(ReasoningFormat::Think),
            "none" => Some(ReasoningFormat::None),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::None => "none",
            ReasoningFormat::Think => "think",
        }
    }

    /// The format a chat template's model thinks in: `Think` for a template that writes or strips
    /// `<think>` spans.
    pub fn from_template(template: &str) -> ReasoningFormat {
        if template.contains(OPEN) || template.contains(CLOSE) {
            ReasoningFormat::Think
        } else {
            ReasoningFormat::None
        }
    }

    /// Whether an answer to `prompt` (the rendered text) starts inside the thinking: the prompt
    /// ends with an open `<think>` (DeepSeek R1's templates, Qwen3's with thinking forced).
    pub fn prompt_opens_thinking(self, prompt: &str) -> bool {
        self == ReasoningFormat::Think && prompt.trim_end().ends_with(OPEN)
    }
}

/// What the split gives out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    /// Thinking.
    Reasoning(String),
    /// The answer.
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: an opening `<think>` may still come.
    Start,
    Thinking,
    /// Right after `</think>`: the newlines that follow the tag are not the answer's.
    Closed,
    Answer,
}

/// Splits a thinking model's streamed text into thinking and answer. Text that might still be a tag
/// is held until it is known; the split is the same however the text is cut into pieces.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    state: State,
    held: String,
}

impl ReasoningParser {
    /// `thinking`: the answer starts inside the thinking (its prompt opened it).
    pub fn new(thinking: bool) -> ReasoningParser {
        let state = if thinking { State::Thinking } else { State::Start };
        ReasoningParser { state, held: String::new() }
    }

    /// Whether the thinking is over (or never began): what follows is the answer.
    pub fn answering(&self) -> bool {
        matches!(self.state, State::Closed | State::Answer)
    }

    /// Feeds text; returns what is known now.
    pub fn push(&mut self, text: &str) -> Vec<Split> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_owned();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        break; // whitespace, or the tag's start
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => match self.held.find(CLOSE) {
                    Some(at) => {
                        let thought: String = self.held.drain(..at).collect();
                        self.held.drain(..CLOSE.len());
                        push(&mut out, Split::Reasoning(thought));
                        self.state = State::Closed;
                    }
                    None => {
                        let keep = partial_tail(&self.held, CLOSE);
                        let thought: String = self.held.drain(..self.held.len() - keep).collect();
                        push(&mut out, Split::Reasoning(thought));
                        break;
                    }
                },
                State::Closed => {
                    let rest = self.held.trim_start_matches(['\n', '\r']);
                    if rest.is_empty() {
                        self.held.clear();
                        break;
                    }
                    self.held = rest.to_owned();
                    self.state = State::Answer;
                }
                State::Answer => {
                    push(&mut out, Split::Content(std::mem::take(&mut self.held)));
                    break;
                }
            }
        }
        out
    }

    /// The end of the text: what was held, as what it was (an unclosed thinking stays thinking).
    pub fn finish(&mut self) -> Vec<Split> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Thinking => push(&mut out, Split::Reasoning(held)),
            State::Closed => {}
            State::Start | State::Answer => push(&mut out, Split::Content(held)),
        }
        out
    }
}

fn push(out: &mut Vec<Split>, s: Split) {
    let empty = match &s {
        Split::Reasoning(t) | Split::Content(t) => t.is_empty(),
    };
    if !empty {
        out.push(s);
    }
}

/// The longest tail of `text` that is a proper start of `pat`.
fn partial_tail(text: &str, pat: &str) -> usize {
    (1..pat.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && text.ends_with(&pat[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(thinking: bool, pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(thinking);
        let mut out: Vec<Split> = pieces.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for s in out {
            match s {
                Split::Reasoning(t) => r.push_str(&t),
                Split::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    /// Every way of cutting `text` into pieces gives the same split.
    fn every_cut(thinking: bool, text: &str) -> (String, String) {
        let whole = split(thinking, &[text]);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(thinking, &refs), whole, "{text:?} one character at a time");
        for (at, _) in text.char_indices() {
            assert_eq!(split(thinking, &[&text[..at], &text[at..]]), whole, "{text:?} cut at {at}");
        }
        whole
    }

    #[test]
    fn thinking_is_split_from_the_answer_however_the_text_streams() {
        // Qwen3: the model opens its thinking.
        let (r, c) = every_cut(false, "<think>\nThe user greets me.\n</think>\n\nHello!");
        assert_eq!((r.as_str(), c.as_str()), ("\nThe user greets me.\n", "Hello!"));
        // DeepSeek R1: the prompt opened it.
        let (r, c) = every_cut(true, "Two plus two is four.</think>\n\n4");
        assert_eq!((r.as_str(), c.as_str()), ("Two plus two is four.", "4"));
        // No thinking at all: all answer, whitespace and a lone `<` included.
        let (r, c) = every_cut(false, "  a < b, <thin ice");
        assert_eq!((r.as_str(), c.as_str()), ("", "  a < b, <thin ice"));
        // Cut before the thinking closed: it stays thinking.
        let (r, c) = every_cut(false, "<think>still going </thi");
        assert_eq!((r.as_str(), c.as_str()), ("still going </thi", ""));
        // A tag in the answer is the answer's text.
        let (_, c) = every_cut(false, "<think>x</think>Use <think> tags.");
        assert_eq!(c, "Use <think> tags.");
    }

    #[test]
    fn the_format_is_read_from_the_template() {
        let qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}";
        assert_eq!(ReasoningFormat::from_template(qwen3), ReasoningFormat::Think);
        assert_eq!(ReasoningFormat::from_template("{{ messages }}"), ReasoningFormat::None);
        assert!(ReasoningFormat::Think.prompt_opens_thinking("<|Assistant|><think>\n"));
        assert!(
            !ReasoningFormat::Think.prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        );
        assert!(!ReasoningFormat::None.prompt_opens_thinking("<think>\n"));
    }
}
