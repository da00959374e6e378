//! CRC-32C (Castagnoli), the checksum every block sent inline carries: the receiver recomputes it
//! before the block reaches its KV memory, so a corrupted block fails its transfer instead of being
//! decoded from. The SSE4.2 instruction where the CPU has it (`sys`), a table otherwise.

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82f6_3b78;

const TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crate::sys::crc32c_hw(data).unwrap_or_else(|| crc32c_portable(data))
}

/// The checksum a `Block` carries: CRC-32C over its transfer, epoch and index and the CRC-32C of its
/// bytes, so a block that arrives whole but in the wrong place (a flipped index) fails too. Never 0
/// (0 marks a block sent without one).
pub fn block_checksum(key: crate::TransferKey, index: u32, data: &[u8]) -> u32 {
    let mut head = [0u8; 20];
    head[..8].copy_from_slice(&key.transfer.to_le_bytes());
    head[8..12].copy_from_slice(&key.epoch.to_le_bytes());
    head[12..16].copy_from_slice(&index.to_le_bytes());
    head[16..].copy_from_slice(&crc32c(data).to_le_bytes());
    crc32c(&head).max(1)
}

fn crc32c_portable(data: &[u8]) -> u32 {
    !data.iter().fold(u32::MAX, |c, &b| TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_both_paths_agree() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c_portable(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        let data: Vec<u8> = (0..4099u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 7, 8, 9, 63, 4096, 4099] {
            assert_eq!(crc32c(&data[..len]), crc32c_portable(&data[..len]), "{len} bytes");
        }
        let mut flipped = data.clone();
        flipped[1000] ^= 0x10;
        assert_ne!(crc32c(&flipped), crc32c(&data));
    }
}
