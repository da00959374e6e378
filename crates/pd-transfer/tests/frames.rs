//! Framing: every message survives encode/decode, byte by byte, and bad frames are errors.

use pdserve_pd_transfer::*;

fn layout() -> Layout {
    Layout {
        num_layers: 30,
        num_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        dtype: Dtype::Bf16,
        latent: false,
    }
}

#[test]
fn every_message_round_trips_even_byte_by_byte() {
    let key = TransferKey { transfer: 0xdead_beef_0123, epoch: 9 };
    let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    let msgs = vec![
        (Message::Pull { key, layout: layout(), shared: true }, vec![]),
        (Message::Ready { key, from: 3 }, vec![]),
        (Message::BlockAt { key, index: 2, slot: 77, crc: 0xdead_beef }, vec![]),
        (Message::Confirm { key }, vec![]),
        (Message::Accept { key, blocks: 7, meta: Box::default() }, vec![]),
        (
            Message::Accept {
                key,
                blocks: 2,
                meta: Box::new(PromptMeta {
                    prompt: vec![1, 2, 3, u32::MAX],
                    first_token: 42,
                    first_logprob: -0.25,
                    first_top: vec![(42, -0.25), (7, f32::NAN)],
                    queue_us: 1_000,
                    prefill_us: u64::MAX,
                    cached_tokens: 3,
                }),
            },
            vec![],
        ),
        (
            Message::Reject {
                key,
                reason: FailReason::LayoutMismatch {
                    sender: layout(),
                    receiver: Layout { dtype: Dtype::F32, ..layout() },
                },
            },
            vec![],
        ),
        (Message::Reject { key, reason: FailReason::BlockCountMismatch { sender: 3, receiver: 4 } }, vec![]),
        (
            Message::Block { key, index: 5, len: data.len() as u32, crc: block_checksum(key, 5, &data) },
            data.clone(),
        ),
        (Message::Ack { key, written: 4 }, vec![]),
        (Message::Done { key }, vec![]),
        (Message::Abort { key, reason: FailReason::LeaseExpired }, vec![]),
    ];
    let mut wire = Vec::new();
    for (m, d) in &msgs {
        encode(m, d, &mut wire);
    }
    let mut got = Vec::new();
    let mut buf = Vec::new();
    for b in wire {
        buf.push(b);
        while let Some(f) = decode(&buf).unwrap() {
            got.push((f.msg, f.data.to_vec()));
            let used = f.consumed;
            buf.drain(..used);
        }
    }
    assert_eq!(got, msgs);
    assert_eq!(layout().block_bytes(), 2 * 30 * 16 * 3 * 64 * 2);
}

#[test]
fn bad_frames_are_errors() {
    let mut too_big = ((FRAME_BYTES_MAX + 1) as u32).to_le_bytes().to_vec();
    too_big.push(1);
    assert!(matches!(decode(&too_big), Err(TransferError::FrameTooLarge { .. })));
    for body in [vec![99u8; 13], vec![1u8], vec![6u8; 20]] {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend(&body);
        assert_eq!(decode(&f), Err(TransferError::MalformedFrame), "{body:?}");
    }
    assert_eq!(decode(&[1, 0]), Ok(None));
    // An `Accept` that claims more prompt tokens than its frame holds is malformed, not an allocation.
    let mut f = Vec::new();
    let key = TransferKey { transfer: 1, epoch: 1 };
    encode(&Message::Accept { key, blocks: 1, meta: Box::default() }, &[], &mut f);
    let n = f.len();
    f[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&f), Err(TransferError::MalformedFrame));
}
