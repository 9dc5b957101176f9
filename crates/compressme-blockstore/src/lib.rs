//! Lossless row-blocked storage of float tensors, with random-access row decode.
//!
//! A `[rows, row_bytes]` byte matrix (an embedding table, any weight matrix) is cut into
//! independent blocks of `block_rows` rows. Each block is transformed (the sign bit of each
//! float moved next to the mantissa, so the exponent is a byte plane of its own), split into
//! byte planes ([`compressme_shuffle`]), and each plane is stored in the cheapest of five
//! modes: raw, constant, Huffman-coded with one of a few code tables shared by the whole
//! tensor, rANS-coded with one of a few shared frequency tables ([`Coder::SharedRans`] on
//! every plane where they are smaller, [`Coder::Mixed`] only where they save 0.5% of the
//! plane: smaller, slower to decode; a store with such a plane is format version 2), or a
//! Zstandard frame. Each block is sealed with SHA-256 (block digests are computed four at
//! a time, their rounds interleaved, where the CPU has the SHA extensions).
//!
//! The library's defaults ([`EncodeOptions::new`]: 16-row blocks, Huffman tables) favour
//! random access and decode speed (embedding lookups); `compressme pack` defaults to
//! 64-row blocks (fewer digests a byte) and [`Coder::Mixed`] with 16 tables a plane
//! (rANS tables on exponent planes, where Huffman's whole bits cost about 1.2%), `pack
//! --coder huffman` asks for Huffman tables only (the fastest to read), and `pack --coder
//! rans` for [`Coder::SharedRans`]: the smallest files, the slowest to read.
//!
//! Main types: [`BlockStore`] (encode, serialize, load, verify, decode rows),
//! [`EncodeOptions`] with [`ValueKind`] and [`Coder`], [`StoredBytes`] (exact accounting),
//! [`Decoder`] (a reusable, allocation-light decoding context), [`sha256_many`] and
//! [`Sha256Streams`] (SHA-256 of independent messages, or of streams fed in pieces, four in
//! lockstep: what `compressme-artifact` takes its whole-tensor digests with), and [`Error`].
//!
//! What it is not: a tensor library (it moves bytes, it never does float arithmetic) and
//! not a container for many tensors (`compressme-artifact` puts stores in safetensors).
//! The byte layout is specified in `docs/FORMAT.md`.
//!
//! # Example
//! ```
//! use compressme_blockstore::{BlockStore, EncodeOptions, ValueKind};
//!
//! // a 100 x 8 f32 table
//! let values: Vec<f32> = (0..800).map(|i| (i as f32 * 0.37).sin() * 0.05).collect();
//! let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let store = BlockStore::encode(&bytes, 100, 32, &EncodeOptions::new(ValueKind::F32))?;
//!
//! // rows 7, 3, 7 in that order: verified, decoded, gathered
//! let mut out = vec![0u8; 3 * 32];
//! store.decode_rows(&[7, 3, 7], &mut out)?;
//! assert_eq!(&out[..32], &bytes[7 * 32..8 * 32]);
//! assert_eq!(&out[32..64], &bytes[3 * 32..4 * 32]);
//!
//! // a store survives serialization byte for byte, and is verified when loaded
//! let again = BlockStore::from_bytes(&store.to_bytes())?;
//! assert_eq!(again.decode_all()?, bytes);
//! assert_eq!(store.stored_bytes().total(), store.to_bytes().len() as u64);
//! # Ok::<(), compressme_blockstore::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_code)] // allowed in `digest` (SHA-NI intrinsics), `huffman::avx2` (one call), `rans::simd` (the vector rANS loops) and `decode::wide` (the gathers' tiers)

mod decode;
mod digest;
mod encode;
mod error;
mod format;
mod huffman;
mod rans;

pub use decode::{BLOCKS_TOGETHER, Decoder};
pub use digest::{Sha256Streams, sha256_many};
pub use error::{Error, Result, hex};
pub use format::MAGIC;

use compressme_shuffle::ElementSize;

/// What the bytes of one row are made of; decides the element size and the bit transform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValueKind {
    /// IEEE binary32; sign bit rotated next to the mantissa.
    F32,
    /// bfloat16; sign bit rotated next to the mantissa.
    Bf16,
    /// IEEE binary16; sign bit rotated next to the mantissa.
    F16,
    /// IEEE binary64; sign bit rotated next to the mantissa.
    F64,
    /// Opaque elements of the given size, no bit transform.
    Bytes(ElementSize),
}

impl ValueKind {
    /// The element size in bytes.
    #[must_use]
    pub const fn element_size(self) -> ElementSize {
        match self {
            Self::F32 => ElementSize::Four,
            Self::Bf16 | Self::F16 => ElementSize::Two,
            Self::F64 => ElementSize::Eight,
            Self::Bytes(s) => s,
        }
    }

    /// Whether the sign bit is rotated to the lowest bit of each element before planes.
    #[must_use]
    pub const fn rotates_sign(self) -> bool {
        !matches!(self, Self::Bytes(_))
    }

    /// Wire tag (see `docs/FORMAT.md`); stable forever.
    pub(crate) const fn tag(self) -> u8 {
        match self {
            Self::F32 => 1,
            Self::Bf16 => 2,
            Self::F16 => 3,
            Self::F64 => 4,
            Self::Bytes(ElementSize::One) => 16,
            Self::Bytes(ElementSize::Two) => 17,
            Self::Bytes(ElementSize::Four) => 18,
            Self::Bytes(ElementSize::Eight) => 19,
        }
    }

    pub(crate) const fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            1 => Self::F32,
            2 => Self::Bf16,
            3 => Self::F16,
            4 => Self::F64,
            16 => Self::Bytes(ElementSize::One),
            17 => Self::Bytes(ElementSize::Two),
            18 => Self::Bytes(ElementSize::Four),
            19 => Self::Bytes(ElementSize::Eight),
            _ => return None,
        })
    }
}

/// How a plane that is neither constant nor left raw gets coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Coder {
    /// Canonical Huffman with up to `max_tables` code tables per plane, shared across all
    /// blocks of the tensor (blocks are clustered by their byte histograms, each block picks
    /// the table that codes it shortest). The default, with 4 tables.
    SharedHuffman {
        /// 1..=16 tables per plane.
        max_tables: u8,
    },
    /// Up to `max_tables` tables per plane shared across the tensor, as `SharedHuffman`,
    /// where each plane is coded with rANS frequency tables instead of Huffman code
    /// lengths whenever that stores it in fewer bytes, tables included: a fraction of a
    /// bit a symbol is spent where Huffman spends whole bits (about 0.03 bits a symbol on
    /// an exponent plane), and near-uniform mantissa planes, which Huffman stores raw, are
    /// coded close to their entropy. A store with a rANS plane is block store version 2;
    /// rANS decodes more slowly than Huffman (one table lookup a symbol). A rANS plane is
    /// kept whenever it is smaller than the raw plane (`max_coded_fraction` applies to
    /// Huffman planes). Row-indexed stores keep Huffman tables.
    SharedRans {
        /// 1..=16 tables per plane.
        max_tables: u8,
    },
    /// As `SharedRans`, but a plane takes rANS tables only where they store it in at least
    /// [`MIXED_MIN_GAIN`] fewer bytes than Huffman tables (or raw) would, tables included;
    /// every other plane keeps Huffman tables or stays raw. On trained weights that is the
    /// exponent plane, where Huffman's whole bits cost about 1.2% of the plane, and not the
    /// near-uniform mantissa planes, where rANS saves 0.3% for several times the decode
    /// time of a raw plane. `compressme pack`'s default, with 16 tables.
    Mixed {
        /// 1..=16 tables per plane.
        max_tables: u8,
    },
    /// One Zstandard frame per plane at this level (1..=22); every frame carries its own
    /// entropy tables. Kept for comparison and for data that has repeats Huffman cannot see.
    Zstd {
        /// Zstandard compression level.
        level: i32,
    },
}

/// The fraction of a plane's bytes rANS tables must save over Huffman tables or raw for
/// [`Coder::Mixed`] to take them (0.5%).
pub const MIXED_MIN_GAIN: f64 = 0.005;

impl Default for Coder {
    fn default() -> Self {
        Self::SharedHuffman { max_tables: 4 }
    }
}

/// Everything the encoder needs to know besides the bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodeOptions {
    /// What the values are.
    pub kind: ValueKind,
    /// Rows per independent block (default 16).
    pub block_rows: usize,
    /// Plane coder.
    pub coder: Coder,
    /// A coded plane is kept only if it is at most this fraction of the raw plane
    /// (default 0.98): coding that gains under 2% costs decode time for nothing.
    pub max_coded_fraction: f64,
    /// Encode blocks on all cores (default true).
    pub parallel: bool,
    /// Huffman-coded planes get a per-row index (u16 lengths, rows byte-aligned), so a
    /// lookup decodes only the rows it asks for: faster random access for a few tenths of
    /// a percent more bytes (default false; see docs/BENCHMARKS.md).
    pub row_index: bool,
}

impl EncodeOptions {
    /// Defaults for a value kind: 16-row blocks, shared Huffman with 4 tables per plane.
    #[must_use]
    pub fn new(kind: ValueKind) -> Self {
        Self {
            kind,
            block_rows: 16,
            coder: Coder::default(),
            max_coded_fraction: 0.98,
            parallel: true,
            row_index: false,
        }
    }

    /// Sets the rows per block.
    #[must_use]
    pub fn block_rows(mut self, block_rows: usize) -> Self {
        self.block_rows = block_rows;
        self
    }

    /// Turns the per-row index of Huffman-coded planes on or off.
    #[must_use]
    pub fn row_index(mut self, on: bool) -> Self {
        self.row_index = on;
        self
    }

    /// Sets the coder.
    #[must_use]
    pub fn coder(mut self, coder: Coder) -> Self {
        self.coder = coder;
        self
    }
}

/// Every byte a store keeps, by kind. `total()` equals the serialized length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoredBytes {
    /// Fixed header: magic, version, shape, kind.
    pub header: u64,
    /// Shared code tables.
    pub tables: u64,
    /// Block length table.
    pub offsets: u64,
    /// SHA-256 digests, 32 bytes per block.
    pub digests: u64,
    /// Coded blocks.
    pub payload: u64,
}

impl StoredBytes {
    /// The sum of all parts.
    #[must_use]
    pub const fn total(&self) -> u64 {
        self.header + self.tables + self.offsets + self.digests + self.payload
    }
}

/// A tensor stored as independent, verified, compressed row blocks.
#[derive(Debug, Clone)]
pub struct BlockStore {
    pub(crate) kind: ValueKind,
    pub(crate) rows: u64,
    pub(crate) row_bytes: usize,
    pub(crate) block_rows: usize,
    /// Per plane, the shared code tables.
    pub(crate) tables: Vec<Vec<huffman::CodeLengths>>,
    /// Per plane, decoders built from `tables` (derived, not stored).
    pub(crate) decoders: Vec<Vec<std::sync::Arc<huffman::Decoder>>>,
    /// Per plane, the shared rANS tables (version 2); a plane has Huffman tables or
    /// rANS tables, never both.
    pub(crate) rans: Vec<Vec<std::sync::Arc<rans::Table>>>,
    /// `n_blocks + 1` offsets into `payload`; they tile it exactly.
    pub(crate) offsets: Vec<usize>,
    pub(crate) digests: Vec<[u8; 32]>,
    /// SHA-256 of the serialized index before it (header, tables, lengths, digests):
    /// computed once when encoded, checked once when parsed.
    pub(crate) index_digest: [u8; 32],
    pub(crate) payload: Payload,
    /// Check each block's digest on every decode, not only at build and load.
    pub(crate) verify_on_decode: bool,
    /// Loaded by [`BlockStore::from_shared`]: blocks were not checked at load, so every
    /// decode checks its block whatever `verify_on_decode` says.
    pub(crate) lazy: bool,
}

/// Bytes a store can be read from without copying them: a memory map, a buffer shared
/// with its reader. [`BlockStore::from_shared`] keeps the payload in place in it.
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Where a store's payload lives: its own buffer (encoded, or copied by
/// [`BlockStore::from_bytes`]) or a range of a shared one ([`BlockStore::from_shared`]).
#[derive(Clone)]
pub(crate) struct Payload {
    owner: SharedBytes,
    start: usize,
    end: usize,
}

impl Payload {
    pub(crate) fn owned(bytes: Vec<u8>) -> Self {
        let end = bytes.len();
        Self {
            owner: std::sync::Arc::new(bytes),
            start: 0,
            end,
        }
    }

    pub(crate) fn shared(owner: SharedBytes, start: usize, end: usize) -> Self {
        Self { owner, start, end }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        let all: &[u8] = (*self.owner).as_ref();
        all.get(self.start..self.end).unwrap_or(&[])
    }

    pub(crate) fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.len())
    }
}

impl BlockStore {
    /// Rows in the tensor.
    #[must_use]
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes per row.
    #[must_use]
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Rows per block.
    #[must_use]
    pub fn block_rows(&self) -> usize {
        self.block_rows
    }

    /// The value kind the store was built for.
    #[must_use]
    pub fn kind(&self) -> ValueKind {
        self.kind
    }

    /// Number of blocks.
    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.digests.len()
    }

    /// Bytes of the dense tensor: `rows * row_bytes`.
    #[must_use]
    pub fn dense_bytes(&self) -> u64 {
        self.rows * self.row_bytes as u64
    }

    /// Exact accounting of every byte kept.
    #[must_use]
    pub fn stored_bytes(&self) -> StoredBytes {
        format::stored_bytes(self)
    }

    /// Stored bytes over dense bytes (lower is better; above 1.0 the store grew).
    #[must_use]
    pub fn ratio(&self) -> f64 {
        if self.dense_bytes() == 0 {
            return 1.0;
        }
        self.stored_bytes().total() as f64 / self.dense_bytes() as f64
    }

    /// Turns digest checks on every decode on or off (off by default: every block is
    /// verified once when the store is built or loaded, and decoding reads verified memory).
    pub fn set_verify_on_decode(&mut self, on: bool) {
        self.verify_on_decode = on;
    }

    /// Stops checking block digests when blocks are decoded, even for a store read in
    /// place ([`BlockStore::from_shared`]), for a caller that checks the blocks itself
    /// before decoding them ([`BlockStore::verify_blocks`], as `verify` does) or checks
    /// everything it decodes against a digest of its own (`unpack` and the whole-tensor
    /// SHA-256): the decoder refuses malformed blocks with an error whatever their bytes
    /// (it is fuzzed for that), so what is lost is only the name of the block a
    /// corruption sits in, which `verify` gives.
    pub fn skip_block_digests(&mut self) {
        self.lazy = false;
        self.verify_on_decode = false;
    }

    /// The SHA-256 of each block's stored bytes, in block order.
    #[must_use]
    pub fn block_digests(&self) -> &[[u8; 32]] {
        &self.digests
    }

    /// Whether every decode re-checks digests.
    #[must_use]
    pub fn verify_on_decode(&self) -> bool {
        self.verify_on_decode || self.lazy
    }
}
