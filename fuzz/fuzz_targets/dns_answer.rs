//! The router's DNS answer parser on arbitrary bytes: an error or addresses, never a panic, and
//! whatever it accepts carries the query's id.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_router::discovery::dns::{encode_query, parse_answer, Answer, Qtype};

fuzz_target!(|data: &[u8]| {
    let query = encode_query(0x1234, "decode.pdserve.svc.cluster.local", Qtype::A).expect("a valid name");
    if let Ok(Answer::Addresses(addrs)) = parse_answer(&query, data) {
        assert_eq!(&data[..2], &query[..2], "accepted an answer to another id");
        assert!(addrs.len() <= data.len() / 4, "more addresses than the bytes can hold");
    }
    // The same bytes with the query's header and question in front: deeper into the records.
    let mut framed = query[..query.len() - 11].to_vec();
    framed[2] = 0x81;
    framed[3] = 0x80;
    framed[7] = data.first().copied().unwrap_or(0);
    framed[11] = 0;
    framed.extend_from_slice(data);
    let _ = parse_answer(&query, &framed);
});
