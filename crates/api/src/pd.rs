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
    /// The prefill worker's KV region as UCX exports it (`ucx:` and the hex of its worker address,
    /// memory key, base and length), when it transfers over UCX: a decode worker with UCX reads its
    /// blocks with one-sided gets.
    pub ucx: Option<String>,
    /// In a stack with a cluster secret: HMAC-SHA256 under the secret of every field above (hex),
    /// computed by the prefill worker that made the handle; a decode worker takes a handle only when
    /// it verifies, so no one without the secret can point it at an address of their choosing.
    pub tag: Option<String>,
    /// The W3C `traceparent` of the prefill request's span (or the one its caller sent, where the
    /// prefill worker exports no spans): a decode worker called without a `traceparent` of its own
    /// joins that trace, so the trace crosses the KV transfer even with no router between the two.
    /// Not under the tag: it names a trace, never an address.
    pub traceparent: Option<String>,
}

impl PdHandle {
    pub fn to_json(&self) -> Value {
        let mut v = json!({"addr": self.addr.to_string(), "transfer": self.transfer, "epoch": self.epoch, "shm": self.shm});
        if let Some(u) = &self.ucx {
            v["ucx"] = json!(u);
        }
        if let Some(t) = &self.tag {
            v["tag"] = json!(t);
        }
        if let Some(t) = &self.traceparent {
            v["traceparent"] = json!(t);
        }
        v
    }

    /// The handle with its tag under `secret` (see [`tag`](Self::tag)).
    pub fn signed(mut self, secret: &str) -> PdHandle {
        self.tag = Some(self.mac(secret));
        self
    }

    /// Whether the handle's tag is the one `secret` gives its fields (compared in constant time).
    pub fn verifies(&self, secret: &str) -> bool {
        crate::header::secret_matches(self.tag.as_deref(), &self.mac(secret))
    }

    /// HMAC-SHA256 under `secret` of the fields, each length-prefixed (no two handles share an
    /// encoding), in hex.
    fn mac(&self, secret: &str) -> String {
        use hmac::Mac;
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
        let fields = [
            "pdserve-pd-handle-v1".to_owned(),
            self.addr.to_string(),
            self.transfer.to_string(),
            self.epoch.to_string(),
            self.shm.clone().map_or_else(|| "-".to_owned(), |s| format!("+{s}")),
            self.ucx.clone().map_or_else(|| "-".to_owned(), |s| format!("+{s}")),
        ];
        for f in &fields {
            m.update(&(f.len() as u64).to_le_bytes());
            m.update(f.as_bytes());
        }
        m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
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
            shm: optional_string(v, "shm").map_err(|()| bad("shm"))?,
            ucx: optional_string(v, "ucx").map_err(|()| bad("ucx"))?,
            tag: optional_string(v, "tag").map_err(|()| bad("tag"))?,
            traceparent: optional_string(v, "traceparent").map_err(|()| bad("traceparent"))?,
        })
    }
}

fn optional_string(v: &Value, field: &str) -> Result<Option<String>, ()> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(()),
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
    splice_field(body, HANDLE_FIELD, handle)
}

/// `body` (a JSON object) with member `name` = `value` (raw JSON) added first; the rest of the bytes
/// copied as they are. `None` if `body` is not a JSON object.
pub fn splice_field(body: &[u8], name: &str, value: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + value.len() + name.len() + 8);
    out.extend_from_slice(b"{\"");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(value);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// The member of a re-dispatched request's body (router to worker only) that says how to go on from
/// what the client already has: see [`Resume`].
pub const RESUME_FIELD: &str = "pd_resume";

/// A request the router moves to another worker mid-answer (its first worker died, stalled or lost
/// the KV): the worker computes the prompt followed by `tokens`, treats those as already generated and
/// already sent (they count in `usage`, the sampler's seeded stream is past them, stop strings and
/// tool calls see their text), and streams only what comes after them, under the client's response
/// `id` and `created`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resume {
    /// The client's request id (the worker's own `x-request-id` names the attempt).
    pub request_id: String,
    /// The response's `created`, when the client has seen one.
    pub created: Option<u64>,
    /// Tokens generated and delivered before the move, in order.
    pub tokens: Vec<u32>,
}

impl Resume {
    pub fn to_json(&self) -> Value {
        json!({"request_id": self.request_id, "created": self.created, "tokens": self.tokens})
    }

    pub fn from_json(v: &Value) -> Result<Resume, ApiError> {
        let bad =
            |f: &str| ApiError::invalid(format!("`{RESUME_FIELD}.{f}` is missing or has the wrong type"));
        let tokens = v.get("tokens").and_then(Value::as_array).ok_or_else(|| bad("tokens"))?;
        Ok(Resume {
            request_id: v
                .get("request_id")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("request_id"))?
                .to_owned(),
            created: match v.get("created") {
                None | Some(Value::Null) => None,
                Some(c) => Some(c.as_u64().ok_or_else(|| bad("created"))?),
            },
            tokens: tokens
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| bad("tokens"))?,
        })
    }
}

/// The stream marks a worker writes for the router when the request asks for them
/// ([`header::RESUMABLE`](crate::header::RESUMABLE)): server-sent-event comments, which clients
/// ignore and the router takes out of the stream.
pub mod mark {
    /// `: pdserve-tokens CREATED ID ID...`: the events before it are exactly what the worker made of
    /// the request's tokens so far, these ids the newest of them.
    pub const TOKENS: &str = ": pdserve-tokens ";
    /// `: pdserve-retry KIND`: the request failed here in a way another worker may not (the KV did not
    /// arrive); the error events after it are for the client only if no other worker can take it.
    pub const RETRY: &str = ": pdserve-retry ";
    /// The whole keep-alive mark: the request waits (queued, preempted) at a worker whose engine loop
    /// is turning.
    pub const ALIVE: &str = ": pdserve-alive\n\n";

    /// The tokens mark, as one event.
    pub fn tokens(created: u64, ids: &[u32]) -> String {
        let mut s = format!("{TOKENS}{created}");
        for id in ids {
            s.push(' ');
            s.push_str(&id.to_string());
        }
        s.push_str("\n\n");
        s
    }

    /// What a mark event says: `Some(Ok((created, ids)))` for a tokens mark (a keep-alive mark reads
    /// as one with no ids and `created` 0), `Some(Err(kind))` for a retry mark, `None` for any other
    /// event (or a malformed mark).
    pub fn read(event: &[u8]) -> Option<Result<(u64, Vec<u32>), String>> {
        let text = std::str::from_utf8(event).ok()?.trim_end();
        if text == ALIVE.trim_end() {
            return Some(Ok((0, Vec::new())));
        }
        if let Some(rest) = text.strip_prefix(TOKENS) {
            let mut it = rest.split(' ');
            let created = it.next()?.parse().ok()?;
            let ids = it.map(|t| t.parse().ok()).collect::<Option<Vec<u32>>>()?;
            return Some(Ok((created, ids)));
        }
        text.strip_prefix(RETRY).map(|k| Err(k.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_round_trip_and_errors() {
        let h = PdHandle {
            addr: "127.0.0.1:9000".parse().unwrap(),
            transfer: 7,
            epoch: 3,
            shm: None,
            ucx: None,
            tag: None,
            traceparent: None,
        };
        assert_eq!(PdHandle::from_json(&h.to_json()).unwrap(), h);
        let traced = PdHandle {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            ..h.clone()
        };
        assert_eq!(PdHandle::from_json(&traced.to_json()).unwrap(), traced);
        assert!(h.to_json().get("traceparent").is_none(), "no trace member unless there is one");
        let h2 = PdHandle { shm: Some("/dev/shm/kv".into()), ..h.clone() };
        assert_eq!(PdHandle::from_json(&h2.to_json()).unwrap(), h2);
        let h3 = PdHandle { ucx: Some("ucx:0a0b".into()), ..h2.clone() };
        assert_eq!(PdHandle::from_json(&h3.to_json()).unwrap(), h3);
        assert!(h2.to_json().get("ucx").is_none(), "no UCX member unless there is one");
        let e = PdHandle::from_json(&json!({"addr": "nowhere", "transfer": 1, "epoch": 1})).unwrap_err();
        assert!(e.message.contains("pd_transfer.addr"), "{e}");
        assert!(PdHandle::from_json(&json!({"addr": "127.0.0.1:1", "transfer": 1, "epoch": 1, "shm": 5}))
            .is_err());
    }

    /// A tag verifies under its secret only, and a handle with any field changed (the address
    /// above all), the tag missing or moved between fields does not.
    #[test]
    fn tags_verify_only_their_own_fields_under_their_secret() {
        let h = PdHandle {
            addr: "10.0.0.5:8100".parse().unwrap(),
            transfer: 41,
            epoch: 2,
            shm: Some("/dev/shm/pdserve-kv-a-1".into()),
            ucx: None,
            tag: None,
            traceparent: None,
        };
        let signed = h.clone().signed("s3cret");
        let tag = signed.tag.clone().unwrap();
        assert_eq!(tag.len(), 64);
        let back = PdHandle::from_json(&signed.to_json()).unwrap();
        assert!(back.verifies("s3cret"));
        let traced = PdHandle {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            ..back.clone()
        };
        assert!(traced.verifies("s3cret"), "the trace it names is not under the tag");
        assert!(!back.verifies("s3cre"), "another secret");
        assert!(!h.verifies("s3cret"), "no tag");
        let t = Some(tag);
        for forged in [
            PdHandle { addr: "10.0.0.6:8100".parse().unwrap(), tag: t.clone(), ..h.clone() },
            PdHandle { transfer: 42, tag: t.clone(), ..h.clone() },
            PdHandle { epoch: 3, tag: t.clone(), ..h.clone() },
            PdHandle { shm: None, tag: t.clone(), ..h.clone() },
            PdHandle { shm: None, ucx: Some("/dev/shm/pdserve-kv-a-1".into()), tag: t.clone(), ..h.clone() },
        ] {
            assert!(!forged.verifies("s3cret"), "{forged:?}");
        }
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

    #[test]
    fn resume_and_marks_round_trip() {
        let r = Resume { request_id: "r1".into(), created: Some(17), tokens: vec![5, 0, 70000] };
        assert_eq!(Resume::from_json(&r.to_json()).unwrap(), r);
        let r0 = Resume { created: None, tokens: vec![], ..r.clone() };
        assert_eq!(Resume::from_json(&r0.to_json()).unwrap(), r0);
        let e = Resume::from_json(&json!({"request_id": "r", "tokens": [1, -2]})).unwrap_err();
        assert!(e.message.contains("pd_resume.tokens"), "{e}");
        assert!(Resume::from_json(&json!({"tokens": []})).is_err());
        let m = mark::tokens(17, &[3, 4]);
        assert_eq!(m, ": pdserve-tokens 17 3 4\n\n");
        assert_eq!(mark::read(m.as_bytes()), Some(Ok((17, vec![3, 4]))));
        assert_eq!(mark::read(b": pdserve-tokens 9\n\n"), Some(Ok((9, vec![]))));
        assert_eq!(
            mark::read(b": pdserve-retry kv_transfer_failed\n\n"),
            Some(Err("kv_transfer_failed".into()))
        );
        assert_eq!(mark::read(b"data: {}\n\n"), None);
        assert_eq!(mark::read(mark::ALIVE.as_bytes()), Some(Ok((0, vec![]))));
        assert_eq!(mark::read(b": pdserve-tokens x 1\n\n"), None);
    }
}
