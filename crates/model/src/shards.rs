//! A checkpoint's safetensors files (one, or an index of shards) mapped with memmap2, read tensor by
//! tensor into f32: bf16, f16, block-scaled FP8 and FP4 (NVFP4, MXFP4) widened as they are read.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::bits16::{bf16_value, f16_value};
use crate::sys::{map_file, Mmap};
use crate::ModelError;

pub(crate) struct Shards {
    maps: Vec<(PathBuf, Mmap)>,
    /// tensor name -> shard index
    pub(crate) index: HashMap<String, usize>,
    /// Block-scaled FP8 checkpoints: the scale blocks' shape.
    pub(crate) fp8_block: Option<[usize; 2]>,
}

impl Shards {
    pub(crate) fn open(dir: &Path) -> Result<Shards, ModelError> {
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else {
            let index_path = dir.join("model.safetensors.index.json");
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::format(&index_path, e.to_string()))?;
            let map = v["weight_map"]
                .as_object()
                .ok_or_else(|| ModelError::format(&index_path, "no weight_map"))?;
            let mut files: Vec<PathBuf> =
                map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
            files.sort();
            files.dedup();
            files
        };
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            let map = map_file(&file).map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::format(&path, e.to_string()))?;
            for name in st.names() {
                index.insert(name.to_string(), i);
            }
            maps.push((path, map));
        }
        Ok(Shards { maps, index, fp8_block: None })
    }

    /// Tensor `name` where it lies: its file, that file's map and the view (a missing one is an error
    /// naming it, with `why` after).
    fn view(&self, name: &str, why: &str) -> Result<(&Path, &Mmap, TensorView<'_>), ModelError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::format(&self.maps[0].0, format!("missing tensor {name}{why}")))?;
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::format(path, e.to_string()))?;
        let t = st.tensor(name).map_err(|e| ModelError::format(path, e.to_string()))?;
        Ok((path, map, t))
    }

    /// Tensor `name` as f32, checked against `shape`.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (path, map, t) = self.view(name, "")?;
        if shape.len() == 2 && self.fp4(name) {
            // FP4: two codes a byte, the even column low, each times its group's scale.
            let (scales, group) = self.fp4_scales(name, shape)?;
            let (cols, groups) = (shape[1], shape[1] / group);
            let b = t.data();
            // Codes two a byte (`[rows, cols / 2]`), or `F4` counting 4-bit elements (`[rows, cols]`).
            let stored = if t.dtype() == Dtype::F4 { [shape[0], cols] } else { [shape[0], cols / 2] };
            if t.shape() != stored || b.len() * 2 != shape[0] * cols {
                return Err(ModelError::format(
                    path,
                    format!("FP4 tensor {name} has shape {:?}, expected {shape:?} in codes", t.shape()),
                ));
            }
            let values = (0..shape[0] * cols)
                .map(|i| {
                    let byte = b[i / 2];
                    let code = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
                    // (One rounding, as the kernels widen it.)
                    crate::sys::e2m1_value(code) * scales[(i / cols) * groups + (i % cols) / group]
                })
                .collect();
            let at = b.as_ptr() as usize - map.as_ptr() as usize;
            crate::sys::release_pages(map, at..at + b.len());
            return Ok(values);
        }
        if t.shape() != shape {
            return Err(ModelError::format(
                path,
                format!("tensor {name} has shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        let b = t.data();
        let at = b.as_ptr() as usize - map.as_ptr() as usize;
        let values = match t.dtype() {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| f16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F8_E4M3 if self.fp8_block.is_some() && shape.len() == 2 => {
                let scales = self.fp8_scales(name, shape)?;
                let [br, bc] = self.fp8_block.expect("checked");
                let (cols, scale_cols) = (shape[1], shape[1].div_ceil(bc));
                let lut: Vec<f32> = (0..=255u8).map(crate::sys::e4m3_value).collect();
                b.iter()
                    .enumerate()
                    .map(|(i, &q)| lut[q as usize] * scales[(i / cols / br) * scale_cols + (i % cols) / bc])
                    .collect()
            }
            other => {
                return Err(ModelError::Unsupported {
                    field: format!("dtype of {name}"),
                    value: format!("{other:?}"),
                })
            }
        };
        // Converted: the file's pages of it can go (they come back from the file if read again).
        crate::sys::release_pages(map, at..at + b.len());
        Ok(values)
    }

    /// Integer tensor `name` (i32 or i64) and its shape.
    pub(crate) fn get_ints(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>), ModelError> {
        let (_, _, t) = self.view(name, "")?;
        let b = t.data();
        let values = match t.dtype() {
            Dtype::I32 => {
                b.chunks_exact(4).map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()
            }
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
            other => {
                return Err(ModelError::Unsupported {
                    field: format!("dtype of {name}"),
                    value: format!("{other:?}"),
                })
            }
        };
        Ok((values, t.shape().to_vec()))
    }

    /// The stored type and shape of tensor `name`, when the checkpoint has it.
    fn stored(&self, name: &str) -> Option<(Dtype, Vec<usize>)> {
        let &i = self.index.get(name)?;
        let st = SafeTensors::deserialize(&self.maps[i].1).ok()?;
        st.tensor(name).ok().map(|t| (t.dtype(), t.shape().to_vec()))
    }

    /// Where the group scales of FP4 tensor `name` are, and the group (columns per scale): NVFP4
    /// as ModelOpt writes it (u8 codes two a byte, `_scale` e4m3 per 16 columns, `_scale_2` one f32)
    /// or MXFP4 (u8 / i8 codes two a byte, or `F4` codes, with `_scale` or `_scale_inv` ue8m0 per 32
    /// columns). `None` when `name` is not FP4: an int8 tensor's per-row scale does not fit.
    fn fp4_layout(&self, name: &str) -> Option<(String, usize)> {
        if !name.ends_with(".weight") {
            return None;
        }
        let (dtype, shape) = self.stored(name)?;
        // Columns of codes per stored column.
        let per = match dtype {
            Dtype::U8 | Dtype::I8 => 2,
            Dtype::F4 => 1,
            _ => return None,
        };
        scale_names(name).into_iter().find_map(|scale| {
            let (sd, ss) = self.stored(&scale)?;
            let scale_ok =
                matches!(sd, Dtype::F8_E4M3 | Dtype::F8_E8M0 | Dtype::U8 | Dtype::F32 | Dtype::BF16);
            let (&rows, &cols) = (shape.first()?, shape.get(1)?);
            let groups = *ss.get(1)?;
            let group = (groups > 0).then(|| cols * per / groups)?;
            (scale_ok
                && ss.len() == 2
                && ss[0] == rows
                && matches!(group, 16 | 32)
                && groups * group == cols * per)
                .then_some((scale, group))
        })
    }

    /// Whether `name` is an FP4 tensor's codes (see [`fp4_layout`](Self::fp4_layout)).
    pub(crate) fn fp4(&self, name: &str) -> bool {
        self.fp4_layout(name).is_some()
    }

    /// Scale tensor `n` (f32, bf16, e4m3 or ue8m0 as stored; u8 read as ue8m0) as f32, checked to
    /// hold as many values as `want`.
    fn scale_values(&self, n: &str, want: &[usize], of: &str) -> Result<Vec<f32>, ModelError> {
        let (path, _, t) = self.view(n, &format!(" (the scales of {of})"))?;
        let count: usize = t.shape().iter().product();
        if count != want.iter().product::<usize>() {
            return Err(ModelError::format(
                path,
                format!("tensor {n} has shape {:?}, expected {want:?}", t.shape()),
            ));
        }
        let b = t.data();
        Ok(match t.dtype() {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F8_E4M3 => b.iter().map(|&q| crate::sys::e4m3_value(q)).collect(),
            // ue8m0: an exponent byte, 2^(b - 127).
            Dtype::F8_E8M0 | Dtype::U8 => b.iter().map(|&e| e8m0_value(e)).collect(),
            other => {
                return Err(ModelError::Unsupported {
                    field: format!("dtype of {n}"),
                    value: format!("{other:?}"),
                })
            }
        })
    }

    /// The scale of each group of FP4 tensor `name` of `shape` (row-major, `shape[1] / group` a
    /// row) in f32, NVFP4's per-tensor `_scale_2` folded in, and the group.
    fn fp4_scales(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, usize), ModelError> {
        let (scale, group) = self
            .fp4_layout(name)
            .ok_or_else(|| ModelError::format(&self.maps[0].0, format!("{name} is not an FP4 tensor")))?;
        if !shape[1].is_multiple_of(group) {
            return Err(ModelError::format(
                &self.maps[0].0,
                format!("FP4 tensor {name} has {} columns, not a multiple of the group of {group}", shape[1]),
            ));
        }
        let of = format!("FP4 {name}");
        let scales = self.scale_values(&scale, &[shape[0], shape[1] / group], &of)?;
        let global = format!("{name}_scale_2");
        let global = if self.has(&global) { self.scale_values(&global, &[], &of)?[0] } else { 1.0 };
        Ok((scales.into_iter().map(|s| s * global).collect(), group))
    }

    /// What `name` is stored as (f32 when it is missing or another type: it loads as f32 either way).
    pub(crate) fn dtype(&self, name: &str) -> CheckpointDtype {
        if self.fp4(name) {
            return CheckpointDtype::Fp4;
        }
        let stored = self.index.get(name).and_then(|&i| {
            let st = SafeTensors::deserialize(&self.maps[i].1).ok()?;
            st.tensor(name).ok().map(|t| t.dtype())
        });
        match stored {
            Some(Dtype::BF16) => CheckpointDtype::Bf16,
            Some(Dtype::F16) => CheckpointDtype::F16,
            Some(Dtype::F8_E4M3) => CheckpointDtype::Fp8,
            _ => CheckpointDtype::F32,
        }
    }

    /// The scales of FP8 tensor `name` of `shape` (`name` + `_scale_inv`, or DeepSeek's `stem.scale`: one per block, f32, bf16 or
    /// ue8m0 powers of two), as f32.
    fn fp8_scales(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let [br, bc] = self.fp8_block.expect("an FP8 checkpoint");
        let scale_name = scale_names(name)
            .into_iter()
            .skip(1)
            .find(|n| self.has(n))
            .unwrap_or_else(|| format!("{name}_scale_inv"));
        let want = [shape[0].div_ceil(br), shape[1].div_ceil(bc)];
        if let Some((_, stored)) = self.stored(&scale_name).filter(|(_, s)| s != &want) {
            return Err(ModelError::format(
                &self.maps[0].0,
                format!("tensor {scale_name} has shape {stored:?}, expected {want:?}"),
            ));
        }
        self.scale_values(&scale_name, &want, &format!("FP8 {name}"))
    }

    /// For each value of tensor `name` of `shape`, the scale of the FP8 block it came from, or 0
    /// where it is not FP8 (what `Fp8Matrix::from_blocks` reads).
    pub(crate) fn block_scales(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let n = shape.iter().product();
        if shape.len() == 2 && self.fp4(name) {
            let (scales, group) = self.fp4_scales(name, shape)?;
            let (cols, groups) = (shape[1], shape[1] / group);
            return Ok((0..n).map(|i| scales[(i / cols) * groups + (i % cols) / group]).collect());
        }
        if self.dtype(name) != CheckpointDtype::Fp8 || shape.len() != 2 || self.fp8_block.is_none() {
            return Ok(vec![0.0; n]);
        }
        let scales = self.fp8_scales(name, shape)?;
        let [br, bc] = self.fp8_block.expect("checked");
        let (cols, scale_cols) = (shape[1], shape[1].div_ceil(bc));
        Ok((0..n).map(|i| scales[(i / cols / br) * scale_cols + (i % cols) / bc]).collect())
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
}

/// Where the scales of `name` may be: `name_scale` (ModelOpt's), `name_scale_inv` (Hugging Face's
/// FP8 and DeepSeek's), or `stem.scale` for `stem.weight` (DeepSeek's own checkpoints' naming).
fn scale_names(name: &str) -> Vec<String> {
    let mut names = vec![format!("{name}_scale"), format!("{name}_scale_inv")];
    if let Some(stem) = name.strip_suffix(".weight") {
        names.push(format!("{stem}.scale"));
    }
    names
}

/// The value of ue8m0 scale byte `e`: 2^(e - 127) (255 is NaN).
fn e8m0_value(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(1 << 22),
        255 => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// The precision a checkpoint's projections are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointDtype {
    F32,
    Bf16,
    F16,
    /// Block-scaled FP8 (e4m3 values, a scale per block).
    Fp8,
    /// NVFP4 (e2m1 values two a byte, an e4m3 scale per 16 and an f32 one per tensor).
    Fp4,
}
