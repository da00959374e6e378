//! The health answers of api.md: `GET /health/live`, `/health/ready` (alias `/health`) and
//! `/health/generate`, the same shapes from the router and every worker.

use serde_json::{json, Map, Value};

/// One health answer. A process adds what it knows about itself to `Ready` and `Generated` as
/// `details` (a JSON object; other values are ignored).
#[derive(Debug, Clone, PartialEq)]
pub enum Health {
    /// `/health/live`: the loop runs.
    Live,
    /// `/health/ready`: a path that has proven itself recently (the router), or an engine that ticks
    /// and emits tokens (a worker).
    Ready { details: Value },
    /// `/health/ready`: not ready, and why.
    NotReady { reason: String },
    /// `/health/generate`: a real one-token request went through in `latency_ms`.
    Generated { latency_ms: u64, details: Value },
    /// `/health/generate`: the request did not go through, and why.
    GenerateFailed { reason: String },
}

impl Health {
    /// 200 for `Live`, `Ready` and `Generated`; 503 (with `Retry-After`) otherwise.
    pub fn status(&self) -> u16 {
        match self {
            Health::Live | Health::Ready { .. } | Health::Generated { .. } => 200,
            Health::NotReady { .. } | Health::GenerateFailed { .. } => 503,
        }
    }

    /// The `status` word of the body.
    pub fn word(&self) -> &'static str {
        match self {
            Health::Live => "live",
            Health::Ready { .. } => "ready",
            Health::NotReady { .. } => "not_ready",
            Health::Generated { .. } => "ok",
            Health::GenerateFailed { .. } => "failed",
        }
    }

    /// The JSON body: `{"status": word, ...}` with the reason or the details.
    pub fn to_json(&self) -> Value {
        let mut body = Map::new();
        body.insert("status".into(), json!(self.word()));
        let extend = |body: &mut Map<String, Value>, details: &Value| {
            if let Some(d) = details.as_object() {
                body.extend(d.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        };
        match self {
            Health::Live => {}
            Health::Ready { details } => extend(&mut body, details),
            Health::Generated { latency_ms, details } => {
                body.insert("latency_ms".into(), json!(latency_ms));
                extend(&mut body, details);
            }
            Health::NotReady { reason } | Health::GenerateFailed { reason } => {
                body.insert("reason".into(), json!(reason));
            }
        }
        Value::Object(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_of_api_md() {
        let ready = Health::Ready { details: json!({"workers": 2}) };
        assert_eq!((ready.status(), ready.to_json()), (200, json!({"status": "ready", "workers": 2})));
        let not = Health::NotReady { reason: "no path".into() };
        assert_eq!((not.status(), not.to_json()), (503, json!({"status": "not_ready", "reason": "no path"})));
        let ok = Health::Generated { latency_ms: 12, details: Value::Null };
        assert_eq!(ok.to_json(), json!({"status": "ok", "latency_ms": 12}));
        assert_eq!(Health::GenerateFailed { reason: "x".into() }.status(), 503);
        assert_eq!(Health::Live.to_json(), json!({"status": "live"}));
    }
}
