//! Same-host transfers: control frames over TCP ([`TcpTransport`]), block bytes read straight out of
//! the sender's shared KV region ([`SharedView`]) instead of being sent. A sender on another host, or
//! a region this process cannot map, falls back to inline blocks over the same connection.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::shm::SharedView;
use super::{Arrival, Connected, TcpTransport, Transport};
use crate::{Message, PeerId};

/// Regions kept mapped at once when no connection reads from them.
const VIEWS_MAX: usize = 8;

/// The shared-memory transport. See the [module docs](self).
#[derive(Debug)]
pub struct SharedMemoryTransport {
    tcp: TcpTransport,
    block_bytes: usize,
    /// Senders' shared regions, mapped once each.
    views: HashMap<PathBuf, SharedView>,
    /// The region each connection's named blocks are read from.
    regions: HashMap<PeerId, PathBuf>,
    /// Only regions of this scope are mapped (`shm::valid_scope`).
    scope: String,
}

impl SharedMemoryTransport {
    /// `listen`: the sending side's address (port 0 picks one); `None` on a side that only connects.
    /// `block_bytes`: the size of one KV block, for cutting shared regions into blocks.
    pub fn bind(listen: Option<SocketAddr>, block_bytes: usize) -> io::Result<SharedMemoryTransport> {
        Ok(SharedMemoryTransport {
            tcp: TcpTransport::bind(listen)?,
            block_bytes,
            views: HashMap::new(),
            regions: HashMap::new(),
            scope: super::shm::LOCAL_SCOPE.to_owned(),
        })
    }

    /// Maps only the regions of stack `scope` (`shm::valid_scope`); a sender of another scope sends
    /// its blocks inline. [`LOCAL_SCOPE`](super::shm::LOCAL_SCOPE) by default.
    pub fn with_scope(mut self, scope: &str) -> SharedMemoryTransport {
        self.scope = scope.to_owned();
        self
    }

    /// Maps the region at `path` once; false if this process cannot (another host, another user).
    fn view(&mut self, path: &Path) -> bool {
        if self.views.contains_key(path) {
            return true;
        }
        // Before mapping another region, unmap those no connection reads from whose file is gone (a
        // prefill worker that restarted), or any unused one past the bound: a view pins its memory.
        let in_use: Vec<&PathBuf> = self.regions.values().collect();
        let unused: Vec<PathBuf> = self.views.keys().filter(|p| !in_use.contains(p)).cloned().collect();
        let crowded = self.views.len() >= VIEWS_MAX;
        for p in unused {
            if crowded || !p.exists() {
                self.views.remove(&p);
            }
        }
        match SharedView::open(path, &self.scope, self.block_bytes) {
            Ok(v) => {
                self.views.insert(path.to_path_buf(), v);
                true
            }
            Err(_) => false,
        }
    }
}

impl Transport for SharedMemoryTransport {
    fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Named blocks when the sender's `region` can be mapped here; inline bytes otherwise.
    fn connect(&mut self, addr: SocketAddr, region: Option<&str>) -> io::Result<Connected> {
        let region = region.map(PathBuf::from).filter(|p| self.view(p));
        let c = self.tcp.connect(addr, None)?;
        let named_blocks = region.is_some();
        if let Some(path) = region {
            self.regions.insert(c.peer, path);
        }
        Ok(Connected { peer: c.peer, named_blocks })
    }

    fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]) {
        self.tcp.send(peer, msg, data);
    }

    fn flush(&mut self) {
        self.tcp.flush();
    }

    fn close(&mut self, peer: PeerId) {
        self.regions.remove(&peer);
        self.tcp.close(peer);
    }

    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> io::Result<()> {
        let (views, regions) = (&self.views, &self.regions);
        let mut lost = Vec::new();
        let result = self.tcp.poll(wait, &mut |arrival| match arrival {
            Arrival::Message { peer, msg: Message::BlockAt { key, index, slot, crc } } => {
                let view = regions.get(&peer).and_then(|p| views.get(p));
                match view.and_then(|v| v.block(slot)) {
                    // Checked against the sender's checksum as it is stored (a mismatch fails the
                    // transfer, its blocks released unadopted).
                    Some(data) => on(Arrival::Block { peer, key, index, data, crc: Some(crc) }),
                    // Named, but not readable here: the protocol layer ends the transfer.
                    None => on(Arrival::Message { peer, msg: Message::BlockAt { key, index, slot, crc } }),
                }
            }
            Arrival::Lost { peer } => {
                lost.push(peer);
                on(Arrival::Lost { peer });
            }
            other => on(other),
        });
        for peer in lost {
            self.regions.remove(&peer);
        }
        result
    }
}
