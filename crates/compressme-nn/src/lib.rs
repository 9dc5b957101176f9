//! candle layers whose weights are stored dense, packed or lossless-blocked, and the
//! models built from them.
//!
//! - [`Linear`]: `x W^T + b` with `W` dense or in any `compressme-quant` format (the packed
//!   kernels at every batch on the SIMD tiers, a chunk of rows a call; dequantized tiles
//!   and candle's kernel for large batches where the kernels would be slower).
//! - [`Embedding`]: a table dense, INT8 per row, or a [`PackedFrozenEmbedding`]: a frozen
//!   table kept as independent, SHA-256-sealed, entropy-coded row blocks
//!   ([`compressme_blockstore`]) whose lookups return exactly the original bytes.
//! - [`Hooks`] / [`Observer`]: modules report their inputs by the checkpoint's dotted names.
//! - [`Model`]: named modules, output heads, all-or-nothing storage swaps, byte accounting.
//! - Families: [`Bert`] and [`SentenceEmbedder`] (Hugging Face folders, offline);
//!   pretrained decoders, [`Decoder`] (Llama, GPT-NeoX, GPT-2, with a KV cache) and
//!   [`LanguageModel`] (a decoder with its tokenizer, from a Hugging Face folder, a llama
//!   GGUF file or an artifact); [`CausalLm`] (defined here, trainable with [`AdamW`]).
//! - [`llama_quantize`] puts llama.cpp's formats (through candle's GGUF types) beside ours.
//!
//! What it is not: a file format (see `compressme-artifact`), a profiler or planner (they
//! observe these models through [`Hooks`]), or a general model zoo: families and
//! settings it does not implement (other `model_type`s, rope scaling, sliding windows)
//! are refused by name.
//!
//! # Example
//! ```
//! use candle_core::{Device, Module, Tensor};
//! use compressme_nn::{PackOptions, PackedFrozenEmbedding};
//!
//! let dev = Device::Cpu;
//! let table = Tensor::arange(0f32, 64.0 * 8.0, &dev)?.reshape((64, 8))?;
//! let packed = PackedFrozenEmbedding::new(&table, &PackOptions::default())?;
//!
//! let ids = Tensor::new(&[[3u32, 60], [3, 0]], &dev)?; // any shape, repeats allowed
//! let rows = packed.forward(&ids)?;
//! assert_eq!(rows.dims(), &[2, 2, 8]);
//! let want = table.index_select(&ids.flatten_all()?, 0)?.reshape((2, 2, 8))?;
//! assert_eq!(rows.to_vec3::<f32>()?, want.to_vec3::<f32>()?);
//! println!("{} stored bytes for {} dense", packed.stored_bytes(), packed.dense_bytes());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod bert;
pub mod causal;
pub mod decoder;
mod embedding;
mod error;
mod hook;
mod linear;
mod llama;
pub mod load;
mod model;
pub mod ops;
mod table;

pub use bert::{Bert, BertConfig, SentenceEmbedder};
pub use causal::{AdamW, CausalConfig, CausalLm};
pub use decoder::{Decoder, DecoderConfig, Family, KvCache, LanguageModel};
pub use embedding::{PackOptions, PackedFrozenEmbedding, PackingReport};
pub use error::{Error, Result};
pub use hook::{HookGuard, Hooks, Observer};
pub use linear::{
    DIRECT_MAX_ROWS, KERNEL_CHUNK_ROWS, KERNEL_MIN_WEIGHTS, Linear, TILE_WEIGHTS, Weight,
};
pub use llama::{
    LlamaFormat, LlamaQuantized, candle_kernel_tier, llama_qtensor, llama_quantize, replicate_ggml,
};
pub use load::{apply_artifact, write_artifact};
pub use model::{Model, ModuleInfo, ModuleKind, ModuleMut, ModuleRef, Storage, StorageReport};
pub use table::{Embedding, Table};
