//! Table-driven tests of the sans-IO codec: requests, responses, chunked bodies, limits, and round trips.

use pdserve_api::{ApiError, ErrorKind};
use pdserve_http::{
    write_chunk, write_head, write_last_chunk, write_sse_chunk, BodyKind, Header, HttpError, Limits, Request,
    RequestDecoder, Response, ResponseDecoder, ResponseEvent, SseDecoder, Status,
};

fn small_limits() -> Limits {
    Limits {
        request_line_bytes_max: 64,
        header_bytes_max: 256,
        header_count_max: 4,
        body_bytes_max: 32,
        chunk_line_bytes_max: 16,
    }
}

/// What decoding `input` whole should give: `Ok((method, target, body))`, `Partial`, or the error status.
#[derive(Debug, PartialEq)]
enum Want {
    Req(&'static str, &'static str, &'static [u8]),
    Partial,
    Status(u16),
}

fn check_request(input: &[u8], want: Want) {
    let mut d = RequestDecoder::new(small_limits());
    d.push(input);
    let got = match d.decode() {
        Ok(Status::Complete(r)) => {
            assert_eq!(
                (r.method.as_str(), r.target.as_str(), r.body.as_slice()),
                match want {
                    Want::Req(m, t, b) => (m, t, b),
                    _ => panic!("input {:?}: got a request, want {want:?}", String::from_utf8_lossy(input)),
                }
            );
            return;
        }
        Ok(Status::Partial) => Want::Partial,
        Err(e) => Want::Status(e.status()),
    };
    assert_eq!(got, want, "input {:?}", String::from_utf8_lossy(input));
}

#[test]
fn request_table() {
    let long_target = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(80));
    let many_headers = "GET / HTTP/1.1\r\na: 1\r\nb: 2\r\nc: 3\r\nd: 4\r\ne: 5\r\n\r\n";
    let big_head = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "v".repeat(300));
    let unterminated_big_head = format!("GET / HTTP/1.1\r\nx: {}", "v".repeat(300));
    let cases: Vec<(&[u8], Want)> = vec![
        (b"GET / HTTP/1.1\r\n\r\n", Want::Req("GET", "/", b"")),
        (b"GET /a?b=c HTTP/1.0\r\nHost: x\r\n\r\n", Want::Req("GET", "/a?b=c", b"")),
        (b"\r\n\r\nGET / HTTP/1.1\r\n\r\n", Want::Req("GET", "/", b"")),
        (b"GET / HTTP/1.1\n\n", Want::Req("GET", "/", b"")),
        (b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", Want::Req("POST", "/x", b"hello")),
        (b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhel", Want::Partial),
        (b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n", Want::Req("POST", "/x", b"")),
        (
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
            Want::Req("POST", "/x", b"hi"),
        ),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n", Want::Partial),
        (b"GET / HTTP/1.1\r\nHost: x\r\n", Want::Partial),
        (b"GET / HTT", Want::Partial),
        (b"", Want::Partial),
        (b"GET / HTTP/2.0\r\n\r\n", Want::Status(400)),
        (b"GET\r\n\r\n", Want::Status(400)),
        (b"G@T / HTTP/1.1\r\n\r\n", Want::Status(400)),
        (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", Want::Status(400)),
        (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", Want::Status(400)),
        (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", Want::Status(400)),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", Want::Status(400)),
        (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", Want::Status(400)),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", Want::Status(501)),
        (b"POST / HTTP/1.1\r\nContent-Length: 33\r\n\r\n", Want::Status(413)),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n21\r\n", Want::Status(413)),
        (
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1;aaaaaaaaaaaaaaaaaaaaaa\r\n",
            Want::Status(400),
        ),
        (long_target.as_bytes(), Want::Status(414)),
        (many_headers.as_bytes(), Want::Status(431)),
        (big_head.as_bytes(), Want::Status(431)),
        (unterminated_big_head.as_bytes(), Want::Status(431)),
    ];
    for (input, want) in cases {
        check_request(input, want);
    }
}

#[test]
fn request_line_limit_applies_before_the_line_ends() {
    let mut d = RequestDecoder::new(small_limits());
    d.push(format!("GET /{}", "a".repeat(100)).as_bytes());
    assert!(matches!(d.decode(), Err(HttpError::RequestLineTooLong { limit: 64, .. })));
}

fn sample_requests() -> Vec<Request> {
    let mut post = Request::new("POST", "/v1/chat/completions?x=1");
    post.headers.push(Header { name: "Content-Type".into(), value: b"application/json".to_vec() });
    post.headers.push(Header { name: "x-request-id".into(), value: b"req-1".to_vec() });
    post.body = br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec();
    let mut get = Request::new("GET", "/health/ready");
    get.headers.push(Header { name: "Host".into(), value: b"localhost".to_vec() });
    let mut old = Request::new("GET", "/");
    old.minor_version = 0;
    vec![post, get, old]
}

/// Decoding what `write_to` wrote gives the request back (plus the content-length it added).
#[test]
fn request_round_trip_byte_at_a_time_and_pipelined() {
    let reqs = sample_requests();
    let mut wire = Vec::new();
    for r in &reqs {
        r.write_to(&mut wire);
    }
    for step in [1, 3, 7, wire.len()] {
        let mut d = RequestDecoder::new(Limits::default());
        let mut got = Vec::new();
        for piece in wire.chunks(step) {
            d.push(piece);
            while let Status::Complete(r) = d.decode().expect("valid input") {
                got.push(r);
            }
        }
        assert_eq!(got.len(), reqs.len(), "step {step}");
        for (g, want) in got.iter().zip(&reqs) {
            assert_eq!(g.method, want.method);
            assert_eq!(g.target, want.target);
            assert_eq!(g.minor_version, want.minor_version);
            assert_eq!(g.body, want.body);
            for h in &want.headers {
                assert_eq!(g.header(&h.name), Some(h.value.as_slice()));
            }
        }
        assert!(d.is_idle());
    }
}

#[test]
fn keep_alive_rules() {
    let cases = [
        ("GET / HTTP/1.1\r\n\r\n", true),
        ("GET / HTTP/1.1\r\nConnection: close\r\n\r\n", false),
        ("GET / HTTP/1.1\r\nConnection: foo, Close\r\n\r\n", false),
        ("GET / HTTP/1.0\r\n\r\n", false),
        ("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", true),
    ];
    for (input, want) in cases {
        let mut d = RequestDecoder::new(Limits::default());
        d.push(input.as_bytes());
        let Ok(Status::Complete(r)) = d.decode() else { panic!("{input}") };
        assert_eq!(r.keep_alive(), want, "{input}");
    }
}

#[test]
fn expect_continue_is_reported_once() {
    let mut d = RequestDecoder::new(Limits::default());
    d.push(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n");
    assert_eq!(d.decode().unwrap(), Status::Partial);
    assert!(d.take_expect_continue());
    assert!(!d.take_expect_continue());
    d.push(b"abc");
    assert!(matches!(d.decode().unwrap(), Status::Complete(r) if r.body == b"abc"));
}

fn decode_response(wire: &[u8], step: usize, head_request: bool) -> Result<(u16, Vec<u8>, bool), HttpError> {
    let mut d = ResponseDecoder::new(Limits::default(), head_request);
    let mut status = 0;
    let mut body = Vec::new();
    for piece in wire.chunks(step.max(1)) {
        d.push(piece);
        while let Some(ev) = d.poll()? {
            match ev {
                ResponseEvent::Head(h) => status = h.status,
                ResponseEvent::Data(b) => body.extend(b),
                ResponseEvent::End => return Ok((status, body, d.is_reusable())),
            }
        }
    }
    while let Some(ev) = d.handle_eof()? {
        match ev {
            ResponseEvent::Head(h) => status = h.status,
            ResponseEvent::Data(b) => body.extend(b),
            ResponseEvent::End => return Ok((status, body, false)),
        }
    }
    Err(HttpError::UnexpectedEof)
}

/// (wire, request was HEAD, want (status, body, reusable) or the error status)
type ResponseCase<'a> = (&'a [u8], bool, Result<(u16, &'a [u8], bool), u16>);

#[test]
fn response_table() {
    let mut chunked = Vec::new();
    write_head(&mut chunked, 200, &[("content-type", "text/event-stream")], BodyKind::Chunked, true);
    write_sse_chunk(&mut chunked, "{\"x\":1}");
    write_chunk(&mut chunked, b"");
    write_chunk(&mut chunked, b"tail");
    write_last_chunk(&mut chunked);
    let mut fixed = Vec::new();
    Response::json(404, "{}").write_to(&mut fixed, false);
    let cases: Vec<ResponseCase<'_>> = vec![
        (&chunked, false, Ok((200, b"data: {\"x\":1}\n\ntail", true))),
        (&fixed, false, Ok((404, b"{}", false))),
        (b"HTTP/1.1 204 No Content\r\n\r\n", false, Ok((204, b"", true))),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            false,
            Ok((200, b"ok", true)),
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true, Ok((200, b"", true))),
        (b"HTTP/1.0 200 OK\r\n\r\nuntil close", false, Ok((200, b"until close", false))),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc", false, Err(400)),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", false, Err(400)),
    ];
    for (wire, head_req, want) in cases {
        for step in [1, 2, 5, wire.len()] {
            let got = decode_response(wire, step, head_req).map_err(|e| e.status());
            let want = want.map(|(s, b, r)| (s, b.to_vec(), r));
            assert_eq!(got, want, "step {step} wire {:?}", String::from_utf8_lossy(wire));
        }
    }
}

#[test]
fn sse_stream_inside_chunked_body_byte_at_a_time() {
    let mut wire = Vec::new();
    write_head(&mut wire, 200, &[], BodyKind::Chunked, true);
    let events = ["{\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}", "multi\nline", "[DONE]"];
    for e in events {
        write_sse_chunk(&mut wire, e);
    }
    write_last_chunk(&mut wire);
    let mut d = ResponseDecoder::new(Limits::default(), false);
    let mut sse = SseDecoder::new(4096);
    let mut got = Vec::new();
    for b in wire {
        d.push(&[b]);
        while let Some(ev) = d.poll().unwrap() {
            if let ResponseEvent::Data(bytes) = ev {
                sse.push(&bytes);
                while let Some(e) = sse.next_event().unwrap() {
                    got.push(e.data);
                }
            }
        }
    }
    assert_eq!(got, events);
    assert!(d.is_reusable());
}

#[test]
fn error_answers_are_valid_json_in_the_contract_shape() {
    let e = ApiError::new(ErrorKind::QueueFull, "request queue is full (64 waiting, limit 64) \"quoted\"\n");
    let resp = Response::error(&e, Some("req-1"));
    assert_eq!(resp.status, 429);
    assert_eq!(resp.header_value("retry-after"), Some("1"));
    assert_eq!(resp.header_value("x-request-id"), Some("req-1"));
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["error"]["type"], "queue_full");
    assert_eq!(v["error"]["code"], 429);
    assert_eq!(v["error"]["request_id"], "req-1");
    assert_eq!(v["error"]["message"], "request queue is full (64 waiting, limit 64) \"quoted\"\n");
    // Every decoding error is answered with its one kind.
    let too_big = HttpError::BodyTooLarge { bytes: 9, limit: 8 };
    assert_eq!((too_big.status(), too_big.kind().as_str()), (413, "body_too_large"));
}

/// A deterministic stand-in for the fuzz target that runs in every test run: arbitrary bytes never
/// panic either decoder, and any request they yield survives a write/decode round trip.
#[test]
fn random_bytes_never_panic() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet: &[u8] =
        b"GETPOS /HTP1.0\r\n:;, chunkedContent-LengthTransfer-Encoding0123456789abcdef\x00\xff";
    for _ in 0..20_000 {
        let len = (next() % 200) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| alphabet[(next() % alphabet.len() as u64) as usize]).collect();
        let mut d = RequestDecoder::new(small_limits());
        d.push(&bytes);
        while let Ok(Status::Complete(r)) = d.decode() {
            let mut wire = Vec::new();
            r.write_to(&mut wire);
            let mut again = RequestDecoder::new(Limits::default());
            again.push(&wire);
            let Ok(Status::Complete(back)) = again.decode() else { panic!("round trip of {r:?}") };
            assert_eq!((back.method, back.target, back.body), (r.method, r.target, r.body));
        }
        let mut rd = ResponseDecoder::new(small_limits(), false);
        rd.push(&bytes);
        while let Ok(Some(_)) = rd.poll() {}
        let _ = rd.handle_eof();
    }
}
