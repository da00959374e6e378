//! A GGUF reader: header, metadata, tensor infos, and dequantization of F32, F16, BF16, Q4_0, Q4_1,
//! Q8_0 and the k-quants most published files use (Q4_K, Q5_K, Q6_K: `*.Q4_K_M.gguf` mixes them) to
//! f32.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::sys::{map_file, Mmap};
use crate::ImportError;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// The ggml tensor types this reader can dequantize (named as ggml names them).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// Like Q4_K with a fifth bit per value.
    Q5_K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 8-bit scales, 6-bit values.
    Q6_K,
    BF16,
}

impl GgmlType {
    fn from_u32(t: u32) -> Option<Self> {
        Some(match t {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
        }
    }
}

/// One tensor's description. `dims` are in ggml order (innermost first), so a PyTorch `[rows, cols]`
/// matrix has `dims == [cols, rows]`.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }

    /// The shape in PyTorch order (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    fn bytes(&self) -> usize {
        let (per, bytes) = self.ty.block();
        self.elements() / per * bytes
    }
}

/// An open GGUF file (memory mapped).
#[derive(Debug)]
pub struct GgufFile {
    pub(crate) path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ImportError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            ImportError::format(self.path, format!("truncated at byte {} (wanted {n} more)", self.pos))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ImportError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ImportError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, ImportError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn len(&mut self, what: &str) -> Result<usize, ImportError> {
        let n = self.u64()?;
        // Nothing in a file can be longer than the file; this also stops absurd allocations.
        if n as usize > self.buf.len() {
            return Err(ImportError::format(self.path, format!("{what} length {n} exceeds the file size")));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, ImportError> {
        let n = self.len("string")?;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ImportError::format(self.path, "string is not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, ImportError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 if depth < 4 => {
                let inner = self.u32()?;
                let n = self.len("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => {
                return Err(ImportError::format(self.path, format!("unknown metadata value type {other}")))
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, ImportError> {
        let file = File::open(path).map_err(|e| ImportError::io(path, e))?;
        let map = map_file(&file).map_err(|e| ImportError::io(path, e))?;
        let mut c = Cursor { buf: &map, pos: 0, path };
        if c.take(4)? != b"GGUF" {
            return Err(ImportError::format(path, "not a GGUF file (bad magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ImportError::Unsupported {
                field: "GGUF version".into(),
                value: version.to_string(),
            });
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims > 4 {
                return Err(ImportError::format(path, format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
            let raw_ty = c.u32()?;
            let ty = GgmlType::from_u32(raw_ty).ok_or_else(|| ImportError::Unsupported {
                field: format!("ggml type of tensor {name}"),
                value: raw_ty.to_string(),
            })?;
            let offset = c.u64()?;
            let info = TensorInfo { name, dims, ty, offset };
            if !info.elements().is_multiple_of(ty.block().0) {
                return Err(ImportError::format(path, format!("tensor {} is not whole blocks", info.name)));
            }
            tensors.push(info);
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
        if align == 0 {
            return Err(ImportError::format(path, "general.alignment is 0"));
        }
        let data_start = c.pos.div_ceil(align) * align;
        for t in &tensors {
            let end = data_start as u64 + t.offset + t.bytes() as u64;
            if end > map.len() as u64 {
                return Err(ImportError::format(
                    path,
                    format!("tensor {} runs past the end of the file", t.name),
                ));
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), map, version, metadata, tensors, data_start })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required integer metadata value.
    pub fn u64(&self, key: &str) -> Result<u64, ImportError> {
        self.get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| ImportError::format(&self.path, format!("missing integer {key}")))
    }

    /// A required float metadata value.
    pub fn f64(&self, key: &str) -> Result<f64, ImportError> {
        self.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| ImportError::format(&self.path, format!("missing number {key}")))
    }

    /// A required string array.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, ImportError> {
        let arr = self.get(key).and_then(Value::as_array);
        arr.and_then(|a| a.iter().map(Value::as_str).collect())
            .ok_or_else(|| ImportError::format(&self.path, format!("missing string array {key}")))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's values as f32, in PyTorch (row-major, outermost first) order.
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        let start = self.data_start + t.offset as usize;
        dequantize(t.ty, &self.map[start..start + t.bytes()], t.elements())
    }
}

/// An f16 value stored little-endian.
fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// A bf16 value stored little-endian.
fn bf16(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// Sub-block `j`'s 6-bit scale and minimum from a k-quant's 12 packed bytes: the first four of each
/// in the low 6 bits of bytes 0-3 and 4-7, the last four split between bytes 8-11 and the top 2
/// bits of bytes 0-7.
fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Dequantizes `n` values of type `ty` from `raw`.
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    match ty {
        GgmlType::F32 => {
            out.extend(raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        }
        GgmlType::F16 => out.extend(raw.chunks_exact(2).map(|b| f16(le16(b)))),
        GgmlType::BF16 => out.extend(raw.chunks_exact(2).map(|b| bf16(le16(b)))),
        GgmlType::Q4_0 => {
            for blk in raw.chunks_exact(18) {
                let d = f16(le16(blk));
                let qs = &blk[2..];
                out.extend(qs.iter().map(|&q| d * (f32::from(q & 0xf) - 8.0)));
                out.extend(qs.iter().map(|&q| d * (f32::from(q >> 4) - 8.0)));
            }
        }
        GgmlType::Q4_1 => {
            for blk in raw.chunks_exact(20) {
                let d = f16(le16(blk));
                let m = f16(le16(&blk[2..]));
                let qs = &blk[4..];
                out.extend(qs.iter().map(|&q| d * f32::from(q & 0xf) + m));
                out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
            }
        }
        GgmlType::Q8_0 => {
            for blk in raw.chunks_exact(34) {
                let d = f16(le16(blk));
                out.extend(blk[2..].iter().map(|&q| d * f32::from(q as i8)));
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // d, dmin (f16), 12 bytes of packed 6-bit scales and minimums, [Q5_K: 32 bytes of fifth
            // bits], 128 bytes of nibbles. Each 64 values: two sub-blocks of 32, the low nibbles of
            // 32 bytes then their high nibbles.
            let five = ty == GgmlType::Q5_K;
            for blk in raw.chunks_exact(if five { 176 } else { 144 }) {
                let (d, dmin) = (f16(le16(blk)), f16(le16(&blk[2..])));
                let scales = &blk[4..16];
                let (qh, qs) = if five { (&blk[16..48], &blk[48..]) } else { (&blk[..0], &blk[16..]) };
                for (j, q) in qs.chunks_exact(32).enumerate() {
                    for (half, shift) in [(0, 0), (1, 4)] {
                        let (sc, m) = k_scale_min(2 * j + half, scales);
                        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
                        let bit = 1u8 << (2 * j + half);
                        out.extend(q.iter().enumerate().map(|(l, &b)| {
                            let high = if five && qh[l] & bit != 0 { 16 } else { 0 };
                            scale * f32::from(((b >> shift) & 0xf) + high) - min
                        }));
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit scales, d (f16).
            for blk in raw.chunks_exact(210) {
                let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
                let d = f16(le16(&blk[208..]));
                let mut y = [0f32; 256];
                for half in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
                    let y = &mut y[128 * half..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q = [
                            (ql[l] & 0xf) | ((qh[l] & 3) << 4),
                            (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4),
                            (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                            (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                        ];
                        for (k, q) in q.into_iter().enumerate() {
                            let scale = f32::from(sc[is + 2 * k] as i8);
                            y[l + 32 * k] = d * scale * f32::from(q as i8 - 32);
                        }
                    }
                }
                out.extend_from_slice(&y);
            }
        }
    }
    debug_assert_eq!(out.len(), n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions() {
        let cases = [
            (0x0000, 0.0),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x7bff, 65504.0),
            (0x0001, 5.960_464_5e-8),
            (0x03ff, 6.097_555e-5),
        ];
        for (h, want) in cases {
            assert_eq!(f16(h), want, "{h:#06x}");
        }
        assert!(f16(0x7c00).is_infinite());
        assert!(f16(0x7e00).is_nan());
        assert_eq!(bf16(0x3f80), 1.0);
    }

    #[test]
    fn block_formats() {
        // Q4_1: d = 0.5, m = -1.0; low nibbles 0..15 then high nibbles 15..0.
        let mut blk = vec![];
        blk.extend_from_slice(&0x3800u16.to_le_bytes());
        blk.extend_from_slice(&0xbc00u16.to_le_bytes());
        blk.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let v = dequantize(GgmlType::Q4_1, &blk, 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[15], 6.5);
        assert_eq!(v[16], 6.5);
        assert_eq!(v[31], -1.0);
        // Q8_0: d = 2, q = -3.
        let mut blk = 0x4000u16.to_le_bytes().to_vec();
        blk.extend([(-3i8) as u8; 32]);
        assert!(dequantize(GgmlType::Q8_0, &blk, 32).iter().all(|&x| x == -6.0));
        // Q4_0: d = 1, nibble 0 is -8.
        let mut blk = 0x3c00u16.to_le_bytes().to_vec();
        blk.extend([0x80u8; 16]);
        let v = dequantize(GgmlType::Q4_0, &blk, 32);
        assert_eq!((v[0], v[16]), (-8.0, 0.0));
    }
}
