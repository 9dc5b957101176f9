//! `Linear`: `y = x W^T + b` with `W` dense or packed in a `compressme-quant` format.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use compressme_quant::{Format, GgmlMatrix, Packed};

use crate::{Error, Hooks, PackedFrozenEmbedding, Result, Storage};

/// Rows of `x` up to which a packed layer always runs the packed kernels directly. Above
/// it, layers of at least [`KERNEL_MIN_WEIGHTS`] weights still run the packed kernels on
/// the SIMD tiers, [`KERNEL_CHUNK_ROWS`] rows a call, in every format: the integer
/// formats' tiles for batches of 8 and more are faster than dense f32, F16/BF16's too
/// (about 0.7x dense f32's time at batch 32 on AVX2), and every SIMD tier gives the same
/// bits, so a model's outputs do not depend on the CPU it ran on (with
/// dequantized tiles below AVX-512, a report recorded on an AVX-512 CPU did not replay on
/// an AVX2 one). The rest (the portable tier, small layers) dequantize the weight tile by
/// tile into a reused scratch buffer and multiply with candle's dense kernel (measured on
/// MiniLM's shapes: docs/BENCHMARKS.md).
pub const DIRECT_MAX_ROWS: usize = 32;
/// Rows of `x` a call to the packed kernels takes above [`DIRECT_MAX_ROWS`]: bounds the
/// kernels' temporaries (their transposed output and rounded input) whatever the batch.
pub const KERNEL_CHUNK_ROWS: usize = 128;
/// Weights below which a layer keeps the dequantized tiles above [`DIRECT_MAX_ROWS`] rows:
/// on a 128 x 128 layer (the offline benchmark's model) the kernels' setup a call made a
/// forward pass of 1,152 rows 1.2x slower than the tiles; from MiniLM's 384 x 384 up they
/// were level or ahead (docs/BENCHMARKS.md).
pub const KERNEL_MIN_WEIGHTS: usize = 1 << 16;
/// Weights a dequantized tile holds at most (4 MiB of f32): the bound on the scratch.
pub const TILE_WEIGHTS: usize = 1 << 20;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How a [`Linear`]'s weight is held.
#[derive(Debug, Clone)]
pub enum Weight {
    /// An f32 tensor `[out, in]` (trainable when it is a candle `Var`).
    Dense(Tensor),
    /// Packed codes and scales.
    Packed(Arc<Packed>),
    /// One of candle's GGUF types (llama.cpp's formats, such as Q8_0 and Q4_0), multiplied
    /// with candle's quantized kernels: kept so those formats can be run and timed beside
    /// ours on the same model.
    Ggml(Arc<QTensor>),
    /// One of candle's Q5_0 or Q8_0 tensors with a [`GgmlMatrix`] built from its blocks
    /// beside it ([`crate::replicate_ggml`]): the products run on the matrix, whose
    /// outputs are the bits of candle's own kernel for that tensor, in a fraction of its
    /// time; the tensor answers everything else.
    GgmlReplica(Arc<QTensor>, Arc<GgmlMatrix>),
    /// Lossless row blocks: exactly the original weights, decoded for every product
    /// (storage for a weight that must stay exact, at the cost of a decode per call).
    Lossless(Arc<PackedFrozenEmbedding>),
}

impl Weight {
    /// Bytes kept.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        match self {
            Self::Dense(t) => (t.elem_count() * t.dtype().size_in_bytes()) as u64,
            Self::Packed(p) => p.stored_bytes() as u64,
            Self::Ggml(q) | Self::GgmlReplica(q, _) => q.storage_size_in_bytes() as u64,
            Self::Lossless(e) => e.stored_bytes(),
        }
    }

    /// `dense f32` or the format's name.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Dense(t) => format!("dense {:?}", t.dtype()).to_lowercase(),
            Self::Packed(p) => p.format().to_string(),
            Self::Ggml(q) => format!("candle {:?}", q.dtype()).to_lowercase(),
            Self::GgmlReplica(q, _) => format!("candle {:?} (replica)", q.dtype()).to_lowercase(),
            Self::Lossless(_) => "lossless".into(),
        }
    }
}

/// A linear layer with a stable dotted name, whose input an observer can see.
#[derive(Debug, Clone)]
pub struct Linear {
    name: String,
    weight: Weight,
    bias: Option<Tensor>,
    out_features: usize,
    in_features: usize,
    hooks: Hooks,
}

impl Linear {
    /// A dense layer from `weight` `[out, in]` (f32, f16 or bf16; kept as f32) and an
    /// optional `bias` `[out]`.
    ///
    /// # Errors
    /// [`Error::Shape`] for a weight that is not 2-D or a bias of the wrong length.
    pub fn new(name: &str, weight: Tensor, bias: Option<Tensor>, hooks: Hooks) -> Result<Self> {
        let (out_features, in_features) = weight
            .dims2()
            .map_err(|_| Error::Shape(format!("{name}: weight {:?} is not 2-D", weight.dims())))?;
        if let Some(b) = &bias
            && b.dims() != [out_features]
        {
            return Err(Error::Shape(format!(
                "{name}: bias {:?} does not match {out_features} outputs",
                b.dims()
            )));
        }
        let weight = if weight.dtype() == DType::F32 {
            weight
        } else {
            weight.to_dtype(DType::F32)?
        };
        let bias = bias.map(|b| b.to_dtype(DType::F32)).transpose()?;
        Ok(Self {
            name: name.to_string(),
            weight: Weight::Dense(weight),
            bias,
            out_features,
            in_features,
            hooks,
        })
    }

    /// The dotted name (the checkpoint's, without `.weight`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(out, in)`.
    #[must_use]
    pub fn shape(&self) -> (usize, usize) {
        (self.out_features, self.in_features)
    }

    /// The weight storage.
    #[must_use]
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// The bias, if any.
    #[must_use]
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Bytes kept: the weight as stored, plus the bias.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.weight.stored_bytes() + self.bias_bytes()
    }

    /// Bytes of the same layer in f32.
    #[must_use]
    pub fn dense_bytes(&self) -> u64 {
        (4 * self.out_features * self.in_features) as u64 + self.bias_bytes()
    }

    fn bias_bytes(&self) -> u64 {
        self.bias
            .as_ref()
            .map_or(0, |b| (4 * b.elem_count()) as u64)
    }

    /// The weight in f32, row-major: exact for a dense layer, dequantized for a packed
    /// one (re-quantizing a packed layer starts from these values).
    ///
    /// # Errors
    /// candle errors reading a dense weight.
    pub fn weight_f32(&self) -> Result<Vec<f32>> {
        match &self.weight {
            Weight::Dense(t) => Ok(t.flatten_all()?.to_vec1::<f32>()?),
            Weight::Packed(p) => {
                let mut out = vec![0f32; p.rows() * p.cols()];
                p.dequantize_into(&mut out)?;
                Ok(out)
            }
            Weight::Ggml(q) | Weight::GgmlReplica(q, _) => Ok(q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?),
            Weight::Lossless(e) => Ok(e
                .weight()?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?),
        }
    }

    /// Rows `ids` of the weight (u8, u32 or i64, any shape) as `ids.shape + [in]` f32:
    /// the lookup of a token embedding that doubles as the output head. Only the rows
    /// asked for are decoded (all of them for candle's formats). Not reported to the
    /// observer: a tied module's statistics are those of its product.
    ///
    /// # Errors
    /// Unsupported, negative or out-of-range ids; a block that fails to decode.
    pub fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        let mut shape = ids.dims().to_vec();
        shape.push(self.in_features);
        let flat = crate::embedding::ids_u64(ids)?;
        if let Some(&bad) = flat.iter().find(|&&i| i >= self.out_features as u64) {
            return Err(Error::Shape(format!(
                "{}: id {bad} is past {} rows",
                self.name, self.out_features
            )));
        }
        let idx = Tensor::from_vec(
            flat.iter().map(|&i| i as u32).collect::<Vec<u32>>(),
            flat.len(),
            &Device::Cpu,
        )?;
        let rows = match &self.weight {
            Weight::Dense(t) => t.embedding(&idx.to_device(t.device())?)?,
            Weight::Packed(p) => {
                let ids: Vec<usize> = flat.iter().map(|&i| i as usize).collect();
                Tensor::from_vec(
                    p.dequantize_rows(&ids)?,
                    (ids.len(), self.in_features),
                    &Device::Cpu,
                )?
            }
            Weight::Ggml(q) | Weight::GgmlReplica(q, _) => q.embedding(&idx)?,
            Weight::Lossless(e) => e.lookup(&idx)?.to_dtype(DType::F32)?,
        };
        Ok(rows.reshape(shape)?)
    }

    /// The weight `storage` asks for, built from this layer's weight; the layer is not
    /// changed (see [`Linear::set_weight`]).
    ///
    /// # Errors
    /// [`Error::BadStorage`] for `Int8Rows` (embedding-only; `int8` is the same grid for
    /// a linear), and quantization or packing errors (a non-finite weight).
    pub fn prepare(&self, storage: &Storage, device: &Device) -> Result<Weight> {
        match storage {
            Storage::Dense => {
                let w = self.weight_f32()?;
                Ok(Weight::Dense(Tensor::from_vec(
                    w,
                    (self.out_features, self.in_features),
                    device,
                )?))
            }
            Storage::Quant(Format::Int8Rows) => Err(Error::BadStorage {
                module: self.name.clone(),
                reason: "int8-rows is for embedding tables; use int8".into(),
            }),
            Storage::Quant(f) => {
                let w = self.weight_f32()?;
                Ok(Weight::Packed(Arc::new(compressme_quant::quantize(
                    &w,
                    self.out_features,
                    self.in_features,
                    *f,
                )?)))
            }
            Storage::Lossless(opts) => {
                let w = match &self.weight {
                    // the exact bytes of a lossless weight stay as they are
                    Weight::Lossless(e) => e.weight()?,
                    _ => Tensor::from_vec(
                        self.weight_f32()?,
                        (self.out_features, self.in_features),
                        &Device::Cpu,
                    )?,
                };
                Ok(Weight::Lossless(Arc::new(PackedFrozenEmbedding::new(
                    &w, opts,
                )?)))
            }
        }
    }

    /// Replaces the weight with one from [`Linear::prepare`] (same shape).
    ///
    /// # Errors
    /// [`Error::Shape`] when the shape differs.
    pub fn set_weight(&mut self, weight: Weight) -> Result<()> {
        let shape = match &weight {
            Weight::Dense(t) => t.dims2()?,
            Weight::Packed(p) => (p.rows(), p.cols()),
            Weight::Ggml(q) | Weight::GgmlReplica(q, _) => q.shape().dims2()?,
            Weight::Lossless(e) => (
                usize::try_from(e.num_embeddings()).unwrap_or(usize::MAX),
                e.dim(),
            ),
        };
        if shape != (self.out_features, self.in_features) {
            return Err(Error::Shape(format!(
                "{}: new weight {shape:?} for a {:?} layer",
                self.name,
                self.shape()
            )));
        }
        self.weight = weight;
        Ok(())
    }

    /// Reports `x` to the observer as [`Linear::forward`] does, without the product.
    ///
    /// # Errors
    /// The observer's error.
    pub fn observe(&self, x: &Tensor) -> Result<()> {
        self.hooks.observe(&self.name, x)
    }

    /// `x W^T + b` for `x` of shape `[..., in]`, after reporting `x` to the observer.
    ///
    /// # Errors
    /// A shape mismatch, an observer's error, or candle's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.observe(x)?;
        let y = match &self.weight {
            Weight::Dense(w) => shared_matmul(x, w)?,
            Weight::Packed(p) => packed_forward(&self.name, x, p)?,
            Weight::Ggml(q) => {
                let x32 = x.to_dtype(DType::F32)?.contiguous()?;
                QMatMul::from_arc(Arc::clone(q))?
                    .forward(&x32)?
                    .to_dtype(x.dtype())?
            }
            Weight::GgmlReplica(_, m) => replica_forward(&self.name, x, m)?,
            Weight::Lossless(e) => {
                let w = e.weight()?.to_dtype(DType::F32)?;
                let x32 = x.to_dtype(DType::F32)?;
                let y = shared_matmul(&x32, &w)?;
                y.to_dtype(x.dtype())?
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `x W^T` for `x: [..., in]` and a dense `W: [out, in]`, broadcast over `x`'s leading
/// dimensions as candle multiplies it (its backward sums the weight's gradient over them),
/// through [`crate::ops::matmul`]: the same bits on every CPU.
fn shared_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match x.dims() {
        [b1, b2, _, _] => crate::ops::matmul(x, &w.broadcast_left((*b1, *b2))?.t()?),
        [b, _, _] => crate::ops::matmul(x, &w.broadcast_left(*b)?.t()?),
        _ => crate::ops::matmul(x, &w.t()?),
    }
}

/// `x W^T` with packed `W`: the packed kernels for small batches, dequantized tiles and
/// candle's dense kernel for large ones.
fn packed_forward(name: &str, x: &Tensor, p: &Packed) -> Result<Tensor> {
    let dims = x.dims();
    let cols = p.cols();
    if dims.last() != Some(&cols) {
        return Err(Error::Shape(format!(
            "{name}: input {dims:?} does not end in {cols} features"
        )));
    }
    let n = x.elem_count() / cols.max(1);
    let mut out_shape = dims.to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = p.rows();
    }
    let x32 = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let y = if n <= DIRECT_MAX_ROWS {
        let y = crate::ops::with_f32(&x32, |xv| compressme_quant::matmul(xv, n, p))??;
        Tensor::from_vec(y, out_shape, &Device::Cpu)?
    } else if p.rows() * cols >= KERNEL_MIN_WEIGHTS && kernels_at_any_batch() {
        let rows = p.rows();
        let mut y = vec![0f32; n * rows];
        crate::ops::with_f32(&x32, |xv| {
            for (xc, yc) in xv
                .chunks(KERNEL_CHUNK_ROWS * cols)
                .zip(y.chunks_mut(KERNEL_CHUNK_ROWS * rows))
            {
                compressme_quant::matmul_into(xc, xc.len() / cols, p, yc)?;
            }
            Ok::<_, compressme_quant::Error>(())
        })??;
        Tensor::from_vec(y, out_shape, &Device::Cpu)?
    } else {
        tiled(&x32.reshape((n, cols))?, p)?.reshape(out_shape)?
    };
    Ok(y.to_dtype(x.dtype())?.to_device(x.device())?)
}

/// `x W^T` on a [`GgmlMatrix`] (all of `x`'s rows in one call: its temporaries are the
/// rows rounded to 8 bits and the output).
fn replica_forward(name: &str, x: &Tensor, m: &GgmlMatrix) -> Result<Tensor> {
    let dims = x.dims();
    if dims.last() != Some(&m.cols()) {
        return Err(Error::Shape(format!(
            "{name}: input {dims:?} does not end in {} features",
            m.cols()
        )));
    }
    let mut out_shape = dims.to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = m.rows();
    }
    let y = crate::ops::with_f32(x, |xv| m.matmul(xv, xv.len() / m.cols().max(1)))??;
    Ok(Tensor::from_vec(y, out_shape, &Device::Cpu)?.to_dtype(x.dtype())?)
}

/// Whether this process's kernel tier runs the packed kernels at every batch (see
/// [`DIRECT_MAX_ROWS`]): every SIMD tier, whatever the format, so the arithmetic (and the
/// bits) are the same on every CPU with AVX2.
fn kernels_at_any_batch() -> bool {
    compressme_quant::kernel_tier().is_ok_and(|t| t > compressme_quant::Tier::Portable)
}

/// Dequantizes `p` a tile of rows at a time into this thread's scratch (at most
/// [`TILE_WEIGHTS`] values), multiplies each tile with candle's dense kernel and writes
/// its columns straight into the output, so the product is held once (a decoder's head
/// on a window of 512 tokens is 100 MB of logits; joining the tiles' parts held it twice).
fn tiled(x: &Tensor, p: &Packed) -> Result<Tensor> {
    let (rows, cols) = (p.rows(), p.cols());
    let n = x.dim(0)?;
    let tile = (TILE_WEIGHTS / cols.max(1)).max(1);
    if rows <= tile {
        return SCRATCH.with(|s| -> Result<Tensor> {
            let mut buf = s.borrow_mut();
            buf.resize(rows * cols, 0.0);
            p.dequantize_range_into(0, &mut buf)?;
            let w = Tensor::from_slice(&buf, (rows, cols), &Device::Cpu)?;
            crate::ops::matmul(x, &w.t()?)
        });
    }
    let mut out = vec![0f32; n * rows];
    SCRATCH.with(|s| -> Result<()> {
        let mut buf = s.borrow_mut();
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + tile).min(rows);
            buf.resize((r1 - r0) * cols, 0.0);
            p.dequantize_range_into(r0, &mut buf)?;
            let w = Tensor::from_slice(&buf, (r1 - r0, cols), &Device::Cpu)?;
            let part = crate::ops::matmul(x, &w.t()?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let width = r1 - r0;
            for (dst, src) in out.chunks_exact_mut(rows).zip(part.chunks_exact(width)) {
                if let Some(d) = dst.get_mut(r0..r1) {
                    d.copy_from_slice(src);
                }
            }
            r0 = r1;
        }
        Ok(())
    })?;
    Ok(Tensor::from_vec(out, (n, rows), &Device::Cpu)?)
}
