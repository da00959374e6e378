//! Two endpoints over a real TCP transport on loopback, each with a real KV ledger and its own block
//! memory, pumped in turn on one thread: transfers inline and through a shared region carry exactly
//! the sender's bytes and prompt; aborts and a vanished sender end transfers on both sides; both
//! ledgers return to baseline.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdserve_kvcache::{KvCache, KvConfig, SeqId, TransferId};
use pdserve_pd_transfer::transport::shm::SharedRegion;
use pdserve_pd_transfer::*;

const BLOCKS: u32 = 64;

/// How a worker's transport moves block bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// `TcpTransport`: every block inline.
    Tcp,
    /// `SharedMemoryTransport`: reads named blocks out of a same-host sender's region.
    Shm,
    /// `UcxTransport`: a sender exports its region, a receiver reads named blocks with UCX gets.
    #[cfg(feature = "ucx")]
    Ucx,
}

impl Via {
    /// A sender that exports its region through UCX (its handle names the export, not its file).
    fn exports(self) -> bool {
        #[cfg(feature = "ucx")]
        return self == Via::Ucx;
        #[cfg(not(feature = "ucx"))]
        return false;
    }
}

fn layout() -> Layout {
    Layout { num_layers: 2, num_kv_heads: 2, head_dim: 8, block_size: 4, dtype: Dtype::F32, latent: false }
}

struct Worker {
    ep: Endpoint,
    kv: KvCache,
    /// Heap memory, or a shared region (the prefill worker's `--kv-shm`).
    mem: Box<dyn BlockMemory>,
    /// The shared region's file, if the memory is one.
    region: Option<String>,
    ended: HashMap<u64, TransferOutcome>,
    described: HashMap<u64, PromptMeta>,
    /// Give described transfers their destinations at once (else they wait, described).
    accept: bool,
}

impl Worker {
    /// `shared`: this worker's KV memory is a shared region (a sender then names its blocks); `via`:
    /// its transport.
    fn new(listen: bool, shared: bool, via: Via) -> Worker {
        let bytes = BLOCKS as usize * layout().block_bytes();
        let (mem, region): (Box<dyn BlockMemory>, _) = if shared {
            let r = SharedRegion::create(pdserve_pd_transfer::transport::shm::LOCAL_SCOPE, bytes).unwrap();
            let path = r.path().display().to_string();
            (Box::new(r), Some(path))
        } else {
            (Box::new(vec![0u8; bytes]), None)
        };
        let at = listen.then(|| "127.0.0.1:0".parse().unwrap());
        let transport = transport(via, at, region.as_deref());
        let config = EndpointConfig {
            sender: SenderConfig { window_blocks: 4, transfers_max: 64, shared_region: shared },
            ..EndpointConfig::default()
        };
        let ep = Endpoint::new(transport, layout(), config);
        // A UCX sender's handle names its export; any other's, its region file.
        let region = ep.region().or(region);
        Worker {
            ep,
            kv: KvCache::new(KvConfig { num_blocks: BLOCKS, block_size: layout().block_size }).unwrap(),
            mem,
            region,
            ended: HashMap::new(),
            described: HashMap::new(),
            accept: true,
        }
    }

    /// One turn, settling events with the ledger as a worker's engine does.
    fn turn(&mut self, now: u64) {
        self.ep.pump(&self.kv, self.mem.as_mut(), now, Duration::from_millis(1)).unwrap();
        while let Some(e) = self.ep.poll_event() {
            match e {
                EndpointEvent::Described { transfer, meta, .. } if !self.accept => {
                    self.described.insert(transfer, meta);
                }
                EndpointEvent::Described { transfer, blocks, meta } => {
                    let l =
                        self.kv.allocate_lease(TransferId(transfer), blocks as usize, now + 10_000).unwrap();
                    let dest = l.blocks.iter().copied().zip(l.epochs.iter().copied()).collect();
                    self.described.insert(transfer, meta);
                    self.ep.set_destination(transfer, 0, dest).unwrap();
                }
                EndpointEvent::Ended { side, transfer, outcome, .. } => {
                    assert!(self.ended.insert(transfer, outcome.clone()).is_none(), "{transfer} ended twice");
                    if side == Side::Receiving && outcome == TransferOutcome::Completed {
                        let seq = SeqId(transfer);
                        let tokens = self.described[&transfer].prompt.clone();
                        self.kv.adopt_lease(TransferId(transfer), seq, &tokens).unwrap();
                    } else if self.kv.lease(TransferId(transfer)).is_ok() {
                        self.kv.release_lease(TransferId(transfer)).unwrap();
                    }
                }
            }
        }
        self.kv.check_invariants().unwrap();
    }

    /// A prompt of `tokens` tokens computed here, its blocks filled with a pattern of `t`, offered.
    fn offer(&mut self, t: u64, tokens: usize, now: u64) -> (TransferKey, Vec<u32>) {
        let prompt: Vec<u32> = (0..tokens as u32).map(|i| i * 3 + t as u32).collect();
        let seq = SeqId(t);
        self.kv.add_sequence(seq, &prompt).unwrap();
        self.kv.reserve(seq, tokens).unwrap();
        self.kv.commit(seq, tokens).unwrap();
        let lease = self.kv.lease_sequence(seq, TransferId(t), now + 10_000).unwrap();
        let blocks = lease.blocks.to_vec();
        let bb = layout().block_bytes();
        for (i, b) in blocks.iter().enumerate() {
            self.mem.write_block(*b, &pattern(t, i, bb)).unwrap();
        }
        let meta = PromptMeta {
            prompt: prompt.clone(),
            first_token: 9,
            first_logprob: -0.125,
            ..PromptMeta::default()
        };
        let key = self.ep.offer(TransferId(t), blocks, now + 10_000, meta, now).unwrap();
        (key, prompt)
    }
}

fn pattern(t: u64, i: usize, n: usize) -> Vec<u8> {
    (0..n).map(|k| (t as usize * 13 + i * 7 + k) as u8).collect()
}

fn run_until(p: &mut Worker, d: &mut Worker, mut done: impl FnMut(&Worker, &Worker) -> bool) {
    let start = Instant::now();
    while !done(p, d) {
        let now = start.elapsed().as_millis() as u64;
        p.turn(now);
        d.turn(now);
        assert!(start.elapsed() < Duration::from_secs(20), "transfers did not end");
    }
}

/// Five transfers from a sender whose KV is (or is not) in a shared region to a receiver whose
/// transport can (or cannot) read such a region; the blocks come through it only when both hold.
fn transfer_several(shared: bool, sender: Via, receiver: Via) {
    let mut p = Worker::new(true, shared, sender);
    let mut d = Worker::new(false, false, receiver);
    let addr = p.ep.local_addr().unwrap();
    let region = p.region.clone();
    let mut prompts = HashMap::new();
    for t in 1..=5u64 {
        let (key, prompt) = p.offer(t, 1 + 5 * t as usize, 0);
        prompts.insert(t, prompt);
        d.ep.pull(&Source { addr, key, region: region.clone() }, 10_000, 0).unwrap();
    }
    run_until(&mut p, &mut d, |p, d| p.ended.len() == 5 && d.ended.len() == 5);
    let bb = layout().block_bytes();
    for t in 1..=5u64 {
        assert_eq!(d.ended[&t], TransferOutcome::Completed);
        assert_eq!(p.ended[&t], TransferOutcome::Completed);
        assert_eq!(d.described[&t].prompt, prompts[&t], "the prompt travels with the transfer");
        assert_eq!((d.described[&t].first_token, d.described[&t].first_logprob), (9, -0.125));
        for (i, b) in d.kv.block_table(SeqId(t)).unwrap().iter().enumerate() {
            let mut got = vec![0; bb];
            d.mem.read_block(*b, &mut got).unwrap();
            assert_eq!(got, pattern(t, i, bb), "transfer {t} block {i}");
        }
        d.kv.free_sequence(SeqId(t), false).unwrap();
    }
    let stats = d.ep.stats();
    // Named blocks need a region and a receiver that reads the kind of region the sender names.
    let reads_region = match receiver {
        Via::Tcp => false,
        Via::Shm => !sender.exports(),
        #[cfg(feature = "ucx")]
        Via::Ucx => sender.exports(),
    };
    if shared && reads_region {
        assert!(stats.bytes_shared > 0 && stats.bytes_received == 0, "{stats:?}");
    } else {
        assert!(stats.bytes_received > 0 && stats.bytes_shared == 0, "{stats:?}");
    }
    for w in [&p, &d] {
        let s = w.kv.stats();
        assert_eq!((s.leases, s.sequences, s.blocks_free), (0, 0, s.blocks_total));
        assert!(w.ep.is_empty());
    }
}

#[test]
fn inline_transfers_carry_the_bytes_and_the_prompt() {
    transfer_several(false, Via::Tcp, Via::Tcp);
    // A receiver that could map a region, from a sender without one: inline too.
    transfer_several(false, Via::Tcp, Via::Shm);
}

#[test]
fn shared_region_transfers_copy_from_the_senders_memory() {
    transfer_several(true, Via::Tcp, Via::Shm);
}

#[test]
fn a_receiver_over_plain_tcp_gets_a_shared_senders_blocks_inline() {
    transfer_several(true, Via::Tcp, Via::Tcp);
}

#[cfg(feature = "ucx")]
#[test]
fn ucx_transfers_read_the_senders_exported_memory() {
    transfer_several(true, Via::Ucx, Via::Ucx);
    // A UCX receiver from a sender without an export, and a plain receiver from a UCX sender: inline.
    transfer_several(true, Via::Tcp, Via::Ucx);
    transfer_several(true, Via::Ucx, Via::Tcp);
}

#[test]
fn aborts_and_a_vanished_sender_end_both_sides() {
    aborts_and_a_vanished_sender(false, Via::Tcp, Via::Shm);
}

#[cfg(feature = "ucx")]
#[test]
fn aborts_and_a_vanished_sender_end_both_sides_over_ucx() {
    aborts_and_a_vanished_sender(true, Via::Ucx, Via::Ucx);
}

fn aborts_and_a_vanished_sender(shared: bool, sender: Via, receiver: Via) {
    let mut p = Worker::new(true, shared, sender);
    let mut d = Worker::new(false, false, receiver);
    let addr = p.ep.local_addr().unwrap();
    let region = p.region.clone();
    let (k1, _) = p.offer(1, 40, 0);
    let (k2, _) = p.offer(2, 40, 0);
    d.ep.pull(&Source { addr, key: k1, region: region.clone() }, 10_000, 0).unwrap();
    // A stale epoch is refused by the sender; the offer stays.
    let stale = TransferKey { epoch: k2.epoch ^ 1, ..k2 };
    d.ep.pull(&Source { addr, key: stale, region: region.clone() }, 10_000, 0).unwrap();
    run_until(&mut p, &mut d, |_, d| d.ended.contains_key(&2));
    assert_eq!(d.ended[&2], TransferOutcome::Failed(FailReason::StaleEpoch));
    // The decode side gives up on transfer 1 once it is described.
    d.accept = false;
    run_until(&mut p, &mut d, |_, d| d.described.contains_key(&1));
    assert!(d.ep.abort(1));
    run_until(&mut p, &mut d, |p, d| p.ended.contains_key(&1) && d.ended.contains_key(&1));
    assert_eq!(d.ended[&1], TransferOutcome::Failed(FailReason::Aborted));
    assert_eq!(p.ended[&1], TransferOutcome::Failed(FailReason::Aborted));
    // A pull of transfer 2, then the prefill worker vanishes.
    d.accept = true;
    d.ended.remove(&2);
    d.ep.pull(&Source { addr, key: k2, region: region.clone() }, 10_000, 0).unwrap();
    run_until(&mut p, &mut d, |_, d| d.described.contains_key(&2) || d.ended.contains_key(&2));
    drop(p);
    let start = Instant::now();
    while !d.ended.contains_key(&2) {
        d.turn(start.elapsed().as_millis() as u64);
        assert!(start.elapsed() < Duration::from_secs(5), "a vanished sender ends the pull");
    }
    assert!(matches!(d.ended[&2], TransferOutcome::Failed(_)), "{:?}", d.ended[&2]);
    // A sender nobody listens on: the pull ends, failed, instead of waiting for its deadline.
    d.ended.remove(&1);
    d.ep.pull(&Source { addr: "127.0.0.1:1".parse().unwrap(), key: k1, region: None }, 60_000, 0).unwrap();
    let start = Instant::now();
    while !d.ended.contains_key(&1) {
        d.turn(start.elapsed().as_millis() as u64);
        assert!(start.elapsed() < Duration::from_secs(5), "a refused connection ends the pull");
    }
    let s = d.kv.stats();
    assert_eq!((s.leases, s.blocks_free), (0, s.blocks_total));
    assert!(d.ep.is_empty());
}

/// `via`'s transport, listening at `at`; a UCX one exports `region`.
fn transport(via: Via, at: Option<std::net::SocketAddr>, region: Option<&str>) -> Box<dyn Transport> {
    let bb = layout().block_bytes();
    let _ = region;
    match via {
        Via::Tcp => Box::new(TcpTransport::bind(at).unwrap()),
        Via::Shm => Box::new(SharedMemoryTransport::bind(at, bb).unwrap()),
        #[cfg(feature = "ucx")]
        Via::Ucx => {
            let export = region.map(std::path::Path::new);
            Box::new(pdserve_pd_transfer::UcxTransport::bind(at, bb, export).unwrap())
        }
    }
}

/// A transport with one bit of every block flipped on arrival, inline or read out of the sender's
/// memory (a faulty NIC, a bad cable, a stray write into shared memory).
#[derive(Debug)]
struct Corrupting(Box<dyn Transport>);

impl Transport for Corrupting {
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.0.local_addr()
    }
    fn connect(&mut self, addr: std::net::SocketAddr, region: Option<&str>) -> std::io::Result<Connected> {
        self.0.connect(addr, region)
    }
    fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]) {
        self.0.send(peer, msg, data)
    }
    fn flush(&mut self) {
        self.0.flush()
    }
    fn close(&mut self, peer: PeerId) {
        self.0.close(peer)
    }
    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> std::io::Result<()> {
        self.0.poll(wait, &mut |a| match a {
            Arrival::Block { peer, key, index, data, crc } => {
                let mut bad = data.to_vec();
                let mid = bad.len() / 2;
                bad[mid] ^= 0x04;
                on(Arrival::Block { peer, key, index, data: &bad, crc })
            }
            other => on(other),
        })
    }
}

/// Whatever carries the block (inline over TCP, read out of the sender's shared memory, or with UCX
/// gets), a corrupted one fails its transfer as a checksum failure before a byte reaches KV memory.
#[test]
fn a_corrupted_block_fails_its_transfer_and_is_never_written() {
    corrupted_block(false, Via::Tcp, Via::Tcp);
    corrupted_block(true, Via::Tcp, Via::Shm);
    #[cfg(feature = "ucx")]
    corrupted_block(true, Via::Ucx, Via::Ucx);
}

fn corrupted_block(shared: bool, sender: Via, receiver: Via) {
    let mut p = Worker::new(true, shared, sender);
    let mut d = Worker::new(false, false, receiver);
    d.ep = Endpoint::new(
        Box::new(Corrupting(transport(receiver, None, None))),
        layout(),
        EndpointConfig::default(),
    );
    let addr = p.ep.local_addr().unwrap();
    let (key, _) = p.offer(1, 40, 0);
    d.ep.pull(&Source { addr, key, region: p.region.clone() }, 10_000, 0).unwrap();
    run_until(&mut p, &mut d, |p, d| p.ended.contains_key(&1) && d.ended.contains_key(&1));
    assert_eq!(d.ended[&1], TransferOutcome::Failed(FailReason::Checksum));
    assert!(matches!(p.ended[&1], TransferOutcome::Failed(_)), "{:?}", p.ended[&1]);
    assert!(d.ep.stats().checksum_failures >= 1, "{:?}", d.ep.stats());
    // The corrupted bytes reach no sequence: the pull's blocks went back to the pool unadopted.
    assert!(d.kv.block_table(SeqId(1)).is_err(), "the failed transfer's blocks were adopted");
    for w in [&p, &d] {
        let s = w.kv.stats();
        assert_eq!((s.leases, s.sequences, s.blocks_free), (0, 0, s.blocks_total));
        assert!(w.ep.is_empty());
    }
}
