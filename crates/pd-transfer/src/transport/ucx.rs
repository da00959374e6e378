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
const READ_SPIN: Duration = Duration::from_millis(2);
/// Reads in flight per connection at most (each holds a block-sized buffer); later named blocks
/// wait their turn.
const READS_MAX: usize = 64;
/// The prefix of a UCX region in a handle.
pub const REGION_PREFIX: &str = "ucx:";

/// An arrival on a UCX-read connection, held in order until it can be handed over.
#[derive(Debug)]
enum Held {
    /// A named block whose read has not started (over the per-connection bound).
    Named {
        key: TransferKey,
        index: u32,
        slot: u32,
        crc: u32,
    },
    /// A named block being read.
    Read {
        key: TransferKey,
        index: u32,
        slot: u32,
        crc: u32,
        read: Pending,
    },
    /// A named block whose read could not start: handed over as the unread name it is (the
    /// protocol then ends the transfer).
    Unread {
        key: TransferKey,
        index: u32,
        slot: u32,
        crc: u32,
    },
    Message(Message),
}

/// The UCX transport. See the [module docs](self).
#[derive(Debug)]
pub struct UcxTransport {
    tcp: TcpTransport,
    block_bytes: usize,
    exporter: Option<Exporter>,
    /// The reading side's UCX worker, made at the first connection to a UCX sender.
    importer: Option<Importer>,
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
            importer: None,
            reading: HashMap::new(),
        })
    }

    fn forget(&mut self, peer: PeerId) {
        if let (Some(q), Some(im)) = (self.reading.remove(&peer), self.importer.as_mut()) {
            let reads = q.into_iter().filter_map(|h| match h {
                Held::Read { read, .. } => Some(read),
                _ => None,
            });
            im.disconnect(peer.0, reads.collect());
        }
    }

    /// Opens a UCX endpoint to the sender of `region`, if it is a UCX region this side can reach.
    fn open(&mut self, peer: PeerId, addr: SocketAddr, region: Option<&str>) -> bool {
        let Some(blob) = region.and_then(|r| r.strip_prefix(REGION_PREFIX)).and_then(Blob::from_hex) else {
            return false;
        };
        if self.importer.is_none() {
            match Importer::new() {
                Ok(im) => self.importer = Some(im),
                Err(e) => {
                    eprintln!("kv transfer: UCX is unavailable here ({e}); blocks come inline");
                    return false;
                }
            }
        }
        let Some(im) = self.importer.as_mut() else { return false };
        match im.connect(peer.0, &blob) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("kv transfer: UCX cannot reach {addr} ({e}); its blocks come inline");
                false
            }
        }
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        // Every read is given back to the importer (which waits for it) before anything goes.
        let peers: Vec<PeerId> = self.reading.keys().copied().collect();
        for peer in peers {
            self.forget(peer);
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
    /// otherwise (a shared-memory file's path included: this transport reads only UCX regions).
    fn connect(&mut self, addr: SocketAddr, region: Option<&str>) -> io::Result<Connected> {
        let c = self.tcp.connect(addr, None)?;
        let named_blocks = self.open(c.peer, addr, region);
        if named_blocks {
            self.reading.insert(c.peer, VecDeque::new());
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
        self.forget(peer);
        self.tcp.close(peer);
    }

    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> io::Result<()> {
        let busy = self.reading.values().any(|q| !q.is_empty());
        let reading = &mut self.reading;
        let mut lost = Vec::new();
        let result = self.tcp.poll(if busy { Duration::ZERO } else { wait }, &mut |arrival| match arrival {
            Arrival::Message { peer, msg } if reading.contains_key(&peer) => {
                let q = reading.get_mut(&peer).expect("checked");
                match msg {
                    Message::BlockAt { key, index, slot, crc } => {
                        q.push_back(Held::Named { key, index, slot, crc })
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
        let Some(im) = self.importer.as_mut() else { return result };
        im.reap();
        // Start reads, in order, up to the bound per connection.
        let bb = self.block_bytes;
        for (&peer, q) in self.reading.iter_mut() {
            let mut reads = q.iter().filter(|h| matches!(h, Held::Read { .. })).count();
            for h in q.iter_mut() {
                if reads >= READS_MAX {
                    break;
                }
                if let Held::Named { key, index, slot, crc } = *h {
                    *h = match im.get(peer.0, u64::from(slot) * bb as u64, bb) {
                        Ok(read) => {
                            reads += 1;
                            Held::Read { key, index, slot, crc, read }
                        }
                        Err(_) => Held::Unread { key, index, slot, crc },
                    };
                }
            }
        }
        // Progress the reads (bounded), then hand over, per connection in order, what is done up to
        // the first still in flight.
        let mut in_flight: Vec<&mut Pending> = self
            .reading
            .values_mut()
            .flat_map(|q| q.iter_mut())
            .filter_map(|h| match h {
                Held::Read { read, .. } => Some(read),
                _ => None,
            })
            .collect();
        if !in_flight.is_empty() {
            im.wait(&mut in_flight, READ_SPIN);
        }
        for (&peer, q) in self.reading.iter_mut() {
            while let Some(front) = q.front_mut() {
                let done = match front {
                    Held::Named { .. } => break,
                    Held::Read { read, .. } => match im.poll(read) {
                        None => break,
                        Some(r) => r.is_ok(),
                    },
                    Held::Unread { .. } | Held::Message(_) => true,
                };
                match q.pop_front() {
                    Some(Held::Read { key, index, slot, crc, read }) if done => match read.bytes() {
                        // Checked against the sender's checksum as it is stored (a mismatch fails
                        // the transfer, its blocks released unadopted).
                        Some(data) => on(Arrival::Block { peer, key, index, data, crc: Some(crc) }),
                        None => {
                            on(Arrival::Message { peer, msg: Message::BlockAt { key, index, slot, crc } })
                        }
                    },
                    Some(
                        Held::Read { key, index, slot, crc, .. } | Held::Unread { key, index, slot, crc },
                    ) => on(Arrival::Message { peer, msg: Message::BlockAt { key, index, slot, crc } }),
                    Some(Held::Message(msg)) => on(Arrival::Message { peer, msg }),
                    Some(Held::Named { .. }) | None => {}
                }
            }
        }
        result
    }
}
