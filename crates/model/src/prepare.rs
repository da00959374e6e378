//! Weights in the form a format serves, made a layer at a time: `ModelFiles::load_for` converts each
//! layer as it is read and drops its f32 projections at once where nothing will read them, so loading
//! never holds the whole model in f32 and in its served form together (the peak is the served form,
//! the f32 embedding and one layer in f32).

use crate::fp4::Fp4Matrix;
use crate::fp8::Fp8Matrix;
use crate::quant::{
    stack_layer, Bf16Matrix, F16Matrix, Q4Matrix, Q8Matrix, QuantLayer, QuantMatrix, WeightFormat,
};
use crate::weights::LayerWeights;
use crate::{ModelConfig, ModelError};

/// Each layer's projections in a served format, ready for `CpuBackend::with_prepared`.
#[derive(Debug)]
pub struct PreparedWeights {
    pub(crate) format: WeightFormat,
    pub(crate) layers: PreparedLayers,
    /// What the checkpoint stores (see [`from_checkpoint`](Self::from_checkpoint)).
    checkpoint: crate::CheckpointDtype,
}

/// The converted layers, by format.
#[derive(Debug)]
pub(crate) enum PreparedLayers {
    /// f32: nothing to convert.
    None,
    Q8(Vec<QuantLayer<Q8Matrix>>),
    Q4(Vec<QuantLayer<Q4Matrix>>),
    Bf16(Vec<QuantLayer<Bf16Matrix>>),
    F16(Vec<QuantLayer<F16Matrix>>),
    Fp8(Vec<QuantLayer<Fp8Matrix>>),
    Fp4(Vec<QuantLayer<Fp4Matrix>>),
}

impl PreparedWeights {
    /// Nothing converted yet, for `format` (`Auto` is taken as f32: resolve it first).
    pub fn new(format: WeightFormat, _c: &ModelConfig) -> Result<PreparedWeights, ModelError> {
        let format = if format == WeightFormat::Auto { WeightFormat::F32 } else { format };
        let layers = match format {
            WeightFormat::Q8 => PreparedLayers::Q8(Vec::new()),
            WeightFormat::Q4 => PreparedLayers::Q4(Vec::new()),
            WeightFormat::Bf16 => PreparedLayers::Bf16(Vec::new()),
            WeightFormat::F16 => PreparedLayers::F16(Vec::new()),
            WeightFormat::Fp8 => PreparedLayers::Fp8(Vec::new()),
            WeightFormat::Fp4 => PreparedLayers::Fp4(Vec::new()),
            WeightFormat::F32 | WeightFormat::Auto => PreparedLayers::None,
        };
        Ok(PreparedWeights { format, layers, checkpoint: crate::CheckpointDtype::F32 })
    }

    /// Says what the checkpoint stores: an FP4 one's codes and scales are then kept as shipped
    /// under `fp4` wherever it ships them, in every layer (MXFP4 experts beside a dense first
    /// layer: that layer held plain, not quantized); any other is quantized.
    pub fn from_checkpoint(mut self, dtype: crate::CheckpointDtype) -> PreparedWeights {
        self.checkpoint = dtype;
        self
    }

    /// The format the layers are in.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Whether every step of `format` reads converted weights, so the f32 projections can go: every
    /// format but f32.
    pub(crate) fn replaces_f32(format: WeightFormat, _c: &ModelConfig) -> bool {
        !matches!(format, WeightFormat::F32 | WeightFormat::Auto)
    }

    /// Whether the bf16 rows product takes a model's quantized projections: every stacked matrix's
    /// widths are multiples of 32.
    pub(crate) fn rows_bf16_fits(c: &ModelConfig) -> bool {
        crate::quant::matrix_shapes(c).iter().all(|&(r, k)| r % 32 == 0 && k % 32 == 0)
    }

    /// Converts the next layer (FP8: each group quantized with its own scale).
    pub fn push(&mut self, l: &LayerWeights, c: &ModelConfig) -> Result<(), ModelError> {
        self.push_with_scales(l, None, c)
    }

    /// [`push`](Self::push), FP8 taking each value's block scale from `scales` where given (the
    /// layer of scales `Weights::load_each` reads: the checkpoint's own codes and scales kept).
    pub fn push_with_scales(
        &mut self,
        l: &LayerWeights,
        scales: Option<&LayerWeights>,
        c: &ModelConfig,
    ) -> Result<(), ModelError> {
        fn quantize<M: QuantMatrix>(l: &LayerWeights, c: &ModelConfig) -> Result<QuantLayer<M>, ModelError> {
            stack_layer(l, c, M::quantize).ok_or_else(|| ModelError::Unsupported {
                field: "quantized weights".into(),
                value: "a matrix width that is not a multiple of 32".into(),
            })
        }
        match &mut self.layers {
            PreparedLayers::None => {}
            PreparedLayers::Q8(v) => v.push(quantize(l, c)?),
            PreparedLayers::Q4(v) => v.push(quantize(l, c)?),
            PreparedLayers::F16(v) => {
                v.push(stack_layer(l, c, F16Matrix::quantize).ok_or_else(|| ModelError::Unsupported {
                    field: "--weights f16".into(),
                    value: "a weight past f16's range".into(),
                })?)
            }
            PreparedLayers::Fp8(v) => {
                let refused = || ModelError::Unsupported {
                    field: "--weights fp8".into(),
                    value: "FP8 blocks narrower than 16 columns".into(),
                };
                v.push(
                    as_shipped(l, scales, c, Fp8Matrix::dynamic, Fp8Matrix::from_blocks)
                        .ok_or_else(refused)?,
                )
            }
            PreparedLayers::Fp4(v) => {
                let refused = || ModelError::Unsupported {
                    field: "--weights fp4".into(),
                    value:
                        "a projection whose width is not a multiple of 16, or FP4 groups other than 16 or 32"
                            .into(),
                };
                // An FP4 checkpoint's codes and scales as shipped (what it ships unquantized, plain):
                // NVFP4 by its config, MXFP4 experts by their tensors; any other checkpoint quantized.
                let shipped = c.fp4_group.is_some() || self.checkpoint == crate::CheckpointDtype::Fp4;
                let scales = scales.filter(|_| shipped);
                v.push(
                    as_shipped(l, scales, c, Fp4Matrix::dynamic, Fp4Matrix::from_groups)
                        .ok_or_else(refused)?,
                )
            }
            PreparedLayers::Bf16(v) => {
                v.push(stack_layer(l, c, Bf16Matrix::pack).ok_or_else(|| ModelError::Unsupported {
                    field: "--weights bf16".into(),
                    value: "a projection whose rows are not a multiple of 32".into(),
                })?)
            }
        }
        Ok(())
    }

    /// [`push`](Self::push), then the layer's f32 projections dropped where no step will read them;
    /// FP8 reads the layer's block scales with `scales` (see `Weights::load_each`).
    pub fn push_and_free(
        &mut self,
        l: &mut LayerWeights,
        scales: &dyn Fn() -> Result<LayerWeights, ModelError>,
        c: &ModelConfig,
    ) -> Result<(), ModelError> {
        match self.layers {
            PreparedLayers::Fp8(_) | PreparedLayers::Fp4(_) => {
                self.push_with_scales(l, Some(&scales()?), c)?
            }
            _ => self.push(l, c)?,
        }
        if PreparedWeights::replaces_f32(self.format, c) {
            l.release_projections();
        }
        Ok(())
    }
}

/// Layer `l` in a scaled format: from the checkpoint's own values and `scales` (one per value,
/// moved as the values were) with `shipped`, or quantized with `dynamic` where no scales are given.
fn as_shipped<M>(
    l: &LayerWeights,
    scales: Option<&LayerWeights>,
    c: &ModelConfig,
    dynamic: fn(&[f32], usize, usize) -> Option<M>,
    shipped: fn(&[f32], &[f32], usize, usize) -> Option<M>,
) -> Option<QuantLayer<M>> {
    match scales {
        None => stack_layer(l, c, dynamic),
        Some(s) => {
            let raw = |w: &[f32], r: usize, k: usize| Some((w.to_vec(), r, k));
            let w = stack_layer(l, c, raw)?;
            let s = stack_layer(s, c, raw)?;
            w.zip(s, &|(w, r, k), (s, _, _)| shipped(&w, &s, r, k))
        }
    }
}
