//! The few msgpack forms the events use, written by hand: arrays, unsigned integers, nil,
//! strings and 64-bit floats (the spec's smallest encoding of each, as every msgpack decoder reads).

pub(crate) fn array(out: &mut Vec<u8>, len: usize) {
    match len {
        0..=15 => out.push(0x90 | len as u8),
        16..=0xffff => {
            out.push(0xdc);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdd);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }
}

pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

pub(crate) fn nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

pub(crate) fn str(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    match b.len() {
        0..=31 => out.push(0xa0 | b.len() as u8),
        32..=0xff => out.extend_from_slice(&[0xd9, b.len() as u8]),
        0x100..=0xffff => {
            out.push(0xda);
            out.extend_from_slice(&(b.len() as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdb);
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(b);
}

pub(crate) fn float(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from the msgpack spec's tables.
    #[test]
    fn encodings_are_the_specs() {
        let enc = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut v = Vec::new();
            f(&mut v);
            v
        };
        assert_eq!(enc(&|o| uint(o, 127)), [0x7f]);
        assert_eq!(enc(&|o| uint(o, 128)), [0xcc, 0x80]);
        assert_eq!(enc(&|o| uint(o, 65536)), [0xce, 0, 1, 0, 0]);
        assert_eq!(enc(&|o| uint(o, u64::MAX)), [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(&|o| array(o, 3)), [0x93]);
        assert_eq!(enc(&|o| array(o, 16)), [0xdc, 0, 16]);
        assert_eq!(enc(&|o| str(o, "GPU")), [0xa3, b'G', b'P', b'U']);
        assert_eq!(enc(&|o| float(o, 1.5)), [0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
    }
}
