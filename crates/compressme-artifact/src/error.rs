use std::path::PathBuf;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong reading, writing or verifying an artifact or a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be opened, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a well-formed safetensors file.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    NotSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A size read from the file is past a bound.
    #[error("{}: {what} is {got} bytes, over the bound of {limit}", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// What was measured.
        what: String,
        /// Its size.
        got: u64,
        /// The bound.
        limit: u64,
    },
    /// A tensor that would decode to far more than it stores (a decompression bomb, or a
    /// degenerate tensor of one repeated value), refused before decoding.
    #[error(
        "{}: tensor `{tensor}` decodes to {decoded} bytes from {stored} stored, more than {limit}x: a decompression bomb or a degenerate tensor (raise the expansion limit, `--max-expansion`, to accept it)",
        path.display()
    )]
    Expansion {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Bytes it decodes to.
        decoded: u64,
        /// Bytes its payload holds.
        stored: u64,
        /// The bound on their ratio.
        limit: u64,
    },
    /// A safetensors file without the artifact's metadata.
    #[error("{}: not a compressme artifact ({reason})", path.display())]
    NotArtifact {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// An artifact of a version this build cannot read.
    #[error("{}: artifact version {found} is not supported (this build reads {supported})", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: String,
        /// What is readable.
        supported: String,
    },
    /// The recipe does not match the payload, or is malformed.
    #[error("{}: recipe: {reason}", path.display())]
    Recipe {
        /// The file.
        path: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// A tensor's dtype that cannot be handled.
    #[error("tensor `{tensor}`: unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// A tensor that is not there.
    #[error("no tensor `{0}`")]
    MissingTensor(String),
    /// Work skipped because an earlier item of the same run failed (never the error a
    /// run returns: that is the earlier failure).
    #[error("cancelled after an earlier error")]
    Cancelled,
    /// A digest that does not match: the data is corrupt.
    #[error("tensor `{tensor}`: {what} does not match its SHA-256")]
    Digest {
        /// The tensor.
        tensor: String,
        /// `block 12`, or `whole tensor`.
        what: String,
    },
    /// A tensor's stored blocks could not be read.
    #[error("tensor `{tensor}`: {source}")]
    Blocks {
        /// The tensor.
        tensor: String,
        /// The block store's error (names the block).
        source: compressme_blockstore::Error,
    },
    /// A tensor's packed weights could not be read or made.
    #[error("tensor `{tensor}`: {source}")]
    Quant {
        /// The tensor.
        tensor: String,
        /// The cause.
        source: compressme_quant::Error,
    },
    /// A request that cannot be done (quantizing a 1-D tensor, say).
    #[error("tensor `{tensor}`: {reason}")]
    Invalid {
        /// The tensor.
        tensor: String,
        /// Why.
        reason: String,
    },
}
