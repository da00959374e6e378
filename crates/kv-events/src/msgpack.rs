//! The few msgpack forms the events use, written by hand (arrays, unsigned integers, nil,
//! strings and 64-bit floats, the spec's smallest encoding of each), and a reader of every form but
//! extensions, for subscribers.

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

/// A decoded msgpack value, borrowing strings and binaries from the input.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
}

/// Arrays and maps nested deeper are refused (events nest three levels).
const DEPTH_MAX: usize = 16;

/// Decodes one value from the front of `input`, returning it and the rest. Every length is checked
/// against the bytes left before anything is allocated, so a hostile length costs nothing.
pub(crate) fn read(input: &[u8]) -> Result<(Value<'_>, &[u8]), String> {
    read_at(input, 0)
}

fn take(input: &[u8], n: usize) -> Result<(&[u8], &[u8]), String> {
    if input.len() < n {
        return Err(format!("{n} bytes announced, {} left", input.len()));
    }
    Ok(input.split_at(n))
}

fn be(input: &[u8], n: usize) -> Result<(u64, &[u8]), String> {
    let (b, rest) = take(input, n)?;
    Ok((b.iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x)), rest))
}

fn string(n: usize, rest: &[u8]) -> Result<(Value<'_>, &[u8]), String> {
    let (b, rest) = take(rest, n)?;
    let s = std::str::from_utf8(b).map_err(|e| format!("a string that is not UTF-8: {e}"))?;
    Ok((Value::Str(s), rest))
}

fn bin(n: usize, rest: &[u8]) -> Result<(Value<'_>, &[u8]), String> {
    let (b, rest) = take(rest, n)?;
    Ok((Value::Bin(b), rest))
}

fn items(n: usize, mut rest: &[u8], depth: usize) -> Result<(Value<'_>, &[u8]), String> {
    // Each item takes a byte at least.
    if n > rest.len() {
        return Err(format!("an array of {n} in {} bytes", rest.len()));
    }
    // (A hint only: a value is larger than the byte it may take.)
    let mut out = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let (v, r) = read_at(rest, depth + 1)?;
        out.push(v);
        rest = r;
    }
    Ok((Value::Array(out), rest))
}

fn pairs(n: usize, mut rest: &[u8], depth: usize) -> Result<(Value<'_>, &[u8]), String> {
    if n.saturating_mul(2) > rest.len() {
        return Err(format!("a map of {n} in {} bytes", rest.len()));
    }
    let mut out = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let (k, r) = read_at(rest, depth + 1)?;
        let (v, r) = read_at(r, depth + 1)?;
        out.push((k, v));
        rest = r;
    }
    Ok((Value::Map(out), rest))
}

fn read_at(input: &[u8], depth: usize) -> Result<(Value<'_>, &[u8]), String> {
    if depth > DEPTH_MAX {
        return Err(format!("nested deeper than {DEPTH_MAX}"));
    }
    let (&tag, rest) = input.split_first().ok_or("the input ends inside a value")?;
    match tag {
        0x00..=0x7f => Ok((Value::Uint(u64::from(tag)), rest)),
        0x80..=0x8f => pairs(usize::from(tag & 0x0f), rest, depth),
        0x90..=0x9f => items(usize::from(tag & 0x0f), rest, depth),
        0xa0..=0xbf => string(usize::from(tag & 0x1f), rest),
        0xc0 => Ok((Value::Nil, rest)),
        0xc2 => Ok((Value::Bool(false), rest)),
        0xc3 => Ok((Value::Bool(true), rest)),
        0xc4..=0xc6 => {
            let (n, rest) = be(rest, 1 << (tag - 0xc4))?;
            bin(n as usize, rest)
        }
        0xca => {
            let (v, rest) = be(rest, 4)?;
            Ok((Value::Float(f64::from(f32::from_bits(v as u32))), rest))
        }
        0xcb => {
            let (v, rest) = be(rest, 8)?;
            Ok((Value::Float(f64::from_bits(v)), rest))
        }
        0xcc..=0xcf => {
            let (v, rest) = be(rest, 1 << (tag - 0xcc))?;
            Ok((Value::Uint(v), rest))
        }
        0xd0..=0xd3 => {
            let n = 1usize << (tag - 0xd0);
            let (v, rest) = be(rest, n)?;
            let shift = 64 - 8 * n as u32;
            Ok((Value::Int(((v << shift) as i64) >> shift), rest))
        }
        0xd9..=0xdb => {
            let (n, rest) = be(rest, 1 << (tag - 0xd9))?;
            string(n as usize, rest)
        }
        0xdc | 0xdd => {
            let (n, rest) = be(rest, if tag == 0xdc { 2 } else { 4 })?;
            items(n as usize, rest, depth)
        }
        0xde | 0xdf => {
            let (n, rest) = be(rest, if tag == 0xde { 2 } else { 4 })?;
            pairs(n as usize, rest, depth)
        }
        0xe0..=0xff => Ok((Value::Int(i64::from(tag as i8)), rest)),
        other => Err(format!("msgpack type 0x{other:02x} (extensions) is not read")),
    }
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
    #[test]
    fn what_is_written_reads_back_and_hostile_lengths_fail_cheaply() {
        let mut v = Vec::new();
        array(&mut v, 5);
        uint(&mut v, u64::MAX);
        str(&mut v, &"x".repeat(40));
        nil(&mut v);
        float(&mut v, -2.5);
        array(&mut v, 20);
        for i in 0..20 {
            uint(&mut v, i * 1000);
        }
        v.extend_from_slice(&[0xd0, 0xfe, 0xff]); // int8 -2, then a negative fixint -1
        let (val, rest) = read(&v).unwrap();
        let Value::Array(items) = val else { panic!("{val:?}") };
        assert_eq!(items[0], Value::Uint(u64::MAX));
        assert_eq!(items[1], Value::Str(&"x".repeat(40)));
        assert_eq!((&items[2], &items[3]), (&Value::Nil, &Value::Float(-2.5)));
        assert_eq!(items[4], Value::Array((0..20).map(|i| Value::Uint(i * 1000)).collect()));
        assert_eq!(read(rest).unwrap(), (Value::Int(-2), &[0xffu8][..]));
        assert_eq!(read(&[0xff]).unwrap().0, Value::Int(-1));
        // An array of 2^32-1 items in 4 bytes is refused before allocating.
        assert!(read(&[0xdd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4]).is_err());
        assert!(read(&[0xdb, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(read(&[0x91; 40]).is_err(), "nesting is bounded");
        assert!(read(&[]).is_err());
    }
}
