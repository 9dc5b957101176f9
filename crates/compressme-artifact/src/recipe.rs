//! The recipe: what each original tensor was and how it is stored.
#![deny(clippy::arithmetic_side_effects)] // reads files: no unchecked arithmetic

use serde::{Deserialize, Serialize};

/// The recipe's `format` field.
pub const FORMAT_NAME: &str = "compressme-artifact";
/// The version this build writes for an artifact that records no source header (every
/// artifact a benchmark writes, so their reports' `artifact_version`).
pub const VERSION: u32 = 2;
/// The version this build writes for an artifact that records its source file's header
/// ([`Recipe::source_header_sha256`]), so that `unpack` gives back the file byte for byte.
pub const VERSION_SOURCE_HEADER: u32 = 3;
/// The versions this build reads: 1 (every block digest in the recipe), 2 (the block
/// store's index digest, which seals them, instead) and 3 (version 2 and the source
/// file's header).
pub const READABLE: [u32; 3] = [1, 2, 3];
/// `__metadata__` key holding the recipe JSON.
pub const RECIPE_KEY: &str = "compressme.recipe";
/// `__metadata__` key holding the format name.
pub const FORMAT_KEY: &str = "format";
/// `__metadata__` key holding the version.
pub const VERSION_KEY: &str = "compressme.version";
/// `__metadata__` key holding the SHA-256 of the recipe JSON string.
pub const RECIPE_SHA_KEY: &str = "compressme.recipe_sha256";
/// `__metadata__` key holding the source file's header text (version 3).
pub const SOURCE_HEADER_KEY: &str = "compressme.source_header";

/// Everything needed to rebuild each original tensor, and what was used to make them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The artifact version.
    pub version: u32,
    /// The writing tool and its version.
    pub tool: String,
    /// Per original tensor, in name order.
    pub tensors: Vec<TensorRecipe>,
    /// Which modules were kept at high precision as output heads, if a plan said so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_head_policy: Option<String>,
    /// SHA-256 of the plan JSON, when a plan chose the storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_sha256: Option<String>,
    /// SHA-256 of the calibration text, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_sha256: Option<String>,
    /// SHA-256 of the tokenizer file, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_sha256: Option<String>,
    /// The source checkpoint's own `__metadata__`, restored by unpack.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub source_metadata: std::collections::BTreeMap<String, String>,
    /// Version 3 only: SHA-256 of the source file's header text, which
    /// `__metadata__[SOURCE_HEADER_KEY]` holds (the bytes after the source's length
    /// prefix, padding included); `unpack` writes that header and lays the tensors out
    /// at its offsets, which gives back the source file byte for byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_header_sha256: Option<String>,
}

/// One original tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRecipe {
    /// The checkpoint's name.
    pub name: String,
    /// Its safetensors dtype name.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// SHA-256 of its original bytes (lossless and dense storage; absent when quantized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// How it is stored.
    pub storage: StorageRecipe,
}

/// How one tensor is stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum StorageRecipe {
    /// As it was, under its own name.
    Dense,
    /// A block store (`cm.blocks/NAME`, U8).
    Lossless {
        /// Rows per block.
        block_rows: usize,
        /// Rows of the `[rows, row_bytes]` view (the first dimension; 1 for a scalar or
        /// a 1-D tensor).
        rows: u64,
        /// Bytes a row.
        row_bytes: u64,
        /// `huffman`, `mixed`, `rans` or `zstd-LEVEL`: how it was written (a decoder needs
        /// only the block store).
        coder: String,
        /// Whether coded planes carry a per-row index.
        row_index: bool,
        /// Bytes an element (the shuffle's element size).
        element_size: usize,
        /// Version 1: SHA-256 of each stored block, in order (absent in version 2).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        block_sha256: Vec<String>,
        /// Version 2: the block store's index digest, which seals its header, tables,
        /// block lengths and every block digest (absent in version 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        index_sha256: Option<String>,
    },
    /// A `compressme-quant` format (`cm.codes/NAME` U8, `cm.scales/NAME` F32 per row or
    /// F16 per group, `cm.mins/NAME` F16 for `int4-g*`).
    Quant {
        /// The format's name (`nf4-g64`, ...).
        format: String,
        /// Rows (the first dimension).
        rows: usize,
        /// Columns (the product of the others).
        cols: usize,
        /// SHA-256 of the payload bytes as stored: codes, then scales, then minimums.
        payload_sha256: String,
    },
}

/// Lowercase hex (the block store's encoder).
pub use compressme_blockstore::hex;

/// SHA-256 as lowercase hex.
#[must_use]
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let d: [u8; 32] = sha2::Sha256::digest(bytes).into();
    hex(&d)
}
