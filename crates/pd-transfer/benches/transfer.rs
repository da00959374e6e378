//! KV transfer throughput for the default model's layout as served (30 layers, 3 KV heads, head dim
//! 64, f16 KV, 16-token blocks: 360 KiB per block) and prompts of 128, 2,048 and 8,192 tokens, through the path a
//! worker runs: two [`Endpoint`]s with the engine's settings, each with its own KV ledger and block
//! memory, the sender on a thread of its own (as a prefill worker's engine thread), over
//! - `TcpTransport`: every block's bytes framed over TCP loopback;
//! - `SharedMemoryTransport`: control frames over TCP, each block copied by the receiver straight out
//!   of the sender's shared region (a prefill worker's `--kv-shm`),
//! - with `--features ucx`, `UcxTransport`: control frames over TCP, each block read by the receiver
//!   with a UCX one-sided get out of the sender's exported region (whatever transport UCX picks;
//!   `UCX_TLS=tcp` forces TCP),
//!
//! beside a plain `memcpy` of the same bytes in the same run, the rate of the checksum every block
//! carries, and each of TCP and shared memory again with checksums off (the checksums' cost: each
//! side computes them in a pass it makes anyway, so it should be near 0). The time runs from the pull to the
//! receiver's `Ended`; the pair of workers lives across transfers (best of 3 after a warm-up one), so
//! memory is faulted in and the region mapped once, as in running workers.
//! Run: `cargo bench -p pdserve-pd-transfer [--features ucx]`.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use pdserve_kvcache::{KvCache, KvConfig, SeqId, TransferId};
use pdserve_pd_transfer::transport::shm::SharedRegion;
use pdserve_pd_transfer::*;

fn layout() -> Layout {
    Layout { num_layers: 30, num_kv_heads: 3, head_dim: 64, block_size: 16, dtype: Dtype::F16, latent: false }
}

fn pattern(block: usize) -> Vec<u8> {
    (0..layout().block_bytes()).map(|i| (block * 7 + i) as u8).collect()
}

/// How the blocks move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Tcp,
    Shm,
    #[cfg(feature = "ucx")]
    Ucx,
}

fn ms(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

/// A prefill worker's end, on a thread of its own: KV memory and ledger for `n` blocks, an endpoint
/// listening over TCP. Each transfer id sent on `offers` is a prompt computed (the blocks filled),
/// leased and offered; its `Source` comes back on `sources`. Kept alive across transfers, as a
/// worker is: its memory is faulted in once, and a receiver maps its region once.
fn prefill_worker(
    n: usize,
    via: Via,
    checksums: bool,
    offers: mpsc::Receiver<u64>,
    sources: mpsc::Sender<Source>,
) {
    let bb = layout().block_bytes();
    let start = Instant::now();
    let shared = via != Via::Tcp;
    let (mut mem, region): (Box<dyn BlockMemory>, _) = if shared {
        let r = SharedRegion::create(pdserve_pd_transfer::transport::shm::LOCAL_SCOPE, (n + 1) * bb)
            .expect("shared region");
        let path = r.path().display().to_string();
        (Box::new(r), Some(path))
    } else {
        (Box::new(vec![0u8; (n + 1) * bb]), None)
    };
    let mut kv = KvCache::new(KvConfig { num_blocks: n as u32 + 1, block_size: 16 }).expect("kv");
    let listen = Some("127.0.0.1:0".parse().unwrap());
    let transport: Box<dyn Transport> = match via {
        #[cfg(feature = "ucx")]
        Via::Ucx => {
            let export = region.as_deref().map(std::path::Path::new);
            Box::new(UcxTransport::bind(listen, bb, export).expect("UCX export"))
        }
        _ => Box::new(TcpTransport::bind(listen).expect("listen")),
    };
    let config = EndpointConfig {
        sender: SenderConfig { shared_region: shared, ..SenderConfig::default() },
        checksums,
        ..EndpointConfig::default()
    };
    let mut ep = Endpoint::new(transport, layout(), config);
    let region = ep.region().or(region);
    loop {
        match offers.try_recv() {
            Ok(t) => {
                let prompt: Vec<u32> = (0..(n * 16) as u32).map(|i| i + t as u32).collect();
                kv.add_sequence(SeqId(t), &prompt).expect("sequence");
                kv.reserve(SeqId(t), prompt.len()).expect("reserve");
                kv.commit(SeqId(t), prompt.len()).expect("commit");
                let lease = kv.lease_sequence(SeqId(t), TransferId(t), u64::MAX / 2).expect("lease");
                let blocks = lease.blocks.to_vec();
                for (i, b) in blocks.iter().enumerate() {
                    mem.write_block(*b, &pattern(i)).expect("fill");
                }
                let meta = PromptMeta { prompt, first_token: 1, ..PromptMeta::default() };
                let key = ep.offer(TransferId(t), blocks, u64::MAX / 2, meta, ms(start)).expect("offer");
                let region = region.clone();
                sources.send(Source { addr: ep.local_addr().expect("addr"), key, region }).expect("source");
            }
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => return,
        }
        ep.pump(&kv, mem.as_mut(), ms(start), Duration::from_millis(1)).expect("pump");
        while let Some(e) = ep.poll_event() {
            if let EndpointEvent::Ended { transfer, outcome, .. } = e {
                assert_eq!(outcome, TransferOutcome::Completed);
                kv.release_lease(TransferId(transfer)).expect("release");
            }
        }
    }
}

/// A decode worker's end and the prefill worker it pulls from.
struct Pair {
    offers: mpsc::Sender<u64>,
    sources: mpsc::Receiver<Source>,
    prefill: Option<std::thread::JoinHandle<()>>,
    ep: Endpoint,
    kv: KvCache,
    mem: Vec<u8>,
    via: Via,
    next: u64,
}

impl Pair {
    fn new(n: usize, via: Via, checksums: bool) -> Pair {
        let (offers, offers_rx) = mpsc::channel();
        let (sources_tx, sources) = mpsc::channel();
        let prefill = std::thread::spawn(move || prefill_worker(n, via, checksums, offers_rx, sources_tx));
        let bb = layout().block_bytes();
        let transport: Box<dyn Transport> = match via {
            Via::Tcp => Box::new(TcpTransport::bind(None).expect("transport")),
            Via::Shm => Box::new(SharedMemoryTransport::bind(None, bb).expect("transport")),
            #[cfg(feature = "ucx")]
            Via::Ucx => Box::new(UcxTransport::bind(None, bb, None).expect("transport")),
        };
        Pair {
            offers,
            sources,
            prefill: Some(prefill),
            ep: Endpoint::new(transport, layout(), EndpointConfig::default()),
            kv: KvCache::new(KvConfig { num_blocks: n as u32 + 1, block_size: 16 }).expect("kv"),
            // A decode worker's KV pool is allocated and resident from startup.
            mem: vec![1; (n + 1) * bb],
            via,
            next: 1,
        }
    }

    /// One transfer of the prompt's blocks; the seconds from the pull to the receiver's end.
    fn transfer(&mut self) -> f64 {
        let t = self.next;
        self.next += 1;
        self.offers.send(t).expect("offer");
        let source = self.sources.recv().expect("the prefill worker offered");
        let before = self.ep.stats();
        let start = Instant::now();
        self.ep.pull(&source, u64::MAX / 2, 0).expect("pull");
        let mut table = Vec::new();
        'pulled: loop {
            self.ep.pump(&self.kv, &mut self.mem, ms(start), Duration::from_millis(1)).expect("pump");
            while let Some(e) = self.ep.poll_event() {
                match e {
                    EndpointEvent::Described { transfer, blocks, .. } => {
                        let l = self
                            .kv
                            .allocate_lease(TransferId(transfer), blocks as usize, u64::MAX / 2)
                            .expect("lease");
                        table = l.blocks.to_vec();
                        let dest = l.blocks.iter().copied().zip(l.epochs.iter().copied()).collect();
                        self.ep.set_destination(transfer, 0, dest).expect("destination");
                    }
                    EndpointEvent::Ended { outcome, .. } => {
                        assert_eq!(outcome, TransferOutcome::Completed);
                        break 'pulled;
                    }
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let s = self.ep.stats();
        let moved = if self.via != Via::Tcp {
            s.bytes_shared - before.bytes_shared
        } else {
            s.bytes_received - before.bytes_received
        };
        assert_eq!(moved, (table.len() * layout().block_bytes()) as u64, "{s:?}");
        let mut got = vec![0; layout().block_bytes()];
        for (i, b) in table.iter().enumerate() {
            self.mem.read_block(*b, &mut got).expect("read");
            assert!(got == pattern(i), "block {i} differs");
        }
        self.kv.release_lease(TransferId(t)).expect("release");
        secs
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let (gone, _) = mpsc::channel();
        self.offers = gone;
        if let Some(p) = self.prefill.take() {
            let _ = p.join();
        }
    }
}

/// Best of 3 transfers after a first one that warms the pair up (connections, mappings).
fn best_transfer(n: usize, via: Via, checksums: bool) -> f64 {
    let mut pair = Pair::new(n, via, checksums);
    pair.transfer();
    (0..3).map(|_| pair.transfer()).fold(f64::MAX, f64::min)
}

/// What each block's checksum computes over its bytes.
fn checksum_of(data: &[u8]) -> u32 {
    pdserve_pd_transfer::block_checksum(TransferKey { transfer: 1, epoch: 1 }, 0, data)
}

fn main() {
    println!("block: {} bytes", layout().block_bytes());
    println!("prompt tokens  bytes        memcpy GB/s   shared GB/s  shared/memcpy  tcp GB/s   tcp/memcpy   tcp latency  checksum GB/s  tcp no-crc GB/s  checksum cost tcp  shm no-crc GB/s  checksum cost shm  ucx GB/s  ucx/memcpy");
    for tokens in [128usize, 2048, 8192] {
        let n = tokens.div_ceil(16);
        let src: Vec<Vec<u8>> = (0..n).map(pattern).collect();
        let bytes = (n * layout().block_bytes()) as f64;
        // memcpy of the same blocks, block by block, best of 3.
        let mut dst: Vec<Vec<u8>> = vec![vec![0u8; layout().block_bytes()]; n];
        let memcpy = (0..3)
            .map(|_| {
                let t = Instant::now();
                for (d, s) in dst.iter_mut().zip(&src) {
                    d.copy_from_slice(std::hint::black_box(s));
                }
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        let crc = (0..3)
            .map(|_| {
                let t = Instant::now();
                let sum = src.iter().fold(0u32, |a, s| a ^ checksum_of(std::hint::black_box(s)));
                std::hint::black_box(sum);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        let fused = (0..3)
            .map(|_| {
                let t = Instant::now();
                let mut sum = 0;
                for (d, s) in dst.iter_mut().zip(&src) {
                    sum ^= copy_striped(d, std::hint::black_box(s));
                }
                std::hint::black_box(sum);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        eprintln!("copy+checksum: {:.2} GB/s", bytes / fused / 1e9);
        let tcp = best_transfer(n, Via::Tcp, true);
        let bare = best_transfer(n, Via::Tcp, false);
        let shm = best_transfer(n, Via::Shm, true);
        let shm_bare = best_transfer(n, Via::Shm, false);
        #[cfg(feature = "ucx")]
        let ucx = Some(best_transfer(n, Via::Ucx, true));
        #[cfg(not(feature = "ucx"))]
        let ucx: Option<f64> = None;
        let ucx_cols = ucx.map_or("        -           -".to_owned(), |u| {
            format!("{:>8.2}  {:>10.3}", bytes / u / 1e9, memcpy / u)
        });
        println!(
            "{tokens:>13}  {:>9.1} MB  {:>11.2}  {:>11.2}  {:>13.3}  {:>9.2}  {:>11.3}  {:>9.1} ms  {:>11.2}  {:>15.2}  {:>16.1}%  {:>15.2}  {:>16.1}%  {ucx_cols}",
            bytes / 1e6,
            bytes / memcpy / 1e9,
            bytes / shm / 1e9,
            memcpy / shm,
            bytes / tcp / 1e9,
            memcpy / tcp,
            tcp * 1e3,
            bytes / crc / 1e9,
            bytes / bare / 1e9,
            (tcp / bare - 1.0) * 100.0,
            bytes / shm_bare / 1e9,
            (shm / shm_bare - 1.0) * 100.0
        );
    }
}
