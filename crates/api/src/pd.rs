//! The prefill/decode handle: what a prefill worker answers, the router forwards without parsing, and a
//! decode worker takes to pull the prompt's KV.
//!
//! The handle names only where the KV is (the prefill worker's transfer address, the transfer and its
//! epoch, the shared KV file on the same host). Everything else the decode worker needs (the prompt's
//! token ids, the first token and its log-probabilities, the prefill timings) travels in the binary
//! exchange between the two workers, not through the router.

use std::net::SocketAddr;

use serde_json::{json, Value};

use crate::ApiError;

/// The member of the prefill worker's answer, and of the decode leg's body, that holds the handle.
pub const HANDLE_FIELD: &str = "pd_transfer";

/// Where a prompt's KV waits for a decode worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdHandle {
    /// The prefill worker's KV transfer address.
    pub addr: SocketAddr,
    pub transfer: u64,
    pub epoch: u32,
    /// The prefill worker's shared KV file, when it keeps one (a decode worker on the same host copies
    /// blocks straight out of it).
    pub shm: Option<String>,
}

impl PdHandle {
    pub fn to_json(&self) -> Value {
        json!({"addr": self.addr.to_string(), "transfer": self.transfer, "epoch": self.epoch, "shm": self.shm})
    }

    /// Reads a handle; errors name the member that is missing or wrong.
    pub fn from_json(v: &Value) -> Result<PdHandle, ApiError> {
        let bad =
            |f: &str| ApiError::invalid(format!("`{HANDLE_FIELD}.{f}` is missing or has the wrong type"));
        Ok(PdHandle {
            addr: v
                .get("addr")
                .and_then(Value::as_str)
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| bad("addr"))?,
            transfer: v.get("transfer").and_then(Value::as_u64).ok_or_else(|| bad("transfer"))?,
            epoch: v
                .get("epoch")
                .and_then(Value::as_u64)
                .and_then(|e| u32::try_from(e).ok())
                .ok_or_else(|| bad("epoch"))?,
            shm: match v.get("shm") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err(bad("shm")),
            },
        })
    }
}

/// The handle's raw JSON bytes in a prefill worker's answer, found without building a tree.
pub fn handle_bytes(prefill_answer: &[u8]) -> Option<&[u8]> {
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        #[serde(borrow, rename = "pd_transfer")]
        handle: &'a serde_json::value::RawValue,
    }
    let a: Answer<'_> = serde_json::from_slice(prefill_answer).ok()?;
    let raw: &serde_json::value::RawValue = a.handle;
    Some(raw.get().as_bytes())
}

/// The decode leg's body: the client's JSON object with the handle added as its first member (the
/// client's bytes are copied, never re-serialized). `None` if `body` is not a JSON object.
pub fn splice_handle(body: &[u8], handle: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + handle.len() + 20);
    out.extend_from_slice(b"{\"");
    out.extend_from_slice(HANDLE_FIELD.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(handle);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_round_trip_and_errors() {
        let h = PdHandle { addr: "127.0.0.1:9000".parse().unwrap(), transfer: 7, epoch: 3, shm: None };
        assert_eq!(PdHandle::from_json(&h.to_json()).unwrap(), h);
        let h2 = PdHandle { shm: Some("/dev/shm/kv".into()), ..h.clone() };
        assert_eq!(PdHandle::from_json(&h2.to_json()).unwrap(), h2);
        let e = PdHandle::from_json(&json!({"addr": "nowhere", "transfer": 1, "epoch": 1})).unwrap_err();
        assert!(e.message.contains("pd_transfer.addr"), "{e}");
        assert!(PdHandle::from_json(&json!({"addr": "127.0.0.1:1", "transfer": 1, "epoch": 1, "shm": 5}))
            .is_err());
    }

    #[test]
    fn splices_and_finds_the_handle() {
        let b = splice_handle(b" {\"a\":1}", br#"{"transfer":7}"#).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["pd_transfer"]["transfer"], 7);
        assert_eq!(v["a"], 1);
        let b = splice_handle(b"{ }", b"1").unwrap();
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["pd_transfer"], 1);
        assert!(splice_handle(b"[]", b"1").is_none());
        let h = handle_bytes(br#"{"pd_transfer":{"transfer":3,"shm":null},"usage":{}}"#).unwrap();
        assert_eq!(h, br#"{"transfer":3,"shm":null}"#);
        assert!(handle_bytes(br#"{"usage":{}}"#).is_none());
    }
}
