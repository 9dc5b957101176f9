//! The compressme artifact: one safetensors file holding lossless row blocks, packed
//! quantized weights and dense tensors, with a closed, versioned recipe in its
//! `__metadata__`, verified block by block when written and when read.
//!
//! - [`Writer`] adds tensors one at a time (dense, lossless where it pays, quantized:
//!   plainly, against per-channel importance, or by GPTQ, [`Storage`]),
//!   spooling payloads to a temporary file so memory holds one tensor, or straight into
//!   the artifact after room reserved for its header ([`Writer::reserve_header`]);
//!   [`Writer::prepare`] builds a tensor on any thread and [`Writer::commit`] writes it,
//!   so a [`pipeline::ordered`] run prepares tensors in parallel and writes them in
//!   order; `finish` writes the header, reopens the file and checks every stored byte
//!   against its digest (`set_paranoid`: decodes and hashes everything again), and
//!   renames it into place.
//! - [`Artifact::open`] checks the header (sizes against caller-set [`Limits`] before
//!   any allocation), the format name and version, and the recipe against the payload,
//!   all before reading a payload byte; [`Artifact::verify`] checks every digest;
//!   [`unpack`] writes a plain safetensors file, byte-identical for lossless tensors, and
//!   (version 3, which records the source file's header:
//!   [`Writer::set_source_header`]) the source file itself, byte for byte.
//! - [`Checkpoint`] reads any safetensors checkpoint (one file, a folder, or shards
//!   through the index JSON) a tensor at a time, each memory-mapped (or read, at 16 KiB
//!   or less) ([`Mapped`]: one of the crate's two `unsafe` places, with what it assumes
//!   written beside it; the other asks the kernel to write a file back); artifacts are
//!   read the same way, block stores in place.
//!
//! The layout is specified in `docs/FORMAT.md` ("Artifact, versions 1, 2, 3 and 4": this
//! build writes version 4 when lossless tensors record XXH3-128 whole-tensor digests,
//! [`WholeDigest::Xxh3`], the default; with SHA-256 ones, version 3 when it records the
//! source header and version 2 otherwise; it reads all four); frozen fixtures live under
//! `fixtures/artifact/v1/` to `v4/`. What it is not: a model loader (the umbrella crate
//! applies artifacts to models) or a compressor of its own (the block store and the
//! quantized formats are).
//!
//! # Example
//! ```
//! use compressme_artifact::{Artifact, Dtype, Limits, Writer};
//! use compressme_blockstore::Coder;
//!
//! let dir = std::env::temp_dir().join(format!("cm-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let path = dir.join("a.safetensors");
//! let values: Vec<u8> = (0..64 * 32).flat_map(|i| ((i % 7) as f32 * 0.25).to_le_bytes()).collect();
//! let mut w = Writer::create(&path)?;
//! let added = w.add_lossless("emb.weight", Dtype::F32, &[64, 32], &values, 16, Coder::default())?;
//! assert!(added.stored_bytes < added.dense_bytes);
//! let summary = w.finish()?; // written, reopened, every digest checked, renamed
//! assert_eq!(summary.lossless, 1);
//!
//! let mut a = Artifact::open(&path, &Limits::default())?;
//! let (bytes, exact) = a.read_tensor("emb.weight")?;
//! assert!(exact && bytes == values);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_code)]
// allowed in two places: `st::Mapped::new` (a read-only memory map), and `st::write_behind`
// and `st::drop_behind` (sync_file_range(2) and posix_fadvise(2) on a file of ours)
#![deny(clippy::unwrap_used, clippy::expect_used)]

mod convert;
mod error;
pub mod pipeline;
mod read;
pub mod recipe;
mod source;
mod st;
mod validate;
mod write;

pub use convert::{from_f32, row_view, to_f32, unpack, value_kind};
pub use error::{Error, Result};
pub use read::{Artifact, STREAM_BYTES, STREAM_PIECE, Stored, Summary};
pub use recipe::{Recipe, StorageRecipe, TensorRecipe, WholeDigest};
pub use source::Checkpoint;
pub use st::{
    AtomicFile, Dtype, Durability, EXPANSION_FLOOR, Entry, Limits, Mapped, Planned,
    SafetensorsFile, header_bytes, remove_temporaries,
};
pub use validate::{blocks_name, codes_name, mins_name, scales_name};
pub use write::{Added, Input, Prepared, Storage, Writer};
