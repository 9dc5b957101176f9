//! candle layers whose weights are stored packed or lossless-blocked.
//!
//! The first of them is [`PackedFrozenEmbedding`]: a frozen embedding table kept as
//! independent, SHA-256-sealed, entropy-coded row blocks ([`compressme_blockstore`]). A
//! lookup decodes only the blocks holding the requested rows and returns exactly the
//! original bytes, in the shape `ids.shape + [dim]`, on the device the layer was moved to.
//! Nothing is approximated: integer indexing and byte copies only.
//!
//! Main types: [`PackedFrozenEmbedding`], [`PackOptions`], [`PackingReport`], [`Error`];
//! [`llama_quantize`] puts llama.cpp's formats (through candle's GGUF types) beside ours.
//!
//! What it is not (yet): the model families, activation hooks and quantized layers arrive
//! with later work; this crate never defines file formats (see `compressme-artifact`).
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
mod embedding;
mod error;
mod hook;
mod linear;
mod llama;
mod model;
pub mod ops;
mod table;

pub use bert::{Bert, BertConfig, SentenceEmbedder};
pub use causal::{AdamW, CausalConfig, CausalLm};
pub use embedding::{PackOptions, PackedFrozenEmbedding, PackingReport};
pub use error::{Error, Result};
pub use hook::{HookGuard, Hooks, Observer};
pub use linear::{DIRECT_MAX_ROWS, Linear, TILE_WEIGHTS, Weight};
pub use llama::{LlamaFormat, LlamaQuantized, llama_quantize};
pub use model::{Model, ModuleInfo, ModuleKind, ModuleMut, ModuleRef, Storage, StorageReport};
pub use table::{Embedding, Table};
