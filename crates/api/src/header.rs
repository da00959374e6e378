//! Header names every hop reads and writes (lowercase, as the codec compares them without case).

/// The request's id: taken from the client if present, else generated; echoed on every response and
/// forwarded on every hop.
pub const REQUEST_ID: &str = "x-request-id";
/// Milliseconds left until the request's deadline, set by the router and decremented at each hop.
pub const DEADLINE_MS: &str = "x-request-deadline-ms";
/// Seconds to wait before retrying; on every 429 and 503.
pub const RETRY_AFTER: &str = "retry-after";
/// `Bearer KEY` for client API keys and the admin key.
pub const AUTHORIZATION: &str = "authorization";
/// The API key as Anthropic's clients send it.
pub const API_KEY: &str = "x-api-key";
