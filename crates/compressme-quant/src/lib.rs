//! Weight formats with exact byte accounting, and kernels that read packed weights directly.
//!
//! A [`Packed`] matrix is `[rows, cols]` f32 weights (rows = output features) stored in one
//! [`Format`]: `F16`, `Bf16`, `Int8` (symmetric, one scale per row), `Nf4` (the QLoRA
//! NormalFloat codebook, one absmax scale per row), the blockwise 4-bit formats
//! `Nf4Block` and `Int4Block` (one f16 scale, and for `Int4Block` an f16 minimum, per group
//! of 32, 64 or 128 weights along a row), `Int8Block` (INT8 with one f16 scale per group:
//! llama.cpp's Q8_0 layout at groups of 32), and `Int8Rows` for embedding tables.
//! [`quantize`] refuses non-finite weights and empty shapes; [`quantize_weighted`] picks
//! each 4-bit group's scale against per-channel activation weights, and [`quantize_gptq`]
//! rounds with GPTQ's error feedback against a layer's input Gram matrix ([`GptqFactor`]; the same
//! layouts: only which codes the weights get differs); [`Packed::dequantize_into`],
//! [`Packed::dequantize_rows`] and [`Packed::stored_bytes`] do what they say; [`matmul`]
//! computes `x W^T` reading the packed bytes (integer sums for the integer formats with
//! activations rounded to 14 bits, or, for the 4-bit formats, to 8 bits per block of 32,
//! a row of `x` the same bits at any batch: see [`Activations`]), never holding `W` in f32,
//! on all cores, on the fastest
//! [`Tier`] the CPU has (AVX-512 VNNI with Intel's AMX tiles, AVX-512 VNNI, AVX-VNNI, AVX2,
//! or portable Rust; `COMPRESSME_KERNEL` forces one, see [`kernel_tier`]), every SIMD tier
//! giving the same bits (batches of 8 or more run on tiles, one `x` row a vector lane; at
//! batches of 8 and more the per-row INT8 formats, and every format with 8-bit activations,
//! on AMX's tiles where the tier has them), and [`matmul_into`] writes the same bits into a
//! caller's slice ([`matmul_into_using`] with chosen activations);
//! [`reference::matmul`] is the exact definition they are held to, within [`error_bound`]
//! (and [`error_bound_block8`] for 8-bit activations). On the AVX-512 tier a 4-bit matrix
//! multiplied at batches of 1 to 7, and a large INT8 matrix at batch 1, keeps a
//! second, tiled copy of its codes in memory, built on that first product for the kernel to read in order ([`Packed::layout_bytes`] counts
//! it; `COMPRESSME_REPACK=0` turns it off; the outputs are the same bits).
//!
//! Products run on a small pool of the kernels' own threads; [`single_threaded`] keeps a
//! thread's products on that thread, and [`in_lanes`] runs work items side by side, one
//! lane a thread, for callers with several models to run at once.
//!
//! Beside our formats, [`GgmlMatrix`] holds llama.cpp's Q5_0 or Q8_0 blocks and multiplies
//! them with the arithmetic candle uses for them, to its bits ([`GgmlKind`] says which), in
//! a fraction of its time where candle runs one output at a time.
//!
//! Also [`softmax`]: the sums over a vocabulary that scoring a language model takes
//! (log-softmax, the KL divergence's sum, argmax), on the same tiers and the same bits on
//! every CPU, for `compressme-eval` (which has no `unsafe` to dispatch with).
//!
//! What it is not: a candle integration (no candle dependency here; `compressme-nn` and the
//! benches put llama.cpp's formats beside these), and not a file format (the artifact
//! crate stores these buffers).
//!
//! # Example
//! ```
//! use compressme_quant::{Format, GroupSize, matmul, quantize};
//!
//! let w: Vec<f32> = (0..4 * 64).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
//! let q = quantize(&w, 4, 64, Format::Nf4Block(GroupSize::G32))?;
//! // 4-bit codes plus one f16 scale per 32 weights: 4.5 bits a weight
//! assert_eq!(q.stored_bytes(), 4 * 32 + 4 * 2 * 2);
//! let x = vec![1.0f32; 64];
//! let y = matmul(&x, 1, &q)?; // [1, 4]
//! assert_eq!(y.len(), 4);
//! # Ok::<(), compressme_quant::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_code)]

mod format;
mod gptq;
mod kernels;
pub mod reference;
pub mod softmax;
pub mod synthetic;

pub use format::{
    Format, GroupSize, NF4_CODEBOOK, Packed, SCALE_GRID, quantize, quantize_gptq, quantize_weighted,
};
pub use gptq::GptqFactor;
pub use kernels::ggml::{GGML_BLOCK, GgmlKind, GgmlMatrix};
pub use kernels::{
    Activations, Backend, NF4_I8, Tier, activations_for, error_bound, error_bound_block8, in_lanes,
    kernel_tier, matmul, matmul_into, matmul_into_using, matmul_into_with, matmul_with,
    single_threaded,
};

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong quantizing or multiplying.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A weight is NaN or infinite.
    #[error("weight {index} (row {row}) is not finite: {value}")]
    NonFinite {
        /// Flat index of the weight.
        index: usize,
        /// Its row.
        row: usize,
        /// The value.
        value: f32,
    },
    /// A finite weight the format cannot hold: it would become infinite (f16 past
    /// 65,504, a group scale past f16's range). Keep such a tensor dense or in another
    /// format.
    #[error("weight {index} ({value}) does not fit {format}: {reason}")]
    Unrepresentable {
        /// The format's name.
        format: String,
        /// Flat index of the first such weight.
        index: usize,
        /// The weight.
        value: f32,
        /// What overflows.
        reason: String,
    },
    /// The shape does not fit the data, or is empty.
    #[error("bad shape: {0}")]
    Shape(String),
    /// Packed buffers that do not match their format and shape.
    #[error("malformed packed weights: {0}")]
    Malformed(String),
    /// A kernel tier this CPU cannot run, or a `COMPRESSME_KERNEL` that names none.
    #[error("{0}")]
    Kernel(String),
    /// A row id past the end.
    #[error("row {id} out of range for {rows} rows")]
    RowOutOfRange {
        /// The id.
        id: usize,
        /// Rows in the matrix.
        rows: usize,
    },
}
