//! ZMTP 3.0 with the NULL mechanism (rfc.zeromq.org/spec/23), as much as a PUB and a ROUTER socket
//! serving libzmq peers need, and a SUB and a DEALER using them: the greeting, the READY handshake,
//! frames, and a subscriber's (un)subscriptions in both their 3.0 (message) and 3.1 (command) forms.

use std::io::{self, Read, Write};

/// Frame flags.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Bytes of a frame body taken at most (a peer announcing more is dropped): subscriptions and replay
/// requests are short.
pub const FRAME_BYTES_MAX: u64 = 64 * 1024;

/// What a peer sent.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    /// A message of one or more frames.
    Message(Vec<Vec<u8>>),
    /// A command: its name and data.
    Command(String, Vec<u8>),
}

/// Sends this side's greeting and READY (`socket_type`: `PUB`, `ROUTER`), reads the peer's, and
/// returns the peer's socket type. The stream's timeouts bound every read and write.
pub(crate) fn handshake(s: &mut (impl Read + Write), socket_type: &str) -> io::Result<String> {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3; // version 3.0
    greeting[12..16].copy_from_slice(b"NULL");
    s.write_all(&greeting)?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs)?;
    if theirs[0] != 0xff || theirs[9] & 1 != 1 || theirs[10] < 3 {
        return Err(bad("not a ZMTP 3 peer"));
    }
    if &theirs[12..16] != b"NULL" || theirs[16..32].iter().any(|&b| b != 0) {
        return Err(bad("the peer asks for a security mechanism other than NULL"));
    }
    let mut ready = vec![5u8];
    ready.extend_from_slice(b"READY");
    property(&mut ready, "Socket-Type", socket_type.as_bytes());
    write_frame(s, &ready, COMMAND)?;
    match read(s)? {
        Incoming::Command(name, data) if name == "READY" => Ok(properties(&data)
            .into_iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("Socket-Type"))
            .map_or_else(String::new, |(_, v)| String::from_utf8_lossy(&v).into_owned())),
        other => Err(bad(&format!("expected READY, got {other:?}"))),
    }
}

fn property(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

fn properties(mut data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n);
        if rest.len() < n + 4 {
            break;
        }
        let name = String::from_utf8_lossy(&rest[..n]).into_owned();
        let len = u32::from_be_bytes([rest[n], rest[n + 1], rest[n + 2], rest[n + 3]]) as usize;
        let Some(value) = rest.get(n + 4..n + 4 + len) else { break };
        out.push((name, value.to_vec()));
        data = &rest[n + 4 + len..];
    }
    out
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

fn write_frame(s: &mut impl Write, body: &[u8], flags: u8) -> io::Result<()> {
    let mut head = Vec::with_capacity(9);
    if body.len() > 255 {
        head.push(flags | LONG);
        head.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        head.push(flags);
        head.push(body.len() as u8);
    }
    s.write_all(&head)?;
    s.write_all(body)
}

/// Writes a multipart message.
pub(crate) fn write_message(s: &mut impl Write, frames: &[&[u8]]) -> io::Result<()> {
    for (i, f) in frames.iter().enumerate() {
        write_frame(s, f, if i + 1 < frames.len() { MORE } else { 0 })?;
    }
    s.flush()
}

/// Reads one message or command (commands are single frames), of at most [`FRAME_BYTES_MAX`] bytes
/// in all.
pub fn read(s: &mut impl Read) -> io::Result<Incoming> {
    read_limited(s, FRAME_BYTES_MAX)
}

/// [`read`] with messages of at most `bytes_max` bytes, all frames together (a subscriber's batches
/// are larger).
pub fn read_limited(s: &mut impl Read, bytes_max: u64) -> io::Result<Incoming> {
    let mut frames = Vec::new();
    let mut total = 0u64;
    loop {
        let mut flags = [0u8; 1];
        s.read_exact(&mut flags)?;
        let len = if flags[0] & LONG != 0 {
            let mut b = [0u8; 8];
            s.read_exact(&mut b)?;
            u64::from_be_bytes(b)
        } else {
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            u64::from(b[0])
        };
        total = total.saturating_add(len);
        if total > bytes_max {
            return Err(bad(&format!("a message of over {bytes_max} bytes")));
        }
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body)?;
        if flags[0] & COMMAND != 0 {
            let n = usize::from(*body.first().ok_or_else(|| bad("an empty command"))?);
            let name = body.get(1..1 + n).ok_or_else(|| bad("a command name past its frame"))?;
            return Ok(Incoming::Command(String::from_utf8_lossy(name).into_owned(), body[1 + n..].to_vec()));
        }
        frames.push(body);
        if flags[0] & MORE == 0 {
            return Ok(Incoming::Message(frames));
        }
        if frames.len() > 16 {
            return Err(bad("a message of over 16 frames"));
        }
    }
}

/// A subscriber's change of subscription: `Some((true, prefix))` to subscribe, `(false, prefix)` to
/// cancel; `None` for anything else.
pub fn subscription(m: &Incoming) -> Option<(bool, Vec<u8>)> {
    match m {
        // ZMTP 3.1.
        Incoming::Command(name, topic) if name == "SUBSCRIBE" => Some((true, topic.clone())),
        Incoming::Command(name, topic) if name == "CANCEL" => Some((false, topic.clone())),
        // ZMTP 3.0: one frame, its first byte 1 (subscribe) or 0 (cancel).
        Incoming::Message(frames) if frames.len() == 1 => match frames[0].split_first() {
            Some((1, topic)) => Some((true, topic.to_vec())),
            Some((0, topic)) => Some((false, topic.to_vec())),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_short_long_and_commands() {
        let mut wire = Vec::new();
        let long = vec![7u8; 300];
        write_message(&mut wire, &[b"topic", &long, b""]).unwrap();
        let mut cmd = vec![9u8];
        cmd.extend_from_slice(b"SUBSCRIBE");
        cmd.extend_from_slice(b"kv@");
        write_frame(&mut wire, &cmd, COMMAND).unwrap();
        wire.extend_from_slice(&[0, 4, 1, b'k', b'v', b'@']);
        let mut r = &wire[..];
        assert_eq!(read(&mut r).unwrap(), Incoming::Message(vec![b"topic".to_vec(), long, Vec::new()]));
        let c = read(&mut r).unwrap();
        assert_eq!(subscription(&c), Some((true, b"kv@".to_vec())));
        assert_eq!(subscription(&read(&mut r).unwrap()), Some((true, b"kv@".to_vec())));
        assert!(read(&mut r).is_err(), "the stream is over");
        // A frame announcing more than the bound is refused before it is read.
        let mut huge = vec![LONG];
        huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
        assert!(read(&mut &huge[..]).is_err());
    }

    #[test]
    fn ready_properties_parse() {
        let mut data = Vec::new();
        property(&mut data, "Socket-Type", b"SUB");
        property(&mut data, "Identity", b"");
        assert_eq!(
            properties(&data),
            vec![("Socket-Type".into(), b"SUB".to_vec()), ("Identity".into(), Vec::new())]
        );
    }
}
