//! Constrained decoding: a request whose output must match a JSON schema, a regex, a list of choices
//! or a grammar (`response_format`, the guided fields, a required tool call) gets an llguidance
//! matcher. A compiling thread builds it for the text thread ([`Compiler`]; a malformed or
//! unsatisfiable constraint, or one not compiled in time, is the request's `400`, before it reaches
//! the engine thread); the engine thread computes each step's token mask on a
//! second thread while the forward pass runs, masks the logits, and feeds the sampled token back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use pdserve_api::generation::Constraint;
use serde_json::{json, Value};

/// The longest run of whitespace a schema's JSON may hold between two tokens where the schema asks
/// for flexible whitespace: a model that favours whitespace once a constraint masks its choice would
/// otherwise pad until `max_tokens` (vLLM #38696, #45012).
const JSON_WHITESPACE_RUN_MAX: usize = 16;

/// How JSON is written under a schema: on one line, with Python's separators; or, where the schema
/// brings its own `x-guidance` options, as they say (llguidance's defaults for the rest), whitespace
/// runs bounded all the same unless they give a pattern of their own. `oneOf` is taken as `anyOf`, as
/// other servers' grammar engines take it.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        let options = match o.get("x-guidance").and_then(Value::as_object) {
            None => json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ",
                           "coerce_one_of": true}),
            Some(theirs) => {
                let mut options = serde_json::Map::new();
                options.insert("coerce_one_of".into(), Value::Bool(true));
                options.extend(theirs.iter().map(|(k, v)| (k.clone(), v.clone())));
                let flexible = options.get("whitespace_flexible").and_then(Value::as_bool).unwrap_or(true);
                if flexible && options.get("whitespace_pattern").is_none_or(Value::is_null) {
                    let bounded = format!(r"[\x20\x0A\x0D\x09]{{1,{JSON_WHITESPACE_RUN_MAX}}}");
                    options.insert("whitespace_pattern".into(), Value::String(bounded));
                }
                Value::Object(options)
            }
        };
        o.insert("x-guidance".into(), options);
    }
    schema
}

/// The vocabulary as llguidance sees it, built once per engine.
pub(crate) struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// From `tokenizer.json`'s text; `vocab_size` is the model's (its logits' length), `eos` the token
    /// that ends a finished constraint.
    pub(crate) fn new(tokenizer_json: &str, vocab_size: usize, eos: u32) -> Result<Grammars, String> {
        let v: Value = serde_json::from_str(tokenizer_json).map_err(|e| e.to_string())?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&v).map_err(|e| e.to_string())?;
        words.resize(vocab_size.max(words.len()), Vec::new());
        let info = TokRxInfo::new(words.len() as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        // A client's 400 names what is wrong, not the parser's state and grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(Grammars { factory })
    }

    /// A fresh matcher for `c`, or what is wrong with it.
    pub(crate) fn matcher(&self, c: &Constraint) -> Result<Guide, String> {
        let grammar = match c {
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Constraint::Choice(list) => {
                let alts: Vec<String> = list.iter().map(|s| Value::String(s.clone()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let mut m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        // A constraint nothing can satisfy: no token is allowed at the start, and it is not finished.
        let mask = m.compute_mask().map_err(|e| e.to_string())?;
        if mask.is_zero() && !m.is_accepting().unwrap_or(false) {
            return Err("no output can satisfy it".into());
        }
        m.reset().map_err(|e| e.to_string())?;
        Ok(Guide(m))
    }
}

/// A constraint to compile for request `id`, whose own deadline is `deadline` (a job still queued
/// then is not compiled).
#[derive(Debug)]
pub(crate) struct CompileJob {
    pub id: u64,
    pub constraint: Constraint,
    pub deadline: Instant,
    /// Set when nobody waits for the result any more (the request was aborted, timed out or
    /// ended): a job still queued is then skipped.
    pub cancel: Arc<std::sync::atomic::AtomicBool>,
}

/// What the compiling threads tell the text thread.
#[derive(Debug)]
pub(crate) enum Compile {
    /// Request `id`'s compile began (the time bound runs from here: waiting for a thread is load,
    /// not the constraint's cost).
    Started { id: u64, at: Instant },
    /// Request `id`'s constraint compiled (or what is wrong with it), in `took`.
    Done { id: u64, guide: Result<Box<Guide>, String>, took: Duration },
}

/// A compiling thread's stack. llguidance's compiler recurses over the grammar, about 4 KiB a
/// level: 8,000 required properties (540 kB of schema, well under a worker's 4 MiB body limit)
/// overflow a default 2 MiB thread stack, which aborts the whole process. Only the pages touched are
/// ever committed, and the grammar size limit (about 20,000 such properties) stays far below this.
const COMPILE_STACK_BYTES: usize = 256 << 20;

/// The compiling threads' niceness: on a machine whose cores the engine's steps keep busy, a heavy
/// compile takes what the steps leave, so the requests already streaming keep their pace (a compile
/// past the time bound is a 400 for its own request).
const COMPILE_NICE: i32 = 10;

/// Compiles constraints on threads of their own, so a schema that takes long to compile delays its
/// own request only: the text thread, which turns every request's tokens into text, never waits on
/// one. llguidance bounds a compile's work (lexer fuel, grammar size); the text thread bounds its
/// time (`EngineConfig::grammar_compile_timeout`, from the compile's start) and answers a compile
/// past it with a 400, which a late result no longer changes.
#[derive(Debug)]
pub(crate) struct Compiler {
    jobs: Sender<CompileJob>,
    /// Starts and results, in order; the text thread selects on it.
    pub done: Receiver<Compile>,
}

impl Compiler {
    /// `threads` compiling threads, and `queue` jobs waiting at most.
    pub(crate) fn start(grammars: Arc<Grammars>, threads: usize, queue: usize) -> std::io::Result<Compiler> {
        let (jobs, rx) = crossbeam_channel::bounded::<CompileJob>(queue);
        let (tx, done) = crossbeam_channel::bounded(2 * (queue + threads));
        for i in 0..threads.max(1) {
            let (rx, tx, grammars) = (rx.clone(), tx.clone(), Arc::clone(&grammars));
            let thread = std::thread::Builder::new().name(format!("engine-grammar-{i}"));
            thread.stack_size(COMPILE_STACK_BYTES).spawn(move || {
                crate::sys::lower_this_threads_priority(COMPILE_NICE);
                // Ends when the text thread drops its side.
                for job in rx {
                    let at = Instant::now();
                    if at >= job.deadline || job.cancel.load(std::sync::atomic::Ordering::Relaxed) {
                        continue; // the request ended while it waited here
                    }
                    if tx.send(Compile::Started { id: job.id, at }).is_err() {
                        return;
                    }
                    let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        grammars.matcher(&job.constraint).map(Box::new)
                    }));
                    let guide = compiled.unwrap_or_else(|p| {
                        Err(format!("the grammar compiler failed: {}", crate::core::panic_text(&p)))
                    });
                    if tx.send(Compile::Done { id: job.id, guide, took: at.elapsed() }).is_err() {
                        return;
                    }
                }
            })?;
        }
        Ok(Compiler { jobs, done })
    }

    /// Queues `job`; `false` when the queue is full.
    pub(crate) fn submit(&self, job: CompileJob) -> bool {
        self.jobs.try_send(job).is_ok()
    }

    /// Jobs the queue holds at most.
    pub(crate) fn capacity(&self) -> usize {
        self.jobs.capacity().unwrap_or(0)
    }
}

/// One request's output constraint: an llguidance matcher, compiled off the text thread.
pub struct Guide(Matcher);

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl Guide {
    /// The tokens allowed next (only the end-of-sequence token once the constraint is complete).
    pub(crate) fn mask(&mut self) -> Result<SimpleVob, String> {
        self.0.compute_mask_or_eos().map_err(|e| e.to_string())
    }

    /// Takes the sampled token. An end-of-sequence token needs no feeding.
    pub(crate) fn accept(&mut self, token: u32) -> Result<(), String> {
        self.0.consume_token(token).map_err(|e| e.to_string())
    }

    /// How many of `tokens` (in order, from the output so far) the constraint allows, without
    /// taking them.
    pub(crate) fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.0.validate_tokens(tokens).unwrap_or(0)
    }

    /// The masks after each of `drafts` (the first: before any), the constraint left where it was
    /// (the drafts are taken by a copy: a draft may end the constraint, the end-of-sequence token
    /// among them, and an ended matcher cannot step back).
    pub(crate) fn masks_along(&mut self, drafts: &[u32]) -> Vec<Result<SimpleVob, String>> {
        let mut out = vec![self.mask()];
        if drafts.is_empty() {
            return out;
        }
        let mut ahead = Guide(self.0.deep_clone());
        for &d in drafts {
            // A draft the matcher does not take ends the constraint (end of sequence): verification
            // stops at it, so no row after it is sampled.
            if ahead.accept(d).is_err() {
                break;
            }
            out.push(ahead.mask());
        }
        out
    }

    /// Whether the output so far is a complete match (end-of-sequence is allowed).
    pub(crate) fn is_accepting(&mut self) -> bool {
        self.0.is_accepting().unwrap_or(false)
    }
}

/// Sets every logit outside `mask` to minus infinity.
pub(crate) fn apply_mask(logits: &mut [f32], mask: &SimpleVob) {
    for (t, l) in logits.iter_mut().enumerate() {
        if t >= mask.len() || !mask.is_allowed(t as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_api::tools::Tool;
    use pdserve_chat_template::ToolFormat;

    /// A byte-level vocabulary of the 256 bytes (GPT-2's byte-to-character mapping), token id = byte,
    /// and an end-of-sequence token 256: every text is a token sequence.
    fn byte_tokenizer() -> String {
        let printable =
            |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let mut extra = 0;
        let mut vocab = serde_json::Map::new();
        for b in 0..256u32 {
            let c = if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            };
            vocab.insert(c.to_string(), json!(b));
        }
        json!({"model": {"type": "BPE", "vocab": vocab, "merges": []},
               "decoder": {"type": "ByteLevel"},
               "added_tokens": [{"id": 256, "content": "<eos>", "special": true}]})
        .to_string()
    }

    /// Every format's forced-call grammar compiles and accepts a call as the format writes it, token
    /// by token, to the end.
    #[test]
    fn forced_call_grammars_accept_the_calls_their_format_writes() {
        let g = Grammars::new(&byte_tokenizer(), 257, 256).unwrap();
        let tools = [
            Tool {
                name: "read_file".into(),
                description: None,
                parameters: json!({"type": "object",
                "properties": {"path": {"type": "string"}}, "required": ["path"]}),
                strict: false,
            },
            Tool {
                name: "ls".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: false,
            },
        ];
        // (The grammars keep JSON compact with a space after each separator.)
        let args = r#"{"path": "a.txt"}"#;
        for (f, call) in [
            (ToolFormat::Hermes, format!("<tool_call>\n{{\"name\": \"read_file\", \"arguments\": {args}}}\n</tool_call>")),
            (ToolFormat::Mistral, format!("[TOOL_CALLS][{{\"name\": \"read_file\", \"arguments\": {args}}}]")),
            (
                ToolFormat::DeepSeekV3,
                format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            ),
            (
                ToolFormat::DeepSeekV31,
                format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            ),
            (
                ToolFormat::DeepSeekV4,
                "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a <b> \"c\".txt</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>".into(),
            ),
            (
                ToolFormat::DeepSeekV32,
                "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"ls\">\n<｜DSML｜parameter name=\"depth\" string=\"false\">{\"max\": 2}</｜DSML｜parameter>\n<｜DSML｜parameter name=\"dir\" string=\"true\">src</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>".into(),
            ),
        ] {
            let mut m = g.matcher(&Constraint::Lark(f.forced_call_grammar(&tools, None, 1))).unwrap();
            feed(&mut m, &call, f);
            assert!(m.is_accepting(), "{f:?}: {call} is not a whole call");
        }
        // DSML: declared parameters in order, typed as declared (a string raw, an integer as JSON,
        // an enum as one of its values); the required ones cannot be left out.
        let typed = [Tool {
            name: "grep".into(),
            description: None,
            parameters: json!({"type": "object", "required": ["pattern", "max"],
                "properties": {"max": {"type": "integer"}, "mode": {"type": "string", "enum": ["fast", "exact"]},
                               "pattern": {"type": "string"}}}),
            strict: true,
        }];
        let grammar = Constraint::Lark(ToolFormat::DeepSeekV4.forced_call_grammar(&typed, Some("grep"), 1));
        let head = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"grep\">\n";
        let call = format!("{head}<｜DSML｜parameter name=\"max\" string=\"false\">12</｜DSML｜parameter>\n<｜DSML｜parameter name=\"mode\" string=\"true\">exact</｜DSML｜parameter>\n<｜DSML｜parameter name=\"pattern\" string=\"true\">fn [a-z]+</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
        let mut m = g.matcher(&grammar).unwrap();
        feed(&mut m, &call, ToolFormat::DeepSeekV4);
        assert!(m.is_accepting(), "{call}");
        for (ok, bad) in [
            (format!("{head}<｜DSML｜parameter name=\"max\" string=\"false\">"), b'x'),
            (format!("{head}<｜DSML｜parameter name=\"max\" string=\"false\">1</｜DSML｜parameter>\n<｜DSML｜parameter name=\"mode\" string=\"true\">"), b's'),
            (format!("{head}<｜DSML｜parameter name=\"max\" string=\"false\">1</｜DSML｜parameter>\n<"), b'/'),
        ] {
            let mut m = g.matcher(&grammar).unwrap();
            feed(&mut m, &ok, ToolFormat::DeepSeekV4);
            assert!(!m.mask().unwrap().is_allowed(u32::from(bad)), "{ok:?} then {:?} was allowed", bad as char);
        }
        // Hermes with parallel calls: after a call and its newline the model may end (it is never
        // forced into a second call), or call again up to the limit, and no further.
        let call = "<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>";
        let hermes = Constraint::Lark(ToolFormat::Hermes.forced_call_grammar(&tools, None, 2));
        let mut m = g.matcher(&hermes).unwrap();
        feed(&mut m, &format!("{call}\n"), ToolFormat::Hermes);
        assert!(
            m.is_accepting()
                && m.mask().unwrap().is_allowed(256)
                && m.mask().unwrap().is_allowed(u32::from(b'<'))
        );
        feed(&mut m, call, ToolFormat::Hermes);
        assert!(m.is_accepting());
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(u32::from(b'\n')));
        m.accept(u32::from(b'\n')).unwrap();
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(256) && !mask.is_allowed(u32::from(b'<')), "a third call is refused");
    }

    /// `strict` tools under `auto`: free text is the model's, and once it writes the format's opener
    /// the calls must fit their schemas.
    #[test]
    fn auto_call_grammars_take_hold_at_the_opener() {
        let g = Grammars::new(&byte_tokenizer(), 257, 256).unwrap();
        let tools = [Tool {
            name: "read_file".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
            strict: true,
        }];
        let args = r#"{"path": "a.txt"}"#;
        for (f, call, bad) in [
            (
                ToolFormat::Hermes,
                format!("<tool_call>\n{{\"name\": \"read_file\", \"arguments\": {args}}}\n</tool_call>"),
                "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"file\"",
            ),
            (
                ToolFormat::Mistral,
                format!("[TOOL_CALLS][{{\"name\": \"read_file\", \"arguments\": {args}}}]"),
                "[TOOL_CALLS][{\"name\": \"rm\"",
            ),
            (
                ToolFormat::DeepSeekV31,
                format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm",
            ),
            (
                ToolFormat::DeepSeekV4,
                "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>".into(),
                "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"rm",
            ),
        ] {
            let grammar = Constraint::Lark(f.auto_call_grammar(&tools, 8).unwrap());
            let mut m = g.matcher(&grammar).unwrap();
            feed(&mut m, "Sure, a < b and [x] is fine.", f);
            assert!(m.is_accepting(), "{f:?}: free text is a whole answer");
            feed(&mut m, &format!(" Reading it.\n{call}"), f);
            assert!(m.is_accepting(), "{f:?}: text then a call");
            let mut m = g.matcher(&grammar).unwrap();
            let mut refused = false;
            for b in bad.bytes() {
                if !m.mask().unwrap().is_allowed(u32::from(b)) {
                    refused = true;
                    break;
                }
                m.accept(u32::from(b)).unwrap();
            }
            assert!(refused, "{f:?}: {bad:?} was allowed");
        }
        // DSML: a call's head without the block's tag is no free text either (the parser would take
        // it for a call, unchecked), and a forced call may open with DeepSeek's blank line.
        let grammar = Constraint::Lark(ToolFormat::DeepSeekV4.auto_call_grammar(&tools, 8).unwrap());
        let mut m = g.matcher(&grammar).unwrap();
        feed(&mut m, "Sure. <｜DSML｜invok", ToolFormat::DeepSeekV4);
        assert!(!m.mask().unwrap().is_allowed(u32::from(b'e')), "a bare head was allowed as free text");
        let forced = Constraint::Lark(ToolFormat::DeepSeekV4.forced_call_grammar(&tools, None, 1));
        let mut m = g.matcher(&forced).unwrap();
        feed(&mut m, "\n\n<｜DSML｜tool_calls>\n", ToolFormat::DeepSeekV4);
    }

    /// Drafts are checked and masked on the side: the guide stays where it was, also when a draft
    /// ends the constraint (the end-of-sequence token, which prompt-lookup drafts from the prompt's
    /// turns).
    #[test]
    fn masks_along_drafts_leave_the_guide_where_it_was() {
        let g = Grammars::new(&byte_tokenizer(), 257, 256).unwrap();
        let mut m = g.matcher(&Constraint::Lark("start: \"ab\"\n".into())).unwrap();
        let drafts = [u32::from(b'a'), u32::from(b'b'), 256];
        let valid = m.valid_prefix(&drafts);
        let masks = m.masks_along(&drafts[..valid]);
        assert_eq!((valid, masks.len()), (3, 3), "a mask for each row up to the end-of-sequence draft's");
        assert!(masks.iter().all(Result::is_ok), "{masks:?}");
        assert!(masks[1].as_ref().unwrap().is_allowed(u32::from(b'b')));
        assert!(m.mask().unwrap().is_allowed(u32::from(b'a')), "the guide moved");
        feed(&mut m, "ab", ToolFormat::Hermes);
        assert!(m.is_accepting());
    }

    /// A schema asking for flexible whitespace gets runs of at most `JSON_WHITESPACE_RUN_MAX`
    /// between tokens (a model that favours whitespace cannot pad to `max_tokens`), and `oneOf`
    /// compiles (as `anyOf`).
    #[test]
    fn flexible_whitespace_is_bounded_and_one_of_compiles() {
        let g = Grammars::new(&byte_tokenizer(), 257, 256).unwrap();
        let schema = json!({"type": "object", "required": ["a"],
            "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "string"}]}},
            "x-guidance": {"whitespace_flexible": true}});
        let mut m = g.matcher(&Constraint::JsonSchema(schema)).unwrap();
        feed(&mut m, "{\"a\":", ToolFormat::Hermes);
        for i in 0..JSON_WHITESPACE_RUN_MAX {
            assert!(m.mask().unwrap().is_allowed(u32::from(b' ')), "space {i} refused");
            m.accept(u32::from(b' ')).unwrap();
        }
        assert!(!m.mask().unwrap().is_allowed(u32::from(b' ')), "a run past the bound was allowed");
        feed(&mut m, "\"x\"}", ToolFormat::Hermes);
        assert!(m.is_accepting());
        // Without options of its own a schema's JSON is compact: no run at all.
        let mut m = g
            .matcher(&Constraint::JsonSchema(json!({"type": "array", "items": {"type": "integer"}})))
            .unwrap();
        feed(&mut m, "[1,", ToolFormat::Hermes);
        assert!(m.mask().unwrap().is_allowed(u32::from(b' ')));
        m.accept(u32::from(b' ')).unwrap();
        assert!(!m.mask().unwrap().is_allowed(u32::from(b' ')));
    }

    /// A schema large enough to overflow a default thread stack while it compiles (which aborts the
    /// whole process) compiles on the compiling threads, and their news comes in order.
    #[test]
    fn a_schema_that_overflows_a_default_stack_compiles_on_the_compiler() {
        let compiler =
            Compiler::start(Arc::new(Grammars::new(&byte_tokenizer(), 257, 256).unwrap()), 1, 4).unwrap();
        let n = 8_000;
        let props: serde_json::Map<String, Value> = (0..n)
            .map(|i| (format!("p{i}"), json!({"type": "string", "pattern": "[a-z]{1,40}(x|y){3,9}"})))
            .collect();
        let required: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
        let schema = json!({"type": "object", "properties": props, "required": required});
        let deadline = Instant::now() + Duration::from_secs(120);
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let job =
            |id, constraint, deadline| CompileJob { id, constraint, deadline, cancel: Arc::clone(&cancel) };
        assert!(compiler.submit(job(7, Constraint::JsonSchema(schema), deadline)));
        let news = |c: &Compiler| c.done.recv_timeout(Duration::from_secs(120)).unwrap();
        assert!(matches!(news(&compiler), Compile::Started { id: 7, .. }));
        match news(&compiler) {
            Compile::Done { id: 7, guide: Ok(_), .. } => {}
            other => panic!("{other:?}"),
        }
        // A job whose request ended while it queued, or that nobody waits for any more, is not
        // compiled.
        assert!(compiler.submit(job(8, Constraint::Regex("a".into()), Instant::now())));
        let cancelled = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let c = Constraint::Regex("b".into());
        assert!(compiler.submit(CompileJob { id: 10, constraint: c, deadline, cancel: cancelled }));
        assert!(compiler.submit(job(9, Constraint::Regex("(".into()), deadline)));
        assert!(matches!(news(&compiler), Compile::Started { id: 9, .. }));
        assert!(matches!(news(&compiler), Compile::Done { id: 9, guide: Err(_), .. }));
    }

    /// Feeds `text` byte by byte, each byte allowed by the mask before it.
    fn feed(m: &mut Guide, text: &str, f: ToolFormat) {
        for b in text.bytes() {
            let mask = m.mask().unwrap();
            assert!(mask.is_allowed(u32::from(b)), "{f:?}: {text:?} refused at byte {:?}", b as char);
            m.accept(u32::from(b)).unwrap();
        }
    }
}
