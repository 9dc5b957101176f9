//! compressme: store trained neural-network weights in fewer bytes, with proof.
//!
//! This is the umbrella crate: it re-exports the focused crates and carries the
//! `compressme` command-line tool. Logic lives in the crates it re-exports:
//!
//! - [`shuffle`] ([`compressme_shuffle`]): byte shuffle / unshuffle;
//! - [`blockstore`] ([`compressme_blockstore`]): lossless row blocks with SHA-256 seals;
//! - [`nn`] ([`compressme_nn`]): candle layers on packed storage, such as
//!   [`PackedFrozenEmbedding`];
//! - [`quant`] ([`compressme_quant`]): weight formats (f16, bf16, INT8, NF4, blockwise
//!   4-bit) and kernels that read packed weights directly;
//! - [`artifact`], [`profile`], [`plan`], [`eval`]: the stored file, activation profiles,
//!   precision plans, evaluation metrics;
//! - [`offline`] ([`compressme_offline`]): the offline benchmark behind `compressme bench`.
//!
//! What it is not: a place for codecs or model code of its own.
//!
//! # Example
//! ```
//! use compressme::blockstore::{BlockStore, EncodeOptions, ValueKind};
//!
//! let bytes: Vec<u8> = (0..64u32).flat_map(|i| (i as f32 * 0.01).to_le_bytes()).collect();
//! let store = BlockStore::encode(&bytes, 8, 32, &EncodeOptions::new(ValueKind::F32))?;
//! assert_eq!(store.decode_all()?, bytes);
//! # Ok::<(), compressme::blockstore::Error>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub use compressme_artifact as artifact;
pub use compressme_blockstore as blockstore;
pub use compressme_eval as eval;
pub use compressme_nn as nn;
pub use compressme_nn::{PackOptions, PackedFrozenEmbedding};
pub use compressme_offline as offline;
pub use compressme_plan as plan;
pub use compressme_profile as profile;
pub use compressme_quant as quant;
pub use compressme_shuffle as shuffle;
