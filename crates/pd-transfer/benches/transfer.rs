//! KV transfer throughput for the default model's layout (30 layers, 3 KV heads, head dim 64, f32,
//! 16-token blocks: 720 KiB per block) and prompts of 128, 2,048 and 8,192 tokens: the protocol with its
//! framing over a TCP loopback connection, beside a plain `memcpy` of the same bytes in the same run.
//! Run: `cargo bench -p pdserve-pd-transfer`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use pdserve_kvcache::BlockId;
use pdserve_pd_transfer::*;

fn layout() -> Layout {
    Layout { num_layers: 30, num_kv_heads: 3, head_dim: 64, block_size: 16, dtype: Dtype::F32 }
}

/// Reads frames from `s` into `buf` until one decodes; returns (message, data).
fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> (Message, Vec<u8>) {
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        if let Some(f) = decode(buf).expect("frame") {
            let out = (f.msg, f.data.to_vec());
            let used = f.consumed;
            buf.drain(..used);
            return out;
        }
        let n = s.read(&mut chunk).expect("read");
        assert!(n > 0, "peer closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The transfer with control frames over TCP and each block named (`BlockAt`) and copied by the
/// receiver straight out of the sender's memory, as a decode worker copies from a prefill worker's
/// shared KV file: one `memcpy` per block plus the protocol.
fn shared_transfer(src: &[Vec<u8>]) -> f64 {
    transfer(src, true)
}

fn tcp_transfer(src: &[Vec<u8>]) -> f64 {
    transfer(src, false)
}

fn transfer(src: &[Vec<u8>], shared: bool) -> f64 {
    let n = src.len();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let key = TransferKey { transfer: 1, epoch: 1 };
    let blocks: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
    let region = std::sync::Arc::new(src.to_vec());
    let src = std::sync::Arc::clone(&region);
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut sender =
            Sender::new(SenderConfig { window_blocks: u32::MAX, transfers_max: 1, shared_region: shared });
        sender.offer(key, layout(), blocks, u64::MAX, PromptMeta::default()).expect("offer");
        let mut buf = Vec::new();
        let mut out = Vec::with_capacity(src[0].len() + 64);
        loop {
            let (msg, _) = read_frame(&mut s, &mut buf);
            let done = matches!(msg, Message::Done { .. });
            sender.handle_message(PeerId(1), msg);
            while let Some(a) = sender.poll_action() {
                out.clear();
                match a {
                    SendAction::Message { msg, .. } => encode(&msg, &[], &mut out),
                    SendAction::Block { key, index, block, shared: true, .. } => {
                        encode(&Message::BlockAt { key, index, slot: block.0 }, &[], &mut out);
                    }
                    SendAction::Block { key, index, block, shared: false, .. } => {
                        let data = &src[block.0 as usize];
                        encode(&Message::Block { key, index, len: data.len() as u32 }, data, &mut out);
                    }
                }
                s.write_all(&out).expect("write");
            }
            if done {
                return;
            }
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    // A decode worker's KV pool is allocated and resident from startup: touch it before timing.
    let mut dst: Vec<Vec<u8>> = vec![vec![1u8; layout().block_bytes()]; n];
    let mut receiver = Receiver::new(64);
    let start = Instant::now();
    receiver.start(key, PeerId(1), layout(), u64::MAX, shared).expect("start");
    let mut buf = Vec::new();
    let mut out = Vec::new();
    loop {
        while let Some(d) = receiver.poll_described() {
            let dest = (0..d.blocks).map(|b| (BlockId(b), 0)).collect();
            receiver.set_destination(d.key.transfer, dest).expect("destination");
        }
        while let Some((_, msg)) = receiver.poll_transmit() {
            out.clear();
            encode(&msg, &[], &mut out);
            s.write_all(&out).expect("write");
        }
        if let Some(e) = receiver.poll_event() {
            assert_eq!(e.outcome, Outcome::Completed);
            break;
        }
        let (msg, data) = read_frame(&mut s, &mut buf);
        match msg {
            Message::Block { key, index, len } => {
                let d = receiver.accept_block(PeerId(1), key, index, len as usize).expect("destination");
                dst[d.block.0 as usize].copy_from_slice(&data);
                receiver.block_written(key, index);
            }
            Message::BlockAt { key, index, slot } => {
                let d = receiver
                    .accept_block(PeerId(1), key, index, layout().block_bytes())
                    .expect("destination");
                dst[d.block.0 as usize].copy_from_slice(&region[slot as usize]);
                receiver.block_written(key, index);
            }
            other => receiver.handle_message(PeerId(1), other),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    server.join().expect("sender thread");
    assert!(dst.iter().zip(&src_check(n)).all(|(a, b)| a == b), "bytes differ");
    secs
}

fn src_check(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|b| (0..layout().block_bytes()).map(|i| (b * 7 + i) as u8).collect()).collect()
}

fn main() {
    println!("block: {} bytes", layout().block_bytes());
    println!("prompt tokens  bytes        memcpy GB/s   shared GB/s  shared/memcpy  tcp GB/s   tcp/memcpy   tcp latency");
    for tokens in [128usize, 2048, 8192] {
        let n = tokens.div_ceil(16);
        let src = src_check(n);
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
        let tcp = (0..3).map(|_| tcp_transfer(&src)).fold(f64::MAX, f64::min);
        let shm = (0..3).map(|_| shared_transfer(&src)).fold(f64::MAX, f64::min);
        println!(
            "{tokens:>13}  {:>9.1} MB  {:>11.2}  {:>11.2}  {:>13.3}  {:>9.2}  {:>11.3}  {:>9.1} ms",
            bytes / 1e6,
            bytes / memcpy / 1e9,
            bytes / shm / 1e9,
            memcpy / shm,
            bytes / tcp / 1e9,
            memcpy / tcp,
            tcp * 1e3
        );
    }
}
