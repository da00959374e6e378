//! Both endpoints on a virtual clock, joined by an in-memory link with delay, reordering, loss and peer
//! death, each with a real KV cache. After every step both KV ledgers hold; at the end every transfer
//! has ended exactly once on each living side, completed transfers carry exactly the right bytes and
//! the prompt the prefill side described, and both ledgers are back to baseline.

use std::collections::{BTreeMap, HashMap};

use pdserve_kvcache::{BlockId, KvCache, KvConfig, SeqId, TransferId};
use pdserve_pd_transfer::*;

const P: PeerId = PeerId(1);
const D: PeerId = PeerId(2);
const BS: u32 = 4;

fn layout() -> Layout {
    Layout { num_layers: 2, num_kv_heads: 1, head_dim: 2, block_size: BS, dtype: Dtype::F32, latent: false }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Clone, Copy)]
struct Faults {
    delay_ms: u64,
    loss_percent: u64,
    /// Kill this side at this time.
    death: Option<(PeerId, u64)>,
    /// The same-host mode: blocks are named (`BlockAt`) and read from the prefill side's memory when
    /// the message arrives; freed prefill blocks are overwritten at once (as if reused).
    shared: bool,
}

/// A frame in flight: the message and, for blocks, its bytes.
struct Frame {
    to: PeerId,
    msg: Message,
    data: Vec<u8>,
}

fn expected_bytes(transfer: u64, index: u32) -> Vec<u8> {
    (0..layout().block_bytes()).map(|i| (transfer as usize * 31 + index as usize * 7 + i) as u8).collect()
}

#[derive(Default)]
struct Tally {
    completed: usize,
    failed: BTreeMap<&'static str, usize>,
}

fn run(seed: u64, transfers: u64, faults: Faults) -> (Tally, Tally) {
    let mut rng = Rng(seed | 1);
    let mut kv_p = KvCache::new(KvConfig { num_blocks: 256, block_size: BS }).unwrap();
    let mut kv_d = KvCache::new(KvConfig { num_blocks: 256, block_size: BS }).unwrap();
    let mut mem_p: HashMap<BlockId, Vec<u8>> = HashMap::new();
    let mut mem_d: HashMap<BlockId, Vec<u8>> = HashMap::new();
    let mut sender =
        Sender::new(SenderConfig { window_blocks: 3, transfers_max: 1024, shared_region: faults.shared });
    let mut receiver = Receiver::new(2);
    let mut link: Vec<(u64, Frame)> = Vec::new();
    let mut now = 0u64;
    let mut ended_p: HashMap<u64, TransferOutcome> = HashMap::new();
    let mut ended_d: HashMap<u64, TransferOutcome> = HashMap::new();
    let mut prompts: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut wrong_count: HashMap<u64, bool> = HashMap::new();
    // Set up every transfer: prefill computes and leases; decode pulls, and allocates its destination
    // once the prefill side has described the transfer.
    for t in 0..transfers {
        let len = 1 + rng.below(5 * BS as u64) as usize;
        let seq = SeqId(t);
        let prompt: Vec<u32> = (0..len as u32).map(|i| i + 100 * t as u32).collect();
        kv_p.add_sequence(seq, &prompt).unwrap();
        kv_p.reserve(seq, len).unwrap();
        kv_p.commit(seq, len).unwrap();
        let lease = kv_p.lease_sequence(seq, TransferId(t), now + 50 + rng.below(400)).unwrap();
        let blocks = lease.blocks.to_vec();
        let expires = lease.expires_at;
        for (i, b) in blocks.iter().enumerate() {
            mem_p.insert(*b, expected_bytes(t, i as u32));
        }
        let key = TransferKey { transfer: t, epoch: 7 };
        let meta = PromptMeta {
            prompt: prompt.clone(),
            first_token: t as u32,
            first_logprob: -0.5,
            first_top: vec![(t as u32, -0.5), (1, -2.0)],
            queue_us: t,
            prefill_us: 2 * t,
            cached_tokens: 0,
        };
        sender.offer(key, layout(), blocks.clone(), expires, meta).unwrap();
        prompts.insert(t, prompt);
        // Some pulls are wrong on purpose: another epoch, another layout, another block count.
        let (pull_key, pull_layout) = match rng.below(10) {
            0 => (TransferKey { transfer: t, epoch: 6 }, layout()),
            1 => (key, Layout { head_dim: 4, ..layout() }),
            _ => (key, layout()),
        };
        wrong_count.insert(t, rng.below(10) == 2);
        receiver.start(pull_key, P, pull_layout, now + 100 + rng.below(400), faults.shared).unwrap();
    }
    let alive = |who: PeerId, now: u64| faults.death.is_none_or(|(p, at)| p != who || now < at);
    for _ in 0..20_000 {
        // The shells: move what the state machines want sent onto the link.
        while let Some((to, msg)) = receiver.poll_transmit() {
            if alive(D, now) {
                link.push((now + rng.below(faults.delay_ms + 1), Frame { to, msg, data: Vec::new() }));
            }
        }
        while let Some(a) = sender.poll_action() {
            if !alive(P, now) {
                continue;
            }
            let (to, msg, data) = match a {
                SendAction::Message { peer, msg } => (peer, msg, Vec::new()),
                SendAction::Block { peer, key, index, block, shared: true } => {
                    let crc = pdserve_pd_transfer::block_checksum(key, index, &mem_p[&block]);
                    (peer, Message::BlockAt { key, index, slot: block.0, crc }, Vec::new())
                }
                SendAction::Block { peer, key, index, block, shared: false } => {
                    // Read only from a block the transfer's lease still holds.
                    let lease =
                        kv_p.lease(TransferId(key.transfer)).expect("a sending transfer holds its lease");
                    assert!(lease.blocks.contains(&block));
                    let data = mem_p[&block].clone();
                    let crc = pdserve_pd_transfer::block_checksum(key, index, &data);
                    (peer, Message::Block { key, index, len: data.len() as u32, crc }, data)
                }
            };
            let to = if to == D { D } else { to };
            link.push((now + rng.below(faults.delay_ms + 1), Frame { to, msg, data }));
        }
        // Deliver what is due, in random order among them (reordering), dropping some (loss).
        let mut due: Vec<Frame> = Vec::new();
        let mut i = 0;
        while i < link.len() {
            if link[i].0 <= now {
                due.push(link.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        for k in (1..due.len()).rev() {
            let j = rng.below(k as u64 + 1) as usize;
            due.swap(k, j);
        }
        for f in due {
            if rng.below(100) < faults.loss_percent || !alive(f.to, now) {
                continue;
            }
            if f.to == P {
                sender.handle_message(D, f.msg);
            } else if let Message::Block { key, index, len, .. }
            | Message::BlockAt { key, index, slot: len, .. } = f.msg
            {
                let (len, data) = match f.msg {
                    // Named block: read the prefill side's memory now, whatever it holds now.
                    Message::BlockAt { .. } => (layout().block_bytes(), mem_p[&BlockId(len)].clone()),
                    _ => (len as usize, f.data),
                };
                if let Some(dst) = receiver.accept_block(P, key, index, len) {
                    // The protocol and the ledger agree on where the bytes may go.
                    kv_d.check_write(TransferId(key.transfer), dst.block, dst.block_epoch)
                        .expect("a destination the lease holds");
                    mem_d.insert(dst.block, data);
                    receiver.block_written(key, index);
                }
            } else {
                receiver.handle_message(P, f.msg);
            }
        }
        if alive(P, now) {
            sender.handle_timeout(now);
        }
        if alive(D, now) {
            receiver.handle_timeout(now);
        }
        // Events: each transfer ends once per side; the shells settle the leases.
        while let Some(e) = sender.poll_event() {
            assert!(ended_p.insert(e.key.transfer, e.outcome).is_none(), "sender ended {} twice", e.key);
            // Freed blocks get reused at once: a reader that still trusts them sees garbage.
            for b in kv_p.lease(TransferId(e.key.transfer)).unwrap().blocks.to_vec() {
                mem_p.insert(b, vec![0xee; layout().block_bytes()]);
            }
            kv_p.release_lease(TransferId(e.key.transfer)).unwrap();
        }
        while let Some(d) = receiver.poll_described() {
            let t = d.key.transfer;
            assert_eq!(d.meta.prompt, prompts[&t], "transfer {t}: the prompt came across");
            assert_eq!((d.meta.first_token, d.meta.first_top.len()), (t as u32, 2));
            let n = d.blocks as usize + usize::from(wrong_count[&t]);
            let dl = kv_d.allocate_lease(TransferId(t), n, now + 400).unwrap();
            let dest: Vec<(BlockId, u32)> =
                dl.blocks.iter().copied().zip(dl.epochs.iter().copied()).collect();
            // Half the time the decode side holds some leading blocks already (its prefix cache, here
            // written directly) and pulls only the rest; sometimes all of them.
            let from = if rng.below(2) == 0 { rng.below(u64::from(d.blocks) + 1) as u32 } else { 0 };
            for (i, (b, _)) in dest.iter().enumerate().take(from as usize) {
                mem_d.insert(*b, expected_bytes(t, i as u32));
            }
            if receiver.set_destination(t, from, dest[from as usize..].to_vec()).is_err() {
                // A wrong count ends the transfer at once; its end event releases the lease.
                assert!(wrong_count[&t]);
            }
        }
        while let Some(e) = receiver.poll_event() {
            let t = e.key.transfer;
            assert!(ended_d.insert(t, e.outcome.clone()).is_none(), "receiver ended {} twice", e.key);
            if e.outcome == TransferOutcome::Completed {
                let len = prompts[&t].len();
                let seq = SeqId(1_000_000 + t);
                kv_d.adopt_lease(TransferId(t), seq, &vec![0; len]).unwrap();
                for (i, b) in kv_d.block_table(seq).unwrap().to_vec().into_iter().enumerate() {
                    assert_eq!(
                        mem_d[&b],
                        expected_bytes(t, i as u32),
                        "transfer {t} block {i} holds wrong bytes"
                    );
                }
                kv_d.free_sequence(seq, false).unwrap();
            } else if kv_d.lease(TransferId(t)).is_ok() {
                // Ended after the destination was allocated (not before the description came).
                kv_d.release_lease(TransferId(t)).unwrap();
            }
        }
        kv_p.check_invariants().unwrap();
        kv_d.check_invariants().unwrap();
        let p_done = !alive(P, now) || sender.is_empty();
        let d_done = !alive(D, now) || receiver.is_empty();
        if p_done && d_done && link.is_empty() {
            break;
        }
        now += 1;
    }
    if alive(P, now) {
        assert!(sender.is_empty(), "sender still holds transfers at {now} ms");
        assert_eq!(kv_p.stats().leases, 0, "prefill leases left");
        assert_eq!(ended_p.len() as u64, transfers);
    }
    if alive(D, now) {
        assert!(receiver.is_empty(), "receiver still holds transfers");
        let s = kv_d.stats();
        assert_eq!(
            (s.leases, s.sequences, s.blocks_free),
            (0, 0, s.blocks_total),
            "decode ledger not at baseline"
        );
        assert_eq!(ended_d.len() as u64, transfers);
    }
    // The receiver completes only on the sender's `Confirm`, which the sender sends as it completes.
    for (t, o) in &ended_d {
        if *o == TransferOutcome::Completed && alive(P, now) {
            assert_eq!(
                ended_p.get(t),
                Some(&TransferOutcome::Completed),
                "transfer {t}: receiver completed alone"
            );
        }
    }
    let tally = |m: &HashMap<u64, TransferOutcome>| {
        let mut t = Tally::default();
        for o in m.values() {
            match o {
                TransferOutcome::Completed => t.completed += 1,
                TransferOutcome::Failed(r) => *t.failed.entry(r.as_str()).or_default() += 1,
            }
        }
        t
    };
    (tally(&ended_p), tally(&ended_d))
}

#[test]
fn clean_link_completes_every_good_transfer() {
    let (p, d) = run(1, 60, Faults { delay_ms: 0, loss_percent: 0, death: None, shared: false });
    assert!(d.completed > 30, "{:?}", d.failed);
    assert_eq!(p.completed, d.completed, "both sides agree on what completed");
    for reason in d.failed.keys() {
        assert!(["stale_epoch", "layout_mismatch", "block_count_mismatch"].contains(reason), "{reason}");
    }
}

#[test]
fn delay_and_reordering_change_nothing_but_timing() {
    for seed in 1..10 {
        let (p, d) =
            run(seed, 40, Faults { delay_ms: 20, loss_percent: 0, death: None, shared: seed % 2 == 0 });
        assert!(d.completed > 0);
        // A `Confirm` that arrives after the receiver's deadline leaves the sender completed and the
        // receiver failed (safely: it never uses KV it could not confirm); never the other way round.
        assert!(p.completed >= d.completed, "sender {} < receiver {}", p.completed, d.completed);
    }
}

#[test]
fn loss_ends_transfers_by_deadline_never_with_wrong_bytes() {
    for seed in 1..10 {
        let (_, d) =
            run(seed, 40, Faults { delay_ms: 5, loss_percent: 10, death: None, shared: seed % 2 == 0 });
        assert!(d.failed.values().sum::<usize>() > 0, "10% loss must break some transfers");
    }
}

#[test]
fn peer_death_on_either_side_ends_the_other_sides_transfers() {
    for seed in 1..6 {
        let (p, _) =
            run(seed, 40, Faults { delay_ms: 3, loss_percent: 0, death: Some((D, 2)), shared: false });
        assert!(p.failed.get("lease_expired").copied().unwrap_or(0) > 0, "{:?}", p.failed);
        let (_, d) =
            run(seed, 40, Faults { delay_ms: 3, loss_percent: 0, death: Some((P, 2)), shared: true });
        assert!(d.failed.get("data_timeout").copied().unwrap_or(0) > 0, "{:?}", d.failed);
    }
}

#[test]
fn shared_region_mode_completes_and_never_trusts_reused_blocks() {
    let (p, d) = run(3, 60, Faults { delay_ms: 0, loss_percent: 0, death: None, shared: true });
    assert!(d.completed > 30 && p.completed == d.completed, "{:?} {:?}", d.failed, p.failed);
    // Slow links: leases expire mid-transfer and their blocks are overwritten; completed transfers
    // still carry exactly the right bytes (checked inside `run`).
    for seed in 10..20 {
        run(seed, 40, Faults { delay_ms: 40, loss_percent: 2, death: None, shared: true });
    }
}
