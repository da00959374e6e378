//! The router's connections to workers: [`Upstreams`], the slots `pdserve_http::Upstream`
//! connections live in (addressed by their mio token), who owns each, and each worker's bounded pool
//! of idle ones.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Instant;

use mio::Registry;
use pdserve_http::{Limits, Server, Upstream, UpstreamPhase};

use crate::flight::LegId;
use crate::workers::Workers;

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

    /// Aborts still being sent (each has its own timer).
    pub fn aborts_pending(&self) -> usize {
        self.slots.iter().zip(&self.owners).filter(|(u, o)| u.is_some() && **o == Owner::Abort).count()
    }

    /// Slots whose timer has passed, with their phase.
    pub fn due(&self, now: Instant) -> Vec<(usize, UpstreamPhase)> {
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
        up.phase = UpstreamPhase::Idle;
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
