/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong building, loading or decoding a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller's shape or options do not fit the bytes given.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A requested row does not exist.
    #[error("row {id} out of range for a table of {rows} rows")]
    RowOutOfRange {
        /// The requested id.
        id: u64,
        /// Rows in the table.
        rows: u64,
    },
    /// A block's bytes do not hash to the recorded digest.
    #[error("block {block} fails its SHA-256 check: expected {expected}, found {actual}")]
    ChecksumMismatch {
        /// Block index.
        block: usize,
        /// Recorded digest, hex.
        expected: String,
        /// Digest of the bytes present, hex.
        actual: String,
    },
    /// The header, code tables or block index do not hash to the recorded index digest.
    #[error("block store index fails its SHA-256 check: expected {expected}, found {actual}")]
    IndexChecksumMismatch {
        /// Recorded digest, hex.
        expected: String,
        /// Digest of the bytes present, hex.
        actual: String,
    },
    /// The serialized store is not one this version reads.
    #[error("unsupported block store version {found} (this build reads {supported})")]
    UnsupportedVersion {
        /// Version in the bytes.
        found: u16,
        /// Versions this build reads.
        supported: &'static str,
    },
    /// The bytes are not a well-formed store (or a block inside is not well-formed).
    #[error("malformed block store: {0}")]
    Malformed(String),
    /// A block's bytes are malformed; names the block.
    #[error("block {block} is malformed: {reason}")]
    BadBlock {
        /// Block index.
        block: usize,
        /// What is wrong.
        reason: String,
    },
}

impl Error {
    pub(crate) fn in_block(self, block: usize) -> Self {
        match self {
            Self::Malformed(reason) => Self::BadBlock { block, reason },
            other => other,
        }
    }
}

/// Lowercase hex of `bytes` (digests in messages, recipes and reports): the workspace's
/// one hex encoder.
#[must_use]
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(
        String::with_capacity(bytes.len().saturating_mul(2)),
        |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        },
    )
}
