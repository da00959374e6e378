//! TCP transport for KV transfers, driven from the engine thread (which owns the KV memory): a mio
//! poll over the transfer listener (prefill role) and transfer connections, non-blocking, polled with
//! a zero or short timeout between engine steps. Frames are `pdserve-pd-transfer`'s.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Poll, Token};
use pdserve_pd_transfer::{decode, encode, Message, PeerId};

const LISTENER: Token = Token(usize::MAX);

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
}

/// One received frame, owned.
#[derive(Debug)]
pub(crate) struct Received {
    pub peer: PeerId,
    pub msg: Message,
    pub data: Vec<u8>,
}

#[derive(Debug)]
pub(crate) struct TransferIo {
    poll: Poll,
    events: mio::Events,
    listener: Option<TcpListener>,
    conns: HashMap<u64, Conn>,
    next_peer: u64,
    lost: Vec<PeerId>,
}

impl TransferIo {
    /// `listen`: the prefill role's transfer address; `None` for the decode role (it only connects).
    pub(crate) fn new(listen: Option<SocketAddr>) -> io::Result<TransferIo> {
        let poll = Poll::new()?;
        let listener = match listen {
            Some(addr) => {
                let mut l = TcpListener::bind(addr)?;
                poll.registry().register(&mut l, LISTENER, Interest::READABLE)?;
                Some(l)
            }
            None => None,
        };
        Ok(TransferIo {
            poll,
            events: mio::Events::with_capacity(256),
            listener,
            conns: HashMap::new(),
            next_peer: 1,
            lost: Vec::new(),
        })
    }

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
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

    /// Opens a connection to a prefill worker's transfer address.
    pub(crate) fn connect(&mut self, addr: SocketAddr) -> io::Result<PeerId> {
        let stream = TcpStream::connect(addr)?;
        self.add(stream)
    }

    /// Queues a frame for `peer` and writes what the socket takes now.
    pub(crate) fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]) {
        let Some(c) = self.conns.get_mut(&peer.0) else { return };
        encode(msg, data, &mut c.out);
        self.flush(peer.0);
    }

    pub(crate) fn close(&mut self, peer: PeerId) {
        if let Some(mut c) = self.conns.remove(&peer.0) {
            // Best effort: what is queued (an Abort, a Done) goes out before the close.
            let _ = c.stream.set_nodelay(true);
            let _ = c.stream.write_all(&c.out[c.out_pos..]);
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
    }

    /// Connections whose peer went away since the last call.
    pub(crate) fn take_lost(&mut self) -> Vec<PeerId> {
        std::mem::take(&mut self.lost)
    }

    fn lose(&mut self, id: u64) {
        if let Some(mut c) = self.conns.remove(&id) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            self.lost.push(PeerId(id));
        }
    }

    fn flush(&mut self, id: u64) {
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

    /// Runs the sockets for up to `timeout` and returns the frames that arrived.
    pub(crate) fn pump(&mut self, timeout: Duration) -> Vec<Received> {
        let mut got = Vec::new();
        if self.poll.poll(&mut self.events, Some(timeout)).is_err() {
            return got;
        }
        let ready: Vec<(Token, bool, bool)> = self
            .events
            .iter()
            .map(|e| (e.token(), e.is_readable() || e.is_read_closed() || e.is_error(), e.is_writable()))
            .collect();
        for (token, readable, writable) in ready {
            if token == LISTENER {
                while let Some(Ok((s, _))) = self.listener.as_ref().map(|l| l.accept()) {
                    let _ = self.add(s);
                }
                continue;
            }
            let id = token.0 as u64;
            if writable {
                self.flush(id);
            }
            if readable {
                self.read(id, &mut got);
            }
        }
        got
    }

    fn read(&mut self, id: u64, got: &mut Vec<Received>) {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let Some(c) = self.conns.get_mut(&id) else { return };
            match c.stream.read(&mut buf) {
                Ok(0) => break self.decode_all(id, got, true),
                Ok(n) => c.inbuf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break self.decode_all(id, got, false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break self.decode_all(id, got, true),
            }
        }
    }

    fn decode_all(&mut self, id: u64, got: &mut Vec<Received>, closed: bool) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let mut pos = 0;
        let mut bad = false;
        loop {
            match decode(&c.inbuf[pos..]) {
                Ok(Some(f)) => {
                    got.push(Received { peer: PeerId(id), msg: f.msg, data: f.data.to_vec() });
                    pos += f.consumed;
                }
                Ok(None) => break,
                Err(_) => {
                    bad = true;
                    break;
                }
            }
        }
        c.inbuf.drain(..pos);
        if closed || bad {
            self.lose(id);
        }
    }
}
