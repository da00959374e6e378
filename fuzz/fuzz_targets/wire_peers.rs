//! What fleet peers send a worker, on arbitrary bytes: ZMTP frames from a KV event subscriber (an
//! error or a bounded message, never a panic or an allocation past the frame bound), a batch payload
//! a publisher sends the router (decoded or refused; what decodes encodes back to the same events),
//! a `--kv-events-config` value, and a `traceparent` header (whatever parses formats back to itself).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_kv_events::zmtp::{read, subscription, Incoming, FRAME_BYTES_MAX};
use pdserve_kv_events::{decode_batch, encode_batch, KvEventsConfig};
use pdserve_trace::TraceContext;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    for _ in 0..64 {
        match read(&mut r) {
            Ok(m) => {
                if let Incoming::Message(frames) = &m {
                    assert!(
                        frames.len() <= 17
                            && frames.iter().map(|f| f.len() as u64).sum::<u64>() <= FRAME_BYTES_MAX
                    );
                }
                let _ = subscription(&m);
            }
            Err(_) => break,
        }
    }
    if let Ok(b) = decode_batch(7, data) {
        let again = decode_batch(7, &encode_batch(b.ts, &b.events, 0)).expect("what decodes encodes");
        assert_eq!(again.events, b.events);
    }
    let text = String::from_utf8_lossy(data);
    let _ = KvEventsConfig::parse(&text);
    if let Some(c) = TraceContext::parse(&text) {
        assert_eq!(TraceContext::parse(&c.traceparent()), Some(c));
        assert_ne!(c.trace_id, [0; 16]);
        assert_ne!(c.span_id, [0; 8]);
    }
});
