//! Arbitrary bytes, cut at an arbitrary point, never panic the request decoder; every request it
//! yields comes back unchanged from a write/decode round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_http::{Limits, RequestDecoder, Status};

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else { return };
    let cut = usize::from(cut).min(rest.len());
    let limits = Limits { header_count_max: 8, body_bytes_max: 4096, ..Limits::default() };
    let mut d = RequestDecoder::new(limits);
    for piece in [&rest[..cut], &rest[cut..]] {
        d.push(piece);
        while let Ok(Status::Complete(r)) = d.decode() {
            let mut wire = Vec::new();
            r.write_to(&mut wire);
            let mut again = RequestDecoder::new(Limits::default());
            again.push(&wire);
            match again.decode() {
                Ok(Status::Complete(back)) => {
                    assert_eq!(back.method, r.method);
                    assert_eq!(back.target, r.target);
                    assert_eq!(back.minor_version, r.minor_version);
                    assert_eq!(back.body, r.body);
                }
                other => panic!("round trip of {r:?} gave {other:?}"),
            }
        }
    }
});
