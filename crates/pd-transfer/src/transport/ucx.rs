//! KV over UCX (feature `ucx`): control frames over TCP ([`TcpTransport`]), block bytes read by the
//! receiver with UCX one-sided `get`s straight out of the sender's registered KV region (UCX picks
//! RDMA where the NIC has it, shared memory or TCP where not). The protocol is the shared-memory
//! path's: the sender names each block's slot (`BlockAt`), the receiver reads it, and the sender's
//! `Confirm` (its lease held until after every read) is what makes the bytes trusted.
//!
//! The sending side registers its KV region (the `/dev/shm` file a prefill worker keeps its KV in)
//! and publishes what a reader needs ([`Transport::region`]: `ucx:` and the hex of its worker
//! address, packed remote key, base and length), which travels in the transfer handle. A thread of
//! its own progresses its UCX worker, so reads are served while the engine thread computes. The
//! receiving side issues one `get` per named block and progresses its worker in `poll` (a bounded
//! spin while reads are in flight), handing each block over in order. A sender it cannot reach
//! through UCX (no `ucx:` region, a bad blob) sends its blocks inline over the same connection.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use super::{Arrival, Connected, TcpTransport, Transport};
use crate::sys::ucx::{Blob, Exporter, Importer, Pending};
use crate::{Message, PeerId, TransferKey};

/// Longest `poll` spends progressing reads already in flight.
const READ_SPIN: Duration = Duration::from_millis(5);
/// The prefix of a UCX region in a handle.
pub const REGION_PREFIX: &str = "ucx:";

/// An arrival held back behind a read still in flight on the same connection.
#[derive(Debug)]
enum Held {
    Read { key: TransferKey, index: u32, slot: u32, read: Option<Pending> },
    Message(Message),
}

/// The UCX transport. See the [module docs](self).
#[derive(Debug)]
pub struct UcxTransport {
    tcp: TcpTransport,
    block_bytes: usize,
    exporter: Option<Exporter>,
    importer: Importer,
    /// Connections whose named blocks are read through UCX, and what arrived on them in order.
    reading: HashMap<PeerId, VecDeque<Held>>,
}

impl UcxTransport {
    /// `listen`: the sending side's address (port 0 picks one), `None` on a side that only connects.
    /// `export`: the sending side's KV region file, registered for remote reads. `block_bytes`: one
    /// KV block's size.
    pub fn bind(
        listen: Option<SocketAddr>,
        block_bytes: usize,
        export: Option<&Path>,
    ) -> io::Result<UcxTransport> {
        let exporter = match export {
            Some(path) => {
                let file = std::fs::File::open(path)?;
                Some(Exporter::new(crate::sys::map_read_only(&file)?)?)
            }
            None => None,
        };
        Ok(UcxTransport {
            tcp: TcpTransport::bind(listen)?,
            block_bytes,
            exporter,
            importer: Importer::new()?,
            reading: HashMap::new(),
        })
    }

    fn forget(&mut self, peer: PeerId) {
        if let Some(q) = self.reading.remove(&peer) {
            let reads = q.into_iter().filter_map(|h| match h {
                Held::Read { read, .. } => read,
                Held::Message(_) => None,
            });
            self.importer.disconnect(peer.0, reads.collect());
        }
    }
}

impl Transport for UcxTransport {
    fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.local_addr()
    }

    fn region(&self) -> Option<String> {
        self.exporter.as_ref().map(|e| format!("{REGION_PREFIX}{}", e.blob().to_hex()))
    }

    /// Named blocks when `region` is a UCX region this side can open an endpoint to; inline bytes
    /// otherwise.
    fn connect(&mut self, addr: SocketAddr, region: Option<&str>) -> io::Result<Connected> {
        let c = self.tcp.connect(addr, None)?;
        let blob = region.and_then(|r| r.strip_prefix(REGION_PREFIX)).and_then(Blob::from_hex);
        let named_blocks = match blob {
            Some(b) => match self.importer.connect(c.peer.0, &b) {
                Ok(()) => true,
                Err(e) => {
                    eprintln!("kv transfer: UCX cannot reach {addr} ({e}); its blocks come inline");
                    false
                }
            },
            None => false,
        };
        if named_blocks {
            self.reading.insert(c.peer, VecDeque::new());
        }
        Ok(Connected { peer: c.peer, named_blocks })
    }

    fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]) {
        self.tcp.send(peer, msg, data);
    }

    fn close(&mut self, peer: PeerId) {
        self.forget(peer);
        self.tcp.close(peer);
    }

    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> io::Result<()> {
        let busy = self.reading.values().any(|q| !q.is_empty());
        let (importer, reading, block_bytes) =
            (&mut self.importer, &mut self.reading, self.block_bytes as u64);
        let mut lost = Vec::new();
        let result = self.tcp.poll(if busy { Duration::ZERO } else { wait }, &mut |arrival| match arrival {
            Arrival::Message { peer, msg } if reading.contains_key(&peer) => {
                let q = reading.get_mut(&peer).expect("checked");
                match msg {
                    Message::BlockAt { key, index, slot } => {
                        // A read that cannot start is handed over as the unread name it is: the
                        // protocol ends the transfer.
                        let read =
                            importer.get(peer.0, u64::from(slot) * block_bytes, block_bytes as usize).ok();
                        q.push_back(Held::Read { key, index, slot, read });
                    }
                    msg if q.is_empty() => on(Arrival::Message { peer, msg }),
                    msg => q.push_back(Held::Message(msg)),
                }
            }
            Arrival::Lost { peer } => {
                lost.push(peer);
                on(Arrival::Lost { peer });
            }
            other => on(other),
        });
        for peer in lost {
            self.forget(peer);
        }
        // Reads in flight: progress them (bounded), then hand over, per connection in order, what is
        // done up to the first still in flight.
        let mut in_flight: Vec<&mut Pending> = self
            .reading
            .values_mut()
            .flat_map(|q| q.iter_mut())
            .filter_map(|h| match h {
                Held::Read { read: Some(p), .. } => Some(p),
                _ => None,
            })
            .collect();
        if !in_flight.is_empty() {
            self.importer.wait(&mut in_flight, READ_SPIN);
        }
        for (&peer, q) in self.reading.iter_mut() {
            while let Some(front) = q.front_mut() {
                match front {
                    Held::Read { read: Some(p), .. } => match self.importer.poll(p) {
                        None => break,
                        Some(done) => {
                            let Some(Held::Read { key, index, slot, read: Some(p) }) = q.pop_front() else {
                                unreachable!("the front was a read")
                            };
                            match done {
                                Ok(()) => on(Arrival::Block { peer, key, index, data: &p.buf, crc: None }),
                                Err(_) => {
                                    on(Arrival::Message { peer, msg: Message::BlockAt { key, index, slot } })
                                }
                            }
                        }
                    },
                    Held::Read { read: None, .. } => {
                        if let Some(Held::Read { key, index, slot, .. }) = q.pop_front() {
                            on(Arrival::Message { peer, msg: Message::BlockAt { key, index, slot } });
                        }
                    }
                    Held::Message(_) => {
                        if let Some(Held::Message(msg)) = q.pop_front() {
                            on(Arrival::Message { peer, msg });
                        }
                    }
                }
            }
        }
        result
    }
}
