//! The client side of the codec: decoding responses, streamed body piece by body piece.

use crate::request::{body_framing, find_head_end, find_header, keep_alive, BodyFraming, Header};
use crate::{HttpError, Limits};

/// A response's status line and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub minor_version: u8,
    pub headers: Vec<Header>,
}

impl ResponseHead {
    /// The first value of header `name`, compared without regard to case.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.headers, name)
    }

    /// The first value of header `name` if it is valid UTF-8, trimmed.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok()).map(str::trim)
    }
}

/// What the response decoder yields, in order: one `Head`, any number of `Data`, one `End`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseEvent {
    Head(ResponseHead),
    /// A piece of the (de-chunked) body.
    Data(Vec<u8>),
    End,
}

#[derive(Debug)]
enum State {
    Head { scanned: usize },
    Body(BodyFraming),
    UntilClose,
    End,
    Done,
}

/// Incremental response decoder for one response on a connection.
///
/// Call [`push`](Self::push) with received bytes, then [`poll`](Self::poll) until it returns `Ok(None)`;
/// on end of input call [`handle_eof`](Self::handle_eof). Interim `1xx` responses are skipped.
#[derive(Debug)]
pub struct ResponseDecoder {
    limits: Limits,
    buf: Vec<u8>,
    state: State,
    no_body: bool,
    keep_alive: bool,
}

impl ResponseDecoder {
    /// `head_request`: the request was `HEAD`, so the response has no body whatever its headers say.
    pub fn new(limits: Limits, head_request: bool) -> Self {
        ResponseDecoder {
            limits,
            buf: Vec::new(),
            state: State::Head { scanned: 0 },
            no_body: head_request,
            keep_alive: false,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// True after `End` was returned.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// True when the connection can carry another request: the response ended cleanly, both sides
    /// agreed to keep the connection, and no stray bytes follow the response.
    pub fn is_reusable(&self) -> bool {
        self.is_done() && self.keep_alive && self.buf.is_empty()
    }

    /// The next event, or `Ok(None)` when more input is needed.
    pub fn poll(&mut self) -> Result<Option<ResponseEvent>, HttpError> {
        loop {
            match &mut self.state {
                State::Head { scanned } => {
                    let Some(head_len) = find_head_end(&self.buf, scanned.saturating_sub(3)) else {
                        if self.buf.len() > self.limits.header_bytes_max {
                            return Err(HttpError::HeadersTooLarge {
                                bytes: self.buf.len(),
                                limit: self.limits.header_bytes_max,
                            });
                        }
                        *scanned = self.buf.len();
                        return Ok(None);
                    };
                    let head = self.parse_head(head_len)?;
                    self.buf.drain(..head_len);
                    if (100..200).contains(&head.status) && head.status != 101 {
                        self.state = State::Head { scanned: 0 };
                        continue;
                    }
                    self.keep_alive = keep_alive(head.minor_version, head.header("connection"));
                    let bodiless =
                        self.no_body || head.status == 204 || head.status == 304 || head.status < 200;
                    self.state = if bodiless {
                        State::End
                    } else {
                        match body_framing(&head.headers, &self.limits)? {
                            Some(BodyFraming::Length(0)) => State::End,
                            Some(f) => State::Body(f),
                            None => {
                                // Delimited by the server closing the connection.
                                self.keep_alive = false;
                                State::UntilClose
                            }
                        }
                    };
                    return Ok(Some(ResponseEvent::Head(head)));
                }
                State::Body(BodyFraming::Length(remaining)) => {
                    let take = (*remaining).min(self.buf.len());
                    if take == 0 {
                        return Ok(None);
                    }
                    *remaining -= take;
                    if *remaining == 0 {
                        self.state = State::End;
                    }
                    return Ok(Some(ResponseEvent::Data(self.buf.drain(..take).collect())));
                }
                State::Body(BodyFraming::Chunked(dec)) => {
                    let mut out = Vec::new();
                    let used = dec.decode(&self.buf, &mut out)?;
                    self.buf.drain(..used);
                    if dec.is_done() {
                        self.state = State::End;
                    }
                    if !out.is_empty() {
                        return Ok(Some(ResponseEvent::Data(out)));
                    }
                    if !matches!(self.state, State::End) {
                        return Ok(None);
                    }
                }
                State::UntilClose => {
                    if self.buf.is_empty() {
                        return Ok(None);
                    }
                    return Ok(Some(ResponseEvent::Data(std::mem::take(&mut self.buf))));
                }
                State::End => {
                    self.state = State::Done;
                    return Ok(Some(ResponseEvent::End));
                }
                State::Done => return Ok(None),
            }
        }
    }

    /// The peer closed the connection: ends a close-delimited body, and is an error anywhere else
    /// before the end.
    pub fn handle_eof(&mut self) -> Result<Option<ResponseEvent>, HttpError> {
        match self.state {
            State::UntilClose if self.buf.is_empty() => {
                self.state = State::Done;
                Ok(Some(ResponseEvent::End))
            }
            State::UntilClose | State::End => self.poll(),
            State::Done => Ok(None),
            State::Head { .. } | State::Body(_) => Err(HttpError::UnexpectedEof),
        }
    }

    fn parse_head(&self, head_len: usize) -> Result<ResponseHead, HttpError> {
        if head_len > self.limits.header_bytes_max {
            return Err(HttpError::HeadersTooLarge { bytes: head_len, limit: self.limits.header_bytes_max });
        }
        let mut slots = vec![httparse::EMPTY_HEADER; self.limits.header_count_max];
        let mut resp = httparse::Response::new(&mut slots);
        match resp.parse(&self.buf[..head_len]) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err(HttpError::Malformed { what: "response head" }),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(HttpError::TooManyHeaders { limit: self.limits.header_count_max })
            }
            Err(_) => return Err(HttpError::Malformed { what: "response head" }),
        }
        let (Some(status), Some(minor_version)) = (resp.code, resp.version) else {
            return Err(HttpError::Malformed { what: "status line" });
        };
        Ok(ResponseHead {
            status,
            minor_version,
            headers: resp
                .headers
                .iter()
                .map(|h| Header { name: h.name.to_owned(), value: h.value.to_vec() })
                .collect(),
        })
    }
}
