//! Connections to workers: [`Upstream`], one non-blocking connection driven by the router's loop
//! (connect, write one request, decode its response piece by piece; readiness events are hints and
//! every call tolerates spurious ones), and [`Upstreams`], the slots they live in, who owns each, and
//! each worker's bounded pool of idle ones.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Instant;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use pdserve_http::{HttpError, Limits, ResponseDecoder, ResponseEvent, Server};

use crate::flight::LegId;
use crate::workers::Workers;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The TCP connect is in progress.
    Connecting,
    /// Connected; a request is being written or its response read.
    Busy,
    /// In the pool, waiting for the next request.
    Idle,
}

/// What went wrong on a connection, and whether the worker may have seen the request.
#[derive(Debug)]
pub(crate) enum UpError {
    /// The connection never came up (refused, unreachable): nothing was sent.
    Connect(io::Error),
    /// Reading or writing failed after the request was (partly) sent.
    Io(io::Error),
    /// The worker closed the connection before the response ended.
    Closed,
    /// The response was malformed.
    Protocol(HttpError),
}

impl std::fmt::Display for UpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpError::Connect(e) => write!(f, "connect failed: {e}"),
            UpError::Io(e) => write!(f, "connection failed: {e}"),
            UpError::Closed => write!(f, "worker closed the connection before the response ended"),
            UpError::Protocol(e) => write!(f, "malformed response: {e}"),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Upstream {
    pub stream: TcpStream,
    pub worker: u32,
    pub phase: Phase,
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
            phase: Phase::Connecting,
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
    pub fn send(&mut self, request: Vec<u8>, head_request: bool) -> Result<(), UpError> {
        self.out = request;
        self.out_pos = 0;
        self.decoder = ResponseDecoder::new(self.limits, head_request);
        self.bytes_in = 0;
        self.reused = self.phase == Phase::Idle;
        if self.phase == Phase::Idle {
            self.phase = Phase::Busy;
        }
        if self.phase == Phase::Busy {
            self.flush()?;
        }
        Ok(())
    }

    /// Called on a writable event while connecting: finishes the connect. `Ok(false)`: still pending.
    pub fn finish_connect(&mut self) -> Result<bool, UpError> {
        if let Ok(Some(e)) | Err(e) = self.stream.take_error() {
            return Err(UpError::Connect(e));
        }
        match self.stream.peer_addr() {
            Ok(_) => {
                self.phase = Phase::Busy;
                let _ = self.stream.set_nodelay(true);
                self.flush()?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(UpError::Connect(e)),
        }
    }

    /// Writes buffered request bytes until done or the socket is full.
    pub fn flush(&mut self) -> Result<(), UpError> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(UpError::Closed),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(UpError::Io(e)),
            }
        }
        if !self.out.is_empty() {
            self.out = Vec::new();
            self.out_pos = 0;
        }
        Ok(())
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
    ) -> Result<(), UpError> {
        loop {
            match self.stream.read(buf) {
                Ok(0) => {
                    self.drain(events)?;
                    while !self.decoder.is_done() {
                        match self.decoder.handle_eof() {
                            Ok(Some(ev)) => events.push(ev),
                            Ok(None) => break,
                            Err(HttpError::UnexpectedEof) => return Err(UpError::Closed),
                            Err(e) => return Err(UpError::Protocol(e)),
                        }
                    }
                    return if self.decoder.is_done() { Ok(()) } else { Err(UpError::Closed) };
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
                Err(e) => return Err(UpError::Io(e)),
            }
        }
    }

    fn drain(&mut self, events: &mut Vec<ResponseEvent>) -> Result<(), UpError> {
        while let Some(ev) = self.decoder.poll().map_err(UpError::Protocol)? {
            events.push(ev);
        }
        Ok(())
    }

    /// The request went out on a pooled connection and failed before any response byte: the worker
    /// closed the connection while it was idle (a restart, its keep-alive timeout) and cannot have
    /// answered, so the request may be sent again on a new connection.
    pub fn stale(&self) -> bool {
        self.reused && self.bytes_in == 0
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

/// Who a connection slot works for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Idle in its worker's pool, or free.
    None,
    /// A leg of a flight.
    Leg { flight: u64, leg: LegId },
    /// A health probe of the worker.
    Probe { worker: u32 },
    /// A `POST /abort/{id}` whose answer is read and dropped.
    Abort,
    /// A `/debug/requests` fan-out.
    Collect { id: u64, worker: u32 },
}

/// Why no connection could be had.
#[derive(Debug)]
pub(crate) enum AcquireError {
    /// The worker left the registry.
    Gone,
    /// All of the worker's connections are busy (not a failure of the worker).
    PoolFull { max: usize, url: String },
    /// The connect failed at once.
    Connect { addr: SocketAddr, error: io::Error },
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::Gone => write!(f, "worker is gone"),
            AcquireError::PoolFull { max, url } => {
                write!(f, "all {max} pooled connections to {url} are busy")
            }
            AcquireError::Connect { addr, error } => write!(f, "connect to {addr} failed: {error}"),
        }
    }
}

/// Every upstream connection of the router, in slots addressed by the mio token they register with.
#[derive(Debug, Default)]
pub(crate) struct Upstreams {
    slots: Vec<Option<Upstream>>,
    owners: Vec<Owner>,
    free: Vec<usize>,
}

impl Upstreams {
    pub fn get_mut(&mut self, slot: usize) -> Option<&mut Upstream> {
        self.slots.get_mut(slot).and_then(Option::as_mut)
    }

    pub fn get(&self, slot: usize) -> Option<&Upstream> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    pub fn owner(&self, slot: usize) -> Owner {
        self.owners.get(slot).copied().unwrap_or(Owner::None)
    }

    pub fn set_owner(&mut self, slot: usize, owner: Owner) {
        if let Some(o) = self.owners.get_mut(slot) {
            *o = owner;
        }
    }

    /// Open connections.
    pub fn count(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Slots whose timer has passed, with their phase.
    pub fn due(&self, now: Instant) -> Vec<(usize, Phase)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, u)| u.as_ref().filter(|u| u.timer <= now).map(|u| (i, u.phase)))
            .collect()
    }

    /// A connection to `worker`: a pooled idle one, or a new one under the worker's bound.
    pub fn acquire(
        &mut self,
        workers: &mut Workers,
        worker: u32,
        server: &Server,
        limits: Limits,
        connect_deadline: Instant,
        max: usize,
    ) -> Result<usize, AcquireError> {
        let w = workers.get_mut(worker).ok_or(AcquireError::Gone)?;
        if let Some(slot) = w.idle.pop() {
            return Ok(slot);
        }
        if w.connections >= max {
            return Err(AcquireError::PoolFull { max, url: w.url.clone() });
        }
        let addr = w.addr;
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.owners.push(Owner::None);
                self.slots.len() - 1
            }
        };
        match Upstream::connect(
            addr,
            worker,
            server.registry(),
            Server::app_token(slot),
            limits,
            connect_deadline,
        ) {
            Ok(up) => {
                self.slots[slot] = Some(up);
                w.connections += 1;
                Ok(slot)
            }
            Err(error) => {
                self.free.push(slot);
                Err(AcquireError::Connect { addr, error })
            }
        }
    }

    /// Closes the connection in `slot` (never reused).
    pub fn close(&mut self, slot: usize, registry: &Registry, workers: &mut Workers) {
        if let Some(mut up) = self.slots.get_mut(slot).and_then(Option::take) {
            let _ = registry.deregister(&mut up.stream);
            if let Some(w) = workers.get_mut(up.worker) {
                w.connections = w.connections.saturating_sub(1);
                w.idle.retain(|&s| s != slot);
            }
            self.owners[slot] = Owner::None;
            self.free.push(slot);
        }
    }

    /// Returns a connection whose response ended cleanly to its worker's pool (until `idle_until`), or
    /// closes it.
    pub fn release(&mut self, slot: usize, registry: &Registry, workers: &mut Workers, idle_until: Instant) {
        let Some(up) = self.get_mut(slot) else { return };
        let worker = up.worker;
        let keep = up.reusable() && workers.get(worker).is_some_and(|w| !w.draining);
        if !keep {
            return self.close(slot, registry, workers);
        }
        up.phase = Phase::Idle;
        up.timer = idle_until;
        self.owners[slot] = Owner::None;
        if let Some(w) = workers.get_mut(worker) {
            w.idle.push(slot);
        }
    }

    /// Closes every idle connection of `worker` (they are as old as one it closed, or it is leaving).
    pub fn close_idle(&mut self, worker: u32, registry: &Registry, workers: &mut Workers) {
        let idle = workers.get(worker).map(|w| w.idle.clone()).unwrap_or_default();
        for slot in idle {
            self.close(slot, registry, workers);
        }
    }
}
