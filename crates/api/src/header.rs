//! Header names every hop reads and writes (lowercase, as the codec compares them without case).

/// The request's id: taken from the client if present, else generated; echoed on every response and
/// forwarded on every hop.
pub const REQUEST_ID: &str = "x-request-id";
/// W3C Trace Context: the caller's span (`00-<trace id>-<span id>-<flags>`), passed on every leg.
pub const TRACEPARENT: &str = "traceparent";
/// Milliseconds left until the request's deadline, set by the router and decremented at each hop.
pub const DEADLINE_MS: &str = "x-request-deadline-ms";
/// Seconds to wait before retrying; on every 429 and 503.
pub const RETRY_AFTER: &str = "retry-after";
/// `Bearer KEY` for client API keys and the admin key.
pub const AUTHORIZATION: &str = "authorization";
/// The API key as Anthropic's clients send it.
pub const API_KEY: &str = "x-api-key";
/// The stack's own secret, carried on every request the router sends a worker when the stack has one
/// (`--cluster-secret-file`, or `PDSERVE_CLUSTER_SECRET`): workers refuse requests without it.
pub const CLUSTER_SECRET: &str = "x-pdserve-cluster-secret";

/// On a request from the router: write the stream's resume marks ([`crate::pd::mark`]), so the router
/// can move the request to another worker mid-stream. On the worker's answer: it does.
pub const RESUMABLE: &str = "x-pdserve-resumable";

/// The environment variable that holds the cluster secret when no file names it.
pub const CLUSTER_SECRET_ENV: &str = "PDSERVE_CLUSTER_SECRET";

/// Whether `presented` is `secret`, compared in time that depends on the lengths only (no early exit
/// at the first differing byte).
pub fn secret_matches(presented: Option<&str>, secret: &str) -> bool {
    let Some(p) = presented else { return false };
    let (a, b) = (p.as_bytes(), secret.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

/// The cluster secret: the contents of `file` (surrounding whitespace trimmed), else the environment
/// variable [`CLUSTER_SECRET_ENV`], else none. An empty or unreadable file is an error.
pub fn cluster_secret(file: Option<&std::path::Path>) -> Result<Option<String>, String> {
    match file {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| format!("--cluster-secret-file {}: {e}", f.display()))?;
            let s = text.trim();
            if s.is_empty() {
                return Err(format!("--cluster-secret-file {}: the file is empty", f.display()));
            }
            Ok(Some(s.to_owned()))
        }
        None => {
            Ok(std::env::var(CLUSTER_SECRET_ENV).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_match_only_exactly() {
        assert!(secret_matches(Some("s3cret"), "s3cret"));
        for wrong in [None, Some(""), Some("s3cre"), Some("s3cret!"), Some("S3cret"), Some("s3cre\u{0}")] {
            assert!(!secret_matches(wrong, "s3cret"), "{wrong:?}");
        }
    }
}
