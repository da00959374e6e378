//! Reading a request's `tools` and `tool_choice` (OpenAI's shapes; Anthropic's are mapped onto them).

use pdserve_api::tools::{Tool, ToolChoice};
use pdserve_api::ApiError;
use serde_json::{json, Value};

/// Most tools one request may offer.
pub const TOOLS_MAX: usize = 128;

/// Reads `tools` (function tools only).
pub fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let list = v.as_array().ok_or_else(|| ApiError::invalid("`tools` must be an array"))?;
    if list.len() > TOOLS_MAX {
        return Err(ApiError::invalid(format!(
            "`tools` takes at most {TOOLS_MAX} tools, got {}",
            list.len()
        )));
    }
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid(format!("tools[{i}]{what}"));
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => return Err(bad(&format!(".type {other:?} is not supported (only \"function\")"))),
            None => return Err(bad(".type must be \"function\"")),
        }
        let f =
            t.get("function").and_then(Value::as_object).ok_or_else(|| bad(".function must be an object"))?;
        let name =
            f.get("name").and_then(Value::as_str).ok_or_else(|| bad(".function.name must be a string"))?;
        if name.is_empty()
            || name.len() > 64
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(bad(".function.name must be 1-64 letters, digits, underscores or dashes"));
        }
        if out.iter().any(|t| t.name == name) {
            return Err(bad(&format!(".function.name {name:?} is given twice")));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(bad(".function.description must be a string")),
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(bad(".function.parameters must be a JSON schema object")),
        };
        if let Some(s) = f.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
            return Err(bad(&format!(".function.strict must be true or false, got {s}")));
        }
        for k in f.keys() {
            if !matches!(k.as_str(), "name" | "description" | "parameters" | "strict") {
                return Err(bad(&format!(".function has an unrecognized field `{k}`")));
            }
        }
        let strict = f.get("strict").and_then(Value::as_bool).unwrap_or(false);
        out.push(Tool { name: name.to_owned(), description, parameters, strict });
    }
    Ok(out)
}

/// Reads `tool_choice` against the `tools` offered.
pub fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None | Some(Value::Null) => {
            return Ok(if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto })
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(format!(
                "`tool_choice` {other:?} is not one of \"none\", \"auto\", \"required\" or a named function"
            )))
            }
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(format!(
                    "`tool_choice` names {name:?}, which is not in `tools`"
                )));
            }
            ToolChoice::Function(name.to_owned())
        }
        Some(_) => return Err(ApiError::invalid("`tool_choice` must be a string or an object")),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(ApiError::invalid("`tool_choice` requires a call but `tools` is empty"));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(Some(&json!([
            {"type": "function", "function": {"name": "read_file", "description": "Reads a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
            {"type": "function", "function": {"name": "list_dir"}}
        ])))
        .unwrap()
    }

    #[test]
    fn tools_and_tool_choice_are_checked() {
        let t = tools();
        assert_eq!(t[1].parameters, json!({"type": "object"}));
        for (v, want) in [
            (json!({"a": 1}), "`tools` must be an array"),
            (json!([{"type": "retrieval"}]), "tools[0].type \"retrieval\""),
            (json!([{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
            (json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]), "parameters"),
            (json!([{"type": "function", "function": {"name": "f", "params": {}}}]), "`params`"),
        ] {
            assert!(parse_tools(Some(&v)).unwrap_err().message.contains(want), "{v}");
        }
        assert_eq!(parse_tool_choice(None, &t).unwrap(), ToolChoice::Auto);
        assert_eq!(parse_tool_choice(None, &[]).unwrap(), ToolChoice::None);
        let named = json!({"type": "function", "function": {"name": "list_dir"}});
        assert_eq!(parse_tool_choice(Some(&named), &t).unwrap(), ToolChoice::Function("list_dir".into()));
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert!(parse_tool_choice(Some(&unknown), &t).unwrap_err().message.contains("not in `tools`"));
        assert!(parse_tool_choice(Some(&json!("required")), &[]).is_err());
        assert!(parse_tool_choice(Some(&json!("sometimes")), &t).is_err());
    }
}
