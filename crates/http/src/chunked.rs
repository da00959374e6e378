//! Incremental decoder for `Transfer-Encoding: chunked` bodies, shared by the request and response sides.

use crate::HttpError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a chunk-size line (`1a;ext=1\r\n`).
    Size,
    /// Inside chunk data; this many bytes remain.
    Data(usize),
    /// Expecting the CRLF that ends a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields until an empty line.
    Trailer,
    Done,
}

/// Decodes a chunked body piece by piece; partial input leaves it waiting, never fails it.
#[derive(Debug, Clone)]
pub(crate) struct ChunkedDecoder {
    state: State,
    body_bytes: usize,
    body_bytes_max: usize,
    line_bytes_max: usize,
}

impl ChunkedDecoder {
    pub(crate) fn new(body_bytes_max: usize, line_bytes_max: usize) -> Self {
        ChunkedDecoder { state: State::Size, body_bytes: 0, body_bytes_max, line_bytes_max }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consumes what it can of `input`, appending payload bytes to `out`, and returns how many bytes of
    /// `input` it used. Stops at the end of the body, so bytes of a following message are left alone.
    pub(crate) fn decode(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
        let mut pos = 0;
        loop {
            match self.state {
                State::Done => return Ok(pos),
                State::Data(remaining) => {
                    let take = remaining.min(input.len() - pos);
                    if take == 0 {
                        return Ok(pos);
                    }
                    out.extend_from_slice(&input[pos..pos + take]);
                    pos += take;
                    self.state =
                        if take == remaining { State::DataEnd } else { State::Data(remaining - take) };
                }
                State::Size | State::DataEnd | State::Trailer => {
                    let Some(line_len) = self.line(&input[pos..])? else { return Ok(pos) };
                    let line = trim_cr(&input[pos..pos + line_len]);
                    pos += line_len + 1;
                    self.state = match self.state {
                        State::Size => {
                            let size = parse_size(line)?;
                            self.body_bytes = self.body_bytes.saturating_add(size);
                            if self.body_bytes > self.body_bytes_max {
                                return Err(HttpError::BodyTooLarge {
                                    bytes: self.body_bytes,
                                    limit: self.body_bytes_max,
                                });
                            }
                            if size == 0 {
                                State::Trailer
                            } else {
                                State::Data(size)
                            }
                        }
                        State::DataEnd if line.is_empty() => State::Size,
                        State::DataEnd => return Err(HttpError::Malformed { what: "chunk terminator" }),
                        // Trailer fields are read and dropped; the empty line ends the body.
                        _ if line.is_empty() => State::Done,
                        _ => State::Trailer,
                    };
                }
            }
        }
    }

    /// Length of the next line up to (not including) its `\n`, or `None` if it is not complete yet.
    fn line(&self, input: &[u8]) -> Result<Option<usize>, HttpError> {
        match input.iter().position(|&b| b == b'\n') {
            Some(n) if n > self.line_bytes_max => {
                Err(HttpError::ChunkLineTooLong { limit: self.line_bytes_max })
            }
            Some(n) => Ok(Some(n)),
            None if input.len() > self.line_bytes_max => {
                Err(HttpError::ChunkLineTooLong { limit: self.line_bytes_max })
            }
            None => Ok(None),
        }
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn parse_size(line: &[u8]) -> Result<usize, HttpError> {
    // Chunk extensions (`;name=value`) are allowed by the grammar and ignored.
    let digits = line.split(|&b| b == b';').next().unwrap_or(line);
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(HttpError::Malformed { what: "chunk size" });
    }
    let mut size = 0usize;
    for &b in digits {
        let v = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return Err(HttpError::Malformed { what: "chunk size" }),
        };
        size = size * 16 + usize::from(v);
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8]) -> Result<(Vec<u8>, usize, bool), HttpError> {
        let mut d = ChunkedDecoder::new(1 << 20, 64);
        let mut out = Vec::new();
        let used = d.decode(input, &mut out)?;
        Ok((out, used, d.is_done()))
    }

    type Case = (&'static [u8], Result<(&'static [u8], usize, bool), u16>);

    #[test]
    fn table() {
        let cases: &[Case] = &[
            (b"5\r\nhello\r\n0\r\n\r\n", Ok((b"hello", 15, true))),
            (b"5;ext=1\r\nhello\r\n0\r\n\r\nNEXT", Ok((b"hello", 21, true))),
            (b"3\r\nabc\r\n2\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n", Ok((b"abcde", 34, true))),
            (b"A\r\n0123456789\r\n0\r\n\r\n", Ok((b"0123456789", 20, true))),
            (b"5\r\nhel", Ok((b"hel", 6, false))),
            (b"5\n", Ok((b"", 2, false))),
            (b"zz\r\n", Err(400)),
            (b"\r\n", Err(400)),
            (b"3\r\nabcX\r\n", Err(400)),
            (b"fffffffffffffffffff\r\n", Err(400)),
        ];
        for (input, want) in cases {
            let got = decode_all(input).map_err(|e| e.status());
            let want = want.map(|(b, n, d)| (b.to_vec(), n, d));
            assert_eq!(got, want, "input {:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn limits() {
        let mut d = ChunkedDecoder::new(4, 64);
        let err = d.decode(b"5\r\nhello\r\n", &mut Vec::new()).unwrap_err();
        assert_eq!(err, HttpError::BodyTooLarge { bytes: 5, limit: 4 });
        let mut d = ChunkedDecoder::new(100, 8);
        let err = d.decode(b"5;aaaaaaaaaaaaaaaa", &mut Vec::new()).unwrap_err();
        assert_eq!(err, HttpError::ChunkLineTooLong { limit: 8 });
    }

    #[test]
    fn byte_at_a_time() {
        let input = b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n";
        let mut d = ChunkedDecoder::new(1 << 20, 64);
        let mut out = Vec::new();
        let mut pending = Vec::new();
        for &b in input.iter() {
            pending.push(b);
            let used = d.decode(&pending, &mut out).unwrap();
            pending.drain(..used);
        }
        assert!(d.is_done());
        assert!(pending.is_empty());
        assert_eq!(out, b"abc0123456789abcdef");
    }
}
