//! Which endpoint a generation came from, and a response's identity: what every dialect's shapes are
//! chosen by. The leaf of the crate: it knows no dialect's shapes.

use pdserve_api::path;

/// Which endpoint a generation came from; it decides the response shapes (see
/// [`crate::full_response`] and the other functions above both dialects).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completion,
    /// `POST /v1/messages` (Anthropic's Messages API; see [`crate::anthropic`])
    Messages,
    /// `POST /v1/responses` (OpenAI's Responses API; see [`crate::responses`])
    Responses,
}

/// How a Messages stream ends when it ends well (its `message_stop` event, framed).
pub const MESSAGES_STREAM_END: &str = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

impl Endpoint {
    pub const CHAT_PATH: &'static str = path::CHAT;
    pub const COMPLETION_PATH: &'static str = path::COMPLETIONS;
    pub const MESSAGES_PATH: &'static str = path::MESSAGES;
    pub const RESPONSES_PATH: &'static str = path::RESPONSES;

    /// The endpoint served at `path`.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            Endpoint::CHAT_PATH => Some(Endpoint::Chat),
            Endpoint::COMPLETION_PATH => Some(Endpoint::Completion),
            Endpoint::MESSAGES_PATH => Some(Endpoint::Messages),
            Endpoint::RESPONSES_PATH => Some(Endpoint::Responses),
            _ => None,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => Endpoint::CHAT_PATH,
            Endpoint::Completion => Endpoint::COMPLETION_PATH,
            Endpoint::Messages => Endpoint::MESSAGES_PATH,
            Endpoint::Responses => Endpoint::RESPONSES_PATH,
        }
    }

    /// The response `id` of request `request_id`, the same whichever process answers.
    pub fn response_id(self, request_id: &str) -> String {
        match self {
            Endpoint::Chat => format!("chatcmpl-{request_id}"),
            Endpoint::Completion => format!("cmpl-{request_id}"),
            Endpoint::Messages => format!("msg_{request_id}"),
            Endpoint::Responses => format!("resp_{request_id}"),
        }
    }

    /// How a stream from this endpoint ends when it ends well (a Responses stream ends with its
    /// last event, whose data varies: see [`Endpoint::stream_ended`]).
    pub fn stream_end(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Completion => "data: [DONE]\n\n",
            Endpoint::Messages => MESSAGES_STREAM_END,
            Endpoint::Responses => "\"type\":\"response.completed\"}\n\n",
        }
    }

    /// Whether a stream whose last bytes are `tail` ended well: the router reads it to tell a
    /// finished stream from a cut one.
    pub fn stream_ended(self, tail: &[u8]) -> bool {
        match self {
            Endpoint::Responses => crate::responses::ended(tail),
            _ => tail.ends_with(self.stream_end().as_bytes()),
        }
    }

    /// The `object` word of a response or stream chunk.
    pub(crate) fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
            (Endpoint::Messages, _) => "message",
            (Endpoint::Responses, _) => "response",
        }
    }
}

/// The identity of a response: id, creation time, model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub endpoint: Endpoint,
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
}

/// One server-sent event, framed (`data` is one line: compact JSON or `[DONE]`).
pub fn sse(event: Option<&str>, data: &str) -> String {
    match event {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}
