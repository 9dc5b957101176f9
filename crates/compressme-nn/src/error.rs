/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from building or running packed layers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The tensor cannot be packed as asked; says why.
    #[error("not eligible for packing: {0}")]
    NotEligible(String),
    /// Ids of a dtype that cannot index rows.
    #[error("ids must be u8, u32 or i64, got {0}")]
    UnsupportedIds(String),
    /// A negative id.
    #[error("id {0} is negative")]
    NegativeId(i64),
    /// The block store refused (bad id, corrupt block, ...).
    #[error(transparent)]
    Store(#[from] compressme_blockstore::Error),
    /// candle refused.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::msg(other),
        }
    }
}
