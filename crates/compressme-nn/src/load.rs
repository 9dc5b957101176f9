//! Models from artifacts: module storage exactly as an artifact holds it.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use compressme_artifact::{Artifact, Dtype, Stored};

use crate::{Error, Model, ModuleMut, ModuleRef, PackedFrozenEmbedding, Result, Table, Weight};

/// The candle dtype of a safetensors dtype.
pub(crate) fn candle_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::Bf16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

enum Staged {
    Linear(Weight),
    Embedding(Table),
}

/// Gives every module whose weight the artifact holds (`NAME.weight` for module `NAME`)
/// that weight in the artifact's storage: packed codes stay packed (no re-quantization),
/// lossless tables stay in their verified blocks, dense weights become dense tensors.
/// All or nothing: every such weight is read, verified and checked against its module's
/// shape before any module changes; on an error the model is as it was.
/// Returns how many modules changed. Tensors that are not module weights (biases, norms)
/// are left to the loader that built the model.
///
/// # Errors
/// A shape that differs from the module's, an embedding stored quantized in a format
/// other than `int8-rows`, and any read or verification error of the artifact.
pub fn apply_artifact<M: Model>(model: &mut M, artifact: &mut Artifact) -> Result<usize> {
    let names: Vec<(String, String, String, Vec<usize>)> = artifact
        .recipe()
        .tensors
        .iter()
        .filter_map(|t| {
            let module = t.name.strip_suffix(".weight")?;
            Some((
                module.to_string(),
                t.name.clone(),
                t.dtype.clone(),
                t.shape.clone(),
            ))
        })
        .collect();
    let mut staged = Vec::new();
    for (module, tensor, dtype, shape) in names {
        let expected = match model.module(&module) {
            Some(ModuleRef::Linear(l)) => l.shape(),
            Some(ModuleRef::Embedding(e)) => e.shape(),
            None => continue,
        };
        if shape != [expected.0, expected.1] {
            return Err(Error::Shape(format!(
                "artifact tensor `{tensor}` is {shape:?}, module `{module}` is {expected:?}"
            )));
        }
        let dtype = Dtype::parse(&dtype)
            .and_then(candle_dtype)
            .ok_or_else(|| Error::Shape(format!("`{tensor}` has dtype {dtype}")))?;
        let stored = artifact.read_stored(&tensor)?;
        let is_linear = matches!(model.module(&module), Some(ModuleRef::Linear(_)));
        let built = match (is_linear, stored) {
            (true, Stored::Quantized(p)) => Staged::Linear(Weight::Packed(Arc::new(p))),
            (false, Stored::Quantized(p)) => {
                if p.format() != compressme_quant::Format::Int8Rows {
                    return Err(Error::BadStorage {
                        module,
                        reason: format!("an embedding stored as {}", p.format()),
                    });
                }
                Staged::Embedding(Table::Int8Rows(Arc::new(p)))
            }
            (false, Stored::Lossless(store)) => Staged::Embedding(Table::Lossless(Arc::new(
                PackedFrozenEmbedding::from_store(store, dtype, &Device::Cpu)?,
            ))),
            (is_linear, stored) => {
                let (bytes, _) = match stored {
                    Stored::Dense(b) => (b, true),
                    Stored::Lossless(s) => (s.decode_all()?, true),
                    Stored::Quantized(_) => (Vec::new(), false),
                };
                let t = Tensor::from_raw_buffer(&bytes, dtype, &shape, &Device::Cpu)?;
                if is_linear {
                    Staged::Linear(Weight::Dense(t.to_dtype(DType::F32)?))
                } else {
                    Staged::Embedding(Table::Dense(t))
                }
            }
        };
        staged.push((module, built));
    }
    let n = staged.len();
    for (module, built) in staged {
        match (model.module_mut(&module), built) {
            (Some(ModuleMut::Linear(l)), Staged::Linear(w)) => l.set_weight(w)?,
            (Some(ModuleMut::Embedding(e)), Staged::Embedding(t)) => e.set_table(t),
            _ => {
                return Err(Error::BadStorage {
                    module,
                    reason: "module changed kind while loading".into(),
                });
            }
        }
    }
    Ok(n)
}
