//! A request's input to token ids: chat messages through the model's template with the request's
//! tools (`TextCodec::render_chat`, shared with the router's prefix routing), text and token ids
//! checked.

use pdserve_api::tools::Tool;

use pdserve_chat_template::ReasoningFormat;
use pdserve_model::{ChatMessage, ModelError, TextCodec};
use serde_json::{Map, Value};

use crate::info::EngineInfo;
use crate::{EngineError, Input};

/// The token ids of `input` (a remote prompt has none here), checked against the vocabulary.
pub(crate) fn tokens(
    codec: &TextCodec,
    info: &EngineInfo,
    input: &Input,
    tools: &[Tool],
    kwargs: &Map<String, Value>,
) -> Result<Vec<u32>, EngineError> {
    let invalid = |e: ModelError| EngineError::InvalidInput { problem: e.to_string() };
    Ok(match input {
        Input::Chat(msgs) => {
            if info.reasoning_format == ReasoningFormat::None
                && msgs.iter().any(|m| m.reasoning_content.is_some())
            {
                // A model that does not think never wrote any: nowhere to put it.
                return Err(EngineError::InvalidInput {
                    problem: "`reasoning_content` in the conversation, but the served model does not think (its chat template has no thinking)".into(),
                });
            }
            let text = codec.render_chat(msgs, tools, info.tool_format, kwargs).map_err(invalid)?;
            codec.encode(&text).map_err(invalid)?
        }
        Input::Text(t) => codec.encode_prompt(t).map_err(invalid)?,
        Input::Tokens(t) => match t.iter().find(|&&x| x as usize >= info.vocab_size) {
            Some(bad) => {
                return Err(EngineError::InvalidInput {
                    problem: format!("token id {bad} is outside the vocabulary of {}", info.vocab_size),
                })
            }
            None => t.clone(),
        },
        Input::Remote(_) => Vec::new(),
    })
}

/// Whether an answer under this template and `kwargs` starts inside the model's thinking (the
/// prompt opens it: DeepSeek R1's templates), read from a one-message render.
pub(crate) fn opens_thinking(
    codec: &TextCodec,
    format: ReasoningFormat,
    kwargs: &Map<String, Value>,
) -> bool {
    let probe = [ChatMessage::new("user", "Hi")];
    format != ReasoningFormat::None
        && codec
            .apply_chat_template_with(&probe, &[], true, kwargs)
            .is_ok_and(|p| format.prompt_opens_thinking(&p))
}
