use std::path::PathBuf;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from building, loading or running layers and models.
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
    /// Shapes that do not fit.
    #[error("bad shape: {0}")]
    Shape(String),
    /// A storage a module cannot take.
    #[error("{module}: {reason}")]
    BadStorage {
        /// The module.
        module: String,
        /// Why.
        reason: String,
    },
    /// A module name the model does not have.
    #[error("no module `{name}` (the model has {count}, e.g. {known})")]
    UnknownModule {
        /// The name asked for.
        name: String,
        /// A few names the model has.
        known: String,
        /// How many it has.
        count: usize,
    },
    /// An observer could not be installed, or refused what it saw.
    #[error("observer: {0}")]
    Observer(String),
    /// A file could not be read or parsed.
    #[error("{}: {message}", path.display())]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{}: missing tensor `{name}`", path.display())]
    MissingTensor {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor of the wrong shape.
    #[error("{}: tensor `{name}` has shape {got:?}, expected {expected:?}", path.display())]
    TensorShape {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What the config implies.
        expected: Vec<usize>,
        /// What the file holds.
        got: Vec<usize>,
    },
    /// A tensor of a dtype the model cannot use.
    #[error("{}: tensor `{name}` has dtype {got}, expected a float type (f32, f16, bf16)", path.display())]
    TensorDtype {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its dtype.
        got: String,
    },
    /// A `model_type` this crate does not implement.
    #[error("{}: model_type `{model_type}` is not supported (supported: {supported})", path.display())]
    UnsupportedModel {
        /// The config file.
        path: PathBuf,
        /// What it says.
        model_type: String,
        /// What is supported.
        supported: String,
    },
    /// A remote model identifier: only local folders are read.
    #[error(
        "`{0}` is not a local folder: remote model identifiers are not resolved (download the folder first)"
    )]
    Remote(String),
    /// The tokenizer refused.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The block store refused (bad id, corrupt block, ...).
    #[error(transparent)]
    Store(#[from] compressme_blockstore::Error),
    /// An artifact could not be read or failed verification.
    #[error(transparent)]
    Artifact(#[from] compressme_artifact::Error),
    /// Quantization refused.
    #[error(transparent)]
    Quant(#[from] compressme_quant::Error),
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
