//! A bounded pool of upstream connections, and a blocking HTTP client on top of it.
//!
//! The pool never waits without a deadline, never holds more than `connections_per_upstream_max`
//! connections to one upstream (idle and busy together), and never hands out a connection whose previous
//! response was not read to its end: a [`Pooled`] dropped without [`Pooled::release_reusable`] is closed.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{HttpError, Limits, Request, ResponseDecoder, ResponseEvent, ResponseHead};

/// Bounds of a [`Pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most connections (idle plus busy) to one upstream.
    pub connections_per_upstream_max: usize,
    /// Most callers waiting for a connection to one upstream; one more is refused at once.
    pub waiters_per_upstream_max: usize,
    /// An idle connection older than this is closed instead of reused.
    pub idle_timeout: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            connections_per_upstream_max: 64,
            waiters_per_upstream_max: 256,
            idle_timeout: Duration::from_secs(30),
        }
    }
}

/// Gauges of one upstream's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub idle: usize,
    pub busy: usize,
    pub waiting: usize,
}

#[derive(Debug)]
struct Upstream<C> {
    idle: Vec<(C, Instant)>,
    busy: usize,
    waiting: usize,
}

impl<C> Default for Upstream<C> {
    fn default() -> Self {
        Upstream { idle: Vec::new(), busy: 0, waiting: 0 }
    }
}

#[derive(Debug)]
struct Shared<C> {
    config: PoolConfig,
    upstreams: Mutex<HashMap<String, Upstream<C>>>,
    freed: Condvar,
}

/// A bounded, thread-safe pool of connections of type `C`, keyed by upstream name.
#[derive(Debug)]
pub struct Pool<C> {
    shared: Arc<Shared<C>>,
}

impl<C> Clone for Pool<C> {
    fn clone(&self) -> Self {
        Pool { shared: Arc::clone(&self.shared) }
    }
}

impl<C> Pool<C> {
    pub fn new(config: PoolConfig) -> Self {
        Pool {
            shared: Arc::new(Shared { config, upstreams: Mutex::new(HashMap::new()), freed: Condvar::new() }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Upstream<C>>> {
        // A panic while holding this lock leaves only counters behind, which stay consistent.
        self.shared.upstreams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes an idle connection to `upstream`, or opens one with `connect` if under the bound, or waits
    /// for one to be released until `deadline`. `connect` runs without the pool's lock held.
    pub fn acquire(
        &self,
        upstream: &str,
        deadline: Instant,
        connect: impl FnOnce() -> io::Result<C>,
    ) -> Result<Pooled<C>, HttpError> {
        let start = Instant::now();
        let config = self.shared.config;
        let mut map = self.lock();
        loop {
            let up = map.entry(upstream.to_owned()).or_default();
            let now = Instant::now();
            while let Some((conn, since)) = up.idle.pop() {
                if now.duration_since(since) < config.idle_timeout {
                    up.busy += 1;
                    return Ok(self.pooled(upstream, conn, true));
                }
            }
            if up.busy < config.connections_per_upstream_max {
                // Reserve the slot, then connect outside the lock.
                up.busy += 1;
                drop(map);
                return match connect() {
                    Ok(conn) => Ok(self.pooled(upstream, conn, false)),
                    Err(e) => {
                        self.release_slot(upstream);
                        Err(HttpError::Connect(e))
                    }
                };
            }
            if now >= deadline {
                return Err(HttpError::AcquireTimeout { waited: now.duration_since(start), busy: up.busy });
            }
            if up.waiting >= config.waiters_per_upstream_max {
                return Err(HttpError::TooManyWaiters { limit: config.waiters_per_upstream_max });
            }
            up.waiting += 1;
            let (guard, _) = self
                .shared
                .freed
                .wait_timeout(map, deadline.saturating_duration_since(now))
                .unwrap_or_else(|e| e.into_inner());
            map = guard;
            if let Some(up) = map.get_mut(upstream) {
                up.waiting -= 1;
            }
        }
    }

    /// Gauges for `upstream` (zeros if never used).
    pub fn stats(&self, upstream: &str) -> PoolStats {
        self.lock()
            .get(upstream)
            .map(|u| PoolStats { idle: u.idle.len(), busy: u.busy, waiting: u.waiting })
            .unwrap_or_default()
    }

    /// Gauges for every upstream the pool has seen, sorted by name.
    pub fn all_stats(&self) -> Vec<(String, PoolStats)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|(k, u)| (k.clone(), PoolStats { idle: u.idle.len(), busy: u.busy, waiting: u.waiting }))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Closes every idle connection to `upstream` (for a worker being removed).
    pub fn clear_idle(&self, upstream: &str) {
        if let Some(up) = self.lock().get_mut(upstream) {
            up.idle.clear();
        }
    }

    fn pooled(&self, upstream: &str, conn: C, reused: bool) -> Pooled<C> {
        Pooled { pool: self.clone(), upstream: upstream.to_owned(), conn: Some(conn), reused }
    }

    fn release_slot(&self, upstream: &str) {
        if let Some(up) = self.lock().get_mut(upstream) {
            up.busy -= 1;
        }
        self.shared.freed.notify_one();
    }
}

/// A connection taken from a [`Pool`]. Dropping it closes the connection and frees its slot;
/// [`release_reusable`](Self::release_reusable) returns it to the idle list instead.
#[derive(Debug)]
pub struct Pooled<C> {
    pool: Pool<C>,
    upstream: String,
    conn: Option<C>,
    reused: bool,
}

impl<C> Pooled<C> {
    /// Whether this connection carried an earlier request (it may have been closed by the peer since).
    pub fn was_reused(&self) -> bool {
        self.reused
    }

    /// Returns the connection to the idle list. Call only after its last response was read to the end.
    pub fn release_reusable(mut self) {
        if let Some(conn) = self.conn.take() {
            let mut map = self.pool.lock();
            if let Some(up) = map.get_mut(&self.upstream) {
                up.busy -= 1;
                up.idle.push((conn, Instant::now()));
            }
            drop(map);
            self.pool.shared.freed.notify_one();
        }
    }
}

impl<C> std::ops::Deref for Pooled<C> {
    type Target = C;
    fn deref(&self) -> &C {
        self.conn.as_ref().unwrap_or_else(|| unreachable!("conn is present until drop or release"))
    }
}

impl<C> std::ops::DerefMut for Pooled<C> {
    fn deref_mut(&mut self) -> &mut C {
        self.conn.as_mut().unwrap_or_else(|| unreachable!("conn is present until drop or release"))
    }
}

impl<C> Drop for Pooled<C> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(conn);
            self.pool.release_slot(&self.upstream);
        }
    }
}

/// Configuration of an [`HttpClient`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientConfig {
    pub pool: PoolConfig,
    pub connect_timeout: Duration,
    /// Limits for decoding responses.
    pub limits: Limits,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            pool: PoolConfig::default(),
            connect_timeout: Duration::from_secs(2),
            limits: Limits { body_bytes_max: 256 * 1024 * 1024, ..Limits::default() },
        }
    }
}

/// A blocking HTTP/1.1 client over a [`Pool`] of TCP connections. Every call has a deadline.
#[derive(Debug, Clone)]
pub struct HttpClient {
    pool: Pool<TcpStream>,
    config: ClientConfig,
}

impl HttpClient {
    pub fn new(config: ClientConfig) -> Self {
        HttpClient { pool: Pool::new(config.pool), config }
    }

    /// The pool underneath, for its gauges.
    pub fn pool(&self) -> &Pool<TcpStream> {
        &self.pool
    }

    /// Sends `request` to `addr` and reads the response head. The body is read through the returned
    /// [`ClientResponse`]; the connection goes back to the pool only if the body is read to its end.
    ///
    /// A reused connection that the server closed while idle fails before any response byte; that one
    /// case is retried once on a new connection, since the server cannot have seen the request.
    pub fn send(
        &self,
        addr: SocketAddr,
        request: &Request,
        deadline: Instant,
    ) -> Result<ClientResponse, HttpError> {
        let mut wire = Vec::with_capacity(256 + request.body.len());
        request.write_to(&mut wire);
        let head_request = request.method.eq_ignore_ascii_case("HEAD");
        let key = addr.to_string();
        for attempt in 0..2 {
            let connect_timeout = self.config.connect_timeout;
            let conn = self.pool.acquire(&key, deadline, || {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let s = TcpStream::connect_timeout(
                    &addr,
                    connect_timeout.min(remaining).max(Duration::from_millis(1)),
                )?;
                s.set_nodelay(true)?;
                Ok(s)
            })?;
            let reused = conn.was_reused();
            let mut response = ClientResponse {
                conn: Some(conn),
                decoder: ResponseDecoder::new(self.config.limits, head_request),
                head: None,
                deadline,
                pending: Vec::new(),
                bytes_seen: 0,
            };
            match response.start(&wire) {
                Ok(()) => return Ok(response),
                Err(e) if reused && attempt == 0 && response.bytes_seen == 0 && e.peer_closed() => continue,
                Err(e) => return Err(e),
            }
        }
        Err(HttpError::Io(io::Error::new(io::ErrorKind::ConnectionReset, "stale pooled connection")))
    }

    /// Sends `request` and reads the whole answer: its status and body (bounded by the client's
    /// `body_bytes_max`), all by `deadline`.
    pub fn call(
        &self,
        addr: SocketAddr,
        request: &Request,
        deadline: Instant,
    ) -> Result<(u16, Vec<u8>), HttpError> {
        let r = self.send(addr, request, deadline)?;
        let status = r.status();
        Ok((status, r.read_to_end()?))
    }

    /// Sends `request` and closes the connection at once, without waiting for the answer: a client
    /// that gives up right after asking (for fault tests; the server must see it leave).
    pub fn send_and_leave(
        &self,
        addr: SocketAddr,
        request: &Request,
        deadline: Instant,
    ) -> Result<(), HttpError> {
        let mut wire = Vec::with_capacity(256 + request.body.len());
        request.write_to(&mut wire);
        let connect_timeout = self.config.connect_timeout;
        let mut conn = self.pool.acquire(&addr.to_string(), deadline, || {
            let remaining = deadline.saturating_duration_since(Instant::now());
            TcpStream::connect_timeout(&addr, connect_timeout.min(remaining).max(Duration::from_millis(1)))
        })?;
        set_deadline(&conn, deadline)?;
        // Dropping the pooled connection closes it: it is never reused.
        conn.write_all(&wire).map_err(HttpError::Io)
    }
}

/// A response being read. Dropping it before the end closes the connection.
#[derive(Debug)]
pub struct ClientResponse {
    conn: Option<Pooled<TcpStream>>,
    decoder: ResponseDecoder,
    head: Option<ResponseHead>,
    deadline: Instant,
    pending: Vec<u8>,
    bytes_seen: usize,
}

impl ClientResponse {
    fn start(&mut self, wire: &[u8]) -> Result<(), HttpError> {
        let conn = self.conn.as_mut().ok_or(HttpError::DeadlineExceeded)?;
        set_deadline(conn, self.deadline)?;
        conn.write_all(wire).map_err(HttpError::Io)?;
        match self.next_event()? {
            Some(ResponseEvent::Head(h)) => {
                self.head = Some(h);
                Ok(())
            }
            Some(_) => unreachable!("the head comes first"),
            None => Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into())),
        }
    }

    /// The status line and headers.
    pub fn head(&self) -> &ResponseHead {
        self.head.as_ref().unwrap_or_else(|| unreachable!("send returns only after the head"))
    }

    pub fn status(&self) -> u16 {
        self.head().status
    }

    /// The next piece of the body, `Ok(None)` at its end (when the connection goes back to the pool).
    pub fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        if !self.pending.is_empty() {
            return Ok(Some(std::mem::take(&mut self.pending)));
        }
        loop {
            match self.next_event()? {
                Some(ResponseEvent::Data(d)) if d.is_empty() => continue,
                Some(ResponseEvent::Data(d)) => return Ok(Some(d)),
                Some(ResponseEvent::End) | None => return Ok(None),
                Some(ResponseEvent::Head(_)) => return Err(HttpError::Malformed { what: "second head" }),
            }
        }
    }

    /// Reads the whole body (bounded by the client's `body_bytes_max`).
    pub fn read_to_end(mut self) -> Result<Vec<u8>, HttpError> {
        let mut body = Vec::new();
        while let Some(d) = self.next_chunk()? {
            body.extend_from_slice(&d);
        }
        Ok(body)
    }

    fn next_event(&mut self) -> Result<Option<ResponseEvent>, HttpError> {
        loop {
            if let Some(ev) = self.decoder.poll()? {
                if ev == ResponseEvent::End {
                    self.finish();
                }
                return Ok(Some(ev));
            }
            let Some(conn) = self.conn.as_mut() else { return Ok(None) };
            set_deadline(conn, self.deadline)?;
            let mut buf = [0u8; 16 * 1024];
            match conn.read(&mut buf) {
                Ok(0) => {
                    let ev = self.decoder.handle_eof().map_err(|e| {
                        if self.bytes_seen == 0 {
                            HttpError::Io(io::ErrorKind::UnexpectedEof.into())
                        } else {
                            e
                        }
                    })?;
                    // The server closed: this connection is never reused.
                    self.conn = None;
                    return Ok(ev);
                }
                Ok(n) => {
                    self.bytes_seen += n;
                    self.decoder.push(&buf[..n]);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    self.conn = None;
                    return Err(HttpError::DeadlineExceeded);
                }
                Err(e) => {
                    self.conn = None;
                    return Err(HttpError::Io(e));
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.decoder.is_reusable() {
                conn.release_reusable();
            }
        }
    }
}

fn set_deadline(conn: &TcpStream, deadline: Instant) -> Result<(), HttpError> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        return Err(HttpError::DeadlineExceeded);
    }
    conn.set_read_timeout(Some(remaining)).map_err(HttpError::Io)?;
    conn.set_write_timeout(Some(remaining)).map_err(HttpError::Io)
}
