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
/// The version this build writes for an artifact with a lossless tensor whose whole-tensor
/// digest is XXH3-128 ([`TensorRecipe::xxh3_128`], [`WholeDigest::Xxh3`], the default):
/// version 2 or 3 otherwise, and the source file's header recorded or not.
pub const VERSION_XXH3: u32 = 4;
/// The versions this build reads: 1 (every block digest in the recipe), 2 (the block
/// store's index digest, which seals them, instead), 3 (version 2 and the source
/// file's header) and 4 (lossless tensors' whole-tensor digest XXH3-128, the source
/// header optional).
pub const READABLE: [u32; 4] = [1, 2, 3, 4];
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
    /// SHA-256 of its original bytes: dense storage, and lossless storage before version
    /// 4 (absent when quantized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Version 4, lossless storage only: XXH3-128 of its original bytes (32 lowercase hex
    /// digits, the canonical big-endian form), in place of `sha256`. The stored bytes
    /// stay sealed by SHA-256 (every block's digest, under the index digest); this one
    /// checks that decoding gave the original bytes back, at a fraction of SHA-256's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3_128: Option<String>,
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

/// The whole-tensor digest a writer records for a lossless tensor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WholeDigest {
    /// XXH3-128 (artifact version 4): the stored bytes are sealed by SHA-256 block digests
    /// already; this checks the decoding, at several times SHA-256's speed.
    #[default]
    Xxh3,
    /// SHA-256 (artifact versions 2 and 3): a cryptographic digest of the original bytes,
    /// for a recipe that names each tensor by the digest other tools use.
    Sha256,
}

impl TensorRecipe {
    /// Which whole-tensor digest the recipe records for this tensor: `None` for a
    /// quantized one (its payload digest seals it).
    #[must_use]
    pub fn whole_digest(&self) -> Option<WholeDigest> {
        if self.xxh3_128.is_some() {
            Some(WholeDigest::Xxh3)
        } else if self.sha256.is_some() {
            Some(WholeDigest::Sha256)
        } else {
            None
        }
    }

    /// [`TensorRecipe::whole_digest`] of a lossless tensor, `None` for any other: what
    /// decides an artifact's version (a writer's lossless tensors share one kind) and how
    /// a reader streams the tensor.
    pub(crate) fn lossless_whole_digest(&self) -> Option<WholeDigest> {
        match self.storage {
            StorageRecipe::Lossless { .. } => self.whole_digest(),
            StorageRecipe::Dense | StorageRecipe::Quant { .. } => None,
        }
    }

    /// Whether `hex` (of the digest [`TensorRecipe::whole_digest`] names) is the one the
    /// recipe records.
    pub(crate) fn whole_is(&self, hex: &str) -> bool {
        self.xxh3_128.as_deref().or(self.sha256.as_deref()) == Some(hex)
    }
}

impl WholeDigest {
    /// This digest of `bytes`, as the recipe records it (lowercase hex).
    #[must_use]
    pub fn hex_of(self, bytes: &[u8]) -> String {
        match self {
            WholeDigest::Sha256 => sha256_hex(bytes),
            WholeDigest::Xxh3 => xxh3_hex(bytes),
        }
    }
}

/// XXH3-128 as 32 lowercase hex digits (canonical, big-endian).
#[must_use]
pub fn xxh3_hex(bytes: &[u8]) -> String {
    xxh3_128_hex(xxhash_rust::xxh3::xxh3_128(bytes))
}

/// An XXH3-128 value as the recipe records it: 32 lowercase hex digits, big-endian.
pub(crate) fn xxh3_128_hex(d: u128) -> String {
    format!("{d:032x}")
}

/// SHA-256 as lowercase hex.
#[must_use]
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let d: [u8; 32] = sha2::Sha256::digest(bytes).into();
    hex(&d)
}
