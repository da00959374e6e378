//! One non-blocking connection to an upstream server, for programs that run their own mio loop (the
//! router): connect, write one request, decode its response piece by piece. Readiness events are
//! hints; every call tolerates spurious ones. It follows the same rule as [`crate::HttpClient`]: a
//! request on a pooled connection that fails before any response byte was never taken by the server
//! ([`Upstream::stale`]), so it may be sent again.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Instant;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};

use crate::{HttpError, Limits, ResponseDecoder, ResponseEvent};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamPhase {
    /// The TCP connect is in progress.
    Connecting,
    /// Connected; a request is being written or its response read.
    Busy,
    /// In the pool, waiting for the next request.
    Idle,
}

#[derive(Debug)]
pub struct Upstream {
    pub stream: TcpStream,
    pub worker: u32,
    pub phase: UpstreamPhase,
    out: Vec<u8>,
    out_pos: usize,
    decoder: ResponseDecoder,
    limits: Limits,
    /// When the connect must have finished, or when an idle connection expires.
    pub timer: Instant,
    /// The status of the response being read, for owners that only need the verdict (probes).
    pub status: u16,
    /// The current request went out on a connection taken from the idle pool.
    reused: bool,
    /// Response bytes received for the current request.
    bytes_in: usize,
}

impl Upstream {
    /// Starts connecting to `addr` and registers for both directions under `token`.
    pub fn connect(
        addr: SocketAddr,
        worker: u32,
        registry: &Registry,
        token: Token,
        limits: Limits,
        connect_deadline: Instant,
    ) -> io::Result<Upstream> {
        let mut stream = TcpStream::connect(addr)?;
        registry.register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)?;
        Ok(Upstream {
            stream,
            worker,
            phase: UpstreamPhase::Connecting,
            out: Vec::new(),
            out_pos: 0,
            decoder: ResponseDecoder::new(limits, false),
            limits,
            timer: connect_deadline,
            status: 0,
            reused: false,
            bytes_in: 0,
        })
    }

    /// Queues a request (wire bytes) on a connected or connecting connection; writes what it can now.
    pub fn send(&mut self, request: Vec<u8>, head_request: bool) -> Result<(), HttpError> {
        self.out = request;
        self.out_pos = 0;
        self.decoder = ResponseDecoder::new(self.limits, head_request);
        self.bytes_in = 0;
        self.reused = self.phase == UpstreamPhase::Idle;
        if self.phase == UpstreamPhase::Idle {
            self.phase = UpstreamPhase::Busy;
        }
        if self.phase == UpstreamPhase::Busy {
            self.flush()?;
        }
        Ok(())
    }

    /// Called on a writable event while connecting: finishes the connect. `Ok(false)`: still pending.
    pub fn finish_connect(&mut self) -> Result<bool, HttpError> {
        if let Ok(Some(e)) | Err(e) = self.stream.take_error() {
            return Err(HttpError::Connect(e));
        }
        match self.stream.peer_addr() {
            Ok(_) => {
                self.phase = UpstreamPhase::Busy;
                let _ = self.stream.set_nodelay(true);
                self.flush()?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(HttpError::Connect(e)),
        }
    }

    /// Writes buffered request bytes until done or the socket is full.
    pub fn flush(&mut self) -> Result<(), HttpError> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(HttpError::UnexpectedEof),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(HttpError::Io(e)),
            }
        }
        Ok(())
    }

    /// The request this connection carried (kept until the next `send`), to send it again on a new
    /// connection when this one turned out [`stale`](Self::stale).
    pub fn take_request(&mut self) -> Vec<u8> {
        self.out_pos = 0;
        std::mem::take(&mut self.out)
    }

    /// Reads what has arrived and appends the decoded response events to `events`. `Err` ends the
    /// connection; events decoded before the error are still appended.
    /// `drain`: read until the socket would block (the peer closed); otherwise a short read ends the
    /// turn (edge-triggered readiness raises a new event for later bytes).
    pub fn read(
        &mut self,
        buf: &mut [u8],
        events: &mut Vec<ResponseEvent>,
        drain: bool,
    ) -> Result<(), HttpError> {
        loop {
            match self.stream.read(buf) {
                Ok(0) => {
                    self.drain(events)?;
                    while !self.decoder.is_done() {
                        match self.decoder.handle_eof() {
                            Ok(Some(ev)) => events.push(ev),
                            Ok(None) => break,
                            Err(e) => return Err(e),
                        }
                    }
                    return if self.decoder.is_done() { Ok(()) } else { Err(HttpError::UnexpectedEof) };
                }
                Ok(n) => {
                    self.bytes_in += n;
                    self.decoder.push(&buf[..n]);
                    self.drain(events)?;
                    if self.decoder.is_done() || (!drain && n < buf.len()) {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(HttpError::Io(e)),
            }
        }
    }

    fn drain(&mut self, events: &mut Vec<ResponseEvent>) -> Result<(), HttpError> {
        while let Some(ev) = self.decoder.poll()? {
            events.push(ev);
        }
        Ok(())
    }

    /// The request went out on a pooled connection that failed with `err` before any response byte,
    /// and `err` says the worker closed it ([`HttpError::peer_closed`]): the worker closed the
    /// connection while it was idle (a restart, its keep-alive timeout) and never took the request, so
    /// it may be sent again on a new connection. (A timeout is not stale: the worker may be working.)
    pub fn stale(&self, err: &HttpError) -> bool {
        self.reused && self.bytes_in == 0 && err.peer_closed()
    }

    /// The response ended cleanly and the connection may carry another request.
    pub fn reusable(&self) -> bool {
        self.decoder.is_reusable() && self.out_pos >= self.out.len()
    }

    /// An idle connection got readable: the worker closed it (or sent garbage). Either way it is done.
    pub fn idle_is_dead(&mut self, buf: &mut [u8]) -> bool {
        !matches!(self.stream.read(buf), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}
