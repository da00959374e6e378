//! A single-threaded mio server loop that hands complete requests to the application.
//!
//! The application owns the loop: it calls [`Server::poll`], handles the [`Event`]s, and answers through
//! [`Server::respond`] or the streaming calls, now or on a later turn (other threads wake the loop with
//! [`Server::waker`]). The server enforces every limit in [`ServerConfig`] itself: decoding limits answer
//! 400/413/414/431, a head that does not arrive in time answers 408, a connection over the maximum answers
//! 503 with `Retry-After`; each of those closes the connection after the answer is flushed.
//!
//! Order of calls per turn: `poll` (fills `events`), then any number of `respond` / `start_stream` /
//! `send_chunk` / `end_stream` / `close` for connections that have a request outstanding.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Poll, Token, Waker};
use pdserve_api::{ApiError, ErrorKind};

use crate::response::{write_head, BodyKind};
use crate::{
    write_chunk, write_last_chunk, HttpError, Request, RequestDecoder, Response, ServerConfig, Status,
};

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX);
/// Timeouts are checked at this granularity at the finest.
const TIMER_SLACK: Duration = Duration::from_millis(5);

/// Identifies one connection; stale after the connection closes (the slot's generation moves on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId {
    slot: u32,
    gen: u32,
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn-{}.{}", self.slot, self.gen)
    }
}

/// What the loop reports to the application.
#[derive(Debug)]
pub enum Event {
    /// A complete request. Exactly one response (or [`Server::close`]) is expected for it.
    Request { conn: ConnId, request: Request },
    /// The client went away while its request was outstanding: abort the work behind it.
    Disconnected { conn: ConnId, reason: DisconnectReason },
    /// Readiness of a source the application registered itself (see [`Server::registry`]), for
    /// example an upstream connection a proxy drives in the same loop. `token` is the application's own
    /// number, as given to [`Server::app_token`].
    /// `read_closed`: the peer closed its side or the socket errored, so a reader should read to the end.
    Io { token: usize, readable: bool, writable: bool, read_closed: bool },
}

/// Application tokens are mapped above this value; connection slots stay below it.
const APP_TOKEN_BASE: usize = 1 << 40;

/// Why an outstanding request's connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisconnectReason {
    /// The client closed its side.
    ClientClosed,
    /// Reading or writing failed (reset, broken pipe).
    IoError(io::ErrorKind),
}

/// Counters of what the loop did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    pub connections_accepted_total: u64,
    pub connections_rejected_total: u64,
    pub requests_total: u64,
    pub bad_requests_total: u64,
    pub header_timeouts_total: u64,
    pub idle_timeouts_total: u64,
    pub disconnects_total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Between requests on a kept-alive connection (or freshly accepted).
    Idle,
    /// Part of a request has arrived.
    Reading,
    /// A request was handed to the application; `streaming` once a chunked head went out.
    Responding { keep_alive: bool, streaming: bool },
    /// Flush what is buffered, then half-close and linger.
    Closing,
    /// Written side shut; discarding input until the client closes or the linger deadline.
    Lingering,
}

#[derive(Debug)]
struct Conn {
    gen: u32,
    stream: TcpStream,
    decoder: RequestDecoder,
    out: Vec<u8>,
    out_pos: usize,
    phase: Phase,
    deadline: Option<Instant>,
    read_paused: bool,
}

impl Conn {
    fn unsent(&self) -> usize {
        self.out.len() - self.out_pos
    }
}

/// The server loop. See the module docs for the order of calls.
#[derive(Debug)]
pub struct Server {
    config: ServerConfig,
    poll: Poll,
    mio_events: mio::Events,
    listener: TcpListener,
    waker: Arc<Waker>,
    slots: Vec<Option<Conn>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    live: usize,
    to_parse: Vec<u32>,
    pending: Vec<Event>,
    next_timer_check: Instant,
    accept_backlog: bool,
    stats: ServerStats,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)).
    pub fn bind(addr: SocketAddr, config: ServerConfig) -> io::Result<Server> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::bind(addr)?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        Ok(Server {
            config,
            poll,
            mio_events: mio::Events::with_capacity(1024),
            listener,
            waker,
            slots: Vec::new(),
            gens: Vec::new(),
            free: Vec::new(),
            live: 0,
            to_parse: Vec::new(),
            pending: Vec::new(),
            next_timer_check: Instant::now() + Duration::from_secs(3600),
            accept_backlog: false,
            stats: ServerStats::default(),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// A handle other threads use to wake [`poll`](Self::poll) (after queueing work for the loop).
    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }

    /// The loop's registry, for sources the application drives itself (register them with
    /// [`Server::app_token`]; their readiness comes back as [`Event::Io`]).
    pub fn registry(&self) -> &mio::Registry {
        self.poll.registry()
    }

    /// The mio token for the application's source number `token` (below 2^40).
    pub fn app_token(token: usize) -> Token {
        assert!(token < APP_TOKEN_BASE, "application token {token} out of range");
        Token(APP_TOKEN_BASE + token)
    }

    pub fn stats(&self) -> ServerStats {
        self.stats
    }

    /// Open client connections.
    pub fn connection_count(&self) -> usize {
        self.live
    }

    /// Waits up to `timeout` (`None`: until something happens) for I/O, runs it, and appends what the
    /// application must handle to `events`. Returns early when woken.
    pub fn poll(&mut self, events: &mut Vec<Event>, timeout: Option<Duration>) -> io::Result<()> {
        let now = Instant::now();
        self.parse_queued(now);
        let mut timeout = timeout;
        if !self.pending.is_empty() || self.accept_backlog {
            timeout = Some(if self.pending.is_empty() { Duration::from_millis(10) } else { Duration::ZERO });
        }
        let until_timer = self.next_timer_check.saturating_duration_since(now);
        timeout = Some(timeout.map_or(until_timer, |t| t.min(until_timer)));
        let mut mio_events = std::mem::replace(&mut self.mio_events, mio::Events::with_capacity(0));
        let polled = self.poll.poll(&mut mio_events, timeout);
        let result = match polled {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            other => other,
        };
        if result.is_ok() {
            let now = Instant::now();
            for ev in mio_events.iter() {
                match ev.token() {
                    LISTENER => self.accept_all(now),
                    WAKER => {}
                    Token(t) if t >= APP_TOKEN_BASE => self.pending.push(Event::Io {
                        token: t - APP_TOKEN_BASE,
                        readable: ev.is_readable() || ev.is_read_closed() || ev.is_error(),
                        writable: ev.is_writable() || ev.is_write_closed(),
                        read_closed: ev.is_read_closed() || ev.is_error(),
                    }),
                    Token(t) => {
                        let slot = t as u32;
                        if ev.is_writable() {
                            self.flush(slot, now);
                        }
                        if ev.is_read_closed() || ev.is_error() {
                            self.read(slot, now, true);
                        } else if ev.is_readable() {
                            self.read(slot, now, false);
                        }
                    }
                }
            }
            if self.accept_backlog {
                self.accept_all(now);
            }
            if now >= self.next_timer_check {
                self.check_timers(now);
            }
        }
        self.mio_events = mio_events;
        events.append(&mut self.pending);
        result
    }

    /// Writes a whole response and ends the request.
    pub fn respond(&mut self, conn: ConnId, response: &Response) -> Result<(), HttpError> {
        let c = self.responding(conn)?;
        let Phase::Responding { keep_alive, streaming: false } = c.phase else {
            return Err(HttpError::NotResponding);
        };
        response.write_to(&mut c.out, keep_alive);
        self.finish_response(conn.slot);
        Ok(())
    }

    /// Starts a chunked response (for SSE: `content-type: text/event-stream`).
    pub fn start_stream(
        &mut self,
        conn: ConnId,
        status: u16,
        headers: &[(&str, &str)],
    ) -> Result<(), HttpError> {
        let c = self.responding(conn)?;
        let Phase::Responding { keep_alive, streaming: false } = c.phase else {
            return Err(HttpError::NotResponding);
        };
        write_head(&mut c.out, status, headers, BodyKind::Chunked, keep_alive);
        c.phase = Phase::Responding { keep_alive, streaming: true };
        self.flush(conn.slot, Instant::now());
        Ok(())
    }

    /// Sends one chunk of a started stream. Refused with [`HttpError::Backpressure`] while the client
    /// leaves `write_buffer_bytes_max` bytes unread.
    pub fn send_chunk(&mut self, conn: ConnId, data: &[u8]) -> Result<(), HttpError> {
        let max = self.config.write_buffer_bytes_max;
        let c = self.responding(conn)?;
        let Phase::Responding { streaming: true, .. } = c.phase else { return Err(HttpError::NotResponding) };
        if c.unsent() >= max {
            return Err(HttpError::Backpressure { buffered_bytes: c.unsent() });
        }
        write_chunk(&mut c.out, data);
        self.flush(conn.slot, Instant::now());
        self.check_alive(conn)
    }

    /// Ends a started stream.
    pub fn end_stream(&mut self, conn: ConnId) -> Result<(), HttpError> {
        let c = self.responding(conn)?;
        let Phase::Responding { streaming: true, .. } = c.phase else { return Err(HttpError::NotResponding) };
        write_last_chunk(&mut c.out);
        self.finish_response(conn.slot);
        Ok(())
    }

    /// Closes the connection at once, dropping anything unsent (for a stream that cannot be finished).
    /// No [`Event::Disconnected`] follows. Unknown or stale ids are ignored.
    pub fn close(&mut self, conn: ConnId) {
        if self.get(conn).is_some() {
            self.drop_conn(conn.slot, None);
        }
    }

    /// Unsent bytes on every connection together (a process that stops waits for them to go out).
    pub fn unsent_total(&self) -> usize {
        self.slots.iter().flatten().map(Conn::unsent).sum()
    }

    /// Unsent bytes on a connection, for a caller that paces a stream.
    pub fn unsent_bytes(&self, conn: ConnId) -> Option<usize> {
        self.slots.get(conn.slot as usize)?.as_ref().filter(|c| c.gen == conn.gen).map(Conn::unsent)
    }

    fn get(&mut self, conn: ConnId) -> Option<&mut Conn> {
        self.slots.get_mut(conn.slot as usize)?.as_mut().filter(|c| c.gen == conn.gen)
    }

    fn responding(&mut self, conn: ConnId) -> Result<&mut Conn, HttpError> {
        let c = self.get(conn).ok_or(HttpError::Gone)?;
        match c.phase {
            Phase::Responding { .. } => Ok(c),
            _ => Err(HttpError::NotResponding),
        }
    }

    fn check_alive(&mut self, conn: ConnId) -> Result<(), HttpError> {
        self.get(conn).map(|_| ()).ok_or(HttpError::Gone)
    }

    fn finish_response(&mut self, slot: u32) {
        let now = Instant::now();
        let Some(c) = self.slots[slot as usize].as_mut() else { return };
        let Phase::Responding { keep_alive, .. } = c.phase else { return };
        if keep_alive {
            c.phase = Phase::Idle;
            let deadline = now + self.config.idle_timeout;
            c.deadline = Some(deadline);
            self.next_timer_check = self.next_timer_check.min(deadline);
            // Pipelined bytes may already hold the next request.
            self.to_parse.push(slot);
        } else {
            c.phase = Phase::Closing;
            let deadline = now + self.config.linger_timeout;
            c.deadline = Some(deadline);
            self.next_timer_check = self.next_timer_check.min(deadline);
        }
        self.flush(slot, now);
    }

    fn accept_all(&mut self, now: Instant) {
        self.accept_backlog = false;
        loop {
            let (mut stream, _) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    // Out of descriptors or a similar condition: try again shortly rather than lose the
                    // edge-triggered readiness.
                    self.accept_backlog = true;
                    return;
                }
            };
            if self.live >= self.config.connections_max {
                self.stats.connections_rejected_total += 1;
                let reply = ApiError::new(
                    ErrorKind::NoCapacity,
                    format!("server is at its connection limit ({})", self.config.connections_max),
                )
                .with_retry_after(self.config.retry_after_s);
                let mut out = Vec::new();
                Response::error(&reply, None).write_to(&mut out, false);
                // Best effort: a fresh socket's send buffer takes a small answer whole.
                let _ = stream.write(&out);
                let _ = stream.shutdown(Shutdown::Write);
                continue;
            }
            let _ = stream.set_nodelay(true);
            let slot = match self.free.pop() {
                Some(s) => s,
                None => {
                    self.slots.push(None);
                    self.gens.push(0);
                    (self.slots.len() - 1) as u32
                }
            };
            if self
                .poll
                .registry()
                .register(&mut stream, Token(slot as usize), Interest::READABLE | Interest::WRITABLE)
                .is_err()
            {
                self.free.push(slot);
                continue;
            }
            self.gens[slot as usize] = self.gens[slot as usize].wrapping_add(1);
            let deadline = now + self.config.header_read_timeout;
            self.next_timer_check = self.next_timer_check.min(deadline);
            self.slots[slot as usize] = Some(Conn {
                gen: self.gens[slot as usize],
                stream,
                decoder: RequestDecoder::new(self.config.limits),
                out: Vec::new(),
                out_pos: 0,
                phase: Phase::Idle,
                deadline: Some(deadline),
                read_paused: false,
            });
            self.live += 1;
            self.stats.connections_accepted_total += 1;
        }
    }

    /// Reads what the socket holds. `drain`: read until the socket says it would block (the peer
    /// closed or errored, or reading was paused); otherwise a short read ends the turn, saving the
    /// extra system call: with edge-triggered readiness, bytes that arrive later raise a new event.
    fn read(&mut self, slot: u32, now: Instant, drain: bool) {
        let head_cap = self.config.limits.header_bytes_max;
        let mut buf = [0u8; 16 * 1024];
        loop {
            let Some(c) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
            if matches!(c.phase, Phase::Responding { .. }) && c.decoder.buffered_bytes() >= head_cap {
                // The client pipelines faster than we answer: stop reading until this response ends.
                c.read_paused = true;
                return;
            }
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    self.drop_conn(slot, Some(DisconnectReason::ClientClosed));
                    return;
                }
                Ok(n) => {
                    if matches!(c.phase, Phase::Closing | Phase::Lingering) {
                        continue;
                    }
                    c.decoder.push(&buf[..n]);
                    if c.phase == Phase::Idle {
                        c.phase = Phase::Reading;
                        let deadline = now + self.config.header_read_timeout;
                        c.deadline = Some(deadline);
                        self.next_timer_check = self.next_timer_check.min(deadline);
                    }
                    if c.phase == Phase::Reading {
                        self.decode(slot, now);
                    }
                    if !drain && n < buf.len() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.drop_conn(slot, Some(DisconnectReason::IoError(e.kind())));
                    return;
                }
            }
        }
    }

    /// Decodes buffered bytes of a connection in `Reading`/`Idle`; hands over a complete request.
    fn decode(&mut self, slot: u32, now: Instant) {
        let Some(c) = self.slots[slot as usize].as_mut() else { return };
        let was_body = c.decoder.is_reading_body();
        match c.decoder.decode() {
            Ok(Status::Complete(request)) => {
                let keep_alive = request.keep_alive();
                c.phase = Phase::Responding { keep_alive, streaming: false };
                c.deadline = None;
                self.stats.requests_total += 1;
                self.pending.push(Event::Request { conn: ConnId { slot, gen: c.gen }, request });
            }
            Ok(Status::Partial) => {
                if c.decoder.take_expect_continue() {
                    c.out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                }
                if !was_body && c.decoder.is_reading_body() {
                    let deadline = now + self.config.body_read_timeout;
                    c.deadline = Some(deadline);
                    self.next_timer_check = self.next_timer_check.min(deadline);
                }
                if c.phase == Phase::Idle && c.decoder.buffered_bytes() > 0 {
                    c.phase = Phase::Reading;
                }
                self.flush(slot, now);
            }
            Err(e) => {
                self.stats.bad_requests_total += 1;
                self.fail(slot, &e, now);
            }
        }
    }

    /// Answers a decoding error and closes the connection once the answer is out.
    fn fail(&mut self, slot: u32, err: &HttpError, now: Instant) {
        self.reply_and_close(slot, &err.to_api_error(), now);
    }

    fn reply_and_close(&mut self, slot: u32, reply: &ApiError, now: Instant) {
        let Some(c) = self.slots[slot as usize].as_mut() else { return };
        Response::error(reply, None).write_to(&mut c.out, false);
        c.phase = Phase::Closing;
        let deadline = now + self.config.linger_timeout;
        c.deadline = Some(deadline);
        self.next_timer_check = self.next_timer_check.min(deadline);
        self.flush(slot, now);
    }

    fn flush(&mut self, slot: u32, now: Instant) {
        let Some(c) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        while c.out_pos < c.out.len() {
            match c.stream.write(&c.out[c.out_pos..]) {
                Ok(0) => {
                    self.drop_conn(slot, Some(DisconnectReason::IoError(io::ErrorKind::WriteZero)));
                    return;
                }
                Ok(n) => c.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.drop_conn(slot, Some(DisconnectReason::IoError(e.kind())));
                    return;
                }
            }
        }
        c.out.clear();
        c.out_pos = 0;
        if c.phase == Phase::Closing {
            // Half-close and keep reading for a moment, so the client reads our answer instead of a
            // reset caused by request bytes we never read.
            let _ = c.stream.shutdown(Shutdown::Write);
            c.phase = Phase::Lingering;
            let deadline = now + self.config.linger_timeout;
            c.deadline = Some(deadline);
            self.next_timer_check = self.next_timer_check.min(deadline);
            self.read(slot, now, true);
        }
    }

    fn parse_queued(&mut self, now: Instant) {
        let queued = std::mem::take(&mut self.to_parse);
        for slot in queued {
            let Some(c) = self.slots[slot as usize].as_mut() else { continue };
            if c.phase != Phase::Idle {
                continue;
            }
            if c.decoder.buffered_bytes() > 0 {
                self.decode(slot, now);
            }
            let Some(c) = self.slots[slot as usize].as_mut() else { continue };
            if std::mem::take(&mut c.read_paused) {
                self.read(slot, now, true);
            }
        }
    }

    fn check_timers(&mut self, now: Instant) {
        let mut next = now + Duration::from_secs(3600);
        for slot in 0..self.slots.len() as u32 {
            let Some(c) = self.slots[slot as usize].as_ref() else { continue };
            let Some(deadline) = c.deadline else { continue };
            if deadline > now {
                next = next.min(deadline);
                continue;
            }
            match c.phase {
                Phase::Idle => {
                    self.stats.idle_timeouts_total += 1;
                    self.drop_conn(slot, None);
                }
                Phase::Reading => {
                    self.stats.header_timeouts_total += 1;
                    let reply =
                        ApiError::new(ErrorKind::RequestTimeout, "the request did not arrive in time");
                    self.reply_and_close(slot, &reply, now);
                    if let Some(c) = self.slots[slot as usize].as_ref() {
                        next = next.min(c.deadline.unwrap_or(next));
                    }
                }
                Phase::Closing | Phase::Lingering => self.drop_conn(slot, None),
                Phase::Responding { .. } => {}
            }
        }
        self.next_timer_check = next.max(now + TIMER_SLACK);
    }

    fn drop_conn(&mut self, slot: u32, reason: Option<DisconnectReason>) {
        let Some(mut c) = self.slots[slot as usize].take() else { return };
        let _ = self.poll.registry().deregister(&mut c.stream);
        self.live -= 1;
        self.free.push(slot);
        if let (Phase::Responding { .. }, Some(reason)) = (c.phase, reason) {
            self.stats.disconnects_total += 1;
            self.pending.push(Event::Disconnected { conn: ConnId { slot, gen: c.gen }, reason });
        }
    }
}
