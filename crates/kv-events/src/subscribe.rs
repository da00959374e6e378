//! The subscriber's side: a SUB connection reading a publisher's batches and decoding them back into
//! [`KvEvent`]s (vLLM's schema, as any publisher of it writes them), and a DEALER asking the replay
//! socket for what was missed. Blocking std I/O, every read and write under a deadline.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::msgpack::{self, Value};
use crate::{zmtp, KvEvent, MEDIUM_PRIMARY};

/// Bytes of one batch (its whole message) taken at most; a publisher sending more is cut off.
pub const BATCH_BYTES_MAX: u64 = 16 << 20;

/// Batches one replay answer may hold at most; a longer answer is cut off.
pub const REPLAY_BATCHES_MAX: usize = 1 << 17;

/// Bytes one replay answer may hold at most, all batches together.
pub const REPLAY_BYTES_MAX: u64 = 256 << 20;

/// A stream every read and write of which must end by one deadline: a peer sending a byte at a time
/// cannot stretch a message past it (a timeout per call would let it).
pub(crate) struct Until<'a> {
    pub(crate) s: &'a mut TcpStream,
    pub(crate) deadline: Instant,
}

impl Until<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "past the deadline"));
        }
        Ok(left)
    }
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf)
    }
}

impl Write for Until<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_write_timeout(Some(left))?;
        self.s.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
    }
}

/// One batch as published: `[ts, [events...], data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub seq: u64,
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u64>,
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// vLLM's mediums as the enum's names; another publisher's other names read as the primary pool's.
fn medium(v: Option<&Value<'_>>) -> &'static str {
    match v {
        Some(Value::Str("CPU")) => "CPU",
        Some(Value::Str("DISK")) => "DISK",
        _ => MEDIUM_PRIMARY,
    }
}

/// A block hash: an integer (pdserve, older vLLM) or bytes (vLLM's sha256 hashes, folded to their
/// first eight bytes).
fn hash(v: &Value<'_>) -> Result<u64, String> {
    match v {
        Value::Uint(h) => Ok(*h),
        Value::Int(h) => Ok(*h as u64),
        Value::Bin(b) if !b.is_empty() => Ok(b.iter().take(8).fold(0u64, |acc, &x| acc << 8 | u64::from(x))),
        other => Err(format!("a block hash that is {other:?}")),
    }
}

fn hashes(v: Option<&Value<'_>>) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        other => Err(format!("block_hashes that are {other:?}")),
    }
}

fn event(v: &Value<'_>) -> Result<KvEvent, String> {
    let Value::Array(f) = v else { return Err(format!("an event that is not an array: {v:?}")) };
    match f.first() {
        Some(Value::Str("BlockStored")) => {
            let parent_block_hash = match f.get(2) {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash(h)?),
            };
            let token_ids = match f.get(3) {
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|t| match t {
                        Value::Uint(x) => u32::try_from(*x).map_err(|_| format!("token id {x}")),
                        other => Err(format!("a token id that is {other:?}")),
                    })
                    .collect::<Result<Vec<u32>, String>>()?,
                other => return Err(format!("token_ids that are {other:?}")),
            };
            let block_size = match f.get(4) {
                Some(Value::Uint(b)) if (1..=1 << 20).contains(b) => *b as u32,
                other => return Err(format!("a block_size that is {other:?}")),
            };
            Ok(KvEvent::BlockStored {
                block_hashes: hashes(f.get(1))?,
                parent_block_hash,
                token_ids,
                block_size,
                medium: medium(f.get(6)),
            })
        }
        Some(Value::Str("BlockRemoved")) => {
            Ok(KvEvent::BlockRemoved { block_hashes: hashes(f.get(1))?, medium: medium(f.get(2)) })
        }
        Some(Value::Str("AllBlocksCleared")) => Ok(KvEvent::AllBlocksCleared),
        other => Err(format!("an event tagged {other:?}")),
    }
}

/// Decodes a batch's payload (msgpack `[ts, [events...], data_parallel_rank]`).
pub fn decode_batch(seq: u64, payload: &[u8]) -> Result<Batch, String> {
    let (v, rest) = msgpack::read(payload)?;
    if !rest.is_empty() {
        return Err(format!("{} bytes after the batch", rest.len()));
    }
    let Value::Array(top) = v else { return Err("a batch that is not an array".into()) };
    let ts = match top.first() {
        Some(Value::Float(t)) => *t,
        Some(Value::Uint(t)) => *t as f64,
        other => return Err(format!("a timestamp that is {other:?}")),
    };
    let events = match top.get(1) {
        Some(Value::Array(e)) => e.iter().map(event).collect::<Result<Vec<_>, _>>()?,
        other => return Err(format!("events that are {other:?}")),
    };
    let data_parallel_rank = match top.get(2) {
        Some(Value::Uint(r)) => Some(*r),
        _ => None,
    };
    Ok(Batch { seq, ts, events, data_parallel_rank })
}

/// A message's sequence frame (8 bytes, big-endian; -1 ends a replay).
fn seq_of(frame: &[u8]) -> io::Result<i64> {
    <[u8; 8]>::try_from(frame).map(i64::from_be_bytes).map_err(|_| bad("a sequence frame not 8 bytes long"))
}

/// A batch's sequence number: never negative.
fn batch_seq(frame: &[u8]) -> io::Result<u64> {
    u64::try_from(seq_of(frame)?).map_err(|_| bad("a negative sequence number on a batch"))
}

/// Connects and does the handshake, both by `deadline`.
fn connect(addr: SocketAddr, socket_type: &str, deadline: Instant) -> io::Result<TcpStream> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&addr, left)?;
    s.set_nodelay(true)?;
    zmtp::handshake(&mut Until { s: &mut s, deadline }, socket_type)?;
    Ok(s)
}

/// A SUB connection to a publisher, subscribed to one topic prefix.
#[derive(Debug)]
pub struct Subscription {
    stream: TcpStream,
    io_timeout: Duration,
}

impl Subscription {
    /// Connects, does the handshake and subscribes to `topic` (a prefix; empty: everything), all
    /// within `timeout`, which also bounds every later batch from its first byte to its last.
    pub fn connect(addr: SocketAddr, topic: &[u8], timeout: Duration) -> io::Result<Subscription> {
        let deadline = Instant::now() + timeout;
        let mut stream = connect(addr, "SUB", deadline)?;
        let mut sub = Vec::with_capacity(1 + topic.len());
        sub.push(1);
        sub.extend_from_slice(topic);
        zmtp::write_message(&mut Until { s: &mut stream, deadline }, &[&sub])?;
        Ok(Subscription { stream, io_timeout: timeout })
    }

    /// The next batch, waiting up to `wait` for one to start (`Ok(None)`: none came). A batch that
    /// does not decode is an error (`InvalidData`), as is a closed connection.
    pub fn next(&mut self, wait: Duration) -> io::Result<Option<Batch>> {
        self.stream.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        let mut first = [0u8; 1];
        match self.stream.peek(&mut first) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the publisher closed")),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        }
        let deadline = Instant::now() + self.io_timeout;
        match zmtp::read_limited(&mut Until { s: &mut self.stream, deadline }, BATCH_BYTES_MAX)? {
            zmtp::Incoming::Message(frames) if frames.len() == 3 => {
                decode_batch(batch_seq(&frames[1])?, &frames[2]).map(Some).map_err(bad)
            }
            zmtp::Incoming::Message(frames) => Err(bad(format!("a message of {} frames", frames.len()))),
            // Commands (PING, say) carry no batch.
            zmtp::Incoming::Command(..) => Ok(None),
        }
    }
}

/// Asks a publisher's replay socket for every batch it still holds from sequence `from` on, all
/// within `timeout` (at most [`REPLAY_BATCHES_MAX`] batches of [`REPLAY_BYTES_MAX`] bytes in all).
pub fn replay(addr: SocketAddr, from: u64, timeout: Duration) -> io::Result<Vec<Batch>> {
    let deadline = Instant::now() + timeout;
    let mut s = connect(addr, "DEALER", deadline)?;
    let mut s = Until { s: &mut s, deadline };
    zmtp::write_message(&mut s, &[b"", &from.to_be_bytes()])?;
    let (mut out, mut bytes) = (Vec::new(), 0u64);
    loop {
        let zmtp::Incoming::Message(frames) = zmtp::read_limited(&mut s, BATCH_BYTES_MAX)? else { continue };
        bytes += frames.iter().map(|f| f.len() as u64).sum::<u64>();
        if bytes > REPLAY_BYTES_MAX {
            return Err(bad(format!("a replay of over {REPLAY_BYTES_MAX} bytes")));
        }
        // `["", seq, payload]` (the delimiter a REQ expects), `[seq, payload]` from some publishers.
        let frames = match frames.first() {
            Some(f) if f.is_empty() && frames.len() == 3 => &frames[1..],
            _ => &frames[..],
        };
        let [seq, payload] = frames else { return Err(bad("a replay message not [seq, payload]")) };
        if seq_of(seq)? == -1 {
            return Ok(out);
        }
        if out.len() >= REPLAY_BATCHES_MAX {
            return Err(bad(format!("a replay of over {REPLAY_BATCHES_MAX} batches")));
        }
        out.push(decode_batch(batch_seq(seq)?, payload).map_err(bad)?);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode_batch, KvEventsConfig, Publisher};

    #[test]
    fn batches_decode_back_to_their_events() {
        let events = vec![
            KvEvent::stored(vec![u64::MAX, 5], None, (0..32).collect(), 16),
            KvEvent::BlockStored {
                block_hashes: vec![6],
                parent_block_hash: Some(5),
                token_ids: (70_000..70_016).collect(),
                block_size: 16,
                medium: "CPU",
            },
            KvEvent::BlockRemoved { block_hashes: vec![6], medium: "DISK" },
            KvEvent::AllBlocksCleared,
        ];
        let b = decode_batch(9, &encode_batch(1.5, &events, 3)).unwrap();
        assert_eq!(b, Batch { seq: 9, ts: 1.5, events, data_parallel_rank: Some(3) });
        assert!(decode_batch(0, &[0x93, 0xcb]).is_err());
        assert!(decode_batch(0, &encode_batch(1.0, &[], 0)[..5]).is_err());
    }

    #[test]
    fn a_subscription_reads_live_batches_and_replays_the_missed_ones() {
        let cfg = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv@w1"}"#,
        )
        .unwrap()
        .unwrap();
        let p = Publisher::start(&cfg).unwrap();
        let at = SocketAddr::from(([127, 0, 0, 1], p.pub_addr().unwrap().port()));
        let mut sub = Subscription::connect(at, b"kv@", Duration::from_secs(5)).unwrap();
        // The subscription takes effect on the publisher's side a little later: publish until one
        // arrives.
        let until = Instant::now() + Duration::from_secs(20);
        let first = loop {
            p.publish(vec![KvEvent::AllBlocksCleared]);
            if let Some(b) = sub.next(Duration::from_millis(50)).unwrap() {
                break b;
            }
            assert!(Instant::now() < until, "nothing reached the subscriber");
        };
        assert_eq!(first.events, vec![KvEvent::AllBlocksCleared]);
        let stored = KvEvent::stored(vec![1, 2], None, (0..32).collect(), 16);
        p.publish(vec![stored.clone()]);
        let next = loop {
            let b = sub.next(Duration::from_secs(5)).unwrap().expect("a batch");
            if b.events != vec![KvEvent::AllBlocksCleared] {
                break b;
            }
        };
        assert_eq!(next.events, vec![stored.clone()]);
        let replayed = replay(p.replay_addr().unwrap(), 0, Duration::from_secs(5)).unwrap();
        assert_eq!(replayed.first().map(|b| b.seq), Some(0), "from the first batch");
        assert_eq!(replayed.last(), Some(&next));
        assert!(replayed.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        let tail = replay(p.replay_addr().unwrap(), next.seq, Duration::from_secs(5)).unwrap();
        assert_eq!(tail, vec![next]);
    }
}
