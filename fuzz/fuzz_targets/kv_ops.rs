//! Arbitrary bytes decoded as KV cache operations: every invariant holds after every operation, and
//! after ending everything every block is free again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_kvcache::sim::{Driver, Op};
use pdserve_kvcache::KvConfig;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else { return };
    let block_size = [1, 2, 4, 16][usize::from(shape % 4)];
    let num_blocks = 8 + u32::from(shape / 4) % 56;
    let Ok(mut d) = Driver::new(KvConfig { num_blocks, block_size }) else { return };
    let mut bytes = rest.iter().copied();
    while let Some(op) = Op::decode(&mut bytes) {
        d.apply(op);
    }
    d.drain();
});
