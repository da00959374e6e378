//! Server-Sent Events: writing `data:` frames and parsing an event stream on the client side.

use crate::HttpError;

/// Appends one event carrying `data`. Each line of `data` becomes its own `data:` field, so a payload
/// with newlines survives the round trip.
pub fn write_sse_event(out: &mut Vec<u8>, data: &str) {
    for line in data.split('\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.strip_suffix('\r').unwrap_or(line).as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
}

/// Appends one event as one chunk of a chunked body, the form a streaming response is sent in.
pub fn write_sse_chunk(out: &mut Vec<u8>, data: &str) {
    let mut frame = Vec::with_capacity(data.len() + 16);
    write_sse_event(&mut frame, data);
    crate::write_chunk(out, &frame);
}

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` fields joined with `\n`.
    pub data: String,
    /// The `id:` field, if any.
    pub id: Option<String>,
}

/// Incremental event-stream parser (the WHATWG algorithm, less `retry:`): push body bytes, take events.
#[derive(Debug)]
pub struct SseDecoder {
    buf: Vec<u8>,
    pending: SseEvent,
    has_data: bool,
    line_bytes_max: usize,
}

impl SseDecoder {
    /// `line_bytes_max` bounds one line; a longer one is an error rather than unbounded buffering.
    pub fn new(line_bytes_max: usize) -> Self {
        SseDecoder { buf: Vec::new(), pending: SseEvent::default(), has_data: false, line_bytes_max }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete event, `Ok(None)` if more bytes are needed.
    pub fn next_event(&mut self) -> Result<Option<SseEvent>, HttpError> {
        let mut start = 0;
        let result = loop {
            let Some(off) = self.buf[start..].iter().position(|&b| b == b'\n') else {
                if self.buf.len() - start > self.line_bytes_max {
                    break Err(HttpError::Malformed { what: "event-stream line (too long)" });
                }
                break Ok(None);
            };
            let line = &self.buf[start..start + off];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            start += off + 1;
            if line.is_empty() {
                if self.has_data {
                    self.has_data = false;
                    break Ok(Some(std::mem::take(&mut self.pending)));
                }
                self.pending = SseEvent::default();
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let text = String::from_utf8_lossy(line);
            let (field, value) = match text.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (text.as_ref(), ""),
            };
            match field {
                "data" => {
                    if self.has_data {
                        self.pending.data.push('\n');
                    }
                    self.pending.data.push_str(value);
                    self.has_data = true;
                }
                "event" => self.pending.event = Some(value.to_owned()),
                "id" => self.pending.id = Some(value.to_owned()),
                _ => {}
            }
        };
        self.buf.drain(..start);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_multiline_and_done() {
        let mut out = Vec::new();
        write_sse_event(&mut out, "{\"a\":1}");
        write_sse_event(&mut out, "line1\nline2");
        write_sse_event(&mut out, "[DONE]");
        let mut d = SseDecoder::new(1024);
        for b in out {
            d.push(&[b]);
        }
        // Bytes were pushed one at a time but events are only taken now.
        let got: Vec<String> = std::iter::from_fn(|| d.next_event().unwrap()).map(|e| e.data).collect();
        assert_eq!(got, ["{\"a\":1}", "line1\nline2", "[DONE]"]);
    }

    #[test]
    fn fields_comments_and_crlf() {
        let mut d = SseDecoder::new(1024);
        d.push(b": keep-alive\r\nevent: error\r\nid: 7\r\ndata:x\r\n\r\n\n\ndata: y\n");
        let e = d.next_event().unwrap().unwrap();
        assert_eq!(e, SseEvent { event: Some("error".into()), data: "x".into(), id: Some("7".into()) });
        assert_eq!(d.next_event().unwrap(), None);
        d.push(b"\n");
        assert_eq!(d.next_event().unwrap().unwrap().data, "y");
    }

    #[test]
    fn long_line_is_an_error() {
        let mut d = SseDecoder::new(8);
        d.push(b"data: 0123456789");
        assert!(d.next_event().is_err());
    }
}
