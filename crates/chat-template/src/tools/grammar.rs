//! The grammars that hold a model to its call format: forced calls, and `strict` tools under `auto`.

use pdserve_api::tools::Tool;
use serde_json::{json, Value};

use super::dsml::{INVOKE, INVOKE_END, PARAM, PARAM_END};
use super::{ToolFormat, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP};

impl ToolFormat {
    /// The llguidance Lark grammar that makes the model call one of `tools` (or `only`), in this
    /// format: one call to at most `calls_max`, then the end (where the format separates calls with a
    /// newline, one newline may follow the last; the model then chooses between another call and the
    /// end, never forced into a second). Each call's arguments fit its schema.
    pub fn forced_call_grammar(self, tools: &[Tool], only: Option<&str>, calls_max: usize) -> String {
        match self.call_rules(tools, only, calls_max) {
            // (DeepSeek writes a blank line before its DSML block.)
            Some((opener, rules)) if self.dsml_block().is_some() => {
                format!("start: \"\\n\\n\"? {} rest\n{rules}", lit(opener))
            }
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
        let escape = |s: &str| -> String {
            s.chars()
                .map(|c| if "\\.^$|?*+()[]{}/".contains(c) { format!("\\{c}") } else { c.to_string() })
                .collect()
        };
        // Free text holds no opener: for DSML, no call's head either (the parser takes a head without
        // the block's tag for a call).
        let (excluded, prefix) = match self.dsml_block() {
            Some(_) => (
                format!("({}|{})", escape(opener), escape(INVOKE)),
                format!("/(.|\\n)*/ & ~/(.|\\n)*{}(.|\\n)*/", escape(INVOKE)),
            ),
            None => (escape(opener), "/(.|\\n)*/".to_owned()),
        };
        Some(format!(
            "start: FREE | prefix rest\nFREE: /(.|\\n)*/ & ~/(.|\\n)*{excluded}(.|\\n)*/\nprefix[stop={}]: {prefix}\n{rules}",
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
            ToolFormat::DeepSeekV32 | ToolFormat::DeepSeekV4 => {
                let (begin, end) = self.dsml_block().expect("a DSML format");
                Some((begin, dsml_rules(tools, only, calls_max, end, &call["x-guidance"])))
            }
        }
    }
}

/// The longest `maxLength` a DSML string is held to by counting (longer: any length).
const STRING_BOUND_MAX: u64 = 1024;

/// DSML's calls: one rule per function, its declared parameters in order (the required ones
/// always), strings raw up to the close tag (an `enum` of strings as its values), other values as
/// JSON of their schema; a function that declares none takes any parameters.
fn dsml_rules(tools: &[Tool], only: Option<&str>, calls_max: usize, end: &str, compact: &Value) -> String {
    let offered: Vec<&Tool> = tools.iter().filter(|t| only.is_none_or(|n| n == t.name)).collect();
    let more = if calls_max > 1 { format!(" (\"\\n\" call){{0,{}}}", calls_max - 1) } else { String::new() };
    let mut g = format!(
        "rest: \"\\n\" call{more} {}\ncall: {}\n",
        lit(&format!("\n{end}")),
        (0..offered.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(" | ")
    );
    g.push_str(&format!("sval[stop={}]: /(.|\\n)*/\n", lit(PARAM_END)));
    let json_of = |schema: &Value| {
        let mut s = if schema.is_object() { schema.clone() } else { json!({}) };
        s["x-guidance"] = compact.clone();
        s
    };
    let mut any = false;
    for (i, t) in offered.iter().enumerate() {
        let required: Vec<&str> =
            t.parameters["required"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let mut parts = Vec::new();
        match t.parameters.get("properties").and_then(Value::as_object).filter(|p| !p.is_empty()) {
            Some(props) => {
                for (j, (k, schema)) in props.iter().enumerate() {
                    let rule = format!("p{i}_{j}");
                    let open = |string: &str| lit(&format!("{PARAM} name=\"{k}\" string=\"{string}\">"));
                    let strings: Option<Vec<&str>> = schema
                        .get("enum")
                        .and_then(Value::as_array)
                        .and_then(|e| e.iter().map(Value::as_str).collect());
                    let bound = |k: &str| schema.get(k).and_then(Value::as_u64);
                    let body = if schema.get("type").and_then(Value::as_str) == Some("string") {
                        match (strings, bound("minLength"), bound("maxLength")) {
                            (Some(values), ..) if !values.is_empty() => format!(
                                "{} ({})",
                                open("true"),
                                values
                                    .iter()
                                    .map(|v| lit(&format!("{v}{PARAM_END}\n")))
                                    .collect::<Vec<_>>()
                                    .join(" | ")
                            ),
                            // Bounded lengths: characters other than `<` (the close tag's start),
                            // counted.
                            (_, min, Some(max)) if max <= STRING_BOUND_MAX => {
                                g.push_str(&format!(
                                    "S{i}_{j}: /[^<]{{{},{max}}}/\n",
                                    min.unwrap_or(0).min(max)
                                ));
                                format!("{} S{i}_{j} {}", open("true"), lit(&format!("{PARAM_END}\n")))
                            }
                            _ => format!("{} sval \"\\n\"", open("true")),
                        }
                    } else {
                        g.push_str(&format!("v{i}_{j}: %json {}\n", json_of(schema)));
                        format!("{} v{i}_{j} {}", open("false"), lit(&format!("{PARAM_END}\n")))
                    };
                    g.push_str(&format!("{rule}: {body}\n"));
                    parts.push(if required.contains(&k.as_str()) { rule } else { format!("{rule}?") });
                }
            }
            None => {
                any = true;
                parts.push("gp*".to_owned());
            }
        }
        let head = lit(&format!("{INVOKE} name=\"{}\">\n", t.name));
        g.push_str(&format!("c{i}: {head} {} \"\\n\"? {}\n", parts.join(" "), lit(INVOKE_END)));
    }
    if any {
        // Any parameters: a name, then a string or a JSON value.
        g.push_str(&format!(
            "gp: {} GNAME {} (\"true\\\">\" sval | \"false\\\">\" gv {}) \"\\n\"\nGNAME: /[A-Za-z0-9_.\\-]{{1,64}}/\ngv: %json {}\n",
            lit(&format!("{PARAM} name=\"")),
            lit("\" string=\""),
            lit(PARAM_END),
            json_of(&json!({}))
        ));
    }
    g
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
