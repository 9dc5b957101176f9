//! `Embedding`: a lookup table held dense, as INT8 rows, or losslessly packed.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use compressme_quant::Packed;

use crate::{Error, Hooks, PackedFrozenEmbedding, Result, Storage};

/// How an [`Embedding`]'s table is held.
#[derive(Debug, Clone)]
pub enum Table {
    /// A dense tensor `[rows, dim]` (trainable when it is a candle `Var`).
    Dense(Tensor),
    /// Packed codes and scales in any `compressme-quant` format (`int8-rows` keeps
    /// all-zero rows exactly zero); a lookup dequantizes only the rows asked for.
    Packed(Arc<Packed>),
    /// Lossless row blocks: lookups return the original bytes.
    Lossless(Arc<PackedFrozenEmbedding>),
}

impl Table {
    /// Bytes kept.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        match self {
            Self::Dense(t) => (t.elem_count() * t.dtype().size_in_bytes()) as u64,
            Self::Packed(p) => p.stored_bytes() as u64,
            Self::Lossless(e) => e.stored_bytes(),
        }
    }

    /// `dense f32`, the format's name, or `lossless`.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Dense(t) => format!("dense {:?}", t.dtype()).to_lowercase(),
            Self::Packed(p) => p.format().to_string(),
            Self::Lossless(_) => "lossless".into(),
        }
    }
}

/// An embedding layer with a stable dotted name; an observer sees its output.
#[derive(Debug, Clone)]
pub struct Embedding {
    name: String,
    table: Table,
    rows: usize,
    dim: usize,
    /// The dtype of the original table, which lookups return.
    dtype: DType,
    device: Device,
    hooks: Hooks,
}

impl Embedding {
    /// A dense table `[rows, dim]` of any float dtype.
    ///
    /// # Errors
    /// [`Error::Shape`] for a table that is not 2-D, [`Error::NotEligible`] for one that is
    /// not floating point.
    pub fn new(name: &str, table: Tensor, hooks: Hooks) -> Result<Self> {
        let (rows, dim) = table
            .dims2()
            .map_err(|_| Error::Shape(format!("{name}: table {:?} is not 2-D", table.dims())))?;
        if !table.dtype().is_float() {
            return Err(Error::NotEligible(format!(
                "{name}: table dtype {:?} is not floating point",
                table.dtype()
            )));
        }
        Ok(Self {
            name: name.to_string(),
            dtype: table.dtype(),
            device: table.device().clone(),
            table: Table::Dense(table),
            rows,
            dim,
            hooks,
        })
    }

    /// The dotted name (the checkpoint's, without `.weight`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(rows, dim)`.
    #[must_use]
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.dim)
    }

    /// The table storage.
    #[must_use]
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Bytes kept.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.table.stored_bytes()
    }

    /// Bytes of the table in its original dtype.
    #[must_use]
    pub fn dense_bytes(&self) -> u64 {
        (self.rows * self.dim * self.dtype.size_in_bytes()) as u64
    }

    /// The whole table as a tensor of the original dtype: exact for dense and lossless
    /// storage, dequantized for INT8 rows.
    ///
    /// # Errors
    /// A block that fails to decode, or candle's.
    pub fn weight(&self) -> Result<Tensor> {
        match &self.table {
            Table::Dense(t) => Ok(t.detach()),
            Table::Lossless(e) => e.weight(),
            Table::Packed(p) => {
                let mut out = vec![0f32; self.rows * self.dim];
                p.dequantize_into(&mut out)?;
                Ok(Tensor::from_vec(out, (self.rows, self.dim), &self.device)?
                    .to_dtype(self.dtype)?)
            }
        }
    }

    /// The table `storage` asks for, built from this layer's table; the layer is not
    /// changed (see [`Embedding::set_table`]).
    ///
    /// # Errors
    /// Packing and quantization errors (a non-finite weight, a width a format cannot
    /// group).
    pub fn prepare(&self, storage: &Storage) -> Result<Table> {
        match storage {
            Storage::Dense => Ok(Table::Dense(self.weight()?)),
            Storage::Lossless(opts) => {
                let e = PackedFrozenEmbedding::new(&self.weight()?, opts)?;
                Ok(Table::Lossless(Arc::new(e.to_device(&self.device))))
            }
            Storage::Quant(f) => {
                let w = self
                    .weight()?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                Ok(Table::Packed(Arc::new(compressme_quant::quantize(
                    &w, self.rows, self.dim, *f,
                )?)))
            }
        }
    }

    /// Replaces the table with one from [`Embedding::prepare`].
    pub fn set_table(&mut self, table: Table) {
        self.table = table;
    }

    /// Rows `ids` (u8, u32 or i64, any shape) as `ids.shape + [dim]`, reported to the
    /// observer.
    ///
    /// # Errors
    /// Unsupported, negative or out-of-range ids; an observer's error.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let out = match &self.table {
            Table::Lossless(e) => e.lookup(ids)?,
            Table::Dense(t) => {
                let flat = ids.flatten_all()?;
                let mut shape = ids.dims().to_vec();
                shape.push(self.dim);
                t.embedding(&flat)?.reshape(shape)?
            }
            Table::Packed(p) => {
                let flat = crate::embedding::ids_u64(ids)?;
                let idx = flat
                    .iter()
                    .map(|&i| usize::try_from(i).unwrap_or(usize::MAX))
                    .collect::<Vec<_>>();
                let rows = p.dequantize_rows(&idx)?;
                let mut shape = ids.dims().to_vec();
                shape.push(self.dim);
                Tensor::from_vec(rows, shape, &self.device)?.to_dtype(self.dtype)?
            }
        };
        self.hooks.observe(&self.name, &out)?;
        Ok(out)
    }
}
