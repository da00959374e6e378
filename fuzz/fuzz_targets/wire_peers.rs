//! What fleet peers send a worker, on arbitrary bytes: ZMTP frames from a KV event subscriber (an
//! error or a bounded message, never a panic or an allocation past the frame bound), a
//! `--kv-events-config` value, and a `traceparent` header (whatever parses formats back to itself).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_kv_events::zmtp::{read, subscription, Incoming, FRAME_BYTES_MAX};
use pdserve_kv_events::KvEventsConfig;
use pdserve_trace::TraceContext;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    for _ in 0..64 {
        match read(&mut r) {
            Ok(m) => {
                if let Incoming::Message(frames) = &m {
                    assert!(frames.len() <= 17 && frames.iter().all(|f| f.len() as u64 <= FRAME_BYTES_MAX));
                }
                let _ = subscription(&m);
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(data);
    let _ = KvEventsConfig::parse(&text);
    if let Some(c) = TraceContext::parse(&text) {
        assert_eq!(TraceContext::parse(&c.traceparent()), Some(c));
        assert_ne!(c.trace_id, [0; 16]);
        assert_ne!(c.span_id, [0; 8]);
    }
});
