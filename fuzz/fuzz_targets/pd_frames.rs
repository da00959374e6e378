//! Arbitrary bytes as transfer frames fed to both state machines: decoding never panics, a decoded
//! frame re-encodes to the same bytes, and no input makes a receiver hand out a destination outside
//! the blocks it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_kvcache::BlockId;
use pdserve_pd_transfer::*;

fuzz_target!(|data: &[u8]| {
    let layout = Layout {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 2,
        block_size: 2,
        dtype: Dtype::F32,
        latent: false,
    };
    let key = TransferKey { transfer: 1, epoch: 1 };
    let mut sender = Sender::new(SenderConfig { window_blocks: 2, transfers_max: 4, shared_region: true });
    let _ = sender.offer(key, layout, vec![BlockId(0), BlockId(1)], 100, PromptMeta::default());
    let mut receiver = Receiver::new(1);
    let dest = vec![(BlockId(7), 3), (BlockId(8), 3)];
    let _ = receiver.start(key, PeerId(1), layout, 100, true);
    let mut buf = data;
    let mut now = 0;
    while let Ok(Some(Frame { msg, data: bytes, consumed: used })) = decode(buf) {
        let mut again = Vec::new();
        encode(&msg, bytes, &mut again);
        assert_eq!(&again[..], &buf[..used]);
        buf = &buf[used..];
        now += 1;
        sender.handle_message(PeerId(2), msg.clone());
        match msg {
            Message::Block { key, index, len, .. } => {
                if let Some(d) = receiver.accept_block(PeerId(1), key, index, len as usize) {
                    assert!(dest.contains(&(d.block, d.block_epoch)));
                    receiver.block_written(key, index);
                }
            }
            other => receiver.handle_message(PeerId(1), other),
        }
        // Whatever the sender claims to hold, the destinations stay among the two given here; the
        // receiver may hold the first block already (its prefix cache), as the input's length says.
        while let Some(d) = receiver.poll_described() {
            let from = (buf.len() % 2) as u32;
            let _ = receiver.set_destination(d.key.transfer, from, dest[from as usize..].to_vec());
        }
        sender.handle_timeout(now);
        receiver.handle_timeout(now);
        while sender.poll_action().is_some() {}
        while receiver.poll_transmit().is_some() {}
    }
    sender.handle_timeout(u64::MAX);
    receiver.handle_timeout(u64::MAX);
    assert!(sender.is_empty() && receiver.is_empty());
});
