//! Tool calling's vocabulary: the functions a request offers (`Tool`), whether and how the model
//! must call them (`ToolChoice`), and the calls it made (`ToolCall`), with the OpenAI JSON shapes chat
//! templates and answers use. Reading them from a request body is `pdserve-codec`'s; the formats
//! models write calls in, and lifting calls out of a model's text, are `pdserve-engine`'s.

use serde_json::{json, Map, Value};

/// A function the model may call (`tools[i]` with `"type": "function"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (`{"type": "object"}` when the request gives none).
    pub parameters: Value,
    /// `strict: true`: the call's arguments must fit the schema, under `tool_choice: auto` too.
    pub strict: bool,
}

impl Tool {
    /// The OpenAI shape, as chat templates expect it (`tools` in the template's context).
    pub fn to_json(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), json!(self.name));
        if let Some(d) = &self.description {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": f})
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model is not offered the tools and its text is never read as a call.
    None,
    /// The model may answer or call (the default when `tools` are given).
    #[default]
    Auto,
    /// The model must call one or more of the tools (enforced by constrained decoding).
    Required,
    /// The model must call this function (enforced by constrained decoding).
    Function(String),
}

/// One call the model made (`message.tool_calls[i]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON text (an object).
    pub arguments: String,
}

impl ToolCall {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// The streaming delta that carries this whole call as entry `index` of `tool_calls`.
    pub fn delta_json(&self, index: usize) -> Value {
        let mut v = self.to_json();
        v["index"] = json!(index);
        v
    }
}
