//! `PackedFrozenEmbedding`: a frozen embedding served from lossless row blocks.

use candle_core::{DType, Device, Module, Tensor};
use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};

use crate::{Error, Result};

/// How to pack a table.
#[derive(Debug, Clone, PartialEq)]
pub struct PackOptions {
    /// Rows per independent block (default 16): smaller blocks decode less per lookup,
    /// larger blocks pay less per-block overhead (32-byte digest, length, mode bytes).
    pub block_rows: usize,
    /// Plane coder (default: shared Huffman tables).
    pub coder: Coder,
    /// Index Huffman-coded planes by row, so a lookup decodes only the rows it asks for
    /// (default true: a lookup layer is for random access; it costs a few tenths of a
    /// percent of the dense bytes at 16-row blocks, see docs/BENCHMARKS.md).
    pub row_index: bool,
}

impl Default for PackOptions {
    fn default() -> Self {
        Self {
            block_rows: 16,
            coder: Coder::default(),
            row_index: true,
        }
    }
}

impl PackOptions {
    /// Planes coded as Zstandard frames at `level` instead of shared Huffman tables.
    #[must_use]
    pub fn zstd(block_rows: usize, level: i32) -> Self {
        Self {
            block_rows,
            coder: Coder::Zstd { level },
            row_index: false,
        }
    }
}

/// What packing a given table would cost or save; see [`PackedFrozenEmbedding::assess`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackingReport {
    /// Bytes of the dense table.
    pub dense_bytes: u64,
    /// Bytes the packed table keeps: payload, block lengths, digests, code tables, header.
    pub stored_bytes: u64,
}

impl PackingReport {
    /// Stored over dense; above 1.0 the table grew.
    #[must_use]
    pub fn ratio(&self) -> f64 {
        if self.dense_bytes == 0 {
            1.0
        } else {
            self.stored_bytes as f64 / self.dense_bytes as f64
        }
    }

    /// Whether packing saves bytes at all (small or incompressible tables may grow).
    #[must_use]
    pub fn pays(&self) -> bool {
        self.stored_bytes < self.dense_bytes
    }
}

/// A frozen 2-D embedding table stored as verified, compressed row blocks.
///
/// `forward(ids)` returns exactly `weight.index_select(ids)` reshaped to
/// `ids.shape + [dim]`, byte for byte, on the device the layer was moved to. The payload
/// stays in host memory; decoded rows are copied to the device. No decoded rows are
/// cached between calls.
#[derive(Debug, Clone)]
pub struct PackedFrozenEmbedding {
    store: BlockStore,
    dtype: DType,
    dim: usize,
    device: Device,
}

fn value_kind(dtype: DType) -> Result<ValueKind> {
    match dtype {
        DType::F32 => Ok(ValueKind::F32),
        DType::BF16 => Ok(ValueKind::Bf16),
        DType::F16 => Ok(ValueKind::F16),
        DType::F64 => Ok(ValueKind::F64),
        other => Err(Error::NotEligible(format!(
            "dtype {other:?} is not a float type (f32, bf16, f16 or f64)"
        ))),
    }
}

/// The little-endian bytes of a float tensor, in row-major order.
fn float_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F64 => flat
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        other => {
            return Err(Error::NotEligible(format!(
                "dtype {other:?} is not a float type"
            )));
        }
    })
}

/// Row ids of any integer tensor the layer accepts, as u64.
pub(crate) fn ids_u64(ids: &Tensor) -> Result<Vec<u64>> {
    let flat = ids.flatten_all()?;
    match ids.dtype() {
        DType::U32 => Ok(flat.to_vec1::<u32>()?.into_iter().map(u64::from).collect()),
        DType::U8 => Ok(flat.to_vec1::<u8>()?.into_iter().map(u64::from).collect()),
        DType::I64 => flat
            .to_vec1::<i64>()?
            .into_iter()
            .map(|i| u64::try_from(i).map_err(|_| Error::NegativeId(i)))
            .collect(),
        other => Err(Error::UnsupportedIds(format!("{other:?}"))),
    }
}

impl PackedFrozenEmbedding {
    /// Packs a frozen `[num_embeddings, dim]` float table (f32, bf16, f16 or f64).
    ///
    /// The table's bytes are copied: changing `weight` afterwards leaves the packed table
    /// unchanged, and the caller's tensor is never modified.
    ///
    /// # Errors
    /// [`Error::NotEligible`] when the tensor is not 2-D, not contiguous, a trainable
    /// variable, or not a float dtype; block store errors for bad options.
    pub fn new(weight: &Tensor, opts: &PackOptions) -> Result<Self> {
        let (rows, dim) = match weight.dims() {
            &[r, d] => (r, d),
            dims => {
                return Err(Error::NotEligible(format!(
                    "expected a 2-D table, got shape {dims:?}"
                )));
            }
        };
        if !weight.is_contiguous() {
            return Err(Error::NotEligible(
                "the table is not contiguous (call .contiguous() first)".into(),
            ));
        }
        if weight.is_variable() {
            return Err(Error::NotEligible(
                "the table is a trainable variable; pass a frozen tensor (.detach())".into(),
            ));
        }
        let kind = value_kind(weight.dtype())?;
        let bytes = float_bytes(weight)?;
        let row_bytes = dim * weight.dtype().size_in_bytes();
        let enc = EncodeOptions::new(kind)
            .block_rows(opts.block_rows)
            .coder(opts.coder)
            .row_index(opts.row_index);
        let store = BlockStore::encode(&bytes, rows as u64, row_bytes, &enc)?;
        Ok(Self {
            store,
            dtype: weight.dtype(),
            dim,
            device: weight.device().clone(),
        })
    }

    /// Wraps an already built (and verified) store, for example one loaded from an artifact.
    ///
    /// # Errors
    /// [`Error::NotEligible`] when `dtype` does not match the store's value kind or row width.
    pub fn from_store(store: BlockStore, dtype: DType, device: &Device) -> Result<Self> {
        if value_kind(dtype)? != store.kind()
            || !store.row_bytes().is_multiple_of(dtype.size_in_bytes())
        {
            return Err(Error::NotEligible(format!(
                "store of {:?} cannot serve dtype {dtype:?}",
                store.kind()
            )));
        }
        let dim = store.row_bytes() / dtype.size_in_bytes();
        Ok(Self {
            store,
            dtype,
            dim,
            device: device.clone(),
        })
    }

    /// Reports stored against dense bytes for `weight` packed with `opts`, so a caller can
    /// decide whether to replace a dense table. Packs once to measure; nothing is kept.
    ///
    /// # Errors
    /// As [`PackedFrozenEmbedding::new`].
    pub fn assess(weight: &Tensor, opts: &PackOptions) -> Result<PackingReport> {
        Ok(Self::new(weight, opts)?.report())
    }

    /// Stored and dense bytes of this table.
    #[must_use]
    pub fn report(&self) -> PackingReport {
        PackingReport {
            dense_bytes: self.dense_bytes(),
            stored_bytes: self.stored_bytes(),
        }
    }

    /// The same layer, returning rows on `device` (the payload stays in host memory).
    #[must_use]
    pub fn to_device(mut self, device: &Device) -> Self {
        self.device = device.clone();
        self
    }

    /// Gathers rows `ids` (u8, u32 or i64, any shape; repeats and empty allowed) into a
    /// tensor of shape `ids.shape + [dim]`, byte-identical to `index_select` on the original.
    ///
    /// # Errors
    /// Unsupported or negative ids, an id past the end (nothing is returned), and, when
    /// verification on decode is on, a block that fails its digest.
    pub fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        let flat = ids_u64(ids)?;
        let mut shape = ids.dims().to_vec();
        shape.push(self.dim);
        let t = match self.dtype {
            DType::F32 => self.gather::<f32>(&flat, shape)?,
            DType::F64 => self.gather::<f64>(&flat, shape)?,
            DType::BF16 => self.gather::<half::bf16>(&flat, shape)?,
            DType::F16 => self.gather::<half::f16>(&flat, shape)?,
            other => {
                return Err(Error::NotEligible(format!(
                    "dtype {other:?} is not a float type"
                )));
            }
        };
        Ok(if self.device.is_cpu() {
            t
        } else {
            t.to_device(&self.device)?
        })
    }

    /// Decodes rows straight into the vector that becomes the tensor's storage: one
    /// allocation and no copy (a second buffer and a copy cost a quarter of a lookup).
    fn gather<T: candle_core::WithDType + bytemuck::Pod>(
        &self,
        ids: &[u64],
        shape: Vec<usize>,
    ) -> Result<Tensor> {
        let mut out = vec![T::zeroed(); ids.len() * self.dim];
        self.store
            .decode_rows(ids, bytemuck::cast_slice_mut(&mut out))?;
        Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
    }

    /// A complete, independent copy of the table on the layer's device. Changing it leaves
    /// the packed table unchanged. Needs the dense table's memory.
    ///
    /// # Errors
    /// A block that fails to decode.
    pub fn weight(&self) -> Result<Tensor> {
        let bytes = self.store.decode_all()?;
        let rows = usize::try_from(self.store.rows())
            .map_err(|_| Error::NotEligible("table too large".into()))?;
        let t = Tensor::from_raw_buffer(&bytes, self.dtype, &[rows, self.dim], &Device::Cpu)?;
        Ok(if self.device.is_cpu() {
            t
        } else {
            t.to_device(&self.device)?
        })
    }

    /// Turns SHA-256 checks on every lookup on or off (off by default: every block is
    /// verified when the table is packed or loaded).
    pub fn set_verify_on_decode(&mut self, on: bool) {
        self.store.set_verify_on_decode(on);
    }

    /// The underlying block store.
    #[must_use]
    pub fn store(&self) -> &BlockStore {
        &self.store
    }

    /// Rows in the table.
    #[must_use]
    pub fn num_embeddings(&self) -> u64 {
        self.store.rows()
    }

    /// Width of a row.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Element type of the rows returned.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device the rows are returned on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes kept for this table (every buffer: payload, lengths, digests, tables, header).
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.store.stored_bytes().total()
    }

    /// Bytes of the dense table.
    #[must_use]
    pub fn dense_bytes(&self) -> u64 {
        self.store.dense_bytes()
    }
}

impl Module for PackedFrozenEmbedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.lookup(ids).map_err(Into::into)
    }
}
