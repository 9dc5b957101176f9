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

/// Tensors by name, in the artifact's order.
pub(crate) type NamedTensors = Vec<(String, Tensor)>;

/// Every tensor of an artifact, read and verified, as stored dtype and shape (quantized
/// ones dequantized): what a model is first built from, before [`apply_artifact`] gives
/// its modules the artifact's own storage.
///
/// # Errors
/// A dtype candle does not have; the artifact's read and verification errors.
pub(crate) fn artifact_tensors(a: &mut Artifact) -> Result<NamedTensors> {
    Ok(artifact_tensors_with(a, false)?.0)
}

/// [`artifact_tensors`], but with `placeholders`, no 2-D `*.weight` is read: each stands
/// as a zero-stride view of the right shape (no memory) for [`apply_artifact`] to replace
/// with its stored form, so that loading a model holds each weight once, and a packed
/// one never dense. Returns the tensors and the names that stand in.
///
/// # Errors
/// As [`artifact_tensors`].
pub(crate) fn artifact_tensors_with(
    a: &mut Artifact,
    placeholders: bool,
) -> Result<(NamedTensors, Vec<String>)> {
    let mut out = Vec::new();
    let mut standing = Vec::new();
    for t in a.recipe().tensors.clone() {
        if placeholders && t.shape.len() == 2 && t.name.ends_with(".weight") {
            let view =
                Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(t.shape.as_slice())?;
            out.push((t.name.clone(), view));
            standing.push(t.name.clone());
            continue;
        }
        let dtype = Dtype::parse(&t.dtype)
            .and_then(candle_dtype)
            .ok_or_else(|| Error::Shape(format!("`{}` has dtype {}", t.name, t.dtype)))?;
        let (bytes, _) = a.read_tensor(&t.name)?;
        out.push((
            t.name.clone(),
            Tensor::from_raw_buffer(&bytes, dtype, &t.shape, &Device::Cpu)?,
        ));
    }
    Ok((out, standing))
}

enum Staged {
    Linear(Weight),
    Embedding(Table),
}

/// Gives every module whose weight the artifact holds (`NAME.weight` for module `NAME`)
/// that weight in the artifact's storage: packed codes stay packed (no re-quantization),
/// lossless weights and tables stay in their verified blocks, dense weights become dense
/// tensors.
/// All or nothing: every such weight is read, verified and checked against its module's
/// shape before any module changes; on an error the model is as it was.
/// Returns how many modules changed. Tensors that are not module weights (biases, norms)
/// are left to the loader that built the model.
///
/// # Errors
/// A shape that differs from the module's, and any read or verification error of the
/// artifact.
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
            (false, Stored::Quantized(p)) => Staged::Embedding(Table::Packed(Arc::new(p))),
            (is_linear, Stored::Lossless(store)) => {
                let e = Arc::new(PackedFrozenEmbedding::from_store(
                    store,
                    dtype,
                    &Device::Cpu,
                )?);
                if is_linear {
                    Staged::Linear(Weight::Lossless(e))
                } else {
                    Staged::Embedding(Table::Lossless(e))
                }
            }
            (is_linear, Stored::Dense(bytes)) => {
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

/// Writes `tensors` (every parameter of `model` under its checkpoint name, as
/// [`crate::Decoder::tensors`] lists them) to an artifact at `path`, each module weight
/// in the module's current storage: packed codes as they are (no re-quantization),
/// lossless weights re-sealed in blocks of the same rows, dense weights dense; every
/// other tensor dense. `metadata` goes into the recipe's source metadata.
///
/// # Errors
/// A module stored in candle's formats (not an artifact storage), and the writer's errors
/// (the file is then not created).
pub fn write_artifact<M: Model>(
    model: &M,
    tensors: &[(String, Tensor)],
    metadata: std::collections::BTreeMap<String, String>,
    path: &std::path::Path,
) -> Result<compressme_artifact::Summary> {
    use compressme_artifact::Writer;
    use compressme_blockstore::Coder;
    let mut w = Writer::create(path)?;
    w.recipe_mut().source_metadata = metadata;
    let bytes_of = |t: &Tensor| -> Result<(Dtype, Vec<u8>)> {
        let t32 = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((Dtype::F32, compressme_artifact::from_f32(Dtype::F32, &t32)))
    };
    // the blocks' exact bytes, re-sealed: NaN payloads and all
    let lossless = |w: &mut Writer, name: &str, e: &PackedFrozenEmbedding| -> Result<()> {
        let dtype = match e.dtype() {
            DType::BF16 => Dtype::Bf16,
            DType::F16 => Dtype::F16,
            DType::F64 => Dtype::F64,
            _ => Dtype::F32,
        };
        let rows = usize::try_from(e.num_embeddings())
            .map_err(|_| Error::Shape(format!("{name}: too many rows")))?;
        w.add_lossless(
            name,
            dtype,
            &[rows, e.dim()],
            &e.store().decode_all()?,
            e.store().block_rows(),
            Coder::default(),
        )?;
        Ok(())
    };
    for (name, t) in tensors {
        let module = name.strip_suffix(".weight").and_then(|m| model.module(m));
        match module {
            Some(ModuleRef::Linear(l)) => match l.weight() {
                Weight::Packed(p) => {
                    w.add_packed(name, Dtype::F32, t.dims(), p)?;
                }
                Weight::Lossless(e) => lossless(&mut w, name, e)?,
                Weight::Ggml(_) | Weight::GgmlReplica(..) => {
                    return Err(Error::BadStorage {
                        module: l.name().to_string(),
                        reason: "candle's formats are not an artifact storage".into(),
                    });
                }
                Weight::Dense(_) => {
                    let (d, b) = bytes_of(t)?;
                    w.add_dense(name, d, t.dims(), &b)?;
                }
            },
            Some(ModuleRef::Embedding(e)) => match e.table() {
                Table::Packed(p) => {
                    w.add_packed(name, Dtype::F32, t.dims(), p)?;
                }
                Table::Lossless(p) => lossless(&mut w, name, p)?,
                Table::Dense(_) => {
                    let (d, b) = bytes_of(t)?;
                    w.add_dense(name, d, t.dims(), &b)?;
                }
            },
            None => {
                let (d, b) = bytes_of(t)?;
                w.add_dense(name, d, t.dims(), &b)?;
            }
        }
    }
    Ok(w.finish()?)
}
