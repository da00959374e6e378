//! The paths of api.md that every process serves, and the answer for a request no route takes.

use crate::{ApiError, ErrorKind};

pub const HEALTH_LIVE: &str = "/health/live";
pub const HEALTH_READY: &str = "/health/ready";
/// An alias of [`HEALTH_READY`].
pub const HEALTH: &str = "/health";
pub const HEALTH_GENERATE: &str = "/health/generate";
pub const METRICS: &str = "/metrics";
pub const DEBUG_REQUESTS: &str = "/debug/requests";
pub const MODELS: &str = "/v1/models";
pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";
/// Anthropic's Messages API.
pub const MESSAGES: &str = "/v1/messages";
/// OpenAI's Responses API.
pub const RESPONSES: &str = "/v1/responses";
/// Anthropic's token count of a Messages request.
pub const MESSAGES_COUNT_TOKENS: &str = "/v1/messages/count_tokens";
/// Token ids of a prompt or chat (rendered as a chat request would be).
pub const TOKENIZE: &str = "/tokenize";
/// Text of token ids.
pub const DETOKENIZE: &str = "/detokenize";
/// The server's version.
pub const VERSION: &str = "/version";

/// Whether `path` is Anthropic's (`/v1/messages` and under it): its answers, errors included, are in
/// Anthropic's shapes.
pub fn is_anthropic(path: &str) -> bool {
    path == MESSAGES || path.starts_with("/v1/messages/")
}

/// One stored response's path, `/v1/responses/{id}`: the id (`None` for other paths).
pub fn response_id(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/responses/").filter(|id| !id.is_empty() && !id.contains('/'))
}

/// One model's path, `/v1/models/{id}`: the id (`None` for other paths).
pub fn model_id(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/models/").filter(|id| !id.is_empty())
}

/// The paths the router and every worker serve.
pub const SERVED_BY_ALL: [&str; 15] = [
    HEALTH_LIVE,
    HEALTH_READY,
    HEALTH,
    HEALTH_GENERATE,
    METRICS,
    DEBUG_REQUESTS,
    MODELS,
    CHAT,
    COMPLETIONS,
    MESSAGES,
    MESSAGES_COUNT_TOKENS,
    RESPONSES,
    TOKENIZE,
    DETOKENIZE,
    VERSION,
];

/// The answer when no route takes `method` on `path`: 405 `method_not_allowed` for a path the process
/// serves (one of [`SERVED_BY_ALL`] or of its own `also`), 404 `not_found` otherwise.
pub fn no_route(method: &str, path: &str, also: &[&str]) -> ApiError {
    if SERVED_BY_ALL.contains(&path) || also.contains(&path) {
        ApiError::new(ErrorKind::MethodNotAllowed, format!("{method} is not allowed on {path}"))
    } else {
        ApiError::new(ErrorKind::NotFound, format!("no route {method} {path}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_paths_get_405_others_404() {
        assert_eq!(no_route("DELETE", METRICS, &[]).status(), 405);
        assert_eq!(no_route("GET", "/workers", &["/workers"]).status(), 405);
        assert_eq!(no_route("GET", "/nope", &["/workers"]).status(), 404);
    }
}
