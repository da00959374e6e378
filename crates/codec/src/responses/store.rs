//! Answered responses kept for `previous_response_id` and `GET /v1/responses/{id}`, bounded in count,
//! bytes and age.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::Value;

/// One stored response: the conversation's items up to and including its output, and the response
/// object (`GET /v1/responses/{id}`).
#[derive(Debug, Clone)]
struct Stored {
    items: Vec<Value>,
    response: Value,
    at: Instant,
    /// Its size as JSON text (what the byte bound counts).
    bytes: usize,
}

/// Answered responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
/// `count_max`, together at most `bytes_max` (each holds its whole conversation), none older than
/// `age_max`; the oldest go first. Requests with `store: false` are never kept.
#[derive(Debug)]
pub struct ResponseStore {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
    bytes: usize,
    pub count_max: usize,
    pub bytes_max: usize,
    pub age_max: Duration,
}

impl ResponseStore {
    pub fn new(count_max: usize, bytes_max: usize, age_max: Duration) -> ResponseStore {
        ResponseStore {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            count_max,
            bytes_max,
            age_max,
        }
    }

    fn drop_oldest(&mut self) -> bool {
        let Some(old) = self.order.pop_front() else { return false };
        if let Some(s) = self.by_id.remove(&old) {
            self.bytes -= s.bytes;
        }
        true
    }

    /// Keeps response `response` (its `id` names it), whose conversation is `items` then its output.
    pub fn put(&mut self, mut items: Vec<Value>, response: Value, now: Instant) {
        let Some(id) = response["id"].as_str().map(str::to_owned) else { return };
        if self.count_max == 0 {
            return;
        }
        items.extend(response["output"].as_array().into_iter().flatten().cloned());
        let bytes = items.iter().map(|i| i.to_string().len()).sum::<usize>() + response.to_string().len();
        if bytes > self.bytes_max {
            return; // larger than the whole store: not kept
        }
        self.expire(now);
        self.delete(&id);
        while self.by_id.len() >= self.count_max || self.bytes + bytes > self.bytes_max {
            if !self.drop_oldest() {
                break;
            }
        }
        self.bytes += bytes;
        self.by_id.insert(id.clone(), Stored { items, response, at: now, bytes });
        self.order.push_back(id);
    }

    fn expire(&mut self, now: Instant) {
        while let Some(id) = self.order.front() {
            match self.by_id.get(id) {
                Some(s) if now.saturating_duration_since(s.at) < self.age_max => break,
                _ => {
                    self.drop_oldest();
                }
            }
        }
    }

    fn live(&self, id: &str, now: Instant) -> Option<&Stored> {
        self.by_id.get(id).filter(|s| now.saturating_duration_since(s.at) < self.age_max)
    }

    /// The conversation items of response `id` (its output included), if kept.
    pub fn items(&self, id: &str, now: Instant) -> Option<Vec<Value>> {
        self.live(id, now).map(|s| s.items.clone())
    }

    /// The response object `id`, if kept.
    pub fn response(&self, id: &str, now: Instant) -> Option<Value> {
        self.live(id, now).map(|s| s.response.clone())
    }

    /// Forgets response `id`; whether it was kept.
    pub fn delete(&mut self, id: &str) -> bool {
        let Some(s) = self.by_id.remove(id) else { return false };
        self.bytes -= s.bytes;
        self.order.retain(|o| o != id);
        true
    }

    /// Bytes held (the stored conversations and responses as JSON text).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::read;
    use serde_json::json;

    #[test]
    fn the_store_is_bounded_in_count_and_age() {
        let t0 = Instant::now();
        let mut store = ResponseStore::new(2, 1 << 20, Duration::from_secs(60));
        let resp = |id: &str| json!({"id": id, "output": [{"type": "message", "role": "assistant", "content": "x"}]});
        store.put(vec![json!({"role": "user", "content": "a"})], resp("r1"), t0);
        store.put(Vec::new(), resp("r2"), t0);
        assert_eq!(store.items("r1", t0).map(|i| i.len()), Some(2));
        store.put(Vec::new(), resp("r3"), t0);
        assert!(store.items("r1", t0).is_none() && store.items("r2", t0).is_some());
        assert!(store.items("r3", t0 + Duration::from_secs(61)).is_none());
        assert!(store.delete("r2") && !store.delete("r2"));
        // The byte bound: a conversation too large for what is left pushes the oldest out.
        let mut small = ResponseStore::new(100, 300, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            small.put(vec![json!({"role": "user", "content": "x".repeat(60)})], resp(id), t0);
        }
        assert!(small.items("a", t0).is_none() && small.items("c", t0).is_some() && small.bytes() <= 300);
        small.put(vec![json!("y".repeat(400))], resp("huge"), t0);
        assert!(small.items("huge", t0).is_none() && small.items("c", t0).is_some());
        // A follow-up reads the stored conversation, then its own input.
        let previous = |id: &str| store.items(id, t0);
        let r = read(br#"{"input": "next", "previous_response_id": "r3"}"#, &previous, false).unwrap();
        assert_eq!(r.items.len(), 2);
    }
}
