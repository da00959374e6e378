//! Frames over TCP, non-blocking, on a mio poll of its own: a listener on the sending side, one
//! connection per pull. Block bytes travel inline; a named block (`BlockAt`) is handed over as the
//! message it is (a transport that can read the sender's memory resolves it, see
//! [`SharedMemoryTransport`](super::SharedMemoryTransport)).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::{Arrival, Connected, Transport};
use crate::{decode, encode, Message, PeerId};

const LISTENER: Token = Token(usize::MAX);
/// Bytes read per `read` call; a frame larger than this arrives over several.
const READ_BYTES: usize = 256 * 1024;
/// Queued bytes that are written at once rather than at the next flush: a block's frame, or many
/// small frames. Smaller frames wait for [`Transport::flush`] and go out together (a 2,048-token
/// pull names 128 blocks: one write instead of 128).
const WRITE_NOW_BYTES: usize = 64 * 1024;

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
}

/// The TCP transport. See the [module docs](super).
#[derive(Debug)]
pub struct TcpTransport {
    poll: Poll,
    events: Events,
    listener: Option<TcpListener>,
    conns: HashMap<u64, Conn>,
    next_peer: u64,
    lost: Vec<PeerId>,
    read_buf: Vec<u8>,
}

impl TcpTransport {
    /// `listen`: the sending side's address (port 0 picks one); `None` on a side that only connects.
    pub fn bind(listen: Option<SocketAddr>) -> io::Result<TcpTransport> {
        let poll = Poll::new()?;
        let listener = match listen {
            Some(addr) => {
                let mut l = TcpListener::bind(addr)?;
                poll.registry().register(&mut l, LISTENER, Interest::READABLE)?;
                Some(l)
            }
            None => None,
        };
        Ok(TcpTransport {
            poll,
            events: Events::with_capacity(256),
            listener,
            conns: HashMap::new(),
            next_peer: 1,
            lost: Vec::new(),
            read_buf: vec![0; READ_BYTES],
        })
    }

    fn add(&mut self, mut stream: TcpStream) -> io::Result<PeerId> {
        let id = self.next_peer;
        self.next_peer += 1;
        self.poll.registry().register(
            &mut stream,
            Token(id as usize),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        let _ = stream.set_nodelay(true);
        self.conns.insert(id, Conn { stream, inbuf: Vec::new(), out: Vec::new(), out_pos: 0 });
        Ok(PeerId(id))
    }

    fn lose(&mut self, id: u64) {
        if let Some(mut c) = self.conns.remove(&id) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            self.lost.push(PeerId(id));
        }
    }

    fn flush_peer(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        while c.out_pos < c.out.len() {
            match c.stream.write(&c.out[c.out_pos..]) {
                Ok(0) => return self.lose(id),
                Ok(n) => c.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.lose(id),
            }
        }
        c.out.clear();
        c.out_pos = 0;
    }

    /// Reads what `id` sent and hands over every whole frame; `false` if the connection is gone.
    fn read(&mut self, id: u64, on: &mut dyn FnMut(Arrival<'_>)) -> bool {
        let Some(c) = self.conns.get_mut(&id) else { return false };
        let buf = &mut self.read_buf;
        let mut closed = false;
        loop {
            match c.stream.read(buf) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => c.inbuf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let peer = PeerId(id);
        let mut pos = 0;
        let mut bad = false;
        loop {
            match decode(&c.inbuf[pos..]) {
                Ok(Some(f)) => {
                    pos += f.consumed;
                    match f.msg {
                        Message::Block { key, index, crc, .. } => {
                            on(Arrival::Block { peer, key, index, data: f.data, crc: Some(crc) })
                        }
                        msg => on(Arrival::Message { peer, msg }),
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    bad = true;
                    break;
                }
            }
        }
        c.inbuf.drain(..pos);
        !(closed || bad)
    }
}

impl Transport for TcpTransport {
    fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Block bytes always come inline over TCP: `region` is not used.
    fn connect(&mut self, addr: SocketAddr, _region: Option<&str>) -> io::Result<Connected> {
        let peer = self.add(TcpStream::connect(addr)?)?;
        Ok(Connected { peer, named_blocks: false })
    }

    fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]) {
        let Some(c) = self.conns.get_mut(&peer.0) else { return };
        encode(msg, data, &mut c.out);
        if c.out.len() - c.out_pos >= WRITE_NOW_BYTES {
            self.flush_peer(peer.0);
        }
    }

    fn flush(&mut self) {
        let queued: Vec<u64> =
            self.conns.iter().filter(|(_, c)| c.out_pos < c.out.len()).map(|(&id, _)| id).collect();
        for id in queued {
            self.flush_peer(id);
        }
    }

    fn close(&mut self, peer: PeerId) {
        if let Some(mut c) = self.conns.remove(&peer.0) {
            // Best effort: what is queued (an Abort, a Done) goes out before the close.
            let _ = c.stream.write_all(&c.out[c.out_pos..]);
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
    }

    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> io::Result<()> {
        // Nothing queued waits out a poll unwritten, whoever forgot to flush.
        Transport::flush(self);
        self.poll.poll(&mut self.events, Some(wait))?;
        let ready: Vec<(Token, bool, bool)> = self
            .events
            .iter()
            .map(|e| (e.token(), e.is_readable() || e.is_read_closed() || e.is_error(), e.is_writable()))
            .collect();
        for (token, readable, writable) in ready {
            if token == LISTENER {
                while let Some(Ok((s, _))) = self.listener.as_ref().map(TcpListener::accept) {
                    let _ = self.add(s);
                }
                continue;
            }
            let id = token.0 as u64;
            if writable {
                self.flush_peer(id);
            }
            if readable && !self.read(id, on) {
                self.lose(id);
            }
        }
        for peer in std::mem::take(&mut self.lost) {
            on(Arrival::Lost { peer });
        }
        Ok(())
    }
}
