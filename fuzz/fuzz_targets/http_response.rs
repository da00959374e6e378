//! Arbitrary bytes never panic the response and event-stream decoders, and never make them yield
//! more body than was fed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_http::{Limits, ResponseDecoder, ResponseEvent, SseDecoder};

fuzz_target!(|data: &[u8]| {
    let mut d = ResponseDecoder::new(Limits::default(), false);
    let mut sse = SseDecoder::new(1024);
    let mut body = 0usize;
    for piece in data.chunks(7) {
        d.push(piece);
        while let Ok(Some(ev)) = d.poll() {
            if let ResponseEvent::Data(b) = ev {
                body += b.len();
                sse.push(&b);
                while let Ok(Some(_)) = sse.next_event() {}
            }
        }
    }
    let _ = d.handle_eof();
    assert!(body <= data.len());
});
