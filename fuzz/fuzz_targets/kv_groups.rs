//! Arbitrary bytes decoded as operations on KV groups (a sliding window, rows compressed by 4 and by
//! 8, per-request state with restore points, or none): every invariant holds after every operation, a
//! prefix hit and a transfer's reused blocks hold what the prompt computed, a restore resumes the
//! state of exactly its prefix, and after ending everything every block and state slot is free again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_kvcache::sim_groups::{config, GroupDriver, GroupOp};

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else { return };
    let blocks = [
        6 + u32::from(shape % 4) * 10,
        6 + u32::from(shape / 4 % 4) * 10,
        6 + u32::from(shape / 16 % 4) * 10,
    ];
    let (state_bytes, slots) = if shape >= 192 { (0, 16) } else { (64, 3 + u32::from(shape % 13)) };
    let Ok(mut d) = GroupDriver::new(config(blocks, state_bytes, slots)) else { return };
    let mut bytes = rest.iter().copied();
    while let Some(op) = GroupOp::decode(&mut bytes) {
        d.apply(op);
    }
    d.drain();
});
