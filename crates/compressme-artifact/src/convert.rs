//! Conversion: dtypes to the block store's value kinds and row views, float bytes to and
//! from f32, and [`unpack`] (an artifact back to a plain safetensors file). Sizes come from
//! the file: every operation on one is checked (`arithmetic_side_effects` is denied).
#![deny(clippy::arithmetic_side_effects)]

use std::path::Path;

use compressme_blockstore::ValueKind;

use crate::Result;
use crate::read::{Artifact, Summary, has_whole_digest};
use crate::recipe::TensorRecipe;
use crate::st::{AtomicFile, Dtype, Durability, Planned, header_bytes};
use crate::validate::decoded_bytes;

/// The block store's value kind for a dtype.
#[must_use]
pub fn value_kind(dtype: Dtype) -> ValueKind {
    use compressme_shuffle::ElementSize;
    match dtype {
        Dtype::F32 => ValueKind::F32,
        Dtype::Bf16 => ValueKind::Bf16,
        Dtype::F16 => ValueKind::F16,
        Dtype::F64 => ValueKind::F64,
        d => ValueKind::Bytes(match d.size() {
            2 => ElementSize::Two,
            4 => ElementSize::Four,
            8 => ElementSize::Eight,
            _ => ElementSize::One,
        }),
    }
}

/// The `[rows, row_bytes]` view a tensor is blocked by: the first dimension, or one row.
#[must_use]
pub fn row_view(dtype: Dtype, shape: &[usize]) -> (u64, u64) {
    let numel = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
    let rows = if shape.len() >= 2 {
        shape.first().copied().unwrap_or(1) as u64
    } else {
        1
    };
    let row_bytes = numel
        .checked_div(rows)
        .unwrap_or(0)
        .saturating_mul(dtype.size() as u64);
    (rows, row_bytes)
}

/// Little-endian float bytes as f32 values.
#[must_use]
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        _ => Vec::new(),
    }
}

/// f32 values as little-endian bytes of `dtype` (round to nearest even).
#[must_use]
pub fn from_f32(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        Dtype::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        Dtype::F64 => values
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Writes a plain safetensors file from an artifact: every tensor under its own name and
/// dtype, byte-identical to the original for dense and lossless storage (dequantized for
/// quantized tensors), with the source's `__metadata__`. A version-3 artifact records the
/// source file's header: it is written as it was and each tensor at its offset, so an
/// artifact whose tensors are all dense or lossless unpacks to the source file byte for
/// byte (its SHA-256 is the source's); before version 3 the header is compressme's own,
/// tensors in name order. Large tensors stream a piece at a time, four side by side (their
/// whole-tensor digests in lockstep), small ones are decoded whole four at a time, and
/// quantized ones are dequantized a piece at a time; each is written at its offset. The
/// file is written beside `dest` and renamed when complete (synced to the disk first with
/// [`Durability::Synced`]). `progress` gets each tensor's name and bytes once it is
/// written and checked (on any of rayon's threads, one call at a time).
///
/// # Errors
/// Any read or verification error (nothing is left at `dest`).
pub fn unpack(
    artifact: &mut Artifact,
    dest: &Path,
    durability: Durability,
    mut progress: impl FnMut(&str, u64) + Send,
) -> Result<Summary> {
    let tensors = artifact.recipe().tensors.clone();
    let planned: Vec<Planned> = tensors
        .iter()
        .map(|t| {
            let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
            Planned {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
                // bounded by the limits `Artifact::open` checked
                len: decoded_bytes(t).unwrap_or(u64::MAX),
            }
        })
        .collect();
    // version 3: the source file's own header, and its tensors at its offsets (checked
    // against the recipe at open); before it, a header of our own in the recipe's order
    let (header, offsets) = match (artifact.source_header(), artifact.source_entries()) {
        (Some(text), Some(entries)) => {
            let mut header = (text.len() as u64).to_le_bytes().to_vec();
            header.extend_from_slice(text);
            let start = header.len() as u64;
            let offsets: std::collections::HashMap<&str, u64> = entries
                .iter()
                .map(|e| (e.name.as_str(), start.saturating_add(e.begin)))
                .collect();
            let offsets = tensors
                .iter()
                .map(|t| offsets.get(t.name.as_str()).copied().unwrap_or(u64::MAX))
                .collect::<Vec<u64>>();
            (header, offsets)
        }
        _ => {
            let header = header_bytes(&planned, &artifact.recipe().source_metadata)?;
            let mut at = header.len() as u64;
            let mut offsets = Vec::with_capacity(tensors.len());
            for p in &planned {
                offsets.push(at);
                at = at.saturating_add(p.len);
            }
            (header, offsets)
        }
    };
    let mut out = AtomicFile::create(dest)?;
    out.set_durability(durability);
    // a large output is not read back here: its pages go back as they are written
    out.set_drop_behind();
    out.write_all(&header)?;
    // every tensor's place in the file is known from the header: tensors are decoded in
    // parallel, each written at its offset as it streams, so writing overlaps decoding
    let art: &Artifact = artifact;
    let out_ref = &out;
    // one writer at a time: concurrent writes to one file spin on its lock in the kernel
    let writing = std::sync::Mutex::new(());
    let write_at = |at: u64, piece: &[u8]| -> Result<()> {
        let _turn = writing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        out_ref.write_all_at(at, piece)
    };
    let mut s = Summary::default();
    let mut count = |t: &TensorRecipe, len: u64, exact: bool| {
        s.tensors = s.tensors.saturating_add(1);
        s.dense_bytes = s.dense_bytes.saturating_add(len);
        if exact {
            s.lossless = s.lossless.saturating_add(1);
        } else {
            s.quantized = s.quantized.saturating_add(1);
        }
        progress(&t.name, len);
    };
    // quantized tensors in parallel, each written at its offset as it is dequantized;
    // then dense and lossless ones side by side, their whole-tensor digests four at a
    // time: every lossless block is decoded and the result checked against the tensor's
    // digest (block digests are `verify`'s, which names the block); a mismatch abandons
    // the file before it is renamed
    let ts: Vec<&TensorRecipe> = tensors.iter().collect();
    art.stream_all(
        &ts,
        false,
        |i, at, piece| {
            let offset = offsets.get(i).copied().unwrap_or(u64::MAX);
            write_at(offset.saturating_add(at), piece)
        },
        |i| {
            if let (Some(t), Some(p)) = (ts.get(i), planned.get(i)) {
                count(t, p.len, has_whole_digest(t));
            }
            Ok(())
        },
    )?;
    out.commit()?;
    s.file_bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(s)
}
